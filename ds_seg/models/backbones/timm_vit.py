"""Any timm ViT-family model (ViT, DeiT/DeiT-3, DINOv2 with or without registers, EVA/EVA-02,
DINOv3, CLIP/SigLIP towers...) as a four-level encoder for UperNet, FPN and
SegFormer heads.

Shape legend: B batch, C channels, D embedding width, H/W image height/width, h/w token grid.

The blocks' outputs come from timm's own ``forward_intermediates`` (so every token layout timm
knows works: class token, register tokens, no class position embedding, RoPE), one block per
quarter of the depth by default; a simple feature pyramid (ViTDet/BEiT-style: two transposed
convs, one, identity, max-pool) turns them into strides 4, 8, 16, 32. A patch-14 grid (DINOv2)
is resampled to the stride-16 grid first, so heads always see strides 4/8/16/32.
"""
import os
import re

import torch.nn.functional as F
from torch import nn

from ..common import BACKBONES
from ..pretrained import check_band_map, create_timm_model, load_pretrained, timm_state_dict
from .vit import SimplePyramid, pyramid_block_indices

# timm modules whose models are plain (single-stride) ViTs with forward_intermediates; names from
# these route to TimmViT in UperNet/FPN/SegFormer-style factories (hierarchical models such as
# Swin or ConvNeXt keep TimmBackbone's features_only path).
# (BEiT and relative-position ViTs are left out: their position bias is fixed to one image size.)
PLAIN_VIT_MODULES = ('vision_transformer', 'deit', 'eva')


def is_plain_vit(name):
    """Whether timm's model ``name`` is a plain ViT (one stride) that :class:`TimmViT` serves.

    Example: ``is_plain_vit('vit_large_patch14_reg4_dinov2')`` is True, ``is_plain_vit('swin_tiny_patch4_window7_224')``
    False.
    """
    from timm.models import is_model, model_entrypoint
    if not is_model(name):
        return False
    return model_entrypoint(name).__module__.rsplit('.', 1)[-1] in PLAIN_VIT_MODULES


def _convert_dinov2(state):
    """The layout of facebookresearch/dinov2 files -> timm's (what timm's own loader does): the
    register tokens are ``reg_token``, and with registers timm's model has no class position
    embedding, so the class token takes its position embedding along. ViT-g's SwiGLU MLP is
    ``w12``/``w3`` there and ``fc1``/``fc2`` (packed) in timm. A model trained with
    ``block_chunks`` (the DINOv2 repo's default for its large runs) saves ``blocks.<chunk>.<i>.``,
    ``i`` the block's own index: that is timm's ``blocks.<i>.``."""
    chunked = re.compile(r'^blocks\.\d+\.(\d+\.)')
    state = {chunked.sub(r'blocks.\1', k): v for k, v in state.items()}
    swiglu = re.compile(r'(blocks\.\d+\.mlp\.)(w12|w3)\.')
    state = {swiglu.sub(lambda m: m[1] + ('fc1.' if m[2] == 'w12' else 'fc2.'), k): v for k, v in state.items()}
    if 'register_tokens' in state:
        state['reg_token'] = state.pop('register_tokens')
        if 'cls_token' in state and 'pos_embed' in state:
            state['cls_token'] = state['cls_token'] + state['pos_embed'][:, :1]
            state['pos_embed'] = state['pos_embed'][:, 1:]
    return state


@BACKBONES.register_module()
class TimmViT(nn.Module):
    """``timm.create_model(name, dynamic_img_size=True, **timm_kwargs)`` as four feature maps at
    strides 4, 8, 16, 32 (``out_channels`` the embedding width four times).

    Any crop size works: the segmentor pads the input to a multiple of the patch size and timm
    resamples the position embeddings to the token grid (antialiased bicubic). ``img_size`` sets
    the grid the position embeddings are stored at (a pretrained file of another grid is resized
    on load with the same kernel). ``out_indices`` picks the blocks (default: the last of each
    quarter of the depth); features pass the model's final norm. ``pretrained`` is a local file
    (a timm or DINOv2 state dict) or True (timm's default weights, network needed once);
    ``band_map`` maps a multispectral checkpoint's bands onto the data's (one file band index or
    None per data band), otherwise the first layer is adapted to ``in_channels`` as for every
    backbone. Loading is exact or refused (:func:`ds_seg.models.pretrained.load_pretrained`).

    Example::

        enc = TimmViT('vit_large_patch14_reg4_dinov2', in_channels=4,
                      pretrained='weights/dinov2_vitl14_reg4.pth')
        feats = enc(torch.randn(1, 4, 518, 518))    # 4 x [1, 1024, .], strides 4, 8, 16, 32
    """

    def __init__(self, name='vit_base_patch16_224', in_channels=3, out_indices=None, pretrained=False,
                 band_map=None, activation_checkpointing=False, **timm_kwargs):
        super().__init__()
        check_band_map(band_map, in_channels, pretrained, name)
        kwargs = dict(timm_kwargs)
        kwargs.setdefault('dynamic_img_size', True)  # position embeddings follow the token grid
        self.model = create_timm_model(name, num_classes=0, in_chans=in_channels, **kwargs)
        depth = self.built_depth = len(self.model.blocks)
        self.out_indices = pyramid_block_indices(name, out_indices, depth)
        # The blocks after the last feature block and the classifier are never run: drop them
        # (DDP and ZeRO would otherwise see parameters without gradients).
        self.model.prune_intermediate_layers(sorted(set(self.out_indices)), prune_norm=False, prune_head=True)
        patch = self.model.patch_embed.patch_size
        self.patch_size = int(patch[0] if isinstance(patch, (tuple, list)) else patch)
        self.size_divisor = self.patch_size
        dim = self.model.embed_dim
        self.neck = SimplePyramid(dim)
        self.fresh_modules = ('neck',)  # not pretrained: trains with the heads (param_groups)
        self.out_channels = [dim] * 4
        self.strides = [4, 8, 16, 32]
        if activation_checkpointing:
            self.model.set_grad_checkpointing(True)
        if pretrained:
            source = timm_state_dict(name) if pretrained is True else pretrained
            self.load_pretrained(source, band_map=band_map, where=f'{name} pretrained',
                                 origin=f"timm's weights for {name}" if pretrained is True else None)

    def load_pretrained(self, source, band_map=None, where='pretrained', origin=None):
        """Load a timm (or DINOv2-layout) state dict into the ViT; the pyramid neck starts fresh."""
        from ..pretrained import _under_prefix, read_state_dict
        state = read_state_dict(source, where) if isinstance(source, str) else dict(source)
        # Under a prefix (DINO's teacher 'backbone.', an mmpretrain checkpoint's) the DINOv2 names
        # are only recognised once it is removed.
        inner, prefix = _under_prefix(state, set(self.model.state_dict()) | {'register_tokens'}, where, source)
        inner = _convert_dinov2(inner)
        # Put back under its prefix, beside the file's other parts: load_pretrained takes it from
        # there and says what it took and left, as for every backbone (a ViT's load was silent on
        # the decode head and neck it dropped).
        state = ({**{k: v for k, v in state.items() if not k.startswith(prefix)}, **{prefix + k: v for k, v in inner.items()}}
                 if prefix else inner)
        kept = len(self.model.blocks)
        match = re.compile(r'blocks\.(\d+)\.').match

        def pruned(key):  # blocks after the last feature block were dropped at build
            # ... not blocks the model was built without: a 12-block file in a 6-block model
            # loaded its first 6 and put the final norm, trained on block 11, after block 5.
            found = match(key)
            return bool(found) and kept <= int(found[1]) < self.built_depth

        model = self.model
        load_pretrained(model, state, allow_unused=pruned, band_map=band_map, input_key='patch_embed.proj.weight',
                        pos_embed_prefix=0 if getattr(model, 'no_embed_class', False) else model.num_prefix_tokens,
                        pos_embed_grid=tuple(model.patch_embed.grid_size), where=where,
                        origin=origin or (source if isinstance(source, (str, os.PathLike)) else None))

    def block_features(self, images_BCHW):
        """The normed outputs of the ``out_indices`` blocks as ``[B, D, h, w]`` token grids (what
        timm's ``forward_intermediates(norm=True)`` gives), before the pyramid."""
        take = sorted(set(self.out_indices))
        maps = self.model.forward_intermediates(images_BCHW, indices=take, norm=True, output_fmt='NCHW',
                                                intermediates_only=True)
        by_index = dict(zip(take, maps))
        return [by_index[i] for i in self.out_indices]

    def forward(self, images_BCHW):
        H, W = images_BCHW.shape[-2:]
        features = self.block_features(images_BCHW)
        if self.patch_size != 16:
            # Stride-14 (or 8...) tokens -> the stride-16 grid, so the pyramid gives strides 4..32.
            size = ((H + 15) // 16, (W + 15) // 16)  # integer arithmetic stays symbolic under export
            features = [F.interpolate(f, size=size, mode='bilinear', align_corners=False) for f in features]
        return self.neck(features)
