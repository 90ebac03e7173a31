"""How a run stops: signals, agreement between ranks, heartbeats, exit codes, failure classes.

* SIGUSR1 (Slurm's warning before the time limit) and SIGTERM (preemption, ``scancel``) only set
  a flag. Ranks agree on it at *check steps* (:class:`CheckSchedule`: every step on a CPU, at most
  10 steps or 2 s apart on a GPU, or every ``train.stop_check_interval`` steps; and at every log,
  evaluation and checkpoint step), then all checkpoint at that same step and exit 75. SIGHUP (the
  terminal closed; unless nohup ignores it) and Ctrl-C stop the same way, as the user's stops:
  ``interrupted``, exit 130, not requeued.
* Non-finite losses are counted on the device (no host read per step) and exchanged at the same
  check steps; ``train.max_nonfinite_steps`` consecutive ones stop the run (exit 3).
* A failed collective (a rank died, hung, or the network broke) becomes :class:`LostRankError`
  naming the rank that stopped answering (exit 4); a failed write or read becomes
  :class:`RunIOError` naming the path and errno (exit 74).

The exit codes are the contract with batch scripts (launch/slurm/*.sbatch requeue on 75).

For replayable failure tests, ``DS_SEG_FAULT=sigkill@<point>:<step>`` makes a process SIGKILL
itself at a named point of the run (see :func:`fault_point`), instead of a test racing a kill
against a save that lasts milliseconds; ``DS_SEG_FAULT=slow@step:<seconds>`` makes every step
that much longer (a slow node), so that a test can catch a short run still running.
"""
import datetime
import errno as errno_codes
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from .. import distributed
from ..stop_signals import HANGUP, STOP_SIGNALS, first_signal, takes_over

EXIT_PREEMPTED = 75   # EX_TEMPFAIL: stopped by a signal after a checkpoint; resume to continue
EXIT_NONFINITE = 3    # the loss stayed non-finite; the last checkpoint is intact
EXIT_LOST_RANK = 4    # another rank died or stopped answering
EXIT_IO_ERROR = 74    # EX_IOERR: a write or read failed (disk full, read-only, I/O error)
EXIT_DATA_ERROR = 65  # EX_DATAERR: a window of the data broke mid-run (a label value, a truncated tile)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C: stopped by the user, not requeued
EXIT_CODES = {'completed': 0, 'preempted': EXIT_PREEMPTED, 'interrupted': EXIT_INTERRUPTED,
              'nonfinite_loss': EXIT_NONFINITE, 'lost_rank': EXIT_LOST_RANK, 'io_error': EXIT_IO_ERROR}


class LostRankError(RuntimeError):
    """A collective failed because another rank died, hung past the timeout, or the network broke."""


class RunIOError(RuntimeError):
    """The run stopped on a failed write or read; the message names the path and the errno, and
    the last complete checkpoint is intact."""


def describe_io_error(exc):
    """``path: [Errno 28 ENOSPC] No space left on device`` for an OSError."""
    from .checkpoint import CheckpointWriteError
    if isinstance(exc, CheckpointWriteError):
        return str(exc)
    name = errno_codes.errorcode.get(exc.errno, exc.errno) if exc.errno else None
    where = exc.filename or 'a file'
    return f"{where}: [Errno {exc.errno} {name}] {exc.strerror or exc}" if name else f'{where}: {exc}'


def is_collective_failure(exc):
    """A collective's failure: torch's DistError, or a RuntimeError in the words gloo and NCCL
    use, where there are other ranks. Not an OSError of this rank's own (a closed or full stdout:
    'broken pipe') nor a data error whose message says a server timed out: those were called a
    lost rank (exit 4, 'check the node'), not what they are."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    from ..config import ConfigError
    if distributed.world_size() == 1 or not isinstance(exc, RuntimeError) or isinstance(exc, ConfigError):
        return False
    text = str(exc).lower()
    return any(word in text for word in ('gloo', 'nccl', 'connection closed', 'connection reset',
                                         'broken pipe', 'timed out', 'timeout'))


# ---------------------------------------------------------------------------------- signals
_NEVER = 2 ** 62
_SIGNUMS = 128       # above every signal code: (step, signal) packed into one integer
# Which signal names a stop when ranks got different ones after the same step: the later in this
# list (Ctrl-C is the user's own word; a launcher passing it on as SIGTERM does not change it).
_PRECEDENCE = ('LAUNCHER_GONE', 'SIGUSR1', 'SIGTERM', HANGUP, 'SIGINT')
INTERRUPT = 'SIGINT'
_REPEAT_WINDOW_S = 1.0  # a second SIGINT sooner is the same Ctrl-C (torchrun passes the terminal's on)
# The launcher that started this rank (deepspeed, torchrun) exited without stopping it: a signal
# to the launcher alone (`kill <pid>`, a Ctrl-C that only it got) left the ranks training on,
# unseen, holding the work dir. A stop by the user, as a Ctrl-C is.
LAUNCHER_GONE = 'LAUNCHER_GONE'
USER_STOPS = (INTERRUPT, LAUNCHER_GONE, HANGUP)   # a closed terminal too: stopped, not requeued
LAUNCHER_PROGRAMS = {'deepspeed': 'deepspeed', 'torchrun': 'torchrun'}
LAUNCHER_MODULES = {'deepspeed.launcher.launch': 'deepspeed', 'torch.distributed.run': 'torchrun',
                    'torch.distributed.launch': 'torchrun'}


def _launcher_name(argv):
    """'deepspeed' or 'torchrun' when ``argv`` (a command line) starts one of them, else None."""
    for token in argv[:2]:  # the program, or the script python runs (python .../bin/deepspeed)
        if os.path.basename(token) in LAUNCHER_PROGRAMS:
            return LAUNCHER_PROGRAMS[os.path.basename(token)]
    modules = [b for a, b in zip(argv, argv[1:]) if a == '-m']
    return LAUNCHER_MODULES.get(modules[0]) if modules else None


def _proc_stat(pid):
    """(parent pid, start time) of ``pid`` from /proc, or None (gone, or no /proc)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            fields = f.read().rsplit(')', 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19]


def launcher_ancestors(levels=3):
    """``[(pid, start time, name)]`` of the launcher processes above this one (the deepspeed
    runner and its per-node launch.py, torchrun), by their command lines; [] where there is no /proc."""
    found, pid = [], os.getppid()
    for _ in range(levels):
        stat = _proc_stat(pid)
        if pid <= 1 or stat is None:
            break
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                argv = f.read().decode(errors='replace').split('\0')
        except OSError:
            break
        name = _launcher_name(argv)
        if name:
            found.append((pid, stat[1], name))
        pid = stat[0]
    return found


def ignore_stop_signals():
    """Once a run's outcome is decided (it completed, stopped or failed): ignore SIGUSR1/SIGTERM
    until the process exits.

    There is nothing left to checkpoint, and Python's finalization puts back the default action
    (end the process) of every signal it handles: a Slurm time-limit warning landing in the
    seconds of shutdown would turn a completed run (exit 0) into a rank killed by SIGUSR1, and a
    batch job into FAILED. Ignored at the C level, the disposition outlives finalization.
    """
    if threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)


class StopRequests:
    """Agreement between ranks on whether to stop, and why, at check steps only.

    A signal handler only sets a flag. :meth:`agree` is one tiny all-reduce on a CPU (gloo)
    group, so it never waits for the GPU's queue; the non-finite counters it carries are read
    from the device there, once per check step, never in the steps between.
    """

    def __init__(self, start_step=0):
        self.signal_name = first_signal[0]   # one that came while the run was still starting
        # Steps this rank had finished when its signal arrived: the stop line reports it, so that
        # how many steps a stop took is read from the run, not guessed from the sender's clock.
        self.steps_done = start_step
        self.arrived_after = start_step if self.signal_name else None
        self.agreed = None
        self.slowest_step_s = 0.0
        self._group = None
        self._interrupted_at = None
        self._previous_interrupt_handler = None
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                if takes_over(name):
                    signal.signal(getattr(signal, name), self._on_signal)
            # A rank started in the background of a script (the one-node sbatch template) ignores
            # SIGINT from its start, as Python leaves it: so does the run.
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                self._previous_interrupt_handler = signal.signal(signal.SIGINT, self._on_interrupt)
        if self.signal_name is None and first_signal[0]:   # one that came as the handlers changed
            self.signal_name, self.arrived_after = first_signal[0], start_step
        if dist.is_initialized() and distributed.world_size() > 1:
            self._group = dist.new_group(backend='gloo') if dist.get_backend() != 'gloo' else None
        self._launchers = launcher_ancestors()
        self._watching = threading.Event()
        if self._launchers:
            threading.Thread(target=self._watch_launchers, daemon=True, name='ds_seg-launcher-watch').start()

    def _watch_launchers(self, interval_s=1.0):
        while not self._watching.wait(interval_s):
            gone = next(((pid, name) for pid, start, name in self._launchers
                         if (_proc_stat(pid) or (None, None))[1] != start), None)
            if gone:
                if self.signal_name is None:
                    self.arrived_after, self.signal_name = self.steps_done, LAUNCHER_GONE
                    if distributed.is_main():
                        os.write(2, f'[ds_seg] the launcher ({gone[1]}, pid {gone[0]}) exited: stopping at the '
                                    'next check step with a checkpoint\n'.encode())
                return

    def _on_signal(self, signum, frame):
        # The first signal is the reason for the stop; a later one (Slurm's SIGTERM at the time
        # limit after its USR1 warning, both before a slow first step) only repeats the request.
        if self.signal_name is None:
            self.arrived_after = self.steps_done
            self.signal_name = signal.Signals(signum).name

    def _on_interrupt(self, signum, frame):
        """Ctrl-C: the first stops the run at the next check step with a checkpoint, as a
        SIGTERM does; a second one (a second later or more) stops it at once, without one."""
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at = now
            self._on_signal(signum, frame)
            if distributed.is_main():  # os.write: a print could land inside another print
                os.write(2, b'[ds_seg] Ctrl-C: stopping at the next check step with a checkpoint '
                            b'(Ctrl-C again to stop at once, without one)\n')
        elif now - self._interrupted_at >= _REPEAT_WINDOW_S:
            raise KeyboardInterrupt

    def close(self):
        """Ctrl-C does what it did before the loop (Python's default: KeyboardInterrupt) once it is over."""
        self._watching.set()
        if self._previous_interrupt_handler is not None:
            signal.signal(signal.SIGINT, self._previous_interrupt_handler)

    def agree(self, nonfinite_counts, seconds_per_step=0.0):
        """Collective. ``nonfinite_counts`` = (longest run of consecutive non-finite steps since the
        last check, current run) on this rank, as a device tensor. Returns ``(any rank signalled,
        longest run, current run)``, the maximum over ranks: the same answer everywhere. The
        signal that arrived first (after the fewest steps; the later in _PRECEDENCE on a tie) is agreed
        too, so every rank's :meth:`describe` names it even if its own copy is late or differs;
        so is the slowest ``seconds_per_step`` (``slowest_step_s``, for :class:`CheckSchedule`)."""
        counts = nonfinite_counts.to('cpu', torch.int64)     # the one device read of a check step
        # One number whose maximum is the earliest arrival, then the later in _PRECEDENCE.
        first = (-self.arrived_after * _SIGNUMS + 1 + _PRECEDENCE.index(self.signal_name)) if self.signal_name \
            else -_NEVER
        step_us = round(seconds_per_step * 1e6)   # integral: every rank reduces to the same number
        flags = torch.cat([torch.tensor([first], dtype=torch.int64), counts, torch.tensor([step_us])])
        if dist.is_initialized() and distributed.world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        first, longest, current, step_us = flags.tolist()
        self.slowest_step_s = step_us / 1e6
        signalled = first != -_NEVER
        if signalled:   # -a*K + c, 0 < c < K: Python's % gives c back, then a
            code = first % _SIGNUMS
            self.agreed = _PRECEDENCE[code - 1], (code - first) // _SIGNUMS
        return signalled, int(longest), int(current)

    def describe(self):
        """'SIGTERM (arrived after step 14)', once :meth:`agree` has found a signal."""
        name, arrived_after = self.agreed
        if name == LAUNCHER_GONE:
            return f"its launcher's exit (noticed after step {arrived_after})"
        return f'{name} (arrived after step {arrived_after})'


class Heartbeat:
    """Each rank stamps the time into the rendezvous store every few seconds, so that when a
    collective fails the survivors can say which rank stopped answering."""

    def __init__(self, interval_s=2.0):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._store = None
        self._thread = None
        if dist.is_initialized() and distributed.world_size() > 1:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:
                self._store = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name='ds_seg-heartbeat')
            self._thread.start()

    def _beat(self):
        key = f'ds_seg/heartbeat/{distributed.rank()}'
        while not self._stop.is_set():
            try:
                self._store.set(key, str(time.time()))
            except Exception:
                return  # the store is gone (its host died): describe_failure() will say so
            self._stop.wait(self.interval_s)

    def stale_ranks(self):
        """Ranks whose last heartbeat is older than 3 intervals; ``None`` if the store is gone."""
        if self._store is None:
            return []
        try:
            self._store.set_timeout(datetime.timedelta(seconds=5))
            now, stale = time.time(), []
            for r in range(distributed.world_size()):
                key = f'ds_seg/heartbeat/{r}'
                if not self._store.check([key]) or now - float(self._store.get(key)) > 3 * self.interval_s:
                    stale.append(r)
            return stale
        except Exception:
            return None

    def describe_failure(self):
        """A sentence naming the lost rank(s) after a failed collective."""
        time.sleep(3 * self.interval_s)  # let a dead rank's heartbeat go stale
        stale = self.stale_ranks()
        if stale is None:
            return ('lost contact with the rendezvous store hosted by rank 0 (MASTER_ADDR): '
                    'rank 0 or its node has died')
        stale = [r for r in stale if r != distributed.rank()]
        if stale:
            return f"rank{'s' if len(stale) > 1 else ''} {', '.join(map(str, stale))} stopped responding (died or hung)"
        return 'a collective failed although every rank still answers (network error or timeout)'

    def close(self):
        self._stop.set()
        if self._thread is not None:  # a stamp in flight ends first: the store goes with the process group
            self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------- the run's guard
FAULT_ENV = 'DS_SEG_FAULT'
# Where a planned fault can strike, in the order a checkpoint save passes them.
FAULT_POINTS = {
    'save-files': 'every rank has written its checkpoint files; no marker yet (all ranks die)',
    'save-marker': 'rank 0 has written and fsynced the COMPLETE marker; the folder is not yet '
                   'renamed into place (only rank 0 gets there)',
}


def planned_fault():
    """``(point, step)`` from ``DS_SEG_FAULT='sigkill@save-files:40'``, ``('slow-step', seconds)``
    from ``'slow@step:0.3'``, or None when unset; a malformed value is refused in one line
    before training starts."""
    value = os.environ.get(FAULT_ENV, '').strip()
    if not value:
        return None
    action, _, where = value.partition('@')
    point, _, arg = where.partition(':')
    if action == 'sigkill' and point in FAULT_POINTS and arg.isdigit():
        return point, int(arg)
    if action == 'slow' and point == 'step' and arg.replace('.', '', 1).isdigit():
        return 'slow-step', float(arg)
    from ..config import ConfigError
    raise ConfigError(f"{FAULT_ENV}={value!r}: expected 'sigkill@<point>:<step>' with <point> one of "
                      f"{', '.join(FAULT_POINTS)}, or 'slow@step:<seconds>'; unset it for a normal run.")


def fault_point(point, step):
    """SIGKILL this process if ``DS_SEG_FAULT`` plans a fault at ``point`` of ``step``: the exact,
    replayable stand-in for a node dying there (no handler, no flush, no cleanup)."""
    if planned_fault() == (point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def planned_step_delay():
    """Seconds ``DS_SEG_FAULT=slow@step:<seconds>`` adds to every step; 0 otherwise."""
    plan = planned_fault()
    return plan[1] if plan and plan[0] == 'slow-step' else 0.0


def resume_advice(last, fix):
    """How to go on after a stop, true to what is on disk: ``last`` (the newest complete
    checkpoint, or None) is intact and ``--resume auto`` continues it, or none was written."""
    if last:
        return f'the last complete checkpoint ({last}) is intact; {fix}, then --resume auto.'
    return f'no checkpoint was written; {fix}, then start the run again.'


class Faults:
    """What the training loop holds while it runs: the stop requests and the heartbeat, and the
    translation of an exception into the run's exit reason.

    Example::

        faults = Faults()
        try:
            ...  # steps; at check steps: signalled, longest, current = faults.stop.agree(counts)
        except Exception as exc:
            exit_reason, error, message = faults.classify(exc, step, checkpointer.last_complete)
            raise error from exc
        finally:
            faults.close()
    """

    def __init__(self, start_step=0):
        self.step_delay = planned_step_delay()  # a malformed DS_SEG_FAULT stops the run here
        self.stop = StopRequests(start_step)
        self.heartbeat = Heartbeat()

    def after_step(self, steps_done):
        self.stop.steps_done = steps_done
        if self.step_delay:  # a planned slow node (tests)
            time.sleep(self.step_delay)

    def close(self):
        self.stop.close()
        self.heartbeat.close()

    def classify(self, exc, step, last_checkpoint):
        """``(exit_reason, exception to raise, one-line error or None)`` for an exception out of
        the loop: a lost rank and a failed write get their own exceptions and exit codes; any
        other keeps its own, and its first line goes to summary.json.
        ``last_checkpoint()`` names the newest complete checkpoint (asked only for the message)."""
        if is_collective_failure(exc):
            message = (f'rank {distributed.rank()}: {self.heartbeat.describe_failure()}; stopping; '
                       f'{resume_advice(last_checkpoint(), "check the node")} ({exc})')
            return 'lost_rank', LostRankError(message), None
        if isinstance(exc, OSError):  # disk full, read-only, I/O error: checkpoint.save cleaned up
            message = (f'{describe_io_error(exc)}; stopped at step {step}; '
                       f'{resume_advice(last_checkpoint(), "free space or fix the disk")}')
            return 'io_error', RunIOError(message), message
        first_line = (str(exc).strip().splitlines() or [''])[0][:300]  # summary.json says what it was
        return 'error', exc, f'{type(exc).__name__}: {first_line}' if first_line else type(exc).__name__


def default_stop_check_interval(device):
    """Every step on a CPU (work is synchronous there, the exchange costs nothing), at most every
    10 on a GPU, so that the host runs ahead of the device between checks."""
    return 1 if device.type != 'cuda' else 10


# The most training time between two check steps of the default schedule. A stop must reach its
# check step and write its checkpoint before the launcher's or Slurm's SIGKILL (30 s after a
# Ctrl-C or the time limit's SIGTERM); a check costs one wait for the device's queue, nothing
# next to 2 s of steps.
CHECK_SPACING_S = 2.0


class CheckSchedule:
    """Which steps are *check steps*, besides log, evaluation and checkpoint steps (always are).

    ``train.stop_check_interval`` N fixes them at every N-th step. The default is every step on a
    CPU; on a GPU every 10th, or sooner where 10 steps take longer than CHECK_SPACING_S: the steps
    of a ZeRO-3 offload run take seconds each, and at 10 of them a stop signal's checkpoint came
    after the SIGKILL. The step time it goes by is the slowest rank's since the last check, agreed
    in that check's all-reduce (:meth:`StopRequests.agree`), so every rank picks the same next check
    step. It is read on the host clock at check steps only, which wait for the device anyway.

    Example::

        checks = CheckSchedule(cfg.train.stop_check_interval, device, start_step=step)
        ...  # after a step: if not (log_now or checks.due(step)): continue
        signalled, longest, current = stop.agree(counts, checks.seconds_per_step(step))
        ...  # evaluation, checkpoint
        checks.checked(step, stop.slowest_step_s)
    """

    def __init__(self, interval, device, start_step=0):
        self.fixed = interval
        self.most = interval or default_stop_check_interval(device)
        self.next = start_step + 1   # the first step is a check: its time sets the next one
        self._since = (time.perf_counter(), start_step)   # (host clock, step) as the last check ended

    def due(self, step):
        return step % self.fixed == 0 if self.fixed else step >= self.next

    def seconds_per_step(self, step):
        """This rank's mean time per step since the last check step ended (or the loop began)."""
        if step <= self._since[1]:
            return 0.0
        return (time.perf_counter() - self._since[0]) / (step - self._since[1])

    def checked(self, step, slowest_step_s):
        """A check step is over: the next one comes after at most ``most`` steps, fewer where the
        slowest rank's steps would pass CHECK_SPACING_S first."""
        steps = self.most
        if slowest_step_s > 0:
            steps = max(1, min(self.most, int(CHECK_SPACING_S / slowest_step_s)))
        self.next = step + steps
        self._since = (time.perf_counter(), step)


__all__ = ['EXIT_CODES', 'EXIT_DATA_ERROR', 'EXIT_INTERRUPTED', 'EXIT_IO_ERROR', 'EXIT_LOST_RANK', 'EXIT_NONFINITE',
           'EXIT_PREEMPTED', 'INTERRUPT', 'CheckSchedule', 'Faults', 'Heartbeat', 'LostRankError', 'RunIOError', 'StopRequests',
           'default_stop_check_interval', 'describe_io_error', 'is_collective_failure']
