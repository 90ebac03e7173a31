"""Where the windows of a scene fall and how much each window's pixels count when blended.

Example::

    window_starts(11, 4, 1)                                  # [0, 3, 6, 7]
    w = blend_weights((256, 256), 64, 'linear', borders=(True, False, True, False))
    plan = ScenePlan(1000, 800, tile=256, overlap=64, block=256, world_size=2)
"""
import math

import numpy as np

BLENDS = ('gaussian', 'linear', 'none')


def window_starts(length, tile, overlap, align=1):
    """Start offsets of windows of size ``tile`` with stride ``tile - overlap`` covering
    ``[0, length)``; the last window is flush with the end (a scene shorter than the tile
    gets one window at 0, padded; run_scene first cuts the tile down to such a scene).

    ``align``: the input multiple of the model (its deepest stride, 2**depth for a UNet, the
    patch for a ViT). Every start is a multiple of it, as every pixel's position in a whole-scene
    pass is: a start off that grid (the flush last window at ``length - tile``) put its pixels at
    another pooling phase than their neighbours', and their probabilities 70x as far from a
    whole-scene pass's as the rest. So the stride is rounded down to a multiple (the overlap
    grows), and the last window starts at the next multiple past ``length - tile``, padded
    beyond the scene as the model pads a whole scene.

    Example::

        window_starts(10, 4, 1)   # [0, 3, 6]
        window_starts(11, 4, 1)   # [0, 3, 6, 7]
        window_starts(11, 4, 1, align=2)   # [0, 2, 4, 6, 8]
    """
    if overlap < 0 or overlap >= tile:
        raise ValueError(f"overlap must be in [0, tile) = [0, {tile}), got {overlap}")
    if length <= tile:
        return [0]
    align = max(1, int(align))
    if align > tile - overlap:  # a stride of the multiple would leave gaps between windows: as before
        align = 1
    stride = (tile - overlap) // align * align
    last = -(-(length - tile) // align) * align
    return list(range(0, last, stride)) + [last]


def input_multiple(model):
    """The input multiple a model pads to (mmseg's ``size_divisor``: its deepest stride), its
    own or its backbone's, through what wraps it (a backend's bound ``forward``, a functools.wraps
    wrapper of one (training's evaluation checking for stops), DDP's or
    DeepSpeed's ``module``, torch.compile's ``_orig_mod``; an ONNX file's, from its card:
    deploy.load_onnx); 1 for anything else (a plain callable, an ONNX file exported before the
    card recorded it). Training's evaluation and evaluate.py must agree on it: they score alike."""
    todo, seen = [model], set()
    while todo:
        part = todo.pop(0)
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        divisor = getattr(part, 'size_divisor', None)
        if isinstance(divisor, int) and not isinstance(divisor, bool) and divisor > 0:
            return divisor
        todo += [getattr(part, name, None) for name in ('__self__', '__wrapped__', 'module', '_orig_mod', 'backbone')]
    return 1


def _profile(n, overlap, mode, at_start, at_end):
    """1-D blending weights over a window of ``n`` pixels.

    ``at_start``/``at_end`` mean that side lies on the scene border: no other window covers
    those pixels, so they keep full weight instead of fading out (otherwise border pixels
    would get weights near 0, and a float16 accumulator could lose them).
    """
    i = np.arange(n, dtype=np.float64) + 0.5
    if mode == 'none':
        w = np.ones(n)
    elif mode == 'linear':
        # Ramps of ``overlap`` pixels, (i + 0.5) / overlap: a rising ramp and the falling ramp
        # of the neighbour add up to exactly 1 over a regular overlap (partition of unity).
        w = np.ones(n)
        if overlap > 0:
            ramp = np.minimum(i / overlap, 1.0)
            if not at_start:
                w = np.minimum(w, ramp)
            if not at_end:
                w = np.minimum(w, ramp[::-1])
    elif mode == 'gaussian':
        sigma = n / 8.0  # nnU-Net's choice: centre pixels dominate, edges still count
        w = np.exp(-0.5 * ((i - n / 2.0) / sigma) ** 2)
        half = n // 2
        if at_start:
            w[:half] = w[half]
        if at_end:
            w[half:] = w[half]
        w = np.maximum(w / w.max(), 1e-3)
    else:
        raise ValueError(f"blend must be one of {BLENDS}, got {mode!r}")
    return w


def blend_weights(tile_hw, overlap, mode='gaussian', borders=(False, False, False, False)):
    """Weights ``[tile_h, tile_w]`` (float32) for one window.

    ``borders`` = (top, bottom, left, right): which sides of this window lie on the scene
    border (those sides are not faded). Weights are > 0 everywhere, so every scene pixel has a
    positive weight sum however the windows fall.

    Example::

        w = blend_weights((256, 256), 64, 'linear', borders=(True, False, True, False))
        w[0, 0] == 1.0 and w[-1, -1] < 0.01
    """
    th, tw = tile_hw
    top, bottom, left, right = borders
    wy = _profile(th, overlap, mode, top, bottom)
    wx = _profile(tw, overlap, mode, left, right)
    return np.outer(wy, wx).astype(np.float32)


def _as_hw(v):
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


class ScenePlan:
    """Where the windows of one ``height x width`` scene fall and which rows each rank owns.

    Rank bands are contiguous runs of whole output block rows (so each rank writes whole
    GeoTIFF block rows).

    Example::

        plan = ScenePlan(1000, 800, tile=256, overlap=64, block=256, world_size=2)
        plan.band(1)            # (512, 1000)
        plan.forward_calls(batch_size=8)   # the same on every rank
    """

    def __init__(self, height, width, tile, overlap, block=256, world_size=1, align=1):
        self.height, self.width = int(height), int(width)
        self.tile_h, self.tile_w = _as_hw(tile)
        self.overlap = int(overlap)
        self.block = int(block)
        if self.block <= 0 or self.block % 16:
            raise ValueError(f"block must be a positive multiple of 16 (GeoTIFF tiles), got {block}")
        self.ys = window_starts(self.height, self.tile_h, min(self.overlap, self.tile_h - 1), align)
        self.xs = window_starts(self.width, self.tile_w, min(self.overlap, self.tile_w - 1), align)
        self.world_size = int(world_size)
        n_blocks = math.ceil(self.height / self.block)
        base, extra = divmod(n_blocks, self.world_size)
        self._bands, start = [], 0
        for r in range(self.world_size):
            count = base + (r < extra)
            self._bands.append((min(start * self.block, self.height),
                                min((start + count) * self.block, self.height)))
            start += count

    def band(self, rank):
        """Output rows ``[a, b)`` that ``rank`` computes and emits (may be empty)."""
        return self._bands[rank]

    def window_rows(self, rank):
        """Indices into ``ys`` of the window rows that touch ``rank``'s band."""
        a, b = self.band(rank)
        return [r for r, y in enumerate(self.ys) if a < b and y < b and y + self.tile_h > a]

    def windows(self, rank):
        """``(row, column, y, x)`` of every window ``rank`` runs, in the global order."""
        return [(r, c, self.ys[r], x) for r in self.window_rows(rank) for c, x in enumerate(self.xs)]

    def global_batches(self, rank, batch_size):
        """Indices ``k`` of the batches ``rank`` runs: batch ``k`` holds the windows
        ``k * batch_size`` to ``(k + 1) * batch_size - 1`` of the global order, as one rank would
        batch them; ``rank`` runs those that hold a window of its rows (their other windows too)."""
        rows = self.window_rows(rank)
        if not rows:
            return range(0)
        first, end = rows[0] * len(self.xs), (rows[-1] + 1) * len(self.xs)
        return range(first // batch_size, math.ceil(end / batch_size))

    def forward_batches(self, rank, batch_size):
        return len(self.global_batches(rank, batch_size))

    def forward_calls(self, batch_size):
        """Batches every rank runs: the maximum over ranks (the others pad with dummies)."""
        return max(self.forward_batches(r, batch_size) for r in range(self.world_size))

    def borders(self, r, c):
        return (r == 0, r == len(self.ys) - 1, c == 0, c == len(self.xs) - 1)
