"""Vector labels (GeoPackage, GeoJSON, FlatGeobuf, Shapefile) rasterised per window, on the fly.

The features are read once, reprojected to the image's CRS if theirs differs, and indexed with
a shapely ``STRtree``; each window then rasterises only the features that intersect it, in the
window's own grid (``rasterio.features.rasterize``, pixel-centre rule, later features drawn
over earlier ones, as a whole-scene rasterisation in file order would). So a buildings layer
needs no pre-rasterised label GeoTIFF, and a window costs its own features, not the scene's.

Used by :class:`~ds_seg.data.GeoTiffScenes` when ``labels`` names a vector file::

    ds = GeoTiffScenes('tiles/*.tif', labels='buildings.gpkg', label_field='class', classes=3)
"""
import contextlib
import os
import re

import numpy as np
import rasterio
from rasterio._err import CPLE_BaseError
from rasterio.features import rasterize

from ds_seg.config import ConfigError
from ds_seg.data.raster import gdal_path, is_remote, remote_gdal_options

VECTOR_EXTENSIONS = ('.gpkg', '.geojson', '.json', '.fgb', '.shp', '.parquet')


@contextlib.contextmanager
def vector_env(path):
    """``raster.remote_gdal_options()`` for pyogrio's reads of a remote ``path``
    (a no-op for a local one), restored after; an option the user sets in the environment wins.

    pyogrio carries its own GDAL, which ``rasterio.Env`` does not reach: without this a vector
    over HTTP would be read with no time limit (a stalled server holds the run's start-up
    forever) and cached for the life of the process (a republished file read as old and new bytes).
    """
    if not is_remote(path):
        yield
        return
    import pyogrio
    # No .aux.xml probe: a vector has no PAM sidecar worth a request, and GeoPackage's close
    # makes it while pyogrio holds the GIL, which a server in this process cannot then answer.
    options = remote_gdal_options(GDAL_PAM_ENABLED='NO')
    before = {k: pyogrio.get_gdal_config_option(k) for k in options}
    pyogrio.set_gdal_config_options(options)
    try:
        yield
    finally:
        pyogrio.set_gdal_config_options(before)


def is_vector(path):
    """True when ``path`` names a vector file (by its extension)."""
    return os.fspath(path).lower().split('?')[0].endswith(VECTOR_EXTENSIONS)


class VectorLabels:
    """The features of one vector file, in one target CRS, with a class value each.

    Args:
        path: vector file (local or a URL GDAL reads).
        field: attribute holding the class: integers (class indices) or names (looked up in
            ``classes``); None: every feature is class 1 (binary, e.g. buildings).
        crs: the image CRS the geometries are brought to (None: taken as they are).
        classes: class names, for name-valued fields.
        layer: the layer of a file that holds several (a GeoPackage); None: its only layer.

    Example::

        v = VectorLabels('buildings.gpkg', 'class', crs=src.crs, classes=('bg', 'building'))
        label_HW = v.rasterize(src.transform, Window(0, 0, 256, 256), fill=0, dtype='uint8')
    """

    def __init__(self, path, field=None, crs=None, classes=None, layer=None, areas=None):
        import shapely
        self.path = os.fspath(path)
        what = f"labels {self.path}"
        try:
            with vector_env(self.path):
                meta, wkb, data = self._read(gdal_path(self.path), field, layer, what)
        except ConfigError:
            raise
        except Exception as e:  # pyogrio's DataSourceError and friends, a failed or stalled download
            raise ConfigError(f"{what}: cannot read it as a vector file ({e})") from e
        geoms = shapely.from_wkb(wkb)
        keep = ~shapely.is_missing(geoms) & ~shapely.is_empty(geoms)
        # Features without a geometry label no pixel: counted, so the dataset can say so (the only
        # 'road' feature vanished without a word, where a feature without a class is refused).
        self.without_geometry = int((~keep).sum())
        geoms = geoms[keep]
        self.named = False  # the field's values are class names (no label value to decode)
        if field is None or not len(data):   # (no column read: a file without features, see _read)
            values = np.ones(len(geoms), np.int64)
        else:
            raw = data[0][keep]
            if raw.dtype.kind == 'b':  # a yes/no field: classes 0 and 1
                raw = raw.astype(np.int64)
            missing = np.isnan(raw) if raw.dtype.kind == 'f' else np.array([v is None for v in raw], bool)
            if missing.any():
                raise ConfigError(f"{what}: {int(missing.sum())} feature(s) have no {field!r} value (null); "
                                  f"give each a class, or drop them")
            # Text that is all class names is names, digits included: classes ('1', '0') named by
            # a field of '1'/'0' were read as indices 1 and 0, the reverse of the names.
            as_names = raw.dtype.kind == 'O' and classes is not None and all(str(v) in classes for v in raw)
            if raw.dtype.kind == 'O' and not as_names and all(re.fullmatch(r'\s*[-+]?\d+\s*', str(v)) for v in raw):
                raw = np.array([int(str(v).strip()) for v in raw], np.int64)  # class indices stored as text
            if raw.dtype.kind == 'f' and not np.all(np.mod(raw, 1) == 0):
                fraction = raw[np.mod(raw, 1) != 0][0]
                raise ConfigError(f"{what}: field {field!r} holds the fraction {float(fraction)!r}; class indices are "
                                  "whole numbers (or give names with `classes`)")
            if raw.dtype.kind in 'iu' or raw.dtype.kind == 'f':
                values = raw.astype(np.int64)
            else:
                names = [str(v) for v in raw]
                if classes is None:
                    raise ConfigError(f"{what}: field {field!r} holds names ({names[0]!r}, ...); "
                                      f"give `classes` so they can be mapped to class indices")
                unknown = sorted(set(names) - set(classes))
                if unknown:
                    raise ConfigError(f"{what}: field {field!r} has value(s) {unknown[:5]} that are "
                                      f"not in classes {list(classes)}")
                index = {n: i for i, n in enumerate(classes)}
                values = np.array([index[n] for n in names], np.int64)
                self.named = True
        src_crs = meta.get('crs')
        self.file_crs = rasterio.crs.CRS.from_user_input(src_crs) if src_crs else None
        # GDAL gives every GeoJSON EPSG:4326, the format's own (RFC 7946), declared or not: files
        # in pixel coordinates (annotation tools write them) say it too.
        self.file_crs_declared = self.file_crs is not None and meta.get('driver') not in ('GeoJSON', 'GeoJSONSeq')
        # What the file holds, for the lines about it: features far from every image are dropped below.
        self.file_count = len(geoms)
        self.file_bounds = tuple(float(v) for v in shapely.total_bounds(geoms)) if len(geoms) else None
        if crs is not None and self.file_crs is not None and self.file_crs != crs:
            west, south, east, north = self.file_bounds or (0, 0, 0, 0)
            if self.file_crs.is_geographic and not (-540 <= west and east <= 540 and -90.5 <= south and north <= 90.5):
                raise ConfigError(f"{what}: its coordinates cannot be moved from its CRS ({self.file_crs}) to the "
                                  f"image's ({crs}): they span {self.file_bounds}, which are no degrees; the file's CRS "
                                  "is probably not the one its coordinates are in (metres labelled as EPSG:4326, "
                                  "say): set the right one (ogr2ogr -a_srs)")
            if areas:
                geoms, values = _near_areas(geoms, values, self.file_crs, crs, areas)
            try:
                geoms = _reproject(geoms, self.file_crs, crs)
            except (rasterio.errors.RasterioError, CPLE_BaseError) as exc:  # PROJ's "utm: Invalid latitude"
                reason = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
                raise ConfigError(f"{what}: its coordinates cannot be moved from its CRS ({self.file_crs}) to the "
                                  f"image's ({crs}): {reason}; the file's CRS is probably not the one its "
                                  "coordinates are in (metres labelled as EPSG:4326, say): set the right one "
                                  "(ogr2ogr -a_srs)") from None
        self.crs = crs
        self.geoms, self.values = geoms, values
        self._tree = None

    @staticmethod
    def _read(source, field, layer, what):
        """(meta, WKB geometries, field values) of the checked ``layer`` of ``source``."""
        import pyogrio
        import pyogrio.raw
        layers = [str(name) for name, _ in pyogrio.list_layers(source)]
        # GDAL would read the first of several layers (an AOI outline, say) without a word.
        if layer is None and len(layers) > 1:
            raise ConfigError(f"{what}: holds {len(layers)} layers ({', '.join(layers)}); set label_layer to "
                              f"the one with the labels")
        if layer is not None and str(layer) not in layers:
            raise ConfigError(f"{what}: no layer {layer!r}; its layers are {', '.join(layers)}")
        info = pyogrio.read_info(source, layer=layer)
        fields = list(info['fields'])
        # A file without features is a tile without labelled objects (below): an empty GeoJSON
        # has no fields to check either, and was refused as having "no field 'class'".
        if info.get('features') == 0 and field not in fields:
            field = None
        if field is not None and field not in fields:
            raise ConfigError(f"{what}: no field {field!r}; its fields are "
                              f"{', '.join(fields) or '(none)'}; set label_field to one of them")
        meta, _, wkb, data = pyogrio.raw.read(source, layer=layer, columns=[] if field is None else [field])
        return dict(meta, driver=info.get('driver')), wkb, data

    @property
    def max_value(self):
        return int(self.values.max(initial=-1))

    def __getstate__(self):  # the tree is rebuilt where it is used (cheap, and not picklable)
        state = self.__dict__.copy()
        state['_tree'] = None
        return state

    def _hits(self, transform, window):
        """Indices (file order) of the features that intersect ``window`` of the grid ``transform``."""
        import shapely
        if self._tree is None:
            self._tree = shapely.STRtree(self.geoms)
        t = transform
        x0, y0, w, h = window.col_off, window.row_off, window.width, window.height
        # The window's footprint: its four corners in map coordinates (any rotation).
        corners = [(t.a * x + t.b * y + t.c, t.d * x + t.e * y + t.f)
                   for x, y in ((x0, y0), (x0 + w, y0), (x0 + w, y0 + h), (x0, y0 + h))]
        return np.sort(self._tree.query(shapely.Polygon(corners), predicate='intersects'))

    def overlaps(self, transform, width, height):
        """True when some feature lies (partly) on the ``width`` x ``height`` image of ``transform``."""
        from rasterio.windows import Window
        return len(self._hits(transform, Window(0, 0, width, height))) > 0

    def bounds(self):
        """(xmin, ymin, xmax, ymax) of every feature, in the target CRS (None when there are none)."""
        import shapely
        if not len(self.geoms):
            return None
        return tuple(float(v) for v in shapely.total_bounds(self.geoms))

    def rasterize(self, transform, window, fill, dtype):
        """Class values of ``window`` (a rasterio Window of the image grid ``transform``)."""
        shape = (int(window.height), int(window.width))
        x0, y0 = window.col_off, window.row_off
        t = transform
        hits = self._hits(transform, window)  # file order: later on top
        if not len(hits):
            return np.full(shape, fill, dtype)
        win_transform = t @ rasterio.Affine.translation(x0, y0)
        geoms = _clip_far_reaching(self.geoms[hits], win_transform, shape)
        return rasterize(zip(geoms, self.values[hits].tolist()), out_shape=shape,
                         transform=win_transform, fill=fill, dtype=dtype)


# GDAL burns in pixel coordinates held in 32-bit ints: a polygon reaching 2**31 pixels from the
# window (a continent-wide "background" feature at 1 m) vanished from the labels without a word.
FAR_PIXELS = 2 ** 24


def _clip_far_reaching(geoms, win_transform, shape):
    """``geoms``, those that reach more than FAR_PIXELS from the window clipped to a box around
    it (a window's size beyond it on each side). A polygon's pixels in the window stay as they
    were; a line's may move by a pixel on a rotated grid (GDAL's tie-breaking follows its start
    point), which beats the line vanishing."""
    import shapely
    inv = ~win_transform
    xmin, ymin, xmax, ymax = shapely.bounds(geoms).T
    reach = np.zeros(len(geoms))
    for x, y in ((xmin, ymin), (xmin, ymax), (xmax, ymin), (xmax, ymax)):
        col, row = inv.a * x + inv.b * y + inv.c, inv.d * x + inv.e * y + inv.f
        reach = np.maximum(reach, np.maximum(np.abs(col), np.abs(row)))
    far = ~(reach <= FAR_PIXELS)  # NaN/inf bounds too
    if not far.any():
        return geoms
    h, w = shape
    corners = [win_transform * (c, r) for c in (-w, 2 * w) for r in (-h, 2 * h)]
    xs, ys = zip(*corners)
    geoms = geoms.copy()
    geoms[far] = shapely.clip_by_rect(geoms[far], min(xs), min(ys), max(xs), max(ys))
    return geoms


def _near_areas(geoms, values, file_crs, crs, areas):
    """The features near ``areas`` (image footprints ``(west, south, east, north)`` in ``crs``),
    clipped to a box around them in the file's CRS and with their edges split so that they bend
    as the reprojection bends them. A file of the whole world in EPSG:4326 had every vertex moved
    into the image's UTM zone: features on the other side of the globe landed on the tile (a
    Pacific lake painted over Germany), a point beyond the projection's domain refused the file,
    and a world-wide polygon collapsed to a line. Where the footprint cannot be moved into the
    file's CRS (or it crosses the antimeridian there), every feature is kept, as before."""
    import shapely
    from rasterio.warp import transform_bounds
    boxes = []
    for west, south, east, north in areas:
        # Half a footprint of margin on each side: nothing that reaches the image is cut.
        dx, dy = (east - west) / 2, (north - south) / 2
        try:
            box = transform_bounds(crs, file_crs, west - dx, south - dy, east + dx, north + dy, densify_pts=21)
        except Exception:
            return geoms, values
        if not all(np.isfinite(box)) or box[0] >= box[2] or box[1] >= box[3]:
            return geoms, values
        boxes.append(shapely.box(*box))
    near = np.zeros(len(geoms), bool)
    for box in boxes:
        near |= shapely.intersects(geoms, box)
    west, south, east, north = shapely.total_bounds(np.array(boxes))
    kept = shapely.clip_by_rect(geoms[near], west, south, east, north)
    kept = shapely.segmentize(kept, max(east - west, north - south) / 256)
    return kept, values[near]


def _reproject(geoms, src_crs, dst_crs):
    """Geometries from ``src_crs`` to ``dst_crs`` (GDAL's transformer, all vertices at once)."""
    import shapely
    from rasterio.warp import transform as warp

    def move(xy):
        x, y = warp(src_crs, dst_crs, xy[:, 0], xy[:, 1])
        return np.column_stack([x, y])

    return shapely.transform(geoms, move)
