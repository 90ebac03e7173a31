"""The rows a resumed run logs are the uninterrupted run's. A stop between log steps (a signal at
step 7 with log_interval=5) checkpoints inside an open log window; the resumed run's first row
averaged only the steps since the checkpoint (8-10 for the 6-10 the uninterrupted row holds), a
different number in metrics.jsonl and possibly summary.json's final_loss. The window's per-rank
loss sums now travel in the checkpoint. (2 CPU ranks, ZeRO-1 and DDP, the tiny UNet.)"""
import os

import pytest

from tests.dist import run_on_ranks
from tests.tiny import ds_config, fit_and_close, read_jsonl, signal_at_step, tiny_cfg

pytestmark = pytest.mark.slow
STEPS, LOG_EVERY, SIGNAL_AT = 12, 5, 7


def _run(tmp, backend, stage, name, resume=None, signal_at=None):
    """One run of the tiny UNet into ``<tmp>/<name>``: its (step, loss) rows and final_loss."""
    from ds_seg.engine.trainer import Trainer
    work = os.path.join(tmp, name)
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=STEPS, log_interval=LOG_EVERY)
    trainer = Trainer(cfg, ds_config(stage), backend=backend, work_dir=work, resume=resume)
    if signal_at and int(os.environ['RANK']) == 0:
        signal_at_step(trainer, signal_at)
    summary = fit_and_close(trainer)
    return [(r['step'], r['loss']) for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))], summary


@pytest.mark.parametrize('backend, stage', [('deepspeed', 1), ('ddp', 0)])
def test_a_resume_inside_a_log_window_logs_the_uninterrupted_rows(tmp_path, backend, stage):
    # Each run in processes of its own: a second DeepSpeed process group in one process hangs
    # in its rendezvous here.
    tmp = str(tmp_path)
    straight, summary = run_on_ranks(_run, 2, args=(tmp, backend, stage, 'straight'), timeout=300)[0]
    _, stop = run_on_ranks(_run, 2, args=(tmp, backend, stage, 'stopped', None, SIGNAL_AT), timeout=300)[0]
    assert stop['steps'] == SIGNAL_AT and stop['exit_reason'] == 'preempted'
    resumed, final = run_on_ranks(_run, 2, args=(tmp, backend, stage, 'stopped', 'auto'), timeout=300)[0]
    assert [s for s, _ in straight] == [5, 10, 12]
    assert resumed == straight and final['final_loss'] == summary['final_loss']
