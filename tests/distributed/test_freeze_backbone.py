"""optim.paramwise.freeze_backbone (linear probing): the pretrained backbone's weights and BatchNorm
statistics leave training exactly as they came from its file, under DDP and ZeRO 1-3 alike
(through the checkpoint, ZeRO-3's partitions included), while the heads learn the same losses in
every backend; a resume that freezes otherwise is refused in one line (2 CPU ranks, FPN over
timm's test_resnet, 4 steps)."""
import json
import os

import pytest
import torch

from ds_seg.config import load_config
from tests.dist import run_on_ranks
from tests.tiny import TINY_CONFIG, ds_config, logged_losses

RUNS = [('ddp', 'ddp', 0), ('zero1', 'deepspeed', 1), ('zero2', 'deepspeed', 2), ('zero3', 'deepspeed', 3)]
STEPS = 4


def _cfg(tmp, pretrained, freeze=True, steps=STEPS):
    cache = os.path.join(tmp, 'cache')
    return load_config(TINY_CONFIG, [
        f'data.train.cache_dir={cache!r}', f'data.val.cache_dir={cache!r}', 'data.train.scene_size=128',
        'data.val.scene_size=128', 'data.crop_size=64', f'train.max_steps={steps}', 'train.eval_interval=0',
        'train.checkpoint_interval=2', 'train.log_interval=1', 'train.warmup_log_steps=0',
        'train.peak_tflops=1.0', 'model.type=FPN', 'model.backbone=test_resnet', 'model.channels=16',
        *([f'model.pretrained={pretrained!r}'] if pretrained else []),
        f'optim.paramwise.freeze_backbone={freeze}'])


def _fit_or_refusal(cfg, ds, **kwargs):
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    try:
        trainer = Trainer(cfg, ds, **kwargs)
    except ConfigError as exc:
        return str(exc)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _train(tmp, pretrained, name, backend, stage):
    summary = _fit_or_refusal(_cfg(tmp, pretrained), ds_config(stage, micro_batch=2), backend=backend,
                              work_dir=os.path.join(tmp, name))
    assert isinstance(summary, dict) and summary['exit_reason'] == 'completed', summary


def _refusals(tmp, pretrained):
    # The DDP run's work dir resumed without freezing: its optimizer state holds the heads only.
    unfrozen = _fit_or_refusal(_cfg(tmp, pretrained, freeze=False, steps=STEPS + 1), ds_config(0, micro_batch=2),
                               backend='ddp', work_dir=os.path.join(tmp, 'ddp'), resume='auto')
    # Freezing a backbone of random filters.
    random = _fit_or_refusal(_cfg(tmp, None), ds_config(2, micro_batch=2), backend='deepspeed',
                             work_dir=os.path.join(tmp, 'random'))
    return dict(unfrozen_resume=unfrozen, no_pretrained=random)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    import timm
    tmp = str(tmp_path_factory.mktemp('freeze'))
    pretrained = os.path.join(tmp, 'test_resnet.pth')
    torch.manual_seed(1)
    timm_model = timm.create_model('test_resnet', pretrained=False)
    with torch.no_grad():  # BatchNorm statistics of its own, not the 0/1 a fresh layer has
        for module in timm_model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    torch.save(timm_model.state_dict(), pretrained)
    for name, backend, stage in RUNS:  # a process group each, as a launcher gives every run
        run_on_ranks(_train, 2, args=(tmp, pretrained, name, backend, stage), timeout=300)
    out = run_on_ranks(_refusals, 2, args=(tmp, pretrained), timeout=300)[0]
    from ds_seg.engine.checkpoint import consolidated_state_dict
    for name, *_ in RUNS:
        with open(os.path.join(tmp, name, 'summary.json')) as f:
            summary = json.load(f)
        with open(os.path.join(tmp, name, 'metrics.jsonl')) as f:
            rows = [json.loads(line) for line in f]
        out[name] = dict(losses=logged_losses(os.path.join(tmp, name)), summary=summary, rows=rows,
                         states=[consolidated_state_dict(os.path.join(tmp, name, 'checkpoints', f'step_{s:08d}'))
                                 for s in (2, STEPS)])
    out['pretrained'] = timm_model.state_dict()
    return out


@pytest.mark.parametrize('name', [r[0] for r in RUNS])
def test_the_backbone_leaves_training_as_its_file_has_it(runs, name):
    pretrained = runs['pretrained']
    for state in runs[name]['states']:
        assert set(state) == set(runs['ddp']['states'][0]), 'the export left tensors out'
        backbone = {k[len('backbone.model.'):]: v for k, v in state.items() if k.startswith('backbone.model.')}
        assert backbone and set(backbone) <= set(pretrained)
        assert any(k.endswith('running_var') for k in backbone)   # BatchNorm statistics are checked too
        for key, value in backbone.items():
            assert torch.equal(value.to(pretrained[key].dtype), pretrained[key]), f'{name}: {key} changed'


@pytest.mark.parametrize('name', [r[0] for r in RUNS])
def test_the_heads_train_to_the_same_losses_in_every_backend(runs, name):
    early, late = runs[name]['states']
    heads = [k for k in late if not k.startswith('backbone.') and late[k].is_floating_point()]
    assert heads and any(not torch.equal(early[k], late[k]) for k in heads), 'the heads did not train'
    ref, got = runs['ddp']['losses'], runs[name]['losses']
    assert len(ref) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f'step {step}: DDP loss {a} vs {name} {b}'
    for key in heads:
        torch.testing.assert_close(late[key], runs['ddp']['states'][1][key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize('name', [r[0] for r in RUNS])
def test_mfu_counts_no_backward_through_the_frozen_backbone(runs, name):
    summary = runs[name]['summary']
    fwd, train = summary['flops_per_image_fwd'], summary['flops_per_image_train']
    # The forward plus 2x the heads' (FPN over a frozen ResNet), not the 3x forward of a full step.
    assert fwd < train < 3 * fwd
    assert (fwd, train) == (runs['ddp']['summary']['flops_per_image_fwd'],
                            runs['ddp']['summary']['flops_per_image_train'])
    for row in runs[name]['rows']:  # train.peak_tflops=1: the whole run's FLOP/s over 2 ranks' peak
        if row['images_per_s']:
            assert row['mfu'] == pytest.approx(train * row['images_per_s'] / (1e12 * 2), rel=1e-9)


def test_a_resume_that_freezes_otherwise_is_refused(runs):
    got = runs['unfrozen_resume']
    assert isinstance(got, str) and got.startswith('--resume: '), got
    assert 'optim.paramwise.freeze_backbone True there' in got, got


def test_a_backbone_without_weights_is_not_frozen(runs):
    got = runs['no_pretrained']
    assert isinstance(got, str) and got.startswith('optim.paramwise.freeze_backbone=True: the backbone has no '
                                                   'pretrained weights'), got
