"""train.keep_checkpoints prunes the checkpoints ds_seg wrote, never what a user put beside them:
an exported model or predictions copied into a step folder by hand went with the folder."""
import os

from ds_seg.engine.trainer import Trainer
from tests.tiny import ds_config, fit_and_close, tiny_cfg


def _trainer(tmp, max_steps, resume=None):
    cfg = tiny_cfg(tmp / 'cache', max_steps=max_steps, checkpoint_interval=2, keep_checkpoints=1)
    return Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(tmp / 'work'), resume=resume)


def _put_user_files(step_dir):
    (step_dir / 'my_model.pt').write_bytes(b'exported by hand')
    (step_dir / 'preds').mkdir()
    (step_dir / 'preds' / 'scene_classes.tif').write_bytes(b'a prediction')


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def test_pruning_moves_what_the_save_did_not_write_aside_and_says_where(tmp_path, capsys):
    fit_and_close(_trainer(tmp_path, 2))
    step2 = tmp_path / 'work' / 'checkpoints' / 'step_00000002'
    _put_user_files(step2)
    capsys.readouterr()
    fit_and_close(_trainer(tmp_path, 6, resume='auto'))   # saves 4 and 6; keep 1: 2 and 4 pruned
    out = capsys.readouterr().out
    checkpoints = tmp_path / 'work' / 'checkpoints'
    assert sorted(n for n in os.listdir(checkpoints) if n.startswith('step_')) == ['step_00000006']
    kept = tmp_path / 'work' / 'kept_from_pruning'
    assert _tree(kept) == ['step_00000002/my_model.pt', 'step_00000002/preds/scene_classes.tif']
    assert (kept / 'step_00000002' / 'my_model.pt').read_bytes() == b'exported by hand'
    assert (f'train.keep_checkpoints pruned {step2}; what ds_seg had not written there (my_model.pt, preds/) '
            f'moved to {kept / "step_00000002"}') in out
    # step 4 held only the save's own files: pruned whole, and nothing is said of it.
    assert 'pruned' not in out.replace(f'pruned {step2};', '')


def test_saving_a_step_again_keeps_what_a_user_put_in_its_folder(tmp_path):
    trainer = _trainer(tmp_path, 2)
    try:
        trainer.fit()
        step2 = tmp_path / 'work' / 'checkpoints' / 'step_00000002'
        _put_user_files(step2)
        trainer.checkpointer.save(trainer.step, trainer._data_position())   # the same step, saved again
    finally:
        trainer.close()
    assert _tree(step2) == sorted(['COMPLETE', 'ddp_state.pt', 'my_model.pt', 'preds/scene_classes.tif'])
    from ds_seg.engine import checkpoint
    assert checkpoint.verify(str(step2.parent), step2.name) is None


def test_a_fresh_run_moves_a_checkpoints_latest_it_did_not_write_to_previous(tmp_path, capsys):
    """A work dir holding no checkpoint but a user's own checkpoints/latest (and a model beside it):
    the fresh run's first save replaced that latest without a word."""
    checkpoints = tmp_path / 'work' / 'checkpoints'
    checkpoints.mkdir(parents=True)
    (checkpoints / 'latest').write_text('my notes\n')
    (checkpoints / 'my_model.pth').write_bytes(b'a model of mine')
    fit_and_close(_trainer(tmp_path, 2))
    (archive,) = os.listdir(tmp_path / 'work' / 'previous')
    archive = tmp_path / 'work' / 'previous' / archive
    assert (archive / 'checkpoints' / 'latest').read_text() == 'my notes\n'
    assert (checkpoints / 'my_model.pth').read_bytes() == b'a model of mine'   # no name a save writes: left alone
    assert (checkpoints / 'latest').read_text() == 'step_00000002'
    assert (f"the logs of an earlier run in {tmp_path / 'work'} ({os.path.join('checkpoints', 'latest')}) moved to "
            f"{archive}/") in capsys.readouterr().out
