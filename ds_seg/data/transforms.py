"""Joint image/label transforms, label decoding, and the per-step random scale.

Every random choice takes an explicit ``numpy.random.Generator`` (the dataset derives it from
the sample index), never a global RNG: a sample is then the same whatever process, worker or
rank computes it, which is what makes loaders with 0 and 2 workers give identical batches.

Transforms work on ``image_CHW`` in the file's units and dtype (normalisation happens later, on
the device: :mod:`ds_seg.data.preprocess`) and ``label_HW`` integer class indices with
``ignore_index``; they return the same dtypes (views with negative strides are fine).

Example::

    from ds_seg.registry import TRANSFORMS, build
    t = build(TRANSFORMS, dict(type='PhotoMetricDistortion', brightness=0.2))
    image, label = t(image_CHW, label_HW, np.random.default_rng(0))
"""
import math

import numpy as np

from ds_seg.config import checked_number
from ds_seg.registry import TRANSFORMS, build


# ---------------------------------------------------------------------- joint transforms
@TRANSFORMS.register_module()
class RandomFlip:
    """Horizontal and/or vertical flip of image and label together.

    Example::

        image, label = RandomFlip(prob=0.5, direction=('horizontal', 'vertical'))(img, lbl, rng)
    """

    DIRECTIONS = ('horizontal', 'vertical')

    def __init__(self, prob=0.5, direction=('horizontal', 'vertical')):
        self.prob = float(checked_number('RandomFlip', 'prob', prob, high=1.0))
        self.direction = (direction,) if isinstance(direction, str) else tuple(direction)
        # A misspelt direction ('horizonal') would simply never flip.
        unknown = [d for d in self.direction if d not in self.DIRECTIONS]
        if unknown or not self.direction:
            raise ValueError(f"RandomFlip direction must be one or both of {', '.join(map(repr, self.DIRECTIONS))}, "
                             f"got {direction!r}")

    def __call__(self, image, label, rng):
        # One draw per direction whether or not it is used: the stream of draws (and so every
        # later transform's randomness) does not depend on the configured directions.
        draws = rng.random(2) < self.prob
        if 'horizontal' in self.direction and draws[0]:
            image, label = image[..., ::-1], label[..., ::-1]
        if 'vertical' in self.direction and draws[1]:
            image, label = image[..., ::-1, :], label[..., ::-1, :]
        return image, label


@TRANSFORMS.register_module()
class RandomRotate90:
    """Rotation by a random multiple of 90 degrees (180 only, for non-square crops, so the
    shape stays the same on every sample).

    Example::

        image, label = RandomRotate90()(img, lbl, rng)
    """

    def __init__(self, prob=0.75):
        self.prob = float(checked_number('RandomRotate90', 'prob', prob, high=1.0))

    def __call__(self, image, label, rng):
        apply, k = rng.random() < self.prob, int(rng.integers(1, 4))
        if not apply:
            return image, label
        if image.shape[-1] != image.shape[-2]:
            k = 2
        return np.rot90(image, k, axes=(-2, -1)), np.rot90(label, k, axes=(-2, -1))


@TRANSFORMS.register_module()
class PhotoMetricDistortion:
    """Brightness, contrast and saturation jitter, like mmseg's PhotoMetricDistortion but in
    units of each band's standard deviation (inputs may be uint16 or float, so there is no
    0..255 range to work in).

    brightness: add U(-b, b) standard deviations; contrast: scale the distance from the band
    mean by U(1-c, 1+c); saturation: blend each normalised band with the mean of the bands by
    U(1-s, 1+s). Integer images stay in their dtype (rounded, clipped to its range), as
    mmseg's stay in 0..255. The dataset tells the transform its band statistics
    (:meth:`bind_image_stats`); unbound, it treats the input as already normalised. The label
    never changes.

    Example::

        t = PhotoMetricDistortion(brightness=0.2, contrast=0.2, saturation=0.2, prob=0.5)
    """

    def __init__(self, brightness=0.2, contrast=0.2, saturation=0.2, prob=0.5):
        # contrast and saturation are the half-widths of factors around 1: above 1 a factor can be
        # negative and invert the bands.
        self.brightness = float(checked_number('PhotoMetricDistortion', 'brightness', brightness))
        self.contrast = float(checked_number('PhotoMetricDistortion', 'contrast', contrast, high=1.0))
        self.saturation = float(checked_number('PhotoMetricDistortion', 'saturation', saturation, high=1.0))
        self.prob = float(checked_number('PhotoMetricDistortion', 'prob', prob, high=1.0))
        self.mean = self.std = None

    def bind_image_stats(self, mean, std):
        self.mean = np.asarray(mean, np.float32).reshape(-1, 1, 1)
        self.std = np.asarray(std, np.float32).reshape(-1, 1, 1)

    def __call__(self, image, label, rng):
        use = rng.random(3) < self.prob
        b = rng.uniform(-self.brightness, self.brightness)
        c = rng.uniform(1 - self.contrast, 1 + self.contrast)
        s = rng.uniform(1 - self.saturation, 1 + self.saturation)
        if not use.any():
            return image, label
        x = np.array(image, dtype=np.float32, copy=True)
        if self.mean is not None:
            x -= self.mean
            x /= self.std
        if use[0]:
            x += np.float32(b)
        if use[1]:
            x *= np.float32(c)
        if use[2] and x.shape[0] > 1:
            grey = x.mean(axis=0, keepdims=True)
            x = grey + np.float32(s) * (x - grey)
        if self.mean is not None:
            x *= self.std
            x += self.mean
        if image.dtype.kind in 'iu':
            info = np.iinfo(image.dtype)
            x = np.clip(np.rint(x), info.min, info.max).astype(image.dtype)
        return x, label


class Compose:
    """Apply transforms built from config dicts in order, with one shared generator."""

    def __init__(self, transforms):
        if isinstance(transforms, (dict, str)):  # one transform without its list: iterated as keys
            raise ValueError(f"transforms must be a list of dicts, e.g. [dict(type='RandomFlip')], got {transforms!r}")
        self.transforms = [t if callable(t) else build(TRANSFORMS, t, where=f'transforms[{i}]')
                           for i, t in enumerate(transforms or [])]

    def __call__(self, image, label, rng):
        for t in self.transforms:
            image, label = t(image, label, rng)
        return image, label

    def bind_image_stats(self, mean, std):
        """Tell transforms that work in units of the band statistics what those are."""
        for t in self.transforms:
            if hasattr(t, 'bind_image_stats'):
                t.bind_image_stats(mean, std)

    def __bool__(self):
        return bool(self.transforms)


# ---------------------------------------------------------------------- random scale
def check_random_scale(random_scale):
    """None or a (low, high) pair with 0 < low <= high; returned as a tuple of floats."""
    if random_scale is None:
        return None
    if isinstance(random_scale, (int, float)):
        random_scale = (random_scale, random_scale)
    lo, hi = (float(v) for v in random_scale)
    if not 0 < lo <= hi < math.inf:  # inf (1e999) crashed numpy's draw at the first step
        raise ValueError(f"random_scale must be (low, high) with 0 < low <= high, got {random_scale!r}")
    return lo, hi


def scale_for_micro_step(seed, micro_step, random_scale):
    """The resize factor of every sample of global micro-step ``micro_step``, on every rank.

    A pure function of (seed, micro_step): ranks agree without communicating, a resumed run
    draws the same factors, and the number of workers does not matter.
    """
    if random_scale is None:
        return 1.0
    lo, hi = random_scale
    # 0x5CA1E separates this stream from the per-sample ones, which are seeded [seed, index].
    return float(np.random.default_rng([int(seed), 0x5CA1E, int(micro_step)]).uniform(lo, hi))


def resize(image_CHW, label_HW, invalid_HW, size_hw):
    """Image bilinear in its own dtype (integers rounded, as cv2 and mmseg's imrescale do),
    label and nodata mask (None: none) nearest, to ``size_hw``.

    Band by band on the CHW planes: no HWC transposes (3x faster for RGB, and any band count).
    Bilinear also when shrinking (at most 2x with the usual scale range): INTER_AREA costs 6x
    more at non-integer ratios, ~0.4 ms a band at 256 px.
    """
    import cv2
    h, w = size_hw
    if image_CHW.shape[-2:] == (h, w):
        return image_CHW, label_HW, invalid_HW
    dtype = image_CHW.dtype
    work = image_CHW if dtype in (np.uint8, np.uint16, np.int16, np.float32) else image_CHW.astype(np.float32)
    out = np.empty((image_CHW.shape[0], h, w), work.dtype)
    for band, dst in zip(work, out):
        cv2.resize(np.ascontiguousarray(band), (w, h), dst=dst, interpolation=cv2.INTER_LINEAR)
    if out.dtype != dtype:
        out = (np.rint(out) if dtype.kind in 'iu' else out).astype(dtype)

    def nearest(a):
        return cv2.resize(np.ascontiguousarray(a), (w, h), interpolation=cv2.INTER_NEAREST)
    lbl = nearest(label_HW.astype(np.uint16 if label_HW.max(initial=0) > 255 else np.uint8)).astype(label_HW.dtype)
    invalid = None if invalid_HW is None else nearest(invalid_HW.view(np.uint8)).view(bool)
    return out, lbl, invalid


# ---------------------------------------------------------------------- label decoding
def default_palette_tolerance(palette):
    """Half the smallest L-inf distance between two palette colours (at most 60), so a noisy
    colour can never be closer to a wrong entry than to its own."""
    p = np.asarray(palette, dtype=np.int64)
    if len(p) < 2:
        return 60
    d = np.abs(p[:, None, :] - p[None, :, :]).max(-1)
    d[np.eye(len(p), dtype=bool)] = 10 ** 6
    return int(min(60, max(1, (d.min() - 1) // 2)))


def palette_lut(palette, tolerance, ignore_colors=(), ignore_index=255, unmatched=-1):
    """A 32x32x32 lookup table from quantised RGB (value >> 3) to class index.

    A colour within ``tolerance`` (L-inf, measured from the centre of its quantisation bin, so
    the table is exact to +-4) of a palette entry decodes to that class, of an ``ignore_colors``
    entry to ``ignore_index``, else to ``unmatched``. JPEG-like noise moves colours by a few
    units: a lookup rather than an exact match tolerates it at the cost of one gather per pixel.
    """
    centres = (np.arange(32) * 8 + 4).astype(np.int64)
    grid = np.stack(np.meshgrid(centres, centres, centres, indexing='ij'), -1).reshape(-1, 3)
    entries = [np.asarray(c, np.int64) for c in palette] + [np.asarray(c, np.int64) for c in ignore_colors]
    values = list(range(len(palette))) + [ignore_index] * len(ignore_colors)
    dist = np.stack([np.abs(grid - e).max(-1) for e in entries], 0)
    best = dist.argmin(0)
    lut = np.where(dist[best, np.arange(len(grid))] <= tolerance + 4, np.asarray(values)[best], unmatched)
    return lut.astype(np.int16)


def decode_palette(rgb_3HW, lut):
    """Class indices (int16) of an RGB label window via :func:`palette_lut`."""
    q = rgb_3HW.astype(np.uint16, copy=False) >> 3
    return lut[(q[0] << 10) | (q[1] << 5) | q[2]]
