"""STAC input: an ItemCollection of single-band assets reads like the stacked GeoTIFFs."""
import datetime
import json
import os
import shutil

import numpy as np
import pystac
import pytest
import rasterio
import torch
from rasterio.transform import from_origin

from ds_seg.config import ConfigError
from ds_seg.data import GeoTiffScenes
from ds_seg.data.raster import DataError
from ds_seg.data.rangeserver import RangeServer

BANDS = ['red', 'green', 'blue']
KW = dict(crop_size=48, classes=3, mean=[127.5] * 3, std=[73.9] * 3, seed=1)


@pytest.fixture(scope='module')
def catalogue(tmp_path_factory):
    """Two items, each with red/green/blue single-band COG-like assets and a label asset (relative
    hrefs), written with pystac; plus the same scenes as stacked 3-band GeoTIFFs for reference."""
    tmp = tmp_path_factory.mktemp('stac')
    rng = np.random.default_rng(0)
    items, stacked, labels = [], [], []
    for k, (h, w) in enumerate([(100, 90), (80, 120)]):
        common = dict(driver='GTiff', width=w, height=h, crs='EPSG:32633',
                      transform=from_origin(400000 + 1000 * k, 5600000, 1.0, 1.0), tiled=True,
                      blockxsize=32, blockysize=32)
        img = rng.integers(0, 256, (3, h, w), dtype=np.uint8)
        lbl = rng.integers(0, 3, (1, h, w), dtype=np.uint8)
        item = pystac.Item(id=f'scene{k}', geometry=None, bbox=None, properties={},
                           datetime=datetime.datetime(2024, 5, 1 + k))
        for b, name in enumerate(BANDS):
            path = tmp / f'scene{k}_{name}.tif'
            with rasterio.open(path, 'w', count=1, dtype='uint8', **common) as d:
                d.write(img[b:b + 1])
            item.add_asset(name, pystac.Asset(href=path.name, media_type=pystac.MediaType.COG))
        with rasterio.open(tmp / f'scene{k}_label.tif', 'w', count=1, dtype='uint8', **common) as d:
            d.write(lbl)
        item.add_asset('label', pystac.Asset(href=f'scene{k}_label.tif', roles=['labels']))
        with rasterio.open(tmp / f'scene{k}_rgb.tif', 'w', count=3, dtype='uint8', photometric='RGB',
                           **common) as d:
            d.write(img)
        items.append(item)
        stacked.append(str(tmp / f'scene{k}_rgb.tif'))
        labels.append(str(tmp / f'scene{k}_label.tif'))
    collection = pystac.ItemCollection(items)
    with open(tmp / 'items.json', 'w') as f:
        json.dump(collection.to_dict(transform_hrefs=False), f)
    with open(tmp / 'item0.json', 'w') as f:
        json.dump(items[0].to_dict(transform_hrefs=False), f)
    return dict(tmp=tmp, stacked=stacked, labels=labels)


def _assert_same(a, b, n=6):
    assert len(a) == len(b) and a.scenes[0]['width'] == b.scenes[0]['width']
    for i in range(n):
        x, y = a[i], b[i]
        assert torch.equal(x['image'], y['image']) and torch.equal(x['label'], y['label']), i


def test_stac_item_collection_equals_stacked_files(catalogue):
    ref = GeoTiffScenes(catalogue['stacked'], catalogue['labels'], mode='grid', **KW)
    ds = GeoTiffScenes(stac=str(catalogue['tmp'] / 'items.json'), stac_bands=BANDS, stac_label='label',
                       mode='grid', **KW)
    _assert_same(ref, ds, n=len(ref))
    one = GeoTiffScenes(stac=str(catalogue['tmp'] / 'item0.json'), stac_bands=BANDS, mode='random', **KW)
    _assert_same(GeoTiffScenes(catalogue['stacked'][:1], catalogue['labels'][:1], mode='random', **KW), one)
    # one asset of several bands, no VRT: the stacked file itself
    single = GeoTiffScenes(stac=str(catalogue['tmp'] / 'items.json'), stac_bands='red', mode='grid',
                           crop_size=48, classes=3, mean=[127.5], std=[73.9])
    assert single.scenes[0]['image'].endswith('scene0_red.tif')


def test_stac_over_http(catalogue):
    with RangeServer(catalogue['tmp']) as server:
        ds = GeoTiffScenes(stac=server.url('items.json'), stac_bands=BANDS, mode='random', **KW)
        assert ds.scenes[0]['label'].startswith('http://127.0.0.1')
        ref = GeoTiffScenes(catalogue['stacked'], catalogue['labels'], mode='random', **KW)
        _assert_same(ref, ds)
        assert server.requests > 0
        with pytest.raises(ConfigError, match='nothing.json'):
            GeoTiffScenes(stac=server.url('nothing.json'), stac_bands=BANDS, **KW)


def test_relative_hrefs_are_relative_to_where_the_document_was_read(catalogue, tmp_path):
    """A catalogue reached through a redirect (a short link, a DOI) had its relative hrefs joined to
    the URL asked for: 404. A percent-encoded relative href ('dir%20a/x.tif', a URI) in a document
    read from disk named a file 'dir%20a/x.tif'."""
    ref = GeoTiffScenes(catalogue['stacked'], catalogue['labels'], mode='random', **KW)
    with RangeServer(catalogue['tmp'], json_alias='latest/') as server:
        _assert_same(ref, GeoTiffScenes(stac=server.url('latest/items.json'), stac_bands=BANDS, mode='random', **KW))
    folder = tmp_path / 'dir with space'
    folder.mkdir()
    with open(catalogue['tmp'] / 'items.json') as f:
        doc = json.load(f)
    for feature in doc['features']:
        for asset in feature['assets'].values():
            shutil.copy(catalogue['tmp'] / asset['href'], folder / asset['href'])
            asset['href'] = 'dir%20with%20space/' + asset['href']
    (tmp_path / 'items.json').write_text(json.dumps(doc))
    _assert_same(ref, GeoTiffScenes(stac=str(tmp_path / 'items.json'), stac_bands=BANDS, mode='random', **KW))


def test_missing_asset_names_the_assets(catalogue):
    with pytest.raises(ConfigError, match=r"no asset 'nir' \(stac_bands\); its assets are red, green, blue, label"):
        GeoTiffScenes(stac=str(catalogue['tmp'] / 'items.json'), stac_bands=['red', 'nir'], **KW)
    assert os.path.exists(catalogue['tmp'] / 'items.json')
    with pytest.raises(ConfigError, match=r"not both \(over a config that sets images: --cfg-options "
                                          r"data.train.images=None data.train.labels=None\)"):
        GeoTiffScenes(catalogue['stacked'], catalogue['labels'], stac=str(catalogue['tmp'] / 'items.json'),
                      stac_bands=BANDS, **KW)


def test_each_geospatial_input_works_through_cfg_options(catalogue):
    """The README's --cfg-options for STAC, vector labels, rare-class sampling and dated scenes
    reach GeoTiffScenes through the config layer and the trainer's dataset builder."""
    import pyogrio.raw
    import shapely

    from ds_seg.config import load_config
    from ds_seg.engine.trainer import _build_dataset
    tmp = catalogue['tmp']
    with rasterio.open(catalogue['stacked'][0]) as src:
        left, bottom, right, top = src.bounds
    gpkg = str(tmp / 'houses.gpkg')
    if not os.path.exists(gpkg):
        pyogrio.raw.write(gpkg, shapely.to_wkb(np.array([shapely.box(left + 10, top - 40, left + 40, top - 10)])),
                          field_data=[np.array([2], np.int32)], fields=['kind'], crs='EPSG:32633', driver='GPKG',
                          geometry_type='Polygon')
    image, label = catalogue['stacked'][0], catalogue['labels'][0]
    second = str(tmp / 'scene0_rgb_date2.tif')  # a date of its own: one file as two dates is refused
    shutil.copy(image, second)
    base = ["data.train.type='GeoTiffScenes'", "data.train.classes=3", "data.train.mean=[127.5, 127.5, 127.5]",
            "data.train.std=[73.9, 73.9, 73.9]"]
    cases = {
        'stac': [f"data.train.stac={str(tmp / 'items.json')!r}", "data.train.stac_bands=['red', 'green', 'blue']",
                 "data.train.images=None", "data.train.labels=None"],
        'vector': [f"data.train.images=[{image!r}]", f"data.train.labels={gpkg!r}", "data.train.label_field='kind'"],
        'rare_class': [f"data.train.images=[{image!r}]", f"data.train.labels=[{label!r}]",
                       "data.train.sampling='rare_class'", "data.train.rare_class_temperature=0.1"],
        'dates': [f"data.train.images=[[{image!r}, {second!r}]]", f"data.train.labels=[{label!r}]"],
    }
    for name, options in cases.items():
        cfg = load_config(None, base + options)
        ds = _build_dataset(dict(cfg.data.train), 'data.train', 32, 0)
        sample = ds[0]
        assert sample['image'].shape == (6 if name == 'dates' else 3, 32, 32), name
        assert {'stac': len(ds.scenes) == 2, 'vector': ds.scenes[0].get('vector'),
                'rare_class': ds.sampling == 'rare_class', 'dates': ds.num_dates == 2}[name], name


def test_multi_band_and_mixed_type_assets_stack_every_band_without_wrapping(catalogue, tmp_path):
    """['rgb', 'nir']: the three bands of a multi-band asset, then a uint16 band, read as uint16
    (the type that holds both), so no value wraps; an int8 band beside uint8 ones reads as int16."""
    from ds_seg.data.raster import open_raster
    from ds_seg.data.stac import stac_scenes
    with rasterio.open(catalogue['stacked'][0]) as src:
        profile, rgb = src.profile, src.read()
    nir = (np.arange(rgb[0].size, dtype=np.uint16).reshape(rgb[0].shape) * 7)[None]
    signed = (rgb[:1].astype(np.int16) - 128).astype(np.int8)
    for name, values in (('nir', nir), ('signed', signed)):
        with rasterio.open(tmp_path / f'{name}.tif', 'w', **dict(profile, count=1, dtype=values.dtype.name,
                                                                   photometric='MINISBLACK')) as d:
            d.write(values)
    item = pystac.Item(id='T33/2024-05-01', geometry=None, bbox=None, properties={},  # a '/' in the id
                       datetime=datetime.datetime(2024, 5, 1))
    for name, href in (('rgb', catalogue['stacked'][0]), ('nir', 'nir.tif'), ('signed', 'signed.tif'),
                       ('label', catalogue['labels'][0])):
        item.add_asset(name, pystac.Asset(href=str(href)))
    with open(tmp_path / 'item.json', 'w') as f:
        json.dump(item.to_dict(transform_hrefs=False), f)
    (stack,), _ = stac_scenes(str(tmp_path / 'item.json'), ['rgb', 'nir'], 'label')
    assert os.path.dirname(stack) == str(tmp_path / '.ds_seg_stac')  # the id's '/' did not make a folder
    with open_raster(stack) as src:
        assert src.count == 4 and set(src.dtypes) == {'uint16'}
        np.testing.assert_array_equal(src.read(), np.concatenate([rgb.astype(np.uint16), nir]))
    (stack,), _ = stac_scenes(str(tmp_path / 'item.json'), ['rgb', 'signed'], 'label')
    with open_raster(stack) as src:
        assert set(src.dtypes) == {'int16'}
        np.testing.assert_array_equal(src.read(4), signed[0])


@pytest.mark.parametrize('document, message', [
    ([{'type': 'Feature'}], r"expected a STAC Item or ItemCollection .*found type 'list'"),
    ({'type': 'Feature', 'stac_version': '1.0.0', 'id': 'x', 'geometry': None, 'properties': {'datetime': None},
      'links': [], 'assets': {'red': {'title': 'no href'}}}, r"not a valid STAC Feature \(KeyError: missing 'href'\)"),
    ('not json {', r'not a JSON document'),
    # No stac_version: pystac's STACTypeError, which is no STACError, was a traceback.
    ({'type': 'Feature', 'id': 'x', 'geometry': None, 'properties': {'datetime': None}, 'links': [],
      'assets': {'red': {'href': 'red.tif'}}}, r"not a valid STAC Feature \(STACTypeError: "),
    ({'type': 'FeatureCollection', 'features': [{'type': 'Feature', 'id': 'x', 'geometry': None, 'links': [],
      'properties': {'datetime': None}, 'assets': {'red': {'href': 'red.tif'}}}]},
     r"not a valid STAC FeatureCollection \(STACTypeError: "),
])
def test_documents_that_are_not_stac_are_one_line(tmp_path, document, message):
    path = tmp_path / 'doc.json'
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    with pytest.raises(ConfigError, match=message):
        GeoTiffScenes(stac=str(path), stac_bands=['red'], **KW)


def test_file_url_hrefs_read_as_the_local_files(catalogue, tmp_path):
    """Assets given as file:// URLs (as stactools and rio-stac write local assets) are the files
    they name, not 'no such file'."""
    with open(catalogue['tmp'] / 'items.json') as f:
        doc = json.load(f)
    for feature in doc['features']:
        for asset in feature['assets'].values():
            asset['href'] = (catalogue['tmp'] / asset['href']).as_uri()
    path = tmp_path / 'items_file_urls.json'
    path.write_text(json.dumps(doc))
    stac = GeoTiffScenes(stac=str(path), stac_bands=BANDS, stac_label='label', **KW)
    _assert_same(stac, GeoTiffScenes(catalogue['stacked'], catalogue['labels'], **KW))
    # The document itself as a file:// URL ('No such file or directory: file:///...'); its
    # relative hrefs are relative to the file.
    relative = GeoTiffScenes(stac=(catalogue['tmp'] / 'items.json').as_uri(), stac_bands=BANDS, stac_label='label', **KW)
    _assert_same(relative, GeoTiffScenes(catalogue['stacked'], catalogue['labels'], **KW))


def test_two_items_of_the_same_assets_are_one_scene_twice(catalogue, tmp_path):
    """Each item is stacked into a VRT of its own name, so the repeated-scene check saw two files:
    an evaluation counted the scene twice (the confusion matrix summed to twice its pixels)."""
    collection = json.loads((catalogue['tmp'] / 'items.json').read_text())
    twin = json.loads(json.dumps(collection['features'][0]))
    twin['id'] = 'scene0_again'
    collection['features'].append(twin)
    path = catalogue['tmp'] / 'twice.json'
    path.write_text(json.dumps(collection))
    with pytest.raises(ConfigError, match=r"items 'scene0' and 'scene0_again' have the same assets .* the scene "
                                          r"would count twice"):
        GeoTiffScenes(stac=str(path), stac_bands=BANDS, mode='grid', **KW)


def test_items_declaring_other_raster_bands_scale_or_offset_are_refused(catalogue, tmp_path):
    """Sentinel-2 items before and after processing baseline 04.00 declare offsets 0 and -0.1 in
    raster:bands; their files carry no tags, and the mix was trained as one encoding without a
    word (GeoTIFFs whose own tags differ are refused). Items that agree are read as before."""
    collection = json.loads((catalogue['tmp'] / 'items.json').read_text())
    for k, offset in enumerate((0.0, -0.1)):
        for name in BANDS:
            collection['features'][k]['assets'][name]['raster:bands'] = [{'scale': 0.0001, 'offset': offset}]
    mixed = catalogue['tmp'] / 'mixed_baselines.json'
    mixed.write_text(json.dumps(collection))
    with pytest.raises(ConfigError) as refused:
        GeoTiffScenes(stac=str(mixed), stac_bands=BANDS, mode='grid', **KW)
    assert str(refused.value) == (
        f"stac={str(mixed)!r}: items 'scene0' and 'scene1' declare other raster:bands scale/offset for asset "
        f"{BANDS[0]!r} ([[0.0001, 0.0]] and [[0.0001, -0.1]]); ds_seg trains on the raw values, so every scene must "
        "share one encoding: use items of one processing baseline, or convert them to one (gdal_translate -scale)")
    for name in BANDS:
        collection['features'][1]['assets'][name]['raster:bands'] = [{'scale': 0.0001}]   # offset 0 by default
    one = catalogue['tmp'] / 'one_baseline.json'
    one.write_text(json.dumps(collection))
    assert len(GeoTiffScenes(stac=str(one), stac_bands=BANDS, mode='grid', **KW)) > 0
    # One item declares its scale, the other nothing: which encoding its files hold is unknown.
    for name in BANDS:
        del collection['features'][0]['assets'][name]['raster:bands']
    silent = catalogue['tmp'] / 'one_silent.json'
    silent.write_text(json.dumps(collection))
    with pytest.raises(ConfigError) as refused:
        GeoTiffScenes(stac=str(silent), stac_bands=BANDS, mode='grid', **KW)
    assert str(refused.value).startswith(
        f"stac={str(silent)!r}: item 'scene1' declares raster:bands scale/offset [[0.0001, 0.0]] for asset "
        f"{BANDS[0]!r} and item 'scene0' declares none, so whether they share one encoding is unknown")
    for name in BANDS:   # a declared identity encoding is what a silent item is read as
        collection['features'][1]['assets'][name]['raster:bands'] = [{'scale': 1, 'offset': 0}]
    silent.write_text(json.dumps(collection))
    assert len(GeoTiffScenes(stac=str(silent), stac_bands=BANDS, mode='grid', **KW)) > 0


def test_a_null_scale_or_offset_is_not_declared_and_a_word_is_refused(catalogue):
    """Serialisers that keep None fields write "scale": null: float(None) was a TypeError
    traceback. A null is the default (1, 0); a string is one line naming the item and asset."""
    collection = json.loads((catalogue['tmp'] / 'items.json').read_text())
    for feature in collection['features']:
        for name in BANDS:
            feature['assets'][name]['raster:bands'] = [{'scale': None, 'offset': None, 'nodata': None}]
    nulls = catalogue['tmp'] / 'nulls.json'
    nulls.write_text(json.dumps(collection))
    assert len(GeoTiffScenes(stac=str(nulls), stac_bands=BANDS, mode='grid', **KW)) > 0
    collection['features'][1]['assets'][BANDS[1]]['raster:bands'] = [{'scale': '0.0001'}]
    words = catalogue['tmp'] / 'words.json'
    words.write_text(json.dumps(collection))
    with pytest.raises(ConfigError) as refused:
        GeoTiffScenes(stac=str(words), stac_bands=BANDS, mode='grid', **KW)
    assert str(refused.value) == (f"stac={str(words)!r}: item 'scene1', asset {BANDS[1]!r}: raster:bands[0].scale is "
                                  "'0.0001', not a number; fix the item (or remove the key)")


def test_time_series_sharing_a_baseline_date_are_two_evaluation_scenes(catalogue):
    """Scenes [a, b] and [a, c] were refused as 'a given twice'; [a, b] twice still is."""
    from ds_seg.data import DataError
    red, green, blue = (str(catalogue['tmp'] / f'scene0_{n}.tif') for n in BANDS)
    label = catalogue['labels'][0]
    kw = dict(KW, mean=[127.5], std=[73.9])
    ds = GeoTiffScenes([[red, green], [red, blue]], [label, label], mode='grid', **kw)
    assert len(ds.scenes) == 2 and ds.num_dates == 2
    with pytest.raises(DataError, match='is given twice'):
        GeoTiffScenes([[red, green], [red, green]], [label, label], mode='grid', **kw)


def test_statistics_of_stacked_assets_follow_the_assets_and_train_and_val_keep_theirs(catalogue, tmp_path,
                                                                                      monkeypatch):
    """A STAC item's bands are read through a VRT of its assets; the statistics cache was keyed
    to the VRT, which does not change when an asset is rewritten: the old statistics stayed. And
    the folder's cache held one set of scenes, so train and val replaced each other's every run."""
    for path in catalogue['tmp'].iterdir():
        if path.suffix in ('.tif', '.json'):
            shutil.copy(path, tmp_path / path.name)
    kw = dict(crop_size=48, classes=3, check_labels=0)
    stac = dict(stac=str(tmp_path / 'items.json'), stac_bands=BANDS, **kw)
    before = GeoTiffScenes(**stac).mean
    red = tmp_path / 'scene0_red.tif'
    with rasterio.open(red, 'r+') as d:
        d.write((d.read() // 2).astype(np.uint8))
    after = GeoTiffScenes(**stac).mean
    assert after[0] < before[0] - 10 and np.allclose(after[1:], before[1:])
    train = GeoTiffScenes([str(tmp_path / 'scene0_rgb.tif')], [str(tmp_path / 'scene0_label.tif')], **kw)
    val = GeoTiffScenes([str(tmp_path / 'scene1_rgb.tif')], [str(tmp_path / 'scene1_label.tif')], **kw)
    from ds_seg.data.geotiff import GeoTiffScenes as Scenes

    def no_reads(*args):
        raise AssertionError('statistics computed again: the cache lost this set')
    monkeypatch.setattr(Scenes, '_band_statistics', no_reads)
    again = GeoTiffScenes([str(tmp_path / 'scene0_rgb.tif')], [str(tmp_path / 'scene0_label.tif')], **kw)
    np.testing.assert_array_equal(again.mean, train.mean)
    np.testing.assert_array_equal(
        GeoTiffScenes([str(tmp_path / 'scene1_rgb.tif')], [str(tmp_path / 'scene1_label.tif')], **kw).mean, val.mean)


def test_stacked_assets_keep_their_masks_and_colour_interpretation(catalogue, tmp_path):
    """A VRT has no mask of its own: the assets' internal GDAL masks (each hiding another part)
    hide a pixel of the stack where any of them does, and each band keeps its colour
    interpretation. Masked pixels were read as data: trained, counted in the statistics, scored."""
    from ds_seg.data.raster import open_raster
    from ds_seg.data.stac import stac_scenes
    with rasterio.open(catalogue['stacked'][0]) as src:
        profile, rgb = src.profile, src.read()
    h, w = rgb.shape[1:]
    left, top = np.full((h, w), 255, np.uint8), np.full((h, w), 255, np.uint8)
    left[:, :w // 2] = 0
    top[:h // 3] = 0
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True):
        with rasterio.open(tmp_path / 'rgb.tif', 'w', **profile) as d:
            d.write(rgb)
            d.write_mask(left)
        with rasterio.open(tmp_path / 'nir.tif', 'w', **dict(profile, count=1, photometric='MINISBLACK')) as d:
            d.write(rgb[:1])
            d.write_mask(top)
    # An RGBA 'visual' asset: its alpha stays a band tagged alpha (band numbers as the files give
    # them), and its zeros hide pixels like the other assets' masks.
    with rasterio.open(tmp_path / 'rgba.tif', 'w', **dict(profile, count=4, alpha='YES')) as d:
        d.write(np.concatenate([rgb, left[None]]))
    item = pystac.Item(id='masked', geometry=None, bbox=None, properties={}, datetime=datetime.datetime(2024, 5, 1))
    for name, href in (('rgb', 'rgb.tif'), ('nir', 'nir.tif'), ('rgba', 'rgba.tif'), ('label', catalogue['labels'][0])):
        item.add_asset(name, pystac.Asset(href=str(href)))
    with open(tmp_path / 'item.json', 'w') as f:
        json.dump(item.to_dict(transform_hrefs=False), f)
    hidden = (left == 0) | (top == 0)
    for assets, names, nir_band in ((['rgb', 'nir'], ['red', 'green', 'blue', 'gray'], 4),
                                    (['nir', 'rgb'], ['gray', 'red', 'green', 'blue'], 1),
                                    (['rgba', 'nir'], ['red', 'green', 'blue', 'alpha', 'gray'], 5)):
        (stack,), _ = stac_scenes(str(tmp_path / 'item.json'), assets, 'label')
        with open_raster(stack) as src:
            np.testing.assert_array_equal(src.dataset_mask() == 0, hidden)
            assert [c.name for c in src.colorinterp] == names
            np.testing.assert_array_equal(src.read(nir_band), rgb[0])
    with pytest.raises(DataError, match=r'band 4 is tagged as alpha'):  # as a file's alpha is
        GeoTiffScenes(stac=str(tmp_path / 'item.json'), stac_bands=['rgba', 'nir'], stac_label='label',
                      split='val', mode='grid', **dict(KW, mean=[127.5] * 5, std=[73.9] * 5))
    ds = GeoTiffScenes(stac=str(tmp_path / 'item.json'), stac_bands=['rgb', 'nir'], stac_label='label',
                       split='val', mode='grid', **dict(KW, crop_size=max(h, w), mean=[127.5] * 4, std=[73.9] * 4))
    sample = ds[0]
    label = sample['label'].numpy()[:h, :w]
    assert (label[hidden] == 255).all() and (label[~hidden] != 255).all()


def test_a_stacked_items_band_scale_and_offset_are_kept(catalogue, tmp_path):
    """Per-band assets tagged offset -1000 (Sentinel-2 since baseline 04.00) came out of the
    item's VRT as [1, 0]: items of two baselines trained together unchecked, and the model
    recorded [1, 0] for files that carry -1000."""
    from ds_seg.data.raster import open_raster
    from ds_seg.data.stac import stac_scenes
    item = pystac.Item(id='offset', geometry=None, bbox=None, properties={}, datetime=datetime.datetime(2024, 5, 1))
    for name in BANDS:
        path = tmp_path / f'{name}.tif'
        shutil.copy(catalogue['tmp'] / f'scene0_{name}.tif', path)
        with rasterio.open(path, 'r+') as dst:
            dst.offsets, dst.scales = (-1000.0,), (0.0001,)
        item.add_asset(name, pystac.Asset(href=str(path)))
    item.add_asset('label', pystac.Asset(href=str(catalogue['labels'][0])))
    with open(tmp_path / 'item.json', 'w') as f:
        json.dump(item.to_dict(transform_hrefs=False), f)
    (stack,), _ = stac_scenes(str(tmp_path / 'item.json'), list(BANDS), 'label', cache_dir=str(tmp_path / 'vrt'))
    with open_raster(stack) as src:
        assert src.offsets == (-1000.0,) * 3 and src.scales == (0.0001,) * 3
    plain, _ = stac_scenes(str(catalogue['tmp'] / 'item0.json'), list(BANDS), 'label', cache_dir=str(tmp_path / 'vrt'))
    with open_raster(plain[0]) as src:
        assert src.offsets == (0.0,) * 3 and src.scales == (1.0,) * 3
    raw = json.loads((catalogue['tmp'] / 'item0.json').read_text())
    for asset in raw['assets'].values():
        asset['href'] = str(catalogue['tmp'] / asset['href'])
    both = {'type': 'FeatureCollection', 'features': [raw, json.loads((tmp_path / 'item.json').read_text())]}
    (tmp_path / 'both.json').write_text(json.dumps(both))
    with pytest.raises(DataError, match=r"its bands' scale/offset \[\[0.0001, -1000.0\]"):
        GeoTiffScenes(stac=str(tmp_path / 'both.json'), stac_bands=list(BANDS), **KW)


def test_a_stacked_asset_gone_mid_run_is_named_not_called_corrupt(tmp_path):
    """A STAC asset deleted (or its signed URL expired) after the dataset opened it: the line named
    ds_seg's own stacking VRT and asked "corrupt or truncated?". It now names the asset's URL and
    what its server answers now, as for a URL read alone."""
    rng = np.random.default_rng(3)
    common = dict(driver='GTiff', width=1024, height=1024, crs='EPSG:32633', transform=from_origin(400000, 5600000, 1, 1),
                  tiled=True, blockxsize=128, blockysize=128, count=1, dtype='uint8')
    item = pystac.Item(id='big', geometry=None, bbox=None, properties={}, datetime=datetime.datetime(2024, 5, 1))
    for name in BANDS + ['label']:
        with rasterio.open(tmp_path / f'{name}.tif', 'w', **common) as d:
            d.write(rng.integers(0, 3 if name == 'label' else 256, (1, 1024, 1024), dtype=np.uint8))
        item.add_asset(name, pystac.Asset(href=f'{name}.tif', media_type=pystac.MediaType.COG))
    with open(tmp_path / 'item.json', 'w') as f:
        json.dump(item.to_dict(transform_hrefs=False), f)
    with RangeServer(tmp_path) as server:
        ds = GeoTiffScenes(stac=server.url('item.json'), stac_bands=BANDS, stac_label='label', mode='grid',
                           split='val', check_labels=0, **dict(KW, crop_size=128))
        ds[0]
        os.remove(tmp_path / 'green.tif')
        with pytest.raises(DataError) as caught:
            ds[len(ds) - 1]  # a window GDAL has not fetched
    message = str(caught.value)
    assert f"its source {server.url('green.tif')} now answers HTTP response code: 404" in message, message
    assert 'corrupt' not in message, message


def test_nodata_declared_only_in_the_item_masks_the_fill(catalogue):
    """A COG written without a nodata tag, whose item declares raster:bands nodata: the fill was
    read as data (windows over a 0-filled stripe counted no nodata pixel). The declared value now
    marks it, for stacked assets and a single one; a file saying another value is refused."""
    from ds_seg.data.raster import open_raster
    from ds_seg.data.stac import stac_scenes
    collection = json.loads((catalogue['tmp'] / 'items.json').read_text())
    for feature in collection['features']:
        for name in BANDS:
            feature['assets'][name]['raster:bands'] = [{'nodata': 0}]
    declared = catalogue['tmp'] / 'declared_nodata.json'
    declared.write_text(json.dumps(collection))
    for bands in (BANDS, BANDS[:1]):
        images, _ = stac_scenes(str(declared), bands, 'label')
        for image in images:
            with open_raster(image) as src:
                assert src.nodata == 0 and image.endswith('.vrt'), image
    plain, _ = stac_scenes(str(catalogue['tmp'] / 'items.json'), BANDS[:1], 'label')
    assert not plain[0].endswith('.vrt')   # an item that declares nothing: its asset as it is
    path = catalogue['tmp'] / f"scene0_{BANDS[0]}.tif"
    with rasterio.open(path, 'r+') as d:
        d.nodata = 255
    try:
        with pytest.raises(ConfigError, match=rf"STAC item 'scene0': asset .*scene0_{BANDS[0]}\.tif has nodata 255\.0 "
                                              r"in its file but 0\.0 in the item's raster:bands; fix one of them"):
            stac_scenes(str(declared), BANDS, 'label')
    finally:
        with rasterio.open(path, 'r+') as d:
            d.nodata = None
