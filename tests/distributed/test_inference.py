"""Whole-scene prediction and evaluation on 2 real gloo ranks equal the single-rank result, and
predict.py / evaluate.py work end to end with an exported model."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import rasterio
import torch

from ds_seg.config import REPO_ROOT
from tests.dist import run_on_ranks
from tests.tiny import TINY_CONFIG
from tests.unit.test_inference import K, LookupModel, predict_classes, write_scene


def _predict_on_ranks(tmp, scene, label):
    from ds_seg import distributed, inference
    distributed.init(use_deepspeed=False)
    model = LookupModel()
    kw = dict(mean=[0, 0], std=[1, 1], tile=40, overlap=10, batch_size=3, block=32)
    stats = inference.predict_scene(model, scene, os.path.join(tmp, 'two.tif'), classes=list('abcde'),
                                    probs_path=os.path.join(tmp, 'two_probs.tif'), **kw)
    ev = inference.evaluate_scenes(model, [(scene, label)], num_classes=K, erode_boundary=2, **kw)
    return dict(calls=model.calls, band=stats['band'], cm=ev['confusion'], windows=stats['windows'])


def test_two_ranks_write_the_same_file_as_one(tmp_path):
    from ds_seg import inference
    tmp = str(tmp_path)
    scene, label = os.path.join(tmp, 'scene.tif'), os.path.join(tmp, 'label.tif')
    _, ref = write_scene(scene, 150, 90)
    write_scene(label, 150, 90, bands=1, nodata=None)
    # Blocky labels (patches of 10 x 15 px) so that boundary erosion leaves pixels to count.
    lbl = (np.arange(150)[:, None] // 10 + np.arange(90)[None] // 15) % K
    with rasterio.open(label, 'r+') as dst:
        dst.write(lbl.astype(np.uint16)[None])
    ranks = run_on_ranks(_predict_on_ranks, 2, args=(tmp, scene, label))
    assert ranks[0]['calls'] == ranks[1]['calls'], 'ZeRO-3 needs equal forward calls per rank'
    assert ranks[0]['band'] == (0, 96) and ranks[1]['band'] == (96, 150)
    assert torch.equal(ranks[0]['cm'], ranks[1]['cm'])

    kw = dict(mean=[0, 0], std=[1, 1], tile=40, overlap=10, batch_size=3, block=32)
    one = inference.predict_scene(LookupModel(), scene, os.path.join(tmp, 'one.tif'), classes=list('abcde'),
                                  probs_path=os.path.join(tmp, 'one_probs.tif'), **kw)
    cm_one = inference.evaluate_scenes(LookupModel(), [(scene, label)], num_classes=K, erode_boundary=2,
                                       **kw)['confusion']
    assert torch.equal(ranks[0]['cm'], cm_one) and cm_one.sum() > 0
    assert one['windows'] < ranks[0]['windows'] + ranks[1]['windows'], 'boundary windows run on both'
    for a, b in [('one.tif', 'two.tif'), ('one_probs.tif', 'two_probs.tif')]:
        with rasterio.open(os.path.join(tmp, a)) as x, rasterio.open(os.path.join(tmp, b)) as y:
            assert x.profile == y.profile and x.tags() == y.tags()
            np.testing.assert_array_equal(x.read(), y.read())
    with rasterio.open(os.path.join(tmp, 'two.tif')) as y:
        np.testing.assert_array_equal(y.read(1), ref)
    assert not [f for f in os.listdir(tmp) if '.part' in f], 'part files are removed'


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    """A UNetTiny weights file in the format launch/export.py writes (random weights), and a
    small 3-band scene with a label, a CRS and a nodata stripe."""
    tmp = tmp_path_factory.mktemp('e2e')
    torch.manual_seed(0)
    from ds_seg.registry import MODELS, build
    cfg = dict(type='UNetTiny', in_channels=3, num_classes=6)
    model = build(MODELS, cfg).eval()
    names = ['grass', 'road', 'building', 'tree', 'water', 'car']
    weights = str(tmp / 'weights.pt')
    torch.save({'state_dict': model.state_dict(), 'model': cfg, 'classes': names,
                'data': {'bands': [1, 2, 3], 'mean': [100.0, 110.0, 90.0], 'std': [40.0, 40.0, 35.0]}}, weights)
    from ds_seg.data.synthetic import generate_scene
    from rasterio.transform import from_origin
    image, label = generate_scene(np.random.default_rng(3), (150, 130))
    image[:, 20:24] = 0
    scene, lbl = str(tmp / 'scene.tif'), str(tmp / 'scene_label.tif')
    common = dict(driver='GTiff', width=130, height=150, crs='EPSG:25832',
                  transform=from_origin(360_000, 5_700_000, 0.2, 0.2))
    with rasterio.open(scene, 'w', count=3, dtype='uint8', nodata=0, photometric='RGB', **common) as dst:
        dst.write(image)
    with rasterio.open(lbl, 'w', count=1, dtype='uint8', **common) as dst:
        dst.write(label[None])
    return dict(tmp=tmp, weights=weights, model=model, scene=scene, label=lbl, names=names)


def _run(script, *args):
    proc = subprocess.run([sys.executable, f'launch/{script}', *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_predict_and_evaluate_end_to_end(exported):
    from ds_seg import inference
    from ds_seg.metrics import metrics_from_confusion
    e = exported
    out = str(e['tmp'] / 'pred')
    common = ['--tile', '64', '--overlap', '16', '--batch-size', '4']
    log = _run('predict.py', '--checkpoint', e['weights'], '--input', e['scene'], '--output', out, '--probs',
               *common)
    assert 'windows/s' in log and 'ETA' in log
    with torch.inference_mode():
        direct, _ = predict_classes(e['model'], e['scene'], e['tmp'], mean=[100.0, 110.0, 90.0],
                                    std=[40.0, 40.0, 35.0], tile=64, overlap=16, batch_size=4)
    with rasterio.open(e['scene']) as src, rasterio.open(os.path.join(out, 'scene_classes.tif')) as dst:
        assert (dst.crs, dst.transform, dst.shape) == (src.crs, src.transform, src.shape)
        classes = dst.read(1)
        assert json.loads(dst.tags()['classes']) == e['names']
    # The command line normalised with the checkpoint's recorded statistics, like training.
    np.testing.assert_array_equal(classes, direct)
    assert (classes[20:24] == inference.CLASS_NODATA).all() and (classes[:20] < 6).all()
    assert os.path.isfile(os.path.join(out, 'scene_probs.tif'))

    ev = str(e['tmp'] / 'eval')
    log = _run('evaluate.py', '--checkpoint', e['weights'], '--images', e['scene'], '--labels', e['label'],
               '--output', ev, '--exclude', 'car', '--erode', '1', *common)
    result = json.loads(open(os.path.join(ev, 'eval.json')).read())
    # the same numbers from the direct API: the CLI adds nothing and loses nothing
    with torch.inference_mode():
        cm = inference.evaluate_scenes(e['model'], [(e['scene'], e['label'])], num_classes=6,
                                       mean=[100.0, 110.0, 90.0], std=[40.0, 40.0, 35.0], erode_boundary=1,
                                       tile=64, overlap=16, batch_size=4)['confusion']
    expected = metrics_from_confusion(cm, e['names'], exclude=('car',))
    assert result['confusion'] == cm.tolist()
    assert result['mIoU'] == pytest.approx(expected['mIoU']) and result['OA'] == pytest.approx(expected['OA'])
    assert set(result['per_class']['road']) == {'iou', 'f1', 'precision', 'recall'}
    assert 'mF1' in result and 'mIoU' in log
    for png in ('confusion.png', 'preview_0.png'):
        assert os.path.getsize(os.path.join(ev, png)) > 1000


def test_predict_reports_a_missing_input_without_a_traceback(exported):
    proc = subprocess.run([sys.executable, 'launch/predict.py', '--checkpoint', exported['weights'], '--input',
                           'nope.tif', '--output', str(exported['tmp'] / 'x')], cwd=REPO_ROOT,
                          capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert proc.returncode == 2 and 'nope.tif' in proc.stderr and 'Traceback' not in proc.stderr


def _refusal_cases(tmp, weights, scene, label):
    """(exit status, stderr lines, files under tmp before, after) of each mistaken command, run
    in this process through the commands' main()."""
    import contextlib
    import importlib
    import io
    from rasterio.control import GroundControlPoint
    tmp = str(tmp)
    with rasterio.open(scene) as src:
        img, profile = src.read(), dict(src.profile)
    gcp_scene = os.path.join(tmp, 'gcp_scene.tif')
    gcps = [GroundControlPoint(r, c, 360_000 + c * 0.2, 5_700_000 - r * 0.2) for r, c in ((0, 0), (0, 130), (150, 0))]
    profile.pop('transform')
    with rasterio.open(gcp_scene, 'w', **dict(profile, gcps=gcps)) as dst:
        dst.write(img)
    garbage = os.path.join(tmp, 'garbage.onnx')
    with open(garbage, 'wb') as f:
        f.write(os.urandom(2000))
    old_eval = os.path.join(tmp, 'old_eval')
    os.makedirs(old_eval, exist_ok=True)
    with open(os.path.join(old_eval, 'confusion.png'), 'wb') as f:
        f.write(b'an earlier run')
    a_file = os.path.join(tmp, 'a_file')
    open(a_file, 'w').close()
    from ds_seg.engine import checkpoint
    payload = checkpoint.load_weights_file(weights)
    names = list(payload['classes'])
    edited = os.path.join(tmp, 'classes_edited.pt')   # one name dropped by hand: the head still has them all
    torch.save(dict(payload, classes=names[:-1]), edited)
    # A run's checkpoint folder: its keep_checkpoints pruning deleted an export or evaluation put there.
    run = os.path.join(tmp, 'run')
    step = os.path.join(run, 'checkpoints', 'step_00000002')
    os.makedirs(step)
    for name in ('config.json', 'ds_config.json'):
        with open(os.path.join(run, name), 'w') as f:
            f.write('{}')
    pred = ['--checkpoint', weights, '--input', scene, '--tile', '64', '--device', 'cpu']
    ev = ['--checkpoint', weights, '--images', scene, '--labels', label, '--tile', '64', '--device', 'cpu']
    cases = {
        'std_zero': ('predict', pred + ['--output', os.path.join(tmp, 'p1'), '--mean', '1', '1', '1', '--std', '0', '0', '0']),
        'std_nan': ('predict', pred + ['--output', os.path.join(tmp, 'p2'), '--mean', '1', '1', '1', '--std', '1', 'nan', '1']),
        'mean_count': ('predict', pred + ['--output', os.path.join(tmp, 'p3'), '--mean', '1', '2', '--std', '1', '1']),
        'mean_too_many': ('predict', pred + ['--output', os.path.join(tmp, 'p3'), '--mean', '1', '2', '3', '4',
                                             '--std', '1', '1', '1', '1']),
        'device_typo': ('predict', pred + ['--output', os.path.join(tmp, 'p4'), '--device', 'gpu']),
        'eval_device_typo': ('evaluate', ev + ['--output', os.path.join(tmp, 'e1'), '--device', 'gpu']),
        'eval_exclude_all': ('evaluate', ev + ['--output', os.path.join(tmp, 'e1x'), '--exclude', *names]),
        'classes_edited': ('predict', ['--checkpoint', edited, '--input', scene, '--output', os.path.join(tmp, 'p4c')]),
        'export_into_step': ('export', [weights, '--format', 'onnx', '--out', os.path.join(step, 'mine.onnx')]),
        'eval_into_step': ('evaluate', ev + ['--output', step]),
        'predict_into_step': ('predict', pred + ['--output', os.path.join(step, 'preds')]),
        'vector_into_checkpoints': ('predict', pred + ['--output', os.path.join(tmp, 'p4v'), '--vector',
                                                       os.path.join(run, 'checkpoints', 'v.gpkg')]),
        'device_meta': ('predict', pred + ['--output', os.path.join(tmp, 'p4m'), '--device', 'meta']),
        'eval_device_fpga': ('evaluate', ev + ['--output', os.path.join(tmp, 'e1f'), '--device', 'fpga']),
        'output_unwritable': ('predict', pred + ['--output', '/proc/ds_seg_out']),
        'output_readonly': ('predict', pred + ['--output', '/proc/self']),
        'vector_unwritable': ('predict', pred + ['--output', os.path.join(tmp, 'p5'), '--vector', '/proc/self/x.gpkg']),
        'eval_unwritable': ('evaluate', ev + ['--output', '/proc/ds_seg_eval']),
        'eval_under_file': ('evaluate', ev + ['--output', os.path.join(a_file, 'sub')]),
        'export_unwritable': ('export', [weights, '--format', 'onnx', '--out', '/proc/self/w.onnx']),
        'eval_existing_png': ('evaluate', ev + ['--output', old_eval]),
        'eval_model_option': ('evaluate', ['--checkpoint', weights, '--config', TINY_CONFIG, '--device', 'cpu',
                                           '--output', os.path.join(tmp, 'e3'), '--cfg-options',
                                           'data.eval_overlap=8', 'model.base_channels=32']),
        'ignore_is_class': ('evaluate', ev + ['--output', os.path.join(tmp, 'e2'), '--ignore-index', '0']),
        'gcp_vector': ('predict', ['--checkpoint', weights, '--input', gcp_scene, '--output', os.path.join(tmp, 'p6'),
                                   '--vector', 'gpkg']),
        'onnx_garbage': ('predict', ['--checkpoint', garbage, '--input', scene, '--output', os.path.join(tmp, 'p7')]),
        'export_onnx_as_pt': ('export', [weights, '--format', 'onnx', '--out', os.path.join(tmp, 'model.pt')]),
        'export_weights_as_onnx': ('export', [weights, '--out', os.path.join(tmp, 'w.onnx')]),
        'export_safetensors': ('export', [weights, '--out', os.path.join(tmp, 'w.safetensors')]),
    }
    if not torch.cuda.is_available():
        cases['no_gpu'] = ('predict', pred + ['--output', os.path.join(tmp, 'p8'), '--device', 'cuda'])
        cases['eval_no_gpu'] = ('evaluate', ev + ['--output', os.path.join(tmp, 'e3'), '--device', 'cuda'])
    results = {}
    for case, (program, argv) in cases.items():
        before = sorted(os.walk(tmp))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = importlib.import_module(f'ds_seg.cli.{program}').main(argv)
        results[case] = (code, err.getvalue().strip().splitlines(), before == sorted(os.walk(tmp)))
    results['old_png'] = open(os.path.join(old_eval, 'confusion.png'), 'rb').read()
    return results


@pytest.fixture(scope='module')
def refusals(exported):
    e = exported
    tmp = e['tmp'] / 'refusals'
    tmp.mkdir()
    return run_on_ranks(_refusal_cases, 1, args=(tmp, e['weights'], e['scene'], e['label']), timeout=300)[0]


@pytest.mark.parametrize('case, program, fragments', [
    ('std_zero', 'predict', ['--std (0 0 0)', 'finite and > 0']),
    ('std_nan', 'predict', ['--std (1 nan 1)', 'finite']),
    ('mean_count', 'predict', ['--mean has 2 value(s) but the model takes 3 band(s)']),
    ('mean_too_many', 'predict', ['--mean has 4 value(s) but the model takes 3 band(s)', 'e.g. --bands 1 2 3']),
    ('device_typo', 'predict', ['--device gpu: not a device']),
    ('eval_device_typo', 'evaluate', ['--device gpu: not a device']),
    ('eval_exclude_all', 'evaluate', ['--exclude names every class', 'leave at least one class in']),
    ('classes_edited', 'predict', ['classes_edited.pt: records 5 class name(s)', 'of 6 classes', 'export it again']),
    ('export_into_step', 'export', ['step_00000002/mine.onnx is inside the checkpoints of the run in',
                                    'keep_checkpoints pruning move and delete', 'run/exports']),
    ('eval_into_step', 'evaluate', ['--output: ', 'step_00000002 is inside the checkpoints of the run in']),
    ('predict_into_step', 'predict', ['--output: ', 'step_00000002/preds is inside the checkpoints of the run']),
    ('vector_into_checkpoints', 'predict', ['--vector: ', 'is inside the checkpoints of the run in']),
    ('device_meta', 'predict', ['--device meta: holds no data', 'give cpu, cuda or cuda:N']),
    ('eval_device_fpga', 'evaluate', ['--device fpga: no fpga device is available here']),
    ('no_gpu', 'predict', ['--device cuda: no CUDA GPU']),
    ('eval_no_gpu', 'evaluate', ['--device cuda: no CUDA GPU']),
    ('output_unwritable', 'predict', ['--output: /proc/ds_seg_out is not writable']),
    ('output_readonly', 'predict', ['--output: /proc/self is not writable']),
    ('vector_unwritable', 'predict', ['--vector: /proc/self is not writable']),
    ('eval_unwritable', 'evaluate', ['--output: /proc/ds_seg_eval is not writable']),
    ('eval_under_file', 'evaluate', ['a_file']),
    ('export_unwritable', 'export', ['--out: /proc/self is not writable']),
    ('eval_existing_png', 'evaluate', ['confusion.png already exists', '--overwrite']),
    # accepted, and the metrics were those without it
    ('eval_model_option', 'evaluate', ['--cfg-options model.base_channels: evaluate scores --checkpoint\'s model',
                                       'leave it out']),
    ('ignore_is_class', 'evaluate', ["--ignore-index 0 is class 0 ('grass')"]),
    ('gcp_vector', 'predict', ['gcp_scene.tif is located by GCPs', 'gdalwarp']),
    ('onnx_garbage', 'predict', ['garbage.onnx is not an ONNX model']),
    ('export_onnx_as_pt', 'export', ['model.pt: the name says weights', '--format onnx']),
    ('export_weights_as_onnx', 'export', ['w.onnx: the name says onnx', '--format weights']),
    # torch.load reads a .safetensors name with safetensors: every reader failed on the file.
    ('export_safetensors', 'export', ['w.safetensors: the name says safetensors', 'name it', 'w.pt']),
])
def test_mistaken_options_are_one_line_before_any_work(refusals, case, program, fragments):
    if case not in refusals:
        pytest.skip('a CUDA GPU is visible here')
    code, lines, unchanged = refusals[case]
    assert code == 2, lines
    errors = [line for line in lines if line.startswith(f'{program}: error:')]
    assert len(errors) == 1 and not any('Traceback' in line for line in lines), lines
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert unchanged, 'a refused command wrote nothing'
    assert refusals['old_png'] == b'an earlier run'


def test_evaluate_with_a_runs_config_scores_as_its_training_evaluated(tmp_path):
    """evaluate.py --config <run>/config.json (the run's resolved config: refused before, 'unknown
    key config_name') scores data.val in the windows training evaluated with (data.eval_tile or
    crop_size, data.eval_overlap): an fp32 run's eval.json equals its last eval.jsonl row. The
    512 px windows evaluate.py used instead scored the same weights differently. Without
    --config, a checkpoint of the run means its config (the embedded default's scenes were scored)."""
    fp32 = json.load(open(REPO_ROOT / 'ds_configs' / 'zero0.json'))
    fp32['fp16']['enabled'] = False  # the training evaluation in the precision evaluate.py runs
    json.dump(fp32, open(tmp_path / 'fp32.json', 'w'))
    work, cache = tmp_path / 'work', tmp_path / 'cache'
    _run('train.py', '--config', 'configs/unet_tiny_synthetic.py', '--backend', 'ddp', '--deepspeed_config',
         str(tmp_path / 'fp32.json'), '--work-dir', str(work), '--cfg-options', 'train.max_steps=20',
         'train.eval_interval=20', 'train.checkpoint_interval=20', 'data.eval_overlap=8',
         # A val scene whose last window is off the model's 8-px grid (203 - 64): training's
         # evaluation (through its backend's forward) and evaluate.py (the model) align it alike.
         'data.val.scene_size=203',
         f'data.train.cache_dir={str(cache)!r}', f'data.val.cache_dir={str(cache)!r}')
    trained = [json.loads(line) for line in open(work / 'eval.jsonl')][-1]
    results = {}
    config, step = ['--config', str(work / 'config.json')], str(work / 'checkpoints' / 'step_00000020')
    # Without --config, a checkpoint of a run (its work dir, a step folder) means that run's config.
    for name, checkpoint, extra in (('as_trained', str(work), config), ('tile_512', str(work), config + ['--tile', '512']),
                                    ('work_dir', str(work), []), ('step_dir', step, [])):
        _run('evaluate.py', '--checkpoint', checkpoint, '--output', str(tmp_path / name), *extra)
        results[name] = json.load(open(tmp_path / name / 'eval.json'))
    got = results['as_trained']
    assert (got['settings']['tile'], got['settings']['overlap']) == (64, 8)
    for name in ('as_trained', 'work_dir', 'step_dir'):
        assert {k: results[name][k] for k in ('mIoU', 'OA', 'mF1', 'per_class')} == \
            {k: trained[k] for k in ('mIoU', 'OA', 'mF1', 'per_class')}, name
    assert results['tile_512']['confusion'] != got['confusion'], 'the windows change the score'
    # A window option that contradicts the config's, and a config with no validation set: one line
    # naming where the value came from, nothing written.
    for extra, said in ((['--overlap', '64'], '--overlap must be >= 0 and smaller than the evaluation tile 64 '
                                              '(data.eval_tile or data.crop_size of the config'),
                        (['--cfg-options', 'data.val=None'], 'config.json: data.val is None, so there is no '
                                                             'validation set to evaluate')):
        proc = subprocess.run([sys.executable, 'launch/evaluate.py', '--checkpoint', str(work), '--config',
                               str(work / 'config.json'), '--output', str(tmp_path / 'refused'), *extra],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
            proc.stderr
        assert not (tmp_path / 'refused').exists()


def test_evaluate_finds_a_runs_relative_data_paths_from_any_folder(tmp_path):
    """A run trained from its project folder with relative data paths (images='data/*_image.tif',
    as a config usually gives them): evaluate.py --checkpoint <work dir>, started from another
    folder, evaluates the run's config.json, whose paths were read against the folder evaluate
    started in ('the pattern ... matches no file'). config.json records them absolute."""
    import rasterio
    from rasterio.transform import from_origin

    from ds_seg.data.synthetic import generate_scene
    project, elsewhere = tmp_path / 'project', tmp_path / 'elsewhere'
    (project / 'data').mkdir(parents=True)
    elsewhere.mkdir()
    for i in range(2):
        image, label = generate_scene(np.random.default_rng(i), (96, 96))
        for name, array in ((f'{i}_image.tif', image), (f'{i}_label.tif', label[None].astype(np.uint8))):
            with rasterio.open(project / 'data' / name, 'w', driver='GTiff', width=96, height=96, count=len(array),
                               dtype='uint8', crs='EPSG:25832', transform=from_origin(360_000, 5_700_000, 0.2, 0.2)) as dst:
                dst.write(array)
    scenes = "dict(type='GeoTiffScenes', images='data/*_image.tif', labels='data/*_label.tif')"
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    train = subprocess.run([sys.executable, str(REPO_ROOT / 'launch' / 'train.py'), '--config',
                            str(REPO_ROOT / 'configs' / 'unet_tiny_synthetic.py'), '--backend', 'ddp',
                            '--work-dir', 'work', '--cfg-options', 'train.max_steps=2', 'train.eval_interval=0',
                            'train.checkpoint_interval=2', f'data.train={scenes}', f'data.val={scenes}'],
                           cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    recorded = json.load(open(project / 'work' / 'config.json'))['data']
    assert recorded['val']['images'] == str(project / 'data' / '*_image.tif'), recorded['val']
    assert recorded['train']['labels'] == str(project / 'data' / '*_label.tif'), recorded['train']
    proc = subprocess.run([sys.executable, str(REPO_ROOT / 'launch' / 'evaluate.py'), '--checkpoint',
                           str(project / 'work'), '--output', 'eval'], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert 0.0 <= json.load(open(elsewhere / 'eval' / 'eval.json'))['mIoU'] <= 1.0


def test_evaluate_with_another_models_config_says_which_model_it_scores(exported, tmp_path):
    """--config of an FPN run beside a UNetTiny checkpoint: only the config's data.val is used,
    and the scores were read as the FPN's without a word."""
    cache = tmp_path / 'cache'
    fpn = str(REPO_ROOT / 'configs' / 'fpn_tiny_synthetic.py')
    out = _run('evaluate.py', '--checkpoint', exported['weights'], '--config', fpn, '--device', 'cpu',
               '--output', str(tmp_path / 'eval'), '--previews', '0', '--cfg-options',
               f'data.val.cache_dir={cache}')
    assert f"[evaluate] --config {fpn} trains a FPNTiny; evaluate scores --checkpoint's model, a UNetTiny, on that " \
           "config's data.val" in out, out
    same = _run('evaluate.py', '--checkpoint', exported['weights'], '--config', TINY_CONFIG, '--device', 'cpu',
                '--output', str(tmp_path / 'eval2'), '--previews', '0', '--cfg-options', f'data.val.cache_dir={cache}')
    assert 'evaluate scores --checkpoint' not in same, same
