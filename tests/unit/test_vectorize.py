"""Polygon output: class map GeoTIFF -> GeoPackage/GeoJSON/FlatGeobuf, polygonised by row bands."""
import json

import cv2
import numpy as np
import pyogrio
import pyogrio.raw
import pytest
import rasterio
from rasterio.enums import ColorInterp
import shapely
from rasterio.features import rasterize
from rasterio.transform import from_origin

from ds_seg.vectorize import vectorize_class_map
from tests.distributed.test_inference import exported  # noqa: F401  (a pytest fixture)

CLASSES = ['background', 'building', 'road', 'tree']
PIXEL = 0.5  # metres


def _class_map(h=150, w=130, seed=0):
    """Blobs of 4 classes with holes, one snake spanning every band, and nodata."""
    rng = np.random.default_rng(seed)
    noise = cv2.GaussianBlur(rng.random((h, w)).astype(np.float32), (0, 0), 4)
    q = np.quantile(noise, [0.3, 0.55, 0.8])
    cls = np.digitize(noise, q).astype(np.uint8)
    cls[:, 60:63] = 2                    # a vertical road through every band
    cls[40:80, 90:120] = 1               # a building ring around a tree hole crossing a band edge
    cls[50:70, 100:110] = 3
    cls[0:5, 0:40] = 255                 # nodata
    return cls


def _write(path, arr, classes=CLASSES, crs='EPSG:32632'):
    profile = dict(driver='GTiff', height=arr.shape[-2], width=arr.shape[-1], count=1 if arr.ndim == 2 else arr.shape[0],
                   dtype='uint8', crs=crs, transform=from_origin(500000.0, 5700000.0, PIXEL, PIXEL), nodata=255)
    with rasterio.open(path, 'w', **profile) as dst:
        dst.write(arr, 1) if arr.ndim == 2 else dst.write(arr)
        dst.update_tags(classes=json.dumps(classes))
    return path


def _components(cls):
    """(class, pixel count, mask) of every 4-connected region of one class, nodata excluded."""
    out = []
    for c in np.unique(cls[cls != 255]):
        k, lab = cv2.connectedComponents((cls == c).astype(np.uint8), connectivity=4)
        for i in range(1, k):
            out.append((int(c), lab == i))
    return out


@pytest.mark.parametrize('ext', ['gpkg', 'fgb', 'geojson'])
def test_polygons_rasterise_back_to_the_class_map_across_bands(tmp_path, ext):
    cls = _class_map()
    src = _write(tmp_path / 'a_classes.tif', cls)
    out = tmp_path / f'a.{ext}'
    info = vectorize_class_map(src, str(out), band_rows=16)  # 150 rows: 10 bands
    _, _, geometry, fields = pyogrio.raw.read(out)
    meta = pyogrio.read_info(out)
    geoms = shapely.from_wkb(geometry)
    class_id, names, area = fields[0], fields[1], fields[2]
    with rasterio.open(src) as s:
        transform, crs = s.transform, s.crs
    assert rasterio.crs.CRS.from_user_input(meta['crs']) == crs
    back = rasterize(zip(geoms, class_id.tolist()), out_shape=cls.shape, transform=transform,
                     fill=255, dtype='uint8')
    np.testing.assert_array_equal(back, cls)
    # None is split at a band edge: one polygon per connected region of the whole map.
    regions = _components(cls)
    assert info['features'] == len(geoms) == len(regions)
    assert all(isinstance(g, shapely.Polygon) for g in geoms)
    assert any(len(g.interiors) for g in geoms)  # the building ring keeps its hole
    assert sorted(np.round(area, 6)) == sorted(round(m.sum() * PIXEL * PIXEL, 6) for _, m in regions)
    np.testing.assert_allclose(area, shapely.area(geoms))  # exact before simplification
    assert [CLASSES[c] for c in class_id] == list(names)


@pytest.mark.parametrize('ext', ['gpkg', 'fgb', 'geojson'])
@pytest.mark.parametrize('empty', [False, True])
def test_the_layer_is_named_after_the_file_not_its_temporary_name(tmp_path, ext, empty):
    """a_classes.gpkg holds layer 'a_classes' (was 'a_classes.partial', the name the file is
    written under until complete: read_file(path, layer='a_classes') failed), also when every
    class is excluded and the layer is empty."""
    src = _write(tmp_path / 'a_classes.tif', _class_map(40, 40))
    out = tmp_path / f'a_classes.{ext}'
    vectorize_class_map(src, str(out), exclude=CLASSES if empty else ())
    assert [name for name, _ in pyogrio.list_layers(out)] == ['a_classes']
    if ext == 'geojson':
        assert json.loads(out.read_text())['name'] == 'a_classes'


def test_mean_probability_min_area_exclude_and_simplify(tmp_path):
    cls = _class_map(seed=1)
    rng = np.random.default_rng(2)
    probs = rng.integers(0, 251, (len(CLASSES),) + cls.shape).astype(np.uint8)
    src = _write(tmp_path / 'b_classes.tif', cls)
    psrc = _write(tmp_path / 'b_probs.tif', probs)
    out = tmp_path / 'b.gpkg'
    vectorize_class_map(src, str(out), probs_path=psrc, band_rows=16, min_area=5.0,
                        exclude=['background'])
    _, _, geometry, (class_id, _, area, mean_prob) = pyogrio.raw.read(out)
    geoms = shapely.from_wkb(geometry)
    expected = {}
    for c, m in _components(cls):
        if c == 0 or m.sum() * PIXEL * PIXEL < 5.0:
            continue
        key = round(m.sum() * PIXEL * PIXEL, 6), c
        expected.setdefault(key, []).append(round(float(probs[c][m].mean()) / 250, 5))
    got = {}
    for c, a, p in zip(class_id.tolist(), area.tolist(), mean_prob.tolist()):
        got.setdefault((round(a, 6), c), []).append(round(p, 5))
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in expected.items()}
    assert 0 not in class_id.tolist() and len(geoms) == sum(map(len, expected.values()))

    simple = tmp_path / 'b_simple.gpkg'
    vectorize_class_map(src, str(simple), band_rows=16, simplify=2 * PIXEL)
    exact = tmp_path / 'b_exact.gpkg'
    vectorize_class_map(src, str(exact), band_rows=16)
    n_simple = shapely.get_num_coordinates(shapely.from_wkb(pyogrio.raw.read(simple)[2])).sum()
    n_exact = shapely.get_num_coordinates(shapely.from_wkb(pyogrio.raw.read(exact)[2])).sum()
    assert n_simple < 0.8 * n_exact


def test_a_tolerance_of_many_pixels_is_said_in_the_map_units(tmp_path):
    """--simplify is in map units: 0.5 meant for metres is 55 km in a scene in degrees, and the
    polygons of a scene 0.0003 degrees across lost their shape without a word."""
    src = _write(tmp_path / 'm.tif', _class_map(60, 60))
    assert vectorize_class_map(src, str(tmp_path / 'a.gpkg'), simplify=2 * PIXEL)['notes'] == []
    assert vectorize_class_map(src, str(tmp_path / 'b.gpkg'), simplify=50.0)['notes'] == [
        "simplify 50 is in the class map's metres: 100 of its pixels (0.5 metres each), so the polygons keep little "
        "of their shape; a tolerance of a pixel or two is 0.5-1"]
    geographic = tmp_path / 'g.tif'
    with rasterio.open(src) as s, rasterio.open(geographic, 'w', **dict(
            s.profile, crs='EPSG:4326', transform=from_origin(7.0, 50.0, 1e-5, 1e-5))) as d:
        d.write(s.read())
        d.update_tags(**s.tags())
    notes = vectorize_class_map(str(geographic), str(tmp_path / 'g.gpkg'), simplify=0.5)['notes']
    assert len(notes) == 1 and notes[0].startswith("simplify 0.5 is in the class map's degrees: 50,000 of its pixels")


def test_existing_output_and_unknown_names_are_refused(tmp_path):
    src = _write(tmp_path / 'c_classes.tif', _class_map(40, 40))
    out = tmp_path / 'c.gpkg'
    out.write_text('mine')
    with pytest.raises(FileExistsError, match='already exists'):
        vectorize_class_map(src, str(out))
    assert out.read_text() == 'mine'
    with pytest.raises(ValueError, match='unknown vector format'):
        vectorize_class_map(src, str(tmp_path / 'c.shpx'))
    with pytest.raises(ValueError, match="unknown class 'water'"):
        vectorize_class_map(src, str(tmp_path / 'd.gpkg'), exclude=['water'])


def test_predict_cli_writes_polygons_and_refuses_to_overwrite(exported):
    """predict.py --vector: the polygons are the class map it wrote, minus the excluded class."""
    import os
    import subprocess
    import sys

    import torch

    from ds_seg.config import REPO_ROOT
    from tests.unit.test_inference import predict_classes
    e = exported
    with torch.inference_mode():  # leave out the class the (random) model predicts most
        direct, _ = predict_classes(e['model'], e['scene'], e['tmp'], mean=[100.0, 110.0, 90.0],
                                    std=[40.0, 40.0, 35.0], tile=64, overlap=16)
    top = int(np.bincount(direct[direct != 255]).argmax())
    out, vector = str(e['tmp'] / 'vec'), str(e['tmp'] / 'scene.fgb')
    cmd = [sys.executable, 'launch/predict.py', '--checkpoint', e['weights'], '--input', e['scene'],
           '--output', out, '--probs', '--tile', '64', '--overlap', '16', '--vector', vector,
           '--exclude-classes', e['names'][top]]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with rasterio.open(os.path.join(out, 'scene_classes.tif')) as src:
        cls, transform = src.read(1), src.transform
    _, _, geometry, fields = pyogrio.raw.read(vector)
    back = rasterize(zip(shapely.from_wkb(geometry), fields[0].tolist()), out_shape=cls.shape,
                     transform=transform, fill=255, dtype='uint8')
    np.testing.assert_array_equal(cls, direct)
    np.testing.assert_array_equal(back, np.where(cls == top, 255, cls))
    assert e['names'][top] not in set(fields[1]) and len(fields[0]) and ((fields[3] > 0) & (fields[3] <= 1)).all()
    size = os.path.getsize(vector)
    again = [a if a != out else out + '_again' for a in cmd]  # new rasters, the same polygon file
    proc = subprocess.run(again, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr
    assert f'--vector: {vector} already exists' in proc.stderr
    assert os.path.getsize(vector) == size and not os.path.exists(out + '_again')


@pytest.fixture
def tiny_weights(tmp_path):
    """A 3-band scene twice under one file name (a/x.tif, b/x.tif) and UNetTiny weights."""
    import torch

    from ds_seg.registry import MODELS, build
    image = np.random.default_rng(0).integers(0, 256, (3, 40, 48), dtype=np.uint8)
    scenes = []
    for folder in ('a', 'b'):
        (tmp_path / folder).mkdir()
        scenes.append(_write(tmp_path / folder / 'x.tif', image))
    cfg = dict(type='UNetTiny', in_channels=3, num_classes=4)
    weights = str(tmp_path / 'w.pt')
    torch.manual_seed(0)
    torch.save({'state_dict': build(MODELS, cfg).state_dict(), 'model': cfg, 'classes': CLASSES,
                'data': {'bands': [1, 2, 3], 'mean': [127.5] * 3, 'std': [73.9] * 3}}, weights)
    return dict(tmp=tmp_path, scenes=[str(s) for s in scenes], weights=weights)


def _predict(t, *args):
    from ds_seg.cli import predict
    return predict.main(['--checkpoint', t['weights'], '--output', str(t['tmp'] / 'out'), '--tile', '32',
                         '--overlap', '8', *args])


@pytest.mark.parametrize('args, message', [
    (['--exclude-classes', 'water'], r"--exclude-classes: unknown class 'water'; classes are background, building"),
    (['--exclude-classes', '9'], r"--exclude-classes: class id 9 is not one of 0..3"),
    (['--simplify', '-1'], r"--simplify must be >= 0, got -1.0"),
    (['--min-area', '-5'], r"--min-area must be >= 0, got -5.0"),
    (['--vector', '{tmp}/nodir/x.gpkg'], r"--vector: the folder .*nodir does not exist"),
    (['--vector', 'x.shp'], r"--vector: x.shp: unknown vector format '.shp'"),
    (['--exclude-classes', 'background'], r"shape the polygons of --vector; add --vector"),  # no --vector
])
def test_predict_cli_refuses_bad_polygon_options_before_any_work(tiny_weights, capsys, args, message):
    """Each is one line and exit 2 before the scene is predicted (was: after it, or a traceback,
    or an unknown class id silently kept)."""
    import re
    t = tiny_weights
    args = [a.format(tmp=t['tmp']) for a in args]
    if '--vector' not in args and 'add --vector' not in message:
        args = ['--vector', str(t['tmp'] / 'x.gpkg')] + args
    code = _predict(t, '--input', t['scenes'][0], *args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
    assert re.search(message, err), err
    assert not (t['tmp'] / 'out').exists() and not (t['tmp'] / 'x.gpkg').exists()


@pytest.mark.parametrize('driver, name', [('PNG', 'x.png'), ('JPEG', 'x.jpg'), ('GTiff', 'plain.tif')])
def test_predict_cli_refuses_polygons_of_a_scene_without_georeferencing(tiny_weights, capsys, driver, name):
    """A PNG, JPEG or TIFF with no geotransform, GCPs or RPCs and --vector: one line, nothing
    written (was: polygons in pixel coordinates, upside down in a GIS, with area_m2 = pixel
    counts, like the GCP-located scene that was already refused)."""
    t = tiny_weights
    with rasterio.open(t['scenes'][0]) as src:
        pixels = src.read()
    path = str(t['tmp'] / name)
    with rasterio.open(path, 'w', driver=driver, width=pixels.shape[2], height=pixels.shape[1], count=3,
                       dtype='uint8') as dst:
        dst.write(pixels)
    code = _predict(t, '--input', path, '--vector', 'gpkg')
    err = capsys.readouterr().err
    assert code == 2 and 'Traceback' not in err, err
    errors = [line for line in err.splitlines() if line.startswith('predict: error:')]
    assert len(errors) == 1 and f'--vector: {path} has no georeferencing' in errors[0], err
    assert not (t['tmp'] / 'out').exists()
    assert _predict(t, '--input', path) == 0  # the class map alone is still made


def test_predict_cli_two_inputs_of_one_name_get_two_polygon_files(tiny_weights):
    """a/x.tif and b/x.tif: a_x_classes.gpkg and b_x_classes.gpkg, like their rasters (the second
    scene was refused after the first, both named x_classes.gpkg); ids or names exclude alike."""
    t = tiny_weights
    assert _predict(t, '--input', *t['scenes'], '--vector', 'gpkg', '--exclude-classes', '0') == 0
    out = t['tmp'] / 'out'
    assert sorted(p.name for p in out.iterdir()) == ['a_x_classes.gpkg', 'a_x_classes.tif',
                                                     'b_x_classes.gpkg', 'b_x_classes.tif']
    for name in ('a_x', 'b_x'):
        with rasterio.open(out / f'{name}_classes.tif') as src:
            cls, transform = src.read(1), src.transform
        _, _, geometry, fields = pyogrio.raw.read(out / f'{name}_classes.gpkg')
        back = rasterize(zip(shapely.from_wkb(geometry), fields[0].tolist()), out_shape=cls.shape,
                         transform=transform, fill=255, dtype='uint8')
        np.testing.assert_array_equal(back, np.where(cls == 0, 255, cls))
    by_name = str(t['tmp'] / 'by_name.gpkg')
    vectorize_class_map(str(out / 'a_x_classes.tif'), by_name, exclude=['background'])
    assert pyogrio.raw.read(by_name)[3][0].tolist() == pyogrio.raw.read(out / 'a_x_classes.gpkg')[3][0].tolist()


def test_predict_cli_scenes_differing_only_in_extension_get_one_class_map_each(tiny_weights):
    """x.tif and x.png (the same pixels, one without georeferencing) in one folder: two class
    maps, x_tif_classes.tif and x_png_classes.tif, with equal classes (was: refused as "the same
    file given twice"). Names that still clash after every parent folder are numbered."""
    from ds_seg.inputs import output_stems
    t = tiny_weights
    with rasterio.open(t['scenes'][0]) as src:
        pixels = src.read()
    png = str(t['tmp'] / 'a' / 'x.png')
    with rasterio.open(png, 'w', driver='PNG', width=pixels.shape[2], height=pixels.shape[1], count=3,
                       dtype='uint8') as dst:
        dst.write(pixels)
    assert _predict(t, '--input', t['scenes'][0], png) == 0
    out = t['tmp'] / 'out'
    assert sorted(p.name for p in out.iterdir()) == ['x_png_classes.tif', 'x_tif_classes.tif']
    with rasterio.open(out / 'x_tif_classes.tif') as a, rasterio.open(out / 'x_png_classes.tif') as b:
        np.testing.assert_array_equal(a.read(1), b.read(1))
    assert output_stems(['/d/a/x.tif', '/e/a/x.tif', '/d/a_x.tif']) == ['d_a_x', 'e_a_x', 'd_a_x_2']
    # The number is one no other input's name has: d_a_x_2 was given twice, and one class map lost.
    assert output_stems(['/d/a/x.tif', '/e/a/x.tif', '/d/a_x.tif', '/f/d_a_x_2.tif']) == [
        'd_a_x', 'e_a_x', 'd_a_x_3', 'd_a_x_2']
    # A name in two folders takes the folders whatever else shares it: b/x.tif was plain 'x' when
    # a/x.TIF sat beside a/x.tif (their extensions told them apart, and the folder went unsaid).
    assert output_stems(['/d/a/x.tif', '/d/b/x.tif', '/d/a/x.TIF']) == ['a_x_tif', 'b_x', 'a_x_TIF']


def test_area_is_ground_square_metres_in_web_mercator_as_in_utm(tmp_path):
    """The same 100 m x 100 m field at 47 degrees N, in UTM 32N and in EPSG:3857 (where it spans
    100 / cos(47) 'metres' a side): both report about 10,000 m2 (UTM's own scale is within 0.1%)."""
    from rasterio.warp import transform as warp
    (e,), (n,) = warp('EPSG:4326', 'EPSG:32632', [9.0], [47.0])
    (mx,), (my,) = warp('EPSG:4326', 'EPSG:3857', [9.0], [47.0])
    areas = {}
    for crs, x0, y0, pixel in (('EPSG:32632', e, n, 1.0), ('EPSG:3857', mx, my, 1.0 / np.cos(np.radians(47.0)))):
        cls = np.zeros((120, 120), np.uint8)
        cls[10:110, 10:110] = 1
        path = str(tmp_path / f"{crs.replace(':', '')}.tif")
        with rasterio.open(path, 'w', driver='GTiff', height=120, width=120, count=1, dtype='uint8', crs=crs,
                           transform=from_origin(x0, y0, pixel, pixel), nodata=255) as dst:
            dst.write(cls, 1)
            dst.update_tags(classes=json.dumps(CLASSES[:2]))
        vectorize_class_map(path, str(tmp_path / f"{crs.replace(':', '')}.gpkg"))
        _, _, _, (class_id, _, area) = pyogrio.raw.read(str(tmp_path / f"{crs.replace(':', '')}.gpkg"),
                                                          columns=['class_id', 'class_name', 'area_m2'])
        areas[crs] = float(area[class_id == 1][0])
    assert areas['EPSG:32632'] == pytest.approx(10_000, rel=1e-6)
    assert areas['EPSG:3857'] == pytest.approx(10_000, rel=0.01), areas


def test_output_names_of_signed_urls_and_of_time_series_sharing_a_date():
    """A URL's query named the output (base.tif?v=1_classes.tif; ?token=a/b gave b_classes.tif);
    two time series with one baseline date were refused as the same file given twice."""
    from ds_seg.config import ConfigError
    from ds_seg.inputs import output_stems
    assert output_stems(['http://127.0.0.1:8000/base.tif?v=1.5', 'https://h/d/small.tif?token=a/b&x=%2F']) == \
        ['base', 'small']
    assert output_stems(['https://h/x/a.tif?s=1', 'https://g/x/a.tif']) == ['h_x_a', 'g_x_a']
    assert output_stems([['/d/t_may.tif', '/d/t_aug.tif'], ['/d/t_may.tif', '/d/t_oct.tif']]) == ['t_may', 't_may_2']
    with pytest.raises(ConfigError, match='/d/a.tif,/d/b.tif, /d/a.tif,/d/b.tif are the same scene given twice'):
        output_stems([['/d/a.tif', '/d/b.tif'], ['/d/a.tif', '/d/b.tif']])
    with pytest.raises(ConfigError, match='the same file given twice'):
        output_stems(['https://h/a.tif?s=1', 'https://h/a.tif?s=1'])


def test_a_users_file_of_the_old_temporary_name_is_kept(tmp_path):
    # survey.partial.gpkg beside --vector survey.gpkg was taken for a killed run's temporary file
    # and deleted without a word.
    src = _write(tmp_path / 'a_classes.tif', _class_map(40, 40))
    mine = tmp_path / 'survey.partial.gpkg'
    mine.write_bytes(b'field survey')
    vectorize_class_map(src, str(tmp_path / 'survey.gpkg'))
    assert mine.read_bytes() == b'field survey'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['a_classes.tif', 'survey.gpkg', 'survey.partial.gpkg']


def _on_the_scenes_grid(t, name, bands_from_pixels, driver='GTiff', **creation):
    """A raster ``name`` on the grid of the fixture's scene holding ``bands_from_pixels(its pixels)``."""
    with rasterio.open(t['scenes'][0]) as src:
        pixels, profile = src.read(), src.profile
    data = bands_from_pixels(pixels)
    path = t['tmp'] / name
    with rasterio.open(path, 'w', driver=driver, width=data.shape[2], height=data.shape[1], count=data.shape[0],
                       dtype=data.dtype, crs=profile['crs'], transform=profile['transform'], **creation) as dst:
        dst.write(data)
    return path


def test_predict_cli_never_writes_polygons_over_its_input(tiny_weights, capsys):
    # A GeoPackage raster (as QGIS writes them) given as --input and --vector with --overwrite was
    # replaced by the polygons: the imagery was gone.
    t = tiny_weights
    area = _on_the_scenes_grid(t, 'area.gpkg', lambda pixels: pixels, driver='GPKG')
    before = area.read_bytes()
    code = _predict(t, '--input', str(area), '--vector', str(area), '--overwrite')
    err = capsys.readouterr().err
    assert code == 2 and f'--vector: writing {area} would replace the input of the same name' in err, err
    assert area.read_bytes() == before and not (t['tmp'] / 'out').exists()


def test_predict_and_evaluate_refuse_a_data_band_tagged_alpha_as_training_does(tiny_weights, capsys):
    # GDAL tags band 4 of an 8-bit RGB file alpha: predict wrote nodata, and evaluate left out,
    # every pixel where that (NIR) band was 0, while training refused the file.
    t = tiny_weights
    rgba = _on_the_scenes_grid(t, 'rgbn.tif', lambda pixels: np.concatenate([pixels, np.zeros_like(pixels[:1])]),
                               photometric='RGB', alpha='YES')
    code = _predict(t, '--input', str(rgba), '--bands', '1', '2', '4')
    err = capsys.readouterr().err
    assert code == 2 and 'rgbn.tif: band 4 is tagged as alpha, so its 0 pixels read as nodata' in err, err
    assert 'gdal_edit.py -colorinterp_4 undefined' in err and not (t['tmp'] / 'out').exists()
    from ds_seg.cli import evaluate
    label = _on_the_scenes_grid(t, 'label.tif', lambda pixels: np.ones_like(pixels[:1]))
    code = evaluate.main(['--checkpoint', t['weights'], '--images', str(rgba), '--labels', str(label), '--bands',
                          '1', '2', '4', '--output', str(t['tmp'] / 'ev')])
    err = capsys.readouterr().err
    assert code == 2 and 'band 4 is tagged as alpha' in err and not (t['tmp'] / 'ev').exists(), err
    assert _predict(t, '--input', str(rgba)) == 0  # its recorded bands 1-3: the alpha band is the mask it is


def test_the_colour_check_follows_dates_and_compares_the_bands_files_name(tmp_path):
    """A file stacking two dates of BGR passed for a model of RGB dates (the lists differed in
    length), and an RGB + undefined-NIR model took a BGR + NIR scene (one band said nothing)."""
    from rasterio.transform import from_origin

    from ds_seg.config import ConfigError
    from ds_seg.inputs import check_bands

    def tagged(name, interp):
        path = str(tmp_path / name)
        with rasterio.open(path, 'w', driver='GTiff', width=16, height=16, count=len(interp), dtype='uint8',
                           crs='EPSG:32632', transform=from_origin(0, 16, 1, 1)) as dst:
            dst.write(np.ones((len(interp), 16, 16), np.uint8))
        with rasterio.open(path, 'r+') as dst:
            dst.colorinterp = [getattr(ColorInterp, c) for c in interp]
        return path
    stacked = tagged('bgr_x2.tif', ('blue', 'green', 'red') * 2)
    with pytest.raises(ConfigError, match=r"bgr_x2.tif: .* hold blue, green, red, blue, green, red .* Select "
                                          r"--bands 3 2 1 6 5 4"):
        check_bands(stacked, None, 6, colours=['red', 'green', 'blue'])
    bgrn = tagged('bgrn.tif', ('blue', 'green', 'red', 'undefined'))
    with pytest.raises(ConfigError, match=r"hold blue, green, red, \(unsaid\) .* Select --bands 3 2 1 4"):
        check_bands(bgrn, None, 4, colours=['red', 'green', 'blue', None])
    check_bands(bgrn, [3, 2, 1, 4], 4, colours=['red', 'green', 'blue', None])
    rgbn = tagged('rgbn.tif', ('red', 'green', 'blue', 'undefined'))
    check_bands(rgbn, None, 4, colours=['red', 'green', 'blue', None])


def test_predict_and_evaluate_refuse_a_scene_whose_colours_are_in_another_order(tiny_weights, capsys):
    # A model trained on RGB files (recorded: data.colours) read a BGR scene's bands 1-3 as
    # red, green, blue: every pixel was classified with its colours swapped, without a word.
    import torch

    from ds_seg.cli import evaluate
    t = tiny_weights
    payload = torch.load(t['weights'], weights_only=True)
    payload['data']['colours'] = ['red', 'green', 'blue']
    torch.save(payload, t['weights'])

    def tagged(name, interp, **creation):
        path = _on_the_scenes_grid(t, name, lambda pixels: pixels, **creation)
        with rasterio.open(path, 'r+') as dst:
            dst.colorinterp = [getattr(ColorInterp, c) for c in interp]
        return path
    bgr = tagged('bgr.tif', ('blue', 'green', 'red'))
    code = _predict(t, '--input', str(bgr))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ('bgr.tif: the bands the model reads (1 2 3) hold blue, green, red by the file\'s colour interpretation, '
            'but the model was trained on bands holding red, green, blue') in err, err
    assert 'Select --bands 3 2 1' in err and not (t['tmp'] / 'out').exists()
    label = _on_the_scenes_grid(t, 'label.tif', lambda pixels: np.ones_like(pixels[:1]))
    code = evaluate.main(['--checkpoint', t['weights'], '--images', str(bgr), '--labels', str(label),
                          '--output', str(t['tmp'] / 'ev')])
    err = capsys.readouterr().err
    assert code == 2 and 'hold blue, green, red' in err and not (t['tmp'] / 'ev').exists(), err
    # A config's data.val is checked as --images are.
    config = t['tmp'] / 'bgr_val.py'
    val = dict(type='GeoTiffScenes', images=[str(bgr)], labels=[str(label)], classes=4)
    config.write_text(f"data = dict(crop_size=32, train={val!r}, val={val!r})\n")
    code = evaluate.main(['--checkpoint', t['weights'], '--config', str(config), '--output', str(t['tmp'] / 'ev2')])
    err = capsys.readouterr().err
    assert code == 2 and 'bgr.tif: the bands the model reads (1 2 3) hold blue, green, red' in err, err
    # The bands that hold the model's colours, and a file that does not say: both predicted.
    assert _predict(t, '--input', str(bgr), '--bands', '3', '2', '1') == 0
    assert _predict(t, '--input', str(tagged('grey.tif', ('gray', 'undefined', 'undefined'))), '--overwrite') == 0


def test_an_unnamed_wide_class_map_and_ids_outside_the_names(tmp_path):
    """An int32 class map without a classes tag named every id its type holds (2^31 strings: out
    of memory for 2000 pixels); an id below 0 took the last class's name (Python's classes[-1])."""
    cls = np.zeros((40, 50), np.int32)
    cls[5:15, 5:25] = 7
    cls[20:30, 30:45] = 70000
    cls[:3, :] = -1
    profile = dict(driver='GTiff', height=40, width=50, count=1, dtype='int32', crs='EPSG:32632',
                   transform=from_origin(500000.0, 5700000.0, PIXEL, PIXEL))
    with rasterio.open(tmp_path / 'wide.tif', 'w', nodata=-5, **profile) as dst:
        dst.write(cls, 1)
    vectorize_class_map(str(tmp_path / 'wide.tif'), str(tmp_path / 'wide.gpkg'))
    ids, names, areas = pyogrio.raw.read(tmp_path / 'wide.gpkg')[3]
    assert dict(zip(ids.tolist(), names.tolist())) == {-1: 'class_-1', 0: 'class_0', 7: 'class_7',
                                                      70000: 'class_70000'}
    assert areas[ids.tolist().index(7)] == pytest.approx(200 * PIXEL * PIXEL)
    with rasterio.open(tmp_path / 'named.tif', 'w', nodata=-5, **profile) as dst:
        dst.write(cls, 1)
        dst.update_tags(classes=json.dumps(CLASSES))
    vectorize_class_map(str(tmp_path / 'named.tif'), str(tmp_path / 'named.gpkg'))
    ids, names, _ = pyogrio.raw.read(tmp_path / 'named.gpkg')[3]
    assert dict(zip(ids.tolist(), names.tolist())) == {-1: 'class_-1', 0: 'background', 7: 'class_7',
                                                      70000: 'class_70000'}


@pytest.mark.parametrize('where', ['gcps', 'none'])
def test_a_class_map_without_a_geotransform_is_refused_alone_as_by_predict(tmp_path, where):
    """predict --vector refused a scene located by GCPs or not at all; vectorize_class_map on such a
    class map wrote polygons in pixel coordinates with area_m2 counting pixels."""
    from rasterio.control import GroundControlPoint
    path = tmp_path / 'c.tif'
    with rasterio.open(path, 'w', driver='GTiff', height=40, width=50, count=1, dtype='uint8') as dst:
        dst.write(np.ones((40, 50), np.uint8), 1)
        if where == 'gcps':
            dst.gcps = ([GroundControlPoint(0, 0, 500000, 5700000), GroundControlPoint(0, 50, 500025, 5700000),
                         GroundControlPoint(40, 0, 500000, 5699980)], rasterio.crs.CRS.from_epsg(32632))
    expect = 'is located by GCPs, not a geotransform' if where == 'gcps' else 'has no georeferencing'
    with pytest.raises(ValueError, match=expect):
        vectorize_class_map(str(path), str(tmp_path / 'c.gpkg'))
    assert not (tmp_path / 'c.gpkg').exists()


LAEA = '+proj=laea +lat_0=52 +lon_0=10 +x_0=4321000 +y_0=3210000 +ellps=GRS80 +units=m +no_defs'


@pytest.mark.parametrize('crs', [LAEA, None])
def test_geojson_polygons_of_a_crs_it_cannot_carry_are_refused(tmp_path, tiny_weights, capsys, crs):
    """GeoJSON names a CRS by EPSG code only, and a file without one reads as WGS84 lon/lat: the
    polygons of a LAEA scene (or of one with no CRS) came out at metre values read as degrees,
    without a word. GeoPackage and FlatGeobuf keep the CRS."""
    from rasterio.crs import CRS
    cls = _class_map()
    path = _write(str(tmp_path / f'cls_{bool(crs)}.tif'), cls, crs=crs)
    said = ("CRS has no EPSG code, which GeoJSON cannot carry" if crs else
            "has no CRS, and a GeoJSON file without one is read as WGS84 longitude/latitude")
    with pytest.raises(ValueError, match=said):
        vectorize_class_map(path, str(tmp_path / 'polys.geojson'))
    assert not (tmp_path / 'polys.geojson').exists()
    if crs:
        vectorize_class_map(path, str(tmp_path / 'polys.gpkg'))
        assert CRS.from_wkt(pyogrio.read_info(str(tmp_path / 'polys.gpkg'))['crs']) == CRS.from_user_input(crs)
    # An EPSG CRS goes to GeoJSON as before, and predict refuses the others before any window.
    vectorize_class_map(_write(str(tmp_path / 'utm.tif'), cls), str(tmp_path / 'utm.geojson'))
    assert pyogrio.read_info(str(tmp_path / 'utm.geojson'))['crs'] == 'EPSG:32632'
    t = tiny_weights
    with rasterio.open(t['scenes'][0]) as src:
        profile, pixels = src.profile, src.read()
    scene = str(tmp_path / 'scene.tif')
    with rasterio.open(scene, 'w', **dict(profile, crs=crs)) as dst:
        dst.write(pixels)
    capsys.readouterr()
    assert _predict(t, '--input', scene, '--vector', 'geojson') == 2
    assert said in capsys.readouterr().err and not (t['tmp'] / 'out').exists()


def test_a_classes_tag_that_is_no_json_list_of_names_is_one_line(tmp_path):
    """A class map tagged classes=building,road (not predict's JSON list) was a JSONDecodeError."""
    path = _write(str(tmp_path / 'cls.tif'), _class_map())
    for tag in ('building,road', '{"a": 1}'):
        with rasterio.open(path, 'r+') as dst:
            dst.update_tags(classes=tag)
        with pytest.raises(ValueError, match=r"its 'classes' tag .* is not a JSON list of class names; give the "
                                             r"names with --classes"):
            vectorize_class_map(path, str(tmp_path / 'polys.gpkg'))
    vectorize_class_map(path, str(tmp_path / 'polys.gpkg'), classes=CLASSES)
