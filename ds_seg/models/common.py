"""Parts shared by every model of the zoo: the backbone and head registries, conv blocks,
per-block activation checkpointing and resizing.

Backbones and heads have their own registries (not MODELS) so that MODELS, and the model-facts
table built from it, lists only complete segmentation models.

Example::

    from ds_seg.models.common import BACKBONES, HEADS
    from ds_seg.registry import build
    encoder = build(BACKBONES, dict(type='ViT', variant='vit_small'))
    encoder.out_channels, encoder.strides        # ([384] * 4, [4, 8, 16, 32])
"""
import functools

import torch
import torch.nn.functional as F
from mmengine.registry import Registry
from torch import nn
from torch.utils.checkpoint import checkpoint

# The BatchNorm-safe recomputation context of the UNet, shared so every model checkpoints alike.
from .unet import _checkpoint_context

BACKBONES = Registry('backbone', scope='ds_seg')
HEADS = Registry('head', scope='ds_seg')


def run_block(block, *inputs, checkpointing=False):
    """``block(*inputs)``, recomputed in backward (non-reentrant, BN statistics updated once) when
    ``checkpointing`` and the block is training with grad enabled."""
    if checkpointing and block.training and torch.is_grad_enabled():
        return checkpoint(block, *inputs, use_reentrant=False,
                          context_fn=functools.partial(_checkpoint_context, block))
    return block(*inputs)


def meta_device():
    """``torch.device('meta')``, to build a model without memory or weights, with torch._dynamo
    imported first: torch 2.8 could not import it under the meta device, and timm imports it, so
    every timm model's first build there was a circular-import AttributeError. (timm itself, 1-2 s
    of a process's start, is left to the models that use it.)

    Example::

        with meta_device():
            model = build(MODELS, cfg)
    """
    import torch._dynamo  # noqa: F401
    return torch.device('meta')


def resize(x_BCHW, size):
    # Under export the shortcut would bake the traced sizes' equality into the graph.
    if not torch.compiler.is_exporting() and tuple(x_BCHW.shape[-2:]) == tuple(size):
        return x_BCHW
    return F.interpolate(x_BCHW, size=size, mode='bilinear', align_corners=False)


class ConvBNReLU(nn.Sequential):
    """conv (no bias: BN shifts) -> BatchNorm -> ReLU, or conv with bias -> ReLU when ``norm`` is
    False (for 1x1 pooled maps, where BatchNorm over a batch of one has no statistics)."""

    def __init__(self, in_channels, out_channels, kernel_size=1, dilation=1, norm=True):
        padding = dilation * (kernel_size // 2)
        layers = [nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, dilation=dilation,
                            bias=not norm)]
        if norm:
            layers.append(nn.BatchNorm2d(out_channels))
        layers.append(nn.ReLU(inplace=True))
        super().__init__(*layers)


class TruncNormalLinear(nn.Linear):
    """Linear with the transformer initialisation (truncated normal, std 0.02; zero bias).

    The initialisation lives in ``reset_parameters`` so it runs inside the layer's own
    constructor: a parent that re-initialises its children afterwards would write into empty
    tensors when the model is built partitioned (ZeRO-3), and silently keep the default init.
    """

    def reset_parameters(self):
        nn.init.trunc_normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class DropPath(nn.Module):
    """Stochastic depth: drop the residual branch per sample with probability ``p`` in training."""

    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


def linspace(end, steps):
    """Stochastic-depth rates 0..end as Python floats (works while building on the meta device)."""
    return [end * i / max(1, steps - 1) for i in range(steps)]


def num_params(module):
    """Parameters of ``module`` (the model zoo's tests compare them with published counts)."""
    return sum(p.numel() for p in module.parameters())
