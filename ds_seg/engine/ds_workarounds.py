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
* :func:`quiet_deprecated_collectives` -- DeepSpeed 0.19's communication layer calls
  ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor``, which torch 2.14
  deprecates with a FutureWarning: about a dozen lines per rank in every ZeRO-2/3 run that the
  user can do nothing about. Those two messages are filtered.
* :func:`inert_initial_fp16_step` -- DeepSpeed 0.19's ZeRO-0 fp16 optimizers (``FP16_Optimizer``,
  ``FP16_UnfusedOptimizer``) call the wrapped optimizer's ``step()`` once with zero gradients
  while they are built, to allocate its state, at the JSON's ``lr``: AdamW's decoupled weight
  decay shrinks every weight by ``lr x weight_decay`` before training, and Adam's step count
  starts at 1 (the first real update is bias-corrected as step 2: about 0.74x of DDP's). That
  step runs with ``lr`` and ``weight_decay`` 0, and its step counts are reset.
* :func:`sync_free_zero_norms` -- two host reads in every DeepSpeed 0.19 ZeRO-1/2 step that
  computes the gradient norm, which ``torch.cuda.set_sync_debug_mode('error')`` stopped on an H100
  (tests/gpu): ``mask_nan_or_inf_with_val_inplace`` (the norm's inf/NaN mask, ZeRO-3's and
  ``clip_grad_norm_``'s too) builds ``torch.tensor(-1.0, device=...)`` from a host scalar, a
  host-to-device copy that waits for the stream; and ``unscale_and_clip_grads`` asks on the host
  whether the norm is finite before it clips. ds_seg's versions compute the same values on the
  device. They replace DeepSpeed's only where its source is the one they were written against
  (a SHA-256 of it), so another DeepSpeed keeps its own.
* :func:`save_checkpoint_collectively` -- DeepSpeed 0.19's ``save_checkpoint`` ends with
  collectives that a rank whose own file write raised (a full disk, EFBIG, an I/O error on its
  shard) never reaches: ZeRO-3's ``checkpoint_event_epilogue`` (an all-gather of the persistent
  parameters) and a ``dist.barrier()``. The other ranks waited there, the failing one in ds_seg's
  exchange of failures, until the process-group timeout, and the run then blamed the network.
  A rank whose write raised runs that tail before the exception goes on.
* Universal checkpoints (ds_seg/engine/reshard.py) carry parameters only, no buffers: the
  BatchNorm running statistics are copied from the original checkpoint there, and loading one
  means setting the engine's private ``_config.load_universal_checkpoint``.
"""
import contextlib
import hashlib
import importlib
import importlib.abc
import inspect
import logging
import pickle
import sys
import traceback

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


MUON_MODULES = ('deepspeed.runtime.zero.muon.muon_optimizer', 'deepspeed.runtime.zero.muon.original_muon')
MUON_STAND_IN = ("DeepSpeed's Muon is not available in a process that imported ds_seg, which refuses it "
                 "(ds_seg/engine/ds_workarounds.py: keep_zero_from_importing_muon)")


class _MuonStandIn:
    """Nothing is an instance of it: ZeRO's isinstance checks answer False, as for any optimizer
    ds_seg builds."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(MUON_STAND_IN)


def _muon_refused(*args, **kwargs):
    raise RuntimeError(MUON_STAND_IN)


def keep_zero_from_importing_muon():
    """Call before DeepSpeed's ZeRO first builds an optimizer (ds_seg/__init__.py does).

    ZeRO-1/2/3 and the bf16 optimizer import DeepSpeed's Muon modules at their start (and at every
    ZeRO-1/2 step) only to ask ``isinstance(optimizer, MuonWithAuxAdam)`` or to reach
    ``muon_update`` for parameters marked ``use_muon``. Importing them compiles Muon's kernels,
    which imports torch._inductor: 1-2 s of every rank's start on a CPU, for an optimizer ds_seg
    refuses (config.py: 'optimizer.type' 'muon'). Stand-in modules answer those questions; anything
    else taken from them says why it is missing. A process that imported the real modules first
    keeps them."""
    import types
    for name, attrs in zip(MUON_MODULES, ({'MuonWithAuxAdam': _MuonStandIn},
                                          {'muon_update': _muon_refused, 'adam_update': _muon_refused,
                                           'MuonWithAuxAdam': _MuonStandIn})):
        if name not in sys.modules:
            stand_in = types.ModuleType(name, MUON_STAND_IN)
            stand_in.__dict__.update(attrs)
            stand_in.__getattr__ = _muon_module_getattr
            sys.modules[name] = stand_in


def _muon_module_getattr(name):
    raise AttributeError(f'{name}: {MUON_STAND_IN}')


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


DEPRECATED_COLLECTIVES = r'`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated'


def quiet_deprecated_collectives():
    """Filter torch's deprecation warnings of the collectives DeepSpeed calls (see the module
    docstring)."""
    import warnings
    warnings.filterwarnings('ignore', message=DEPRECATED_COLLECTIVES, category=FutureWarning)


def _source_sha(function):
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
    except (OSError, TypeError):
        return None


# DeepSpeed 0.19.8's sources of what sync_free_zero_norms replaces.
_DS_NORM_MASK_SHA = '9728853d4df6cd692cc5bc0aa2bfa4b54d85b0b06f30129a424cbdf93cd4ce3c'
_DS_ZERO_CLIP_SHA = '6bf2ce6f97eafcc24c08a0355e7c180992c8e86da5b7f02026eef6fbd68efa74'
# The modules that call mask_nan_or_inf_with_val_inplace by their own name for it.
_NORM_MASK_USERS = ('deepspeed.runtime.utils', 'deepspeed.runtime.zero.stage_1_and_2', 'deepspeed.runtime.zero.stage3')
deepspeed_originals = {}   # what was replaced: 'mask', 'clip' -> DeepSpeed's function (its test compares the two)


def _mask_nan_or_inf_inplace(input, device=None, val=-1.):
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace`` without its host-to-device copy: inf and
    NaN become -1.0 (DeepSpeed's fills -1.0 whatever ``val`` says; so does this)."""
    input.masked_fill_(~torch.isfinite(input), -1.0)


def _unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    """DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` with its host test of
    the norm (``if is_invalid_grad_norm(clip_norm)``) made a ``torch.where`` on the device: an
    invalid norm (not finite, or DeepSpeed's -1 sentinel) still clips as an infinite one."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    if not (torch.is_tensor(total_norm) and total_norm.dtype == torch.float32 and total_norm.numel() == 1):
        # DeepSpeed 0.19.8 passes a one-element float32 norm; anything else keeps its own arithmetic.
        return deepspeed_originals['clip'](self, grad_groups_flat, total_norm)
    combined_scale = self.loss_scale
    if self.clip_grad > 0.:
        clip_norm = torch.where(torch.isfinite(total_norm) & (total_norm >= 0), total_norm, float('inf'))
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * self.loss_scale
    for grad in grad_groups_flat:
        for g in (grad if isinstance(grad, list) else [grad]):
            g.data.mul_(1. / combined_scale)


def sync_free_zero_norms():
    """Install the two replacements (see the module docstring) where DeepSpeed's sources are the
    known ones; returns what was replaced this call ('mask', 'clip')."""
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    done = []
    mask = ds_utils.mask_nan_or_inf_with_val_inplace
    if mask is not _mask_nan_or_inf_inplace and _source_sha(mask) == _DS_NORM_MASK_SHA:
        deepspeed_originals['mask'] = mask
        for name in _NORM_MASK_USERS:
            module = importlib.import_module(name)
            if getattr(module, 'mask_nan_or_inf_with_val_inplace', None) is mask:
                module.mask_nan_or_inf_with_val_inplace = _mask_nan_or_inf_inplace
        done.append('mask')
    clip = DeepSpeedZeroOptimizer.unscale_and_clip_grads
    if clip is not _unscale_and_clip_grads and _source_sha(clip) == _DS_ZERO_CLIP_SHA:
        deepspeed_originals['clip'] = clip
        DeepSpeedZeroOptimizer.unscale_and_clip_grads = _unscale_and_clip_grads
        done.append('clip')
    return done


# DeepSpeed 0.19's save_checkpoint: a barrier, the tag check's all-reduce, then these write the
# rank's files (no collective among them; copytree and disk_usage: the NVMe offload files copied
# in, the largest write of such a save), then the optimizer's checkpoint epilogue (ZeRO-3: an
# all-gather) and the closing barrier.
_DEEPSPEED_WRITERS = frozenset({'_save_checkpoint', '_save_zero_checkpoint', '_create_zero_checkpoint_files',
                                '_save_moe_checkpoint', 'copytree', 'disk_usage'})


def _raised_while_writing(exc):
    """Whether ``exc`` came out of save_checkpoint's writing part (after its collectives but the
    closing barrier), going by the functions its traceback passed through."""
    frames = {frame.f_code.co_name for frame, _ in traceback.walk_tb(exc.__traceback__)}
    return bool(frames & _DEEPSPEED_WRITERS)


def save_checkpoint_collectively(engine, directory, tag, client_state):
    """``engine.save_checkpoint``; where this rank's write raises, it first joins the collectives
    the other ranks go on to (the optimizer's epilogue, the closing barrier), so that every rank
    reaches ds_seg's exchange of failures (checkpoint.save) at once."""
    try:
        engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)
    except Exception as exc:
        if _raised_while_writing(exc):
            import deepspeed.comm as ds_comm
            if engine._optimizer_has_ckpt_event_epilogue():
                engine.optimizer.checkpoint_event_epilogue()
            ds_comm.barrier()
        raise
