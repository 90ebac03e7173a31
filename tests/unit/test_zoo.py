"""Behaviour of every zoo model (tiny variants from the registry): shapes at odd sizes, any band
count, checkpointing equivalence, FLOP and parameter figures, pretrained first-layer adaptation."""
import os
import re
import sys

import pytest
import torch
from torch import nn

import ds_seg  # noqa: F401  (registers everything)
from ds_seg.config import ConfigError
from ds_seg.models import segmentation_loss
from ds_seg.models.common import BACKBONES, num_params
from ds_seg.models.pretrained import adapt_input_weight
from ds_seg.registry import MODELS, RegistryError, build
from ds_seg.telemetry import forward_flops

TINY = sorted(n for n, m in MODELS.module_dict.items()
              if m.__module__ == 'ds_seg.models.segmentor' and n.endswith('Tiny'))


def make(name, **kwargs):
    torch.manual_seed(0)
    return build(MODELS, dict(type=name, **kwargs))


def logits_of(out):
    return out['logits'] if isinstance(out, dict) else out


def test_every_family_has_a_tiny_variant():
    assert TINY == ['DeepLabV3PlusTiny', 'FPNTiny', 'SegFormerTiny', 'UperNetTiny', 'UperNetViTTiny']
    for name in TINY:
        assert name[:-len('Tiny')] in MODELS.module_dict


@pytest.mark.parametrize('name', TINY)
@pytest.mark.parametrize('size', [(64, 64), (70, 45), (33, 47), (1, 1), (5, 300), (17, 23)])
def test_logits_at_input_resolution(name, size):
    model = make(name, num_classes=5, aux_head=True)
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, *size)).shape == (2, 5, *size)
        out = model.train()(torch.randn(2, 3, *size))
    # Training mode with an auxiliary head: both outputs at the input size.
    assert out['logits'].shape == out['aux'][0][1].shape == (2, 5, *size)
    assert out['aux'][0][0] == pytest.approx(0.4)


@pytest.mark.parametrize('name', TINY + ['UperNet:test_convnext'])
def test_the_last_row_and_column_reach_the_logits_at_an_odd_size(name):
    """A ConvNeXt stem (4x4, stride 4, no padding) floors the size: at 65x97 the last row and
    column changed no logit, and the 64x96 feature grids were stretched over 65x97."""
    name, _, backbone = name.partition(':')
    model = make(name, num_classes=5, **({'backbone': backbone, 'channels': 16} if backbone else {})).eval()
    x = torch.randn(1, 3, 65, 97)
    edited = x.clone()
    edited[..., -1, :] += 3.0
    edited[..., :, -1] += 3.0
    with torch.no_grad():
        change = (logits_of(model(x)) - logits_of(model(edited))).abs()
    assert change[..., -1, :].amax() > 1e-3 and change[..., :, -1].amax() > 1e-3


@pytest.mark.parametrize('name', TINY)
@pytest.mark.parametrize('in_channels', [1, 4, 13])
def test_any_band_count_trains_every_parameter(name, in_channels):
    model = make(name, in_channels=in_channels, num_classes=6, aux_head=True).train()
    labels_BHW = torch.randint(0, 6, (2, 48, 48))
    loss = segmentation_loss(nn.CrossEntropyLoss(), model(torch.randn(2, in_channels, 48, 48)), labels_BHW)
    loss.backward()
    nonzero = 0
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        nonzero += bool(p.grad.abs().sum() > 0)
        if not pname.startswith('backbone.'):
            assert p.grad.abs().sum() > 0, pname
    # timm ResNets zero-initialise each block's last BN scale, so that block's earlier weights
    # start with zero gradient; everything else, the adapted first layer included, learns.
    assert nonzero >= 0.7 * len(list(model.parameters()))
    first = next(p for p in model.backbone.parameters() if p.dim() == 4)
    assert first.shape[1] == in_channels and first.grad.abs().sum() > 0


def _step(model, images_BCHW, labels_BHW):
    torch.manual_seed(1)  # the same dropout masks in both models
    loss = segmentation_loss(nn.CrossEntropyLoss(), model(images_BCHW), labels_BHW)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize('name', TINY)
def test_activation_checkpointing_same_loss_and_gradients(name, monkeypatch):
    import ds_seg.models.common as common
    calls = []
    real = common.checkpoint
    monkeypatch.setattr(common, 'checkpoint', lambda block, *a, **k: calls.append(block) or real(block, *a, **k))
    plain = make(name, aux_head=True).train()
    ckpt = make(name, aux_head=True, activation_checkpointing=True).train()
    ckpt.load_state_dict(plain.state_dict())
    images_BCHW, labels_BHW = torch.randn(2, 3, 40, 56), torch.randint(0, 6, (2, 40, 56))
    for _ in range(2):  # a second BN-statistics update during recomputation would show
        loss_plain, grads_plain = _step(plain, images_BCHW, labels_BHW)
        loss_ckpt, grads_ckpt = _step(ckpt, images_BCHW, labels_BHW)
        torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-6, atol=0)
        for n in grads_plain:
            torch.testing.assert_close(grads_ckpt[n], grads_plain[n], rtol=1e-5, atol=1e-6, msg=n)
    assert len(calls) >= 8, 'every encoder block is checkpointed'
    buffers = dict(plain.named_buffers())
    for n, b in ckpt.named_buffers():
        torch.testing.assert_close(b, buffers[n], rtol=0, atol=0, msg=n)


def _gflops(cfg, size=512, in_channels=3):
    return forward_flops(lambda: build(MODELS, cfg), (1, in_channels, size, size)) / 1e9


def test_flops_match_published_figures():
    # FlopCounterMode counts a multiply-add as 2 FLOPs. UNet base 64: 385 GFLOP at 512.
    assert _gflops(dict(type='UNet', num_classes=6)) == pytest.approx(385, rel=0.03)
    # SegFormer-B0, 256-channel all-MLP head: 8.4 G multiply-adds published for ADE20K (150 classes).
    assert _gflops(dict(type='SegFormer', variant='mit_b0', num_classes=150)) == pytest.approx(16.8, rel=0.03)


def test_parameter_counts_match_references():
    with torch.device('meta'):
        b0 = num_params(build(MODELS, dict(type='SegFormer', variant='mit_b0', num_classes=150)))
        b2 = num_params(build(BACKBONES, dict(type='MixTransformer', variant='mit_b2')))
        giant = build(BACKBONES, dict(type='ViT', variant='vit_giant'))
        vit_b = build(BACKBONES, dict(type='ViT', variant='vit_base', img_size=224))
    assert b0 == pytest.approx(3.75e6, rel=0.02)        # mmsegmentation: 3.8 M
    assert b2 == pytest.approx(24.2e6, rel=0.02)        # MiT-B2 encoder without its classifier
    # ViT-B/16 at 224 has timm's 85.8 M encoder (timm's 86.6 M less its 1000-class head).
    assert num_params(vit_b) - num_params(vit_b.neck) == pytest.approx(85.8e6, rel=0.005)
    assert 1.0e9 <= num_params(giant) - num_params(giant.neck) <= 1.03e9


def test_free_width_and_depth_reach_billions():
    with torch.device('meta'):
        model = build(MODELS, dict(type='UperNetViT', embed_dim=2048, depth=48, num_heads=32))
    assert 2.4e9 < num_params(model) < 2.7e9


@pytest.mark.parametrize('depth', [1, 2, 3])
def test_a_vit_shallower_than_four_blocks_repeats_blocks_in_its_pyramid(depth):
    """The depth search of launch/benchmark.py --find-max-model starts anywhere, depth 1 included:
    each of the four levels is the last block of its quarter of the depth, at least block 0."""
    torch.manual_seed(0)
    vit = build(BACKBONES, dict(type='ViT', variant='vit_tiny_test', img_size=64, patch_size=8, depth=depth)).eval()
    expected = {1: [0, 0, 0, 0], 2: [0, 0, 0, 1], 3: [0, 0, 1, 2]}[depth]
    assert vit.out_indices == expected
    seen = []
    vit.neck.forward = lambda maps: seen.extend(maps) or maps
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        vit(x)
    assert len(seen) == 4
    for i, j in zip(range(4), range(1, 4)):  # the same block gives the same map
        assert torch.equal(seen[i], seen[j]) == (expected[i] == expected[j])
    with pytest.raises(ValueError, match='ViT depth must be at least 1'):
        build(BACKBONES, dict(type='ViT', variant='vit_tiny_test', depth=0))


def test_adapted_first_layer_sees_a_grey_image_as_rgb_does():
    w = torch.randn(8, 3, 3, 3)
    assert torch.equal(adapt_input_weight(w, 3), w)
    torch.testing.assert_close(adapt_input_weight(w, 1), w.sum(1, keepdim=True))
    w4 = adapt_input_weight(w, 4)
    torch.testing.assert_close(w4[:, :3], w * 0.75)       # RGB filters kept (scaled)
    for c in (1, 2, 4, 13):
        torch.testing.assert_close(adapt_input_weight(w, c).sum(1), w.sum(1))


@pytest.mark.parametrize('in_channels', [1, 4, 13])
def test_timm_backbone_loads_local_file_and_adapts_first_layer(tmp_path, in_channels):
    import timm
    torch.manual_seed(3)
    classifier = timm.create_model('test_resnet', pretrained=False)  # as a downloaded file would hold
    path = str(tmp_path / 'test_resnet.pth')
    torch.save(classifier.state_dict(), path)
    cfg = dict(type='TimmBackbone', name='test_resnet', out_indices=(1, 2, 3, 4), pretrained=path)
    rgb = build(BACKBONES, dict(cfg, in_channels=3)).eval()
    bands = build(BACKBONES, dict(cfg, in_channels=in_channels)).eval()
    torch.testing.assert_close(rgb.model.layer4[0].conv1.weight, classifier.layer4[0].conv1.weight)
    grey_B1HW = torch.rand(2, 1, 40, 40)
    with torch.no_grad():
        feats_rgb = rgb(grey_B1HW.expand(-1, 3, -1, -1))
        feats_bands = bands(grey_B1HW.expand(-1, in_channels, -1, -1))
    for a, b in zip(feats_rgb, feats_bands):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_vit_loads_timm_weights_from_file_with_another_grid(tmp_path):
    import timm
    torch.manual_seed(4)
    vit = timm.create_model('vit_tiny_patch16_224', pretrained=False)   # 14x14 grid, 192 wide
    path = str(tmp_path / 'vit_tiny.pth')
    torch.save({'model': vit.state_dict()}, path)
    ours = build(BACKBONES, dict(type='ViT', variant='vit_tiny_test', embed_dim=192, depth=12, num_heads=3,
                                 mlp_ratio=4.0, img_size=256, in_channels=4, pretrained=path))
    torch.testing.assert_close(ours.blocks[7].attn.qkv.weight, vit.blocks[7].attn.qkv.weight)
    torch.testing.assert_close(ours.patch_embed.proj.weight.sum(1), vit.patch_embed.proj.weight.sum(1))
    assert ours.pos_embed.shape == (1, 1 + 16 * 16, 192)
    torch.testing.assert_close(ours.pos_embed[:, 0], vit.pos_embed[:, 0])  # the class token's


@pytest.mark.parametrize('size', [64, 224, 320])
def test_vit_features_equal_timms_at_any_window_size(tmp_path, size):
    """The position embedding was resized with plain bicubic for windows other than img_size,
    timm's dynamic_img_size with antialiased bicubic: the features of the same weights differed
    by up to 0.1 at 64 px (0.014 at 512)."""
    import timm
    torch.manual_seed(5)
    ref = timm.create_model('vit_tiny_patch16_224', pretrained=False, dynamic_img_size=True).eval()
    path = str(tmp_path / 'vit_tiny.pth')
    torch.save(ref.state_dict(), path)
    ours = build(BACKBONES, dict(type='ViT', variant='vit_tiny_test', embed_dim=192, depth=12, num_heads=3,
                                 mlp_ratio=4.0, img_size=224, pretrained=path)).eval()
    normed = []
    ours.norm.register_forward_hook(lambda module, args, out: normed.append(out))
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        ours(x)
        theirs = ref.forward_intermediates(x, indices=list(ours.out_indices), norm=True, intermediates_only=True)
    assert len(normed) == len(theirs) == len(ours.out_indices)
    for a, b in zip(normed, theirs):
        torch.testing.assert_close(a, b.flatten(2).transpose(1, 2), rtol=0, atol=1e-5)


def test_pretrained_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match='missing.pth'):
        build(MODELS, dict(type='SegFormer', variant='mit_b0', pretrained=str(tmp_path / 'missing.pth')))
    with pytest.raises(ValueError, match='file'):
        build(BACKBONES, dict(type='MixTransformer', variant='mit_tiny_test', pretrained=True))
    with pytest.raises(RegistryError, match='TimmBackbone'):
        build(MODELS, dict(type='Segmentor', backbone=dict(type='TimBackbone'), decode_head=dict(type='UperHead')))
    # A config or JSON given by mistake was "holds Python objects other than tensors (loading it
    # could run code)": the unpickler's refusal of its first byte.
    (tmp_path / 'notes.pth').write_text('{"lr": 0.01}\n')
    with pytest.raises(ConfigError, match=r'notes.pth is a text file, not a weights file \(.pth, .pt'):
        build(MODELS, dict(type='SegFormer', variant='mit_b0', pretrained=str(tmp_path / 'notes.pth')))
    # Binary files whose first bytes happen to be ASCII are not called text.
    for name, head, kind in (('model.onnx', b'\x08\x0e\x12\x07pytorch\x1a\x03', 'an ONNX model'),
                             ('big.pth', b'II+\x00\x08\x00\x00\x00', 'a TIFF raster')):
        (tmp_path / name).write_bytes(head + bytes(range(256)))
        with pytest.raises(ConfigError, match=rf'{re.escape(name)} is {kind}, not a weights file'):
            build(MODELS, dict(type='SegFormer', variant='mit_b0', pretrained=str(tmp_path / name)))


def test_model_facts_command_lists_the_zoo(capsys):
    from ds_seg.cli.models import main, zoo
    labels = [label for label, _ in zoo()]
    assert {'SegFormer mit_b5', 'UperNetViT vit_giant', 'DeepLabV3Plus resnet101', 'UNet', 'FPNTiny'} <= set(labels)
    assert main(['--size', '512', '--filter', 'SegFormerTiny']) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[0] == 'SegFormerTiny' and float(row[1]) == pytest.approx(0.09, abs=0.01) and float(row[2]) > 0


@pytest.mark.parametrize('argv, message', [
    (['--size', '0'], '--size must be at least 16, got 0'),
    (['--in-channels', '-1'], '--in-channels must be at least 1, got -1'),
    (['--num-classes', '0'], '--num-classes must be at least 1, got 0'),
    (['--filter', 'Nope'], "--filter 'Nope' matches no model; the models are "),  # other tests register more
])
def test_model_facts_refuse_what_describes_no_model(argv, message, capsys):
    """One line each, as the other commands' mistakes (argparse's usage block came first)."""
    from ds_seg.cli import models
    code, err = models.main(argv), capsys.readouterr().err
    assert code == 2 and err.startswith(f'{os.path.basename(sys.argv[0])}: error: {message}') \
        and len(err.strip().splitlines()) == 1, err


def test_pretrained_true_without_network_is_quick_one_line_and_still_uses_the_cache(tmp_path, monkeypatch):
    """With no network, pretrained=True retried for about a minute and ended in the hub's words,
    naming neither the key nor what to do. Now: the cache if it holds the file, else one line."""
    import socket
    import time

    import timm
    from huggingface_hub import constants
    from safetensors.torch import save_file

    from ds_seg.config import ConfigError

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, 'Name or service not known')
    monkeypatch.setattr(socket, 'getaddrinfo', no_dns)
    monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(tmp_path / 'hub'))
    cfg = dict(type='FPN', backbone='test_resnet', pretrained=True)
    offline_before = constants.HF_HUB_OFFLINE
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"model\.pretrained=True: could not fetch timm's weights for 'test_resnet' "
                                          r"from https://huggingface.co/timm/test_resnet.* give pretrained='path"):
        build(MODELS, cfg)
    assert time.monotonic() - start < 10
    assert constants.HF_HUB_OFFLINE == offline_before   # the hub's setting is given back
    # The same weights in the hub's cache layout load with no network.
    repo = timm.models.get_pretrained_cfg('test_resnet').hf_hub_id
    snapshot = tmp_path / 'hub' / f"models--{repo.replace('/', '--')}" / 'snapshots' / 'abc'
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / 'refs').mkdir()
    (snapshot.parent.parent / 'refs' / 'main').write_text('abc')
    reference = timm.create_model('test_resnet', pretrained=False).state_dict()
    save_file(reference, str(snapshot / 'model.safetensors'))
    model = build(MODELS, cfg)
    torch.testing.assert_close(model.backbone.model.layer2[0].conv1.weight, reference['layer2.0.conv1.weight'])


def test_an_aux_head_level_the_encoder_lacks_is_one_line():
    """aux_head=dict(type='FCNHead', in_index=5) on a 4-level encoder was an IndexError traceback."""
    from ds_seg.config import ConfigError
    for in_index in (5, -5):
        with pytest.raises(ConfigError, match=r"model\.aux_head \(FCNHead\): .*in_index must pick one of the "
                                              r"encoder's 4 feature levels \(-4\.\.3\)"):
            make('UperNet', backbone='test_convnext', channels=16, aux_head=dict(type='FCNHead', in_index=in_index))
    with pytest.raises(ConfigError, match=r"^model\.aux_head\.in_index: '2' is a string, not a number"):
        make('UperNet', backbone='test_convnext', channels=16, aux_head=dict(type='FCNHead', in_index='2'))
    assert make('UperNet', backbone='test_convnext', channels=16, aux_head=dict(type='FCNHead', in_index=-1)).aux_head


@pytest.mark.parametrize('backbone', ['efficientnet_b0', 'mobilenetv3_small_050'])
def test_activation_checkpointing_of_timm_stem_stage_nets_updates_batchnorm_once(backbone):
    """EfficientNet and MobileNet feature nets checkpointed through timm's own switch, which
    recomputes the forward in backward in training mode: every BatchNorm running statistic was
    updated twice a step (141 buffers of efficientnet_b0 off after one step)."""
    cfg = dict(type='FPN', backbone=backbone, num_classes=6, channels=16)
    plain = build(MODELS, cfg).train()
    ckpt = build(MODELS, dict(cfg, activation_checkpointing=True)).train()
    ckpt.load_state_dict(plain.state_dict())
    images_BCHW, labels_BHW = torch.randn(2, 3, 40, 56), torch.randint(0, 6, (2, 40, 56))
    for _ in range(2):
        loss_plain, grads_plain = _step(plain, images_BCHW, labels_BHW)
        loss_ckpt, grads_ckpt = _step(ckpt, images_BCHW, labels_BHW)
        torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-6, atol=0)
        for n in grads_plain:
            torch.testing.assert_close(grads_ckpt[n], grads_plain[n], rtol=1e-5, atol=1e-6, msg=n)
    buffers = dict(plain.named_buffers())
    for n, b in ckpt.named_buffers():
        torch.testing.assert_close(b, buffers[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize('cfg, message', [
    (dict(type='DeepLabV3PlusTiny'), None),
    (dict(type='DeepLabV3Plus', backbone='resnet18', output_stride=4), 'model.output_stride must be 8 or 16'),
    (dict(type='DeepLabV3Plus', backbone='resnet18', output_stride=32), 'model.output_stride must be 8 or 16'),
    (dict(type='FPNTiny', num_classes=2.5), 'model.num_classes: write a whole number, got 2.5.'),
    (dict(type='FPNTiny', num_classes='6'), "model.num_classes: '6' is a string, not a number"),
    (dict(type='UperNetTiny', in_channels=0), 'model in_channels must be an integer >= 1, got 0'),
])
def test_model_settings_that_cannot_build_a_model_are_named(cfg, message):
    """output_stride=4 was a bare AssertionError from timm and 32 took OS8's ASPP dilations;
    num_classes=2.5 blamed a head's conv groups, '6' string formatting, 0 failed at the forward."""
    from ds_seg.config import ConfigError
    if message is None:
        build(MODELS, cfg, where='model')
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(MODELS, cfg, where='model')


def test_deeplabv3plus_auxiliary_head_reads_the_level_before_the_last_as_mmseg():
    # It read the stride-4 low-level map (in_index -2 of the two levels the head takes): a weak
    # signal on the largest map, where mmsegmentation's FCNHead reads a ResNet's stage 3.
    model = build(MODELS, dict(type='DeepLabV3Plus', backbone='resnet18', aux_head=True, num_classes=5))
    assert model.backbone.out_channels == [64, 256, 512] and model.backbone.strides == [4, 16, 16]
    assert model.aux_head.conv[0].in_channels == 256  # layer3 of resnet18
    model.train()
    out = model(torch.randn(2, 3, 64, 64))
    assert out['logits'].shape == out['aux'][0][1].shape == (2, 5, 64, 64)


def test_mit_features_equal_timms_pvt_v2_with_the_same_weights():
    """SegFormer's MiT is timm's pvt_v2 with an MLP ratio of 4 (NVlabs' mit_b* and timm's
    pvt_v2_b* share their layers, in one order). The blocks' and stages' LayerNorms had eps 1e-5
    where NVlabs (the source of the mit_b* weights) and timm use 1e-6: 1.7e-5 apart at low
    contrast. Equal to float rounding, at a size no multiple of the strides."""
    import timm

    from ds_seg.models.backbones.mit import MixTransformer
    torch.manual_seed(0)
    ours = MixTransformer('mit_b0').eval()
    peer = timm.create_model('pvt_v2_b0', mlp_ratios=(4, 4, 4, 4), features_only=True).eval()
    with torch.no_grad():
        for p in peer.parameters():  # away from the initial LayerNorm ones and zeros
            p.add_(torch.randn_like(p) * 0.02)
    weights = list(peer.state_dict().values())
    assert [tuple(v.shape) for v in weights] == [tuple(v.shape) for v in ours.state_dict().values()]
    ours.load_state_dict(dict(zip(ours.state_dict(), weights)))
    images = torch.randn(1, 3, 100, 60) * 0.01  # a hazy, low-contrast scene: where eps shows
    with torch.no_grad():
        for a, b in zip(ours(images), peer(images), strict=True):
            # Float rounding (up to 4e-6 with other kernels) passes; the eps difference (1.7e-5) does not.
            torch.testing.assert_close(a, b, atol=5e-6, rtol=0)


class _WritesFile:
    """Unpickling this would create a file (builtins.open): evidence that loading ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


class _RunsShell:
    def __reduce__(self):
        return (os.system, ('touch /nonexistent-dir/x',))


def test_training_checkpoints_of_timm_and_mmengine_load_their_weights_and_run_none_of_their_objects(tmp_path):
    """timm's train.py saves its arguments (argparse.Namespace) and the EMA copy beside the weights,
    mmengine its MessageHub (HistoryBuffer objects, numpy scalars): both were refused as "objects
    other than tensors", where the README says they load. Their other objects now load as inert
    stand-ins, so a class in the file still runs nothing; modules torch blocks stay refused."""
    import argparse

    import numpy as np
    from mmengine.logging import HistoryBuffer
    model = build(MODELS, dict(type='FPN', backbone='test_resnet', num_classes=3))
    weights = model.backbone.model.state_dict()
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in weights.items()}
    marker = tmp_path / 'code_ran'
    timm_file, mm_file, shell_file = tmp_path / 'model_best.pth.tar', tmp_path / 'epoch_100.pth', tmp_path / 's.pth'
    torch.save({'epoch': 3, 'args': argparse.Namespace(model='test_resnet', lr=0.1), 'state_dict': weights,
                'state_dict_ema': ema, 'evil': _WritesFile(str(marker))}, timm_file)
    buffer = HistoryBuffer()
    buffer.update(0.5)
    torch.save({'meta': {'epoch': 100, 'seed': np.int64(0)}, 'message_hub': {'log_scalars': {'loss': buffer}},
                'state_dict': {f'backbone.{k}': v for k, v in weights.items()}}, mm_file)
    torch.save({'state_dict': weights, 'evil': _RunsShell()}, shell_file)
    from ds_seg.models.pretrained import read_state_dict
    got = read_state_dict(timm_file)
    assert got.keys() == ema.keys() and all(torch.equal(got[k], ema[k]) for k in ema)   # the EMA copy, as timm
    assert not marker.exists()
    built = build(MODELS, dict(type='FPN', backbone='test_resnet', num_classes=3, pretrained=str(mm_file)))
    assert all(torch.equal(built.backbone.model.state_dict()[k], v) for k, v in weights.items())
    with pytest.raises(ConfigError, match=r"s\.pth holds Python objects other than tensors that are refused .*posix"):
        read_state_dict(shell_file)


def test_pretrained_true_on_a_timm_model_without_released_weights_says_so():
    """resnet50t has a pretrained config with no hub id and an empty URL: the fetch from '' was
    'could not fetch ... ([Errno 21] Is a directory: ...)', advice about the network."""
    with pytest.raises(ConfigError, match=r"timm has no pretrained weights for 'resnet50t' \(list the models that have "
                                          r"some with timm\.list_pretrained\(\)\); pass a file path"):
        build(MODELS, dict(type='FPN', backbone='resnet50t', pretrained=True, num_classes=2))


@pytest.mark.parametrize('cfg, message', [
    # timm's own weight options: ignored (built with pretrained=False), trained from random weights unsaid
    (dict(backbone='test_resnet', backbone_kwargs=dict(pretrained_cfg_overlay=dict(file='w.pth'))),
     r"^model\.backbone_kwargs\.pretrained_cfg_overlay: timm's own weight loading is not used by ds_seg"),
    (dict(backbone='test_vit', backbone_kwargs=dict(checkpoint_path='w.pth')),
     r"^model\.backbone_kwargs\.checkpoint_path: timm's own weight loading"),
    # was "timm has no model 'hf-hub:...'", with a hint to list convnext*
    (dict(backbone='hf-hub:timm/resnet18.a1_in1k'), r"names weights on the Hugging Face hub .* give timm's "
                                                     r"architecture name as backbone"),
    # was "timm cannot build ... choose a backbone with feature maps"
    (dict(backbone='test_convnext.bogus_tag'), r"Invalid pretrained tag \(bogus_tag\).*timm\.list_pretrained\("
                                                r"'test_convnext\*'\)\)\", or give the name without a tag"),
])
def test_timms_own_weight_options_hub_names_and_tags_are_named_as_such(cfg, message):
    with pytest.raises(ConfigError, match=message):
        build(MODELS, dict(type='UperNet' if 'vit' in cfg['backbone'] else 'FPN', num_classes=2, **cfg))
