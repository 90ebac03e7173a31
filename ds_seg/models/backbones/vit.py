"""A plain Vision Transformer backbone in pure PyTorch with a simple feature pyramid, from
ViT-S (22 M) to ViT-g (1 B) and beyond (free depth/width), for UperNet-style decoders.

Shape legend: B batch, C channels, H/W height/width, N tokens, D embedding width.

Parameter names follow timm's ``VisionTransformer`` (``patch_embed.proj``, ``blocks.i.attn.qkv``,
...), so timm ViT weights load with :func:`ds_seg.models.pretrained.load_pretrained`.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..common import BACKBONES, DropPath, TruncNormalLinear, linspace, run_block
from ..pretrained import load_pretrained, timm_state_dict

# embed_dim, depth, num_heads, mlp_ratio (timm's ViT-S/B/L/H and ViT-g/14 widths; patch 16 here
# so that 512-pixel crops give a whole token grid). Backbone parameters: 22 M, 86 M, 303 M,
# 630 M, 1.01 B.
VIT_PRESETS = {
    'vit_small': dict(embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    'vit_base': dict(embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
    'vit_large': dict(embed_dim=1024, depth=24, num_heads=16, mlp_ratio=4.0),
    'vit_huge': dict(embed_dim=1280, depth=32, num_heads=16, mlp_ratio=4.0),
    'vit_giant': dict(embed_dim=1408, depth=40, num_heads=16, mlp_ratio=48 / 11),
    'vit_tiny_test': dict(embed_dim=32, depth=4, num_heads=2, mlp_ratio=2.0),
}
# The timm weights pretrained=True fetches for each preset (patch 16 where timm has it).
TIMM_WEIGHTS = {
    'vit_small': 'vit_small_patch16_224.augreg_in21k_ft_in1k',
    'vit_base': 'vit_base_patch16_224.augreg_in21k_ft_in1k',
    'vit_large': 'vit_large_patch16_224.augreg_in21k_ft_in1k',
}


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = TruncNormalLinear(dim, dim * 3)
        self.proj = TruncNormalLinear(dim, dim)

    def forward(self, x_BND):
        B, N, D = x_BND.shape
        q, k, v = self.qkv(x_BND).reshape(B, N, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        x_BND = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        return self.proj(x_BND)


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = TruncNormalLinear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = TruncNormalLinear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim, num_heads, mlp_ratio, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(round(dim * mlp_ratio)))
        self.drop_path = DropPath(drop_path)

    def forward(self, x_BND):
        x_BND = x_BND + self.drop_path(self.attn(self.norm1(x_BND)))
        return x_BND + self.drop_path(self.mlp(self.norm2(x_BND)))


class PatchEmbed(nn.Module):
    def __init__(self, in_channels, dim, patch_size):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)

    def forward(self, x_BCHW):
        return self.proj(x_BCHW)


def pyramid_block_indices(where, out_indices, depth):
    """The four blocks (0..depth-1) a ViT's pyramid takes: ``out_indices``, or the last block of
    each quarter of the depth. Negative indices count from the last block, as in Python and timm
    (``(-4, -3, -2, -1)``): they were once clamped to 0 (TimmViT: the first block fed all four
    levels, silently) or never matched (ViT: a KeyError in forward). Anything else out of range is
    one line naming the model."""
    if out_indices is None:
        return [max(0, depth * (q + 1) // 4 - 1) for q in range(4)]
    from ...config import ConfigError
    given = list(out_indices) if isinstance(out_indices, (list, tuple)) else [out_indices]
    if len(given) != 4 or not all(isinstance(i, int) and not isinstance(i, bool) and -depth <= i < depth
                                  for i in given):
        raise ConfigError(f'{where}: out_indices must be 4 block indices in {-depth}..{depth - 1} (the model '
                          f'has {depth} blocks; negative ones count from the last), got {out_indices!r}.')
    return [i % depth for i in given]


class SimplePyramid(nn.Module):
    """Stride-16 ViT maps from four depths -> strides 4, 8, 16, 32 (BEiT/ViTDet-style necks:
    two transposed convs, one, identity, max-pool)."""

    def __init__(self, dim):
        super().__init__()
        self.up4 = nn.Sequential(nn.ConvTranspose2d(dim, dim, 2, stride=2), nn.BatchNorm2d(dim), nn.GELU(),
                                 nn.ConvTranspose2d(dim, dim, 2, stride=2))
        self.up2 = nn.ConvTranspose2d(dim, dim, 2, stride=2)
        self.down2 = nn.MaxPool2d(2, ceil_mode=True)

    def forward(self, features):
        f4, f8, f16, f32 = features
        return [self.up4(f4), self.up2(f8), f16, self.down2(f32)]


@BACKBONES.register_module()
class ViT(nn.Module):
    """Plain ViT encoder returning four feature maps at strides 4, 8, 16, 32.

    ``variant`` picks a preset (``vit_small`` ... ``vit_giant``); ``embed_dim``, ``depth``,
    ``num_heads``, ``mlp_ratio`` override it, e.g. ``embed_dim=2048, depth=48, num_heads=32``
    gives a 2.4 B backbone. Features are taken after the blocks in ``out_indices`` (default: the
    last block of each quarter of the depth). Inputs of any size are padded by the segmentor to
    a multiple of ``size_divisor``; position embeddings are resized to the token grid.

    Example::

        vit = ViT('vit_base', in_channels=4)
        feats = vit(torch.randn(1, 4, 512, 512))   # [1,768,128,128] ... [1,768,16,16]
    """

    def __init__(self, variant='vit_base', in_channels=3, img_size=512, patch_size=16, embed_dim=None,
                 depth=None, num_heads=None, mlp_ratio=None, out_indices=None, drop_path_rate=0.0,
                 activation_checkpointing=False, pretrained=None):
        super().__init__()
        if variant not in VIT_PRESETS:
            raise ValueError(f'ViT variant {variant!r} is unknown; known: {", ".join(VIT_PRESETS)}.')
        arch = dict(VIT_PRESETS[variant])
        arch.update({k: v for k, v in dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                                           mlp_ratio=mlp_ratio).items() if v is not None})
        dim, depth = arch['embed_dim'], arch['depth']
        self.patch_size = patch_size
        self.size_divisor = patch_size
        self.activation_checkpointing = activation_checkpointing
        if depth < 1:
            raise ValueError(f'ViT depth must be at least 1, got {depth}.')
        # The last block of each quarter of the depth; a ViT shallower than 4 repeats blocks.
        self.out_indices = pyramid_block_indices(f'ViT {variant}', out_indices, depth)
        grid = img_size // patch_size
        self.patch_embed = PatchEmbed(in_channels, dim, patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + grid * grid, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=1e-6)
        rates = linspace(drop_path_rate, depth)
        self.blocks = nn.ModuleList(Block(dim, arch['num_heads'], arch['mlp_ratio'], rates[i])
                                    for i in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.neck = SimplePyramid(dim)
        self.fresh_modules = ('neck',)  # not pretrained: trains with the heads (param_groups)
        self.out_channels = [dim] * 4
        self.strides = [4, 8, 16, 32]
        if pretrained:
            source = timm_state_dict(TIMM_WEIGHTS.get(variant, variant)) if pretrained is True else pretrained
            # A classification ViT has no pyramid neck: that part starts from scratch.
            load_pretrained(self, source, allow_missing=('neck.',), where=f'{variant} pretrained', band_map_option=None)

    def _pos_embed(self, grid_h, grid_w):
        pos = self.pos_embed[:, 1:]
        old = int(math.sqrt(pos.shape[1]))
        if torch.compiler.is_exporting() or (grid_h, grid_w) != (old, old):  # keep the export's H, W dynamic
            pos = pos.reshape(1, old, old, -1).permute(0, 3, 1, 2)
            # timm's kernel (antialiased bicubic, resample_abs_pos_embed): features equal timm's
            # ViT with dynamic_img_size at any window size, not only at img_size.
            pos = F.interpolate(pos, size=(grid_h, grid_w), mode='bicubic', align_corners=False, antialias=True)
            pos = pos.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, -1)
        return pos

    def forward(self, images_BCHW):
        x_BDhw = self.patch_embed(images_BCHW)
        B, D, h, w = x_BDhw.shape
        x_BND = x_BDhw.flatten(2).transpose(1, 2) + self._pos_embed(h, w)
        x_BND = torch.cat([(self.cls_token + self.pos_embed[:, :1]).expand(B, -1, -1), x_BND], dim=1)
        by_index = {}
        for i, block in enumerate(self.blocks):
            x_BND = run_block(block, x_BND, checkpointing=self.activation_checkpointing)
            if i in self.out_indices:
                by_index[i] = self.norm(x_BND[:, 1:]).transpose(1, 2).reshape(B, D, h, w)
        return self.neck([by_index[i] for i in self.out_indices])
