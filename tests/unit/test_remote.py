"""Rasters over HTTP: window reads of a cloud-optimised GeoTIFF fetch only the tiles they need.

A real HTTP server on 127.0.0.1 (ds_seg.data.rangeserver) serves real GeoTIFFs; GDAL reads
them through /vsicurl/ (http://) and /vsis3/ (s3:// with AWS_S3_ENDPOINT pointing at it).
"""
import os
import re
import shutil

import numpy as np
import pytest
import rasterio
import rasterio.shutil
import torch
from rasterio.transform import from_origin

from ds_seg.config import ConfigError
from ds_seg.data import GeoTiffScenes
from ds_seg.data.geotiff import DataError, gdal_path
from ds_seg.data.raster import open_raster, raster_env
from ds_seg.data.rangeserver import RangeServer

SIZE, TILE = 2048, 128


@pytest.fixture(scope='module')
def cogs(tmp_path_factory):
    """A 2048 px 3-band deflate COG (128 px tiles, overviews) and its label, served on 127.0.0.1."""
    tmp = tmp_path_factory.mktemp('cog')
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (3, SIZE, SIZE), dtype=np.uint8)
    label = (np.arange(SIZE)[:, None] // 100 + np.arange(SIZE)[None] // 70) % 4
    common = dict(driver='GTiff', width=SIZE, height=SIZE, crs='EPSG:32632',
                  transform=from_origin(500000, 5700000, 0.3, 0.3))
    for name, arr in (('img', image), ('lbl', label.astype(np.uint8)[None])):
        plain = str(tmp / f'{name}_plain.tif')
        with rasterio.open(plain, 'w', count=arr.shape[0], dtype='uint8',
                           **({'photometric': 'RGB'} if name == 'img' else {}), **common) as dst:
            dst.write(arr)
        rasterio.shutil.copy(plain, str(tmp / f'{name}.tif'), driver='COG', blocksize=TILE,
                             compress='DEFLATE', overview_resampling='nearest')
        os.remove(plain)
    with RangeServer(tmp) as server:
        yield dict(tmp=tmp, server=server)


def _datasets(paths_local, paths_remote, **kw):
    """The same dataset on local paths and on URLs (explicit stats: no full-scene reads)."""
    kw = {**dict(crop_size=256, classes=4, mean=[127.5] * 3, std=[73.9] * 3, mode='random', seed=3,
                 check_labels=0), **kw}
    return GeoTiffScenes(*paths_local, **kw), GeoTiffScenes(*paths_remote, **kw)


def test_http_windows_fetch_a_small_fraction_and_equal_local_reads(cogs):
    tmp, server = cogs['tmp'], cogs['server']
    local = [str(tmp / 'img.tif')], [str(tmp / 'lbl.tif')]
    remote = [server.url('img.tif')], [server.url('lbl.tif')]
    ds_local, ds_remote = _datasets(local, remote)
    total = os.path.getsize(local[0][0]) + os.path.getsize(local[1][0])
    for i in range(4):
        server.reset()
        a, b = ds_local[i], ds_remote[i]
        fetched = server.bytes_served
        # A 256 px window covers at most 3x3 tiles of 128 px in each file: about 2% of them.
        assert 0 < fetched < 0.05 * total, (fetched, total)
        for key in ('image', 'label', 'nodata'):
            assert torch.equal(a[key], b[key]), key
    grid_local, grid_remote = _datasets(local, remote, split='val', mode='grid')
    for i in (0, len(grid_local) - 1):
        assert torch.equal(grid_local[i]['image'], grid_remote[i]['image'])


def test_s3_urls_read_through_vsis3(cogs, monkeypatch):
    tmp, server = cogs['tmp'], cogs['server']
    # Path-style S3 against the local server: /vsis3/<bucket>/<key> -> GET /<bucket>/<key>.
    for k, v in dict(AWS_S3_ENDPOINT=f'127.0.0.1:{server.port}', AWS_HTTPS='NO',
                     AWS_VIRTUAL_HOSTING='FALSE', AWS_NO_SIGN_REQUEST='YES').items():
        monkeypatch.setenv(k, v)
    bucket = 'bucket'  # a folder of the served root
    os.makedirs(tmp / bucket, exist_ok=True)
    for name in ('img.tif', 'lbl.tif'):
        if not os.path.exists(tmp / bucket / name):
            os.link(tmp / name, tmp / bucket / name)
    assert gdal_path(f's3://{bucket}/img.tif') == f'/vsis3/{bucket}/img.tif'
    ds_local, ds_remote = _datasets(([str(tmp / 'img.tif')], [str(tmp / 'lbl.tif')]),
                                    ([f's3://{bucket}/img.tif'], [f's3://{bucket}/lbl.tif']))
    for i in range(2):
        server.reset()
        assert torch.equal(ds_local[i]['image'], ds_remote[i]['image'])
        assert server.requests > 0  # read from the server, not from a cache of the http:// test


def test_unreachable_url_is_one_line_naming_it(cogs):
    from ds_seg.config import ConfigError
    from ds_seg.inputs import expand_inputs
    url = cogs['server'].url('missing.tif')
    with pytest.raises(DataError, match=r'missing.tif: cannot open: HTTP response code: 404 \(no such file'):
        GeoTiffScenes([url], [url], classes=2, mean=[0], std=[1], check_labels=0)
    with pytest.raises(ConfigError, match=r'--input: .*missing.tif cannot be read: .*404 \(no such file'):
        expand_inputs([url])  # predict.py's check of its inputs


def test_a_server_that_ignores_range_is_refused_in_one_line(cogs):
    """Whole-file answers to ranged GETs would download the COG for every window: refused."""
    from ds_seg.config import ConfigError
    from ds_seg.inputs import expand_inputs
    with RangeServer(cogs['tmp'], honour_range=False) as server:
        url = server.url('img.tif')
        with pytest.raises(DataError, match=r'img.tif: cannot open: .*ignores HTTP Range requests'):
            GeoTiffScenes([url], [server.url('lbl.tif')], classes=4, mean=[0] * 3, std=[1] * 3, check_labels=0)
        with pytest.raises(ConfigError, match=r'--input: .*img.tif cannot be read: .*ignores HTTP Range'):
            expand_inputs([url])


def test_predict_scene_reads_a_url_like_a_file(cogs):
    from tests.unit.test_inference import LookupModel, predict_classes
    tmp, server = cogs['tmp'], cogs['server']
    kw = dict(mean=[0, 0, 0], std=[1, 1, 1], tile=512, overlap=0, batch_size=4)
    local, _ = predict_classes(LookupModel(), str(tmp / 'img.tif'), tmp, **kw)
    server.reset()
    remote, _ = predict_classes(LookupModel(), server.url('img.tif'), tmp, **kw)
    np.testing.assert_array_equal(local, remote)
    assert server.requests > 0


def test_urls_with_any_suffix_or_none_read_like_tif(cogs, tmp_path):
    """GDAL's sidecar probes are off by the empty-directory option, not by a suffix list that
    would turn .gtiff, .cog or no suffix at all into 'does not exist'."""
    import shutil
    for name in ('img.gtiff', 'img.cog', 'img_no_suffix'):
        shutil.copy(cogs['tmp'] / 'img.tif', tmp_path / name)
    window = rasterio.windows.Window(300, 200, 256, 256)
    with rasterio.open(cogs['tmp'] / 'img.tif') as src:
        expected = src.read(window=window)
    with RangeServer(tmp_path) as server:
        for name in ('img.gtiff', 'img.cog', 'img_no_suffix'):
            server.reset()
            with open_raster(server.url(name)) as src:
                np.testing.assert_array_equal(src.read(window=window), expected)
            assert server.bytes_served < os.path.getsize(tmp_path / name) / 4  # ranges, not the file


def test_a_server_that_stops_answering_is_one_line_not_a_hang(cogs, monkeypatch):
    """A server that accepts the connection and sends nothing: the read gives up (GDAL's low-speed
    limit; the user's GDAL_HTTP_LOW_SPEED_TIME wins over ds_seg's minute) and says what happened;
    a STAC document from it likewise (ds_seg's own HTTP time limit)."""
    import time

    from ds_seg.config import ConfigError
    from ds_seg.data import raster
    from ds_seg.data.stac import stac_scenes
    monkeypatch.setenv('GDAL_HTTP_LOW_SPEED_TIME', '2')
    monkeypatch.setattr(raster, 'HTTP_TIMEOUT_S', 2)
    with RangeServer(cogs['tmp'], stall=True) as server:
        t0 = time.monotonic()
        with pytest.raises(DataError, match=r'img.tif: cannot open: .*stopped answering'):
            open_raster(server.url('img.tif'))
        with pytest.raises(ConfigError, match=r"stac='http.*items.json': cannot read a STAC JSON document \(timed out"):
            stac_scenes(server.url('items.json'), ['red'], 'label')
        assert time.monotonic() - t0 < 30


def test_a_server_that_stops_mid_run_is_named_as_stopped_not_as_a_bad_url(cogs, monkeypatch):
    """Windows read, then the server stalls (accepts, never answers) or goes away: the failing
    read says so. GDAL's own words are only "TIFFReadEncodedTile() failed", and ds_seg's request
    of its own got no status either: the line blamed the URL, a permission, or the file."""
    from ds_seg.data import raster
    monkeypatch.setenv('GDAL_HTTP_LOW_SPEED_TIME', '2')
    monkeypatch.setattr(raster, 'HTTP_TIMEOUT_S', 2)
    tmp = cogs['tmp']
    with RangeServer(tmp) as server:
        ds = GeoTiffScenes([server.url('img.tif')], [server.url('lbl.tif')], crop_size=256, classes=4,
                           mean=[127.5] * 3, std=[73.9] * 3, mode='random', seed=3, check_labels=0)
        ds[0]
        server.stall = True
        with pytest.raises(DataError) as stalled:
            for i in range(1, 8):  # (a window in tiles fetched already reads from GDAL's cache)
                ds[i]
        server.stall = False
    message = str(stalled.value)
    assert 'img.tif: cannot read window' in message and 'now timed out: no answer within 2 s' in message
    assert 'the server stopped answering' in message and 'unreachable URL' not in message, message
    with pytest.raises(DataError) as gone:  # the server has shut down: nothing listens on its port
        for i in range(8, 16):
            ds[i]
    message = str(gone.value)
    assert 'could not connect' in message and 'the server is down or unreachable now' in message, message


@pytest.mark.parametrize('etag', [True, False])
def test_a_republished_url_gets_new_band_statistics(tmp_path, monkeypatch, etag):
    """The statistics cache of a URL is keyed to the server's ETag / Last-Modified: a file
    republished under the same URL (new values) is measured again, not served old numbers."""
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    rng = np.random.default_rng(1)
    common = dict(driver='GTiff', width=1024, height=1024, crs='EPSG:32632', transform=from_origin(0, 0, 1, 1),
                  dtype='uint16', tiled=True, blockxsize=256, blockysize=256)

    def publish(values):
        with rasterio.open(tmp_path / 'new.tif', 'w', count=3, **common) as d:
            d.write(values)
        # Within the same second as the first version: Last-Modified alone (no ETag) cannot tell them
        # apart, and the stale statistics were kept.
        os.utime(tmp_path / 'new.tif', ns=(1_700_000_000_000_000_000,) * 2)
        os.replace(tmp_path / 'new.tif', tmp_path / 'img.tif')

    with rasterio.open(tmp_path / 'lbl.tif', 'w', count=1, **common) as d:
        d.write(rng.integers(0, 4, (1, 1024, 1024), dtype=np.uint16))
    image = rng.integers(0, 1000, (3, 1024, 1024), dtype=np.uint16)
    publish(image)
    with RangeServer(tmp_path, etag=etag) as server:
        url, label = server.url('img.tif'), server.url('lbl.tif')
        kw = dict(classes=4, crop_size=64, check_labels=0)
        first = GeoTiffScenes([url], [label], **kw).mean
        # (decimated to 512 px, as the local copy's statistics are)
        np.testing.assert_allclose(first, image.reshape(3, -1).mean(1), rtol=2e-3)
        np.testing.assert_array_equal(first, GeoTiffScenes([str(tmp_path / 'img.tif')], [str(tmp_path / 'lbl.tif')],
                                                           **kw).mean)
        server.reset()
        assert np.array_equal(GeoTiffScenes([url], [label], **kw).mean, first)
        assert server.bytes_served < image.nbytes / 4  # the cache answered: the pixels were not read again
        # (what was read: the version's first and last 64 KiB, and the label check's decimated read)
        publish(image * 20)  # same size, same name, new values (a new ETag)
        second = GeoTiffScenes([url], [label], **kw).mean
    np.testing.assert_allclose(second, first * 20, rtol=1e-6)


def _republish(path, values, mtime_s):
    """Replace the file at ``path`` by a new one of the same layout (tile offsets and sizes) and
    ``values``: its old offsets then hold the new pixels, which GDAL read without a word."""
    with rasterio.open(path) as src:
        profile = src.profile
    tmp = str(path) + '.new'
    with rasterio.open(tmp, 'w', **profile) as dst:
        dst.write(values)
    os.utime(tmp, (mtime_s, mtime_s))
    os.replace(tmp, path)


@pytest.mark.parametrize('etag', [True, False])
def test_a_url_republished_mid_run_is_refused_not_read_as_two_versions_mixed(tmp_path, etag):
    """A file replaced under its URL after the run first read it: a training read and a prediction
    stop with a line saying so (the server's 412 to the version precondition: its
    ETag, or its Last-Modified where it sends none), where GDAL had gone on reading the new file's
    blocks at the old offsets. A new dataset or prediction reads the new version."""
    from tests.unit.test_inference import LookupModel, predict_classes
    rng = np.random.default_rng(2)
    common = dict(driver='GTiff', width=1024, height=1024, crs='EPSG:32632', transform=from_origin(0, 0, 1, 1),
                  tiled=True, blockxsize=128, blockysize=128)
    first = rng.integers(0, 200, (3, 1024, 1024), dtype=np.uint8)
    with rasterio.open(tmp_path / 'img.tif', 'w', count=3, dtype='uint8', **common) as d:
        d.write(first)
    with rasterio.open(tmp_path / 'lbl.tif', 'w', count=1, dtype='uint8', **common) as d:
        d.write(rng.integers(0, 4, (1, 1024, 1024), dtype=np.uint8))
    os.utime(tmp_path / 'img.tif', (1_700_000_000, 1_700_000_000))
    second = (255 - first).astype(np.uint8)
    with RangeServer(tmp_path, etag=etag) as server:
        url = server.url('img.tif')
        ds = GeoTiffScenes([url], [server.url('lbl.tif')], crop_size=128, classes=4, mean=[127.5] * 3,
                           std=[73.9] * 3, mode='grid', split='val', check_labels=0)
        ds[0]
        _republish(tmp_path / 'img.tif', second, 1_700_000_100)
        with pytest.raises(DataError) as caught:
            ds[len(ds) - 1]  # a tile GDAL has not fetched yet
        message = str(caught.value)
        assert message.startswith(f'{url}: cannot read window'), message
        assert f'{url} was replaced since the run first read it' in message, message

        # A prediction: the file is replaced while it runs (at its first forward pass).
        _republish(tmp_path / 'img.tif', first, 1_700_000_200)
        model = LookupModel()

        def republishing(images_BCHW):
            if not getattr(republishing, 'done', False):
                republishing.done = True
                _republish(tmp_path / 'img.tif', second, 1_700_000_300)
            return model(images_BCHW)
        kw = dict(mean=[0, 0, 0], std=[1, 1, 1], tile=256, overlap=0, batch_size=2, block=256)
        with pytest.raises(DataError, match='was replaced since the run first read it'):
            predict_classes(republishing, url, tmp_path, **kw)
        # A new prediction reads the new version, all of it: as the local file predicts.
        remote, _ = predict_classes(model, url, tmp_path, **kw)
        local, _ = predict_classes(model, str(tmp_path / 'img.tif'), tmp_path, **kw)
        np.testing.assert_array_equal(remote, local)
        # A new dataset likewise, the same windows as the local file's.
        kw = dict(crop_size=128, classes=4, mean=[127.5] * 3, std=[73.9] * 3, mode='grid', split='val',
                  check_labels=0)
        ds = GeoTiffScenes([url], [server.url('lbl.tif')], **kw)
        local = GeoTiffScenes([str(tmp_path / 'img.tif')], [str(tmp_path / 'lbl.tif')], **kw)
        for i in (0, len(ds) - 1):
            np.testing.assert_array_equal(ds[i]['image'], local[i]['image'])


def test_the_version_precondition_keeps_the_users_own_gdal_headers(cogs, monkeypatch):
    """The precondition is a path-specific GDAL_HTTP_HEADERS, which replaces the user's for that
    URL: their headers (a token) must go along, split as GDAL splits a one-line list."""
    monkeypatch.setenv('GDAL_HTTP_HEADERS', 'X-Token: abc, X-Other: "a,b"')
    seen = []
    with RangeServer(cogs['tmp']) as server:
        handler = server._httpd.RequestHandlerClass
        plain_get = handler.do_GET
        monkeypatch.setattr(handler, 'do_GET', lambda self: (seen.append(dict(self.headers)), plain_get(self))[1])
        url = server.url('img.tif')
        with open_raster(url) as src, raster_env(url):
            src.read(1, window=((0, 10), (0, 10)))
    gdal = [h for h in seen if 'X-Token' in h]  # (ds_seg's own requests for the version come first)
    assert gdal and all(h['X-Token'] == 'abc' and h['X-Other'] == 'a,b' and h['If-Match'].startswith('"')
                        for h in gdal), seen


def test_urls_read_without_a_writable_home_and_caches_follow_ds_seg_cache(cogs, tmp_path, monkeypatch):
    """A HOME that does not exist (a compute node) failed every run that read a URL: "[Errno 2] No
    such file or directory: '/proc/nohome'", even with mean/std given. The URL caches are best
    effort now, and $DS_SEG_CACHE moves them."""
    local = [str(cogs['tmp'] / 'img.tif')], [str(cogs['tmp'] / 'lbl.tif')]
    remote = [cogs['server'].url('img.tif')], [cogs['server'].url('lbl.tif')]
    monkeypatch.delenv('DS_SEG_CACHE', raising=False)
    monkeypatch.setenv('HOME', '/proc/nohome')
    kw = dict(classes=4, crop_size=64, check_labels=0)
    ds = GeoTiffScenes(*remote, sampling='rare_class', **kw)
    np.testing.assert_allclose(ds.mean, GeoTiffScenes(*local, **kw).mean, rtol=1e-6)
    monkeypatch.setenv('DS_SEG_CACHE', str(tmp_path / 'cache'))
    GeoTiffScenes(*remote, **kw)
    assert any(p.name.startswith('stats-') for p in (tmp_path / 'cache').iterdir())


@pytest.mark.parametrize('gdal_words, hint', [
    ('HTTP response code: 503 - Service Unavailable', 'the server failed; try again later'),
    ('HTTP response code: 500', 'the server failed; try again later'),   # was "unreachable URL, no permission"
    ('HTTP response code: 404', 'no such file at that URL'),
    ('HTTP response code: 403', 'no permission'),
])
def test_what_a_failed_url_read_is_told_to_do(gdal_words, hint):
    from ds_seg.data.raster import remote_hint
    assert remote_hint(RuntimeError(gdal_words)).startswith(f'{gdal_words} ({hint}')


def test_a_url_that_fails_mid_run_says_what_the_server_answers_now(cogs, tmp_path, monkeypatch):
    """An object deleted (or a signed URL expired) after the dataset opened it: GDAL says only
    that a tile read failed; the line adds the server's answer now, and its hint."""
    import shutil
    served = tmp_path / 'served'
    served.mkdir()
    for name in ('img.tif', 'lbl.tif'):
        shutil.copy(cogs['tmp'] / name, served / name)
    with RangeServer(served) as server:
        ds = GeoTiffScenes([server.url('img.tif')], [server.url('lbl.tif')], crop_size=256, classes=4,
                           mean=[127.5] * 3, std=[73.9] * 3, mode='grid', split='val', check_labels=0)
        ds[0]
        os.remove(served / 'img.tif')
        with pytest.raises(DataError) as caught:
            ds[len(ds) - 1]  # another tile: not in GDAL's block cache
        # Where GDAL sends credentials, a plain request's answer (a 401) would blame them wrongly.
        monkeypatch.setenv('GDAL_HTTP_HEADERS', 'X-Token: abc')
        with pytest.raises(DataError) as with_credentials:
            ds[len(ds) // 2]
        monkeypatch.delenv('GDAL_HTTP_HEADERS')
        # predict's and evaluate's later opens of a URL checked before (the band check, the scene
        # itself, the dates check) ended in a bare RasterioIOError traceback.
        from ds_seg.cli.evaluate import refuse_one_date_of_a_series
        from ds_seg.data.raster import open_scene
        from ds_seg.inputs import check_bands
        url = server.url('img.tif')
        for later_open in (lambda: check_bands(url, [1, 2, 3]), lambda: open_scene(url).__enter__(),
                           lambda: refuse_one_date_of_a_series(url, {'model': {'num_dates': 2, 'in_channels': 6}}, None)):
            with pytest.raises(DataError, match=rf'^{re.escape(url)}: cannot open: .*HTTP response code: 404'):
                later_open()
    assert 'failed; the server now answers it with HTTP response code: 404 (no such file at that URL' in str(caught.value)
    assert 'the server now answers' not in str(with_credentials.value)


def test_a_data_loader_workers_error_is_its_own_message():
    """A DataLoader worker's exception reaches the trainer wrapped in the worker's traceback text,
    with GDAL's chained causes first; the line keeps the dataset's own message."""
    from torch.utils.data import DataLoader, Dataset

    from ds_seg.cli.train import _worker_message

    class Failing(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            # GDAL's errors come from C: a cause with no Python traceback of its own.
            raise DataError('http://h/a.tif: cannot read window 3: TIFFReadEncodedTile() failed.\n') \
                from ValueError('TIFFReadEncodedTile:Read error at row 2816; got 0 bytes')

    with pytest.raises(DataError) as caught:
        next(iter(DataLoader(Failing(), num_workers=1)))
    assert str(caught.value).startswith('Caught DataError in DataLoader worker')
    assert _worker_message(caught.value) == 'http://h/a.tif: cannot read window 3: TIFFReadEncodedTile() failed.'


def test_remote_scenes_without_a_valid_labelled_pixel_are_said(cogs, tmp_path):
    """A local set whose images hold only nodata is refused (after a whole read); remote scenes
    are not read whole (a download), so an all-nodata remote set trained to loss 0 without a
    word. The decimated read that found nothing is now said at the start of training."""
    served = tmp_path / 'served'
    served.mkdir()
    common = dict(driver='GTiff', width=256, height=256, crs='EPSG:32632', transform=from_origin(500000, 5700000, 1, 1),
                  tiled=True, blockxsize=128, blockysize=128, dtype='uint8')
    with rasterio.open(served / 'empty.tif', 'w', count=3, nodata=0, **common) as d:
        d.write(np.zeros((3, 256, 256), np.uint8))
    with rasterio.open(served / 'lbl.tif', 'w', count=1, **common) as d:
        d.write(np.ones((1, 256, 256), np.uint8))
    with RangeServer(served) as server:
        kw = dict(crop_size=64, classes=4, mean=[127.5] * 3, std=[73.9] * 3)
        empty = GeoTiffScenes([server.url('empty.tif')], [server.url('lbl.tif')], **kw)
        held = GeoTiffScenes([cogs['server'].url('img.tif')], [cogs['server'].url('lbl.tif')], **kw)
    assert len(empty.notes) == 1 and empty.notes[0].startswith(
        f"{server.url('empty.tif')}: a decimated read shows no pixel both labelled with a class and valid")
    assert not getattr(held, 'notes', None)


def test_a_url_georeferenced_by_a_world_file_is_one_line(tmp_path):
    """A PNG (.pgw) or plain TIFF (.tfw) georeferenced by a world file: GDAL reads it beside a local
    copy, and a URL's open lists no directory. Over HTTP the class map came out at pixel
    coordinates, and evaluate paired the image with a label 10 km away by its size alone. A URL
    with its own georeferencing is opened without a request for a world file; one with none and
    no world file opens as the local copy does."""
    from ds_seg.data.raster import _world_file_beside, open_scene
    pixels = np.random.default_rng(0).integers(1, 255, (3, 32, 32)).astype('uint8')
    plain = dict(width=32, height=32, count=3, dtype='uint8')
    for name, driver, world in (('w.png', 'PNG', 'w.pgw'), ('w.tif', 'GTiff', 'w.tfw'), ('n.png', 'PNG', None),
                                ('v.tif', 'GTiff', 'v.wld')):
        with rasterio.open(tmp_path / name, 'w', driver=driver, **plain) as d:
            d.write(pixels)
        if world:
            (tmp_path / world).write_text('0.5\n0\n0\n-0.5\n500000.25\n5599999.75\n')
    with rasterio.open(tmp_path / 'g.tif', 'w', driver='GTiff', crs='EPSG:32633',
                       transform=from_origin(500000, 5600000, 0.5, 0.5), **plain) as d:
        d.write(pixels)
    (tmp_path / 'g.tfw').write_text('1\n0\n0\n-1\n0\n0\n')   # ignored by GDAL: the file's own comes first
    with rasterio.open(tmp_path / 'w.png') as local:   # what the local copy gives
        assert local.transform == from_origin(500000, 5600000, 0.5, 0.5)
    with RangeServer(tmp_path) as server:
        for name, world in (('w.png', 'w.pgw'), ('w.tif', 'w.tfw'), ('v.tif', 'v.wld')):
            with pytest.raises(DataError) as refused:
                with open_scene(server.url(name)):
                    pass
            assert str(refused.value) == (
                f"{server.url(name)}: {server.url(world)} beside it holds its georeferencing (a world file), which is "
                "not read over HTTP; embed it (gdal_translate the file to a GeoTIFF, which carries it), or download "
                "both and give the local path.")
        with open_scene(server.url('n.png')) as src:
            assert src.transform.is_identity and src.crs is None
        _world_file_beside.cache_clear()
        server.reset()
        with open_scene(server.url('g.tif')) as src:
            assert src.transform == from_origin(500000, 5600000, 0.5, 0.5)
        assert _world_file_beside.cache_info().currsize == 0


def test_a_url_with_a_mask_or_georeferencing_beside_it_is_one_line(tmp_path):
    """Remote reads do not look beside a URL: a PNG's georeferencing in its .aux.xml was lost (CRS
    None, identity transform) and a .tif.msk mask ignored (masked pixels predicted as data), where
    the local copies had them. A .aux.xml of statistics only (QGIS writes them beside COGs) is fine."""
    from ds_seg.data.raster import open_scene, remote_sidecar_refusal, uses_mask_band
    pixels = np.random.default_rng(0).integers(1, 255, (3, 64, 64)).astype('uint8')
    grid = dict(width=64, height=64, count=3, dtype='uint8', crs='EPSG:32633',
                transform=from_origin(500000, 5600000, 0.5, 0.5))
    with rasterio.open(tmp_path / 's.png', 'w', driver='PNG', **grid) as d:   # georeferencing -> s.png.aux.xml
        d.write(pixels)
    mask = np.full((64, 64), 255, np.uint8)
    mask[:20, :20] = 0
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=False):
        with rasterio.open(tmp_path / 'm.tif', 'w', driver='GTiff', **grid) as d:   # mask -> m.tif.msk
            d.write(pixels)
            d.write_mask(mask)
    with rasterio.open(tmp_path / 'c.tif', 'w', driver='GTiff', **grid) as d:
        d.write(pixels)
    (tmp_path / 'c.tif.aux.xml').write_text('<PAMDataset><PAMRasterBand band="1"><Metadata><MDI key="STATISTICS_MEAN">'
                                            '127</MDI></Metadata></PAMRasterBand></PAMDataset>')
    assert (tmp_path / 's.png.aux.xml').exists() and (tmp_path / 'm.tif.msk').exists()
    with RangeServer(tmp_path) as server:
        with pytest.raises(DataError, match=r's.png.aux.xml beside it holds its SRS, GeoTransform, which is not read '
                                            r'over HTTP; embed it'):
            with open_scene(server.url('s.png')):
                pass
        with pytest.raises(DataError, match=r'm.tif.msk beside it holds its mask, which is not read over HTTP'):
            open_raster(server.url('m.tif'))
        with open_scene(server.url('c.tif')) as src:
            assert src.crs == grid['crs']
        signed = server.url('m.tif?X-Amz-Signature=abc')   # this server ignores the query: the sibling is found
        assert 'm.tif.msk beside it' in remote_sidecar_refusal(signed)
        # Checked where a file is opened, not in raster_env, which wraps every window read: there
        # its requests hung on the read path (cached per process, up to 4096 URLs).
        from ds_seg.data.raster import raster_env
        remote_sidecar_refusal.cache_clear()
        server.reset()
        with raster_env(server.url('m.tif')):
            pass
        assert server.requests == 0
        with pytest.raises(DataError, match=r'm.tif.msk beside it'):
            open_raster(server.url('m.tif'))
        # GDAL's own spelling of the URL was read without a word, masked pixels as data.
        with pytest.raises(DataError, match=r'm.tif.msk beside it holds its mask'):
            open_raster('/vsicurl/' + server.url('m.tif'))
        # A local file opened while a URL is open (evaluate.py: a URL label, a local image) keeps
        # its .msk: under the URL's options GDAL listed no directory, and masked pixels were scored.
        with open_scene(server.url('c.tif')), open_scene(str(tmp_path / 'm.tif')) as local:
            assert int((local.read_masks(1) == 0).sum()) == 20 * 20
        # ... and so do local dates of a time series, each opened by open_raster.
        for suffix in ('', '.msk'):
            shutil.copy(tmp_path / f'm.tif{suffix}', tmp_path / f'm2.tif{suffix}')
        with open_scene(server.url('c.tif')), open_scene([str(tmp_path / 'm.tif'), str(tmp_path / 'm2.tif')]) as dates:
            assert uses_mask_band(dates) and int((dates.dataset_mask() == 0).sum()) == 20 * 20
    # A site that answers every path with a page (catch-all, soft 404, login portal): c.tif has
    # no mask, and was refused for the page its .msk address got.
    remote_sidecar_refusal.cache_clear()
    with RangeServer(tmp_path, catch_all=True) as server:
        assert remote_sidecar_refusal(server.url('c.tif')) is None
        with open_scene(server.url('c.tif')) as src:
            assert src.crs == grid['crs']
        assert 'm.tif.msk beside it holds its mask' in remote_sidecar_refusal(server.url('m.tif'))
        # The page that site sends for a file it lacks is said to be one (it was "unreachable URL,
        # no permission, or not a raster"), opened by a dataset or checked by predict/evaluate.
        from ds_seg.inputs import expand_inputs
        page = 'the server answers it with a web page (HTTP 200), not a raster: a login or error page?'
        with pytest.raises(DataError, match=r'gone.tif: cannot open: .*' + re.escape(page)):
            open_raster(server.url('gone.tif'))
        with pytest.raises(ConfigError, match=r'^--input: .*gone.tif cannot be read: .*' + re.escape(page)):
            expand_inputs([server.url('gone.tif')])


def test_one_remote_scene_under_two_signed_urls_is_given_twice(cogs):
    """Signed URLs carry a new signature each time they are made: a list of them repeated a scene
    that evaluate.py scored twice (every pixel counted twice). The server's ETag says it is one
    file; addresses of other files, or without an ETag to go by, are not asked about."""
    from ds_seg.data.geotiff import refuse_repeated_scenes
    server = cogs['server']
    img, lbl = server.url('img.tif'), server.url('lbl.tif')
    with pytest.raises(DataError, match=r"^--images: .*img.tif\?sig=2 is given twice \(also as .*img.tif\?sig=1\)"):
        refuse_repeated_scenes([img + '?sig=1', img + '?sig=2'], '--images')
    with pytest.raises(DataError, match=r'is given twice'):
        refuse_repeated_scenes([img, img + '?sig=2'], '--images')
    with pytest.raises(DataError, match=r'is given twice'):
        refuse_repeated_scenes([img + '?sig=1', img + '?sig=2'], 'images', labels=[lbl + '?a=1', lbl + '?a=2'])
    server.reset()
    refuse_repeated_scenes([img + '?sig=1', lbl + '?sig=1'], '--images')   # two files: no request made
    assert server.requests == 0
    refuse_repeated_scenes([img + '?sig=1', img + '?sig=2'], 'images', labels=[lbl, img])   # other labels: two scenes
