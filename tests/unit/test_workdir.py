"""The work-dir lock's stale rule: taken over only when the owner is provably gone, never while
it may live (the real two-process test is in tests/distributed/test_reliability.py)."""
import json
import os
import subprocess
import time

import pytest

from ds_seg.engine.workdir import LOCK_NAME, WorkDirBusy, WorkDirLock, _process_start, describe, identity, owner_gone


def _me(**over):
    return dict(identity(), **over)


def test_same_host_owner_is_gone_only_when_its_process_is():
    sleeper = subprocess.Popen(['sleep', '60'])
    try:
        alive = _me(pid=sleeper.pid, pid_start=_process_start(sleeper.pid))
        assert not owner_gone(alive)
        assert owner_gone(dict(alive, pid_start=alive['pid_start'] + 1)), 'the PID now runs another process'
    finally:
        sleeper.kill()
        sleeper.wait()
    assert owner_gone(alive), 'the process has exited'


def test_requeued_job_takes_over_its_earlier_incarnation_on_any_host():
    me = _me(host='n2', slurm_job_id='123', slurm_restart_count='1')
    earlier = dict(me, host='n1', pid=1, slurm_restart_count='0')
    assert owner_gone(earlier, me)
    assert not owner_gone(dict(earlier, slurm_restart_count='1'), me), 'the same incarnation may still live'


def test_an_owner_of_another_cluster_is_never_taken_over_by_its_job_id(tmp_path, monkeypatch):
    """Two clusters sharing /home: cluster B's job asked its own squeue about cluster A's live
    job 20 ("Invalid job id": gone) and took the lock over, and both trained into one work dir.
    A job id says something only within its cluster."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'squeue').write_text('#!/bin/sh\necho "slurm_load_jobs error: Invalid job id specified" >&2\nexit 1\n')
    (bin_dir / 'squeue').chmod(0o755)
    monkeypatch.setenv('PATH', f"{bin_dir}:{os.environ['PATH']}")
    me = _me(host='nodeB', slurm_job_id='7000', slurm_cluster='b')
    assert owner_gone(dict(me, host='vm', pid=1, slurm_job_id='20', slurm_cluster='b'), me), 'this cluster: gone'
    assert not owner_gone(dict(me, host='vm', pid=1, slurm_job_id='20', slurm_cluster='a'), me)
    # The same id on two clusters is two jobs, not two starts of one.
    assert not owner_gone(dict(me, host='vm', pid=1, slurm_restart_count='1', slurm_cluster='a'), me)
    assert owner_gone(dict(me, host='vm', pid=1, slurm_restart_count='1'), dict(me, slurm_restart_count='2'))
    assert 'Slurm job 20 of cluster a' in describe(dict(me, slurm_job_id='20', slurm_cluster='a'))


def test_other_hosts_without_proof_are_never_taken_over(monkeypatch):
    me = _me(host='n2', slurm_job_id=None)
    assert not owner_gone(dict(me, host='n1', pid=1), me), 'no job id: nothing proves the owner gone'
    monkeypatch.setenv('PATH', '/nonexistent')  # squeue cannot be asked
    assert not owner_gone(dict(me, host='n1', pid=1, slurm_job_id='77'), me)


def test_a_busy_lock_names_its_owner_and_a_stale_one_is_taken_over(tmp_path):
    sleeper = subprocess.Popen(['sleep', '60'])
    try:
        with open(tmp_path / LOCK_NAME, 'w') as f:
            json.dump(_me(pid=sleeper.pid, pid_start=_process_start(sleeper.pid)), f)
        with pytest.raises(WorkDirBusy, match=f'pid {sleeper.pid}'):
            WorkDirLock(str(tmp_path)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    lock = WorkDirLock(str(tmp_path))
    assert f'pid {sleeper.pid}' in lock.acquire()
    assert json.load(open(tmp_path / LOCK_NAME))['pid'] == os.getpid()
    lock.release()
    assert not os.path.exists(tmp_path / LOCK_NAME)


def test_resuming_another_runs_checkpoint_sets_aside_every_checkpoint_of_this_work_dir(tmp_path):
    from ds_seg.engine.checkpoint import set_aside_other_branch
    work, other = tmp_path / 'work', tmp_path / 'other'
    for root, tags in ((work / 'checkpoints', ('step_00000002', 'step_00000004', '.tmp-step_00000006')),
                       (other / 'checkpoints', ('step_00000003',))):
        for tag in tags:
            (root / tag).mkdir(parents=True)
            (root / tag / 'f.pt').write_bytes(tag.encode())
    (work / 'checkpoints' / 'latest').write_text('step_00000004')
    aside = set_aside_other_branch(str(work), str(other / 'checkpoints'), 'step_00000003')
    assert sorted(os.listdir(os.path.join(aside, 'checkpoints'))) == \
        ['.tmp-step_00000006', 'latest', 'step_00000002', 'step_00000004']
    assert os.listdir(work / 'checkpoints') == []
    # Within one work dir only the later branch moves, and latest follows the resumed tag.
    for tag in ('step_00000002', 'step_00000004'):
        (work / 'checkpoints' / tag).mkdir()
    aside = set_aside_other_branch(str(work), str(work / 'checkpoints'), 'step_00000002')
    assert os.listdir(os.path.join(aside, 'checkpoints')) == ['step_00000004']
    assert (work / 'checkpoints' / 'latest').read_text() == 'step_00000002'


def test_two_rollbacks_to_one_tag_keep_both_abandoned_branches(tmp_path):
    from ds_seg.engine.checkpoint import set_aside_other_branch
    root = tmp_path / 'checkpoints'
    asides = []
    for _ in range(2):
        for tag in ('step_00000002', 'step_00000004'):
            (root / tag).mkdir(parents=True, exist_ok=True)
        asides.append(set_aside_other_branch(str(tmp_path), str(root), 'step_00000002'))
    assert asides[0] != asides[1]
    assert all(os.listdir(os.path.join(a, 'checkpoints')) == ['step_00000004'] for a in asides)


def test_a_resume_keeps_the_configs_it_replaces_by_different_ones(tmp_path, capsys):
    """config.json was rewritten on every resume: after one with a longer max_steps or other
    data, nothing said what the steps before it had run with."""
    from ds_seg.telemetry import RunLog
    work = str(tmp_path)
    before = {'config.json': {'train': {'max_steps': 10}}, 'ds_config.json': {'zero_optimization': {'stage': 2}}}
    for name, obj in before.items():
        with open(os.path.join(work, name), 'w') as f:
            json.dump(obj, f)
    log = RunLog(work, enabled=True)
    log.keep_replaced(before)                                  # a requeue: the same configs
    assert not os.path.exists(os.path.join(work, 'previous'))
    after = dict(before, **{'config.json': {'train': {'max_steps': 20}}})
    log.keep_replaced(after)
    kept = os.listdir(os.path.join(work, 'previous'))
    assert len(kept) == 1 and os.listdir(os.path.join(work, 'previous', kept[0])) == ['config.json']
    with open(os.path.join(work, 'previous', kept[0], 'config.json')) as f:
        assert json.load(f) == before['config.json']
    # It names the settings: another data.crop_size was said only as "differs".
    assert "config.json of the run before this resume differs from this run's (train.max_steps); kept in" \
        in capsys.readouterr().out
    # A second change within the same second gets a folder of its own.
    with open(os.path.join(work, 'config.json'), 'w') as f:
        json.dump(after['config.json'], f)
    log.keep_replaced(before)
    assert len(os.listdir(os.path.join(work, 'previous'))) == 2


def _contend(work, start, results, all_decided):
    lock = WorkDirLock(work)
    while time.time() < start:  # all at once
        pass
    try:
        lock.acquire()
        results.put('held')
        # Alive, holding, until every contender has decided: a holder that exited sooner left a
        # dead run's lock, which a contender slow to start (a loaded machine) rightly took over.
        all_decided.wait(60)
    except WorkDirBusy:
        results.put('busy')


def test_contenders_for_a_dead_runs_lock_leave_exactly_one_holder(tmp_path):
    """Two processes that both read the dead owner each removed what was there, the second the
    first's new, live lock: 5 trials of 20 had two runs in one work dir."""
    import multiprocessing
    ctx = multiprocessing.get_context('fork')
    for trial in range(8):
        work = tmp_path / f'w{trial}'
        work.mkdir()
        (work / LOCK_NAME).write_text(json.dumps(_me(pid=999999, pid_start=1)))  # a dead run's
        results, start, all_decided = ctx.Queue(), time.time() + 0.3, ctx.Event()
        procs = [ctx.Process(target=_contend, args=(str(work), start, results, all_decided)) for _ in range(6)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
        all_decided.set()
        for p in procs:
            p.join(30)
        assert outcomes == ['busy'] * 5 + ['held'], (trial, outcomes)
        assert sorted(os.listdir(work)) == [LOCK_NAME]  # no take-over mutex or stale file left


def test_summary_json_is_strict_json_when_the_loss_overflowed(tmp_path):
    """An overflowing learning rate wrote "loss": NaN into summary.json, which jq, JavaScript and
    most JSON parsers refuse; non-finite numbers are null there."""
    from ds_seg.telemetry import RunLog

    def refuse(constant):
        raise ValueError(f'not JSON: {constant}')

    log = RunLog(str(tmp_path), enabled=True)
    log.write_json('summary.json', {'loss': float('nan'), 'history': [1.5, float('inf')], 'mIoU': 0.25,
                                    'nested': {'grad_norm': float('-inf')}})
    with open(tmp_path / 'summary.json') as f:
        got = json.loads(f.read(), parse_constant=refuse)
    assert got == {'loss': None, 'history': [1.5, None], 'mIoU': 0.25, 'nested': {'grad_norm': None}}


@pytest.mark.parametrize('argv, message', [
    (['--work-dir', ''], '--work-dir is empty; give a path'),    # trained into work_dirs/<config name>
    (['--resume', ' '], '--resume is empty; give a path'),       # started a fresh run
])
def test_an_empty_path_option_is_refused_not_taken_as_its_default(tmp_path, capsys, argv, message):
    from ds_seg.cli import train
    assert train.main(argv + ['--cfg-options', 'train.max_steps=1']) == 2
    err = capsys.readouterr().err
    assert err.strip() == f'ds_seg: error: {message}, or leave {argv[0]} out for its default', err


def test_export_refuses_an_empty_out(tmp_path, capsys):
    """--out '' wrote the default weights file beside the checkpoints."""
    from ds_seg.cli import export
    with pytest.raises(SystemExit) as exited:
        export.main([str(tmp_path), '--out', ''])
    assert exited.value.code == 2 and '--out is empty' in capsys.readouterr().err and not os.listdir(tmp_path)


def test_a_fresh_run_says_where_the_earlier_runs_logs_went(tmp_path, capsys):
    """Reusing a work dir whose run never checkpointed moved its logs to previous/<time>/ without a
    word (a resume's move said so): the user found them gone."""
    from ds_seg.telemetry import RunLog
    (tmp_path / 'metrics.jsonl').write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / 'config.json').write_text('{}')
    RunLog(str(tmp_path), enabled=True).start(resumed_step=None)
    kept = os.listdir(tmp_path / 'previous')
    assert len(kept) == 1 and sorted(os.listdir(tmp_path / 'previous' / kept[0])) == ['config.json', 'metrics.jsonl']
    assert (f"[ds_seg] the logs of an earlier run in {tmp_path} (metrics.jsonl, config.json) moved to "
            f"{tmp_path / 'previous' / kept[0]}/") in capsys.readouterr().out


def test_a_resume_purges_the_tensorboard_points_of_the_steps_it_redoes(tmp_path):
    """metrics.jsonl kept one row per step after a kill and --resume, but TensorBoard showed the
    steps after the checkpoint twice (the killed run's and the redone ones)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ds_seg.telemetry import RunLog
    killed = RunLog(str(tmp_path), enabled=True)
    killed.start(resumed_step=None)
    for step in range(1, 9):
        killed._scalars({'train/loss': 10.0 - step}, step)
    killed.tb.close()
    resumed = RunLog(str(tmp_path), enabled=True)
    resumed.start(resumed_step=4)
    for step in range(5, 9):
        resumed._scalars({'train/loss': 100.0 + step}, step)
    resumed.tb.close()
    events = EventAccumulator(str(tmp_path / 'tb'))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars('train/loss')]
    assert points == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]


@pytest.mark.parametrize('program', ['predict', 'evaluate'])
def test_an_empty_output_folder_is_refused_before_the_model_is_loaded(tmp_path, capsys, program):
    """The same class of mistake as an empty --work-dir: predict --output '' failed after loading
    the model with "[Errno 2] No such file or directory: ''"."""
    from ds_seg.cli import evaluate, predict
    weights = tmp_path / 'w.pt'  # never unpickled: the output is checked before the model is loaded
    weights.write_bytes(b'not read')
    import numpy as np
    import rasterio
    scene = str(tmp_path / 'scene.tif')
    with rasterio.open(scene, 'w', driver='GTiff', width=8, height=8, count=1, dtype='uint8') as dst:
        dst.write(np.zeros((1, 8, 8), np.uint8))
    argv = ['--checkpoint', str(weights), '--output', '']
    if program == 'predict':
        code = predict.main(argv + ['--input', scene])
    else:
        code = evaluate.main(argv + ['--images', scene, '--labels', scene])
    err = capsys.readouterr().err
    assert code == 2 and '--output is empty; give a folder for the outputs.' in err, err


@pytest.mark.parametrize('layout, message', [
    ('dangling', 'checkpoints is a symbolic link to'),
    ('file', 'checkpoints is a file, not the folder checkpoints are written into'),
    ('latest_folder', 'latest is a folder, where the name of the newest checkpoint is written'),
    ('best_folder', 'best is a folder, where the name of the best checkpoint is written'),
    ('previous_file', 'previous is a file, where the logs of earlier runs are moved to'),
    ('lock_folder', '.ds_seg.lock is a folder, where ds_seg keeps the lock file'),
    ('own_config', 'config.json is not one an earlier run wrote'),
    ('own_ds_config', 'ds_config.json is not one an earlier run wrote'),
])
@pytest.mark.parametrize('resume', [[], ['--resume', 'auto']])
def test_a_checkpoints_folder_the_first_save_cannot_use_is_refused_before_any_step(tmp_path, capsys, layout,
                                                                                   message, resume):
    """A dangling checkpoints link (scratch purged), a checkpoints file, a latest folder: the run
    trained checkpoint_interval steps, then stopped with exit 74 ('File exists'; 'free space or fix
    the disk'), and a requeued --resume auto job did the same every time."""
    from ds_seg.cli import train
    work = tmp_path / 'run'
    work.mkdir()
    if layout == 'dangling':
        os.symlink(tmp_path / 'purged' / 'ck', work / 'checkpoints')
    elif layout == 'file':
        (work / 'checkpoints').write_text('mine')
    elif layout == 'previous_file':
        (work / 'previous').write_text('mine')
        (work / 'config.json').write_text('{}')   # an earlier run's log, to be moved into previous/
        (work / 'ds_config.json').write_text('{"ds_seg": {"backend": "deepspeed"}}')
    elif layout == 'own_config':  # the user's own config, which a fresh run moved into previous/
        (work / 'config.json').write_text('{"model": {"type": "UNetTiny"}}')
    elif layout == 'own_ds_config':  # a DeepSpeed JSON, not one a run wrote (no "ds_seg")
        (work / 'ds_config.json').write_text('{"train_micro_batch_size_per_gpu": 2}')
    elif layout == 'lock_folder':
        (work / LOCK_NAME).mkdir()
    else:
        (work / 'checkpoints' / layout.split('_')[0]).mkdir(parents=True)
    before = sorted(os.listdir(work))
    assert train.main(['--config', 'unet_tiny_synthetic', '--work-dir', str(work), *resume, '--cfg-options',
                       'train.max_steps=2', f'data.train.cache_dir={str(tmp_path)!r}',
                       f'data.val.cache_dir={str(tmp_path)!r}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert sorted(os.listdir(work)) == before


def test_a_tilde_in_a_path_option_is_the_home_folder(tmp_path, capsys, monkeypatch):
    """--work-dir=~/run (no shell expands a ~ after '=' or inside quotes) wrote into a folder
    named '~' in the current directory; --resume ~/... was 'does not exist'."""
    from ds_seg.cli import export, train
    home, elsewhere = tmp_path / 'home', tmp_path / 'cwd'
    (home / 'run').mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.setenv('HOME', str(home))
    monkeypatch.chdir(elsewhere)
    (home / 'run' / 'checkpoints').write_text('mine')   # a refusal that names the folder it looked at
    assert train.main(['--config', 'unet_tiny_synthetic', '--work-dir=~/run', '--cfg-options', 'train.max_steps=1',
                       f'data.train.cache_dir={str(tmp_path)!r}', f'data.val.cache_dir={str(tmp_path)!r}']) == 2
    assert f"{home / 'run' / 'checkpoints'} is a file" in capsys.readouterr().err
    assert export.main(['~/run', '--out', '~/weights.pt']) == 2
    assert str(home / 'run') in capsys.readouterr().err
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize('content', ['[1, 2]', '42', '"x"', '', 'not json'])
def test_a_lock_file_without_an_owner_record_is_taken_over_once_it_is_old(tmp_path, content, monkeypatch):
    """JSON that is not an object was an AttributeError traceback; and an unreadable file was taken
    over after 0.2 s, where on a network file system another node may still be writing it. The
    wait is timed on this node (an old mtime may be another clock's), from when it was seen so."""
    monkeypatch.setattr(WorkDirLock, 'UNREADABLE_GRACE_S', 1.0)
    path = tmp_path / LOCK_NAME
    path.write_text(content)
    started = time.time()
    lock = WorkDirLock(str(tmp_path))
    assert lock.acquire() == 'an unreadable lock'
    assert time.time() - started >= 0.8          # waited for it to age: not a writer's half-written file
    assert json.loads(path.read_text())['pid'] == os.getpid()


def test_a_pointer_of_any_bytes_and_a_marker_of_the_wrong_shape_are_named_not_tracebacks(tmp_path):
    """A `latest` of non-UTF-8 bytes was a UnicodeDecodeError (a traceback from --resume, a line
    that named no file from export/predict); a COMPLETE marker whose 'files' is a list was an
    AttributeError from verify (export and --resume auto)."""
    from ds_seg.engine import checkpoint
    root = tmp_path / 'checkpoints'
    (root / 'step_00000004').mkdir(parents=True)
    (root / 'step_00000004' / checkpoint.COMPLETE).write_text(json.dumps({'step': 4, 'files': ['a.pt']}))
    (root / 'latest').write_bytes(b'garbage\x00\xff')
    assert checkpoint.read_pointer(str(root), 'latest') is None
    with pytest.raises(FileNotFoundError, match=r'latest: does not name a step_\* checkpoint'):
        checkpoint.find_checkpoint(str(root / 'latest'))
    assert checkpoint.verify(str(root), 'step_00000004').startswith(f'unreadable {checkpoint.COMPLETE} marker')
    (root / 'latest').write_text('step_00000004')
    with pytest.raises(FileNotFoundError, match=r'not a usable checkpoint: unreadable COMPLETE marker'):
        checkpoint.find_checkpoint(str(root / 'latest'))


def test_a_marker_edited_to_drop_a_state_file_does_not_pass(tmp_path):
    """A COMPLETE marker with a damaged file's entry removed (or 'files': {}) passed verify and
    is_complete: --resume auto took the checkpoint and died in DeepSpeed's loader with a
    traceback, where the step before was good. The marker lists every file a save writes."""
    import hashlib

    from ds_seg.engine import checkpoint
    tag = tmp_path / 'step_00000006'
    tag.mkdir()
    for name, data in (('mp_rank_00_model_states.pt', b'model'), ('zero_pp_rank_0_mp_rank_00_optim_states.pt', b'x' * 9)):
        (tag / name).write_bytes(data)
    names = sorted(p.name for p in tag.iterdir())
    marker = {'step': 6, 'files': {n: (tag / n).stat().st_size for n in names},
              'sha256': {n: hashlib.sha256((tag / n).read_bytes()).hexdigest() for n in names}}
    (tag / checkpoint.COMPLETE).write_text(json.dumps(marker))
    (tag / 'notes.txt').write_text('a file of the user, not state')
    (tag / 'model.pt').write_bytes(b'weights a user exported into it')
    assert checkpoint.verify(str(tmp_path), tag.name) is None and checkpoint.is_complete(str(tmp_path), tag.name)
    for dropped in ({'zero_pp_rank_0_mp_rank_00_optim_states.pt'}, set(names)):
        edited = {key: {n: v for n, v in marker[key].items() if n not in dropped} for key in ('files', 'sha256')}
        (tag / checkpoint.COMPLETE).write_text(json.dumps(dict(marker, **edited)))
        assert 'is not in its COMPLETE marker' in checkpoint.verify(str(tmp_path), tag.name)
        assert not checkpoint.is_complete(str(tmp_path), tag.name)
    # The entry dropped and the file deleted too: the marker's own record (a ZeRO-2 save of one
    # rank) says what the save wrote. Passed, the resume ended "[Errno 2] No such file ...".
    marker.update(world_size=1, backend='deepspeed', zero_stage=2)
    (tag / checkpoint.COMPLETE).write_text(json.dumps(marker))
    assert checkpoint.verify(str(tmp_path), tag.name) is None and checkpoint.is_complete(str(tmp_path), tag.name)
    optim = 'zero_pp_rank_0_mp_rank_00_optim_states.pt'
    (tag / optim).unlink()
    edited = {key: {n: v for n, v in marker[key].items() if n != optim} for key in ('files', 'sha256')}
    (tag / checkpoint.COMPLETE).write_text(json.dumps(dict(marker, **edited)))
    assert checkpoint.verify(str(tmp_path), tag.name) == ('its marker lists 0 optimizer-states file(s), and a save '
                                                          'of 1 rank(s) writes 1 (an edited marker?)')
    assert not checkpoint.is_complete(str(tmp_path), tag.name)
    for record, expected in ((dict(zero_stage=3, world_size=2), 'lists 1 model-states file(s), and a ZeRO-3 save of 2 '
                              'rank(s) writes 2'), (dict(backend='ddp'), 'its marker lists no ddp_state.pt')):
        (tag / checkpoint.COMPLETE).write_text(json.dumps(dict(marker, **record)))
        assert expected in checkpoint.verify(str(tmp_path), tag.name)


def test_only_a_ds_seg_runs_checkpoints_folder_holds_a_work_dir(tmp_path):
    """A work dir inside another run's checkpoints/ is refused; a user's own folder named
    checkpoints under a project with some tool's config.json is not another run's."""
    from ds_seg.inputs import run_whose_checkpoints_hold as _run_whose_checkpoints_hold
    project = tmp_path / 'proj'
    (project / 'checkpoints' / 'exp1').mkdir(parents=True)
    (project / 'config.json').write_text('{}')
    assert _run_whose_checkpoints_hold(str(project / 'checkpoints' / 'exp1')) is None
    (project / 'ds_config.json').write_text('{}')
    assert _run_whose_checkpoints_hold(str(project / 'checkpoints' / 'exp1')) == str(project)
    assert _run_whose_checkpoints_hold(str(project / 'checkpoints')) == str(project)
    assert _run_whose_checkpoints_hold(str(project)) is None


def test_a_step_folder_whose_marker_is_of_another_step_does_not_pass(tmp_path):
    """step_00000002 and step_00000004 swapped by hand resumed "from step_00000004 at step 2", and
    the save at step 4 then replaced the folder holding the only step-2 checkpoint. A link named
    for one step to another run's checkpoint of another step passed the same way."""
    import hashlib

    from ds_seg.engine import checkpoint
    root = tmp_path / 'checkpoints'
    for step in (2, 4, 6):
        tag = root / checkpoint.tag_for(step)
        tag.mkdir(parents=True)
        (tag / 'ddp_state.pt').write_bytes(b'state of step %d' % step)
        names = ['ddp_state.pt']
        (tag / checkpoint.COMPLETE).write_text(json.dumps({
            'step': step, 'world_size': 1, 'backend': 'ddp', 'files': {n: (tag / n).stat().st_size for n in names},
            'sha256': {n: hashlib.sha256((tag / n).read_bytes()).hexdigest() for n in names}}))
    assert checkpoint.newest_verified(str(root)) == ('step_00000006', [])
    os.rename(root / 'step_00000004', root / 'swap')
    os.rename(root / 'step_00000006', root / 'step_00000004')
    os.rename(root / 'swap', root / 'step_00000006')
    reason = 'its COMPLETE marker is of step {} (a folder renamed, swapped or linked by hand?)'
    assert checkpoint.newest_verified(str(root)) == ('step_00000002', [('step_00000006', reason.format(4)),
                                                                       ('step_00000004', reason.format(6))])
    assert checkpoint.complete_tags(str(root)) == ['step_00000002']
    # `latest` names a folder deleted by hand: said, where the run went back to an older one unsaid.
    gone = "named by 'latest', but its folder is not there (deleted or moved?)"
    checkpoint.write_pointer(str(root), 'latest', 'step_00000008')
    assert checkpoint.newest_verified(str(root)) == ('step_00000002', [('step_00000008', gone),
                                                                       ('step_00000006', reason.format(4)),
                                                                       ('step_00000004', reason.format(6))])
    checkpoint.write_pointer(str(root), 'latest', 'step_00000005')
    assert checkpoint.newest_verified(str(root))[1][1] == ('step_00000005', gone)
    checkpoint.write_pointer(str(root), 'latest', 'step_00000002')
    assert checkpoint.newest_verified(str(root))[1] == [('step_00000006', reason.format(4)),
                                                        ('step_00000004', reason.format(6))]


def test_a_work_dir_link_round_a_loop_is_said_as_a_loop(tmp_path):
    """`ln -s x x` was said to point at something 'purged, or not mounted here'."""
    from ds_seg.config import ConfigError
    from ds_seg.inputs import check_writable
    loop = tmp_path / 'x'
    os.symlink(loop, loop)
    with pytest.raises(ConfigError, match=r"--work-dir: .*x is a symbolic link that leads round a loop back to itself"):
        check_writable(str(loop), '--work-dir', create=True)
    dangling = tmp_path / 'y'
    os.symlink(tmp_path / 'purged', dangling)
    with pytest.raises(ConfigError, match=r"y is a symbolic link to .*purged, which does not exist \(purged, or not"):
        check_writable(str(dangling), '--work-dir', create=True)


def test_an_unwritable_folder_says_which_creation_failed(monkeypatch, tmp_path):
    """/proc was "not writable (No such file or directory)", the probe file's errno said as if the
    folder itself were missing; and the ONNX refusal of load_from named predict.py/evaluate.py to a
    user of the installed console scripts."""
    from ds_seg.config import ConfigError
    from ds_seg.engine import checkpoint
    from ds_seg.inputs import as_invoked, check_writable
    for folder, create, tried in (('/proc', False, 'creating a file in it failed'),
                                  ('/proc/x', False, 'creating a folder in /proc failed'),
                                  ('/proc/a/b', True, 'making it failed')):
        with pytest.raises(ConfigError) as refused:
            check_writable(folder, '--out', create=create)
        assert str(refused.value).startswith(f'--out: {folder} is not writable ({tried}: '), str(refused.value)
    onnx = tmp_path / 'model.onnx'
    onnx.write_bytes(b'\x08\x07\x12\x07pytorch' + bytes(64))
    with pytest.raises(ValueError) as refused:
        checkpoint.load_weights_file(str(onnx))
    monkeypatch.setattr('sys.argv', ['/venv/bin/ds-seg-train'])
    said = as_invoked(str(refused.value))
    assert '(ds-seg-export --format onnx)' in said and 'ds-seg-predict and ds-seg-evaluate run it' in said, said


def test_a_resume_at_another_seed_of_synthetic_scenes_is_refused(tmp_path, capsys):
    """train.seed generates SyntheticAerial's scenes: a resume at another seed trained and
    validated on other scenes (mIoU 0.11 -> 0.0003 at its next evaluation), said only as
    changed statistics."""
    from ds_seg.cli import train
    work = tmp_path / 'run'
    common = ['--config', 'unet_tiny_synthetic', '--work-dir', str(work), '--cfg-options', 'data.crop_size=32',
              'train.eval_interval=0', 'train.checkpoint_interval=2', f'data.train.cache_dir={str(tmp_path)!r}',
              f'data.val.cache_dir={str(tmp_path)!r}']
    assert train.main(common + ['train.max_steps=2']) == 0
    capsys.readouterr()
    before = sorted(os.listdir(work))
    assert train.main(common[:2] + ['--resume', 'auto'] + common[2:] + ['train.max_steps=4', 'train.seed=1']) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith('ds_seg: error:')]
    assert err == [f'ds_seg: error: --resume: {work}/checkpoints/step_00000002 was trained on the synthetic '
                   'scenes of train.seed=0, and train.seed=1 generates others (for training and validation); resume '
                   'with train.seed=0, or start a new run from its weights instead (launch/export.py, then '
                   'load_from=).'], err
    assert sorted(os.listdir(work)) == before
    assert train.main(common[:2] + ['--resume', 'auto'] + common[2:] + ['train.max_steps=4']) == 0


@pytest.mark.parametrize('folder, words', [('tb', 'which that run logs its TensorBoard events to and moves aside'),
                                           ('previous', 'which that run keeps earlier runs in')])
def test_a_work_dir_inside_another_runs_logs_is_refused(tmp_path, folder, words):
    """--work-dir base/tb/x trained into the base run's TensorBoard folder: TensorBoard showed it as
    the base run's, whose next fresh start moves tb/ (with this run's checkpoints) into previous/."""
    from ds_seg.config import ConfigError
    from ds_seg.engine.workdir import check_work_dir_entries
    base = tmp_path / 'base'
    (base / folder).mkdir(parents=True)
    (base / 'config.json').write_text('{}')
    (base / 'ds_config.json').write_text('{"ds_seg": {}}')
    inner = base / folder / 'run'
    with pytest.raises(ConfigError) as refused:
        check_work_dir_entries(str(inner))
    assert str(refused.value) == (f"--work-dir: {inner} is inside the {folder}/ folder of the run in {base}, {words}; "
                                  f"choose a folder outside {base / folder}.")
    check_work_dir_entries(str(base / 'elsewhere'))   # beside them: fine
    (base / 'ds_config.json').unlink()  # not a run's folder (a project's own tb/): fine
    (base / 'config.json').unlink()
    check_work_dir_entries(str(inner))
