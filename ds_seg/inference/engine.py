"""The streaming engine: one scene through a model window by window, blended into block rows.

:class:`SceneEngine` reads the scene one window row at a time (a strip of ``tile`` rows),
batches its windows through the model, adds each window's class probabilities times its
blending weight into accumulators for the output *block rows* it touches, and hands a block
row to a sink as soon as no pending window reaches into it. Memory is therefore
``K x (tile + block) x width`` floats whatever the scene height. :func:`run_scene` opens a
scene and runs one; :func:`~ds_seg.inference.predict_scene` and
:func:`~ds_seg.inference.evaluate_scenes` are the sinks' owners.
"""
import time

import numpy as np
import rasterio
import torch
from rasterio.windows import Window

from .. import distributed
from ..data.preprocess import BatchPreprocessor, host_dtype
from ..data.raster import DataError, open_scene, read_error, read_window, source_name, uses_mask_band
from .tiling import ScenePlan, blend_weights, input_multiple

TTA_FLIPS = {'none': (), 'h': ((-1,),), 'hv': ((-1,), (-2,), (-2, -1))}


class _Rows:
    """Accumulators for one output block row: weighted scores, weight sum and nodata mask."""

    __slots__ = ('scores', 'wsum', 'nodata')

    def __init__(self, h, w):
        self.scores = None  # allocated at the first window: K is known from the model's output
        self.wsum = np.zeros((h, w), np.float32)
        self.nodata = np.zeros((h, w), bool)


@torch.no_grad()  # the library calls (predict_scene(model, ...)) come without the CLIs' inference_mode
def _softmax_probs(forward_fn, images_BCHW, device, tta):
    """Class probabilities (float32 numpy), averaged over flips; one forward per variant."""
    x = images_BCHW.to(device)
    probs = torch.softmax(forward_fn(x).float(), dim=1)
    for dims in TTA_FLIPS[tta]:
        probs += torch.softmax(forward_fn(x.flip(dims)).float(), dim=1).flip(dims)
    if TTA_FLIPS[tta]:
        probs /= 1 + len(TTA_FLIPS[tta])
    return probs.cpu().numpy()


@torch.no_grad()
def _fitted_tile(forward_fn, tile, height, width, channels, device):
    """``tile`` (h, w) cut down to a scene smaller than it, as mmseg's slide inference does: the
    scene then goes through the model in one pass at its own size, not padded out to the tile
    (the padding, nodata, changed about 1 pixel in 100 of a 96 px scene in a 512 px window).
    Kept where the model cannot take that size (a model of one input size, an ONNX graph of one
    shape): every rank runs the same probe, so all agree. Returns the tile and the forward calls
    the probe made (0 or 1)."""
    tile_hw = (int(tile), int(tile)) if np.isscalar(tile) else (int(tile[0]), int(tile[1]))
    fitted = (min(tile_hw[0], int(height)), min(tile_hw[1], int(width)))
    if fitted == tile_hw:
        return tile_hw, 0
    try:
        forward_fn(torch.zeros(1, channels, *fitted, device=device))
    except Exception:  # any refusal of the size keeps the padded tile
        return tile_hw, 1
    return fitted, 1


class SceneEngine:
    """The windows of ``rank``'s band of an open scene ``src``, blended and handed to ``sink``
    block row by block row (see :func:`run_scene` for ``sink``).

    Windows run in the batches of :meth:`ScenePlan.global_batches` and are added in the global
    order of :meth:`ScenePlan.windows`, so a rank's rows are bit-identical to a single-rank run's.

    Example::

        with open_scene('scene.tif') as src:
            plan = ScenePlan(src.height, src.width, tile=256, overlap=64)
            engine = SceneEngine(src, plan, 0, [1, 2, 3], BatchPreprocessor(mean, std), sink)
            stats = engine.run(model, batch_size=8)
    """

    def __init__(self, src, plan, rank, band_idx, prep, sink, blend='gaussian',
                 accumulate_dtype='float32', num_classes=None):
        self.src, self.plan, self.rank, self.sink = src, plan, rank, sink
        self.band_idx, self.prep, self.blend = band_idx, prep, blend
        self.acc_dtype = np.dtype(accumulate_dtype)
        self.num_classes = num_classes  # None: from the model's first output
        self.window_dtype = host_dtype(src.dtypes[0])
        self.nodata = src.nodata
        self.masked = uses_mask_band(src)
        self.a, self.b = plan.band(rank)
        self.windows = plan.windows(rank)
        # How many windows of each window row are still to be added: a block row can be
        # emitted once no pending window row reaches into it.
        self.remaining = {r: len(plan.xs) for r in plan.window_rows(rank)}
        self.pending_rows = sorted(self.remaining)
        self.rows = {}      # block row index -> _Rows
        self.weights = {}   # window borders -> blend weights
        self.emitted = self.a  # first row not yet handed to the sink

    def run(self, forward_fn, batch_size=8, device='cpu', tta='none', progress=None):
        """Every window of the band through ``forward_fn``; returns the numbers of windows and
        forward calls, the band and the seconds taken."""
        plan = self.plan
        th, tw = plan.tile_h, plan.tile_w
        n_batches = plan.forward_batches(self.rank, batch_size)
        total_batches = plan.forward_calls(batch_size)
        calls = 0
        n_done = 0
        strip = strip_row = None
        t0 = time.perf_counter()
        ncols = len(plan.xs)
        for k in plan.global_batches(self.rank, batch_size):
            # The batches a single rank runs (global window order, cut every batch_size windows),
            # the windows of other ranks in them included: a model's output for a window changes
            # in its last bits with its batch-mates (the kernels a batch size picks), and a rank
            # that batched from its own first window wrote other probabilities than one rank.
            batch, masks, meta = [], [], []
            for g in range(k * batch_size, min((k + 1) * batch_size, len(plan.ys) * ncols)):
                r, c = divmod(g, ncols)
                mine = r in self.remaining
                if mine:
                    if strip_row != r:
                        strip, mask = self._read_strip(r)
                        strip_row = r
                    window, window_mask = self._window_arrays(strip, mask, plan.xs[c])
                else:  # a batch-mate from another rank's rows: only its own window is read
                    window, window_mask = self._other_window(r, c)
                batch.append(window)
                masks.append(window_mask)
                meta.append((r, plan.ys[r], plan.xs[c], c, mine))
            # Normalised on the device, as in training: the same code, the same numbers.
            images = self.prep.images(torch.from_numpy(np.stack(batch)), torch.from_numpy(np.stack(masks)), device)
            probs = _softmax_probs(forward_fn, images, device, tta)
            calls += 1 + len(TTA_FLIPS[tta])
            if probs.shape[-2:] != (th, tw):
                # A smaller map died in numpy's broadcasting, a larger one was cut to its corner.
                raise ValueError(f"the model returns {probs.shape[-2]}x{probs.shape[-1]} logits for {th}x{tw} "
                                 "windows; a segmentation model returns one logit per input pixel (resize "
                                 "its logits to the input size, as ds_seg's models do)")
            if self.num_classes is None:
                self.num_classes = probs.shape[1]
            elif probs.shape[1] != self.num_classes:
                raise ValueError(f"the model returns {probs.shape[1]} classes, expected {self.num_classes}")
            for p, (wr, wy, wx, wc, mine) in zip(probs, meta):
                if not mine:
                    continue
                self._add(p, wr, wy, wx, wc)
                n_done += 1
                self.remaining[wr] -= 1
                if self.remaining[wr] == 0:
                    self.pending_rows.remove(wr)
            self._emit_finished(all_done=not self.pending_rows)
            if progress is not None:
                progress(n_done, len(self.windows), time.perf_counter() - t0)
        self._emit_finished(all_done=True)
        # ZeRO-3 gathers parameters collectively inside each forward: ranks with fewer
        # windows run zero batches of the same shape so every rank makes the same calls.
        for _ in range(total_batches - n_batches):
            _softmax_probs(forward_fn, torch.zeros(batch_size, len(self.band_idx), th, tw), device, tta)
            calls += 1 + len(TTA_FLIPS[tta])
        return dict(windows=len(self.windows), forward_calls=calls, band=(self.a, self.b),
                    seconds=time.perf_counter() - t0)

    def _block(self, k):
        blk = self.rows.get(k)
        if blk is None:
            h = min((k + 1) * self.plan.block, self.plan.height) - k * self.plan.block
            blk = self.rows[k] = _Rows(h, self.plan.width)
        return blk

    def _add(self, probs_KHW, r, y, x, c):
        # Only the part of the window inside this rank's band and the scene is kept.
        plan = self.plan
        th, tw = plan.tile_h, plan.tile_w
        key = plan.borders(r, c)
        w = self.weights.get(key)
        if w is None:
            w = self.weights[key] = blend_weights((th, tw), plan.overlap, self.blend, key)
        y_end, x_end = min(y + th, self.b, plan.height), min(x + tw, plan.width)
        yy = max(y, self.a)
        while yy < y_end:
            k = yy // plan.block
            blk = self._block(k)
            k0 = k * plan.block
            y_stop = min(y_end, k0 + blk.wsum.shape[0])
            wy = w[yy - y:y_stop - y, :x_end - x]
            if blk.scores is None:
                blk.scores = np.zeros((self.num_classes,) + blk.wsum.shape, self.acc_dtype)
            blk.scores[:, yy - k0:y_stop - k0, x:x_end] += (
                probs_KHW[:, yy - y:y_stop - y, :x_end - x] * wy).astype(self.acc_dtype, copy=False)
            blk.wsum[yy - k0:y_stop - k0, x:x_end] += wy
            yy = y_stop

    def _emit_finished(self, all_done):
        # Rows below the first unfinished window row will receive nothing more.
        plan, b = self.plan, self.b
        limit = b if all_done else min(b, plan.ys[self.pending_rows[0]])
        while self.emitted < b:
            k = self.emitted // plan.block
            end = min((k + 1) * plan.block, plan.height)
            if end > limit:
                break
            blk = self.rows.pop(k)
            self.sink(self.emitted, blk.scores, blk.wsum, blk.nodata)
            self.emitted = end

    def _read_strip(self, r):
        plan = self.plan
        y = plan.ys[r]
        h = min(plan.tile_h, plan.height - y)
        window = Window(0, y, plan.width, h)
        # A stack of dates is read as one raster: a pixel with no data at any one date is nodata.
        try:
            raw, mask = read_window(self.src, window, self.band_idx, self.nodata, self.masked)
        except rasterio.errors.RasterioError as e:  # a truncated file, a server that went away
            name = source_name(self.src)
            raise DataError(f"{name}: cannot read rows {y}-{y + h}: {read_error(name, e)}") from e
        if mask is None:
            mask = np.zeros(raw.shape[1:], bool)
        # The nodata mask is a property of the input pixel: record it once per block row.
        yy = max(y, self.a)
        while yy < min(y + h, self.b):
            k = yy // plan.block
            blk = self._block(k)
            k0 = k * plan.block
            y_stop = min(y + h, self.b, k0 + blk.wsum.shape[0])
            blk.nodata[yy - k0:y_stop - k0] |= mask[yy - y:y_stop - y]
            yy = y_stop
        return raw, mask

    def _other_window(self, r, c):
        """The window of row ``r``, column ``c`` of another rank's rows (a batch-mate), read alone."""
        plan = self.plan
        y, x = plan.ys[r], plan.xs[c]
        window = Window(x, y, min(plan.tile_w, plan.width - x), min(plan.tile_h, plan.height - y))
        try:
            raw, mask = read_window(self.src, window, self.band_idx, self.nodata, self.masked)
        except rasterio.errors.RasterioError as e:
            name = source_name(self.src)
            raise DataError(f"{name}: cannot read rows {y}-{y + window.height}: {read_error(name, e)}") from e
        return self._window_arrays(raw, np.zeros(raw.shape[1:], bool) if mask is None else mask, 0)

    def _window_arrays(self, raw, mask, x):
        # As read, padded past the scene's edge; padding counts as nodata (0 once normalised).
        th, tw = self.plan.tile_h, self.plan.tile_w
        part, part_mask = raw[:, :, x:x + tw], mask[:, x:x + tw]
        out = np.zeros((len(self.band_idx), th, tw), self.window_dtype)
        out[:, :part.shape[1], :part.shape[2]] = part
        out_mask = np.ones((th, tw), bool)
        out_mask[:part.shape[1], :part.shape[2]] = part_mask
        return out, out_mask


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
    with open_scene(image_path) as src:  # a path, a URL, or a list of dates (StackedRaster)
        band_idx = list(range(1, src.count + 1)) if bands is None else [int(b) for b in bands]
        dates = src.count // getattr(src, 'per_date', src.count)
        if bands is not None and dates > 1 and len(band_idx) * dates == np.size(mean):
            # bands name the bands of one date (as in training): the same bands of every date
            band_idx = [t * src.per_date + b for t in range(dates) for b in band_idx]
        if max(band_idx) > src.count or min(band_idx) < 1:
            raise ValueError(f"{image_path}: has bands 1..{src.count}; bands={band_idx} asked for")
        mean_c = np.asarray(mean, np.float64).reshape(-1)
        std_c = np.asarray(std, np.float64).reshape(-1)
        if mean_c.size != len(band_idx) or std_c.size != len(band_idx):
            # Not "the model was trained on N bands": mean/std may be a user's --mean/--std.
            raise ValueError(f"{image_path}: {len(band_idx)} band(s) read but mean/std have "
                             f"{mean_c.size}/{std_c.size} values; give one mean and std per band read "
                             f"(bands select the bands)")
        prep = BatchPreprocessor(mean_c, std_c)
        tile, probes = _fitted_tile(forward_fn, tile, src.height, src.width, len(band_idx), device)
        plan = ScenePlan(src.height, src.width, tile, overlap, block, world_size, align=input_multiple(forward_fn))
        engine = SceneEngine(src, plan, rank, band_idx, prep, sink, blend=blend, accumulate_dtype=acc_dtype,
                             num_classes=num_classes)
        stats = engine.run(forward_fn, batch_size=batch_size, device=device, tta=tta, progress=progress)
        return dict(stats, forward_calls=stats['forward_calls'] + probes)
