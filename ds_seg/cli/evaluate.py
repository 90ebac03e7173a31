"""Metrics over whole validation scenes, with the same sliding-window code as predict.py.

    python launch/evaluate.py --checkpoint weights.pt --images 'val/*_rgb.tif' --labels 'val/*_label.tif' \\
        --output eval/ [--exclude clutter] [--erode 3]
    python launch/evaluate.py --checkpoint work_dirs/default --config configs/unet_synthetic.py --output eval/

Writes ``eval.json`` (per-class IoU/F1/precision/recall, mIoU, mF1, OA, the confusion matrix and
the settings), ``confusion.png`` (row-normalised) and ``preview_<n>.png`` (image, label,
prediction side by side). Under torchrun/deepspeed the scenes are split into bands of rows
across ranks and one confusion matrix is all-reduced. ``--erode r`` ignores label pixels within
r px of a class boundary (ISPRS's eroded ground truth, r = 3); ``--exclude`` leaves classes out
of mIoU and mF1 (not out of OA).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

from ds_seg.cli.predict import (DEFAULT_TILE, Progress, add_window_args, check_band_count,  # noqa: E402
                               check_pixel_type, check_scene_values, check_tile_fits, load_forward, normalisation,
                               quiet_about_plain_images, setup, tile_from_model, window_kwargs)

from ds_seg import distributed  # noqa: E402
from ds_seg.cli import OneLineParser, exit_without_finalization, outlive_stdout, run_command  # noqa: E402
from ds_seg.inference import default_palette, evaluate_scenes, scene_pairs  # noqa: E402
from ds_seg.inputs import (user_path, check_bands, check_checkpoint_option, check_output_folder, check_outputs,  # noqa: E402
                           check_writable, refuse_inside_checkpoints, expand_inputs, replaced_when_done)
from ds_seg.metrics import metrics_from_confusion  # noqa: E402
from ds_seg.vectorize import exclude_ids  # noqa: E402


MAX_ERODE = 100  # --erode, px

def save_confusion_png(cm, classes, path, exclude=()):
    """Row-normalised confusion matrix (recall per class on the diagonal) as a PNG."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    cm = np.asarray(cm, np.float64)
    norm = cm / np.maximum(cm.sum(1, keepdims=True), 1)
    k = len(classes)
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * k, 0.8 + 0.6 * k))
    ax.imshow(norm, cmap='Blues', vmin=0, vmax=1)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f'{norm[i, j]:.2f}', ha='center', va='center', fontsize=7,
                    color='white' if norm[i, j] > 0.5 else 'black')
    labels = [f'{c} (excl.)' if c in exclude else c for c in classes]
    ax.set_xticks(range(k), labels, rotation=45, ha='right')
    ax.set_yticks(range(k), labels)
    ax.set_xlabel('prediction')
    ax.set_ylabel('ground truth')
    ax.set_title('confusion (rows sum to 1)')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PREVIEW_MARK = 'ds_seg evaluate.py preview'


def save_preview_png(preview, classes, path, bands=None):
    """Image | label | prediction of one scene (decimated), ignore/nodata in black."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import rasterio
    pred, truth, step = preview['prediction'], preview['truth'], preview['step']
    # A time series shows its first date (its bands are the first of the model's).
    image = preview['image'][0] if isinstance(preview['image'], (list, tuple)) else preview['image']
    with rasterio.open(image) as src:
        idx = [b for b in (bands or range(1, src.count + 1)) if b <= src.count][:3] or [1]
        idx = idx[:1] if len(idx) == 2 else idx   # two bands (SAR VV/VH...): the first, in grey
        img = src.read(idx, out_shape=(len(idx),) + pred.shape).astype(np.float64)
    finite = np.isfinite(img)  # NaN nodata made both percentiles NaN: a blank picture
    lo, hi = np.percentile(img[finite], (2, 98)) if finite.any() else (0.0, 1.0)
    img = np.clip((np.where(finite, img, lo) - lo) / max(hi - lo, 1e-9), 0, 1).transpose(1, 2, 0)
    if img.shape[2] == 1:
        img = np.repeat(img, 3, axis=2)
    lut = np.zeros((256, 3), np.uint8)
    lut[:len(classes)] = default_palette(len(classes))
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.3))
    for ax, im, title in zip(axes, (img, lut[truth], lut[pred]), ('image', 'label', 'prediction')):
        ax.imshow(im, interpolation='nearest')
        ax.set_title(title)
        ax.axis('off')
    fig.suptitle(f'{os.path.basename(image)}' + (f' (every {step} pixels, one shown)' if step > 1 else ''))
    fig.tight_layout()
    # Marked as evaluate's own: an --overwrite run removes earlier ones of this mark only.
    fig.savefig(path, dpi=90, metadata={'Software': PREVIEW_MARK})
    plt.close(fig)


def run_config_of(checkpoint):
    """The ``config.json`` of the run ``checkpoint`` belongs to (its work dir, checkpoints folder,
    a step_* folder or the ``latest``/``best`` file in it, or a file exported into the work dir), or None."""
    from ds_seg.engine.checkpoint import find_checkpoint, is_pointer_file
    path = os.path.abspath(checkpoint)
    if os.path.isdir(path) or is_pointer_file(path):
        try:
            work = os.path.dirname(os.path.dirname(find_checkpoint(path)))
        except FileNotFoundError:  # loading it says what is wrong
            return None
    else:
        work = os.path.dirname(path)
    config = os.path.join(work, 'config.json')
    return config if os.path.isfile(config) and os.path.isdir(os.path.join(work, 'checkpoints')) else None


def evaluated_config(args):
    """The experiment config whose data.val is evaluated: --config; without it and --images, the
    config of the run --checkpoint comes from (the embedded default evaluated another run's
    checkpoint on the default's scenes), else the embedded default. None for --images/--labels."""
    if args.config or not args.images:
        from ds_seg.config import load_config
        path = args.config or run_config_of(args.checkpoint)
        # Before the process group exists (setup comes later): the launcher's RANK says who prints.
        if not args.config and os.environ.get('RANK', '0') == '0':
            print(f"[evaluate] data.val of the run's config {path} (give --config to evaluate another)" if path else
                  "[evaluate] data.val of the embedded default config (synthetic scenes): --checkpoint is not in "
                  "a run's work dir; give --config or --images/--labels to evaluate your scenes")
        cfg = load_config(path, args.cfg_options)
        if cfg.data.val is None:
            raise ValueError(f"{path or 'the default config'}: data.val is None, so there is no validation set to "
                             "evaluate; set data.val (--cfg-options), or give --images/--labels")
        return cfg
    return None


def resolve_windows(args, cfg):
    """--tile/--overlap not given: for a config's data.val, the windows its training evaluated
    with (data.eval_tile or data.crop_size, data.eval_overlap), so that evaluate.py reproduces the
    run's eval.jsonl (512 px windows scored the same weights differently); else 512 px. Returns
    how a refusal names a tile taken from the config (None: --tile or the default)."""
    if args.tile is not None:
        return None
    if cfg is None:
        args.tile = DEFAULT_TILE
        return None
    args.tile = cfg.data.get('eval_tile') or cfg.data.crop_size
    if args.overlap is None:
        args.overlap = cfg.data.get('eval_overlap')
    return (f"the evaluation tile {args.tile} (data.eval_tile or data.crop_size of the config; --tile sets "
            f"another)")


def build_scenes(args, info, cfg):
    """A dataset from ``cfg``'s data.val, or (image, label) pairs from --images/--labels."""
    if cfg is not None:
        from ds_seg.registry import DATASETS, build
        with distributed.main_process_first():  # a synthetic set is written once, by rank 0
            ds = build(DATASETS, cfg.data.val, where='data.val', crop_size=cfg.data.crop_size,
                       seed=cfg.train.seed)
        check_classes(args, list(ds.classes), info, data_val=args.config or run_config_of(args.checkpoint)
                      or 'the embedded default config (synthetic scenes)')
        return ds, list(ds.classes)
    from ds_seg.data.geotiff import (cached_label_histograms, expand_paths, inspect_pair, label_nodata_message,
                                     pair_by_name, refuse_repeated_scenes)
    from ds_seg.data.raster import same_value
    # Globs, and folders (their GeoTIFFs, as predict.py's --input): every file readable to its end
    images = expand_inputs(expand_paths(args.images, '--images'), '--images')
    labels = expand_inputs(expand_paths(args.labels or [], '--labels'), '--labels')
    if len(images) != len(labels):
        raise ValueError(f'{len(images)} images but {len(labels)} labels; they are paired in order')
    copied = refuse_repeated_scenes(images, '--images')
    if copied and distributed.is_main():
        print(f'[evaluate] note: {copied}', flush=True)
    refuse_label_decoding(info)
    labels = pair_by_name(images, labels)  # as training pairs them
    scenes = []
    refuse_one_date_of_a_series(images[0], info, args.bands)
    for image, label in zip(images, labels):
        scenes.append(inspect_pair(image, label))  # size, geotransform, CRS, one label band: as training checks
        check_bands(image, args.bands or (info.get('data') or {}).get('bands'), info['model'].get('in_channels'),
                    option='--images', colours=(info.get('data') or {}).get('colours'))
    classes = args.classes or info['classes']
    if not classes:
        raise ValueError('the checkpoint records no class names; give --classes')
    check_classes(args, list(classes), info)
    # Before any window is predicted: every label value a class or --ignore-index (training's
    # cached full scan of each label file), and no label nodata tag that is a class.
    ignore = 255 if args.ignore_index is None else int(args.ignore_index)
    histograms = cached_label_histograms(labels)
    for scene, histogram in zip(scenes, histograms):
        nodata = scene.get('label_nodata')
        if nodata is not None and float(nodata).is_integer() and 0 <= nodata < len(classes) and nodata != ignore:
            raise ValueError(label_nodata_message(scene['label'], float(nodata), int(nodata), classes[int(nodata)], ignore))
        bad = sorted(v for v in (histogram or {}) if v != ignore and not same_value(v, nodata)  # nodata: unlabelled
                     and not (v.is_integer() and 0 <= v < len(classes)))
        if bad:
            raise ValueError(f"{scene['label']}: {histogram[bad[0]]} pixel(s) have label value {bad[0]:.10g}, which is not "
                             f"a class index 0..{len(classes) - 1} nor --ignore-index {ignore}; nothing was evaluated. "
                             "Check --labels, --classes or --ignore-index")
    if all(h is not None for h in histograms) and not any(  # before hours of prediction, not after
            v != ignore and not same_value(v, s.get('label_nodata')) for s, h in zip(scenes, histograms) for v in h):
        raise ValueError(no_class_pixels(labels, args))
    return list(zip(images, labels)), list(classes)


def refuse_one_date_of_a_series(image, info, bands):
    """--images gives one file per scene; a time-series model takes several dates per scene. A file
    of one date's bands was told to 'give --bands with 6 band numbers' (a 3-band file has none)."""
    from ds_seg.data.raster import open_raster
    model = info.get('model') or {}
    # A temporal model says num_dates; a plain one trained on stacked dates (early fusion) has it
    # in its data record, as predict reads it.
    dates = model.get('num_dates') or (info.get('data') or {}).get('num_dates') or 1
    channels = model.get('in_channels')
    if dates < 2 or not channels or bands:
        return
    with open_raster(image) as src:
        count = src.count
    if count < channels:
        raise ValueError(f"--images: the model ({model.get('type')}) takes {dates} dates of {channels // dates} "
                         f"band(s) per scene, and {image} is one file of {count} band(s); --images takes one file "
                         "per scene (all its dates stacked), so give the dates through a config: --checkpoint <the "
                         "run's work dir> --cfg-options data.val.images=[[date_1, date_2, ...], ...] "
                         "data.val.labels=[...]")


def refuse_label_decoding(info):
    """--labels are read as class indices. A model trained on labels that a label_map or
    reduce_zero_label decoded (recorded in its checkpoint) was scored on the raw values: mIoU 0.02
    for a run whose own evaluation said 0.15, without a word. Its run's config decodes them."""
    from ds_seg.data.geotiff import effective_label_decoding
    decoding = effective_label_decoding((info.get('data') or {}).get('label_decoding'), len(info.get('classes') or ()))
    decoding = {k: v for k, v in (decoding or {}).items() if k != 'palette'}
    if decoding:
        said = ', '.join(f'{k}={v!r}' for k, v in decoding.items())
        raise ValueError(f"--labels: the model was trained on labels decoded with {said}, and --labels are read as "
                         "class indices; evaluate through a config that decodes them: --checkpoint <the run's work "
                         "dir> --cfg-options data.val.images=... data.val.labels=... (a benchmark type such as "
                         "Potsdam: data.val.data_root=...), or --config with the same label settings")


def no_class_pixels(labels, args):
    """The line for labels of which no pixel can be scored."""
    return (f"no pixel of the labels ({', '.join(labels)}) is a class: all are "
            f"ignore_index{'' if args.ignore_index is None else ' ' + str(args.ignore_index)}, "
            f"nodata{' or eroded' if args.erode else ''}; nothing can be measured. Check the label files, "
            "--ignore-index or --erode.")


def check_dates(scenes, info):
    """A model of one date scored only the first date of a time-series data.val (its bands are
    the first file's); a time-series model on one date was a riddle about mean/std lengths."""
    if not hasattr(scenes, 'num_dates'):  # --images/--labels: one file per scene, its bands checked
        return
    model = info.get('model') or {}
    model_dates, data_dates = model.get('num_dates') or 1, scenes.num_dates
    # Every date's bands in one file (a time-series model on one stacked file), or the dates
    # stacked as channels of a plain model (early fusion, as training allows): the channels agree.
    fused = (model_dates == 1 or data_dates == 1) and scenes.in_channels == model.get('in_channels')
    if data_dates != model_dates and not fused:
        raise ValueError(f"data.val has {data_dates} date(s) per scene but the model ({model.get('type')}) takes "
                         f"{model_dates}; give data.val images of {model_dates} date(s) per scene "
                         f"(images=[[a_may.tif, a_aug.tif], ...] for a time series)")


def output_files(args):
    """eval.json, confusion.png and preview_0.png .. preview_<--previews - 1>.png in --output."""
    names = ['eval.json', 'confusion.png'] + [f'preview_{i}.png' for i in range(max(args.previews, 0))]
    return [os.path.join(args.output, n) for n in names]


def check_classes(args, classes, info, data_val=None):
    """The options that name classes, against the classes evaluated, before any window is
    predicted (an unknown --exclude name was refused only when the metrics were computed, after
    the whole evaluation; a --classes list of another length was blamed on the label values).
    ``data_val``: the config whose data.val gave ``classes`` (None: --classes or the checkpoint)."""
    predicted = info['model'].get('num_classes')
    if predicted and len(classes) != predicted and data_val is not None:
        # Not the user's --classes: the model was trained on data other than this data.val.
        raise ValueError(f"data.val of {data_val} has {len(classes)} classes ({', '.join(classes)}) but the model "
                         f"predicts {predicted}: it was trained on other data; give its run's config (--config), "
                         "or the scenes to evaluate with --images/--labels")
    if predicted and len(classes) != predicted:
        raise ValueError(f"{len(classes)} classes given ({', '.join(classes)}) but the model predicts {predicted}; "
                         f"give one --classes name per class the model predicts")
    # Names or ids, as predict.py's --exclude-classes takes them (one rule for both commands).
    args.exclude = [classes[i] for i in exclude_ids(args.exclude, list(classes), option='--exclude')]
    twice = sorted({name for name in args.exclude if list(args.exclude).count(name) > 1})
    if twice:  # eval.json said "(mIoU/mF1 without grass, grass)"
        raise ValueError(f"--exclude names {', '.join(twice)} twice; name each class once")
    if args.exclude and set(args.exclude) >= set(classes):  # the whole evaluation ran to write mIoU null
        raise ValueError(f"--exclude names every class ({', '.join(classes)}): mIoU and mF1 would average "
                         f"none; leave at least one class in")
    check_ignore_index(args.ignore_index, classes)


def remove_stale_previews(folder, written):
    """After an --overwrite run: the preview_<n>.png of an earlier evaluation of more scenes (or
    with more --previews) would stay beside the new eval.json as if they were this run's. Removed,
    said aloud, when evaluate wrote them (their PNG mark); a file of the user's of that name stays."""
    import re
    for name in sorted(os.listdir(folder)):
        match = re.fullmatch(r'preview_(\d+)\.png', name)
        if not match or int(match.group(1)) < written:
            continue
        path = os.path.join(folder, name)
        if _written_by_evaluate(path):
            os.remove(path)
            print(f"[evaluate] removed {path}: an earlier evaluation's preview, not this one's "
                  f"(--overwrite, and this run wrote {written})", flush=True)
        else:
            print(f"[evaluate] kept {path}: not a preview evaluate wrote, though named like one", flush=True)


def _written_by_evaluate(path):
    try:
        from PIL import Image
        with Image.open(path) as image:
            return getattr(image, 'text', {}).get('Software') == PREVIEW_MARK
    except Exception:  # unreadable, or no PNG at all: not one of ours
        return False


def check_ignore_index(ignore_index, classes):
    """As training refuses it: an --ignore-index that is a class index would drop that class
    from every metric without a word."""
    if ignore_index is not None and 0 <= ignore_index < len(classes):
        raise ValueError(f"--ignore-index {ignore_index} is class {ignore_index} ({classes[ignore_index]!r}): "
                         f"its pixels would never be counted; use a value outside 0..{len(classes) - 1} "
                         "(default 255)")


def _run(args):
    """The command after argument parsing; user errors raise (see ds_seg.cli.run_command)."""
    # --config evaluates its data.val: --images/--labels beside it were ignored without a word
    # (another set of scenes scored), as were --cfg-options beside --images.
    if args.config and (args.images or args.labels):
        raise ValueError("--config evaluates its data.val, so --images/--labels would be ignored; give either "
                         "--images/--labels, or --config (its scenes set with --cfg-options data.val.images=... "
                         "data.val.labels=..., or data.val.data_root=... for a benchmark type such as Potsdam, to "
                         "decode labels as that config does)")
    if args.cfg_options and not args.config and args.images:
        raise ValueError("--cfg-options change --config's data.val, which --images/--labels replace, so they "
                         "would be ignored; leave them out, or give --config instead of --images/--labels")
    if args.cfg_options:
        from ds_seg.config import option_keys
        # data.* and the seed data.val is built with; model.base_channels=32 or loss.ignore_index=0
        # were accepted and changed nothing.
        ignored = [k for k in option_keys(args.cfg_options) if not (k.split('.')[0] == 'data' or k == 'train.seed')]
        if ignored:
            raise ValueError(f"--cfg-options {ignored[0]}: evaluate scores --checkpoint's model on the config's "
                             "data (data.val, its windows, train.seed); other settings take no part and would be "
                             "ignored: leave it out")
    if args.classes and not args.images:  # the dataset's own classes were used, these ignored
        raise ValueError("--classes names the classes of --images/--labels; --config's data.val has its own "
                         "(set data.val.classes with --cfg-options)")
    if args.labels and not args.images:
        raise ValueError("--labels without --images: give the image scenes with --images")
    if args.previews < 0:  # wrote none, without a word
        raise ValueError(f"--previews must be >= 0 (0 writes none), got {args.previews}")
    if args.erode is not None and args.erode > MAX_ERODE:
        # Each block row compares (2r + 1)^2 offsets: --erode 100000 ran for hours on a 128 px scene.
        raise ValueError(f"--erode must be at most {MAX_ERODE} px (ISPRS uses 3; a wider band leaves little but "
                         f"the insides of large objects), got {args.erode}")
    if args.erode is not None and args.erode < 0:  # was an IndexError traceback after the first window
        raise ValueError(f"--erode must be >= 0 (label pixels within that many px of a class boundary are "
                         f"not counted; ISPRS uses 3), got {args.erode}")
    # Before the config's line about which data.val is scored: a missing --checkpoint was told
    # about the embedded default's scenes first, then refused.
    check_checkpoint_option(args.checkpoint)
    cfg = evaluated_config(args)
    tile_given = args.tile is not None
    window_kwargs(args, tile_said=resolve_windows(args, cfg))  # checks the window options
    check_output_folder(args.output)
    # Every file this run may write, not only eval.json: an earlier run's pictures are results too.
    check_outputs(output_files(args), [], overwrite=args.overwrite)
    check_writable(args.output)
    refuse_inside_checkpoints(args.output, '--output')
    device = setup(args)
    # An .onnx export is evaluated as predict.py runs it (onnxruntime); it was read as a torch file
    # and refused as 'a text file'.
    model, info = load_forward(args.checkpoint, device, args.cpu_threads)
    said = (cfg.get('model') or {}).get('type') if args.config else None
    scored = (info.get('model') or {}).get('type')
    if said and scored and said != scored and os.environ.get('RANK', '0') == '0':
        # Only its data.val is used: the config's model was taken for the one scored.
        print(f"[evaluate] --config {args.config} trains a {said}; evaluate scores --checkpoint's model, a {scored}, "
              f"on that config's data.val", flush=True)
    scenes, classes = build_scenes(args, info, cfg)
    check_dates(scenes, info)
    mean, std, bands = normalisation(args, info, fallback=scenes if hasattr(scenes, 'scenes') else None)
    if not tile_given and cfg is None:  # a config's data.val evaluates with the tile it trained with
        window_kwargs(args, tile_said=tile_from_model(args, info, model, bands, device, 'evaluate'))
    # Scenes of a dataset (--config) or (image, label) pairs (--images/--labels).
    images = [p for s in scenes.scenes for p in s.get('dates', (s['image'],))] if hasattr(scenes, 'scenes') \
        else [image for image, _ in scenes]
    option = '--images' if args.images else 'data.val'
    for path in images:
        check_pixel_type(path, info, args, option)
        check_scene_values(path, info, bands, option, program='evaluate')
        if args.images:  # a dataset selects its bands by its own config
            check_band_count(path, info, args, option)
        else:  # --images were checked against the model's colours as they were paired
            check_bands(path, bands, None, option, colours=(info.get('data') or {}).get('colours'))
    check_tile_fits(model, info, args.tile, bands, device)
    with torch.inference_mode():
        result = evaluate_scenes(model, scenes, num_classes=len(classes), mean=mean, std=std,
                                 bands=bands, ignore_index=args.ignore_index, erode_boundary=args.erode,
                                 device=device, preview_size=512 if args.previews else 0,
                                 progress=Progress('evaluation', program='evaluate'), **window_kwargs(args))
    cm = result['confusion']
    if int(cm.sum()) == 0:  # metrics of nothing would be null, or a traceback; nothing is written
        if result['image_pixels'] == 0:  # the images, not the labels, left nothing to measure
            more = f' and {len(images) - 3} more' if len(images) > 3 else ''
            raise ValueError(f"no pixel of the images ({', '.join(images[:3])}{more}) holds data: all are nodata "
                             "(their nodata value, mask or alpha band); nothing can be measured. Check the image files")
        raise ValueError(no_class_pixels([p[1] for p in scene_pairs(scenes)], args))
    metrics = metrics_from_confusion(cm, classes, exclude=tuple(args.exclude))
    if distributed.is_main():
        os.makedirs(args.output, exist_ok=True)
        record = dict(**metrics, confusion=cm.tolist(), classes=classes, exclude=list(args.exclude),
                      erode_boundary=args.erode, checkpoint=os.path.abspath(args.checkpoint),
                      checkpoint_read=info.get('source') or os.path.abspath(args.checkpoint),
                      step=info.get('step'),
                      scenes=[p[0] for p in scene_pairs(scenes)], labels=[p[1] for p in scene_pairs(scenes)],
                      windows=result['windows'], world_size=distributed.world_size(),
                      settings=window_kwargs(args))
        with replaced_when_done(os.path.join(args.output, 'eval.json'), args.overwrite) as tmp, open(tmp, 'w') as f:
            json.dump(record, f, indent=1)
        with replaced_when_done(os.path.join(args.output, 'confusion.png'), args.overwrite) as tmp:
            save_confusion_png(cm, classes, tmp, args.exclude)
        written = result['previews'][:args.previews]
        for i, preview in enumerate(written):
            with replaced_when_done(os.path.join(args.output, f'preview_{i}.png'), args.overwrite) as tmp:
                save_preview_png(preview, classes, tmp, bands)
        if args.overwrite:
            remove_stale_previews(args.output, len(written))
        num = lambda x: 'n/a' if x is None else f'{x:.4f}'  # noqa: E731 -- every class excluded or absent
        print(f"[evaluate] mIoU {num(metrics['mIoU'])} | mF1 {num(metrics['mF1'])} | OA {num(metrics['OA'])}"
              + (f" (mIoU/mF1 without {', '.join(args.exclude)})" if args.exclude else ''))
        for name, v in metrics['per_class'].items():
            fmt = lambda x: '  -  ' if x is None else f'{x:.3f}'  # noqa: E731
            print(f"[evaluate]   {name:>14}: IoU {fmt(v['iou'])} F1 {fmt(v['f1'])} "
                  f"precision {fmt(v['precision'])} recall {fmt(v['recall'])}")
        print(f"[evaluate] wrote {os.path.join(args.output, 'eval.json')}")


def main(argv=None):
    if argv is None:   # the command itself: a stdout that closes does not stop it
        outlive_stdout()
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--checkpoint', type=user_path, required=True, help='weights file, step_* folder, checkpoints folder, work dir, or an .onnx export '
                        '(run with onnxruntime on the CPU)')
    parser.add_argument('--images', type=user_path, nargs='+', default=None, help='image scenes (paths, globs or folders)')
    parser.add_argument('--labels', type=user_path, nargs='+', default=None, help='label rasters, paired with --images in order')
    parser.add_argument('--config', type=user_path, default=None, help="experiment config whose data.val is evaluated "
                        "(default without --images: the config.json of the run --checkpoint comes from, "
                        "else the embedded default)")
    parser.add_argument('--cfg-options', nargs='+', action='extend', default=None, help='overrides for --config')
    parser.add_argument('--classes', nargs='+', default=None, help='class names (default: the checkpoint)')
    parser.add_argument('--exclude', nargs='+', default=(), help='classes (names or ids) left out of mIoU/mF1, e.g. clutter')
    parser.add_argument('--erode', type=int, default=None,
                        help='ignore label pixels within this many px of a class boundary (ISPRS: 3)')
    parser.add_argument('--ignore-index', type=int, default=None, help='label value not counted (default 255)')
    parser.add_argument('--previews', type=int, default=3, help='side-by-side PNGs to write (default 3)')
    parser.add_argument('--output', type=user_path, required=True, help='output folder')
    parser.add_argument('--overwrite', action='store_true', help='replace earlier outputs (eval.json, confusion.png, preview_N.png) in '
                        '--output')
    add_window_args(parser, tile_default="512, or the model's img_size; for --config's data.val, "
                    "data.eval_tile or crop_size, and data.eval_overlap, as its training evaluated")
    args = parser.parse_args(argv)
    status = run_command('evaluate', quiet_about_plain_images(lambda: _run(args)),
                       errors=(FileNotFoundError, ValueError, KeyError),
                       output=lambda: args.output if os.path.isdir(args.output) else None)
    if argv is None:  # the program, not a call from Python: gloo threads must not meet finalization
        exit_without_finalization(status)
    return status


if __name__ == '__main__':
    sys.exit(main())
