"""Procedurally generated aerial scenes, written as real tiled GeoTIFFs.

The default experiment needs data that exists everywhere (no download), exercises the same
GeoTIFF path as real datasets, and is hard enough that a model has to learn texture and shape,
not a colour lookup: grey roofs look like roads, trees differ from grass mostly in brightness
and canopy texture, shadows darken whatever lies under them, and illumination varies across
the scene.

Example::

    rng = np.random.default_rng(0)
    image_CHW, label_HW = generate_scene(rng, 512)            # uint8 RGB
    ds = SyntheticAerial(split='train', crop_size=256)          # writes 8 scenes once, then reads
"""
import hashlib
import json
import os
import shutil
import tempfile
import zlib

import numpy as np
import rasterio
from rasterio.transform import from_origin

from ds_seg.config import checked_number
from ds_seg.registry import DATASETS

from .geotiff import STATS_FILE, GeoTiffScenes
from .raster import cache_root

CLASSES = ('grass', 'road', 'building', 'tree', 'water', 'car')
PALETTE = ((120, 190, 80), (128, 128, 128), (200, 60, 50), (20, 100, 30), (40, 90, 200),
           (250, 200, 0))
GRASS, ROAD, BUILDING, TREE, WATER, CAR = range(len(CLASSES))

# Bump when the generator's output changes, so cached scenes are regenerated.
GENERATOR_VERSION = 1
PIXEL_SIZE_M = 0.1
CRS = 'EPSG:32632'
DTYPE_SCALE = {'uint8': 255.0, 'uint16': 10000.0, 'float32': 1.0}

# Reflectance (red, green, blue, near infrared) in 0..1. NIR is high for vegetation, which is
# what makes the 4-band variant easier than RGB, as with real imagery.
_GRASS_GREEN = (0.30, 0.42, 0.20, 0.55)
_GRASS_DRY = (0.44, 0.44, 0.27, 0.42)
_TREE = (0.17, 0.28, 0.12, 0.62)
_ASPHALT = (0.40, 0.40, 0.41, 0.25)
_MARKING = (0.78, 0.78, 0.74, 0.50)
_WATER_DEEP = (0.08, 0.17, 0.28, 0.03)
_WATER_SHALLOW = (0.16, 0.28, 0.28, 0.07)
_ROOFS = ((0.58, 0.28, 0.22, 0.30),   # red tiles
          (0.43, 0.43, 0.45, 0.27),   # grey: deliberately close to asphalt
          (0.42, 0.32, 0.24, 0.30),   # brown
          (0.26, 0.26, 0.28, 0.20),   # dark
          (0.68, 0.67, 0.64, 0.45))   # light concrete
_CARS = ((0.85, 0.85, 0.85, 0.60), (0.07, 0.07, 0.08, 0.07), (0.70, 0.10, 0.10, 0.30),
         (0.12, 0.20, 0.60, 0.20), (0.60, 0.60, 0.62, 0.45))
# Texture amplitude per class (relative brightness) for fine (per pixel), medium (~4 px) and
# coarse (~32 px) noise: canopy is clumpy, grass patchy, roofs and water smooth.
_TEXTURE = np.array([[0.05, 0.07, 0.10],   # grass
                     [0.07, 0.02, 0.06],   # road
                     [0.03, 0.02, 0.03],   # building
                     [0.10, 0.22, 0.05],   # tree
                     [0.01, 0.02, 0.04],   # water
                     [0.02, 0.00, 0.00]],  # car
                    dtype=np.float32)


# ---------------------------------------------------------------------- numpy helpers
def _smooth_noise(rng, h, w, cell):
    """Unit-variance value noise: a random grid every ``cell`` px, smoothly interpolated."""
    grid = rng.standard_normal((h // cell + 3, w // cell + 3)).astype(np.float32)
    y = np.arange(h, dtype=np.float32) / cell + rng.random()
    x = np.arange(w, dtype=np.float32) / cell + rng.random()
    y0, x0 = y.astype(np.int64), x.astype(np.int64)
    fy, fx = (y - y0)[:, None], (x - x0)[None, :]
    fy, fx = fy * fy * (3 - 2 * fy), fx * fx * (3 - 2 * fx)  # smoothstep hides the grid
    top, bottom = grid[y0], grid[y0 + 1]
    out = ((top[:, x0] * (1 - fx) + top[:, x0 + 1] * fx) * (1 - fy)
           + (bottom[:, x0] * (1 - fx) + bottom[:, x0 + 1] * fx) * fy)
    return out / max(float(out.std()), 1e-6)


def _box_blur(a, r):
    """Mean over a (2r+1)^2 box on the first two axes, via cumulative sums (edges clamped)."""
    for axis in (0, 1):
        pad = [(0, 0)] * a.ndim
        pad[axis] = (r + 1, r)
        c = np.cumsum(np.pad(a, pad, mode='edge'), axis=axis, dtype=np.float32)
        n = a.shape[axis]
        hi = [slice(None)] * a.ndim
        lo = [slice(None)] * a.ndim
        hi[axis] = slice(2 * r + 1, 2 * r + 1 + n)
        lo[axis] = slice(0, n)
        a = (c[tuple(hi)] - c[tuple(lo)]) / (2 * r + 1)
    return a


def _shift(mask, dy, dx):
    """``mask`` moved by (dy, dx) pixels, filled with False."""
    out = np.zeros_like(mask)
    h, w = mask.shape
    out[max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        mask[max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


class _Canvas:
    """Label and reflectance being painted, plus painting of shapes in local boxes only."""

    def __init__(self, rng, h, w):
        self.rng, self.h, self.w = rng, h, w
        self.label = np.zeros((h, w), np.uint8)
        self.color = np.empty((h, w, 4), np.float32)
        self.caster = np.zeros((h, w), bool)  # what casts a shadow (buildings, trees)

    def box(self, cy, cx, radius):
        """Slices and local coordinates of the square of ``radius`` around (cy, cx), clipped."""
        y0, y1 = max(int(cy - radius), 0), min(int(cy + radius) + 2, self.h)
        x0, x1 = max(int(cx - radius), 0), min(int(cx + radius) + 2, self.w)
        if y0 >= y1 or x0 >= x1:
            return None
        dy = (np.arange(y0, y1, dtype=np.float32) - cy)[:, None]
        dx = (np.arange(x0, x1, dtype=np.float32) - cx)[None, :]
        return (slice(y0, y1), slice(x0, x1)), dy, dx

    def rect(self, cy, cx, half_len, half_wid, angle, margin=0.0):
        """Local box and mask of a rotated rectangle (long axis along ``angle``), or None."""
        b = self.box(cy, cx, np.hypot(half_len, half_wid) + margin)
        if b is None:
            return None
        sl, dy, dx = b
        c, s = np.cos(angle), np.sin(angle)
        u = dx * c + dy * s     # along the long axis
        v = -dx * s + dy * c    # across it
        mask = (np.abs(u) < half_len + margin) & (np.abs(v) < half_wid + margin)
        return sl, mask, u, v


# ---------------------------------------------------------------------- scene elements
def _paint_grass(cv, large):
    dryness = 1 / (1 + np.exp(-1.5 * large))[..., None]  # fields: green and dry patches
    cv.color[:] = (np.asarray(_GRASS_GREEN, np.float32) * (1 - dryness)
                   + np.asarray(_GRASS_DRY, np.float32) * dryness)


def _paint_water(cv, coarse, scale):
    rng = cv.rng
    for _ in range(int(rng.random() < 0.6) + int(rng.random() < 0.2 * scale)):
        cy, cx = rng.random() * cv.h, rng.random() * cv.w
        radius = rng.uniform(25, 90)
        b = cv.box(cy, cx, radius * 1.5)
        if b is None:
            continue
        sl, dy, dx = b
        r = np.sqrt(dy * dy + dx * dx) / radius
        mask = r < 1 + 0.35 * coarse[sl]  # irregular but smooth shoreline
        depth = np.clip(1.3 - r, 0, 1)[..., None]  # shallower (greener) near the shore
        color = (np.asarray(_WATER_DEEP, np.float32) * depth
                 + np.asarray(_WATER_SHALLOW, np.float32) * (1 - depth))
        cv.label[sl][mask] = WATER
        cv.color[sl][mask] = color[mask]


def _paint_roads(cv, scale):
    rng = cv.rng
    ys = np.arange(cv.h, dtype=np.float32)[:, None]
    xs = np.arange(cv.w, dtype=np.float32)[None, :]
    roads = []
    for _ in range(max(1, int(round(rng.integers(2, 5) * scale)))):
        if rng.random() < 0.6:   # most roads follow the survey grid
            angle = float(rng.integers(2)) * np.pi / 2 + rng.normal(0, 0.02)
        else:
            angle = rng.uniform(0, np.pi)
        cy, cx = rng.random() * cv.h, rng.random() * cv.w
        width = rng.uniform(10, 22)
        c, s = np.cos(angle), np.sin(angle)
        across = (xs - cx) * -s + (ys - cy) * c
        along = (xs - cx) * c + (ys - cy) * s
        mask = np.abs(across) < width / 2
        tone = np.float32(1 + rng.normal(0, 0.08))  # old and new asphalt
        cv.label[mask] = ROAD
        cv.color[mask] = np.asarray(_ASPHALT, np.float32) * tone
        if width > 14:  # dashed centre line, still labelled road
            dash = mask & (np.abs(across) < 0.8) & (np.mod(along, 24) < 12)
            cv.color[dash] = _MARKING
        roads.append((cy, cx, angle, width))
    return roads


def _paint_buildings(cv, roads, scale):
    rng = cv.rng
    placed = 0
    target = int(rng.integers(6, 15) * scale)
    for _ in range(target * 8):
        if placed >= target:
            break
        half_len, half_wid = rng.uniform(10, 32), rng.uniform(8, 20)
        # Buildings mostly line up with a road, as in real settlements.
        angle = roads[rng.integers(len(roads))][2] if rng.random() < 0.8 else rng.uniform(0, np.pi)
        cy, cx = rng.random() * cv.h, rng.random() * cv.w
        r = cv.rect(cy, cx, half_len, half_wid, angle, margin=3)
        if r is None:
            continue
        sl, clearance, _, _ = r
        if (cv.label[sl][clearance] != GRASS).any():
            continue
        sl, mask, u, v = cv.rect(cy, cx, half_len, half_wid, angle)
        roof = np.asarray(_ROOFS[rng.integers(len(_ROOFS))], np.float32)
        roof = roof * (1 + rng.normal(0, 0.06, 4)).astype(np.float32)
        shade = np.ones(mask.shape, np.float32)
        if rng.random() < 0.7:  # gable roof: the two halves catch the sun differently
            shade = np.where(v > 0, np.float32(0.8), np.float32(1.05))
        cv.label[sl][mask] = BUILDING
        cv.color[sl][mask] = roof * shade[mask][:, None]
        cv.caster[sl] |= mask
        placed += 1


def _paint_trees(cv, scale, medium):
    rng = cv.rng
    for _ in range(int(rng.integers(6, 14) * scale)):
        gy, gx = rng.random() * cv.h, rng.random() * cv.w
        for _ in range(int(rng.integers(2, 12))):
            cy, cx = gy + rng.normal(0, 18), gx + rng.normal(0, 18)
            iy, ix = int(cy), int(cx)
            if not (0 <= iy < cv.h and 0 <= ix < cv.w) or cv.label[iy, ix] in (BUILDING, WATER):
                continue
            radius = rng.uniform(5, 13)
            b = cv.box(cy, cx, radius * 1.3)
            if b is None:
                continue
            sl, dy, dx = b
            r = np.sqrt(dy * dy + dx * dx) / radius
            mask = r + 0.15 * medium[sl] < 1  # ragged crown edge
            # A crown is a dome: lit in the middle, darker at the rim.
            crown = np.asarray(_TREE, np.float32) * np.float32(1 + rng.normal(0, 0.08))
            shade = np.clip(1.2 - 0.5 * r * r, 0.5, 1.2)[mask][:, None]
            cv.label[sl][mask] = TREE
            cv.color[sl][mask] = crown * shade
            cv.caster[sl] |= mask


def _paint_cars(cv, roads):
    rng = cv.rng
    for cy, cx, angle, width in roads:
        length = 2 * np.hypot(cv.h, cv.w)
        for _ in range(int(rng.poisson(length / 80))):
            t = rng.uniform(-length / 2, length / 2)
            lane = rng.choice((-1, 1)) * width / 4
            py = cy + t * np.sin(angle) + lane * np.cos(angle)
            px = cx + t * np.cos(angle) - lane * np.sin(angle)
            r = cv.rect(py, px, 4, 2, angle)  # ~8 x 4 px
            if r is None:
                continue
            sl, mask, u, _ = r
            if not mask.any() or mask.sum() < 20 or (cv.label[sl][mask] != ROAD).any():
                continue  # off the scene, partly under a tree or on another car
            body = np.asarray(_CARS[rng.integers(len(_CARS))], np.float32)
            glass = np.where((u > 0.5) & (u < 2.0), np.float32(0.45), np.float32(1.0))  # windscreen
            cv.label[sl][mask] = CAR
            cv.color[sl][mask] = body * glass[mask][:, None]


def generate_scene(rng, size, bands=3, dtype='uint8'):
    """One aerial-looking scene and its label map, with numpy only.

    Args:
        rng: ``np.random.Generator``; the scene is a pure function of its state.
        size: int or (height, width) in pixels (0.1 m each: cars are ~8 x 4 px).
        bands: 3 (RGB), 4 (RGB + NIR) or more (extra bands are fixed mixtures of the four).
        dtype: 'uint8' (0..255), 'uint16' (reflectance x 10000) or 'float32' (0..1).

    Returns:
        ``(image_CHW, label_HW)`` with ``label_HW`` uint8 indices into :data:`CLASSES`.

    Example::

        image, label = generate_scene(np.random.default_rng(0), 256, bands=4, dtype='uint16')
    """
    if dtype not in DTYPE_SCALE:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_SCALE)}, got {dtype!r}")
    if bands < 1:
        raise ValueError(f"bands must be >= 1, got {bands}")
    h, w = (size, size) if np.isscalar(size) else size
    h, w = int(h), int(w)
    scale = h * w / 512 ** 2  # object counts follow the area; object sizes stay in pixels
    fine = rng.standard_normal((h, w), dtype=np.float32)
    medium = _smooth_noise(rng, h, w, 4)
    coarse = _smooth_noise(rng, h, w, 32)
    large = _smooth_noise(rng, h, w, 128)

    cv = _Canvas(rng, h, w)
    _paint_grass(cv, large)
    _paint_water(cv, coarse, scale)
    roads = _paint_roads(cv, scale)
    _paint_buildings(cv, roads, scale)
    _paint_trees(cv, scale, medium)
    _paint_cars(cv, roads)
    label, img = cv.label, cv.color

    tex = _TEXTURE[label]
    img *= (1 + tex[..., 0] * fine + tex[..., 1] * medium + tex[..., 2] * coarse)[..., None]
    # Shadows fall towards the side away from the sun; the label stays what is under them.
    sun = rng.choice([-1, 1], 2) * rng.integers(3, 7, 2)
    shadow = _shift(cv.caster, int(sun[0]), int(sun[1])) & ~cv.caster
    img[shadow] *= np.float32(0.55)
    # Illumination: a gradient across the scene plus slow haze, then optics and sensor noise.
    gy, gx = rng.normal(0, 0.12, 2)
    ramp = (gy * np.linspace(-1, 1, h, dtype=np.float32)[:, None]
            + gx * np.linspace(-1, 1, w, dtype=np.float32)[None, :])
    img *= (1 + ramp + 0.05 * large)[..., None]
    img = 0.5 * img + 0.5 * _box_blur(img, 1)
    img += rng.normal(0, 0.015, img.shape).astype(np.float32)

    if bands > 4:  # more channels: fixed (scene-independent) mixtures of the four, like SWIR
        mix = np.random.default_rng(1234).dirichlet(np.ones(4), bands - 4).astype(np.float32)
        img = np.concatenate([img, img @ mix.T], axis=-1)
    img = np.clip(img[..., :bands], 0, 1) * np.float32(DTYPE_SCALE[dtype])
    if dtype != 'float32':
        img = np.rint(img)
    return np.ascontiguousarray(img.transpose(2, 0, 1).astype(dtype)), label


def seasonal_date(image_CHW, label_HW, date, num_dates, dtype, rng):
    """Date ``date`` of ``num_dates`` spread over a year: the same place, land cover unchanged.

    Vegetation follows the season (greener and brighter in NIR in summer, redder when dry),
    water a little, everything a per-date illumination, plus fresh sensor noise; roofs and
    roads stay as they are. A time series of one scene for temporal models.

    Example::

        image, label = generate_scene(np.random.default_rng(0), 256, bands=4)
        autumn = seasonal_date(image, label, 2, 4, 'uint8', np.random.default_rng(1))
    """
    phase = 2 * np.pi * date / num_dates
    c = image_CHW.shape[0]
    gain = np.ones((len(CLASSES), max(c, 4)), np.float32)
    veg = (1 + 0.20 * np.sin(phase), 1 + 0.25 * np.cos(phase), 1 + 0.10 * np.sin(phase), 1 + 0.30 * np.cos(phase))
    gain[GRASS, :4] = veg
    gain[TREE, :4] = [1 + 0.5 * (g - 1) for g in veg]  # evergreen-ish canopy: half the swing
    gain[WATER, :4] = 1 + 0.10 * np.cos(phase + 1)
    g = gain[label_HW][..., :c].transpose(2, 0, 1)
    scale = np.float32(DTYPE_SCALE[dtype])
    x = image_CHW.astype(np.float32) / scale * g * np.float32(1 + 0.08 * np.sin(phase + 0.7))
    x += rng.normal(0, 0.01, x.shape).astype(np.float32)
    x = np.clip(x, 0, 1) * scale
    return (x if dtype == 'float32' else np.rint(x)).astype(dtype)


# ---------------------------------------------------------------------- files on disk
def default_cache_dir():
    return cache_root()


def _block_size(crop_size):
    """Largest GeoTIFF block (256 down to 16) that is at most half the crop, so a random
    crop touches few blocks beyond its own pixels."""
    for b in (256, 128, 64, 32, 16):
        if b <= crop_size // 2:
            return b
    return 16


def _scene_rng(seed, split, index):
    # crc32, not hash(): str hashes are salted per process and would differ between ranks.
    return np.random.default_rng([seed, zlib.crc32(split.encode()), index])


def write_synthetic_scenes(root, split='train', num_scenes=8, scene_size=512, bands=3,
                           dtype='uint8', seed=0, block_size=128, dates=1):
    """Write (once) ``num_scenes`` scenes as GeoTIFFs under ``root/synthetic/<hash>/``.

    Returns the directory, holding ``image_NNN.tif``, ``label_NNN.tif``, ``stats.json`` and
    ``params.json``; with ``dates > 1`` a seasonal series ``image_NNN_tK.tif`` per scene
    instead of ``image_NNN.tif`` (:func:`seasonal_date`). Concurrent callers (ranks, tests) are safe: each writes a private
    temporary directory and renames it into place; the first rename wins, later ones discard
    theirs. A present directory is complete, because rename is atomic.
    """
    params = dict(version=GENERATOR_VERSION, split=split, num_scenes=int(num_scenes),
                  scene_size=int(scene_size), bands=int(bands), dtype=str(dtype), seed=int(seed),
                  block_size=int(block_size))
    if int(dates) > 1:  # only then: single-date caches keep their names
        params['dates'] = int(dates)
    digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    parent = os.path.join(os.fspath(root), 'synthetic')
    target = os.path.join(parent, digest)
    if os.path.isdir(target):
        return target
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{digest}.tmp-', dir=parent)
    try:
        _write_scenes(tmp, params)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isdir(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_scenes(directory, p):
    size, bands, bs = p['scene_size'], p['bands'], p['block_size']
    total = np.zeros(bands)
    total_sq = np.zeros(bands)
    # A distinct origin per split and scene: the scenes are different places on the map.
    west0 = 400_000 + (zlib.crc32(p['split'].encode()) % 100) * 10_000
    common = dict(driver='GTiff', width=size, height=size, crs=CRS, tiled=True,
                  blockxsize=bs, blockysize=bs)  # uncompressed: the fastest window reads
    for i in range(p['num_scenes']):
        rng = _scene_rng(p['seed'], p['split'], i)
        image, label = generate_scene(rng, size, bands, p['dtype'])
        dates = p.get('dates', 1)
        series = ([(f'image_{i:03d}.tif', image)] if dates == 1 else
                  [(f'image_{i:03d}_t{t}.tif', seasonal_date(image, label, t, dates, p['dtype'], rng))
                   for t in range(dates)])
        transform = from_origin(west0 + 1000 * i, 5_500_000, PIXEL_SIZE_M, PIXEL_SIZE_M)
        # Explicit photometric: with the default, a 4th band would be written as alpha.
        photometric = 'RGB' if bands == 3 else 'MINISBLACK'
        for name, image in series:
            with rasterio.open(os.path.join(directory, name), 'w', count=bands,
                               dtype=p['dtype'], transform=transform, photometric=photometric,
                               interleave='pixel', **common) as dst:
                dst.write(image)
                dst.descriptions = tuple((['red', 'green', 'blue', 'nir']
                                          + [f'extra_{k}' for k in range(bands)])[:bands])
        with rasterio.open(os.path.join(directory, f'label_{i:03d}.tif'), 'w', count=1,
                           dtype='uint8', transform=transform, photometric='MINISBLACK',
                           **common) as dst:
            dst.write(label[None])
        for _, image in series:
            flat = image.reshape(bands, -1).astype(np.float64)
            total += flat.sum(1)
            total_sq += (flat * flat).sum(1)
    n = p['num_scenes'] * size * size * p.get('dates', 1)
    mean = total / n
    std = np.sqrt(np.maximum(total_sq / n - mean * mean, 0))
    with open(os.path.join(directory, STATS_FILE), 'w') as f:
        json.dump(dict(mean=mean.tolist(), std=std.tolist(), classes=list(CLASSES),
                       palette=[list(c) for c in PALETTE]), f, indent=1)
    with open(os.path.join(directory, 'params.json'), 'w') as f:
        json.dump(p, f, indent=1)


@DATASETS.register_module()
class SyntheticAerial(GeoTiffScenes):
    """Procedural aerial scenes (see :func:`generate_scene`), cached as GeoTIFFs, read as
    :class:`GeoTiffScenes`. Train and val scenes come from different seeds.

    Configurable so it can stand in for real data: ``num_scenes`` and ``scene_size`` (pixels),
    ``bands`` (how many to generate: 3 RGB, 4 + NIR, more: mixtures, like multispectral),
    ``dtype`` ('uint8', 'uint16', 'float32'), and ``classes``: a subset of :data:`CLASSES`
    names, every unlisted class merged into the first listed one (e.g. ``('grass',
    'building')`` is a binary building task), ``dates``: a seasonal series of that many dates
    per scene (T x ``bands`` channels, for :class:`~ds_seg.models.temporal.TemporalSegmentor`). Other keyword arguments (``augment``,
    ``random_scale``, ``transforms``, ``mean``, ...) go to :class:`GeoTiffScenes`.

    Example::

        train = SyntheticAerial(split='train', crop_size=256)              # 8 scenes of 512 px
        val = SyntheticAerial(split='val', bands=4, dtype='uint16')        # 2 scenes, grid mode
        big = SyntheticAerial(num_scenes=2, scene_size=2048, bands=8, dtype='uint16',
                              classes=('grass', 'building', 'road'))
    """

    def __init__(self, split='train', num_scenes=None, scene_size=512, bands=3, dtype='uint8',
                 cache_dir=None, seed=0, crop_size=256, mode=None, ignore_index=255, classes=None,
                 dates=1, **kw):
        if classes is not None:
            if isinstance(classes, str) or not isinstance(classes, (list, tuple)):
                # A count (classes=5, as GeoTiffScenes takes) failed as "'int' object is not iterable".
                raise ValueError(f"SyntheticAerial classes must be a list of names from {CLASSES} (the ones to "
                                 f"keep, in order), got {classes!r}; it draws these {len(CLASSES)} classes itself")
            unknown = [c for c in classes if c not in CLASSES]
            if unknown or not classes:
                raise ValueError(f"SyntheticAerial classes must be names from {CLASSES}, got {classes!r}")
            kw['label_map'] = {i: (list(classes).index(c) if c in classes else 0)
                               for i, c in enumerate(CLASSES)}
        given = [key for key in ('images', 'labels') if key in kw]
        if given:  # was "GeoTiffScenes.__init__() got multiple values for keyword argument 'images'"
            section = 'data.val' if split == 'val' else 'data.train'
            raise ValueError(f"SyntheticAerial generates its own scenes and takes no {' or '.join(given)}; for "
                             "your files set type='GeoTiffScenes' (e.g. --cfg-options "
                             f"{section}.type=GeoTiffScenes {section}.images=... {section}.labels=...)")
        if not isinstance(split, str) or not split.strip():
            # A list, a number or None reached the scene writer: an AttributeError traceback.
            raise ValueError(f"SyntheticAerial split must be a name, 'train' or 'val' (its scenes' seed), "
                             f"got {split!r}")
        if num_scenes is None:
            num_scenes = 8 if split == 'train' else 2
        # True was one scene, 0 a divide-by-zero warning then "images: no files given".
        checked_number('SyntheticAerial', 'num_scenes', num_scenes, low=1, integer=True)
        checked_number('SyntheticAerial', 'scene_size', scene_size, low=16, integer=True)
        checked_number('SyntheticAerial', 'bands', bands, low=1, integer=True)
        checked_number('SyntheticAerial', 'dates', dates, low=1, integer=True)
        crop = crop_size if isinstance(crop_size, int) else min(crop_size)
        root = cache_dir or default_cache_dir()
        try:
            self.directory = write_synthetic_scenes(
                root, split=split, num_scenes=num_scenes,
                scene_size=scene_size, bands=bands, dtype=dtype, seed=seed,
                block_size=_block_size(crop), dates=dates)
        except OSError as exc:  # "[Errno 2] No such file or directory: '/proc/ds_seg_cache'": whose folder?
            where = ('cache_dir' if cache_dir else
                     '$DS_SEG_CACHE' if os.environ.get('DS_SEG_CACHE') else '~/.cache/ds_seg ($DS_SEG_CACHE moves it)')
            raise ValueError(f"the synthetic scenes cannot be written under {root} ({where}): "
                             f"{exc.strerror or exc}; give a writable folder") from exc
        # The scenes are the seed's (train.seed): recorded in checkpoints, so a resume at another
        # seed, which trains and validates on other scenes, is refused (checkpointer._check_data).
        self.generated_from_seed = int(seed)
        with open(os.path.join(self.directory, STATS_FILE)) as f:
            stats = json.load(f)
        kw.setdefault('mean', stats['mean'])
        kw.setdefault('std', stats['std'])
        super().__init__(
            images=[os.path.join(self.directory, f'image_{i:03d}.tif') if dates == 1 else
                    [os.path.join(self.directory, f'image_{i:03d}_t{t}.tif') for t in range(dates)]
                    for i in range(num_scenes)],
            labels=[os.path.join(self.directory, f'label_{i:03d}.tif') for i in range(num_scenes)],
            crop_size=crop_size, mode=mode, split=split,
            classes=CLASSES if classes is None else tuple(classes),
            ignore_index=ignore_index, seed=seed, **kw)
