"""Inputs of any size through encoders that need a multiple (mmseg's ``size_divisor``): pad at the
bottom and right, run, crop the logits back, so every pixel, the last row and column included,
reaches them and the logits are at the input's resolution.

Example::

    images_BCHW, pad_h, pad_w = pad_to_multiple(images_BCHW, 32)
    logits_BKHW = crop_padding(model(images_BCHW), pad_h, pad_w)
"""
import torch
import torch.nn.functional as F


def pad_to_multiple(images_BCHW, divisor):
    """``(padded, pad_h, pad_w)``: zero rows/columns at the bottom/right up to a multiple of
    ``divisor``. An exported graph always pads (by 0 at a multiple), so it stays exact at every size."""
    H, W = images_BCHW.shape[-2:]
    pad_h, pad_w = -H % divisor, -W % divisor
    if torch.compiler.is_exporting() or pad_h or pad_w:
        images_BCHW = F.pad(images_BCHW, (0, pad_w, 0, pad_h))
    return images_BCHW, pad_h, pad_w


def crop_padding(x_BKHW, pad_h, pad_w):
    """Drop the padded bottom rows and right columns. Exported, as a negative pad: a slice's
    "is it the whole dimension" check would bind the graph to the traced size's divisibility."""
    if torch.compiler.is_exporting():
        return F.pad(x_BKHW, (0, -pad_w, 0, -pad_h))
    return x_BKHW[..., :x_BKHW.shape[-2] - pad_h, :x_BKHW.shape[-1] - pad_w]
