"""DDP and every ZeRO stage compute the same optimizer step, checked where a wrong step shows.

Plain SGD (no momentum, no weight decay, no clipping, constant LR, fp32) moves the weights by
exactly -lr x the averaged gradient, so any uniform error in the gradient (a missing division
by the accumulation steps, a sum over ranks instead of a mean, a stale ZeRO partition) moves the
final weights by a large fraction of the training displacement, and the logged gradient norm by
the same factor. Adam (tests/distributed/test_training.py) normalises such factors away, which is
why it cannot be the check for them. Between correct backends only float32 rounding of a
different reduction order remains: about 1e-7 of the displacement.
"""
import os

import pytest
import torch

from tests.dist import run_on_ranks
from tests.distributed.test_training import _full_params
from tests.tiny import ds_config, read_jsonl, tiny_cfg

STEPS = 4
GRAD_ACCUM = 2
# Small on purpose. This tiny UNet's gradient is very sensitive to its weights (ReLU and
# BatchNorm on flat synthetic scenes: weights perturbed by 3e-7 of themselves move the gradient
# by 1%), so each step multiplies a rounding difference by about (1 + lr x 6000). Measured
# |ddp - zero2| / displacement after 4 steps: 9.6e-4 at lr 0.05, 8.2e-6 at 1e-3, 1.8e-9 at 1e-4,
# against 2.8e-7 after one step at any lr. At 1e-4 the comparison stays at rounding level while
# a gradient off by a factor still moves the weights by a multiple of the whole displacement.
LR = 1e-4
# float32 rounding of a reduction in another order; a gradient off by any factor (2 for a sum
# over 2 ranks or a missing / grad_accum) ends a whole displacement away.
RTOL = 1e-5


def sgd_ds_config(stage):
    ds = ds_config(stage, grad_accum=GRAD_ACCUM)
    ds['optimizer'] = {'type': 'SGD', 'params': {'lr': LR, 'momentum': 0.0, 'weight_decay': 0.0}}
    ds['gradient_clipping'] = 0.0
    ds.pop('scheduler', None)  # a constant LR: the step is exactly -lr x gradient
    ds['zero_allow_untested_optimizer'] = True  # torch SGD under ZeRO
    return ds


def _train_sgd(tmp, backend, stage, work):
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=STEPS)
    trainer = Trainer(cfg, sgd_ds_config(stage), backend=backend, work_dir=os.path.join(tmp, work))
    try:
        initial = _full_params(trainer)
        summary = trainer.fit()
        return dict(initial=initial, params=_full_params(trainer), summary=summary)
    finally:
        trainer.close()


BACKENDS = [('ddp', 'ddp', 0), ('zero0', 'deepspeed', 0), ('zero1', 'deepspeed', 1),
            ('zero2', 'deepspeed', 2), ('zero3', 'deepspeed', 3)]


@pytest.fixture(scope='module')
def sgd_runs(tmp_path_factory):
    """The same SGD run (4 steps, accumulation 2, 2 ranks) under DDP and ZeRO 0-3."""
    tmp = str(tmp_path_factory.mktemp('sgd'))
    out = {}
    for name, backend, stage in BACKENDS:
        ranks = run_on_ranks(_train_sgd, 2, args=(tmp, backend, stage, name))
        out[name] = dict(rank0=ranks[0], rows=read_jsonl(os.path.join(tmp, name, 'metrics.jsonl')))
    return out


@pytest.mark.parametrize('name', ['zero0', 'zero1', 'zero2', 'zero3'])
def test_sgd_final_weights_equal_ddp_to_float32_rounding(sgd_runs, name):
    ref, got = sgd_runs['ddp']['rank0'], sgd_runs[name]['rank0']
    assert got['summary']['exit_reason'] == 'completed'
    assert torch.equal(ref['initial'], got['initial']), 'both runs start from the same weights'
    moved = (ref['params'] - ref['initial']).norm()
    apart = (ref['params'] - got['params']).norm()
    print(f'{name}: |ddp - {name}| / |ddp - start| = {float(apart / moved):.2e}')
    assert moved > 0
    assert apart <= RTOL * moved, f'{name} ends {float(apart / moved):.2e} of the displacement away from DDP'


@pytest.mark.parametrize('name', ['zero0', 'zero1', 'zero2', 'zero3'])
def test_sgd_logged_grad_norm_and_loss_equal_ddp_every_step(sgd_runs, name):
    ref, got = sgd_runs['ddp']['rows'], sgd_runs[name]['rows']
    assert [r['step'] for r in ref] == [r['step'] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert a['grad_norm'] is not None and b['grad_norm'] is not None, (a, b)
        assert b['grad_norm'] == pytest.approx(a['grad_norm'], rel=RTOL, abs=0), \
            f"step {a['step']}: grad_norm DDP {a['grad_norm']} vs {name} {b['grad_norm']}"
        assert b['loss'] == pytest.approx(a['loss'], rel=RTOL, abs=0), f"step {a['step']}: loss"
        assert a['lr'] == b['lr'] == LR


def _train_sgd_json_defaults(tmp, backend, work):
    """The SGD run with a JSON that leaves gradient_clipping out (DeepSpeed's default applies)."""
    from ds_seg.engine.trainer import Trainer
    ds = sgd_ds_config(0)
    del ds['gradient_clipping']
    trainer = Trainer(tiny_cfg(os.path.join(tmp, 'cache'), max_steps=STEPS), ds, backend=backend,
                      work_dir=os.path.join(tmp, work))
    try:
        initial = _full_params(trainer)
        trainer.fit()
        return dict(initial=initial, params=_full_params(trainer), clip=trainer.spec.ds_config['gradient_clipping'])
    finally:
        trainer.close()


def test_a_json_without_gradient_clipping_trains_alike_under_deepspeed_and_ddp(tmp_path):
    """DeepSpeed clips at its default 1.0 when the key is absent; DDP did not clip at all, so the
    same JSON trained another experiment under --backend ddp, and ds_config.json hid it."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    runs = {name: run_on_ranks(_train_sgd_json_defaults, 1, args=(str(tmp_path), backend, name))[0]
            for name, backend in (('ddp', 'ddp'), ('zero0', 'deepspeed'))}
    assert runs['ddp']['clip'] == runs['zero0']['clip'] == GRADIENT_CLIPPING_DEFAULT
    norms = [r['grad_norm'] for r in read_jsonl(os.path.join(tmp_path, 'zero0', 'metrics.jsonl'))]
    assert max(norms) > GRADIENT_CLIPPING_DEFAULT, norms   # the clipping acts: the test can fail
    ref, got = runs['ddp'], runs['zero0']
    moved = (ref['params'] - ref['initial']).norm()
    apart = (ref['params'] - got['params']).norm()
    assert moved > 0 and apart <= RTOL * moved, f'{float(apart / moved):.2e} of the displacement apart'
