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
import functools
import hashlib
import math
import os
import re
import warnings

import numpy as np
import rasterio
from rasterio.enums import ColorInterp, MaskFlags, Resampling
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
# What remote reads need, in one place (rasterio.Env around every remote open and read). A GDAL
# option the user sets in the environment wins over these (raster_env).
REMOTE_GDAL_OPTIONS = dict(
    # No directory listing, so no probes for .aux.xml/.ovr sidecars either: one request to open,
    # whatever the file is called (.tif, .gtiff, no suffix, a signed URL).
    GDAL_DISABLE_READDIR_ON_OPEN='EMPTY_DIR',
    VSI_CACHE=True, VSI_CACHE_SIZE=32 << 20,  # per-file cache of fetched ranges (header, IFDs)
    # GDAL also keeps what it fetched of a URL for the life of the process, across opens: a file
    # republished under the same URL would be read as old and new bytes mixed. Per handle only.
    CPL_VSIL_CURL_NON_CACHED='/vsicurl/:/vsis3/:/vsigs/:/vsiaz/',
    GDAL_HTTP_MERGE_CONSECUTIVE_RANGES='YES',  # adjacent tiles of a window: one request
    GDAL_HTTP_MULTIPLEX='YES',                 # HTTP/2: parallel ranges on one connection
    GDAL_HTTP_MAX_RETRY=4, GDAL_HTTP_RETRY_DELAY=0.5,  # a 429/503 from object storage is transient
    # A server that accepts the connection and then sends nothing would hold a read (and a run's
    # start-up, which defers Slurm's stop signals) forever: give up after a minute without a byte.
    # A slow but live link is not cut, as a total-time limit would cut a large window.
    GDAL_HTTP_CONNECTTIMEOUT=30, GDAL_HTTP_LOW_SPEED_TIME=60, GDAL_HTTP_LOW_SPEED_LIMIT=1,
)
# The same limits for the plain HTTP requests ds_seg makes itself (STAC documents, HEAD for caches).
HTTP_TIMEOUT_S = 60


def same_file_key(path):
    """What two spellings of one file share (``a.tif``, ``./x/../a.tif``, a symbolic or hard
    link to it): its device and inode; a URL as given."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return path
    return st.st_dev, st.st_ino


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


def remote_gdal_options(**extra):
    """:data:`REMOTE_GDAL_OPTIONS` (and ``extra``) less those the user set in the environment,
    which win: what ``raster_env`` and ``vector_labels.vector_env`` give GDAL."""
    return {k: v for k, v in {**REMOTE_GDAL_OPTIONS, **extra}.items() if k not in os.environ}


def raster_env(path):
    """``rasterio.Env`` with :data:`REMOTE_GDAL_OPTIONS` for a remote path, else a no-op context.

    Example::

        with raster_env(url), rasterio.open(gdal_path(url)) as src:
            block = src.read(1, window=Window(0, 0, 512, 512))
    """
    # A VRT (STAC bands stacked) may point at remote assets: its reads need the options too.
    if is_remote(path) or os.fspath(path).lower().endswith('.vrt'):
        return rasterio.Env(**remote_gdal_options())
    return contextlib.nullcontext()


def opening_env(path):
    """:func:`raster_env` for opening ``path``: a URL with a sidecar its remote reads would miss is
    refused first (:func:`remote_sidecar_refusal`). At opening only, not in ``raster_env``, which
    wraps every window read: the check's requests stay off the read path.

    A local file opens with GDAL's own directory listing even inside a remote file's environment
    (evaluate.py holds a URL label open while the local image is opened): under the remote
    ``EMPTY_DIR`` GDAL never saw the image's ``.msk``, and masked pixels were scored as data."""
    if not is_remote(path) and not os.fspath(path).lower().endswith('.vrt'):
        return rasterio.Env(GDAL_DISABLE_READDIR_ON_OPEN=os.environ.get('GDAL_DISABLE_READDIR_ON_OPEN', 'FALSE'))
    refusal = remote_sidecar_refusal(os.fspath(path)) if is_remote(path) else None
    if refusal:
        raise DataError(refusal)
    for url in [path] if is_remote(path) else _vrt_sources(os.fspath(path)):
        pin_version(url)
    return raster_env(path)


# ----------------------------------------------------------------------------------------------
# One version of a remote file per run: GDAL reads a URL range by range, for as long as the run
# lasts; a file republished under the same URL mid-run would be read as windows of both versions
# (blocks at the old offsets of the new file), without a word. Every request GDAL makes for a URL
# carries the version first seen as a precondition (If-Match its ETag, or If-Unmodified-Since
# its Last-Modified), as a GDAL path-specific option: the server answers 412 once the file has
# changed, and the read stops with a line saying so. Process-wide, so DataLoader workers forked
# later inherit it; a new dataset or scene prediction pins afresh (refresh=True).
# ----------------------------------------------------------------------------------------------
_PINNED = {}  # url -> the precondition header its requests carry (None: the server names no version)


@functools.lru_cache(maxsize=1)
def _libgdal():
    """The GDAL library rasterio uses (ctypes), or None. Not any libgdal in the process: pyogrio
    loads one of its own, whose options rasterio's reads never see. A symbol looked up through
    rasterio's extension module resolves in the libraries it links, its GDAL."""
    import ctypes

    import rasterio._base
    try:
        lib = ctypes.CDLL(rasterio._base.__file__)
        lib.VSISetPathSpecificOption.argtypes = [ctypes.c_char_p] * 3
        lib.VSIClearPathSpecificOptions.argtypes = [ctypes.c_char_p]
    except (OSError, AttributeError):  # a GDAL before 3.6
        return None
    return lib


def _version_precondition(url):
    """The precondition header naming the version ``url`` serves now, or None: one-byte GET (a
    signed URL is signed for GET; a HEAD of it is refused)."""
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={'Range': 'bytes=0-0'}),
                                    timeout=min(10, HTTP_TIMEOUT_S)) as r:
            etag, modified = r.headers.get('ETag'), r.headers.get('Last-Modified')
    except (OSError, ValueError):
        return None
    # If-Match compares strongly: a weak ETag (W/"..."; a compressing proxy) would never match.
    if etag and not etag.startswith('W/'):
        return f'If-Match: {etag}'
    return f'If-Unmodified-Since: {modified}' if modified else None


def pin_version(path, refresh=False):
    """Make GDAL's reads of an http(s) URL ``path`` from now on require the version it serves
    now (once per process; ``refresh``: again). Other paths: nothing."""
    url = os.fspath(path)
    url = url[len('/vsicurl/'):] if url.startswith('/vsicurl/') else url
    if not url.startswith(('http://', 'https://')) or (url in _PINNED and not refresh):
        return
    lib = _libgdal()
    if lib is None:
        return
    header = _version_precondition(url)
    prefix = ('/vsicurl/' + url).encode()
    lib.VSIClearPathSpecificOptions(prefix)
    _PINNED[url] = header
    if header:
        # A path-specific option replaces the global one for this path: the user's own headers
        # (a token) go along. Lines end in CRLF: GDAL reads a value without one as a
        # comma-separated list and strips its double quotes, an ETag's.
        user = os.environ.get('GDAL_HTTP_HEADERS')
        if not user:
            lines = []
        elif '\r\n' in user:
            lines = [line for line in user.split('\r\n') if line.strip()]
        else:
            lines = _gdal_header_list(user)
        lib.VSISetPathSpecificOption(prefix, b'GDAL_HTTP_HEADERS',
                                     ''.join(f'{line}\r\n' for line in [*lines, header]).encode())


def _gdal_header_list(value):
    """The headers a one-line GDAL_HTTP_HEADERS names, split as GDAL splits it (CSLTokenizeString2
    with CSLT_HONOURSTRINGS): at commas outside double quotes, the quotes dropped, ``\\"`` and
    ``\\\\`` inside them unescaped."""
    parts, token, quoted, i = [], [], False, 0
    while i < len(value):
        c = value[i]
        if quoted and c == '\\' and i + 1 < len(value) and value[i + 1] in '"\\':
            token.append(value[i + 1])
            i += 1
        elif c == '"':
            quoted = not quoted
        elif c == ',' and not quoted:
            parts.append(''.join(token))
            token = []
        else:
            token.append(c)
        i += 1
    parts.append(''.join(token))
    return [part.strip() for part in parts if part.strip()]


def pin_versions(paths):
    """:func:`pin_version` afresh for every URL in ``paths`` (a path, or lists of them: dates),
    and every URL a local VRT among them reads: where a dataset or a scene prediction starts."""
    if isinstance(paths, (str, os.PathLike)):
        path = os.fspath(paths)
        for url in [path] if is_remote(path) else _vrt_sources(path) if path.lower().endswith('.vrt') else []:
            pin_version(url, refresh=True)
    elif isinstance(paths, (list, tuple)):
        for p in paths:
            pin_versions(p)


def replaced_since_pinned(url):
    """True when the http(s) ``url`` was pinned and now serves another version."""
    url = os.fspath(url)
    url = url[len('/vsicurl/'):] if url.startswith('/vsicurl/') else url
    pinned = _PINNED.get(url)
    return bool(pinned) and _version_precondition(url) not in (None, pinned)


# What in a PAM file (.aux.xml) changes where a raster's pixels are or what they mean; the rest
# (statistics, histograms, metadata QGIS writes beside a COG) changes nothing ds_seg reads.
_PAM_MEANING = ('<SRS', '<GeoTransform', '<GCPList', '<NoDataValue', '<Offset', '<Scale')


@functools.lru_cache(maxsize=4096)
def remote_sidecar_refusal(url):
    """One line for an http(s) URL with a file beside it that GDAL reads for a local copy and that
    ds_seg's remote reads do not look for (no directory listing over HTTP: one request to open):
    an external mask (``.msk``), or a PAM file (``.aux.xml``) holding georeferencing, nodata or
    scale (a PNG's CRS and transform). Else None. Once per URL and process, by small requests; a
    signed URL's signature does not cover its siblings, which then read as absent. Without this a
    URL's prediction lost its CRS and transform, or predicted masked pixels as data, where the
    local copy's did not."""
    # GDAL's own spelling of a URL (/vsicurl/https://...) lists no directory either.
    http = url[len('/vsicurl/'):] if url.startswith('/vsicurl/') else url
    if not http.startswith(('http://', 'https://')):
        return None
    base, sep, query = http.partition('?')
    fix = "embed it (gdal_translate the file to a GeoTIFF, which carries it), or download both and give the local path."
    # (10 s at most each: a server that does not answer is left to the read's own time limit.)
    # A TIFF, not any answer: a site that answers every path (a catch-all page, a soft 404, a
    # login portal) gave every COG a mask it does not have, and refused it.
    if _http_head(base + '.msk' + sep + query, 4) in TIFF_MAGICS:
        return f"{url}: {base}.msk beside it holds its mask, which is not read over HTTP; {fix}"
    pam = _http_text(base + '.aux.xml' + sep + query)
    said = [tag[1:] for tag in _PAM_MEANING if pam and tag in pam]
    if said:
        return (f"{url}: {base}.aux.xml beside it holds its {', '.join(said)}, which is not read over HTTP; {fix}")
    return None


def refuse_lost_world_file(url, src):
    """Close ``src`` and raise DataError in one line where it is an http(s) URL opened without
    georeferencing while a world file beside it (``.tfw``, ``.pgw``, ``.wld``...) holds it: GDAL
    reads that file for a local copy, and the remote open lists no directory. A URL whose file
    carries its own georeferencing is left alone (GDAL prefers that to a world file anyway),
    without a request. Without this a PNG or GeoTIFF georeferenced by a world file predicted to a
    class map at pixel coordinates, and evaluate paired it with a label 10 km away by its size."""
    if not is_remote(url) or src.crs or src.gcps[0] or not src.transform.is_identity:
        return
    found = _world_file_beside(os.fspath(url))
    if found:
        src.close()
        raise DataError(f"{url}: {found} beside it holds its georeferencing (a world file), which is not read over "
                        "HTTP; embed it (gdal_translate the file to a GeoTIFF, which carries it), or download both and "
                        "give the local path.")


@functools.lru_cache(maxsize=4096)
def _world_file_beside(url):
    """The URL of the world file GDAL would read beside ``url`` (its names for the extension:
    ``.tfw``/``.tifw`` for ``.tif``, ``.pgw``/``.pngw`` for ``.png``..., then ``.wld``), or None.
    Six numbers, not any answer: a site that answers every path (a soft 404) holds none."""
    http = url[len('/vsicurl/'):] if url.startswith('/vsicurl/') else url
    base, sep, query = http.partition('?')
    stem, dot, ext = base.rpartition('.')
    if not dot or '/' in ext or not ext:
        return None
    for name in dict.fromkeys((ext[0] + ext[-1] + 'w', ext + 'w', 'wld')):
        text = _http_text(f'{stem}.{name}{sep}{query}', limit=1024)
        try:
            if text is not None and len([float(v) for v in text.split()]) == 6:
                return f'{stem}.{name}'
        except ValueError:
            continue
    return None


TIFF_MAGICS = (b'II*\x00', b'MM\x00*', b'II+\x00', b'MM\x00+')   # TIFF and BigTIFF, either byte order


def _http_head(url, size):
    """The first ``size`` bytes at ``url``, or None where there are none (an error status, no answer)."""
    import urllib.request
    try:
        request = urllib.request.Request(url, headers={'Range': f'bytes=0-{size - 1}'})
        with urllib.request.urlopen(request, timeout=min(10, HTTP_TIMEOUT_S)) as r:
            return r.read(size)
    except (OSError, ValueError):
        return None


def _http_text(url, limit=1 << 20):
    """The text at ``url`` (at most ``limit`` bytes), or None where there is none."""
    head = _http_head(url, limit)
    return None if head is None else head.decode('utf-8', 'replace')


def gdal_message(exc):
    """The first line of GDAL's own error: rasterio's "Read failed. See previous exception"
    wraps it as the cause."""
    while exc.__cause__ is not None and 'See previous exception' in str(exc):
        exc = exc.__cause__
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def same_value(a, b):
    """Equality of two nodata values or pixel values, where NaN equals NaN (as a nodata tag means it)."""
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def read_error(path, exc):
    """What to say of a failed read of ``path``: GDAL's own words, and for a URL what to do."""
    message = gdal_message(exc)
    urls = [path] if is_remote(path) else _vrt_sources(path) if os.fspath(path).lower().endswith('.vrt') else []
    replaced = [url for url in urls if replaced_since_pinned(url)]
    if replaced or re.search(r'response code: 412\b', message):
        return (f"{message.rstrip('.')}: {' and '.join(replaced) or 'the file at this URL'} was replaced since the "
                "run first read it, and windows of the two versions would mix; start again to read the new "
                "version, or publish each version under a URL of its own")
    if not is_remote(path):
        # A VRT of URLs (STAC assets stacked): which of them fails now, as for a URL read alone.
        for url in (u for u in urls if str(u).startswith(('http://', 'https://'))):
            status = http_status(url, timeout=min(10, HTTP_TIMEOUT_S))
            if isinstance(status, int) and status >= 400:
                return f'{message.rstrip(".")}; its source {url} now answers HTTP response code: {status}'
            if isinstance(status, str):
                return f'{message.rstrip(".")}; a request for its source {url} now {status}'
        return message
    if ('response code' not in message and os.fspath(path).startswith(('http://', 'https://'))
            and not any(os.environ.get(k) for k in _GDAL_HTTP_CREDENTIALS)):
        # A block read that fails mid-run says only "TIFFReadEncodedTile() failed": ask the
        # server what it answers now (an expired signed URL, a deleted object). Not where GDAL
        # sends credentials this plain request would lack: its 401 would blame them wrongly.
        status = http_status(path, timeout=min(10, HTTP_TIMEOUT_S))
        if isinstance(status, int) and status >= 400:
            message = f'{message.rstrip(".")}; the server now answers it with HTTP response code: {status}'
        elif isinstance(status, str):  # no answer at all: a stalled or stopped server, not the file
            message = f'{message.rstrip(".")}; a request for it now {status}'
        elif isinstance(status, int) and remote_hint(exc, message).endswith(_UNSURE):
            # It answers: "unreachable URL, no permission, or not a raster" would mislead.
            head = _http_head(path, 64) or b''
            if head[:4] in TIFF_MAGICS:
                return (f"{message.rstrip('.')}; the server answers it now (HTTP {status}) with a TIFF, so the "
                        "transfer broke off (a dropped connection, a proxy's limit?); try again, or download it "
                        "and give the local path")
            if head.lstrip()[:1] == b'<' and b'<?xml' not in head[:8]:
                return (f"{message.rstrip('.')}; the server answers it with a web page (HTTP {status}), not a "
                        "raster: a login or error page? check the address and that it needs no sign-in")
    return remote_hint(exc, message)


def unreadable(path, exc):
    """The one line for a raster at ``path`` whose read failed (``exc``): a local file may be
    corrupt or truncated; a URL, or a VRT reading URLs (STAC assets stacked), gets
    :func:`read_error`'s account of its server (replaced, gone), not a guess of corruption."""
    vrt = os.fspath(path).lower().endswith('.vrt')
    if is_remote(path) or (vrt and any(is_remote(u) for u in _vrt_sources(path))):
        return f"{path}: cannot be read: {read_error(path, exc)}"
    return f"{path}: cannot be read (corrupt or truncated?): {gdal_message(exc)}"


# GDAL's settings that add credentials or headers to its HTTP requests.
_GDAL_HTTP_CREDENTIALS = ('GDAL_HTTP_HEADERS', 'GDAL_HTTP_HEADER_FILE', 'GDAL_HTTP_USERPWD', 'GDAL_HTTP_AUTH',
                          'GDAL_HTTP_BEARER', 'GDAL_HTTP_COOKIE', 'GDAL_HTTP_COOKIEFILE', 'GDAL_HTTP_PROXYUSERPWD')


def http_status(url, timeout=10):
    """The HTTP status a one-byte GET of ``url`` gets now (a GET, not a HEAD: a signed URL is
    signed for its method); where no status comes, what happened instead, in words ("timed out
    ...", "could not connect ..."), or None (not a URL urllib can ask)."""
    import socket
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={'Range': 'bytes=0-0'}),
                                    timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (TimeoutError, socket.timeout):
        return f'timed out: no answer within {timeout:g} s'
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return f'timed out: no answer within {timeout:g} s'
        return f'could not connect ({getattr(reason, "strerror", None) or reason})'
    except (OSError, ValueError):
        return None


_UNSURE = '(unreachable URL, no permission, or not a raster)'


def remote_hint(exc, message=None):
    """GDAL's error for a URL (or ``message``, what is known of it), with what to do about the
    usual causes."""
    message = message or gdal_message(exc)
    if 'Range downloading not supported' in message:
        return (f"{message} (the server ignores HTTP Range requests, so every window would fetch "
                f"the whole file; serve it from one that honours Range, or download it and give "
                f"the local path)")
    if 'response code: 404' in message or 'response code: 410' in message:
        return f"{message} (no such file at that URL; check the address)"
    if 'response code: 401' in message or 'response code: 403' in message:
        return f"{message} (no permission; set GDAL's credentials, e.g. AWS_* for s3://)"
    if 'could not connect' in message:
        return f"{message} (the server is down or unreachable now; check it, or try again later)"
    if 'Operation too slow' in message or 'timed out' in message.lower():
        return (f"{message} (the server stopped answering; check it, or allow a slower one with "
                f"GDAL_HTTP_LOW_SPEED_TIME / GDAL_HTTP_CONNECTTIMEOUT in the environment)")
    if re.search(r'response code: 5\d\d', message):
        return f"{message} (the server failed; try again later, or ask its operator)"
    return f"{message} {_UNSURE}"


def cache_root():
    """``$DS_SEG_CACHE``, default ``$XDG_CACHE_HOME/ds_seg`` (``~/.cache/ds_seg``, as torch.hub's
    and Hugging Face's): where ds_seg keeps what it may rebuild."""
    xdg = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.environ.get('DS_SEG_CACHE') or os.path.join(xdg, 'ds_seg')


def user_cache_dir(*parts):
    """``$DS_SEG_CACHE`` (default ``~/.cache/ds_seg``) joined with ``parts``, created; None where it
    cannot be (a HOME that does not exist or is read-only on a compute node): caches of URLs are
    best effort, and a missing HOME failed every run that read one."""
    folder = os.path.join(cache_root(), *parts)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


def _vrt_sources(path):
    """The files a local VRT reads (its SourceFilename elements), as paths or URLs."""
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    sources = []
    for element in root.iter('SourceFilename'):
        name = (element.text or '').strip()
        if name.startswith('/vsicurl/'):
            name = name[len('/vsicurl/'):]
        elif element.get('relativeToVRT') == '1':
            name = os.path.join(os.path.dirname(path), name)
        if name and name not in sources:
            sources.append(name)
    return sources


# Files GDAL reads beside a raster (and so part of its version): an external mask, the PAM
# file (nodata, scale/offset, statistics) and external overviews, in either case.
GDAL_SIDECARS = ('.msk', '.MSK', '.aux.xml', '.AUX.XML', '.ovr', '.OVR')
# Vector formats GDAL knows that ds_seg's labels do not take (VECTOR_EXTENSIONS, vector_labels.py).
OTHER_VECTOR_SUFFIXES = ('.kml', '.kmz', '.gml', '.shp.zip', '.geojsonl', '.geojsons', '.geojsonseq', '.csv', '.gpx',
                         '.tab', '.mif', '.osm', '.pbf', '.dxf', '.gdb', '.sqlite')
SHAPEFILE_PARTS = ('.dbf', '.DBF', '.shx', '.SHX', '.prj', '.PRJ', '.cpg', '.CPG')


def file_identity(path, sample_bytes=1 << 16):
    """What a cache keyed to a file compares, or None where nothing identifies its version.

    A local file: absolute path, size, modification time and a SHA-256 of its first and last
    ``sample_bytes`` (a file rewritten in place with the same name, even with its old mtime
    restored, is recognised as new), and the same of each GDAL sidecar beside it
    (:data:`GDAL_SIDECARS`); a VRT's also the identities of the files it reads. An
    ``http(s)://`` URL: the server's ETag, Last-Modified and
    size from one HEAD request (a republished file gets new ones); None when the server gives
    neither ETag nor Last-Modified, and for other schemes (s3://...), whose version ds_seg cannot
    ask for without GDAL's credentials: callers then compute instead of trusting a cache.
    """
    path = os.fspath(path)
    if is_remote(path):
        return _http_identity(path) if path.startswith(('http://', 'https://')) else None
    path = os.path.abspath(path)
    identity = {'path': path, **_local_version(path, sample_bytes)}
    # GDAL reads these beside the file: a rewritten mask (.msk), nodata or scale tag (.aux.xml)
    # or overview (.ovr) changes what the file's pixels are, the file itself unchanged.
    sidecars = {suffix: _local_version(path + suffix, sample_bytes) for suffix in GDAL_SIDECARS
                if os.path.isfile(path + suffix)}
    if sidecars:
        identity['sidecars'] = sidecars
    if path.lower().endswith('.shp'):
        # A shapefile's attributes (.dbf: a class edited in QGIS's table), index and CRS (.prj)
        # live in files of its stem: an edit there is a new label file.
        parts = {ext: _local_version(path[:-4] + ext, sample_bytes) for ext in SHAPEFILE_PARTS
                 if os.path.isfile(path[:-4] + ext)}
        if parts:
            identity['parts'] = parts
    if path.lower().endswith('.vrt'):
        # A VRT is unchanged when the files it reads change (a STAC item's stacked assets, a
        # republished asset): their identities are its version too.
        sources = [file_identity(source, sample_bytes) if is_remote(source) or os.path.exists(source) else None
                   for source in _vrt_sources(path)]
        if None in sources:
            return None
        identity['sources'] = sources
    return identity


def _local_version(path, sample_bytes):
    st = os.stat(path)
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        digest.update(f.read(sample_bytes))
        if st.st_size > sample_bytes:
            f.seek(max(sample_bytes, st.st_size - sample_bytes))
            digest.update(f.read(sample_bytes))
    return {'size': st.st_size, 'mtime_ns': st.st_mtime_ns, 'sample_sha256': digest.hexdigest()}


def _http_identity(url):
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method='HEAD'), timeout=HTTP_TIMEOUT_S) as r:
            headers = r.headers
    except (OSError, ValueError):  # URLError and timeouts are OSErrors: no identity, no cache
        return None
    etag, modified = headers.get('ETag'), headers.get('Last-Modified')
    if not (etag or modified):
        return None
    identity = {'path': url, 'etag': etag, 'last_modified': modified, 'size': headers.get('Content-Length')}
    # Last-Modified, and nginx's default ETag (mtime and size), count whole seconds: a file
    # rewritten within the second at its size kept its identity, and its stale statistics. The
    # first and last 64 KiB are part of it, as for a local file.
    sample = _http_sample_sha256(url, headers.get('Content-Length'))
    if sample is not None:
        identity['sample_sha256'] = sample
    return identity


def _http_sample_sha256(url, size, sample_bytes=1 << 16):
    """SHA-256 of the first and last ``sample_bytes`` of ``url`` by two Range requests, or None
    where the server does not answer them as ranges."""
    import urllib.request
    try:
        size = int(size)
    except (TypeError, ValueError):
        return None
    ranges = [(0, min(size, sample_bytes) - 1)]
    if size > sample_bytes:
        ranges.append((max(sample_bytes, size - sample_bytes), size - 1))
    digest = hashlib.sha256()
    try:
        for start, end in ranges:
            request = urllib.request.Request(url, headers={'Range': f'bytes={start}-{end}'})
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as r:
                if r.status != 206:
                    return None
                digest.update(r.read())
    except (OSError, ValueError):
        return None
    return digest.hexdigest()


def same_pixels(a, b, width, height, tol_px=0.01):
    """True when geotransforms ``a`` and ``b`` put the pixels of a ``width`` x ``height`` raster
    in the same places, to ``tol_px`` of a pixel at every corner. Measured in pixels, not map
    units: a fixed tolerance in map units (Affine.almost_equals: 1e-5) is several pixels of a
    raster in degrees."""
    inverse = ~a
    for x, y in ((0, 0), (width, 0), (0, height), (width, height)):
        px, py = inverse * (b * (x, y))
        if abs(px - x) > tol_px or abs(py - y) > tol_px:
            return False
    return True


def open_raster(path):
    """``rasterio.open`` with the two user errors turned into one line naming the file.

    URLs (:func:`is_remote`) open through GDAL's virtual file systems with
    :data:`REMOTE_GDAL_OPTIONS`.
    """
    if is_remote(path):
        try:
            with opening_env(path), warnings.catch_warnings():
                warnings.simplefilter('ignore', NotGeoreferencedWarning)
                src = rasterio.open(gdal_path(path))
        except rasterio.errors.RasterioIOError as e:
            raise DataError(f"{path}: cannot open: {read_error(path, e)}") from e
        refuse_lost_world_file(path, src)
        return src
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    other = next((s for s in OTHER_VECTOR_SUFFIXES if os.fspath(path).lower().endswith(s)), None)
    if other:   # was "not a readable raster (corrupt or not an image)": a sound file, of another kind
        raise DataError(f"{path}: a vector file ({other}), a format ds_seg does not read; vector labels are "
                        f"GeoPackage, GeoJSON, FlatGeobuf, Shapefile or GeoParquet: convert it "
                        f"(ogr2ogr labels.gpkg {path})")
    try:
        # (opening_env: GDAL finds the file's .msk even inside a remote file's environment. A
        # VRT opens as before: its sources may be remote, read with their options.)
        env = contextlib.nullcontext() if os.fspath(path).lower().endswith('.vrt') else opening_env(path)
        with warnings.catch_warnings(), env:
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
        self.name = ','.join(self.paths)  # as predict.py's --input names the scene
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
        """Refuse dates that are not on one grid (size, transform, CRS, band count) or do not
        encode pixels alike (band types, nodata value, mask band): one date's values would be
        cast to another's type, and its nodata read as data."""
        # One file as two dates (a copy-paste slip, overlapping globs) would train on a series
        # with a date missing and say nothing; refused like a scene given twice for evaluation.
        from .geotiff import _scene_keys     # links, two spellings, one URL under two signatures
        keys, seen = _scene_keys(paths), {}
        for t, p in enumerate(paths):
            key = keys[p]
            if key in seen:
                raise DataError(f"{p} is given as date {t + 1} and as date {seen[key] + 1} of one scene "
                                f"({','.join(paths)}); give each date its own raster")
            seen[key] = t
        grids, codings = [], []
        for p in paths:
            with open_raster(p) as src:
                grids.append((src.width, src.height, src.transform, src.crs, src.count))
                codings.append((tuple(src.dtypes), src.nodata, uses_mask_band(src), tuple(src.scales), tuple(src.offsets)))
        for p, g in zip(paths[1:], grids[1:]):
            # The grid to a hundredth of a pixel (same_pixels), as for image and label: origins
            # written by another tool differ in the last float digits (500000.10000000003) and
            # are the same grid.
            w, h, transform, crs, count = grids[0]
            if g[4] != count and g[:2] == (w, h) and g[3] == crs and same_pixels(g[2], transform, w, h):
                raise DataError(f"{p} has {g[4]} band(s) but {paths[0]} has {count}; every date of a scene needs "
                                "the same bands: give files of one product (gdal_translate -b picks bands)")
            if g[:2] != (w, h) or g[3:] != (crs, count) or not same_pixels(g[2], transform, w, h):
                raise DataError(f"{p} is not co-registered with {paths[0]} (size, transform, CRS or "
                                f"band count differ: {g[:2]} {tuple(g[2])[:6]} {g[3]} {g[4]} vs {grids[0][:2]} "
                                f"{tuple(transform)[:6]} {crs} {count}); resample the dates onto one grid")
        for p, c in zip(paths[1:], codings[1:]):
            if c[0] != codings[0][0] or not same_value(c[1], codings[0][1]) or c[2:] != codings[0][2:]:
                def say(c):
                    scaled = [[a, b] for a, b in zip(c[3], c[4])]
                    return (f"types {'/'.join(sorted(set(c[0])))}, nodata {c[1]}, "
                            f"{'a mask band' if c[2] else 'no mask band'}, band scale/offset {scaled}")
                raise DataError(f"{p} does not encode pixels like {paths[0]} ({say(c)} vs {say(codings[0])}); "
                                f"give every date the same type, nodata and scale/offset (gdal_translate -ot, "
                                f"gdal_edit.py -a_nodata, -scale/-offset)")

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
    with open_raster(path) as src:   # a URL gone or republished since it was checked: one line
        yield src


def pixel_grid(src):
    """``(transform, crs, residual_px)`` that place a raster's pixels on the ground: its
    geotransform (``residual_px`` None), or the affine fit to its ground control points (a
    GCP-located scene has neither a geotransform nor a CRS of its own), with the largest distance
    in pixels between a point and the fit; ``(identity, None, None)`` for a raster with neither."""
    points, crs = src.gcps
    if points and src.transform.is_identity and src.crs is None:
        transform = rasterio.transform.from_gcps(points)
        inverse = ~transform
        residual = max(math.hypot(col - p.col, row - p.row)
                       for p in points for col, row in [inverse * (p.x, p.y)])
        return transform, crs, residual
    return src.transform, src.crs, None


def uses_mask_band(src):
    """True where a GDAL mask band or alpha marks invalid pixels. With a nodata value as well,
    both count (GDAL and QGIS give the mask band precedence; reading only the nodata value
    would predict and score pixels the mask hides)."""
    return any(MaskFlags.per_dataset in f or MaskFlags.alpha in f for f in src.mask_flag_enums)


# Colour interpretations that say nothing of what a band holds (GDAL's default for most files).
_UNSAID_COLOURS = frozenset({'undefined', 'gray'})


def band_colours(colorinterp, bands):
    """What the file's colour interpretation says each selected band (1-based) holds, e.g.
    ``['red', 'green', 'blue', None]`` for RGB + an undefined NIR band (None: grey or undefined,
    the file does not say); None where it says nothing of any.

    ``colorinterp``: the file's, as names (``[c.name for c in src.colorinterp]``)."""
    if not colorinterp or not bands or max(bands) > len(colorinterp):
        return None
    said = [None if str(colorinterp[b - 1]).lower() in _UNSAID_COLOURS else str(colorinterp[b - 1]).lower()
            for b in bands]
    return said if any(said) else None


def _aligned(said, expected):
    """``expected`` at ``said``'s length where one repeats the other per date (a file stacking
    every date's RGB against one date's colours, or the reverse); None where they do not align."""
    if len(said) == len(expected):
        return list(expected)
    if len(said) % len(expected) == 0:
        return list(expected) * (len(said) // len(expected))
    if len(expected) % len(said) == 0 and list(expected) == list(expected[:len(said)]) * (len(expected) // len(said)):
        return list(expected[:len(said)])
    return None


def colours_conflict(said, expected):
    """Whether two colour lists (:func:`band_colours`) disagree on a band both say something of."""
    expected = _aligned(said, expected) if said and expected else None
    return bool(expected) and any(a and b and a != b for a, b in zip(said, expected))


def bands_holding(colorinterp, colours):
    """The 1-based bands of a file whose colour interpretation is ``colours``, in that order: each
    colour takes the next band tagged with it (a file stacking dates holds each colour once per
    date), a None entry the next band that says nothing; None where the file runs out of one."""
    names = [str(c).lower() for c in colorinterp or ()]
    used, picked = set(), []
    for colour in colours or ():
        band = next((i for i, n in enumerate(names) if i not in used and
                     (n == colour if colour else n in _UNSAID_COLOURS)), None)
        if band is None:
            return None
        used.add(band)
        picked.append(band + 1)
    return picked or None


def colours_said(colours):
    """'red, green, (unsaid)': colour lists (:func:`band_colours`) as lines say them."""
    return ', '.join(c or '(unsaid)' for c in colours)


def colour_order_refusal(path, colorinterp, bands, expected, bands_said, expected_said, fix):
    """One line where ``path``'s selected ``bands`` hold other colours, by its colour
    interpretation, than ``expected`` (the model's, or data.train's); None where they agree on
    every band both say something of. ``bands_said``/``expected_said`` name both in the line;
    ``fix(bands)`` says how to select given bands (``--bands 3 2 1``, ``data.val.bands=[3, 2, 1]``)."""
    said = band_colours(colorinterp, bands)
    if not colours_conflict(said, expected):
        return None
    expected = _aligned(said, expected)
    right = bands_holding(colorinterp, expected)
    how = f"Select {fix(right)}" if right else f"Give a file whose bands hold {colours_said(expected)}"
    first = next(c for c in expected if c)
    return (f"{path}: {bands_said} hold {colours_said(said)} by the file's colour interpretation, but {expected_said} "
            f"{colours_said(expected)}: the model would see the colours swapped. {how}; if the file's tags are wrong, "
            f"correct them (gdal_edit.py -colorinterp_1 {first} ... {path}).")


def alpha_bands(src):
    """1-based bands the file tags as alpha (masks, not data)."""
    return [i + 1 for i, c in enumerate(src.colorinterp) if c == ColorInterp.alpha]


def alpha_as_data_refusal(path, src, bands, bands_said):
    """The line refusing a raster whose selected ``bands`` include one it tags as alpha, or None.
    GDAL reads a 0 in an alpha band as "no data here" in every band: a NIR band tagged so (GDAL's
    default for band 4 of an 8-bit RGB file) hides every dark pixel as nodata."""
    both = sorted(set(alpha_bands(src)) & set(bands))
    if not both:
        return None
    b = both[0]
    # rasterio's own CLI too: a pip-installed rasterio has no gdal_edit.py.
    interp = ','.join('undefined' if i + 1 in both else c.name for i, c in enumerate(src.colorinterp))
    return (f"{path}: band {b} is tagged as alpha, so its 0 pixels read as nodata, but {bands_said} takes it "
            f"as data. If it is data (NIR...), untag it: gdal_edit.py -colorinterp_{b} undefined {path} (or rio "
            f"edit-info --colorinterp {interp} {path}); if it is a mask, leave it out of the bands")


# A magnitude no measurement reaches: float32's lowest, -3.4028235e38 (the no-data fill ArcGIS and
# other tools write into float rasters), -1e38 and the like. Left untagged, it made computed
# statistics of 1e38 and NaN losses, or inputs normalised to a constant and nothing learnt.
FILL_MAGNITUDE = 1e30


def untagged_fill(raw_CN, path, file_dtype, band_numbers=None, nodata=None):
    """The line for pixels of an image (``raw_CN``: its bands' valid pixels, the tagged nodata left
    out; ``band_numbers``: the file's 1-based number of each row, 1.. by default; ``nodata``: the
    file's tag, which a band holding in pixels where others hold data does not make a fill) that
    hold a fill value no nodata tag marks, or None.

    A fill is a value no measurement takes: in floating-point files a magnitude of
    FILL_MAGNITUDE or more; in signed integer files the type's lowest value (int16's -32768, the
    void of DEMs and of many processors' reflectances), when the band's other values are nowhere
    near it (all above half of it), so a band that truly spans the type's range is not taken
    for one."""
    dtype = np.dtype(file_dtype)
    if dtype.kind not in 'fi' or not raw_CN.size:
        return None
    if dtype.kind == 'f':
        fill = np.isfinite(raw_CN) & (np.abs(raw_CN) >= FILL_MAGNITUDE)
        kind = 'float rasters use'
    else:
        lowest = np.iinfo(dtype).min
        fill = raw_CN == lowest
        apart = ~fill.any(axis=1) | (np.where(fill, 0, raw_CN).min(axis=1) > lowest / 2)
        fill &= apart[:, None]
        kind = f'is {dtype.name}\'s lowest, which tools use'
    if nodata is not None:
        fill &= raw_CN != nodata
    if not fill.any():
        return None
    band = int(np.argmax(fill.any(axis=1)))
    value = float(raw_CN[band][fill[band]][0])
    share = 100.0 * fill[band].mean()
    number = band_numbers[band] if band_numbers is not None else band + 1
    return (f"{path}: band {number} holds {value:.8g} in {share:.2g}% of its pixels (a sampled read), a fill "
            f"value that {kind} for no data, but the file has no nodata tag for it, so it would be "
            f"read as data; tag it (rio edit-info --nodata {value:.8g} FILE) to have those pixels masked")


def ground_metres_per_unit(src):
    """Metres on the ground per unit of an open raster's CRS at the scene's centre, as (x, y), or
    None (no CRS, GCPs, a CRS GDAL cannot say the units of). Web Mercator's "metres" are a
    ground metre only at the equator (times cos(latitude)); degrees are about 111 km times
    cos(latitude) east-west."""
    try:
        crs = src.crs
        if crs is None or src.transform.is_identity:
            return None
        if crs.is_geographic:
            lat = _centre_latitude(src)
            return (111_320.0 * math.cos(math.radians(lat)), 110_574.0)
        if not crs.is_projected:
            return None
        factor = float(crs.linear_units_factor[1])
        if (crs.to_dict() or {}).get('proj') == 'merc':
            factor *= math.cos(math.radians(_centre_latitude(src)))
        return (factor, factor)
    except Exception:   # a CRS GDAL cannot say the units of, or cannot take to latitude
        return None


def _centre_latitude(src):
    from rasterio.warp import transform
    x, y = src.xy(src.height / 2, src.width / 2, offset="ul")
    if src.crs.is_geographic:
        return float(y)
    return float(transform(src.crs, 'EPSG:4326', [x], [y])[1][0])


def pixel_size_m(src):
    """The side of a pixel on the ground in metres (the mean of its x and y sizes) of an open
    raster, or None (no CRS, GCPs): what a model was trained at, recorded so a scene of another
    ground resolution is said at prediction."""
    per_unit = ground_metres_per_unit(src)
    if per_unit is None:
        return None
    return float((abs(src.res[0]) * per_unit[0] + abs(src.res[1]) * per_unit[1]) / 2)


def untagged_fill_refusal(path, bands=None, size=512):
    """:func:`untagged_fill` of a decimated read (at most ``size`` px a side, overviews if any) of
    the file at ``path`` (``bands``: 1-based, all by default): for a scene a command is given
    directly (predict.py, evaluate.py), as training's statistics pass checks its scenes."""
    with open_raster(path) as src:
        if np.dtype(src.dtypes[0]).kind not in 'fi':
            return None
        f = max(1.0, max(src.height, src.width) / size)
        shape = (max(1, int(src.height / f)), max(1, int(src.width / f)))
        idx = list(bands) if bands else list(range(1, src.count + 1))
        x = src.read(idx, out_shape=(len(idx),) + shape).reshape(len(idx), -1)
        valid = ~nodata_mask(x, src.nodata)
        if uses_mask_band(src):
            valid &= src.dataset_mask(out_shape=shape).reshape(-1) > 0
        return untagged_fill(x[:, valid], path, src.dtypes[0], idx, src.nodata)


def nodata_mask(raw_CHW, nodata, dtype=None):
    """Pixels with no data: the ``nodata`` value in any band (NaN-aware), or in every band where
    the pixels are 8-bit; in floating-point images also pixels with a non-finite value in any
    band. ``dtype``: the file's pixel type, where ``raw_CHW`` was converted from it.

    In 16-bit and floating-point scenes the tag is a reserved code (0 in Sentinel-2 and Landsat
    DNs, -9999, -32768) and a band holding it has no data there (Sentinel-2's band edges differ
    by detector): one -9999 in one band, read as a value, changed 886 predicted pixels around
    it. In 8-bit imagery the tag (0, 255) is also a real value of one band (a black shadow, a
    saturated roof), so only a pixel with it in every band is nodata.

    Example::

        nodata_mask(np.array([[[0, 5]], [[0, 0]]], np.uint8), 0)        # [[True, False]]
        nodata_mask(np.array([[[0, 5]], [[0, 0]]], np.uint16), 0)       # [[True, True]]
    """
    reduce = np.all if np.dtype(dtype or raw_CHW.dtype).itemsize == 1 else np.any
    out = np.zeros(raw_CHW.shape[1:], bool)
    if nodata is not None:
        if isinstance(nodata, float) and math.isnan(nodata):
            out |= np.isnan(raw_CHW).any(axis=0)
        else:
            out |= reduce(raw_CHW == nodata, axis=0)
    if raw_CHW.dtype.kind == 'f':
        out |= ~np.isfinite(raw_CHW).all(axis=0)
    return out


def source_name(src):
    """The path or URL (dates joined by commas) an open raster was given as, for messages."""
    name = getattr(src, 'name', '?')
    for scheme, prefix in _VSI_PREFIXES.items():
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return rest if prefix == '/vsicurl/' else scheme + rest
    return name


def same_units(dtype_a, dtype_b):
    """Whether statistics measured on ``dtype_a`` pixels hold for ``dtype_b`` ones: the same type,
    or two float types (float32 and float64 hold the same physical values; uint8 and uint16 do
    not: another range, another scaling)."""
    a, b = np.dtype(dtype_a), np.dtype(dtype_b)
    return a == b or (a.kind == 'f' and b.kind == 'f')


def pixel_type_refusal(path, dtypes):
    """The one line for a raster whose band types ``dtypes`` ds_seg cannot read, or None.

    Complex pixels (SAR SLC, interferograms): numpy would drop the imaginary part with a warning
    and the model learn from half the signal. Bands of several types (a VRT stacking 8-bit RGB
    and a 16-bit NIR): rasterio reads a window in one type only."""
    dtypes = [str(d) for d in dtypes]
    complex_type = next((d for d in dtypes if d.startswith('complex')), None)  # also GDAL's CInt16 ('complex_int16')
    if complex_type:
        return (f"{path} holds complex ({complex_type}) pixels; segmentation takes real bands: derive them first "
                f"(amplitude/phase or real/imaginary parts, e.g. gdal_translate -ot Float32 for the real part, or a "
                f"VRT with a derived band)")
    if len(set(dtypes)) > 1:
        widest = np.result_type(*dtypes).name
        return (f"{path} has bands of several pixel types ({', '.join(dtypes)}); ds_seg reads a file in one type: "
                f"write it with one (gdal_translate -ot {GDAL_TYPE_NAMES.get(widest, widest)} {os.path.basename(path)} "
                f"out.tif), or stack bands of one type")
    return None


GDAL_TYPE_NAMES = {'uint8': 'Byte', 'int8': 'Int8', 'uint16': 'UInt16', 'int16': 'Int16', 'uint32': 'UInt32',
                   'int32': 'Int32', 'float32': 'Float32', 'float64': 'Float64', 'int64': 'Int64', 'uint64': 'UInt64'}


def label_nodata(raw, nodata, hidden=None):
    """Pixels of a label raster that hold its nodata value (NaN-aware), or that its mask band
    ``hidden`` (:func:`read_label_band`): unlabelled, so ``ignore_index``, whatever the value
    (-9999, NaN, 65535). None where there are none."""
    hit = None
    if nodata is not None:
        hit = np.isnan(raw) if math.isnan(nodata) else raw == nodata  # an array: same_value is for scalars
        hit = hit if hit.any() else None
    if hidden is not None:
        hit = hidden if hit is None else hit | hidden
    return hit


def read_label_band(src, window=None, out_shape=None):
    """``(class values, unlabelled)`` of a single-band label raster: band 1 of ``window``
    (decimated to ``out_shape`` by nearest neighbour), and the pixels its GDAL mask band marks
    empty, or None. GDAL and QGIS show those pixels as empty, whatever value they hold: they are
    ``ignore_index``, as the label's nodata value is (:func:`label_nodata`)."""
    shape = {} if out_shape is None else dict(out_shape=out_shape, resampling=Resampling.nearest)
    raw = src.read(1, window=window, **shape)
    if not uses_mask_band(src):
        return raw, None
    hidden = src.dataset_mask(window=window, **shape) == 0
    return raw, (hidden if hidden.any() else None)


def read_window(src, window, indexes, nodata, masked):
    """``(pixels, invalid)`` of ``window`` of an open raster: bands ``indexes`` in the file's
    dtype, and the pixels that hold no data (:func:`nodata_mask`, date by date for a
    :class:`StackedRaster`; and with ``masked``
    (:func:`uses_mask_band`) those the mask band marks), or None where no pixel can be
    invalid (no nodata value, integer bands, no mask band).

    Example::

        pixels, invalid = read_window(src, Window(0, 0, 256, 256), [1, 2, 3], src.nodata, False)
    """
    raw = src.read(indexes=indexes, window=window)
    invalid = None
    if nodata is not None or raw.dtype.kind == 'f':
        per_date = getattr(src, 'per_date', None)
        if per_date:  # a stack of dates: no data at any one date makes the pixel invalid (as in training)
            dates = np.array([(int(i) - 1) // per_date for i in indexes])
            invalid = np.zeros(raw.shape[1:], bool)
            for t in np.unique(dates):
                invalid |= nodata_mask(raw[dates == t], nodata)
        else:
            invalid = nodata_mask(raw, nodata)
    if masked:
        bad = src.dataset_mask(window=window) == 0
        invalid = bad if invalid is None else invalid | bad
    return raw, invalid


def boundary_mask(label_HW, radius, ignore_index=255):
    """Pixels within ``radius`` px (a disk, ISPRS convention) of a pixel of another class: the
    pixels ``evaluate --erode`` and a dataset's ``boundary_ignore`` leave out.

    Ignore pixels are no class: they neither create boundaries nor are marked. Pixels outside
    the array do not count. ``radius=0`` marks nothing.

    Example::

        boundary_mask(np.array([[0, 0, 1, 1]]), 1)   # [[False, True, True, False]]
    """
    lbl = np.asarray(label_HW)
    out = np.zeros(lbl.shape, bool)
    if radius <= 0:
        return out
    h, w = lbl.shape
    valid = lbl != ignore_index
    # Offsets past the array compare nothing: the loops stop at its size whatever the radius.
    for dy in range(-min(radius, h - 1), min(radius, h - 1) + 1):
        for dx in range(-min(radius, w - 1), min(radius, w - 1) + 1):
            if (dy or dx) and dy * dy + dx * dx <= radius * radius:
                # compare each pixel p with its neighbour q = p + (dy, dx) where q is inside
                ys, ye = max(0, -dy), min(h, h - dy)
                xs, xe = max(0, -dx), min(w, w - dx)
                if ys >= ye or xs >= xe:
                    continue
                p = lbl[ys:ye, xs:xe]
                q = lbl[ys + dy:ye + dy, xs + dx:xe + dx]
                out[ys:ye, xs:xe] |= (p != q) & valid[ys:ye, xs:xe] & valid[ys + dy:ye + dy, xs + dx:xe + dx]
    return out
