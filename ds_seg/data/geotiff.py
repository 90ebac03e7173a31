"""Fixed-size windows read from GeoTIFF image/label scene pairs.

Scenes are never read whole: every sample is one ``rasterio`` windowed read, so a 6000x6000
scene costs the same per sample as a 512x512 one (tiled files make that read touch only the
blocks under the window).

Two modes:

- ``'random'`` (training): sample ``index`` is a pure function of ``(seed, index)``: the scene,
  the position and the flips/rotation come from ``np.random.default_rng([seed, index])``. The
  sampler decides which indices a rank reads, so the stream is reproducible whatever the number
  of workers or ranks, and resuming means asking for the same indices again.
- ``'grid'`` (evaluation): a stride = crop grid that covers every pixel of every scene; pixels
  already covered by an earlier window are ``ignore_index`` in the later one, so a confusion
  matrix accumulated over all windows counts each scene pixel exactly once.

Example::

    ds = GeoTiffScenes('scenes/*_rgb.tif', 'scenes/*_label.tif', crop_size=512,
                       classes=('road', 'building', 'tree'))
    sample = ds[0]          # dict(image=float32 CxHxW, label=int64 HxW)
"""
import glob
import json
import math
import os
from collections import OrderedDict

import numpy as np
import rasterio
import torch
from rasterio.windows import Window

from ds_seg.registry import DATASETS

STATS_FILE = 'stats.json'            # written by dataset generators/converters next to images
STATS_CACHE_FILE = '.ds_seg_stats.json'  # our own cache of statistics computed on first use
_MAX_OPEN_FILES = 16


def configure_gdal_for_worker(cache_mb=64):
    """Bound GDAL's per-process block cache and threads; call before opening any raster.

    GDAL's default cache is a share of RAM *per process*, multiplied by DataLoader workers x
    ranks; and its internal threads compete with the workers that already parallelise reads.
    GDAL reads these variables when it first needs them, so set them before the first read.
    """
    os.environ['GDAL_CACHEMAX'] = str(int(cache_mb))  # values below 100000 are megabytes
    os.environ['GDAL_NUM_THREADS'] = '1'


def expand_paths(spec, what):
    """A path, a glob or a list of either -> list of paths (each glob sorted)."""
    if isinstance(spec, (str, os.PathLike)):
        spec = [spec]
    paths = []
    for item in spec:
        item = os.fspath(item)
        if glob.has_magic(item):
            matches = sorted(glob.glob(item))
            if not matches:
                raise ValueError(f"{what}: the pattern {item!r} matches no file")
            paths.extend(matches)
        else:
            paths.append(item)
    if not paths:
        raise ValueError(f"{what}: no files given")
    return paths


def grid_starts(length, crop):
    """Window starts with stride ``crop`` covering ``[0, length)``; the last one flush with the end."""
    if length <= crop:
        return [0]
    return list(range(0, length - crop, crop)) + [length - crop]


@DATASETS.register_module()
class GeoTiffScenes(torch.utils.data.Dataset):
    """Crops of ``crop_size`` from GeoTIFF scenes with a single-band label GeoTIFF each.

    Args:
        images, labels: paths or glob patterns (globs are sorted); paired by position.
        crop_size: int or (height, width) of every sample; smaller scenes are padded.
        mode: ``'random'`` or ``'grid'``; None: random for split 'train', grid otherwise.
        classes: tuple of class names or a class count; None: from ``stats.json`` next to the
            first image, else ``max label + 1`` from a one-time scan of the labels.
        mean, std: per selected band, in the file's units; None: ``stats.json`` next to the
            first image, else computed once from a decimated read and cached.
        bands: 1-based band indices to read (GDAL convention); None: all bands.
        augment: joint flips and 90-degree rotations in random mode; None: on for 'random'.

    Example::

        ds = GeoTiffScenes(['a.tif'], ['a_label.tif'], crop_size=256, classes=6, mode='grid')
        assert ds[0]['image'].shape == (ds.in_channels, 256, 256)
    """

    def __init__(self, images, labels, crop_size=256, mode=None, split='train', classes=None,
                 mean=None, std=None, bands=None, ignore_index=255, seed=0, augment=None):
        configure_gdal_for_worker()
        images = expand_paths(images, 'images')
        labels = expand_paths(labels, 'labels')
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels: they are paired by "
                             f"position, give one label file per image (first image {images[0]!r})")
        if mode is None:
            mode = 'random' if split == 'train' else 'grid'
        if mode not in ('random', 'grid'):
            raise ValueError(f"mode must be 'random' or 'grid', got {mode!r}")
        if isinstance(crop_size, int):
            crop_size = (crop_size, crop_size)
        self.crop_h, self.crop_w = (int(c) for c in crop_size)
        self.mode = mode
        self.split = split
        self.ignore_index = int(ignore_index)
        self.seed = int(seed)
        # Evaluation windows are never augmented: their labels are compared pixel for pixel.
        self.augment = mode == 'random' and (augment is None or bool(augment))

        self._scenes = [self._inspect(img, lbl) for img, lbl in zip(images, labels)]
        count = self._scenes[0]['count']
        for s in self._scenes:
            if s['count'] != count:
                raise ValueError(f"{s['image']}: {s['count']} bands, but {images[0]} has {count}; "
                                 f"all scenes of a dataset need the same bands")
        self.num_file_bands = count
        self.bands = list(range(1, count + 1)) if bands is None else [int(b) for b in bands]
        if not self.bands or min(self.bands) < 1 or max(self.bands) > count:
            raise ValueError(f"bands={bands!r}: {images[0]} has bands 1..{count} (1-based)")
        self.in_channels = len(self.bands)

        stats = self._stats_file(images[0])
        self.classes = self._resolve_classes(classes, stats)
        self.num_classes = len(self.classes)
        self.mean, self.std = self._resolve_stats(mean, std, stats, images)

        # Small numpy tables rather than lists of objects: cheap to pickle to every worker.
        self._areas = np.array([s['height'] * s['width'] for s in self._scenes], dtype=np.float64)
        self._scene_p = self._areas / self._areas.sum()
        self._num_random = int(sum(max(1, s['height'] // self.crop_h) * max(1, s['width'] // self.crop_w)
                                   for s in self._scenes))
        self._grid = self._build_grid()

        self._handles = None  # opened lazily per process: rasterio handles cannot be pickled
        self._pid = None

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _inspect(image, label):
        for path in (image, label):
            if not os.path.exists(path):
                raise ValueError(f"{path}: no such file")
        with rasterio.open(image) as img, rasterio.open(label) as lbl:
            if (img.width, img.height) != (lbl.width, lbl.height):
                raise ValueError(f"image {image} is {img.width}x{img.height} but label {label} is "
                                 f"{lbl.width}x{lbl.height}; they must have the same size")
            if not img.transform.almost_equals(lbl.transform):
                raise ValueError(f"image {image} and label {label} have different geotransforms "
                                 f"({tuple(img.transform)[:6]} vs {tuple(lbl.transform)[:6]}); "
                                 f"they must cover the same pixels")
            if lbl.count != 1:
                raise ValueError(f"label {label} has {lbl.count} bands; expected one band of class "
                                 f"indices (image {image})")
            return dict(image=image, label=label, width=img.width, height=img.height,
                        count=img.count, nodata=img.nodata)

    @staticmethod
    def _stats_file(first_image):
        path = os.path.join(os.path.dirname(os.path.abspath(first_image)), STATS_FILE)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return {}

    def _resolve_classes(self, classes, stats):
        if classes is None:
            classes = stats.get('classes')
        if classes is None:
            # One-time full read of the labels: slow for big datasets, so name the option.
            top = -1
            for s in self._scenes:
                with rasterio.open(s['label']) as src:
                    lbl = src.read(1)
                valid = lbl[lbl != self.ignore_index]
                if valid.size:
                    top = max(top, int(valid.max()))
            classes = top + 1
        if isinstance(classes, int):
            classes = tuple(f'class_{i}' for i in range(classes))
        return tuple(classes)

    def _select(self, values, what):
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.size == self.in_channels:
            return values
        if values.size == self.num_file_bands:
            return values[np.array(self.bands) - 1]
        raise ValueError(f"{what} has {values.size} values; expected one per selected band "
                         f"({self.in_channels}) or per file band ({self.num_file_bands})")

    def _resolve_stats(self, mean, std, stats, images):
        if mean is None or std is None:
            if 'mean' in stats and 'std' in stats:
                file_stats = stats
            else:
                file_stats = self._cached_or_computed_stats(images)
            mean = file_stats['mean'] if mean is None else mean
            std = file_stats['std'] if std is None else std
        mean = self._select(mean, 'mean')
        std = self._select(std, 'std')
        std = np.where(std > 0, std, 1.0)  # a constant band normalises to 0, not to inf
        return mean.astype(np.float32), std.astype(np.float32)

    def _cached_or_computed_stats(self, images):
        key = [os.path.abspath(p) for p in images[:4]]
        cache = os.path.join(os.path.dirname(key[0]), STATS_CACHE_FILE)
        try:
            with open(cache) as f:
                cached = json.load(f)
            if cached.get('images') == key:
                return cached
        except (OSError, ValueError):
            pass
        total = np.zeros(self.num_file_bands)
        total_sq = np.zeros(self.num_file_bands)
        n = 0
        for s in self._scenes[:4]:
            # A decimated read (GDAL picks overviews if any) is enough for normalisation stats.
            f = max(1.0, max(s['height'], s['width']) / 512)
            shape = (s['count'], max(1, int(s['height'] / f)), max(1, int(s['width'] / f)))
            with rasterio.open(s['image']) as src:
                x = src.read(out_shape=shape).reshape(s['count'], -1).astype(np.float64)
            if s['nodata'] is not None:
                x = x[:, ~self._nodata_mask(x, s['nodata'])]
            total += x.sum(1)
            total_sq += (x * x).sum(1)
            n += x.shape[1]
        mean = total / max(n, 1)
        std = np.sqrt(np.maximum(total_sq / max(n, 1) - mean * mean, 0))
        result = dict(images=key, mean=mean.tolist(), std=std.tolist())
        try:  # best effort: read-only dataset directories just recompute next time
            tmp = f'{cache}.{os.getpid()}.tmp'
            with open(tmp, 'w') as f:
                json.dump(result, f)
            os.replace(tmp, cache)
        except OSError:
            pass
        return result

    def _build_grid(self):
        rows = []
        for i, s in enumerate(self._scenes):
            ys = grid_starts(s['height'], self.crop_h)
            xs = grid_starts(s['width'], self.crop_w)
            for r, y in enumerate(ys):
                # Rows of this window already seen by the window above (same for columns).
                top = ys[r - 1] + self.crop_h - y if r else 0
                for c, x in enumerate(xs):
                    left = xs[c - 1] + self.crop_w - x if c else 0
                    rows.append((i, y, x, max(top, 0), max(left, 0)))
        return np.array(rows, dtype=np.int64).reshape(-1, 5)

    # ------------------------------------------------------------------ reading
    def __getstate__(self):
        state = self.__dict__.copy()
        state['_handles'] = None
        state['_pid'] = None
        return state

    def _open(self, path):
        # Handles opened in a parent process are not safe to use after fork: start afresh.
        if self._pid != os.getpid():
            self._handles = OrderedDict()
            self._pid = os.getpid()
        src = self._handles.get(path)
        if src is None:
            src = rasterio.open(path)
            self._handles[path] = src
            if len(self._handles) > _MAX_OPEN_FILES:
                self._handles.popitem(last=False)[1].close()
        else:
            self._handles.move_to_end(path)
        return src

    def _read(self, path, window, indexes):
        try:
            return self._open(path).read(indexes=indexes, window=window)
        except Exception as e:  # a worker's traceback alone would not say which file broke
            raise RuntimeError(f"{path}: cannot read window {window}: {e}") from e

    @staticmethod
    def _nodata_mask(raw_CHW, nodata):
        if isinstance(nodata, float) and math.isnan(nodata):
            return np.isnan(raw_CHW).all(axis=0)
        return (raw_CHW == nodata).all(axis=0)

    def _load(self, scene, y, x):
        """Normalised image and label of the crop at (y, x), padded to the crop size."""
        s = self._scenes[scene]
        h = min(self.crop_h, s['height'] - y)
        w = min(self.crop_w, s['width'] - x)
        window = Window(int(x), int(y), int(w), int(h))
        raw = self._read(s['image'], window, self.bands)
        label = self._read(s['label'], window, 1).astype(np.int64)
        image = (raw.astype(np.float32) - self.mean[:, None, None]) / self.std[:, None, None]
        if s['nodata'] is not None:
            nodata = self._nodata_mask(raw, s['nodata'])
            label[nodata] = self.ignore_index
            image[:, nodata] = 0
        bad = ((label >= self.num_classes) & (label != self.ignore_index)) | (label < 0)
        if bad.any():
            raise ValueError(f"{s['label']}: label value {int(label[bad][0])} in window {window} is "
                             f"not a class index 0..{self.num_classes - 1} nor ignore_index "
                             f"{self.ignore_index}; check `classes` or remap the labels")
        if (h, w) != (self.crop_h, self.crop_w):
            # Padding is 0 after normalisation (the band mean), like nodata, and ignored in the loss.
            padded = np.zeros((image.shape[0], self.crop_h, self.crop_w), np.float32)
            padded[:, :h, :w] = image
            padded_label = np.full((self.crop_h, self.crop_w), self.ignore_index, np.int64)
            padded_label[:h, :w] = label
            image, label = padded, padded_label
        return image, label

    def __len__(self):
        return self._num_random if self.mode == 'random' else len(self._grid)

    def __getitem__(self, index):
        index = int(index)
        if index < 0:
            raise IndexError(f"negative index {index}")
        if self.mode == 'random':
            return self._random_sample(index)
        return self._grid_sample(index)

    def _random_sample(self, index):
        rng = np.random.default_rng([self.seed, index])
        scene = int(rng.choice(len(self._scenes), p=self._scene_p))
        s = self._scenes[scene]
        y = int(rng.integers(0, max(s['height'] - self.crop_h, 0) + 1))
        x = int(rng.integers(0, max(s['width'] - self.crop_w, 0) + 1))
        # Always drawn, so switching augmentation off leaves positions unchanged.
        hflip, vflip = rng.random(2) < 0.5
        quarter_turns = int(rng.integers(4)) if self.crop_h == self.crop_w else 2 * int(rng.integers(2))
        image, label = self._load(scene, y, x)
        if self.augment:
            if hflip:
                image, label = image[..., ::-1], label[..., ::-1]
            if vflip:
                image, label = image[..., ::-1, :], label[..., ::-1, :]
            if quarter_turns:
                image = np.rot90(image, quarter_turns, axes=(-2, -1))
                label = np.rot90(label, quarter_turns, axes=(-2, -1))
        return dict(image=torch.from_numpy(np.ascontiguousarray(image)),
                    label=torch.from_numpy(np.ascontiguousarray(label)))

    def _grid_sample(self, index):
        scene, y, x, top, left = (int(v) for v in self._grid[index % len(self._grid)])
        image, label = self._load(scene, y, x)
        if index >= len(self._grid):
            label[:] = self.ignore_index  # padding for equal shards across ranks: counts nothing
        else:
            label[:top] = self.ignore_index
            label[:, :left] = self.ignore_index
        return dict(image=torch.from_numpy(image), label=torch.from_numpy(label))

    def window(self, index):
        """(image path, label path, rasterio Window) of grid window ``index``; for stitching."""
        scene, y, x, _, _ = (int(v) for v in self._grid[index % len(self._grid)])
        s = self._scenes[scene]
        return s['image'], s['label'], Window(x, y, min(self.crop_w, s['width'] - x),
                                              min(self.crop_h, s['height'] - y))

    @property
    def scenes(self):
        """Per-scene ``dict(image, label, width, height, count, nodata)``."""
        return [dict(s) for s in self._scenes]
