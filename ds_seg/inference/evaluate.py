"""Whole-scene evaluation: the engine's block rows compared with labels into a confusion matrix.

Example::

    cm = evaluate_scenes(model, val_set, tile=512, overlap=128, erode_boundary=3)['confusion']
"""
import contextlib
import math
import os

import numpy as np
import torch
from rasterio.windows import Window

from .. import distributed
from ..data.geotiff import inspect_pair
from ..data.raster import boundary_mask, label_nodata, open_scene, pin_versions, read_label_band
from ..data.vector_labels import is_vector
from ..metrics import confusion_matrix
from .engine import run_scene
from .model import scene_refusal, training_normalisation
from .writer import CLASS_NODATA


def scene_pairs(scenes):
    """(image, label) pairs from a GeoTiffScenes-like dataset or an iterable of pairs."""
    if hasattr(scenes, 'scenes'):  # a time series scene: its list of dates
        return [(list(s['dates']) if 'dates' in s else s['image'], s['label']) for s in scenes.scenes]
    return [tuple(p) for p in scenes]


@contextlib.contextmanager
def _label_source(dataset, scene_index, label_path, ignore_index, num_classes):
    """``read(window) -> int64 class indices`` of a scene's labels.

    With a dataset, its own decoding (:meth:`~ds_seg.data.geotiff.GeoTiffScenes.read_label`:
    colour palette, ``label_map``, ``reduce_zero_label``, vector features rasterised in the
    image grid), so evaluation counts exactly the classes training learnt; otherwise the label
    raster holds class indices. Values that are no class stop the evaluation with the file named.
    """
    def checked(lbl, window):
        # Before the cast to int64, which read a float label's 1.5 (or NaN) as class 1 (or garbage).
        bad = ((lbl < 0) | (lbl >= num_classes) | (lbl != np.floor(lbl))) & (lbl != ignore_index)
        if bad.any():
            raise ValueError(f"{label_path}: label value {lbl[bad].flat[0]:.10g} in {window} is not "
                             f"a class index 0..{num_classes - 1} nor ignore_index {ignore_index}")
        return lbl.astype(np.int64)

    if dataset is not None:
        yield lambda window: checked(dataset.read_label(scene_index, window), window)
        return
    def unlabelled_ignored(src, window):  # the nodata value and the mask band: unlabelled, as in training
        raw, hidden = read_label_band(src, window)
        hit = label_nodata(raw, src.nodata, hidden)
        return raw if hit is None else np.where(hit, ignore_index, raw)

    with open_scene(label_path) as lbl_src:
        yield lambda window: checked(unlabelled_ignored(lbl_src, window), window)


def evaluate_scenes(forward_fn, scenes, num_classes=None, mean=None, std=None, bands=None,
                    ignore_index=None, erode_boundary=None, tile=512, overlap=128, batch_size=8,
                    blend='gaussian', tta='none', block=256, device='cpu', preview_size=0,
                    progress=None):
    """Confusion matrix (int64 ``[K, K]``, rows = truth) of whole scenes, summed over ranks.

    ``scenes`` is a :class:`~ds_seg.data.geotiff.GeoTiffScenes` (its bands, mean, std, classes,
    ignore index and ``boundary_ignore`` are the defaults, after the training normalisation a
    model from :func:`~ds_seg.inference.load_model` carries, and its label decoding (palette,
    label_map) is applied) or a list of ``(image, label)`` paths. Predictions are
    streamed block row by block row and compared with the labels, never written. Pixels that
    are ``ignore_index``, nodata in the image, or (``erode_boundary=r``) within r px of a
    class boundary in the label are not counted. Every rank must call this (it all-reduces).
    With ``preview_size`` > 0 also returns, per scene, a decimated (prediction, label) pair of
    at most that many pixels a side, for pictures. ``image_pixels``: the pixels that hold data
    (not nodata in the image), whatever the labels say.

    Example::

        cm = evaluate_scenes(model, val_set, tile=512, overlap=128, erode_boundary=3)['confusion']
        metrics_from_confusion(cm, val_set.classes, exclude=('clutter',))
    """
    world_size = distributed.world_size()
    dataset = scenes if hasattr(scenes, 'scenes') else None
    # A model from load_model brings its training normalisation: it comes before the dataset's
    # own statistics (computed from the validation scenes, which differ).
    trained = training_normalisation(forward_fn)
    own_normalisation = mean is None and std is None and trained[0] is not None
    bands_given = bands is not None
    if own_normalisation:
        mean, std = trained[0], trained[1]
        bands = trained[2] if bands is None else bands
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
    if num_classes is None and getattr(forward_fn, 'class_names', None):  # a model from load_model
        num_classes = len(forward_fn.class_names)
    if num_classes is None or mean is None or std is None:
        raise ValueError("evaluate_scenes: num_classes, mean and std are needed (or a dataset)")
    cm = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    previews = []
    stats = dict(windows=0, forward_calls=0, seconds=0.0)
    image_pixels = torch.zeros((), dtype=torch.int64)  # pixels holding data: an all-nodata image is named
    pairs = scene_pairs(scenes)
    if dataset is None:  # (a dataset pinned its URLs' versions when it was made: the run's)
        pin_versions(pairs)  # URLs: every window of this scoring from the versions served now
    for image_path, label_path in pairs:  # every scene before the first window, as evaluate.py does
        refusal = own_normalisation and scene_refusal(forward_fn, image_path, bands_given=bands_given)
        if refusal:
            raise ValueError(f"evaluate_scenes: {refusal}")
        if dataset is None and isinstance(image_path, (str, os.PathLike)) and not is_vector(label_path):
            # Pairs of the caller's: size, geotransform, CRS and one label band, as training and
            # evaluate.py check them (a label on another grid was scored, size alone checked).
            inspect_pair(image_path, label_path)
    for scene_index, (image_path, label_path) in enumerate(pairs):
        if hasattr(progress, 'name') and len(pairs) > 1:  # (evaluate.py's Progress) each scene's own lines
            first = image_path[0] if isinstance(image_path, (list, tuple)) else image_path
            progress.name, progress.last = f'{os.path.basename(str(first))} ({scene_index + 1}/{len(pairs)})', 0.0
        with open_scene(image_path) as img:
            height, width = img.height, img.width
        if not is_vector(label_path):
            with open_scene(label_path) as lbl_src:
                if (width, height) != (lbl_src.width, lbl_src.height):
                    raise ValueError(f"image {image_path} is {width}x{height} but label "
                                     f"{label_path} is {lbl_src.width}x{lbl_src.height}")
        step = max(1, math.ceil(max(height, width) / preview_size)) if preview_size else 0
        prev_pred = np.zeros((math.ceil(height / step), math.ceil(width / step)), np.int32) if step else None
        prev_lbl = np.zeros_like(prev_pred) if step else None

        with _label_source(dataset, scene_index, label_path, ignore_index, num_classes) as read_label:

            def sink(y0, scores, wsum, nodata):
                h = scores.shape[1]
                # A halo of r rows above and below: erosion near a block edge needs them.
                r = int(erode_boundary)
                top, bottom = max(0, y0 - r), min(height, y0 + h + r)
                lbl = read_label(Window(0, top, width, bottom - top))
                ignore = boundary_mask(lbl, r, ignore_index)[y0 - top:y0 - top + h] if r else None
                lbl = lbl[y0 - top:y0 - top + h]
                pred = scores.argmax(0)
                image_pixels.add_(int(nodata.size - np.count_nonzero(nodata)))
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
                          device=device, num_classes=num_classes, progress=progress)
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
        distributed.all_reduce_sum(image_pixels)
    return dict(confusion=cm, previews=previews, image_pixels=int(image_pixels), **stats)
