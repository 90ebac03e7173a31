"""Encoder-decoder segmentors, and the zoo built from them: SegFormer, UperNet-ViT, UperNet / FPN
/ DeepLabV3+ over timm backbones, each with a tiny variant registered next to it.

Shape legend: B batch, C channels, K classes, H/W height/width.

Every registered model is ``model(images_BCHW) -> logits_BKHW`` at the input's H, W. With an
auxiliary head, training mode returns ``{'logits': logits_BKHW, 'aux': [(weight, aux_BKHW)]}``
instead; :func:`ds_seg.models.losses.segmentation_loss` adds the weighted auxiliary losses.
A registered model may carry ``variants`` (label -> kwargs): the presets ``launch/models.py``
lists.
"""
from torch import nn

from ..registry import MODELS, build
from .common import BACKBONES, HEADS, resize
from .padding import crop_padding, pad_to_multiple


@MODELS.register_module()
class Segmentor(nn.Module):
    """``backbone -> decode_head (-> aux_head in training) -> logits at the input size``.

    ``backbone`` and heads are ``dict(type=..., ...)`` configs of BACKBONES/HEADS (or modules);
    ``in_channels`` and ``activation_checkpointing`` are passed to the backbone, the encoder's
    ``out_channels`` and ``num_classes`` to the heads. ``aux_head`` may carry ``loss_weight``.

    Example::

        model = Segmentor(backbone=dict(type='TimmBackbone', name='convnext_tiny'),
                          decode_head=dict(type='UperHead', channels=256),
                          aux_head=dict(type='FCNHead', in_index=2, loss_weight=0.4),
                          in_channels=4, num_classes=6)
        logits_BKHW = model.eval()(torch.randn(1, 4, 250, 250))     # [1, 6, 250, 250]
    """

    def __init__(self, backbone, decode_head, aux_head=None, in_channels=3, num_classes=6,
                 activation_checkpointing=False):
        super().__init__()
        from ..config import checked_number
        # A float, a string or 0 failed deep in a head's conv (or only at the first forward).
        self.in_channels = int(checked_number('model', 'in_channels', in_channels, low=1, integer=True))
        self.num_classes = int(checked_number('model', 'num_classes', num_classes, low=1, integer=True))
        self.backbone = backbone if isinstance(backbone, nn.Module) else build(
            BACKBONES, backbone, where='model.backbone', in_channels=in_channels,
            activation_checkpointing=activation_checkpointing)
        channels = list(self.backbone.out_channels)
        self.decode_head = self._head(decode_head, channels, 'model.decode_head')
        self.aux_weight = None
        self.aux_head = None
        if aux_head is not None:
            aux_head = dict(aux_head)
            # Checked as a loss's: a negative weight ascended the aux loss, 1e999 trained on inf.
            self.aux_weight = float(checked_number('model.aux_head', 'loss_weight', aux_head.pop('loss_weight', 0.4)))
            self.aux_head = self._head(aux_head, channels, 'model.aux_head')

    def _head(self, cfg, channels, where):
        if isinstance(cfg, nn.Module):
            return cfg
        return build(HEADS, cfg, where=where, in_channels=channels, num_classes=self.num_classes)

    def forward(self, images_BCHW):
        # Pad bottom/right to the encoder's multiple and crop the logits back: exact at any size.
        images_BCHW, pad_h, pad_w = pad_to_multiple(images_BCHW, getattr(self.backbone, 'size_divisor', 1))
        size = images_BCHW.shape[-2:]
        features = self.backbone(images_BCHW)
        logits_BKHW = crop_padding(resize(self.decode_head(features), size), pad_h, pad_w)
        if self.aux_head is None or not self.training:
            return logits_BKHW
        aux_BKHW = crop_padding(resize(self.aux_head(features), size), pad_h, pad_w)
        return {'logits': logits_BKHW, 'aux': [(self.aux_weight, aux_BKHW)]}


def _aux(aux_head, in_index=-2, channels=256):
    if aux_head is True:
        return dict(type='FCNHead', in_index=in_index, channels=channels, loss_weight=0.4)
    return aux_head or None


# -- SegFormer ------------------------------------------------------------------------------
@MODELS.register_module()
def SegFormer(variant='mit_b0', in_channels=3, num_classes=6, head_channels=None, aux_head=False,
              drop_path_rate=0.1, pretrained=None, activation_checkpointing=False):
    """SegFormer: Mix Transformer ``mit_b0``..``mit_b5`` + all-MLP head (256 ch for B0/B1, else 768).

    Example: ``build(MODELS, dict(type='SegFormer', variant='mit_b2', in_channels=4, num_classes=6))``
    """
    head_channels = head_channels or (256 if variant in ('mit_b0', 'mit_b1') else 768)
    return Segmentor(
        backbone=dict(type='MixTransformer', variant=variant, drop_path_rate=drop_path_rate, pretrained=pretrained),
        decode_head=dict(type='SegFormerHead', channels=head_channels),
        aux_head=_aux(aux_head), in_channels=in_channels, num_classes=num_classes,
        activation_checkpointing=activation_checkpointing)


SegFormer.variants = {f'mit_b{i}': dict(variant=f'mit_b{i}') for i in range(6)}


@MODELS.register_module()
def SegFormerTiny(in_channels=3, num_classes=6, aux_head=False, activation_checkpointing=False):
    """A SegFormer for CPU tests (4 stages of one block, 8-48 channels, ~90 k parameters)."""
    return Segmentor(
        backbone=dict(type='MixTransformer', variant='mit_tiny_test', drop_path_rate=0.0),
        decode_head=dict(type='SegFormerHead', channels=32),
        aux_head=_aux(aux_head, channels=16), in_channels=in_channels, num_classes=num_classes,
        activation_checkpointing=activation_checkpointing)


# -- UperNet over a plain ViT -----------------------------------------------------------------
@MODELS.register_module()
def UperNetViT(variant='vit_base', in_channels=3, num_classes=6, img_size=512, patch_size=16, embed_dim=None,
               depth=None, num_heads=None, mlp_ratio=None, channels=512, aux_head=True, drop_path_rate=0.1,
               pretrained=None, activation_checkpointing=False):
    """UperNet over a plain ViT (``vit_small`` ... ``vit_giant``, or any depth/width).

    Example: ``build(MODELS, dict(type='UperNetViT', variant='vit_large', in_channels=4))``;
    ``dict(type='UperNetViT', embed_dim=2048, depth=48, num_heads=32)`` is a 2.5 B model.
    """
    return Segmentor(
        backbone=dict(type='ViT', variant=variant, img_size=img_size, patch_size=patch_size, embed_dim=embed_dim,
                      depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate,
                      pretrained=pretrained),
        decode_head=dict(type='UperHead', channels=channels),
        aux_head=_aux(aux_head), in_channels=in_channels, num_classes=num_classes,
        activation_checkpointing=activation_checkpointing)


UperNetViT.variants = {v: dict(variant=v) for v in ('vit_small', 'vit_base', 'vit_large', 'vit_huge', 'vit_giant')}


@MODELS.register_module()
def UperNetViTTiny(in_channels=3, num_classes=6, aux_head=True, activation_checkpointing=False):
    """A UperNet-ViT for CPU tests (width 32, depth 4, patch 8, 32-channel head)."""
    return Segmentor(
        backbone=dict(type='ViT', variant='vit_tiny_test', img_size=64, patch_size=8),
        decode_head=dict(type='UperHead', channels=32),
        aux_head=_aux(aux_head, channels=16), in_channels=in_channels, num_classes=num_classes,
        activation_checkpointing=activation_checkpointing)


# -- heads over timm backbones ----------------------------------------------------------------
def _timm(backbone, pretrained, img_size=None, band_map=None, backbone_kwargs=None, **kwargs):
    """The backbone config for timm model ``backbone``: a plain ViT (ViT, DeiT, DINOv2, EVA...)
    becomes a TimmViT (blocks + simple pyramid, strides 4-32), anything else a features_only
    TimmBackbone. ``img_size`` and ``backbone_kwargs`` go to ``timm.create_model``."""
    from ..config import ConfigError
    from .backbones.timm_vit import is_plain_vit
    if not isinstance(backbone, str):  # an mmseg-style dict(type='ResNet', depth=50): a KeyError deep in timm
        raise ConfigError(f"model.backbone: a timm model name ('resnet50', 'convnext_tiny', "
                          f"'vit_base_patch16_224'...), got {backbone!r}; give the backbone's settings in "
                          "model.backbone_kwargs.")
    extra = dict(backbone_kwargs or {})
    if img_size is not None:
        extra['img_size'] = img_size
    if is_plain_vit(backbone):
        if kwargs.get('levels') == 'low_high':  # DeepLabV3+'s ASPP on a ViT's pooled map, its dilations unused
            raise ConfigError(f"model.backbone: DeepLabV3Plus dilates a CNN to output_stride 8 or 16; {backbone!r} "
                              "is a ViT of one stride: use UperNet or FPN over it, or a ResNet here.")
        return dict(type='TimmViT', name=backbone, pretrained=pretrained, band_map=band_map, **extra)
    return dict(type='TimmBackbone', name=backbone, pretrained=pretrained, band_map=band_map, **kwargs, **extra)


@MODELS.register_module()
def UperNet(backbone='convnext_tiny', in_channels=3, num_classes=6, channels=512, aux_head=True,
            pretrained=False, img_size=None, band_map=None, backbone_kwargs=None, activation_checkpointing=False):
    """UperNet over any timm backbone with four stages (ConvNeXt, Swin, ResNet...) or any timm
    ViT (ViT, DeiT-3, DINOv2 with registers, EVA-02...: blocks + a simple pyramid).

    ``img_size`` (Swin's window grid, a ViT's position-embedding grid) and ``backbone_kwargs``
    pass through to ``timm.create_model``; ``band_map`` maps a multispectral checkpoint's
    bands onto the data's (:class:`~ds_seg.models.backbones.TimmViT`).

    Example: ``build(MODELS, dict(type='UperNet', backbone='vit_large_patch14_reg4_dinov2',
    pretrained='weights/dinov2_vitl14_reg4.pth'))``
    """
    return Segmentor(backbone=_timm(backbone, pretrained, img_size, band_map, backbone_kwargs, levels='pyramid'),
                     decode_head=dict(type='UperHead', channels=channels), aux_head=_aux(aux_head),
                     in_channels=in_channels, num_classes=num_classes,
                     activation_checkpointing=activation_checkpointing)


UperNet.variants = {b: dict(backbone=b) for b in ('convnext_tiny', 'convnext_base', 'resnet50')}


@MODELS.register_module()
def UperNetTiny(in_channels=3, num_classes=6, aux_head=True, activation_checkpointing=False):
    """UperNet over timm's ``test_convnext`` (0.2 M) for CPU tests."""
    return Segmentor(backbone=_timm('test_convnext', False), decode_head=dict(type='UperHead', channels=32),
                     aux_head=_aux(aux_head, channels=16), in_channels=in_channels, num_classes=num_classes,
                     activation_checkpointing=activation_checkpointing)


@MODELS.register_module()
def FPN(backbone='resnet50', in_channels=3, num_classes=6, channels=256, aux_head=False, pretrained=False,
        img_size=None, band_map=None, backbone_kwargs=None, activation_checkpointing=False):
    """Semantic FPN over a timm backbone or timm ViT (strides 4-32; arguments as :func:`UperNet`).

    Example: ``build(MODELS, dict(type='FPN', backbone='efficientnet_b3', in_channels=13))``
    """
    return Segmentor(backbone=_timm(backbone, pretrained, img_size, band_map, backbone_kwargs, levels='pyramid'),
                     decode_head=dict(type='FPNHead', channels=channels), aux_head=_aux(aux_head),
                     in_channels=in_channels, num_classes=num_classes,
                     activation_checkpointing=activation_checkpointing)


FPN.variants = {b: dict(backbone=b) for b in ('resnet50', 'efficientnet_b3')}


@MODELS.register_module()
def FPNTiny(in_channels=3, num_classes=6, aux_head=False, activation_checkpointing=False):
    """Semantic FPN over timm's ``test_resnet`` for CPU tests."""
    return Segmentor(backbone=_timm('test_resnet', False, levels='pyramid'),
                     decode_head=dict(type='FPNHead', channels=32, segmentation_channels=16),
                     aux_head=_aux(aux_head, channels=16), in_channels=in_channels, num_classes=num_classes,
                     activation_checkpointing=activation_checkpointing)


@MODELS.register_module()
def DeepLabV3Plus(backbone='resnet50', in_channels=3, num_classes=6, output_stride=16, channels=256,
                  aux_head=False, pretrained=False, band_map=None, activation_checkpointing=False):
    """DeepLabV3+ over a dilated timm ResNet (``resnet50``/``resnet101``), output stride 16 or 8.
    ``band_map`` maps a multispectral pretrained file's bands onto the data's (as :func:`UperNet`).

    Example: ``build(MODELS, dict(type='DeepLabV3Plus', backbone='resnet101', output_stride=8))``
    """
    if output_stride not in (8, 16) or isinstance(output_stride, bool):  # 32 got OS8's dilations, 4 a bare assert
        from ..config import ConfigError
        raise ConfigError(f"model.output_stride must be 8 or 16 (the ASPP dilations are set for those), "
                          f"got {output_stride!r}")
    dilations = (6, 12, 18) if output_stride == 16 else (12, 24, 36)
    return Segmentor(backbone=_timm(backbone, pretrained, band_map=band_map, levels='low_high',
                                    output_stride=output_stride),
                     decode_head=dict(type='DeepLabV3PlusHead', channels=channels, dilations=dilations),
                     aux_head=_aux(aux_head), in_channels=in_channels, num_classes=num_classes,
                     activation_checkpointing=activation_checkpointing)


DeepLabV3Plus.variants = {'resnet50': dict(backbone='resnet50'), 'resnet101': dict(backbone='resnet101'),
                          'resnet101 OS8': dict(backbone='resnet101', output_stride=8)}


@MODELS.register_module()
def DeepLabV3PlusTiny(in_channels=3, num_classes=6, aux_head=False, activation_checkpointing=False):
    """DeepLabV3+ over timm's ``test_resnet`` at output stride 16 for CPU tests."""
    return Segmentor(backbone=_timm('test_resnet', False, levels='low_high', output_stride=16),
                     decode_head=dict(type='DeepLabV3PlusHead', channels=32, low_level_channels=8),
                     aux_head=_aux(aux_head, channels=16), in_channels=in_channels, num_classes=num_classes,
                     activation_checkpointing=activation_checkpointing)
