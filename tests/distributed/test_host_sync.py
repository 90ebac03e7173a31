"""No host synchronisation inside a plain training step (issue: a GPU step stalled the host).

On a GPU, reading a device tensor (``.item()``, ``float()``, ``bool()``, ``.tolist()``, a blocking
copy to the host), ``torch.cuda.synchronize`` and a blocking collective all make the host wait
for the device's queue. On these CPU ranks nothing waits, so the calls themselves are counted:
every such call made *directly by ds_seg code* is recorded with the step it happened in. (What
torch or DeepSpeed do inside their own calls is theirs: tests/gpu runs the loop under
``torch.cuda.set_sync_debug_mode('error')`` for that.)

A plain step (not a log, evaluation, checkpoint or stop-check step) must record none. Check
steps come every ``train.stop_check_interval`` steps, and a stop signal that one rank receives
between them is honoured at the next one, on every rank, with a checkpoint.
"""
import os
import signal
import sys

import pytest
import torch

from tests.dist import run_on_ranks
from tests.tiny import ds_config, tiny_cfg

MAX_STEPS = 12
LOG_INTERVAL = 3
CHECK_INTERVAL = 4
SIGNAL_AT = 7          # rank 1 receives SIGUSR1 while it starts step 7 (a plain step)
STOP_AT = 8            # the next check step
DS_SEG = os.sep + 'ds_seg' + os.sep


def _host_only(frame):
    """Reads of tensors that never go to the device: the batch's flip codes, read on the host
    before the batch is copied (ds_seg/data/preprocess.py)."""
    import linecache
    return "batch['geom']" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def _instrument(events, current):
    """Wrap the host-reading calls; record (step, call, where) for calls made from ds_seg code."""
    import torch.distributed as dist

    def record(name, depth=2):
        frame = sys._getframe(depth)
        if DS_SEG in frame.f_code.co_filename and not _host_only(frame):
            where = f"{frame.f_code.co_filename.split(DS_SEG)[-1]}:{frame.f_lineno}"
            events.append((current['step'], name, where))

    def wrap(owner, name, counts=lambda *a, **k: True):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if counts(*args, **kwargs):
                record(name)
            return original(*args, **kwargs)
        setattr(owner, name, wrapper)

    for name in ('item', 'tolist', '__float__', '__bool__', '__int__', 'numpy'):
        wrap(torch.Tensor, name)

    def to_host_blocking(tensor, *args, **kwargs):
        target = kwargs.get('device', args[0] if args else None)
        is_cpu = (isinstance(target, str) and target.startswith('cpu')) or (
            isinstance(target, torch.device) and target.type == 'cpu')
        return is_cpu and not kwargs.get('non_blocking', False)
    wrap(torch.Tensor, 'to', to_host_blocking)
    wrap(torch.Tensor, 'cpu')
    wrap(torch.cuda, 'synchronize')
    wrap(torch.cuda.Event, 'synchronize')
    for name in ('all_reduce', 'barrier', 'all_gather_object', 'broadcast', 'all_gather'):
        wrap(dist, name)


def _run(tmp, backend, stage):
    from ds_seg.engine.trainer import Trainer
    events, current = [], {'step': 0}
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=MAX_STEPS, log_interval=LOG_INTERVAL,
                   stop_check_interval=CHECK_INTERVAL, warmup_log_steps=1)
    trainer = Trainer(cfg, ds_config(stage, grad_accum=2), backend=backend,
                      work_dir=os.path.join(tmp, f'{backend}{stage}'))
    real_step = trainer.train_step

    def train_step(want_grad_norm=False):
        current['step'] = trainer.step + 1
        if current['step'] == SIGNAL_AT and trainer.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)   # only this rank is signalled
        return real_step(want_grad_norm=want_grad_norm)
    trainer.train_step = train_step
    _instrument(events, current)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    saved = sorted(n for n in os.listdir(os.path.join(tmp, f'{backend}{stage}', 'checkpoints')) if n.startswith('step_'))
    return dict(events=events, summary=summary, saved=saved)


def _ranks(tmp):
    # Instrumentation patches torch for the rest of the process: one backend per process group.
    return {name: run_on_ranks(_run, 2, args=(tmp, *case))
            for name, case in (('ddp', ('ddp', 0)), ('zero2', ('deepspeed', 2)))}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    return _ranks(str(tmp_path_factory.mktemp('sync')))


def _kinds(steps):
    log = {s for s in steps if s % LOG_INTERVAL == 0}
    check = {s for s in steps if s % CHECK_INTERVAL == 0}
    return log, check, set(steps) - log - check


@pytest.mark.parametrize('name', ['ddp', 'zero2'])
def test_plain_steps_read_nothing_from_the_device(runs, name):
    for rank, result in enumerate(runs[name]):
        steps = range(1, STOP_AT + 1)
        _, _, plain = _kinds(steps)
        assert plain == {1, 2, 5, 7}
        in_plain = [e for e in result['events'] if e[0] in plain]
        assert not in_plain, f'rank {rank}: host reads in plain steps: {in_plain}'
        # The instrumentation sees the loop's reads where they are allowed (it can fail).
        seen_at = {e[0] for e in result['events'] if e[0] > 0}
        assert {3, 4, 6, 8} <= seen_at, sorted(seen_at)


@pytest.mark.parametrize('name', ['ddp', 'zero2'])
def test_ranks_agree_every_interval_and_honour_a_signal_at_the_next_check(runs, name):
    for rank, result in enumerate(runs[name]):
        agreed = sorted({e[0] for e in result['events'] if e[1] == 'all_reduce' and 'faults.py' in e[2]})
        log, check, _ = _kinds(range(1, STOP_AT + 1))
        assert agreed == sorted(log | check), agreed
        summary = result['summary']
        assert summary['exit_reason'] == 'preempted' and summary['steps'] == STOP_AT, summary
        assert result['saved'][-1] == f'step_{STOP_AT:08d}'
