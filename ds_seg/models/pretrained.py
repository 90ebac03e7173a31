"""Pretrained weights for backbones: from a local file, or through timm when asked and reachable,
with first layers adapted to any band count rather than dropped.

Example::

    backbone = build(BACKBONES, dict(type='TimmBackbone', name='resnet50', in_channels=4,
                                     pretrained='weights/resnet50.safetensors'))
"""
import os

import torch
import torch.nn.functional as F


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


def read_state_dict(path):
    """A state dict from ``.pth``/``.pt``/``.bin``/``.safetensors``; unwraps ``state_dict``/``model``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f'pretrained: {path} does not exist.')
    if path.endswith('.safetensors'):
        from safetensors.torch import load_file
        return load_file(path)
    payload = torch.load(path, map_location='cpu', weights_only=True)
    for key in ('state_dict', 'model', 'module'):
        if isinstance(payload, dict) and isinstance(payload.get(key), dict):
            payload = payload[key]
    return payload


def timm_state_dict(name):
    """Download (or take from the cache) the default pretrained weights timm knows for ``name``,
    as a state dict, without building a model (so it also works while ZeRO-3 partitions)."""
    import timm
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None:
        raise ValueError(f"pretrained=True: timm has no pretrained weights for {name!r}; pass a file path.")
    if cfg.hf_hub_id:
        from timm.models._hub import load_state_dict_from_hf
        return load_state_dict_from_hf(cfg.hf_hub_id)
    return torch.hub.load_state_dict_from_url(cfg.url, map_location='cpu')


def load_pretrained(module, source, rename=None, allow_missing=(), where='pretrained'):
    """Copy the weights of ``source`` (a path or a state dict) into ``module``.

    ``rename`` maps a module key to the file's key (or None) when the layouts differ. A tensor
    that differs only in input channels (dim 1) is adapted with :func:`adapt_input_weight`; a
    ViT position embedding of another grid is resized. Keys of the file the module does not have
    (a classifier) are ignored; module keys missing from the file raise unless they start with
    one of ``allow_missing`` (parts the source model does not have). Works on a model built
    partitioned by ZeRO-3 (parameters are gathered module by module).
    """
    state = read_state_dict(source) if isinstance(source, (str, os.PathLike)) else source
    rename = rename or (lambda key: key)
    mapped = {}
    for key in module.state_dict():
        src = rename(key)
        if src in state:
            mapped[key] = state[src]

    def adapt(key, tensor, shape):
        if tensor.dim() == 4 and tensor.shape[0] == shape[0] and tensor.shape[2:] == shape[2:]:
            return adapt_input_weight(tensor.float(), shape[1]).to(tensor.dtype)
        if key.endswith('pos_embed') and tensor.dim() == 3 and tensor.shape[-1] == shape[-1]:
            return resize_pos_embed(tensor, shape[1])
        raise ValueError(f'{where}: {key} has shape {tuple(tensor.shape)} in the weights but '
                         f'{tuple(shape)} in the model.')

    # The per-module loader of the DeepSpeed backend also serves unpartitioned models.
    from ds_seg.engine.deepspeed_backend import load_state_dict_gathered
    missing, _ = load_state_dict_gathered(module, mapped, adapt=adapt)
    missing = [k for k in missing if not k.endswith('num_batches_tracked') and not k.startswith(tuple(allow_missing))]
    if missing:
        raise ValueError(f'{where}: the weights lack {len(missing)} tensor(s) of the model, '
                         f'e.g. {missing[:5]}.')


def resize_pos_embed(pos_embed_1ND, num_tokens, num_prefix=1):
    """Bicubically resize a square grid of position embeddings (after ``num_prefix`` class
    tokens) to ``num_tokens`` tokens in all."""
    prefix, grid = pos_embed_1ND[:, :num_prefix], pos_embed_1ND[:, num_prefix:]
    old, new = int(round(grid.shape[1] ** 0.5)), int(round((num_tokens - num_prefix) ** 0.5))
    grid = grid.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(new, new), mode='bicubic', align_corners=False)
    return torch.cat([prefix, grid.permute(0, 2, 3, 1).reshape(1, new * new, -1).to(prefix.dtype)], dim=1)
