"""A model ready for prediction from an exported weights file or a checkpoint."""
import os


def load_model(path, device='cpu'):
    """A model ready for prediction from an exported weights file or a checkpoint folder.

    ``path``: a file written by launch/export.py, a ``step_*`` folder, a ``checkpoints``
    folder or a work dir (the newest complete checkpoint). Returns ``(model, info)`` with
    ``info = dict(classes, model, data, source, step)``; ``data`` holds the training normalisation
    (``bands``, ``mean``, ``std``) when the checkpoint recorded it, else None; the model carries it
    as ``training_normalisation``, and its class names as ``class_names``: the defaults of
    :func:`~ds_seg.inference.predict_scene` and :func:`~ds_seg.inference.evaluate_scenes`.

    Example::

        model, info = load_model('work_dirs/default/weights_step_00000400.pt')
        predict_scene(model, 'scene.tif', 'out.tif', mean=info['data']['mean'],
                      std=info['data']['std'], bands=info['data']['bands'], classes=info['classes'])
    """
    from .. import models  # noqa: F401  (registers every model)
    from ..engine import checkpoint
    from ..inputs import check_checkpoint_option
    from ..models.pretrained import without_pretrained
    from ..registry import MODELS, build, import_custom_modules
    check_checkpoint_option(path)
    if os.path.isfile(path) and not checkpoint.is_pointer_file(path):
        payload = checkpoint.load_weights_file(path)
        state, model_cfg = payload['state_dict'], payload.get('model')
        classes, data = payload.get('classes'), payload.get('data')
        source, step = os.path.abspath(path), payload.get('step')
        custom = payload.get('custom_imports')
    else:
        ckpt = checkpoint.find_checkpoint(path, report=lambda line: print(f'[ds_seg] {line}', flush=True))
        marker = checkpoint.read_marker(ckpt)
        state = checkpoint.consolidated_state_dict(ckpt)
        model_cfg, classes, data = marker.get('model'), marker.get('classes'), marker.get('data')
        custom = marker.get('custom_imports')
        # The step folder actually read: a work dir or 'latest' whose newest checkpoint is damaged
        # falls back to an older one (said in one line), and records of the result name it.
        source, step = os.path.abspath(ckpt), marker.get('step')
    if not model_cfg:
        raise ValueError(f"{path}: records no model config; re-export it with launch/export.py")
    # The weights below replace the pretrained ones: that file (and the band_map that maps its
    # bands, which is refused without it) is never read again.
    model_cfg = without_pretrained(model_cfg)
    # A model of the user's own: the module that registers it, as training imported it.
    import_custom_modules(custom, where=f'{path}: its model {model_cfg.get("type")!r} comes from your module')
    try:
        model = build(MODELS, model_cfg, where='model')
        missing, unexpected = model.load_state_dict(state, strict=False)
    except (RuntimeError, TypeError) as exc:  # tensors of other shapes than the config it records builds
        detail = next((line.strip() for line in str(exc).splitlines() if 'size mismatch' in line),
                      (str(exc).splitlines() or [type(exc).__name__])[0]).rstrip('.')
        raise ValueError(f"{path}: its weights do not fit the model it records ({model_cfg.get('type')}): "
                         f"{detail}; the file was edited or assembled by hand: export it again") from exc
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit {model_cfg.get('type')}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    heads = model_cfg.get('num_classes')
    if classes and isinstance(heads, int) and len(classes) != heads:
        # Found only at the first window, as "the model returns 6 classes, expected 5".
        raise ValueError(f"{path}: records {len(classes)} class name(s) ({', '.join(map(str, classes))}) for a "
                         f"{model_cfg.get('type')} of {heads} classes; the file was edited or assembled by hand: "
                         f"export it again")
    model.to(device).eval()
    # What its inputs were normalised with in training: evaluate_scenes and predict_scene take it
    # for their defaults (a validation set's own statistics scored another model: tree recall
    # 0.75 instead of 0.96, without a word).
    model.training_normalisation = dict(data) if data else None
    # And its class names: predict_scene's tags said class_0.. where predict.py wrote the names.
    model.class_names = list(classes) if classes else None
    return model, dict(classes=list(classes) if classes else None, model=dict(model_cfg), data=data,
                       source=source, step=step)


def trained_dtype_refusal(trained_dtype, path):
    """Why the scene at ``path`` cannot take statistics measured on ``trained_dtype`` pixels, or
    None: mean/std are in the units of the training scenes' pixel type, and a uint16 scene
    through a uint8 model's statistics predicts garbage without a word. Shared by predict.py,
    evaluate.py and the API; each adds how to give other statistics."""
    if not trained_dtype:
        return None
    from ..data.raster import open_raster, same_units
    with open_raster(path) as src:
        if same_units(src.dtypes[0], trained_dtype):
            return None
        return (f"{path} holds {src.dtypes[0]} pixels but the model was trained on {trained_dtype} (its mean/std "
                f"are in those units); convert the scene (gdal_translate -ot)")


def band_count_refusal(data, path):
    """Why a model trained on every band of its files (``data``: load_model's ``info['data']``)
    cannot read the scene at ``path`` without being told its bands, or None: it read the first 4
    bands of a 6-band scene without a word (another sensor product, or another band order). Each
    caller adds how to say which bands."""
    trained, bands = (data or {}).get('file_bands'), (data or {}).get('bands')
    if not trained or not bands:
        return None
    from ..data.raster import open_raster
    with open_raster(path) as src:
        count = src.count
    if count == trained:
        return None
    alpha = (data or {}).get('file_alpha') or ()
    if alpha and count == trained - len(alpha) and max(alpha) > count >= max(bands):
        return None   # the training files' RGB(N) without their trailing alpha band: the same bands
    return (f"{path} has {count} bands, but the model was trained on files of {trained} (its bands "
            f"{' '.join(map(str, bands))}); say which of this scene's bands those are")


def scene_refusal(forward_fn, image_path, bands_given):
    """The API's own checks of a scene against a model from :func:`load_model` whose training
    normalisation it takes (predict.py and evaluate.py refuse the same): its pixel type, and,
    for a one-file scene without ``bands=``, its band count. The line, or None."""
    data = getattr(forward_fn, 'training_normalisation', None) or {}
    first = image_path if isinstance(image_path, (str, os.PathLike)) else list(image_path)[0]
    refusal = trained_dtype_refusal(data.get('dtype'), first)
    if refusal:
        return f"{refusal}, or give mean= and std= for its units"
    if not bands_given and isinstance(image_path, (str, os.PathLike)):
        refusal = band_count_refusal(data, image_path)
        if refusal:
            return f"{refusal} with bands= (e.g. bands={list(data['bands'])})"
    if not bands_given:
        refusal = band_encoding_refusal(data, first)
        if refusal:
            return f"{refusal}, or give mean= and std= for its units"
    return None


def band_encoding_refusal(data, path):
    """Why the scene at ``path`` is not in the units the model was trained on, or None: its
    bands' GDAL scale/offset ([scale, offset] each) differ from those the training scenes had
    (``data['encoding']``, recorded since; raw values are what the model saw). Raw+1000 with
    offset -1000 against raw reflectance was predicted on without a word."""
    trained, bands = (data or {}).get('encoding'), (data or {}).get('bands')
    if not trained or not bands:
        return None
    from ..data.raster import open_raster
    with open_raster(path) as src:
        if max(bands) > src.count:
            return None   # the band count is refused where it matters
        here = [[float(src.scales[b - 1]), float(src.offsets[b - 1])] for b in bands]
    trained = [[float(a), float(b)] for a, b in trained]
    # A time series: one date's file against a model of files stacking every date (its encoding
    # holds each date's bands in turn), or a file stacking every date against one of date files.
    if len(here) == len(trained):
        expected = [trained]
    elif len(trained) % len(here) == 0:
        expected = [trained[i:i + len(here)] for i in range(0, len(trained), len(here))]
    elif len(here) % len(trained) == 0:
        expected = [trained * (len(here) // len(trained))]
    else:
        return None   # another band count: refused where it matters
    if here in expected:
        return None
    return (f"{path}: its bands' scale/offset {here} differ from those of the scenes the model was trained on "
            f"{trained} ([scale, offset] per band); the model takes raw values in the "
            f"training encoding: write the scene in it (the values converted, and gdal_edit.py -scale/-offset)")


def training_normalisation(forward_fn):
    """``(mean, std, bands)`` a model from :func:`load_model` was trained with, else Nones."""
    data = getattr(forward_fn, 'training_normalisation', None) or {}
    return data.get('mean'), data.get('std'), data.get('bands')


def fixed_input_size(model_cfg):
    """The square input size a model config builds its model for, or None: its ``img_size``. A
    timm Swin builds its attention windows for it and takes no other size; a ViT resamples its
    position embeddings and takes any. Where the model refuses other sizes, predict's default
    window and an export's size follow it."""
    model_cfg = model_cfg or {}
    size = model_cfg.get('img_size') or (model_cfg.get('backbone_kwargs') or {}).get('img_size')
    if isinstance(size, (list, tuple)) and len(size) == 2 and size[0] == size[1]:
        size = size[0]
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 16 else None


def native_input_size(model_cfg):
    """The input size the model is built for: its ``img_size``, else the default input size timm
    records for its backbone (224 for swin_tiny_patch4_window7_224), else None."""
    size = fixed_input_size(model_cfg)
    backbone = (model_cfg or {}).get('backbone')
    if size is None and isinstance(backbone, str):
        try:
            import timm
            cfg = timm.models.get_pretrained_cfg(backbone)
        except Exception:  # not a timm name: building the model says so
            cfg = None
        input_size = getattr(cfg, 'input_size', None)
        if input_size and input_size[-1] == input_size[-2]:
            size = int(input_size[-1])
    return size


def _meta_cannot_run(exc):
    """An op with no meta kernel, or one that reads values (``.item()``, ``nonzero``): the meta
    device cannot tell whether the window fits; the real run will."""
    return isinstance(exc, NotImplementedError) or 'meta' in str(exc).lower()


def window_refusal(forward, channels, size, device='cpu'):
    """Why ``forward`` cannot take one ``size`` x ``size`` window of ``channels`` bands (blank),
    or None: ``(reason, size_is_the_fault)``. The size is blamed only when a larger window
    (max(512, 2 x size)) runs; otherwise the reason is another fault (a model of one fixed input
    size, a channel mismatch, memory), said as it is. On the meta device a failure of the meta
    device itself (an op without a meta kernel) is None: it tells nothing about the window.
    Shared by training's start-up check (on the meta device: no memory, no compute) and
    predict/evaluate's ``--tile`` check."""
    import torch

    def error(side):
        try:
            with torch.inference_mode():
                forward(torch.zeros(1, int(channels), side, side, device=device))
        except Exception as exc:  # torch's RuntimeError, onnxruntime's own classes, out of memory
            return exc
        return None

    exc = error(size)
    if exc is None or (device == 'meta' and _meta_cannot_run(exc)):
        return None
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or 'allocate' in reason.lower():
        return reason, False
    return reason, error(max(512, 2 * size)) is None
