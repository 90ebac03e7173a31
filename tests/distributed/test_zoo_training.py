"""Every model family of the zoo trains through the Trainer under ZeRO-2 and ZeRO-3 on 2 CPU
ranks (tiny configs), to the same losses; under ZeRO-3 the model is built partitioned (each rank
holds about half of every parameter from construction on; a timm backbone only while timm builds
and initialises it) and ``load_from`` weights load into the partitions."""
import os

import pytest
import torch

from ds_seg.config import REPO_ROOT, load_config
from tests.dist import run_on_ranks
from tests.tiny import ds_config, read_jsonl

# upernet_dinov2: any timm ViT through UperNet (DINOv2-reg4, patch 14) at a 512 crop.
FAMILIES = ['segformer', 'upernet_vit', 'upernet', 'fpn', 'deeplabv3plus', 'upernet_dinov2']
STEPS = 8
COMPARED_STEPS = 3  # test_zero3_trains_the_losses_zero2_does: before rounding has grown


def _cfg(tmp, family, **extra):
    options = [f'data.train.cache_dir={os.path.join(tmp, "cache")!r}',
               f'data.val.cache_dir={os.path.join(tmp, "cache")!r}',
               f'train.max_steps={STEPS}', 'train.log_interval=1', 'train.eval_interval=0',
               'train.checkpoint_interval=0', 'train.warmup_log_steps=0']
    options += [f'{k}={v!r}' for k, v in extra.items()]
    return load_config(str(REPO_ROOT / 'configs' / f'{family}_tiny_synthetic.py'), options)


def _zoo_ds_config(stage):
    ds = ds_config(stage, micro_batch=2)
    ds['scheduler']['params']['warmup_num_steps'] = 1
    # Partition even the tiny tensors of the test models (the shipped threshold keeps < 100 k).
    ds['zero_optimization']['stage3_param_persistence_threshold'] = 0
    return ds


def _train_all(tmp, stage, weights_file, dino_file):
    """On each rank: every family for STEPS steps, one Trainer after another in one process
    group (process start-up dominates these runs); under ZeRO-3 also a load_from check."""
    from ds_seg.engine import backend as backends
    from ds_seg.engine import trainer as trainer_mod
    seen = {}
    real_build_backend = backends.build_backend

    def spy(spec, model, *args, **kwargs):  # what the trainer built, before deepspeed.initialize
        seen['local'] = sum(p.numel() for p in model.parameters())
        seen['partition'] = sum(p.ds_tensor.numel() for p in model.parameters() if hasattr(p, 'ds_tensor'))
        seen['full'] = sum(p.ds_numel if hasattr(p, 'ds_numel') else p.numel() for p in model.parameters())
        return real_build_backend(spec, model, *args, **kwargs)

    backends.build_backend = spy
    out = {}
    jobs = [(f, {}) for f in FAMILIES]
    if stage == 3:
        jobs.append(('upernet_vit', {'load_from': weights_file}))
        jobs.append(('upernet_dinov2', {'model.pretrained': dino_file}))
    for family, extra in jobs:
        name = family + ('_load_from' if extra else '')
        cfg = _cfg(tmp, family, **extra)
        trainer = trainer_mod.Trainer(cfg, _zoo_ds_config(stage), work_dir=os.path.join(tmp, f'{name}_z{stage}'))
        try:
            row = dict(seen)
            if extra:
                import deepspeed
                params = dict(trainer.backend.module.named_parameters())
                with deepspeed.zero.GatheredParameters(list(params.values())):
                    row['loaded'] = {k: p.detach().clone() for k, p in params.items()}
                row['steps'] = 0
            else:
                row['summary'] = trainer.fit()
            out[name] = row
        finally:
            trainer.log.close()  # the process group stays up for the next family
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp('zoo'))
    import ds_seg  # noqa: F401
    from ds_seg.registry import MODELS, build
    torch.manual_seed(123)  # other weights than the trainer's seed would give
    reference = build(MODELS, dict(type='UperNetViTTiny', in_channels=3, num_classes=6)).state_dict()
    weights_file = os.path.join(tmp, 'upernet_vit_tiny.pt')
    torch.save({'state_dict': reference, 'model': {'type': 'UperNetViTTiny'}, 'classes': []}, weights_file)
    import timm  # a timm DINOv2-reg4 state dict as the "pretrained file" (built with random weights)
    dino = timm.create_model('vit_small_patch14_reg4_dinov2', pretrained=False, depth=2, embed_dim=32,
                             num_heads=2).state_dict()
    dino_file = os.path.join(tmp, 'dinov2_reg4_tiny.pth')
    torch.save(dino, dino_file)
    out = {stage: run_on_ranks(_train_all, 2, args=(tmp, stage, weights_file, dino_file), timeout=500)
           for stage in (2, 3)}
    return tmp, out, reference, dino


@pytest.mark.parametrize('stage', [2, 3])
@pytest.mark.parametrize('family', FAMILIES)
def test_family_trains(runs, family, stage):
    tmp, out, _, _ = runs
    summary = out[stage][0][family]['summary']
    assert summary['exit_reason'] == 'completed' and summary['zero_stage'] == stage and summary['steps'] == STEPS
    losses = [row['loss'] for row in read_jsonl(os.path.join(tmp, f'{family}_z{stage}', 'metrics.jsonl'))]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[-3:]) < losses[0], f'{family} ZeRO-{stage} did not learn: {losses}'


@pytest.mark.parametrize('family', FAMILIES)
def test_zero3_trains_the_losses_zero2_does(runs, family):
    """The same seed, the same model: built partitioned, timm's backbones (ResNet, ConvNeXt, the
    DINOv2 ViT) skipped their own initialisation and ZeRO-3 trained another model than ZeRO-2
    (losses apart from the first step). Compared over the first COMPARED_STEPS: ZeRO-2 and ZeRO-3
    reduce gradients in another order, and where a backbone's gradients are near Adam's eps
    (ConvNeXt's layer scale of 1e-6) Adam multiplies that float32 rounding about 10x a step.
    Measured on an AMD EPYC, |ZeRO-2 - ZeRO-3| / loss for UperNet-ConvNeXt: 0, 0, 9.6e-8, 4.7e-6,
    4.9e-6, 5.4e-5, 3.3e-4, 3.8e-4 over steps 1-8 (every other family below 1e-5 at step 8)."""
    tmp = runs[0]
    zero2, zero3 = ([row['loss'] for row in read_jsonl(os.path.join(tmp, f'{family}_z{stage}', 'metrics.jsonl'))]
                    for stage in (2, 3))
    assert len(zero2) == len(zero3) == STEPS
    for step, (a, b) in enumerate(zip(zero2[:COMPARED_STEPS], zero3[:COMPARED_STEPS]), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f'{family} step {step}: ZeRO-2 loss {a} vs ZeRO-3 {b}'


@pytest.mark.parametrize('family', FAMILIES)
def test_zero3_builds_partitioned_halves(runs, family):
    _, out, _, _ = runs
    ranks = [out[3][r][family] for r in range(2)]
    full = ranks[0]['full']
    for r in ranks:
        # Built inside zero.Init: no rank holds a full parameter once built...
        assert r['local'] == 0 and r['full'] == full
        # ...and each holds about half of them (padding rounds every tensor up to an even size).
        assert 0.49 * full <= r['partition'] <= 0.52 * full, (r['partition'], full)
    # ZeRO-2 builds the full model on each rank.
    assert out[2][0][family]['local'] == full and out[2][0][family]['partition'] == 0


def test_zero3_load_from_gathers_module_by_module(runs):
    _, out, reference, _ = runs
    for rank in range(2):
        loaded = out[3][rank]['upernet_vit_load_from']['loaded']
        assert loaded.keys() == {k for k in reference if not k.endswith(('running_mean', 'running_var',
                                                                         'num_batches_tracked'))}
        for key, value in loaded.items():
            torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)


def test_zero3_timm_vit_pretrained_loads_into_partitions(runs):
    """A timm DINOv2-reg4 file loads exactly into the TimmViT built inside zero.Init."""
    _, out, _, dino = runs
    for rank in range(2):
        loaded = out[3][rank]['upernet_dinov2_load_from']['loaded']
        backbone = {k[len('backbone.model.'):]: v for k, v in loaded.items() if k.startswith('backbone.model.')}
        assert backbone.keys() == {k for k in dino if not k.startswith('head.')}
        for key, value in backbone.items():
            torch.testing.assert_close(value, dino[key], rtol=0, atol=0, msg=key)
