"""Surviving the cluster: preemption signals, kill -9, dead ranks, damaged checkpoints, and the
Slurm templates exercised as far as a machine without Slurm allows. Every rank here is a real
process started the way srun starts them (only SLURM_* variables, no launcher)."""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from ds_seg.config import REPO_ROOT
from ds_seg.engine import checkpoint
from tests.dist import run_on_ranks
from tests.distributed.test_launchers import _env, _free_port
from tests.tiny import TINY_CONFIG, read_jsonl

pytestmark = pytest.mark.slow


def _args(tmp, work, steps, ckpt_every, *extra):
    cache = os.path.join(tmp, 'cache')
    return ['--config', TINY_CONFIG, '--work-dir', os.path.join(tmp, work), '--deepspeed_config',
            'ds_configs/zero2.json', '--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}',
            f'train.max_steps={steps}', 'train.eval_interval=0', f'train.checkpoint_interval={ckpt_every}',
            'train.log_interval=1', 'train.keep_checkpoints=100', *extra]


def _start_ranks(args, world_size=2, resume=None, extra_env=None):
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = _env(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(world_size), SLURM_STEP_ID='0',
                   SLURM_JOB_ID=str(port - 15000), SLURM_JOB_NODELIST='localhost', **(extra_env or {}))
        cmd = [sys.executable, 'launch/train.py', *args] + (['--resume', resume] if resume else [])
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, preexec_fn=_sigint_default))
    return procs


def _sigint_default():
    """Ranks start with Ctrl-C's default action, as a terminal's foreground job does: pytest run in
    the background of a script (CI) passes SIGINT on ignored, and a rank keeps an ignored SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _finish(procs, timeout=240):
    out = []
    for p in procs:
        try:
            out.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            out.append(p.communicate()[0])
    return [p.returncode for p in procs], out


def _wait_for_step(work, step, procs, timeout=120):
    path = os.path.join(work, 'metrics.jsonl')
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if os.path.exists(path) and len(read_jsonl(path)) >= step:
                return
        except ValueError:  # read while rank 0 was appending a line: look again
            pass
        assert all(p.poll() is None for p in procs), 'a rank exited early'
        time.sleep(0.02)
    raise AssertionError(f'no step {step} within {timeout}s')


def _final_weights(work):
    ckpt = os.path.join(work, 'checkpoints', checkpoint.find_latest(os.path.join(work, 'checkpoints')))
    return checkpoint.consolidated_state_dict(ckpt)


def _assert_same_weights(a, b, bn_stats_rtol=0.0):
    """Bit for bit; BatchNorm running statistics within ``bn_stats_rtol`` if given (see the
    SIGUSR1 test)."""
    assert a.keys() == b.keys()
    for k in a:
        if bn_stats_rtol and k.endswith(('running_mean', 'running_var')):
            torch.testing.assert_close(a[k], b[k], rtol=bn_stats_rtol, atol=0, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """An uninterrupted 2-rank run of 60 steps: what every interrupted run must reproduce."""
    tmp = str(tmp_path_factory.mktemp('reference'))
    codes, out = _finish(_start_ranks(_args(tmp, 'ref', 60, 10)))
    assert codes == [0, 0], out[0][-3000:]
    return tmp, _final_weights(os.path.join(tmp, 'ref'))


def _start_reference_again(tmp_path, reference):
    """The reference run started anew in ``tmp_path`` (same data): (tmp, work dir, processes)."""
    tmp = str(tmp_path)
    shutil.copytree(os.path.join(reference[0], 'cache'), os.path.join(tmp, 'cache'))
    return tmp, os.path.join(tmp, 'run'), _start_ranks(_args(tmp, 'run', 60, 10))


def _importing(program, args, env):
    """``program`` (the console script, launch/train.py or ``-m ds_seg.cli.train``) started with
    ``args``, returned once torch's library is mapped into it, i.e. in the middle of its imports."""
    if program == 'ds-seg-train':
        script = os.path.join(os.path.dirname(sys.executable), program)
        assert os.path.isfile(script), 'the console script is installed with the package (pip install -e .)'
        cmd = [script]
    else:
        cmd = [sys.executable, *program.split()]
    proc = subprocess.Popen(cmd + args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=_sigint_default)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        with open(f'/proc/{proc.pid}/maps') as f:
            if 'libtorch' in f.read():
                break
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize('program', ['ds-seg-train', 'launch/train.py', '-m ds_seg.cli.train'])
def test_a_stop_signal_while_the_rank_imports_stops_it_after_its_first_step(tmp_path, program):
    """A Slurm signal that lands while a rank is still importing ds_seg (torch, DeepSpeed: seconds)
    is kept, and the run stops with a checkpoint after its first step: Python's default action
    would have killed the rank (the job FAILED, not requeued). The ways the templates start a
    rank (the checkout's launch/train.py, the installed console script) and torchrun's
    `-m ds_seg.cli.train`. The signal is sent
    once torch's library is mapped into the process, i.e. in the middle of the imports."""
    tmp = str(tmp_path)
    env = _env(SLURM_PROCID='0', SLURM_LOCALID='0', SLURM_NTASKS='1', SLURM_STEP_ID='0', SLURM_JOB_ID=str(_free_port()),
               SLURM_JOB_NODELIST='localhost')
    proc = _importing(program, _args(tmp, 'run', 6, 6), env)
    os.kill(proc.pid, signal.SIGUSR1)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 75, out[-3000:]
    assert 'stopping at step 1 on SIGUSR1 (arrived after step 0): checkpoint saved' in out, out[-3000:]
    work = os.path.join(tmp, 'run')
    assert json.load(open(os.path.join(work, 'summary.json')))['exit_reason'] == 'preempted'
    assert checkpoint.find_latest(os.path.join(work, 'checkpoints')) == checkpoint.tag_for(1)


@pytest.mark.parametrize('program', ['ds-seg-train', 'launch/train.py', '-m ds_seg.cli.train'])
def test_a_ctrl_c_while_the_rank_imports_is_one_line_and_130(tmp_path, program):
    """A Ctrl-C in the seconds of the imports was a KeyboardInterrupt traceback from inside
    torch's or rasterio's import (one per rank under a launcher) and death by SIGINT, where a Ctrl-C
    a moment later is one line and status 130. Sent once torch's library is mapped."""
    tmp = str(tmp_path)
    proc = _importing(program, _args(tmp, 'run', 6, 6), _env())
    os.kill(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 130 and 'Traceback' not in out, out[-3000:]
    assert 'ds_seg: interrupted (Ctrl-C) before training started' in out.splitlines(), out[-3000:]
    assert not os.path.exists(os.path.join(tmp, 'run'))


def test_a_stop_signal_after_the_last_checkpoint_leaves_a_completed_run_completed(tmp_path):
    """A Slurm time-limit warning that lands while a finished run shuts down (its last checkpoint
    written) has nothing left to save: the exit status stays 0. Python's finalization restores the
    default action of the signals it handles, so without ignoring them the rank died of SIGUSR1
    and Slurm marked the job FAILED (seen on the real Slurm of tests/slurm)."""
    tmp = str(tmp_path)
    (proc,) = _start_ranks(_args(tmp, 'run', 4, 4), world_size=1)
    for line in proc.stdout:
        if 'saved checkpoint' in line and 'step_00000004' in line:
            break
    while proc.poll() is None:  # SIGUSR1 through the whole shutdown, every 2 ms
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.002)
    rest = proc.stdout.read()
    assert proc.returncode == 0, rest[-3000:]
    assert json.load(open(os.path.join(tmp, 'run', 'summary.json')))['exit_reason'] == 'completed'


def test_a_stop_signal_agreed_at_the_last_step_completes_the_run(tmp_path):
    """SIGUSR1 during the last step: the run saved its final checkpoint, then exited 75 ("continue
    with --resume auto"), and the Slurm template requeued a finished job, whose next start only
    said "steps 4->4". The outcome is decided there: exit 0, completed, nothing to continue."""
    tmp = str(tmp_path)
    (proc,) = _start_ranks(_args(tmp, 'run', 4, 2), world_size=1, extra_env={'DS_SEG_FAULT': 'slow@step:1.5'})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(r'step 3/4 ', line):
            break
    time.sleep(0.3)   # into step 4 (1.5 s)
    proc.send_signal(signal.SIGUSR1)
    rest = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, (''.join(lines) + rest)[-3000:]
    assert 'SIGUSR1 came with the last step: the run is complete, its final checkpoint saved' in rest, rest[-3000:]
    assert 'continue with --resume auto' not in rest
    work = os.path.join(tmp, 'run')
    assert json.load(open(os.path.join(work, 'summary.json')))['exit_reason'] == 'completed'
    assert checkpoint.find_latest(os.path.join(work, 'checkpoints')) == checkpoint.tag_for(4)


def test_sigusr1_checkpoints_exits_75_and_resume_matches_uninterrupted(tmp_path, reference):
    tmp, work, procs = _start_reference_again(tmp_path, reference)
    _wait_for_step(work, 3, procs)
    procs[1].send_signal(signal.SIGUSR1)  # one rank is enough: they agree at the next step
    codes, out = _finish(procs)
    assert codes == [75, 75], out[0][-3000:]
    summary = json.load(open(os.path.join(work, 'summary.json')))
    assert summary['exit_reason'] == 'preempted' and summary['steps'] < 60
    # Rank 0 never had the signal; it names it, and the step it reached rank 1 after, from the
    # ranks' agreement. Every step is a check step on a CPU: the stop ends the step in progress.
    stops = re.findall(r'stopping at step \d+ on SIGUSR1 \(arrived after step (\d+)\): checkpoint '
                       r'saved; continue with --resume auto', out[0])
    assert len(stops) == 1, out[0][-3000:]
    assert 3 <= int(stops[0]) <= summary['steps'] <= int(stops[0]) + 1, (stops, summary['steps'])
    assert checkpoint.find_latest(os.path.join(work, 'checkpoints')) == checkpoint.tag_for(summary['steps'])
    codes, out = _finish(_start_ranks(_args(tmp, 'run', 60, 10), resume='auto'))
    assert codes == [0, 0], out[0][-3000:]
    # Every checkpoint averages the ranks' BatchNorm running statistics (the saved model is the
    # ranks' average); the stop adds one checkpoint the reference run did not make. Averaging
    # commutes with the running-average update in exact arithmetic, not in the last bit of a
    # float32: statistics agree to a few ulps, every parameter bit for bit.
    _assert_same_weights(_final_weights(work), reference[1], bn_stats_rtol=1e-6)


def test_ctrl_c_checkpoints_exits_130_and_resume_matches_uninterrupted(tmp_path, reference):
    """Ctrl-C (SIGINT) ended every rank with a KeyboardInterrupt traceback, exit_reason "error",
    and the steps since the last checkpoint lost. A terminal's Ctrl-C reaches every rank and its
    loader workers; torchrun passes it on once more at once: the same Ctrl-C, not a second one."""
    tmp, work, procs = _start_reference_again(tmp_path, reference)
    _wait_for_step(work, 3, procs)
    for p in procs:
        p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    procs[0].send_signal(signal.SIGINT)  # torchrun's copy
    codes, out = _finish(procs)
    assert codes == [130, 130], out[0][-3000:]
    summary = json.load(open(os.path.join(work, 'summary.json')))
    assert summary['exit_reason'] == 'interrupted' and summary['steps'] < 60
    assert 'Traceback' not in out[0] + out[1], out[0][-3000:]
    assert re.search(r'stopping at step \d+ on SIGINT \(arrived after step \d+\): checkpoint saved; continue with '
                     r'--resume auto', out[0]), out[0][-3000:]
    assert checkpoint.find_latest(os.path.join(work, 'checkpoints')) == checkpoint.tag_for(summary['steps'])
    codes, out = _finish(_start_ranks(_args(tmp, 'run', 60, 10), resume='auto'))
    assert codes == [0, 0], out[0][-3000:]
    _assert_same_weights(_final_weights(work), reference[1], bn_stats_rtol=1e-6)  # see the SIGUSR1 test


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path):
    """The first Ctrl-C asks for a stop with a checkpoint at the next check step; a second one,
    a second or more later (a step that takes long), stops the run at once: exit 130, one line
    naming the last complete checkpoint, no traceback, and that checkpoint intact."""
    tmp = str(tmp_path)
    work = os.path.join(tmp, 'run')
    proc = subprocess.Popen([sys.executable, 'launch/train.py', *_args(tmp, 'run', 60, 2)], cwd=REPO_ROOT,
                            env=_env(DS_SEG_FAULT='slow@step:3'), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_sigint_default)
    _wait_for_step(work, 2, [proc])
    time.sleep(0.4)  # into step 3's planned 3 s: both Ctrl-Cs land in it, before its check
    proc.send_signal(signal.SIGINT)
    time.sleep(1.2)
    proc.send_signal(signal.SIGINT)
    (code,), (out,) = _finish([proc])
    assert code == 130, out[-3000:]
    assert 'Traceback' not in out, out[-3000:]
    last = checkpoint.find_latest(os.path.join(work, 'checkpoints'))
    assert re.search(rf'ds_seg: interrupted \(Ctrl-C\) at step \d+; the last complete checkpoint '
                     rf'\(.*{last}\) is intact: continue with --resume auto', out), out[-3000:]
    summary = json.load(open(os.path.join(work, 'summary.json')))
    # Stopped inside step 3, with step 2's checkpoint the last: none was written for the stop.
    # Both Ctrl-Cs land in step 3's compute (2 s on a slow machine: native fp16 on a Xeon did) or in its planned
    # sleep after the update: the step count is 2 or 3, and the line names it.
    assert summary['exit_reason'] == 'interrupted' and summary['steps'] in (2, 3), summary
    assert f"interrupted (Ctrl-C) at step {summary['steps']};" in out, out[-3000:]
    assert last == checkpoint.tag_for(2), last


def test_a_rank_started_with_ctrl_c_ignored_keeps_ignoring_it(tmp_path):
    """A process started in the background of a script (the one-node sbatch template's ranks)
    ignores SIGINT from its start, as Python leaves it; the run does not take it over."""
    tmp = str(tmp_path)
    proc = subprocess.Popen([sys.executable, 'launch/train.py', *_args(tmp, 'run', 6, 0)], cwd=REPO_ROOT,
                            env=_env(DS_SEG_FAULT='slow@step:0.5'), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    _wait_for_step(os.path.join(tmp, 'run'), 2, [proc])
    proc.send_signal(signal.SIGINT)
    (code,), (out,) = _finish([proc])
    assert code == 0 and 'Ctrl-C' not in out, out[-3000:]
    assert json.load(open(os.path.join(tmp, 'run', 'summary.json')))['steps'] == 6


KILL_AT_STEP = 27  # between the checkpoints of steps 20 and 30


def _kill_all(procs):
    for p in procs:
        p.kill()
    _finish(procs)


def test_kill9_at_a_fixed_step_and_in_each_phase_of_a_save_then_resume_auto_gives_same_weights(tmp_path, reference):
    """Three kills at replayable points, each followed by --resume auto: SIGKILL of every rank once
    metrics.jsonl reaches step 27 (between checkpoints); then, planned through DS_SEG_FAULT, every
    rank dying in the save of step 40 with its files written and no marker; then rank 0 dying in
    the save of step 50 with the marker written and fsynced but the folder not renamed. The run
    that finishes ends bit for bit with the uninterrupted weights, one metrics.jsonl row per step."""
    tmp, work, procs = _start_reference_again(tmp_path, reference)
    _wait_for_step(work, KILL_AT_STEP, procs)
    _kill_all(procs)
    root = os.path.join(work, 'checkpoints')
    assert checkpoint.find_latest(root) == 'step_00000020'

    codes, _ = _finish(_start_ranks(_args(tmp, 'run', 60, 10), resume='auto',
                                    extra_env={'DS_SEG_FAULT': 'sigkill@save-files:40'}))
    assert codes == [-signal.SIGKILL] * 2
    assert checkpoint.find_latest(root) == 'step_00000030'
    assert '.tmp-step_00000040' in os.listdir(root) and 'step_00000040' not in os.listdir(root)

    procs = _start_ranks(_args(tmp, 'run', 60, 10), resume='auto', extra_env={'DS_SEG_FAULT': 'sigkill@save-marker:50'})
    codes, out = _finish(procs[:1])
    procs[1].kill()  # rank 1 waits in the save's last agreement for a rank 0 that is gone
    _finish(procs[1:])
    assert codes == [-signal.SIGKILL], out[0][-3000:]
    assert os.path.exists(os.path.join(root, '.tmp-step_00000050', checkpoint.COMPLETE)), 'the marker was written'
    assert checkpoint.find_latest(root) == 'step_00000040', 'a folder not renamed into place is never trusted'

    codes, out = _finish(_start_ranks(_args(tmp, 'run', 60, 10), resume='auto'))
    assert codes == [0, 0], out[0][-3000:]
    assert 'step_00000040 at step 40' in out[0], out[0][-3000:]
    assert not [n for n in os.listdir(root) if n.startswith('.tmp')], 'the next save clears a killed one'
    _assert_same_weights(_final_weights(work), reference[1])
    steps = [r['step'] for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))]
    assert steps == list(range(1, 61)), 'logs after the checkpoint are redone, not duplicated'


def test_a_malformed_fault_plan_is_refused_in_one_line(monkeypatch):
    from ds_seg.config import ConfigError
    from ds_seg.engine import faults
    monkeypatch.setenv('DS_SEG_FAULT', 'sigkill@save:40')
    with pytest.raises(ConfigError, match="DS_SEG_FAULT='sigkill@save:40': expected 'sigkill@<point>:<step>'"):
        faults.Faults()
    monkeypatch.setenv('DS_SEG_FAULT', 'sigkill@save-files:40')
    assert faults.planned_fault() == ('save-files', 40) and faults.planned_step_delay() == 0
    monkeypatch.setenv('DS_SEG_FAULT', 'slow@step:-1')
    with pytest.raises(ConfigError, match="or 'slow@step:<seconds>'"):
        faults.Faults()
    monkeypatch.setenv('DS_SEG_FAULT', 'slow@step:0.25')
    assert faults.planned_step_delay() == 0.25


def test_a_killed_rank_makes_the_survivor_exit_in_bounded_time_naming_it(tmp_path):
    tmp = str(tmp_path)
    work = os.path.join(tmp, 'run')
    procs = _start_ranks(_args(tmp, 'run', 100000, 0), extra_env={'DS_SEG_DIST_TIMEOUT': '30'})
    _wait_for_step(work, 3, procs)
    procs[1].kill()
    t0 = time.time()
    codes, out = _finish(procs[:1], timeout=90)
    assert time.time() - t0 < 60, 'the survivor must not hang until a wall-clock limit'
    assert codes == [4], out[0][-3000:]
    assert 'rank 1 stopped responding' in out[0], out[0][-2000:]
    # No checkpoint (checkpoint_interval 0): the line says so, not "resume from the last one".
    assert 'no checkpoint was written; check the node, then start the run again.' in out[0], out[0][-2000:]
    procs[1].wait()
    # Its os._exit skipped close(): the lock stayed, until the next run took it over.
    assert not os.path.exists(os.path.join(work, '.ds_seg.lock'))
    assert json.load(open(os.path.join(work, 'summary.json')))['exit_reason'] == 'lost_rank'


def test_damaged_checkpoints_fall_back_to_the_newest_good_one_and_match_uninterrupted(tmp_path, reference):
    """Four kinds of damage, newest first: a truncated file, a missing rank file, bytes flipped
    inside a file without changing its size (only the SHA-256 catches it), and a killed save's
    temporary folder. --resume auto passes over each, saying why, and the run that continues
    from the newest good checkpoint ends with the uninterrupted run's weights, bit for bit. A
    metrics.jsonl line cut short by a full disk is set aside instead of breaking the resume."""
    ref_tmp, _ = reference
    tmp = str(tmp_path)
    work = os.path.join(tmp, 'run')
    root = os.path.join(work, 'checkpoints')
    shutil.copytree(os.path.join(ref_tmp, 'ref', 'checkpoints'), root)
    shutil.copy(os.path.join(ref_tmp, 'ref', 'metrics.jsonl'), os.path.join(work, 'metrics.jsonl'))
    with open(os.path.join(work, 'metrics.jsonl'), 'a') as f:
        f.write('{"step": 61, "loss": 0.4')  # the disk filled mid-line

    def largest(tag):
        folder = os.path.join(root, tag)
        return os.path.join(folder, max((f for f in os.listdir(folder) if f.endswith('.pt')),
                                        key=lambda f: os.path.getsize(os.path.join(folder, f))))

    with open(largest('step_00000060'), 'r+b') as f:  # truncated
        f.truncate(100)
    os.remove(largest('step_00000050'))                # a rank's file missing
    size = os.path.getsize(largest('step_00000040'))
    with open(largest('step_00000040'), 'r+b') as f:   # silent corruption, same size
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    assert os.path.getsize(largest('step_00000040')) == size
    shutil.copytree(os.path.join(root, 'step_00000030'), os.path.join(root, '.tmp-step_00000070'))
    assert checkpoint.verify(root, 'step_00000040') and checkpoint.verify(root, 'step_00000030') is None

    shutil.copytree(os.path.join(ref_tmp, 'cache'), os.path.join(tmp, 'cache'))
    codes, out = _finish(_start_ranks(_args(tmp, 'run', 60, 10), resume='auto'))
    assert codes == [0, 0], out[0][-3000:]
    assert 'resumed from' in out[0] and 'step_00000030' in out[0]
    assert 'skipped step_00000060' in out[0] and 'skipped step_00000050' in out[0], out[0][-3000:]
    assert 'skipped step_00000040: ' in out[0] and 'SHA-256' in out[0], out[0][-3000:]
    _assert_same_weights(_final_weights(work), reference[1])
    assert [r['step'] for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))] == list(range(1, 61))
    assert open(os.path.join(work, 'metrics.jsonl.damaged')).read().startswith('{"step": 61')


# -- the sbatch templates, run by bash with stand-ins for srun and scontrol -----------------------

FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$@" >> "$FAKE_SCONTROL_LOG"
if [ "$1 $2" = "show hostnames" ]; then hostname; fi
"""


@pytest.mark.parametrize('script', ['train.sbatch', 'train_multinode.sbatch'])
def test_sbatch_templates_parse(script):
    subprocess.run(['bash', '-n', str(REPO_ROOT / 'launch' / 'slurm' / script)], check=True)


def _bash_functions(script):
    text = (REPO_ROOT / 'launch' / 'slurm' / script).read_text()
    return dict(re.findall(r'(?ms)^(\w+)\(\) \{\n(.*?)^\}\n', text))


def test_sbatch_templates_share_their_helpers_word_for_word():
    """Each template is a file of its own (Slurm copies the script alone, nothing beside it to
    source): the helpers both need are written twice and must not drift apart."""
    one, multi = _bash_functions('train.sbatch'), _bash_functions('train_multinode.sbatch')
    shared = {'being_cancelled', 'requeue_or_say_why', 'seconds_of', 'warned_at_once', 'expand_patterns'}
    assert shared <= set(one) and shared <= set(multi), (sorted(one), sorted(multi))
    for name in shared:
        assert one[name] == multi[name], name


def _endless_template_job(tmp_path, bin_dir, work, cache, **env):
    """train.sbatch as Slurm job 4242 (the stand-ins in ``bin_dir`` first on PATH) on the tiny
    config with no end in sight, as a Popen; ``env``: NPROC_PER_NODE and the like."""
    env = _env(PATH=f'{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ["PATH"]}',
               SLURM_JOB_ID='4242', SLURM_JOB_NAME='ds_seg', SLURM_NNODES='1', SLURM_JOB_NODELIST='localhost',
               SLURM_SUBMIT_DIR=str(REPO_ROOT), WORK_DIR=str(work), MASTER_PORT=str(_free_port()),
               DS_CONFIG='zero2', CONFIG=TINY_CONFIG, FAKE_SCONTROL_LOG=str(tmp_path / 'scontrol.log'), **env)
    options = ['--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}',
               'train.max_steps=100000', 'train.eval_interval=0', 'train.checkpoint_interval=0', 'train.log_interval=1']
    return subprocess.Popen(['bash', str(REPO_ROOT / 'launch' / 'slurm' / 'train.sbatch'), *options], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _end_template_job(job):
    """Kill what is left of a template job a failed test leaves running (its ranks train for ever)."""
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def test_sbatch_template_checkpoints_on_usr1_and_requeues(tmp_path):
    """Stand-in for the batch-shell path (tests/slurm/ runs the template on a real Slurm)."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'scontrol').write_text(FAKE_SCONTROL)
    (bin_dir / 'scontrol').chmod(stat.S_IRWXU)
    work = tmp_path / 'work'
    cache = tmp_path / 'cache'
    job = _endless_template_job(tmp_path, bin_dir, work, cache, NPROC_PER_NODE='2')
    try:
        _wait_for_step(str(work), 3, [job], timeout=180)
        job.send_signal(signal.SIGUSR1)  # what Slurm does --signal=B:USR1@300 before the time limit
        out = job.communicate(timeout=180)[0]
    finally:
        _end_template_job(job)
    assert job.returncode == 0, out[-3000:]
    summary = json.load(open(work / 'summary.json'))
    assert summary['exit_reason'] == 'preempted'
    assert checkpoint.find_latest(str(work / 'checkpoints')) == checkpoint.tag_for(summary['steps'])
    assert 'requeue 4242' in (tmp_path / 'scontrol.log').read_text()
    assert 'exit 75, not a failure' in out and 'Traceback' not in out and 'ChildFailedError' not in out


SCONTROL_10_MIN_JOB = """#!/usr/bin/env bash
echo "$@" >> "$FAKE_SCONTROL_LOG"
if [ "$1 $2" = "show hostnames" ]; then hostname; fi
if [ "$1 $2" = "show job" ]; then echo "JobId=4242 JobState=RUNNING Reason=None Restarts=${SLURM_RESTART_COUNT:-0} TimeLimit=00:10:00"; fi
"""


@pytest.mark.parametrize('restart', ['0', '1'])
def test_sbatch_template_stops_requeueing_a_warning_at_once_whose_lead_is_not_in_the_file(tmp_path, restart):
    """`sbatch --time=10 --signal=B:USR1@600 train.sbatch`: the lead on the command line overrides
    the file's @300, which the at-once guard read, so every start was warned within 30 s and
    requeued again (seven starts in 200 s, a step or two each, for ever). A USR1 in the first 30 s
    of a requeued start is taken for such a warning: the first start is requeued, the second not."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'scontrol').write_text(SCONTROL_10_MIN_JOB)
    (bin_dir / 'scontrol').chmod(stat.S_IRWXU)
    work, cache = tmp_path / 'work', tmp_path / 'cache'
    job = _endless_template_job(tmp_path, bin_dir, work, cache, NPROC_PER_NODE='1', SLURM_RESTART_COUNT=restart)
    try:
        for line in job.stdout:   # the shell's traps are set before it prints this
            if line.startswith('[sbatch] job 4242'):
                break
        job.send_signal(signal.SIGUSR1)   # Slurm's warning, 0 to 30 s into the start
        out = job.communicate(timeout=300)[0]
    finally:
        _end_template_job(job)
    log = (tmp_path / 'scontrol.log').read_text()
    if restart == '0':
        assert job.returncode == 0 and 'requeue 4242' in log, out[-3000:]
    else:
        assert job.returncode == 75 and 'requeue 4242' not in log, out[-3000:]
        assert re.search(r'a USR1 came \d+ s into this start \(restart 1\) of job 4242, whose time limit is 00:10:00', out)
        assert f'and WORK_DIR={work}' in out, out[-3000:]
    assert checkpoint.find_latest(str(work / 'checkpoints')) is not None


def test_a_requeued_start_continues_with_the_runs_own_config_not_the_edited_file(tmp_path):
    """The config file edited while the job waited in the queue (for the next experiment): the
    requeued start read the edited file, and the run went on as another experiment, one line
    mid-log. It continues with the run's own config.json."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'scontrol').write_text(FAKE_SCONTROL)
    (bin_dir / 'scontrol').chmod(stat.S_IRWXU)
    work, cache, own = tmp_path / 'work', tmp_path / 'cache', tmp_path / 'own.py'
    own.write_text(f"_base_ = [{TINY_CONFIG!r}]\ntrain = dict(max_steps=2, eval_interval=0, log_interval=1)\n"
                   f"data = dict(num_workers=0, train=dict(cache_dir={str(cache)!r}), val=dict(cache_dir={str(cache)!r}))\n")
    env = _env(PATH=f'{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', SLURM_JOB_ID='4242',
               SLURM_JOB_NAME='ds_seg', SLURM_NNODES='1', SLURM_JOB_NODELIST='localhost', NPROC_PER_NODE='1',
               WORK_DIR=str(work), MASTER_PORT=str(_free_port()), DS_CONFIG='zero0', CONFIG=str(own),
               FAKE_SCONTROL_LOG=str(tmp_path / 'scontrol.log'))
    script = ['bash', str(REPO_ROOT / 'launch' / 'slurm' / 'train.sbatch')]
    first = subprocess.run(script, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    own.write_text(own.read_text().replace('max_steps=2', 'max_steps=4'))   # the next experiment
    again = subprocess.run(script, cwd=REPO_ROOT, env=dict(env, SLURM_RESTART_COUNT='1'), capture_output=True,
                           text=True, timeout=240)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert (f"[sbatch] restart 1 of job 4242: continuing with the run's own {work}/config.json (a change to {own} "
            f"takes effect in a new submission with WORK_DIR={work})") in out, out[-3000:]
    assert 'already at step 2 = train.max_steps: nothing to train' in out, out[-3000:]
    assert json.load(open(work / 'summary.json'))['steps'] == 2


def test_a_signal_to_a_rank_slow_to_start_is_kept_until_it_catches_it(tmp_path):
    """On a loaded node a rank's imports took over the 20 s the batch shell waited for it to catch
    USR1; the signal, sent to a rank that still ignored it, was lost, and the run trained on
    (1532 steps, seen in CI). A rank 25 s slow to start still gets it, and checkpoints."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'scontrol').write_text(FAKE_SCONTROL)
    (bin_dir / 'slow_python').write_text(f'#!/usr/bin/env bash\nsleep 25\nexec {sys.executable} "$@"\n')
    for name in ('scontrol', 'slow_python'):
        (bin_dir / name).chmod(stat.S_IRWXU)
    work = tmp_path / 'work'
    job = _endless_template_job(tmp_path, bin_dir, work, tmp_path / 'cache', NPROC_PER_NODE='1',
                                PYTHON=str(bin_dir / 'slow_python'))
    try:
        for line in job.stdout:
            if line.startswith('[sbatch] job 4242'):
                break
        time.sleep(2)   # the rank started, its signals still ignored for 23 s more
        job.send_signal(signal.SIGUSR1)
        out = job.communicate(timeout=300)[0]
    finally:
        _end_template_job(job)
    assert job.returncode == 0 and 'requeue 4242' in (tmp_path / 'scontrol.log').read_text(), out[-3000:]
    assert json.load(open(work / 'summary.json'))['exit_reason'] == 'preempted'


def _template_outside_slurm(tmp_path, work):
    """`bash train.sbatch` with one rank of the tiny config and no end in sight, as a Popen."""
    cache = tmp_path / 'cache'
    env = _env(PATH=f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', NPROC_PER_NODE='1',
               WORK_DIR=str(work), MASTER_PORT=str(_free_port()), DS_CONFIG='zero2', CONFIG=TINY_CONFIG)
    options = ['--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}',
               'train.max_steps=100000', 'train.eval_interval=0', 'train.checkpoint_interval=0', 'train.log_interval=1']
    return subprocess.Popen(['bash', str(REPO_ROOT / 'launch' / 'slurm' / 'train.sbatch'), *options], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sbatch_template_run_outside_slurm_exits_75_after_its_stop(tmp_path):
    """`bash train.sbatch` on a workstation: after a stop the template ran `scontrol requeue
    "${SLURM_JOB_ID}"` under `set -u` and died on the unbound variable (exit 1, its fallback line
    never printed). Outside Slurm nothing requeues: it says so and exits 75, the stop's status."""
    work = tmp_path / 'work'
    job = _template_outside_slurm(tmp_path, work)
    _wait_for_step(str(work), 2, [job], timeout=180)
    job.send_signal(signal.SIGUSR1)
    out = job.communicate(timeout=180)[0]
    assert job.returncode == 75, out[-3000:]
    assert 'not a Slurm job, so nothing requeues it; run this script again to resume' in out, out[-3000:]
    assert 'unbound variable' not in out and json.load(open(work / 'summary.json'))['exit_reason'] == 'preempted'


def test_sbatch_template_signal_in_the_ranks_first_moments_is_a_stop_not_a_crash(tmp_path):
    """A signal forwarded while a rank's Python was starting, before launch/train.py caught it,
    killed the rank (status 138): the stop at the start of a job (a time-limit warning at Slurm's
    first check, a preemption) became a failed job. The template waits until the rank catches it."""
    work = tmp_path / 'work'
    job = _template_outside_slurm(tmp_path, work)
    head = ''
    for line in job.stdout:   # the ranks are being started as this line is read
        head += line
        if line.startswith('[sbatch] job'):
            break
    job.send_signal(signal.SIGUSR1)
    out = head + job.communicate(timeout=240)[0]
    assert job.returncode == 75, out[-3000:]
    summary = json.load(open(work / 'summary.json'))
    assert summary['exit_reason'] == 'preempted' and summary['steps'] == 1, out[-3000:]
    assert checkpoint.find_latest(str(work / 'checkpoints')) == checkpoint.tag_for(1)


def test_sbatch_template_ranks_meet_at_a_free_port(tmp_path):
    """The port was 15000 + job id % 20000: jobs 4242 and 24242 on one node (or anything else
    listening there) met at the same port, and the second failed at its rendezvous."""
    port = _free_port()
    taken = socket.socket()
    taken.bind(('127.0.0.1', port))
    taken.listen()
    work, cache = tmp_path / 'work', tmp_path / 'cache'
    env = _env(PATH=f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', SLURM_JOB_ID=str(port - 15000 + 20000),
               NPROC_PER_NODE='2', WORK_DIR=str(work), DS_CONFIG='zero2', CONFIG=TINY_CONFIG, PYTHON=sys.executable)
    options = ['--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}', 'train.max_steps=2',
               'train.eval_interval=0', 'train.checkpoint_interval=0', 'train.log_interval=1']
    try:
        proc = subprocess.run(['bash', str(REPO_ROOT / 'launch' / 'slurm' / 'train.sbatch'), *options], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
    finally:
        taken.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert json.load(open(work / 'summary.json'))['exit_reason'] == 'completed'
    assert f'port {port},' not in out and ', port ' in out, out[-3000:]
    # Below the kernel's ephemeral range: the OS's own pick (an ephemeral port) was taken by other
    # jobs' connections before rank 0 listened there (EADDRINUSE at the rendezvous).
    used = int(re.search(r', port (\d+),', out).group(1))
    assert 10000 <= used < int(open('/proc/sys/net/ipv4/ip_local_port_range').read().split()[0]), used


@pytest.mark.parametrize('nproc', [None, '0', 'two'])
def test_sbatch_template_without_gpus_or_ranks_fails_instead_of_completing(tmp_path, nproc):
    """No nvidia-smi, no SLURM_GPUS_ON_NODE, no NPROC_PER_NODE: the template started 0 ranks and
    exited 0, so Slurm marked the job COMPLETED with nothing trained."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for tool in ('bash', 'hostname', 'wc', 'cat'):  # a PATH without nvidia-smi
        os.symlink(shutil.which(tool), bin_dir / tool)
    env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'NPROC_PER_NODE'))}
    env.update(PATH=str(bin_dir), WORK_DIR=str(tmp_path / 'work'), **({'NPROC_PER_NODE': nproc} if nproc else {}))
    proc = subprocess.run([str(bin_dir / 'bash'), str(REPO_ROOT / 'launch' / 'slurm' / 'train.sbatch')], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'no GPU found' in proc.stderr and 'set NPROC_PER_NODE' in proc.stderr
    assert not (tmp_path / 'work').exists()


@pytest.mark.parametrize('script', ['train.sbatch', 'train_multinode.sbatch'])
def test_a_first_start_finding_its_default_work_dir_taken_refuses_it(tmp_path, script):
    """A job id seen before (two clusters sharing /home, a reset controller): the new job's first
    start resumed the old job's run in work_dirs/<name>-<id> (--resume auto) and reported it
    COMPLETED. Refused before any rank, the old run untouched; a requeued start resumes it."""
    old = tmp_path / 'work_dirs' / 'ds_seg-5000'
    (old / 'checkpoints').mkdir(parents=True)
    (old / 'summary.json').write_text('{"steps": 12}')
    env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'WORK_DIR'))}
    env.update(SLURM_JOB_ID='5000', SLURM_JOB_NAME='ds_seg', NPROC_PER_NODE='0')
    cmd = ['bash', str(REPO_ROOT / 'launch' / 'slurm' / script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ('[sbatch] work_dirs/ds_seg-5000 already exists, but this is the first start of job 5000: another job '
            'of the same id') in proc.stderr, proc.stderr
    assert 'Submit again with WORK_DIR=work_dirs/ds_seg-5000 to continue that run' in proc.stderr
    assert sorted(os.listdir(old)) == ['checkpoints', 'summary.json']
    if script == 'train.sbatch':  # a requeued start (restart 1) gets past it, to the next check (no ranks here)
        proc = subprocess.run(cmd, cwd=tmp_path, env=dict(env, SLURM_RESTART_COUNT='1'), capture_output=True,
                              text=True, timeout=60)
        assert 'already exists' not in proc.stderr and 'NPROC_PER_NODE' in proc.stderr, proc.stderr


# Stand-ins for the commands the templates run before they start the ranks (a GPU count, the
# allocation's host names: seconds on a busy node), slow on purpose, and for srun (every task here).
SLOW_NVIDIA_SMI = """#!/usr/bin/env bash
touch "$FAKE_SLOW_MARK"; sleep 4; printf 'GPU 0: stand-in\\nGPU 1: stand-in\\n'
"""
SLOW_SCONTROL = """#!/usr/bin/env bash
echo "$@" >> "$FAKE_SCONTROL_LOG"
if [ "$1 $2" = "show hostnames" ]; then touch "$FAKE_SLOW_MARK"; sleep 4; echo 127.0.0.1; fi
"""
LOCAL_SRUN = """#!/usr/bin/env bash
while [ "${1#--}" != "$1" ]; do shift; done   # srun's own options
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_ID=0 "$@" & pids+=($!); done
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
status=0
for pid in "${pids[@]}"; do
    while :; do rc=0; wait "$pid" || rc=$?; kill -0 "$pid" 2>/dev/null || break; done
    [ "$status" -eq 0 ] && status=$rc
done
exit "$status"
"""


@pytest.mark.parametrize('script, signum', [('train.sbatch', signal.SIGUSR1),
                                             ('train_multinode.sbatch', signal.SIGTERM)])
def test_sbatch_template_passes_a_signal_from_before_the_ranks_started_on_to_them(tmp_path, script, signum):
    """A time-limit warning or `scancel --full` that lands while the batch shell is still
    preparing (here: a slow `nvidia-smi -L`, a slow `scontrol show hostnames`). bash's default
    action for SIGUSR1 ended the shell (the job FAILED, nothing requeued); now the ranks start
    with it, checkpoint after their first step, and the job is requeued."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('nvidia-smi', SLOW_NVIDIA_SMI), ('scontrol', SLOW_SCONTROL), ('srun', LOCAL_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    work, cache, mark = tmp_path / 'work', tmp_path / 'cache', tmp_path / 'slow-command-started'
    env = _env(PATH=f'{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ["PATH"]}',
               SLURM_JOB_ID='4343', SLURM_JOB_NAME='ds_seg', SLURM_NNODES='1', SLURM_JOB_NODELIST='localhost',
               SLURM_SUBMIT_DIR=str(REPO_ROOT), WORK_DIR=str(work), MASTER_PORT=str(_free_port()),
               DS_CONFIG='zero2', CONFIG=TINY_CONFIG, FAKE_SCONTROL_LOG=str(tmp_path / 'scontrol.log'),
               FAKE_SLOW_MARK=str(mark), **({'SLURM_NTASKS': '2'} if 'multinode' in script else {}))
    options = ['--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}',
               'train.max_steps=40', 'train.eval_interval=0', 'train.checkpoint_interval=0', 'train.log_interval=1']
    job = subprocess.Popen(['bash', str(REPO_ROOT / 'launch' / 'slurm' / script), *options], cwd=REPO_ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while not mark.exists() and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert mark.exists(), job.communicate()[0][-3000:]
    job.send_signal(signum)   # --signal=B:USR1@N, `scancel --batch`: the batch shell only
    out = job.communicate(timeout=240)[0]
    assert job.returncode == 0, out[-3000:]
    name = signal.Signals(signum).name
    assert f'[sbatch] received {name[3:]} before the ranks started' in out, out[-3000:]
    assert f'stopping at step 1 on {name} (arrived after step 0): checkpoint saved' in out, out[-3000:]
    assert json.load(open(work / 'summary.json'))['exit_reason'] == 'preempted'
    assert checkpoint.find_latest(str(work / 'checkpoints')) == checkpoint.tag_for(1)
    assert 'requeue 4343' in (tmp_path / 'scontrol.log').read_text()
    assert 'exit 75, not a failure' in out and 'Traceback' not in out


def test_ranks_whose_launcher_is_killed_alone_stop_with_a_checkpoint(tmp_path):
    """`kill <pid of deepspeed>` (or a Ctrl-C only the launcher got) ended the launcher at once and
    left its ranks training on as orphans: no line, no summary, the work dir locked, a restart
    refused while they went on writing to it. The ranks notice their launcher's exit and stop at
    the next check step with a checkpoint, as for a Ctrl-C."""
    tmp = str(tmp_path)
    work = os.path.join(tmp, 'run')
    deepspeed = os.path.join(os.path.dirname(sys.executable), 'deepspeed')
    log = open(os.path.join(tmp, 'ranks.log'), 'w')
    launcher = subprocess.Popen([deepspeed, '--num_gpus', '2', '--master_port', str(_free_port()), 'launch/train.py',
                                 *_args(tmp, 'run', 100000, 0)], cwd=REPO_ROOT, env=_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_step(work, 3, [launcher])
        launcher.terminate()  # the runner alone, not its process group
        launcher.wait(timeout=30)
        deadline = time.time() + 90
        while time.time() < deadline and not os.path.exists(os.path.join(work, 'summary.json')):
            time.sleep(0.2)
        time.sleep(2)
        summary = json.load(open(os.path.join(work, 'summary.json')))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # whatever is left of the group
    out = open(os.path.join(tmp, 'ranks.log')).read()
    assert summary['exit_reason'] == 'interrupted', out[-3000:]
    step = summary['steps']
    assert checkpoint.find_latest(os.path.join(work, 'checkpoints')) == checkpoint.tag_for(step), out[-3000:]
    assert f"stopping at step {step} on its launcher's exit (noticed after step" in out, out[-3000:]
    assert not os.path.exists(os.path.join(work, '.ds_seg.lock'))


@pytest.mark.parametrize('script', ['train.sbatch', 'train_multinode.sbatch'])
def test_sbatch_template_without_its_python_says_so_before_starting_ranks(tmp_path, script):
    """Under `sbatch --export=NONE` the job's PATH is not the submitting shell's: each rank failed
    with `python: command not found` (or found a Python without ds_seg)."""
    proc = subprocess.run(['bash', str(REPO_ROOT / 'launch' / 'slurm' / script)], cwd=REPO_ROOT,
                          env=dict(PATH='/usr/bin:/bin', PYTHON=str(tmp_path / 'nope' / 'python'), NPROC_PER_NODE='1',
                                   WORK_DIR=str(tmp_path / 'work')),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"[sbatch] {tmp_path / 'nope' / 'python'}: no such command on "), proc.stderr
    assert "this job's PATH: /usr/bin:/bin" in proc.stderr and 'PYTHON=/path/to/' in proc.stderr
    assert not (tmp_path / 'work').exists()


def test_sbatch_template_outside_a_checkout_runs_ds_seg_of_its_python_not_the_project_s_script(tmp_path):
    """Submitted from a project with a launch/train.py of its own, the template ran that script with
    ds_seg's arguments (the job COMPLETED, nothing trained); and outside a checkout PYTHON was
    ignored: the job looked for ds-seg-train on a PATH without it and told the user to set the
    PYTHON they had set."""
    project = tmp_path / 'project'
    (project / 'launch').mkdir(parents=True)
    marker = tmp_path / 'their_script_ran'
    (project / 'launch' / 'train.py').write_text(f"open({str(marker)!r}, 'w').close()\n")
    work, cache = tmp_path / 'work', tmp_path / 'cache'
    env = _env(PATH='/usr/bin:/bin', NPROC_PER_NODE='1', WORK_DIR=str(work), DS_CONFIG='zero2', CONFIG=TINY_CONFIG,
               PYTHON=sys.executable)
    options = ['--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}', 'train.max_steps=1',
               'train.eval_interval=0', 'train.checkpoint_interval=0']
    proc = subprocess.run(['bash', str(REPO_ROOT / 'launch' / 'slurm' / 'train.sbatch'), *options], cwd=project,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert not marker.exists()
    assert json.load(open(work / 'summary.json'))['exit_reason'] == 'completed', out[-3000:]


NODE_NAME_SCONTROL = """#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then echo node-only-slurm-knows; fi
if [ "$1 $2 $3" = "show node -o" ]; then echo "NodeName=$4 Arch=x86_64 NodeAddr=$FAKE_NODE_ADDR NodeHostName=$4"; fi
"""
STOP_SRUN = """#!/usr/bin/env bash
exit 0
"""


@pytest.mark.parametrize('addr, resolved', [('127.0.0.1', True), ('also-unknown.invalid', False)])
def test_multinode_template_meets_at_the_first_nodes_address_where_its_name_does_not_resolve(tmp_path, addr, resolved):
    """NodeName=node001 NodeAddr=10.1.0.1: the ranks waited 15 minutes (DS_SEG_DIST_TIMEOUT) for a
    rendezvous at a name no resolver knows, flooding the log with C++ frames. The template meets
    at Slurm's NodeAddr instead, or says at once that neither resolves."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('scontrol', NODE_NAME_SCONTROL), ('srun', STOP_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = _env(PATH=f'{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', SLURM_JOB_ID='4243',
               SLURM_JOB_NODELIST='node-only-slurm-knows', SLURM_NNODES='1', SLURM_NTASKS='1', NPROC_PER_NODE='1',
               WORK_DIR=str(tmp_path / 'work'), FAKE_NODE_ADDR=addr, PYTHON=sys.executable)
    proc = subprocess.run(['bash', str(REPO_ROOT / 'launch' / 'slurm' / 'train_multinode.sbatch')], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    if resolved:
        assert proc.returncode == 0 and 'master 127.0.0.1:' in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.startswith("[sbatch] the allocation's first node, node-only-slurm-knows, does not resolve on "
                                      ), proc.stderr
        assert "(Slurm's NodeAddr for it: also-unknown.invalid)" in proc.stderr


def test_the_multinode_template_outside_an_allocation_says_so_in_one_line(tmp_path):
    """Run with bash on a login node, it went on to 'SLURM_JOB_NODELIST: unbound variable' and a
    first node named '' that did not resolve."""
    env = {k: v for k, v in _env(WORK_DIR=str(tmp_path / 'work'), PYTHON=sys.executable).items()
           if not k.startswith('SLURM_')}
    proc = subprocess.run(['bash', str(REPO_ROOT / 'launch' / 'slurm' / 'train_multinode.sbatch')], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == '', proc.stdout + proc.stderr
    assert proc.stderr.count('\n') == 1 and proc.stderr.startswith(
        '[sbatch] this template runs in a Slurm allocation (SLURM_JOB_NODELIST is not set): submit it with sbatch '
        '--nodes=N '), proc.stderr
    assert not (tmp_path / 'work').exists()


def _signal_during_evaluation(tmp, resume=None):
    """4 steps, an evaluation at 2 of 32 px tiles one at a time (16+ forwards on each rank); rank 1
    gets SIGTERM at its second forward of that evaluation."""
    from ds_seg import distributed
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import ds_config, tiny_cfg
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4, eval_interval=2, checkpoint_interval=4)
    cfg.data.eval_tile, cfg.data.eval_overlap, cfg.data.eval_batch_size = 32, 0, 1
    trainer = Trainer(cfg, ds_config(2), work_dir=os.path.join(tmp, 'work'), resume=resume)
    forwards = []
    real_forward = trainer.backend.forward

    def forward(x):
        if trainer.backend.module.training:   # a training step's
            return real_forward(x)
        forwards.append(trainer.step)
        if resume is None and distributed.rank() == 1 and len(forwards) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_forward(x)
    trainer.backend.forward = forward
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return dict(summary=summary, forwards=forwards)


def test_a_stop_signal_during_an_evaluation_cuts_it_short_and_checkpoints_at_once(tmp_path):
    """The evaluation ran to its end (225 s for a 16000 px scene) and another step after it before
    the stop's checkpoint: far past Slurm's 30 s before SIGKILL, so the preempted run lost its steps."""
    tmp = str(tmp_path)
    stopped = run_on_ranks(_signal_during_evaluation, 2, args=(tmp,))
    for rank in stopped:
        assert rank['summary']['exit_reason'] == 'preempted' and rank['summary']['steps'] == 2
        assert rank['forwards'] == [2, 2]   # the signal came in the second; agreed before the third
    work = tmp_path / 'work'
    assert checkpoint.find_latest(str(work / 'checkpoints')) == 'step_00000002'
    assert not (work / 'eval.jsonl').exists()   # cut short: nothing recorded
    resumed = run_on_ranks(_signal_during_evaluation, 2, args=(tmp, 'auto'))
    assert resumed[0]['summary']['exit_reason'] == 'completed' and resumed[0]['summary']['steps'] == 4
    assert [row['step'] for row in read_jsonl(work / 'eval.jsonl')] == [4]


def _hangup(disposition):
    def preexec():
        signal.signal(signal.SIGHUP, disposition)   # a terminal's job; or nohup's ignored SIGHUP
    return preexec


@pytest.mark.parametrize('nohup', [False, True])
def test_a_closed_terminals_sighup_checkpoints_and_stops_unless_nohup_ignores_it(tmp_path, nohup):
    """An ssh session closed without nohup: SIGHUP killed the run (exit 129), no checkpoint, no
    summary.json, the steps since the last checkpoint lost. Under nohup it is ignored, as before."""
    tmp = str(tmp_path)
    work = os.path.join(tmp, 'run')
    proc = subprocess.Popen([sys.executable, 'launch/train.py', *_args(tmp, 'run', 12, 100)], cwd=REPO_ROOT,
                            env=_env(DS_SEG_FAULT='slow@step:0.3'), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=_hangup(signal.SIG_IGN if nohup else signal.SIG_DFL))
    _wait_for_step(work, 2, [proc])
    proc.send_signal(signal.SIGHUP)
    (code,), (out,) = _finish([proc])
    summary = json.load(open(os.path.join(work, 'summary.json')))
    if nohup:
        assert code == 0 and summary['exit_reason'] == 'completed' and summary['steps'] == 12, out[-3000:]
        return
    assert code == 130 and summary['exit_reason'] == 'interrupted' and summary['steps'] < 12, out[-3000:]
    assert re.search(r'stopping at step \d+ on SIGHUP \(arrived after step \d+\): checkpoint saved', out), out[-3000:]
    assert checkpoint.find_latest(os.path.join(work, 'checkpoints')) == checkpoint.tag_for(summary['steps'])
