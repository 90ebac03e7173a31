"""BatchNorm running statistics are made equal across ranks at the documented points -- before
every evaluation and every checkpoint -- and only there (on CPU ranks there is no SyncBatchNorm:
each rank normalises with its own micro-batch, as DDP does by default).

The control: just before each synchronisation the ranks' statistics differ (they saw different
data), so equality afterwards is the synchronisation's doing, not the data's.
"""
import os

import pytest
import torch

from ds_seg.registry import MODELS
from tests.dist import run_on_ranks
from tests.tiny import ds_config, tiny_cfg

MAX_STEPS, EVAL_EVERY = 4, 2     # evaluation at 2 and 4, a checkpoint at 4


def _train(tmp, backend, stage):
    from ds_seg.engine.common import batchnorm_buffers
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=MAX_STEPS, eval_interval=EVAL_EVERY,
                   checkpoint_interval=MAX_STEPS)
    trainer = Trainer(cfg, ds_config(stage), backend=backend, work_dir=os.path.join(tmp, f'{backend}{stage}'))
    calls = []
    real_sync = trainer.backend.sync_buffers

    def sync():
        flat = lambda: torch.cat([b.detach().flatten().clone() for b in batchnorm_buffers(trainer.backend.module)])  # noqa: E731
        before = flat()
        real_sync()
        calls.append(dict(step=trainer.step, before=before, after=flat()))
    trainer.backend.sync_buffers = sync
    try:
        trainer.fit()
    finally:
        trainer.close()
    return calls


@pytest.mark.parametrize('backend, stage', [('ddp', 0), ('deepspeed', 2)])
def test_batchnorm_statistics_are_averaged_before_each_evaluation_and_checkpoint(tmp_path, backend, stage):
    r0, r1 = run_on_ranks(_train, 2, args=(str(tmp_path), backend, stage))
    # evaluation at 2; evaluation then checkpoint at 4 (the second finds them equal already)
    assert [c['step'] for c in r0] == [c['step'] for c in r1] == [2, 4, 4]
    for a, b in zip(r0[:2], r1[:2]):
        assert not torch.allclose(a['before'], b['before']), 'control: ranks saw different data'
        mean = (a['before'] + b['before']) / 2
        assert torch.allclose(a['after'], mean, rtol=1e-6, atol=1e-7)
        assert torch.equal(a['after'], b['after'])
    assert torch.equal(r0[2]['before'], r1[2]['before'])


def _average_on_ranks():
    from ds_seg import distributed
    distributed.init(use_deepspeed=False)
    rank = distributed.rank()
    same64 = torch.full((3,), 0.1, dtype=torch.float64)
    same32 = torch.full((2,), 0.1)
    differing = torch.tensor([float(rank), 1.0])
    distributed.average_where_different_([same64, same32, differing, torch.empty(0)])
    return same64, same32, differing


def test_buffers_that_agree_are_left_bit_for_bit_and_those_that_differ_are_averaged():
    """On 3 ranks the mean of three float64 0.1s is 0.10000000000000002: a constant buffer
    averaged at every checkpoint would drift."""
    assert (0.1 + 0.1 + 0.1) / 3 != 0.1, 'control: averaging equal values rounds here'
    for same64, same32, differing in run_on_ranks(_average_on_ranks, 3):
        assert torch.equal(same64, torch.full((3,), 0.1, dtype=torch.float64))
        assert torch.equal(same32, torch.full((2,), 0.1))
        assert torch.equal(differing, torch.tensor([1.0, 1.0]))   # (0 + 1 + 2) / 3; 1 agrees


@MODELS.register_module()
class RunningScaleNet(torch.nn.Module):
    """No BatchNorm: a float buffer updated from each rank's own data in training (an EMA of its
    activations' scale), beside a constant one."""

    def __init__(self, in_channels=3, num_classes=6):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, 8, 3, padding=1)
        self.cls = torch.nn.Conv2d(8, num_classes, 1)
        self.register_buffer('running_scale', torch.ones(1))
        self.register_buffer('offset', torch.full((1,), 0.1, dtype=torch.float64))

    def forward(self, x):
        h = torch.relu(self.conv(x))
        if self.training:
            with torch.no_grad():
                self.running_scale.mul_(0.5).add_(0.5 * h.abs().mean())
        return self.cls(h / self.running_scale + self.offset.float())


def _train_running_scale(tmp, work, resume):
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4, checkpoint_interval=2)
    cfg.model = dict(type='RunningScaleNet', in_channels=3, num_classes=6)
    trainer = Trainer(cfg, ds_config(2), work_dir=os.path.join(tmp, work), resume=resume)
    seen = []
    real_sync = trainer.backend.sync_buffers

    def sync():
        seen.append(trainer.backend.module.running_scale.clone())
        real_sync()
    trainer.backend.sync_buffers = sync
    try:
        trainer.fit()
        module = trainer.backend.module
        return dict(params=torch.cat([p.detach().flatten().clone() for p in module.parameters()]),
                    buffers={k: v.clone() for k, v in module.named_buffers()}, before_sync=seen)
    finally:
        trainer.close()


def test_a_resume_equals_the_uninterrupted_run_for_a_model_with_its_own_running_buffer(tmp_path):
    """The checkpoint held rank 0's running_scale and every rank resumed from it: rank 1's
    differed from the run that never stopped, and so did every later step."""
    import shutil
    tmp = str(tmp_path)
    straight = run_on_ranks(_train_running_scale, 2, args=(tmp, 'straight', None))
    assert not torch.equal(straight[0]['before_sync'][0], straight[1]['before_sync'][0]), \
        'control: the ranks saw different data'
    run_on_ranks(_train_running_scale, 2, args=(tmp, 'interrupted', None))
    shutil.rmtree(os.path.join(tmp, 'interrupted', 'checkpoints', 'step_00000004'))
    resumed = run_on_ranks(_train_running_scale, 2, args=(tmp, 'interrupted', 'auto'))
    for rank in (0, 1):
        assert torch.equal(straight[rank]['params'], resumed[rank]['params'])
        assert torch.equal(straight[rank]['buffers']['running_scale'], resumed[rank]['buffers']['running_scale'])
        assert torch.equal(resumed[rank]['buffers']['offset'], torch.full((1,), 0.1, dtype=torch.float64))
