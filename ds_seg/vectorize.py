"""Class-map GeoTIFF -> polygons (GeoPackage, GeoJSON or FlatGeobuf), in bounded memory.

The class map is read in bands of rows. In each band every 4-connected region of one class
gets an id (OpenCV connected components, per class) and ``rasterio.features.shapes`` traces
the id raster, so each region of the band is one polygon in exact pixel-edge coordinates.
A region cut by a band edge continues in the next band: the last row of ids of one band and
the first row of the next say which pieces touch across the edge (same class, vertically
adjacent pixels, i.e. the same 4-connectivity), a union-find joins them, and a region is
written (its pieces unioned with shapely) as soon as no piece of it reaches the current band's
last row. Memory is therefore a band of rows plus the regions still open at the band edge, not
the scene; pixel counts and probability sums travel with the pieces, so areas and mean
probabilities are exact whatever the band height.

Attributes: ``class_id``, ``class_name``, ``area_m2`` (pixel count x pixel area in ground square
metres: degrees and Mercator units converted at the region's latitude; before any
simplification) and, given the probabilities GeoTIFF ``predict.py --probs`` writes, ``mean_prob``
(the mean probability of the region's class over its pixels).

Example::

    from ds_seg.vectorize import vectorize_class_map
    vectorize_class_map('scene_classes.tif', 'scene.gpkg', probs_path='scene_probs.tif',
                        simplify=0.5, min_area=10.0, exclude=['background'])
"""
import json
import math
import os

import cv2
import numpy as np
import rasterio
import rasterio.warp
from rasterio.features import shapes
from rasterio.windows import Window

DRIVERS = {'.gpkg': 'GPKG', '.geojson': 'GeoJSON', '.json': 'GeoJSON', '.fgb': 'FlatGeobuf'}
PROB_SCALE = 250.0          # predict.py stores probabilities as uint8 x 250
_EARTH_RADIUS_M = 6371008.8  # mean radius: areas in geographic CRSs are a spherical estimate
_FLUSH_FEATURES = 20000      # finished polygons kept before an append to the output file


def vector_driver(path):
    """The OGR driver for an output path, from its extension (``.gpkg``, ``.geojson``, ``.fgb``)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in DRIVERS:
        raise ValueError(f"{path}: unknown vector format {ext or '(no extension)'!r}; use one of "
                         f"{', '.join(sorted(DRIVERS))}")
    return DRIVERS[ext]


def exclude_ids(exclude, classes, option='exclude'):
    """Class ids of ``exclude`` (names or ids, ``'3'`` as 3); unknown names and ids out of
    ``classes`` are refused, so a misspelt class never silently stays in the output. A class name
    is read as that name, digits included (classes named by codes); other digits are ids.

    Example::

        exclude_ids(['background', '3'], ['background', 'building', 'road', 'tree'])   # [0, 3]
    """
    ids = []
    for e in exclude or ():
        if isinstance(e, str) and e in classes:
            # A name first, digits too: classes named by codes ('2', '1', '0') are excluded by their
            # names (evaluate read '0' as the name, predict as the id: two classes for one option).
            ids.append(classes.index(e))
        elif isinstance(e, str) and not e.strip().isdigit():
            if e not in classes:
                raise ValueError(f"{option}: unknown class {e!r}; classes are {', '.join(classes)}")
            ids.append(classes.index(e))
        else:
            i = int(e)
            if not 0 <= i < len(classes):
                raise ValueError(f"{option}: class id {i} is not one of 0..{len(classes) - 1} "
                                 f"({', '.join(classes)})")
            ids.append(i)
    return ids


def georeference_refusal(src, path):
    """Why the polygons of the raster ``src`` (at ``path``) cannot be placed on the map, or None.
    They are written in its geotransform: a raster located only by ground control points or RPCs
    has none, nor has a plain image (PNG, JPEG, a TIFF without georeferencing), and its polygons
    would land in pixel coordinates (y down, so upside down in a GIS) with ``area_m2`` counting
    pixels."""
    if not src.transform.is_identity:
        return None
    gcps = bool(src.gcps[0])
    if gcps or src.rpcs is not None:
        return (f"{path} is located by {'GCPs' if gcps else 'RPCs'}, not a geotransform, so polygons would be "
                "in pixel coordinates; warp the scene first (gdalwarp -t_srs EPSG:<code> in.tif warped.tif)")
    return (f"{path} has no georeferencing (no geotransform, GCPs or RPCs), so polygons would be in pixel "
            "coordinates and area_m2 in pixels; georeference it (gdal_translate -a_srs EPSG:<code> -a_ullr ...)")


def geojson_crs_refusal(crs, path, out_path):
    """Why polygons in ``crs`` (the scene at ``path``'s) cannot go to the GeoJSON ``out_path``, or
    None. A GeoJSON file names its CRS only by EPSG code (GDAL's legacy ``crs`` member); without
    one it is read as WGS84 longitude/latitude (RFC 7946), so polygons of a custom CRS (a PROJ
    string, LAEA) or of none were placed at metre values read as degrees, without a word."""
    if DRIVERS.get(os.path.splitext(str(out_path))[1].lower()) != 'GeoJSON':
        return None
    if crs is None:
        return (f"{path} has no CRS, and a GeoJSON file without one is read as WGS84 longitude/latitude; "
                "write .gpkg or .fgb instead, or set the scene's CRS (gdal_edit.py -a_srs EPSG:<code>)")
    if crs.to_epsg() is None and not crs.is_geographic:
        return (f"{path}'s CRS has no EPSG code, which GeoJSON cannot carry (the polygons would be read as WGS84 "
                "longitude/latitude); write .gpkg or .fgb instead")
    return None


def check_vector_options(simplify, min_area, prefix=''):
    """Refuse a negative simplification tolerance or minimum area (``prefix``: the CLI's names)."""
    for name, value in (('simplify', simplify), ('min-area' if prefix else 'min_area', min_area)):
        if not (float(value) >= 0):  # NaN too
            raise ValueError(f"{prefix}{name} must be >= 0, got {value} (0: "
                             f"{'exact pixel edges' if name == 'simplify' else 'keep every polygon'})")


def _metres_per_unit(crs):
    """(factor, geographic): map units -> metres; None when the CRS is unknown."""
    if crs is None:
        return None, False
    if crs.is_geographic:
        return None, True
    try:
        _, factor = crs.linear_units_factor
    except Exception:  # e.g. an engineering CRS without units: metres is the usual meaning
        factor = 1.0
    return float(factor), False


def _is_mercator(crs):
    """Web Mercator (EPSG:3857) and the other Mercator projections, whose units are metres only
    at the equator (at 47 degrees N a square 'metre' of the map is 0.46 m2 of ground)."""
    if crs is None or crs.is_geographic:
        return False
    try:
        return (crs.to_dict() or {}).get('proj') == 'merc' or crs.to_epsg() in (3857, 3395, 900913)
    except Exception:
        return False


class _Region:
    """One class region under construction: its pieces (pixel coordinates) and pixel sums."""
    __slots__ = ('cls', 'pieces', 'count', 'psum', 'ymin', 'ymax')

    def __init__(self, cls, piece, count, psum, ymin, ymax):
        self.cls, self.pieces, self.count, self.psum = cls, [piece], count, psum
        self.ymin, self.ymax = ymin, ymax

    def absorb(self, other):
        self.pieces.extend(other.pieces)
        self.count += other.count
        self.psum += other.psum
        self.ymin, self.ymax = min(self.ymin, other.ymin), max(self.ymax, other.ymax)


def _find(parent, i):
    root = i
    while parent[root] != root:
        root = parent[root]
    while parent[i] != root:  # path compression
        parent[i], i = root, parent[i]
    return root


def _component_ids(cls_hW, valid_hW):
    """int32 ids (0 = none), one per 4-connected region of equal class, and their count."""
    ids = np.zeros(cls_hW.shape, np.int32)
    n = 0
    for c in np.unique(cls_hW[valid_hW]).tolist():
        binary = ((cls_hW == c) & valid_hW).astype(np.uint8)
        k, lab = cv2.connectedComponents(binary, connectivity=4, ltype=cv2.CV_32S)
        if k > 1:
            inside = lab > 0
            ids[inside] = lab[inside] + n
            n += k - 1
    return ids, n


def vectorize_class_map(class_path, out_path, probs_path=None, classes=None, simplify=0.0,
                        min_area=0.0, exclude=(), band_rows=256, layer=None, overwrite=False):
    """Write the class regions of a class-map GeoTIFF as polygons; returns a summary dict
    (``features``, ``out_path``, ``height``, ``width``, and ``notes``: lines for the user, such as
    a ``simplify`` tolerance of many pixels).

    Args:
        class_path: single-band integer class map (``predict.py``'s ``*_classes.tif``); its
            nodata value (255 there) is left out.
        out_path: ``.gpkg``, ``.geojson`` or ``.fgb``; an existing file is refused unless
            ``overwrite``. Written under ``<name>.ds_seg-partial<ext>`` and renamed when complete, so
            an interrupted run neither leaves a partial file nor loses an older one.
        probs_path: K-band uint8 probabilities x 250 (``*_probs.tif``): adds ``mean_prob``.
        classes: class names (default: the ``classes`` tag of the class map, else ``class_<i>``).
        simplify: Douglas-Peucker tolerance in map units (0: exact pixel edges). Each polygon is
            simplified on its own, so neighbours may no longer share edges exactly.
        min_area: regions smaller than this many square metres are dropped.
        exclude: class ids or names not written (e.g. background).
        band_rows: rows per band (memory: about ``band_rows x width x (25 + K)`` bytes, plus the
            regions still open at the band edge; 20000 px wide: 256 rows ~ 600 MB peak in all).

    Example::

        info = vectorize_class_map('a_classes.tif', 'a.fgb', exclude=['background'])
        print(info['features'], 'polygons')
    """
    driver = vector_driver(out_path)
    check_vector_options(simplify, min_area)
    if os.path.exists(out_path) and not overwrite:
        raise FileExistsError(f"{out_path} already exists; remove it or choose another name "
                              f"(vector outputs are never overwritten)")
    from .inputs import replaced_when_done
    # The file is written under a temporary name (see below), from which GDAL would name the
    # layer ('a_classes.ds_seg-partial'): name it after the final file, as writing there directly would.
    layer = layer or os.path.splitext(os.path.basename(out_path))[0]
    with replaced_when_done(out_path, overwrite) as tmp:
        summary = _vectorize(class_path, tmp, probs_path, classes, simplify, min_area, exclude,
                             band_rows, layer, driver)
    return dict(summary, out_path=out_path)


def _vectorize(class_path, out_path, probs_path, classes, simplify, min_area, exclude, band_rows,
               layer, driver):
    import pyogrio.raw
    import shapely

    with rasterio.open(class_path) as src, \
            (rasterio.open(probs_path) if probs_path else _NullContext()) as psrc:
        if src.count != 1 or src.dtypes[0] not in ('uint8', 'uint16', 'int16', 'int32', 'uint32'):
            raise ValueError(f"{class_path}: expected one integer band of class ids, found "
                             f"{src.count} band(s) of {src.dtypes[0]}")
        refusal = georeference_refusal(src, class_path) or geojson_crs_refusal(src.crs, class_path, out_path)
        if refusal:
            raise ValueError(refusal)
        notes = []
        pixel = min(abs(src.res[0]), abs(src.res[1]))
        if simplify and pixel and simplify / pixel > 10:
            # A tolerance in map units: 0.5 meant for metres is 55 km in a scene in degrees
            # (EPSG:4326), where the polygons of a 0.0003-degree scene lost their shape without a word.
            units = 'degrees' if src.crs and src.crs.is_geographic else (
                (src.crs.linear_units if src.crs else None) or 'map units')
            units = {'metre': 'metres', 'meter': 'metres', 'foot': 'feet', 'US survey foot': 'US survey feet'}.get(
                units, units)
            notes.append(f"simplify {simplify:g} is in the class map's {units}: {simplify / pixel:,.0f} of its pixels "
                         f"({pixel:g} {units} each), so the polygons keep little of their shape; a tolerance of a "
                         f"pixel or two is {pixel:g}-{2 * pixel:g}")
        if classes is None:
            tag = src.tags().get('classes')
            try:
                classes = json.loads(tag) if tag else None
            except ValueError:
                classes = None
            if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
                classes = None
            if tag and classes is None:  # not the JSON list of names predict writes: not guessed at
                raise ValueError(f"{class_path}: its 'classes' tag ({tag[:60]!r}) is not a JSON list of class "
                                 "names; give the names with --classes, or fix the tag "
                                 "(gdal_edit.py -mo classes='[\"a\", \"b\"]')")
        if classes is None:
            # Unnamed: class_<id> for every id the pixel type holds, named when written (a list of
            # 2^32 names for an int32 map ran out of memory). 256 ids for exclude= to name.
            classes = [f'class_{i}' for i in range(256)]
        classes = list(classes)
        skip = set(exclude_ids(exclude, classes))
        if psrc is not None and (psrc.width, psrc.height) != (src.width, src.height):
            raise ValueError(f"{probs_path} is {psrc.width}x{psrc.height} but {class_path} is "
                             f"{src.width}x{src.height}")
        H, W = src.height, src.width
        T = src.transform
        pixel_area = abs(T.a * T.e - T.b * T.d)  # map units^2
        factor, geographic = _metres_per_unit(src.crs)
        mercator = _is_mercator(src.crs)
        nodata = src.nodata

        def area_m2(region):
            if mercator:  # a Mercator metre is 1/cos(latitude) ground metres: areas scale by cos^2
                x, y = T * (W / 2, (region.ymin + region.ymax) / 2)
                lat = rasterio.warp.transform(src.crs, 'EPSG:4326', [x], [y])[1][0]
                return region.count * pixel_area * factor * factor * math.cos(math.radians(lat)) ** 2
            if factor is not None:
                return region.count * pixel_area * factor * factor
            if geographic:  # degrees^2 -> m^2 at the region's latitude (spherical earth)
                lat = (T * (0, (region.ymin + region.ymax) / 2))[1]
                k = math.pi / 180 * _EARTH_RADIUS_M
                return region.count * pixel_area * k * k * math.cos(math.radians(lat))
            return region.count * pixel_area  # no CRS: map units as they are

        matrix = np.array([[T.a, T.d], [T.b, T.e]])
        offset_xy = np.array([T.xoff, T.yoff])

        def to_map(xy):  # pixel (column, row) -> map coordinates
            return xy @ matrix + offset_xy
        out = dict(geoms=[], cls=[], area=[], prob=[])
        written = [0]

        def flush():
            if not out['geoms']:
                return
            # Vectorised over the batch: per-polygon shapely calls would dominate the run time.
            geoms = shapely.transform(np.array(out['geoms'], dtype=object), to_map)
            if simplify:
                geoms = shapely.simplify(geoms, simplify, preserve_topology=True)
            geoms, which = shapely.get_parts(geoms, return_index=True)  # MultiPolygon only if simplified so
            cls_ids = np.array(out['cls'], np.int32)[which]
            fields = ['class_id', 'class_name', 'area_m2']
            data = [cls_ids,
                    np.array([classes[c] if 0 <= c < len(classes) else f'class_{c}' for c in cls_ids.tolist()],
                             object),
                    np.array(out['area'], np.float64)[which]]
            if psrc is not None:
                fields.append('mean_prob')
                data.append(np.array(out['prob'], np.float32)[which])
            pyogrio.raw.write(out_path, shapely.to_wkb(geoms), field_data=data, fields=fields,
                              crs=src.crs.to_wkt() if src.crs else None, driver=driver,
                              geometry_type='Polygon', layer=layer, append=written[0] > 0)
            written[0] += len(geoms)
            for v in out.values():
                v.clear()

        def finish(region):
            area = area_m2(region)
            if area < min_area:
                return
            out['geoms'].append(region.pieces[0] if len(region.pieces) == 1
                                else shapely.union_all(region.pieces))
            out['cls'].append(region.cls)
            out['area'].append(area)
            out['prob'].append(region.psum / max(region.count, 1) / PROB_SCALE)
            if len(out['geoms']) >= _FLUSH_FEATURES:
                flush()

        open_regions = {}   # root id -> _Region, for regions reaching the previous band's edge
        edge_ids = None     # global ids of the previous band's last row (0: none)
        edge_cls = None
        next_id = 1
        band_rows = max(1, int(band_rows))
        for y0 in range(0, H, band_rows):
            h = min(band_rows, H - y0)
            win = Window(0, y0, W, h)
            cls = src.read(1, window=win)
            valid = np.ones(cls.shape, bool) if nodata is None else cls != nodata
            for c in skip:
                valid &= cls != c
            local, n = _component_ids(cls, valid)
            # Global ids of the first and last rows: all that links this band to its neighbours.
            gid_top, gid_bottom = (np.where(r > 0, r.astype(np.int64) + (next_id - 1), 0)
                                   for r in (local[0], local[-1]))
            counts = np.bincount(local.ravel(), minlength=n + 1)
            if psrc is not None:
                probs = psrc.read(window=win)
                own = np.take_along_axis(probs, np.minimum(cls, probs.shape[0] - 1)[None].astype(np.intp), 0)[0]
                psums = np.bincount(local.ravel(), weights=own.ravel().astype(np.float64), minlength=n + 1)
            else:
                psums = np.zeros(n + 1)
            parent = {}
            regions = {}
            # shapes() traces each id's region; ids are unique per region so one polygon each.
            offset = rasterio.Affine.translation(0, y0)
            cls_of = np.zeros(n + 1, np.int64)
            cls_of[local.ravel()] = cls.ravel()  # every pixel of a region has its class
            for geom, value in shapes(local, mask=local > 0, connectivity=4, transform=offset):
                i = int(value)
                g = next_id - 1 + i
                rings = geom['coordinates']
                poly = shapely.Polygon(rings[0], rings[1:])
                _, ymin, _, ymax = poly.bounds
                regions[g] = _Region(int(cls_of[i]), poly, int(counts[i]), float(psums[i]), ymin, ymax)
                parent[g] = g
            for r in open_regions:
                parent[r] = r
            if edge_ids is not None:
                top = gid_top
                touch = (edge_ids > 0) & (top > 0) & (edge_cls == cls[0])
                for a, b in set(zip(edge_ids[touch].tolist(), top[touch].tolist())):
                    ra, rb = _find(parent, a), _find(parent, b)
                    if ra != rb:
                        parent[rb] = ra
            # Gather the pieces under their roots.
            merged = {}
            for key, region in list(open_regions.items()) + list(regions.items()):
                root = _find(parent, key)
                if root in merged:
                    merged[root].absorb(region)
                else:
                    merged[root] = region
            last = y0 + h >= H
            still_open = set() if last else {_find(parent, g) for g in np.unique(gid_bottom).tolist() if g}
            open_regions = {}
            for root, region in merged.items():
                if root in still_open:
                    open_regions[root] = region
                else:
                    finish(region)
            if not last:
                edge_ids = np.array([_find(parent, g) if g else 0 for g in gid_bottom.tolist()], np.int64)
                edge_cls = cls[-1].copy()
            next_id += n
        flush()
        if written[0] == 0:  # an empty layer still says what it would hold
            _write_empty(out_path, driver, src.crs, psrc is not None, layer)
    return dict(features=written[0], out_path=out_path, height=H, width=W, notes=notes)


def _write_empty(path, driver, crs, with_probs, layer):
    import pyogrio.raw
    fields = ['class_id', 'class_name', 'area_m2'] + (['mean_prob'] if with_probs else [])
    data = [np.array([], np.int32), np.array([], object), np.array([], np.float64)]
    if with_probs:
        data.append(np.array([], np.float32))
    pyogrio.raw.write(path, np.array([], dtype=object), field_data=data, fields=fields,
                      crs=crs.to_wkt() if crs else None, driver=driver, geometry_type='Polygon',
                      layer=layer)


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def add_vector_args(parser):
    """The ``--vector`` options of ``launch/predict.py``."""
    parser.add_argument('--vector', type=os.path.expanduser, default=None, metavar='PATH|FORMAT',
                        help='also write class polygons: a .gpkg/.geojson/.fgb path (one input), or '
                             'a format (gpkg, geojson, fgb) for <output>/<name>_classes.<format>')
    parser.add_argument('--simplify', type=float, default=0.0,
                        help='polygon simplification tolerance in map units (default 0: pixel edges)')
    parser.add_argument('--min-area', type=float, default=0.0, help='drop polygons below this many m2')
    parser.add_argument('--exclude-classes', nargs='+', default=(), metavar='CLASS',
                        help='class names or ids not vectorised (e.g. background)')


def vector_outputs(vector, stems, output_dir, overwrite=False):
    """``--vector`` -> one output path per input; refuses existing files, folders that do not
    exist and ambiguous names. ``stems``: the inputs' output name stems, as their rasters get them
    (``ds_seg.inputs.output_stems``: ``a/x.tif`` and ``b/x.tif`` give ``a_x`` and ``b_x``).

    Example::

        vector_outputs('gpkg', ['a', 'b'], 'out')  # ['out/a_classes.gpkg', 'out/b_classes.gpkg']
    """
    from .config import ConfigError  # here: the vectoriser itself runs without the package (benchmark)
    if vector is None:
        return [None] * len(stems)
    if ('.' + vector.lower()) in DRIVERS:
        paths = [os.path.join(output_dir, f'{stem}_classes.{vector.lower()}') for stem in stems]
    else:
        try:
            vector_driver(vector)
        except ValueError as e:
            raise ConfigError(f"--vector: {e}") from e
        if len(stems) > 1:
            raise ConfigError(f"--vector {vector}: one file for {len(stems)} inputs; give a format "
                              f"(gpkg, geojson or fgb) to write one file per input into --output")
        parent = os.path.dirname(os.path.abspath(vector))
        if not os.path.isdir(parent) and parent != os.path.abspath(output_dir):
            from .inputs import missing_folder
            raise ConfigError(f"--vector: {missing_folder(parent)} (or write into --output)")
        paths = [vector]
    for p in paths:
        if os.path.isdir(p):
            raise ConfigError(f"--vector: {p} is a folder; give a file name")
        if os.path.exists(p) and not overwrite:
            raise ConfigError(f"--vector: {p} already exists; choose another name, delete it, or add --overwrite")
    return paths
