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
