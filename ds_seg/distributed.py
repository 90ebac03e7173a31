"""Process-group set-up for every way users start ds_seg, and small collective helpers.

Launchers and what they leave in the environment:

* ``deepspeed``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (+ ``--local_rank``)
* ``torchrun``: the same plus TORCHELASTIC_RUN_ID
* ``srun`` (Slurm, e.g. ``deepspeed --launcher slurm``): only SLURM_PROCID, SLURM_LOCALID,
  SLURM_NTASKS, SLURM_STEP_ID, SLURM_JOB_NODELIST, ... -- we map them to the variables above
  (a batch script's own processes have no SLURM_STEP_ID: they are not ranks of a step)
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
import sys
import time
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
    if 'SLURM_PROCID' in env and 'SLURM_NTASKS' in env and _in_slurm_step(env):
        return 'slurm'
    return 'none'


def _in_slurm_step(env):
    """srun's tasks carry their job step's id; the batch script itself (and a plain ``python``
    it runs) has SLURM_PROCID=0 and the allocation's SLURM_NTASKS but no step: taken for rank 0
    of N, it waited 600 s at the rendezvous for ranks nobody started."""
    return 'SLURM_STEP_ID' in env or 'SLURM_STEPID' in env


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
        tasks = env.get('SLURM_NTASKS', '')
        if tasks.isdigit() and int(tasks) > 1:
            print(f"ds_seg: note: SLURM_NTASKS={tasks}, but this process was not started by srun (no job step): it "
                  f"trains alone; start the ranks with srun, or use the sbatch templates (ds-seg-train "
                  f"--sbatch-template).", file=sys.stderr, flush=True)
    env.setdefault('LOCAL_RANK', '0')
    _check_env(env, launcher)
    if env['WORLD_SIZE'] == '1':  # one process meets only itself: any free local port will do
        env.setdefault('MASTER_ADDR', '127.0.0.1')
        env.setdefault('MASTER_PORT', str(free_port()))
    return launcher


def _check_env(env, launcher):
    """Refuse rank variables that cannot describe this process (leftovers of another job, a
    typo), in one line, instead of a rendezvous that fails or waits for ranks that never come."""
    from ds_seg.config import ConfigError
    names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')
    values = {}
    for name in names:
        raw = env.get(name, '')
        if not raw.isdigit():
            raise ConfigError(f"launcher environment ({launcher}): {name}={raw!r} is not a non-negative integer; "
                              f"unset the stale rank variables, or start through deepspeed, torchrun or srun.")
        values[name] = int(raw)
    if values['WORLD_SIZE'] < 1 or values['RANK'] >= values['WORLD_SIZE']:
        raise ConfigError(f"launcher environment ({launcher}): RANK={values['RANK']} with WORLD_SIZE="
                          f"{values['WORLD_SIZE']}; a rank must be below the world size. Unset the stale rank "
                          f"variables, or start through deepspeed, torchrun or srun.")
    if values['WORLD_SIZE'] > 1 and not env.get('DS_SEG_INIT_METHOD'):
        missing = [n for n in ('MASTER_ADDR', 'MASTER_PORT') if not env.get(n)]
        if missing:
            raise ConfigError(f"launcher environment ({launcher}): WORLD_SIZE={values['WORLD_SIZE']} but "
                              f"{' and '.join(missing)} not set; the ranks cannot meet. Start through "
                              f"deepspeed, torchrun or srun, which set them.")


def device():
    if torch.cuda.is_available():
        return torch.device('cuda', cuda_index(int(os.environ.get('LOCAL_RANK', 0)), torch.cuda.device_count()))
    return torch.device('cpu')


def cuda_index(local_rank, visible):
    """The GPU of local rank ``local_rank`` among ``visible`` GPUs. One visible GPU is each
    rank's own where the launcher binds one per task (Slurm's --gpus-per-task: every rank sees
    its GPU as cuda:0). More ranks than several visible GPUs would put two ranks on one GPU
    (NCCL: "Duplicate GPU detected"), after the model was built: refused."""
    if visible > 1 and local_rank >= visible:
        from .config import ConfigError
        raise ConfigError(f"LOCAL_RANK={local_rank}, but this node shows {visible} GPUs (cuda:0..cuda:{visible - 1}): "
                          f"start at most {visible} processes per node (deepspeed --num_gpus, torchrun "
                          "--nproc_per_node, the sbatch templates' NPROC_PER_NODE or --ntasks-per-node)")
    return local_rank % visible


def local_world_size():
    """Ranks on this node, as the launchers say (1 where none does)."""
    return next((int(os.environ[k]) for k in ('LOCAL_WORLD_SIZE', 'LOCAL_SIZE', 'SLURM_NTASKS_PER_NODE')
                 if os.environ.get(k, '').isdigit() and int(os.environ[k]) > 0), 1)


def _share_cpu_cores():
    """Give each CPU rank its share of the cores unless the user chose (OMP_NUM_THREADS).

    torchrun sets OMP_NUM_THREADS=1, but the deepspeed launcher sets nothing, and N ranks that
    each start one thread per core oversubscribe the machine: 2 ranks on 2 cores ran 3.5x slower.
    """
    if 'OMP_NUM_THREADS' in os.environ:
        return
    local = local_world_size()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local)))


# A week: past it a timedelta still holds, and no collective waits that long on purpose.
_MAX_TIMEOUT_S = 7 * 24 * 3600


def env_timeout_s():
    """Seconds a collective waits for a lost rank, from ``DS_SEG_DIST_TIMEOUT`` (seconds) or
    ``DEEPSPEED_TIMEOUT`` (minutes, DeepSpeed's), else :data:`DEFAULT_TIMEOUT_S`. A value that is
    no number > 0 (abc, nan, inf, 0, -5) is one line naming the variable: it was a traceback, or
    for 0 and below a rendezvous 'timed out after -5000ms' that blamed the port."""
    found = []  # both are checked: DeepSpeed's import reads DEEPSPEED_TIMEOUT whatever ds_seg takes
    for name, unit in (('DS_SEG_DIST_TIMEOUT', 1), ('DEEPSPEED_TIMEOUT', 60)):
        if name not in os.environ:
            continue
        text = os.environ[name]
        try:
            value = float(text) * unit
        except ValueError:
            value = float('nan')
        if name == 'DEEPSPEED_TIMEOUT' and not text.strip().isdigit():
            value = float('nan')   # DeepSpeed itself reads it with int() at import
        if not 0 < value <= _MAX_TIMEOUT_S:
            from .config import ConfigError
            what = 'seconds' if unit == 1 else 'whole minutes'
            raise ConfigError(f"{name}={text!r}: give a number of {what} > 0 (at most a week) that a collective "
                              f"waits for a lost rank, or unset it (default {DEFAULT_TIMEOUT_S} s).")
        found.append(value)
    return found[0] if found else DEFAULT_TIMEOUT_S


def gpu_memory_gib():
    """``DS_SEG_GPU_MEMORY_GIB``: GiB of the GPU this process may allocate (torch's per-process
    memory fraction), or None. The benchmark sets it to measure what fits on a smaller card than
    the one it runs on (``--gpu-memory-gib``); the CUDA context and NCCL's buffers are outside it."""
    text = os.environ.get('DS_SEG_GPU_MEMORY_GIB')
    if text is None or text == '':
        return None
    try:
        value = float(text)
    except ValueError:
        value = float('nan')
    if not 0 < value < float('inf'):
        from .config import ConfigError
        raise ConfigError(f"DS_SEG_GPU_MEMORY_GIB={text!r}: give the GiB of the GPU a rank may allocate "
                          "(a number > 0), or unset it.")
    return value


def check_environment():
    """The environment variables ds_seg reads, checked before anything is imported or built:
    one line for a value it cannot use."""
    env_timeout_s()
    gpu_memory_gib()
    from .engine.faults import planned_fault
    planned_fault()
    from .config import ConfigError
    value = os.environ.get('DS_SEG_CPU_FP16')
    if value is not None and value not in ('', '0', '1'):
        raise ConfigError(f"DS_SEG_CPU_FP16={value!r}: give 1 (native fp16 on a CPU) or 0, or unset it.")
    port = os.environ.get('MASTER_PORT')
    if port is not None and not (port.strip().isdigit() and int(port) <= 65535):
        # torch's rendezvous said it in a traceback from every rank ("invalid literal for int()").
        # (0 is valid: the store picks a free port, as one rank or a file:// rendezvous may ask.)
        raise ConfigError(f"MASTER_PORT={port!r}: give the rendezvous port, a number from 1 to 65535 "
                          "(or unset it where the launcher sets it).")


def init(use_deepspeed=True, timeout_s=None):
    """Initialise the process group once; returns the launcher name.

    ``timeout_s`` bounds how long a collective waits for a lost rank (default: env
    ``DS_SEG_DIST_TIMEOUT`` or ``DEEPSPEED_TIMEOUT`` minutes, else 10 minutes).
    """
    # RANK/WORLD_SIZE without the LOCAL_RANK every launcher sets: left in a shell, most likely.
    bare_env = detect_launcher() == 'deepspeed' and 'LOCAL_RANK' not in os.environ
    launcher = setup_env()
    if dist.is_initialized():
        return launcher
    if timeout_s is None:
        timeout_s = env_timeout_s()
    timeout = datetime.timedelta(seconds=timeout_s)
    dev = device()
    if dev.type == 'cuda':
        torch.cuda.set_device(dev)
        cap_gib = gpu_memory_gib()
        if cap_gib is not None:
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), dev)
    else:
        _share_cpu_cores()
    backend = 'nccl' if dev.type == 'cuda' else 'gloo'
    # A file:// rendezvous (tests) avoids races for free ports between concurrent jobs.
    init_method = os.environ.get('DS_SEG_INIT_METHOD') or None
    ranks = dict(rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE']))
    where = init_method or f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        with _ctrl_c_ends_the_wait(f"rank {ranks['rank']} of {ranks['world_size']} waited for the others at {where}"), \
                _say_while_waiting(ranks, where, bare_env):
            _init_process_group(use_deepspeed, backend, timeout, init_method, ranks)
    except (dist.DistNetworkError, dist.DistStoreError) as exc:  # a port in use, ranks that never came
        from ds_seg.config import ConfigError
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"rank {ranks['rank']} of {ranks['world_size']} could not meet the others at {where}: "
                          f"{detail} (another job on that port, or fewer ranks started than WORLD_SIZE)") from exc
    return launcher


def _init_process_group(use_deepspeed, backend, timeout, init_method, ranks):
    if use_deepspeed:
        # DeepSpeed JIT-builds a shared-memory all-reduce op on first use on CPU (~40 s); it only
        # speeds up inference all-reduce, so training skips the build.
        importlib.import_module('deepspeed.comm.torch').build_shm_op = lambda: None
        import deepspeed
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout,
                                   init_method=init_method, **ranks)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, init_method=init_method, **ranks)


# Seconds at the rendezvous before a rank says it is still waiting, then between its lines. Ranks
# started together meet within seconds; a rank started alone waited the whole timeout in silence.
WAIT_NOTICE_S = float(os.environ.get('DS_SEG_WAIT_NOTICE_S', 30))


@contextmanager
def _say_while_waiting(ranks, where, bare_env):
    import threading
    met = threading.Event()
    started = time.monotonic()

    def say():
        interval = WAIT_NOTICE_S
        while not met.wait(interval):
            stale = (' (RANK and WORLD_SIZE come from the environment: for one process, unset them)'
                     if bare_env else '')
            print(f"ds_seg: rank {ranks['rank']} of {ranks['world_size']} has waited "
                  f"{time.monotonic() - started:.0f} s for the other ranks at {where}{stale}; it gives up after "
                  f"{env_timeout_s():.0f} s (DS_SEG_DIST_TIMEOUT)", file=sys.stderr, flush=True)
            interval = max(WAIT_NOTICE_S, 120)
    if WAIT_NOTICE_S <= 0:
        yield
        return
    thread = threading.Thread(target=say, name='ds_seg-rendezvous-notice', daemon=True)
    thread.start()
    try:
        yield
    finally:
        met.set()
        thread.join()


# Set by a command run as a program (ds_seg.cli.train): a Ctrl-C may end the process outright
# while it waits at the rendezvous. A Python caller's process is its own.
EXIT_ON_CTRL_C_WHILE_WAITING = False


@contextmanager
def _ctrl_c_ends_the_wait(waiting):
    """The rendezvous blocks in C++ (TCPStore) until every rank came or the timeout (10 minutes)
    passed, and Python runs no signal handler there: a Ctrl-C of a rank started alone (stale
    WORLD_SIZE/RANK) did nothing. Python's C-level handler still writes the signal's number to
    a wakeup fd at once; a thread reading it ends the process with the one line of a Ctrl-C
    before training."""
    import select
    import signal
    import threading
    if not EXIT_ON_CTRL_C_WHILE_WAITING or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    earlier = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    done = threading.Event()

    def watch():
        while not done.is_set():
            if select.select([read_fd], [], [], 0.2)[0] and signal.SIGINT in os.read(read_fd, 64):
                os.write(2, f'ds_seg: interrupted (Ctrl-C) before training started, while {waiting}\n'.encode())
                os._exit(130)   # faults.EXIT_INTERRUPTED; nothing was started, nothing to close
    watcher = threading.Thread(target=watch, name='ds_seg-ctrl-c-at-rendezvous', daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(earlier)
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)


def close():
    """Destroy every process group. A group's gloo threads run on while anything refers to it
    (see ds_seg.cli.train's exit); DeepSpeed keeps its own references in
    ``deepspeed.utils.groups``, which its destroy releases and torch's does not."""
    global _CPU_GROUP
    _CPU_GROUP = None
    if not dist.is_initialized():
        return
    ds_comm = sys.modules.get('deepspeed.comm.comm')
    if ds_comm is not None and ds_comm.cdb is not None and ds_comm.cdb.is_initialized():
        ds_comm.destroy_process_group()
    else:
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


def average_where_different_(tensors):
    """Average in place, over all ranks, those tensors whose values differ between ranks, and
    leave the others bit for bit: an average of equal float64 values can round (3 x 0.1 / 3 is
    0.10000000000000002), and a model's constant buffers must not drift at every checkpoint."""
    n = world_size()
    tensors = [t for t in tensors if t.numel()]
    if n == 1 or not tensors:
        return
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    bounds = torch.cat([flat, -flat])      # the maximum and (negated) minimum in one collective
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    high, low = bounds[:flat.numel()], -bounds[flat.numel():]
    differs = high != low
    total = flat.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    starts = [0]
    for t in tensors:
        starts.append(starts[-1] + t.numel())
    flags = torch.stack([differs[a:b].any() for a, b in zip(starts, starts[1:])]).tolist()   # one read-back
    for t, a, b, differ in zip(tensors, starts, starts[1:], flags):
        if differ:
            t.copy_((total[a:b] / n).view_as(t).to(t.dtype))


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


def from_main(value):
    """Collective: every rank gets rank 0's ``value`` (small and picklable)."""
    if not dist.is_initialized() or world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_cpu_group())
    return box[0]


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
