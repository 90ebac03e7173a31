"""Opening rasters and reading windows of them, with what marks pixels that hold no data.

Shared by training (:class:`~ds_seg.data.geotiff.GeoTiffScenes`) and whole-scene prediction
(:mod:`ds_seg.inference`), so both read the same pixels and call the same pixels nodata:
the image's nodata value in every band (NaN-aware), any non-finite value of a floating-point
image, and 0 in a GDAL mask band or alpha (used when the file has no nodata value). Paths may
be URLs (read through GDAL's virtual file systems) or, for a time series, lists of dates.

Example::

    with open_scene('scene.tif') as src:
        pixels, invalid = read_window(src, Window(0, 0, 512, 512), [1, 2, 3], src.nodata,
                                      uses_mask_band(src))
"""
import contextlib
import math
import os
import warnings

import numpy as np
import rasterio
from rasterio.enums import MaskFlags
from rasterio.errors import NotGeoreferencedWarning

from ds_seg.config import ConfigError


class DataError(ConfigError):
    """Bad input data (missing/corrupt file, mismatched pair, bad labels), found before training.

    A :class:`~ds_seg.config.ConfigError` (so a ``ValueError``): ``launch/train.py`` prints its
    one-line message, which names the file(s), and stops before training starts.
    """


# URL schemes GDAL reads through its virtual file systems: only the byte ranges of the blocks
# under a window travel, so a 10 GB cloud-optimised GeoTIFF is never downloaded whole.
_VSI_PREFIXES = {'http://': '/vsicurl/', 'https://': '/vsicurl/', 's3://': '/vsis3/',
                 'gs://': '/vsigs/', 'az://': '/vsiaz/'}
# What remote reads need, in one place (rasterio.Env around every remote open and read):
REMOTE_GDAL_OPTIONS = dict(
    GDAL_DISABLE_READDIR_ON_OPEN='EMPTY_DIR',  # no directory listing (one request, not hundreds)
    CPL_VSIL_CURL_ALLOWED_EXTENSIONS='.tif,.tiff,.TIF,.TIFF,.vrt,.jp2,.img',  # no probes for .aux.xml, .ovr
    VSI_CACHE=True, VSI_CACHE_SIZE=32 << 20,  # per-file cache of fetched ranges (header, IFDs)
    GDAL_HTTP_MERGE_CONSECUTIVE_RANGES='YES',  # adjacent tiles of a window: one request
    GDAL_HTTP_MULTIPLEX='YES',                 # HTTP/2: parallel ranges on one connection
    GDAL_HTTP_MAX_RETRY=4, GDAL_HTTP_RETRY_DELAY=0.5,  # a 429/503 from object storage is transient
)


def is_remote(path):
    """True for ``http(s)://``, ``s3://``, ``gs://``, ``az://`` URLs and ``/vsi*`` paths."""
    path = os.fspath(path)
    return path.startswith(tuple(_VSI_PREFIXES)) or path.startswith('/vsi')


def gdal_path(path):
    """The name GDAL opens: ``https://h/a.tif`` -> ``/vsicurl/https://h/a.tif``, ``s3://b/k`` ->
    ``/vsis3/b/k``; local paths and ``/vsi*`` names unchanged.

    Example::

        assert gdal_path('s3://bucket/scene.tif') == '/vsis3/bucket/scene.tif'
    """
    path = os.fspath(path)
    for scheme, prefix in _VSI_PREFIXES.items():
        if path.startswith(scheme):
            return prefix + (path if prefix == '/vsicurl/' else path[len(scheme):])
    return path


def raster_env(path):
    """``rasterio.Env`` with :data:`REMOTE_GDAL_OPTIONS` for a remote path, else a no-op context.

    Example::

        with raster_env(url), rasterio.open(gdal_path(url)) as src:
            block = src.read(1, window=Window(0, 0, 512, 512))
    """
    # A VRT (STAC bands stacked) may point at remote assets: its reads need the options too.
    if is_remote(path) or os.fspath(path).lower().endswith('.vrt'):
        return rasterio.Env(**REMOTE_GDAL_OPTIONS)
    return contextlib.nullcontext()


def remote_hint(exc):
    """GDAL's error for a URL, with what to do about the usual causes."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if 'Range downloading not supported' in message:
        return (f"{message} (the server ignores HTTP Range requests, so every window would fetch "
                f"the whole file; serve it from one that honours Range, or download it and give "
                f"the local path)")
    if 'response code: 404' in message or 'response code: 410' in message:
        return f"{message} (no such file at that URL; check the address)"
    if 'response code: 401' in message or 'response code: 403' in message:
        return f"{message} (no permission; set GDAL's credentials, e.g. AWS_* for s3://)"
    return f"{message} (unreachable URL, no permission, or not a raster)"


def open_raster(path):
    """``rasterio.open`` with the two user errors turned into one line naming the file.

    URLs (:func:`is_remote`) open through GDAL's virtual file systems with
    :data:`REMOTE_GDAL_OPTIONS`.
    """
    if is_remote(path):
        try:
            with raster_env(path), warnings.catch_warnings():
                warnings.simplefilter('ignore', NotGeoreferencedWarning)
                return rasterio.open(gdal_path(path))
        except rasterio.errors.RasterioIOError as e:
            raise DataError(f"{path}: cannot open: {remote_hint(e)}") from e
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', NotGeoreferencedWarning)  # PNG/JPG patches
            return rasterio.open(path)
    except rasterio.errors.RasterioIOError as e:
        raise DataError(f"{path}: not a readable raster (corrupt or not an image): {e}") from e


class StackedRaster:
    """Co-registered rasters of one scene at several dates, read as one raster of T*C bands.

    Bands are date-major: band ``t * C + b`` (1-based ``b``) is band ``b`` of date ``t``, the
    layout :class:`~ds_seg.data.geotiff.GeoTiffScenes` yields for a time series and
    :class:`~ds_seg.models.temporal.TemporalSegmentor` expects. Enough of a rasterio dataset
    for whole-scene prediction (``count``, ``dtypes``, ``nodata``, ``profile``, ``read``,
    ``dataset_mask``, ``mask_flag_enums``).

    Example::

        with StackedRaster(['may.tif', 'aug.tif']) as src:      # 2 dates x 4 bands
            x = src.read(window=Window(0, 0, 256, 256))          # (8, 256, 256)
    """

    def __init__(self, paths):
        self.paths = [os.fspath(p) for p in paths]
        self.check(self.paths)
        self._srcs = [open_raster(p) for p in self.paths]
        first = self._srcs[0]
        self.per_date = first.count
        self.count = first.count * len(self._srcs)
        self.dtypes = tuple(first.dtypes) * len(self._srcs)
        self.nodata, self.height, self.width = first.nodata, first.height, first.width
        self.crs, self.transform = first.crs, first.transform
        self.mask_flag_enums = tuple(first.mask_flag_enums) * len(self._srcs)
        self.profile = dict(first.profile, count=self.count)

    @staticmethod
    def check(paths):
        """Refuse dates that are not on one grid (size, transform, CRS, band count)."""
        grids = []
        for p in paths:
            with open_raster(p) as src:
                grids.append((src.width, src.height, tuple(src.transform)[:6], src.crs, src.count))
        for p, g in zip(paths[1:], grids[1:]):
            if g != grids[0]:
                raise DataError(f"{p} is not co-registered with {paths[0]} (size, transform, CRS or "
                                f"band count differ: {g[:2]} {g[2]} {g[3]} {g[4]} vs {grids[0][:2]} "
                                f"{grids[0][2]} {grids[0][3]} {grids[0][4]}); resample the dates onto one grid")

    def read(self, indexes=None, window=None):
        idx = list(range(1, self.count + 1)) if indexes is None else [int(i) for i in indexes]
        out = []
        for i in idx:
            t, b = divmod(i - 1, self.per_date)
            with raster_env(self.paths[t]):
                out.append(self._srcs[t].read(b + 1, window=window))
        return np.stack(out)

    def dataset_mask(self, window=None):
        masks = []
        for p, s in zip(self.paths, self._srcs):
            with raster_env(p):
                masks.append(s.dataset_mask(window=window))
        return np.minimum.reduce(masks)

    def close(self):
        for s in self._srcs:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


@contextlib.contextmanager
def open_scene(path):
    """A whole scene for prediction: one raster (path or URL), or a list of dates stacked
    (:class:`StackedRaster`); remote reads get :data:`REMOTE_GDAL_OPTIONS`.

    Example::

        with open_scene(['may.tif', 'aug.tif']) as src:
            print(src.count, src.height, src.width)
    """
    if isinstance(path, (list, tuple)):
        with StackedRaster(path) as src:
            yield src
        return
    with raster_env(path), rasterio.open(gdal_path(path)) as src:
        yield src


def uses_mask_band(src):
    """True where a GDAL mask band or alpha, not a nodata value, marks the invalid pixels."""
    return src.nodata is None and any(MaskFlags.per_dataset in f or MaskFlags.alpha in f
                                      for f in src.mask_flag_enums)


def nodata_mask(raw_CHW, nodata):
    """Pixels where every band equals ``nodata`` (NaN-aware); in floating-point images also
    pixels with a non-finite value.

    Example::

        nodata_mask(np.array([[[0, 5]], [[0, 0]]]), 0)   # [[True, False]]
    """
    out = np.zeros(raw_CHW.shape[1:], bool)
    if nodata is not None:
        if isinstance(nodata, float) and math.isnan(nodata):
            out |= np.isnan(raw_CHW).all(axis=0)
        else:
            out |= (raw_CHW == nodata).all(axis=0)
    if raw_CHW.dtype.kind == 'f':
        out |= ~np.isfinite(raw_CHW).all(axis=0)
    return out


def read_window(src, window, indexes, nodata, masked):
    """``(pixels, invalid)`` of ``window`` of an open raster: bands ``indexes`` in the file's
    dtype, and the pixels that hold no data (:func:`nodata_mask`, and with ``masked``
    (:func:`uses_mask_band`) those the mask band marks), or None where no pixel can be
    invalid (no nodata value, integer bands, no mask band).

    Example::

        pixels, invalid = read_window(src, Window(0, 0, 256, 256), [1, 2, 3], src.nodata, False)
    """
    raw = src.read(indexes=indexes, window=window)
    invalid = None
    if nodata is not None or raw.dtype.kind == 'f':
        invalid = nodata_mask(raw, nodata)
    if masked:
        bad = src.dataset_mask(window=window) == 0
        invalid = bad if invalid is None else invalid | bad
    return raw, invalid
