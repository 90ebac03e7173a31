"""Joint image/label transforms, label decoding, and the per-step random scale.

Every random choice takes an explicit ``numpy.random.Generator`` (the dataset derives it from
the sample index), never a global RNG: a sample is then the same whatever process, worker or
rank computes it, which is what makes loaders with 0 and 2 workers give identical batches.

Transforms work on ``image_CHW`` in the file's units and dtype (normalisation happens later, on
the device: :mod:`ds_seg.data.preprocess`) and ``label_HW`` integer class indices with
``ignore_index``; they return the same dtypes (views with negative strides are fine).

A transform that moves pixels (a flip, a rotation, a crop) must move the window's nodata mask
with them: the device zeroes the input wherever the mask says, so an unmoved mask blanks valid
pixels and leaves nodata in. Such a transform takes ``invalid=None`` (``invalid_HW`` bool, or
None) and, given one, returns ``(image, label, invalid)``. A registered transform without that
parameter is taken to leave pixels in place; :class:`Compose` stops with its name if it moved
the labels of nodata pixels.

Example::

    from ds_seg.registry import TRANSFORMS, build
    t = build(TRANSFORMS, dict(type='PhotoMetricDistortion', brightness=0.2))
    image, label = t(image_CHW, label_HW, np.random.default_rng(0))
"""
import inspect
import numbers

import numpy as np

from ds_seg.config import checked_number
from ds_seg.data.preprocess import work_dtype
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

    def __call__(self, image, label, rng, invalid=None):
        # One draw per direction whether or not it is used: the stream of draws (and so every
        # later transform's randomness) does not depend on the configured directions.
        draws = rng.random(2) < self.prob
        planes = [image, label] + ([] if invalid is None else [invalid])
        if 'horizontal' in self.direction and draws[0]:
            planes = [p[..., ::-1] for p in planes]
        if 'vertical' in self.direction and draws[1]:
            planes = [p[..., ::-1, :] for p in planes]
        return tuple(planes)


@TRANSFORMS.register_module()
class RandomRotate90:
    """Rotation by a random multiple of 90 degrees (180 only, for non-square crops, so the
    shape stays the same on every sample).

    Example::

        image, label = RandomRotate90()(img, lbl, rng)
    """

    def __init__(self, prob=0.75):
        self.prob = float(checked_number('RandomRotate90', 'prob', prob, high=1.0))

    def __call__(self, image, label, rng, invalid=None):
        apply, k = rng.random() < self.prob, int(rng.integers(1, 4))
        planes = [image, label] + ([] if invalid is None else [invalid])
        if not apply:
            return tuple(planes)
        if image.shape[-1] != image.shape[-2]:
            k = 2
        return tuple(np.rot90(p, k, axes=(-2, -1)) for p in planes)


@TRANSFORMS.register_module()
class PhotoMetricDistortion:
    """Brightness, contrast and saturation jitter, like mmseg's PhotoMetricDistortion but in
    units of each band's standard deviation (inputs may be uint16 or float, so there is no
    0..255 range to work in).

    brightness: add U(-b, b) standard deviations; contrast: scale the distance from the band
    mean by U(1-c, 1+c); saturation: blend each normalised band with the mean of the bands by
    U(1-s, 1+s); in a time series (``num_dates`` > 1, channels date-major) each date is blended
    with the mean of its own bands, as each date is its own image. Integer images stay in their
    dtype (rounded, clipped to its range), as mmseg's stay in 0..255. The dataset tells the
    transform its band statistics and dates (:meth:`bind_image_stats`); unbound, it treats the
    input as already normalised. The label never changes.

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
        self.num_dates = 1

    def bind_image_stats(self, mean, std, num_dates=1):
        self.mean = np.asarray(mean, np.float64).reshape(-1, 1, 1)
        self.std = np.asarray(std, np.float64).reshape(-1, 1, 1)
        self.num_dates = int(num_dates)

    def __call__(self, image, label, rng, invalid=None):
        """Pixels stay where they are: ``invalid`` comes back unchanged."""
        keep = () if invalid is None else (invalid,)
        use = rng.random(3) < self.prob
        b = rng.uniform(-self.brightness, self.brightness)
        c = rng.uniform(1 - self.contrast, 1 + self.contrast)
        s = rng.uniform(1 - self.saturation, 1 + self.saturation)
        if not use.any():
            return (image, label) + keep
        x = np.array(image, dtype=work_dtype(image.dtype), copy=True)
        if self.mean is not None:
            mean, std = self.mean.astype(x.dtype), self.std.astype(x.dtype)
            x -= mean
            x /= std
        if use[0]:
            x += np.float32(b)
        if use[1]:
            x *= np.float32(c)
        if use[2] and x.shape[0] > self.num_dates:
            # Per date: one grey over every date's bands pulled each date towards the others,
            # erasing the very differences a temporal model learns from.
            dated = x.reshape(self.num_dates, -1, *x.shape[1:])
            grey = dated.mean(axis=1, keepdims=True)
            x = (grey + np.float32(s) * (dated - grey)).reshape(x.shape)
        if self.mean is not None:
            x *= std
            x += mean
        if image.dtype.kind in 'iu':
            info = np.iinfo(image.dtype)
            x = np.clip(np.rint(x), info.min, info.max).astype(image.dtype)
        return (x, label) + keep


def takes_invalid(transform):
    """Whether a transform's ``__call__`` takes the nodata mask (``invalid=``)."""
    try:
        return 'invalid' in inspect.signature(transform).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no introspectable signature
        return False


class Compose:
    """Apply transforms built from config dicts in order, with one shared generator; the nodata
    mask goes through those that take it (see the module docstring)."""

    def __init__(self, transforms):
        if isinstance(transforms, (dict, str)):  # one transform without its list: iterated as keys
            raise ValueError(f"transforms must be a list of dicts, e.g. [dict(type='RandomFlip')], got {transforms!r}")
        self.transforms = [t if callable(t) else build(TRANSFORMS, t, where=f'transforms[{i}]')
                           for i, t in enumerate(transforms or [])]
        self._takes_invalid = [takes_invalid(t) for t in self.transforms]

    def __call__(self, image, label, rng, invalid=None):
        """``(image, label, invalid)`` after every transform (``invalid``: bool H x W, or None)."""
        for i, (t, moves_mask) in enumerate(zip(self.transforms, self._takes_invalid)):
            if invalid is None or moves_mask:
                out = t(image, label, rng) if invalid is None else t(image, label, rng, invalid=invalid)
                image, label = out[0], out[1]
                if invalid is not None:
                    invalid = out[2]
                continue
            # A transform that knows nothing of the mask: nodata pixels are ignore_index in the
            # label, so one that moved pixels shows as another label under the unmoved mask.
            marker = label[invalid].flat[0] if invalid.any() else None
            image, label = t(image, label, rng)
            if label.shape != invalid.shape or (marker is not None and (label[invalid] != marker).any()):
                raise ValueError(f"transforms[{i}] ({type(t).__name__}) moved pixels but not the nodata mask, "
                                 "so valid pixels would be blanked and nodata trained on; give its __call__ an "
                                 "`invalid=None` parameter and return (image, label, invalid) moved alike")
        return image, label, invalid

    def bind_image_stats(self, mean, std, num_dates=1):
        """Tell transforms that work in units of the band statistics what those are (``mean``,
        ``std``: per channel; ``num_dates``: how many dates the channels hold, date-major)."""
        for t in self.transforms:
            if hasattr(t, 'bind_image_stats'):
                # A user's transform written for single images may not take num_dates.
                dated = 'num_dates' in inspect.signature(t.bind_image_stats).parameters
                t.bind_image_stats(mean, std, **({'num_dates': num_dates} if dated else {}))

    def __bool__(self):
        return bool(self.transforms)


# ---------------------------------------------------------------------- random scale
RANDOM_SCALE_LIMITS = (0.1, 10.0)


def check_random_scale(random_scale):
    """None or a (low, high) pair with 0.1 <= low <= high <= 10; returned as a tuple of floats.

    A factor of 100 trained on 1-pixel windows of a 64-pixel crop blown up to 64 (exit 0), and
    0.01 on windows 100 times the crop, mostly padding: a percentage or a size given as a factor."""
    if random_scale is None:
        return None
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731 (numpy's too)
    pair = (random_scale, random_scale) if real(random_scale) else random_scale
    try:
        pair = tuple(pair)
    except TypeError:
        pair = ()
    low, high = RANDOM_SCALE_LIMITS
    if not (len(pair) == 2 and all(real(v) for v in pair)
            and low <= pair[0] <= pair[1] <= high):  # also NaN and inf (1e999), which crashed numpy's draw
        raise ValueError(f"random_scale must be (low, high) with {low:g} <= low <= high <= {high:g} (resize "
                         f"factors, e.g. (0.5, 2.0)), got {random_scale!r}")
    return float(pair[0]), float(pair[1])


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
    work = image_CHW if dtype in (np.uint8, np.uint16, np.int16, np.float32) else image_CHW.astype(work_dtype(dtype))
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
def check_colours(colours, key):
    """``colours`` as a list of (R, G, B) int tuples in 0..255, or ValueError naming ``key``.
    rasterio's ``colormap()`` gives RGBA quadruples: the alpha has no meaning for a class."""
    out = []
    for i, c in enumerate(colours):
        try:
            rgb = tuple(int(v) for v in c)
            exact = all(float(v) == int(v) for v in c)
        except (TypeError, ValueError):
            rgb, exact = (), False
        if len(rgb) != 3 or not exact or not all(0 <= v <= 255 for v in rgb):
            hint = ' (drop the alpha: rasterio colormap() entries are RGBA)' if len(rgb) == 4 else ''
            raise ValueError(f"{key}[{i}] is {c!r}; each colour must be an (R, G, B) triple of integers "
                             f"0..255{hint}")
        out.append(rgb)
    return out


def default_palette_tolerance(palette):
    """Half the smallest L-inf distance between two palette colours (at most 60), so a noisy
    colour can never be closer to a wrong entry than to its own."""
    p = np.asarray(palette, dtype=np.int64)
    if len(p) < 2:
        return 60
    d = np.abs(p[:, None, :] - p[None, :, :]).max(-1)
    d[np.eye(len(p), dtype=bool)] = 10 ** 6
    return int(min(60, max(0, (d.min() - 1) // 2)))


class PaletteDecoder:
    """RGB label window -> class indices (int16): a colour within ``tolerance`` (L-inf) of a
    palette entry is that class, of an ``ignore_colors`` entry ``ignore_index``, the nearest
    entry when several are; else ``unmatched`` (-1).

    Exact for every colour. A 32x32x32 table over quantised RGB (value >> 3) answers every pixel
    whose 8x8x8 bin decodes one way throughout (one gather per pixel: JPEG-like noise makes exact
    matching useless, and per-pixel distances cost ~10x more); pixels of the few bins that
    straddle a tolerance boundary, or hold two palette colours (grey codes 0, 1, 2...), are
    decoded by their distances.

    Example::

        decode = PaletteDecoder([(255, 255, 255), (0, 0, 255)], tolerance=20)
        classes_HW = decode(rgb_3HW)
    """

    _MIXED = -2  # table value of a bin that does not decode one way throughout
    _CHUNK = 16  # palette entries per pass when building the table and deciding mixed colours

    def __init__(self, palette, tolerance, ignore_colors=(), ignore_index=255, unmatched=-1):
        self.entries = np.asarray(list(palette) + list(ignore_colors), np.int64).reshape(-1, 3)
        self.values = np.asarray(list(range(len(palette))) + [ignore_index] * len(ignore_colors), np.int64)
        self.tolerance, self.unmatched = int(tolerance), int(unmatched)
        lo = (np.arange(32) * 8).astype(np.int32)
        grid = np.stack(np.meshgrid(lo, lo, lo, indexing='ij'), -1).reshape(-1, 1, 3)  # bin's low corner
        entries32 = self.entries.astype(np.int32)
        # Entries a few at a time: a bins x entries x 3 array of 150 classes was ~400 MB per rank.
        chunks = [slice(i, i + self._CHUNK) for i in range(0, len(entries32), self._CHUNK)]

        def distances(chunk):  # (nearest, farthest) L-inf distance of each bin's colours to each entry
            e = entries32[chunk][None]
            return (np.maximum(np.maximum(grid - e, e - (grid + 7)), 0).max(-1),
                    np.maximum(np.abs(grid - e), np.abs(grid + 7 - e)).max(-1))
        best_far = np.full(len(grid), np.iinfo(np.int32).max, np.int32)
        best = np.zeros(len(grid), np.int64)
        matchable = np.zeros(len(grid), bool)
        for chunk in chunks:
            nearest, farthest = distances(chunk)
            matchable |= (nearest <= self.tolerance).any(1)
            arg = farthest.argmin(1)
            better = farthest[np.arange(len(grid)), arg] < best_far   # strict: the first entry wins a tie
            best_far[better], best[better] = farthest[better, arg[better]], arg[better] + chunk.start
        # Entries of another class that some colour of the bin may be as close to as to `best`.
        rivals = np.zeros(len(grid), bool)
        for chunk in chunks:
            nearest, _ = distances(chunk)
            rivals |= ((nearest <= best_far[:, None]) & (self.values[chunk][None] != self.values[best][:, None])).any(1)
        lut = np.full(len(grid), self._MIXED, np.int64)
        lut[~matchable] = self.unmatched
        sure = (best_far <= self.tolerance) & ~rivals
        lut[sure] = self.values[best[sure]]
        self.lut = lut.astype(np.int16)
        # An entry's own colour is that entry (distance 0): found by a search, not by distances.
        # First occurrence of a colour wins, as argmin's does.
        packed = (self.entries[:, 0] << 16) | (self.entries[:, 1] << 8) | self.entries[:, 2]
        _, first = np.unique(packed, return_index=True)
        self._packed, self._packed_values = packed[first], self.values[first]

    def __call__(self, rgb_3HW):
        q = rgb_3HW.astype(np.uint16, copy=False) >> 3
        out = self.lut[(q[0] << 10) | (q[1] << 5) | q[2]]
        mixed = out == self._MIXED
        if mixed.any():
            out[mixed] = self.exact(rgb_3HW[:, mixed])
        return out

    def exact(self, rgb_3N):
        """Class of each colour by its distances to every entry (the reference the table follows),
        once per distinct colour: a noisy window holds far fewer colours than pixels."""
        rgb = rgb_3N.astype(np.int64)
        colours, back = np.unique((rgb[0] << 16) | (rgb[1] << 8) | rgb[2], return_inverse=True)
        at = np.minimum(np.searchsorted(self._packed, colours), len(self._packed) - 1)
        hit = self._packed[at] == colours
        decoded = np.empty(colours.shape, np.int16)
        decoded[hit] = self._packed_values[at[hit]]
        rest = colours[~hit]
        if rest.size:
            c = np.stack([rest >> 16, (rest >> 8) & 255, rest & 255], -1).astype(np.int32)[:, None, :]
            best_d = np.full(len(rest), np.iinfo(np.int32).max, np.int32)
            best = np.zeros(len(rest), np.int64)
            for i in range(0, len(self.entries), self._CHUNK):
                d = np.abs(c - self.entries[i:i + self._CHUNK].astype(np.int32)[None]).max(-1)
                arg = d.argmin(1)
                better = d[np.arange(len(rest)), arg] < best_d     # strict: the first entry wins a tie
                best_d[better], best[better] = d[better, arg[better]], arg[better] + i
            decoded[~hit] = np.where(best_d <= self.tolerance, self.values[best], self.unmatched)
        return decoded[back.reshape(-1)]
