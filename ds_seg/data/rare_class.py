"""Rare-class sampling (DAFormer, Hoyer et al. 2022) for windows cut from large scenes.

Each training window first draws a class ``c`` with probability ``p_c ∝ exp((1 - f_c) / T)``,
``f_c`` the class's share of the labelled pixels, then a pixel of class ``c`` and a window that
contains it. A class covering 0.5% of the pixels then appears in far more windows than uniform
positions would give it, so its gradient signal does not vanish (torchgeo #757, #1883).

Where the pixels of each class are is indexed once: the labels are read block row by block row
(through the dataset's own label decoding), every pixel is counted, and the pixels on a grid of
``stride`` (an eighth of the crop) are kept as candidate positions per class, plus up to
``_EXTRA_PER_BAND`` pixels of any class the grid misses in a band (a small object between grid
points is still found). The index is cached next to the labels (or in ``~/.cache/ds_seg``)
keyed by the label and image files' identity (size, time, sampled content; a URL's ETag) and
the decoding, like the band statistics.

Example::

    ds = GeoTiffScenes('scenes/*_rgb.tif', 'scenes/*_cls.tif', sampling='rare_class',
                       rare_class_temperature=0.01)
"""
import hashlib
import json
import os

import numpy as np
from rasterio.windows import Window

from .raster import file_identity, is_remote, user_cache_dir

_VERSION = 2  # 2: keyed to the images too
_BAND_ROWS = 1024
_EXTRA_PER_BAND = 64
_MAX_PER_CLASS = 200_000


def class_probabilities(counts, temperature):
    """DAFormer's ``p_c ∝ exp((1 - f_c) / T)`` over the classes present (absent classes: 0).

    Example::

        class_probabilities([900, 95, 5], 0.1)   # the 0.5% class is drawn most often
    """
    counts = np.asarray(counts, np.float64)
    if temperature <= 0:
        raise ValueError(f"rare_class_temperature must be > 0, got {temperature}")
    freq = counts / max(counts.sum(), 1.0)
    logits = (1.0 - freq) / float(temperature)
    logits = np.where(counts > 0, logits, -np.inf)
    p = np.exp(logits - logits[counts > 0].max())
    return p / p.sum()


def _cache_path(dataset, key):
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    first = dataset._scenes[0]['label']
    if not is_remote(first):
        local = os.path.join(os.path.dirname(os.path.abspath(first)), f'.ds_seg_classes_{digest}.npz')
        if os.access(os.path.dirname(local), os.W_OK) or os.path.exists(local):
            return local
    folder = user_cache_dir()
    return folder and os.path.join(folder, f'classes_{digest}.npz')


def _key(dataset, stride):
    """What the index depends on, or None where a file's version is unknown (not cached): the
    label files and the images (a vector label is burned into its image's grid, so one label
    file over a new image is a new index), and the decoding."""
    files = []
    for s in dataset._scenes:
        ident = [file_identity(p) for p in (s['label'], s['image'])]
        if None in ident:
            return None
        files.append(ident)
    return dict(version=_VERSION, files=files, classes=dataset.num_classes,
                ignore=dataset.ignore_index, stride=int(stride), decoding=dataset.label_decoding_digest())


def class_index(dataset, stride):
    """``(counts[K], locations)``: pixel counts per class and, per class, an ``(n, 3)`` int32
    array of candidate ``(scene, row, column)`` positions; cached (see the module docstring)."""
    key = _key(dataset, stride)
    if key is None:
        return _build(dataset, stride)
    path = _cache_path(dataset, key)
    if path is None:  # no writable cache folder
        return _build(dataset, stride)
    try:
        with np.load(path, allow_pickle=False) as z:
            if json.loads(str(z['key'])) == key:
                k = dataset.num_classes
                return z['counts'], [z[f'loc_{c}'] for c in range(k)]
    except (OSError, ValueError, KeyError):
        pass
    counts, locations = _build(dataset, stride)
    try:  # best effort, atomic: a read-only dataset folder just recomputes next time
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f'{path}.{os.getpid()}.tmp.npz'
        np.savez(tmp, key=json.dumps(key), counts=counts,
                 **{f'loc_{c}': loc for c, loc in enumerate(locations)})
        os.replace(tmp, path)
    except OSError:
        pass
    return counts, locations


def _build(dataset, stride):
    k, ignore = dataset.num_classes, dataset.ignore_index
    counts = np.zeros(k, np.int64)
    found = [[] for _ in range(k)]
    rng = np.random.default_rng(0)  # thinning is part of the cached index: fixed
    for i, s in enumerate(dataset._scenes):
        for y0 in range(0, s['height'], _BAND_ROWS):
            h = min(_BAND_ROWS, s['height'] - y0)
            label = np.asarray(dataset.read_label(i, Window(0, y0, s['width'], h)))
            valid = label[label != ignore].astype(np.int64)
            band_counts = np.bincount(valid, minlength=k)[:k]
            counts += band_counts
            first = (-y0) % stride  # the grid is global: rows y with y % stride == 0
            grid = label[first::stride, ::stride]
            seen = np.zeros(k, bool)
            for c in np.unique(grid[grid != ignore]).tolist():
                if c < k:
                    ys, xs = np.nonzero(grid == c)
                    found[c].append(np.stack([np.full_like(ys, i), ys * stride + first + y0, xs * stride], 1))
                    seen[c] = True
            for c in np.flatnonzero((band_counts > 0) & ~seen).tolist():
                ys, xs = np.nonzero(label == c)  # a class small enough to fall between grid points
                pick = rng.permutation(len(ys))[:_EXTRA_PER_BAND]
                found[c].append(np.stack([np.full(len(pick), i), ys[pick] + y0, xs[pick]], 1))
    locations = []
    for c in range(k):
        loc = np.concatenate(found[c]).astype(np.int32) if found[c] else np.zeros((0, 3), np.int32)
        if len(loc) > _MAX_PER_CLASS:
            loc = loc[np.sort(rng.choice(len(loc), _MAX_PER_CLASS, replace=False))]
        locations.append(loc)
    return counts, locations
