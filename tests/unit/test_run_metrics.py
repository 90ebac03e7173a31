"""Non-finite losses are counted on the device between check steps (ds_seg/engine/run_metrics.py):
the longest run of consecutive non-finite steps since the last check, and the run still going."""
import math

import torch

from ds_seg.engine.run_metrics import RunMetrics
from ds_seg.engine.run_spec import RunSpec


def _metrics():
    spec = RunSpec(backend='ddp', rank=0, world_size=1, device=torch.device('cpu'), launcher='python',
                   micro_batch=1, grad_accum=1, global_batch=1, zero_stage=None, precision='fp32', ds_config={})
    return RunMetrics(spec, log=None, backend=None, flops_per_image=None, peak_flops=None, warmup_steps=0,
                      max_steps=10, train_images=1, report=print, t_start=0.0)


def _feed(metrics, losses):
    for value in losses:
        metrics.add_step(torch.tensor(value))


def test_counts_between_checks_are_the_longest_run_and_the_current_one():
    m = _metrics()
    nan, inf = math.nan, math.inf
    _feed(m, [1.0, nan, inf, nan, 2.0, nan])            # a run of 3 that ended, then one going on
    assert m.take_nonfinite_counts().tolist() == [3, 1]
    _feed(m, [nan, nan])                                 # the run continues across the check
    assert m.take_nonfinite_counts().tolist() == [3, 3]
    _feed(m, [1.0])                                      # a finite loss ends it; nothing since the check
    assert m.take_nonfinite_counts().tolist() == [0, 0]
    _feed(m, [1.0, 1.0])
    assert m.take_nonfinite_counts().tolist() == [0, 0]


def test_loss_sum_stays_a_device_tensor_until_the_log_step():
    m = _metrics()
    _feed(m, [1.0, 2.5])
    assert isinstance(m._loss_sum, torch.Tensor) and float(m._loss_sum) == 3.5


def test_the_summary_median_is_the_median_of_this_runs_configuration(tmp_path):
    """Four rows gave the upper middle one (425.81 of [433.82, 415.67, 425.81, 414.25], median
    420.74); after a resume on another number of ranks the earlier pass's rows counted too."""
    import json
    import types
    from ds_seg.telemetry import RunLog
    rows = [dict(step=1, images_per_s=100.0, world_size=2), dict(step=2, images_per_s=433.82, world_size=1),
            dict(step=3, images_per_s=415.67, world_size=1), dict(step=4, images_per_s=425.81, world_size=1),
            dict(step=5, images_per_s=414.25, world_size=1, loss=1.0)]
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    m = _metrics()
    m.log = RunLog(str(tmp_path), enabled=True)
    m.backend = types.SimpleNamespace(skipped_steps=0, optimizer_impl='torch.AdamW')
    summary = m.write_summary('completed', 5, None, str)
    assert summary['images_per_s_median'] == (415.67 + 425.81) / 2


def test_a_full_disk_while_logging_names_the_file(tmp_path):
    """A buffered write fails when the file closes, with no file name: the stop line said
    "a file: [Errno 28 ENOSPC]". /dev/full answers every write with ENOSPC."""
    import os

    import pytest

    from ds_seg.engine.faults import describe_io_error
    from ds_seg.telemetry import RunLog
    log = RunLog(str(tmp_path), enabled=True)
    os.symlink('/dev/full', tmp_path / 'metrics.jsonl')
    os.symlink('/dev/full', tmp_path / '.summary.json.tmp')
    for write in (lambda: log._append('metrics.jsonl', {'step': 1}), lambda: log.write_json('summary.json', {})):
        with pytest.raises(OSError) as failed:
            write()
        said = describe_io_error(failed.value)
        assert said.startswith(str(tmp_path)) and 'ENOSPC' in said and 'a file' not in said, said
    assert not os.path.exists(tmp_path / 'summary.json')   # nothing half-written in its place


def test_a_window_resumed_at_another_number_of_ranks_keeps_its_mean():
    """Steps 6-7 of a window were trained on 2 ranks (loss 1.0 each: sums [2, 2]), the rest on 1.
    Rank 0 took the 2 ranks' sum as it was, and the row (divided by steps x this run's 1 rank)
    read 1.4 where every loss was 1.0."""
    m = _metrics()
    m.start_loop(7, dict(start=5, loss_sums=[2.0, 2.0]))
    _feed(m, [1.0, 1.0, 1.0])                       # steps 8-10
    assert m.window_start_step == 5 and float(m._loss_sum) * 1 / (10 - 5) == 1.0
    same = _metrics()
    same.start_loop(7, dict(start=5, loss_sums=[2.0]))   # the same number of ranks: its own sum
    assert float(same._loss_sum) == 2.0


def test_wall_time_total_adds_the_earlier_passes_up_to_the_checkpoint_resumed(tmp_path):
    """summary.json's wall_time_s is this pass's: after a requeued job's five starts it said the
    last one's minutes. wall_time_total_s adds the time of the passes before, up to the
    checkpoint resumed from (its client state records it)."""
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import ds_config, tiny_cfg

    def run(max_steps, resume=None):
        cfg = tiny_cfg(tmp_path / 'cache', max_steps=max_steps, checkpoint_interval=2)
        trainer = Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp_path / 'work'), resume=resume)
        try:
            return trainer.fit()
        finally:
            trainer.close()
    first = run(4)
    assert 0 < first['wall_time_s'] <= first['wall_time_total_s'] < first['wall_time_s'] + 0.5
    second = run(6, resume='auto')
    earlier = second['wall_time_total_s'] - second['wall_time_s']
    # The checkpoint of step 4 was saved before the first pass's end: less, but most of it.
    assert 0.5 * first['wall_time_s'] < earlier <= first['wall_time_s'], (earlier, first['wall_time_s'])
