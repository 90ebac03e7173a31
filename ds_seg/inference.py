"""Whole-scene prediction: sliding windows, weighted blending, a band of rows in memory.

A scene of any size goes through the model as fixed-size windows (``tile``, overlapping by
``overlap``), several windows per forward call. Each window's class probabilities are
multiplied by a blending weight (linear ramp or Gaussian, so seams between windows disappear)
and added into host accumulators; the blended map is ``scores / weight_sum``. Accumulators
exist only for the *block rows* (``block`` rows of the output GeoTIFF) that some pending
window still touches: once every window over a block row has been added, the row is handed to
a sink (written to a tiled compressed GeoTIFF, or compared with labels) and freed. Memory is
therefore ``K x (tile + block) x width`` floats whatever the scene height.

Across ranks a scene is split into contiguous bands of whole block rows. A rank runs every
window that touches its band (windows straddling a band boundary run on both ranks) and adds
them in the same global order as a single-rank run, so its rows are bit-identical to a
single-rank result for any model whose output for a window does not depend on the other
windows in the batch. Every rank makes the same number of forward calls (missing ones are
zero-filled dummy batches): under ZeRO-3 each forward is a collective.

Shape legend: B batch, C bands, K classes, H/W height/width.

Example::

    model.eval()
    predict_scene(lambda x: model(x), 'scene.tif', 'scene_classes.tif', mean=[...], std=[...],
                  tile=512, overlap=128, batch_size=8, classes=['road', 'building'])
    cm = evaluate_scenes(lambda x: model(x), [('a.tif', 'a_label.tif')], num_classes=2,
                         mean=[...], std=[...])
"""
import json
import math
import os
import time

import numpy as np
import rasterio
import torch
from rasterio.windows import Window

from . import distributed
from .data.preprocess import BatchPreprocessor, host_dtype
from .metrics import confusion_matrix

BLENDS = ('gaussian', 'linear', 'none')
TTA_FLIPS = {'none': (), 'h': ((-1,),), 'hv': ((-1,), (-2,), (-2, -1))}
CLASS_NODATA = 255


# ---------------------------------------------------------------------------------- windows
def window_starts(length, tile, overlap):
    """Start offsets of windows of size ``tile`` with stride ``tile - overlap`` covering
    ``[0, length)``; the last window is flush with the end (a scene shorter than the tile
    gets one window at 0, padded).

    Example::

        window_starts(10, 4, 1)   # [0, 3, 6]
        window_starts(11, 4, 1)   # [0, 3, 6, 7]
    """
    if overlap < 0 or overlap >= tile:
        raise ValueError(f"overlap must be in [0, tile) = [0, {tile}), got {overlap}")
    if length <= tile:
        return [0]
    return list(range(0, length - tile, tile - overlap)) + [length - tile]


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

    def __init__(self, height, width, tile, overlap, block=256, world_size=1):
        self.height, self.width = int(height), int(width)
        self.tile_h, self.tile_w = _as_hw(tile)
        self.overlap = int(overlap)
        self.block = int(block)
        if self.block <= 0 or self.block % 16:
            raise ValueError(f"block must be a positive multiple of 16 (GeoTIFF tiles), got {block}")
        self.ys = window_starts(self.height, self.tile_h, min(self.overlap, self.tile_h - 1))
        self.xs = window_starts(self.width, self.tile_w, min(self.overlap, self.tile_w - 1))
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

    def forward_batches(self, rank, batch_size):
        return math.ceil(len(self.window_rows(rank)) * len(self.xs) / batch_size)

    def forward_calls(self, batch_size):
        """Batches every rank runs: the maximum over ranks (the others pad with dummies)."""
        return max(self.forward_batches(r, batch_size) for r in range(self.world_size))

    def borders(self, r, c):
        return (r == 0, r == len(self.ys) - 1, c == 0, c == len(self.xs) - 1)


# ---------------------------------------------------------------------------------- the engine
class _Rows:
    """Accumulators for one output block row: weighted scores, weight sum and nodata mask."""

    __slots__ = ('scores', 'wsum', 'nodata')

    def __init__(self, h, w):
        self.scores = None  # allocated at the first window: K is known from the model's output
        self.wsum = np.zeros((h, w), np.float32)
        self.nodata = np.zeros((h, w), bool)


def nodata_mask(raw_CHW, nodata):
    """Pixels where every band equals ``nodata`` (NaN-aware), as the datasets define it;
    in floating-point images also pixels with a non-finite value.

    Example::

        nodata_mask(np.array([[[0, 5]], [[0, 0]]]), 0)   # [[True, False]]
    """
    out = np.zeros(raw_CHW.shape[1:], bool)
    if nodata is not None:
        if isinstance(nodata, float) and math.isnan(nodata):
            out |= np.isnan(raw_CHW).all(axis=0)
        else:
            out |= (raw_CHW == nodata).all(axis=0)
    if raw_CHW.dtype.kind == 'f':
        out |= ~np.isfinite(raw_CHW).all(axis=0)
    return out


def _uses_mask_band(src):
    # A GDAL mask band or alpha (without a nodata value) marks invalid pixels on its own.
    from rasterio.enums import MaskFlags
    return src.nodata is None and any(MaskFlags.per_dataset in f or MaskFlags.alpha in f
                                      for f in src.mask_flag_enums)


def _softmax_probs(forward_fn, images_BCHW, device, tta):
    """Class probabilities (float32 numpy), averaged over flips; one forward per variant."""
    x = images_BCHW.to(device)
    probs = torch.softmax(forward_fn(x).float(), dim=1)
    for dims in TTA_FLIPS[tta]:
        probs += torch.softmax(forward_fn(x.flip(dims)).float(), dim=1).flip(dims)
    if TTA_FLIPS[tta]:
        probs /= 1 + len(TTA_FLIPS[tta])
    return probs.cpu().numpy()


def run_scene(forward_fn, image_path, sink, mean, std, bands=None, tile=512, overlap=128,
              batch_size=8, blend='gaussian', tta='none', block=256, device='cpu',
              accumulate_dtype='float32', num_classes=None, rank=None, world_size=None,
              progress=None):
    """Stream one scene through ``forward_fn`` and hand finished block rows to ``sink``.

    ``forward_fn(images_BCHW) -> logits_BKHW`` (a module, a backend's forward, a ZeRO engine);
    ``sink(y0, scores_KhW, wsum_hW, nodata_hW)`` is called once per block row of this rank's
    band, top to bottom; the blended probabilities are ``scores / wsum``. Returns the number
    of windows and forward calls this rank ran. Most callers want :func:`predict_scene` or
    :func:`evaluate_scenes`, which build the sink.

    Example::

        rows = []
        run_scene(model, 'scene.tif', lambda y0, s, w, nd: rows.append((y0, s.argmax(0))),
                  mean=[120.0] * 3, std=[50.0] * 3, tile=256, overlap=64)
    """
    rank = distributed.rank() if rank is None else rank
    world_size = distributed.world_size() if world_size is None else world_size
    if tta not in TTA_FLIPS:
        raise ValueError(f"tta must be one of {sorted(TTA_FLIPS)}, got {tta!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    acc_dtype = np.dtype(accumulate_dtype)
    with rasterio.open(image_path) as src:
        band_idx = list(range(1, src.count + 1)) if bands is None else [int(b) for b in bands]
        if max(band_idx) > src.count or min(band_idx) < 1:
            raise ValueError(f"{image_path}: has bands 1..{src.count}; bands={band_idx} asked for")
        mean_c = np.asarray(mean, np.float32).reshape(-1)
        std_c = np.asarray(std, np.float32).reshape(-1)
        if mean_c.size != len(band_idx) or std_c.size != len(band_idx):
            raise ValueError(f"{image_path}: {len(band_idx)} band(s) read but mean/std have "
                             f"{mean_c.size}/{std_c.size} values (the model was trained on "
                             f"{mean_c.size} band(s); select bands to match)")
        prep = BatchPreprocessor(mean_c, std_c)
        window_dtype = host_dtype(src.dtypes[0])
        nodata = src.nodata
        masked = _uses_mask_band(src)
        plan = ScenePlan(src.height, src.width, tile, overlap, block, world_size)
        th, tw = plan.tile_h, plan.tile_w
        a, b = plan.band(rank)
        my_windows = plan.windows(rank)
        n_batches = plan.forward_batches(rank, batch_size)
        total_batches = plan.forward_calls(batch_size)
        # How many windows of each window row are still to be added: a block row can be
        # emitted once no pending window row reaches into it.
        remaining = {r: len(plan.xs) for r in plan.window_rows(rank)}
        pending_rows = sorted(remaining)
        rows = {}
        weights = {}
        emitted = a
        calls = 0
        n_done = 0
        k_classes = num_classes
        strip = strip_row = None
        t0 = time.perf_counter()

        def rows_block(k):
            blk = rows.get(k)
            if blk is None:
                h = min((k + 1) * plan.block, plan.height) - k * plan.block
                blk = rows[k] = _Rows(h, plan.width)
            return blk

        def add(probs_KHW, r, y, x, c):
            # Only the part of the window inside this rank's band and the scene is kept.
            key = plan.borders(r, c)
            w = weights.get(key)
            if w is None:
                w = weights[key] = blend_weights((th, tw), plan.overlap, blend, key)
            y_end, x_end = min(y + th, b, plan.height), min(x + tw, plan.width)
            yy = max(y, a)
            while yy < y_end:
                k = yy // plan.block
                blk = rows_block(k)
                k0 = k * plan.block
                y_stop = min(y_end, k0 + blk.wsum.shape[0])
                wy = w[yy - y:y_stop - y, :x_end - x]
                if blk.scores is None:
                    blk.scores = np.zeros((k_classes,) + blk.wsum.shape, acc_dtype)
                blk.scores[:, yy - k0:y_stop - k0, x:x_end] += (
                    probs_KHW[:, yy - y:y_stop - y, :x_end - x] * wy).astype(acc_dtype, copy=False)
                blk.wsum[yy - k0:y_stop - k0, x:x_end] += wy
                yy = y_stop

        def emit_finished(all_done):
            nonlocal emitted
            # Rows below the first unfinished window row will receive nothing more.
            limit = b if all_done else min(b, plan.ys[pending_rows[0]])
            while emitted < b:
                k = emitted // plan.block
                end = min((k + 1) * plan.block, plan.height)
                if end > limit:
                    break
                blk = rows.pop(k)
                sink(emitted, blk.scores, blk.wsum, blk.nodata)
                emitted = end

        def read_strip(r):
            y = plan.ys[r]
            h = min(th, plan.height - y)
            window = Window(0, y, plan.width, h)
            raw = src.read(indexes=band_idx, window=window)
            mask = nodata_mask(raw, nodata)
            if masked:
                mask |= src.dataset_mask(window=window) == 0
            # The nodata mask is a property of the input pixel: record it once per block row.
            yy = max(y, a)
            while yy < min(y + h, b):
                k = yy // plan.block
                blk = rows_block(k)
                k0 = k * plan.block
                y_stop = min(y + h, b, k0 + blk.wsum.shape[0])
                blk.nodata[yy - k0:y_stop - k0] |= mask[yy - y:y_stop - y]
                yy = y_stop
            return raw, mask

        def window_arrays(raw, mask, x):
            # As read, padded past the scene's edge; padding counts as nodata (0 once normalised).
            part, part_mask = raw[:, :, x:x + tw], mask[:, x:x + tw]
            out = np.zeros((len(band_idx), th, tw), window_dtype)
            out[:, :part.shape[1], :part.shape[2]] = part
            out_mask = np.ones((th, tw), bool)
            out_mask[:part.shape[1], :part.shape[2]] = part_mask
            return out, out_mask

        batch, masks, meta = [], [], []
        for i, (r, c, y, x) in enumerate(my_windows):
            if strip_row != r:
                strip, mask = read_strip(r)
                strip_row = r
            window, window_mask = window_arrays(strip, mask, x)
            batch.append(window)
            masks.append(window_mask)
            meta.append((r, y, x, c))
            if len(batch) == batch_size or i == len(my_windows) - 1:
                # Normalised on the device, as in training: the same code, the same numbers.
                images = prep.images(torch.from_numpy(np.stack(batch)), torch.from_numpy(np.stack(masks)), device)
                probs = _softmax_probs(forward_fn, images, device, tta)
                calls += 1 + len(TTA_FLIPS[tta])
                if k_classes is None:
                    k_classes = probs.shape[1]
                elif probs.shape[1] != k_classes:
                    raise ValueError(f"the model returns {probs.shape[1]} classes, expected {k_classes}")
                for p, (wr, wy, wx, wc) in zip(probs, meta):
                    add(p, wr, wy, wx, wc)
                    remaining[wr] -= 1
                    if remaining[wr] == 0:
                        pending_rows.remove(wr)
                n_done += len(batch)
                batch, masks, meta = [], [], []
                emit_finished(all_done=not pending_rows)
                if progress is not None:
                    progress(n_done, len(my_windows), time.perf_counter() - t0)
        emit_finished(all_done=True)
        # ZeRO-3 gathers parameters collectively inside each forward: ranks with fewer
        # windows run zero batches of the same shape so every rank makes the same calls.
        for _ in range(total_batches - n_batches):
            _softmax_probs(forward_fn, torch.zeros(batch_size, len(band_idx), th, tw), device, tta)
            calls += 1 + len(TTA_FLIPS[tta])
    return dict(windows=len(my_windows), forward_calls=calls, band=(a, b),
                seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------- writing
def default_palette(num_classes):
    """A fixed, distinct RGB colour per class (the synthetic data set's palette first)."""
    from .data.synthetic import PALETTE
    extra = [(int(r * 255), int(g * 255), int(b_ * 255)) for r, g, b_ in _tab20()]
    colours = list(PALETTE) + extra
    return [tuple(colours[i % len(colours)]) for i in range(num_classes)]


def _tab20():
    # matplotlib's tab20 without importing matplotlib in the prediction path
    hexes = ('1f77b4 aec7e8 ff7f0e ffbb78 2ca02c 98df8a d62728 ff9896 9467bd c5b0d5 '
             '8c564b c49c94 e377c2 f7b6d2 7f7f7f c7c7c7 bcbd22 dbdb8d 17becf 9edae5').split()
    return [tuple(int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)) for h in hexes]


class GeoTiffRowWriter:
    """A class-map GeoTIFF (and optionally a probabilities GeoTIFF) written block row by row.

    Georeferencing comes from the input; the files are tiled (``block`` x ``block``), ZSTD
    compressed, BigTIFF when needed. Rows must arrive as whole block rows, top to bottom:
    overlapping or partial writes into compressed tiles would inflate the file and slow it.

    Example::

        with rasterio.open('scene.tif') as src:
            w = GeoTiffRowWriter('classes.tif', src.profile, classes=['a', 'b'])
        w.write(0, classes_hW)   # rows 0..block-1
        w.close()
    """

    def __init__(self, path, src_profile, classes, palette=None, probs_path=None, block=256,
                 row_offset=0, height=None, compress='zstd'):
        self.classes = list(classes)
        k = len(self.classes)
        if k > 255:
            raise ValueError(f"{k} classes do not fit a uint8 class map with nodata {CLASS_NODATA}")
        height = src_profile['height'] if height is None else height
        transform = src_profile['transform'] @ rasterio.Affine.translation(0, row_offset)
        common = dict(driver='GTiff', width=src_profile['width'], height=height,
                      crs=src_profile.get('crs'), transform=transform, tiled=True,
                      blockxsize=block, blockysize=block, compress=compress, BIGTIFF='IF_SAFER')
        self.block = block
        self.paths = [path]
        self.dst = rasterio.open(path, 'w', count=1, dtype='uint8', nodata=CLASS_NODATA,
                                 photometric='PALETTE', **common)
        palette = palette or default_palette(k)
        self.dst.write_colormap(1, {i: tuple(palette[i][:3]) + (255,) for i in range(k)}
                                | {CLASS_NODATA: (0, 0, 0, 0)})
        self.dst.set_band_description(1, 'class')
        self.dst.update_tags(classes=json.dumps(self.classes), nodata_class=str(CLASS_NODATA),
                             **{f'CLASS_{i}': n for i, n in enumerate(self.classes)})
        self.probs = None
        if probs_path:
            self.paths.append(probs_path)
            # 0..250 in steps of 1/250 (255 stays free as nodata)
            self.probs = rasterio.open(probs_path, 'w', count=k, dtype='uint8', nodata=255,
                                       photometric='MINISBLACK', interleave='band', **common)
            for i, n in enumerate(self.classes):
                self.probs.set_band_description(i + 1, n)
            self.probs.update_tags(classes=json.dumps(self.classes), scale='1/250')

    def write(self, y0, classes_hW, probs_KhW=None):
        h = classes_hW.shape[0]
        if y0 % self.block:
            raise ValueError(f"row {y0} is not at a block boundary ({self.block})")
        window = Window(0, y0, classes_hW.shape[1], h)
        self.dst.write(classes_hW, 1, window=window)
        if self.probs is not None and probs_KhW is not None:
            self.probs.write(probs_KhW, window=window)

    def close(self):
        self.dst.close()
        if self.probs is not None:
            self.probs.close()


def _to_outputs(scores, wsum, nodata, with_probs):
    classes = scores.argmax(0).astype(np.uint8)  # argmax of scores = argmax of scores / wsum
    classes[nodata] = CLASS_NODATA
    probs = None
    if with_probs:
        probs = np.rint(scores.astype(np.float32) / wsum * 250).astype(np.uint8)
        probs[:, nodata] = 255
    return classes, probs


def predict_scene(forward_fn, image_path, out_path=None, mean=None, std=None, classes=None,
                  probs_path=None, palette=None, tile=512, overlap=128, batch_size=8,
                  blend='gaussian', tta='none', block=256, bands=None, device='cpu',
                  accumulate_dtype='float32', progress=None, rank=None, world_size=None):
    """Label one GeoTIFF scene of any size; returns a summary dict (and the map if no path).

    With ``out_path`` a uint8 class map is written with the input's CRS, transform and size,
    tiled and ZSTD-compressed, nodata 255 where the input is nodata, class names in the tags
    and a colour table; ``probs_path`` adds a K-band uint8 GeoTIFF of probabilities x 250.
    Without ``out_path`` the class map is returned as ``result['classes']`` (small scenes,
    tests). With several ranks every rank calls this; each writes its band to a part file next
    to ``out_path`` and rank 0 joins them (so ``out_path`` must be on a shared file system).

    Example::

        model = build(MODELS, payload['model']); model.load_state_dict(payload['state_dict'])
        predict_scene(model.eval(), 'scene.tif', 'scene_classes.tif', mean=m, std=s,
                      classes=payload['classes'], tile=512, overlap=128, batch_size=8)
    """
    if mean is None or std is None:
        raise ValueError("predict_scene: mean and std (the training normalisation) are required")
    rank = distributed.rank() if rank is None else rank
    world_size = distributed.world_size() if world_size is None else world_size
    k = len(classes) if classes is not None else None
    with rasterio.open(image_path) as src:
        profile = dict(src.profile)
    writer = None
    result_map = None
    part = world_size > 1 and out_path is not None
    plan = ScenePlan(profile['height'], profile['width'], tile, overlap, block, world_size)
    a, b = plan.band(rank)

    def sink(y0, scores, wsum, nodata):
        nonlocal writer
        cls, probs = _to_outputs(scores, wsum, nodata, probs_path is not None)
        if out_path is None:
            result_map[y0:y0 + cls.shape[0]] = cls
            return
        if writer is None:
            names = list(classes) if classes is not None else [f'class_{i}' for i in range(scores.shape[0])]
            if part:
                writer = GeoTiffRowWriter(f'{out_path}.part{rank}', profile, names, palette,
                                          f'{probs_path}.part{rank}' if probs_path else None,
                                          block, row_offset=a, height=b - a)
            else:
                writer = GeoTiffRowWriter(out_path, profile, names, palette, probs_path, block)
        writer.write(y0 - (a if part else 0), cls, probs)

    if out_path is None:
        result_map = np.full((profile['height'], profile['width']), CLASS_NODATA, np.uint8)
    try:
        stats = run_scene(forward_fn, image_path, sink, mean, std, bands=bands, tile=tile,
                          overlap=overlap, batch_size=batch_size, blend=blend, tta=tta, block=block,
                          device=device, accumulate_dtype=accumulate_dtype, num_classes=k,
                          rank=rank, world_size=world_size, progress=progress)
    finally:
        if writer is not None:
            writer.close()
    if part:
        distributed.barrier()  # every part file is closed
        if rank == 0:
            _join_parts(out_path, probs_path, profile, plan, classes, palette, block)
        distributed.barrier()
    if out_path is None and world_size > 1:
        # Rows of other ranks are 255 here; a max-reduce would need a collective of its own.
        stats['band_only'] = True
    stats['classes'] = result_map
    stats['out_path'] = out_path
    return stats


def _join_parts(out_path, probs_path, profile, plan, classes, palette, block):
    """Copy the ranks' part files into the final GeoTIFF, one block row at a time."""
    first = f'{out_path}.part0'
    with rasterio.open(first) as p:
        names = json.loads(p.tags()['classes'])
    writer = GeoTiffRowWriter(out_path, profile, names, palette, probs_path, block)
    try:
        for r in range(plan.world_size):
            a, b = plan.band(r)
            if a >= b:
                continue
            paths = [f'{out_path}.part{r}'] + ([f'{probs_path}.part{r}'] if probs_path else [])
            srcs = [rasterio.open(p) for p in paths]
            try:
                for y in range(a, b, block):
                    win = Window(0, y - a, profile['width'], min(block, b - y))
                    writer.write(y, srcs[0].read(1, window=win),
                                 srcs[1].read(window=win) if probs_path else None)
            finally:
                for s in srcs:
                    s.close()
            for p in paths:
                os.remove(p)
    finally:
        writer.close()


# ---------------------------------------------------------------------------------- evaluation
def boundary_mask(label_HW, radius, ignore_index=255):
    """Pixels within ``radius`` px (a disk, ISPRS convention) of a pixel of another class.

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
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
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


def _scene_pairs(scenes):
    """(image, label) pairs from a GeoTiffScenes-like dataset or an iterable of pairs."""
    if hasattr(scenes, 'scenes'):
        return [(s['image'], s['label']) for s in scenes.scenes]
    return [tuple(p) for p in scenes]


def _label_reader(dataset, label_src, ignore_index, num_classes):
    """``read(window) -> int64 class indices`` for a label raster.

    With a dataset, its own decoding (colour palette, ``label_map``, ``reduce_zero_label``) is
    applied, so evaluation counts exactly the classes training learnt; otherwise the file holds
    class indices. Values that are no class stop the evaluation with the file named.
    """
    def read(window):
        if dataset is not None and getattr(dataset, 'palette', None) is not None:
            from .data.transforms import decode_palette
            lbl = decode_palette(label_src.read([1, 2, 3], window=window), dataset._palette_lut)
            lbl[lbl < 0] = ignore_index  # off-palette noise is ignored, as in the dataset
        elif dataset is not None and hasattr(dataset, '_map_labels'):
            lbl = dataset._map_labels(label_src.read(1, window=window))
        else:
            lbl = label_src.read(1, window=window)
        lbl = lbl.astype(np.int64)
        bad = ((lbl < 0) | (lbl >= num_classes)) & (lbl != ignore_index)
        if bad.any():
            raise ValueError(f"{label_src.name}: label value {int(lbl[bad].flat[0])} in {window} is not "
                             f"a class index 0..{num_classes - 1} nor ignore_index {ignore_index}")
        return lbl
    return read


def evaluate_scenes(forward_fn, scenes, num_classes=None, mean=None, std=None, bands=None,
                    ignore_index=None, erode_boundary=None, tile=512, overlap=128, batch_size=8,
                    blend='gaussian', tta='none', block=256, device='cpu', preview_size=0,
                    progress=None, rank=None, world_size=None):
    """Confusion matrix (int64 ``[K, K]``, rows = truth) of whole scenes, summed over ranks.

    ``scenes`` is a :class:`~ds_seg.data.geotiff.GeoTiffScenes` (its bands, mean, std, classes,
    ignore index and ``boundary_ignore`` are the defaults, and its label decoding (palette,
    label_map) is applied) or a list of ``(image, label)`` paths. Predictions are
    streamed block row by block row and compared with the labels, never written. Pixels that
    are ``ignore_index``, nodata in the image, or (``erode_boundary=r``) within r px of a
    class boundary in the label are not counted. Every rank must call this (it all-reduces).
    With ``preview_size`` > 0 also returns, per scene, a decimated (prediction, label) pair of
    at most that many pixels a side, for pictures.

    Example::

        cm = evaluate_scenes(model, val_set, tile=512, overlap=128, erode_boundary=3)['confusion']
        metrics_from_confusion(cm, val_set.classes, exclude=('clutter',))
    """
    rank = distributed.rank() if rank is None else rank
    world_size = distributed.world_size() if world_size is None else world_size
    dataset = scenes if hasattr(scenes, 'scenes') else None
    if dataset is not None:
        if ignore_index is None:
            ignore_index = getattr(dataset, 'ignore_index', 255)
        if erode_boundary is None:
            erode_boundary = getattr(dataset, 'boundary_ignore', 0)
        mean = scenes.mean if mean is None else mean
        std = scenes.std if std is None else std
        bands = scenes.bands if bands is None else bands
        num_classes = scenes.num_classes if num_classes is None else num_classes
    ignore_index = 255 if ignore_index is None else int(ignore_index)
    erode_boundary = int(erode_boundary or 0)
    if num_classes is None or mean is None or std is None:
        raise ValueError("evaluate_scenes: num_classes, mean and std are needed (or a dataset)")
    cm = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    previews = []
    stats = dict(windows=0, forward_calls=0, seconds=0.0)
    for image_path, label_path in _scene_pairs(scenes):
        with rasterio.open(image_path) as img, rasterio.open(label_path) as lbl_src:
            if (img.width, img.height) != (lbl_src.width, lbl_src.height):
                raise ValueError(f"image {image_path} is {img.width}x{img.height} but label "
                                 f"{label_path} is {lbl_src.width}x{lbl_src.height}")
            height, width = img.height, img.width
        step = max(1, math.ceil(max(height, width) / preview_size)) if preview_size else 0
        prev_pred = np.zeros((math.ceil(height / step), math.ceil(width / step)), np.int32) if step else None
        prev_lbl = np.zeros_like(prev_pred) if step else None

        with rasterio.open(label_path) as lbl_src:
            read_label = _label_reader(dataset, lbl_src, ignore_index, num_classes)

            def sink(y0, scores, wsum, nodata):
                h = scores.shape[1]
                # A halo of r rows above and below: erosion near a block edge needs them.
                r = int(erode_boundary)
                top, bottom = max(0, y0 - r), min(height, y0 + h + r)
                lbl = read_label(Window(0, top, width, bottom - top))
                ignore = boundary_mask(lbl, r, ignore_index)[y0 - top:y0 - top + h] if r else None
                lbl = lbl[y0 - top:y0 - top + h]
                pred = scores.argmax(0)
                lbl[nodata] = ignore_index
                if ignore is not None:
                    lbl[ignore] = ignore_index
                cm.add_(confusion_matrix(torch.from_numpy(pred), torch.from_numpy(lbl), num_classes,
                                         ignore_index=ignore_index))
                if step:
                    first = (-y0) % step  # rows y with y % step == 0
                    rows = slice(first, h, step)
                    dst = slice((y0 + first) // step, (y0 + first) // step + len(range(first, h, step)))
                    # +1 so that rows of other ranks (0) are told apart after the sum
                    prev_pred[dst] = np.where(nodata[rows, ::step], CLASS_NODATA, pred[rows, ::step]) + 1
                    prev_lbl[dst] = lbl[rows, ::step] + 1

            s = run_scene(forward_fn, image_path, sink, mean, std, bands=bands, tile=tile,
                          overlap=overlap, batch_size=batch_size, blend=blend, tta=tta, block=block,
                          device=device, num_classes=num_classes, rank=rank, world_size=world_size,
                          progress=progress)
        for key in ('windows', 'forward_calls', 'seconds'):
            stats[key] += s[key]
        if step:
            both = torch.from_numpy(np.stack([prev_pred, prev_lbl]))
            if world_size > 1:
                distributed.all_reduce_sum(both)
            both = both.numpy() - 1
            previews.append(dict(image=image_path, label=label_path, step=step,
                                 prediction=both[0].astype(np.uint8), truth=both[1].astype(np.uint8)))
    if world_size > 1:
        distributed.all_reduce_sum(cm)
    return dict(confusion=cm, previews=previews, **stats)


# ---------------------------------------------------------------------------------- models
def load_model(path, device='cpu'):
    """A model ready for prediction from an exported weights file or a checkpoint folder.

    ``path``: a file written by launch/export.py, a ``step_*`` folder, a ``checkpoints``
    folder or a work dir (the newest complete checkpoint). Returns ``(model, info)`` with
    ``info = dict(classes, model, data)``; ``data`` holds the training normalisation
    (``bands``, ``mean``, ``std``) when the checkpoint recorded it, else None.

    Example::

        model, info = load_model('work_dirs/default/weights_step_00000400.pt')
        predict_scene(model, 'scene.tif', 'out.tif', mean=info['data']['mean'],
                      std=info['data']['std'], bands=info['data']['bands'], classes=info['classes'])
    """
    from . import models  # noqa: F401  (registers every model)
    from .engine import checkpoint
    from .inputs import check_checkpoint_option
    from .registry import MODELS, build
    check_checkpoint_option(path)
    if os.path.isfile(path):
        payload = checkpoint.load_weights_file(path)
        state, model_cfg = payload['state_dict'], payload.get('model')
        classes, data = payload.get('classes'), payload.get('data')
    else:
        ckpt = checkpoint.find_checkpoint(path, report=lambda line: print(f'[ds_seg] {line}', flush=True))
        marker = checkpoint.read_marker(ckpt)
        state = checkpoint.consolidated_state_dict(ckpt)
        model_cfg, classes, data = marker.get('model'), marker.get('classes'), marker.get('data')
    if not model_cfg:
        raise ValueError(f"{path}: records no model config; re-export it with launch/export.py")
    model = build(MODELS, dict(model_cfg), where='model')
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit {model_cfg.get('type')}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.to(device).eval()
    return model, dict(classes=list(classes) if classes else None, model=dict(model_cfg), data=data)
