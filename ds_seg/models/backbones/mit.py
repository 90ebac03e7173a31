"""Mix Transformer (MiT) encoder of SegFormer (Xie et al. 2021), variants ``mit_b0`` ... ``mit_b5``.

Shape legend: B batch, C channels, H/W height/width, N = H*W tokens.

Parameter names follow the official NVlabs ``mix_transformer.py`` (``patch_embed1.proj``,
``block1.0.attn.kv``, ``block1.0.mlp.dwconv.dwconv``, ``norm1``...), so the released ImageNet
``mit_b*.pth`` files load as ``pretrained='path/mit_b0.pth'``.
"""
import torch.nn.functional as F
from torch import nn

from ..common import BACKBONES, DropPath, TruncNormalLinear, linspace, run_block
from ..pretrained import load_pretrained

_WIDE = dict(embed_dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8))
MIT_PRESETS = {
    'mit_b0': dict(embed_dims=(32, 64, 160, 256), num_heads=(1, 2, 5, 8), depths=(2, 2, 2, 2)),
    'mit_b1': dict(**_WIDE, depths=(2, 2, 2, 2)),
    'mit_b2': dict(**_WIDE, depths=(3, 4, 6, 3)),
    'mit_b3': dict(**_WIDE, depths=(3, 4, 18, 3)),
    'mit_b4': dict(**_WIDE, depths=(3, 8, 27, 3)),
    'mit_b5': dict(**_WIDE, depths=(3, 6, 40, 3)),
    'mit_tiny_test': dict(embed_dims=(8, 16, 32, 48), num_heads=(1, 1, 2, 2), depths=(1, 1, 1, 1)),
}


class OverlapPatchEmbed(nn.Module):
    def __init__(self, in_channels, dim, kernel_size, stride):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size, stride=stride, padding=kernel_size // 2)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x_BCHW):
        x_BCHW = self.proj(x_BCHW)
        H, W = x_BCHW.shape[-2:]
        return self.norm(x_BCHW.flatten(2).transpose(1, 2)), H, W


class EfficientAttention(nn.Module):
    """Self-attention whose keys and values come from a map reduced ``sr_ratio`` times per side."""

    def __init__(self, dim, num_heads, sr_ratio):
        super().__init__()
        self.num_heads = num_heads
        self.q = TruncNormalLinear(dim, dim)
        self.kv = TruncNormalLinear(dim, dim * 2)
        self.proj = TruncNormalLinear(dim, dim)
        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, sr_ratio, stride=sr_ratio)
            self.norm = nn.LayerNorm(dim)

    def forward(self, x_BNC, H, W):
        B, N, C = x_BNC.shape
        heads = self.num_heads
        q = self.q(x_BNC).reshape(B, N, heads, C // heads).transpose(1, 2)
        kv_BNC = x_BNC
        if self.sr_ratio > 1:
            kv_BNC = self.sr(x_BNC.transpose(1, 2).reshape(B, C, H, W)).flatten(2).transpose(1, 2)
            kv_BNC = self.norm(kv_BNC)
        k, v = self.kv(kv_BNC).reshape(B, -1, 2, heads, C // heads).permute(2, 0, 3, 1, 4)
        x_BNC = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x_BNC)


class DWConv(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x_BNC, H, W):
        B, N, C = x_BNC.shape
        return self.dwconv(x_BNC.transpose(1, 2).reshape(B, C, H, W)).flatten(2).transpose(1, 2)


class MixFFN(nn.Module):
    """MLP with a 3x3 depth-wise conv: gives position information without position embeddings."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = TruncNormalLinear(dim, hidden)
        self.dwconv = DWConv(hidden)
        self.act = nn.GELU()
        self.fc2 = TruncNormalLinear(hidden, dim)

    def forward(self, x_BNC, H, W):
        return self.fc2(self.act(self.dwconv(self.fc1(x_BNC), H, W)))


class MixBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio, sr_ratio, drop_path):
        super().__init__()
        # eps 1e-6 in the blocks and after each stage, as in NVlabs' MiT that the mit_b* weights
        # come from (and timm's pvt_v2); the patch embedding and reduction norms keep 1e-5.
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = EfficientAttention(dim, num_heads, sr_ratio)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MixFFN(dim, dim * mlp_ratio)
        self.drop_path = DropPath(drop_path)

    def forward(self, x_BNC, H, W):
        x_BNC = x_BNC + self.drop_path(self.attn(self.norm1(x_BNC), H, W))
        return x_BNC + self.drop_path(self.mlp(self.norm2(x_BNC), H, W))


@BACKBONES.register_module()
class MixTransformer(nn.Module):
    """SegFormer's hierarchical encoder: four stages at strides 4, 8, 16, 32.

    Example::

        mit = MixTransformer('mit_b2', in_channels=4)
        feats = mit(torch.randn(1, 4, 512, 512))     # 64/128/320/512 channels at 128..16 px
    """

    def __init__(self, variant='mit_b0', in_channels=3, mlp_ratio=4, sr_ratios=(8, 4, 2, 1),
                 drop_path_rate=0.1, activation_checkpointing=False, pretrained=None):
        super().__init__()
        if variant not in MIT_PRESETS:
            raise ValueError(f'MixTransformer variant {variant!r} is unknown; known: {", ".join(MIT_PRESETS)}.')
        arch = MIT_PRESETS[variant]
        self.activation_checkpointing = activation_checkpointing
        # Padded by the segmentor to its deepest stride, as mmseg pads SegFormer's inputs: below 32 px
        # the first stage's attention reduction (an 8 x 8 convolution at stride 4) had no room.
        self.size_divisor = 32
        self.out_channels = list(arch['embed_dims'])
        self.strides = [4, 8, 16, 32]
        rates = iter(linspace(drop_path_rate, sum(arch['depths'])))
        previous = in_channels
        for i, (dim, heads, depth) in enumerate(zip(arch['embed_dims'], arch['num_heads'], arch['depths']), 1):
            kernel, stride = (7, 4) if i == 1 else (3, 2)
            setattr(self, f'patch_embed{i}', OverlapPatchEmbed(previous, dim, kernel, stride))
            setattr(self, f'block{i}', nn.ModuleList(
                MixBlock(dim, heads, mlp_ratio, sr_ratios[i - 1], next(rates)) for _ in range(depth)))
            setattr(self, f'norm{i}', nn.LayerNorm(dim, eps=1e-6))
            previous = dim
        if pretrained:
            if not isinstance(pretrained, str):
                raise ValueError('MixTransformer: timm has no MiT weights; pass pretrained as the path of '
                                 'an ImageNet mit_b*.pth file (NVlabs/SegFormer releases).')
            load_pretrained(self, pretrained, where=f'{variant} pretrained', band_map_option=None)

    def forward(self, images_BCHW):
        features, x = [], images_BCHW
        for i in range(1, 5):
            x_BNC, H, W = getattr(self, f'patch_embed{i}')(x)
            for block in getattr(self, f'block{i}'):
                x_BNC = run_block(block, x_BNC, H, W, checkpointing=self.activation_checkpointing)
            x_BNC = getattr(self, f'norm{i}')(x_BNC)
            x = x_BNC.transpose(1, 2).reshape(x_BNC.shape[0], -1, H, W)
            features.append(x)
        return features

