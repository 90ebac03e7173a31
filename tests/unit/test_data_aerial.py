"""Issue 4: label decoding, bad input, sampling options, random scale, transforms, benchmark
trees and training on each of them. Generated data only."""
import hashlib  # not hash(): str/bytes hashes are salted per process
import itertools
import os

import numpy as np
import pytest
import rasterio
import torch
from rasterio.transform import from_origin

from ds_seg.config import ConfigError, load_config
from ds_seg.data import (DataError, DeepGlobeLandCover, GeoTiffScenes, ImageMaskFolder, InriaAerial,
                         LoveDA, Potsdam, Vaihingen, build_train_loader)
from ds_seg.data.benchmarks import ISPRS_PALETTE
from ds_seg.data.miniature import write_miniature
from ds_seg.registry import TRANSFORMS, build
from tests.dist import run_on_ranks
from tests.tiny import finished

IGNORE = 255
BENCHMARKS = {'Potsdam': Potsdam, 'Vaihingen': Vaihingen, 'LoveDA': LoveDA, 'InriaAerial': InriaAerial,
              'DeepGlobeLandCover': DeepGlobeLandCover}


def write_tif(path, array, transform=None, nodata=None, crs='EPSG:32632'):
    array = array[None] if array.ndim == 2 else array
    with rasterio.open(path, 'w', driver='GTiff', width=array.shape[2], height=array.shape[1],
                       count=array.shape[0], dtype=array.dtype, crs=crs,
                       transform=transform or from_origin(500_000, 5_500_000, 0.1, 0.1),
                       tiled=True, blockxsize=16, blockysize=16, photometric='MINISBLACK',
                       nodata=nodata) as dst:
        dst.write(array)
    return str(path)


@pytest.fixture(scope='module')
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp('trees')
    return {name: write_miniature(name, str(root / name), size=96) for name in list(BENCHMARKS) + ['ImageMaskFolder']}


# ------------------------------------------------------------------ GeoTIFF variants
def test_uint16_four_band_nodata_stripes_and_float_nan(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.integers(1, 10000, (4, 64, 48)).astype(np.uint16)
    values[:, 8:12] = 0                     # nodata stripe (all bands)
    values[:, :, 40:] = 0                   # another, along the edge
    labels = rng.integers(0, 3, (64, 48)).astype(np.uint8)
    img = write_tif(tmp_path / 'u16.tif', values, nodata=0)
    lbl = write_tif(tmp_path / 'u16_label.tif', labels)
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=3, mode='grid', bands=[4, 3, 2, 1])
    assert ds.in_channels == 4 and ds.scenes[0]['nodata'] == 0
    full = np.full((64, 48), -1)
    for i in range(len(ds)):
        _, _, w = ds.window(i)
        sample = ds[i]
        keep = sample['label'].numpy() != IGNORE
        full[w.row_off:w.row_off + 32, w.col_off:w.col_off + 32][keep] = sample['label'].numpy()[keep]
    expect = labels.astype(int)
    expect[8:12] = -1
    expect[:, 40:] = -1
    np.testing.assert_array_equal(full, expect)
    assert ds[0]['image'].dtype == torch.uint16
    first, _ = finished(ds, 0)        # window (0, 0): rows 8-11 are nodata, zero in the input
    assert (first[:, 8:12] == 0).all() and (first[:, :8] != 0).any(dim=0).all()
    # Band order follows `bands`: band 4 of the file comes first, normalised by its own stats.
    np.testing.assert_allclose(first[0, 0, 0].item(), (values[3, 0, 0] - ds.mean[0]) / ds.std[0], rtol=1e-5)

    fl = rng.random((2, 32, 32)).astype(np.float32)
    fl[1, 5, :] = np.nan                    # NaN in one band only: still not a usable pixel
    fimg = write_tif(tmp_path / 'f.tif', fl)
    flbl = write_tif(tmp_path / 'f_label.tif', np.ones((32, 32), np.uint8))
    fimage, flabel = finished(GeoTiffScenes([fimg], [flbl], crop_size=32, classes=2, mode='grid'), 0)
    assert (flabel[5] == IGNORE).all() and (flabel[6] == 1).all()
    assert torch.isfinite(fimage).all() and (fimage[:, 5] == 0).all() and (fimage[:, 6] != 0).all()


def test_palette_decoding_tolerates_noise(tmp_path):
    rng = np.random.default_rng(1)
    truth = rng.integers(0, 6, (48, 48))
    truth[:4] = -1                                   # black boundary pixels: ignore
    colours = np.asarray(ISPRS_PALETTE + ((0, 0, 0),), np.int16)
    rgb = colours[truth].transpose(2, 0, 1) + rng.integers(-30, 31, (3, 48, 48))  # JPEG-like noise
    img = write_tif(tmp_path / 'img.tif', rng.integers(0, 255, (3, 48, 48)).astype(np.uint8))
    lbl = write_tif(tmp_path / 'lbl.tif', np.clip(rgb, 0, 255).astype(np.uint8))
    ds = GeoTiffScenes([img], [lbl], crop_size=48, mode='grid', palette=ISPRS_PALETTE,
                       palette_ignore=[(0, 0, 0)])
    assert ds.num_classes == 6
    expect = np.where(truth < 0, IGNORE, truth)
    np.testing.assert_array_equal(ds[0]['label'].numpy(), expect)


def test_colour_labels_without_a_class_colour_are_named_not_the_images(tmp_path):
    # Every pixel black (palette_ignore): the line blamed the images' nodata value and `bands`.
    rng = np.random.default_rng(2)
    img = write_tif(tmp_path / 'img.tif', rng.integers(1, 255, (3, 32, 32)).astype(np.uint8))
    lbl = write_tif(tmp_path / 'black.tif', np.zeros((3, 32, 32), np.uint8))
    with pytest.raises(DataError, match=r"black.tif: no pixel is labelled with a class \(all are colours of "
                                        r"`palette_ignore`, unknown colours or nodata\).*`palette` or "
                                        r"`palette_ignore`"):
        GeoTiffScenes([img], [lbl], crop_size=32, palette=ISPRS_PALETTE, palette_ignore=[(0, 0, 0)])
    # A class colour in one pixel is enough: no refusal.
    one = np.zeros((3, 32, 32), np.uint8)
    one[:, 7, 9] = ISPRS_PALETTE[2]
    GeoTiffScenes([img], [write_tif(tmp_path / 'one.tif', one)], crop_size=32, palette=ISPRS_PALETTE,
                  palette_ignore=[(0, 0, 0)], palette_max_unmatched=1)


def test_label_map_and_reduce_zero_label(tmp_path):
    img = write_tif(tmp_path / 'img.tif', np.zeros((1, 16, 16), np.uint8))
    raw = np.tile(np.array([0, 1, 2, 255], np.uint8), (16, 4))
    lbl = write_tif(tmp_path / 'lbl.tif', raw)
    zero = GeoTiffScenes([img], [lbl], crop_size=16, mode='grid', classes=2, reduce_zero_label=True)
    np.testing.assert_array_equal(zero[0]['label'][0, :4].numpy(), [IGNORE, 0, 1, IGNORE])
    mapped = GeoTiffScenes([img], [lbl], crop_size=16, mode='grid', classes=2, label_map={255: 1, 2: IGNORE})
    np.testing.assert_array_equal(mapped[0]['label'][0, :4].numpy(), [0, 1, IGNORE, 1])
    as_text = GeoTiffScenes([img], [lbl], crop_size=16, mode='grid', classes=2, label_map={'255': 1, '2': IGNORE})
    np.testing.assert_array_equal(as_text[0]['label'][0, :4].numpy(), [0, 1, IGNORE, 1])  # keys of a JSON config
    for key in (-1, 70000, 'nodata', 1.5):  # -1 used to remap 65535; 70000 was an IndexError
        with pytest.raises(ValueError, match=rf"label_map key {key!r}: keys are label file values 0..65535"):
            GeoTiffScenes([img], [lbl], crop_size=16, classes=2, label_map={key: IGNORE})


# ------------------------------------------------------------------ bad input
def _pair(tmp_path, labels=None, size=(32, 32), label_size=None, label_transform=None):
    img = write_tif(tmp_path / 'img.tif', np.ones((3,) + size, np.uint8))
    lab = labels if labels is not None else np.zeros(label_size or size, np.uint8)
    return img, write_tif(tmp_path / 'img_label.tif', lab, transform=label_transform)


def test_bad_input_messages_name_the_files(tmp_path):
    img, lbl = _pair(tmp_path)
    cases = []
    with pytest.raises(DataError) as e:                                   # missing file
        GeoTiffScenes([img], [str(tmp_path / 'nope.tif')], classes=2)
    cases.append((e, [str(tmp_path / 'nope.tif'), 'no such file']))
    garbage = tmp_path / 'garbage.tif'
    garbage.write_bytes(b'II*\x00' + os.urandom(300))                    # corrupt GeoTIFF
    with pytest.raises(DataError) as e:
        GeoTiffScenes([str(garbage)], [lbl], classes=2)
    cases.append((e, [str(garbage), 'not a readable raster']))
    img2, bad = _pair(tmp_path / '', labels=np.full((32, 32), 7, np.uint8))  # labels outside the classes
    with pytest.raises(DataError) as e:
        GeoTiffScenes([img2], [bad], classes=('a', 'b', 'c'))
    cases.append((e, [bad, 'label value 7', 'a, b, c']))
    sub = tmp_path / 'shifted'
    sub.mkdir()
    img3, shifted = _pair(sub, label_transform=from_origin(500_010, 5_500_000, 0.1, 0.1))  # transform mismatch
    with pytest.raises(DataError) as e:
        GeoTiffScenes([img3], [shifted], classes=2)
    cases.append((e, [img3, shifted, 'geotransforms']))
    trunc = tmp_path / 'trunc.tif'                                        # truncated download
    trunc.write_bytes(open(img, 'rb').read()[:700])
    with pytest.raises(DataError) as e:
        GeoTiffScenes([str(trunc)], [lbl], classes=2, mean=[0] * 3, std=[1] * 3)
    cases.append((e, [str(trunc), 'corrupt or truncated']))
    for err, parts in cases:
        message = str(err.value)
        assert '\n' not in message and 'See previous exception' not in message, message  # GDAL's words, not rasterio's
        for part in parts:
            assert part in message, (part, message)
    # ...and through the CLI's path: a ConfigError, so launch/train.py prints one line.
    assert issubclass(DataError, ConfigError)


def test_bad_palette_and_folder_pairs(tmp_path, trees):
    img, lbl = _pair(tmp_path, labels=np.stack([np.full((32, 32), 128, np.uint8)] * 3))
    with pytest.raises(DataError, match=r'img_label\.tif: 100\.0% of the label pixels match no palette'):
        GeoTiffScenes([img], [lbl], palette=[(0, 0, 0), (255, 255, 255)], palette_tolerance=20)
    # A negative tolerance matched nothing, and the line above blamed the palette (and its colours).
    for bad in (-1, 256, 'high', True):
        with pytest.raises(DataError, match=rf"^palette_tolerance={bad!r}: give how far \(0\.\.255 per channel\)"):
            GeoTiffScenes([img], [lbl], palette=[(0, 0, 0), (255, 255, 255)], palette_tolerance=bad)
    with pytest.raises(DataError, match=r"^palette_max_unmatched=1\.5: give the share \(0\.\.1\)"):
        GeoTiffScenes([img], [lbl], palette=[(0, 0, 0), (255, 255, 255)], palette_max_unmatched=1.5)
    root = write_miniature('ImageMaskFolder', str(tmp_path / 'folder'), size=32)
    os.remove(os.path.join(root, 'ann_dir', 'train', '0_0_0_32_32.png'))
    with pytest.raises(DataError, match=r'img_dir/train/0_0_0_32_32\.png has no label: expected .*ann_dir/train/0_0_0_32_32\.png'):
        ImageMaskFolder(root, split='train', classes=6)
    with pytest.raises(DataError, match=r'top_potsdam_2_10_label_noBoundary\.tif not found'):
        os.rename(os.path.join(trees['Potsdam'], '5_Labels_all_noBoundary'), str(tmp_path / 'moved'))
        try:
            Potsdam(trees['Potsdam'], split='train', eroded=True)
        finally:
            os.rename(str(tmp_path / 'moved'), os.path.join(trees['Potsdam'], '5_Labels_all_noBoundary'))


# ------------------------------------------------------------------ sampling options
def _ramp_scene(tmp_path, h=96, w=96):
    # class = f(position), image = 60 * class + fixed noise: the class shows in the image (any
    # misregistration or wrong resize shows up) and no two windows have the same pixels.
    yy, xx = np.mgrid[:h, :w]
    label = ((yy // 8 + xx // 8) % 4).astype(np.uint8)
    image = label * 60 + np.random.default_rng(0).integers(0, 50, (h, w)).astype(np.uint8)
    return (write_tif(tmp_path / 'r.tif', image[None]), write_tif(tmp_path / 'r_label.tif', label), label)


def test_random_scale_reads_crop_over_scale_and_resizes(tmp_path):
    img, lbl, _ = _ramp_scene(tmp_path)
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=4, mean=[0], std=[1], augment=False,
                       random_scale=(2.0, 2.0))
    for i in range(5):
        s = ds[i]
        assert s['image'].shape == (1, 32, 32) and s['scale'] == 2.0
        label = s['label'].numpy()
        # A 16 px window upsampled 2x (nearest): every 2x2 block is one value, and the 8 px class
        # cells of the scene appear 16 px wide.
        np.testing.assert_array_equal(label[::2, ::2], label[1::2, 1::2])
        assert (np.diff(label[0]) != 0).sum() <= 2
    half = GeoTiffScenes([img], [lbl], crop_size=32, classes=4, mean=[0], std=[1], augment=False,
                         random_scale=(0.5, 0.5))[0]['label'].numpy()
    assert (np.diff(half[0]) != 0).sum() >= 7  # a 64 px window shrunk: 4 px cells, 8 changes


def test_random_scale_keeps_nodata_out_of_valid_pixels(tmp_path):
    values = np.full((1, 64, 64), 50, np.uint8)
    values[:, :, 29:35] = 255                          # a nodata stripe: edges on both sides
    img = write_tif(tmp_path / 'n.tif', values, nodata=255)
    lbl = write_tif(tmp_path / 'n_label.tif', np.ones((64, 64), np.uint8))
    for scale in (0.6, 1.7):                           # shrink and enlarge
        ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=2, mean=[100], std=[50], augment=False,
                           random_scale=(scale, scale))
        edges = 0
        for i in range(20):
            image, label = finished(ds, i)
            valid = label != IGNORE
            assert (image[0][~valid] == 0).all()
            # Valid pixels are (50 - 100) / 50 = -1. Next to nodata, bilinear weights can reach
            # pixels the nearest-resized mask calls valid: they may drift towards 0 (the mean,
            # which nodata is filled with before resizing), never towards (255 - 100) / 50 = 3.1.
            v = image[0][valid]
            assert (v >= -1).all() and (v <= 0).all(), v.max()
            edges += int((v > -1).sum())
        assert edges > 0, 'no window crossed the nodata edge: the test checks nothing'


def test_scale_comes_from_the_micro_step(tmp_path):
    img, lbl, _ = _ramp_scene(tmp_path)
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=4, random_scale=(0.5, 2.0))
    ds.set_sampling_layout(world_size=2, micro_batch=3)
    for m in range(20):
        scales = {ds.scale_for_index((m * 2 + r) * 3 + j) for r in range(2) for j in range(3)}
        assert len(scales) == 1
    assert len({ds.scale_for_index(m * 6) for m in range(20)}) == 20


def _rank_stream(tmp, steps):
    # No process group: the ranks cannot communicate, so agreement must come from shared state.
    import torch.distributed as dist
    assert not dist.is_initialized()
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    img, lbl = os.path.join(tmp, 'r.tif'), os.path.join(tmp, 'r_label.tif')
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=4, random_scale=(0.5, 2.0),
                       transforms=[dict(type='PhotoMetricDistortion')])
    loader = build_train_loader(ds, micro_batch=2, rank=rank, world_size=world, num_workers=0)
    out = []
    for batch in itertools.islice(iter(loader), steps):
        out.append((tuple(batch['image'].shape), tuple(batch['label'].shape), batch['scale'].tolist(),
                    [hashlib.sha1(x.numpy().tobytes()).hexdigest() for x in batch['image']]))
    return out


def test_equal_shapes_and_scales_on_two_ranks_over_100_steps(tmp_path):
    _ramp_scene(tmp_path)
    a, b = run_on_ranks(_rank_stream, world_size=2, args=(str(tmp_path), 100), timeout=180)
    scales = []
    for (sa, la, ca, ha), (sb, lb, cb, hb) in zip(a, b):
        assert sa == sb == (2, 1, 32, 32) and la == lb == (2, 32, 32)
        assert len(set(ca + cb)) == 1  # one factor per step, on both ranks and both samples
        scales.append(ca[0])
    assert len(a) == len(b) == 100
    assert min(scales) < 0.8 and max(scales) > 1.6  # the factor really varies between steps
    ha = {h for step in a for h in step[3]}
    hb = {h for step in b for h in step[3]}
    assert not ha & hb and len(ha) == len(hb) == 200  # distinct windows, per rank and across ranks
    # The union is reproducible: computing the stream again (in this process) gives the same.
    os.environ.update(RANK='1', WORLD_SIZE='2')
    try:
        again = _rank_stream(str(tmp_path), 100)
    finally:
        del os.environ['RANK'], os.environ['WORLD_SIZE']
    assert again == b


def test_zero_and_two_workers_identical_with_scale_and_transforms(tmp_path):
    img, lbl, _ = _ramp_scene(tmp_path)
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=4, random_scale=(0.5, 2.0), cat_max_ratio=0.9,
                       transforms=[dict(type='PhotoMetricDistortion', prob=1.0)])
    runs = []
    for workers in (0, 2):
        loader = build_train_loader(ds, micro_batch=2, rank=0, world_size=2, num_workers=workers,
                                    prefetch_factor=1, start_micro_step=5)
        runs.append(list(itertools.islice(iter(loader), 4)))
    for x, y in zip(*runs):
        assert torch.equal(x['image'], y['image']) and torch.equal(x['label'], y['label'])


def test_cat_max_ratio_and_nodata_skipping(tmp_path):
    label = np.zeros((128, 128), np.uint8)
    label[:, 96:] = 1                                  # class 1 only in the right quarter
    values = np.full((1, 128, 128), 50, np.uint8)
    values[:, :64] = 0                                 # left half nodata
    img = write_tif(tmp_path / 'i.tif', values, nodata=0)
    lbl = write_tif(tmp_path / 'l.tif', label)
    kw = dict(crop_size=32, classes=2, mean=[0], std=[1], augment=False)

    def share(ds, fn):
        return np.mean([fn(ds[i]) for i in range(60)])

    def mixed(s):  # both classes present, none above 75%
        lab = s['label'].numpy()
        counts = np.bincount(lab[lab != IGNORE], minlength=2)
        return counts.sum() > 0 and counts.max() / counts.sum() < 0.75

    def mostly_nodata(s):
        return (s['label'].numpy() == IGNORE).mean() > 0.5

    plain = GeoTiffScenes([img], [lbl], **kw)
    assert share(plain, mixed) < 0.2
    # Acceptable windows are rare here (~15%), so 10 retries do not always find one.
    assert share(GeoTiffScenes([img], [lbl], cat_max_ratio=0.75, **kw), mixed) > 0.6
    assert share(plain, mostly_nodata) > 0.3
    assert share(GeoTiffScenes([img], [lbl], max_nodata_ratio=0.5, **kw), mostly_nodata) < 0.05


def test_transforms_are_registered_and_joint(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.standard_normal((3, 16, 16)).astype(np.float32)
    image[:, 0, 0] = 0
    label = rng.integers(0, 4, (16, 16))
    for cfg in (dict(type='RandomFlip', prob=1.0), dict(type='RandomRotate90', prob=1.0)):
        t = build(TRANSFORMS, cfg)
        out_img, out_lbl = t(image, label, np.random.default_rng(3))
        key = image[0] * 10 + label                   # a value that travels with each pixel
        out_key = out_img[0] * 10 + out_lbl
        assert not np.array_equal(out_key, key)
        np.testing.assert_allclose(np.sort(out_key.ravel()), np.sort(key.ravel()), rtol=1e-6)
    pmd = build(TRANSFORMS, dict(type='PhotoMetricDistortion', prob=1.0))
    out_img, out_lbl = pmd(image, label, np.random.default_rng(0))
    assert out_lbl is label and not np.allclose(out_img, image)
    # Bound to band statistics it does the same in file units and keeps the dtype: distorting
    # raw uint8 then normalising equals normalising then distorting, up to the rounding to uint8.
    mean, std = np.array([100, 120, 140], np.float32), np.array([20, 30, 40], np.float32)
    raw = np.clip(image * std[:, None, None] + mean[:, None, None], 0, 255).round().astype(np.uint8)
    bound = build(TRANSFORMS, dict(type='PhotoMetricDistortion', prob=1.0))
    bound.bind_image_stats(mean, std)
    out_raw, _ = bound(raw, label, np.random.default_rng(0))
    norm = (raw.astype(np.float32) - mean[:, None, None]) / std[:, None, None]
    expect = pmd(norm, label, np.random.default_rng(0))[0] * std[:, None, None] + mean[:, None, None]
    assert out_raw.dtype == np.uint8
    inside = (expect > 0.5) & (expect < 254.5)
    assert inside.mean() > 0.9 and np.abs(out_raw[inside] - expect[inside]).max() <= 0.5 + 1e-3


@pytest.mark.parametrize('transform, named', [
    (dict(type='RandomFlip', direction='horizonal'), "RandomFlip direction must be one or both of 'horizontal', "
                                                     "'vertical', got 'horizonal'"),
    (dict(type='RandomFlip', direction=[]), 'RandomFlip direction must be one or both'),
    (dict(type='RandomFlip', prob=1.5), 'RandomFlip prob must be a number in [0, 1], got 1.5'),
    (dict(type='RandomRotate90', prob=-0.1), 'RandomRotate90 prob must be a number in [0, 1]'),
    (dict(type='PhotoMetricDistortion', contrast=1.5), 'PhotoMetricDistortion contrast must be a number in [0, 1]'),
    (dict(type='PhotoMetricDistortion', saturation=2), 'PhotoMetricDistortion saturation must be a number in [0, 1]'),
    (dict(type='PhotoMetricDistortion', brightness=-0.2), 'PhotoMetricDistortion brightness must be a number >= 0'),
    (dict(type='PhotoMetricDistortion', prob='0.5'), "PhotoMetricDistortion prob must be a number in [0, 1], got '0.5'"),
])
def test_transform_settings_out_of_range_are_refused_when_the_dataset_is_built(tmp_path, transform, named):
    """A misspelt flip direction never flipped, a contrast or saturation above 1 drew negative
    factors that inverted the bands, a prob above 1 was silently 1: each is now one line when the
    training set is built, naming the transform."""
    from tests.unit.test_data import write_tif
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'img.tif', rng.integers(0, 255, (3, 64, 64), dtype=np.uint8))
    lbl = write_tif(tmp_path / 'lbl.tif', rng.integers(0, 3, (1, 64, 64), dtype=np.uint8))
    with pytest.raises(ConfigError, match=r'transforms\[0\] \(') as info:
        GeoTiffScenes([img], [lbl], classes=3, crop_size=32, transforms=[transform])
    assert named in str(info.value)


def test_a_transform_without_its_list_is_named():
    """transforms=dict(type='RandomFlip') was iterated as its keys: "transforms[0]: expected a
    dict with a 'type' key, got 'type'"."""
    from ds_seg.data.transforms import Compose
    with pytest.raises(ValueError, match=r"transforms must be a list of dicts, e.g. \[dict\(type='RandomFlip'\)\], "
                                         r"got \{'type': 'RandomFlip'\}"):
        Compose(dict(type='RandomFlip'))


@pytest.mark.parametrize('classes, named', [
    ('building', "classes='building' is a string, which would be 8 one-letter classes; give a tuple of names "
                 "(one name needs a trailing comma: ('building',))"),
    (('a', 'b', 'a'), "classes gives 'a' more than once"),
    (0, 'classes must be a tuple of names or a class count >= 1, got 0'),
    (True, 'classes must be a tuple of names or a class count >= 1, got True'),
])
def test_classes_that_are_not_a_list_of_distinct_names_are_refused(tmp_path, classes, named):
    """classes=('building') (no comma) became 8 one-letter classes, and a name given twice
    merged two classes' rows in eval.jsonl's per_class."""
    from tests.unit.test_data import write_tif
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'img.tif', rng.integers(0, 255, (3, 32, 32), dtype=np.uint8))
    lbl = write_tif(tmp_path / 'lbl.tif', np.zeros((1, 32, 32), dtype=np.uint8))
    with pytest.raises(ValueError) as info:
        GeoTiffScenes([img], [lbl], classes=classes, crop_size=32)
    assert named in str(info.value)


@pytest.mark.parametrize('option, named', [
    (dict(cat_max_ratio=75), 'cat_max_ratio must be None or a share in (0, 1] (e.g. 0.75, not 75), got 75'),
    (dict(cat_max_ratio=0), 'cat_max_ratio must be None or a share in (0, 1]'),
    (dict(max_nodata_ratio=50), 'max_nodata_ratio must be None or a share in [0, 1] (e.g. 0.75, not 75), got 50'),
    (dict(max_nodata_ratio=-0.1), 'max_nodata_ratio must be None or a share in [0, 1]'),
    (dict(max_retries=-1), 'max_retries must be an integer >= 0, got -1'),
    (dict(augment='false'), "augment must be True, False or None (on in random mode), got 'false'"),
])
def test_window_options_out_of_range_are_refused(tmp_path, option, named):
    """cat_max_ratio=75 or max_nodata_ratio=50 (percentages) never rejected a window, a ratio of
    0 rejected every one (each sample read 11 times), augment='false' augmented."""
    from tests.unit.test_data import write_tif
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'img.tif', rng.integers(0, 255, (3, 32, 32), dtype=np.uint8))
    lbl = write_tif(tmp_path / 'lbl.tif', rng.integers(0, 2, (1, 32, 32), dtype=np.uint8))
    with pytest.raises(ValueError) as info:
        GeoTiffScenes([img], [lbl], classes=2, crop_size=32, **option)
    assert named in str(info.value)
    for ok in (dict(cat_max_ratio=1.0, max_nodata_ratio=0.0, max_retries=0, augment=None), dict(augment=False)):
        GeoTiffScenes([img], [lbl], classes=2, crop_size=32, **ok)


def test_home_in_image_and_label_paths_is_expanded(tmp_path, monkeypatch):
    """images='~/scenes/*.tif' in a config matched nothing: no shell expands '~' there."""
    from tests.unit.test_data import write_tif
    monkeypatch.setenv('HOME', str(tmp_path))
    rng = np.random.default_rng(0)
    write_tif(tmp_path / 'img.tif', rng.integers(0, 255, (3, 32, 32), dtype=np.uint8))
    write_tif(tmp_path / 'lbl.tif', rng.integers(0, 2, (1, 32, 32), dtype=np.uint8))
    ds = GeoTiffScenes('~/img*.tif', ['~/lbl.tif'], classes=2, crop_size=32)
    assert [s['image'] for s in ds.scenes] == [str(tmp_path / 'img.tif')]


def test_random_scale_must_be_finite(tmp_path):
    """random_scale=(0.5, 1e999) passed the checks and crashed numpy's draw at the first step."""
    from ds_seg.data.transforms import check_random_scale
    with pytest.raises(ConfigError, match=r'data.random_scale must be None or \(low, high\)'):
        load_config(None, ['data.random_scale=(0.5, 1e999)'])
    with pytest.raises(ValueError, match='random_scale must be'):
        check_random_scale((0.5, float('inf')))
    assert check_random_scale((0.5, 2)) == (0.5, 2.0)


@pytest.mark.parametrize('scale', ['(100, 100)', '(0.01, 0.01)', '(0.05, 2.0)', '(0.5, 12)', '(2, 1)'])
def test_random_scale_of_windows_too_small_or_too_large_is_refused(scale):
    """(100, 100) trained on 1-pixel windows of a 64-pixel crop blown up to 64, (0.01, 0.01) on
    windows 100 times the crop (mostly padding); both exited 0."""
    with pytest.raises(ConfigError, match=r'data.random_scale must be None or \(low, high\) resize factors with '
                                          r'0.1 <= low <= high <= 10'):
        load_config(None, [f'data.random_scale={scale}'])
    load_config(None, ['data.random_scale=(0.1, 10)'])


@pytest.mark.parametrize('option, named', [('train.seed=99999999999999999999999', 'train.seed must be an integer in '
                                                                                  r'\[0, 2\*\*63 - 1\]'),
                                           ('data.prefetch_batches=1000000', r'data.prefetch_batches must be an '
                                                                             r'integer in \[0, 16\] or None')])
def test_a_seed_torch_cannot_take_and_a_prefetch_depth_that_fills_memory_are_refused(option, named):
    """A seed past 2**63 was torch's 'Overflow when unpacking long long' traceback; a million
    prefetched batches filled the machine's memory before the first step (SIGTERM held for a
    step that never came, only kill -9 ended it)."""
    with pytest.raises(ConfigError, match=named):
        load_config(None, [option])


# ------------------------------------------------------------------ benchmark layouts
def test_benchmark_trees_use_official_names_and_conventions(trees):
    p = Potsdam(trees['Potsdam'], split='train', crop_size=64)
    assert p.tiles == ['2_10', '2_11'] and p.num_classes == 6 and p.classes[-1] == 'clutter'
    assert [os.path.basename(s['image']) for s in p.scenes] == ['top_potsdam_2_10_RGB.tif', 'top_potsdam_2_11_RGB.tif']
    pv = Potsdam(trees['Potsdam'], split='val', crop_size=64)   # eroded: black boundaries ignored
    assert pv.scenes[0]['label'].endswith('top_potsdam_5_15_label_noBoundary.tif')
    full = Potsdam(trees['Potsdam'], split='val', crop_size=64, eroded=False)
    ignored = lambda ds: sum((ds[i]['label'] == IGNORE).sum().item() for i in range(len(ds)))  # noqa: E731
    assert ignored(pv) > ignored(full) + 100
    assert Potsdam(trees['Potsdam'], split='train', modality='RGBIR').in_channels == 4
    v = Vaihingen(trees['Vaihingen'], split='train', crop_size=64)
    assert v.areas == ['1', '3'] and all('/top/' in s['image'] for s in v.scenes)
    assert Vaihingen(trees['Vaihingen'], split='val').areas == ['2']
    lv = LoveDA(trees['LoveDA'], split='train', crop_size=96, mode='grid')
    assert len(LoveDA(trees['LoveDA'], split='train', domain='rural').scenes) == 2 and len(lv.scenes) == 4
    assert (lv[0]['label'][:12] == IGNORE).all() and lv.classes[0] == 'background'  # 0 = no-data
    inria_val = InriaAerial(trees['InriaAerial'], split='val')
    assert sorted(os.path.basename(s['image']) for s in inria_val.scenes) == ['austin1.tif', 'tyrol-w1.tif']
    assert len(InriaAerial(trees['InriaAerial'], split='train').scenes) == 4
    dg = DeepGlobeLandCover(trees['DeepGlobeLandCover'], split='train', crop_size=96, mode='grid')
    assert len(dg.scenes) == 4 and len(DeepGlobeLandCover(trees['DeepGlobeLandCover'], split='val').scenes) == 1
    lab = dg[0]['label'].numpy()
    assert (lab[-9:] == IGNORE).all() and set(np.unique(lab[:-10])) <= set(range(6))  # unknown ignored
    for cls in BENCHMARKS.values():
        assert cls.METRIC and 'Metric convention' in cls.__doc__


@pytest.mark.parametrize('name', list(BENCHMARKS) + ['ImageMaskFolder', 'GeoTiffScenes'])
def test_training_runs_on_each_layout(name, trees, tmp_path):
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import ds_config, read_jsonl
    root = trees.get(name)
    extra = {}
    if name == 'ImageMaskFolder':
        extra = dict(classes=6)
    if name == 'GeoTiffScenes':   # a user's own scenes, as in configs/unet_geotiff_scenes.py
        root = trees['InriaAerial'] + '/AerialImageDataset/train'
        train = dict(type='GeoTiffScenes', images=f'{root}/images/*.tif', labels=f'{root}/gt/*.tif',
                     classes=('background', 'building'), label_map={255: 1})
        val = dict(train, mode='grid')
    else:
        train = dict(type=name, data_root=root, split='train', **extra)
        val = dict(type=name, data_root=root, split='val', **extra)
    cls = {**BENCHMARKS, 'ImageMaskFolder': ImageMaskFolder, 'GeoTiffScenes': GeoTiffScenes}[name]
    num_classes = 2 if name in ('InriaAerial', 'GeoTiffScenes') else len(getattr(cls, 'CLASSES', range(6)))
    cfg = load_config(None, [f'model={dict(type="UNetTiny", in_channels=3, num_classes=num_classes)!r}',
                             f'data.train={train!r}', f'data.val={val!r}', 'data.crop_size=64',
                             'data.num_workers=0', 'data.random_scale=(0.5, 2.0)', 'train.max_steps=4',
                             'train.log_interval=1', 'train.eval_interval=4', 'train.checkpoint_interval=0',
                             'train.warmup_log_steps=0'])
    trainer = Trainer(cfg, ds_config(0, micro_batch=2), backend='ddp', work_dir=str(tmp_path / 'work'))
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary['exit_reason'] == 'completed' and summary['steps'] == 4
    rows = read_jsonl(tmp_path / 'work' / 'metrics.jsonl')
    assert len(rows) == 4 and all(np.isfinite(r['loss']) for r in rows)
    evals = read_jsonl(tmp_path / 'work' / 'eval.jsonl')
    assert evals and 0 <= evals[-1]['mIoU'] <= 1
    assert trainer.train_set.random_scale == (0.5, 2.0)


@pytest.mark.parametrize('config, name', [
    ('unet_potsdam', 'Potsdam'), ('unet_vaihingen', 'Vaihingen'), ('unet_loveda', 'LoveDA'),
    ('unet_deepglobe', 'DeepGlobeLandCover'), ('unet_inria', 'InriaAerial'), ('segformer_potsdam', 'Potsdam'),
    ('upernet_dinov2_potsdam', 'Potsdam')])
def test_the_shipped_benchmark_configs_train_with_their_recipe(config, name, trees):
    """configs/_base_/aerial_recipe.py sets data.train's cat_max_ratio 0.75 and photometric
    distortion without a type; the config inheriting it names the dataset. The section was
    replaced, not merged: every benchmark config trained without the recipe its comments promise."""
    from ds_seg.registry import DATASETS, build
    cfg = load_config(f'configs/{config}.py', [f'data.train.data_root={trees[name]!r}',
                                               f'data.val.data_root={trees[name]!r}'])
    assert cfg.data.train.type == name and cfg.data.train.cat_max_ratio == 0.75
    assert cfg.data.train.transforms == [{'type': 'PhotoMetricDistortion'}]
    train = build(DATASETS, dict(cfg.data.train, crop_size=64))
    assert train.cat_max_ratio == 0.75 and [type(t).__name__ for t in train.transforms.transforms] == [
        'PhotoMetricDistortion']


def _pairing(tmp_path, image_placement, label_placement, accepted):
    """A 40 x 40 image and label placed by ``rasterio.open`` keywords (transform, gcps, crs): the
    dataset pairs them when ``accepted``, else refuses them as misplaced."""
    common = dict(driver='GTiff', width=40, height=40, dtype='uint8')
    for name, count, placement in (('img.tif', 3, image_placement), ('lbl.tif', 1, label_placement)):
        with rasterio.open(tmp_path / name, 'w', count=count, **placement, **common) as d:
            d.write(np.ones((count, 40, 40), np.uint8) if count == 3 else np.zeros((1, 40, 40), np.uint8))
    build = lambda: GeoTiffScenes([str(tmp_path / 'img.tif')], [str(tmp_path / 'lbl.tif')], classes=2,  # noqa: E731
                                  crop_size=16, mean=[0] * 3, std=[1] * 3)
    if accepted:
        build()
    else:
        with pytest.raises(DataError, match='different geotransforms'):
            build()


@pytest.mark.parametrize('shift_px, accepted', [(3, False), (0.5, False), (0.001, True)])
def test_labels_off_by_pixels_are_refused_in_degrees_too(tmp_path, shift_px, accepted):
    """EPSG:4326 at 2.7e-6 degrees a pixel (0.3 m): a label 3 pixels east is 8e-6 degrees off,
    inside a fixed 1e-5 tolerance in map units. The check is in pixels, whatever the CRS;
    rounding noise far below a pixel still pairs."""
    from rasterio.transform import Affine
    px = 2.7e-6
    _pairing(tmp_path, dict(crs='EPSG:4326', transform=Affine(px, 0, 10.0, 0, -px, 47.0)),
             dict(crs='EPSG:4326', transform=Affine(px, 0, 10.0 + shift_px * px, 0, -px, 47.0)), accepted)


def _ground_control_points(east=0.0, centre_east=0.0):
    """The four corners of a 40 x 40 scene of 0.5 m pixels in UTM 32N, ``east`` metres east, and,
    given ``centre_east``, a fifth point at the centre that far off their plane."""
    from rasterio.control import GroundControlPoint as Point
    x, y = 500_000 + east, 5_000_000
    corners = [Point(0, 0, x, y), Point(0, 40, x + 20, y), Point(40, 0, x, y - 20), Point(40, 40, x + 20, y - 20)]
    return corners + ([Point(20, 20, x + 10 + centre_east, y - 10)] if centre_east else [])


@pytest.mark.parametrize('label_located_by, east, accepted', [('gcps', 0, True), ('gcps', 1000, False),
                                                              ('gcps', 0.25, False), ('gcps', 0.001, True),
                                                              ('transform', 0, True), ('transform', 1000, False),
                                                              ('transform', 0.25, False)])
def test_a_scene_located_by_ground_control_points_is_paired_by_where_they_put_it(tmp_path, label_located_by, east,
                                                                                   accepted):
    """A GCP-located scene has neither a geotransform nor a CRS of its own, so a label whose
    points put it 1 km away (or a label with its own geotransform elsewhere) trained and was
    scored without a word. Half a pixel (0.25 m) off, by points that fit exactly, passed a fixed
    one-pixel tolerance: the tolerance is the fits' residuals (none here)."""
    from rasterio.transform import Affine
    label = (dict(gcps=_ground_control_points(east), crs='EPSG:32632') if label_located_by == 'gcps'
             else dict(transform=Affine(0.5, 0, 500_000 + east, 0, -0.5, 5_000_000), crs='EPSG:32632'))
    _pairing(tmp_path, dict(gcps=_ground_control_points(), crs='EPSG:32632'), label, accepted)


def test_ground_control_points_that_are_not_exactly_affine_still_pair_with_their_grid(tmp_path):
    """Real GCP sets carry residuals: a fifth point half a pixel off the corners' plane moves the
    affine fit by about a tenth of a pixel, which the 0.01 px tolerance of geotransforms refused."""
    from rasterio.transform import Affine
    _pairing(tmp_path, dict(gcps=_ground_control_points(centre_east=0.25), crs='EPSG:32632'),
             dict(transform=Affine(0.5, 0, 500_000, 0, -0.5, 5_000_000), crs='EPSG:32632'), accepted=True)


def test_a_mask_band_counts_beside_a_nodata_value_and_a_data_band_tagged_alpha_is_refused(tmp_path):
    """GDAL gives an internal mask precedence over the nodata value: both mark invalid pixels
    here. A 4th band tagged alpha (a NIR band written as RGB + ALPHA=YES) selected as data
    would hide every pixel where it is 0: refused, with both ways out. Scenes of two pixel
    types in one dataset are refused (one mean/std, one cast)."""
    values = np.full((3, 40, 40), 100, np.uint8)
    values[:, :, 30:] = 0  # nodata, right
    common = dict(driver='GTiff', width=40, height=40, crs='EPSG:32632',
                  transform=from_origin(500_000, 5_500_000, 0.1, 0.1))
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True):
        with rasterio.open(tmp_path / 'img.tif', 'w', count=3, dtype='uint8', nodata=0, **common) as d:
            d.write(values)
            mask = np.full((40, 40), 255, np.uint8)
            mask[:, :10] = 0  # masked, left
            d.write_mask(mask)
    label = write_tif(tmp_path / 'lbl.tif', np.ones((40, 40), np.uint8))
    ds = GeoTiffScenes([str(tmp_path / 'img.tif')], [label], classes=2, crop_size=40, mode='grid',
                       mean=[0] * 3, std=[1] * 3)
    invalid = ds[0]['nodata'].numpy()
    assert invalid[:, :10].all() and invalid[:, 30:].all() and not invalid[:, 10:30].any()

    with rasterio.open(tmp_path / 'rgbn.tif', 'w', count=4, dtype='uint8', photometric='RGB', alpha='YES',
                       **common) as d:
        d.write(np.full((4, 40, 40), 50, np.uint8))
    with pytest.raises(DataError, match=r'rgbn.tif: band 4 is tagged as alpha.*gdal_edit.py -colorinterp_4 undefined'
                                        r'.* \(or rio edit-info --colorinterp red,green,blue,undefined .*rgbn.tif\)'):
        GeoTiffScenes([str(tmp_path / 'rgbn.tif')], [label], classes=2, crop_size=40, mean=[0] * 4, std=[1] * 4)
    GeoTiffScenes([str(tmp_path / 'rgbn.tif')], [label], classes=2, crop_size=40, bands=[1, 2, 3],
                  mean=[0] * 3, std=[1] * 3)  # the alpha band left out: its mask applies, as it should
    # The rio command the line gives (a pip-installed rasterio has no gdal_edit.py) untags it.
    import shutil
    import subprocess
    import sys
    rio = shutil.which('rio') or os.path.join(os.path.dirname(sys.executable), 'rio')
    subprocess.run([rio, 'edit-info', '--colorinterp', 'red,green,blue,undefined', str(tmp_path / 'rgbn.tif')],
                   check=True)
    GeoTiffScenes([str(tmp_path / 'rgbn.tif')], [label], classes=2, crop_size=40, mean=[0] * 4, std=[1] * 4)

    wide = write_tif(tmp_path / 'wide.tif', np.full((3, 40, 40), 1000, np.uint16))
    with pytest.raises(DataError, match=r'wide.tif holds uint16 pixels but .*img.tif uint8'):
        GeoTiffScenes([str(tmp_path / 'img.tif'), wide], [label, label], classes=2, crop_size=40,
                      mean=[0] * 3, std=[1] * 3)


@pytest.mark.parametrize('dtype, nodata', [('float32', -9999.0), ('float32', float('nan')), ('int16', -1),
                                           ('uint16', 65535)])
def test_a_label_files_nodata_value_is_unlabelled_in_training_and_evaluation(tmp_path, dtype, nodata):
    """Labels exported from a GIS carry a nodata value no class has (-9999, NaN, -1): those pixels
    are ignore_index, in training and in evaluation of the pair, not 'a value that is no class'
    with a label_map hint that cannot work (label_map keys are 0..65535)."""
    from ds_seg.inference.evaluate import _label_source
    from rasterio.windows import Window
    values = np.tile(np.array([0, 1, 2, 0], np.float64), (16, 4))
    values[:8, :8] = nodata
    label = str(tmp_path / 'lbl.tif')
    with rasterio.open(label, 'w', driver='GTiff', width=16, height=16, count=1, dtype=dtype, nodata=nodata,
                       crs='EPSG:32632', transform=from_origin(500_000, 5_500_000, 0.1, 0.1)) as d:
        d.write(values.astype(dtype)[None])
    img = write_tif(tmp_path / 'img.tif', np.ones((3, 16, 16), np.uint8))
    ds = GeoTiffScenes([img], [label], classes=3, crop_size=16, mode='grid', mean=[0] * 3, std=[1] * 3)
    expected = values.copy()
    expected[:8, :8] = IGNORE
    np.testing.assert_array_equal(ds[0]['label'].numpy(), expected)
    with _label_source(None, 0, label, IGNORE, 3) as read:
        np.testing.assert_array_equal(read(Window(0, 0, 16, 16)), expected)


@pytest.mark.parametrize('val_modality', ['RGB', 'IRRG'])
def test_a_validation_product_of_other_bands_than_training_is_refused(val_modality, trees, tmp_path):
    """ISPRS IRRG files are tagged red, green, blue like the RGB ones, so their tags cannot tell
    them apart: data.train IRRG beside data.val RGB scored near-random mIoU without a word.
    The products' band contents refuse it before the work dir is written."""
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import ds_config
    root = trees['Potsdam']
    train = dict(type='Potsdam', data_root=root, split='train', modality='IRRG')
    val = dict(type='Potsdam', data_root=root, split='val', modality=val_modality)
    cfg = load_config(None, ['model=' + repr(dict(type='UNetTiny', in_channels=3, num_classes=6)),
                             f'data.train={train!r}', f'data.val={val!r}', 'data.crop_size=64',
                             'data.num_workers=0', 'train.max_steps=1', 'train.eval_interval=1',
                             'train.checkpoint_interval=0', 'train.warmup_log_steps=0'])
    work = tmp_path / 'work'
    if val_modality == 'RGB':
        with pytest.raises(ConfigError, match=r"data.val's bands \[1, 2, 3\] hold red, green, blue \(Potsdam "
                                              r"modality RGB\), but data.train's hold nir, red, green"):
            Trainer(cfg, ds_config(0, micro_batch=2), backend='ddp', work_dir=str(work))
        assert not work.exists()
        return
    trainer = Trainer(cfg, ds_config(0, micro_batch=2), backend='ddp', work_dir=str(work))
    try:
        assert trainer.fit()['exit_reason'] == 'completed'
    finally:
        trainer.close()


@pytest.mark.parametrize('name, key', [('Potsdam', 'images'), ('Vaihingen', 'labels'), ('LoveDA', 'classes'),
                                       ('InriaAerial', 'label_map'), ('DeepGlobeLandCover', 'palette')])
def test_a_key_a_benchmark_sets_itself_is_one_line_naming_data_root(name, key, trees):
    """--cfg-options data.val.images=... (what evaluate's own hint said) on a benchmark type was
    "cannot be built ...: got multiple values for argument 'images'": the adapter passes its
    images, labels and classes itself. The line names data_root and GeoTiffScenes instead."""
    from ds_seg.registry import DATASETS, RegistryError, arguments, build
    cls = BENCHMARKS[name]
    assert key not in arguments(cls) and 'data_root' in arguments(cls) and 'bands' in arguments(cls)
    with pytest.raises(RegistryError, match=rf"data.val.{key}: {name} sets its {key} itself \(from data_root and its "
                                          rf"layout\); set data.val.data_root instead, or, for files of your own, "
                                          r"type='GeoTiffScenes' with images and labels.$"):
        build(DATASETS, dict(type=name, data_root=trees[name], split='val', **{key: None}), where='data.val')


def test_labels_covering_a_small_share_of_the_scenes_are_said_with_what_to_do(tmp_path):
    """An annotated area inside a large orthomosaic (the rest ignore_index): uniform random windows
    mostly held no labelled pixel, and their steps trained at loss 0 without a word."""
    labels = np.full((128, 128), 255, np.uint8)
    labels[:24, :24] = 1          # 3.5 % labelled
    labels[:12, :12] = 0
    img, lbl = _pair(tmp_path, labels=labels, size=(128, 128))
    sparse = GeoTiffScenes([img], [lbl], classes=2, crop_size=16)
    said = [n for n in sparse.notes if n.startswith('only 3.5% of the label files')]
    assert said and said[0].endswith("sampling='rare_class' draws every window around a labelled pixel, or crop the "
                                     "scenes to the annotated area")
    assert not any('label files' in n for n in GeoTiffScenes([img], [lbl], classes=2, crop_size=16,
                                                             sampling='rare_class').notes)
    assert not any('label files' in n for n in GeoTiffScenes([img], [lbl], classes=2, crop_size=16,
                                                             mode='grid').notes)   # evaluation reads every window
    labels[:64] = 1               # half labelled: no note
    sub = tmp_path / 'dense'
    sub.mkdir()
    img, lbl = _pair(sub, labels=labels, size=(128, 128))
    assert not any('label files' in n for n in GeoTiffScenes([img], [lbl], classes=2, crop_size=16).notes)
