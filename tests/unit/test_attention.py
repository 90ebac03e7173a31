"""The zoo's ViT and MiT attention go through F.scaled_dot_product_attention (flash / memory-
efficient kernels on a GPU): outputs and gradients equal the explicit softmax(q k^T / sqrt(d)) v."""
import math

import torch

from ds_seg.models.backbones.mit import EfficientAttention
from ds_seg.models.backbones.vit import Attention


def _explicit(q, k, v):
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(dim=-1)
    return weights @ v


def _vit_explicit(attn, x_BND):
    B, N, D = x_BND.shape
    q, k, v = attn.qkv(x_BND).reshape(B, N, 3, attn.num_heads, D // attn.num_heads).permute(2, 0, 3, 1, 4)
    return attn.proj(_explicit(q, k, v).transpose(1, 2).reshape(B, N, D))


def _mit_explicit(attn, x_BNC, H, W):
    B, N, C = x_BNC.shape
    heads = attn.num_heads
    q = attn.q(x_BNC).reshape(B, N, heads, C // heads).transpose(1, 2)
    kv_BNC = x_BNC
    if attn.sr_ratio > 1:
        kv_BNC = attn.norm(attn.sr(x_BNC.transpose(1, 2).reshape(B, C, H, W)).flatten(2).transpose(1, 2))
    k, v = attn.kv(kv_BNC).reshape(B, -1, 2, heads, C // heads).permute(2, 0, 3, 1, 4)
    return attn.proj(_explicit(q, k, v).transpose(1, 2).reshape(B, N, C))


def _same_output_and_gradients(module, fused, explicit):
    out_fused = fused()
    grads_fused = torch.autograd.grad(out_fused.square().sum(), list(module.parameters()))
    out_explicit = explicit()
    grads_explicit = torch.autograd.grad(out_explicit.square().sum(), list(module.parameters()))
    assert torch.allclose(out_fused, out_explicit, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_fused, grads_explicit):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_vit_attention_equals_explicit_softmax():
    torch.manual_seed(0)
    attn = Attention(dim=32, num_heads=4)
    x = torch.randn(2, 17, 32)
    _same_output_and_gradients(attn, lambda: attn(x), lambda: _vit_explicit(attn, x))


def test_mit_attention_with_spatial_reduction_equals_explicit_softmax():
    torch.manual_seed(0)
    attn = EfficientAttention(dim=32, num_heads=2, sr_ratio=2)
    H = W = 8
    x = torch.randn(2, H * W, 32)
    _same_output_and_gradients(attn, lambda: attn(x, H, W), lambda: _mit_explicit(attn, x, H, W))
