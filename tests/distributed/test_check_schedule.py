"""The default check steps on a GPU: at most 10 steps apart, and fewer where 10 steps would take
longer than CHECK_SPACING_S (ds_seg.engine.faults.CheckSchedule). With a fixed 10, a stop signal
during a run of 3 s steps reached its check step after up to 30 s: past the SIGKILL that the
launchers (after a Ctrl-C) and Slurm (KillWait, after the time limit's SIGTERM) send at 30 s, so
the stop's checkpoint was lost.

The ranks here run on CPUs, where the default is every step; the GPU default's cap of 10 is put
in place by the test, and ``DS_SEG_FAULT=slow@step`` makes one rank's steps slow (a slow node)."""
import os
import time

import torch

from ds_seg.engine import faults
from ds_seg.engine.faults import CHECK_SPACING_S, CheckSchedule
from tests.dist import run_on_ranks
from tests.tiny import ds_config, fit_and_close, signal_at_step, tiny_cfg

SLOW_STEP_S = 0.6     # rank 1's steps take at least this: at most int(2 / 0.6) = 3 steps between checks
SIGNAL_AT = 5         # rank 0 gets SIGUSR1 while it runs step 5


def test_the_schedule_keeps_checks_within_the_spacing_and_the_cap():
    gpu = torch.device('cuda')
    checks = CheckSchedule(None, gpu, start_step=20)
    assert [s for s in range(20, 40) if checks.due(s)] == list(range(21, 40))  # the first step is one
    checks.checked(21, 0.0)                    # no time measured (a step of 0 us): the cap
    assert checks.next == 31
    checks.checked(31, 0.05)                   # fast steps: 10 (2 s would be 40)
    assert checks.next == 41
    checks.checked(41, 0.45)                   # 4 steps = 1.8 s, 5 would pass 2 s
    assert checks.next == 41 + int(CHECK_SPACING_S / 0.45) == 45
    checks.checked(45, 30.0)                   # a step longer than the spacing: every step
    assert checks.next == 46 and not checks.due(45) and checks.due(46)
    # The time per step is this rank's own, since the last check ended.
    time.sleep(0.2)
    assert 0.1 <= checks.seconds_per_step(47) <= 1.0
    # A fixed train.stop_check_interval keeps its multiples, whatever the steps take.
    fixed = CheckSchedule(4, gpu)
    fixed.checked(4, 30.0)
    assert [s for s in range(1, 13) if fixed.due(s)] == [4, 8, 12]
    assert [s for s in range(1, 5) if CheckSchedule(None, torch.device('cpu')).due(s)] == [1, 2, 3, 4]


def _run(tmp):
    from ds_seg.engine.trainer import Trainer
    faults.default_stop_check_interval = lambda device: 10   # the GPU default's cap, on these CPU ranks
    rank = int(os.environ['RANK'])
    if rank == 1:
        os.environ['DS_SEG_FAULT'] = f'slow@step:{SLOW_STEP_S}'
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=30, log_interval=100)
    trainer = Trainer(cfg, ds_config(2), backend='deepspeed', work_dir=os.path.join(tmp, 'work'))
    checked, real_checked = [], CheckSchedule.checked

    def record(schedule, step, slowest_step_s):
        checked.append((step, slowest_step_s))
        real_checked(schedule, step, slowest_step_s)
    CheckSchedule.checked = record
    if rank == 0:
        signal_at_step(trainer, SIGNAL_AT)
    summary = fit_and_close(trainer)
    saved = sorted(n for n in os.listdir(os.path.join(tmp, 'work', 'checkpoints')) if n.startswith('step_'))
    return dict(checked=checked, summary=summary, saved=saved)


def test_slow_steps_bring_the_check_steps_closer_on_every_rank_alike(tmp_path):
    ranks = run_on_ranks(_run, 2, args=(str(tmp_path),), timeout=600)
    # Both ranks chose the same check steps from the agreed (slowest) step time: rank 0's own
    # steps are as slow only because it waits for rank 1 in the gradient all-reduce.
    assert [s for s, _ in ranks[0]['checked']] == [s for s, _ in ranks[1]['checked']]
    assert ranks[0]['checked'] == ranks[1]['checked']
    steps = [s for s, _ in ranks[0]['checked']]
    assert steps[0] == 1 and all(1 <= b - a <= int(CHECK_SPACING_S / SLOW_STEP_S) for a, b in zip(steps, steps[1:]))
    assert all(slowest >= SLOW_STEP_S for _, slowest in ranks[0]['checked'][1:])
    # The signal after step 4 stops the run at the next check step, not at step 10.
    for result in ranks:
        stop = result['summary']['steps']
        assert result['summary']['exit_reason'] == 'preempted' and SIGNAL_AT <= stop <= SIGNAL_AT + 2
        assert result['saved'][-1] == f'step_{stop:08d}'
