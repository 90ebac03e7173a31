"""BatchNorm running statistics are made equal across ranks at the documented points -- before
every evaluation and every checkpoint -- and only there (on CPU ranks there is no SyncBatchNorm:
each rank normalises with its own micro-batch, as DDP does by default).

The control: just before each synchronisation the ranks' statistics differ (they saw different
data), so equality afterwards is the synchronisation's doing, not the data's.
"""
import os

import pytest
import torch

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
    real_sync = trainer.backend.sync_batchnorm_stats

    def sync():
        flat = lambda: torch.cat([b.detach().flatten().clone() for b in batchnorm_buffers(trainer.backend.module)])  # noqa: E731
        before = flat()
        real_sync()
        calls.append(dict(step=trainer.step, before=before, after=flat()))
    trainer.backend.sync_batchnorm_stats = sync
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
