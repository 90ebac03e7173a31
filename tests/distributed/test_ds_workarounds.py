"""The DeepSpeed behaviours ds_seg/engine/ds_workarounds.py works around are still there.

Each test asserts DeepSpeed's behaviour itself (not ds_seg's): when one fails after a DeepSpeed
upgrade, DeepSpeed has changed it, and the matching workaround can be deleted.
"""
import contextlib
import inspect
import os
import re

import pytest
import torch

from tests.dist import run_on_ranks


class _RunsCode:
    """Unpickling this creates a file: evidence that a loader executed code from the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


def _engine(config, weight):
    import deepspeed
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
    base = {'train_micro_batch_size_per_gpu': 1, 'gradient_accumulation_steps': 1,
            'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}, 'zero_optimization': {'stage': 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(base, **config))
    return engine


def _observe(tmp):
    """DeepSpeed's behaviour at each workaround, on one real rank."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils import zero_to_fp32
    from ds_seg import distributed
    from ds_seg.engine import ds_workarounds
    # ds_seg's process-group start, as training has it: DeepSpeed's own would first JIT-build its
    # shared-memory all-reduce op (a minute in a fresh TORCH_EXTENSIONS_DIR, as in CI).
    distributed.init()
    out = {}
    # 1. DeepSpeed's checkpoint loader unpickles anything; ds_seg's refuses.
    bait, marker = os.path.join(tmp, 'bait.pt'), os.path.join(tmp, 'code_ran')
    torch.save({'module': _RunsCode(marker)}, bait)
    TorchCheckpointEngine().load(bait, map_location='cpu')
    out['deepspeed_ran_code'] = os.path.exists(marker)
    os.remove(marker)
    try:
        ds_workarounds.safe_torch_load(bait)
        out['safe_loader_refused'] = False
    except Exception:
        out['safe_loader_refused'] = not os.path.exists(marker)
    out['zero_to_fp32_weights_only_false'] = 'weights_only=False' in inspect.getsource(zero_to_fp32)

    # 2. fp16 ZeRO-0: engine.backward leaves the loss unscaled (the gradient is x, not x * scale).
    get_accelerator().is_fp16_supported = lambda: True   # DeepSpeed refuses fp16 on a CPU otherwise
    engine = _engine({'fp16': {'enabled': True, 'initial_scale_power': 10}}, [[1.0, 1.0]])
    x = torch.tensor([[3.0, 5.0]], dtype=torch.float16)
    engine.backward(engine(x).float().sum())
    out['fp16_zero0_grad'] = engine.module.weight.grad.float().tolist()
    out['fp16_zero0_scale'] = float(engine.optimizer.loss_scale_config.cur_scale)
    out['fp16_zero0_needs_scaling'] = ds_workarounds.needs_loss_scaled_here(engine.optimizer, 'fp16')

    # 2b. fp16 ZeRO-0: building the optimizer takes one zero-gradient step at the JSON's lr
    # (AdamW's weight decay shrinks the weight 1 -> 1 - 10 x 0.05 = 0.5; Adam counts a step).
    adamw = {'fp16': {'enabled': True},
             'optimizer': {'type': 'AdamW', 'params': {'lr': 10.0, 'weight_decay': 0.05, 'torch_adam': True}}}
    for name, context in (('plain', contextlib.nullcontext), ('inert', ds_workarounds.inert_initial_fp16_step)):
        with context():
            engine = _engine(adamw, [[1.0, 1.0]])
        inner = engine.optimizer.optimizer
        # The fp32 master weight the first real step starts from (the fp16 copy is written then).
        out[f'fp16_init_{name}'] = dict(weight=engine.optimizer.fp32_groups[0][0].tolist(),
                                        steps=[float(st['step']) for st in inner.state.values()],
                                        group=(inner.param_groups[0]['lr'], inner.param_groups[0]['weight_decay']))

    # 2c. fp16 ZeRO-0 with a torch optimizer (FP16_UnfusedOptimizer) records the norm of the
    # loss-scaled gradients: |(3, 4)| = 5 at scale 2^10 is recorded as 5120.
    engine = _engine({'fp16': {'enabled': True, 'initial_scale_power': 10}}, [[1.0, 1.0]])
    loss = engine(torch.tensor([[3.0, 4.0]], dtype=torch.float16)).float().sum()
    engine.backward(loss * engine.optimizer.loss_scale_config.cur_scale)   # as ds_seg does (needs_loss_scaled_here)
    engine.step()
    out['fp16_unfused_norm'] = float(engine.get_global_grad_norm())
    out['fp16_unfused_recognised'] = ds_workarounds.records_scaled_grad_norm(engine.optimizer, 'fp16')

    # 3. fp32 ZeRO-0 records no global gradient norm.
    engine = _engine({}, [[1.0, 1.0]])
    engine.backward(engine(torch.tensor([[3.0, 4.0]])).sum())
    engine.step()
    out['fp32_zero0_norm'] = engine.get_global_grad_norm()
    return out


@pytest.fixture(scope='module')
def observed(tmp_path_factory):
    return run_on_ranks(_observe, 1, args=(str(tmp_path_factory.mktemp('ds')),))[0]


def test_deepspeed_checkpoint_loaders_still_unpickle_code(observed):
    # Delete safe_torch_load/use_safe_loader/only_safe_torch_load once DeepSpeed loads safely.
    assert observed['deepspeed_ran_code'] and observed['zero_to_fp32_weights_only_false']
    assert observed['safe_loader_refused']


def test_deepspeed_zero0_fp16_backward_still_leaves_the_loss_unscaled(observed):
    # Delete needs_loss_scaled_here once engine.backward scales the loss for ZeRO-0 fp16 too.
    assert observed['fp16_zero0_scale'] == 1024.0
    assert observed['fp16_zero0_grad'] == [[3.0, 5.0]]
    assert observed['fp16_zero0_needs_scaling'] is True


def test_deepspeed_zero0_fp16_optimizers_still_step_while_built_and_ds_seg_makes_it_inert(observed):
    # Delete inert_initial_fp16_step once FP16_Optimizer/FP16_UnfusedOptimizer stop stepping at init.
    assert observed['fp16_init_plain'] == dict(weight=[[0.5, 0.5]], steps=[1.0], group=(10.0, 0.05))
    assert observed['fp16_init_inert'] == dict(weight=[[1.0, 1.0]], steps=[0.0], group=(10.0, 0.05))


def test_deepspeed_zero0_fp16_unfused_optimizer_still_records_the_scaled_norm(observed):
    # Delete records_scaled_grad_norm once FP16_UnfusedOptimizer divides its norm by the scale.
    assert observed['fp16_unfused_norm'] == 5.0 * 1024
    assert observed['fp16_unfused_recognised'] is True


def test_deepspeed_zero0_fp32_still_records_no_grad_norm(observed):
    # Delete records_no_grad_norm once DeepSpeed reports the norm here.
    assert observed['fp32_zero0_norm'] is None


def test_deepspeed_import_still_pulls_in_mlflow_and_ds_seg_stops_it():
    """Delete keep_autotuner_from_importing_mlflow once ``import deepspeed`` leaves mlflow alone."""
    import subprocess
    import sys
    pytest.importorskip('mlflow')
    check = "import sys; {}import deepspeed; print('mlflow' in sys.modules); import mlflow"
    plain = subprocess.run([sys.executable, '-c', check.format('')], capture_output=True, text=True)
    ours = subprocess.run([sys.executable, '-c', check.format('import ds_seg; ')], capture_output=True, text=True)
    assert plain.returncode == 0 and plain.stdout.split()[-1:] == ['True'], plain.stderr[-2000:]
    assert ours.returncode == 0 and ours.stdout.split()[-1:] == ['False'], ours.stderr[-2000:]   # and mlflow still imports


_ZERO_STEP = (
    "import os, sys; os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0', RANK='0', WORLD_SIZE='1', "
    "LOCAL_RANK='0', DS_ACCELERATOR='cpu'); {}import importlib, torch, deepspeed; "
    "importlib.import_module('deepspeed.comm.torch').build_shm_op = lambda: None; "   # no JIT build (as ds_seg)
    "torch.distributed.init_process_group('gloo', world_size=1, rank=0, store=torch.distributed.HashStore()); "
    "torch.manual_seed(0); model = torch.nn.Linear(4, 2); "
    "engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict("
    "train_micro_batch_size_per_gpu=2, optimizer=dict(type='SGD', params=dict(lr=0.1)), zero_allow_untested_optimizer=True, "
    "zero_optimization=dict(stage={stage}))); "
    "loss = engine(torch.ones(2, 4)).sum(); engine.backward(loss); engine.step(); "
    "print('inductor' if 'torch._inductor.compile_fx' in sys.modules else 'no-inductor', "
    "sys.modules['deepspeed.runtime.zero.muon.muon_optimizer'].__doc__ or 'real', float(loss))")


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_deepspeed_zero_still_imports_muon_and_ds_seg_stands_in(stage):
    """Delete keep_zero_from_importing_muon once DeepSpeed's ZeRO optimizers stop importing its Muon
    modules (and so torch._inductor) to build and step. With the stand-ins, the same step gives the
    same loss, and the compiler is never imported."""
    import subprocess
    import sys
    from ds_seg.engine.ds_workarounds import MUON_STAND_IN
    plain = subprocess.run([sys.executable, '-c', _ZERO_STEP.format('', stage=stage)], capture_output=True, text=True)
    ours = subprocess.run([sys.executable, '-c', _ZERO_STEP.format('import ds_seg; ', stage=stage)],
                          capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert ours.returncode == 0, ours.stderr[-2000:]
    plain_out, ours_out = plain.stdout.strip().splitlines()[-1], ours.stdout.strip().splitlines()[-1]
    assert plain_out.startswith('inductor real '), plain_out
    assert ours_out.startswith(f'no-inductor {MUON_STAND_IN} '), ours_out
    assert plain_out.split()[-1] == ours_out.split()[-1]


def test_the_muon_stand_ins_say_why_and_a_process_that_imported_the_real_modules_keeps_them():
    import subprocess
    import sys
    from ds_seg.engine.ds_workarounds import MUON_STAND_IN
    use = ("from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam as M\n"
           "from deepspeed.runtime.zero.muon import original_muon\n"
           "for call in (lambda: M([]), lambda: original_muon.muon_update(None, None), lambda: original_muon.zeropower):\n"
           "    try:\n        call()\n        print('ran')\n    except Exception as exc:\n        print(type(exc).__name__, exc)\n")
    ours = subprocess.run([sys.executable, '-c', 'import ds_seg\n' + use], capture_output=True, text=True)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout.splitlines()[-3:] == ['RuntimeError ' + MUON_STAND_IN, 'RuntimeError ' + MUON_STAND_IN,
                                             f'AttributeError zeropower: {MUON_STAND_IN}'], ours.stdout
    first = ("import sys, deepspeed.runtime.zero.muon.muon_optimizer as real, ds_seg\n"
             "print(sys.modules['deepspeed.runtime.zero.muon.muon_optimizer'] is real, real.__doc__)")
    kept = subprocess.run([sys.executable, '-c', first], capture_output=True, text=True)
    assert kept.returncode == 0 and kept.stdout.splitlines()[-1].split()[:1] == ['True'], kept.stdout + kept.stderr[-2000:]
    assert MUON_STAND_IN not in kept.stdout


def test_deepspeed_schedulers_still_warn_at_construction_and_ds_seg_quiets_it():
    """Delete quiet_scheduler_start_warning once DeepSpeed's WarmupLR constructor stops logging
    "Attempting to get learning rate from scheduler before it has started"."""
    import subprocess
    import sys
    check = ("import sys; {}import torch; from deepspeed.runtime.lr_schedules import WarmupLR; "
             "WarmupLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), warmup_num_steps=3)")
    message = 'Attempting to get learning rate from scheduler before it has started'
    plain = subprocess.run([sys.executable, '-c', check.format('')], capture_output=True, text=True)
    ours = subprocess.run([sys.executable, '-c', check.format('import ds_seg; ')], capture_output=True, text=True)
    assert plain.returncode == 0 and message in plain.stdout + plain.stderr, plain.stderr[-2000:]
    assert ours.returncode == 0 and message not in ours.stdout + ours.stderr, ours.stderr[-2000:]



def test_deepspeed_still_calls_collectives_torch_deprecates_and_ds_seg_quiets_them():
    """Delete quiet_deprecated_collectives once DeepSpeed's all_gather_into_tensor and
    reduce_scatter_tensor stop calling torch's deprecated functions of those names (or torch
    stops warning)."""
    import subprocess
    import sys
    check = ("import os; os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0', RANK='0', WORLD_SIZE='1', "
             "LOCAL_RANK='0', DS_ACCELERATOR='cpu'); {}import importlib, torch, deepspeed.comm as dsc; "
             # no JIT build, as ds_seg.distributed (deepspeed.comm.torch, as an attribute, is torch itself)
             "importlib.import_module('deepspeed.comm.torch').build_shm_op = lambda: None; "
             "torch.distributed.init_process_group('gloo', world_size=1, rank=0, store=torch.distributed.HashStore()); "
             "dsc.init_distributed('gloo'); dsc.all_gather_into_tensor(torch.zeros(2), torch.ones(2)); "
             "dsc.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))")
    plain = subprocess.run([sys.executable, '-c', check.format('')], capture_output=True, text=True)
    ours = subprocess.run([sys.executable, '-c', check.format('import ds_seg; ')], capture_output=True, text=True)
    for name in ('all_gather_into_tensor', 'reduce_scatter_tensor'):
        message = f'`torch.distributed.{name}` is deprecated'
        assert plain.returncode == 0 and message in plain.stderr, plain.stderr[-2000:]
        assert ours.returncode == 0 and message not in ours.stderr, ours.stderr[-2000:]


def test_deepspeed_zero_norms_still_read_the_host_and_ds_seg_computes_the_same_on_the_device():
    """Delete sync_free_zero_norms once DeepSpeed's norm mask stops copying a host scalar in and its
    ZeRO-1/2 clipping stops testing the norm on the host (two host reads per step on an H100:
    tests/gpu/test_gpu_training.py). Then, while they last: ds_seg's versions give DeepSpeed's
    results, read nothing on the host, and are installed where DeepSpeed's source is the known one."""
    import inspect
    import types
    from unittest import mock

    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    from ds_seg.engine import ds_workarounds
    ds_workarounds.sync_free_zero_norms()
    their_mask = ds_workarounds.deepspeed_originals['mask']
    their_clip = ds_workarounds.deepspeed_originals['clip']
    assert 'is_invalid_grad_norm(clip_norm)' in inspect.getsource(their_clip)

    values = torch.tensor([1.5, float('inf'), -float('inf'), float('nan'), 0.0])
    theirs, ours = values.clone(), values.clone()
    with mock.patch.object(torch, 'tensor', wraps=torch.tensor) as made:
        their_mask(theirs, device='cpu')
    assert any(call.args[:1] == (-1.0,) for call in made.call_args_list), 'DeepSpeed no longer copies -1.0 in'

    def no_host_reads(*_):
        raise AssertionError('read on the host')
    host_reads = [mock.patch.object(torch.Tensor, name, no_host_reads) for name in ('__bool__', 'item', 'tolist')]
    with contextlib.ExitStack() as stack:
        for patch in host_reads:
            stack.enter_context(patch)
        ds_workarounds._mask_nan_or_inf_inplace(ours, device='cpu')
    assert torch.equal(ours.isnan(), theirs.isnan()) and ours.tolist() == [1.5, -1.0, -1.0, -1.0, 0.0] == theirs.tolist()

    # Clipping: no clip (norm 0.5), a clip (norm 8), an invalid norm (inf, nan, DeepSpeed's -1).
    for clip_grad, loss_scale in ((1.0, 1.0), (2.0, 1024.0), (0.0, 4.0)):
        zero = types.SimpleNamespace(clip_grad=clip_grad, loss_scale=loss_scale, device=torch.device('cpu'))
        for norm in (0.5, 8.0, float('inf'), float('nan'), -1.0):
            grads = [torch.linspace(-3, 3, 7), [torch.ones(3), torch.full((2,), -2.0)]]
            expected = [grads[0].clone(), [g.clone() for g in grads[1]]]
            their_clip(zero, [expected[0], expected[1]], torch.tensor(norm))
            with contextlib.ExitStack() as stack:
                for patch in host_reads:
                    stack.enter_context(patch)
                ds_workarounds._unscale_and_clip_grads(zero, [grads[0], grads[1]], torch.tensor(norm))
            assert torch.equal(grads[0], expected[0]), (clip_grad, loss_scale, norm)
            assert all(torch.equal(a, b) for a, b in zip(grads[1], expected[1])), (clip_grad, loss_scale, norm)

    for module in (ds_utils, stage_1_and_2, stage3):
        assert module.mask_nan_or_inf_with_val_inplace is ds_workarounds._mask_nan_or_inf_inplace
    assert stage_1_and_2.DeepSpeedZeroOptimizer.unscale_and_clip_grads is ds_workarounds._unscale_and_clip_grads
    assert ds_workarounds.sync_free_zero_norms() == []    # once


def test_deepspeed_save_checkpoint_still_writes_between_its_collectives():
    """save_checkpoint_collectively runs DeepSpeed's tail (the epilogue, the closing barrier) on a
    rank whose write raised in one of the writers it names: they must still be the engine's
    methods, called after the opening barrier and the tag check and before that tail. The
    behaviour itself: tests/distributed/test_reliability.py (a write failing on one rank)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_seg.engine import ds_workarounds
    assert all(callable(getattr(DeepSpeedEngine, name, None)) for name in ds_workarounds._DEEPSPEED_WRITERS
               if name.startswith('_'))   # (copytree, disk_usage: shutil's)
    source = inspect.getsource(DeepSpeedEngine.save_checkpoint)
    opening, tag_check = source.index('dist.barrier()'), source.index('self._checkpoint_tag_validation(')
    writes = [source.index(f'self.{name}(') for name in ('_save_checkpoint', '_save_zero_checkpoint')]
    epilogue, closing = source.index('self.optimizer.checkpoint_event_epilogue()'), source.rindex('dist.barrier()')
    assert opening < tag_check < min(writes) and max(writes) < epilogue < closing
    # What else runs between the tag check and the epilogue: the NVMe offload copy (named among
    # the writers); any other call there could raise past the writers unnoticed.
    assert max(writes) < source.index('copytree(') < epilogue
    between = source[tag_check:epilogue]
    calls = set(re.findall(r'(?<![\w.])(?:self\.)?(\w+)\(', between)) - {'self'}
    assert calls <= ds_workarounds._DEEPSPEED_WRITERS | {
        '_checkpoint_tag_validation', '_create_checkpoint_file', 'dp_index_to_str', 'zero_nvme_offload_optimizer',
        'lambda', 'list', 'filter', 'join', 'info', 'has_moe_layers', 'str', '_optimizer_has_ckpt_event_epilogue',
        'module_state_dict'}, calls   # (the last: named in a comment)
    assert source.count('dist.') == 2, 'another collective in save_checkpoint'   # the two barriers
