"""GPU checks (skipped without CUDA; CI has none): the main command's code path on one GPU with
native fp16/bf16, where BatchNorm must run in fp32 and DeepSpeed's loss scaling is live."""
import os

import pytest
import torch

from tests.dist import run_on_ranks
from tests.tiny import ds_config, read_jsonl, tiny_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


def _train(tmp, precision, stage):
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=20)
    trainer = Trainer(cfg, ds_config(stage, precision=precision), work_dir=os.path.join(tmp, f'{precision}{stage}'))
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.mark.parametrize('precision', ['fp16', 'bf16'])
@pytest.mark.parametrize('stage', [0, 2, 3])
def test_native_half_precision_trains_with_fp32_batchnorm(tmp_path, precision, stage):
    summary = run_on_ranks(_train, 1, args=(str(tmp_path), precision, stage))[0]
    rows = read_jsonl(os.path.join(tmp_path, f'{precision}{stage}', 'metrics.jsonl'))
    assert summary['precision'] == precision and summary['exit_reason'] == 'completed'
    assert rows[-1]['loss'] < rows[0]['loss']
    assert rows[-1]['max_mem_mb'] > 0
    assert rows[-1]['mfu'] is None or 0 < rows[-1]['mfu'] < 1


def _train_without_syncs(tmp, backend, stage):
    """bf16, 12 steps; plain steps (not log or stop-check steps) run under
    ``torch.cuda.set_sync_debug_mode('error')``: any synchronising call in them raises."""
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=12, log_interval=6, stop_check_interval=4,
                   warmup_log_steps=1)
    trainer = Trainer(cfg, ds_config(stage, precision='bf16'), backend=backend,
                      work_dir=os.path.join(tmp, f'sync_{backend}{stage}'))
    real_step = trainer.train_step

    def train_step(want_grad_norm=False):
        step = trainer.step + 1
        # The first step builds lazily (allocator, kernels); DDP rebuilds its gradient buckets once,
        # in the second step's forward (torch's Reducer._rebuild_buckets reads sizes on the host).
        plain = step % 6 and step % 4 and step > 2
        torch.cuda.set_sync_debug_mode('error' if plain else 'default')
        return real_step(want_grad_norm=want_grad_norm)
    trainer.train_step = train_step
    try:
        return trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode('default')
        trainer.close()


@pytest.mark.parametrize('backend, stage', [('ddp', 0), ('deepspeed', 2)])
def test_plain_steps_do_not_synchronise_the_device(tmp_path, backend, stage):
    summary = run_on_ranks(_train_without_syncs, 1, args=(str(tmp_path), backend, stage))[0]
    assert summary['exit_reason'] == 'completed' and summary['steps'] == 12
