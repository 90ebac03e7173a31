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
