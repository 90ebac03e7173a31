"""Every shipped DeepSpeed JSON trains: three steps of the tiny model on one CPU rank, each row
logged with a finite loss and gradient norm. (ZeRO-0 native bf16, zero0_bf16.json, died at its
first log step with a TypeError: its optimizer was taken for the loss-scaled fp16 one.)"""
import math
import os

import pytest

from ds_seg.config import DS_CONFIGS_DIR
from tests.dist import run_on_ranks
from tests.tiny import read_jsonl, tiny_cfg

pytestmark = pytest.mark.slow
NAMES = sorted(p.stem for p in DS_CONFIGS_DIR.glob('*.json'))


def _train_each(tmp):
    """On one rank, one process (start-up dominates): each JSON as shipped, but for torch's Adam
    (DeepSpeed's CPU Adam is a first-use JIT build, kept out of the tests) and a micro-batch of 2."""
    from ds_seg.config import load_ds_config
    from ds_seg.engine.trainer import Trainer
    out = {}
    for name in NAMES:
        ds = load_ds_config(str(DS_CONFIGS_DIR / f'{name}.json'))
        ds['optimizer']['params']['torch_adam'] = True
        if 'offload' in name:
            ds['zero_force_ds_cpu_optimizer'] = False
        ds['train_micro_batch_size_per_gpu'] = 2
        work = os.path.join(tmp, name)
        trainer = Trainer(tiny_cfg(os.path.join(tmp, 'cache'), max_steps=3), ds, work_dir=work)
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
        rows = read_jsonl(os.path.join(work, 'metrics.jsonl'))
        out[name] = (summary['exit_reason'], [(r['step'], r['loss'], r['grad_norm'], r['precision']) for r in rows])
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    return run_on_ranks(_train_each, 1, args=(str(tmp_path_factory.mktemp('shipped')),), timeout=600)[0]


@pytest.mark.parametrize('name', NAMES)
def test_every_shipped_json_trains_and_logs_finite_numbers(runs, name):
    reason, rows = runs[name]
    assert reason == 'completed', rows
    assert [r[0] for r in rows] == [1, 2, 3]
    for step, loss, grad_norm, precision in rows:
        assert math.isfinite(loss) and grad_norm is not None and math.isfinite(grad_norm) and grad_norm > 0, rows
    if name.endswith('_bf16'):
        assert rows[0][3] == 'bf16', rows   # native bf16 runs on a CPU (fp16 falls back to bf16 autocast)


def test_zero0_native_bf16_logs_the_gradient_norm_zero1_does(runs):
    """Same model, data and precision: the same losses, and the same norms up to the float32 vs
    float64 sums the two optimizers take them with (a norm divided by a loss scale this optimizer
    does not have would be off by orders of magnitude, or fail as it did)."""
    zero0, zero1 = runs['zero0_bf16'][1], runs['zero1_bf16'][1]
    assert [r[1] for r in zero0] == [r[1] for r in zero1]
    assert [r[2] for r in zero0] == pytest.approx([r[2] for r in zero1], rel=1e-6)
