"""Encoders: each returns a list of feature maps and exposes ``out_channels``, ``strides`` and
``size_divisor`` (the input multiple it needs; the segmentor pads to it)."""
from .mit import MixTransformer
from .timm_backbone import TimmBackbone
from .timm_vit import TimmViT
from .vit import ViT

__all__ = ['MixTransformer', 'TimmBackbone', 'TimmViT', 'ViT']
