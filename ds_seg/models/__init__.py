"""Models and losses. Every module that registers into MODELS or LOSSES is imported here, so a
registry lookup can never fail because its file was not imported."""
from .losses import (CombinedLoss, CrossEntropyLoss, DiceLoss, FocalLoss, LovaszLoss, OhemCrossEntropyLoss,
                     segmentation_loss)
from .unet import UNet, UNetTiny
from . import backbones, heads  # noqa: F401,E402  (register BACKBONES and HEADS)
from .segmentor import (FPN, DeepLabV3Plus, DeepLabV3PlusTiny, FPNTiny, SegFormer, SegFormerTiny, Segmentor,
                        UperNet, UperNetTiny, UperNetViT, UperNetViTTiny)
from .temporal import TinyTemporalSegFormer, TemporalSegmentor  # noqa: E402

__all__ = ['CombinedLoss', 'CrossEntropyLoss', 'DiceLoss', 'FocalLoss', 'LovaszLoss', 'OhemCrossEntropyLoss',
           'segmentation_loss',
           'UNet', 'UNetTiny', 'Segmentor', 'SegFormer', 'SegFormerTiny', 'UperNetViT', 'UperNetViTTiny',
           'UperNet', 'UperNetTiny', 'FPN', 'FPNTiny', 'DeepLabV3Plus', 'DeepLabV3PlusTiny']
