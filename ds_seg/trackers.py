"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases, switched on from the
experiment config and fed by rank 0's :class:`ds_seg.telemetry.RunLog` with the same scalars
(``train/*``, ``val/*``, ``val_iou/*``), the resolved config and the final summary.

Example (experiment config)::

    log = dict(trackers=['tensorboard', 'mlflow'], mlflow_tracking_uri='file:///scratch/mlruns',
               experiment='potsdam')
"""
import json
import os

from .config import ConfigError, extra_hint

KNOWN = ('tensorboard', 'mlflow', 'wandb')


def _flatten(node, prefix=''):
    out = {}
    for key, value in (node or {}).items():
        path = f'{prefix}{key}'
        if isinstance(value, dict):
            out.update(_flatten(value, f'{path}.'))
        else:
            out[path] = value
    return out


# How a run ended (Trainer.exit_reason) in each tracker's terms. A stopped run (a signal, Ctrl-C,
# a time limit) is KILLED, not FAILED: its checkpoint is there and `--resume auto` goes on with it.
# 'refused': a start refused after the trackers started (FAILED; a reopened run keeps KILLED).
MLFLOW_STATUS = {'completed': 'FINISHED', 'preempted': 'KILLED', 'interrupted': 'KILLED', 'running': 'KILLED'}
STOPPED = tuple(reason for reason, status in MLFLOW_STATUS.items() if status == 'KILLED')


def _numeric(record, prefix):
    return {f'{prefix}/{k}': float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != 'step'}


def _check_server_answers(uri, timeout_s=10):
    """An http(s) tracking server that nothing listens at (or that never accepts) is one line at
    once: MLflow's client retries for about 4 minutes before its error, in silence."""
    import socket
    from urllib.parse import urlsplit
    parts = urlsplit(uri)
    if parts.scheme not in ('http', 'https') or not parts.hostname:
        return
    try:
        port = parts.port or (443 if parts.scheme == 'https' else 80)
    except ValueError:
        raise ConfigError(f"log.mlflow_tracking_uri {uri!r}: not a valid port; give http://host:port") from None
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = 'no answer within %g s' % timeout_s if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ConfigError(f"log.mlflow_tracking_uri {uri}: no tracking server at {parts.hostname}:{port} ({reason}); "
                          "start it (mlflow server), or give a file:// folder") from None


def _follow_moved_store(root):
    """The default store (``<work dir>/mlruns``) of a work dir that was moved: MLflow's file store
    records absolute artifact locations, so the resumed run's artifacts went to the old place
    (re-created there, or a NotADirectoryError where a file now stands). Its experiments and runs
    are pointed at where the store is now; a store of the user's own (a configured URI) is not
    touched."""
    import pathlib

    import yaml
    if not os.path.isdir(root):
        return
    new = pathlib.Path(os.path.abspath(root)).as_uri()
    for experiment in sorted(os.listdir(root)):
        folder = os.path.join(root, experiment)
        meta = _read_meta(os.path.join(folder, 'meta.yaml'))
        location = meta.get('artifact_location') if meta else None
        if not isinstance(location, str) or not location.endswith('/' + experiment):
            continue
        old = location[:-len('/' + experiment)]
        if old == new:
            continue
        metas = [os.path.join(folder, 'meta.yaml')] + [os.path.join(folder, run, 'meta.yaml')
                                                       for run in sorted(os.listdir(folder))]
        for path in metas:
            meta = _read_meta(path)
            if not meta:
                continue
            for key in ('artifact_location', 'artifact_uri'):
                value = meta.get(key)
                if isinstance(value, str) and (value == old or value.startswith(old + '/')):
                    meta[key] = new + value[len(old):]
            tmp = path + '.ds_seg-tmp'
            with open(tmp, 'w') as f:
                yaml.safe_dump(meta, f, default_flow_style=False, allow_unicode=True)
            os.replace(tmp, path)


def _read_meta(path):
    import yaml
    try:
        with open(path) as f:
            meta = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return meta if isinstance(meta, dict) else None


class MLflowTracker:
    """One MLflow run per training run: a resumed run (a requeued job, ``--resume auto``) logs on
    to the MLflow run its earlier steps went to, recorded in the work dir's ``trackers.json``."""
    NAME = 'mlflow'

    def __init__(self, log_cfg, work_dir, run_name, earlier=None):
        try:
            import mlflow
        except ImportError as exc:
            raise ConfigError(f"log.trackers: 'mlflow' needs the mlflow client: {extra_hint('mlflow')} "
                              "(mlflow-skinny is enough).") from exc
        self.mlflow = mlflow
        configured = log_cfg.get('mlflow_tracking_uri')
        uri = configured or 'file://' + os.path.abspath(os.path.join(work_dir, 'mlruns'))
        _check_server_answers(uri)
        if not configured:
            _follow_moved_store(os.path.join(work_dir, 'mlruns'))
        if uri.startswith('file:') or '://' not in uri:
            # MLflow 3 refuses its file store unless opted in; a file URI here is the user's choice
            # (or our no-server default), and it needs no database packages.
            os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')
        mlflow.set_tracking_uri(uri)
        experiment = log_cfg.get('experiment') or 'ds_seg'
        mlflow.set_experiment(experiment)
        # What the config says, not the path it resolves to: the default store moves with a moved
        # (or symlinked) work dir, and its run is still there.
        self.where = dict(tracking_uri=configured, experiment=experiment)
        self.note = None        # what the trainer says about the run it logs to
        self.resumed = False
        self.run = None
        if earlier and earlier.get('run_id'):
            if {k: earlier.get(k) for k in self.where} != self.where:
                self.note = (f"MLflow: the earlier steps were logged to run {earlier['run_id']} in "
                             f"{earlier.get('experiment')!r} at {earlier.get('tracking_uri') or '<work dir>/mlruns'}; "
                             "log.mlflow_tracking_uri or log.experiment changed, so the resumed steps start a new run")
            else:
                try:
                    self.run = mlflow.start_run(run_id=earlier['run_id'])
                    self.resumed = True
                except mlflow.exceptions.MlflowException as exc:  # deleted, or the store was moved
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                    self.note = (f"MLflow: the run of the earlier steps, {earlier['run_id']}, could not be "
                                 f"reopened ({first}); the resumed steps go to a new run")
        if self.run is None:
            self.run = mlflow.start_run(run_name=run_name)
        if self.resumed:
            self.note = f"MLflow: the resumed steps go on in run {self.run.info.run_id} ({experiment!r})"

    def ids(self):
        return dict(run_id=self.run.info.run_id, **self.where)

    def config(self, cfg):
        # Params are short strings in MLflow (500 chars); the full config goes in as an artifact.
        params = {k: str(v)[:500] for k, v in _flatten(cfg).items()}
        if self.resumed:
            # MLflow refuses to change a logged param (a resume with a longer train.max_steps):
            # the run keeps the params it started with, and the config.json artifact is replaced
            # by this resume's (the work dir keeps each one, previous/<time>/config.json).
            logged = self.mlflow.get_run(self.run.info.run_id).data.params
            params = {k: v for k, v in params.items() if k not in logged}
        for start in range(0, len(params), 100):  # log_params takes at most 100 at a time
            self.mlflow.log_params(dict(list(params.items())[start:start + 100]))
        self.mlflow.log_dict(cfg, 'config.json')

    def scalars(self, values, step):
        if values:
            self.mlflow.log_metrics(values, step=step)

    def summary(self, summary):
        self.mlflow.log_dict(json.loads(json.dumps(summary, default=str)), 'summary.json')
        self.scalars(_numeric(summary, 'summary'), summary.get('steps') or 0)

    def close(self, exit_reason=None):
        if exit_reason == 'refused' and self.resumed:  # reopened, then refused: as it was, resumable
            exit_reason = 'interrupted'
        self.mlflow.end_run(status=MLFLOW_STATUS.get(exit_reason, 'FAILED'))


class WandbTracker:
    """A W&B run in ``log.wandb_project`` (``WANDB_MODE=offline`` works without a network)."""
    NAME = 'wandb'

    def __init__(self, log_cfg, work_dir, run_name, earlier=None):
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(f"log.trackers: 'wandb' needs the wandb client: {extra_hint('wandb')}.") from exc
        self.wandb = wandb
        # create_new: this run's own handle (every call below goes through it), never a user's
        # wandb.run of the same process finished or reused behind their back.
        project = log_cfg.get('wandb_project') or 'ds_seg'
        # A resumed run (same project) goes on in the W&B run of its earlier steps.
        same = bool(earlier and earlier.get('id') and earlier.get('project') == project)
        self.run = wandb.init(project=project, name=run_name, dir=work_dir, reinit='create_new',
                              **(dict(id=earlier['id'], resume='allow') if same else {}))
        self.note = f"W&B: the resumed steps go on in run {self.run.id} ({project!r})" if same else None

    def ids(self):
        return dict(id=self.run.id, project=self.run.project)

    def config(self, cfg):
        self.run.config.update(cfg, allow_val_change=True)

    def scalars(self, values, step):
        if values:
            self.run.log(values, step=step)

    def summary(self, summary):
        self.run.summary.update(json.loads(json.dumps(summary, default=str)))

    def close(self, exit_reason=None):
        if exit_reason == 'preempted':
            self.run.mark_preempting()  # W&B's state for a run that a scheduler stopped and will requeue
        self.run.finish(exit_code=0 if exit_reason == 'completed' or exit_reason in STOPPED else 1)


def check_trackers(log_cfg):
    """The tracker names of ``log.trackers``, or a ConfigError naming the known ones."""
    names = list(log_cfg.get('trackers') or [])
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ConfigError(f"log.trackers: {unknown} unknown; known trackers: {', '.join(KNOWN)}.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # a second MLflow run in the same process failed as "Run ... is already active"
        raise ConfigError(f"log.trackers names {', '.join(map(repr, twice))} twice; name each tracker once.")
    return names


def run_is_inside_work_dir(name, ids):
    """Whether the tracker run ``trackers.json`` records as ``ids`` is kept in the work dir itself
    (MLflow's default store, ``<work dir>/mlruns``): a copied work dir holds a copy of it, to log
    on to; a configured store or server, and W&B, keep one run that a copy would share."""
    return name == 'mlflow' and isinstance(ids, dict) and not ids.get('tracking_uri')


def build_trackers(log_cfg, work_dir, run_name, earlier=None):
    """The non-TensorBoard trackers ``log.trackers`` asks for, started (rank 0 only). ``earlier``:
    what a resumed run's ``trackers.json`` recorded ({name: ids}), to log on to those runs.

    Example: ``build_trackers(dict(trackers=['mlflow']), 'work_dirs/x', 'x')``
    """
    classes = {'mlflow': MLflowTracker, 'wandb': WandbTracker}
    trackers = []
    for name in check_trackers(log_cfg):
        if name not in classes:
            continue
        try:
            trackers.append(classes[name](log_cfg, work_dir, run_name, (earlier or {}).get(name)))
        except Exception as exc:  # no login, an unwritable store, an unreachable server...
            for started in trackers:  # no run left open in the trackers that did start
                started.close('refused')
            if isinstance(exc, ConfigError):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"log.trackers: {name!r} could not start a run ({first[:200]}); "
                              f"{START_HINTS[name]}") from exc
    return trackers


# What to do when a tracker cannot start its run, by tracker.
START_HINTS = {
    'mlflow': 'give log.mlflow_tracking_uri a writable file:// folder or a reachable server.',
    'wandb': 'run `wandb login`, or set WANDB_MODE=offline to write the run to the work dir and '
             '`wandb sync` it later.',
}
