"""log.trackers: one short run logs the same scalars, the config and the summary to MLflow's local
file store, read back with the MLflow client, and to a W&B offline run (no network), read back
from the run's own ``.wandb`` file; TensorBoard stays the default."""
import glob
import json
import os
import struct

import pytest

from tests.dist import run_on_ranks
from tests.tiny import ds_config, fit_and_close, read_jsonl, signal_at_step, tiny_cfg


def _train(tmp, uri):
    from ds_seg.engine.trainer import Trainer
    os.environ.update(WANDB_MODE='offline', WANDB_SILENT='true')  # W&B writes its run file, sends nothing
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4, eval_interval=4)
    cfg.merge_from_dict({'log': dict(trackers=['tensorboard', 'mlflow', 'wandb'], mlflow_tracking_uri=uri,
                                     experiment='tracker-test', wandb_project='tracker-test')})
    trainer = Trainer(cfg, ds_config(0, micro_batch=2), work_dir=os.path.join(tmp, 'run'))
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.fixture(scope='module')
def tracked_run(tmp_path_factory):
    """(tmp dir, MLflow URI, summary) of one 4-step, 2-rank run logged to all three trackers."""
    tmp = str(tmp_path_factory.mktemp('trackers'))
    uri = 'file://' + os.path.join(tmp, 'mlruns')
    summary = run_on_ranks(_train, 2, args=(tmp, uri), timeout=240)[0]
    return tmp, uri, summary


def test_mlflow_gets_the_scalars_config_and_summary(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient
    monkeypatch.setenv('MLFLOW_ALLOW_FILE_STORE', 'true')  # this process reads the file store back
    tmp, uri, summary = tracked_run
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name('tracker-test')
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, 'rank 0 only'
    run = runs[0]
    rows = read_jsonl(os.path.join(tmp, 'run', 'metrics.jsonl'))
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, 'train/loss')}
    assert history == pytest.approx({r['step']: r['loss'] for r in rows}) and len(history) == 4
    evals = read_jsonl(os.path.join(tmp, 'run', 'eval.jsonl'))
    assert client.get_metric_history(run.info.run_id, 'val/mIoU')[-1].value == pytest.approx(evals[-1]['mIoU'])
    assert run.data.params['train.max_steps'] == '4' and run.data.params['model.type'] == 'UNetTiny'
    artifacts = os.path.join(client.download_artifacts(run.info.run_id, ''), '')
    assert json.load(open(artifacts + 'summary.json'))['steps'] == summary['steps'] == 4
    assert json.load(open(artifacts + 'config.json'))['model']['type'] == 'UNetTiny'
    assert os.listdir(os.path.join(tmp, 'run', 'tb')), 'TensorBoard still written'


def wandb_records(path):
    """The ``Record`` protos of a W&B run file: a ':W&B' header, then LevelDB-log framing (32 KiB
    blocks; each chunk has a 7-byte header: crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4)."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, 'rb').read()
    assert data[:4] == b':W&B', f'{path}: not a W&B run file'
    block, pos, pending = 32768, 7, b''
    while pos + 7 <= len(data):
        room = block - pos % block
        _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
        if room < 7 or (kind == 0 and length == 0):  # the zero padding at a block's end
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b''
            yield record


def _key(item):  # W&B writes a key either flat or as a nested path
    return item.key or '/'.join(item.nested_key)


def test_wandb_offline_run_holds_the_same_scalars_config_and_summary(tracked_run):
    tmp, _, summary = tracked_run
    files = glob.glob(os.path.join(tmp, 'run', 'wandb', 'offline-run-*', 'run-*.wandb'))
    assert len(files) == 1, 'one W&B run, from rank 0 only'
    history, config, final = {}, {}, {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof('record_type')
        if kind == 'history':
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            history[row['_step']] = row
        elif kind == 'config':
            config.update({_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == 'summary':
            final.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    rows = read_jsonl(os.path.join(tmp, 'run', 'metrics.jsonl'))
    assert {step: row['train/loss'] for step, row in history.items()} == pytest.approx(
        {r['step']: r['loss'] for r in rows}) and len(history) == 4
    evals = read_jsonl(os.path.join(tmp, 'run', 'eval.jsonl'))
    assert history[4]['val/mIoU'] == pytest.approx(evals[-1]['mIoU'])
    assert config['train']['max_steps'] == 4 and config['model']['type'] == 'UNetTiny'
    assert final['steps'] == summary['steps'] == 4 and final['exit_reason'] == summary['exit_reason']


def _start_tracker_that_cannot_start(tmp, log):
    """A Trainer asked for a tracker that cannot start its run: the refusal each rank gets."""
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    for name in ('WANDB_MODE', 'WANDB_API_KEY'):  # a machine that never ran `wandb login`
        os.environ.pop(name, None)
    os.environ.update(HOME=os.path.join(tmp, 'home'), WANDB_CONFIG_DIR=os.path.join(tmp, 'home', 'wandb'))
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=2)
    cfg.merge_from_dict({'log': log})
    try:
        Trainer(cfg, ds_config(0, micro_batch=2), work_dir=os.path.join(tmp, 'run')).close()
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize('log, hint', [
    (dict(trackers=['tensorboard', 'wandb']), 'wandb login'),                       # no API key
    (dict(trackers=['mlflow'], mlflow_tracking_uri='file:///proc/ds_seg_mlruns'), 'writable file://'),
])
def test_a_tracker_that_cannot_start_stops_every_rank_with_one_line(tmp_path, log, hint):
    lines = run_on_ranks(_start_tracker_that_cannot_start, 2, args=(str(tmp_path), log), timeout=180)
    name = log['trackers'][-1]
    assert lines[0] == lines[1] and lines[0].startswith(f"log.trackers: '{name}' could not start a run (")
    assert hint in lines[0] and '\n' not in lines[0]


def _refused_with_mlflow(tmp, case):
    """A run refused while MLflow is asked for: ``wandb_fails`` (MLflow starts, then W&B cannot)
    or ``config_refused`` (model.num_classes against the data): the MLflow runs left behind."""
    from mlflow.tracking import MlflowClient
    uri = 'file://' + os.path.join(tmp, 'mlruns')
    if case == 'wandb_fails':
        log, options = dict(trackers=['mlflow', 'wandb'], mlflow_tracking_uri=uri), {}
    else:
        log, options = dict(trackers=['mlflow'], mlflow_tracking_uri=uri), {'model': {'num_classes': 3}}
    for name in ('WANDB_MODE', 'WANDB_API_KEY'):
        os.environ.pop(name, None)
    os.environ.update(HOME=os.path.join(tmp, 'home'), WANDB_CONFIG_DIR=os.path.join(tmp, 'home', 'wandb'))
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=2)
    cfg.merge_from_dict(dict(options, log=log))
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    try:
        Trainer(cfg, ds_config(0, micro_batch=2), work_dir=os.path.join(tmp, 'run')).close()
        refused = False
    except ConfigError:
        refused = True
    os.environ['MLFLOW_ALLOW_FILE_STORE'] = 'true'  # this process reads the file store back
    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return refused, [r.info.status for r in runs]


@pytest.mark.parametrize('case, statuses', [('wandb_fails', ['FAILED']), ('config_refused', [])])
def test_a_refused_run_leaves_no_tracker_run_open(tmp_path, case, statuses):
    refused, got = run_on_ranks(_refused_with_mlflow, 1, args=(str(tmp_path), case), timeout=180)[0]
    assert refused and got == statuses


def test_unknown_tracker_is_refused_naming_the_known_ones():
    from ds_seg.config import ConfigError
    from ds_seg.trackers import check_trackers
    with pytest.raises(ConfigError, match="log.trackers: \\['tensorbord'\\] unknown; known trackers: tensorboard"):
        check_trackers(dict(trackers=['tensorbord']))


def test_a_tracker_named_twice_or_a_server_nobody_runs_is_one_line_at_once():
    """log.trackers=['mlflow', 'mlflow'] failed as "Run ... is already active" after starting a run;
    an http tracking URI where no server listens took MLflow's 4 minutes of retries to say so."""
    import time

    from ds_seg.config import ConfigError
    from ds_seg.trackers import MLflowTracker, check_trackers
    with pytest.raises(ConfigError, match="^log.trackers names 'mlflow' twice; name each tracker once.$"):
        check_trackers(dict(trackers=['mlflow', 'tensorboard', 'mlflow']))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"^log.mlflow_tracking_uri http://127.0.0.1:9: no tracking server at "
                                          r"127.0.0.1:9 \(Connection refused\); start it"):
        MLflowTracker(dict(mlflow_tracking_uri='http://127.0.0.1:9'), '/nonexistent', 'x')
    assert time.monotonic() - t0 < 15


def _mlflow_store_lost_mid_run(tmp):
    """A 6-step run whose MLflow store is deleted after step 3 (a server restarted without its
    data, a store cleaned up): (summary, metrics.jsonl steps, what the run printed)."""
    import contextlib
    import io
    import shutil

    from ds_seg.engine.trainer import Trainer
    store = os.path.join(tmp, 'mlruns')
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=6, eval_interval=6)
    cfg.merge_from_dict({'log': dict(trackers=['tensorboard', 'mlflow'], mlflow_tracking_uri='file://' + store)})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(cfg, ds_config(0, micro_batch=2), work_dir=os.path.join(tmp, 'run'))
        real_step = trainer.train_step

        def train_step(want_grad_norm=False):
            if trainer.step == 3:
                shutil.rmtree(store)
            return real_step(want_grad_norm=want_grad_norm)
        trainer.train_step = train_step
        summary = fit_and_close(trainer)
    return summary, [r['step'] for r in read_jsonl(os.path.join(tmp, 'run', 'metrics.jsonl'))], out.getvalue()


def test_a_tracker_that_fails_mid_run_is_dropped_and_training_goes_on(tmp_path):
    """The MLflow run's store went away at step 3: the next log step raised MlflowException, the
    tracker's close raised it again, and the run died with three tracebacks (exit 1, the steps since
    the last checkpoint lost). Now one line, and the run completes with every step in its logs."""
    summary, steps, out = run_on_ranks(_mlflow_store_lost_mid_run, 1, args=(str(tmp_path),), timeout=240)[0]
    assert summary['exit_reason'] == 'completed' and summary['steps'] == 6 and steps == [1, 2, 3, 4, 5, 6]
    warnings = [line for line in out.splitlines() if 'warning: mlflow' in line]
    assert len(warnings) == 1 and 'failed; it is left out for the rest of this run' in warnings[0], out[-3000:]
    assert 'Traceback' not in out


def _preempted_then_resumed(tmp, uri):
    """A run SIGUSR1 stops at step 3 (a checkpoint, exit 75), then ``--resume auto`` to step 5:
    the MLflow runs with their status and loss history, and each pass's W&B run id."""
    from mlflow.tracking import MlflowClient
    from ds_seg.engine.trainer import Trainer
    os.environ.update(WANDB_MODE='offline', WANDB_SILENT='true')
    seen = {}
    for max_steps, resume in ((5, None), (5, 'auto')):
        cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=max_steps, checkpoint_interval=100)
        cfg.merge_from_dict({'log': dict(trackers=['tensorboard', 'mlflow', 'wandb'], mlflow_tracking_uri=uri,
                                         experiment='resumed', wandb_project='resumed')})
        trainer = Trainer(cfg, ds_config(0, micro_batch=2), work_dir=os.path.join(tmp, 'run'), resume=resume)
        if resume is None:
            signal_at_step(trainer, 3)  # the scheduler's warning, during step 3
        summary = fit_and_close(trainer)
        seen.setdefault('exit_reasons', []).append(summary['exit_reason'])
        seen.setdefault('wandb_ids', []).append(trainer.log.tracker_runs()['wandb']['id'])
        os.environ['MLFLOW_ALLOW_FILE_STORE'] = 'true'
        client = MlflowClient(tracking_uri=uri)
        run_id = trainer.log.tracker_runs()['mlflow']['run_id']
        seen.setdefault('statuses', []).append((run_id, client.get_run(run_id).info.status))
    runs = client.search_runs([client.get_experiment_by_name('resumed').experiment_id])
    seen['runs'] = [(r.info.run_id, r.info.status) for r in runs]
    seen['recorded'] = trainer.log.tracker_runs()['mlflow']['run_id']
    seen['history'] = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, 'train/loss')}
    seen['max_steps_param'] = runs[0].data.params['train.max_steps']
    seen['loss'] = {r['step']: r['loss'] for r in read_jsonl(os.path.join(tmp, 'run', 'metrics.jsonl'))}
    return seen


def test_a_preempted_run_is_killed_in_mlflow_and_its_resume_logs_on_to_the_same_runs(tmp_path):
    # A requeued job used to start a new MLflow run for every pass, and the stopped pass's run
    # stayed RUNNING for ever: the loss curve was split over runs that all looked alive.
    uri = 'file://' + os.path.join(str(tmp_path), 'mlruns')
    seen = run_on_ranks(_preempted_then_resumed, 1, args=(str(tmp_path), uri), timeout=300)[0]
    assert seen['exit_reasons'] == ['preempted', 'completed']
    (first, stopped), (second, finished) = seen['statuses']
    assert stopped == 'KILLED' and finished == 'FINISHED' and first == second
    assert len(seen['runs']) == 1 and seen['runs'][0] == (seen['recorded'], 'FINISHED')
    assert sorted(seen['history']) == [1, 2, 3, 4, 5] == sorted(seen['loss'])
    assert seen['history'] == pytest.approx(seen['loss'])
    wandb_ids = seen['wandb_ids']
    assert wandb_ids[0] == wandb_ids[1], 'the resumed pass goes on in the W&B run of the first'



def test_trackers_json_keeps_runs_of_a_pass_without_them_and_follows_a_moved_work_dir(tmp_path, monkeypatch):
    """Real MLflow (default store in the work dir) and W&B offline runs, three passes as three
    resumes would start them: a pass without W&B kept no record of its run, so the next pass with
    W&B began a new one; a moved work dir (the default store moves with it) began a new MLflow run."""
    import shutil
    from ds_seg.telemetry import RunLog
    from ds_seg.trackers import build_trackers
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    first = tmp_path / 'first'
    ids = []
    for names, earlier in ((['mlflow', 'wandb'], False), (['mlflow'], True), (['mlflow', 'wandb'], True)):
        log = RunLog(str(first), enabled=True)
        log.trackers = build_trackers(dict(trackers=names), str(first), 'run',
                                      earlier=log.tracker_runs() if earlier else None)
        log.record_tracker_runs()
        ids.append(log.tracker_runs())
        log.close('preempted')
    assert ids[0]['mlflow']['run_id'] == ids[1]['mlflow']['run_id'] == ids[2]['mlflow']['run_id']
    assert ids[1]['wandb'] == ids[0]['wandb'] and ids[2]['wandb']['id'] == ids[0]['wandb']['id']
    moved = tmp_path / 'moved ü "q"'   # (MLflow's file store writes such a path percent-encoded)
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    first.write_text('a file where the work dir was')
    log = RunLog(str(moved), enabled=True)
    earlier, note = log.tracker_runs_to_continue(['mlflow'])   # moved, not copied: logs on
    assert note is None and earlier == log.tracker_runs()
    log.trackers = build_trackers(dict(trackers=['mlflow']), str(moved), 'run', earlier=earlier)
    assert log.trackers[0].run.info.run_id == ids[0]['mlflow']['run_id'] and log.trackers[0].resumed
    # The artifacts of the resumed run go to the moved store: MLflow's file store had recorded the
    # old absolute place (a NotADirectoryError here, a folder re-created there where it could be).
    log.write_json('summary.json', {'steps': 7})
    log.close('completed')
    assert first.read_text() == 'a file where the work dir was'
    written = glob.glob(str(moved / 'mlruns' / '*' / ids[0]['mlflow']['run_id'] / 'artifacts' / 'summary.json'))
    assert len(written) == 1 and json.load(open(written[0]))['steps'] == 7


def _one_pass(work, names, uri=None):
    """One pass's tracker start as the trainer's resume makes it: (run ids by tracker, the line said)."""
    from ds_seg.telemetry import RunLog
    from ds_seg.trackers import build_trackers
    log = RunLog(str(work), enabled=True)
    earlier, note = log.tracker_runs_to_continue(names)
    log.trackers = build_trackers(dict(trackers=names, mlflow_tracking_uri=uri), str(work), 'run', earlier=earlier)
    log.record_tracker_runs()
    ids = {t.NAME: t.ids().get('run_id') or t.ids().get('id') for t in log.trackers}
    log.close('preempted')
    return ids, note


def test_a_copied_work_dir_logs_to_runs_of_its_own_where_the_original_logs_to_a_shared_one(tmp_path, monkeypatch):
    """cp -a of a work dir (a forked experiment) whose MLflow store is a configured one, and W&B:
    both the copy's and the original's resumed steps went into the same runs, interleaved. The copy
    starts its own (said once), then logs on to those; the original logs on to its own. A copy of
    a default store (inside the work dir) holds a copy of the run and logs on to it."""
    import shutil
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    shared = 'file://' + str(tmp_path / 'store')
    original, copy = tmp_path / 'a', tmp_path / 'b'
    first, note = _one_pass(original, ['mlflow', 'wandb'], shared)
    assert note is None
    shutil.copytree(original, copy, symlinks=True)
    forked, note = _one_pass(copy, ['mlflow', 'wandb'], shared)
    assert forked['mlflow'] != first['mlflow'] and forked['wandb'] != first['wandb']
    assert note == (f'MLflow/W&B: this work dir is a copy of {original}, which logs to the same MLflow/W&B run; '
                    "the copy's resumed steps start a run of their own (the original's go on in its own)")
    assert _one_pass(original, ['mlflow', 'wandb'], shared) == (first, None)
    assert _one_pass(copy, ['mlflow', 'wandb'], shared) == (forked, None)
    # A pass without W&B forgets the shared W&B run too: a later one with it does not log on to the original's.
    other = tmp_path / 'c'
    shutil.copytree(original, other, symlinks=True)
    assert _one_pass(other, ['mlflow'], shared)[1].startswith(f'MLflow: this work dir is a copy of {original}')
    assert _one_pass(other, ['mlflow', 'wandb'], shared)[0]['wandb'] != first['wandb']
    # The default store is copied with the work dir: the copy logs on to its copy of the run.
    own, default = tmp_path / 'own', tmp_path / 'own copy'
    ids, _ = _one_pass(own, ['mlflow'])
    shutil.copytree(own, default, symlinks=True)
    assert _one_pass(default, ['mlflow']) == (ids, None)


def _refused_rollback(tmp):
    """Six steps with checkpoints at 3 and 6, then a resume from step 3 (a rollback: step 6 would be
    set aside) whose MLflow store cannot be written: the work dir's files before and after."""
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    import contextlib
    import io
    work = os.path.join(tmp, 'run')
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=6, checkpoint_interval=3)
    cfg.merge_from_dict({'log': dict(experiment='potsdam')})  # no MLflow in this pass: said, not dropped
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = Trainer(cfg, ds_config(0, micro_batch=2), work_dir=work)
    try:
        trainer.fit()
    finally:
        trainer.close()

    def files():
        return sorted(os.path.relpath(os.path.join(d, f), work) for d, _, fs in os.walk(work) for f in fs)
    before = files()
    cfg.merge_from_dict({'log': dict(trackers=['mlflow'], mlflow_tracking_uri='file:///proc/ds_seg_mlruns')})
    try:
        Trainer(cfg, ds_config(0, micro_batch=2), work_dir=work,
                resume=os.path.join(work, 'checkpoints', 'step_00000003')).close()
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    return before, files(), refused, printed.getvalue()


def test_a_resume_refused_by_its_tracker_leaves_the_work_dir_as_it_was(tmp_path):
    # The trackers started after the rollback had moved step 6 aside: the refused run changed the
    # work dir, and the next --resume auto dropped the rows of steps 4-6 instead of keeping them.
    before, after, refused, printed = run_on_ranks(_refused_rollback, 1, args=(str(tmp_path),), timeout=240)[0]
    assert ("[ds_seg] log.experiment='potsdam' is not used: it takes effect only with 'mlflow' in log.trackers"
            in printed.splitlines())
    assert refused and refused.startswith("log.trackers: 'mlflow' could not start a run")
    assert after == before and 'checkpoints/step_00000006/COMPLETE' in after


def _deepspeed_wandb_monitor_without_login(tmp):
    """DeepSpeed's own W&B monitor (the JSON's "wandb" block) on a machine without `wandb login`."""
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    for name in ('WANDB_MODE', 'WANDB_API_KEY'):
        os.environ.pop(name, None)
    os.environ.update(HOME=os.path.join(tmp, 'home'), WANDB_CONFIG_DIR=os.path.join(tmp, 'home', 'wandb'))
    ds = ds_config(0, micro_batch=2, wandb={'enabled': True, 'project': 'x'})
    try:
        Trainer(tiny_cfg(os.path.join(tmp, 'cache'), max_steps=2), ds, work_dir=os.path.join(tmp, 'run')).close()
    except ConfigError as exc:
        return str(exc), os.path.exists(os.path.join(tmp, 'run'))
    return None, None


def test_deepspeeds_own_wandb_monitor_that_cannot_start_is_one_line(tmp_path):
    """A 40-line wandb UsageError traceback from inside deepspeed.initialize."""
    line, left = run_on_ranks(_deepspeed_wandb_monitor_without_login, 1, args=(str(tmp_path),), timeout=180)[0]
    assert line is not None and line.startswith("--deepspeed_config: DeepSpeed's wandb monitor (the JSON's 'wandb' "
                                                "block) cannot start (") and '\n' not in line, line
    assert left is False   # the refused run removed the work dir it created


def _refused_after_a_finished_run(tmp, case):
    """A finished 2-step run logged to MLflow, then a second start on its work dir that is
    refused: the MLflow runs' statuses afterwards."""
    from mlflow.tracking import MlflowClient

    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    uri = 'file://' + os.path.join(tmp, 'mlruns')
    work = os.path.join(tmp, 'run')

    def cfg(steps):
        c = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=2)
        c.merge_from_dict(dict(log=dict(trackers=['mlflow'], mlflow_tracking_uri=uri)))
        return c
    assert fit_and_close(Trainer(cfg(2), ds_config(0, micro_batch=2), work_dir=work))['exit_reason'] == 'completed'
    second = dict(fresh_over_checkpoints=(cfg(2), 'deepspeed', None), other_backend=(cfg(4), 'ddp', 'auto'),
                  past_max_steps=(cfg(1), 'deepspeed', 'auto'))[case]
    try:
        Trainer(second[0], ds_config(0, micro_batch=2), backend=second[1], work_dir=work, resume=second[2]).close()
        refused = False
    except ConfigError:
        refused = True
    os.environ['MLFLOW_ALLOW_FILE_STORE'] = 'true'  # this process reads the file store back
    client = MlflowClient(tracking_uri=uri)
    return refused, [r.info.status for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


@pytest.mark.parametrize('case', ['fresh_over_checkpoints', 'other_backend', 'past_max_steps'])
def test_a_refused_start_on_a_finished_run_leaves_its_tracker_runs_as_they_were(tmp_path, case):
    """The trackers started before these refusals: each refused attempt added a FAILED MLflow run
    (into the work dir's own mlruns/ by default), and a refused resume marked the finished run KILLED."""
    refused, statuses = run_on_ranks(_refused_after_a_finished_run, 1, args=(str(tmp_path), case), timeout=180)[0]
    assert refused and statuses == ['FINISHED']


def _deepspeed_file_monitors(tmp):
    """Two 2-step runs of one JSON with DeepSpeed's csv and TensorBoard monitors, in two work dirs,
    started from ``tmp/cwd``: what each monitor wrote, and where."""
    from ds_seg.engine.trainer import Trainer
    cwd = os.path.join(tmp, 'cwd')
    os.makedirs(cwd)
    os.chdir(cwd)
    ds = ds_config(0, micro_batch=2, csv_monitor={'enabled': True}, tensorboard={'enabled': True, 'output_path': 'ds'})
    for run in ('a', 'b'):
        trainer = Trainer(tiny_cfg(os.path.join(tmp, 'cache'), max_steps=2), ds, work_dir=os.path.join(tmp, run))
        trainer.fit()
        trainer.close()
    return {root: sorted(files) for root, _, files in os.walk(tmp) if 'DeepSpeedJobName' in root}


def test_deepspeeds_own_file_monitors_write_into_the_work_dir(tmp_path):
    """DeepSpeed's monitors wrote into the folder the command ran in (the checkout): every run
    appended to one CSV and put its TensorBoard events beside the others'. Their default path, or
    a relative one, is taken inside the work dir."""
    written = run_on_ranks(_deepspeed_file_monitors, 1, args=(str(tmp_path),), timeout=300)[0]
    assert sorted(written) == [str(tmp_path / run / sub / 'DeepSpeedJobName') for run in 'ab'
                               for sub in ('deepspeed_monitor', 'ds')], written
    for run in 'ab':
        assert written[str(tmp_path / run / 'deepspeed_monitor' / 'DeepSpeedJobName')] == ['Train_Samples_lr.csv']
        assert len(written[str(tmp_path / run / 'ds' / 'DeepSpeedJobName')]) == 1   # its events file
        rows = (tmp_path / run / 'deepspeed_monitor' / 'DeepSpeedJobName' / 'Train_Samples_lr.csv').read_text()
        assert rows.count('step,') == 1, rows
