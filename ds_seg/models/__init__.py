"""Models and losses. Every module that registers into MODELS or LOSSES is imported here, so a
registry lookup can never fail because its file was not imported."""
from .losses import CrossEntropyLoss, DiceLoss
from .unet import UNet, UNetTiny

__all__ = ['CrossEntropyLoss', 'DiceLoss', 'UNet', 'UNetTiny']
