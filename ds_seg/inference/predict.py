"""Whole-scene prediction to GeoTIFF: the engine's block rows become class and probability maps.

Example::

    predict_scene(model.eval(), 'scene.tif', 'scene_classes.tif', mean=m, std=s, classes=names)
"""
import os

import numpy as np

from .. import distributed
from ..data.raster import open_scene, pin_versions
from .engine import run_scene
from .model import scene_refusal, training_normalisation
from .tiling import ScenePlan
from ..inputs import check_outputs, partial_path, publish, remove_quietly, remove_stale_partials, run_token
from .writer import CLASS_NODATA, GeoTiffRowWriter, join_parts


def _to_outputs(scores, wsum, nodata, with_probs):
    classes = scores.argmax(0).astype(np.uint8)  # argmax of scores = argmax of scores / wsum
    classes[nodata] = CLASS_NODATA
    probs = None
    if with_probs:
        probs = np.rint(scores.astype(np.float32) / wsum * 250).astype(np.uint8)
        probs[:, nodata] = 255
    return classes, probs


def predict_scene(forward_fn, image_path, out_path, mean=None, std=None, classes=None,
                  probs_path=None, tile=512, overlap=128, batch_size=8, blend='gaussian',
                  tta='none', block=256, bands=None, device='cpu', accumulate_dtype='float32',
                  progress=None, overwrite=False):
    """Label one GeoTIFF scene of any size into ``out_path``; returns a summary dict.

    A uint8 class map is written with the input's CRS, transform and size, tiled and
    ZSTD-compressed, nodata 255 where the input is nodata, class names in the tags and a colour
    table; ``probs_path`` adds a K-band uint8 GeoTIFF of probabilities x 250. With several
    ranks every rank calls this; each writes its band to a part file next to ``out_path`` and
    rank 0 joins them (so ``out_path`` must be on a shared file system). ``mean``/``std``/``bands``
    and ``classes`` left out are those a model from :func:`~ds_seg.inference.load_model` was
    trained with.
    ``overwrite=False`` (the default, as predict.py's)
    refuses an output that exists at the start, and never replaces one that exists when the scene
    is done (another run's, written meanwhile): FileExistsError, and this run's files are removed.
    (The default was True: a second call replaced the first's class map without a word.)

    Example::

        model = build(MODELS, payload['model']); model.load_state_dict(payload['state_dict'])
        predict_scene(model.eval(), 'scene.tif', 'scene_classes.tif', mean=m, std=s,
                      classes=payload['classes'], tile=512, overlap=128, batch_size=8)
    """
    if mean is None and std is None:  # a model from load_model knows them
        mean, std, trained_bands = training_normalisation(forward_fn)
        refusal = mean is not None and scene_refusal(forward_fn, image_path, bands_given=bands is not None)
        if refusal:
            raise ValueError(f"predict_scene: {refusal}")
        bands = trained_bands if bands is None else bands
    if mean is None or std is None:
        raise ValueError("predict_scene: mean and std (the training normalisation) are required")
    # Before any window, as predict.py: a class map written over the scene it reads, or over the
    # probabilities (a GDAL error after the whole scene).
    scene_files = [image_path] if isinstance(image_path, (str, os.PathLike)) else list(image_path)
    check_outputs([p for p in (out_path, probs_path) if p], scene_files, overwrite=overwrite, option='predict_scene')
    if probs_path and os.path.realpath(probs_path) == os.path.realpath(out_path):
        raise ValueError(f"predict_scene: probs_path and out_path are both {out_path}; give each its own file")
    if classes is None:  # a model from load_model knows its class names
        classes = getattr(forward_fn, 'class_names', None)
    rank, world_size = distributed.rank(), distributed.world_size()
    k = len(classes) if classes is not None else None
    pin_versions(image_path)  # a URL: every window of this prediction from the version served now
    with open_scene(image_path) as src:
        profile = dict(src.profile)
        if src.transform.is_identity:  # located by GCPs or RPCs instead (a stack of dates has none)
            profile.update(gcps=getattr(src, 'gcps', None), rpcs=getattr(src, 'rpcs', None))
        tags = src.tags() if hasattr(src, 'tags') else {}
        profile['area_or_point'] = tags.get('AREA_OR_POINT')   # PixelIsPoint kept (see GeoTiffRowWriter)
    writer = None
    part = world_size > 1
    plan = ScenePlan(profile['height'], profile['width'], tile, overlap, block, world_size)
    a, b = plan.band(rank)
    # Written under a temporary name of this run's (see inputs.partial_path) and given the final
    # name when complete; the ranks' part files are named after it, and rank 0 joins them into it.
    token = distributed.from_main(run_token())
    if rank == 0:
        for path in (out_path, probs_path):
            if path:
                remove_stale_partials(path)
    tmp_out = partial_path(out_path, token)
    tmp_probs = partial_path(probs_path, token) if probs_path else None
    parts = (f'{tmp_out}.part{rank}', f'{tmp_probs}.part{rank}' if probs_path else None)

    def sink(y0, scores, wsum, nodata):
        nonlocal writer
        cls, probs = _to_outputs(scores, wsum, nodata, probs_path is not None)
        if writer is None:
            names = list(classes) if classes is not None else [f'class_{i}' for i in range(scores.shape[0])]
            if part:
                writer = GeoTiffRowWriter(parts[0], profile, names, parts[1], block, row_offset=a, height=b - a)
            else:
                writer = GeoTiffRowWriter(tmp_out, profile, names, tmp_probs, block)
        writer.write(y0 - (a if part else 0), cls, probs)

    try:
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
                join_parts(tmp_out, tmp_probs, profile, plan, block)
        taken = None
        if rank == 0:  # complete: now (and only now) the final names, both or neither
            try:
                publish([(tmp_out, out_path)] + ([(tmp_probs, probs_path)] if probs_path else []), overwrite)
            except FileExistsError as exc:
                taken = str(exc)
        taken = distributed.first_failure(taken) if part else taken  # no rank waits for rank 0
        if taken:
            raise FileExistsError(taken)
    except BaseException:  # an error, Ctrl-C: nothing half-written stays, an older output is intact
        remove_quietly(*parts, *((tmp_out, tmp_probs) if rank == 0 else ()))
        raise
    if part:
        distributed.barrier()
    stats['out_path'] = out_path
    return stats
