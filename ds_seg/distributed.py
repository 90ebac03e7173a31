"""Process-group set-up for every way users start ds_seg, and small collective helpers.

Launchers and what they leave in the environment:

* ``deepspeed``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (+ ``--local_rank``)
* ``torchrun``: the same plus TORCHELASTIC_RUN_ID
* ``srun`` (Slurm, e.g. ``deepspeed --launcher slurm``): only SLURM_PROCID, SLURM_LOCALID,
  SLURM_NTASKS, SLURM_JOB_NODELIST, ... -- we map them to the variables above
* plain ``python``: nothing; we become rank 0 of 1 with a free local port, so neither
  DeepSpeed's MPI discovery (needs mpi4py) nor a launcher is required.

Every run initialises a process group, even with one process, so the rest of the code has a
single path: collectives on a world of one are cheap no-ops in effect.
"""
import datetime
import importlib
import os
import re
import shutil
import socket
import subprocess
from contextlib import contextmanager

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def detect_launcher(env=None):
    """Name the launcher that started this process: deepspeed, torchrun, slurm or none."""
    env = os.environ if env is None else env
    if 'TORCHELASTIC_RUN_ID' in env:
        return 'torchrun'
    if 'RANK' in env and 'WORLD_SIZE' in env:
        return 'deepspeed'  # or any launcher that sets the standard variables
    if 'SLURM_PROCID' in env and 'SLURM_NTASKS' in env:
        return 'slurm'
    return 'none'


def _first_slurm_host(nodelist):
    """First host of a Slurm node list ("node[03-05,07]" -> "node03"), via scontrol if present."""
    if shutil.which('scontrol'):
        try:
            out = subprocess.run(['scontrol', 'show', 'hostnames', nodelist], check=True,
                                 capture_output=True, text=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    # Without scontrol: the first entry of the list, each bracket group replaced by its first
    # value ("a[1-2],b3" -> "a1", "node[0-1]-[2-3]" -> "node0-2").
    host, depth, group = '', 0, ''
    for ch in nodelist:
        if depth == 0 and ch == ',':
            break
        if ch == '[':
            depth, group = 1, ''
        elif ch == ']' and depth:
            host += re.split(r'[,-]', group)[0]
            depth = 0
        elif depth:
            group += ch
        else:
            host += ch
    return host or '127.0.0.1'


def setup_env(env=None):
    """Fill RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for the detected launcher."""
    env = os.environ if env is None else env
    launcher = detect_launcher(env)
    if launcher == 'slurm':
        env['RANK'] = env['SLURM_PROCID']
        env['WORLD_SIZE'] = env['SLURM_NTASKS']
        env['LOCAL_RANK'] = env.get('SLURM_LOCALID', '0')
        if 'MASTER_ADDR' not in env:
            nodelist = env.get('SLURM_JOB_NODELIST') or env.get('SLURM_NODELIST') or '127.0.0.1'
            env['MASTER_ADDR'] = _first_slurm_host(nodelist)
        if 'MASTER_PORT' not in env:
            # All tasks of a job must agree without talking to each other: derive from the job id.
            env['MASTER_PORT'] = str(15000 + int(env.get('SLURM_JOB_ID', '0')) % 20000)
    elif launcher == 'none':
        env.setdefault('RANK', '0')
        env.setdefault('WORLD_SIZE', '1')
        env.setdefault('LOCAL_RANK', '0')
        env.setdefault('MASTER_ADDR', '127.0.0.1')
        env.setdefault('MASTER_PORT', str(free_port()))
    env.setdefault('LOCAL_RANK', '0')
    return launcher


def device():
    if torch.cuda.is_available():
        return torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count())
    return torch.device('cpu')


def _share_cpu_cores():
    """Give each CPU rank its share of the cores unless the user chose (OMP_NUM_THREADS).

    torchrun sets OMP_NUM_THREADS=1, but the deepspeed launcher sets nothing, and N ranks that
    each start one thread per core oversubscribe the machine: 2 ranks on 2 cores ran 3.5x slower.
    """
    if 'OMP_NUM_THREADS' in os.environ:
        return
    local = next((int(os.environ[k]) for k in ('LOCAL_WORLD_SIZE', 'LOCAL_SIZE', 'SLURM_NTASKS_PER_NODE')
                  if os.environ.get(k, '').isdigit()), 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local)))


def init(use_deepspeed=True, timeout_s=None):
    """Initialise the process group once; returns the launcher name.

    ``timeout_s`` bounds how long a collective waits for a lost rank (default: env
    ``DS_SEG_DIST_TIMEOUT`` or ``DEEPSPEED_TIMEOUT`` minutes, else 10 minutes).
    """
    launcher = setup_env()
    if dist.is_initialized():
        return launcher
    if timeout_s is None:
        if 'DS_SEG_DIST_TIMEOUT' in os.environ:
            timeout_s = float(os.environ['DS_SEG_DIST_TIMEOUT'])
        elif 'DEEPSPEED_TIMEOUT' in os.environ:
            timeout_s = 60 * float(os.environ['DEEPSPEED_TIMEOUT'])
        else:
            timeout_s = DEFAULT_TIMEOUT_S
    timeout = datetime.timedelta(seconds=timeout_s)
    dev = device()
    if dev.type == 'cuda':
        torch.cuda.set_device(dev)
    else:
        _share_cpu_cores()
    backend = 'nccl' if dev.type == 'cuda' else 'gloo'
    # A file:// rendezvous (tests) avoids races for free ports between concurrent jobs.
    init_method = os.environ.get('DS_SEG_INIT_METHOD') or None
    ranks = dict(rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE']))
    if use_deepspeed:
        # DeepSpeed JIT-builds a shared-memory all-reduce op on first use on CPU (~40 s); it only
        # speeds up inference all-reduce, so training skips the build.
        importlib.import_module('deepspeed.comm.torch').build_shm_op = lambda: None
        import deepspeed
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout,
                                   init_method=init_method, **ranks)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, init_method=init_method, **ranks)
    return launcher


def close():
    global _CPU_GROUP
    _CPU_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main():
    return rank() == 0


def barrier():
    if dist.is_initialized() and world_size() > 1:
        dist.barrier()


def all_reduce_sum(tensor):
    """Sum ``tensor`` in place over all ranks (gloo needs CPU tensors for some dtypes)."""
    if dist.is_initialized() and world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean_(tensors):
    """Average a list of tensors in place over all ranks (used for BatchNorm running stats)."""
    n = world_size()
    if n == 1:
        return
    for t in tensors:
        work = t.detach().float() if t.is_floating_point() else t.detach().double()
        dist.all_reduce(work, op=dist.ReduceOp.SUM)
        t.copy_((work / n).to(t.dtype))


_CPU_GROUP = None


def _cpu_group():
    """A gloo group for small host-side messages (NCCL only moves device tensors)."""
    global _CPU_GROUP
    if dist.get_backend() == 'gloo':
        return None
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend='gloo')
    return _CPU_GROUP


def first_failure(message):
    """Collective: every rank passes None or a one-line failure; all get the lowest rank's
    failure (or None). Also a barrier. Keeps ranks from hanging when only one of them failed."""
    if not dist.is_initialized() or world_size() == 1:
        return message
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, message, group=_cpu_group())
    return next((m for m in gathered if m is not None), None)


@contextmanager
def main_process_first():
    """Let rank 0 do a one-off job (e.g. writing a data cache) before the other ranks look."""
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()


# ----------------------------------------------------------------------------------------------
# Stopping together: signals, non-finite losses, lost ranks
# ----------------------------------------------------------------------------------------------

_early_signal = [None]


def catch_stop_signals():
    """From the start of a training program: remember SIGUSR1/SIGTERM instead of dying of them.

    Python's default action for both is to end the process; a Slurm warning that arrives while a
    rank is still importing or building its model would then kill it. :class:`StopRequests`
    picks the signal up, and the run stops with a checkpoint after its first step.
    """
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return

    def remember(signum, frame):
        _early_signal[0] = _early_signal[0] or signal.Signals(signum).name
    for name in StopRequests.SIGNALS:
        signal.signal(getattr(signal, name), remember)


class StopRequests:
    """Per-step agreement between ranks on whether to stop, and why.

    SIGUSR1 (Slurm's warning before the time limit) and SIGTERM (preemption, scancel) only set
    a flag: the current step finishes, then all ranks learn at the same step that any rank was
    signalled, and checkpoint together. The exchange is one tiny all-reduce on a CPU (gloo)
    group, so it never waits for the GPU.
    """

    SIGNALS = ('SIGUSR1', 'SIGTERM')

    def __init__(self):
        import signal
        import threading
        self.signal_name = _early_signal[0]   # one that came while the run was still starting
        self._group = None
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                signal.signal(getattr(signal, name), self._on_signal)
        if dist.is_initialized() and world_size() > 1:
            self._group = dist.new_group(backend='gloo') if dist.get_backend() != 'gloo' else None
        # Under a launcher (torchrun) a batch script cannot signal the ranks through it; the sbatch
        # templates read these files to signal every rank directly.
        self.pid_file = None
        pid_dir = os.environ.get('DS_SEG_PID_DIR')
        if pid_dir:
            host_dir = os.path.join(pid_dir, socket.gethostname())
            os.makedirs(host_dir, exist_ok=True)
            self.pid_file = os.path.join(host_dir, f'{rank()}.pid')
            with open(self.pid_file, 'w') as f:
                f.write(str(os.getpid()))

    def close(self):
        if self.pid_file and os.path.exists(self.pid_file):
            os.remove(self.pid_file)

    def _on_signal(self, signum, frame):
        import signal
        self.signal_name = signal.Signals(signum).name

    def exchange(self, local_nonfinite):
        """Return (any rank signalled, any rank saw a non-finite loss) -- same answer everywhere."""
        flags = torch.tensor([self.signal_name is not None, bool(local_nonfinite)], dtype=torch.int32)
        if dist.is_initialized() and world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flags[0]), bool(flags[1])


class Heartbeat:
    """Each rank stamps the time into the rendezvous store every few seconds, so that when a
    collective fails the survivors can say which rank stopped answering."""

    def __init__(self, interval_s=2.0):
        import threading
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._store = None
        if dist.is_initialized() and world_size() > 1:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:
                self._store = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name='ds_seg-heartbeat')
            self._thread.start()

    def _beat(self):
        import time
        key = f'ds_seg/heartbeat/{rank()}'
        while not self._stop.is_set():
            try:
                self._store.set(key, str(time.time()))
            except Exception:
                return  # the store is gone (its host died): diagnose() will say so
            self._stop.wait(self.interval_s)

    def stale_ranks(self):
        """Ranks whose last heartbeat is older than 3 intervals; ``None`` if the store is gone."""
        import time
        if self._store is None:
            return []
        try:
            self._store.set_timeout(datetime.timedelta(seconds=5))
            now, stale = time.time(), []
            for r in range(world_size()):
                key = f'ds_seg/heartbeat/{r}'
                if not self._store.check([key]) or now - float(self._store.get(key)) > 3 * self.interval_s:
                    stale.append(r)
            return stale
        except Exception:
            return None

    def describe_failure(self):
        """A sentence naming the lost rank(s) after a failed collective."""
        import time
        time.sleep(3 * self.interval_s)  # let a dead rank's heartbeat go stale
        stale = self.stale_ranks()
        if stale is None:
            return ('lost contact with the rendezvous store hosted by rank 0 (MASTER_ADDR): '
                    'rank 0 or its node has died')
        stale = [r for r in stale if r != rank()]
        if stale:
            return f"rank{'s' if len(stale) > 1 else ''} {', '.join(map(str, stale))} stopped responding (died or hung)"
        return 'a collective failed although every rank still answers (network error or timeout)'

    def close(self):
        self._stop.set()
