"""Decode heads (``head(features) -> logits``), registered in HEADS."""
from .decoders import DeepLabV3PlusHead, FCNHead, FPNHead, SegFormerHead, UperHead

__all__ = ['DeepLabV3PlusHead', 'FCNHead', 'FPNHead', 'SegFormerHead', 'UperHead']
