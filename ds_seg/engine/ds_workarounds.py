"""Every place ds_seg works around DeepSpeed behaviour, in one module.

Each entry names the DeepSpeed version it was written against and has a test in
tests/distributed/test_ds_workarounds.py that asserts the behaviour is still there: once DeepSpeed
changes it, that test fails, and the workaround (and its test) can be deleted.

* :func:`safe_torch_load` / :func:`only_safe_torch_load` -- DeepSpeed 0.19 unpickles checkpoint
  files with ``weights_only=False`` (``TorchCheckpointEngine.load``, ``zero_to_fp32``), so a
  downloaded checkpoint could run code. ds_seg routes both through an allow-listed loader.
* :func:`needs_loss_scaled_here` -- DeepSpeed 0.19 applies the fp16 loss scale in
  ``engine.backward`` only for ZeRO optimizers; its ZeRO-0 fp16 optimizers still unscale the
  gradients and check them for overflow in ``step()``, so without this the run would train on
  gradients divided by the scale and never see an overflow.
* :func:`records_no_grad_norm` -- DeepSpeed 0.19 records no global gradient norm for ZeRO-0
  without native fp16 (``get_global_grad_norm()`` is None); ds_seg computes it for the logs
  (under fp16 autocast from the gradients its GradScaler scaled, divided by that scale).
* :func:`records_scaled_grad_norm` -- DeepSpeed 0.19's ``FP16_UnfusedOptimizer`` (ZeRO-0 native
  fp16 with any optimizer but FusedAdam: torch's AdamW on every GPU ds_seg picks it for) records
  the norm of the gradients still multiplied by the loss scale (65536 times the real one with
  the shipped zero0.json); ``FP16_Optimizer`` divides it. ds_seg divides it by the scale the step
  ran with.
* :func:`keep_autotuner_from_importing_mlflow` -- DeepSpeed 0.19's autotuner imports mlflow, when
  it is installed, as ``import deepspeed`` runs: about 3 s of every process's start, for a
  feature ds_seg never uses. That one import is refused (ds_seg's own MLflow tracker still
  imports it).
* :func:`quiet_scheduler_start_warning` -- DeepSpeed 0.19's LR schedulers (WarmupLR and those
  built on it) call ``get_lr()`` in their constructor, which logs "Attempting to get learning
  rate from scheduler before it has started" on every run (and on ds_seg's own check of a JSON's
  scheduler) although nothing is wrong. That one message is filtered from DeepSpeed's logger.
* :func:`inert_initial_fp16_step` -- DeepSpeed 0.19's ZeRO-0 fp16 optimizers (``FP16_Optimizer``,
  ``FP16_UnfusedOptimizer``) call the wrapped optimizer's ``step()`` once with zero gradients
  while they are built, to allocate its state, at the JSON's ``lr``: AdamW's decoupled weight
  decay shrinks every weight by ``lr x weight_decay`` before training, and Adam's step count
  starts at 1 (the first real update is bias-corrected as step 2: about 0.74x of DDP's). That
  step runs with ``lr`` and ``weight_decay`` 0, and its step counts are reset.
* :func:`sync_free_norm_mask` -- DeepSpeed 0.19's gradient norms (ZeRO-1/2 at every step that
  clips, ZeRO-3, ``clip_grad_norm_``) end in ``mask_nan_or_inf_with_val_inplace``, which builds
  ``torch.tensor(-1.0, device=...)`` from a host scalar: a host-to-device copy that
  ``torch.cuda.set_sync_debug_mode('error')`` stopped as synchronising, once per ZeRO-2 step on an
  H100 (tests/gpu). ds_seg's version fills the same -1 from a Python scalar, with no copy.
* Universal checkpoints (ds_seg/engine/reshard.py) carry parameters only, no buffers: the
  BatchNorm running statistics are copied from the original checkpoint there, and loading one
  means setting the engine's private ``_config.load_universal_checkpoint``.
"""
import contextlib
import importlib
import importlib.abc
import logging
import pickle
import sys

import torch


def safe_torch_load(path, map_location=None):
    """``torch.load`` that cannot run code from the file: plain tensors and containers plus the
    few DeepSpeed classes its checkpoints hold."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    from .checkpoint import UnsafeFileError
    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        try:
            # torch.serialization.load, not torch.load: only_safe_torch_load routes torch.load here.
            return torch.serialization.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeFileError(path) from exc


def use_safe_loader(engine):
    """Make ``engine.load_checkpoint`` read files with :func:`safe_torch_load`."""
    engine.checkpoint_engine.load = safe_torch_load


@contextlib.contextmanager
def only_safe_torch_load(module):
    """Within the block, ``module.torch.load`` (e.g. deepspeed.utils.zero_to_fp32's) is
    :func:`safe_torch_load`."""
    original = module.torch.load
    module.torch.load = lambda path, map_location=None, **_: safe_torch_load(path, map_location=map_location)
    try:
        yield
    finally:
        module.torch.load = original


def _inert(initialize_optimizer_states):
    """``initialize_optimizer_states`` whose one zero-gradient step leaves the weights as they
    are and counts no step (see :func:`inert_initial_fp16_step`)."""
    def inert(self):
        groups = self.optimizer.param_groups
        kept = [(g['lr'], g.get('weight_decay')) for g in groups]
        for g in groups:
            g['lr'] = 0.0
            if g.get('weight_decay') is not None:
                g['weight_decay'] = 0.0
        try:
            return initialize_optimizer_states(self)
        finally:
            for g, (lr, decay) in zip(groups, kept):
                g['lr'] = lr
                if decay is not None:
                    g['weight_decay'] = decay
                if 'step' in g:  # DeepSpeed's FusedAdam counts per group
                    g['step'] = 0
            for state in self.optimizer.state.values():
                if 'step' in state:
                    state['step'] = torch.zeros_like(state['step']) if torch.is_tensor(state['step']) else 0
    return inert


@contextlib.contextmanager
def inert_initial_fp16_step():
    """Within the block (``deepspeed.initialize``), DeepSpeed's ZeRO-0 fp16 optimizers allocate
    their state without a step that trains (see the module docstring)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    originals = [(cls, cls.initialize_optimizer_states) for cls in (FP16_Optimizer, FP16_UnfusedOptimizer)]
    for cls, original in originals:
        cls.initialize_optimizer_states = _inert(original)
    try:
        yield
    finally:
        for cls, original in originals:
            cls.initialize_optimizer_states = original


def needs_loss_scaled_here(optimizer, precision):
    """Whether ds_seg must multiply an fp16 loss by the loss scale before ``engine.backward``."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    scale_cfg = getattr(optimizer, 'loss_scale_config', None)
    return (precision == 'fp16' and not isinstance(optimizer, ZeROOptimizer)
            and scale_cfg is not None and scale_cfg.use_grad_scaling)


def records_no_grad_norm(zero_stage, precision):
    """Whether DeepSpeed leaves ``get_global_grad_norm()`` None, so ds_seg computes the norm."""
    return zero_stage == 0 and precision in ('fp32', 'bf16-autocast', 'fp16-autocast')


def records_scaled_grad_norm(optimizer, precision):
    """Whether ``get_global_grad_norm()`` after a step is the norm of the loss-scaled gradients.
    Native fp16 only: ZeRO-0 native bf16 runs the same optimizer class without a loss scale (taken
    for fp16, its norm was divided by no scale: a TypeError at the first log step)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    return precision == 'fp16' and isinstance(optimizer, FP16_UnfusedOptimizer)


class _NoMlflowForTheAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == 'mlflow':
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_globals.get('__name__') == 'deepspeed.autotuning.autotuner':
                    raise ImportError('not imported for DeepSpeed autotuning (ds_seg/engine/ds_workarounds.py)')
                frame = frame.f_back
        return None   # everyone else imports it normally


def keep_autotuner_from_importing_mlflow():
    """Call before DeepSpeed is first imported (ds_seg/__init__.py does)."""
    if not any(isinstance(finder, _NoMlflowForTheAutotuner) for finder in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())


SCHEDULER_START_MESSAGE = 'Attempting to get learning rate from scheduler before it has started'


def _not_the_scheduler_start_warning(record):
    return record.getMessage() != SCHEDULER_START_MESSAGE


def quiet_scheduler_start_warning():
    """Filter DeepSpeed's constructor-time scheduler warning (see the module docstring). DeepSpeed
    logs through ``logging.getLogger('DeepSpeed')``, so this needs no DeepSpeed import."""
    logger = logging.getLogger('DeepSpeed')
    if _not_the_scheduler_start_warning not in logger.filters:
        logger.addFilter(_not_the_scheduler_start_warning)


# The modules of DeepSpeed 0.19 that call mask_nan_or_inf_with_val_inplace by its own name.
deepspeed_norm_mask = None   # DeepSpeed's own, once replaced (its test compares the two)
_NORM_MASK_USERS = ('deepspeed.runtime.utils', 'deepspeed.runtime.zero.stage_1_and_2', 'deepspeed.runtime.zero.stage3')


def _mask_nan_or_inf_inplace(input, device=None, val=-1.):
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` without its host-to-device copy: inf and
    NaN become -1.0 (DeepSpeed's fills -1.0 whatever ``val`` says; so does this)."""
    input.masked_fill_(~torch.isfinite(input), -1.0)


def sync_free_norm_mask():
    """Replace DeepSpeed's norm mask where its modules still hold DeepSpeed's own (see the module
    docstring); returns the names of the modules changed."""
    global deepspeed_norm_mask
    from deepspeed.runtime import utils as ds_utils
    original = deepspeed_norm_mask or getattr(ds_utils, 'mask_nan_or_inf_with_val_inplace', None)
    deepspeed_norm_mask = original
    changed = []
    for name in _NORM_MASK_USERS:
        module = importlib.import_module(name)
        if original is not None and getattr(module, 'mask_nan_or_inf_with_val_inplace', None) is original:
            module.mask_nan_or_inf_with_val_inplace = _mask_nan_or_inf_inplace
            changed.append(name)
    return changed
