"""Decode heads: ``head(features) -> logits_BKhw`` at the resolution of the finest feature used.

Every head takes ``in_channels`` (the encoder's ``out_channels``) and ``num_classes``; the
segmentor upsamples its logits to the input size. Shape legend: B batch, C channels,
K classes, h/w a feature map's height/width.
"""
import torch
from torch import nn

from ..common import HEADS, ConvBNReLU, resize


class _ClassifierMixin:
    def _init_classifier(self, channels, num_classes, dropout):
        self.dropout = nn.Dropout2d(dropout) if dropout else nn.Identity()
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def classify(self, x_BChw):
        return self.classifier(self.dropout(x_BChw))


def _bins(length, bins, like):
    """``[bins, length]`` averaging weights of PyTorch's adaptive pooling bins
    ``[floor(i * L / s), ceil((i + 1) * L / s))``, built from tensor ops so a traced size stays
    dynamic."""
    pos = torch.arange(length, device=like.device)
    i = torch.arange(bins, device=like.device)
    start = torch.div(i * length, bins, rounding_mode='floor')
    end = torch.div((i + 1) * length + bins - 1, bins, rounding_mode='floor')
    inside = ((pos[None] >= start[:, None]) & (pos[None] < end[:, None])).to(like.dtype)
    return inside / inside.sum(1, keepdim=True)


def adaptive_avg_pool(x_BChw, size):
    """``F.adaptive_avg_pool2d``; under ONNX export the same bins as two averaging matrices,
    because the ONNX exporter has no adaptive pooling for sizes that do not divide the input."""
    if not torch.compiler.is_exporting():
        return nn.functional.adaptive_avg_pool2d(x_BChw, size)
    h, w = x_BChw.shape[-2:]
    return torch.einsum('sh,bchw,tw->bcst', _bins(h, size, x_BChw), x_BChw, _bins(w, size, x_BChw))


class PyramidPooling(nn.Module):
    """PSPNet pooling over the coarsest map; the pooled branches have no BatchNorm because a
    1x1 map of a micro-batch of one has no batch statistics to normalise with."""

    def __init__(self, in_channels, channels, scales=(1, 2, 3, 6)):
        super().__init__()
        self.scales = scales
        self.branches = nn.ModuleList(ConvBNReLU(in_channels, channels, 1, norm=False) for _ in scales)
        self.bottleneck = ConvBNReLU(in_channels + len(scales) * channels, channels, 3)

    def forward(self, x_BChw):
        size = x_BChw.shape[-2:]
        pooled = [resize(branch(adaptive_avg_pool(x_BChw, s)), size)
                  for s, branch in zip(self.scales, self.branches)]
        return self.bottleneck(torch.cat([x_BChw, *pooled], dim=1))


@HEADS.register_module()
class UperHead(_ClassifierMixin, nn.Module):
    """UperNet (Xiao et al. 2018): pyramid pooling on the coarsest map, an FPN top-down path,
    and a fusion of all levels at the finest stride (mmsegmentation's layout, 512 channels).

    Example::

        head = UperHead([96, 192, 384, 768], num_classes=6)
        logits = head(feats)      # at the stride of feats[0]
    """

    def __init__(self, in_channels, num_classes, channels=512, dropout=0.1):
        super().__init__()
        self.ppm = PyramidPooling(in_channels[-1], channels)
        self.laterals = nn.ModuleList(ConvBNReLU(c, channels, 1) for c in in_channels[:-1])
        self.fpn_convs = nn.ModuleList(ConvBNReLU(channels, channels, 3) for _ in in_channels[:-1])
        self.fuse = ConvBNReLU(len(in_channels) * channels, channels, 3)
        self._init_classifier(channels, num_classes, dropout)

    def forward(self, features):
        laterals = [lateral(f) for lateral, f in zip(self.laterals, features)] + [self.ppm(features[-1])]
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + resize(laterals[i], laterals[i - 1].shape[-2:])
        outs = [conv(x) for conv, x in zip(self.fpn_convs, laterals[:-1])] + [laterals[-1]]
        size = outs[0].shape[-2:]
        return self.classify(self.fuse(torch.cat([resize(o, size) for o in outs], dim=1)))


@HEADS.register_module()
class SegFormerHead(_ClassifierMixin, nn.Module):
    """SegFormer's all-MLP decoder: one linear layer per level to ``channels``, upsample to the
    finest level, concatenate, fuse with a 1x1 conv (256 channels for B0/B1, 768 for B2-B5).

    Example::

        head = SegFormerHead([32, 64, 160, 256], num_classes=6, channels=256)
    """

    def __init__(self, in_channels, num_classes, channels=256, dropout=0.1):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(c, channels) for c in in_channels)
        self.fuse = ConvBNReLU(len(in_channels) * channels, channels, 1)
        self._init_classifier(channels, num_classes, dropout)

    def forward(self, features):
        size = features[0].shape[-2:]
        outs = []
        for linear, f_BChw in zip(self.linears, features):
            x_BChw = linear(f_BChw.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(
                f_BChw.shape[0], -1, *f_BChw.shape[-2:])
            outs.append(resize(x_BChw, size))
        # Coarsest first, as in the reference implementation (the fuse weights depend on it).
        return self.classify(self.fuse(torch.cat(outs[::-1], dim=1)))


@HEADS.register_module()
class FPNHead(_ClassifierMixin, nn.Module):
    """Semantic FPN (Kirillov et al. 2019, segmentation_models_pytorch layout): a top-down
    pyramid, each level brought to the finest stride by conv+2x upsampling stages, summed.

    Example::

        head = FPNHead([64, 128, 256, 512], num_classes=6)
    """

    def __init__(self, in_channels, num_classes, channels=256, segmentation_channels=128, dropout=0.1):
        super().__init__()
        self.laterals = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in in_channels)
        self.seg_blocks = nn.ModuleList(
            nn.ModuleList(ConvBNReLU(channels if j == 0 else segmentation_channels, segmentation_channels, 3)
                          for j in range(max(1, i)))
            for i in range(len(in_channels)))
        self._init_classifier(segmentation_channels, num_classes, dropout)

    def forward(self, features):
        pyramid = [lateral(f) for lateral, f in zip(self.laterals, features)]
        for i in range(len(pyramid) - 1, 0, -1):
            pyramid[i - 1] = pyramid[i - 1] + resize(pyramid[i], pyramid[i - 1].shape[-2:])
        size = pyramid[0].shape[-2:]
        total = 0
        for level, (blocks, x) in enumerate(zip(self.seg_blocks, pyramid)):
            for j, block in enumerate(blocks):
                x = block(x)
                if level > 0:  # one 2x upsampling per block; the last one lands on the finest size
                    x = resize(x, size if j == len(blocks) - 1 else [s * 2 for s in x.shape[-2:]])
            total = total + x
        return self.classify(total)


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: 1x1, three dilated 3x3 and an image-pooling branch."""

    def __init__(self, in_channels, channels, dilations):
        super().__init__()
        self.branches = nn.ModuleList([ConvBNReLU(in_channels, channels, 1)] + [
            ConvBNReLU(in_channels, channels, 3, dilation=d) for d in dilations])
        # No BatchNorm after global pooling: a micro-batch of one has no statistics there.
        self.image_pool = ConvBNReLU(in_channels, channels, 1, norm=False)
        self.project = ConvBNReLU((len(dilations) + 2) * channels, channels, 1)

    def forward(self, x_BChw):
        pooled = self.image_pool(nn.functional.adaptive_avg_pool2d(x_BChw, 1)).expand(-1, -1, *x_BChw.shape[-2:])
        return self.project(torch.cat([b(x_BChw) for b in self.branches] + [pooled], dim=1))


@HEADS.register_module()
class DeepLabV3PlusHead(_ClassifierMixin, nn.Module):
    """DeepLabV3+ (Chen et al. 2018): ASPP on the coarsest map, upsampled and joined with 48
    projected channels of the stride-4 map, refined by two 3x3 convs.

    ``dilations`` suit output stride 16 (6, 12, 18); use (12, 24, 36) at output stride 8.

    Example::

        head = DeepLabV3PlusHead([256, 2048], num_classes=6)   # stride 4 and stride 16 maps
    """

    def __init__(self, in_channels, num_classes, channels=256, low_level_channels=48, dilations=(6, 12, 18),
                 dropout=0.1):
        super().__init__()
        self.aspp = ASPP(in_channels[-1], channels, dilations)
        self.low_level = ConvBNReLU(in_channels[0], low_level_channels, 1)
        self.refine = nn.Sequential(ConvBNReLU(channels + low_level_channels, channels, 3),
                                    ConvBNReLU(channels, channels, 3))
        self._init_classifier(channels, num_classes, dropout)

    def forward(self, features):
        low_BChw = self.low_level(features[0])
        x_BChw = resize(self.aspp(features[-1]), low_BChw.shape[-2:])
        return self.classify(self.refine(torch.cat([x_BChw, low_BChw], dim=1)))


@HEADS.register_module()
class FCNHead(_ClassifierMixin, nn.Module):
    """Auxiliary head: a 3x3 conv and a classifier on one feature level (``in_index``), used for
    a deep-supervision loss during training only.

    Example::

        aux = FCNHead([96, 192, 384, 768], num_classes=6, in_index=2)
    """

    def __init__(self, in_channels, num_classes, in_index=-2, channels=256, dropout=0.1):
        super().__init__()
        levels = len(in_channels)
        if isinstance(in_index, bool) or not isinstance(in_index, int) or not -levels <= in_index < levels:
            raise ValueError(f'in_index must pick one of the encoder\'s {len(in_channels)} feature levels '
                             f'({-len(in_channels)}..{len(in_channels) - 1}), got {in_index!r}')
        self.in_index = in_index
        self.conv = ConvBNReLU(in_channels[in_index], channels, 3)
        self._init_classifier(channels, num_classes, dropout)

    def forward(self, features):
        return self.classify(self.conv(features[self.in_index]))
