"""train.save_best: the checkpoint of the best evaluation is kept beside the newest ones, named by
checkpoints/best, and a resumed run goes on comparing with it (mmsegmentation's save_best)."""
import json
import os

import pytest

from ds_seg.config import ConfigError
from ds_seg.engine import checkpoint
from ds_seg.engine.trainer import Trainer
from tests.tiny import ds_config, fit_and_close, tiny_cfg


def _run(tmp, max_steps, scores, resume=None, save_best='mIoU', checkpoint_interval=4, keep=1):
    """A real run of the tiny config (DDP, one process) whose evaluations score ``scores[step]``:
    the scores decide which checkpoint is best, so they are set, not left to a few steps of SGD."""
    cfg = tiny_cfg(tmp / 'cache', max_steps=max_steps, eval_interval=2, checkpoint_interval=checkpoint_interval,
                   keep_checkpoints=keep, save_best=save_best)
    trainer = Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp / 'work'), resume=resume)
    trainer.evaluate = lambda stop=None: trainer.metrics.log_eval(
        trainer.step, dict(mIoU=scores[trainer.step], OA=0.5, mF1=0.5, per_class={}))
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _checkpoints(tmp):
    root = tmp / 'work' / 'checkpoints'
    return sorted(n for n in os.listdir(root) if checkpoint.TAG_RE.match(n)), checkpoint.read_pointer(root, 'best')


def test_the_best_checkpoint_outlives_keep_checkpoints_and_a_resume(tmp_path):
    # Steps 2, 4, 6: the best (4) stays beside the newest (6) although keep_checkpoints=1.
    summary = _run(tmp_path, 6, {2: 0.3, 4: 0.5, 6: 0.4})
    assert _checkpoints(tmp_path) == (['step_00000004', 'step_00000006'], 'step_00000004')
    assert (summary['best']['metric'], summary['best']['value'], summary['best']['step']) == ('mIoU', 0.5, 4)
    # Resumed, 0.45 at step 8 is not a new best: the best score came back from the run's records
    # (not lost with the process, which would have made 0.45 the best).
    summary = _run(tmp_path, 8, {8: 0.45}, resume='auto')
    assert _checkpoints(tmp_path) == (['step_00000004', 'step_00000008'], 'step_00000004')
    assert summary['best']['step'] == 4
    # A new best replaces it: the old best goes the way keep_checkpoints says.
    summary = _run(tmp_path, 10, {10: 0.6}, resume='auto')
    assert _checkpoints(tmp_path) == (['step_00000010'], 'step_00000010')
    assert (summary['best']['value'], summary['best']['step']) == (0.6, 10)
    # checkpoints/best is taken where a checkpoint is (predict, evaluate, export, --resume).
    best = tmp_path / 'work' / 'checkpoints' / 'best'
    assert checkpoint.find_checkpoint(str(best)) == str(tmp_path / 'work' / 'checkpoints' / 'step_00000010')
    rows = [json.loads(line) for line in open(tmp_path / 'work' / 'eval.jsonl')]
    assert [(r['step'], r['mIoU']) for r in rows] == [(2, 0.3), (4, 0.5), (6, 0.4), (8, 0.45), (10, 0.6)]
    # Resumed without save_best: the best weights the work dir holds are not pruned away, and
    # summary.json still names them, by the metric that chose them (from their marker).
    summary = _run(tmp_path, 14, {12: 0.1, 14: 0.2}, resume='auto', save_best=None)
    assert _checkpoints(tmp_path) == (['step_00000010', 'step_00000014'], 'step_00000010')
    assert summary['best'] == dict(metric='mIoU', value=0.6, step=10,
                                   checkpoint=str(tmp_path / 'work' / 'checkpoints' / 'step_00000010'))


def test_a_rollback_past_the_best_keeps_the_best_of_the_live_branch(tmp_path, capsys):
    """The best (step 6) went to abandoned/ with the branch after step 4; the retrained step 6
    (0.4) was then announced as the best, though step 4 (0.5) is on the live branch."""
    _run(tmp_path, 6, {2: 0.5, 4: 0.5, 6: 0.6}, checkpoint_interval=2, keep=0)
    assert _checkpoints(tmp_path)[1] == 'step_00000006'
    step4 = str(tmp_path / 'work' / 'checkpoints' / 'step_00000004')
    summary = _run(tmp_path, 6, {6: 0.4}, resume=step4, checkpoint_interval=2, keep=0)
    # the first of equal scores, as an uninterrupted run keeps it
    assert _checkpoints(tmp_path) == (['step_00000002', 'step_00000004', 'step_00000006'], 'step_00000002')
    assert (summary['best']['value'], summary['best']['step']) == (0.5, 2)
    assert 'checkpoints/best: step 2 (mIoU 0.5000), the best checkpointed evaluation of the steps resumed from' in capsys.readouterr().out
    # The abandoned branch's summary names its best where it now is, not the live step 6 (another model).
    aside, = (tmp_path / 'work' / 'abandoned').iterdir()
    best = json.load(open(aside / 'summary.json'))['best']
    assert (best['step'], best['value'], best['checkpoint']) == (6, 0.6, str(aside / 'checkpoints' / 'step_00000006'))
    assert checkpoint.is_complete(str(aside / 'checkpoints'), 'step_00000006')
    summary = _run(tmp_path, 8, {8: 0.7}, resume='auto', checkpoint_interval=2, keep=0)
    assert (summary['best']['value'], summary['best']['step']) == (0.7, 8)


def test_a_resume_keeping_the_best_by_another_metric_is_refused_where_pruning_would_delete_it(tmp_path):
    """save_best=mIoU kept step 4; resumed with save_best=OA, the first OA best moved `best` on and
    keep_checkpoints=1 pruned step 4, the run's best weights, without a word."""
    _run(tmp_path, 6, {2: 0.3, 4: 0.5, 6: 0.4})
    with pytest.raises(ConfigError, match=r"step_00000004 is the run's best by mIoU \(train.save_best='mIoU'\); "
                                          r"keeping the best by OA instead would let train.keep_checkpoints=1 "
                                          r"delete it"):
        _run(tmp_path, 8, {8: 0.45}, resume='auto', save_best='OA')
    assert _checkpoints(tmp_path) == (['step_00000004', 'step_00000006'], 'step_00000004')
    # Another run's checkpoint continued in a work dir of its own: that run's best is never pruned
    # by this one, which may keep the best by any metric.
    cfg = tiny_cfg(tmp_path / 'cache', max_steps=8, eval_interval=2, checkpoint_interval=4, keep_checkpoints=1,
                   save_best='OA')
    other = Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp_path / 'other'),
                    resume=str(tmp_path / 'work' / 'checkpoints' / 'step_00000006'))
    other.close()


@pytest.mark.parametrize('options, message', [
    (dict(save_best='miou'), "train.save_best must be None or one of 'mIoU', 'mF1', 'OA', got 'miou'"),
    (dict(save_best='mIoU', eval_interval=0), "train.save_best='mIoU' keeps the checkpoint of the best evaluation, "
                                              "but this run evaluates nothing (train.eval_interval=0)"),
])
def test_save_best_without_a_metric_to_compare_is_one_line(tmp_path, options, message):
    with pytest.raises(ConfigError) as info:
        cfg = tiny_cfg(tmp_path / 'cache', max_steps=4, **options)
        Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp_path / 'work'))
    assert message in str(info.value) and '\n' not in str(info.value)
    assert not (tmp_path / 'work').exists()


def test_exporting_a_best_checkpoint_a_run_never_wrote_says_why(tmp_path):
    """README: export.py work_dirs/default/checkpoints/best on a run without train.save_best
    said only 'does not exist'."""
    import pytest as _pytest
    from ds_seg.engine import checkpoint
    (tmp_path / 'checkpoints').mkdir()
    with _pytest.raises(FileNotFoundError, match='checkpoints/best is written only by runs with train.save_best'):
        checkpoint.find_checkpoint(str(tmp_path / 'checkpoints' / 'best'))
    # predict.py and evaluate.py say it alike (they said only "does not exist")
    from ds_seg.inputs import check_checkpoint_option
    with _pytest.raises(ConfigError, match=r"--checkpoint: .*best does not exist: checkpoints/best is written only by "
                                           r"runs with train.save_best"):
        check_checkpoint_option(str(tmp_path / 'checkpoints' / 'best'))


def test_a_resume_with_another_model_setting_of_the_same_shapes_says_so(tmp_path, capsys):
    """Model settings that leave every tensor's shape (activation_checkpointing, a drop-path rate)
    changed on resume without a word: the marker then recorded the new one for the whole run."""
    def run(max_steps, **model):
        cfg = tiny_cfg(tmp_path / 'cache', max_steps=max_steps, eval_interval=0, checkpoint_interval=2)
        cfg.model.update(model)
        trainer = Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp_path / 'work'), resume='auto')
        try:
            trainer.fit()
        finally:
            trainer.close()
    run(2)
    capsys.readouterr()
    run(4, activation_checkpointing=True)
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if 'another model config' in line]
    assert len(said) == 1 and 'model.activation_checkpointing (default) there, True here' in said[0], out


def test_a_run_that_keeps_no_checkpoint_says_so_at_its_start(tmp_path, capsys):
    """train.checkpoint_interval=0: the run completed with no weights kept, and nothing said it."""
    cfg = tiny_cfg(tmp_path / 'cache', max_steps=1, eval_interval=0, checkpoint_interval=0)
    trainer = Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp_path / 'work'))
    try:
        trainer.fit()
    finally:
        trainer.close()
    out = capsys.readouterr().out
    assert 'train.checkpoint_interval=0: no checkpoint is written unless a signal stops the run' in out, out
    assert not os.path.exists(tmp_path / 'work' / 'checkpoints')
    # With save_best the best evaluations are checkpointed: 'no checkpoint is written' was said, and
    # the run wrote them.
    cfg = tiny_cfg(tmp_path / 'cache', max_steps=2, eval_interval=1, checkpoint_interval=0, save_best='mIoU')
    fit_and_close(Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp_path / 'best')))
    out = capsys.readouterr().out
    assert "train.checkpoint_interval=0: checkpoints are written at evaluations that improve " \
           "train.save_best='mIoU'" in out and 'no checkpoint is written' not in out, out
    assert os.listdir(tmp_path / 'best' / 'checkpoints')


def test_save_best_given_on_resume_starts_from_the_best_checkpointed_evaluation(tmp_path):
    """The variant without a rollback: a run that kept no best, resumed with save_best, took its
    first new evaluation as the best, whatever the earlier checkpointed ones scored."""
    _run(tmp_path, 4, {2: 0.2, 4: 0.5}, save_best=None, checkpoint_interval=2, keep=0)
    summary = _run(tmp_path, 6, {6: 0.3}, resume='auto', checkpoint_interval=2, keep=0)
    assert (summary['best']['value'], summary['best']['step']) == (0.5, 4)
    assert _checkpoints(tmp_path)[1] == 'step_00000004'


def test_resuming_a_step_of_an_abandoned_branch_makes_that_branch_live_again(tmp_path, capsys):
    """A rollback set branch A (steps 4, 6) aside; --resume of A's step 4 treated it as another
    run's checkpoint: all the shared history (steps 1-2, tb/) went to previous/, and save_best
    compared only with the evaluations after the resume. Now A is the live branch again: its
    checkpoints up to step 4 and their rows come back, the rollback's branch (B) is set aside, the
    resumed steps equal A's own, and TensorBoard shows A's points, not B's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    work = tmp_path / 'work'
    root = work / 'checkpoints'
    _run(tmp_path, 6, {2: 0.5, 4: 0.5, 6: 0.6}, checkpoint_interval=2, keep=0)
    a_rows = [json.loads(line) for line in open(work / 'metrics.jsonl')]
    _run(tmp_path, 6, {4: 0.3, 6: 0.4}, resume=str(root / 'step_00000002'), checkpoint_interval=2, keep=0,
         save_best=None)
    b_rows = [json.loads(line) for line in open(work / 'metrics.jsonl')][2:]
    branch_a, = (work / 'abandoned').iterdir()
    assert json.load(open(branch_a / 'branch.json')) == {'branched_after': 'step_00000002'}
    capsys.readouterr()
    summary = _run(tmp_path, 6, {6: 0.55}, resume=str(branch_a / 'checkpoints' / 'step_00000004'),
                   checkpoint_interval=2, keep=0)
    out = capsys.readouterr().out
    branch_b, = set((work / 'abandoned').iterdir()) - {branch_a}
    assert (f'resuming step_00000004 of the branch abandoned in {branch_a}: it is the live branch again (its '
            'checkpoints up to step_00000004 and their log rows are back in the work dir); the live branch after '
            f'step_00000002 was moved to {branch_b} (nothing deleted)') in out, out
    assert "another run's checkpoint" not in out and not list(work.glob('previous/*/metrics.jsonl'))
    assert _checkpoints(tmp_path) == (['step_00000002', 'step_00000004', 'step_00000006'], 'step_00000006')
    assert open(root / 'latest').read() == 'step_00000006'
    # A after the step resumed, with its best (0.6 at step 6: what that branch scored).
    assert sorted(os.listdir(branch_a / 'checkpoints')) == ['best', 'step_00000006']
    assert sorted(os.listdir(branch_b / 'checkpoints')) == ['step_00000004', 'step_00000006']
    # The logs: steps 1-2 shared, 3-4 A's, 5-6 this run's; B's rows with B, A's later ones with A.
    rows = [json.loads(line) for line in open(work / 'metrics.jsonl')]
    assert [r['step'] for r in rows] == list(range(1, 7))
    assert rows[:4] == a_rows[:4]
    assert [r['loss'] for r in rows[4:6]] == [r['loss'] for r in a_rows[4:6]]   # A's steps 5-6, retrained alike
    assert [json.loads(line) for line in open(branch_b / 'metrics.jsonl')] == b_rows
    assert [json.loads(line)['step'] for line in open(branch_a / 'metrics.jsonl')] == [5, 6]
    evals = [(json.loads(line)['step'], json.loads(line)['mIoU']) for line in open(work / 'eval.jsonl')]
    assert evals == [(2, 0.5), (4, 0.5), (6, 0.55)]
    assert (summary['best']['step'], summary['best']['value']) == (6, 0.55)
    events = EventAccumulator(str(work / 'tb'))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars('val/mIoU')] == evals
    assert [(e.step, round(e.value, 5)) for e in events.Scalars('train/loss')] == [(r['step'], round(r['loss'], 5))
                                                                                 for r in rows]
    # B is now a branch of this lineage (it can be brought back in turn); the live folder is none.
    assert checkpoint.abandoned_branch_of(str(work), str(branch_b / 'checkpoints')) == (str(branch_b), 'step_00000002')
    assert checkpoint.abandoned_branch_of(str(work), str(root)) is None


def test_a_model_that_pads_every_crop_is_told_to_shrink_the_model_not_the_crop(tmp_path):
    """A UNet of depth 10 pads every input to 1024 px: its activation estimate (about 270 GiB)
    was the same at crop 64 and 16, and the refusal said to lower data.crop_size."""
    from ds_seg.config import ConfigError
    cfg = tiny_cfg(tmp_path / 'cache', max_steps=1)
    cfg.model.update(type='UNet', depth=10)
    cfg.data.crop_size = 32
    with pytest.raises(ConfigError, match=r"UNet pads every input to a multiple of 1024 px, so a 32-px crop is "
                                          r"computed at 1024 px: a shallower model \(model.depth\)"):
        Trainer(cfg, ds_config(0, micro_batch=8), backend='ddp', work_dir=str(tmp_path / 'work'))
    assert not os.path.exists(tmp_path / 'work')
