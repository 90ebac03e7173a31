"""Vector labels rasterised per window equal labels rasterised once for the whole scene."""
import json
import re

import numpy as np
import pyogrio.raw
import pytest
import rasterio
import shapely
import torch
from rasterio.features import rasterize
from rasterio.transform import from_origin

from ds_seg.config import ConfigError
from ds_seg.data.raster import DataError
from ds_seg.data import GeoTiffScenes

H, W = 300, 260
TRANSFORM = from_origin(500000.0, 5700000.0, 0.5, 0.5)
NAMES = ['background', 'building', 'road', 'water']


def _features(rng, n=40):
    """Boxes, rotated boxes and a ring (with its hole), overlapping, some past the scene edge."""
    x0, y0 = TRANSFORM.c, TRANSFORM.f
    geoms, cls = [], []
    for _ in range(n):
        cx, cy = x0 + rng.uniform(-10, W * 0.5 + 10), y0 - rng.uniform(-10, H * 0.5 + 10)
        g = shapely.box(cx, cy, cx + rng.uniform(2, 25), cy + rng.uniform(2, 25))
        if rng.random() < 0.5:
            g = shapely.affinity.rotate(g, rng.uniform(0, 90))
        geoms.append(g)
        cls.append(int(rng.integers(1, 4)))
    geoms.append(shapely.Point(x0 + 60, y0 - 60).buffer(30).difference(shapely.Point(x0 + 60, y0 - 60).buffer(12)))
    cls.append(3)
    return geoms, np.array(cls)


def _write_vector(path, geoms, fields, crs='EPSG:32632'):
    pyogrio.raw.write(str(path), shapely.to_wkb(np.array(geoms, dtype=object)),
                      field_data=list(fields.values()), fields=list(fields), crs=crs,
                      driver='GPKG', geometry_type='Unknown')
    return str(path)


@pytest.fixture
def scene(tmp_path):
    import shapely.affinity  # noqa: F401
    rng = np.random.default_rng(0)
    geoms, cls = _features(rng)
    img = rng.integers(0, 256, (3, H, W), dtype=np.uint8)
    common = dict(driver='GTiff', width=W, height=H, crs='EPSG:32632', transform=TRANSFORM)
    with rasterio.open(tmp_path / 'img.tif', 'w', count=3, dtype='uint8', photometric='RGB', **common) as dst:
        dst.write(img)
    # The reference: the whole scene rasterised once, in file order (later features on top).
    ref = rasterize(zip(geoms, cls.tolist()), out_shape=(H, W), transform=TRANSFORM, fill=0, dtype='uint8')
    with rasterio.open(tmp_path / 'lbl.tif', 'w', count=1, dtype='uint8', **common) as dst:
        dst.write(ref[None])
    vec = _write_vector(tmp_path / 'labels.gpkg', geoms,
                        {'class': cls.astype(np.int32), 'name': np.array([NAMES[c] for c in cls], object)})
    return dict(tmp=tmp_path, img=str(tmp_path / 'img.tif'), lbl=str(tmp_path / 'lbl.tif'), vec=vec,
                geoms=geoms, cls=cls, ref=ref)


KW = dict(crop_size=64, classes=NAMES, mean=[127.5] * 3, std=[73.9] * 3)


@pytest.mark.parametrize('field', ['class', 'name'])
def test_vector_labels_equal_prerasterised_labels_window_by_window(scene, field):
    assert len(np.unique(scene['ref'])) == 4
    raster = GeoTiffScenes([scene['img']], [scene['lbl']], mode='grid', **KW)
    vector = GeoTiffScenes([scene['img']], scene['vec'], label_field=field, mode='grid', **KW)
    assert len(raster) == len(vector)
    for i in range(len(raster)):
        assert torch.equal(raster[i]['label'], vector[i]['label']), i
    raster = GeoTiffScenes([scene['img']], [scene['lbl']], mode='random', boundary_ignore=2, **KW)
    vector = GeoTiffScenes([scene['img']], scene['vec'], label_field=field, mode='random',
                           boundary_ignore=2, **KW)
    for i in range(20):
        a, b = raster[i], vector[i]
        assert torch.equal(a['label'], b['label']) and torch.equal(a['image'], b['image']), i
    assert (b['label'] == 255).any()  # boundary ignore applies to vector labels too


def test_vector_labels_in_another_crs_are_reprojected(scene):
    from rasterio.warp import transform as warp
    moved = shapely.transform(np.array(scene['geoms'], dtype=object), lambda xy: np.column_stack(
        warp('EPSG:32632', 'EPSG:4326', xy[:, 0], xy[:, 1])))
    vec = _write_vector(scene['tmp'] / 'wgs84.gpkg', moved, {'class': scene['cls'].astype(np.int32)},
                        crs='EPSG:4326')
    ds = GeoTiffScenes([scene['img']], vec, label_field='class', mode='grid', crop_size=(H, W),
                       classes=NAMES, mean=[127.5] * 3, std=[73.9] * 3)
    agree = (ds[0]['label'].numpy() == scene['ref']).mean()
    assert agree > 0.995, agree  # only pixels whose centre sits on a reprojected edge differ


def test_bad_vector_labels_are_one_line(scene):
    with pytest.raises(ConfigError, match="no field 'klass'; its fields are class, name"):
        GeoTiffScenes([scene['img']], scene['vec'], label_field='klass', **KW)
    with pytest.raises(ConfigError, match=r"not in classes"):
        GeoTiffScenes([scene['img']], scene['vec'], label_field='name', crop_size=64,
                      classes=['background', 'building'], mean=[0] * 3, std=[1] * 3)
    with pytest.raises(ConfigError, match=r"value [23] .* not a class index 0..1"):
        GeoTiffScenes([scene['img']], scene['vec'], label_field='class', crop_size=64, classes=2,
                      mean=[0] * 3, std=[1] * 3)


def test_whole_scene_evaluation_reads_vector_labels_like_rasters(scene):
    from ds_seg.inference import evaluate_scenes

    def model(images_BCHW):  # position-independent: class from the first band's value
        cls = (images_BCHW[:, 0] * 3).round().long().remainder(4)
        return torch.nn.functional.one_hot(cls, 4).permute(0, 3, 1, 2).float()

    kw = dict(tile=64, overlap=16, batch_size=4, erode_boundary=1)
    raster = evaluate_scenes(model, GeoTiffScenes([scene['img']], [scene['lbl']], mode='grid', **KW), **kw)
    vector = evaluate_scenes(model, GeoTiffScenes([scene['img']], scene['vec'], label_field='class',
                                                  mode='grid', **KW), **kw)
    assert torch.equal(raster['confusion'], vector['confusion']) and raster['confusion'].sum() > 0


def test_features_off_the_image_are_refused_not_learnt_as_background(scene):
    """Polygons that miss every image (another place, or a CRS declared wrong) would make every
    pixel label_fill: one line naming the file, both extents and the CRS instead."""
    far = shapely.affinity.translate(shapely.box(0, 0, 20, 20), TRANSFORM.c + 5000, TRANSFORM.f - 50)
    vec = _write_vector(scene['tmp'] / 'far.gpkg', [far], {'class': np.array([1], np.int32)})
    with pytest.raises(ConfigError, match=r"far.gpkg: no feature lies on image .*img.tif .*both in EPSG:32632\); "):
        GeoTiffScenes([scene['img']], vec, label_field='class', **KW)
    # The scene's own features, but the file says Web Mercator: reprojected off the image.
    wrong = _write_vector(scene['tmp'] / 'mercator.gpkg', scene['geoms'], {'class': scene['cls'].astype(np.int32)},
                          crs='EPSG:3857')
    with pytest.raises(ConfigError, match=r"mercator.gpkg: no feature .*reprojected from the file's CRS EPSG:3857"):
        GeoTiffScenes([scene['img']], wrong, label_field='class', **KW)
    # Metres said to be degrees: outside EPSG:4326's range, PROJ refuses ('utm: Invalid latitude'),
    # which was a traceback.
    degrees = _write_vector(scene['tmp'] / 'degrees.gpkg', scene['geoms'], {'class': scene['cls'].astype(np.int32)},
                            crs='EPSG:4326')
    with pytest.raises(ConfigError, match=r"^labels .*degrees.gpkg: its coordinates cannot be moved from its CRS "
                                          r"\(EPSG:4326\) to the image's \(EPSG:32632\): .*ogr2ogr -a_srs\)$"):
        GeoTiffScenes([scene['img']], degrees, label_field='class', **KW)
    # One file per tile: a tile whose file holds no feature is fine (a tile without buildings).
    empty = _write_vector(scene['tmp'] / 'empty.gpkg', [], {'class': np.array([], np.int32)})
    ds = GeoTiffScenes([scene['img'], scene['img']], [scene['vec'], empty], label_field='class', mode='grid', **KW)
    last = ds[len(ds) - 1]['label']  # the second tile's last window: background, or seen before
    assert ((last == 0) | (last == 255)).all() and (last == 0).any()
    # An empty GeoJSON declares no fields (it has no feature to hold them): it was refused as
    # "no field 'class'; its fields are (none)".
    empty_json = scene['tmp'] / 'empty.geojson'
    empty_json.write_text(json.dumps({'type': 'FeatureCollection', 'features': []}))
    ds = GeoTiffScenes([scene['img'], scene['img']], [scene['vec'], str(empty_json)], label_field='class', mode='grid',
                       **KW)
    np.testing.assert_array_equal(ds[len(ds) - 1]['label'], last)


def test_a_geopackage_of_several_layers_needs_label_layer_and_null_or_text_classes_are_handled(scene):
    """GDAL reads the first layer of several without a word (here an AOI outline that would
    label the whole tile): refused, listing the layers; label_layer picks one. A feature with
    no class value is refused; class indices stored as text ('2') read as indices."""
    path = scene['tmp'] / 'two.gpkg'
    x0, y0 = TRANSFORM.c, TRANSFORM.f
    pyogrio.raw.write(str(path), shapely.to_wkb(np.array([shapely.box(x0, y0 - H, x0 + W, y0)], dtype=object)),
                      field_data=[np.array([1], np.int32)], fields=['class'], crs='EPSG:32632', driver='GPKG',
                      geometry_type='Polygon', layer='aoi')
    pyogrio.raw.write(str(path), shapely.to_wkb(np.array(scene['geoms'], dtype=object)),
                      field_data=[scene['cls'].astype(np.int32)], fields=['class'], crs='EPSG:32632', driver='GPKG',
                      geometry_type='Unknown', layer='labels', append=True)
    with pytest.raises(ConfigError, match=r'two.gpkg: holds 2 layers \(aoi, labels\); set label_layer'):
        GeoTiffScenes([scene['img']], str(path), label_field='class', **KW)
    with pytest.raises(ConfigError, match=r"no layer 'buildings'; its layers are aoi, labels"):
        GeoTiffScenes([scene['img']], str(path), label_field='class', label_layer='buildings', **KW)
    chosen = GeoTiffScenes([scene['img']], str(path), label_field='class', label_layer='labels', mode='grid',
                           crop_size=(H, W), classes=NAMES, mean=[0] * 3, std=[1] * 3)
    np.testing.assert_array_equal(chosen[0]['label'].numpy(), scene['ref'])

    values = scene['cls'].astype(np.float64)
    values[3] = np.nan
    nulls = _write_vector(scene['tmp'] / 'nulls.gpkg', scene['geoms'], {'class': values})
    with pytest.raises(ConfigError, match=r"nulls.gpkg: 1 feature\(s\) have no 'class' value \(null\)"):
        GeoTiffScenes([scene['img']], nulls, label_field='class', **KW)
    text = _write_vector(scene['tmp'] / 'text.gpkg', scene['geoms'],
                         {'class': np.array([str(c) for c in scene['cls']], object)})
    as_text = GeoTiffScenes([scene['img']], text, label_field='class', mode='grid', crop_size=(H, W),
                            classes=4, mean=[0] * 3, std=[1] * 3)
    np.testing.assert_array_equal(as_text[0]['label'].numpy(), scene['ref'])


# Reads the labels over HTTP in a child process, so that a read that never returns fails the test
# (the timeout) instead of hanging it: pyogrio holds the GIL while its GDAL waits on the network.
_READ_OVER_HTTP = r'''
import sys
import numpy as np
from ds_seg.config import ConfigError
from ds_seg.data.raster import DataError
from ds_seg.data import GeoTiffScenes, raster
raster.REMOTE_GDAL_OPTIONS['GDAL_HTTP_LOW_SPEED_TIME'] = 2  # ds_seg's own limit (not the environment's)
out, image, names = sys.argv[1], sys.argv[2], sys.argv[3].split(',')
for i, url in enumerate(sys.argv[4:]):
    try:
        ds = GeoTiffScenes([image], url, label_field='class', mode='grid', crop_size=(300, 260),
                           classes=names, mean=[0] * 3, std=[1] * 3)
        np.save(f'{out}/{i}.npy', ds[0]['label'].numpy())
    except ConfigError as e:
        print(e)
'''


def test_vector_labels_over_http_equal_the_whole_scene_reference_and_a_stalled_server_is_one_line(scene):
    """GeoPackage (SQLite pages read at random), GeoJSON, FlatGeobuf and a Shapefile (with its
    .shx/.dbf/.prj beside it) served by a real HTTP server label each window as the local file
    does; a server that stops answering ends the read with one line within ds_seg's low-speed
    limit. pyogrio carries its own GDAL, which rasterio.Env does not
    reach: without ds_seg's remote options there, the stalled read would wait forever."""
    import os
    import subprocess
    import sys

    from ds_seg.data.rangeserver import RangeServer
    tmp = scene['tmp']
    formats = ('gpkg', 'geojson', 'fgb', 'shp')
    for driver, ext in (('GeoJSON', 'geojson'), ('FlatGeobuf', 'fgb'), ('ESRI Shapefile', 'shp')):
        pyogrio.raw.write(str(tmp / f'labels.{ext}'), shapely.to_wkb(np.array(scene['geoms'], dtype=object)),
                          field_data=[scene['cls'].astype(np.int32)], fields=['class'], crs='EPSG:32632',
                          driver=driver, geometry_type='Polygon' if ext == 'shp' else 'Unknown')
    env = {k: v for k, v in os.environ.items() if not k.startswith(('GDAL_', 'CPL_', 'VSI_'))}
    with RangeServer(tmp) as server, RangeServer(tmp, stall=True) as stalled:
        urls = [server.url(f'labels.{ext}') for ext in formats] + [stalled.url('labels.gpkg')]
        done = subprocess.run([sys.executable, '-c', _READ_OVER_HTTP, str(tmp), server.url('img.tif'),
                               ','.join(NAMES), *urls], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    for i, ext in enumerate(formats):
        # The local file as reference (FlatGeobuf's spatial index stores features in another order).
        local = GeoTiffScenes([scene['img']], str(tmp / f'labels.{ext}'), label_field='class', mode='grid',
                              crop_size=(H, W), classes=NAMES, mean=[0] * 3, std=[1] * 3)[0]['label'].numpy()
        np.testing.assert_array_equal(np.load(tmp / f'{i}.npy'), local, err_msg=urls[i])
    np.testing.assert_array_equal(np.load(tmp / '0.npy'), scene['ref'])
    assert not (tmp / f'{len(formats)}.npy').exists()
    said = done.stdout.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"labels {urls[-1]}: cannot read it as a vector file"), said


@pytest.mark.parametrize('key, value', [('label_fill', 1.9), ('label_fill', True), ('label_fill', -1),
                                        ('boundary_ignore', 1.7), ('boundary_ignore', -1)])
def test_a_fill_or_boundary_that_is_not_a_whole_number_is_one_line(scene, key, value):
    # int() truncated them: label_fill=1.9 labelled all unlabelled ground class 1; boundary_ignore=-1
    # crashed the first training window ("negative dimensions are not allowed").
    with pytest.raises(ValueError, match=f'^{key} must be a whole number >= 0, got {value!r}$'):
        GeoTiffScenes([scene['img']], scene['vec'], label_field='class', **{key: value, **KW})
    from ds_seg.engine.trainer import _build_dataset
    with pytest.raises(ConfigError, match=f'^data.train.*{key}') as err:  # through the config: one line
        _build_dataset(dict(type='GeoTiffScenes', images=[scene['img']], labels=scene['vec'], label_field='class',
                            **{key: value}, **KW), 'data.train', 64, 0)
    assert '\n' not in str(err.value)


def test_a_value_past_ignore_index_without_classes_names_the_file_and_value(scene):
    # The class count was inferred as 301, and the message blamed ignore_index 255.
    bad = _write_vector(scene['tmp'] / 'oor.gpkg', scene['geoms'][:2], {'class': np.array([1, 300], np.int32)})
    with pytest.raises(DataError, match=r"labels .*oor.gpkg: field 'class' holds the value 300, above "
                                        r"ignore_index 255; fix the file, or give `classes`"):
        GeoTiffScenes([scene['img']], bad, label_field='class', crop_size=64, mean=[0] * 3, std=[1] * 3)
    # ignore_index itself is no class, as in a raster: 1, 2 and 255 are three classes (0..2).
    ignored = _write_vector(scene['tmp'] / 'ignored.gpkg', scene['geoms'][:3], {'class': np.array([1, 2, 255], np.int32)})
    assert GeoTiffScenes([scene['img']], ignored, label_field='class', crop_size=64, mean=[0] * 3,
                         std=[1] * 3).num_classes == 3


def test_a_polygon_reaching_past_gdals_pixel_range_is_still_burned(scene):
    # A +-1e10 m "background" box lay 2e10 pixels past the window: GDAL's 32-bit pixel coordinates
    # wrapped and the feature vanished from the labels without a word.
    x0, y0 = TRANSFORM.c, TRANSFORM.f
    geoms = [shapely.box(x0 - 1e10, y0 - 1e10, x0 + 1e10, y0 + 1e10), shapely.box(x0 + 10, y0 - 40, x0 + 40, y0 - 10)]
    path = _write_vector(scene['tmp'] / 'huge.gpkg', geoms, {'class': np.array([1, 2], np.int32)})
    ds = GeoTiffScenes([scene['img']], path, label_field='class', classes=3, crop_size=64, mean=[0] * 3, std=[1] * 3)
    from rasterio.windows import Window
    for window in (Window(0, 0, W, H), Window(100, 37, 64, 64)):
        got = ds.read_label(0, window)
        ref = np.ones((H, W), np.uint8)
        ref[20:80, 20:80] = 2  # the small box: 30 m at 0.5 m pixels, from (20, 20)
        np.testing.assert_array_equal(got, ref[window.row_off:window.row_off + window.height,
                                               window.col_off:window.col_off + window.width])


@pytest.mark.parametrize('values, message', [
    # Both were "field 'class' holds names ('1.0', ...); give `classes`": not the mistake.
    (np.array([1.0, 2.5]), r"field 'class' holds the fraction 2\.5; class indices are whole numbers"),
    # was "holds the fraction 1" (formatted with :g), a whole number to the eye
    (np.array([1.0, 1.0000001]), r"field 'class' holds the fraction 1\.0000001; class indices are whole numbers"),
    (np.array(['1', '-1'], object), r"value -1 .* is not a class index 0\.\.3"),
])
def test_fractional_or_negative_class_values_are_named_as_such(scene, values, message):
    path = _write_vector(scene['tmp'] / 'odd.gpkg', scene['geoms'][:2], {'class': values})
    with pytest.raises(ConfigError, match=message):
        GeoTiffScenes([scene['img']], path, label_field='class', **KW)


@pytest.mark.parametrize('decoding', [dict(reduce_zero_label=True), dict(label_map={1: 0, 2: 1})])
def test_class_names_are_never_decoded_as_label_values(scene, decoding):
    """A field of names ('building') is read as class indices at once; reduce_zero_label then
    shifted them again ('building' trained as 'background', 'road' as 'building'), silently."""
    with pytest.raises(DataError, match=r"labels .*labels.gpkg: field 'name' holds class names, which name their "
                                        r"classes directly; " + next(iter(decoding)) + r" decodes label values and "
                                        r"would shift them: leave it out \(label_fill=255 leaves the pixels under no "
                                        r"feature ignored\)"):
        GeoTiffScenes([scene['img']], scene['vec'], label_field='name', **decoding, **KW)
    # The indices of the 'class' field are label values: decoded as given.
    shifted = GeoTiffScenes([scene['img']], scene['vec'], label_field='class', reduce_zero_label=True, mode='grid',
                            crop_size=(H, W), classes=NAMES[1:], mean=[0] * 3, std=[1] * 3)
    np.testing.assert_array_equal(shifted[0]['label'].numpy(), np.where(scene['ref'] == 0, 255, scene['ref'] - 1))


def test_digit_names_are_names_and_a_yes_no_field_is_classes_0_and_1(scene):
    """Text that is all class names is names, digits included (classes ('1', '0') read '1' as
    index 1, the reverse of the names); a boolean field was refused as 'names (True, ...)'."""
    names = _write_vector(scene['tmp'] / 'digits.gpkg', scene['geoms'],
                          {'class': np.array([str(3 - c) for c in scene['cls']], object)})
    ds = GeoTiffScenes([scene['img']], names, label_field='class', mode='grid', crop_size=(H, W),
                       classes=('3', '2', '1', '0'), mean=[0] * 3, std=[1] * 3)
    label = ds[0]['label'].numpy()
    inside = scene['ref'] > 0
    np.testing.assert_array_equal(label[inside], scene['ref'][inside])   # '2' is class 1 ('3' - 1), by name
    flags = _write_vector(scene['tmp'] / 'flags.gpkg', scene['geoms'], {'is_building': scene['cls'] == 1})
    ds = GeoTiffScenes([scene['img']], flags, label_field='is_building', mode='grid', crop_size=(H, W),
                       classes=2, mean=[0] * 3, std=[1] * 3)
    reference = rasterize(zip(scene['geoms'], (scene['cls'] == 1).astype(int).tolist()), out_shape=(H, W),
                          transform=TRANSFORM, fill=0, dtype='uint8')
    np.testing.assert_array_equal(ds[0]['label'].numpy(), reference)


def test_map_coordinates_on_an_image_without_georeferencing_are_refused_pixel_geojson_is_not(scene):
    """An image with no CRS and no geotransform took a GeoPackage's UTM metres as pixel positions:
    every feature off the image (or a few stray pixels on it), trained on without a word. Such a
    file is refused; a GeoJSON in pixel coordinates (GDAL says EPSG:4326 of every GeoJSON) is
    burned where it says, and a geotransform without a CRS is described as such."""
    import json
    rng = np.random.default_rng(1)
    plain = str(scene['tmp'] / 'plain.tif')
    with rasterio.open(plain, 'w', driver='GTiff', width=W, height=H, count=3, dtype='uint8') as dst:
        dst.write(rng.integers(0, 256, (3, H, W), dtype=np.uint8))
    with pytest.raises(ConfigError, match=r"^labels .*labels.gpkg are in EPSG:32632, but image .*plain.tif has no "
                                          r"georeferencing \(no CRS, no geotransform\).*gdal_edit.py -a_srs"):
        GeoTiffScenes([plain], scene['vec'], label_field='class', **KW)
    # Pixel coordinates (x right, y down: rasterio's identity transform) in a GeoJSON.
    box = [[10, 20], [50, 20], [50, 44], [10, 44], [10, 20]]
    path = scene['tmp'] / 'pixels.geojson'
    path.write_text(json.dumps({'type': 'FeatureCollection', 'features': [
        {'type': 'Feature', 'properties': {'class': 2}, 'geometry': {'type': 'Polygon', 'coordinates': [box]}}]}))
    ds = GeoTiffScenes([plain], str(path), label_field='class', mode='grid', **KW)
    label = ds.read_label(0, rasterio.windows.Window(0, 0, 64, 64))
    expected = np.zeros((64, 64), np.uint8)
    expected[20:44, 10:50] = 2
    assert np.array_equal(label, expected)
    # A geotransform but no CRS: the file's coordinates are taken as the image's map units.
    nocrs = str(scene['tmp'] / 'nocrs.tif')
    with rasterio.open(nocrs, 'w', driver='GTiff', width=W, height=H, count=3, dtype='uint8',
                       transform=from_origin(TRANSFORM.c + 9000, TRANSFORM.f, 1, 1)) as dst:
        dst.write(rng.integers(0, 256, (3, H, W), dtype=np.uint8))
    with pytest.raises(ConfigError, match=r"both in the image's map units \(it declares no CRS\); the image declares "
                                          r"no CRS, so the file's coordinates \(EPSG:32632\) were taken as they are\)"):
        GeoTiffScenes([nocrs], scene['vec'], label_field='class', **KW)


def test_features_without_geometry_are_said_and_the_rest_rasterised(scene):
    """A feature with a class but a null or empty geometry labelled nothing, without a word (one
    without a class is refused)."""
    empty = shapely.Polygon()
    geoms = list(scene['geoms']) + [empty, empty]
    cls = np.concatenate([scene['cls'], [2, 3]]).astype(np.int32)
    path = _write_vector(scene['tmp'] / 'holes.gpkg', geoms, {'class': cls})
    ds = GeoTiffScenes([scene['img']], path, label_field='class', mode='grid', crop_size=(H, W), classes=NAMES,
                       mean=[0] * 3, std=[1] * 3)
    assert ds.notes == [f"labels {path}: 2 feature(s) have no geometry (null or empty) and label no pixel; give them "
                        "their shapes, or drop them to silence this"]
    np.testing.assert_array_equal(ds[0]['label'].numpy(), scene['ref'])
    whole = GeoTiffScenes([scene['img']], scene['vec'], label_field='class', mode='grid', crop_size=(H, W),
                          classes=NAMES, mean=[0] * 3, std=[1] * 3)
    assert not getattr(whole, 'notes', [])


def test_time_series_labels_nested_like_the_images_are_one_line(scene):
    with pytest.raises(DataError, match=r"labels: \[.*lbl.tif'\] is a list; a scene has one label file, which all "
                                        r"its dates share"):
        GeoTiffScenes([[scene['img'], scene['img']]], [[scene['lbl']]], **KW)


def test_images_outside_a_shared_vector_files_features_and_classes_without_features_are_said(scene):
    """One vector file over many tiles (tiles/*.tif with buildings.gpkg) annotated over part of
    them: a tile outside every feature trained as all background, and a class no feature holds
    was never seen, without a word. Both are said at the start; a tile inside the features'
    extent with none on it (a tile without buildings) is not."""
    tmp = scene['tmp']
    inside, outside, far = tmp / 'inside.tif', tmp / 'outside.tif', tmp / 'far.tif'
    with rasterio.open(scene['img']) as src:
        profile, img = src.profile, src.read()
    # A 40 x 40 px tile inside the features' extent with none on it; two tiles a kilometre east.
    for path, transform, size in ((inside, from_origin(499990.0, 5699960.0, 0.5, 0.5), 40),
                                  (outside, from_origin(501000.0, 5700000.0, 0.5, 0.5), 64),
                                  (far, from_origin(502000.0, 5700000.0, 0.5, 0.5), 64)):
        with rasterio.open(path, 'w', **dict(profile, transform=transform, width=size, height=size)) as dst:
            dst.write(img[:, :size, :size])
    with rasterio.open(inside) as src:
        assert not any(shapely.box(*src.bounds).intersects(g) for g in scene['geoms'])
    kw = dict(KW, classes=NAMES + ['bridge'])
    ds = GeoTiffScenes([scene['img'], str(inside), str(outside), str(far)], scene['vec'], label_field='class', **kw)
    assert ds.notes == [
        f"labels {scene['vec']}: 2 of 4 images lie outside the extent of all its features (outside.tif, far.tif); "
        "they train as label_fill 0 ('background') everywhere; if the file does not cover them (an annotated area "
        "smaller than the images), leave them out",
        f"labels {scene['vec']}: no feature holds class 'bridge', so the model never sees it; check `classes` and "
        "label_field 'class'"], ds.notes
    # Covered tiles and every class held: nothing to say; a validation set lacking a class is not said.
    assert not GeoTiffScenes([scene['img'], str(inside)], scene['vec'], label_field='class', **KW).notes
    assert not GeoTiffScenes([scene['img'], str(inside)], scene['vec'], label_field='class', mode='grid',
                             split='val', **kw).notes


@pytest.mark.parametrize('far', ['pacific', 'sumatra', 'world'])
def test_a_world_wide_file_labels_a_tile_with_only_the_features_near_it(tmp_path, far):
    """One label file in EPSG:4326 over tiles in their UTM zone: every vertex was moved into the
    tile's zone, so a lake in the Pacific landed on a tile in Germany (all of it 'water', the
    building gone, no word), a field near 98 deg E (beyond the zone's domain) refused the whole
    file as in the wrong CRS, and a world-wide background polygon collapsed to a line."""
    from rasterio.warp import transform_geom
    size = 128
    img = str(tmp_path / 'tile_germany.tif')   # UTM 32N, about 9.0 E 51.44 N
    with rasterio.open(img, 'w', driver='GTiff', width=size, height=size, count=3, dtype='uint8', crs='EPSG:32632',
                       transform=from_origin(500000, 5700000, 1, 1)) as d:
        d.write(np.full((3, size, size), 100, np.uint8))
    building_utm = shapely.box(500010, 5699900, 500040, 5699990)
    building = shapely.geometry.shape(transform_geom('EPSG:32632', 'EPSG:4326', shapely.geometry.mapping(building_utm)))
    other = dict(pacific=shapely.box(-175.64, -2.89, -164.27, 26.27), sumatra=shapely.box(97.9, -0.1, 98.1, 0.1),
                 world=shapely.box(-180, -90, 180, 90))[far]
    geoms, classes = ([other, building], [2, 1]) if far == 'world' else ([building, other], [1, 2])
    labels = str(tmp_path / 'world.gpkg')
    _write_vector(labels, geoms, {'cls': np.array(classes, np.int32)}, crs='EPSG:4326')
    ds = GeoTiffScenes([img], [labels], label_field='cls', classes=['background', 'building', 'water'],
                       crop_size=size, mode='grid', split='val', mean=[1] * 3, std=[1] * 3, check_labels=0)
    expected = rasterize([(building_utm, 1)], out_shape=(size, size), transform=from_origin(500000, 5700000, 1, 1),
                         fill=2 if far == 'world' else 0, dtype='uint8')
    assert np.array_equal(ds[0]['label'].numpy(), expected)


def test_a_file_whose_features_all_lie_far_from_its_tile_is_refused_beside_a_good_one(tmp_path):
    """Far features are dropped before reprojection; a file left with none near its tile is not a
    tile without objects (learnt as background everywhere): the line says where its features are."""
    from rasterio.warp import transform_geom
    tiles, files = [], []
    for name, west in (('a', 500000), ('b', 500200)):
        tiles.append(str(tmp_path / f'{name}.tif'))
        with rasterio.open(tiles[-1], 'w', driver='GTiff', width=64, height=64, count=3, dtype='uint8',
                           crs='EPSG:32632', transform=from_origin(west, 5700000, 1, 1)) as d:
            d.write(np.full((3, 64, 64), 100, np.uint8))
    house = shapely.geometry.shape(transform_geom('EPSG:32632', 'EPSG:4326', shapely.geometry.mapping(
        shapely.box(500010, 5699950, 500030, 5699990))))
    files = [_write_vector(tmp_path / 'a.gpkg', [house], {'cls': np.array([1], np.int32)}, crs='EPSG:4326'),
             _write_vector(tmp_path / 'b.gpkg', [shapely.box(-175.6, -2.9, -164.3, 26.3)],
                           {'cls': np.array([1], np.int32)}, crs='EPSG:4326')]
    with pytest.raises(DataError, match=r"^labels .*b\.gpkg: no feature lies on image .*b\.tif \(its 1 feature\(s\) lie "
                                        r"far from it: they span \(-175\.6, -2\.9, -164\.3, 26\.3\) in EPSG:4326, the "
                                        r"image spans .*, in EPSG:32632; reprojected from the file's CRS EPSG:4326\)"):
        GeoTiffScenes(tiles, files, label_field='cls', classes=2, crop_size=32, mean=[1] * 3, std=[1] * 3)


def test_vector_labels_on_an_image_located_by_ground_control_points_use_their_fit(tmp_path):
    """Raster labels pair with a GCP-located scene by the points' affine fit (README); vector
    labels on one were refused as 'no georeferencing (no CRS, no geotransform)'."""
    from rasterio.control import GroundControlPoint as Gcp
    size = 100
    img = str(tmp_path / 'gcp.tif')
    gcps = [Gcp(0, 0, 500000, 5700000), Gcp(0, size, 500000 + size, 5700000), Gcp(size, 0, 500000, 5700000 - size),
            Gcp(size, size, 500000 + size, 5700000 - size)]
    with rasterio.open(img, 'w', driver='GTiff', width=size, height=size, count=3, dtype='uint8', gcps=gcps,
                       crs='EPSG:32632') as d:
        d.write(np.full((3, size, size), 100, np.uint8))
    house = shapely.box(500010, 5699950, 500040, 5699990)
    labels = _write_vector(tmp_path / 'l.gpkg', [house], {'c': np.array([1], np.int32)})
    ds = GeoTiffScenes([img], [labels], label_field='c', classes=2, crop_size=size, mode='grid', split='val',
                       mean=[1] * 3, std=[1] * 3, check_labels=0)
    expected = rasterize([(house, 1)], out_shape=(size, size), transform=from_origin(500000, 5700000, 1, 1))
    assert np.array_equal(ds[0]['label'].numpy(), expected)


@pytest.mark.parametrize('name', ['labels.kml', 'labels.shp.zip', 'labels.gml', 'labels.csv'])
def test_a_vector_file_of_a_format_not_read_is_named_as_such(scene, name):
    """KML, GML, zipped shapefiles and CSV labels were 'not a readable raster (corrupt or not an
    image)': sound files, of a format the labels do not take."""
    path = scene['tmp'] / name
    path.write_text('<kml/>')
    with pytest.raises(DataError, match=rf"{re.escape(name)}: a vector file \(\.[a-z.]+\), a format ds_seg does not "
                                        r"read; vector labels are GeoPackage, .* convert it \(ogr2ogr labels\.gpkg"):
        GeoTiffScenes([scene['img']], [str(path)], **KW)
