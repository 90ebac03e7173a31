"""The shipped sbatch templates on a real Slurm (tests/slurm/cluster.py): every way Slurm stops a
job ends with a checkpoint at the step the signal arrived on, and the run then continues (Slurm's
requeue) to the same final weights as an uninterrupted run.

All jobs are submitted at once and driven together, so the whole module costs one run's time:
  reference  train.sbatch, not interrupted
  (a)        `--time=2 --signal=B:USR1@45` (the timed warning, to the batch shell)
  (b)        `scancel --signal=TERM --full` (the batch shell's process group)
  (c)        `scancel --signal=USR1 --full`
  (d)        `scontrol requeue` of the running job (Slurm kills it after KillWait)
  each with train.sbatch (one node, no srun) and train_multinode.sbatch (srun, on n1+n2);
  (e)        train_multinode.sbatch on n1+n2, `--time=1` with no warning: the end of the time limit
  (f)        both templates on n3+n4, preempted (with a grace time) by a job of a higher-tier partition
  (g)        a plain `scancel JOB`, both templates: the ranks checkpoint, and the job ends CANCELLED
             (it was requeued, and ran to the end: scancel could not cancel a running job)
After them, on their own: a stop in one task of a job array requeues that task alone, and a rank
that fails at its start ends the job within a minute (the other rank waited until the time limit).
A requeued job gets a begin time `cred_expire` ahead (10 s on the test cluster: see cluster.py);
the driver gives (a) and (e) a longer limit for their second start and otherwise lets Slurm start it.
srun answers a SIGTERM by killing its step at once; the multi-node template keeps it out of the
batch shell's process group (launch/slurm/train_multinode.sbatch), and (b) and (d) check that.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from ds_seg.config import REPO_ROOT
from ds_seg.engine import checkpoint
from tests.distributed.test_launchers import _env
from tests.tiny import TINY_CONFIG, ds_config

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

# slurmctld checks limits every 30 s (job_time_limit) and sends the warning at the first check
# where now + warning + 30 >= the end: with `--time=2 --signal=B:USR1@45`, 45 to 75 s after the
# start, and the time limit's SIGTERM 120 to 150 s after it. (With --time=1 the warning came at the
# first check, 0 to 30 s in: on a loaded machine while slurmd was still starting the batch shell,
# where Slurm drops a signal; and twelve jobs starting at once once took 88 s to their first step,
# the time limit's SIGTERM arriving with the warning.) Unpaced, 120 steps were once done before the
# warning came (the run completed, nothing to test). So (a) runs as a slow node, 0.6 s per step
# (DS_SEG_FAULT, ds_seg.engine.faults): 160 steps outlast the warning, while the other jobs, at
# full speed, stay short. Paced cases are slow on their first start only (SLURM_RESTART_COUNT=0):
# the requeued start runs at full speed.
MAX_STEPS = 160
A_STEP_DELAY = 'slow@step:0.6'
F_STEP_DELAY = 'slow@step:0.4'
# (e) must still be running when its 1 minute is over (slurmctld notices 0 to 30 s later).
E_STEP_DELAY = 'slow@step:0.8'
SIGNAL_AT = 8          # steps done before the driver sends a signal
DRIVE_TIMEOUT_S = 540
# Every job's own limit, in minutes: train.sbatch warns (USR1@300) 5 minutes before it, so a
# limit of 10 stopped the uninterrupted reference at step 156 of 160 when a loaded CI machine
# took over 5 minutes for it. At 30 the warning would come after DRIVE_TIMEOUT_S and the
# module's timeout. (a) and (e) give their own --time.
JOB_TIME_MIN = 30
SINGLE = ['launch/slurm/train.sbatch', '--nodes=1', '--ntasks-per-node=1', '--cpus-per-task=1']
MULTI = ['launch/slurm/train_multinode.sbatch', '--nodes=2', '--ntasks-per-node=1', '--cpus-per-task=1']
WARNING = ['--time=2', '--signal=B:USR1@45']
CASES = {
    'reference': dict(submit=SINGLE, action=None, signal=None),
    # One node, no srun: the ranks are in the batch shell's process group.
    'a_time_warning': dict(submit=SINGLE + WARNING, action=None, signal='SIGUSR1', shell_heard='USR1',
                           pace=A_STEP_DELAY, time_limit=True),
    'b_term_full': dict(submit=SINGLE, action=['scancel', '--signal=TERM', '--full'], signal='SIGTERM'),
    'c_usr1_full': dict(submit=SINGLE, action=['scancel', '--signal=USR1', '--full'], signal='SIGUSR1',
                        shell_heard='USR1'),
    'd_requeue': dict(submit=SINGLE, action=['scontrol', 'requeue'], signal='SIGTERM'),
    # srun in its own session (the template's setsid): the batch shell alone hears the warning and
    # --full, and its trap asks srun for SIGUSR1 on every task; srun itself would kill its step.
    'a_time_warning_multi': dict(submit=MULTI + WARNING, action=None, signal='SIGUSR1', shell_heard='USR1',
                                 pace=A_STEP_DELAY, time_limit=True),
    'b_term_full_multi': dict(submit=MULTI, action=['scancel', '--signal=TERM', '--full'], signal='SIGUSR1',
                              shell_heard='TERM'),
    'c_usr1_full_multi': dict(submit=MULTI, action=['scancel', '--signal=USR1', '--full'], signal='SIGUSR1',
                              shell_heard='USR1'),
    # The tasks get SIGTERM from Slurm directly; the shell's trap adds a SIGUSR1 through srun, which
    # may be the first to arrive on some rank (the stop line names the signal that arrived first,
    # the higher number on a tie).
    'd_requeue_multi': dict(submit=MULTI, action=['scontrol', 'requeue'], signal=('SIGTERM', 'SIGUSR1')),
    # The end of the time limit with no warning asked for: Slurm sends the tasks SIGTERM, refuses
    # srun's kill of its step (the job has stopped running), and accepts the template's requeue.
    # (The template's own USR1 warning, 300 s ahead, would come at once: it is replaced by SIGURG,
    # which bash ignores.)
    'e_time_limit_multi': dict(submit=MULTI + ['--time=1', '--signal=B:URG@1'], action=None,
                               signal=('SIGTERM', 'SIGUSR1'), pace=E_STEP_DELAY, time_limit=True),
    # Preemption (cluster.py: partition 'urgent' preempts 'preemptible', GraceTime 10 s, requeue).
    # Slurm sends SIGTERM to the job steps' tasks when the grace time starts, and the kill sequence
    # to every process when it ends: the multi-node template's tasks stop at once, the one-node
    # template (no job step) at the end of the grace time. Both paced, so as not to finish first.
    'f_preempt': dict(submit=SINGLE, partition='preemptible', action='preempt', signal='SIGTERM',
                      pace=F_STEP_DELAY),
    'f_preempt_multi': dict(submit=MULTI, partition='preemptible', action='preempt', signal='SIGTERM',
                            pace=F_STEP_DELAY),
    # A plain scancel: the job is cancelled, after its checkpoint; not requeued.
    'g_cancel': dict(submit=SINGLE, action=['scancel'], signal='SIGTERM', cancelled=True),
    # The tasks get SIGTERM from Slurm, and the shell's trap passes a SIGUSR1 through srun: a rank
    # names the first to arrive (as in d_requeue_multi).
    'g_cancel_multi': dict(submit=MULTI, action=['scancel'], signal=('SIGTERM', 'SIGUSR1'), cancelled=True),
}
URGENT = ['sbatch', '--parsable', '--partition=urgent', '--nodes=2', '--exclusive', '--time=1', '--job-name=urgent',
          '--output=/dev/null', '--wrap', 'sleep 5']
TERMINAL = {'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'OUT_OF_MEMORY', 'BOOT_FAIL', 'DEADLINE', 'PREEMPTED'}


def _job(job_id):
    out = subprocess.run(['scontrol', 'show', 'job', '-o', str(job_id)], capture_output=True, text=True).stdout
    return dict(re.findall(r'(\w+)=(\S*)', out))


def _steps(work):
    """Rows rank 0 has finished writing (the file may be read in the middle of an append)."""
    path = os.path.join(work, 'metrics.jsonl')
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.endswith('\n') and line.strip())


def _submit(tmp, name, case):
    work = os.path.join(tmp, name)
    ds_path = os.path.join(tmp, 'ds.json')
    script, *sbatch_opts = case['submit']
    python = sys.executable
    if case.get('pace'):   # slow until the signal, then at full speed: the module lasts less
        python = os.path.join(tmp, f'python-{name}')
        with open(python, 'w') as f:
            f.write(f'#!/bin/sh\n[ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && export DS_SEG_FAULT={case["pace"]}\n'
                    f'exec {sys.executable} "$@"\n')
        os.chmod(python, 0o755)
    env = _env(PATH=f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', PYTHON=python,
               NPROC_PER_NODE='2', WORK_DIR=work, DS_CONFIG=ds_path, CONFIG=TINY_CONFIG)
    cache = os.path.join(tmp, 'cache')
    options = ['--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}',
               f'train.max_steps={MAX_STEPS}', 'train.eval_interval=0', f'train.checkpoint_interval={MAX_STEPS}',
               'train.log_interval=1', 'train.keep_checkpoints=0',  # every stop's checkpoint stays to be checked
               'data.num_workers=1']  # a worker per rank: signals reach it too
    cmd = ['sbatch', '--parsable', f"--partition={case.get('partition', 'debug')}", '--gpus-per-node=0',
           f'--time={JOB_TIME_MIN}', '--job-name', name,
           f'--output={tmp}/{name}-%j.out', *sbatch_opts, script, *options]
    job_id = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()
    return dict(case, name=name, job=job_id.split(';')[0], work=work, outs=[f'{tmp}/{name}-{job_id}.out'],
                signalled_step=None, signal_time=None)


def _output(run):
    """The output of the run's jobs (a resubmission's after the first's)."""
    return ''.join(open(out).read() if os.path.exists(out) else '(no output file)' for out in run['outs'])


@pytest.fixture(scope='module')
def runs(slurm_cluster, tmp_path_factory):
    """Submit every case, drive them to completion, return their records."""
    tmp = str(tmp_path_factory.mktemp('slurm'))
    with open(os.path.join(tmp, 'ds.json'), 'w') as f:
        json.dump(ds_config(2, micro_batch=2), f)  # ZeRO-2, fp32, torch Adam: no JIT build
    runs = {name: _submit(tmp, name, case) for name, case in CASES.items()}
    deadline = time.time() + DRIVE_TIMEOUT_S
    urgent = []   # the job that preempts the 'preempt' cases, once they are under way
    while True:
        pending = 0
        for run in runs.values():
            info = _job(run['job'])
            state = info.get('JobState', '?')
            if state == 'CANCELLED' and run.get('cancelled') and run['signalled_step'] is not None:
                continue
            if state in TERMINAL:
                pytest.fail(f"{run['name']}: job {run['job']} ended {state}:\n{_output(run)[-4000:]}\n"
                            f"{slurm_cluster.log_tail(15)}")
            if state == 'COMPLETED':
                continue
            pending += 1
            if state == 'PENDING' and info.get('Reason') == 'BeginTime':   # requeued, waiting cred_expire
                if run.get('time_limit') and info.get('TimeLimit') != f'00:{JOB_TIME_MIN}:00':   # (a), (e): one stop each
                    subprocess.run(['scontrol', 'update', f"JobId={run['job']}", f'TimeLimit={JOB_TIME_MIN}'], check=True)
            elif state == 'RUNNING' and isinstance(run['action'], list) and run['signalled_step'] is None:
                done = _steps(run['work'])
                if done >= SIGNAL_AT:
                    run['signalled_step'], run['signal_time'] = done, time.time()
                    subprocess.run(run['action'] + [run['job']], check=True)
        victims = [r for r in runs.values() if r['action'] == 'preempt']
        if not urgent and all(_job(r['job']).get('JobState') == 'RUNNING' and _steps(r['work']) >= SIGNAL_AT
                              for r in victims):
            for r in victims:  # (no signal_time: the one-node template is signalled a grace time later)
                r['signalled_step'] = _steps(r['work'])
            urgent.append(subprocess.run(URGENT, check=True, capture_output=True, text=True).stdout.strip())
        if not pending:
            break
        if time.time() > deadline:
            pytest.fail('jobs still running after %d s: %s' % (DRIVE_TIMEOUT_S, {
                n: (_job(r['job']).get('JobState'), _steps(r['work'])) for n, r in runs.items()}))
        time.sleep(0.5)
    return runs


def _weights(work):
    root = os.path.join(work, 'checkpoints')
    return checkpoint.consolidated_state_dict(os.path.join(root, checkpoint.find_latest(root)))


def test_reference_run_completes(runs):
    run = runs['reference']
    summary = json.load(open(os.path.join(run['work'], 'summary.json')))
    assert summary['exit_reason'] == 'completed' and summary['steps'] == MAX_STEPS, _output(run)[-3000:]
    assert 'stopping at step' not in _output(run)


@pytest.mark.parametrize('name', [n for n in CASES if n != 'reference' and not CASES[n].get('cancelled')])
def test_signal_checkpoints_at_its_step_and_the_requeued_run_ends_as_the_reference(runs, name):
    run = runs[name]
    out = _output(run)
    stops = re.findall(r'stopping at step (\d+) on (SIG\w+) \(arrived after step (\d+)\): checkpoint saved', out)
    assert stops, out[-4000:]
    step, signal_name, arrived = int(stops[0][0]), stops[0][1], int(stops[0][2])
    assert signal_name in ((run['signal'],) if isinstance(run['signal'], str) else run['signal']), out[-4000:]
    if run.get('shell_heard'):
        assert f"[sbatch] received {run['shell_heard']}" in out, out[-4000:]
        assert 'forcing job termination' not in out, out[-4000:]
    # Every step is a check step here (log_interval=1, CPU): the run stops at the end of the step
    # in progress when the signal arrived. How long Slurm took to deliver it is Slurm's business.
    assert arrived <= step <= arrived + 1, (arrived, step)
    # bash's report of a background job's end ("line 134:  5724 Killed   ( trap ...") is no news
    # of the run's: the multi-node template's resender, killed once srun ended, printed one.
    assert not re.search(r'line \d+: +\d+ Killed', out), out[-3000:]
    if run['signalled_step'] is not None:  # the driver's signal: sent once this many steps were done
        assert run['signalled_step'] <= arrived, (run['signalled_step'], arrived)
    for stop in stops:
        tag = checkpoint.tag_for(int(stop[0]))
        assert os.path.isfile(os.path.join(run['work'], 'checkpoints', tag, checkpoint.COMPLETE)), out[-3000:]
        assert f'resumed from {run["work"]}/checkpoints/{tag} at step {int(stop[0])}' in out, out[-3000:]
    ckpt = os.path.join(run['work'], 'checkpoints', checkpoint.tag_for(step))
    sent_term = 'SIGTERM' in (signal_name, 'SIG' + run.get('shell_heard', ''))
    if run['signal_time'] is not None and sent_term:  # complete well within KillWait (30 s)
        assert os.path.getmtime(os.path.join(ckpt, checkpoint.COMPLETE)) - run['signal_time'] < 30
    assert 'exit 75, not a failure' in out
    assert 'Traceback' not in out and 'ChildFailedError' not in out and 'DataLoader worker' not in out, out[-4000:]
    summary = json.load(open(os.path.join(run['work'], 'summary.json')))
    assert summary['exit_reason'] == 'completed' and summary['steps'] == MAX_STEPS
    assert int(_job(run['job']).get('Restarts', 0)) >= 1
    if name == 'e_time_limit_multi':
        assert 'DUE TO TIME LIMIT' in out, out[-4000:]
    ref, got = _weights(runs['reference']['work']), _weights(run['work'])
    assert ref.keys() == got.keys()
    for key in ref:
        if key.endswith(('running_mean', 'running_var')):
            # Every checkpoint first averages BatchNorm statistics over the ranks. The interrupted run
            # did so once more (at the signal): an average of linear EMA updates, equal up to float
            # rounding. Parameters do not depend on these statistics in training and must be equal.
            assert torch.allclose(ref[key], got[key], rtol=1e-5, atol=1e-6), (key, (ref[key] - got[key]).abs().max())
        else:
            assert torch.equal(ref[key], got[key]), key


def _stops(out):
    return re.findall(r'stopping at step (\d+) on (SIG\w+) \(arrived after step (\d+)\): checkpoint saved', out)


@pytest.mark.parametrize('name', [n for n in CASES if CASES[n].get('cancelled')])
def test_a_plain_scancel_checkpoints_and_cancels_the_job(runs, name):
    """`scancel JOB` is how a user ends a job: it was requeued (exit 75) and trained to the end; three
    scancels in a row gave three requeues. The ranks still checkpoint (nothing is lost), and the
    job ends CANCELLED, never started again."""
    run = runs[name]
    out = _output(run)
    stops = _stops(out)
    expected = (run['signal'],) if isinstance(run['signal'], str) else run['signal']
    assert len(stops) == 1 and stops[0][1] in expected, out[-4000:]
    tag = checkpoint.tag_for(int(stops[0][0]))
    assert os.path.isfile(os.path.join(run['work'], 'checkpoints', tag, checkpoint.COMPLETE)), out[-3000:]
    assert f"job {run['job']} was cancelled (scancel): the ranks checkpointed, and it is not requeued" in out, \
        out[-3000:]
    info = _job(run['job'])
    assert info.get('JobState') == 'CANCELLED' and int(info.get('Restarts', 0)) == 0, info
    assert 'resumed from' not in out and 'requeueing job' not in out, out[-3000:]


def _wait_for(job_id, states, timeout_s):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        info = _job(job_id)
        if info.get('JobState') in states:
            return info
        time.sleep(0.5)
    return _job(job_id)


def test_a_stop_in_one_task_of_an_array_requeues_that_task_alone(slurm_cluster, tmp_path):
    """`scontrol requeue $SLURM_JOB_ID` of an array's first-started task named the whole array: a
    finished sibling was started again and a running one interrupted."""
    ds_path = tmp_path / 'ds.json'
    ds_path.write_text(json.dumps(ds_config(1, micro_batch=2)))
    cache = str(tmp_path / 'cache')
    env = _env(PATH=f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', PYTHON=sys.executable,
               NPROC_PER_NODE='1', DS_CONFIG=str(ds_path), CONFIG=TINY_CONFIG, DS_SEG_FAULT='slow@step:0.3')
    env.pop('WORK_DIR', None)  # each task its own: work_dirs/<name>-<task's job id> under --chdir
    # Submitted from the checkout with --chdir elsewhere (the template's own cd to the submit dir
    # overrode it): --chdir holds no launch/train.py, so the template runs the installed ds-seg-train.
    options = ['--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}', 'train.max_steps=30',
               'train.eval_interval=0', 'train.checkpoint_interval=30', 'train.log_interval=1', 'data.num_workers=0']
    cmd = ['sbatch', '--parsable', '--partition=debug', '--gpus-per-node=0', f'--time={JOB_TIME_MIN}', '--array=0-1%1',
           '--job-name=arr', f'--output={tmp_path}/arr-%A_%a.out', '--nodes=1', '--ntasks-per-node=1',
           '--cpus-per-task=1', f'--chdir={tmp_path}', 'launch/slurm/train.sbatch', *options]
    array = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()
    first, second = f'{array}_0', f'{array}_1'
    assert _wait_for(first, {'COMPLETED'} | TERMINAL, 300).get('JobState') == 'COMPLETED'
    second_id = None
    deadline = time.time() + 300
    while time.time() < deadline:  # the second task started and trained a few steps
        info = _job(second)
        second_id = info.get('JobId')
        work = tmp_path / 'work_dirs' / f'arr-{second_id}'
        if info.get('JobState') == 'RUNNING' and _steps(str(work)) >= 5:
            break
        time.sleep(0.5)
    subprocess.run(['scancel', '--signal=USR1', '--full', second], check=True)
    info = _wait_for(second, {'COMPLETED'} | TERMINAL, 300)
    out = open(f'{tmp_path}/arr-{array}_1.out').read()
    assert info.get('JobState') == 'COMPLETED' and int(info.get('Restarts', 0)) == 1, (info, out[-3000:])
    assert f'requeueing job {second}' in out, out[-3000:]
    assert int(_job(first).get('Restarts', 0)) == 0  # the finished task was not started again


def test_a_rank_that_fails_at_its_start_ends_the_job(slurm_cluster, tmp_path):
    """One rank failing at its start (a port in use, a bad node) left the other in the rendezvous
    until the time limit. The template ends it 30 s after the failure: the job fails in a minute,
    with the failing rank's status."""
    ds_path = tmp_path / 'ds.json'
    ds_path.write_text(json.dumps(ds_config(2, micro_batch=2)))
    python = tmp_path / 'python'
    python.write_text(f'#!/bin/sh\n[ "$RANK" = 1 ] && {{ echo "rank 1: this node is broken" >&2; exit 3; }}\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = _env(PATH=f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', PYTHON=str(python),
               NPROC_PER_NODE='2', WORK_DIR=str(tmp_path / 'work'), DS_CONFIG=str(ds_path), CONFIG=TINY_CONFIG)
    cmd = ['sbatch', '--parsable', '--partition=debug', '--gpus-per-node=0', f'--time={JOB_TIME_MIN}', '--job-name=rankfail',
           f'--output={tmp_path}/rankfail.out', *SINGLE[1:], 'launch/slurm/train.sbatch',
           '--cfg-options', 'train.max_steps=5']
    job = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()
    info = _wait_for(job, TERMINAL | {'COMPLETED'}, 150)
    out = open(tmp_path / 'rankfail.out').read()
    assert info.get('JobState') == 'FAILED' and info.get('ExitCode') == '3:0', (info, out[-3000:])
    assert 'rank 1: this node is broken' in out and 'a rank failed (exit 3) 30 s ago: ending rank process' in out



def _wait_for_steps(job, work, steps, out, timeout_s=300):
    """Until the running job has done this many steps; a job that ended first fails the test."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = _job(job).get('JobState')
        if state == 'RUNNING' and _steps(str(work)) >= steps:
            return
        assert state not in TERMINAL | {'COMPLETED'}, (state, open(out).read()[-3000:] if os.path.exists(out) else '')
        time.sleep(0.5)
    pytest.fail(f'job {job} did not reach step {steps} in {timeout_s} s')


def _submit_small(tmp_path, template, name, max_steps, *sbatch_options, work_dir=None):
    """One rank of the tiny config under ``template``, paced (0.3 s a step) so that the driver's
    signal comes mid-run; returns (job id, work dir, output file). ``work_dir``: WORK_DIR as given
    (patterns unexpanded), else tmp_path/work."""
    ds_path = tmp_path / 'ds.json'
    ds_path.write_text(json.dumps(ds_config(2, micro_batch=2)))
    work = tmp_path / 'work'
    env = _env(PATH=f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}', PYTHON=sys.executable,
               NPROC_PER_NODE='1', WORK_DIR=str(work_dir or work), DS_CONFIG=str(ds_path), CONFIG=TINY_CONFIG,
               DS_SEG_FAULT='slow@step:0.3')
    cache = str(tmp_path / 'cache')
    script, *shape = template
    out = tmp_path / f'{name}.out'
    cmd = ['sbatch', '--parsable', '--partition=debug', '--gpus-per-node=0', f'--time={JOB_TIME_MIN}', *sbatch_options,
           f'--job-name={name}', f'--output={out}', *shape, script,
           '--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}', f'train.max_steps={max_steps}',
           'train.eval_interval=0', f'train.checkpoint_interval={max_steps}', 'train.log_interval=1',
           'data.num_workers=0']
    job = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True).stdout.strip()
    return job, work, out


@pytest.mark.parametrize('template', [SINGLE, MULTI], ids=['one_node', 'multi_node'])
def test_a_stop_that_slurm_will_not_requeue_fails_the_job_and_says_how_to_continue(slurm_cluster, tmp_path, template):
    """A job submitted with --no-requeue (or on a cluster with JobRequeue=0) cannot be requeued:
    the template said "(already being requeued)" and exited 0, so a run stopped at step 8 of 30
    ended COMPLETED. It must fail with the stop's status 75 and say how to continue it."""
    job, work, out_path = _submit_small(tmp_path, template, 'noreq', 30, '--no-requeue')
    _wait_for_steps(job, work, 5, out_path)
    subprocess.run(['scancel', '--signal=USR1', '--full', job], check=True)
    info = _wait_for(job, TERMINAL | {'COMPLETED'}, 150)
    out = out_path.read_text()
    assert info.get('JobState') == 'FAILED' and info.get('ExitCode') == '75:0', (info, out[-3000:])
    stops = _stops(out)
    assert len(stops) == 1, out[-3000:]
    assert os.path.isfile(work / 'checkpoints' / checkpoint.tag_for(int(stops[0][0])) / checkpoint.COMPLETE)
    assert f'job {job} cannot be requeued' in out and f'submit it again with WORK_DIR={work}' in out, out[-3000:]
    assert 'already being requeued' not in out, out[-3000:]


@pytest.mark.parametrize('template', [SINGLE, MULTI], ids=['one_node', 'multi_node'])
def test_other_signals_to_the_batch_shell_are_said_and_ignored(slurm_cluster, tmp_path, template):
    """bash's default action for SIGHUP/SIGUSR2 ended the batch shell, and Slurm then killed the
    ranks mid-step: the job FAILED with nothing saved since the last checkpoint."""
    job, work, out_path = _submit_small(tmp_path, template, 'othersig', 16)
    _wait_for_steps(job, work, 3, out_path)
    for name in ('HUP', 'USR2'):
        subprocess.run(['scancel', f'--signal={name}', '--batch', job], check=True)
        time.sleep(1)
    info = _wait_for(job, TERMINAL | {'COMPLETED'}, 150)
    out = out_path.read_text()
    assert info.get('JobState') == 'COMPLETED' and int(info.get('Restarts', 0)) == 0, (info, out[-3000:])
    for name in ('HUP', 'USR2'):
        assert f'[sbatch] received {name}: ignored' in out, out[-3000:]
    assert json.load(open(work / 'summary.json'))['steps'] == 16 and not _stops(out), out[-3000:]


def _wait_for_line(path, text, timeout_s=120):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if os.path.exists(path) and text in open(path).read():
            return
        time.sleep(0.1)
    pytest.fail(f'{text!r} not in {path} after {timeout_s} s')


@pytest.mark.parametrize('template', [SINGLE, MULTI], ids=['one_node', 'multi_node'])
def test_a_warning_that_comes_at_once_is_not_requeued_for_ever(slurm_cluster, tmp_path, template):
    """With --time=3 the template's --signal=B:USR1@300 warning comes at Slurm's first limit check,
    0 to 30 s into every start: each requeued start trained a step, checkpointed and was requeued
    again, for ever. The job must end FAILED (75) with the checkpoint and say what to change.
    (Slurm drops a signal that comes before the batch shell is up, so the driver sends the
    warning's USR1 to the batch shell itself, as Slurm's B: warning does, once the shell is up.)"""
    job, work, out_path = _submit_small(tmp_path, template, 'warnnow', 30, '--time=3')
    _wait_for_line(out_path, f'[sbatch] job {job}')
    subprocess.run(['scancel', '--signal=USR1', '--batch', job], check=True)
    info = _wait_for(job, TERMINAL | {'COMPLETED'}, 180)
    out = out_path.read_text()
    assert info.get('JobState') == 'FAILED' and info.get('ExitCode') == '75:0', (info, out[-3000:])
    assert int(info.get('Restarts', 0)) == 0 and 'requeueing' not in out, out[-3000:]
    stops = _stops(out)
    assert len(stops) == 1, out[-3000:]
    assert os.path.isfile(work / 'checkpoints' / checkpoint.tag_for(int(stops[0][0])) / checkpoint.COMPLETE)
    assert re.search(rf'the time-limit warning \(USR1\) came \d+ s into this start of job {job}, whose time limit '
                     rf'is 00:03:00: with a lead \(--signal=B:USR1@300\)', out), out[-3000:]
    assert f'and WORK_DIR={work}' in out, out[-3000:]


def test_work_dir_patterns_give_each_array_task_its_own(slurm_cluster, tmp_path):
    """WORK_DIR=work_dirs/sweep-%a was taken literally: every task of the array trained in (and
    resumed from) one directory named sweep-%a. Slurm's --output patterns are expanded."""
    job, _, out_path = _submit_small(tmp_path, SINGLE, 'sweep', 4, '--array=3,5',
                                     work_dir=tmp_path / 'w' / '%x-%A-task%2a')
    for task in (3, 5):
        info = _wait_for(f'{job}_{task}', TERMINAL | {'COMPLETED'}, 300)
        out = out_path.read_text()  # both tasks append to it
        assert info.get('JobState') == 'COMPLETED', (info, out[-3000:])
        work = tmp_path / 'w' / f'sweep-{job}-task{task:02d}'
        assert json.load(open(work / 'summary.json'))['steps'] == 4, out[-3000:]
    assert sorted(os.listdir(tmp_path / 'w')) == [f'sweep-{job}-task03', f'sweep-{job}-task05']


def test_a_work_dir_pattern_it_does_not_know_stops_the_job_before_training(slurm_cluster, tmp_path):
    job, _, out_path = _submit_small(tmp_path, SINGLE, 'badpat', 4, work_dir=tmp_path / 'w' / 'run-%N')
    info = _wait_for(job, TERMINAL | {'COMPLETED'}, 120)
    out = out_path.read_text()
    assert info.get('JobState') == 'FAILED' and info.get('ExitCode') == '2:0', (info, out[-3000:])
    assert f"[sbatch] WORK_DIR={tmp_path / 'w' / 'run-%N'}: %N is not a pattern this script expands" in out, out
    assert not (tmp_path / 'w').exists()
