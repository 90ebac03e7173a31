"""The three measuring commands that live in ds_seg/cli/ (data_benchmark, vector_benchmark,
predict_benchmark) run end to end on tiny inputs, their child processes included, and print
figures that parse and are positive."""
import contextlib
import json
import re
import subprocess

import pytest

from ds_seg.cli import data_benchmark, predict_benchmark, vector_benchmark

NUMBER = r'([0-9]+(?:\.[0-9]+)?)'


def test_data_benchmark_prints_rates_and_a_training_run(tmp_path, capsys):
    out = tmp_path / 'figures.json'
    # --train-steps 4: a real `python -m ds_seg.cli.train` child, the only way data_wait_frac is measured
    assert data_benchmark.main(['--scene-size', '256', '--num-scenes', '1', '--crop', '64', '--windows', '20',
                                '--repeats', '1', '--workers', '1', '--micro-batch', '2', '--train-steps', '4',
                                '--compress', 'none', '--cache-dir', str(tmp_path / 'scenes'), '--http',
                                '--out', str(out)]) == 0
    text = capsys.readouterr().out
    figures = json.loads(out.read_text())
    for variant in ('none',):
        raw = float(re.search(rf'\[\s*{variant}\] raw rasterio loop :\s+{NUMBER} windows/s', text).group(1))
        mine = float(re.search(rf'\[\s*{variant}\] dataset, 1 worker :\s+{NUMBER} windows/s', text).group(1))
        ratio = float(re.search(rf'\[\s*{variant}\] ratio dataset/raw :\s+{NUMBER}x', text).group(1))
        assert raw > 0 and mine > 0 and ratio > 0
        assert round(figures['variants'][variant]['raw_windows_per_s'], 1) == raw  # --out holds what is printed
        # --http: the same windows from a Range-honouring server on 127.0.0.1, and the bytes they cost
        http = re.search(rf'\[\s*{variant}\] dataset over HTTP :\s+{NUMBER} windows/s .* {NUMBER} KiB fetched per '
                         rf'window, files {NUMBER} MiB', text)
        assert http and float(http.group(1)) > 0 and float(http.group(2)) > 0, text
        v = figures['variants'][variant]
        assert v['http_windows_per_s'] > 0 and 0 < v['http_bytes_per_window'] < v['files_bytes']
    assert float(re.search(rf'device step on cpu\s+:\s+{NUMBER} windows/s', text).group(1)) > 0
    assert float(re.search(rf'loader, 1 workers\s+:\s+{NUMBER} windows/s total', text).group(1)) > 0
    wait = re.search(rf'training, 4 steps\s+: data wait {NUMBER}% of step time \(median step {NUMBER} s', text)
    assert wait, text  # 'training run : failed' when the child did not start
    assert 0 <= float(wait.group(1)) <= 100 and float(wait.group(2)) > 0
    assert 0 <= figures['data_wait_frac'] <= 1 and figures['step_time_s'] > 0
    # At --micro-batch, as the run recorded it (it trained zero2.json's 8).
    assert re.search(r'training, 4 steps .*; UNet, micro-batch 2, 1 worker\(s\)\)', text), text
    assert (figures['micro_batch'], figures['model']) == (2, 'UNet')


def test_data_benchmark_copies_striped_scenes_of_one_name_each_apart_and_leaves_no_file(tmp_path, capsys):
    """Compressed copies took a scene's block shape as their tile size: a striped scene (blocks of
    1 x 700) failed with "Bad value 700 for TileWidth" and left a .tmp in the data folder. They were
    named by file name alone, in the first scene's folder, and never rewritten: d2/x.tif was
    measured as d1/x.tif's copy. Now each scene is copied, tiled, into a temporary folder."""
    import numpy as np
    import rasterio
    from rasterio.transform import from_origin
    paths = {}
    for i, folder in enumerate(('d1', 'd2')):
        (tmp_path / folder).mkdir()
        rng = np.random.default_rng(i)
        for kind, count, dtype, high in (('image', 3, 'uint16', 4000), ('label', 1, 'uint8', 3)):
            path = str(tmp_path / folder / f'x_{kind}.tif')  # the same names in both folders
            with rasterio.open(path, 'w', driver='GTiff', width=150, height=120, count=count, dtype=dtype,
                               crs='EPSG:32633', transform=from_origin(500000, 5000000, 0.5, 0.5)) as dst:
                dst.write(rng.integers(0, high, (count, 120, 150)).astype(dtype))  # striped: not tiled
                assert dst.block_shapes[0] != (256, 256)
            paths.setdefault(kind, []).append(path)
    config = tmp_path / 'two.py'
    config.write_text(f"data = dict(train=dict(type='GeoTiffScenes', images={paths['image']!r}, "
                      f"labels={paths['label']!r}, classes=('a', 'b', 'c')))\n")
    ds, _ = data_benchmark.build_dataset(data_benchmark.parse_args(['--config', str(config), '--crop', '64']))
    before = sorted(str(p) for p in tmp_path.rglob('*'))  # with the dataset's own caches of statistics
    assert data_benchmark.main(['--config', str(config), '--crop', '64', '--windows', '5', '--repeats', '1',
                                '--workers', '0', '--train-steps', '0', '--compress', 'none', 'deflate']) == 0
    assert re.search(rf'\[deflate\] ratio dataset/raw :\s+{NUMBER}x', capsys.readouterr().out)
    assert sorted(str(p) for p in tmp_path.rglob('*')) == before
    copies = tmp_path / 'copies'
    copies.mkdir()
    copied = data_benchmark.compressed_copy(ds, 'deflate', str(copies))
    for scene, copy in zip(ds.scenes, copied.scenes):
        for key in ('image', 'label'):
            with rasterio.open(scene[key]) as a, rasterio.open(copy[key]) as b:
                assert np.array_equal(a.read(), b.read()) and b.profile['tiled'], (scene[key], copy[key])


def test_vector_benchmark_measures_a_child_without_torch(tmp_path, capsys):
    assert vector_benchmark.main(['--size', '400', '--band-rows', '64', '--dir', str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    m = re.search(rf': {NUMBER} polygons in {NUMBER} s, peak RSS {NUMBER} MiB '
                  rf'\(Python \+ libraries before the run: {NUMBER} MiB\)', line)
    assert m, line
    polygons, _, peak, baseline = (float(v) for v in m.groups())
    assert polygons > 0 and peak >= baseline > 0
    # The measured process itself: the vectoriser module alone, not the package, so torch
    # (hundreds of MiB, and in this pytest process already) is not in its peak.
    cmd = vector_benchmark.child_command(str(tmp_path / 'classes_400.tif'), str(tmp_path / 'again.gpkg'), 64, 0.0)
    child = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    assert child['torch_imported'] is False
    assert child['features'] == polygons and child['seconds'] > 0 and child['out_mb'] > 0
    # The peak is the child's own: the same figure from this pytest process (torch loaded) as
    # from the benchmark's parent; ru_maxrss would report this process's peak instead.
    assert child['baseline_mb'] < 0.5 * vector_benchmark.peak_rss_mb()


def test_predict_benchmark_reports_a_georeferenced_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv('DS_SEG_CACHE', str(tmp_path))  # where the scene is written; the child inherits it
    # This process's peak, 1 GiB above anything predict.py needs here: ru_maxrss of the child
    # (RUSAGE_CHILDREN) reported it, carried across the fork and exec, as predict's own.
    ballast = bytearray(2 ** 30)
    ballast[::4096] = b'\1' * (2 ** 30 // 4096)
    assert predict_benchmark.main(['--size', '512', '--tile', '256', '--overlap', '32', '--model', 'BenchPixelNet',
                                   '--threads', '1']) == 0
    del ballast
    out = capsys.readouterr().out
    summary = json.loads(out.splitlines()[-1].removeprefix('[benchmark] '))
    assert summary['georeferenced_like_input'] is True
    assert summary['windows'] == 9  # 512 px in 256 px tiles overlapping by 32: 3 x 3
    for key in ('wall_s', 'windows_per_s', 'megapixels_per_s', 'peak_rss_mb'):
        assert summary[key] > 0, key
    assert summary['peak_rss_mb'] < vector_benchmark.peak_rss_mb() - 2 ** 10 + 100, summary
    # The rates are predict's own: the child's start-up (torch's import) was in them. And from its
    # rate, not its seconds printed to 0.1 s ("0.0 s" fell back to the child's whole wall time).
    assert 0 < summary['predict_s'] < summary['wall_s']
    said = float(re.search(r'9 windows in [\d.]+ s \(([\d.]+) windows/s\)', out)[1])
    assert abs(summary['windows_per_s'] - said) <= 0.011 * max(1.0, said / 100), (summary, said)


@pytest.mark.parametrize('argv, message', [
    (['--crop', '0'], '--crop must be at least 16, got 0'),
    (['--workers', '-1'], '--workers must be at least 0, got -1'),
    (['--compress', 'BOGUS'], "invalid choice: 'BOGUS'"),
    (['--cfg-options', 'data.crop_size=2'], '--cfg-options needs --config'),
    # Overwritten without a word, or a FileNotFoundError traceback after the whole benchmark.
    (['--out', __file__], 'already exists; give a new file name'),
    (['--out', '/nonexistent_folder/x.json'], 'the folder /nonexistent_folder does not exist; create it first'),
    # Measured nothing comparable: a padded 1024 crop against a 128 px raw read; a delay for no server.
    (['--crop', '1024'], '--crop 1024 is larger than the --scene-size 128 scenes'),
    (['--latency-ms', '5'], '--latency-ms 5 delays the --http reads, which are not asked for'),
    # Every step warm-up: "training run: failed (see above)", with nothing above and nothing failed.
    (['--train-steps', '2'], "--train-steps 2: the training run's first 2 steps are warm-up, not timed"),
])
def test_data_benchmark_refuses_what_it_would_drop_or_crash_on(argv, message, capsys):
    from tests.tiny import argparse_refusal
    code, err = argparse_refusal(data_benchmark.main, ['--train-steps', '0', '--scene-size', '128', '--num-scenes', '1',
                                                       *argv], capsys)
    assert code == 2 and message in err and 'Traceback' not in err, err
    assert len(err.strip().splitlines()) == 1, err  # not argparse's usage block first


@pytest.mark.parametrize('program, argv, message', [
    # numpy's "can't extend empty axis", or the child's refusal and then a CalledProcessError traceback
    ('predict', ['--size', '0'], '--size must be at least 16, got 0'),
    ('predict', ['--tile', '0'], '--tile must be at least 16, got 0'),
    ('predict', ['--batch-size', '0'], '--batch-size must be at least 1, got 0'),
    ('predict', ['--threads', '0'], '--threads must be at least 1, got 0'),
    ('predict', ['--tile', '64', '--overlap', '64'], '--overlap must be >= 0 and smaller than --tile (64), got 64'),
    ('predict', ['--model', 'Nope'], "--model: 'Nope' is not a registered model"),
    # options the benchmark gives predict itself: --output was a rasterio traceback at the end
    ('predict', ['--extra', '--output', '/tmp/x'], "--extra: --output sets predict's --output, which the benchmark "
                                                   "sets to a folder of its own; leave it out of --extra"),
    ('predict', ['--extra', '--out=/tmp/x'], "--extra: --out=/tmp/x sets predict's --output"),
    ('predict', ['--extra', '--tile', '64'], "sets predict's --tile, which the benchmark sets to its --tile"),
    ('vector', ['--size', '0'], '--size must be at least 16 (got 0)'),
    ('vector', ['--band-rows', '-3'], '--band-rows must be at least 1 (got -3)'),   # was accepted
    ('vector', ['--simplify', '-1'], '--simplify must be a finite number >= 0 (got -1)'),
    ('vector', ['--simplify', 'nan'], '--simplify must be a finite number >= 0 (got nan)'),   # was a traceback
    ('vector', ['--simplify', 'inf'], '--simplify must be a finite number >= 0 (got inf)'),
])
def test_the_measuring_commands_refuse_bad_values_in_one_line_before_any_work(tmp_path, capsys, monkeypatch,
                                                                             program, argv, message):
    monkeypatch.setenv('DS_SEG_CACHE', str(tmp_path / 'cache'))
    main = predict_benchmark.main if program == 'predict' else vector_benchmark.main
    extra = [] if program == 'predict' else ['--dir', str(tmp_path / 'vb')]
    with pytest.raises(SystemExit) as exited:
        main(argv + extra)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and 'Traceback' not in err, err
    assert len(err.strip().splitlines()) == 1, err  # not argparse's usage block first
    assert not (tmp_path / 'cache').exists() and not (tmp_path / 'vb').exists()
    if program == 'vector':   # only what is wrong is named (a right --size was quoted as refused)
        assert err.count('must be') == 1 and ('--size' in err) == (argv[0] == '--size'), err


def test_predict_benchmark_takes_a_small_tile_with_its_default_overlap(tmp_path, capsys, monkeypatch):
    """The fixed default overlap of 64 was refused by predict for any tile of 64 or less."""
    monkeypatch.setenv('DS_SEG_CACHE', str(tmp_path / 'cache'))
    assert predict_benchmark.main(['--size', '128', '--tile', '64', '--model', 'BenchPixelNet']) == 0
    assert '"overlap": 8' in capsys.readouterr().out


@pytest.mark.parametrize('name', ['polygons_64.gpkg', 'classes_64.tif'])
def test_vector_benchmark_neither_deletes_nor_reads_a_users_file_of_its_names(tmp_path, capsys, name):
    # A user's polygons_64.gpkg was deleted and overwritten; a user's classes_64.tif (an RGB image)
    # was vectorised, a traceback.
    mine = tmp_path / name
    mine.write_bytes(b'my own survey')
    with pytest.raises(SystemExit) as exited:
        vector_benchmark.main(['--size', '64', '--dir', str(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f'--dir: {mine} is not a' in err and 'Traceback' not in err, err
    assert mine.read_bytes() == b'my own survey'


def test_vector_benchmark_reruns_over_its_own_files(tmp_path, capsys):
    for _ in range(2):  # the second run reuses its class map and replaces its polygons
        assert vector_benchmark.main(['--size', '64', '--band-rows', '16', '--dir', str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count('wrote') == 1 and out.count('polygons in') == 2, out


def test_vector_benchmark_takes_the_files_of_its_version_before_the_tag(tmp_path, capsys):
    # Class maps and polygons an earlier version wrote (no tag, no record) were refused as "not
    # written by this benchmark".
    import rasterio
    assert vector_benchmark.main(['--size', '64', '--band-rows', '16', '--dir', str(tmp_path)]) == 0
    (tmp_path / '.ds_seg_vector_benchmark.json').unlink()
    class_map = tmp_path / 'classes_64.tif'
    with rasterio.open(class_map) as src:
        pixels, profile = src.read(), src.profile
    with rasterio.open(class_map, 'w', **profile) as dst:  # as the old version wrote it: the classes tag only
        dst.write(pixels)
        dst.update_tags(classes=json.dumps(vector_benchmark.CLASSES))
    assert vector_benchmark.main(['--size', '64', '--band-rows', '16', '--dir', str(tmp_path)]) == 0
    assert capsys.readouterr().out.count('polygons in') == 2


def test_data_benchmark_reads_and_copies_every_date_and_refuses_vector_labels(tmp_path, capsys, monkeypatch):
    """A time series: the raw reference read each scene's first date only (the dataset looked half
    as fast as the reads it makes), the deflate copies kept the first date (a ValueError traceback).
    Vector labels: rasterio.open(x.gpkg), a traceback."""
    import numpy as np
    import rasterio
    from rasterio.transform import from_origin
    rng = np.random.default_rng(0)
    kw = dict(driver='GTiff', width=96, height=96, crs='EPSG:32633', transform=from_origin(500000, 5000000, 1, 1))
    images = []
    for i in range(2):
        dates = []
        for t in range(2):
            path = str(tmp_path / f's{i}_t{t}.tif')
            with rasterio.open(path, 'w', count=3, dtype='uint8', **kw) as dst:
                dst.write(rng.integers(0, 255, (3, 96, 96)).astype('uint8'))
            dates.append(path)
        images.append(dates)
    labels = []
    for i in range(2):
        labels.append(str(tmp_path / f's{i}_label.tif'))
        with rasterio.open(labels[-1], 'w', count=1, dtype='uint8', **kw) as dst:
            dst.write(rng.integers(0, 3, (1, 96, 96)).astype('uint8'))
    config = tmp_path / 'series.py'
    config.write_text(f"data = dict(train=dict(type='GeoTiffScenes', images={images!r}, labels={labels!r}, "
                      "classes=('a', 'b', 'c')))\n")
    reads = []
    real_read = rasterio.io.DatasetReader.read
    monkeypatch.setattr(rasterio.io.DatasetReader, 'read', lambda self, *a, **k: reads.append(self.name) or
                        real_read(self, *a, **k))
    ds, _ = data_benchmark.build_dataset(data_benchmark.parse_args(['--config', str(config), '--crop', '32']))
    with contextlib.ExitStack() as stack:
        handles = {p: stack.enter_context(rasterio.open(p)) for s in ds.scenes for p in (*s['dates'], s['label'])}
        reads.clear()
        data_benchmark.raw_loop(ds.scenes, ds.bands, 1, 32, 10, 0, handles)
    assert len(reads) == 30 and sum('_t1' in r for r in reads) == 10, reads   # both dates and the label
    monkeypatch.undo()
    assert data_benchmark.main(['--config', str(config), '--crop', '32', '--windows', '5', '--repeats', '1',
                                '--workers', '0', '--train-steps', '0', '--compress', 'none', 'deflate']) == 0
    assert re.search(rf'\[deflate\] ratio dataset/raw :\s+{NUMBER}x', capsys.readouterr().out)
    copies = tmp_path / 'copies'
    copies.mkdir()
    copied = data_benchmark.compressed_copy(ds, 'deflate', str(copies))
    assert copied.num_dates == 2 and [len(s['dates']) for s in copied.scenes] == [2, 2]
    for scene, copy in zip(ds.scenes, copied.scenes):
        for a_path, b_path in zip(scene['dates'], copy['dates']):
            with rasterio.open(a_path) as a, rasterio.open(b_path) as b:
                assert np.array_equal(a.read(), b.read())

    import pyogrio
    import shapely
    gpkg = str(tmp_path / 'labels.gpkg')
    pyogrio.raw.write(gpkg, shapely.to_wkb(np.array([shapely.box(500010, 4999950, 500050, 4999990)], dtype=object)),
                      field_data=[np.array([1], np.int32)], fields=['class'], crs='EPSG:32633', driver='GPKG',
                      geometry_type='Polygon')
    vector = tmp_path / 'vector.py'
    vector.write_text(f"data = dict(train=dict(type='GeoTiffScenes', images={[d[0] for d in images]!r}, "
                      f"labels=[{gpkg!r}], label_field='class', classes=('a', 'b', 'c')))\n")
    assert data_benchmark.main(['--config', str(vector), '--crop', '32', '--train-steps', '0']) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'data_benchmark: error: {gpkg}: vector labels, which the raw rasterio reference cannot '
                          'read') and len(err.strip().splitlines()) == 1, err
