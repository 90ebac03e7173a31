"""UNet (Ronneberger et al. 2015) in the layout of milesial/Pytorch-UNet, any depth and band count.

Shape legend: B batch, C channels, K classes, H/W height/width.

Example::

    from ds_seg.registry import MODELS, build
    model = build(MODELS, dict(type='UNet', in_channels=4, num_classes=6))
    logits_BKHW = model(images_BCHW)          # same H, W as the input, any H, W

With ``base_channels=64, depth=4, bilinear=False`` the parameter count equals milesial's UNet
(31.04 M for 3 bands), so results and memory figures can be compared with that reference.
"""
import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_seg.registry import MODELS

from .padding import crop_padding, pad_to_multiple


class DoubleConv(nn.Sequential):
    """(conv3x3 -> BN -> ReLU) x 2; the convs have no bias because BN's shift replaces it."""

    def __init__(self, in_channels, out_channels, mid_channels=None):
        mid_channels = mid_channels or out_channels
        super().__init__(
            nn.Conv2d(in_channels, mid_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class Down(nn.Sequential):
    """Halve the resolution, then DoubleConv."""

    def __init__(self, in_channels, out_channels):
        super().__init__(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))


class Up(nn.Module):
    """Double the resolution of ``x``, concatenate the skip connection, then DoubleConv."""

    def __init__(self, in_channels, skip_channels, out_channels, bilinear):
        super().__init__()
        if bilinear:
            # Parameter-free upsampling keeps the channels; the conv narrows them instead.
            self.up = nn.Upsample(scale_factor=2, mode='bilinear', align_corners=True)
            cat_channels = in_channels + skip_channels
            self.conv = DoubleConv(cat_channels, out_channels, cat_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels // 2 + skip_channels, out_channels)

    def forward(self, x_BCHW, skip_BCHW):
        x_BCHW = self.up(x_BCHW)
        # Odd sizes lose a row or column in max-pooling; pad the upsampled map back to the
        # skip's size (split evenly, as milesial does) so any input size works. An exported graph
        # always pads (by 0 at even sizes): a traced branch would hold only for the traced size.
        dy = skip_BCHW.shape[-2] - x_BCHW.shape[-2]
        dx = skip_BCHW.shape[-1] - x_BCHW.shape[-1]
        if torch.compiler.is_exporting() or dy or dx:
            x_BCHW = F.pad(x_BCHW, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip_BCHW, x_BCHW], dim=1))


_BN_STATS = ('running_mean', 'running_var', 'num_batches_tracked')


@contextlib.contextmanager
def _bn_stats_frozen(module):
    """Point the running statistics of every BatchNorm in ``module`` at scratch copies, and put
    the real buffers back on exit.

    Used for the recomputation of a checkpointed block: the original forward already updated
    the running statistics once, and the recomputation (still in training mode) would update
    them a second time, so they would drift from an uncheckpointed run. Normalisation in
    training mode uses batch statistics, so the recomputed output is unchanged.

    Simpler-looking alternatives are wrong: ``track_running_stats=False`` makes BatchNorm save
    fewer tensors for backward, which checkpoint rejects as a mismatch; ``momentum=0`` still
    increments ``num_batches_tracked`` and turns a non-finite batch statistic into NaN;
    copying saved values back in place would bump the version of tensors autograd saved.
    Swapping the tensor objects touches the real buffers not at all.
    """
    saved = []
    for bn in module.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.track_running_stats:
            originals = {name: getattr(bn, name) for name in _BN_STATS}
            saved.append((bn, originals))
            for name, buf in originals.items():
                setattr(bn, name, buf.clone())
    try:
        yield
    finally:
        for bn, originals in saved:
            for name, buf in originals.items():
                setattr(bn, name, buf)


def _checkpoint_context(module):
    return contextlib.nullcontext(), _bn_stats_frozen(module)


@MODELS.register_module()
class UNet(nn.Module):
    """UNet with ``depth`` down/up stages; returns ``logits_BKHW`` at the input resolution.

    Args:
        in_channels: input bands (1 for DSM/SAR, 3 RGB, 4 RGB-NIR, 13 Sentinel-2, ...).
        num_classes: K, the number of output logits per pixel.
        base_channels: channels of the first stage; stage i has ``base_channels * 2**i``.
        depth: number of 2x down-sampling stages (the input is reduced by ``2**depth``).
        bilinear: bilinear upsampling (fewer parameters) instead of transposed convolutions.
        activation_checkpointing: in training, recompute each encoder/decoder block during
            backward instead of keeping its activations (less memory, about one more forward).

    Example::

        model = UNet(in_channels=3, num_classes=6)
        logits_BKHW = model(torch.randn(2, 3, 256, 256))   # -> [2, 6, 256, 256]
    """

    def __init__(self, in_channels=3, num_classes=6, base_channels=64, depth=4, bilinear=False,
                 activation_checkpointing=False):
        super().__init__()
        if depth < 1:
            raise ValueError(f'UNet depth must be >= 1, got {depth}')
        self.in_channels = in_channels
        self.num_classes = num_classes
        self.activation_checkpointing = activation_checkpointing

        self.size_divisor = 2 ** depth  # the input multiple forward() pads to (as the segmentors' backbones say)
        widths = [base_channels * 2 ** i for i in range(depth + 1)]
        # Bilinear upsampling does not reduce channels, so (as in milesial's UNet) the
        # bottleneck and every decoder stage but the last emit half as many to compensate.
        factor = 2 if bilinear else 1
        self.inc = DoubleConv(in_channels, widths[0])
        self.downs = nn.ModuleList(
            Down(widths[i - 1], widths[i] // factor if i == depth else widths[i])
            for i in range(1, depth + 1))
        ups = []
        below = widths[depth] // factor
        for i in range(depth, 0, -1):
            out = widths[i - 1] if i == 1 else widths[i - 1] // factor
            ups.append(Up(below, widths[i - 1], out, bilinear))
            below = out
        self.ups = nn.ModuleList(ups)
        self.outc = nn.Conv2d(widths[0], num_classes, kernel_size=1)

    def _run(self, block, *inputs):
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(block, *inputs, use_reentrant=False,
                              context_fn=functools.partial(_checkpoint_context, block))
        return block(*inputs)

    def forward(self, images_BCHW):
        # Padded to a multiple of 2**depth (as the segmentors pad to their encoder's): a window
        # smaller than that (a 5 x 300 strip, 1 x 1) pooled to nothing, "Output size is too small".
        images_BCHW, pad_h, pad_w = pad_to_multiple(images_BCHW, self.size_divisor)
        skips = [self._run(self.inc, images_BCHW)]
        for down in self.downs:
            skips.append(self._run(down, skips[-1]))
        x_BCHW = skips.pop()
        for up in self.ups:
            x_BCHW = self._run(up, x_BCHW, skips.pop())
        return crop_padding(self.outc(x_BCHW), pad_h, pad_w)


@MODELS.register_module()
def UNetTiny(in_channels=3, num_classes=6, bilinear=False, activation_checkpointing=False):
    """A UNet small enough for CPU tests in milliseconds (base 8, depth 3, ~0.12 M params)."""
    return UNet(in_channels=in_channels, num_classes=num_classes, base_channels=8, depth=3,
                bilinear=bilinear, activation_checkpointing=activation_checkpointing)
