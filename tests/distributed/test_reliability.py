"""Nothing lost, nothing silently wrong.

* Every class of mistake stops the real entry point before training with one line (exit 2)
  and leaves the work dir byte for byte as it was: each case runs against a copy of a trained
  work dir with ``--resume auto``, so a check that came too late would visibly change it.
* A rollback (``--resume`` of an older checkpoint) moves the abandoned branch aside.
* One run per work dir: a second real run is refused naming the owner; a dead owner's lock is
  taken over.
* A full disk mid-run: one line with the path and errno, the last checkpoint intact, no
  temporary files, summary.json saying why.
* predict / evaluate / export refuse what would overwrite or silently misread files.
"""
import contextlib
import hashlib
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from ds_seg.config import REPO_ROOT
from ds_seg.engine import checkpoint
from ds_seg.engine.workdir import LOCK_NAME
from tests.dist import run_on_ranks
from tests.distributed.test_launchers import _env
from tests.tiny import TINY_CONFIG, read_jsonl

pytestmark = pytest.mark.slow


def _write_tif(path, array_CHW, crs='EPSG:32632', nodata=None):
    import rasterio
    from rasterio.transform import from_origin
    count, h, w = array_CHW.shape
    with rasterio.open(path, 'w', driver='GTiff', width=w, height=h, count=count, dtype=array_CHW.dtype,
                       crs=crs, transform=from_origin(500000, 5000000, 0.1, 0.1), nodata=nodata) as dst:
        dst.write(array_CHW)
    return str(path)


def _entry(name):
    """The command launch/<name>.py runs (ds_seg/cli/<name>.py)."""
    return importlib.import_module(f'ds_seg.cli.{name}')


def _run_main(name, argv):
    """(exit status, stderr lines, stdout) of the command's main() in this process."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = _entry(name).main(argv)
    return code, err.getvalue().strip().splitlines(), out.getvalue()


def _run_main_in(folder, name, argv):
    """:func:`_run_main` from ``folder`` (where the default work dir, work_dirs/<config>, is)."""
    os.chdir(folder)
    return _run_main(name, argv)


def _snapshot(folder):
    """Every file under ``folder`` with its content hash: equal snapshots = nothing changed."""
    snap = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, 'rb') as f:
                snap[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return snap


def _train_argv(tmp, work, *options, ds=None, resume=None):
    argv = ['--config', TINY_CONFIG, '--work-dir', work,
            '--deepspeed_config', ds or _ds_json(tmp, 'zero0_short', lambda d: None)]
    argv += ['--resume', resume] if resume else []
    return argv + ['--cfg-options', f'data.train.cache_dir={tmp}/cache', f'data.val.cache_dir={tmp}/cache',
                   'train.eval_interval=0', 'train.log_interval=4', 'train.keep_checkpoints=10',
                   'data.crop_size=32', *options]


# ------------------------------------------------------------------------------------------------
# Refused before training, work dir untouched
# ------------------------------------------------------------------------------------------------

def _data_cases(tmp):
    d = os.path.join(tmp, 'data')
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    img = _write_tif(os.path.join(d, 'img.tif'), rng.integers(0, 255, (3, 600, 600), dtype=np.uint8))
    good = rng.integers(0, 6, (1, 600, 600), dtype=np.uint8)
    lbl = _write_tif(os.path.join(d, 'lbl.tif'), good)
    one_bad = good.copy()
    one_bad[0, 300, 300] = 9  # one pixel the decimated label check (1 pixel in 2.34) never reads
    lbl_one_bad = _write_tif(os.path.join(d, 'lbl_one_bad.tif'), one_bad)
    lbl_unlabelled = _write_tif(os.path.join(d, 'lbl_unlabelled.tif'), np.full((1, 600, 600), 255, np.uint8))

    def data(label, **extra):
        return [f"data.train={dict(type='GeoTiffScenes', images=[img], labels=[label], classes=6, **extra)!r}",
                'data.val=None']
    return data, lbl, lbl_one_bad, lbl_unlabelled


def _ds_json(tmp, name, mutate):
    ds = json.loads((REPO_ROOT / 'ds_configs' / 'zero0.json').read_text())
    ds['optimizer']['params']['torch_adam'] = True
    ds['scheduler']['params']['warmup_num_steps'] = 2  # runs of 8-12 steps
    mutate(ds)
    path = os.path.join(tmp, f'{name}.json')
    with open(path, 'w') as f:
        json.dump(ds, f)
    return path


REFUSALS = {
    # name: (expected fragments of the one line)
    'ds_stage4': ["'zero_optimization.stage' is 4"],
    'ds_stage_typo': ["unknown key 'zero_optimization.stgae'", "'zero_optimization.stage'"],
    'ds_fp16_typo': ["unknown key 'fp16.enabeld'", "'fp16.enabled'"],
    'ds_optimizer': ["'optimizer.type' 'Adamm'"],
    'ds_lr_string': ["'optimizer.params.lr' must be a number", "'1e-3'"],
    'ds_clip_string': ["'gradient_clipping' must be a number"],
    'ds_scheduler': ["'scheduler.type' 'Cosine'", 'WarmupCosineLR'],
    'ds_betas': ["'optimizer.params.betas' must be two numbers", '[0.9]'],
    'ds_weight_decay': ["refused by AdamW", 'Invalid weight_decay value: -1'],
    'ds_warmup_negative': ["'scheduler.params.warmup_num_steps' must be a number >= 0, got -3"],
    'cfg_log_interval': ['train.log_interval must be a positive integer, got 0'],
    'cfg_keep_string': ["train.keep_checkpoints must be an integer >= 0", "'two'"],
    'cfg_workers': ['data.num_workers must be an integer in [0, 128], got -1'],
    'cfg_overlap': ['data.eval_overlap (32) must be smaller than the evaluation tile (32'],
    'cfg_crop_conflict': ['data.train.crop_size=64 conflicts with data.crop_size=32'],
    # A folder (refused at config load). A missing file is refused by a run that reads it
    # (test_bad_input); a resumed run does not (test_training).
    'cfg_load_from': ["is a folder; give the weights file written by launch/export.py"],
    'data_one_bad_pixel': ['lbl_one_bad.tif', '1 pixel(s) have label value 9'],
    'data_unlabelled': ['lbl_unlabelled.tif', 'no pixel is labelled'],
    'data_ignore_is_a_class': ['ignore_index 0 is also class 0'],
    'loss_ignore_mismatch': ['loss.ignore_index is 100', 'data.train marks padding and nodata with 255'],
    'resume_shape': ['differently shaped model', 'bilinear=(default) there, True here'],
    'resume_backend': ['is a deepspeed checkpoint but this run uses --backend ddp', 'load_from='],
    'resume_stage': ['was saved under ZeRO-0 but the DeepSpeed config uses ZeRO-2', 'load_from='],
    'model_num_classes': ['model.num_classes is 4 but data.train has 6 classes'],
    'busy': ['is in use by another run', 'pid'],
    'resume_optimizer': ["holds the state of optimizer 'adam' but the DeepSpeed config uses 'sgd'", 'load_from='],
    'resume_precision': ['but this run uses bf16', 'load_from='],
    'loss_class_weight': ['loss.class_weight has 2 value(s)', 'data.train has 6 classes'],
    'ds_no_optimizer': ["no 'optimizer' block"],
    'resume_past_max_steps': ['--resume: ', 'step_00000012 is at step 12, past train.max_steps=8'],
}


def _refusal_argv(tmp, trained, case):
    data, lbl, lbl_one_bad, lbl_unlabelled = _data_cases(tmp)
    work = os.path.join(tmp, 'cases', case)
    shutil.copytree(trained, work)
    ds = None
    options = []
    mutations = {
        'ds_stage4': lambda d: d['zero_optimization'].update(stage=4),
        'ds_stage_typo': lambda d: d['zero_optimization'].update(stgae=0),
        'ds_fp16_typo': lambda d: d.update(fp16={'enabeld': True}),
        'ds_optimizer': lambda d: d['optimizer'].update(type='Adamm'),
        'ds_lr_string': lambda d: d['optimizer']['params'].update(lr='1e-3'),
        'ds_clip_string': lambda d: d.update(gradient_clipping='1.0'),
        'ds_scheduler': lambda d: d['scheduler'].update(type='Cosine'),
        'ds_betas': lambda d: d['optimizer']['params'].update(betas=[0.9]),
        'ds_weight_decay': lambda d: d['optimizer']['params'].update(weight_decay=-1),
        'ds_warmup_negative': lambda d: d['scheduler']['params'].update(warmup_num_steps=-3),
        'resume_stage': lambda d: d['zero_optimization'].update(stage=2),
        'resume_optimizer': lambda d: d.update(optimizer={'type': 'SGD', 'params': {'lr': 0.01}}),
        'resume_precision': lambda d: (d.pop('fp16'), d.update(bf16={'enabled': True})),
        'ds_no_optimizer': lambda d: d.pop('optimizer'),
    }
    if case in mutations:
        ds = _ds_json(tmp, case, mutations[case])
    options = {
        'cfg_log_interval': ['train.log_interval=0'],
        'cfg_keep_string': ["train.keep_checkpoints='two'"],
        'cfg_workers': ['data.num_workers=-1'],
        'cfg_overlap': ['data.eval_overlap=32'],
        'cfg_crop_conflict': ['data.train.crop_size=64'],
        'cfg_load_from': [f'load_from={tmp!r}'],
        'data_one_bad_pixel': data(lbl_one_bad),
        'data_unlabelled': data(lbl_unlabelled),
        'data_ignore_is_a_class': data(lbl, ignore_index=0),
        'loss_ignore_mismatch': data(lbl) + ['loss.ignore_index=100'],
        'resume_shape': ['model.bilinear=True'],
        'model_num_classes': ['model.num_classes=4'],
        'loss_class_weight': ['loss.class_weight=[1.0, 2.0]'],
        'resume_past_max_steps': ['train.max_steps=8'],
    }.get(case, [])
    argv = _train_argv(tmp, work, 'train.max_steps=12', *options, ds=ds, resume='auto')
    return argv + (['--backend', 'ddp'] if case == 'resume_backend' else []), work


def _refusals(tmp, trained, cases):
    from ds_seg.engine.workdir import _process_start, identity
    sleeper = subprocess.Popen(['sleep', '600'])  # a live process that owns the 'busy' work dir
    results = {}
    try:
        for case in cases:
            argv, work = _refusal_argv(tmp, trained, case)
            if case == 'busy':
                with open(os.path.join(work, LOCK_NAME), 'w') as f:
                    json.dump(dict(identity(), pid=sleeper.pid, pid_start=_process_start(sleeper.pid)), f)
            before = _snapshot(work)
            code, lines, out = _run_main('train', argv)
            results[case] = (code, lines, before == _snapshot(work), out)
    finally:
        sleeper.kill()
    return results


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A tiny UNetTiny run (base_channels 8) with checkpoints at steps 4, 8 and 12."""
    tmp = str(tmp_path_factory.mktemp('reliability'))
    work = os.path.join(tmp, 'trained')
    argv = _train_argv(tmp, work, 'train.max_steps=12', 'train.checkpoint_interval=4')
    code, lines, out = run_on_ranks(_run_main, 1, args=('train', argv), timeout=300)[0]
    assert code == 0, lines
    return tmp, work


@pytest.fixture(scope='module')
def refusals(trained):
    tmp, work = trained
    return run_on_ranks(_refusals, 1, args=(tmp, work, sorted(REFUSALS)), timeout=400)[0]


@pytest.mark.parametrize('case', sorted(REFUSALS))
def test_mistakes_stop_with_one_line_and_leave_the_work_dir_untouched(refusals, case):
    from ds_seg.config import device_supports
    if case == 'resume_precision' and not device_supports('bf16'):
        pytest.skip('native bf16 falls back to fp32 on this CPU: the same optimizer state as the saved run')
    code, lines, unchanged, out = refusals[case]
    assert code == 2, lines
    assert 'resumed from' not in out, out  # a refused resume is not said to have resumed
    errors = [line for line in lines if line.startswith('ds_seg: error:')]
    assert len(errors) == 1 and not any('Traceback' in line for line in lines), lines
    for fragment in REFUSALS[case]:
        assert fragment in errors[0], errors[0]
    assert unchanged, f'{case}: the work dir changed'


def test_label_scan_is_cached_by_file_identity(trained, tmp_path):
    """The full label scan runs once per file; rewriting a file (same name) scans it again."""
    from ds_seg.data.geotiff import LABELS_CACHE_FILE, GeoTiffScenes
    data, lbl, lbl_one_bad, _ = _data_cases(str(tmp_path))
    img = os.path.join(str(tmp_path), 'data', 'img.tif')
    GeoTiffScenes([img], [lbl], crop_size=32, classes=6)
    cache = json.load(open(os.path.join(os.path.dirname(lbl), LABELS_CACHE_FILE)))
    assert sum(cache[os.path.abspath(lbl)]['values'].values()) == 600 * 600
    shutil.copy(lbl_one_bad, lbl)  # same name, new content
    with pytest.raises(ValueError, match='label value 9'):
        GeoTiffScenes([img], [lbl], crop_size=32, classes=6)


def test_band_statistics_cache_follows_rewritten_images(tmp_path):
    from ds_seg.data.geotiff import GeoTiffScenes
    img = os.path.join(str(tmp_path), 'img.tif')
    lbl = _write_tif(os.path.join(str(tmp_path), 'lbl.tif'), np.zeros((1, 64, 64), np.uint8))
    _write_tif(img, np.full((3, 64, 64), 10, np.uint8))
    first = GeoTiffScenes([img], [lbl], crop_size=32, classes=2)
    stat = os.stat(img)
    _write_tif(img, np.full((3, 64, 64), 200, np.uint8))  # same name and size
    os.utime(img, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even the old mtime restored
    second = GeoTiffScenes([img], [lbl], crop_size=32, classes=2)
    assert first.mean[0] == pytest.approx(10) and second.mean[0] == pytest.approx(200)


# ------------------------------------------------------------------------------------------------
# A loss that stops being finite
# ------------------------------------------------------------------------------------------------

def test_a_non_finite_loss_stops_with_exit_3_and_keeps_the_last_checkpoint(trained):
    """An LR of 1e30 (real training, no fault injected): DeepSpeed's warm-up gives step 1 an LR of
    0 and step 2 1e28, so the weights reach ~1e28 and every forward from step 3 on overflows. With
    max_nonfinite_steps=2 the run stops after step 4 with exit 3; checkpoints (every step) exist for
    steps 1 and 2 only, the weights of steps 3-4 are never saved. Step 2's checkpoint holds the
    weights that gave step 3's loss (the loss comes before the update): the line says so and names
    step 1's, whose weights are the untouched initial ones (DeepSpeed's fp16 optimizer took one
    step at the JSON's lr while it was built: every weight was ~1e28 before step 1)."""
    tmp, _ = trained
    work = os.path.join(tmp, 'nonfinite')
    ds = _ds_json(tmp, 'huge_lr', lambda d: d['optimizer']['params'].update(lr=1e30))
    argv = _train_argv(tmp, work, 'train.max_steps=12', 'train.checkpoint_interval=1', 'train.log_interval=1',
                       'train.max_nonfinite_steps=2', ds=ds)
    code, lines, out = run_on_ranks(_run_main, 1, args=('train', argv), timeout=300)[0]
    assert code == 3, (lines, out[-2000:])
    assert 'stopping at step 4: the loss was not finite for 2 consecutive steps (from step 3); the checkpoint of ' \
           'step 2 holds the weights that gave the first of them: go on from step_00000001 with a lower learning ' \
           f'rate (--resume {os.path.join(work, "checkpoints", "step_00000001")})' in out, out[-2000:]
    # The checkpoint due at step 3 is not written, and said (a run ending there said nothing).
    assert ('step 3: no checkpoint: the loss was not finite for the last 1 step(s), so the weights may be too; the '
            'last checkpoint is kept as it is') in out, out[-2000:]
    losses = [r['loss'] for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))]
    assert [math.isfinite(x) for x in losses] == [True, True, False, False], losses
    root = os.path.join(work, 'checkpoints')
    assert sorted(t for t in os.listdir(root) if t.startswith('step_')) == ['step_00000001', 'step_00000002']
    assert checkpoint.find_latest(root) == 'step_00000002' and checkpoint.verify(root, 'step_00000002') is None
    first = checkpoint.consolidated_state_dict(os.path.join(root, 'step_00000001'))
    assert all(torch.isfinite(v).all() for v in first.values() if v.is_floating_point())
    assert max(float(v.abs().max()) for k, v in first.items() if v.is_floating_point() and 'weight' in k) < 10
    summary = json.load(open(os.path.join(work, 'summary.json')))
    assert summary['exit_reason'] == 'nonfinite_loss' and summary['steps'] == 4


def test_a_bad_window_found_mid_run_is_one_line_with_exit_65_not_a_traceback(trained):
    """A label served over HTTP is not scanned whole at start-up (that would download it): a
    stray value the decimated check does not sample is found by the window that holds it. The
    run stops with one line naming the URL, the window and the value (a DataLoader worker's
    traceback unwrapped) and exit status 65 (EX_DATAERR)."""
    from ds_seg.data.rangeserver import RangeServer
    tmp, _ = trained
    served = os.path.join(tmp, 'served')
    os.makedirs(served, exist_ok=True)
    rng = np.random.default_rng(3)
    _write_tif(os.path.join(served, 'img.tif'), rng.integers(0, 255, (3, 512, 512), dtype=np.uint8))
    label = rng.integers(0, 6, (1, 512, 512), dtype=np.uint8)
    label[0, 6::16, 9::16] = 7  # even rows only: a nearest read at half size samples odd ones
    _write_tif(os.path.join(served, 'lbl.tif'), label)
    work = os.path.join(tmp, 'bad_window')
    with RangeServer(served) as server:
        data = dict(type='GeoTiffScenes', images=[server.url('img.tif')], labels=[server.url('lbl.tif')],
                    classes=6, mean=[127.0] * 3, std=[73.0] * 3)
        argv = _train_argv(tmp, work, 'train.max_steps=8', f'data.train={data!r}', 'data.val=None',
                           'data.num_workers=1')
        proc = subprocess.run([sys.executable, 'launch/train.py', *argv], cwd=REPO_ROOT, env=_env(),
                              capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if 'error' in line.lower()]
    assert proc.returncode == 65, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith('ds_seg: error: http://127.0.0.1:') and 'lbl.tif: label value 7 in window' in errors[0]
    # What the line says of checkpoints is true: it said "the last checkpoint is intact" with none.
    root = os.path.join(work, 'checkpoints')
    last = checkpoint.find_latest(root) if os.path.isdir(root) else None
    assert (f'the last complete checkpoint ({last}) is intact' if last else
            'no checkpoint was written; fix the file, then start the run again') in errors[0], errors[0]


# ------------------------------------------------------------------------------------------------
# Rollback: the abandoned branch is moved aside, and every command agrees on the live one
# ------------------------------------------------------------------------------------------------

def test_rollback_moves_the_abandoned_branch_aside_and_all_commands_agree(trained):
    tmp, original = trained
    work = os.path.join(tmp, 'rollback')
    shutil.copytree(original, work)
    old = {t: _snapshot(os.path.join(work, 'checkpoints', t)) for t in ('step_00000008', 'step_00000012')}
    old_rows = [r for r in read_jsonl(os.path.join(work, 'metrics.jsonl')) if r['step'] > 4]
    old_summary = json.load(open(os.path.join(work, 'summary.json')))
    assert old_summary['steps'] == 12
    argv = _train_argv(tmp, work, 'train.max_steps=8', 'train.checkpoint_interval=4',
                       resume=os.path.join(work, 'checkpoints', 'step_00000004'))
    code, lines, out = run_on_ranks(_run_main, 1, args=('train', argv), timeout=300)[0]
    assert code == 0, lines
    assert 'abandons a later branch' in out and 'nothing deleted' in out, out
    aside = [os.path.join(work, 'abandoned', d) for d in os.listdir(os.path.join(work, 'abandoned'))]
    assert len(aside) == 1
    for tag, snap in old.items():  # the abandoned checkpoints, byte for byte
        assert _snapshot(os.path.join(aside[0], 'checkpoints', tag)) == snap
    assert read_jsonl(os.path.join(aside[0], 'metrics.jsonl')) == old_rows
    # The abandoned branch's end goes with it; the live summary is this run's (it was written over).
    assert json.load(open(os.path.join(aside[0], 'summary.json'))) == old_summary
    assert json.load(open(os.path.join(work, 'summary.json')))['steps'] == 8
    root = os.path.join(work, 'checkpoints')
    assert sorted(t for t in os.listdir(root) if t.startswith('step_')) == ['step_00000004', 'step_00000008']
    assert open(os.path.join(root, 'latest')).read() == 'step_00000008'
    live = os.path.join(root, 'step_00000008')
    assert checkpoint.find_checkpoint(work) == live                    # export, predict, evaluate
    assert checkpoint.resolve_resume('auto', work) == (root, 'step_00000008')
    assert [r['step'] for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))] == [4, 8]


def test_resuming_another_runs_checkpoint_sets_this_work_dirs_own_lineage_aside(trained):
    """--resume <another run's step_4> into a work dir with a run of its own: its rows up to step 4
    stayed live, followed by the other run's continuation (a loss series that jumped), and the
    resumed run logged on to its tracker runs."""
    tmp, original = trained
    work = os.path.join(tmp, 'foreign')
    shutil.copytree(original, work)
    own_rows = read_jsonl(os.path.join(work, 'metrics.jsonl'))
    other = os.path.join(tmp, 'other')
    argv = _train_argv(tmp, other, 'train.max_steps=4', 'train.checkpoint_interval=4', 'train.seed=7')
    assert run_on_ranks(_run_main, 1, args=('train', argv), timeout=300)[0][0] == 0
    argv = _train_argv(tmp, work, 'train.max_steps=8', 'train.checkpoint_interval=4', 'train.seed=7',
                       resume=os.path.join(other, 'checkpoints', 'step_00000004'))
    # Into the config's default work dir (no --work-dir), where a run of its own holds checkpoints:
    # refused, as a fresh run there is; nothing of it moves.
    launch = os.path.join(tmp, 'launch')
    default = os.path.join(launch, 'work_dirs', 'unet_tiny_synthetic')
    shutil.copytree(original, default)
    before = _snapshot(default)
    unnamed = [a for i, a in enumerate(argv) if '--work-dir' not in argv[max(i - 1, 0):i + 1]]
    code, lines, _ = run_on_ranks(_run_main_in, 1, args=(launch, 'train', unnamed), timeout=300)[0]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"ds_seg: error: --resume: {other}/checkpoints/step_00000004 is another run's checkpoint, "
                        "and the default work dir work_dirs/unet_tiny_synthetic holds checkpoints of an earlier run "
                        "of its own; give --work-dir: a new folder to continue that checkpoint in, or this one to "
                        "set its checkpoints aside (moved to abandoned/, nothing deleted).")
    assert _snapshot(default) == before
    code, lines, out = run_on_ranks(_run_main, 1, args=('train', argv), timeout=300)[0]
    assert code == 0, lines
    assert "another run's checkpoint: this work dir's own checkpoints were moved to" in out, out
    assert [r['step'] for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))] == [8]   # the other lineage's
    previous = [os.path.join(work, 'previous', d) for d in os.listdir(os.path.join(work, 'previous'))]
    assert len(previous) == 1 and read_jsonl(os.path.join(previous[0], 'metrics.jsonl')) == own_rows
    aside = os.listdir(os.path.join(work, 'abandoned'))
    assert len(aside) == 1 and sorted(os.listdir(os.path.join(work, 'abandoned', aside[0], 'checkpoints'))) == [
        'latest', 'step_00000004', 'step_00000008', 'step_00000012']
    # Another lineage set aside, not a branch of the one that goes on here: --resume of it is a foreign run's.
    assert checkpoint.abandoned_branch_of(work, os.path.join(work, 'abandoned', aside[0], 'checkpoints')) is None
    assert sorted(os.listdir(os.path.join(other, 'checkpoints'))) == ['latest', 'step_00000004']  # untouched


# ------------------------------------------------------------------------------------------------
# One run per work dir, with real processes
# ------------------------------------------------------------------------------------------------

def _train_process(argv, **env):
    return subprocess.Popen([sys.executable, 'launch/train.py', *argv], cwd=REPO_ROOT, env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_work_dir_inside_another_runs_checkpoints_is_refused(trained):
    """--work-dir <run>/checkpoints/step_N (or the checkpoints folder itself) trained without a word;
    that run's keep_checkpoints pruning later deleted the step folder, and this run with it."""
    tmp, _ = trained
    other = os.path.join(tmp, 'other_run')
    shutil.copytree(os.path.join(tmp, 'trained'), other)
    before = _snapshot(other)
    for work in (os.path.join(other, 'checkpoints', 'step_00000012', 'nested'), os.path.join(other, 'checkpoints')):
        code, lines, out = run_on_ranks(_run_main, 1, args=('train', _train_argv(tmp, work, 'train.max_steps=2')),
                                        timeout=300)[0]
        errors = [line for line in lines if line.startswith('ds_seg: error:')]
        assert code == 2 and len(errors) == 1 and 'Traceback' not in out, out[-3000:]
        assert f'is inside the checkpoints of the run in {other}' in errors[0], errors[0]
    assert _snapshot(other) == before, 'nothing written into the other run'


def test_a_second_run_on_a_busy_work_dir_is_refused_and_a_dead_owner_is_taken_over(trained):
    tmp, _ = trained
    work = os.path.join(tmp, 'busy')
    first = _train_process(_train_argv(tmp, work, 'train.max_steps=100000', 'train.checkpoint_interval=0'))
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(work, 'metrics.jsonl')):
        assert first.poll() is None and time.time() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.1)
    before = _snapshot(work)
    second = _train_process(_train_argv(tmp, work, 'train.max_steps=8'))
    out = second.communicate(timeout=120)[0]
    assert second.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith('ds_seg: error:')]
    assert len(errors) == 1 and f'pid {first.pid}' in errors[0], out[-3000:]
    assert 'Traceback' not in out and 'job array' not in out
    # A task of a job array given the array's one WORK_DIR: told how each gets its own.
    task = _train_process(_train_argv(tmp, work, 'train.max_steps=8'), SLURM_ARRAY_TASK_ID='1')
    out = task.communicate(timeout=120)[0]
    assert task.returncode == 2 and "expand WORK_DIR='work_dirs/name-%a' per task)" in out, out[-3000:]
    first.send_signal(signal.SIGKILL)
    first.communicate()
    after = _snapshot(work)
    assert {k: v for k, v in after.items() if k in before and not k.startswith(('metrics', 'tb'))} == \
        {k: v for k, v in before.items() if not k.startswith(('metrics', 'tb'))}, 'the refused run wrote nothing'
    third = _train_process(_train_argv(tmp, os.path.join(tmp, 'busy'), 'train.max_steps=8', resume='auto'))
    out = third.communicate(timeout=240)[0]
    assert third.returncode == 0, out[-3000:]
    assert 'took over the work-dir lock of a run that is gone' in out and f'pid {first.pid}' in out
    assert not os.path.exists(os.path.join(work, LOCK_NAME)), 'released at the end'


# ------------------------------------------------------------------------------------------------
# A full disk mid-run
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / 'disk'
    mount.mkdir()
    try:
        subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=16m', 'tmpfs', str(mount)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f'cannot mount a small tmpfs here (needs root): {exc}')
    yield str(mount)
    subprocess.run(['umount', '-l', str(mount)], check=False)


def test_a_full_disk_mid_run_stops_with_one_line_and_keeps_the_last_checkpoint(trained, small_disk):
    tmp, original = trained
    size = sum(os.path.getsize(os.path.join(original, 'checkpoints', 'step_00000004', f))
               for f in os.listdir(os.path.join(original, 'checkpoints', 'step_00000004')))
    work = os.path.join(small_disk, 'run')
    # Room for the logs and about 1.5 checkpoints: the first save fits, the second cannot.
    filler = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - int(1.5 * size) - 200_000
    assert filler > 0, 'tmpfs too small for this checkpoint size'
    with open(os.path.join(small_disk, 'filler'), 'wb') as f:
        f.write(b'\0' * filler)
    proc = _train_process(_train_argv(tmp, work, 'train.max_steps=12', 'train.checkpoint_interval=4'))
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 74, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith('ds_seg: error:')]
    assert len(errors) == 1 and 'Traceback' not in out, out[-3000:]
    assert 'No space left on device' in errors[0] and 'ENOSPC' in errors[0] and work in errors[0], errors[0]
    root = os.path.join(work, 'checkpoints')
    assert checkpoint.find_checkpoint(work) == os.path.join(root, 'step_00000004')
    assert checkpoint.verify(root, 'step_00000004') is None
    assert not [n for n in os.listdir(root) if n.startswith('.tmp')], 'no partial checkpoint left'
    assert not [n for n in os.listdir(work) if n.endswith('.tmp')]
    summary = json.load(open(os.path.join(work, 'summary.json')))
    assert summary['exit_reason'] == 'io_error' and 'No space left' in summary['error']


def test_a_disk_too_full_for_the_next_checkpoint_stops_two_ranks_at_once(trained, small_disk):
    """Two ranks, ZeRO-1 (each rank writes its optimizer shard): rank 0 failed inside DeepSpeed's
    save while rank 1 waited in DeepSpeed's barrier, and both sat out the distributed timeout,
    then exited 4 blaming the network, the partial checkpoint left filling the disk. A disk with
    less room than the last checkpoint took stops both ranks before they write."""
    tmp, _ = trained
    work = os.path.join(small_disk, 'run2')
    ds = _ds_json(tmp, 'zero1_short', lambda d: d['zero_optimization'].update(stage=1))
    argv = _train_argv(tmp, work, 'train.max_steps=12', 'train.checkpoint_interval=4', ds=ds)
    env = _env(DS_SEG_DIST_TIMEOUT='120', DS_SEG_FAULT='slow@step:0.3')
    proc = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                             'launch/train.py', *argv], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first = os.path.join(work, 'checkpoints', 'step_00000004')
    deadline = time.time() + 240
    while not os.path.isfile(os.path.join(first, checkpoint.COMPLETE)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    size = sum(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first))
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    with open(os.path.join(small_disk, 'filler'), 'wb') as f:   # room for the logs, not for step 8
        f.write(b'\0' * max(0, free - size // 2))
    started = time.time()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and time.time() - started < 60, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith('ds_seg: error:')]
    assert errors and all('ENOSPC' in e and work in e for e in errors), out[-3000:]
    assert 'network' not in out and 'stopped responding' not in out, out[-3000:]   # (torchrun reports exit 74)
    root = os.path.join(work, 'checkpoints')
    assert checkpoint.find_checkpoint(work) == first and checkpoint.verify(root, 'step_00000004') is None
    assert not [n for n in os.listdir(root) if n.startswith('.tmp')], 'no partial checkpoint left'
    summary = json.load(open(os.path.join(work, 'summary.json')))
    assert summary['exit_reason'] == 'io_error'


def _rank_pid(launcher_pid, rank):
    """The pid of ``launcher_pid``'s child process whose environment says RANK=<rank>."""
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat') as f:
                parent = int(f.read().rsplit(')', 1)[1].split()[1])
            with open(f'/proc/{entry}/environ', 'rb') as f:
                environ = f.read().split(b'\0')
        except OSError:   # gone, or not ours to read
            continue
        if parent == launcher_pid and f'RANK={rank}'.encode() in environ:
            return int(entry)
    return None


@pytest.mark.parametrize('backend, stage, failing_rank', [('deepspeed', 1, 1), ('deepspeed', 3, 0), ('ddp', 0, 0)])
def test_a_write_failing_on_one_rank_mid_checkpoint_stops_every_rank_at_once(trained, backend, stage, failing_rank):
    """One rank's checkpoint write fails for real (its file-size limit lowered with prlimit after
    the first checkpoint: EFBIG inside torch.save) while the other rank's succeeds. The failing
    rank left DeepSpeed's save before its closing barrier (DDP's: before the barrier after rank
    0's write), the other rank waited there, and both sat out DS_SEG_DIST_TIMEOUT, then exited
    blaming the network. Now both stop at once with the failing rank's line, exit 74, and the
    last complete checkpoint intact."""
    tmp, _ = trained
    work = os.path.join(tmp, f'efbig_{backend}{stage}_rank{failing_rank}')
    ds = _ds_json(tmp, f'zero{stage}_short', lambda d: d['zero_optimization'].update(stage=stage))
    argv = _train_argv(tmp, work, 'train.max_steps=40', 'train.checkpoint_interval=4', ds=ds)
    env = _env(DS_SEG_DIST_TIMEOUT='180', DS_SEG_FAULT='slow@step:0.3')
    proc = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2',
                             'launch/train.py', '--backend', backend, *argv], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = os.path.join(work, 'checkpoints', 'step_00000004')
    deadline = time.time() + 240
    while not os.path.isfile(os.path.join(first, checkpoint.COMPLETE)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    # The failing rank's largest checkpoint file fails half-way; every other file it writes
    # (rank 0: the logs) stays far below that.
    own = [f for f in os.listdir(first) if (f'zero_pp_rank_{failing_rank}_' in f if backend == 'deepspeed'
                                            else f.endswith('.pt'))]
    limit = max(os.path.getsize(os.path.join(first, f)) for f in own) // 2
    assert limit > 50 * os.path.getsize(os.path.join(work, 'metrics.jsonl')), limit
    pid = _rank_pid(proc.pid, failing_rank)
    assert pid is not None
    subprocess.run(['prlimit', f'--pid={pid}', f'--fsize={limit}'], check=True)
    started = time.time()
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and time.time() - started < 60, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith('ds_seg: error:')]
    assert errors and all('.tmp-step_00000008' in e for e in errors), out[-3000:]
    assert 'network' not in out and 'stopped responding' not in out, out[-3000:]   # (torchrun reports exit 74)
    root = os.path.join(work, 'checkpoints')
    assert checkpoint.find_checkpoint(work) == first and checkpoint.verify(root, 'step_00000004') is None
    assert not [n for n in os.listdir(root) if n.startswith('.tmp')], 'no partial checkpoint left'
    summary = json.load(open(os.path.join(work, 'summary.json')))
    assert summary['exit_reason'] == 'io_error', summary


# ------------------------------------------------------------------------------------------------
# predict / evaluate / export
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def exported(trained):
    tmp, work = trained
    weights = os.path.join(tmp, 'weights.pt')
    checkpoint.export(checkpoint.find_checkpoint(work), weights)
    d = os.path.join(tmp, 'scenes')
    os.makedirs(os.path.join(d, 'a'))
    os.makedirs(os.path.join(d, 'b'))
    rng = np.random.default_rng(1)
    scene = rng.integers(0, 255, (3, 48, 48), dtype=np.uint8)
    a = _write_tif(os.path.join(d, 'a', 'x.tif'), scene)
    b = _write_tif(os.path.join(d, 'b', 'x.tif'), scene[:, ::-1].copy())
    return tmp, weights, a, b


def _one_line(code, lines, program):
    assert code == 2, lines
    errors = [line for line in lines if line.startswith(f'{program}: error:')]
    assert len(errors) == 1 and not any('Traceback' in line for line in lines), lines
    return errors[0]


def _cli_cases(tmp, weights, a, b):
    out = os.path.join(tmp, 'pred')
    results = {}
    common = ['--checkpoint', weights, '--tile', '32', '--block', '32', '--device', 'cpu']
    results['same_names'] = _run_main('predict', [*common, '--input', a, b, '--output', out])
    results['again'] = _run_main('predict', [*common, '--input', a, b, '--output', out])
    results['folder_input'] = _run_main('predict', [*common, '--input', os.path.dirname(a),
                                                    '--output', os.path.join(tmp, 'pred_dir')])
    clash = os.path.join(tmp, 'clash')
    os.makedirs(clash)
    shutil.copy(a, os.path.join(clash, 'y.tif'))
    shutil.copy(a, os.path.join(clash, 'y_classes.tif'))
    results['replaces_input'] = _run_main('predict', [*common, '--input', os.path.join(clash, 'y.tif'),
                                                      os.path.join(clash, 'y_classes.tif'), '--output', clash])
    results['overlap'] = _run_main('predict', [*common, '--overlap', '32', '--input', a, '--output', out + '2'])
    empty = os.path.join(tmp, 'empty.tif')
    open(empty, 'wb').close()
    results['empty_input'] = _run_main('predict', [*common, '--input', empty, '--output', out + '3'])
    truncated = os.path.join(tmp, 'truncated.tif')
    _write_tif(truncated, np.random.default_rng(2).integers(0, 255, (3, 300, 300), dtype=np.uint8))
    with open(truncated, 'r+b') as f:
        f.truncate(os.path.getsize(truncated) // 2)
    results['truncated_input'] = _run_main('predict', [*common, '--input', truncated, '--output', out + '4'])
    results['raster_checkpoint'] = _run_main('predict', ['--checkpoint', a, '--input', a, '--output', out + '5'])
    wide = _write_tif(os.path.join(tmp, 'wide.tif'), (np.random.default_rng(3).integers(0, 255, (3, 64, 64)) * 200)
                      .astype(np.uint16))  # the model was trained on uint8: its statistics are in those units
    results['other_pixel_type'] = _run_main('predict', [*common, '--input', wide, '--output', out + '7'])
    results['dates_for_one_date_model'] = _run_main('predict', [*common, '--input', f'{a},{b}', '--output', out + '9'])
    payload = torch.load(weights, map_location='cpu', weights_only=True)
    payload['model'] = dict(payload['model'], num_classes=3)  # the tensors (and their SHA-256) unchanged
    edited = os.path.join(tmp, 'edited.pt')
    torch.save(payload, edited)
    results['weights_model_edited'] = _run_main('predict', [*common[:1], edited, *common[2:], '--input', a,
                                                            '--output', out + '8'])

    class Evil:
        def __reduce__(self):
            return (os.system, ('touch ' + os.path.join(tmp, 'pwned'),))
    evil = os.path.join(tmp, 'evil.pt')
    torch.save({'state_dict': {}, 'model': {'type': 'UNetTiny'}, 'payload': Evil()}, evil)
    results['code_pickle'] = _run_main('predict', ['--checkpoint', evil, '--input', a, '--output', out + '6'])
    label = _write_tif(os.path.join(tmp, 'label_other_crs.tif'), np.zeros((1, 48, 48), np.uint8), crs='EPSG:4326')
    results['eval_crs'] = _run_main('evaluate', ['--checkpoint', weights, '--images', a, '--labels', label,
                                                 '--output', os.path.join(tmp, 'eval')])
    results['export_onto_folder'] = _run_main('export', [os.path.join(tmp, 'trained'), '--out', tmp])
    # A folder that does not exist yet, named by its trailing '/': once failed after the export's
    # work, as exit 74 ('writing ... failed: ENOENT'), or blamed on the model under --format onnx.
    results['export_onto_new_folder'] = _run_main('export', [os.path.join(tmp, 'trained'), '--out',
                                                            os.path.join(tmp, 'exports_new') + '/'])
    results['export_missing_parent'] = _run_main('export', [os.path.join(tmp, 'trained'), '--out',
                                                            os.path.join(tmp, 'nope', 'w.pt')])
    results['export_existing'] = _run_main('export', [os.path.join(tmp, 'trained'), '--out', weights])
    unlabelled = _write_tif(os.path.join(tmp, 'label_unlabelled.tif'), np.full((1, 48, 48), 255, np.uint8))
    results['eval_unlabelled'] = _run_main('evaluate', ['--checkpoint', weights, '--images', a, '--labels', unlabelled,
                                                        '--output', os.path.join(tmp, 'eval_u')])
    out_of_range = _write_tif(os.path.join(tmp, 'label_out_of_range.tif'), np.full((1, 48, 48), 9, np.uint8))
    results['eval_out_of_range'] = _run_main('evaluate', ['--checkpoint', weights, '--images', a, '--labels', out_of_range,
                                                          '--output', os.path.join(tmp, 'eval_r')])
    nodata0 = _write_tif(os.path.join(tmp, 'label_nodata0.tif'), np.zeros((1, 48, 48), np.uint8), nodata=0)
    results['eval_label_nodata'] = _run_main('evaluate', ['--checkpoint', weights, '--images', a, '--labels', nodata0,
                                                          '--output', os.path.join(tmp, 'eval_n')])
    flipped = os.path.join(tmp, 'flipped.pt')
    state = checkpoint.load_weights_file(weights)['state_dict']
    raw = max(state.values(), key=lambda t: t.numel()).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data = bytearray(open(weights, 'rb').read())
    data[data.find(raw) + len(raw) // 2] ^= 0x01  # one bit of one weight, same size
    with open(flipped, 'wb') as f:
        f.write(bytes(data))
    results['weights_changed'] = _run_main('predict', [*common, '--checkpoint', flipped, '--input', a,
                                                       '--output', out + '7'])
    results['json_checkpoint'] = _run_main('predict', ['--checkpoint', os.path.join(tmp, 'zero0_short.json'),
                                                       '--input', a, '--output', out + '8'])
    results['pwned'] = os.path.exists(os.path.join(tmp, 'pwned'))
    results.update(_code_pickle_cases(tmp, a))
    return results


class _RunsCode:
    """Unpickling this runs ``touch <marker>``: proof that a loader executed the file's code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}',))


def _poisoned_work_dir(tmp):
    """A copy of the trained work dir whose newest checkpoint carries code in its model-states
    file, with sizes and SHA-256 recorded to match (a consistent checkpoint from elsewhere, which
    verification alone would accept)."""
    from ds_seg.engine.ds_workarounds import safe_torch_load
    work = os.path.join(tmp, 'poisoned')
    shutil.copytree(os.path.join(tmp, 'trained'), work)
    step = os.path.join(work, 'checkpoints', 'step_00000012')
    name = next(n for n in os.listdir(step) if n.endswith('model_states.pt'))
    state = safe_torch_load(os.path.join(step, name), map_location='cpu')
    state['payload'] = _RunsCode(os.path.join(tmp, 'pwned_checkpoint'))
    torch.save(state, os.path.join(step, name))
    marker = json.load(open(os.path.join(step, checkpoint.COMPLETE)))
    marker['files'][name] = os.path.getsize(os.path.join(step, name))
    marker['sha256'][name] = checkpoint.sha256_file(os.path.join(step, name))
    with open(os.path.join(step, checkpoint.COMPLETE), 'w') as f:
        json.dump(marker, f)
    assert checkpoint.verify(os.path.join(work, 'checkpoints'), 'step_00000012') is None
    return work, step


def _code_pickle_cases(tmp, scene):
    """Every loader given a file that carries code: (exit status or the exception, stderr lines)."""
    weights = os.path.join(tmp, 'runs_code.pt')
    torch.save({'state_dict': {}, 'model': {'type': 'UNetTiny'}, 'payload': _RunsCode(os.path.join(tmp, 'pwned_weights'))},
               weights)
    work, step = _poisoned_work_dir(tmp)
    label = _write_tif(os.path.join(tmp, 'label_ok.tif'), np.zeros((1, 48, 48), np.uint8))
    cases = {
        'pickle_evaluate_weights': ('evaluate', ['--checkpoint', weights, '--images', scene, '--labels', label,
                                                 '--output', os.path.join(tmp, 'eval_w')]),
        'pickle_load_from': ('train', _train_argv(tmp, os.path.join(tmp, 'load_evil'), 'train.max_steps=4',
                                                  f'load_from={weights!r}')),
        'pickle_export_checkpoint': ('export', [work, '--out', os.path.join(tmp, 'poisoned.pt')]),
        'pickle_predict_checkpoint': ('predict', ['--checkpoint', step, '--input', scene,
                                                  '--output', os.path.join(tmp, 'pred_p')]),
        'pickle_evaluate_checkpoint': ('evaluate', ['--checkpoint', work, '--images', scene, '--labels', label,
                                                    '--output', os.path.join(tmp, 'eval_p')]),
        'pickle_resume': ('train', _train_argv(tmp, work, 'train.max_steps=16', resume='auto')),
    }
    results = {}
    for case, (program, argv) in cases.items():
        try:
            results[case] = _run_main(program, argv)
        except BaseException as exc:  # noqa: B902 -- recorded, the test says what is wrong with it
            results[case] = (f'raised {type(exc).__name__}: {exc}', [], '')
    results['pwned_by'] = sorted(n for n in os.listdir(tmp) if n.startswith('pwned_'))
    return results


@pytest.fixture(scope='module')
def cli(exported):
    return run_on_ranks(_cli_cases, 1, args=exported, timeout=300)[0]


def test_inputs_with_the_same_file_name_get_distinct_outputs(cli, exported):
    tmp = exported[0]
    assert cli['same_names'][0] == 0, cli['same_names'][1]
    assert sorted(os.listdir(os.path.join(tmp, 'pred'))) == ['a_x_classes.tif', 'b_x_classes.tif']
    assert cli['folder_input'][0] == 0 and os.listdir(os.path.join(tmp, 'pred_dir')) == ['x_classes.tif']


@pytest.mark.parametrize('case, program, fragments', [
    ('again', 'predict', ['a_x_classes.tif already exists', '--overwrite']),
    ('replaces_input', 'predict', ['would replace the input']),
    ('overlap', 'predict', ['--overlap must be >= 0 and smaller than --tile (32), got 32']),
    ('empty_input', 'predict', ['empty.tif is empty (0 bytes)']),
    ('truncated_input', 'predict', ['truncated.tif is not a readable raster']),
    ('raster_checkpoint', 'predict', ['is a TIFF raster, not model weights']),
    ('dates_for_one_date_model', 'predict', ['2 dates, but the model (UNetTiny) takes one scene of one date',
                                             'separated by spaces']),
    ('weights_model_edited', 'predict', ['edited.pt: its weights do not fit the model it records',
                                         'size mismatch', 'export it again']),
    ('other_pixel_type', 'predict', ['wide.tif holds uint16 pixels but the model was trained on uint8',
                                     '--mean and --std']),
    ('code_pickle', 'predict', ['evil.pt: refused', 'could run code']),
    ('eval_crs', 'evaluate', ['label_other_crs.tif', 'different CRS']),
    ('export_onto_folder', 'export', ['is a folder']),
    ('export_onto_new_folder', 'export', ['exports_new/ is a folder', 'give a file name']),
    ('export_missing_parent', 'export', ['does not exist; create it first']),
    ('export_existing', 'export', ['already exists']),
    ('eval_unlabelled', 'evaluate', ['label_unlabelled.tif', 'is a class', 'nothing can be measured']),
    ('eval_out_of_range', 'evaluate', ['label_out_of_range.tif', 'label value 9', 'nothing was evaluated']),
    ('eval_label_nodata', 'evaluate', ['label_nodata0.tif', 'nodata tag is 0', 'gdal_edit.py -unsetnodata']),
    ('weights_changed', 'predict', ['flipped.pt', 'do not match the SHA-256 recorded at export']),
    ('json_checkpoint', 'predict', ['zero0_short.json: is a text file, not a weights file']),
])
def test_prediction_commands_refuse_with_one_line(cli, case, program, fragments):
    line = _one_line(cli[case][0], cli[case][1], program)
    for fragment in fragments:
        assert fragment in line, line


PICKLE_CASES = ['pickle_evaluate_weights', 'pickle_load_from', 'pickle_export_checkpoint', 'pickle_predict_checkpoint',
                'pickle_evaluate_checkpoint', 'pickle_resume']
def test_a_pickle_carrying_code_is_never_run_by_any_loader(cli):
    """README "Safe loading": evaluate, load_from, export, predict and evaluate of a checkpoint
    folder, and a resume, given a weights file or a checksum-consistent checkpoint that carries
    code, never run it and never succeed (predict of a weights file: the case above)."""
    assert cli['pwned_by'] == [], f'unpickling ran the code of {cli["pwned_by"]}'
    for case in PICKLE_CASES:
        assert cli[case][0] != 0, f'{case}: a file carrying code was accepted'


@pytest.mark.parametrize('case, program', [
    ('pickle_evaluate_weights', 'evaluate'),
    pytest.param('pickle_load_from', 'ds_seg'),
    pytest.param('pickle_export_checkpoint', 'export'),
    pytest.param('pickle_predict_checkpoint', 'predict'),
    pytest.param('pickle_evaluate_checkpoint', 'evaluate'),
    pytest.param('pickle_resume', 'ds_seg')])
def test_a_pickle_carrying_code_is_refused_in_one_line(cli, case, program):
    line = _one_line(cli[case][0], cli[case][1], program)
    assert 'could run code' in line, line


def test_refused_prediction_commands_leave_nothing_behind(cli, exported):
    tmp, weights = exported[0], exported[1]
    assert not cli['pwned'], 'unpickling the code-carrying file ran its code'
    assert sorted(os.listdir(os.path.join(tmp, 'pred'))) == ['a_x_classes.tif', 'b_x_classes.tif']
    assert not any(os.path.exists(os.path.join(tmp, f'pred{i}')) for i in range(2, 9))
    assert not any(os.path.exists(os.path.join(tmp, d)) for d in ('nope', 'eval', 'eval_u'))
    assert sorted(os.listdir(os.path.join(tmp, 'clash'))) == ['y.tif', 'y_classes.tif']
    assert not [n for n in os.listdir(tmp) if n.endswith('.tmp')]
    assert checkpoint.load_weights_file(weights)['state_dict'], 'the existing export is intact'


def _one_rank_cannot_use_the_checkpoints_folder(tmp):
    """Rank 1's node sees a checkpoints folder it cannot use (node-local scratch not mounted)."""
    from ds_seg.config import ConfigError
    from ds_seg.engine import trainer as trainer_module
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import ds_config, tiny_cfg
    if int(os.environ.get('RANK', 0)) == 1:
        def cannot(work_dir):
            raise ConfigError(f'--work-dir: {work_dir}/checkpoints is a symbolic link to /scratch/x, which does not exist')
        trainer_module.check_work_dir_entries = cannot
    try:
        Trainer(tiny_cfg(os.path.join(tmp, 'cache'), max_steps=2), ds_config(0), work_dir=os.path.join(tmp, 'run')).close()
    except ConfigError as exc:
        return str(exc)
    return None


def test_a_checkpoints_folder_one_rank_cannot_use_stops_every_rank(tmp_path):
    """Each rank checked the folder on its own: the rank that could not use it stopped, the others
    went on and waited at the next collective until the process-group timeout."""
    lines = run_on_ranks(_one_rank_cannot_use_the_checkpoints_folder, 2, args=(str(tmp_path),), timeout=120)
    assert lines[0] == lines[1] and 'is a symbolic link to /scratch/x' in lines[0]
