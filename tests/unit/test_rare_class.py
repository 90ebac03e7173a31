"""Rare-class sampling: windows follow DAFormer's class distribution, deterministically."""
import glob
import os

import numpy as np
import pytest
import rasterio
import torch
from rasterio.transform import from_origin

from ds_seg.config import ConfigError
from ds_seg.data import GeoTiffScenes
from ds_seg.data import rare_class
from ds_seg.data.rare_class import class_probabilities

N = 200


@pytest.fixture
def scene(tmp_path):
    """Class 0: 60%, 1: 30%, 2: 9.5%, 3: 0.5% (eight 5x5 blobs) of a 200 x 200 scene."""
    label = np.zeros((N, N), np.uint8)
    label[:, 120:180] = 1
    label[:, 181:200] = 2
    label[:, 180] = 2
    for k in range(8):
        y, x = 15 + 22 * k, 10 + 13 * k
        label[y:y + 5, x:x + 5] = 3
    counts = np.bincount(label.ravel(), minlength=4)
    assert counts[3] == 200 and counts[3] / label.size == 0.005
    common = dict(driver='GTiff', width=N, height=N, crs='EPSG:32632', transform=from_origin(0, 0, 1, 1),
                  tiled=True, blockxsize=64, blockysize=64)
    img = np.random.default_rng(0).integers(0, 256, (3, N, N), dtype=np.uint8)
    with rasterio.open(tmp_path / 'img.tif', 'w', count=3, dtype='uint8', photometric='RGB', **common) as d:
        d.write(img)
    with rasterio.open(tmp_path / 'lbl.tif', 'w', count=1, dtype='uint8', **common) as d:
        d.write(label[None])
    return dict(tmp=tmp_path, img=str(tmp_path / 'img.tif'), lbl=str(tmp_path / 'lbl.tif'),
                counts=counts, label=label)


def _ds(scene, **kw):
    return GeoTiffScenes([scene['img']], [scene['lbl']], classes=4, mean=[127.5] * 3, std=[73.9] * 3,
                         mode='random', **kw)


def test_class_shares_of_windows_follow_the_target(scene):
    # 1-pixel windows: a window's class is exactly the class drawn for it.
    ds = _ds(scene, crop_size=1, sampling='rare_class', rare_class_temperature=0.1, augment=False)
    target = class_probabilities(scene['counts'], 0.1)
    np.testing.assert_allclose(ds.class_probabilities, target)
    np.testing.assert_allclose(ds.class_frequencies, scene['counts'] / scene['counts'].sum())
    n = 3000
    labels = np.array([int(ds[i]['label']) for i in range(n)])
    shares = np.bincount(labels, minlength=4) / n
    # 4 binomial standard deviations of the largest share (p ~ 0.6: 0.009)
    np.testing.assert_allclose(shares, target, atol=0.035)
    assert target[3] > 0.6 and shares[0] < 0.05  # the 0.5% class is drawn most, the 60% one least


def test_rare_class_windows_are_deterministic_equal_shaped_and_cached(scene, monkeypatch):
    rare = _ds(scene, crop_size=32, sampling='rare_class', random_scale=(0.5, 1.5))
    uniform = _ds(scene, crop_size=32, random_scale=(0.5, 1.5))
    n = 200
    has_rare = np.mean([bool((rare[i]['label'] == 3).any()) for i in range(n)])
    by_chance = np.mean([bool((uniform[i]['label'] == 3).any()) for i in range(n)])
    assert has_rare > 0.97 and by_chance < 0.6, (has_rare, by_chance)
    assert {tuple(rare[i]['label'].shape) for i in range(20)} == {(32, 32)}
    cache = glob.glob(os.path.join(scene['tmp'], '.ds_seg_classes_*.npz'))
    assert len(cache) == 1

    def no_rebuild(*args):
        raise AssertionError('the class index was rebuilt instead of read from the cache')
    monkeypatch.setattr(rare_class, '_build', no_rebuild)
    again = _ds(scene, crop_size=32, sampling='rare_class', random_scale=(0.5, 1.5))
    np.testing.assert_array_equal(again.class_frequencies, rare.class_frequencies)
    for i in (0, 7, 199):  # a sample is a function of (seed, index): resume and ranks rely on it
        a, b = rare[i], again[i]
        assert torch.equal(a['image'], b['image']) and torch.equal(a['label'], b['label'])
    other = _ds(scene, crop_size=32, sampling='rare_class', random_scale=(0.5, 1.5), seed=1)
    assert not torch.equal(other[0]['image'], rare[0]['image'])


def test_unknown_sampling_is_one_line(scene):
    with pytest.raises(ConfigError, match="sampling='rare'"):
        _ds(scene, crop_size=32, sampling='rare')


def test_config_key_turns_it_on(tmp_path):
    from ds_seg.config import load_config
    from ds_seg.registry import DATASETS, build
    from tests.tiny import TINY_CONFIG
    cfg = load_config(TINY_CONFIG, [f'data.train.cache_dir={str(tmp_path)!r}', "data.train.sampling='rare_class'"])
    ds = build(DATASETS, dict(cfg.data.train), where='data.train', crop_size=32, seed=0)
    f, p = ds.class_frequencies, ds.class_probabilities
    present = np.flatnonzero(f > 0)
    assert ds.sampling == 'rare_class' and p.argmax() == present[f[present].argmin()]


@pytest.mark.parametrize('temperature', [0, -0.5, 'hot', None])
def test_bad_temperature_is_one_line_before_the_labels_are_indexed(scene, monkeypatch, temperature):
    def no_index(*args):
        raise AssertionError('the labels were indexed before the temperature was checked')
    monkeypatch.setattr(rare_class, '_build', no_index)
    with pytest.raises(ConfigError, match=rf"rare_class_temperature={temperature!r}: must be a number > 0"):
        _ds(scene, crop_size=32, sampling='rare_class', rare_class_temperature=temperature)


def test_a_class_absent_from_the_labels_is_named_not_silently_dropped(scene):
    """A class no label holds gets p = 0; the dataset lists it and the trainer prints it."""
    from types import SimpleNamespace

    from mmengine.config import ConfigDict

    from ds_seg.engine.trainer import Trainer
    ds = GeoTiffScenes([scene['img']], [scene['lbl']], classes=('a', 'b', 'c', 'rare', 'water'), mean=[127.5] * 3,
                       std=[73.9] * 3, mode='random', crop_size=32, sampling='rare_class')
    assert ds.rare_class_absent == ('water',) and ds.class_probabilities[4] == 0
    assert _ds(scene, crop_size=32, sampling='rare_class').rare_class_absent == ()
    printed = []
    fake = SimpleNamespace(cfg=ConfigDict(model=dict(type='UNetTiny', in_channels=3, num_classes=5),
                                          loss=dict(ignore_index=255)),
                           train_set=ds, val_set=None, print=printed.append)
    Trainer._check_model_matches_data(fake)
    assert printed == ["data.train.sampling='rare_class': no labelled pixel of 'water' in the training labels; "
                       "never drawn (rare-class sampling can only pick classes that occur)"]


def test_one_vector_label_file_over_another_image_gets_its_own_index(tmp_path):
    """A vector label is burned into its image's grid: the same polygons over a tile 40 m further
    east cover other pixels, so the cached index of the first tile must not be reused."""
    import pyogrio.raw
    import shapely
    common = dict(driver='GTiff', width=100, height=100, crs='EPSG:32632', count=3, dtype='uint8')
    tiles = []
    for name, west in (('tile_a', 0), ('tile_b', 40)):
        tiles.append(str(tmp_path / f'{name}.tif'))
        with rasterio.open(tiles[-1], 'w', transform=from_origin(west, 100, 1, 1), **common) as d:
            d.write(np.zeros((3, 100, 100), np.uint8))
    houses = str(tmp_path / 'houses.geojson')  # 50 x 50 m: all of it in tile a, 20 x 50 m in tile b
    pyogrio.raw.write(houses, shapely.to_wkb(np.array([shapely.box(10, 10, 60, 60)])),
                      field_data=[np.array([1], np.int32)], fields=['kind'], crs='EPSG:32632', driver='GeoJSON',
                      geometry_type='Polygon')

    def frequencies(tile):
        return GeoTiffScenes([tile], houses, label_field='kind', classes=('other', 'house'), crop_size=16,
                             sampling='rare_class', mean=[0] * 3, std=[1] * 3).class_frequencies

    np.testing.assert_allclose(frequencies(tiles[0]), [0.75, 0.25])
    np.testing.assert_allclose(frequencies(tiles[1]), [0.9, 0.1])


def test_names_in_another_class_order_get_their_own_index(tmp_path):
    """A name-valued vector field is looked up in `classes`: reordered, 'road' is another index,
    and the cached index of the first order (counts and candidate pixels swapped) must not be reused."""
    import pyogrio.raw
    import shapely
    img = str(tmp_path / 'img.tif')
    with rasterio.open(img, 'w', driver='GTiff', width=100, height=100, crs='EPSG:32632', count=3, dtype='uint8',
                       transform=from_origin(0, 100, 1, 1)) as d:
        d.write(np.zeros((3, 100, 100), np.uint8))
    labels = str(tmp_path / 'labels.gpkg')  # building 10 x 10 m, road 20 x 20 m
    pyogrio.raw.write(labels, shapely.to_wkb(np.array([shapely.box(10, 10, 20, 20), shapely.box(50, 50, 70, 70)])),
                      field_data=[np.array(['building', 'road'], object)], fields=['class'], crs='EPSG:32632',
                      geometry_type='Polygon')
    for classes in (('bg', 'building', 'road'), ('bg', 'road', 'building')):
        ds = GeoTiffScenes([img], labels, label_field='class', classes=classes, crop_size=16,
                           sampling='rare_class', mean=[0] * 3, std=[1] * 3)
        counts, locations = rare_class.class_index(ds, 1)
        expected = {'bg': 10000 - 500, 'building': 100, 'road': 400}
        assert list(counts) == [expected[c] for c in classes]
        label = ds.read_label(0, rasterio.windows.Window(0, 0, 100, 100))
        for k in (1, 2):  # every candidate of class k is a pixel of class k
            assert set(label[locations[k][:, 1], locations[k][:, 2]].tolist()) == {k}


def test_a_shapefiles_attributes_edited_in_its_dbf_get_a_new_index(tmp_path):
    """A class changed in the attribute table (QGIS writes the .dbf beside an unchanged .shp): the
    cached index of the old classes was reused, sampling drew the old positions and never the new
    class, which it also reported absent."""
    import shutil

    import pyogrio.raw
    import shapely
    img = str(tmp_path / 'img.tif')
    with rasterio.open(img, 'w', driver='GTiff', width=100, height=100, crs='EPSG:32632', count=3, dtype='uint8',
                       transform=from_origin(0, 100, 1, 1)) as d:
        d.write(np.zeros((3, 100, 100), np.uint8))
    for name, kind in (('labels', 1), ('edited', 2)):
        pyogrio.raw.write(str(tmp_path / f'{name}.shp'), shapely.to_wkb(np.array([shapely.box(10, 10, 30, 30)])),
                          field_data=[np.array([kind], np.int32)], fields=['kind'], crs='EPSG:32632',
                          geometry_type='Polygon')

    def counts():
        ds = GeoTiffScenes([img], str(tmp_path / 'labels.shp'), label_field='kind', classes=3, crop_size=16,
                           sampling='rare_class', mean=[0] * 3, std=[1] * 3)
        return list(rare_class.class_index(ds, 1)[0])

    assert counts() == [9600, 400, 0]
    shutil.copy(tmp_path / 'edited.dbf', tmp_path / 'labels.dbf')
    assert counts() == [9600, 0, 400]
