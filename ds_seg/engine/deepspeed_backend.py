"""DeepSpeed backend: the only call of ``deepspeed.initialize`` in ds_seg.

It implements :class:`ds_seg.engine.backend.Backend`, as :class:`DDPBackend` does; the trainer
sees nothing else. DeepSpeed-version workarounds live in ds_seg/engine/ds_workarounds.py.
"""
import os

import torch

from ..config import ConfigError
from . import ds_workarounds, speed
from .common import (BATCHNORM_STATS, average_buffers, global_grad_norm, keep_batchnorm_fp32,
                     prepare_batchnorm)
from .optimizer_state import base_optimizer, kept_implementation
from .param_groups import apply_schedule_now, build_param_groups, group_layout, scale_lr_by_group


# Packages of DeepSpeed's experiment monitors -> the JSON block that starts them.
_MONITOR_PACKAGES = {'wandb': 'wandb', 'comet_ml': 'comet'}


class DeepSpeedBackend:
    name = 'deepspeed'
    uses_deepspeed_comm = True

    @staticmethod
    def precision_run(precision):
        return precision

    @staticmethod
    def zero_stage_of(ds_config):
        return int(ds_config.get('zero_optimization', {}).get('stage', 0))

    def __init__(self, model, spec, optim_cfg=None, unused_parameters=()):  # (DeepSpeed finds those itself)
        import deepspeed
        precision, ds_config = spec.precision, spec.ds_config
        self.precision = precision
        self.device_type = spec.device.type
        self.zero_stage = spec.zero_stage
        self.global_batch = spec.global_batch
        self.ds_config = ds_config
        # Optimizer state (and under ZeRO >= 1 the master weights) is split over the ranks:
        # resuming at another world size goes through DeepSpeed's universal checkpoint.
        self.state_partitioned = bool(self.zero_stage) or precision == 'bf16'
        model = prepare_batchnorm(model, spec.device, spec.world_size)
        if precision in ('fp16', 'bf16'):
            # DeepSpeed casts parameters to half but not buffers: keep BN maths and stats in fp32.
            keep_batchnorm_fp32(model)
        offload = (ds_config.get('zero_optimization', {}).get('offload_optimizer') or {}).get('device') == 'cpu'
        # (describe_run refused a JSON without an optimizer block.)
        ds_config = dict(ds_config, optimizer=speed.choose_adam_params(
            ds_config['optimizer'], spec.device, speed.fused_adam_prebuilt(), offload=offload))
        # Parameters must stay contiguous (not channels_last): DeepSpeed views them as flat bytes.
        # Only the activations go channels_last (forward()).
        self.channels_last = spec.channels_last
        param_groups = build_param_groups(model, optim_cfg)  # its refusals name the config's optim keys
        self.param_group_layout = group_layout(param_groups)
        ds_workarounds.sync_free_zero_norms()
        try:
            with ds_workarounds.inert_initial_fp16_step():
                self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                    model=model, model_parameters=param_groups, config=ds_config)
        except (torch.OutOfMemoryError, torch.distributed.DistError):  # the device or the ranks, not the JSON
            raise
        except (AssertionError, ValueError, NotImplementedError, RuntimeError, NameError, AttributeError,
                KeyError, TypeError, ImportError) as exc:
            # A combination ds_seg's own checks let through and DeepSpeed refuses while building
            # the engine (an untested ZeRO optimizer, an op not built for this device), or fails
            # on (DeepSpeed 0.19's MuAdam/MuSGD: an UnboundLocalError): its words, on one line,
            # before any step.
            detail = (str(exc).strip().splitlines() or [''])[0] or type(exc).__name__
            if spec.device.type == 'cpu' and 'not been implemented on CPU' in detail:
                # Lamb, Lion, 1-bit Adam...: DeepSpeed's fused CUDA ops.
                raise ConfigError(f"--deepspeed_config: 'optimizer.type' {ds_config['optimizer'].get('type')} is "
                                  f"a DeepSpeed CUDA op with no CPU version ({detail}); on the CPU use AdamW, Adam, "
                                  "SGD or Adagrad, or run on a GPU.") from exc
            raise ConfigError(f"--deepspeed_config: DeepSpeed cannot build this engine ({type(exc).__name__}: "
                              f"{detail}); change the JSON (see ds_configs/ for working ones).") from exc
        except Exception as exc:
            # DeepSpeed's W&B or Comet monitor (the JSON's "wandb"/"comet" block) failing to start
            # (no API key, no network) was a 40-line traceback from inside deepspeed.initialize.
            package = type(exc).__module__.split('.')[0]
            if package not in _MONITOR_PACKAGES:
                raise
            detail = (str(exc).strip().splitlines() or [''])[0] or type(exc).__name__
            block = _MONITOR_PACKAGES[package]
            raise ConfigError(f"--deepspeed_config: DeepSpeed's {block} monitor (the JSON's '{block}' block) cannot "
                              f"start ({detail}); set it up, or remove the block (ds_seg's log.trackers=['{block}'] "
                              "logs the run under either backend).") from exc
        if spec.compile_mode:
            self.engine.compile(backend=speed.COMPILE_BACKEND, compile_kwargs=speed.compile_kwargs(spec.compile_mode))
        self.optimizer_impl = speed.optimizer_impl(self.state_holders()[2], spec.device)
        scale_lr_by_group(self.optimizer, self.scheduler)  # optim.layer_decay / paramwise multipliers
        # Resuming reads files that may come from elsewhere: never unpickle arbitrary objects.
        ds_workarounds.use_safe_loader(self.engine)
        self.input_dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(precision)
        self._grad_norm = None
        self._scale_loss_here = ds_workarounds.needs_loss_scaled_here(self.optimizer, precision)
        self._norm_here = ds_workarounds.records_no_grad_norm(self.zero_stage, precision)
        self._norm_scaled = ds_workarounds.records_scaled_grad_norm(self.optimizer, precision)
        self._norm_scale = 1.0  # the loss scale DeepSpeed's recorded norm is multiplied by
        # ZeRO-0 under fp16 autocast: DeepSpeed's torch GradScaler scales the loss in backward.
        self._autocast_scaler = getattr(self.engine, 'torch_autocast_z0_gradscaler', None)

    @property
    def module(self):
        return self.engine.module

    @staticmethod
    def construction_context(spec):
        return construction_context(spec)

    @staticmethod
    def gather(params):
        return gather_partitioned(params)

    def state_holders(self):
        """(module, engine-side optimizer, inner torch optimizer) for ds_seg.memory."""
        opt = self.optimizer
        inner = opt if isinstance(opt, torch.optim.Optimizer) else getattr(opt, 'optimizer', opt)
        return self.engine.module, opt, inner

    def resume_refusal(self, marker, where):
        """Why this run cannot continue a DeepSpeed checkpoint ``marker`` describes, or None."""
        if marker.get('zero_stage') != self.zero_stage:
            return (f"--resume: {where} was saved under ZeRO-{marker.get('zero_stage')} but the DeepSpeed "
                    f"config uses ZeRO-{self.zero_stage}; export it and use load_from= instead.")
        # Native fp16/bf16 wrap the optimizer in DeepSpeed's mixed-precision optimizers, whose
        # state (master weights, loss scale) another precision cannot load; fp32 and autocast
        # runs share the plain optimizer's state.
        saved = marker.get('precision')
        if saved is not None and _optimizer_state_kind(saved) != _optimizer_state_kind(self.precision):
            # A run trained in native fp16 on a CPU (before ds_seg ran bf16 autocast there instead).
            cpu_fp16 = (' (DS_SEG_CPU_FP16=1 runs native fp16 on a CPU again, slowly)'
                        if saved == 'fp16' and self.device_type == 'cpu' else '')
            return (f"--resume: {where} was saved in {saved} but this run uses {self.precision}; DeepSpeed's "
                    f"optimizer state differs between them: use the precision it was trained with{cpu_fp16}, or "
                    "export it and use load_from= instead.")
        from .checkpointer import loss_scaling
        before, now = marker.get('loss_scaling'), loss_scaling(self.ds_config)
        changed = [key for key in (now or {}) if before and key in before and before[key] != now[key]]
        if changed:  # DeepSpeed's fp16 optimizers restore these with the scale: the JSON's never apply
            said = ', '.join(f'{key} {before[key]!r} -> {now[key]!r}' for key in changed)
            return (f"--resume: {where} holds DeepSpeed's fp16 loss scaler, which a resume restores with its own "
                    f"settings, but the DeepSpeed config changes them ({said}; a loss_scale of 0 is dynamic): they "
                    "would be recorded and never applied. Resume with the checkpoint's fp16 block, or start a new "
                    "run from its weights (launch/export.py, then load_from=).")
        return None

    def train(self):
        self.engine.train()

    def eval(self):
        self.engine.eval()

    def forward(self, images_BCHW):
        # Native fp16/bf16 expect inputs in the parameters' dtype; autocast modes take fp32.
        if self.input_dtype is not None:
            images_BCHW = images_BCHW.to(self.input_dtype)
        if self.channels_last:
            images_BCHW = speed.to_channels_last(images_BCHW)
        return self.engine(images_BCHW)

    def backward(self, loss):
        if self._scale_loss_here:
            loss = loss.float() * self.optimizer.loss_scale_config.cur_scale
        self.engine.backward(loss)  # divides by grad_accum; ZeRO optimizers apply the fp16 loss scale

    def is_boundary(self):
        return self.engine.is_gradient_accumulation_boundary()

    def step(self, want_grad_norm=False):
        """Finish a micro-step; at a boundary the optimizer steps. Returns True if it applied."""
        boundary = self.is_boundary()
        if boundary and want_grad_norm and self._norm_here:  # gradients are reduced by now
            # (Read at log steps only: the scaler's scale is a device tensor.)
            scale = float(self._autocast_scaler.get_scale()) if self._autocast_scaler is not None else 1.0
            self._grad_norm = global_grad_norm(self.engine.module.parameters()) / scale
        if boundary and want_grad_norm and self._norm_scaled:
            self._norm_scale = self.loss_scale()  # before the step moves it on
        self.engine.step()
        return boundary and self.engine.was_step_applied()

    def grad_norm(self):
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return self._grad_norm
        return float(norm) / (self._norm_scale if self._norm_scaled else 1.0)

    def loss_scale(self):
        if self.precision not in ('fp16', 'fp16-autocast'):
            return None
        if self._autocast_scaler is not None:
            return float(self._autocast_scaler.get_scale())
        opt = self.optimizer
        for holder in (getattr(opt, 'loss_scale_config', None), opt, getattr(opt, 'loss_scaler', None)):
            scale = getattr(holder, 'cur_scale', None)
            if scale is not None:
                return float(scale)
        return None

    def lr(self):
        return float(self.engine.get_lr()[0])

    @property
    def skipped_steps(self):
        return int(self.engine.skipped_steps)

    def sync_buffers(self):
        average_buffers(self.engine.module)

    # -- checkpoints: every rank must call these --------------------------------------------
    def save(self, directory, tag, client_state):
        ds_workarounds.save_checkpoint_collectively(self.engine, directory, tag, client_state)

    def load(self, directory, tag):
        with kept_implementation(base_optimizer(self.optimizer)):
            path, client_state = self.engine.load_checkpoint(directory, tag=tag)
        if path is None:
            raise RuntimeError(f"{os.path.join(directory, tag)}: DeepSpeed could not load this checkpoint.")
        apply_schedule_now(self.scheduler)
        return client_state


# -- building large models --------------------------------------------------------------------
def gather_partitioned(params):
    """Make ZeRO-3 partitioned ``params`` whole for a block; rank 0's changes are kept on exit."""
    import contextlib
    if not any(hasattr(p, 'ds_id') for p in params):
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def construction_context(spec):
    """``deepspeed.zero.Init`` under ZeRO-3: each parameter is partitioned as soon as its module is
    constructed, so no rank ever holds the full model; pretrained weights loaded by a backbone's
    constructor are gathered module by module. Otherwise a no-op."""
    import contextlib
    if spec.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed
    from ..models.pretrained import gathering_with
    stack = contextlib.ExitStack()
    stack.enter_context(deepspeed.zero.Init(config_dict_or_path=_with_batchnorm_stats_fp32(spec.ds_config)))
    stack.enter_context(gathering_with(gather_partitioned, build_whole=built_whole_then_partitioned))
    return stack


def built_whole_then_partitioned(build, partition=True):
    """The module ``build()`` makes inside ``zero.Init``, built with whole parameters and then
    partitioned as ``zero.Init`` would have (its dtype and device; rank 0's values): for models
    that initialise their layers after building them (timm's init_weights), which zero.Init had
    already partitioned, so the initialisation did nothing, and ZeRO-3 trained another model than
    DDP from the same seed. The module is whole on this rank only while it is built; the same
    random draws as a plain build, so ZeRO-3 starts from DDP's weights. ``partition=False``: built
    outside zero.Init and left so (a model on the meta device, only looked at; a weights file read)."""
    from deepspeed.runtime.zero import partition_parameters
    init = partition_parameters.top_level_context
    if init is None:
        return build()
    partition_parameters.shutdown_init_context()
    try:
        module = build()
    finally:
        partition_parameters.restore_init_context()
    if not partition:
        return module
    dtype = init.dtype if partition_parameters.DeepSpeedTensorOverride.dtype in init.tensor_overrides else None

    def as_built(tensor):  # the device and type zero.Init creates tensors with
        return tensor.to(device=init.local_device, dtype=dtype if tensor.is_floating_point() else None)
    with torch.no_grad():
        for param in module.parameters():  # one at a time: the device never holds the whole model
            param.data = as_built(param.data)
            init._convert_to_zero_parameters([param])
        for buffer in module.buffers():
            buffer.data = as_built(buffer.data)
    init._keep_in_fp32(module)  # the BatchNorm statistics, as zero.Init keeps them (_with_batchnorm_stats_fp32)
    return module


def _with_batchnorm_stats_fp32(ds_config):
    """The config zero.Init builds with: under fp16/bf16 it creates every floating tensor of a
    module's __init__ in that type, BatchNorm's running statistics included (then F.batch_norm:
    'expected scalar type Float but found BFloat16' at the first step of zero3_bf16.json), and
    a pretrained file's statistics were loaded into 16 bits. DeepSpeed's
    ``data_types.keep_in_fp32_modules`` turns the named buffers back to fp32 as each module is
    built, before any weights are loaded into them."""
    data_types = dict(ds_config.get('data_types') or {})
    kept = data_types.get('keep_in_fp32_modules')
    kept = [] if kept in (None, 'auto') else list(kept)
    data_types['keep_in_fp32_modules'] = kept + [name for name in BATCHNORM_STATS if name not in kept]
    return dict(ds_config, data_types=data_types)


def _optimizer_state_kind(precision):
    """Which optimizer state a run in ``precision`` saves: native fp16/bf16 wrap the optimizer in
    DeepSpeed's mixed-precision optimizers; fp32 and autocast runs keep the plain one."""
    return precision if precision in ('fp16', 'bf16') else 'fp32 or autocast'
