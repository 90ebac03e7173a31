"""launch/train.py end to end through every way users start it: the deepspeed CLI, torchrun,
plain python, and processes started by srun that only have SLURM_* variables."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from ds_seg.config import REPO_ROOT
from tests.tiny import TINY_CONFIG, read_jsonl

pytestmark = pytest.mark.slow

METRIC_KEYS = {'step', 'epoch', 'loss', 'lr', 'grad_norm', 'loss_scale', 'images_per_s', 'megapixels_per_s',
               'step_time_s', 'data_wait_frac', 'max_mem_mb', 'mfu', 'backend', 'zero_stage', 'world_size',
               'precision'}


def _free_port(lo=15000, hi=35000):
    for _ in range(200):
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        if lo <= port < hi:
            return port
    import random
    return random.randrange(lo, hi)


def _options(tmp):
    cache = os.path.join(tmp, 'cache')
    return ['--config', TINY_CONFIG, '--work-dir', os.path.join(tmp, 'work'), '--cfg-options',
            f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}', 'train.max_steps=24',
            'train.eval_interval=12', 'train.checkpoint_interval=12', 'train.log_interval=6',
            f'train.peak_tflops={PEAK_TFLOPS}']


PEAK_TFLOPS = 0.5  # one device's: MFU divides the run's images over every rank's peak


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'TORCHELASTIC_RUN_ID')
           and not k.startswith('SLURM_')}
    env.update(OMP_NUM_THREADS='1', PYTHONPATH=str(REPO_ROOT), **extra)
    return env


def _check_run(tmp, world_size, backend='deepspeed', stage=None, launcher=None):
    work = os.path.join(tmp, 'work')
    summary = json.load(open(os.path.join(work, 'summary.json')))
    assert summary['exit_reason'] == 'completed' and summary['steps'] == 24
    ds = json.load(open(os.path.join(work, 'ds_config.json')))
    assert ds['ds_seg']['world_size'] == world_size and ds['ds_seg']['backend'] == backend
    assert ds['train_batch_size'] == ds['train_micro_batch_size_per_gpu'] * ds['gradient_accumulation_steps'] * world_size
    if launcher:
        assert ds['ds_seg']['launcher'] == launcher
    rows = read_jsonl(os.path.join(work, 'metrics.jsonl'))
    assert [r['step'] for r in rows] == [6, 12, 18, 24]
    assert METRIC_KEYS <= set(rows[-1]) and rows[-1]['world_size'] == world_size
    assert rows[-1]['precision'] == summary['precision'] == ds['ds_seg']['precision']
    if stage is not None:
        assert rows[-1]['zero_stage'] == stage
    # MFU was the whole run's images over one device's peak: world_size times too high.
    from ds_seg.registry import MODELS, build
    from ds_seg.telemetry import forward_flops
    cfg = json.load(open(os.path.join(work, 'config.json')))
    flops = forward_flops(lambda: build(MODELS, cfg['model']), (1, cfg['model']['in_channels'],
                                                                cfg['data']['crop_size'], cfg['data']['crop_size']))
    assert rows[-1]['mfu'] == pytest.approx(3 * flops * rows[-1]['images_per_s'] / (PEAK_TFLOPS * 1e12 * world_size))
    evals = read_jsonl(os.path.join(work, 'eval.jsonl'))
    assert [e['step'] for e in evals] == [12, 24] and 0 <= evals[-1]['mIoU'] <= 1
    assert os.listdir(os.path.join(work, 'tb'))
    assert open(os.path.join(work, 'checkpoints', 'latest')).read() == 'step_00000024'


def _run(cmd, env, timeout=300):
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f'{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    return proc


def test_deepspeed_cli_two_cpu_ranks_shipped_zero2(tmp_path):
    deepspeed = shutil.which('deepspeed') or os.path.join(os.path.dirname(sys.executable), 'deepspeed')
    proc = _run([deepspeed, '--num_gpus', '2', '--master_port', str(_free_port()), 'launch/train.py',
                 '--deepspeed_config', 'ds_configs/zero2.json', *_options(str(tmp_path))], _env())
    _check_run(str(tmp_path), 2, stage=2)
    if 'fp16 is not supported' in proc.stdout:  # a CPU: the fallback is said once and recorded
        assert json.load(open(tmp_path / 'work' / 'summary.json'))['precision'] in ('bf16-autocast', 'fp32')


def test_torchrun_two_ranks_zero3(tmp_path):
    _run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port',
          str(_free_port()), 'launch/train.py', '--deepspeed_config', 'ds_configs/zero3.json',
          *_options(str(tmp_path))], _env())
    _check_run(str(tmp_path), 2, stage=3, launcher='torchrun')


def test_plain_python_single_process_ddp(tmp_path):
    _run([sys.executable, 'launch/train.py', '--backend', 'ddp', '--deepspeed_config', 'ds_configs/zero1.json',
          *_options(str(tmp_path))], _env())
    _check_run(str(tmp_path), 1, backend='ddp', launcher='none')


def test_srun_style_processes_with_only_slurm_variables(tmp_path):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = _env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS='2', SLURM_STEP_ID='0', SLURM_NNODES='1',
                   SLURM_NODEID='0', SLURM_JOB_ID=str(port - 15000), SLURM_JOB_NODELIST='localhost')
        procs.append(subprocess.Popen([sys.executable, 'launch/train.py', '--deepspeed_config',
                                       'ds_configs/zero0.json', *_options(str(tmp_path))],
                                      cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], '\n'.join(o[-3000:] for o in outputs)
    _check_run(str(tmp_path), 2, stage=0, launcher='slurm')


def test_user_mistakes_stop_before_training_with_one_line(tmp_path):
    bad = tmp_path / 'bad.json'
    bad.write_text(json.dumps({'train_micro_batch_size_per_gpu': 2, 'gradient_clippin': 1.0}))
    proc = subprocess.run([sys.executable, 'launch/train.py', '--deepspeed_config', str(bad), *_options(str(tmp_path))],
                          cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown top-level key 'gradient_clippin'" in proc.stderr and 'Traceback' not in proc.stderr
    proc = subprocess.run([sys.executable, 'launch/train.py', *_options(str(tmp_path)), 'model.type=Unett'],
                          cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Did you mean 'UNet'" in proc.stderr and 'Traceback' not in proc.stderr
    assert not os.path.exists(tmp_path / 'work' / 'metrics.jsonl')


def test_a_finished_run_exits_with_its_loader_workers_stopped_even_without_garbage_collection(tmp_path):
    """The DataLoader workers ignore SIGTERM (it is meant for their rank), so a worker still
    alive at interpreter exit would be terminate()d in vain and waited for forever. The trainer
    stops them itself; with the garbage collector off nothing else would."""
    code = ('import gc, sys; gc.disable(); from ds_seg.cli.train import main; '
            'sys.exit(main(sys.argv[1:]))')
    args = ['--config', TINY_CONFIG, '--deepspeed_config', 'ds_configs/zero0.json', '--work-dir',
            str(tmp_path / 'work'), '--cfg-options', f'data.train.cache_dir={tmp_path}/cache',
            f'data.val.cache_dir={tmp_path}/cache', 'data.num_workers=1', 'train.max_steps=3',
            'train.eval_interval=0', 'train.checkpoint_interval=0']
    _run([sys.executable, '-c', code, *args], _env(), timeout=90)


def test_a_finished_run_exits_0_while_other_threads_are_inside_native_code(tmp_path):
    """A rank's gloo threads outlive destroy_process_group while DDP/DeepSpeed still refer to the
    group, and interpreter finalization aborts a thread that is inside native code ('terminate
    called without an active exception', status -6: a completed ZeRO-3 run failed CI this way,
    rarely). A thread spinning in torch ops stands in for them, so that the abort is certain
    instead of rare: the run must end with its own status."""
    site = tmp_path / 'site'
    site.mkdir()
    (site / 'sitecustomize.py').write_text(
        'import sys, threading, time\n'
        'def spin():\n'
        '    while "torch" not in sys.modules or not hasattr(sys.modules["torch"], "ones"):\n'
        '        time.sleep(0.05)\n'
        '    import torch\n'
        '    a = torch.ones(128, 128)\n'
        '    while True:\n'
        '        a @ a\n'
        'threading.Thread(target=spin, daemon=True).start()\n')
    env = _env()
    env['PYTHONPATH'] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    args = ['--config', TINY_CONFIG, '--deepspeed_config', 'ds_configs/zero0.json', '--work-dir',
            str(tmp_path / 'work'), '--cfg-options', f'data.train.cache_dir={tmp_path}/cache',
            f'data.val.cache_dir={tmp_path}/cache', 'train.max_steps=2', 'train.eval_interval=0',
            'train.checkpoint_interval=0']
    proc = _run([sys.executable, 'launch/train.py', *args], env, timeout=120)
    assert 'terminate called' not in proc.stderr
    assert json.load(open(tmp_path / 'work' / 'summary.json'))['exit_reason'] == 'completed'


def test_a_mistake_under_two_ranks_is_said_once_and_exits_cleanly(tmp_path):
    """Every rank checks the same config: under torchrun or the deepspeed CLI each printed the
    same error (N lines for N GPUs), and a rank left its process group open, so gloo aborted its
    exit ('terminate called without an active exception', status -6, reported as the failure)."""
    deepspeed = shutil.which('deepspeed') or os.path.join(os.path.dirname(sys.executable), 'deepspeed')
    launchers = {'torchrun': [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2',
                              '--master_port', str(_free_port())],
                 'deepspeed': [deepspeed, '--num_gpus', '2', '--master_port', str(_free_port())]}
    for name, launcher in launchers.items():
        proc = subprocess.run([*launcher, 'launch/train.py', *_options(str(tmp_path)), 'model.type=Unett'],
                              cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        errors = [line for line in out.splitlines() if 'ds_seg: error:' in line]
        assert proc.returncode != 0 and len(errors) == 1, f'{name}: {out[-3000:]}'
        assert "Did you mean 'UNet'" in errors[0]
        assert 'terminate called' not in out and 'exitcode: -6' not in out, f'{name}: {out[-3000:]}'
        assert not os.path.exists(tmp_path / 'work'), name


@pytest.mark.parametrize('backend', ['deepspeed', 'ddp'])
def test_ctrl_c_while_a_rank_waits_for_the_others_ends_it_with_one_line(tmp_path, backend):
    """A rank started alone (WORLD_SIZE=2 left in the shell): the rendezvous blocks in C++ for the
    10-minute timeout, where Python runs no signal handler; a Ctrl-C did nothing (SIGKILL was
    the way out). Now it ends the rank at once: exit 130, the Ctrl-C line naming the wait, and
    no work dir."""
    import signal
    import time
    port = _free_port()
    env = _env(WORLD_SIZE='2', RANK='0', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    # Ctrl-C's default action, as a terminal's foreground job has it: pytest run in the background
    # of a script (CI) passes SIGINT on ignored, and a rank keeps an ignored SIGINT.
    proc = subprocess.Popen([sys.executable, 'launch/train.py', '--backend', backend, *_options(str(tmp_path))],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while True:   # rank 0 serves the rendezvous store on MASTER_PORT once it waits there
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        with socket.socket() as probe:
            if probe.connect_ex(('127.0.0.1', port)) == 0:
                break
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    try:
        out = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()   # (it waited out the 10-minute rendezvous timeout)
    assert proc.returncode == 130, out[-3000:]
    assert ('ds_seg: interrupted (Ctrl-C) before training started, while rank 0 of 2 waited for the others at '
            f'127.0.0.1:{port}') in out and 'Traceback' not in out, out[-3000:]
    assert not (tmp_path / 'work').exists()


def test_a_rank_started_alone_says_it_is_waiting_and_what_to_unset(tmp_path):
    """RANK=0 WORLD_SIZE=2 left in a shell: `python launch/train.py` waited the whole rendezvous
    timeout without a line. It now says, every so often, that it waits and for what, then fails
    with the rendezvous' one line, before a work dir exists."""
    port = _free_port()
    env = _env(WORLD_SIZE='2', RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port),
               DS_SEG_WAIT_NOTICE_S='2', DS_SEG_DIST_TIMEOUT='8')
    out = subprocess.run([sys.executable, 'launch/train.py', *_options(str(tmp_path))], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    said = (f'ds_seg: rank 0 of 2 has waited 2 s for the other ranks at 127.0.0.1:{port} (RANK and WORLD_SIZE come '
            'from the environment: for one process, unset them); it gives up after 8 s (DS_SEG_DIST_TIMEOUT)')
    assert said in out.stderr, out.stderr[-3000:]
    assert out.returncode != 0 and f'rank 0 of 2 could not meet the others at 127.0.0.1:{port}' in out.stderr
    assert 'Traceback' not in out.stderr and not (tmp_path / 'work').exists(), out.stderr[-3000:]


def test_a_run_whose_stdout_reader_quits_goes_on_to_its_end(tmp_path):
    """`train.py ... | head`: the first print after the reader quit raised BrokenPipeError, which
    was called a lost rank (exit 4) and lost every step since the last checkpoint."""
    args = [sys.executable, 'launch/train.py', '--config', TINY_CONFIG, '--deepspeed_config', 'ds_configs/zero0.json',
            '--work-dir', str(tmp_path / 'work'), '--cfg-options', f'data.train.cache_dir={tmp_path}/cache',
            f'data.val.cache_dir={tmp_path}/cache', 'train.max_steps=12', 'train.log_interval=1',
            'train.eval_interval=0', 'train.checkpoint_interval=0', 'train.warmup_log_steps=0']
    # Steps of 0.2 s: the run is still printing when the reader quits.
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=_env(DS_SEG_FAULT='slow@step:0.2'), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:   # read up to the first step, then quit as `head` does
        if '[ds_seg] step 1/' in line:
            break
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    summary = json.load(open(tmp_path / 'work' / 'summary.json'))
    assert summary['exit_reason'] == 'completed' and summary['steps'] == 12
    assert [row['step'] for row in read_jsonl(tmp_path / 'work' / 'metrics.jsonl')] == list(range(1, 13))
    said = [line for line in err.splitlines() if line.startswith('[ds_seg] stdout (pipe:')]
    assert len(said) == 1 and 'failed: [Errno 32 EPIPE] Broken pipe: printing stops here, the command goes on' in said[0]
    assert 'Traceback' not in err and 'Logging error' not in err, err[-3000:]
