"""Time series: one encoder shared by every date, time fused per feature level, one decoder.

Shape legend: B batch, T dates, C bands per date, Ci channels of feature level i, K classes.

The input is ``images_B(T*C)HW``, dates stacked date-major (what
:class:`~ds_seg.data.GeoTiffScenes` yields for a scene given as a list of dated rasters), so
the data pipeline, normalisation and whole-scene prediction need nothing new. The encoder runs
on the ``B*T`` single-date images at once; each feature level ``(B, T, Ci, h, w)`` is fused
over T by ``pooling`` and the decoder sees ordinary ``(B, Ci, h, w)`` levels. This is
TerraTorch's temporal wrapper (``TemporalWrapper``: mean / max / concat / diff), plus
``'attention'``: per-pixel softmax weights over the dates from a 1x1 convolution.

Example::

    model = build(MODELS, dict(type='TinyTemporalSegFormer', num_dates=3, in_channels=12,
                               num_classes=4, pooling='attention'))
    logits_BKHW = model(torch.randn(2, 12, 64, 64))           # 3 dates x 4 bands
"""
import torch
from torch import nn

from ..registry import MODELS, build
from .common import BACKBONES
from .segmentor import Segmentor

POOLINGS = ('mean', 'max', 'concat', 'diff', 'attention')


class TemporalEncoder(nn.Module):
    """Runs ``encoder`` on every date and fuses each feature level over time."""

    def __init__(self, encoder, num_dates, pooling='mean'):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is unknown; use one of {', '.join(POOLINGS)}")
        if pooling == 'diff' and num_dates != 2:
            raise ValueError(f"pooling 'diff' needs 2 dates, got num_dates={num_dates}")
        self.encoder, self.num_dates, self.pooling = encoder, int(num_dates), pooling
        self.out_channels = list(encoder.out_channels)
        self.size_divisor = getattr(encoder, 'size_divisor', 1)
        if hasattr(encoder, 'strides'):
            self.strides = encoder.strides
        T = self.num_dates
        self.fresh_modules = ('fuse',)  # not pretrained: trains with the heads (param_groups)
        if pooling == 'concat':
            self.fuse = nn.ModuleList(nn.Conv2d(T * c, c, 1) for c in self.out_channels)
        elif pooling == 'attention':
            self.fuse = nn.ModuleList(nn.Conv2d(c, 1, 1) for c in self.out_channels)

    def forward(self, images_BXHW):
        B, X, H, W = images_BXHW.shape
        T = self.num_dates
        if X % T:
            raise ValueError(f"{X} input channels are not {T} dates of equal band count")
        # Dates become batch entries: one encoder pass for all of them, weights shared.
        features = self.encoder(images_BXHW.reshape(B * T, X // T, H, W))
        return [self._fuse(i, f.reshape(B, T, *f.shape[1:])) for i, f in enumerate(features)]

    def _fuse(self, level, f_BTChw):
        if self.pooling == 'mean':
            return f_BTChw.mean(1)
        if self.pooling == 'max':
            return f_BTChw.amax(1)
        if self.pooling == 'diff':
            return f_BTChw[:, 1] - f_BTChw[:, 0]
        if self.pooling == 'concat':
            return self.fuse[level](f_BTChw.flatten(1, 2))
        B, T = f_BTChw.shape[:2]
        scores_BT1hw = self.fuse[level](f_BTChw.flatten(0, 1)).reshape(B, T, 1, *f_BTChw.shape[-2:])
        return (torch.softmax(scores_BT1hw, dim=1) * f_BTChw).sum(1)


@MODELS.register_module()
def TemporalSegmentor(backbone, decode_head, num_dates, in_channels, num_classes=6, pooling='mean',
                      aux_head=None, activation_checkpointing=False):
    """A :class:`~ds_seg.models.Segmentor` whose encoder sees each of ``num_dates`` dates.

    ``in_channels`` counts all dates (``num_dates`` x bands per date), like the data's channels.

    Example::

        TemporalSegmentor(backbone=dict(type='MixTransformer', variant='mit_b0'),
                          decode_head=dict(type='SegFormerHead', channels=256),
                          num_dates=4, in_channels=16, num_classes=6, pooling='attention')
    """
    if isinstance(num_dates, bool) or not isinstance(num_dates, int) or num_dates < 1:
        from ..config import ConfigError
        raise ConfigError(f"model.num_dates must be a whole number of at least 1 (dates per scene), got {num_dates!r}")
    if in_channels % num_dates:
        raise ValueError(f"in_channels={in_channels} is not num_dates={num_dates} x bands per date")
    encoder = backbone if isinstance(backbone, nn.Module) else build(
        BACKBONES, backbone, where='model.backbone', in_channels=in_channels // num_dates,
        activation_checkpointing=activation_checkpointing)
    return Segmentor(backbone=TemporalEncoder(encoder, num_dates, pooling), decode_head=decode_head,
                     aux_head=aux_head, in_channels=in_channels, num_classes=num_classes)


@MODELS.register_module()
def TinyTemporalSegFormer(num_dates=1, in_channels=3, num_classes=6, pooling='mean',
                          activation_checkpointing=False):
    """A temporal SegFormer for CPU tests (the ``mit_tiny_test`` encoder, 32-channel head);
    ``in_channels`` counts all dates."""
    return TemporalSegmentor(backbone=dict(type='MixTransformer', variant='mit_tiny_test', drop_path_rate=0.0),
                             decode_head=dict(type='SegFormerHead', channels=32), num_dates=num_dates,
                             in_channels=in_channels, num_classes=num_classes, pooling=pooling,
                             activation_checkpointing=activation_checkpointing)
