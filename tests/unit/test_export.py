"""launch/export.py --format onnx / torch-export: dynamic sizes, equal to PyTorch (< 1e-4) in
onnxruntime on CPU, a model card, never overwriting; launch/predict.py runs the .onnx file."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import rasterio
import torch

from ds_seg.config import REPO_ROOT
from ds_seg.registry import MODELS, build

CLASSES = ['grass', 'road', 'building', 'tree', 'water', 'car']
DATA = {'bands': [1, 2, 3], 'mean': [100.0, 110.0, 90.0], 'std': [40.0, 40.0, 35.0]}


def _run(script, *args, ok=True):
    proc = subprocess.run([sys.executable, f'launch/{script}', *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=300)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


def _saved_model(tmp_path_factory, model_type):
    """(folder, weights file, model) of a seeded ``model_type`` saved as export.py's input."""
    tmp = tmp_path_factory.mktemp(f'export_{model_type}')
    torch.manual_seed(0)
    cfg = dict(type=model_type, in_channels=3, num_classes=6)
    model = build(MODELS, cfg).eval()
    path = str(tmp / 'weights.pt')
    torch.save({'state_dict': model.state_dict(), 'model': cfg, 'classes': CLASSES, 'data': DATA}, path)
    return tmp, path, model


@pytest.fixture(scope='module')
def weights(tmp_path_factory):
    return _saved_model(tmp_path_factory, 'SegFormerTiny')


@pytest.fixture(scope='module')
def small_weights(tmp_path_factory):
    """UNetTiny (an ONNX export ~4 s against SegFormerTiny's ~15 s), for the tests of what an
    export does with files, where the architecture is not what is tested."""
    return _saved_model(tmp_path_factory, 'UNetTiny')


@pytest.fixture(scope='module')
def onnx_file(weights):
    """The weights exported by ``launch/export.py --format onnx`` (once: an export takes seconds)."""
    tmp, path, _ = weights
    out = str(tmp / 'segformer.onnx')
    _run('export.py', path, '--format', 'onnx', '--out', out)
    return out


def test_onnx_export_matches_pytorch_at_other_sizes_and_carries_a_card(weights, onnx_file):
    import onnxruntime as ort
    tmp, path, model = weights
    out = onnx_file
    session = ort.InferenceSession(out, providers=['CPUExecutionProvider'])
    for shape in [(2, 3, 96, 160), (1, 3, 224, 64)]:          # neither is the traced 64 x 64
        x = torch.randn(*shape)
        with torch.no_grad():
            expected = model(x).numpy()
        got = session.run(None, {'images_BCHW': x.numpy()})[0]
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() < 1e-4
    card = json.loads(open(str(tmp / 'segformer.onnx.card.json')).read())
    assert card['classes'] == CLASSES and card['mean'] == DATA['mean'] and card['std'] == DATA['std']
    assert card['bands'] == DATA['bands'] and card['model']['type'] == 'SegFormerTiny'
    assert 'road' in open(str(tmp / 'segformer.onnx.card.md')).read()
    assert json.loads(session.get_modelmeta().custom_metadata_map['ds_seg'])['classes'] == CLASSES

    again = _run('export.py', path, '--format', 'onnx', '--out', out, ok=False)   # never overwrites
    assert 'already exists' in again.stderr and 'Traceback' not in again.stderr


def test_predict_runs_the_onnx_file_like_the_weights(weights, onnx_file):
    tmp, path, _ = weights
    from ds_seg.data.synthetic import generate_scene
    from rasterio.transform import from_origin
    image, _ = generate_scene(np.random.default_rng(3), (150, 130))
    scene = str(tmp / 'scene.tif')
    with rasterio.open(scene, 'w', driver='GTiff', width=130, height=150, count=3, dtype='uint8', crs='EPSG:25832',
                       transform=from_origin(360_000, 5_700_000, 0.2, 0.2)) as dst:
        dst.write(image)
    common = ['--input', scene, '--tile', '64', '--overlap', '16', '--batch-size', '4', '--device', 'cpu']
    _run('predict.py', '--checkpoint', onnx_file, '--output', str(tmp / 'onnx'), *common)
    _run('predict.py', '--checkpoint', path, '--output', str(tmp / 'torch'), *common)
    with rasterio.open(str(tmp / 'onnx' / 'scene_classes.tif')) as a, \
            rasterio.open(str(tmp / 'torch' / 'scene_classes.tif')) as b:
        assert a.tags()['classes'] == b.tags()['classes']
        assert (a.read(1) == b.read(1)).mean() > 0.999   # logits agree to 1e-4: argmax ties aside


def test_torch_export_program_runs_at_another_size(weights):
    tmp, path, model = weights
    out = str(tmp / 'segformer.pt2')
    _run('export.py', path, '--format', 'torch-export', '--out', out)
    program = torch.export.load(out).module()
    x = torch.randn(1, 3, 96, 160)
    with torch.no_grad():
        assert (program(x) - model(x)).abs().max() < 1e-4
    card = json.loads(open(str(tmp / 'segformer.pt2.card.json')).read())
    assert card['format'] == 'torch-export'
    # The card says the size the program holds from (a smaller one may fail with torch's raw
    # shape guard: 100 x 60 did here, and nothing said so); it and sizes above it run.
    assert card['input']['min_size'] == [64, 64]
    with torch.no_grad():
        for size in ((64, 64), (64, 101), (77, 64)):
            x = torch.randn(1, 3, *size)
            assert (program(x) - model(x)).abs().max() < 1e-4
        # Below min_size a program may fail torch's shape guards (this one did at 100 x 60 before the
        # segmentor padded SegFormer's inputs to 32); it holds there now.
        x = torch.randn(1, 3, 100, 60)
        assert (program(x) - model(x)).abs().max() < 1e-4
    assert 'input size: from 64 x 64 px (H x W) up' in open(str(tmp / 'segformer.pt2.card.md')).read()


@pytest.mark.parametrize('name', ['UperNetTiny', 'UperNetViTTiny', 'UNetTiny'])
def test_upernet_pyramid_pooling_vit_and_unet_export_with_dynamic_sizes(tmp_path, name):
    """PPM's adaptive pooling (bins that do not divide the map), the ViT's position-embedding
    resize and the UNet's padding of odd-sized maps stay dynamic in the ONNX graph and in the
    torch.export program."""
    import onnxruntime as ort
    from ds_seg import deploy
    torch.manual_seed(0)
    model = build(MODELS, dict(type=name)).eval()
    out = str(tmp_path / f'{name}.onnx')
    deploy.export_onnx(model, out, dict(model=dict(type=name), classes=CLASSES))
    session = ort.InferenceSession(out, providers=['CPUExecutionProvider'])
    x = torch.randn(1, 3, 160, 96)                   # map 5 x 3 at stride 32: pooled to 6 x 6
    with torch.no_grad():
        assert np.abs(session.run(None, {'images_BCHW': x.numpy()})[0] - model(x).numpy()).max() < 1e-4
    deploy.export_torch(model, str(tmp_path / f'{name}.pt2'), dict(model=dict(type=name), classes=CLASSES))
    program = torch.export.load(str(tmp_path / f'{name}.pt2')).module()
    with torch.no_grad():
        assert (program(x) - model(x)).abs().max() < 1e-4


@pytest.mark.parametrize('name', ['vit_small_patch14_reg4_dinov2', 'deit3_small_patch16_224'])
def test_timm_vit_exports_and_stays_exact_off_the_patch_grid(tmp_path, name):
    """A timm ViT (DINOv2 with registers at patch 14; DeiT-3 without a class position embedding)
    through UperNet: the ONNX graph and the torch.export program pad to the patch multiple,
    resample the position embeddings (antialiased bicubic) and crop back at whatever size they
    are given, as PyTorch does."""
    import onnxruntime as ort
    from ds_seg import deploy
    torch.manual_seed(0)
    model = build(MODELS, dict(type='UperNet', backbone=name, channels=16, aux_head=False,
                               backbone_kwargs=dict(depth=2, embed_dim=32, num_heads=2))).eval()
    out = str(tmp_path / 'vit.onnx')
    deploy.export_onnx(model, out, dict(model=dict(type='UperNet', backbone=name), classes=CLASSES))
    session = ort.InferenceSession(out, providers=['CPUExecutionProvider'])
    for shape in [(1, 3, 200, 90), (2, 3, 57, 131)]:  # multiples of neither 14 nor 16
        x = torch.randn(*shape)
        with torch.no_grad():
            expected = model(x).numpy()
        got = session.run(None, {'images_BCHW': x.numpy()})[0]
        assert got.shape == expected.shape and np.abs(got - expected).max() < 1e-4
    deploy.export_torch(model, str(tmp_path / 'vit.pt2'), dict(model=dict(type='UperNet', backbone=name)))
    program = torch.export.load(str(tmp_path / 'vit.pt2')).module()
    for shape in [(1, 3, 200, 90), (1, 3, 112, 128)]:  # the crop is kept at a multiple of the patch too
        x = torch.randn(*shape)
        with torch.no_grad():
            assert (program(x) - model(x)).abs().max() < 1e-4


def test_a_model_built_for_the_trace_size_is_still_one_of_one_input_size():
    """A Swin built for img_size=64, the size an export traces at, took the probe at that size, was
    exported with H and W dynamic and failed its check at 96x128 in a traceback (ONNX), or ran for
    minutes (torch.export). Probed at another size, it is traced at its own with the batch dynamic."""
    from ds_seg import deploy
    cfg = dict(type='UperNet', backbone='swin_tiny_patch4_window7_224', img_size=64, channels=16, num_classes=6,
               backbone_kwargs=dict(embed_dim=24, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4))
    model = build(MODELS, cfg).eval()
    assert deploy._export_sizes(model, dict(model=cfg)) == ((64, 64), [(64, 64)] * 2, ('B',))
    free = dict(cfg, img_size=None, backbone='resnet18', backbone_kwargs={})
    assert deploy._export_sizes(build(MODELS, free).eval(), dict(model=free))[2] == ('B', 'H', 'W')


def test_a_model_of_one_input_size_exports_at_that_size(tmp_path):
    """A Swin built for img_size=96 refuses every other size: both exports traced it at 64 px and
    failed ('Input height (s68) doesn't match model'). Now they trace and check it at 96 px with
    the batch dynamic, the card says so, and predict runs the ONNX file at that size."""
    import onnxruntime as ort
    from ds_seg import deploy
    torch.manual_seed(0)
    cfg = dict(type='UperNet', backbone='swin_tiny_patch4_window7_224', img_size=96, channels=16, num_classes=6,
               backbone_kwargs=dict(embed_dim=24, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1)))
    model = build(MODELS, cfg).eval()
    out = str(tmp_path / 'swin.onnx')
    deploy.export_onnx(model, out, dict(model=cfg, classes=CLASSES, data=dict(DATA, file_bands=3)))
    assert json.loads(open(f'{out}.card.json').read())['input']['dynamic'] == ['B']
    assert deploy.load_onnx(out)[1]['data']['file_bands'] == 3  # predict's band-count check sees it
    session = ort.InferenceSession(out, providers=['CPUExecutionProvider'])
    x = torch.randn(3, 3, 96, 96)
    with torch.no_grad():
        assert np.abs(session.run(None, {'images_BCHW': x.numpy()})[0] - model(x).numpy()).max() < 1e-4
    deploy.export_torch(model, str(tmp_path / 'swin.pt2'), dict(model=cfg, classes=CLASSES))
    program = torch.export.load(str(tmp_path / 'swin.pt2')).module()
    with torch.no_grad():
        assert (program(x) - model(x)).abs().max() < 1e-4
    scene = str(tmp_path / 'scene.tif')
    with rasterio.open(scene, 'w', driver='GTiff', width=150, height=130, count=3, dtype='uint8') as dst:
        dst.write(np.random.default_rng(0).integers(0, 255, (3, 130, 150), dtype=np.uint8))
    weights = str(tmp_path / 'swin.pt')
    torch.save({'state_dict': model.state_dict(), 'model': cfg, 'classes': CLASSES, 'data': DATA}, weights)
    maps = []
    for checkpoint, folder in ((out, 'onnx'), (weights, 'torch')):
        _run('predict.py', '--checkpoint', checkpoint, '--input', scene, '--output', str(tmp_path / folder))
        with rasterio.open(str(tmp_path / folder / 'scene_classes.tif')) as src:
            maps.append(src.read(1))
    assert np.array_equal(*maps)


class DataDependent(torch.nn.Module):
    """Control flow on pixel values: no graph can hold it for every input."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 1)

    def forward(self, images_BCHW):
        logits = self.conv(images_BCHW)
        return logits if float(images_BCHW.mean()) > 0 else -logits


def test_export_refuses_what_it_cannot_keep_dynamic_in_one_line(tmp_path):
    from ds_seg import deploy
    from ds_seg.config import ConfigError
    out = str(tmp_path / 'model.onnx')
    with pytest.raises(ConfigError, match='--format onnx: DataDependent .* does not export to ONNX') as caught:
        deploy.export_onnx(DataDependent(), out, dict(model=dict(type='DataDependent'), classes=CLASSES))
    assert '\n' not in str(caught.value)
    assert not os.listdir(tmp_path), 'nothing half-written is left behind'


@pytest.fixture(scope='module')
def trained_run(tmp_path_factory):
    """A real 4-step UNetTiny run (plain python, DDP) evaluated and checkpointed at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp('run')
    work = str(tmp / 'work')
    _run('train.py', '--config', 'configs/unet_tiny_synthetic.py', '--backend', 'ddp', '--work-dir', work,
         '--cfg-options', 'train.max_steps=4', 'train.eval_interval=2', 'train.checkpoint_interval=2',
         'train.keep_checkpoints=2', 'train.log_interval=2', f'data.train.cache_dir={str(tmp / "cache")!r}',
         f'data.val.cache_dir={str(tmp / "cache")!r}')
    with open(os.path.join(work, 'eval.jsonl')) as f:
        rows = {row['step']: row for row in map(json.loads, f)}
    assert sorted(rows) == [2, 4] and rows[2]['per_class'] != rows[4]['per_class']
    return tmp, work, rows


@pytest.mark.parametrize('fmt, suffix', [('weights', '.pt'), ('onnx', '.onnx')])
def test_model_card_metrics_are_the_exported_steps(trained_run, fmt, suffix):
    """Exporting step_00000002 of a 4-step run wrote a card whose final metrics (mIoU, OA, mF1,
    per-class IoU, eval_step) were step 4's: a deployment reading the card was told the scores of
    other weights. Now the card carries the evaluation at the exported step; the last checkpoint's
    card equals the run's last eval.jsonl row and summary.json."""
    tmp, work, rows = trained_run
    for step in (2, 4):
        out = str(tmp / f'step{step}_{fmt}{suffix}')
        _run('export.py', os.path.join(work, 'checkpoints', f'step_{step:08d}'), '--format', fmt, '--out', out)
        card = json.loads(open(f'{out}.card.json').read())
        metrics = card['final_metrics']
        assert card['step'] == step and metrics['eval_step'] == step
        assert {k: metrics[k] for k in ('mIoU', 'OA', 'mF1', 'per_class')} == \
            {k: rows[step][k] for k in ('mIoU', 'OA', 'mF1', 'per_class')}
        assert card['training_config']['train']['max_steps'] == 4
        if step == 4:   # the run ended here: its summary belongs to these weights
            assert metrics['steps'] == 4 and metrics['exit_reason'] == 'completed'
        else:
            assert 'steps' not in metrics and 'final_loss' not in metrics


def test_a_weights_file_whose_run_was_retrained_exports_with_its_own_records_beside_it(trained_run, capsys):
    """export.py A.pt --format onnx took the card's training config and metrics from the step folder
    A.pt was exported from, as it is now: retrained in the same work dir (or by another model), the
    card described another run. Without --out it wrote into that run's folder. Now the folder must
    still hold the file's weights (step and SHA-256), else the card has only the file's records
    (said in one line), and the default output is beside the file."""
    import shutil

    from ds_seg.cli.export import _still_holds, export_deployable
    from ds_seg.engine import checkpoint
    tmp, work, _ = trained_run
    copy = tmp / 'retrained'
    shutil.copytree(work, copy)
    step2 = copy / 'checkpoints' / 'step_00000002'
    elsewhere = tmp / 'elsewhere'
    elsewhere.mkdir()
    weights = str(elsewhere / 'a.pt')
    checkpoint.export(str(step2), weights)
    assert _still_holds(str(step2), checkpoint.load_weights_file(weights))
    shutil.rmtree(step2)   # the work dir reused: its step 2 is another run's now
    shutil.copytree(copy / 'checkpoints' / 'step_00000004', step2)
    assert not _still_holds(str(step2), checkpoint.load_weights_file(weights))
    capsys.readouterr()
    ckpt, out = export_deployable(weights, 'onnx')
    assert out == str(elsewhere / 'model_a.onnx') and ckpt == weights
    assert (f'export: {step2}, which {weights} was exported from, no longer holds its weights (retrained or replaced '
            'since): the model card carries only what the file records') in capsys.readouterr().out
    card = json.loads(open(f'{out}.card.json').read())
    assert card['training_config'] is None and card['final_metrics'] is None
    assert card['source'] == weights and card['step'] == 2 and card['model']['type'] == 'UNetTiny'
    assert sorted(os.listdir(copy / 'checkpoints')) == sorted(os.listdir(os.path.join(work, 'checkpoints')))


def test_evaluate_runs_the_onnx_file_like_the_weights_and_others_name_it(weights, onnx_file):
    """evaluate.py --checkpoint model.onnx was refused as 'is a text file, not a weights file'
    (protobuf bytes read as ASCII) though predict.py runs it; it now scores the ONNX file with
    the same confusion matrix as the weights. load_from= and export of an ONNX file (by suffix or
    by content) say it is an ONNX model and which file they take instead."""
    tmp, path, _ = weights
    from ds_seg.data.synthetic import generate_scene
    from rasterio.transform import from_origin
    image, label = generate_scene(np.random.default_rng(4), (90, 110))
    files = {}
    for name, array in (('image', image), ('label', label[None])):
        files[name] = str(tmp / f'eval_{name}.tif')
        with rasterio.open(files[name], 'w', driver='GTiff', width=110, height=90, count=len(array), dtype='uint8',
                           crs='EPSG:25832', transform=from_origin(360_000, 5_700_000, 0.2, 0.2)) as dst:
            dst.write(array.astype('uint8'))
    common = ['--images', files['image'], '--labels', files['label'], '--tile', '64', '--overlap', '16',
              '--device', 'cpu']
    _run('evaluate.py', '--checkpoint', onnx_file, '--output', str(tmp / 'eval_onnx'), *common)
    _run('evaluate.py', '--checkpoint', path, '--output', str(tmp / 'eval_torch'), *common)
    got, expected = (json.loads((tmp / f'eval_{k}' / 'eval.json').read_text()) for k in ('onnx', 'torch'))
    assert got['confusion'] == expected['confusion'] and got['classes'] == expected['classes'] == CLASSES

    renamed = str(tmp / 'model.bin')               # an ONNX file under another name: known by its bytes
    with open(onnx_file, 'rb') as f, open(renamed, 'wb') as g:
        g.write(f.read())
    from ds_seg.engine import checkpoint
    for source in (onnx_file, renamed):
        with pytest.raises(ValueError, match=r'is an ONNX model .*load_from and export take the weights file'):
            checkpoint.load_weights_file(source)
    refused = _run('export.py', onnx_file, '--format', 'torch-export', '--out', str(tmp / 'from_onnx.pt2'), ok=False)
    assert 'is an ONNX model' in refused.stderr and 'Traceback' not in refused.stderr
    assert not (tmp / 'from_onnx.pt2').exists()


def test_a_missing_runtime_is_named_with_the_install_for_this_installation(tmp_path, monkeypatch):
    """Without onnxruntime a valid .onnx file was called 'not an ONNX model onnxruntime can load',
    and every hint said pip install -e '.[x]', which a wheel user has no checkout for."""
    import sys

    from ds_seg import config
    from ds_seg.config import ConfigError
    from ds_seg.deploy import load_onnx
    model = tmp_path / 'm.onnx'
    model.write_bytes(b'any bytes: the runtime is asked for first')
    monkeypatch.setitem(sys.modules, 'onnxruntime', None)   # what a missing package looks like to import
    with pytest.raises(ConfigError, match=r"m.onnx: running an ONNX model needs onnxruntime, which is not "
                                          r"installed: pip install -e '.\[onnx\]' in the checkout"):
        load_onnx(str(model))
    assert config.extra_hint('mlflow').startswith("pip install -e '.[mlflow]'")
    monkeypatch.setattr(config, 'REPO_ROOT', tmp_path / 'site-packages')  # an installed wheel: no setup.py
    assert config.extra_hint('onnx') == 'pip install onnx onnxscript onnxruntime'
    assert config.extra_hint('wandb') == 'pip install wandb'


@pytest.mark.parametrize('package', ['onnx', 'onnxscript', 'onnxruntime'])
def test_a_missing_export_package_is_named_before_the_checkpoint_is_read(tmp_path, monkeypatch, package):
    """Without onnx the export loaded the checkpoint and built its model before the install hint;
    without onnxruntime it traced and wrote the file, then failed in its check. The source here is
    not a checkpoint at all: the package is named first, in one line, and nothing is written."""
    from ds_seg.cli.export import export_deployable
    from ds_seg.config import ConfigError
    source = tmp_path / 'not_a_checkpoint.pt'
    source.write_bytes(b'never read')
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError, match=rf"^--format onnx needs the {package} package: pip install"):
        export_deployable(str(source), 'onnx', str(tmp_path / 'm.onnx'))
    assert sorted(os.listdir(tmp_path)) == ['not_a_checkpoint.pt']


def test_an_export_never_replaces_a_link_even_one_to_nothing(weights, tmp_path):
    """--out dangling.pt, a user's symlink to a missing file: the export replaced the link with
    a file of its own. It is refused as an existing path is."""
    from ds_seg import deploy
    from ds_seg.config import ConfigError
    _, _, model = weights
    link = tmp_path / 'dangling.onnx'
    link.symlink_to(tmp_path / 'missing.onnx')
    with pytest.raises(ConfigError, match=r'--out: .*dangling.onnx already exists'):
        deploy.export_onnx(model, str(link), dict(model=dict(type='SegFormerTiny'), classes=CLASSES))
    assert link.is_symlink() and not (tmp_path / 'missing.onnx').exists()


@pytest.mark.parametrize('fmt', ['weights', 'onnx', 'torch-export'])
def test_an_export_never_touches_a_users_file_of_its_temporary_name(trained_run, small_weights, tmp_path, fmt, capsys):
    """export wrote through fixed temporary names ('<out>.tmp', '<out>.tmp.pt2'): a user's file
    of that name was overwritten, then renamed into the export."""
    from ds_seg.cli import export
    source = os.path.join(trained_run[1], 'checkpoints', 'step_00000004') if fmt == 'weights' else small_weights[1]
    out = tmp_path / {'weights': 'm.pt', 'onnx': 'm.onnx', 'torch-export': 'm.pt2'}[fmt]
    mine = f'{out}.tmp.pt2' if fmt == 'torch-export' else f'{out}.tmp'
    with open(mine, 'w') as f:
        f.write('field notes')
    assert export.main([source, '--out', str(out), '--format', fmt]) == 0
    assert capsys.readouterr().out.strip().endswith(f'exported {source} -> {out}')  # the file given, not its origin
    assert open(mine).read() == 'field notes'
    left = set(os.listdir(tmp_path)) - {os.path.basename(mine), out.name, f'{out.name}.card.json',
                                        f'{out.name}.card.md'}
    assert not left, left


def test_an_onnx_export_with_external_weights_keeps_them_beside_the_file(small_weights, tmp_path, monkeypatch):
    """A model over the exporter's size limit keeps its weights in a file beside the graph: the
    export left '<out>.tmp.data' behind, named in the graph, and saved the graph with every weight
    loaded back in (past protobuf's 2 GB for the models that need it). The limit is lowered here
    so a small model takes that path."""
    import onnxruntime as ort
    from torch.onnx._internal.exporter import _onnx_program

    from ds_seg import deploy
    monkeypatch.setattr(_onnx_program, '_LARGE_MODEL_THRESHOLD', 1000)
    _, _, model = small_weights
    out = str(tmp_path / 'big.onnx')
    deploy.export_onnx(model, out, dict(model=dict(type='UNetTiny'), classes=CLASSES))
    import onnx
    assert sorted(os.listdir(tmp_path)) == ['big.onnx', 'big.onnx.card.json', 'big.onnx.card.md', 'big.onnx.data']
    graph = onnx.load(out, load_external_data=False).graph
    assert {e.value for t in graph.initializer for e in t.external_data if e.key == 'location'} == {'big.onnx.data'}
    x = torch.randn(1, 3, 64, 96)
    session = ort.InferenceSession(out, providers=['CPUExecutionProvider'])
    with torch.no_grad():
        assert np.abs(session.run(None, {'images_BCHW': x.numpy()})[0] - model(x).numpy()).max() < 1e-4


@pytest.mark.parametrize('fmt, suffix', [('onnx', '.onnx'), ('weights', '.pt')])
def test_a_checkpoints_pointer_file_exports_the_step_it_names(trained_run, fmt, suffix, capsys):
    """checkpoints/latest (or best) is given wherever a checkpoint is asked for; --format onnx took
    it for a weights file and refused it ('is a text file, not a weights file')."""
    tmp, work, rows = trained_run
    pointer = os.path.join(work, 'checkpoints', 'latest')
    out = str(tmp / f'latest_{fmt}{suffix}')
    said = _run('export.py', pointer, '--format', fmt, '--out', out).stdout
    assert f"exported {os.path.join(work, 'checkpoints', 'step_00000004')} -> {out}" in said, said
    card = json.loads(open(f'{out}.card.json').read())
    assert card['step'] == 4 and card['final_metrics']['mIoU'] == rows[4]['mIoU']


@pytest.mark.parametrize('fmt, suffix', [('onnx', '.onnx'), ('torch-export', '.pt2')])
def test_a_failed_write_of_the_exported_file_is_a_write_failure_not_the_models(small_weights, tmp_path, fmt, suffix):
    """The disk refusing the file (here a file-size limit: EFBIG, as a full disk's ENOSPC) once
    read 'does not export to ONNX with dynamic sizes' (exit 2), or for torch-export 'exports but
    cannot be saved; use --format onnx': advice about the model for a disk's fault."""
    import resource
    _, path, _ = small_weights
    out = str(tmp_path / f'model{suffix}')

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))   # Python ignores SIGXFSZ: EFBIG
    proc = subprocess.run([sys.executable, 'launch/export.py', path, '--format', fmt, '--out', out], cwd=REPO_ROOT,
                          capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=300,
                          preexec_fn=small_files)
    errors = [line for line in proc.stderr.splitlines() if line.startswith('export: error:')]
    assert proc.returncode == 74 and len(errors) == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
    assert 'EFBIG' in errors[0] and 'nothing was exported' in errors[0], errors[0]
    assert os.listdir(tmp_path) == [], 'the partial file is removed'


@pytest.mark.parametrize('program', ['predict.py', 'evaluate.py'])
def test_a_scene_in_another_band_encoding_is_refused_by_the_commands(tmp_path, program):
    """A model records its training scenes' band [scale, offset]; predict.py and evaluate.py pass
    the model's mean/std to the API themselves, and so skipped its check: a scene stored as raw +
    1000 with offset -1000 was predicted on without a word. --mean/--std say its units."""
    from rasterio.transform import from_origin
    torch.manual_seed(0)
    cfg = dict(type='SegFormerTiny', in_channels=3, num_classes=6)
    weights = str(tmp_path / 'weights.pt')
    torch.save({'state_dict': build(MODELS, cfg).state_dict(), 'model': cfg, 'classes': CLASSES,
                'data': dict(DATA, dtype='uint8', encoding=[[1.0, 0.0]] * 3)}, weights)
    scene, label = str(tmp_path / 'scene.tif'), str(tmp_path / 'label.tif')
    for path, count in ((scene, 3), (label, 1)):
        with rasterio.open(path, 'w', driver='GTiff', width=64, height=64, count=count, dtype='uint8',
                           crs='EPSG:25832', transform=from_origin(360_000, 5_700_000, 0.2, 0.2)) as dst:
            dst.write(np.ones((count, 64, 64), np.uint8))
            if path == scene:
                dst.offsets = (-1000.0,) * 3
    given = ['--input', scene] if program == 'predict.py' else ['--images', scene, '--labels', label]
    proc = _run(program, '--checkpoint', weights, *given, '--output', str(tmp_path / 'out'), '--tile', '64', ok=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "scene.tif: its bands' scale/offset [[1.0, -1000.0], [1.0, -1000.0], [1.0, -1000.0]] differ" in proc.stderr
    assert 'or give --mean and --std for its units' in proc.stderr and not (tmp_path / 'out').exists()
    _run(program, '--checkpoint', weights, *given, '--output', str(tmp_path / 'out'), '--tile', '64',
         '--mean', '0', '0', '0', '--std', '1', '1', '1')


def test_a_checkpoint_pruned_while_it_is_exported_gives_way_to_the_newest(trained_run, tmp_path, monkeypatch, capsys):
    """A run still training prunes (keep_checkpoints) the checkpoint an export reads: the export
    failed with DeepSpeed's "Directory ... doesn't exist", a folder the user never named."""
    import shutil

    from ds_seg.cli import export
    from ds_seg.engine import checkpoint
    _, work, _ = trained_run
    copy = tmp_path / 'work'
    shutil.copytree(work, copy)
    real = checkpoint.consolidated_state_dict
    pruned = []

    def pruned_while_read(ckpt_dir):   # the training run's pruning, between finding and reading
        if not pruned:
            pruned.append(ckpt_dir)
            shutil.rmtree(ckpt_dir)
            checkpoint.write_pointer(str(copy / 'checkpoints'), 'latest', 'step_00000002')
        return real(ckpt_dir)
    monkeypatch.setattr(checkpoint, 'consolidated_state_dict', pruned_while_read)
    assert export.main([str(copy), '--out', str(tmp_path / 'w.pt')]) == 0
    assert pruned == [str(copy / 'checkpoints' / 'step_00000004')]
    assert 'step_00000004 was removed while this export read it' in capsys.readouterr().out
    assert torch.load(tmp_path / 'w.pt', weights_only=True)['step'] == 2
    pruned.clear()   # the step folder itself given: said in one line
    shutil.copytree(copy / 'checkpoints' / 'step_00000002', copy / 'checkpoints' / 'step_00000006')
    marker = json.loads((copy / 'checkpoints' / 'step_00000006' / checkpoint.COMPLETE).read_text())
    (copy / 'checkpoints' / 'step_00000006' / checkpoint.COMPLETE).write_text(json.dumps(dict(marker, step=6)))
    assert export.main([str(copy / 'checkpoints' / 'step_00000006'), '--out', str(tmp_path / 'x.pt')]) == 2
    assert capsys.readouterr().err.startswith(f"export: error: {copy / 'checkpoints' / 'step_00000006'}: removed while "
                                              "this export read it (pruned by keep_checkpoints")
    assert not (tmp_path / 'x.pt').exists()
