"""DDP versus DeepSpeed ZeRO stages, measured the same way: same model, data, seed, global batch,
optimizer implementation and precision; every backend in its own set of processes started with
the chosen launcher; step times from the trainer's own StepTimer (CUDA events per step, read at log steps).

    python launch/benchmark.py --backends ddp,zero0,zero1,zero2,zero3 --steps 40 --warmup 5 \\
        --nproc 2 --work-dir work_dirs/benchmark
    python launch/benchmark.py --config configs/unet_tiny_synthetic.py --backends ddp,zero2 \\
        --steps 10 --warmup 2 --find-max-batch --max-batch 64 --profile 3

Writes into --work-dir: benchmark.json, benchmark.md, benchmark.png and one run folder per
backend (<backend>/tb, metrics.jsonl, summary.json) so ``tensorboard --logdir <work-dir>``
overlays the curves. With --profile, a separate short run per backend records a torch.profiler
trace into <backend>_profile/profile/ (profiled steps are slower, so they are never timed).
"""
import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ds_seg.inputs import refuse_inside_checkpoints, user_path
from ds_seg.cli import OneLineParser, same_package_env
from ds_seg.config import DS_CONFIGS_DIR, find_shipped, option_keys
from ds_seg.memory import zero_formula

# Backend name -> (train.py --backend, shipped DeepSpeed JSON). DDP reads its optimizer, schedule,
# batch, clipping and precision from the same JSON family; only ZeRO settings differ between files.
BACKENDS = {
    'ddp': ('ddp', 'zero0.json'),
    'zero0': ('deepspeed', 'zero0.json'),
    'zero1': ('deepspeed', 'zero1.json'),
    'zero2': ('deepspeed', 'zero2.json'),
    'zero2_bf16': ('deepspeed', 'zero2_bf16.json'),
    'zero3': ('deepspeed', 'zero3.json'),
    'zero3_offload': ('deepspeed', 'zero3_offload.json'),
    'zero0_bf16': ('deepspeed', 'zero0_bf16.json'),
    'zero1_bf16': ('deepspeed', 'zero1_bf16.json'),
    'zero3_bf16': ('deepspeed', 'zero3_bf16.json'),
    'zero3_offload_bf16': ('deepspeed', 'zero3_offload_bf16.json'),
}

# The contract of benchmark.json rows (DESIGN.md), then the state-memory fields.
ROW_FIELDS = ['backend', 'zero_stage', 'precision', 'world_size', 'micro_batch', 'images_per_s',
              'megapixels_per_s', 'step_time_median_s', 'step_time_p90_s', 'data_wait_frac', 'max_mem_mb',
              'mfu', 'speedup_vs_ddp', 'optimizer_impl', 'compile_mode', 'compile_time_s', 'channels_last']
MEMORY_FIELDS = ['num_params', 'params_bytes', 'grads_bytes', 'master_bytes', 'optim_bytes',
                 'comm_buffers_bytes', 'state_bytes', 'formula_params_bytes', 'formula_grads_bytes',
                 'formula_master_bytes', 'formula_optim_bytes', 'formula_state_bytes']


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', type=user_path, default=None, help='experiment config (default: the embedded UNet experiment)')
    p.add_argument('--backends', default='ddp,zero0,zero1,zero2,zero3',
                   help=f"comma-separated, in run order; known: {','.join(BACKENDS)}; or LABEL=file.json "
                   "for a DeepSpeed variant")
    p.add_argument('--steps', type=int, default=40, help='timed optimizer steps per backend')
    p.add_argument('--warmup', type=int, default=5, help='untimed steps before them')
    p.add_argument('--work-dir', '--work_dir', type=user_path, dest='work_dir', default='work_dirs/benchmark')
    p.add_argument('--nproc', type=int, default=None, help='ranks per run (default: GPUs, or 2 on a CPU)')
    p.add_argument('--launcher', choices=['torchrun', 'deepspeed', 'python'], default='torchrun')
    p.add_argument('--cfg-options', '--cfg_options', nargs='+', action='extend', default=[], metavar='KEY=VALUE',
                   help='passed to every run (e.g. data.crop_size=256 model.base_channels=64)')
    p.add_argument('--micro-batch', type=int, default=None, help='override the JSON micro-batch for all backends')
    p.add_argument('--precision', choices=['json', 'fp32', 'bf16', 'fp16', 'bf16-autocast'],
                   default='bf16-autocast',
                   help="'json': as the shipped files say (fp16; the trainer falls back where unsupported). "
                   "bf16-autocast: fp32 parameters, bf16 compute, the same mode for DDP and DeepSpeed (fairest)")
    p.add_argument('--peak-tflops', type=float, default=None, help='device peak for MFU (overrides the table)')
    p.add_argument('--find-max-batch', action='store_true',
                   help='also find the largest micro-batch each backend fits (doubling, then bisection)')
    p.add_argument('--max-batch', type=int, default=None,
                   help='upper bound for --find-max-batch (default 1024 on GPU, 32 on CPU where nothing OOMs)')
    p.add_argument('--find-max-model', default=None, metavar='KEY',
                   help='also find the largest value of the integer config KEY each backend fits, e.g. '
                   'model.depth for UperNetViT (doubling from --model-start, then bisection to 1/8); '
                   'reports the parameter count at that value')
    p.add_argument('--model-start', type=int, default=None,
                   help='first value tried by --find-max-model (default: the value in --cfg-options, else 1)')
    p.add_argument('--max-model', type=int, default=None,
                   help='upper bound for --find-max-model (default 256 on GPU, 4 on CPU where nothing OOMs)')
    p.add_argument('--gpu-memory-gib', type=float, default=None, metavar='GIB',
                   help='let each rank allocate at most GIB of its GPU (torch\'s per-process memory '
                   'fraction): what fits on a smaller card, measured on this one (with --find-max-*)')
    p.add_argument('--profile', type=int, default=0, metavar='STEPS',
                   help='record a torch.profiler trace of STEPS steps per backend (separate, untimed run)')
    p.add_argument('--ds-cpu-adam', action='store_true',
                   help='zero3_offload with DeepSpeedCPUAdam (JIT build ~2 min) instead of torch AdamW')
    p.add_argument('--timeout', type=int, default=1800, help='seconds per run before it is killed')
    return p.parse_args(argv)


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _has_cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def machine_description():
    """One line naming the hardware the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(['lscpu'], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith('Model name:'):
                cpu = line.split(':', 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    desc = f'{cpu}, {os.cpu_count()} cores'
    if _has_cuda():
        import torch
        desc = f'{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; host {desc}'
    return desc


def _backend(name):
    """(train.py --backend, JSON path) for a known name or a ``label=path.json`` DeepSpeed variant
    (how the tuning experiments in docs/benchmarks.md were run)."""
    if '=' in name:   # a path, or a shipped name from any folder, as --deepspeed_config reads it
        return 'deepspeed', os.path.abspath(find_shipped(user_path(name.split('=', 1)[1]), DS_CONFIGS_DIR, '.json'))
    backend, json_name = BACKENDS[name]
    # As ds-seg-train --deepspeed_config reads the name: a project's own ds_configs/<name>.json
    # first, said in a line (the shipped one was measured without a word, its row named as the copy).
    return backend, os.path.abspath(find_shipped(json_name[:-len('.json')], DS_CONFIGS_DIR, '.json'))


def derived_ds_config(name, micro_batch, total_steps, precision, on_gpu, ds_cpu_adam):
    """The shipped JSON for ``name`` with the benchmark's batch, precision and schedule length."""
    ds = json.loads(Path(_backend(name)[1]).read_text())
    if micro_batch is not None:
        ds['train_micro_batch_size_per_gpu'] = micro_batch
        ds.pop('train_batch_size', None)
    sched = ds.get('scheduler', {}).get('params', {})
    if 'warmup_num_steps' in sched:  # the LR schedule must fit the (short) benchmark run
        sched['warmup_num_steps'] = min(sched['warmup_num_steps'], max(1, total_steps // 4))
        # Its length follows the run's train.max_steps, as a training run's does: given here, a run
        # of 1 step (--steps 1 --warmup 0) was refused for a warmup this file had set to 1.
        sched.pop('total_num_steps', None)
    if precision != 'json':
        ds.pop('fp16', None), ds.pop('bf16', None), ds.pop('torch_autocast', None)
        if precision in ('fp16', 'bf16'):
            ds[precision] = {'enabled': True}  # DeepSpeed native; DDP runs it as torch autocast
        elif precision == 'bf16-autocast':
            ds['torch_autocast'] = {'enabled': True, 'dtype': 'bfloat16'}
    params = ds.setdefault('optimizer', {}).setdefault('params', {})
    if name.startswith('zero3_offload') and not ds_cpu_adam:
        # Same torch AdamW as every other backend (a fair comparison, and no 2-minute JIT build of
        # DeepSpeedCPUAdam, on a GPU node too: it needs a compiler there); DeepSpeed otherwise
        # insists on its CPU optimizer for offload.
        params['torch_adam'] = True
        ds['zero_force_ds_cpu_optimizer'] = False
    return ds


TRAIN_MODULE = 'ds_seg.cli.train'


def _program_as_typed():
    """This command as a user types it again: the console script by name, else its path."""
    program = sys.argv[0] if sys.argv else 'launch/benchmark.py'
    if os.path.basename(program).startswith('ds-seg-'):
        return os.path.basename(program)
    if os.path.dirname(os.path.abspath(program)) == os.path.dirname(os.path.abspath(__file__)):
        return 'python -m ds_seg.cli.benchmark'
    return os.path.relpath(program)


def launch_command(launcher, nproc):
    """The command that starts ``nproc`` ranks of the training module under ``launcher``."""
    if launcher == 'torchrun':
        return [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc),
                '--master_port', str(_free_port()), '-m', TRAIN_MODULE]
    if launcher == 'deepspeed':  # its runner takes a module with --module, not python's -m
        # This environment's launcher first: the first deepspeed on PATH (another venv's) started
        # the ranks with its own Python.
        beside = os.path.join(os.path.dirname(sys.executable), 'deepspeed')
        exe = beside if os.access(beside, os.X_OK) else shutil.which('deepspeed') or beside
        return [exe, '--num_gpus', str(nproc), '--master_port', str(_free_port()), '--module', TRAIN_MODULE]
    return [sys.executable, '-m', TRAIN_MODULE]  # one process (_check_args refuses --nproc > 1)


# A label becomes a folder under --work-dir: a plain name, never a path (../x, /tmp, checkpoints/..).
LABEL_PATTERN = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.-]*')
OUTPUTS = ('benchmark.json', 'benchmark.md', 'benchmark.png')
RUN_SUFFIXES = ('', '_maxbatch', '_maxmodel', '_profile')


def _made_by_a_benchmark(path):
    """A run folder this command writes holds the command it ran (command.txt)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, 'command.txt'))


def _labels_of_earlier_benchmark(work_dir):
    """The backend labels of the benchmark.json in ``work_dir`` (plain names only), else []."""
    try:
        with open(os.path.join(work_dir, 'benchmark.json')) as f:
            rows = json.load(f).get('rows') or []
        labels = [r.get('backend') for r in rows if isinstance(r, dict)]
    except (OSError, ValueError, AttributeError):
        return []
    return [x for x in labels if isinstance(x, str) and LABEL_PATTERN.fullmatch(x) and x != 'previous']


def _earlier_results(work_dir, labels):
    """``(ours, theirs)``: what this benchmark would write that is already in ``work_dir``,
    split into an earlier benchmark's results and anything else (a training run's folder...)."""
    ours, theirs = [], []
    names = list(OUTPUTS) + [label + suffix for label in labels for suffix in RUN_SUFFIXES]
    # The earlier benchmark's own runs go with its results, also those of backends this one does
    # not run: left beside the new results, they were mixed in with them (TensorBoard, the table).
    # So do the run folders of a benchmark stopped before it wrote benchmark.json (Ctrl-C, a kill):
    # every folder holding a benchmark's command.txt.
    earlier = [label + suffix for label in _labels_of_earlier_benchmark(work_dir) for suffix in RUN_SUFFIXES]
    if os.path.isdir(work_dir):
        earlier += sorted(n for n in os.listdir(work_dir) if n != 'previous')
    ours += [n for n in dict.fromkeys(earlier) if n not in names and _made_by_a_benchmark(os.path.join(work_dir, n))]
    for name in names:
        path = os.path.join(work_dir, name)
        if not os.path.lexists(path):
            continue
        if name in OUTPUTS and os.path.isfile(path) or _made_by_a_benchmark(path):
            ours.append(name)
        else:
            theirs.append(name)
    return ours, theirs


def set_aside_earlier_results(work_dir, names):
    """Move an earlier benchmark's results to ``<work-dir>/previous/<time>/``: a new benchmark
    never replaces (or mixes its rows with) one a user already has."""
    from ds_seg.telemetry import new_archive
    if not names:
        return None
    archive = new_archive(work_dir)
    for name in names:
        os.replace(os.path.join(work_dir, name), os.path.join(archive, name))
    return archive


# Run settings the benchmark gives every run, which --cfg-options may not change.
BENCHMARK_OWNED = {
    'train.max_steps': '--warmup + --steps', 'train.log_interval': 'every step is logged, to time each',
    'train.warmup_log_steps': '--warmup', 'train.eval_interval': 'no evaluation in timed runs',
    'train.checkpoint_interval': 'no checkpoints in timed runs', 'train.peak_tflops': 'from --peak-tflops',
    'train.profile_steps': 'from --profile', 'train.save_best': 'no evaluation in timed runs'}


def run_backend(args, name, work_dir, steps, warmup, micro_batch=None, extra_options=()):
    """Train ``warmup + steps`` steps of one backend in fresh processes; returns (rc, output tail)."""
    if _made_by_a_benchmark(work_dir):
        shutil.rmtree(work_dir)  # this command's earlier probe: stale checkpoints would block the next
    os.makedirs(work_dir)  # anything else there was refused or set aside by main()
    total = warmup + steps
    ds = derived_ds_config(name, micro_batch or args.micro_batch, total, args.precision, _has_cuda(),
                           args.ds_cpu_adam)
    ds_path = os.path.join(work_dir, 'ds_config.in.json')
    with open(ds_path, 'w') as f:
        json.dump(ds, f, indent=2)
    options = [f'train.max_steps={total}', 'train.log_interval=1', f'train.warmup_log_steps={warmup}',
               'train.eval_interval=0', 'train.checkpoint_interval=0',
               'train.save_best=None']   # a config's save_best needs evaluations: every run was refused
    if args.peak_tflops:
        options.append(f'train.peak_tflops={args.peak_tflops}')
    options += list(args.cfg_options) + list(extra_options)
    cmd = launch_command(args.launcher, args.nproc) + [
        '--backend', _backend(name)[0], '--deepspeed_config', ds_path,
        '--work-dir', work_dir, '--cfg-options', *options]
    if args.config:
        cmd[cmd.index('--backend'):cmd.index('--backend')] = ['--config', args.config]
    env = same_package_env()
    if args.gpu_memory_gib:
        env['DS_SEG_GPU_MEMORY_GIB'] = str(args.gpu_memory_gib)
    if not _has_cuda() and 'OMP_NUM_THREADS' not in os.environ:
        # CPU ranks share the cores: without this each rank starts one thread per core and they thrash.
        env['OMP_NUM_THREADS'] = str(max(1, (os.cpu_count() or 1) // args.nproc))
    with open(os.path.join(work_dir, 'command.txt'), 'w') as f:
        f.write(' '.join(cmd) + '\n')
    rc, output = run_child(cmd, env, args.timeout)
    with open(os.path.join(work_dir, 'output.log'), 'w') as f:
        f.write(output)
    if rc == 124:
        return rc, f'timed out after {args.timeout}s: {output[-2000:]}'
    return rc, output[-4000:]


def run_child(cmd, env, timeout):
    """``(exit code, stdout + stderr)`` of ``cmd`` run in its own process group, which is stopped
    whole when it outlives ``timeout`` (exit 124) or when this process is interrupted: killing the
    launcher alone left its ranks training beside the next backend's."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out + err
    except subprocess.TimeoutExpired:
        stop_process_group(proc)
        out, err = proc.communicate()
        return 124, out + err
    except BaseException:  # Ctrl-C or SIGTERM (see main): the ranks stop with the benchmark
        stop_process_group(proc)
        proc.communicate()
        raise


def stop_process_group(proc, grace_s=30):
    """SIGTERM to ``proc``'s process group (the trainer stops at its next step), SIGKILL to
    whatever of it is left after ``grace_s``; returns once every process of the group is gone (a
    launcher can exit before its ranks)."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return
    deadline = time.monotonic() + grace_s
    while True:
        proc.poll()  # reap the launcher: a zombie still counts as a member of its group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = math.inf
        time.sleep(0.2)
    proc.wait()


class Terminated(BaseException):
    """SIGTERM to the benchmark: raised where it waits, so the running backend's ranks are stopped
    with it (by default Python died at once and left them training)."""


def _terminated(signum, frame):
    raise Terminated()


def _p90(sorted_times):
    # The same index rule as telemetry.StepTimer.summary, so the figures agree with metrics.jsonl.
    return sorted_times[min(len(sorted_times) - 1, int(round(0.9 * (len(sorted_times) - 1))))]


def summarise_run(work_dir, name, warmup):
    """One benchmark row from a run folder (metrics.jsonl logged every step, summary.json)."""
    with open(os.path.join(work_dir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(work_dir, 'summary.json')) as f:
        summary = json.load(f)
    with open(os.path.join(work_dir, 'ds_config.json')) as f:
        ds = json.load(f)
    timed = [r for r in rows if r['step'] > warmup and r.get('step_time_s')]
    if not timed:
        raise RuntimeError(f'{work_dir}: no timed steps in metrics.jsonl (warm-up {warmup} >= steps run?)')
    times = sorted(r['step_time_s'] for r in timed)
    total = sum(times)
    global_batch = summary['global_batch']
    images = global_batch * len(timed)
    mp_per_image = timed[0]['megapixels_per_s'] / timed[0]['images_per_s']
    ratio = [r['mfu'] / r['images_per_s'] for r in timed if r.get('mfu') and r.get('images_per_s')]
    row = dict(
        backend=name, zero_stage=summary['zero_stage'], precision=summary['precision'],
        world_size=summary['world_size'], micro_batch=ds['train_micro_batch_size_per_gpu'], global_batch=global_batch,
        images_per_s=images / total, megapixels_per_s=images * mp_per_image / total,
        step_time_median_s=statistics.median(times), step_time_p90_s=_p90(times),
        data_wait_frac=sum(r['data_wait_frac'] * r['step_time_s'] for r in timed) / total,
        max_mem_mb=max(r['max_mem_mb'] for r in rows if r.get('max_mem_mb') is not None),
        # mfu / images_per_s is the trainer's constant training FLOPs / peak: reuse it, do not re-derive.
        mfu=ratio[0] * images / total if ratio else None,
        speedup_vs_ddp=None,
        # Which update ran (fused, foreach, DeepSpeed's FusedAdam...), and compilation, per row.
        optimizer_impl=summary.get('optimizer_impl'), compile_mode=summary.get('compile_mode'),
        compile_time_s=summary.get('compile_time_s'), channels_last=summary.get('channels_last'))
    mem = summary.get('state_memory')
    if mem:
        formula = zero_formula(mem['num_params'], summary['zero_stage'],  # None under DDP (RunSpec)
                               summary['world_size'], summary['precision'])
        row.update(num_params=mem['num_params'], params_bytes=mem['params_bytes'], grads_bytes=mem['grads_bytes'],
                   master_bytes=mem['master_bytes'], optim_bytes=mem['optim_bytes'],
                   comm_buffers_bytes=mem['comm_buffers_bytes'], state_bytes=mem['total_bytes'],
                   formula_params_bytes=formula['params_bytes'], formula_grads_bytes=formula['grads_bytes'],
                   formula_master_bytes=formula['master_bytes'], formula_optim_bytes=formula['optim_bytes'],
                   formula_state_bytes=formula['total_bytes'])
    else:
        row.update({k: None for k in MEMORY_FIELDS})
    row['timed_steps'] = len(timed)
    row['exit_reason'] = summary['exit_reason']
    return row


def add_speedups(rows):
    """speedup_vs_ddp = DDP's median step time / this backend's (same global batch, same run)."""
    ddp = next((r for r in rows if r['backend'] == 'ddp' and r.get('step_time_median_s')), None)
    for r in rows:
        if ddp and r.get('step_time_median_s'):
            r['speedup_vs_ddp'] = ddp['step_time_median_s'] / r['step_time_median_s']
    return rows


def _is_oom(text):
    lowered = text.lower()
    # The trainer's own guards refuse sizes far past the memory before a step: those are "does not
    # fit" too (ds_seg.engine.trainer: _check_windows_fit_in_memory, _check_activations_fit_in_memory).
    return ('out of memory' in lowered or 'outofmemoryerror' in lowered or 'cannot allocate memory' in lowered
            or 'of activations for its backward pass' in lowered or 'gib as float32, more than' in lowered)


def largest_fitting(fits, start, limit, resolution=lambda good: 1):
    """The largest ``n <= limit`` for which ``fits(n)`` is true, searched from ``start`` by
    doubling, then bisection until the gap is at most ``resolution(good)``. Returns
    ``(n, capped)``: ``n`` is 0 if not even 1 fits; ``capped`` says the limit stopped the search.

    Example: ``largest_fitting(lambda n: n <= 37, 8, 100)`` -> ``(37, False)`` (probes 8, 16, 32,
    64, then 48, 40, 36, 38, 37)."""
    good, bad = 0, None
    n = max(1, min(start, limit))
    while n <= limit:
        if not fits(n):
            bad = n
            break
        good = n
        if n == limit:
            break
        n = min(n * 2, limit)
    while bad is not None and bad - good > max(1, resolution(good)):
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, bad is None


def _fits(args, name, probe_dir, what, **run):
    """Whether a 2-step run of ``name`` succeeds: only an out-of-memory failure counts as "does
    not fit"; any other failure is an error, not a size."""
    rc, tail = run_backend(args, name, probe_dir, steps=2, warmup=1, **run)
    if rc == 0:
        return True
    if _is_oom(tail):
        return False
    raise RuntimeError(f'{name}: {what} failed for a reason other than memory:\n{tail}')


def _option_value(options, key):
    """The integer ``key=N`` among ``--cfg-options``, or None."""
    for option in options or []:
        name, _, value = option.partition('=')
        if key and name == key and value.strip().isdigit():
            return int(value)
    return None


def find_max_batch(args, name, start, limit):
    """Largest micro-batch (<= limit) whose short run succeeds: ``(micro_batch, capped)``."""
    probe_dir = os.path.join(args.work_dir, f"{name.split('=', 1)[0]}_maxbatch")
    found = largest_fitting(lambda mb: _fits(args, name, probe_dir, f'micro-batch {mb}', micro_batch=mb), start, limit)
    shutil.rmtree(probe_dir, ignore_errors=True)
    return found


def find_max_model(args, name, key, start, limit):
    """Largest value (<= limit) of the integer config ``key`` (e.g. ``model.depth`` of
    UperNetViT) whose short run of ``name`` succeeds, to within 1/8 of it (each probe is a whole
    run). Returns ``(value, capped, parameters)``, the parameters counted by that run."""
    probe_dir = os.path.join(args.work_dir, f"{name.split('=', 1)[0]}_maxmodel")
    params = {}

    def fits(value):
        ok = _fits(args, name, probe_dir, f'{key}={value}', extra_options=[f'{key}={value}'])
        if ok:
            with open(os.path.join(probe_dir, 'summary.json')) as f:
                params[value] = (json.load(f).get('state_memory') or {}).get('num_params')
        return ok

    value, capped = largest_fitting(fits, start, limit, resolution=lambda good: good // 8)
    shutil.rmtree(probe_dir, ignore_errors=True)
    return value, capped, params.get(value)


def format_or_dash(value, spec):
    return '-' if value is None else format(value, spec)


def write_markdown(path, rows, meta):
    mb = 2 ** 20
    lines = [f"# Benchmark: {meta['config']}", '',
             f"Machine: {meta['machine']}. Launcher: {meta['launcher']} x {meta['nproc']} rank(s). "
             f"{meta['steps']} timed steps after {meta['warmup']} warm-up steps per backend."
             + (f" Each rank capped at {meta['gpu_memory_gib']:g} GiB of its GPU (--gpu-memory-gib)."
                if meta.get('gpu_memory_gib') else ''), '',
             f"Command: `{meta['command']}`", '',
             '| backend | ZeRO | precision | ranks | micro-batch | img/s | MP/s | step median s | step p90 s '
             '| data wait | max mem MB | MFU | speed-up vs DDP (median step time) | optimizer | compile s | NHWC |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        if r.get('error'):
            what = 'out of memory at the configured size (the size search below ran)' if r.get('oom') else 'failed'
            lines.append(f"| {r['backend']} | {what}: {r['error']} |")  # (one line, 300 characters at most)
            continue
        lines.append(
            f"| {r['backend']} | {format_or_dash(r['zero_stage'], 'd')} | {r['precision']} | {r['world_size']} "
            f"| {r['micro_batch']} | {r['images_per_s']:.2f} | {r['megapixels_per_s']:.3f} "
            f"| {r['step_time_median_s']:.4f} | {r['step_time_p90_s']:.4f} | {r['data_wait_frac']:.1%} "
            f"| {r['max_mem_mb']:.0f} | {format_or_dash(r['mfu'], '.1%')} | {format_or_dash(r['speedup_vs_ddp'], '.3f')} "
            f"| {r.get('optimizer_impl') or '-'} | {format_or_dash(r.get('compile_time_s'), '.1f')} "
            f"| {'yes' if r.get('channels_last') else 'no'} |")
    precisions = {r['backend']: r['precision'] for r in rows if not r.get('error')}
    if len(set(precisions.values())) > 1:
        # --precision json with JSONs of different modes (bf16 against bf16-autocast): said, as
        # the speed-ups then compare modes as well as backends.
        lines += ['', f"Note: the rows ran in different precisions ({', '.join(f'{b} {p}' for b, p in precisions.items())}); "
                  "their speed-ups compare precisions as well as backends (the default --precision bf16-autocast "
                  "runs every backend in one mode)."]
    if any(r.get('num_params') for r in rows):
        lines += ['', 'Per-rank model state, measured from the live tensors (MB) / ZeRO formula (MB):', '',
                  '| backend | params | grads | fp32 master | Adam moments | total | comm buckets |',
                  '|---|---|---|---|---|---|---|']
        for r in rows:
            if r.get('num_params'):
                cells = [f"{r[k] / mb:.2f} / {r['formula_' + k] / mb:.2f}"
                         for k in ('params_bytes', 'grads_bytes', 'master_bytes', 'optim_bytes')]
                cells.append(f"{r['state_bytes'] / mb:.2f} / {r['formula_state_bytes'] / mb:.2f}")
                lines.append(f"| {r['backend']} | " + ' | '.join(cells) + f" | {r['comm_buffers_bytes'] / mb:.1f} |")
        lines.append(f"\nParameters Ψ = {next(r['num_params'] for r in rows if r.get('num_params')):,}.")
    if any('max_micro_batch' in r for r in rows):
        lines += ['', '| backend | largest micro-batch that fits |', '|---|---|']
        for r in rows:
            if 'max_micro_batch' in r:
                capped = f" (search capped at --max-batch {meta['max_batch']})" if r.get('max_micro_batch_capped') else ''
                lines.append(f"| {r['backend']} | {r['max_micro_batch']}{capped} |")
    if any('max_model' in r for r in rows):
        key = meta['find_max_model']
        lines += ['', f'| backend | largest {key} that fits | parameters |', '|---|---|---|']
        for r in rows:
            if 'max_model' in r:
                capped = f" (search capped at --max-model {meta['max_model']})" if r.get('max_model_capped') else ''
                params = '-' if r.get('max_model_params') is None else f"{r['max_model_params'] / 1e6:,.1f} M"
                lines.append(f"| {r['backend']} | {r['max_model']}{capped} | {params} |")
    profiled = [r for r in rows if r.get('profile_dir') or r.get('profile_error')]
    if profiled:
        lines += ['', '| backend | --profile trace |', '|---|---|']
        lines += [f"| {r['backend']} | {r.get('profile_dir') or 'failed: ' + r['profile_error']} |" for r in profiled]
    Path(path).write_text('\n'.join(lines) + '\n')


def write_plot(path, rows, meta):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    ok = [r for r in rows if not r.get('error')]
    names = [r['backend'] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    # Bars and labels of one statistic, the median step: bars of the mean-based images/s under
    # labels of the median-based speed-up showed "1.02x" over a bar lower than DDP's.
    at_median = [r['global_batch'] / r['step_time_median_s'] if r.get('global_batch') and r.get('step_time_median_s')
                 else r['images_per_s'] for r in ok]
    ax.bar(names, at_median, color='tab:blue')
    for i, r in enumerate(ok):
        ax.text(i, at_median[i], format_or_dash(r['speedup_vs_ddp'], '.2f') + 'x', ha='center', va='bottom', fontsize=8)
    ax.set_ylabel('images / s at the median step')
    ax.set_title('throughput (global batch / median step time; on top: speed-up vs DDP)', fontsize=9)
    ax = axes[1]
    bottom = [0.0] * len(ok)
    for key, colour in (('params_bytes', 'tab:green'), ('grads_bytes', 'tab:orange'),
                        ('master_bytes', 'tab:purple'), ('optim_bytes', 'tab:red')):
        values = [(r.get(key) or 0) / 2 ** 20 for r in ok]
        ax.bar(names, values, bottom=bottom, color=colour, label=key.replace('_bytes', ''))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel('MB per rank')
    ax.set_title('model state per rank (measured)')
    ax.legend(fontsize=8)
    fig.suptitle(f"{meta['config']} | {meta['machine']} | {meta['nproc']} rank(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def failure_line(tail):
    """The one line that says why a run failed: its ds_seg refusal (under torchrun followed by the
    launcher's report, whose last 300 characters were the row's error and broke benchmark.md's
    table), else its last line."""
    lines = [line.strip() for line in tail.splitlines() if line.strip() and set(line.strip()) - set('=-')]
    refusals = [line for line in lines if ': error: ' in line or line.startswith('ds_seg: ')]
    # A crash: its exception line ('[rank0]: torch.OutOfMemoryError: ...'), not torchrun's banner.
    crashes = [line for line in lines if re.match(r'^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b.*:', line)
               and 'ChildFailedError' not in line]
    line = (refusals or crashes or lines or ['(no output)'])[-1]
    return line.replace('|', '/')[:300]


# Model arguments training sets from (and checks against) data.train: never a size to search.
DATA_FIXED_MODEL_KEYS = {'num_classes': "data.train's classes", 'in_channels': "data.train's bands",
                         'num_dates': "data.train's dates per scene"}


def search_error(exc):
    """A row's error for a size search stopped by a probe that failed for a reason other than
    memory: the probe named and its failure_line, not the last 300 characters of its output,
    which began mid-word ('ccelerator to CPU...') and could hold the launcher's report."""
    head, _, output = str(exc).strip().partition('\n')
    return (f'{head} {failure_line(output)}' if output.strip() else head).replace('|', '/')[:300]


def _check_args(args):
    """What makes every run fail (or overwrite another's folder), as one line; None if fine."""
    from ds_seg.config import ConfigError, load_config, load_ds_config
    from ds_seg.registry import MODELS, RegistryError, arguments
    names = [n.strip() for n in args.backends.split(',') if n.strip()]
    if not names:
        return f"--backends {args.backends!r} names no backend; known: {', '.join(BACKENDS)}"
    missing = [n for n in names if '=' in n and not os.path.isfile(_backend(n)[1])]
    if missing:
        return f"--backends {missing[0]}: no such DeepSpeed JSON file"
    unknown = [n for n in names if n not in BACKENDS and '=' not in n]
    if unknown:
        return f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(BACKENDS)}, or LABEL=file.json"
    labels = [n.split('=', 1)[0] for n in names]
    odd = [x for x in labels if not LABEL_PATTERN.fullmatch(x) or x == 'previous' or x in OUTPUTS]
    if odd:
        return (f"--backends label {odd[0]!r} is not a plain name (letters, digits, '_', '.', '-'; not 'previous' "
                f"or a benchmark.* file name): each run writes <work-dir>/<label>/, so a label may not be a path")
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        return f"--backends names {', '.join(twice)} twice; each run writes <work-dir>/<label>/"
    if args.steps < 1 or args.warmup < 0:
        return '--steps must be >= 1 and --warmup >= 0'
    for flag in ('nproc', 'micro_batch', 'max_batch', 'max_model', 'model_start'):
        value = getattr(args, flag)
        if value is not None and value < 1:
            return f"--{flag.replace('_', '-')} must be at least 1, got {value}"
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        return f"--peak-tflops must be a finite number > 0 (the device's peak TFLOP/s), got {args.peak_tflops}"
    if args.gpu_memory_gib is not None and not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        return f"--gpu-memory-gib must be a number of GiB > 0, got {args.gpu_memory_gib}"
    if args.gpu_memory_gib is not None and not _has_cuda():
        return '--gpu-memory-gib caps what a rank may allocate on its GPU; this machine has none (leave it out)'
    if args.timeout < 1 or args.profile < 0:
        return (f"--timeout must be at least 1 s, got {args.timeout}" if args.timeout < 1 else
                f"--profile must be >= 0 steps, got {args.profile}")
    for flag, needs in (('max_batch', 'find_max_batch'), ('model_start', 'find_max_model'),
                        ('max_model', 'find_max_model')):
        if getattr(args, flag) is not None and not getattr(args, needs):  # ran the plain benchmark
            return f"--{flag.replace('_', '-')} bounds --{needs.replace('_', '-')}, which is not given"
    if args.launcher == 'python' and (args.nproc or 1) != 1:
        return f"--launcher python starts one process, but --nproc is {args.nproc}; use torchrun or deepspeed"
    if os.path.exists(args.work_dir) and not os.path.isdir(args.work_dir):
        return f"--work-dir {args.work_dir} is a file; give a folder"
    try:  # that run's pruning would delete the benchmark's runs with the step folder they are in
        refuse_inside_checkpoints(args.work_dir, '--work-dir')
    except ConfigError as exc:
        return str(exc)
    for key in option_keys(args.cfg_options):
        owned = [k for k in BENCHMARK_OWNED if k == key or k.startswith(key + '.')]
        if owned:
            # Appended after the benchmark's own settings, it won: train.log_interval=5 timed 3
            # window medians instead of 10 steps, train.max_steps=4 timed 2 of the 10 steps said
            # (and "train=dict(max_steps=1)" the same, spelt as a section).
            return f"--cfg-options {owned[0]}: the benchmark sets it ({BENCHMARK_OWNED[owned[0]]}); leave it out"
    training = [n for n in ('checkpoints', 'metrics.jsonl') if os.path.lexists(os.path.join(args.work_dir, n))]
    if training:  # its files stayed, the benchmark's were mixed in beside them
        return (f"--work-dir {args.work_dir} holds a training run ({training[0]}); a benchmark writes runs of its "
                "own: give it another --work-dir")
    _, theirs = _earlier_results(args.work_dir, labels)
    if theirs:
        return (f"--work-dir {args.work_dir} already holds {theirs[0]}, which no benchmark wrote (a benchmark "
                "would replace it); give another --work-dir or another label (LABEL=file.json)")
    try:
        cfg = load_config(args.config, args.cfg_options)
        if cfg.model.type not in MODELS.module_dict:
            raise ConfigError(f"model.type {cfg.model.type!r} is not a registered model; known: "
                              f"{', '.join(sorted(MODELS.module_dict))}")
        _check_model_builds(cfg.model)
        _check_data_files(cfg.data)
        for n in names:
            if '=' in n:
                label, path = n.split('=', 1)
                problem = _label_claims_another_backend(label, path, load_ds_config(path), load_ds_config)
                if problem:
                    return problem
        problem = _unequal_batches(args, names)
        if problem:
            return problem
        key = args.find_max_model
        if key:  # a key the model does not take failed every run of the search, after the timed ones
            section, _, name = key.partition('.')
            accepted = arguments(MODELS.module_dict[cfg.model.type]) if section == 'model' else None
            first = name.split('.')[0]  # model.backbone_kwargs.depth: a key inside an argument that is a dict
            if section != 'model' or not first or (accepted is not None and first not in accepted):
                known = f"; {cfg.model.type} takes {', '.join(accepted)}" if accepted else ''
                raise ConfigError(f"--find-max-model {key!r}: a size argument of the model, model.<name>{known}")
            # The search doubles a whole number: a switch (bilinear=True) or a name (a timm
            # variant) failed its first probe after the timed run, which the row then lost.
            def not_a_size(name):
                return name in DATA_FIXED_MODEL_KEYS or isinstance(accepted[name].default, (bool, str))
            others = [a for a in accepted or () if not not_a_size(a)]
            known = f"; {cfg.model.type} takes {', '.join(others)}" if others else ''
            if first in DATA_FIXED_MODEL_KEYS:
                # The timed run passed, then training refused every probe (its bands, classes or
                # dates are the data's), and the row read 'failed: ccelerator to CPU...'.
                raise ConfigError(f"--find-max-model {key!r}: the training data fixes it "
                                  f"({DATA_FIXED_MODEL_KEYS[first]}), not the model's size; give a size "
                                  f"argument of the model, model.<name>{known}")
            if accepted is not None and first == name and not_a_size(first):
                default = accepted[first].default
                raise ConfigError(f"--find-max-model {key!r}: the search doubles a whole number, and {first} is "
                                  f"a {type(default).__name__} setting (default {default!r}), not a size; give a "
                                  f"size argument of the model, model.<name>{known}")
    except (ConfigError, RegistryError) as exc:
        return str(exc)
    return None


def _zero_setup(ds):
    """What a DeepSpeed JSON's row stands for: its ZeRO stage and where its state is offloaded."""
    zero = ds.get('zero_optimization') or {}
    offload = [k for k in ('offload_optimizer', 'offload_param')
               if (zero.get(k) or {}).get('device') not in (None, 'none')]
    return int(zero.get('stage', 0)), tuple(offload)


def _label_claims_another_backend(label, path, ds, load):
    """A LABEL=file.json whose label is a shipped backend's name titles its row (and the speed-ups
    against ddp) with that backend: ``zero2=ds_configs/zero1.json`` was tabled as ZeRO-2. A tuned
    variant of the same setup may keep the name; another stage or offload may not."""
    if label not in BACKENDS:
        return None
    if BACKENDS[label][0] == 'ddp':
        return (f"--backends {label}={path}: the label {label!r} is plain PyTorch DDP, the baseline of the "
                "speed-ups, but a LABEL=file.json runs DeepSpeed; give the run another label")
    stage, offload = _zero_setup(ds)
    want_stage, want_offload = _zero_setup(load(BACKENDS[label][1]))
    if (stage, offload) != (want_stage, want_offload):
        def said(s, o):
            return f"ZeRO stage {s}" + (f" with {' and '.join(o)}" if o else '')
        return (f"--backends {label}={path}: the label {label!r} names the shipped {BACKENDS[label][1]} "
                f"({said(want_stage, want_offload)}), but {path} is {said(stage, offload)}; its row would be "
                f"titled {label}: give it a label of its own (e.g. mine={path})")
    return None


def _check_model_builds(model_cfg):
    """The model built on the meta device (no memory, no weights read): a key it does not take
    (``--cfg-options model.nope=3``) or a value it refuses failed every backend's run in turn, each
    with its launcher's traceback, after the earlier results were moved aside."""
    from ds_seg.config import ConfigError
    from ds_seg.models.common import meta_device
    from ds_seg.models.pretrained import without_pretrained
    from ds_seg.registry import MODELS, RegistryError, build
    try:
        with meta_device():
            build(MODELS, without_pretrained(model_cfg), where='model')
    except (ConfigError, RegistryError):
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model ({model_cfg.get('type')}): cannot be built: {str(exc).splitlines()[0]}") from None


def _check_data_files(data_cfg):
    """The training files a config names exist (globs match, folders hold rasters): missing data
    failed every backend's run in turn with its launcher's traceback, after the earlier results
    were moved aside. (The dataset is built by each run; its other checks stay there.)"""
    from ds_seg.config import ConfigError
    from ds_seg.data.geotiff import DataError, expand_paths
    train = data_cfg.get('train') or {}
    for key in ('images', 'labels'):
        value = train.get(key)
        flat = [value] if isinstance(value, str) else value if isinstance(value, (list, tuple)) else []
        if value is None or train.get('stac') or not all(isinstance(v, str) for v in flat):
            continue   # (a time series' dates, lists in a list, are the dataset's to check)
        try:
            expand_paths(value, f'data.train.{key}', folders=True)
        except DataError as exc:
            raise ConfigError(str(exc)) from None


def _unequal_batches(args, names):
    """Every run must train the same global batch: the speed-up compares median step times, and
    a JSON of half the micro-batch looked 1.9x faster than DDP at half its images/s."""
    from ds_seg.config import resolve_batch
    world = args.nproc or (1 if args.launcher == 'python' else None)
    if world is None:
        import torch
        world = torch.cuda.device_count() if _has_cuda() else 2
    batches = {}
    for n in names:
        ds = derived_ds_config(n, args.micro_batch, args.warmup + args.steps, 'json', False, False)
        source = _backend(n)[1]
        micro, accum, total = resolve_batch(ds, world, source)
        batches[n.split('=', 1)[0]] = (total, micro, accum)
    micro = max(m for _, m, _ in batches.values())
    if args.find_max_batch and args.max_batch is not None and args.max_batch < micro:
        # The search starts at the runs' micro-batch: "largest that fits: 2" stood beside a row of 8.
        return (f"--max-batch {args.max_batch} is below the micro-batch the runs train ({micro}), where the search "
                f"starts; give at least {micro}, or a smaller --micro-batch")
    if len({b[0] for b in batches.values()}) > 1:
        listed = ', '.join(f'{label} {t} ({m} x {a} x {world})' for label, (t, m, a) in batches.items())
        return (f"--backends: the runs would train different global batches ({listed}: micro-batch x "
                "accumulation x ranks), so their step times are not comparable; give every JSON the same "
                "train_micro_batch_size_per_gpu and gradient_accumulation_steps (--micro-batch N sets the first)")
    return None


def main(argv=None):
    import signal
    import threading
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _main(argv)
    except (KeyboardInterrupt, Terminated) as exc:
        sig = 'SIGTERM' if isinstance(exc, Terminated) else 'Ctrl-C'
        print(f'benchmark: stopped by {sig}; the running backend was stopped with it, and no benchmark.json was '
              'written (the next benchmark into this --work-dir moves these run folders to previous/)',
              file=sys.stderr, flush=True)
        return 143 if isinstance(exc, Terminated) else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv=None):
    args = parse_args(argv)
    problem = _check_args(args)
    if problem:  # before any run starts: each would fail the same way, minutes later
        print(f'benchmark: error: {problem}', file=sys.stderr)
        return 2
    names = [n.strip() for n in args.backends.split(',') if n.strip()]
    on_gpu = _has_cuda()
    if args.nproc is None:
        import torch
        args.nproc = 1 if args.launcher == 'python' else torch.cuda.device_count() if on_gpu else 2
    if args.max_batch is None:
        args.max_batch = 1024 if on_gpu else 32
    if args.max_model is None:
        args.max_model = 256 if on_gpu else 4
    model_start = args.model_start or _option_value(args.cfg_options, args.find_max_model) or 1
    os.makedirs(args.work_dir, exist_ok=True)
    from ds_seg.engine.workdir import WorkDirBusy, WorkDirLock
    # One benchmark per work dir: a second one moved the first's running backend into previous/
    # (it died on its metrics.jsonl) and overwrote the other's tables.
    lock = WorkDirLock(args.work_dir)
    try:
        lock.acquire()
    except WorkDirBusy as exc:
        print(f'benchmark: error: --work-dir: {exc}', file=sys.stderr)
        return 2
    try:
        return _run_benchmarks(args, names, on_gpu, model_start, argv)
    finally:
        lock.release()


def _run_benchmarks(args, names, on_gpu, model_start, argv):
    """The backends' runs, size searches and profiles, and the tables (the work dir locked)."""
    archive = set_aside_earlier_results(args.work_dir, _earlier_results(args.work_dir, [n.split('=', 1)[0]
                                                                                      for n in names])[0])
    if archive:
        print(f'[benchmark] the earlier results in {args.work_dir} moved to {archive}/', flush=True)
    # The embedded experiment's description holds only while no --cfg-options reshapes it (the
    # GPU run's ViT-L table was titled "UNet base 16, synthetic 128 px").
    default = ('the embedded experiment with the --cfg-options of the command below' if args.cfg_options
               else 'default (UNet base 16, synthetic 128 px)')
    meta = dict(config=args.config or default, machine=machine_description(),
                launcher=args.launcher, nproc=args.nproc, steps=args.steps, warmup=args.warmup,
                device='cuda' if on_gpu else 'cpu', max_batch=args.max_batch,
                find_max_model=args.find_max_model, max_model=args.max_model, gpu_memory_gib=args.gpu_memory_gib,
                command=shlex.join([_program_as_typed()] + list(argv or sys.argv[1:])),  # pastes back
                started=time.strftime('%Y-%m-%d %H:%M:%S'))
    if args.precision in ('fp16', 'bf16'):
        from ds_seg.config import device_supports
        if not device_supports(args.precision):
            # Said once here, not only in each run's output.log: the table's precision column
            # names what ran, the command line what was asked for.
            print(f"[benchmark] --precision {args.precision}: not supported on this {meta['device']}; the runs "
                  "fall back as train.py does (see the table's precision column)", flush=True)
    rows, spec = [], {}
    for name in names:
        label = name.split('=', 1)[0]
        work_dir = os.path.join(args.work_dir, label)
        print(f'[benchmark] {name}: {args.warmup} + {args.steps} steps on {args.nproc} rank(s) -> {work_dir}', flush=True)
        rc, tail = run_backend(args, name, work_dir, args.steps, args.warmup)
        if rc != 0:
            print(f'[benchmark] {name} failed (exit {rc}):\n{tail}', file=sys.stderr, flush=True)
            # A run --timeout stopped ended by the benchmark's own signal: that, not the signal, is why.
            error = f'timed out after {args.timeout} s (--timeout)' if rc == 124 else failure_line(tail)
            rows.append(dict({k: None for k in ROW_FIELDS + MEMORY_FIELDS}, backend=label, error=error))
            if (args.find_max_batch or args.find_max_model) and _is_oom(tail):
                # The configured size does not fit (under --gpu-memory-gib, say): the search still
                # answers what does, from below. Seen on an H100: DDP's row ended at the OOM.
                rows[-1]['oom'] = True
                spec[label] = name
            continue
        row = summarise_run(work_dir, label, args.warmup)
        source = _backend(name)[1]
        shipped = os.path.dirname(source) == os.path.abspath(DS_CONFIGS_DIR)
        row['json'] = os.path.relpath(source, DS_CONFIGS_DIR.parent) if shipped else source
        spec[label] = name
        rows.append(row)
        print(f"[benchmark] {name}: {row['images_per_s']:.2f} img/s, median step {row['step_time_median_s']:.4f} s",
              flush=True)
    for r in rows:
        searchable = not r.get('error') or r.get('oom')
        try:
            if args.find_max_batch and searchable:
                r['max_micro_batch'], r['max_micro_batch_capped'] = find_max_batch(
                    args, spec[r['backend']], r['micro_batch'] or 1, args.max_batch)
                print(f"[benchmark] {r['backend']}: largest micro-batch {r['max_micro_batch']}"
                      f"{' (capped by --max-batch)' if r['max_micro_batch_capped'] else ''}", flush=True)
            if args.find_max_model and searchable:
                r['max_model'], r['max_model_capped'], r['max_model_params'] = find_max_model(
                    args, spec[r['backend']], args.find_max_model, model_start, args.max_model)
                print(f"[benchmark] {r['backend']}: largest {args.find_max_model} {r['max_model']}"
                      f"{' (capped by --max-model)' if r['max_model_capped'] else ''}", flush=True)
        except RuntimeError as exc:  # a probe failed for a reason other than memory: a mistake, not a size
            print(f'[benchmark] size search stopped: {exc}', file=sys.stderr, flush=True)
            r['error'], r['oom'] = search_error(exc), False
        if args.profile and not r.get('error'):
            rc, tail = run_backend(args, spec[r['backend']], os.path.join(args.work_dir, f"{r['backend']}_profile"),
                                   steps=args.profile, warmup=max(2, min(args.warmup, 5)),
                                   # no tb/: its slowed steps beside the timed runs' curves overlaid two
                                   # runs per backend in the README's tensorboard --logdir
                                   extra_options=[f'train.profile_steps={args.profile}', 'log.trackers=[]'])
            r['profile_dir'] = os.path.join(args.work_dir, f"{r['backend']}_profile", 'profile') if rc == 0 else None
            if rc != 0:   # (was said nowhere: exit 0, no line, profile_dir null beside a partial trace)
                r['profile_error'] = (f'timed out after {args.timeout} s (--timeout)' if rc == 124
                                      else failure_line(tail))
                print(f"[benchmark] {r['backend']}: the --profile run failed (exit {rc}): {r['profile_error']}",
                      file=sys.stderr, flush=True)
    add_speedups(rows)
    with open(os.path.join(args.work_dir, 'benchmark.json'), 'w') as f:
        json.dump(dict(meta, rows=rows), f, indent=2)
    write_markdown(os.path.join(args.work_dir, 'benchmark.md'), rows, meta)
    write_plot(os.path.join(args.work_dir, 'benchmark.png'), rows, meta)
    print(Path(args.work_dir, 'benchmark.md').read_text(), flush=True)
    # A row whose configured size ran out of memory but whose size search answered is a result.
    return 1 if any(r.get('error') and not r.get('oom') for r in rows) else 0


if __name__ == '__main__':
    sys.exit(main())
