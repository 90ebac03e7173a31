"""STAC input: scenes from a STAC Item or ItemCollection, assets picked by name.

Each item is one scene. Its image is one multi-band asset (``image_assets='visual'``) or
several assets stacked in the order given (``image_assets=['B04', 'B03', 'B02']``, Sentinel-2
style: one COG per band; every band of a multi-band asset, so ``['visual', 'B08']`` is RGB+NIR).
Stacked bands become a small GDAL VRT that points at the assets, so windows are still read
straight from each asset, over HTTP if that is where they are. The label is one asset (a class raster, or a vector file: see ``label_field``).

Example::

    ds = GeoTiffScenes(stac='https://host/catalog/items.json', stac_bands=['B04', 'B03', 'B02'],
                       stac_label='labels', classes=('other', 'building'))
"""
import hashlib
import os
import re
import tempfile
from xml.sax.saxutils import escape

from ds_seg.config import ConfigError


def _read_json(source):
    """``(document, where it was read)``: the JSON document at a path or an http(s) URL, with a
    time limit on the URL; where: the URL after redirects (relative hrefs are relative to it)."""
    import json
    import urllib.error
    import urllib.request

    from .raster import HTTP_TIMEOUT_S
    try:
        where = source
        if source.startswith(('http://', 'https://')):
            with urllib.request.urlopen(source, timeout=HTTP_TIMEOUT_S) as r:
                text = r.read()
                where = r.geturl()
        else:
            with open(source, 'rb') as f:
                text = f.read()
    except urllib.error.HTTPError as e:
        raise ConfigError(f"stac={source!r}: cannot read a STAC JSON document (HTTP {e.code} {e.reason})") from e
    except (OSError, urllib.error.URLError) as e:  # timeouts are OSErrors
        reason = getattr(e, 'reason', None) or e
        raise ConfigError(f"stac={source!r}: cannot read a STAC JSON document ({reason})") from e
    try:
        return json.loads(text), where
    except ValueError as e:
        raise ConfigError(f"stac={source!r}: not a JSON document ({e}); give a STAC Item or ItemCollection") from e


def _read_items(source):
    import pystac
    doc, where = _read_json(source)
    kind = doc.get('type') if isinstance(doc, dict) else type(doc).__name__
    try:
        if kind == 'Feature':
            items = [pystac.Item.from_dict(doc)]
        elif kind == 'FeatureCollection':
            items = list(pystac.ItemCollection.from_dict(doc).items)
        else:
            raise ConfigError(f"stac={source!r}: expected a STAC Item or ItemCollection (GeoJSON "
                              f"'Feature' or 'FeatureCollection'), found type {kind!r}")
    # STACTypeError (no stac_version, say) is not a STACError: it was a traceback.
    except (KeyError, TypeError, ValueError, AttributeError, pystac.STACError, pystac.STACTypeError) as e:
        if isinstance(e, ConfigError):
            raise
        detail = f"missing {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        raise ConfigError(f"stac={source!r}: not a valid STAC {kind} ({type(e).__name__}: {detail}); "
                          f"every item needs an id and assets with an href") from e
    if not items:
        raise ConfigError(f"stac={source!r}: the ItemCollection holds no items")
    # The document's final URL (after redirects: an alias, a DOI) is what its relative hrefs are
    # relative to (RFC 3986); they were joined to the URL first asked for, and 404ed.
    base = where if where.startswith(('http://', 'https://')) else os.path.abspath(source)
    for item in items:
        item.set_self_href(None)
        for asset in item.assets.values():  # relative hrefs are relative to the document
            if asset.href.startswith('file://'):  # a local file as a URL (stactools, rio-stac): its path
                from urllib.parse import unquote, urlsplit
                asset.href = unquote(urlsplit(asset.href).path)
            if '://' not in asset.href and not os.path.isabs(asset.href):
                from urllib.parse import unquote, urljoin
                # An href is a URI: percent-encoded ('dir%20a/b.tif') whether the document is
                # served or on disk (read from disk it named a file 'dir%20a/b.tif').
                asset.href = (urljoin(base, asset.href) if '://' in base
                              else os.path.normpath(os.path.join(os.path.dirname(base), unquote(asset.href))))
    return items


def _asset(item, name, source, what):
    if name not in item.assets:
        raise ConfigError(f"stac={source!r}: item {item.id!r} has no asset {name!r} ({what}); its "
                          f"assets are {', '.join(item.assets) or '(none)'}")
    return item.assets[name].href


def _band_number(band, key, where, i):
    """``raster:bands[i][key]`` as a float, or None where it is not declared (absent or null: the
    spec's default); the spec's "nan"/"inf" spellings are numbers, any other word is refused."""
    value = band.get(key) if isinstance(band, dict) else None
    if isinstance(value, str) and value.lower() in ('nan', 'inf', '-inf'):
        value = float(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where}: raster:bands[{i}].{key} is {value!r}, not a number; fix the item "
                          "(or remove the key)")
    return None if value is None else float(value)


def _declared_encoding(asset, where='asset'):
    """The ``[scale, offset]`` of each band an asset's STAC ``raster:bands`` declares, or None.
    A null is not declared (the defaults, 1 and 0); a word is refused, naming ``where`` (float()
    of null was a TypeError traceback)."""
    bands = (asset.extra_fields or {}).get('raster:bands')
    if not isinstance(bands, list) or not bands:
        return None
    return [[_or(_band_number(band, 'scale', where, i), 1.0), _or(_band_number(band, 'offset', where, i), 0.0)]
            for i, band in enumerate(bands)]


def _or(value, default):
    return default if value is None else value


def _check_declared_encoding(item, names, source, seen):
    """Items whose ``raster:bands`` declare another scale/offset for an asset than the first item
    with one (Sentinel-2 before and after processing baseline 04.00: offset 0 and -0.1) are
    refused, as GeoTIFFs whose own tags differ are: ds_seg trains on the raw values, and mixed
    encodings were trained as one, without a word, where the files carry no tags."""
    for name in names:
        declared = _declared_encoding(item.assets[name], f'stac={source!r}: item {item.id!r}, asset {name!r}')
        if declared is None:
            seen.setdefault(('silent', name), item.id)
        else:
            first = seen.setdefault(name, (item.id, declared))
            if first[1] != declared:
                raise ConfigError(f"stac={source!r}: items {first[0]!r} and {item.id!r} declare other raster:bands "
                                  f"scale/offset for asset {name!r} ({first[1]} and {declared}); ds_seg trains on the "
                                  "raw values, so every scene must share one encoding: use items of one processing "
                                  "baseline, or convert them to one (gdal_translate -scale)")
            if any(band != [1.0, 0.0] for band in declared):
                seen.setdefault(('scaled', name), (item.id, declared))
        # An item that declares nothing beside one that declares a scale or offset: its files may
        # hold either encoding, and nothing tells which.
        silent, scaled = seen.get(('silent', name)), seen.get(('scaled', name))
        if silent is not None and scaled is not None:
            raise ConfigError(f"stac={source!r}: item {scaled[0]!r} declares raster:bands scale/offset {scaled[1]} "
                              f"for asset {name!r} and item {silent!r} declares none, so whether they share one "
                              "encoding is unknown; ds_seg trains on the raw values: use items that declare it alike "
                              "(one processing baseline), or convert them to one (gdal_translate -scale)")


# The colour interpretations ds_seg's checks read, by GDAL's VRT names; others stay undefined.
_VRT_COLOURS = {'gray': 'Gray', 'red': 'Red', 'green': 'Green', 'blue': 'Blue', 'alpha': 'Alpha'}


def _declared_nodata(asset, where):
    """The nodata value an asset's STAC ``raster:bands`` declare (one for all its bands), or None."""
    bands = (asset.extra_fields or {}).get('raster:bands')
    if not isinstance(bands, list):
        return None
    values = [v for i, band in enumerate(bands) if (v := _band_number(band, 'nodata', where, i)) is not None]
    if len({repr(v) for v in values}) > 1:
        raise ConfigError(f"{where}: raster:bands declare nodata {sorted({repr(v) for v in values})} for one asset's "
                          "bands; ds_seg takes one nodata value per asset")
    return values[0] if values else None


def _declares_other_nodata(href, declared):
    """One asset is read as it is, unless the item declares a nodata value its file does not say
    (then a VRT says it, or refuses a file that says another)."""
    if declared is None:
        return False
    from .raster import open_raster, same_value
    with open_raster(href) as src:
        return src.nodata is None or not same_value(src.nodata, declared)


def _stack_vrt(hrefs, item_id, cache_dir, declared_nodata=None):
    """A VRT of the bands of ``hrefs`` in order (every band of a multi-band asset), read as one
    type (the narrowest that holds them all, so no asset's values wrap); assets must share one
    grid and one nodata value. Each band keeps what its colour interpretation says of colour
    (red stays red, alpha stays alpha: selected as data, it is refused as in a file), and the
    assets' GDAL masks hide a pixel of the stack where any of them hides it (a VRT has no mask of
    its own: without one, masked pixels were read as data)."""
    import numpy as np
    from rasterio import Affine
    from rasterio.dtypes import dtype_rev, typename_fwd

    from .raster import gdal_path, open_raster, same_value, uses_mask_band
    grids, colours, masked, encodings = [], [], [], []
    for h in hrefs:
        with open_raster(h) as src:
            grids.append((src.width, src.height, tuple(src.transform)[:6], src.crs, src.dtypes,
                          src.nodata))
            colours.append([_VRT_COLOURS.get(c.name, 'Undefined') for c in src.colorinterp])
            # Kept on the stack's bands: the dataset compares every scene's (Sentinel-2's
            # offset -1000 since baseline 04.00), and a stack without them said [1, 0] for all.
            encodings.append(list(zip(src.scales, src.offsets)))
            if uses_mask_band(src):
                masked.append(h)
    # Nodata the item declares where its files say none (a COG written without the tag): the
    # fill was read as data. A file that says another value than the item is refused.
    for i, (h, declared) in enumerate(zip(hrefs, declared_nodata or [None] * len(hrefs))):
        if declared is None:
            continue
        if grids[i][5] is None:
            grids[i] = grids[i][:5] + (declared,)
        elif not same_value(grids[i][5], declared):
            raise ConfigError(f"STAC item {item_id!r}: asset {h} has nodata {grids[i][5]} in its file but "
                              f"{declared} in the item's raster:bands; fix one of them")
    w, hgt, transform, crs, _, nodata = grids[0]
    for h, g in zip(hrefs[1:], grids[1:]):
        if g[3] != crs:
            raise ConfigError(f"STAC item {item_id!r}: asset {h} is in {g[3]} but {hrefs[0]} in {crs}; stack "
                              f"bands of one CRS, or reproject them first (gdalwarp -t_srs)")
        if g[:4] != grids[0][:4]:
            raise ConfigError(f"STAC item {item_id!r}: asset {h} ({g[0]}x{g[1]}, {g[2]}) is not on the "
                              f"grid of {hrefs[0]} ({w}x{hgt}, {transform}); stack bands of one "
                              f"resolution, or resample them first")
        if not same_value(g[5], nodata):
            raise ConfigError(f"STAC item {item_id!r}: asset {h} has nodata {g[5]} but {hrefs[0]} has "
                              f"{nodata}; stacked bands need one nodata value")
    dtype = np.result_type(*[np.dtype(d) for g in grids for d in g[4]]).name
    if dtype not in dtype_rev:
        raise ConfigError(f"STAC item {item_id!r}: its bands ({', '.join(sorted({d for g in grids for d in g[4]}))}) "
                          f"have no common raster type ({dtype}); convert the assets to one type")
    gdal_type = typename_fwd[dtype_rev[dtype]]
    gt = Affine(*transform).to_gdal()

    def source(href, band):
        return (f'<SimpleSource><SourceFilename relativeToVRT="0">{escape(gdal_path(href))}</SourceFilename>'
                f'<SourceBand>{band}</SourceBand><SrcRect xOff="0" yOff="0" xSize="{w}" ySize="{hgt}"/>'
                f'<DstRect xOff="0" yOff="0" xSize="{w}" ySize="{hgt}"/></SimpleSource>')

    bands = []
    for h, g, interp, encoding in zip(hrefs, grids, colours, encodings):
        nd = f'<NoDataValue>{g[5]}</NoDataValue>' if g[5] is not None else ''
        for b in range(1, len(g[4]) + 1):
            scale, offset = encoding[b - 1]
            coded = '' if (scale, offset) == (1.0, 0.0) else \
                f'<Offset>{float(offset)!r}</Offset><Scale>{float(scale)!r}</Scale>'
            bands.append(f'<VRTRasterBand dataType="{gdal_type}" band="{len(bands) + 1}">{nd}'
                         f'<ColorInterp>{interp[b - 1]}</ColorInterp>{coded}{source(h, b)}</VRTRasterBand>')
    mask = ''
    if masked:  # 'mask,1': the source's own mask band (its internal mask, or its alpha band)
        sources = ''.join(source(h, 'mask,1') for h in masked)
        mask = ('<MaskBand><VRTRasterBand dataType="Byte">' + sources + '</VRTRasterBand></MaskBand>'
                if len(masked) == 1 else
                '<MaskBand><VRTRasterBand dataType="Byte" subClass="VRTDerivedRasterBand">'
                '<PixelFunctionType>min</PixelFunctionType>' + sources + '</VRTRasterBand></MaskBand>')
    xml = (f'<VRTDataset rasterXSize="{w}" rasterYSize="{hgt}">'
           f'<SRS>{escape(crs.to_wkt()) if crs else ""}</SRS>'
           f'<GeoTransform>{", ".join(repr(float(v)) for v in gt)}</GeoTransform>{"".join(bands)}{mask}'
           '</VRTDataset>')
    digest = hashlib.sha1(xml.encode()).hexdigest()[:12]
    # An item id is the publisher's text ('T33/2024', '../x'): only safe characters in the name.
    safe_id = re.sub(r'[^A-Za-z0-9._-]', '_', str(item_id)).lstrip('.')[:80] or 'item'
    path = os.path.join(cache_dir, f'{safe_id}_{digest}.vrt')
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f'{path}.{os.getpid()}.tmp'
        with open(tmp, 'w') as f:
            f.write(xml)
        os.replace(tmp, path)
    return path


def stac_scenes(source, image_assets, label_asset, cache_dir=None):
    """``(images, labels)`` paths or URLs, one pair per item of a STAC Item/ItemCollection.

    Example::

        images, labels = stac_scenes('items.json', ['red', 'green', 'blue'], 'label')
    """
    from .raster import user_cache_dir
    source = os.fspath(source)
    if source.startswith('file://'):   # as asset hrefs take it (was "No such file: 'file:///...'")
        import urllib.parse
        source = urllib.parse.unquote(urllib.parse.urlparse(source).path)
    items = _read_items(source)
    if cache_dir is None:
        local = not source.startswith(('http://', 'https://'))
        folder = os.path.dirname(os.path.abspath(source)) if local else None
        # The stacked VRTs must be written somewhere: beside the document, in the user cache, or
        # (no writable HOME on a compute node) in a temporary folder of this run.
        cache_dir = (os.path.join(folder, '.ds_seg_stac') if folder and os.access(folder, os.W_OK)
                     else user_cache_dir('stac') or tempfile.mkdtemp(prefix='ds_seg_stac_'))
    names = [image_assets] if isinstance(image_assets, str) else list(image_assets)
    if not names:
        raise ConfigError(f"stac={source!r}: stac_bands names no asset")
    images, labels, seen, encodings = [], [], {}, {}
    for item in items:
        hrefs = [_asset(item, n, source, 'stac_bands') for n in names]
        _check_declared_encoding(item, names, source, encodings)
        label = _asset(item, label_asset, source, 'stac_label')
        # Two items of the same assets are one scene twice (each stacked into its own VRT, so
        # the files' names cannot tell): it would count twice in every metric.
        key = (tuple(hrefs), label)
        if key in seen:
            raise ConfigError(f"stac={source!r}: items {seen[key]!r} and {item.id!r} have the same assets "
                            f"({hrefs[0]}{', ...' if len(hrefs) > 1 else ''}; label {label}); the scene would "
                            "count twice; list each scene once")
        seen[key] = item.id
        declared = [_declared_nodata(item.assets[n], f'stac={source!r}: item {item.id!r}, asset {n!r}') for n in names]
        images.append(hrefs[0] if len(hrefs) == 1 and not _declares_other_nodata(hrefs[0], declared[0])
                      else _stack_vrt(hrefs, item.id, cache_dir, declared))
        labels.append(label)
    return images, labels
