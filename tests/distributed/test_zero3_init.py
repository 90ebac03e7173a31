"""Under ZeRO-3 a model is built partitioned (deepspeed.zero.Init), from the same seed as DDP's:
it must start from the same weights. timm initialises its layers after building them (ResNet's
init_weights over named_modules, named_apply, EfficientNet's ``weight.data.normal_``); built
partitioned, those inits ran on empty tensors and did nothing (no zeroed last BatchNorm per ResNet
block, no truncated normals), and a meta-device build made real tensors and moved the heads'
random draws. 2 CPU ranks, each model built plainly and partitioned, then gathered."""
import types

import pytest
import torch

from tests.dist import run_on_ranks

MODELS = {
    'FPNTiny': dict(type='FPNTiny'),                       # timm test_resnet
    'UperNetTiny': dict(type='UperNetTiny'),               # timm ConvNeXt
    'DeepLabV3PlusTiny': dict(type='DeepLabV3PlusTiny'),
    'dinov2': dict(type='UperNet', backbone='vit_small_patch14_reg4_dinov2', channels=16, aux_head=False,
                   backbone_kwargs=dict(depth=2, embed_dim=32, num_heads=2)),
    'efficientnet': dict(type='FPN', backbone='efficientnet_b0', channels=16),
    'SegFormerTiny': dict(type='SegFormerTiny'),           # ds_seg's own: right before, kept so
}


def _plain_and_partitioned(names, pretrained):
    import deepspeed

    import ds_seg  # noqa: F401  (registers the models)
    from ds_seg import distributed
    from ds_seg.engine.deepspeed_backend import construction_context
    from ds_seg.registry import MODELS as REGISTRY, build
    distributed.init(use_deepspeed=True)
    spec = types.SimpleNamespace(zero_stage=3, ds_config={'train_micro_batch_size_per_gpu': 1,
                                                          'zero_optimization': {'stage': 3}})
    out = {}
    cfgs = {name: MODELS[name] for name in names}
    cfgs['FPN pretrained'] = dict(type='FPN', backbone='test_resnet', channels=16, pretrained=pretrained)
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        plain = build(REGISTRY, cfg)
        torch.manual_seed(0)
        with construction_context(spec):
            partitioned = build(REGISTRY, cfg)
        params = list(partitioned.parameters())
        assert all(p.numel() == 0 for p in params if hasattr(p, 'ds_id')) and any(hasattr(p, 'ds_id') for p in params)
        with deepspeed.zero.GatheredParameters(params):
            got = {k: v.detach().clone() for k, v in partitioned.state_dict().items()}
        want = plain.state_dict()
        out[name] = sorted(k for k in want if not torch.equal(want[k], got[k]))
    # A 16-bit config: zero.Init creates tensors in that type, and a pretrained file read inside it
    # came back as its fp32 bytes taken for bf16 values (BatchNorm weights of ones as [0, 1, 0...],
    # NaN from the first step). The file's values, rounded to the parameters' type, must arrive.
    bf16 = types.SimpleNamespace(zero_stage=3, ds_config=dict(spec.ds_config, bf16={'enabled': True}))
    with construction_context(bf16):
        partitioned = build(REGISTRY, cfgs['FPN pretrained'])
    with deepspeed.zero.GatheredParameters(list(partitioned.parameters())):
        got = {k: v.detach().clone() for k, v in partitioned.state_dict().items()}
    file = torch.load(pretrained, weights_only=True)
    assert {v.dtype for k, v in got.items() if k.endswith('.weight')} == {torch.bfloat16}
    loaded = {k: got[f'backbone.model.{k}'] for k in file if f'backbone.model.{k}' in got}   # not the classifier
    assert len(loaded) > 40
    out['FPN pretrained bf16'] = sorted(k for k, v in loaded.items() if not torch.equal(v, file[k].to(v.dtype)))
    return out


@pytest.fixture(scope='module')
def differing(tmp_path_factory):
    import timm
    pretrained = str(tmp_path_factory.mktemp('zero3_init') / 'test_resnet.pth')
    torch.save(timm.create_model('test_resnet').state_dict(), pretrained)
    return run_on_ranks(_plain_and_partitioned, 2, args=(list(MODELS), pretrained), timeout=300)[0]


@pytest.mark.parametrize('name', [*MODELS, 'FPN pretrained', 'FPN pretrained bf16'])
def test_zero3_builds_the_weights_a_plain_build_does(differing, name):
    assert differing[name] == [], f'{name}: {len(differing[name])} tensors differ, e.g. {differing[name][:4]}'
