"""README claims about checkpoints that need a trained run: keep_checkpoints prunes to the newest
N, export works from DDP and ZeRO-0 checkpoints (the exported tensors are the trained ones), and
predict/evaluate accept every --checkpoint form (work dir, checkpoints/ dir, step dir, exported
file) with identical results. One short 2-rank run per backend, shared by every test here."""
import contextlib
import hashlib
import io
import json
import os

import numpy as np
import pytest
import torch

from ds_seg.engine import checkpoint
from tests.dist import run_on_ranks
from tests.distributed.test_reliability import _run_main, _write_tif
from tests.tiny import ds_config, tiny_cfg

pytestmark = pytest.mark.slow

STEPS, EVERY, KEEP = 6, 2, 2


def _train(tmp, backend, work):
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=STEPS, checkpoint_interval=EVERY, keep_checkpoints=KEEP)
    trainer = Trainer(cfg, ds_config(0), backend=backend, work_dir=os.path.join(tmp, work))
    try:
        trainer.fit()
        trainer.backend.sync_buffers()  # what the checkpoint holds
        return {k: v.detach().clone() for k, v in trainer.backend.module.state_dict().items()}
    finally:
        trainer.close()


def _quiet(program, argv):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = _run_main(program, argv)[0]
    return code, err.getvalue()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp('forms'))
    out = {}
    for backend in ('ddp', 'deepspeed'):
        state = run_on_ranks(_train, 2, args=(tmp, backend, backend))[0]
        work = os.path.join(tmp, backend)
        weights = os.path.join(tmp, f'{backend}.pt')
        code, lines, _ = _run_main('export', [work, '--out', weights])
        assert code == 0, lines
        out[backend] = dict(work=work, state=state, weights=weights)
    return tmp, out


@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_keep_checkpoints_prunes_to_the_newest(runs, backend):
    root = os.path.join(runs[1][backend]['work'], 'checkpoints')
    assert sorted(t for t in os.listdir(root) if t.startswith('step_')) == ['step_00000004', 'step_00000006']
    assert open(os.path.join(root, 'latest')).read() == 'step_00000006'
    assert not [n for n in os.listdir(root) if n.startswith('.tmp')]


@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_export_from_ddp_and_zero0_holds_the_trained_tensors(runs, backend):
    run = runs[1][backend]
    payload = checkpoint.load_weights_file(run['weights'])
    assert payload['model']['type'] == 'UNetTiny' and len(payload['classes']) == 6
    assert payload['state_dict'].keys() == run['state'].keys()
    for k, v in run['state'].items():
        assert torch.equal(payload['state_dict'][k], v.float() if v.is_floating_point() else v), k


def _forms(run):
    root = os.path.join(run['work'], 'checkpoints')
    # 'latest': DeepSpeed's pointer file, which users give where a checkpoint is asked for.
    return {'work_dir': run['work'], 'checkpoints_dir': root, 'step_dir': os.path.join(root, 'step_00000006'),
            'latest': os.path.join(root, 'latest'), 'exported': run['weights']}


def _digest(folder):
    return {n: hashlib.sha256(open(os.path.join(folder, n), 'rb').read()).hexdigest()
            for n in sorted(os.listdir(folder)) if n.endswith('.tif')}


@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_predict_and_evaluate_give_the_same_result_for_every_checkpoint_form(runs, backend):
    tmp, run = runs[0], runs[1][backend]
    rng = np.random.default_rng(3)
    scene = _write_tif(os.path.join(tmp, f'scene_{backend}.tif'), rng.integers(0, 255, (3, 48, 48), dtype=np.uint8))
    label = _write_tif(os.path.join(tmp, f'label_{backend}.tif'), rng.integers(0, 6, (1, 48, 48), dtype=np.uint8))
    predictions, evaluations = {}, {}
    for form, path in _forms(run).items():
        out = os.path.join(tmp, f'pred_{backend}_{form}')
        code, err = _quiet('predict', ['--checkpoint', path, '--input', scene, '--output', out, '--tile', '32',
                                       '--block', '32', '--device', 'cpu'])
        assert code == 0, (form, err[-2000:])
        predictions[form] = _digest(out)
        out = os.path.join(tmp, f'eval_{backend}_{form}')
        code, err = _quiet('evaluate', ['--checkpoint', path, '--images', scene, '--labels', label, '--output', out,
                                        '--previews', '0'])
        assert code == 0, (form, err[-2000:])
        result = json.load(open(os.path.join(out, 'eval.json')))
        evaluations[form] = {k: result[k] for k in ('mIoU', 'OA')}
    assert predictions['exported'], 'predict wrote a class map'
    assert all(p == predictions['exported'] for p in predictions.values()), predictions
    assert all(e == evaluations['exported'] for e in evaluations.values()), evaluations


def _zero0_bf16_masters(tmp):
    """3 steps of native bf16 under ZeRO-0 on one rank: the optimizer's fp32 master weights by
    parameter name (DeepSpeed's 16-bit groups are the module's parameters, in step with them)."""
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=3, checkpoint_interval=3)
    trainer = Trainer(cfg, ds_config(0, precision='bf16'), backend='deepspeed', work_dir=os.path.join(tmp, 'bf16'))
    try:
        trainer.fit()
        engine = trainer.backend.engine
        names = {id(p): n for n, p in engine.module.named_parameters()}
        optimizer = engine.optimizer
        return {names[id(p16)]: p32.detach().clone() for g16, g32 in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                for p16, p32 in zip(g16, g32)}
    finally:
        trainer.close()


def test_a_zero0_native_bf16_export_holds_the_fp32_master_weights(tmp_path):
    """ZeRO-0 keeps no optimizer files: the export read the module's bf16 copies, 3e-3 off the
    weights training had reached (ZeRO 1-3 exports hold the fp32 masters)."""
    masters = run_on_ranks(_zero0_bf16_masters, 1, args=(str(tmp_path),))[0]
    exported = checkpoint.consolidated_state_dict(str(tmp_path / 'bf16' / 'checkpoints' / 'step_00000003'))
    assert masters and all(v.dtype == torch.float32 for v in masters.values())
    off = [name for name, master in masters.items() if not torch.equal(exported[name], master)]
    assert off == []
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values()), 'masters hold fp32 bits'


def test_a_zero0_fused_fp16_export_holds_the_fp32_master_weights():
    """DeepSpeed's fused fp16 optimizer (ZeRO-0 fp16 with FusedAdam, a GPU's) keeps its masters as
    one flat fp32 tensor per parameter group (``fp32_groups_flat``): the export took the module's
    fp16 copies. Here the real FP16_Optimizer, around torch's Adam on the CPU, with two groups
    whose order is not the module's, and the state dict a ZeRO-0 checkpoint saves."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    torch.manual_seed(0)
    from ds_seg.engine.common import keep_batchnorm_fp32
    model = keep_batchnorm_fp32(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                                    torch.nn.Conv2d(4, 2, 1)).half())
    groups = [{'params': list(model[2].parameters())}, {'params': list(model[0].parameters()) + list(model[1].parameters())}]
    optimizer = FP16_Optimizer(torch.optim.Adam(groups, lr=1e-2), static_loss_scale=1.0, verbose=False)
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(torch.randn(2, 3, 8, 8).half()).float().square().mean()
        optimizer.backward(loss)
        optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {}
    for flat, group in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
        offset = 0
        for p in group:
            expected[names[id(p)]] = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
    assert any(not torch.equal(m, m.half().float()) for m in expected.values()), 'control: masters hold fp32 bits'
    saved = {'module': model.state_dict(), 'optimizer': optimizer.state_dict(),
             'buffer_names': [n for n, _ in model.named_buffers()]}
    masters = checkpoint._zero0_fp32_masters(saved)
    assert masters.keys() == expected.keys()
    assert all(torch.equal(masters[k], expected[k]) for k in expected)
