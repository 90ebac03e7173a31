"""Foundation-model backbones: any timm ViT (DINOv2 with registers, DeiT-3...) as a UperNet/FPN
encoder at any crop, pretrained loading that is exact or refused, band maps, Swin sizes.

No network: timm models are built with random weights and tiny depth/width, and their state dict
saved as the "pretrained file"."""
import re

import numpy as np
import pytest
import torch

import ds_seg  # noqa: F401  (registers the zoo)
from ds_seg.config import ConfigError
from ds_seg.models.common import BACKBONES
from ds_seg.registry import MODELS, build

TINY = dict(depth=4, embed_dim=64, num_heads=2)
DINO = 'vit_small_patch14_reg4_dinov2'


def _timm(name, **kwargs):
    import timm
    torch.manual_seed(7)
    return timm.create_model(name, pretrained=False, **dict(TINY, **kwargs)).eval()


def _save(tmp_path, model, name='weights.pth'):
    path = str(tmp_path / name)
    torch.save(model.state_dict(), path)
    return path


def test_timm_backbone_over_a_vit_loads_its_weights(tmp_path):
    """Defect 1: timm's FeatureGetterNet holds a ViT as ``model.``; the key map must strip it."""
    ref = _timm('deit3_small_patch16_224')
    enc = build(BACKBONES, dict(type='TimmBackbone', name='deit3_small_patch16_224', pretrained=_save(tmp_path, ref),
                                **TINY))
    ours, theirs = enc.model.state_dict(), ref.state_dict()
    assert len(ours) > 10
    for key, value in ours.items():   # every tensor of the feature net holds the file's
        torch.testing.assert_close(value, theirs[key.removeprefix('model.')], rtol=0, atol=0, msg=key)


def test_load_refuses_tensors_it_would_drop(tmp_path):
    """Defect 2: a DINOv2-like file (LayerScale gammas) into the zoo's ViT is refused, naming them;
    a classifier head is dropped; a shape mismatch names the tensor."""
    cfg = dict(type='ViT', variant='vit_tiny_test', embed_dim=32, depth=2, num_heads=2, mlp_ratio=4.0, img_size=224)
    with_ls = _timm('vit_small_patch16_224', embed_dim=32, depth=2, num_heads=2, init_values=1e-5)
    with pytest.raises(ConfigError, match=r'blocks\.0\.ls1\.gamma'):
        build(BACKBONES, dict(cfg, pretrained=_save(tmp_path, with_ls)))
    plain = _timm('vit_small_patch16_224', embed_dim=32, depth=2, num_heads=2)  # holds head.weight/bias
    vit = build(BACKBONES, dict(cfg, pretrained=_save(tmp_path, plain, 'plain.pth')))
    torch.testing.assert_close(vit.blocks[1].mlp.fc2.weight, plain.blocks[1].mlp.fc2.weight, rtol=0, atol=0)
    state = plain.state_dict()
    state['blocks.1.mlp.fc1.weight'] = state['blocks.1.mlp.fc1.weight'][:64]
    with pytest.raises(ConfigError, match=r'blocks\.1\.mlp\.fc1\.weight has shape \(64, 32\)'):
        build(BACKBONES, dict(cfg, pretrained=state))


def test_dinov2_reg4_features_equal_timm_at_518_and_upernet_runs_at_512(tmp_path):
    """Defect 3 and the feature check: a patch-14 DINOv2-reg4 loaded from a file gives timm's block
    features within 1e-5 at 518; UperNet over it runs at a 512 crop with strides 4/8/16/32."""
    ref = _timm(DINO, img_size=518)
    path = _save(tmp_path, ref)
    model = build(MODELS, dict(type='UperNet', backbone=DINO, pretrained=path, channels=32, num_classes=5,
                               backbone_kwargs=TINY)).eval()
    enc = model.backbone
    assert type(enc).__name__ == 'TimmViT' and enc.strides == [4, 8, 16, 32]
    x = torch.randn(1, 3, 518, 518)
    with torch.no_grad():
        ours = enc.block_features(x)
        theirs = ref.forward_intermediates(x, indices=enc.out_indices, norm=True, intermediates_only=True)
        logits = model(torch.randn(2, 3, 512, 512))
        pyramid = enc(x)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert logits.shape == (2, 5, 512, 512)
    assert [f.shape[-1] for f in pyramid] == [132, 66, 33, 17]   # the stride-16 grid of 518, x4 .. /2


@pytest.mark.parametrize('name', [DINO, 'deit3_small_patch16_224'])
def test_token_layouts_load_at_another_size_like_timm(tmp_path, name):
    """Defect 5: register tokens / no class position embedding. A file at one grid loaded into a
    model at another equals timm's own model at that size loaded through timm's filter
    (antialiased-bicubic position-embedding resampling)."""
    from timm.models.vision_transformer import checkpoint_filter_fn
    src = _timm(name, img_size=518 if 'dinov2' in name else 160)
    path = _save(tmp_path, src)
    enc = build(BACKBONES, dict(type='TimmViT', name=name, img_size=224, pretrained=path, **TINY)).eval()
    ref = _timm(name, img_size=224)
    ref.load_state_dict(checkpoint_filter_fn(src.state_dict(), ref))
    assert not torch.equal(ref.pos_embed, _timm(name, img_size=224).pos_embed)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        for a, b in zip(enc.block_features(x), ref.forward_intermediates(x, indices=enc.out_indices, norm=True,
                                                                          intermediates_only=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize('nesting', ['plain', 'dino_teacher', 'block_chunks'])
def test_dinov2_release_layout_loads(tmp_path, nesting):
    """facebookresearch/dinov2 files: ``register_tokens``, a class position embedding, ``mask_token``;
    also as DINO training saves them, under teacher/'backbone.' (its register_tokens were not
    recognised under the prefix: refused as having no place in the model), and from a model built
    with block_chunks (``blocks.<chunk>.<i>.``: refused as blocks with no place in the model)."""
    ref = _timm(DINO, img_size=518)
    state = ref.state_dict()
    pos_cls = torch.randn(1, 1, 64)
    state['pos_embed'] = torch.cat([pos_cls, state['pos_embed']], dim=1)
    state['cls_token'] = state['cls_token'] - pos_cls
    state['register_tokens'] = state.pop('reg_token')
    state['mask_token'] = torch.zeros(1, 64)
    if nesting == 'block_chunks':   # two chunks of the blocks, each block under its own index
        half = (len(ref.blocks) + 1) // 2
        state = {re.sub(r'^blocks\.(\d+)\.', lambda m: f'blocks.{int(m[1]) // half}.{m[1]}.', k): v
                 for k, v in state.items()}
        assert any(k.startswith(f'blocks.1.{half}.') for k in state)
    if nesting in ('dino_teacher', 'block_chunks'):
        torch.save({'teacher': {'backbone.' + k: v for k, v in state.items()}, 'student': {}}, tmp_path / 'dino.pth')
        state = str(tmp_path / 'dino.pth')
    enc = build(BACKBONES, dict(type='TimmViT', name=DINO, img_size=518, pretrained=state, **TINY)).eval()
    x = torch.randn(1, 3, 518, 518)
    with torch.no_grad():
        torch.testing.assert_close(enc.block_features(x)[-1], ref.forward_intermediates(
            x, indices=enc.out_indices, norm=True, intermediates_only=True)[-1], rtol=0, atol=1e-5)


def test_band_map_takes_the_checkpoint_bands_the_data_has(tmp_path):
    """Prithvi-like 6-band weights on 4-band data: data band j sees the file's band band_map[j]."""
    src = _timm('vit_small_patch16_224', in_chans=6, dynamic_img_size=True)
    band_map = [2, 1, 0, 3]
    enc = build(BACKBONES, dict(type='TimmViT', name='vit_small_patch16_224', in_channels=4, band_map=band_map,
                                pretrained=_save(tmp_path, src), **TINY)).eval()
    x4 = torch.randn(1, 4, 64, 64)
    x6 = torch.zeros(1, 6, 64, 64)
    x6[:, band_map] = x4          # the same scene as the 6-band sensor would see it, other bands dark
    with torch.no_grad():
        torch.testing.assert_close(enc.block_features(x4)[-1], src.forward_intermediates(
            x6, indices=enc.out_indices, norm=True, intermediates_only=True)[-1], rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match='band_map'):
        build(BACKBONES, dict(type='TimmViT', name='vit_small_patch16_224', in_channels=4, band_map=[0, 1, 2, 9],
                              pretrained=_save(tmp_path, src), **TINY))


def test_swin_runs_at_the_crop_given_by_img_size():
    """Defect 4: img_size passes through UperNet to timm (Swin's window grid)."""
    model = build(MODELS, dict(type='UperNet', backbone='swin_tiny_patch4_window7_224', img_size=256, channels=16,
                               aux_head=False, backbone_kwargs=dict(embed_dim=16, depths=(1, 1, 1, 1),
                                                                    num_heads=(1, 1, 1, 1)))).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 256, 256)).shape == (1, 6, 256, 256)


def test_fpn_over_a_vit_any_crop():
    model = build(MODELS, dict(type='FPN', backbone='deit3_small_patch16_224', channels=16, backbone_kwargs=TINY))
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 200, 136)).shape == (1, 6, 200, 136)


@pytest.mark.parametrize('family', ['UperNet', 'FPN', 'DeepLabV3Plus'])
@pytest.mark.parametrize('backbone', ['test_convnext', 'test_efficientnet', 'test_byobnet', 'test_resnet'])
def test_every_head_takes_the_stride_4_to_32_levels_of_any_timm_family(family, backbone):
    """The levels a head gets are chosen by stride, not by index: FPN/DeepLabV3+ over a ConvNeXt
    (4 levels, stride 4 first) failed with an IndexError, and UperNet over a family not named
    resnet*/efficientnet* (stride-2 stem level first) fused its head at stride 2."""
    model = build(MODELS, dict(type=family, backbone=backbone, channels=16)).eval()
    # DeepLabV3+ at output stride 16: low-level, auxiliary (the level before the last) and ASPP inputs
    want = [4, 16, 16] if family == 'DeepLabV3Plus' else [4, 8, 16, 32]
    assert model.backbone.strides == want
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        features = model.backbone(x)
        assert [128 // f.shape[-1] for f in features] == want
        assert model(x).shape == (1, 6, 128, 128)


def test_an_unknown_or_featureless_timm_name_is_one_line():
    with pytest.raises(ConfigError, match=r"model\.backbone: timm has no model 'convnxt_tiny'\. Did you mean "
                                          r"'convnext_tiny'"):
        build(MODELS, dict(type='UperNet', backbone='convnxt_tiny'))
    with pytest.raises(ConfigError, match=r"levels must be one of"):
        build(BACKBONES, dict(type='TimmBackbone', name='test_resnet', levels='pyramid', out_indices=(1, 2)))


def test_negative_out_indices_count_from_the_last_block_and_out_of_range_is_one_line():
    """``out_indices=(-4, -3, -2, -1)`` (timm's convention) was clamped to block 0 for all four
    levels: it trained, on the first block's features only."""
    cfg = dict(type='UperNet', backbone='deit3_small_patch16_224', channels=16)
    negative = build(MODELS, dict(cfg, backbone_kwargs=dict(TINY, out_indices=(-4, -3, -2, -1))))
    assert negative.backbone.out_indices == [0, 1, 2, 3]
    ours = build(BACKBONES, dict(type='ViT', variant='vit_tiny_test', depth=6, out_indices=[-3, -2, -1, 5]))
    assert ours.out_indices == [3, 4, 5, 5]
    with torch.no_grad():
        assert [f.shape[1] for f in ours(torch.randn(1, 3, 64, 64))] == [ours.out_channels[0]] * 4
    for bad in ((1, 2, 3, 4), (0, 1, 2), (0, 1, 2, 'x')):
        with pytest.raises(ConfigError, match=r'out_indices must be 4 block indices in -4\.\.3'):
            build(MODELS, dict(cfg, backbone_kwargs=dict(TINY, out_indices=bad)))


def test_a_file_of_a_richer_cnn_is_refused_not_trimmed(tmp_path):
    """seresnet-like tensors (squeeze-excitation inside the kept stages) loaded into a plain
    ResNet were dropped without a word; the classifier head and final layers still are."""
    import timm
    plain = timm.create_model('resnet18', pretrained=False)
    state = plain.state_dict()
    torch.save(state, tmp_path / 'resnet18.pth')
    model = build(MODELS, dict(type='UperNet', backbone='resnet18', pretrained=str(tmp_path / 'resnet18.pth')))
    torch.testing.assert_close(model.backbone.model.layer4[1].conv2.weight, plain.layer4[1].conv2.weight)
    richer = timm.create_model('seresnet18', pretrained=False).state_dict()
    assert set(state) < set(richer)
    torch.save(richer, tmp_path / 'seresnet18.pth')
    with pytest.raises(ConfigError, match=r'have no place in the model .*layer1\.0\.se\.fc1'):
        build(MODELS, dict(type='UperNet', backbone='resnet18', pretrained=str(tmp_path / 'seresnet18.pth')))


def test_pretrained_files_as_released_load_and_broken_ones_are_one_line(tmp_path, monkeypatch):
    """A DDP-saved file ('module.' keys, nested under 'model') loads; a folder, a truncated
    .pth/.safetensors and a file of no tensors are one line naming the file (they were the
    reader's traceback, and a folder was said not to exist)."""
    import timm
    from safetensors.torch import save_file
    state = timm.create_model('test_resnet', pretrained=False).state_dict()
    torch.save({'epoch': 3, 'model': {f'module.{k}': v for k, v in state.items()}}, tmp_path / 'ddp.pth')
    model = build(MODELS, dict(type='FPN', backbone='test_resnet', pretrained=str(tmp_path / 'ddp.pth')))
    torch.testing.assert_close(model.backbone.model.layer1[0].conv1.weight, state['layer1.0.conv1.weight'])
    save_file(state, str(tmp_path / 'w.safetensors'))
    torch.save(state, tmp_path / 'w.pth')
    for name in ('w.safetensors', 'w.pth'):
        data = (tmp_path / name).read_bytes()
        (tmp_path / f'cut_{name}').write_bytes(data[:len(data) // 2])
    torch.save([1, 2], tmp_path / 'list.pth')
    # another network's names (no prefix removal makes them the model's)
    torch.save({f'param_{i}': v for i, v in enumerate(state.values())}, tmp_path / 'other.pth')
    (tmp_path / 'folder').mkdir()
    for name, message in (('folder', 'is a folder; give the weights file in it'),
                          ('cut_w.safetensors', 'is not a readable weights file'),
                          ('cut_w.pth', 'is not a readable weights file'),
                          ('list.pth', 'holds no state dict of tensors'),
                          ('other.pth', "the file's keys look like 'param_0'")):
        with pytest.raises(ConfigError, match=rf'test_resnet pretrained: .*{message}') as info:
            build(MODELS, dict(type='FPN', backbone='test_resnet', pretrained=str(tmp_path / name)))
        assert '\n' not in str(info.value)
    # '~' as written in a config is the home folder; a URL (as mmseg configs give) is named as one
    monkeypatch.setenv('HOME', str(tmp_path))
    build(MODELS, dict(type='FPN', backbone='test_resnet', pretrained='~/w.pth'))
    with pytest.raises(ConfigError, match=r'https://host/r50\.pth is a URL; download the file'):
        build(MODELS, dict(type='FPN', backbone='test_resnet', pretrained='https://host/r50.pth'))


def test_a_band_map_not_of_one_entry_per_data_band_is_refused(tmp_path):
    """band_map=[0, 1, 2] on 4-band data built a 3-band weight that was then adapted to 4 bands as
    if it were RGB, and 5 entries were averaged away: the mapping asked for was silently lost."""
    path = _save(tmp_path, _timm('vit_small_patch16_224', in_chans=6))
    cfg = dict(type='UperNet', backbone='vit_small_patch16_224', in_channels=4, pretrained=path, channels=16,
               backbone_kwargs=TINY)
    for band_map, entries in (([0, 1, 2], 3), ([0, 1, 2, 3, 4], 5), (3, 'no')):
        with pytest.raises(ConfigError, match=rf'model\.band_map: .* has {entries} entries for in_channels=4'):
            build(MODELS, dict(cfg, band_map=band_map))
    with pytest.raises(ConfigError, match=r'\[True\] are not band indices'):
        build(MODELS, dict(cfg, band_map=[0, 1, 2, True]))


@pytest.mark.parametrize('name', ['test_resnet', 'test_convnext', 'test_efficientnet',
                                  # timm's feature wrapper flattens stem.conv, features.conv0...: a
                                  # file of these classifiers was refused as lacking tensors
                                  'resnetv2_18', 'densenet121', 'cs3darknet_s', 'efficientvit_b0', 'dpn68'])
def test_cnn_features_equal_timm_with_the_same_weights(tmp_path, name):
    """The CNN counterpart of the DINOv2 check: the encoder of UperNet over a timm CNN, loaded from
    the classifier's file, gives the maps timm's own features_only model loaded by timm from the
    same file gives at strides 4-32, bit for bit."""
    import timm
    torch.manual_seed(5)
    path = _save(tmp_path, timm.create_model(name, pretrained=False))
    model = build(MODELS, dict(type='UperNet', backbone=name, pretrained=path, channels=16)).eval()
    reference = timm.create_model(name, features_only=True, pretrained=True,
                                  pretrained_cfg_overlay=dict(file=path)).eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        theirs = [f for f, s in zip(reference(x), reference.feature_info.reduction()) if s >= 4]
        ours = model.backbone(x)
    assert len(ours) == 4 and [f.shape for f in ours] == [f.shape for f in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_released_checkpoints_with_the_backbone_under_a_prefix_load(tmp_path):
    """mmseg/mmpretrain checkpoints hold the encoder under 'backbone.' beside a decode head, and
    DINO's hold it under teacher/'backbone.' beside a student: they were refused ("none matched");
    the tensors under the prefix are taken, exactly."""
    import timm
    state = timm.create_model('test_resnet', pretrained=False).state_dict()
    mmseg = {'meta': {'epoch': 80}, 'state_dict': {**{'backbone.' + k: v for k, v in state.items()},
                                                    'decode_head.conv_seg.weight': torch.zeros(6, 8, 1, 1)}}
    dino = {'student': {'backbone.' + k: v + 1 for k, v in state.items()},
            'teacher': {**{'backbone.' + k: v for k, v in state.items()}, 'head.mlp.0.weight': torch.zeros(4, 4)}}
    # DINOv2's training checkpoints hold both in one dict ('model': student.backbone., teacher.backbone.):
    # the student came first by name and was loaded. timm's hold the EMA beside the raw weights.
    dinov2 = {'iteration': 5, 'model': {**{'student.backbone.' + k: v + 1 for k, v in state.items()},
                                        **{'teacher.backbone.' + k: v for k, v in state.items()}}}
    timm_train = {'epoch': 3, 'state_dict': {k: v + 1 for k, v in state.items()}, 'state_dict_ema': state}
    ema = {'model.' + k: v + 1 for k, v in state.items()} | {'model_ema.' + k: v for k, v in state.items()}
    for name, payload in (('mmseg.pth', mmseg), ('dino.pth', dino), ('dinov2_train.pth', dinov2),
                          ('timm_train.pth.tar', timm_train), ('ema.pth', ema)):
        torch.save(payload, tmp_path / name)
        model = build(MODELS, dict(type='FPN', backbone='test_resnet', pretrained=str(tmp_path / name)))
        loaded = model.backbone.model.state_dict()
        assert len(loaded) > 10
        if name == 'mmseg.pth':   # the report names the part taken, and what of the file was left
            report = next(m.pretrained_report for m in model.modules() if getattr(m, 'pretrained_report', None))
            assert report.endswith("; taken from under 'backbone.', the file's decode_head. (1) not used (load_from= "
                                   "starts from a whole model)"), report
        for key, value in loaded.items():
            if not key.endswith('num_batches_tracked'):
                torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=f'{name}: {key}')
    # Two copies neither of which is the one a release takes: refused, not the first by name.
    torch.save({'a.' + k: v for k, v in state.items()} | {'b.' + k: v + 1 for k, v in state.items()},
               tmp_path / 'two.pth')
    with pytest.raises(ConfigError, match=r"two.pth holds the weights twice or more, under a., b., and none is a "
                                          r"teacher or EMA copy"):
        build(MODELS, dict(type='FPN', backbone='test_resnet', pretrained=str(tmp_path / 'two.pth')))


def test_a_pretrained_file_is_exact_for_timm_cnns_too(tmp_path):
    """A stray tensor of the file was dropped without a word for timm CNN backbones (anything
    outside the parts the wrapper kept counted as pruned), and a deeper conv that differed only in
    input channels (a depthwise [C, 1, 3, 3] of efficientnet_b0_gn into the grouped [C, 8, 3, 3]
    of efficientnet_b0_g8_gn) was 'adapted' as if it took the image's bands."""
    import timm
    state = timm.create_model('resnet18', pretrained=False).state_dict()
    torch.save(dict(state, extra_thing=torch.zeros(2)), tmp_path / 'extra.pth')
    with pytest.raises(ConfigError, match=r'1 tensor\(s\) of the weights have no place in the model .*extra_thing'):
        build(MODELS, dict(type='UperNet', backbone='resnet18', pretrained=str(tmp_path / 'extra.pth')))
    torch.save(state, tmp_path / 'r18.pth')   # its fc. and the rest load as before, at any band count
    build(MODELS, dict(type='UperNet', backbone='resnet18', pretrained=str(tmp_path / 'r18.pth'), in_channels=4))
    torch.save(timm.create_model('efficientnet_b0_gn', pretrained=False).state_dict(), tmp_path / 'gn.pth')
    with pytest.raises(ConfigError, match=r'blocks.0.0.conv_dw.weight has shape \(32, 1, 3, 3\) in the weights '
                                          r'but \(32, 8, 3, 3\) in the model'):
        build(MODELS, dict(type='FPN', backbone='efficientnet_b0_g8_gn', pretrained=str(tmp_path / 'gn.pth')))


@pytest.mark.parametrize('file_model, name', [(dict(name='vit_small_patch14_dinov2'), DINO),
                                              (dict(name='vit_small_patch16_224', class_token=False,
                                                    global_pool='avg'), 'vit_small_patch16_224')])
def test_a_vit_file_of_another_token_layout_is_one_line(tmp_path, file_model, name):
    """A DINOv2 file without registers for the reg4 model, a ViT without a class token for one
    with: timm's resize of the position embeddings failed with "shape '[1, 37, 37, -1]' is
    invalid", a traceback. Now one line naming pos_embed and the token layout."""
    import timm
    path = _save(tmp_path, timm.create_model(file_model.pop('name'), pretrained=False, **TINY, **file_model))
    with pytest.raises(ConfigError, match=r'^.* pretrained: pos_embed holds \d+ positions in the weights, .* '
                                          r'another token layout .*give the file of this model\.$'):
        build(MODELS, dict(type='UperNet', backbone=name, pretrained=path, channels=16, backbone_kwargs=TINY))


def test_dinov2_giant_swiglu_release_layout_loads():
    """ViT-g's MLP is SwiGLU: w12/w3 in facebookresearch/dinov2 files, fc1/fc2 in timm. Those
    files were refused ('16 tensor(s) have no place: blocks.0.mlp.w12.bias...'); they load as
    timm's own loader takes them."""
    name = 'vit_giant_patch14_reg4_dinov2'
    ref = _timm(name, mlp_ratio=4.0, img_size=56)
    state = {k.replace('mlp.fc1.', 'mlp.w12.').replace('mlp.fc2.', 'mlp.w3.'): v for k, v in ref.state_dict().items()}
    assert any('mlp.w12.' in k for k in state)
    state['register_tokens'] = state.pop('reg_token')
    pos_cls = torch.randn(1, 1, 64)
    state['pos_embed'] = torch.cat([pos_cls, state['pos_embed']], dim=1)
    state['cls_token'] = state['cls_token'] - pos_cls
    enc = build(BACKBONES, dict(type='TimmViT', name=name, img_size=56, pretrained=state, mlp_ratio=4.0,
                                **TINY)).eval()
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(enc.block_features(x)[-1], ref.forward_intermediates(
            x, indices=enc.out_indices, norm=True, intermediates_only=True)[-1], rtol=0, atol=1e-5)


def test_a_multispectral_cnn_file_needs_a_band_map_and_takes_one(tmp_path):
    """A 4-band ResNet file on 3-band data gave every data band the mean of the file's four
    filters (the colour information gone, without a word); band_map was for ViTs only. Now the
    file is refused without band_map, and band_map picks the file's filters for a CNN too."""
    import timm
    torch.manual_seed(0)
    src = timm.create_model('resnet18', in_chans=4, pretrained=False)
    path = _save(tmp_path, src)
    cfg = dict(type='UperNet', backbone='resnet18', pretrained=path, channels=16)
    with pytest.raises(ConfigError, match=r"^resnet18 pretrained: the weights' first layer conv1.weight takes 4 "
                                          r"bands, the data has 3; .*model\.band_map=\[\.\.\.\]"):
        build(MODELS, cfg)
    model = build(MODELS, dict(cfg, band_map=[2, 1, 0]))
    assert torch.equal(model.backbone.model.conv1.weight, src.conv1.weight[:, [2, 1, 0]])
    with pytest.raises(ConfigError, match='band_map maps the bands of a pretrained file'):
        build(MODELS, dict(cfg, pretrained=False, band_map=[2, 1, 0]))
    # More data bands than the file's: which they are cannot be guessed either (its four filters
    # went to the first four data bands by position); band_map says it.
    with pytest.raises(ConfigError, match=r"takes 4 bands, the data has 6; .*model\.band_map=\[\.\.\.\]"):
        build(MODELS, dict(cfg, in_channels=6))
    wider = build(MODELS, dict(cfg, in_channels=6, band_map=[0, 1, 2, 3, None, None]))
    # New bands (None) get the mean filter, and all are scaled by 4/6, as RGB weights are adapted.
    torch.testing.assert_close(wider.backbone.model.conv1.weight[:, :4], src.conv1.weight * (4 / 6), rtol=0, atol=1e-7)
    torch.testing.assert_close(wider.backbone.model.conv1.weight[:, 4], src.conv1.weight.mean(1) * (4 / 6), rtol=0,
                               atol=1e-7)
    # [0, 1, 2, None] on RGB weights is what no band_map gives (it was 4/3 of it).
    rgb = timm.create_model('resnet18', in_chans=3, pretrained=False)
    rgb_cfg = dict(cfg, pretrained=_save(tmp_path, rgb, 'rgb.pth'), in_channels=4)
    torch.testing.assert_close(build(MODELS, dict(rgb_cfg, band_map=[0, 1, 2, None])).backbone.model.conv1.weight,
                               build(MODELS, rgb_cfg).backbone.model.conv1.weight, rtol=0, atol=0)


@pytest.mark.parametrize('backbone', ['convnext_atto', 'efficientnet_b0'])
def test_a_ds_seg_model_file_is_a_pretrained_file_of_its_backbone(tmp_path, backbone):
    """A segmentor's own state dict (backbone.model.stages_0..., timm's feature-wrapper names) was
    refused as pretrained for ConvNeXt ('none of the weights' tensors match'), while a ResNet's
    loaded: only a classifier's names were looked for."""
    torch.manual_seed(0)
    path = _save(tmp_path, build(MODELS, dict(type='UperNet', backbone=backbone, channels=16)))
    source = torch.load(path)
    model = build(MODELS, dict(type='UperNet', backbone=backbone, channels=16, pretrained=path))
    own = model.backbone.state_dict()
    assert own and all(torch.equal(v, source[f'backbone.{k}']) for k, v in own.items())


@pytest.mark.parametrize('cfg, message', [
    (dict(type='UperNet', backbone=dict(type='ResNet', depth=50)),
     r"^model\.backbone: a timm model name .*got \{'type': 'ResNet', 'depth': 50\}; .*backbone_kwargs\.$"),
    (dict(type='UperNet', backbone='xcit_nano_12_p16_224'),
     r"^model\.backbone 'xcit_nano_12_p16_224': timm's features have strides \[16, 16, 16\], one scale"),
    (dict(type='FPN', backbone='mixer_s32_224'), r"^model\.backbone 'mixer_s32_224': .*strides \[32, 32, 32\]"),
    (dict(type='DeepLabV3Plus', backbone='vit_tiny_patch16_224', output_stride=8),
     r"^model\.backbone: DeepLabV3Plus dilates a CNN .*'vit_tiny_patch16_224' is a ViT"),
])
def test_backbones_a_head_cannot_use_are_one_line(cfg, message):
    """An mmseg-style backbone dict was a KeyError traceback inside timm; one-stride models (XCiT,
    MLP-Mixer, BEiT...) gave UperNet/FPN three maps of one stride and trained without a word; a ViT
    under DeepLabV3+ dropped output_stride (ASPP on the stride-32 map) and failed under DDP."""
    with pytest.raises(ConfigError, match=message):
        build(MODELS, cfg, where='model')


def test_dilated_cnns_keep_their_pyramid_and_band_mapped_models_load_for_prediction(tmp_path):
    """The review of the checks above: a dilated ResNet (strides 4, 8, 16, 16) is still a pyramid
    for UperNet; a model trained with band_map loads from its weights file for predict/export
    (the recorded band_map was refused without the pretrained file); band_map also takes a ds_seg
    segmentor's own file (stem_0.weight for timm's stem.0.weight) and works under DeepLabV3+."""
    import timm
    from ds_seg.inference import load_model
    assert build(MODELS, dict(type='UperNet', backbone='resnet18', channels=16,
                              backbone_kwargs=dict(output_stride=16))).backbone.strides == [4, 8, 16, 16]
    torch.manual_seed(0)
    six = _save(tmp_path, timm.create_model('resnet18', in_chans=6, pretrained=False), 'six.pth')
    cfg = dict(type='UperNet', backbone='resnet18', in_channels=4, pretrained=six, band_map=[0, 1, 2, 5],
               channels=16)
    model = build(MODELS, cfg)
    weights = str(tmp_path / 'w.pt')
    torch.save({'state_dict': model.state_dict(), 'model': cfg, 'classes': list('abcdef')}, weights)
    loaded, info = load_model(weights)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ConfigError, match=r"first layer conv1.weight takes 6 bands, the data has 4; .*model\.band_map"):
        build(MODELS, dict(type='DeepLabV3Plus', backbone='resnet18', in_channels=4, pretrained=six, channels=16))
    # On more data bands than the file's 6 (13-band Sentinel-2) its filters went to data bands 1-6 by
    # position, without a word; a 2-band (SAR) file likewise on 3 bands. Only RGB and grey adapt.
    with pytest.raises(ConfigError, match=r"first layer conv1.weight takes 6 bands, the data has 13; .*model\.band_map"):
        build(MODELS, dict(type='UperNet', backbone='resnet18', in_channels=13, pretrained=six, channels=16))
    two = _save(tmp_path, timm.create_model('resnet18', in_chans=2, pretrained=False), 'two.pth')
    with pytest.raises(ConfigError, match=r"first layer conv1.weight takes 2 bands, the data has 3; .*model\.band_map"):
        build(MODELS, dict(type='UperNet', backbone='resnet18', in_channels=3, pretrained=two, channels=16))
    build(MODELS, dict(type='UperNet', backbone='resnet18', in_channels=13, pretrained=six, channels=16,
                       band_map=[0, 1, 2, 3, 4, 5] + [None] * 7))
    dlv3 = build(MODELS, dict(type='DeepLabV3Plus', backbone='resnet18', in_channels=4, pretrained=six,
                              band_map=[0, 1, 2, 5], channels=16))
    source = torch.load(six)
    assert torch.equal(dlv3.backbone.model.conv1.weight, source['conv1.weight'][:, [0, 1, 2, 5]])
    segmentor = build(MODELS, dict(type='FPN', backbone='convnext_atto', in_channels=6, channels=16))
    own = _save(tmp_path, segmentor, 'own.pth')
    mapped = build(MODELS, dict(type='FPN', backbone='convnext_atto', in_channels=4, channels=16, pretrained=own,
                                band_map=[3, 2, 1, 0]))
    assert torch.equal(mapped.backbone.model.stem_0.weight, segmentor.backbone.model.stem_0.weight[:, [3, 2, 1, 0]])


def test_a_deeper_vit_file_is_refused_by_a_shallower_timm_vit_and_pruning_still_loads(tmp_path):
    """A 4-block file into TimmViT(depth=2) loaded its first 2 blocks without a word: blocks 2-3
    were excused as if pruned after the last feature block, and the file's final norm (trained on
    block 3's output) ran after block 1. Blocks the model was built with and pruned still load."""
    path = _save(tmp_path, _timm('vit_small_patch16_224'))
    with pytest.raises(ConfigError, match=r'no place in the model.*blocks\.[23]\.'):
        build(BACKBONES, dict(type='TimmViT', name='vit_small_patch16_224', pretrained=path, **dict(TINY, depth=2)))
    enc = build(BACKBONES, dict(type='TimmViT', name='vit_small_patch16_224', pretrained=path, out_indices=(0, 0, 1, 1),
                                **TINY))
    assert len(enc.model.blocks) == 2   # blocks 2-3 of the 4 built were pruned, their weights excused
    torch.testing.assert_close(enc.model.blocks[1].mlp.fc2.weight, _timm('vit_small_patch16_224').blocks[1].mlp.fc2.weight,
                               rtol=0, atol=0)


def test_the_trainer_says_what_the_pretrained_load_took_and_adapted(tmp_path, capsys):
    """A pretrained file was loaded (or its first layer adapted to the data's bands) without a
    line: the log did not say whether the weights were used at all. The trainer now prints the
    count, the file, what starts fresh and each adaptation."""
    import timm
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import ds_config, tiny_cfg
    path = tmp_path / 'resnet.pth'
    torch.save(timm.create_model('test_resnet', pretrained=False).state_dict(), path)
    cfg = tiny_cfg(tmp_path / 'cache', max_steps=1)
    cfg.data.train.bands = cfg.data.val.bands = 4
    cfg.model = dict(type='FPN', backbone='test_resnet', channels=16, num_classes=6, in_channels=4,
                     pretrained=str(path))
    trainer = Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp_path / 'work'))
    trainer.close()
    backbone = timm.create_model('test_resnet', features_only=True)
    said = [line for line in capsys.readouterr().out.splitlines() if 'test_resnet pretrained:' in line]
    assert said == [f'[ds_seg] test_resnet pretrained: {len(backbone.state_dict())} tensors loaded from {path}; '
                    'first layer conv1.0.weight adapted from 3 to 4 band(s) (its filters kept on data bands 1-3, each '
                    'further band their mean; model.band_map for data in another band order)'], said


def test_rgb_weights_on_files_tagged_in_another_colour_order_need_a_band_map(tmp_path):
    """BGR files (their tags say so) under an RGB-pretrained backbone: ImageNet's red filters ran
    on the blue band, the log saying only how many tensors loaded. Refused with the band_map that
    puts each filter on its colour; a band_map given (that one, or position kept) is taken."""
    import rasterio
    from mmengine.config import ConfigDict
    from rasterio.enums import ColorInterp
    from rasterio.transform import from_origin

    from ds_seg.data import GeoTiffScenes
    from ds_seg.engine.trainer import refuse_rgb_weights_by_position
    rng = np.random.default_rng(0)

    def scene(name, order):
        path = str(tmp_path / f'{name}.tif')
        with rasterio.open(path, 'w', driver='GTiff', width=32, height=32, count=len(order), dtype='uint8',
                           crs='EPSG:32632', transform=from_origin(0, 32, 1, 1), photometric='MINISBLACK') as dst:
            dst.write(rng.integers(0, 255, (len(order), 32, 32), dtype=np.uint8))
            dst.colorinterp = [getattr(ColorInterp, c) for c in order]
        return path
    label = str(tmp_path / 'label.tif')
    with rasterio.open(label, 'w', driver='GTiff', width=32, height=32, count=1, dtype='uint8', crs='EPSG:32632',
                       transform=from_origin(0, 32, 1, 1)) as dst:
        dst.write(rng.integers(0, 2, (1, 32, 32), dtype=np.uint8))
    cfg = ConfigDict(type='UperNet', backbone='resnet18', pretrained='weights.pth', in_channels=4)
    nir_first = GeoTiffScenes([scene('nbgr', ['undefined', 'blue', 'green', 'red'])], [label], crop_size=32, classes=2)
    with pytest.raises(ConfigError, match=r"^model.pretrained: its first layer would go to the data's bands by position "
                                          r"\(the RGB filters on bands 1, 2, 3\), but data.train's files tag bands 2 "
                                          r"blue, 3 green, 4 red; set model.band_map=\[None, 2, 1, 0\] to put each "
                                          r"filter on its colour \(or band_map=\[0, 1, 2, None\] to keep position\)$"):
        refuse_rgb_weights_by_position(cfg, nir_first)
    refuse_rgb_weights_by_position(ConfigDict(cfg, band_map=[None, 2, 1, 0]), nir_first)
    refuse_rgb_weights_by_position(ConfigDict(cfg, pretrained=None), nir_first)
    rgbn = GeoTiffScenes([scene('rgbn', ['red', 'green', 'blue', 'undefined'])], [label], crop_size=32, classes=2)
    refuse_rgb_weights_by_position(cfg, rgbn)
    refuse_rgb_weights_by_position(ConfigDict(type='UNet', in_channels=4), nir_first)   # no pretrained weights


def test_the_band_layer_of_a_backbone_whose_first_4d_weight_is_a_position_embedding(tmp_path):
    """Hiera (SAM 2), PiT, Visformer, TNT and VOLO hold a 4-d position embedding before their
    first convolution: band_map rewrote that embedding (93 of 96 channels made one mean) and left
    the first layer in the file's band order, and 4-band data was refused as 'another shape'."""
    import timm

    from ds_seg.registry import MODELS, build
    name = 'sam2_hiera_tiny'
    weights = tmp_path / f'{name}.pth'
    torch.manual_seed(0)
    torch.save(timm.create_model(name).state_dict(), weights)
    file = torch.load(weights)
    assert file['pos_embed'].dim() == 4   # what made it the "first 4-d weight"
    cfg = dict(type='UperNet', backbone=name, pretrained=str(weights), num_classes=4, channels=16)
    bgr = build(MODELS, dict(cfg, in_channels=3, band_map=[2, 1, 0])).backbone.model.model
    assert torch.equal(bgr.patch_embed.proj.weight, file['patch_embed.proj.weight'][:, [2, 1, 0]])
    assert torch.equal(bgr.pos_embed, file['pos_embed'])
    four = build(MODELS, dict(cfg, in_channels=4)).backbone.model.model
    w = four.patch_embed.proj.weight
    assert w.shape[1] == 4 and torch.equal(four.pos_embed, file['pos_embed'])
    assert torch.allclose(w[:, :3], file['patch_embed.proj.weight'] * 3 / 4)   # RGB kept, scaled for the 4th


def test_a_vit_taken_from_under_a_prefix_says_what_of_the_file_was_left(tmp_path):
    """CNN backbones said "taken from under 'backbone.', the file's decode_head. (1) not used"; a
    timm ViT took the same kind of file (mmseg/mmpretrain, a whole ds_seg export) without a word
    on the parts it dropped."""
    import timm
    state = timm.create_model('test_vit', pretrained=False, num_classes=0).state_dict()
    torch.save({'state_dict': {**{'backbone.' + k: v for k, v in state.items()},
                               'decode_head.conv_seg.weight': torch.zeros(6, 8, 1, 1)}}, tmp_path / 'mmseg.pth')
    model = build(MODELS, dict(type='UperNet', backbone='test_vit', pretrained=str(tmp_path / 'mmseg.pth')))
    report = next(m.pretrained_report for m in model.modules() if getattr(m, 'pretrained_report', None))
    assert report.endswith("; taken from under 'backbone.', the file's decode_head. (1) not used (load_from= "
                           "starts from a whole model)"), report
    for key, value in model.backbone.model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)


def test_swin_weights_load_at_an_img_size_whose_last_windows_shrink_as_timm_loads_them(tmp_path):
    """Swin v1 at img_size 192 or 64: a stage whose grid is under the 7-px window gets a smaller
    window and relative-position table; timm's own load resizes the table, ds_seg refused the
    file ('(169, 1) in the weights but (121, 1) in the model'). Now equal to timm's load."""
    import timm
    name, kw = 'swin_tiny_patch4_window7_224', dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))
    path = str(tmp_path / 'swin.pth')
    torch.save(timm.create_model(name, **kw).state_dict(), path)
    for size in (192, 64):
        ref = timm.create_model(name, img_size=size, pretrained=True, pretrained_cfg_overlay=dict(file=path), **kw)
        ours = build(MODELS, dict(type='UperNet', backbone=name, img_size=size, pretrained=path, backbone_kwargs=kw))
        tables = {k: v for k, v in ours.backbone.model.state_dict().items() if k.endswith('relative_position_bias_table')}
        theirs = {k: v for k, v in ref.state_dict().items() if k.endswith('relative_position_bias_table')}
        assert len(tables) == len(theirs) == 4
        for (k, v), (k_ref, v_ref) in zip(sorted(tables.items()), sorted(theirs.items())):
            torch.testing.assert_close(v, v_ref, rtol=0, atol=0, msg=f'{size}: {k} vs {k_ref}')
        assert any(v.shape != timm.create_model(name, **kw).state_dict()[k_ref].shape for k_ref, v in theirs.items())
