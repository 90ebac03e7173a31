"""The ViT fine-tuning recipe's parameter groups (optim.layer_decay, optim.paramwise)."""
import pytest
import torch

import ds_seg  # noqa: F401
from ds_seg.config import ConfigError
from ds_seg.engine.param_groups import build_param_groups, scale_lr_by_group
from ds_seg.registry import MODELS, build

VIT = dict(type='UperNet', backbone='deit3_small_patch16_224', channels=16, aux_head=False,
           backbone_kwargs=dict(depth=2, embed_dim=32, num_heads=2))


def _group_of(groups, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for g in groups for p in g['params']}


def test_groups_follow_depth_role_and_decay():
    model = build(MODELS, VIT)
    groups = build_param_groups(model, dict(layer_decay=0.5, paramwise=dict(no_weight_decay=True,
                                                                             backbone_lr_mult=0.1)))
    of = _group_of(groups, model)
    assert len(of) == sum(1 for p in model.parameters() if p.requires_grad)   # every parameter once
    expect = {  # name: (lr_mult, decayed)
        'backbone.model.pos_embed': (0.1 * 0.5 ** 3, False),
        'backbone.model.cls_token': (0.1 * 0.5 ** 3, False),
        'backbone.model.patch_embed.proj.weight': (0.1 * 0.5 ** 3, True),
        'backbone.model.blocks.0.attn.qkv.weight': (0.1 * 0.5 ** 2, True),
        'backbone.model.blocks.1.attn.qkv.weight': (0.1 * 0.5, True),
        'backbone.model.blocks.1.norm1.weight': (0.1 * 0.5, False),
        'backbone.model.blocks.1.attn.qkv.bias': (0.1 * 0.5, False),
        'backbone.model.norm.weight': (0.1, False),
        'backbone.neck.up2.weight': (1.0, True),          # the new pyramid trains with the heads
    }
    head = [n for n in of if n.startswith('decode_head.') and of[n]['params'][0].ndim > 1]
    expect.update({n: (1.0, True) for n in head})
    for name, (mult, decayed) in expect.items():
        assert of[name]['lr_mult'] == pytest.approx(mult), name
        assert ('weight_decay' not in of[name]) == decayed, name
    assert groups[0]['lr_mult'] == 1.0   # the LR a backend logs is the base schedule
    assert len({g['name'] for g in groups}) == len(groups)


def test_off_by_default_and_refused_where_it_cannot_apply():
    unet = build(MODELS, dict(type='UNetTiny'))
    params = build_param_groups(unet, dict(layer_decay=None, paramwise=dict(no_weight_decay=False,
                                                                            backbone_lr_mult=1.0)))
    assert [id(p) for p in params] == [id(p) for p in unet.parameters()]
    with pytest.raises(ConfigError, match='optim.layer_decay'):
        build_param_groups(unet, dict(layer_decay=0.75))
    with pytest.raises(ConfigError, match='optim.layer_decay'):
        build_param_groups(unet, dict(layer_decay=1.5))
    with pytest.raises(ConfigError, match='backbone_lr_mult'):
        build_param_groups(unet, dict(paramwise=dict(backbone_lr_mult=0)))
    # A model without a backbone: the multiplier changed nothing, and said nothing.
    with pytest.raises(ConfigError, match=r'optim.paramwise.backbone_lr_mult: model UNetTiny has no backbone'):
        build_param_groups(unet, dict(paramwise=dict(backbone_lr_mult=0.1)))


def test_an_optim_mistake_is_named_as_the_config_s_not_the_deepspeed_json_s(tmp_path, capsys):
    """optim.layer_decay on a UNet was 'DeepSpeed cannot build this engine (ConfigError: ...);
    change the JSON': the JSON was fine."""
    from ds_seg.cli.train import main
    code = main(['--config', 'unet_tiny_synthetic', '--work-dir', str(tmp_path / 'w'), '--cfg-options',
                 f'data.train.cache_dir={tmp_path}', f'data.val.cache_dir={tmp_path}', 'optim.layer_decay=0.5',
                 'train.max_steps=1'])
    err = capsys.readouterr().err
    # (named as the config names it: UNetTiny builds a UNet)
    assert code == 2 and 'ds_seg: error: optim.layer_decay: model UNetTiny has no ViT blocks' in err, err
    assert '--deepspeed_config' not in err


def test_schedule_scales_every_group_proportionally():
    from deepspeed.runtime.lr_schedules import WarmupLR
    model = build(MODELS, VIT)
    opt = torch.optim.AdamW(build_param_groups(model, dict(layer_decay=0.5)), lr=1e-3)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=4,  # absolute LRs
                     warmup_type='linear')
    scale_lr_by_group(opt, sched)
    sched.step()   # iteration 0: LR 0
    for _ in range(3):
        sched.step()
        base = opt.param_groups[0]['lr']
        assert base > 0
        for g in opt.param_groups:
            assert g['lr'] == pytest.approx(base * g['lr_mult'])


def test_layer_decay_counts_transformer_blocks_only():
    """timm's EfficientNet features hold backbone.model.blocks.N too: layer_decay=0.5 was taken,
    the stem (conv_stem, bn1) trained at the full LR and blocks.0 at 0.5^7. It is refused, as for
    any backbone without ViT blocks; no_weight_decay alone still applies to it."""
    model = build(MODELS, dict(type='FPN', backbone='efficientnet_b0', channels=16, aux_head=False))
    assert any(n.startswith('backbone.model.blocks.6.') for n, _ in model.named_parameters())
    with pytest.raises(ConfigError, match='optim.layer_decay: model .* has no ViT blocks'):
        build_param_groups(model, dict(layer_decay=0.5))
    groups = build_param_groups(model, dict(paramwise=dict(no_weight_decay=True)))
    assert {g['lr_mult'] for g in groups} == {1.0}


def test_the_logged_lr_is_the_heads_whatever_the_backbone_multiplier():
    """backbone_lr_mult=2 put the backbone's group first: the logged lr was twice the heads'."""
    model = build(MODELS, VIT)
    for mult in (2.0, 0.5):
        groups = build_param_groups(model, dict(paramwise=dict(backbone_lr_mult=mult)))
        assert groups[0]['lr_mult'] == 1.0 and {g['lr_mult'] for g in groups} == {1.0, mult}


@pytest.mark.parametrize('pooling', ['attention', 'concat'])
def test_a_temporal_model_over_a_vit_gets_the_same_recipe(pooling):
    """TemporalSegmentor nests the ViT at backbone.encoder: its new neck and the temporal fusion
    convolutions trained at the backbone's LR, and layer_decay was refused as 'no ViT blocks'.
    Each parameter gets the multiplier it has in the one-date UperNet over the same ViT."""
    kw = VIT['backbone_kwargs']
    model = build(MODELS, dict(type='TemporalSegmentor', backbone=dict(type='TimmViT', name=VIT['backbone'], **kw),
                               decode_head=dict(type='UperHead', channels=16), num_dates=2, in_channels=6,
                               num_classes=6, pooling=pooling))
    cfg = dict(layer_decay=0.5, paramwise=dict(no_weight_decay=True, backbone_lr_mult=0.1))
    of = _group_of(build_param_groups(model, cfg), model)
    single = build(MODELS, VIT)
    single_of = _group_of(build_param_groups(single, cfg), single)
    for name in single_of:
        if name.startswith('backbone.'):
            temporal = of['backbone.encoder.' + name[len('backbone.'):]]
            assert temporal['lr_mult'] == pytest.approx(single_of[name]['lr_mult']), name
            assert ('weight_decay' in temporal) == ('weight_decay' in single_of[name]), name
    fuse = [n for n in of if n.startswith('backbone.fuse.')]
    assert fuse and all(of[n]['lr_mult'] == 1.0 for n in fuse)


def test_a_layout_that_differs_under_the_same_optim_names_the_group():
    """Another frozen_stages, say, groups the same recipe into other tensor counts: the resume
    refusal said only "2 parameter group(s) there, 2 here"."""
    from ds_seg.engine.checkpointer import _first_group_difference
    saved = [['layer0', 1.0, None, 10], ['layer0_backbone', 0.1, None, 20]]
    now = [['layer0', 1.0, None, 10], ['layer0_backbone', 0.1, None, 18]]
    assert _first_group_difference(saved, now) == ('parameter group 2: layer0_backbone (lr_mult 0.1, 20 tensors) '
                                                    'there, layer0_backbone (lr_mult 0.1, 18 tensors) here')
    assert _first_group_difference(saved, saved[:1]).endswith('there, none here')


def test_a_frozen_backbone_stays_in_eval_mode_and_out_of_the_optimizer():
    """optim.paramwise.freeze_backbone: the backbone's BatchNorm keeps its statistics and dropout
    stays off whenever the model trains; a ViT's fresh neck and the heads train."""
    from ds_seg.engine.param_groups import freeze_backbone, group_layout
    cnn = build(MODELS, dict(type='FPN', backbone='test_resnet', channels=16))
    optim = dict(paramwise=dict(freeze_backbone=True))
    line = freeze_backbone(cnn, optim)
    frozen = sum(p.numel() for n, p in cnn.named_parameters() if n.startswith('backbone.'))
    assert line.startswith(f'optim.paramwise.freeze_backbone: {frozen:,} backbone parameters frozen')
    bn = next(m for n, m in cnn.named_modules() if n.startswith('backbone.') and isinstance(m, torch.nn.BatchNorm2d))
    stats = bn.running_mean.clone()
    cnn.train()
    assert not bn.training and cnn.decode_head.training and cnn.training
    cnn(torch.randn(2, 3, 64, 64)).sum().backward()
    assert torch.equal(bn.running_mean, stats)
    assert all(p.grad is None for n, p in cnn.named_parameters() if n.startswith('backbone.'))
    assert all(p.grad is not None for n, p in cnn.named_parameters() if n.startswith('decode_head.'))
    cnn.eval()
    cnn.train()   # eval and back: still frozen
    assert not bn.training
    groups = build_param_groups(cnn, optim)
    heads = sum(1 for n, p in cnn.named_parameters() if not n.startswith('backbone.'))
    assert group_layout(groups) == [['layer0', 1.0, None, heads]]   # recorded: a resume that freezes otherwise is refused
    vit = build(MODELS, VIT)
    assert "and the backbone's fresh neck" in freeze_backbone(vit, optim)
    vit.train()
    assert vit.backbone.neck.training and not vit.backbone.model.training
    assert all(p.requires_grad == n.startswith('backbone.neck.') for n, p in vit.named_parameters()
               if n.startswith('backbone.'))


def test_freezing_what_cannot_be_frozen_is_refused():
    from ds_seg.engine.param_groups import freeze_backbone
    with pytest.raises(ConfigError, match='optim.paramwise.freeze_backbone: model UNetTiny has no backbone'):
        freeze_backbone(build(MODELS, dict(type='UNetTiny')), dict(paramwise=dict(freeze_backbone=True)))
    for optim, key in ((dict(layer_decay=0.75), 'optim.layer_decay'),
                       (dict(paramwise=dict(backbone_lr_mult=0.1)), 'optim.paramwise.backbone_lr_mult')):
        optim.setdefault('paramwise', {})['freeze_backbone'] = True
        with pytest.raises(ConfigError, match=f'^{key} sets the learning rate of backbone parameters'):
            freeze_backbone(build(MODELS, VIT), optim)
    assert freeze_backbone(build(MODELS, VIT), dict(paramwise=dict(freeze_backbone=False))) is None
