"""Time series: dated rasters stacked T x C, a shared-encoder temporal model, prediction."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import rasterio
import torch
import torch.utils.data
from rasterio.transform import from_origin

from ds_seg.data import BatchPreprocessor, DataError, GeoTiffScenes, SyntheticAerial
from ds_seg.models.temporal import POOLINGS
from ds_seg.registry import MODELS, build

S, BLOCK = 96, 8


def _change_scene(tmp, name, seed):
    """Two dates of 8 px blocks, each dark or bright at random; the label is 'changed'
    (bright at one date, dark at the other). Either date alone says nothing about it."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2, (2, S // BLOCK, S // BLOCK))
    up = bits.repeat(BLOCK, 1).repeat(BLOCK, 2)
    common = dict(driver='GTiff', width=S, height=S, crs='EPSG:32631', transform=from_origin(0, 0, 1, 1),
                  count=1, dtype='uint8')
    paths = []
    for t in range(2):
        img = (60 + 120 * up[t] + rng.integers(-20, 21, (S, S))).astype(np.uint8)
        paths.append(str(tmp / f'{name}_t{t}.tif'))
        with rasterio.open(paths[-1], 'w', **common) as d:
            d.write(img[None])
    label = str(tmp / f'{name}_label.tif')
    with rasterio.open(label, 'w', **common) as d:
        d.write((up[0] != up[1]).astype(np.uint8)[None])
    return paths, label


def _train_and_score(train, val, model, steps=100):
    torch.manual_seed(0)
    prep = BatchPreprocessor.for_dataset(train)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = torch.utils.data.default_collate([train[step * 8 + j] for j in range(8)])
        images, labels = prep(batch, 'cpu')
        loss = torch.nn.functional.cross_entropy(model(images), labels.long(), ignore_index=255)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    right = total = 0
    with torch.no_grad():
        for i in range(len(val)):
            images, labels = BatchPreprocessor.for_dataset(val)(
                torch.utils.data.default_collate([val[i]]), 'cpu')
            keep = labels != 255
            right += int((model(images).argmax(1) == labels)[keep].sum())
            total += int(keep.sum())
    return right / total


def test_change_between_dates_is_learned_and_one_date_cannot_learn_it(tmp_path):
    (t0, t1), label = _change_scene(tmp_path, 'train', 0)
    (v0, v1), vlabel = _change_scene(tmp_path, 'val', 1)
    kw = dict(crop_size=32, classes=('same', 'changed'), mean=[127.5], std=[64.0], seed=0)
    series = GeoTiffScenes([[t0, t1]], [label], mode='random', **kw)
    series_val = GeoTiffScenes([[v0, v1]], [vlabel], mode='grid', split='val', **kw)
    assert series.in_channels == 2 and series.num_dates == 2 and list(series.mean) == [127.5, 127.5]
    # date-major stacking: channel t is date t of the same window
    both = GeoTiffScenes([[t0, t1]], [label], mode='random', augment=False, **kw)[3]['image']
    for t, path in enumerate((t0, t1)):
        assert torch.equal(both[t], GeoTiffScenes([path], [label], mode='random', augment=False, **kw)[3]['image'][0])
    model = build(MODELS, dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2))
    acc_series = _train_and_score(series, series_val, model)

    single = GeoTiffScenes([t1], [label], mode='random', **kw)
    single_val = GeoTiffScenes([v1], [vlabel], mode='grid', split='val', **kw)
    model = build(MODELS, dict(type='TinyTemporalSegFormer', num_dates=1, in_channels=1, num_classes=2))
    acc_single = _train_and_score(single, single_val, model)
    assert acc_series > 0.9 and acc_single < 0.65, (acc_series, acc_single)


@pytest.mark.parametrize('pooling', POOLINGS)
def test_every_pooling_keeps_shapes_and_shares_the_encoder(pooling):
    model = build(MODELS, dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=8, num_classes=3,
                               pooling=pooling)).eval()
    x = torch.randn(2, 8, 40, 36)
    assert model(x).shape == (2, 3, 40, 36)
    single = build(MODELS, dict(type='TinyTemporalSegFormer', num_dates=1, in_channels=4, num_classes=3))
    # one encoder for all dates: its parameters are those of a one-date model
    assert (sum(p.numel() for p in model.backbone.encoder.parameters())
            == sum(p.numel() for p in single.backbone.encoder.parameters()))
    if pooling in ('mean', 'max', 'attention'):  # symmetric in time: swapping dates changes nothing
        swapped = torch.cat([x[:, 4:], x[:, :4]], 1)
        torch.testing.assert_close(model(swapped), model(x), atol=1e-5, rtol=1e-5)


def test_seasonal_synthetic_series_and_misregistered_dates(tmp_path):
    ds = SyntheticAerial(split='train', num_scenes=1, scene_size=64, dates=3, crop_size=32,
                         cache_dir=str(tmp_path))
    x = ds[0]['image'].float()
    assert ds.in_channels == 9 and x.shape == (9, 32, 32)
    assert not torch.equal(x[:3], x[3:6])  # the season changes the pixels
    assert torch.equal(ds[0]['label'], SyntheticAerial(split='train', num_scenes=1, scene_size=64, dates=3,
                                                       crop_size=32, cache_dir=str(tmp_path))[0]['label'])
    (t0, t1), label = _change_scene(tmp_path, 'a', 0)
    with rasterio.open(t1, 'r+') as d:
        d.transform = from_origin(5, 0, 1, 1)
    with pytest.raises(DataError, match='not co-registered'):
        GeoTiffScenes([[t0, t1]], [label], classes=2, mean=[0], std=[1])


def test_predict_scene_takes_the_list_of_dates(tmp_path):
    from tests.unit.test_inference import predict_classes
    (t0, t1), _ = _change_scene(tmp_path, 'p', 2)
    # Seeded: the random model's windows agree with its one pass on 85-100 % of pixels depending
    # on the weights (the tests run before it in the process drew them: under `pytest -n 2` once 85 %).
    torch.manual_seed(0)
    model = build(MODELS, dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2)).eval()
    kw = dict(mean=[127.5, 127.5], std=[64.0, 64.0], tile=48, overlap=16)
    with torch.no_grad():
        out, _ = predict_classes(model, [t0, t1], tmp_path, bands=[1], **kw)
        images = torch.from_numpy(np.concatenate([rasterio.open(p).read() for p in (t0, t1)])[None].astype(np.float32))
        whole = model((images - 127.5) / 64.0).argmax(1)[0].numpy()
    assert out.shape == (S, S)
    # windows with overlap vs one pass: equal away from window seams, where context differs
    assert (out == whole).mean() > 0.9


def test_predict_cli_takes_dates_joined_by_commas(tmp_path):
    import os
    import subprocess
    import sys

    from ds_seg.config import REPO_ROOT
    from tests.unit.test_inference import predict_classes
    (t0, t1), _ = _change_scene(tmp_path, 'c', 3)
    torch.manual_seed(0)
    cfg = dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2, pooling='attention')
    model = build(MODELS, cfg).eval()
    weights = str(tmp_path / 'weights.pt')
    torch.save({'state_dict': model.state_dict(), 'model': cfg, 'classes': ['same', 'changed'],
                'data': {'bands': [1], 'mean': [127.5, 127.5], 'std': [64.0, 64.0]}}, weights)
    proc = subprocess.run([sys.executable, 'launch/predict.py', '--checkpoint', weights, '--input', f'{t0},{t1}',
                           '--output', str(tmp_path / 'out'), '--tile', '48', '--overlap', '16'],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with torch.no_grad():
        direct, _ = predict_classes(model, [t0, t1], tmp_path, mean=[127.5, 127.5], std=[64.0, 64.0], bands=[1],
                                    tile=48, overlap=16)
    with rasterio.open(tmp_path / 'out' / 'c_t0_classes.tif') as src:
        np.testing.assert_array_equal(src.read(1), direct)


def test_wrong_dates_are_refused_in_one_line_before_any_work(tmp_path, capsys):
    """predict.py: a scene of the wrong number of dates, dates on different grids (checked for
    every scene before the first is predicted) or an empty date; training: model.num_dates
    other than the data's dates."""
    from types import SimpleNamespace

    from mmengine.config import ConfigDict

    from ds_seg.cli import predict
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    (t0, t1), label = _change_scene(tmp_path, 'a', 0)
    (u0, u1), _ = _change_scene(tmp_path, 'b', 1)
    # A third date of a's grid (a_t0 again would be refused as one file given twice).
    t2 = str(tmp_path / 'a_t2.tif')
    shutil.copy(u0, t2)
    with rasterio.open(u1, 'r+') as d:  # scene b's second date: shifted by 5 m
        d.transform = from_origin(5, 0, 1, 1)
    cfg = dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2)
    weights = str(tmp_path / 'weights.pt')
    torch.save({'state_dict': build(MODELS, cfg).state_dict(), 'model': cfg, 'classes': ['same', 'changed'],
                'data': {'bands': [1], 'mean': [127.5, 127.5], 'std': [64.0, 64.0]}}, weights)
    out = tmp_path / 'out'
    cases = [([f'{t0},{t1},{t2}'], r'3 date\(s\), but the model \(TinyTemporalSegFormer\) takes 2; give the 2 dates'),
             ([t0], r'1 date\(s\), but the model .* takes 2'),
             ([f'{t0},{t1}', f'{u0},{u1}'], r'b_t1.tif is not co-registered with .*b_t0.tif'),
             ([f'{t0},'], r"an empty date; join the dates of one scene with commas and no spaces")]
    for inputs, message in cases:
        code = predict.main(['--checkpoint', weights, '--input', *inputs, '--output', str(out), '--tile', '32',
                             '--overlap', '8'])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
        assert re.search(message, err), err
        assert not out.exists()  # nothing written, not even scene a's class map
    # One file holding both dates' bands: the line says how to read it as the two dates.
    stacked = str(tmp_path / 'a_both.tif')
    with rasterio.open(t0) as a, rasterio.open(t1) as b:
        profile = dict(a.profile, count=2)
        with rasterio.open(stacked, 'w', **profile) as d:
            d.write(np.concatenate([a.read(), b.read()]))
    assert predict.main(['--checkpoint', weights, '--input', stacked, '--output', str(out), '--tile', '32']) == 2
    assert 'a_both.tif stacks every date\'s bands, select them: --bands 1 2' in capsys.readouterr().err
    assert predict.main(['--checkpoint', weights, '--input', stacked, '--output', str(out), '--tile', '32',
                         '--overlap', '8', '--bands', '1', '2']) == 0

    series = GeoTiffScenes([[t0, t1]], [label], classes=2, mean=[127.5], std=[64.0], crop_size=32)
    fake = SimpleNamespace(cfg=ConfigDict(model=dict(cfg, num_dates=1), loss=dict(ignore_index=255)),
                           train_set=series, val_set=None, print=print)
    with pytest.raises(ConfigError, match=r'model.num_dates is 1 but the scenes of data.train have 2 dates'):
        Trainer._check_model_matches_data(fake)
    matching = ConfigDict(model=cfg, loss=dict(ignore_index=255))
    Trainer._check_model_matches_data(SimpleNamespace(**dict(vars(fake), cfg=matching)))  # 2 dates: accepted
    # A list of one date is one date: a 2-date model read its bands as the dates, without a word.
    one_date = GeoTiffScenes([[t0]], [label], classes=2, mean=[127.5], std=[64.0], crop_size=32)
    with pytest.raises(ConfigError, match=r'model.num_dates is 2 but the scenes of data.train have 1 dates'):
        Trainer._check_model_matches_data(SimpleNamespace(**dict(vars(fake), cfg=ConfigDict(
            model=dict(cfg, in_channels=None), loss=dict(ignore_index=255)), train_set=one_date)))


def test_dates_that_encode_pixels_differently_are_refused(tmp_path):
    """A date with another band type (its values would be cast to the first date's) or another
    nodata tag (its empty pixels would be read as data) is refused, for training and prediction."""
    from ds_seg.data.raster import StackedRaster
    (t0, t1), label = _change_scene(tmp_path, 'a', 0)
    wide = str(tmp_path / 'a_t1_uint16.tif')
    with rasterio.open(t1) as src:
        profile, values = src.profile, src.read()
    with rasterio.open(wide, 'w', **dict(profile, dtype='uint16')) as d:
        d.write(values.astype(np.uint16) * 100)
    with rasterio.open(t1, 'r+') as d:
        d.nodata = 0
    for second, message in ((wide, r'a_t1_uint16.tif does not encode pixels like .*a_t0.tif \(types uint16'),
                            (t1, r'a_t1.tif does not encode pixels like .*a_t0.tif \(types uint8, nodata 0\.0')):
        with pytest.raises(DataError, match=message):
            GeoTiffScenes([[t0, second]], [label], classes=2, mean=[0], std=[1])
        with pytest.raises(DataError, match=message):
            StackedRaster([t0, second])
    from ds_seg.data.rangeserver import RangeServer
    with RangeServer(tmp_path) as server:   # one file under two signatures (signed URLs)
        first, second = server.url('a_t0.tif') + '?sig=1', server.url('a_t0.tif') + '?sig=2'
        with pytest.raises(DataError, match=r'a_t0.tif\?sig=2 is given as date 2 and as date 1 of one scene'):
            StackedRaster([first, second])


def test_prediction_marks_a_pixel_empty_at_any_one_date_as_nodata_like_training(tmp_path):
    from tests.unit.test_inference import predict_classes
    (t0, t1), label = _change_scene(tmp_path, 'n', 4)
    for path in (t0, t1):
        with rasterio.open(path, 'r+') as d:
            d.nodata = 0
    with rasterio.open(t1, 'r+') as d:  # the second date has no data over its left half
        values = d.read()
        values[:, :, :S // 2] = 0
        d.write(values)
    model = build(MODELS, dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2)).eval()
    with torch.no_grad():
        out, _ = predict_classes(model, [t0, t1], tmp_path, bands=[1], mean=[127.5] * 2, std=[64.0] * 2,
                                 tile=48, overlap=16)
    assert (out[:, :S // 2] == 255).all() and (out[:, S // 2:] != 255).all()
    ds = GeoTiffScenes([[t0, t1]], [label], classes=2, mean=[127.5], std=[64.0], crop_size=S, mode='grid')
    np.testing.assert_array_equal(ds[0]['nodata'].numpy(), out == 255)


def test_a_series_with_a_date_holding_no_data_names_that_date(tmp_path):
    """"No pixel is both labelled and valid" named the scene's first date, which held data, not
    the date that held none."""
    (t0, t1), label = _change_scene(tmp_path, 'e', 5)
    for path in (t0, t1):
        with rasterio.open(path, 'r+') as d:
            d.nodata = 0
    with rasterio.open(t1, 'r+') as d:
        d.write(np.zeros((1, S, S), np.uint8))
    with pytest.raises(DataError, match=rf'^{re.escape(t1)} \(date 2 of 2\): no pixel is both labelled'):
        GeoTiffScenes([[t0, t1]], [label], classes=2, crop_size=S, mode='grid', split='val')


def test_dates_on_one_grid_to_float_noise_are_accepted_and_one_file_as_two_dates_is_refused(tmp_path):
    """A date whose origin differs from the first's in the last float digits (another tool wrote
    it) is the same grid, as for image and label; one file given as two dates (by two spellings
    too) is a slip that would train on a series with a date missing: refused, for training and
    prediction alike."""
    from ds_seg.data.raster import StackedRaster
    (t0, t1), label = _change_scene(tmp_path, 'a', 0)
    with rasterio.open(t1, 'r+') as d:
        d.transform = rasterio.Affine(1, 0, 1e-9, 0, -1, 0)  # from_origin(0, 0, 1, 1), as rewritten elsewhere
    series = GeoTiffScenes([[t0, t1]], [label], classes=2, mean=[127.5], std=[64.0], crop_size=32)
    with rasterio.open(t0) as a, rasterio.open(t1) as b:
        expected = np.concatenate([a.read(window=series.window(0)[2]), b.read(window=series.window(0)[2])])
    with StackedRaster([t0, t1]) as src:
        np.testing.assert_array_equal(src.read(window=series.window(0)[2]), expected)
    twice = str(tmp_path / '.' / 'a_t0.tif')
    for second in (t0, twice):
        message = r'a_t0.tif is given as date 2 and as date 1 of one scene .*; give each date its own raster'
        with pytest.raises(DataError, match=message):
            GeoTiffScenes([[t0, second]], [label], classes=2, mean=[127.5], std=[64.0], crop_size=32)
        with pytest.raises(DataError, match=message):
            StackedRaster([t0, second])
    from ds_seg.data.rangeserver import RangeServer
    with RangeServer(tmp_path) as server:   # one file under two signatures (signed URLs)
        first, second = server.url('a_t0.tif') + '?sig=1', server.url('a_t0.tif') + '?sig=2'
        with pytest.raises(DataError, match=r'a_t0.tif\?sig=2 is given as date 2 and as date 1 of one scene'):
            StackedRaster([first, second])


def test_evaluate_a_time_series_val_and_refuse_a_one_date_model_on_it(tmp_path, capsys):
    """evaluate.py on a data.val of dated scenes stopped with a traceback while drawing the
    preview (the scene's image is a list of dates); a model of one date scored the first date of
    each scene only, with exit 0."""
    from ds_seg.cli import evaluate
    (t0, t1), label = _change_scene(tmp_path, 'e', 5)
    config = tmp_path / 'series.py'
    config.write_text(f"data = dict(val=dict(type='GeoTiffScenes', images=[[{t0!r}, {t1!r}]], labels=[{label!r}], "
                      f"classes=('same', 'changed'), mean=[127.5], std=[64.0]), crop_size=32)\n")
    torch.manual_seed(0)
    for name, cfg in (('series', dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2)),
                      ('single', dict(type='UNetTiny', in_channels=1, num_classes=2))):
        torch.save({'state_dict': build(MODELS, cfg).state_dict(), 'model': cfg, 'classes': ['same', 'changed'],
                    'data': {'bands': [1], 'mean': [127.5] * cfg['in_channels'], 'std': [64.0] * cfg['in_channels']}},
                   tmp_path / f'{name}.pt')
    out = tmp_path / 'series_eval'
    assert evaluate.main(['--checkpoint', str(tmp_path / 'series.pt'), '--config', str(config), '--output', str(out),
                          '--tile', '32', '--overlap', '8', '--previews', '1']) == 0
    assert (out / 'preview_0.png').stat().st_size > 1000
    assert int(np.sum(json.loads((out / 'eval.json').read_text())['confusion'])) == S * S
    capsys.readouterr()
    # One date's file through --images: the dates go through a config (it was told to 'give --bands
    # with 2 band numbers', which a one-band file does not have).
    code = evaluate.main(['--checkpoint', str(tmp_path / 'series.pt'), '--images', t0, '--labels', label,
                          '--output', str(tmp_path / 'one_date'), '--tile', '32'])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f'--images: the model (TinyTemporalSegFormer) takes 2 dates of 1 band(s) per scene, and {t0} is one file '
            'of 1 band(s); --images takes one file per scene (all its dates stacked), so give the dates through a '
            'config') in err, err
    code = evaluate.main(['--checkpoint', str(tmp_path / 'single.pt'), '--config', str(config),
                          '--output', str(tmp_path / 'single_eval'), '--tile', '32'])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert 'data.val has 2 date(s) per scene but the model (UNetTiny) takes 1' in err
    assert not (tmp_path / 'single_eval').exists()
    # Early fusion, which training allows: a plain model whose channels are both dates' bands.
    fused = dict(type='UNetTiny', in_channels=2, num_classes=2)
    torch.save({'state_dict': build(MODELS, fused).state_dict(), 'model': fused, 'classes': ['same', 'changed'],
                'data': {'bands': [1], 'mean': [127.5] * 2, 'std': [64.0] * 2}}, tmp_path / 'fused.pt')
    assert evaluate.main(['--checkpoint', str(tmp_path / 'fused.pt'), '--config', str(config),
                          '--output', str(tmp_path / 'fused_eval'), '--tile', '32', '--previews', '0']) == 0


def test_each_date_is_normalised_with_its_own_statistics_as_a_stacked_file_is(tmp_path, monkeypatch):
    """A series of dates given as files was normalised with its first date's statistics only
    (later, brighter dates reached the model several sigma off), while the same series as one
    stacked file got each date's: the two documented ways trained differently. Dates given as
    '~/...' were 'no such file'."""
    rng = np.random.default_rng(0)
    common = dict(driver='GTiff', width=64, height=64, crs='EPSG:32631', transform=from_origin(0, 0, 1, 1),
                  dtype='uint16')
    dates, stacks, labels = [], [], []
    for scene in 'ab':
        values = [rng.normal(1000 + 1000 * t, 50 + 10 * t, (2, 64, 64)).astype(np.uint16) for t in range(3)]
        files = []
        for t, v in enumerate(values):
            files.append(str(tmp_path / f'{scene}_t{t}.tif'))
            with rasterio.open(files[-1], 'w', count=2, **common) as d:
                d.write(v)
        with rasterio.open(tmp_path / f'{scene}_stack.tif', 'w', count=6, **common) as d:
            d.write(np.concatenate(values))
        with rasterio.open(tmp_path / f'{scene}_label.tif', 'w', count=1, **dict(common, dtype='uint8')) as d:
            d.write(rng.integers(0, 2, (1, 64, 64), dtype=np.uint8))
        dates.append(files)
        stacks.append(str(tmp_path / f'{scene}_stack.tif'))
        labels.append(str(tmp_path / f'{scene}_label.tif'))
    monkeypatch.setenv('HOME', str(tmp_path))
    series = GeoTiffScenes([[f.replace(str(tmp_path), '~') for f in d] for d in dates], labels, classes=2,
                           crop_size=32)
    stacked = GeoTiffScenes(stacks, labels, classes=2, crop_size=32)
    expected = np.concatenate([np.concatenate([rasterio.open(d[t]).read().reshape(2, -1) for d in dates], 1)
                               for t in range(3)])
    np.testing.assert_allclose(series.mean, expected.mean(1), rtol=1e-6)
    np.testing.assert_allclose(series.std, expected.std(1), rtol=1e-5)
    np.testing.assert_allclose(series.mean, stacked.mean, rtol=1e-6)
    # A subset of the bands takes each date's statistics of those bands.
    second = GeoTiffScenes(dates, labels, classes=2, crop_size=32, bands=[2])
    np.testing.assert_allclose(second.mean, expected.mean(1)[1::2], rtol=1e-6)


def test_dates_as_files_for_a_model_trained_on_stacked_files_say_which_bands(tmp_path, capsys):
    """A model trained on files stacking both dates (bands 1 2 recorded) given the dates as two
    files: 'a_t0.tif has band(s) 1..1 but the model reads bands [1, 2]', with no way out named.
    Now the line gives the --bands of one date, and with it the class map equals the stacked
    file's."""
    from ds_seg.cli import predict
    (t0, t1), _ = _change_scene(tmp_path, 'a', 0)
    stacked = str(tmp_path / 'a_both.tif')
    with rasterio.open(t0) as a, rasterio.open(t1) as b:
        with rasterio.open(stacked, 'w', **dict(a.profile, count=2)) as d:
            d.write(np.concatenate([a.read(), b.read()]))
    cfg = dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2)
    weights = str(tmp_path / 'weights.pt')
    torch.save({'state_dict': build(MODELS, cfg).state_dict(), 'model': cfg, 'classes': ['same', 'changed'],
                'data': {'bands': [1, 2], 'mean': [127.5, 127.5], 'std': [64.0, 64.0], 'file_bands': 2}}, weights)
    common = ['--checkpoint', weights, '--tile', '32', '--overlap', '8']
    assert predict.main(common + ['--input', f'{t0},{t1}', '--output', str(tmp_path / 'a')]) == 2
    assert capsys.readouterr().err.endswith("the model was trained on files stacking every date's 2 bands; for one "
                                            "file per date, select each date's bands: --bands 1\n")
    assert predict.main(common + ['--input', f'{t0},{t1}', '--output', str(tmp_path / 'b'), '--bands', '1']) == 0
    assert predict.main(common + ['--input', stacked, '--output', str(tmp_path / 'c')]) == 0
    with rasterio.open(tmp_path / 'b' / 'a_t0_classes.tif') as b:
        with rasterio.open(tmp_path / 'c' / 'a_both_classes.tif') as c:
            assert np.array_equal(b.read(), c.read())


def test_dates_of_other_band_counts_are_named_as_such(tmp_path):
    """Dates on one grid but of 1 and 2 bands were told to 'resample the dates onto one grid'."""
    from ds_seg.data.raster import StackedRaster
    (t0, _), _ = _change_scene(tmp_path, 'a', 0)
    two = str(tmp_path / 'a_two.tif')
    with rasterio.open(t0) as a:
        with rasterio.open(two, 'w', **dict(a.profile, count=2)) as d:
            d.write(np.concatenate([a.read(), a.read()]))
    with pytest.raises(DataError, match=r"a_two.tif has 2 band\(s\) but .*a_t0.tif has 1; every date of a scene "
                                        r"needs the same bands"):
        StackedRaster.check([t0, two])


def test_a_series_takes_stats_json_in_the_order_of_its_bands(tmp_path):
    """stats.json (one value per file band) beside a series whose `bands` reorder the file's:
    the values stayed in file order (each band normalised with another's statistics); one date
    took them in `bands` order."""
    rng = np.random.default_rng(0)
    common = dict(driver='GTiff', width=32, height=32, crs='EPSG:32631', transform=from_origin(0, 0, 1, 1),
                  dtype='uint8')
    files = []
    for t in range(2):
        files.append(str(tmp_path / f'a_t{t}.tif'))
        with rasterio.open(files[-1], 'w', count=3, **common) as d:
            d.write(rng.integers(0, 255, (3, 32, 32), dtype=np.uint8))
    with rasterio.open(tmp_path / 'a_label.tif', 'w', count=1, **common) as d:
        d.write(rng.integers(0, 2, (1, 32, 32), dtype=np.uint8))
    (tmp_path / 'stats.json').write_text(json.dumps({'mean': [10.0, 20.0, 30.0], 'std': [1.0, 2.0, 3.0]}))
    label = str(tmp_path / 'a_label.tif')
    one = GeoTiffScenes([files[0]], [label], classes=2, crop_size=16, bands=[3, 2, 1])
    series = GeoTiffScenes([files], [label], classes=2, crop_size=16, bands=[3, 2, 1])
    np.testing.assert_array_equal(one.mean, [30, 20, 10])
    np.testing.assert_array_equal(series.mean, [30, 20, 10, 30, 20, 10])
    np.testing.assert_array_equal(series.std, [3, 2, 1, 3, 2, 1])


def test_saturation_jitter_blends_each_date_with_its_own_bands(tmp_path):
    """Each date is its own image: the stack distorted at once equals each date distorted alone
    with the same draws (one grey over both dates pulled a dark date towards a bright one)."""
    from ds_seg.data.transforms import PhotoMetricDistortion
    rng = np.random.default_rng(0)
    mean, std = np.array([90., 100., 110.]), np.array([20., 25., 30.])
    dark, bright = (rng.integers(lo, lo + 40, (3, 8, 8)).astype(np.uint8) for lo in (10, 200))
    label = np.zeros((8, 8), np.int64)

    def jitter(image, num_dates):
        t = PhotoMetricDistortion(brightness=0, contrast=0, saturation=0.9, prob=1.0)
        t.bind_image_stats(np.tile(mean, num_dates), np.tile(std, num_dates), num_dates=num_dates)
        return t(image, label, np.random.default_rng(5))[0]

    alone = [jitter(d, 1) for d in (dark, bright)]
    stacked = jitter(np.concatenate([dark, bright]), 2)
    assert not np.array_equal(alone[0], dark)  # the draw does change the image
    np.testing.assert_array_equal(stacked, np.concatenate(alone))
    # The dataset tells its transforms how many dates its channels hold.
    ds = SyntheticAerial(split='train', num_scenes=1, scene_size=64, crop_size=32, dates=2, cache_dir=str(tmp_path),
                         transforms=[dict(type='PhotoMetricDistortion', prob=1.0)])
    assert ds.transforms.transforms[0].num_dates == 2


def test_a_scene_missing_a_date_is_the_one_named(tmp_path):
    """The refusal named the first scene, complete, whichever scene lacked a date."""
    scenes = [_change_scene(tmp_path, name, i) for i, name in enumerate('abc')]
    images = [list(dates) for dates, _ in scenes]
    images[1] = images[1][:1]
    with pytest.raises(DataError, match=re.escape(
            f"got [1, 2]: scene 1 has 1 ([{images[1][0]!r}]), scene 0 has 2 ({images[0]})")):
        GeoTiffScenes(images, [label for _, label in scenes], classes=2, mean=[0], std=[1])


def test_a_date_in_another_band_scale_or_offset_is_refused(tmp_path):
    """Scenes of another [scale, offset] are refused, and so must a later date of one scene be
    (only the first date's encoding was compared): raw + 1000 with offset -1000 beside raw."""
    from ds_seg.data.raster import StackedRaster
    paths = []
    for t, offset in enumerate((0.0, -1000.0)):
        path = str(tmp_path / f'd{t}.tif')
        with rasterio.open(path, 'w', driver='GTiff', width=32, height=32, count=3, dtype='uint16', crs='EPSG:32632',
                           transform=from_origin(500_000, 5_500_000, 0.1, 0.1)) as dst:
            dst.write(np.ones((3, 32, 32), np.uint16))
            dst.offsets = (offset,) * 3
        paths.append(path)
    with pytest.raises(DataError, match=r"d1.tif does not encode pixels like .*d0.tif .*band scale/offset "
                                        r"\[\[1.0, -1000.0\], .* vs .*band scale/offset \[\[1.0, 0.0\]"):
        StackedRaster.check(paths)
    StackedRaster.check(paths[:1])


def test_a_glob_among_a_scenes_dates_stands_for_its_dates_in_name_order(tmp_path):
    """images=[['b_t*.tif']] was a traceback in data.val (IndexError) and 'no such file' in
    data.train: the glob was taken as a file name, or its first date expanded into scenes of one
    date each. It stands for the scene's dates, sorted by name."""
    (a0, a1), label_a = _change_scene(tmp_path, 'a', 0)
    (b0, b1), label_b = _change_scene(tmp_path, 'b', 1)
    kw = dict(crop_size=32, mode='grid', mean=[128] * 2, std=[50] * 2, classes=2)
    globbed = GeoTiffScenes([[str(tmp_path / 'a_t*.tif')], [str(tmp_path / 'b_t?.tif')]], [label_a, label_b], **kw)
    listed = GeoTiffScenes([[a0, a1], [b0, b1]], [label_a, label_b], **kw)
    assert [list(s['dates']) for s in globbed.scenes] == [[a0, a1], [b0, b1]]
    assert len(globbed) == len(listed)
    for i in range(len(listed)):
        assert torch.equal(globbed[i]['image'], listed[i]['image']) and torch.equal(globbed[i]['label'], listed[i]['label'])
    with pytest.raises(DataError, match=r"images: the pattern '.*c_t\*\.tif' among a scene's dates matches no file"):
        GeoTiffScenes([[str(tmp_path / 'c_t*.tif')]], [label_a], **kw)


def test_a_glob_of_dates_whose_names_do_not_sort_in_time_is_refused(tmp_path):
    """[['b_*.tif']] over b_may.tif and b_aug.tif (the README's own kind of names), or
    b_2021-5-1/b_2021-10-1, or t1/t10/t2, came out sorted by name: the scene's dates reversed
    against scenes that list theirs, without a word. Refused, naming the matches; zero-padded
    dates and numbers of one width still stand for their dates."""
    (a0, a1), label_a = _change_scene(tmp_path, 'a', 0)
    kw = dict(crop_size=32, mode='grid', mean=[128] * 2, std=[50] * 2, classes=2)
    for style, names in (('month', ['may', 'aug']), ('unpadded', ['2021-5-1', '2021-10-1']),
                         ('count', ['t1', 't2', 't10']), ('dmy', ['15.05.2021', '01.08.2021'])):
        folder = tmp_path / style
        folder.mkdir()
        for k, name in enumerate(names):
            shutil.copy((a0, a1)[k % 2], folder / f'b_{name}.tif')
        pattern = str(folder / 'b_*.tif')
        with pytest.raises(DataError, match=rf"^images: the pattern {re.escape(repr(pattern))} among a scene's dates "
                                            rf"matches b_.*, which sorted by name need not be in time order"):
            GeoTiffScenes([[pattern]], [label_a], **kw)
        # Listed, in time order, they are the scene's dates.
        assert len(GeoTiffScenes([[str(folder / f'b_{n}.tif') for n in names[:2]]], [label_a], **kw)) > 0
    for style, names in (('iso', ['2021-05-01', '2021-10-01']), ('doy', ['2021135', '2021274']),
                         ('padded', ['t01', 't02'])):
        folder = tmp_path / style
        folder.mkdir()
        for k, name in enumerate(names):
            shutil.copy((a0, a1)[k], folder / f'b_{name}.tif')
        ds = GeoTiffScenes([[str(folder / 'b_*.tif')]], [label_a], **kw)
        assert [os.path.basename(p) for p in ds.scenes[0]['dates']] == [f'b_{n}.tif' for n in names]


def test_a_glob_of_dated_product_names_stands_for_its_dates_in_time_order(tmp_path):
    """Landsat 8 and 9 scenes (LC08_..., LC09_...) and Sentinel-2A/2B products sorted by name
    came in order of satellite, not of date: May, August, October fed as August, May, October,
    without a word (Landsat's path/row 200011 read as the same date 2000-11 in every name)."""
    from ds_seg.data.geotiff import dates_out_of_name_order
    (a0, a1), label_a = _change_scene(tmp_path, 'a', 0)
    kw = dict(crop_size=32, mode='grid', mean=[128], std=[50], classes=2)
    for kind, names in (
            ('landsat', ['LC09_L2SP_200011_20220510_20220512_02_T1_SR', 'LC08_L2SP_200011_20220815_20220820_02_T1_SR',
                         'LC09_L2SP_200011_20221004_20221006_02_T1_SR']),
            ('sentinel2', ['S2B_MSIL2A_20210510T103619_N0300_R108_T32TQM_20210510T135217',
                           'S2A_MSIL2A_20210815T103631_N0301_R108_T32TQM_20210815T134102',
                           'S2B_MSIL2A_20211004T103829_N0301_R108_T32TQM_20211004T140018'])):
        folder = tmp_path / kind
        folder.mkdir()
        for k, name in enumerate(names):
            shutil.copy((a0, a1)[k % 2], folder / f'{name}.tif')
        ds = GeoTiffScenes([[str(folder / f'{names[0][:2]}*.tif')]], [label_a], **kw)
        assert [os.path.basename(p) for p in ds.scenes[0]['dates']] == [f'{n}.tif' for n in names]
        assert not getattr(ds, 'notes', [])
        listed = [str(folder / f'{n}.tif') for n in (names[1], names[0], names[2])]
        assert dates_out_of_name_order([listed]) is not None   # listed out of time order: said


def test_dates_given_out_of_the_order_their_names_say_are_noted(tmp_path):
    """Nothing sorts a scene's dates; one scene listed as b_2021-08, b_2021-05 fed the model its
    dates swapped without a word. Where the names carry dates in another order, one note says so."""
    from ds_seg.data.geotiff import dates_out_of_name_order
    (a0, a1), label_a = _change_scene(tmp_path, 'a', 0)
    named = []
    for src, name in ((a0, 'b_2021-05-03.tif'), (a1, 'b_20210815.tif')):
        shutil.copy(src, tmp_path / name)
        named.append(str(tmp_path / name))
    kw = dict(crop_size=32, mode='grid', mean=[128] * 2, std=[50] * 2, classes=2)
    assert not getattr(GeoTiffScenes([named], [label_a], **kw), 'notes', [])
    swapped = GeoTiffScenes([named[::-1]], [label_a], **kw)
    assert swapped.notes == ['the dates of a scene are given as b_20210815.tif, b_2021-05-03.tif, which their names '
                             'place in another order; the order given is the order used (nothing sorts them): check '
                             'that every scene lists its dates in the same order']
    assert dates_out_of_name_order([[a1, a0]]) is None   # names without dates (t0, t1): nothing to say
    assert dates_out_of_name_order([['x_2021-05.tif', 'x_2021-05-20.tif', 'x_2022-01.tif']]) is None


def test_predict_notes_dates_given_out_of_the_order_their_names_say(tmp_path, capsys):
    """Training said it; predict.py ran the swapped dates without a word (435 of 9216 pixels
    changed under pooling='diff')."""
    from ds_seg.cli import predict
    (t0, t1), _ = _change_scene(tmp_path, 'c', 3)
    may, aug = str(tmp_path / 'c_2021-05.tif'), str(tmp_path / 'c_2021-08.tif')
    shutil.copy(t0, may)
    shutil.copy(t1, aug)
    cfg = dict(type='TinyTemporalSegFormer', num_dates=2, in_channels=2, num_classes=2, pooling='diff')
    weights = str(tmp_path / 'weights.pt')
    torch.save({'state_dict': build(MODELS, cfg).state_dict(), 'model': cfg, 'classes': ['same', 'changed'],
                'data': {'bands': [1], 'mean': [127.5, 127.5], 'std': [64.0, 64.0]}}, weights)
    common = ['--checkpoint', weights, '--tile', '48', '--device', 'cpu']
    assert predict.main(common + ['--input', f'{may},{aug}', '--output', str(tmp_path / 'a')]) == 0
    assert '[predict] note' not in capsys.readouterr().out
    assert predict.main(common + ['--input', f'{aug},{may}', '--output', str(tmp_path / 'b')]) == 0
    out = capsys.readouterr().out
    assert (f'[predict] note: --input {aug},{may}: the dates of a scene are given as c_2021-08.tif, c_2021-05.tif, '
            'which their names place in another order') in out, out


def test_a_plain_model_trained_on_a_series_predicts_its_dates_joined_by_commas(tmp_path, capsys):
    """Early fusion, which training allows (UNet in_channels = dates x bands): its checkpoint holds no
    model.num_dates, so predict.py refused `a.tif,b.tif` as 'one scene of one date', and the advice
    it gave (space-separated) was refused next. The checkpoint's data now records the dates."""
    from ds_seg.cli import predict
    from ds_seg.data.geotiff import GeoTiffScenes
    from ds_seg.engine.checkpointer import data_normalisation
    from tests.unit.test_inference import predict_classes
    (t0, t1), label = _change_scene(tmp_path, 'f', 4)
    series = GeoTiffScenes([[t0, t1]], [label], crop_size=32, classes=('same', 'changed'), mean=[127.5], std=[64.0])
    data = data_normalisation(series)
    assert data['num_dates'] == 2 and data['mean'] == [127.5, 127.5]
    assert 'num_dates' not in data_normalisation(GeoTiffScenes([t0], [label], crop_size=32, classes=2))
    torch.manual_seed(0)
    fused = dict(type='UNetTiny', in_channels=2, num_classes=2)
    model = build(MODELS, fused).eval()
    weights = str(tmp_path / 'fused.pt')
    torch.save({'state_dict': model.state_dict(), 'model': fused, 'classes': ['same', 'changed'], 'data': data},
               weights)
    assert predict.main(['--checkpoint', weights, '--input', f'{t0},{t1}', '--output', str(tmp_path / 'out'),
                         '--tile', '48', '--overlap', '16']) == 0
    with torch.no_grad():
        direct, _ = predict_classes(model, [t0, t1], tmp_path, mean=[127.5, 127.5], std=[64.0, 64.0], bands=[1],
                                    tile=48, overlap=16)
    with rasterio.open(tmp_path / 'out' / 'f_t0_classes.tif') as src:
        np.testing.assert_array_equal(src.read(1), direct)
    capsys.readouterr()
    assert predict.main(['--checkpoint', weights, '--input', t0, '--output', str(tmp_path / 'one')]) == 2
    err = capsys.readouterr().err
    assert f'--input {t0}: 1 date(s), but the model (UNetTiny) takes 2; give the 2 dates of the scene joined by ' \
           'commas' in err, err
    # evaluate --images of one date: it read only model.num_dates, and told this 1-band file to
    # 'give --bands with 2 band numbers'.
    from ds_seg.cli import evaluate
    assert evaluate.main(['--checkpoint', weights, '--images', t0, '--labels', label,
                          '--output', str(tmp_path / 'one_eval')]) == 2
    err = capsys.readouterr().err
    assert f'--images: the model (UNetTiny) takes 2 dates of 1 band(s) per scene, and {t0} is one file of 1 ' \
           'band(s)' in err, err


def test_given_statistics_of_a_length_read_two_ways_say_which_reading_was_taken(tmp_path):
    """2-band files, band [1] of 2 dates: two values are one per file band and one per selected
    band and date alike. They were read per band and date without a word, where stats.json's
    layout (and the user's, copying it) is per file band."""
    common = dict(driver='GTiff', width=S, height=S, crs='EPSG:32631', transform=from_origin(0, 0, 1, 1),
                  dtype='uint8')
    dates = []
    for t in range(2):
        dates.append(str(tmp_path / f'x_t{t}.tif'))
        with rasterio.open(dates[-1], 'w', count=2, **common) as d:
            d.write(np.full((2, S, S), 50 + 100 * t, np.uint8))
    label = str(tmp_path / 'x_label.tif')
    with rasterio.open(label, 'w', count=1, **common) as d:
        d.write(np.zeros((1, S, S), np.uint8))
    kw = dict(crop_size=32, mode='grid', classes=2, bands=[1])
    ds = GeoTiffScenes([dates], [label], mean=[10.0, 20.0], std=[5.0, 5.0], **kw)
    assert ds.mean.tolist() == [10.0, 20.0]
    assert ds.notes == ["mean has 2 values, as many as the file's bands and as the selected bands of every date: taken "
                        "per band and date (1 for each of 2 dates, in order); for one value per file band give the 1 "
                        "of the selected bands, [10]"]
    assert not getattr(GeoTiffScenes([dates], [label], mean=[10.0], std=[5.0], **kw), 'notes', [])
    # One reading: nothing to say (the same values per date read either way).
    assert not getattr(GeoTiffScenes([dates], [label], mean=[10.0, 10.0], std=[5.0, 5.0], **kw), 'notes', [])
