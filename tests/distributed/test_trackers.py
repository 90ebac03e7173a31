"""log.trackers: a short run logs the same scalars, the config and the summary to MLflow's local
file store (no network), read back with the MLflow client; TensorBoard stays the default."""
import json
import os

import pytest

from tests.dist import run_on_ranks
from tests.tiny import ds_config, read_jsonl, tiny_cfg


def _train(tmp, uri):
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4, eval_interval=4)
    cfg.merge_from_dict({'log': dict(trackers=['tensorboard', 'mlflow'], mlflow_tracking_uri=uri,
                                     experiment='tracker-test')})
    trainer = Trainer(cfg, ds_config(0, micro_batch=2), work_dir=os.path.join(tmp, 'run'))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_mlflow_gets_the_scalars_config_and_summary(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    monkeypatch.setenv('MLFLOW_ALLOW_FILE_STORE', 'true')  # this process reads the file store back
    tmp = str(tmp_path)
    uri = 'file://' + os.path.join(tmp, 'mlruns')
    summary = run_on_ranks(_train, 2, args=(tmp, uri), timeout=240)[0]
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


def test_unknown_tracker_is_refused_naming_the_known_ones():
    from ds_seg.config import ConfigError
    from ds_seg.trackers import check_trackers
    with pytest.raises(ConfigError, match="log.trackers: \\['tensorbord'\\] unknown; known trackers: tensorboard"):
        check_trackers(dict(trackers=['tensorbord']))
