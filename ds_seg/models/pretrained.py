"""Pretrained weights for backbones: from a local file, or through timm when asked and reachable,
with first layers adapted to any band count rather than dropped.

Example::

    backbone = build(BACKBONES, dict(type='TimmBackbone', name='resnet50', in_channels=4,
                                     pretrained='weights/resnet50.safetensors'))
"""
import contextlib
import os
import pickle
import re

import torch


def without_pretrained(model_cfg):
    """The model config with its pretrained weights (``pretrained`` and the ``band_map`` that maps
    the file's bands, at the top or under ``backbone``) left out: for a model whose weights come
    from elsewhere, or that is only measured. Neither changes the architecture."""
    def strip(section):
        if not section.get('pretrained'):
            return section
        return {k: v for k, v in section.items() if k != 'band_map'} | {'pretrained': None}
    model_cfg = strip(dict(model_cfg))
    if isinstance(model_cfg.get('backbone'), dict):
        model_cfg['backbone'] = strip(dict(model_cfg['backbone']))
    return model_cfg


def has_pretrained(model_cfg):
    """Whether the model config names pretrained weights (at the top or under ``backbone``)."""
    backbone = model_cfg.get('backbone')
    return bool(model_cfg.get('pretrained') or (isinstance(backbone, dict) and backbone.get('pretrained')))


def adapt_input_weight(weight_OIhw, in_channels):
    """Adapt a first-layer weight trained on RGB (``I == 3``) to ``in_channels`` bands.

    The RGB filters are kept for the first three bands, every further band gets their mean, and
    all are scaled by ``3 / in_channels`` (one band: the sum). So an image whose bands are all
    equal to one grey value gives exactly the response the RGB layer gives to that grey image:
    the statistics every later layer was trained on are preserved, and RGB information is kept.

    Example::

        w4 = adapt_input_weight(conv_rgb.weight, 4)   # [O, 3, k, k] -> [O, 4, k, k]
    """
    source = weight_OIhw.shape[1]
    if source == in_channels:
        return weight_OIhw
    mean = weight_OIhw.mean(dim=1, keepdim=True)
    kept = weight_OIhw[:, :min(source, in_channels)] if in_channels >= source else mean.expand(
        -1, in_channels, *weight_OIhw.shape[2:])
    extra = mean.expand(-1, max(0, in_channels - kept.shape[1]), *weight_OIhw.shape[2:])
    return torch.cat([kept, extra], dim=1) * (source / in_channels)


class _Inert:
    """What an object of a training checkpoint other than its weights loads as (timm's argparse
    Namespace, mmengine's MessageHub and HistoryBuffer, numpy scalars...): nothing of its class is
    imported or run, whatever it is built from is dropped."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass


# torch's refusal of a global it does not know (torch/_weights_only_unpickler.py)
_UNKNOWN_GLOBAL = re.compile(r'Unsupported global: GLOBAL (\S+) was not an allowed global')


def _load_tensors_beside_inert_objects(path, most=64):
    """``torch.load(weights_only=True)`` of a training checkpoint: timm's and mmengine's hold their
    arguments, logs and optimizer state beside the weights, objects torch refuses to unpickle.
    Each class torch names is given an inert stand-in (never the class itself: loading runs no code
    of the file's), and the file is read again, so its tensors load and its other objects do not.
    Modules torch blocks outright (os, subprocess...) stay refused."""
    stand_ins = []
    while True:
        try:
            with torch.serialization.safe_globals(stand_ins):
                return torch.load(path, map_location='cpu', weights_only=True)
        except pickle.UnpicklingError as exc:
            found = _UNKNOWN_GLOBAL.search(str(exc))
            # torch's message names builtins without their module ('getattr'); it looks them up with it
            name = found and (found.group(1) if '.' in found.group(1) else f'builtins.{found.group(1)}')
            if not found or len(stand_ins) >= most or any(known == name for _, known in stand_ins):
                raise
            stand_ins.append((type(name, (_Inert,), {}), name))


def read_state_dict(path, where='pretrained'):
    """A state dict from ``.pth``/``.pt``/``.bin``/``.safetensors``; unwraps ``state_dict``/``model``
    (as released files nest them) and strips the ``module.`` prefix of a file saved from a
    DDP-wrapped model (as timm's and mmengine's loaders do).

    A folder, a truncated file or one of another format is one line naming ``where`` and the
    file (ConfigError), not the reader's traceback."""
    from ..config import ConfigError
    if '://' in str(path):  # mmseg configs name released weights by URL; ds_seg reads local files only
        raise ConfigError(f'{where}: {path} is a URL; download the file and give its local path (or '
                          'pretrained=True for timm\'s own weights).')
    path = os.path.expanduser(str(path))  # '~/weights/x.pth' as written in a config
    if os.path.isdir(path):
        raise ConfigError(f'{where}: {path} is a folder; give the weights file in it (.pth, .pt, .bin or '
                          '.safetensors).')
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{where}: {path} does not exist.')
    try:
        if path.endswith('.safetensors'):
            from safetensors.torch import load_file
            payload = outside_partitioning(lambda: load_file(path))
        else:
            from ..engine.checkpoint import is_torch_file, not_torch_kind
            from ..inputs import looks_like_onnx
            with open(path, 'rb') as f:
                head = f.read(512)
            if not is_torch_file(head):  # a JSON or a config given by mistake: not "unsafe Python objects"
                kind = 'an ONNX model' if looks_like_onnx(path, head) else not_torch_kind(head)
                raise ConfigError(f'{where}: {path} is {kind}, not a weights file (.pth, .pt, .bin or .safetensors)')
            payload = outside_partitioning(lambda: _load_tensors_beside_inert_objects(path))
    except ConfigError:
        raise
    except pickle.UnpicklingError as exc:  # weights_only refused what no stand-in may replace
        why = re.search(r'(?:WeightsUnpickler error: )?((?:Unsupported|Trying to load unsupported|Trying to call|'
                        r'Can only create) .*)', str(exc))
        raise ConfigError(f'{where}: {path} holds Python objects other than tensors that are refused (loading '
                          f'them could run code: {(why.group(1) if why else str(exc))[:200]}). Save its '
                          'state_dict() alone, or convert it to .safetensors.') from exc
    except Exception as exc:  # torch's zip reader, safetensors' header check, EOF: truncated or not weights
        detail = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise ConfigError(f'{where}: {path} is not a readable weights file (truncated, or another format: '
                          f'{detail}); download it again.') from exc
    # 'teacher': DINO/iBOT training checkpoints hold student and teacher; the teacher is the model
    # they release and evaluate. timm's training checkpoints hold the EMA copy beside the raw
    # weights: taken first, as timm's own load_checkpoint does (use_ema=True).
    for key in ('state_dict_ema', 'model_ema', 'state_dict', 'model', 'module', 'teacher'):
        if isinstance(payload, dict) and isinstance(payload.get(key), dict):
            payload = payload[key]
    if not isinstance(payload, dict) or not payload or not all(isinstance(v, torch.Tensor) for v in payload.values()):
        keys = f' with keys {", ".join(map(str, list(payload)[:5]))}' if isinstance(payload, dict) else ''
        raise ConfigError(f'{where}: {path} holds no state dict of tensors (found {type(payload).__name__}{keys}).')
    if all(k.startswith('module.') for k in payload):
        payload = {k[len('module.'):]: v for k, v in payload.items()}
    return payload


def create_timm_model(name, **kwargs):
    """``timm.create_model(name, pretrained=False, **kwargs)`` with timm's refusals as one line
    naming ``model.backbone``: an unknown name (with close matches), or a model that cannot give
    what is asked (``features_only`` on a classifier timm has no feature wrapper for)."""
    import difflib

    import timm

    from ..config import ConfigError
    if isinstance(name, str) and name.startswith(('hf-hub:', 'hf_hub:', 'local-dir:')):
        raise ConfigError(f"model.backbone: {name!r} names weights on the Hugging Face hub (or in a folder), which "
                          "ds_seg does not fetch by name; give timm's architecture name as backbone (the hub repo's "
                          "config.json 'architecture') and the weights file as pretrained='path/to/model.safetensors'.")
    if not isinstance(name, str) or not timm.is_model(name):
        close = difflib.get_close_matches(str(name), timm.list_models(), n=3, cutoff=0.75)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ''
        raise ConfigError(f"model.backbone: timm has no model {name!r}.{hint} "
                          "List them with python -c \"import timm; print(timm.list_models('convnext*'))\".")
    # timm's own ways to load weights: ignored here (built with pretrained=False), so the model
    # trained from random weights without a word. Weights go through model.pretrained.
    own = [key for key in ('pretrained_cfg_overlay', 'pretrained_cfg', 'checkpoint_path', 'pretrained') if key in kwargs]
    if own:
        raise ConfigError(f"model.backbone_kwargs.{own[0]}: timm's own weight loading is not used by ds_seg; give the "
                          "weights as model.pretrained='path/to/file' (or pretrained=True for timm's default ones), "
                          "which checks the load and says what was taken.")
    def build():
        return timm.create_model(name, pretrained=False, **kwargs)
    try:
        # timm initialises layers after building them (init_weights over named_modules, named_apply):
        # built partitioned, those inits ran on empty tensors and did nothing (ZeRO-3 trained a
        # ResNet without its zeroed last BatchNorm per block, a ConvNeXt without its truncated normals).
        return built_whole(build)
    except RuntimeError as exc:  # e.g. "features_only not implemented for ..."
        if 'pretrained tag' in str(exc):   # 'resnet50.bogus': the advice below was about feature maps
            raise ConfigError(f"model.backbone: {name!r}: {str(exc).splitlines()[0]}; list the tags timm has with "
                              f"python -c \"import timm; print(timm.list_pretrained('{name.split('.')[0]}*'))\", "
                              "or give the name without a tag.") from exc
        raise ConfigError(f"model.backbone: timm cannot build {name!r} as an encoder here: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; "
                          "choose a backbone with feature maps (ResNet, ConvNeXt, Swin, EfficientNet, a ViT).") from exc


@contextlib.contextmanager
def _hub_offline_unless_reachable(host='huggingface.co'):
    """Where the hub's host name does not even resolve (no network), ask the hub for its local
    cache only: a cached file still loads, and a missing one fails at once instead of after
    huggingface_hub's retries (about a minute of 'Retrying in 8s')."""
    import socket

    from huggingface_hub import constants
    try:
        socket.getaddrinfo(host, 443)
        reachable = True
    except OSError:
        reachable = False
    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = previous or not reachable
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = previous


def timm_state_dict(name):
    """Download (or take from the cache) the default pretrained weights timm knows for ``name``,
    as a state dict, without building a model (so it also works while ZeRO-3 partitions)."""
    import timm

    from ..config import ConfigError
    cfg = timm.models.get_pretrained_cfg(name)
    # (A config with neither a hub id nor a URL was fetched from '' : "Is a directory" of the cache.)
    if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
        raise ValueError(f"pretrained=True: timm has no pretrained weights for {name!r} (list the models that have "
                         "some with timm.list_pretrained()); pass a file path.")
    if cfg.file and not (cfg.hf_hub_id or cfg.url):
        return read_state_dict(cfg.file, where=f'model.pretrained=True ({name!r})')
    source = f'https://huggingface.co/{cfg.hf_hub_id}' if cfg.hf_hub_id else cfg.url
    try:
        if cfg.hf_hub_id:
            from timm.models._hub import load_state_dict_from_hf
            with _hub_offline_unless_reachable():
                return outside_partitioning(lambda: load_state_dict_from_hf(cfg.hf_hub_id))
        return outside_partitioning(lambda: torch.hub.load_state_dict_from_url(cfg.url, map_location='cpu'))
    except Exception as exc:  # no network, a proxy, a server error: the hub's own words, then what to do
        detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)[:200]
        raise ConfigError(f"model.pretrained=True: could not fetch timm's weights for {name!r} from {source} "
                          f"({detail}); run once where there is network (they are cached), or download them and "
                          "give pretrained='path/to/the/file' (.safetensors or .pth).") from exc


# Tensors of a pretrained file that a segmentation backbone never uses and a load may drop: the
# classifier of the source model (timm's ``head``/``fc``/``classifier``, its pooling norm and
# attention pool) and DINOv2/iBOT's masked-image-modelling ``mask_token``. Anything else in the
# file that lands nowhere refuses the load: a silently dropped LayerScale, say, gives wrong
# features without a word.
CLASSIFIER_PREFIXES = ('head.', 'head_dist.', 'fc.', 'classifier.', 'last_linear.', 'fc_norm.',
                       'attn_pool.', 'pre_logits.', 'mask_token')


def _under_prefix(state, wanted, where='pretrained', source=None):
    """The tensors of ``state`` under the key prefix that holds the ``wanted`` keys, the prefix
    removed: ``backbone.`` of an mmseg/mmpretrain checkpoint, ``backbone.`` of DINO's teacher,
    ``encoder.``... Returns ``(state, prefix)``; ``prefix`` is None when the keys match as they are.
    The tensors outside the prefix (a decode head, a projection head) are other parts of the
    source network, which is what a prefix selects, as mmpretrain's ``init_cfg`` prefix does."""
    hits = sum(k in wanted for k in state)
    if hits == len(wanted):  # the usual case: every key found as it is
        return state, None
    prefixes = {'.'.join(k.split('.')[:depth]) + '.' for k in state for depth in (1, 2, 3) if k.count('.') > depth}
    found = {p: sum(k[len(p):] in wanted for k in state if k.startswith(p)) for p in prefixes}
    top = max(found.values(), default=0)
    if top <= hits:
        return state, None
    # Two full copies (DINOv2's student and teacher, a model and its EMA): the one a release
    # takes, never the first by name (student. sorted before teacher. and was loaded).
    tied = sorted(p for p, n in found.items() if n == top)
    ranked = sorted(tied, key=_copy_rank)
    if len(tied) > 1 and _copy_rank(ranked[0]) == _copy_rank(ranked[1]):
        from ..config import ConfigError
        named = f'{source} ' if isinstance(source, (str, os.PathLike)) else 'the weights '
        raise ConfigError(f"{where}: {named}holds the weights twice or more, under {', '.join(tied)}, and none "
                          "is a teacher or EMA copy; save the one to load on its own.")
    best = ranked[0]
    return {k[len(best):]: v for k, v in state.items() if k.startswith(best)}, best


def _copy_rank(prefix):
    """0 for a teacher or EMA copy (what DINO and timm release), 2 for a student, else 1."""
    words = set(re.split(r'[._]', prefix.lower()))
    return 0 if words & {'teacher', 'ema'} else 2 if 'student' in words else 1


def load_pretrained(module, source, rename=None, allow_missing=(), allow_unused=(), band_map=None,
                    input_key=None, pos_embed_prefix=1, pos_embed_grid=None, where='pretrained',
                    band_map_option='model.band_map', origin=None):
    """Copy the weights of ``source`` (a path or a state dict) into ``module``: exact or refused.

    The file's tensors under a prefix that holds the module's (``backbone.`` of an mmseg or
    mmpretrain checkpoint, DINO's ``teacher`` with ``backbone.``) are taken with it removed
    (:func:`_under_prefix`). ``rename`` maps a module key to the file's key (or None) when the
    layouts differ. Every tensor
    of the file must land in the module, except those under :data:`CLASSIFIER_PREFIXES` and
    ``allow_unused`` (prefixes, or a predicate on the file's key: parts the module was built
    without); module keys missing from the file
    raise unless they start with one of ``allow_missing`` (parts the source model does not have).
    Refusals name the tensors left over, and a shape mismatch names the tensor.

    A first-layer weight that differs only in input channels is adapted with
    :func:`adapt_input_weight`, or, with ``band_map`` (one entry per band of the data: the
    file's band index or None), by :func:`map_input_bands` on the file's ``input_key`` tensor. A
    position embedding of another grid is resized with timm's kernel (antialiased bicubic,
    :func:`resize_pos_embed`) after ``pos_embed_prefix`` class/register tokens, to a square
    grid or to ``pos_embed_grid``. A file of more than 3 bands on fewer data bands is refused
    without ``band_map``, naming ``band_map_option`` (None: the model takes none). Works on a model
    built partitioned by ZeRO-3 (parameters are gathered module by module).

    What was loaded and adapted is left in ``module.pretrained_report`` (one line; the trainer
    prints it): ``origin`` names the file where ``source`` is a state dict read from one.

    Example::

        load_pretrained(vit, 'weights/vit_base.pth', allow_missing=('neck.',))
    """
    from ..config import ConfigError
    if isinstance(source, (str, os.PathLike)):
        origin = origin or os.fspath(source)
    state = read_state_dict(source, where) if isinstance(source, (str, os.PathLike)) else dict(source)
    rename = rename or (lambda key: key)
    changes = []  # what the report says besides the count
    # The module's own names are taken too: a file saved from the module itself (a ds_seg
    # segmentor's backbone.model.stages_0...) holds them rather than the classifier's.
    own = set(module.state_dict())
    whole = state
    state, prefix = _under_prefix(state, ({rename(k) for k in own} | own) - {None}, where, source)
    if prefix:
        # Which part of the file was taken, and what was left: a whole-model export (its trained
        # decode_head) given as pretrained read as a complete load.
        left = {}
        for key in whole:
            if not key.startswith(prefix):
                part = key.split('.')[0] + '.'
                left[part] = left.get(part, 0) + 1
        changes.append(f'taken from under {prefix!r}' + (
            f", the file's {', '.join(f'{p} ({n})' for p, n in sorted(left.items()))} not used (load_from= "
            'starts from a whole model)' if left else ''))
    if band_map is not None:
        # A file of the module's own names (a ds_seg segmentor's stem_0.weight) for the
        # classifier's input_key (stem.0.weight).
        input_key = input_key if input_key in state else next(
            (k for k in own if rename(k) == input_key and k in state), input_key)
        if input_key not in state:
            raise ConfigError(f'{where}: band_map needs the first-layer weight {input_key!r}, which the '
                              'weights do not hold.')
        state[input_key] = map_input_bands(state[input_key], band_map, where=f'{where}: band_map')
        changes.append(f'first layer {input_key} mapped to the data bands by band_map {list(band_map)}')
    mapped, used = {}, set()
    for key in module.state_dict():
        src = rename(key)
        if src not in state and key in state:
            src = key
        if src in state:
            mapped[key] = state[src]
            used.add(src)
    droppable = allow_unused if callable(allow_unused) else (lambda key: key.startswith(tuple(allow_unused)))
    unused = sorted(k for k in state if k not in used and not k.startswith(CLASSIFIER_PREFIXES) and not droppable(k))
    if unused and not mapped:  # nothing of the file lands anywhere: another naming, not a few extra tensors
        example = next(k for k, v in module.state_dict().items())
        raise ConfigError(f"{where}: none of the weights' tensors match the model's (none matched: the file's keys "
                          f"look like {unused[0]!r}, the model's like {example!r}); give the file of this backbone.")
    if unused:
        raise ConfigError(f'{where}: {len(unused)} tensor(s) of the weights have no place in the model '
                          f'(refusing to drop them silently): {", ".join(unused[:8])}'
                          f'{" ..." if len(unused) > 8 else ""}. Check that the file matches the model '
                          'architecture (LayerScale, register tokens, depth).')

    # Only the layer that takes the image's bands can differ in input channels: a grouped conv
    # deeper in (a depthwise [C, 1, 3, 3] against [C, 8, 3, 3]) is another architecture.
    # input_key is the file's name for it: the module's may differ (timm's features_only wrapper).
    first_conv = input_key if input_key in mapped else next(
        (k for k in mapped if input_key is not None and rename(k) == input_key), None) or next(
        (n for n, p in module.named_parameters() if len(getattr(p, 'ds_shape', p.shape)) == 4), None)

    def adapt(key, tensor, shape):
        if key == first_conv and tensor.dim() == 4 and tensor.shape[0] == shape[0] and tensor.shape[2:] == shape[2:]:
            if tensor.shape[1] not in (1, 3) and shape[1] != tensor.shape[1]:
                # Which of a multispectral file's bands the data holds cannot be guessed: their
                # mean filter for every band threw the colour information away without a word,
                # and on more data bands (a 6-band HLS file on 13-band Sentinel-2) its filters went
                # to the first data bands by position. Only RGB (and grey) weights adapt by rule.
                how = (f"say which file band each data band is: {band_map_option}=[...] ({shape[1]} file band "
                       "indices from 0, or None)" if band_map_option else
                       f"this model takes no band_map: give a file of RGB or {shape[1]}-band weights")
                raise ConfigError(f"{where}: the weights' first layer {key} takes {tensor.shape[1]} bands, the "
                                  f"data has {shape[1]}; {how}.")
            if tensor.shape[1] != shape[1]:
                changes.append(f'first layer {key} adapted from {tensor.shape[1]} to {shape[1]} band(s) '
                               + (f'(its filters kept on data band{"s 1-" if tensor.shape[1] > 1 else " "}{tensor.shape[1]}, each further band their mean; '
                                  f'{band_map_option or "band_map"} for data in another band order)'
                                  if shape[1] > tensor.shape[1]
                                  else '(the mean filter of its bands)'))
            return adapt_input_weight(tensor.float(), shape[1]).to(tensor.dtype)
        if key.endswith('pos_embed') and tensor.dim() == 3 and tensor.shape[-1] == shape[-1]:
            grid = tensor.shape[1] - pos_embed_prefix
            if grid < 1 or round(grid ** 0.5) ** 2 != grid:
                # Positions of another token layout (a class token, registers) than the model's:
                # timm's resize failed with "shape '[1, 37, 37, -1]' is invalid".
                raise ConfigError(f"{where}: {key} holds {tensor.shape[1]} positions in the weights, which after "
                                  f"the model's {pos_embed_prefix} class/register position(s) are no square grid: "
                                  "the file is of a variant with another token layout (with or without a class "
                                  "token, registers); give the file of this model.")
            if tensor.shape[1] != shape[1]:
                changes.append(f'{key} resized from {tensor.shape[1]} to {shape[1]} positions')
            return resize_pos_embed(tensor, shape[1], num_prefix=pos_embed_prefix, grid=pos_embed_grid)
        if key.endswith('.relative_position_bias_table') and tensor.dim() == 2 and tensor.shape[1] == shape[1]:
            # Swin at another img_size: a stage whose grid is smaller than the 7-px window gets a
            # smaller window, and its table of relative positions another size (timm's own
            # pretrained load resizes it the same way; ds_seg refused the file).
            window = getattr(module.get_submodule(key[:-len('.relative_position_bias_table')]), 'window_size', None)
            if window is not None:
                from timm.layers import resize_rel_pos_bias_table
                tables.append(key)
                return resize_rel_pos_bias_table(tensor, new_window_size=tuple(window), new_bias_shape=tuple(shape))
        raise ConfigError(f'{where}: {key} has shape {tuple(tensor.shape)} in the weights but '
                          f'{tuple(shape)} in the model.')

    tables = []
    missing, _ = load_state_dict_into(module, mapped, adapt=adapt)
    if tables:
        changes.append(f"{len(tables)} relative-position table(s) resized to their windows at this img_size "
                       f"({tables[0]}...)")
    missing = [k for k in missing if not k.endswith('num_batches_tracked') and not k.startswith(tuple(allow_missing))]
    if missing:
        # Where nothing matched at all the file's keys carry another prefix ('backbone.' of an
        # mmseg/mmpretrain checkpoint, 'encoder.'...): show one beside the model's.
        hint = '' if mapped else f" (none matched: the file's keys look like {next(iter(state))!r})"
        raise ConfigError(f'{where}: the weights lack {len(missing)} tensor(s) of the model, '
                          f'e.g. {missing[:5]}{hint}.')
    fresh = [k for k in module.state_dict() if k not in mapped and not k.endswith('num_batches_tracked')]
    module.pretrained_report = (
        f"{where}: {len(mapped)} tensors loaded{f' from {origin}' if origin else ''}"
        + (f"; {len(fresh)} start fresh ({', '.join(sorted({k.split('.')[0] for k in fresh}))})" if fresh else '')
        + ''.join(f'; {change}' for change in changes))


def check_band_map(band_map, in_channels, pretrained, name):
    """``model.band_map`` before anything is built: one entry per band of the data, and a
    pretrained file for it to map. Of another length the mapped weight was then adapted to
    in_channels like an RGB one: a band map meant for the data silently became something else."""
    from ..config import ConfigError
    if band_map is None:
        return
    if not isinstance(band_map, (list, tuple)) or len(band_map) != in_channels:
        entries = len(band_map) if isinstance(band_map, (list, tuple)) else 'no'
        raise ConfigError(f'model.band_map: {band_map!r} has {entries} entries for in_channels={in_channels}; '
                          'give one file band index (or None) per band of the data.')
    if not pretrained:
        raise ConfigError(f'{name}: band_map maps the bands of a pretrained file; give pretrained= too.')


def map_input_bands(weight_OIhw, band_map, where='band_map'):
    """A first-layer weight for the data's bands from a multispectral checkpoint's: data band ``j``
    takes the file's filter ``band_map[j]``; a band mapped to None gets the mean filter of the
    file's bands, and then every filter is scaled by ``file bands / data bands``, as
    :func:`adapt_input_weight` does for extra bands (``[0, 1, 2, None]`` on RGB weights is what no
    band_map gives): unscaled, twelve Sentinel-2 bands on RGB weights summed four times the
    first layer's pretrained response. A map of the file's bands only (a selection, a new order)
    keeps its filters as they are: the data seen as the file's sensor would, its other bands dark.

    Example::

        # Prithvi-like 6-band HLS weights (B, G, R, NIR, SWIR1, SWIR2) on R, G, B, NIR data
        w = map_input_bands(w6, [2, 1, 0, 3])          # [O, 6, p, p] -> [O, 4, p, p]
    """
    from ..config import ConfigError
    source = weight_OIhw.shape[1]
    bad = [b for b in band_map if b is not None and not (isinstance(b, int) and not isinstance(b, bool)
                                                         and 0 <= b < source)]
    if bad:
        raise ConfigError(f'{where}: {bad} are not band indices of the weights (0..{source - 1}); give one '
                          'file band index (or None) per band of the data.')
    mean = weight_OIhw.mean(dim=1)
    mapped = torch.stack([weight_OIhw[:, b] if b is not None else mean for b in band_map], dim=1)
    return mapped * (source / len(band_map)) if None in band_map else mapped


def resize_pos_embed(pos_embed_1ND, num_tokens, num_prefix=1, grid=None):
    """Resize a grid of position embeddings (after ``num_prefix`` class/register tokens) to
    ``num_tokens`` tokens in all (a square grid unless ``grid=(h, w)``), with timm's own kernel
    (``timm.layers.resample_abs_pos_embed``: antialiased bicubic), so a model loaded at another
    size equals the timm model built at that size."""
    from timm.layers import resample_abs_pos_embed
    if grid is None:
        side = int(round((num_tokens - num_prefix) ** 0.5))
        grid = (side, side)
    return resample_abs_pos_embed(pos_embed_1ND, new_size=list(grid), num_prefix_tokens=num_prefix)


# How to see, module by module, the full value of parameters that are partitioned as they are
# built (ZeRO-3), and how to build a third-party model whole before it is partitioned. The engine
# sets them while it constructs a model (ds_seg.engine.backend); models never import the engine,
# and with nothing set the parameters are plain tensors.
_gather_partitioned = [None]
_build_whole = [None]


@contextlib.contextmanager
def gathering_with(gather, build_whole=None):
    """Within the block, :func:`load_state_dict_into` gathers each module's parameters with
    ``gather(params)`` (a context manager that makes them whole and re-partitions on exit), and
    :func:`create_timm_model` builds through ``build_whole(build)`` (the module ``build()`` makes,
    built with whole parameters and partitioned after)."""
    previous = _gather_partitioned[0], _build_whole[0]
    _gather_partitioned[0], _build_whole[0] = gather, build_whole
    try:
        yield
    finally:
        _gather_partitioned[0], _build_whole[0] = previous


def built_whole(build, partition=True):
    """The module ``build()`` makes, built with whole parameters where the engine builds the model
    partitioned (ZeRO-3), and partitioned after unless ``partition`` is False (a model built on the
    meta device only to be looked at). Without an engine hook, ``build()``."""
    hook = _build_whole[0]
    return build() if hook is None else hook(build, partition=partition)


def outside_partitioning(read):
    """``read()`` with the engine's partitioning construction off: a weights file read inside
    ZeRO-3's zero.Init under a 16-bit config came back as its fp32 bytes taken for 16-bit values
    (a BatchNorm weight of ones read as [0, 1, 0, ...], NaN losses from the first step)."""
    return built_whole(read, partition=False)


def load_state_dict_into(model, state_dict, adapt=None, gather=None):
    """``model.load_state_dict(state_dict, strict=False)`` that also works on a model whose
    parameters are partitioned: module by module, only that module's own parameters are gathered
    (peak memory is the largest single module, not the model), filled, and re-partitioned.

    Every rank must call it when parameters are partitioned (the gathers are collectives).
    ``adapt(key, tensor, shape)`` may return a tensor of the model's shape for a mismatching one,
    None to keep the model's own (freshly initialised) tensor, or raise. ``gather`` defaults to the one set by :func:`gathering_with`. Returns
    ``(missing, unexpected)`` key lists.

    Example::

        missing, unexpected = load_state_dict_into(model, torch.load('weights.pt')['state_dict'])
    """
    gather = gather or _gather_partitioned[0]
    expected = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            prefix = f'{prefix}.' if prefix else ''
            params = list(module.parameters(recurse=False))
            with (gather(params) if gather is not None and params else contextlib.nullcontext()):
                named = list(module.named_parameters(recurse=False)) + [
                    (n, b) for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set]
                for name, tensor in named:
                    key = prefix + name
                    expected.add(key)
                    if key not in state_dict:
                        continue
                    value = state_dict[key]
                    if value.shape != tensor.shape:
                        if adapt is None:
                            raise ValueError(f'{key}: shape {tuple(value.shape)} in the weights, '
                                             f'{tuple(tensor.shape)} in the model.')
                        value = adapt(key, value, tensor.shape)
                        if value is None:
                            continue
                    tensor.copy_(value.to(tensor.dtype))
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    return missing, unexpected
