"""The ranks' agreement on a stop signal (ds_seg.engine.faults.StopRequests): which signal the
stop line names, and the step it arrived after, when a rank gets two signals or ranks get
different ones. Real signals to real processes; the two-rank cases run a real gloo all-reduce."""
import os
import signal
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_seg import stop_signals
from ds_seg.engine import faults

NO_NONFINITE = torch.zeros(2, dtype=torch.int64)


@pytest.fixture
def stop_requests():
    """A StopRequests in this process; the signal handlers it installs are put back afterwards."""
    saved = {name: signal.getsignal(getattr(signal, name)) for name in stop_signals.STOP_SIGNALS}
    kept, stop_signals.first_signal[0] = stop_signals.first_signal[0], None
    yield faults.StopRequests
    stop_signals.first_signal[0] = kept
    for name, handler in saved.items():
        signal.signal(getattr(signal, name), handler)


def _signal_self(signum):
    os.kill(os.getpid(), signum)   # the handler runs before os.kill returns to Python code


def test_no_signal_no_stop(stop_requests):
    stop = stop_requests()
    assert stop.agree(NO_NONFINITE) == (False, 0, 0)
    assert stop.agreed is None


def test_the_first_signal_is_the_reason_a_later_one_does_not_replace_it(stop_requests):
    """Slurm's time-limit warning (USR1), then its SIGTERM at the limit, both before the next
    check step (a slow first step on a loaded node): the stop is the warning's, at its step."""
    stop = stop_requests(start_step=2)
    stop.steps_done = 3
    _signal_self(signal.SIGUSR1)
    stop.steps_done = 4
    _signal_self(signal.SIGTERM)
    assert stop.agree(torch.tensor([1, 0])) == (True, 1, 0)
    assert stop.describe() == 'SIGUSR1 (arrived after step 3)'


def test_a_signal_from_start_up_arrived_after_the_start_step(stop_requests):
    stop_signals.first_signal[0] = 'SIGTERM'   # kept by catch_stop_signals() while the rank was starting
    stop = stop_requests(start_step=40)
    stop.steps_done = 41
    _signal_self(signal.SIGUSR1)
    stop.agree(NO_NONFINITE)
    assert stop.describe() == 'SIGTERM (arrived after step 40)'


def _rank(rank, init_file, plan, results):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=len(plan))
    stop = faults.StopRequests()
    for steps_done, signum in plan[rank]:
        stop.steps_done = steps_done
        os.kill(os.getpid(), signum)
    counts = torch.tensor([rank + 1, rank])
    signalled, longest, current = stop.agree(counts)
    results[rank] = (signalled, longest, current, stop.describe() if signalled else None)
    dist.destroy_process_group()


def _agree_on_two_ranks(plan):
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.start_processes(_rank, args=(os.path.join(tmp, 'init'), plan, results), nprocs=len(plan),
                           start_method='spawn')
        return [results[r] for r in range(len(plan))]


@pytest.mark.parametrize('plan, said', [
    # rank 0 had SIGTERM after step 5, rank 1 SIGUSR1 after step 7: the earlier arrival is named
    ([[(5, signal.SIGTERM)], [(7, signal.SIGUSR1)]], 'SIGTERM (arrived after step 5)'),
    ([[(9, signal.SIGTERM)], [(6, signal.SIGUSR1), (8, signal.SIGTERM)]], 'SIGUSR1 (arrived after step 6)'),
    # the same step on both: the higher signal number, whichever rank had it
    ([[(5, signal.SIGUSR1)], [(5, signal.SIGTERM)]], 'SIGTERM (arrived after step 5)'),
    # one rank only: the other names it too
    ([[], [(12, signal.SIGUSR1)]], 'SIGUSR1 (arrived after step 12)'),
    ([[], []], None),
])
def test_ranks_agree_on_the_signal_that_arrived_first(plan, said):
    results = _agree_on_two_ranks(plan)
    # every rank: the same answer, and the non-finite counters' maximum over ranks
    assert results == [(said is not None, 2, 1, said)] * 2


def test_stop_lines_say_which_checkpoint_to_go_on_from_and_never_claim_one_that_is_not_there(tmp_path):
    """A non-finite-loss stop or a failed write said "the last checkpoint is intact" where none
    had been written; a non-finite stop names the checkpoint whose weights gave the first
    non-finite loss (saved at the step before it) and the one before that to go on from."""
    import errno
    from types import SimpleNamespace

    from ds_seg.engine import checkpoint
    from ds_seg.engine.faults import Faults
    from ds_seg.engine.trainer import Trainer
    root = tmp_path / 'checkpoints'
    root.mkdir()

    def message(step, current):
        run = SimpleNamespace(checkpointer=SimpleNamespace(root=str(root)), step=step)
        return Trainer._nonfinite_stop_message(run, current, current)

    assert message(4, 2).endswith('no checkpoint was written: lower the learning rate and start again, or check the data.')
    full = OSError(errno.ENOSPC, 'No space left on device')
    _, error, _ = Faults().classify(full, 4, lambda: None)
    assert 'no checkpoint was written; free space or fix the disk, then start the run again.' in str(error)
    for step in (1, 2):
        (root / checkpoint.tag_for(step)).mkdir()
        (root / checkpoint.tag_for(step) / checkpoint.COMPLETE).write_text('{"files": {}}')
    assert message(4, 2).endswith(f"the checkpoint of step 2 holds the weights that gave the first of them: go on from "
                                  f"step_00000001 with a lower learning rate (--resume {root / 'step_00000001'}), or "
                                  "check the data.")
    assert message(5, 2).endswith(f"the last checkpoint ({root / 'step_00000002'}) is intact: go on from it with a "
                                  "lower learning rate, or check the data.")


def test_only_a_collectives_failure_is_called_a_lost_rank():
    """A mid-run DataError saying a server 'timed out' (exit 65 promised) and a stdout whose reader
    quit ('Broken pipe') were matched by their words and called a lost rank: exit 4, 'check the
    node', on a single process too."""
    import errno

    import torch
    from ds_seg.data.raster import DataError
    from ds_seg.engine.faults import Faults, is_collective_failure
    stalled = DataError('https://example.org/t.tif: window (0, 0, 512, 512) could not be read; a request for it now '
                        'timed out: no answer within 10 s')
    reset = DataError('https://example.org/t.tif: read failed: Connection reset by peer')
    for exc in (stalled, reset):
        reason, raised, line = Faults().classify(exc, 12, lambda: None)
        assert (reason, raised) == ('error', exc) and line.startswith('DataError: https://example.org/t.tif')
    reason, raised, _ = Faults().classify(BrokenPipeError(errno.EPIPE, 'Broken pipe'), 12, lambda: None)
    assert reason == 'io_error' and '[Errno 32 EPIPE] Broken pipe' in str(raised)
    assert not is_collective_failure(RuntimeError('gloo: connection closed by peer'))   # one process: no peer
    assert is_collective_failure(torch.distributed.DistBackendError('NCCL watchdog timeout'))
