"""What predict and evaluate leave in their output folder when something else happens there or
to them: another run writing the same output, a run killed earlier, SIGTERM or Ctrl-C in the
middle, a full disk, a name too long for the file system. Real files, real processes, real
signals."""
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import rasterio

from ds_seg import inference as inf
from ds_seg.config import REPO_ROOT
from tests.unit.test_inference import LookupModel, _cli_files, write_scene

KW = dict(mean=[0, 0], std=[1, 1], classes=list('abcde'), tile=64, overlap=16, block=64, batch_size=2)


@pytest.fixture(scope='module')
def scene(tmp_path_factory):
    path = str(tmp_path_factory.mktemp('scene') / 'scene.tif')
    write_scene(path, 203, 157)
    return path


class _AnotherRunWrites(LookupModel):
    """A second run into the same folder finishes while this one predicts (its 3rd window)."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def __call__(self, images_BCHW):
        if self.calls == 2:
            with open(self.out, 'wb') as f:
                f.write(b"another run's class map")
        return super().__call__(images_BCHW)


def test_an_output_another_run_wrote_meanwhile_is_never_replaced(scene, tmp_path):
    """Two predicts into one --output at once: both passed the check that the output does not
    exist, wrote one partial file between them, and the one that exited 0 reported a class map
    the other had computed (with its own probabilities beside it)."""
    out, probs = str(tmp_path / 'classes.tif'), str(tmp_path / 'probs.tif')
    with pytest.raises(FileExistsError, match=r'classes\.tif was written by another process while this run worked'):
        inf.predict_scene(_AnotherRunWrites(out), scene, out, probs_path=probs, overwrite=False, **KW)
    assert open(out, 'rb').read() == b"another run's class map"
    assert sorted(os.listdir(tmp_path)) == ['classes.tif'], 'neither of its files, nor a partial one'
    # --overwrite replaces, as it says; the partial file was this run's own all along.
    inf.predict_scene(_AnotherRunWrites(out), scene, out, probs_path=probs, overwrite=True, **KW)
    with rasterio.open(out) as src, rasterio.open(probs) as p:
        assert src.count == 1 and p.count == 5
    assert sorted(os.listdir(tmp_path)) == ['classes.tif', 'probs.tif']


def test_a_killed_runs_partial_files_go_and_a_live_runs_and_a_users_stay(scene, tmp_path):
    from ds_seg.inputs import run_token
    out = str(tmp_path / 'classes.tif')
    gone = subprocess.Popen(['true'])
    gone.wait()
    host = run_token().split('-')[0]
    live = subprocess.Popen(['sleep', '60'])
    try:
        files = {f'classes.ds_seg-partial-{host}-{gone.pid}.tif': 'stale',
                 f'classes.ds_seg-partial-{host}-{gone.pid}.tif.part1': 'stale',
                 'classes.ds_seg-partial.tif': 'stale',                   # an older version's
                 f'classes.ds_seg-partial-{host}-{live.pid}.tif': 'kept',   # a run still writing
                 f'classes.ds_seg-partial-0badc0de-{gone.pid}.tif': 'kept',  # another host's
                 'classes.partial.tif': 'kept'}                             # the user's own
        for name in files:
            (tmp_path / name).write_text('x')
        inf.predict_scene(LookupModel(), scene, out, **KW)
        assert sorted(os.listdir(tmp_path)) == sorted(['classes.tif'] + [n for n, k in files.items() if k == 'kept'])
    finally:
        live.kill()


def _predict(tmp_path, *extra, preexec_fn=None, scene=None, **popen):
    weights, default_scene, _ = _cli_files(tmp_path, 'UNetTiny')
    return subprocess.Popen([sys.executable, 'launch/predict.py', '--checkpoint', weights, '--input',
                             scene or default_scene, '--output', str(tmp_path / 'out'), '--device', 'cpu', *extra],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT)},
                            preexec_fn=preexec_fn, **popen)


@pytest.mark.parametrize('signum, status, said', [(signal.SIGTERM, 143, 'predict: stopped by SIGTERM'),
                                                  (signal.SIGINT, 130, 'predict: interrupted (Ctrl-C)')])
def test_a_signal_mid_scene_leaves_no_partial_file_and_says_one_line(tmp_path, signum, status, said):
    """SIGTERM (kill, timeout, Slurm) left the partial class map and probabilities (MBs each);
    Ctrl-C printed a KeyboardInterrupt traceback."""
    big = str(tmp_path / 'big.tif')
    write_scene(big, 2400, 2400, bands=3)
    proc = _predict(tmp_path, '--probs', '--tile', '64', '--overlap', '32', scene=big,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out = tmp_path / 'out'
    deadline = time.monotonic() + 240
    while not (out.is_dir() and any('ds_seg-partial' in n for n in os.listdir(out))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr
    assert said in stderr and 'Traceback' not in stderr, stderr
    assert os.listdir(out) == []


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the write fails with EFBIG instead of killing


def test_a_write_the_disk_refuses_is_one_line_and_status_74(tmp_path):
    """A full disk gave GDAL's error lines and a RasterioIOError traceback. A file size limit of
    64 KiB refuses the writes here as a full disk would (EFBIG for ENOSPC)."""
    big = str(tmp_path / 'big.tif')
    write_scene(big, 600, 600, bands=3)
    proc = _predict(tmp_path, '--probs', '--tile', '64', scene=big, preexec_fn=_limit_file_size)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 74, stderr
    assert 'predict: error: ' in stderr and 'File too large' in stderr and 'Traceback' not in stderr, stderr
    assert os.listdir(tmp_path / 'out') == []


def test_long_names_work_and_a_name_too_long_for_the_file_system_is_refused_before_any_work(tmp_path):
    """A 231-character input failed with a traceback after the model was loaded: its output name
    was legal, its temporary one (with '.ds_seg-partial') was not. That temporary name is now a
    short one where needed; an output name that is itself too long is one line before any work."""
    ok_scene = str(tmp_path / ('s' * 240 + '.tif'))        # -> 252-character class map name
    write_scene(ok_scene, 70, 50, bands=3)
    stdout, stderr = _predict(tmp_path, '--probs', scene=ok_scene).communicate(timeout=300)
    assert sorted(os.listdir(tmp_path / 'out')) == ['s' * 240 + '_classes.tif', 's' * 240 + '_probs.tif'], stderr
    long_scene = str(tmp_path / ('t' * 247 + '.tif'))      # -> 259 characters: more than 255
    write_scene(long_scene, 70, 50, bands=3)
    proc = _predict(tmp_path, scene=long_scene)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr
    assert 'predict: error: --output: the output name tttt' in stderr and 'give the input a shorter name' in stderr
    assert 'Traceback' not in stderr and len(os.listdir(tmp_path / 'out')) == 2


def test_eval_json_names_the_checkpoint_step_it_read(tmp_path):
    """A work dir whose newest checkpoint is damaged is evaluated from an older one (one line
    says so); eval.json recorded only the work dir, read later as the newest step."""
    from ds_seg.cli import evaluate
    from tests.tiny import ds_config, fit_and_close, tiny_cfg
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(tmp_path / 'cache', max_steps=4, checkpoint_interval=2, keep_checkpoints=2)
    work = tmp_path / 'work'
    fit_and_close(Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(work)))
    newest = work / 'checkpoints' / 'step_00000004'
    for name in os.listdir(newest):
        if name.endswith('.pt') or os.path.isdir(newest / name):
            target = newest / name
            break
    if os.path.isdir(target):
        target = next(target / n for n in os.listdir(target))
    with open(target, 'r+b') as f:
        f.write(b'\0' * 64)   # damaged: its SHA-256 no longer verifies
    assert evaluate.main(['--checkpoint', str(work), '--output', str(tmp_path / 'ev'), '--previews', '0']) == 0
    record = json.loads((tmp_path / 'ev' / 'eval.json').read_text())
    assert record['checkpoint'] == str(work)
    assert record['checkpoint_read'] == str(work / 'checkpoints' / 'step_00000002') and record['step'] == 2


@pytest.mark.parametrize('overwrite', [False, True])
def test_a_link_at_an_output_name_is_refused_before_any_work_even_one_to_nothing(tmp_path, overwrite):
    """A link to nothing passed the check (os.path.exists is False for it): the whole scene was
    predicted, then refused as 'written by another process while this run worked'."""
    from ds_seg.config import ConfigError
    from ds_seg.inputs import check_outputs
    (tmp_path / 'mine.tif').write_bytes(b'mine')
    for target in ('/nonexistent/file.tif', str(tmp_path / 'mine.tif')):
        link = tmp_path / 'scene_classes.tif'
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        with pytest.raises(ConfigError) as refused:
            check_outputs([str(link)], ['scene.tif'], overwrite=overwrite)
        assert str(refused.value) == (f'--output: {link} is a link (to {target}); an output never replaces a link '
                                      'or writes through one: remove it or choose another output folder.')
        assert os.readlink(link) == target
    assert (tmp_path / 'mine.tif').read_bytes() == b'mine'
