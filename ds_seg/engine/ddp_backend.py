"""Plain PyTorch DDP backend with the semantics the DeepSpeed JSON describes.

Same optimizer class and arguments, same LR schedule class (DeepSpeed's own, driven by a torch
optimizer), same micro-batch, accumulation and clipping, torch.amp for precision, the same BN
policy: so a DDP run and a DeepSpeed run of one config differ only in the engine.
"""
import contextlib
import inspect
import os
import pickle

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import distributed
from ..config import ConfigError
from .common import average_buffers, prepare_batchnorm
from .optimizer_state import kept_implementation
from .param_groups import apply_schedule_now, build_param_groups, group_layout, scale_lr_by_group
from . import speed

# Keys of DeepSpeed's optimizer params that choose an implementation, not a hyper-parameter.
_DS_ONLY_OPTIMIZER_KEYS = ('torch_adam', 'adam_w_mode')


def build_optimizer(params, optimizer_cfg, device='cpu'):
    """The torch optimizer DeepSpeed builds for ``optimizer_cfg`` with ``torch_adam: true``
    (fused on CUDA: ds_seg/engine/speed.py)."""
    optimizer_cfg = speed.choose_adam_params(optimizer_cfg, device)
    kind = optimizer_cfg.get('type', 'AdamW')
    kwargs = {k: v for k, v in optimizer_cfg.get('params', {}).items() if k not in _DS_ONLY_OPTIMIZER_KEYS}
    if 'betas' in kwargs:
        kwargs['betas'] = tuple(kwargs['betas'])
    lowered = kind.lower()
    if lowered == 'adam':
        adam_w_mode = optimizer_cfg.get('params', {}).get('adam_w_mode', True)
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **kwargs)
    if lowered == 'adamw':
        return torch.optim.AdamW(params, **kwargs)
    if lowered == 'sgd':
        return torch.optim.SGD(params, **kwargs)
    if lowered == 'adagrad':
        return torch.optim.Adagrad(params, **kwargs)
    # Any other torch.optim name (RMSprop, Adamax, NAdam...) is what DeepSpeed builds for it too.
    cls = getattr(torch.optim, kind, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        return cls(params, **kwargs)
    raise ConfigError(f"--deepspeed_config: 'optimizer.type' {kind!r} is one of DeepSpeed's own optimizers, with no "
                      "DDP equivalent; under --backend ddp use a torch.optim one (AdamW, Adam, SGD, Adagrad, "
                      "RMSprop...), or --backend deepspeed.")


# No buffer broadcast at each forward (BN statistics are averaged before evaluation and saving).
# torch 2.15 deprecates broadcast_buffers with a FutureWarning on every run; its successor
# forward_sync_buffers also syncs at init, which is harmless here: every rank builds the same
# seeded model.
NO_BUFFER_SYNC_PER_FORWARD = ({'forward_sync_buffers': False}
                              if 'forward_sync_buffers' in inspect.signature(DistributedDataParallel).parameters
                              else {'broadcast_buffers': False})


# DeepSpeed's communication_data_type names -> torch's DDP compression hooks.
_COMPRESS_HOOKS = {'fp16': 'fp16_compress_hook', 'bf16': 'bf16_compress_hook'}


def build_scheduler(optimizer, scheduler_cfg):
    if not scheduler_cfg:
        return None
    from deepspeed.runtime import lr_schedules
    cls = getattr(lr_schedules, scheduler_cfg['type'], None)
    if cls is None:
        raise ValueError(f"scheduler.type: {scheduler_cfg['type']!r} is not a DeepSpeed scheduler.")
    return cls(optimizer, **scheduler_cfg.get('params', {}))


def _norm_and_overflow(grads):
    """``(global norm as a device tensor, or None; whether it is not finite)``: the overflow check
    reads the norm once on the host, and the step clips with the same norm (no second pass)."""
    if not grads:
        return None, False
    norm = torch.nn.utils.get_total_norm(grads)
    return norm, not bool(torch.isfinite(norm))


class DeepSpeedLossScale:
    """fp16 loss scaling as DeepSpeed's ZeRO-1/2/3 optimizers do it for the JSON's ``fp16`` block
    (DeepSpeed 0.19's ``DynamicLossScaler.update_scale``, whose logging needs DeepSpeed's process
    group): a static ``loss_scale`` stays; a dynamic one starts at 2^initial_scale_power, skips
    overflowing steps, halves only after ``hysteresis`` of them (not below ``min_loss_scale``) and
    doubles after ``loss_scale_window`` clean ones. (torch's GradScaler, used before, doubled a
    static scale every window, had no hysteresis or floor, and grew a step earlier.) DeepSpeed's
    ZeRO-0 fp16 optimizers differ in one respect: they halve at every overflow, ``hysteresis``
    unused."""

    def __init__(self, fp16_block):
        from deepspeed.runtime.precision_config import get_float16_config
        cfg = get_float16_config({'fp16': dict(fp16_block, enabled=True)})
        self.dynamic = cfg.loss_scale == 0
        self.cur_scale = float(2 ** cfg.initial_scale_power if self.dynamic else cfg.loss_scale)
        self.scale_window, self.min_scale = cfg.loss_scale_window, cfg.min_loss_scale
        self.delayed_shift = self.cur_hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow):
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError('fp16: the loss scale is at fp16.min_loss_scale and the gradients '
                                             'still overflow (as DeepSpeed stops)')
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = self.cur_iter - self.last_overflow_iter - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2
        self.cur_iter += 1

    def scale(self, loss):
        return loss * self.cur_scale

    def unscale(self, optimizer, params):
        """Divide the gradients by the scale; ``(their norm, whether one is not finite)`` (a host read)."""
        grads = [p.grad for p in params]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.cur_scale)
        return _norm_and_overflow(grads)

    def step(self, optimizer, overflow):
        if not overflow:
            optimizer.step()
        self.update_scale(overflow)

    def get_scale(self):
        return float(self.cur_scale)

    _STATE = ('cur_scale', 'cur_iter', 'last_overflow_iter', 'cur_hysteresis')

    def state_dict(self):
        return {key: getattr(self, key) for key in self._STATE}

    def load_state_dict(self, state):
        if not self.dynamic:  # a static loss_scale is the JSON's (torch's GradScaler had doubled it)
            return
        if 'scale' in state:  # a checkpoint of torch's GradScaler (ds_seg before this class)
            state = {'cur_scale': float(state['scale'])}
        for key, value in state.items():
            if key in self._STATE:
                setattr(self, key, value)


class TorchLossScale:
    """torch's GradScaler with its defaults: what DeepSpeed's ZeRO-0 builds for ``torch_autocast``
    fp16 (2^16, doubled every 2000 clean steps, halved on each overflow)."""

    def __init__(self, device):
        self.scaler = torch.amp.GradScaler(device.type)

    def scale(self, loss):
        return self.scaler.scale(loss)

    def unscale(self, optimizer, params):
        self.scaler.unscale_(optimizer)
        return _norm_and_overflow([p.grad for p in params])

    def step(self, optimizer, overflow):
        self.scaler.step(optimizer)   # skips the step where unscale_ found an overflow
        self.scaler.update()

    def get_scale(self):
        return float(self.scaler.get_scale())

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, state):
        if 'cur_scale' in state:  # saved under the JSON's fp16 block (DeepSpeedLossScale): its scale goes on
            state = dict(self.scaler.state_dict(), scale=float(state['cur_scale']))
        self.scaler.load_state_dict(state)


class DDPBackend:
    name = 'ddp'
    state_partitioned = False   # every rank holds the whole state: any world size resumes it
    gather = None               # parameters are never partitioned
    uses_deepspeed_comm = False

    @staticmethod
    def precision_run(precision):
        # Native fp16/bf16 parameters are a DeepSpeed feature; DDP runs them as torch.amp autocast.
        return f'{precision}-autocast' if precision in ('fp16', 'bf16') else precision

    @staticmethod
    def zero_stage_of(ds_config):
        return None

    def __init__(self, model, spec, optim_cfg=None, unused_parameters=()):
        ds_config, device = spec.ds_config, spec.device
        self.zero_stage = None
        self.grad_accum = spec.grad_accum
        self.global_batch = spec.global_batch
        self.clip = float(ds_config.get('gradient_clipping', 0.0))
        self.device = device
        # spec.precision is already the autocast equivalent of a native fp16/bf16 JSON (run_spec.py).
        self.precision = spec.precision
        self.amp_dtype = {'fp16-autocast': torch.float16, 'bf16-autocast': torch.bfloat16}.get(self.precision)
        model = prepare_batchnorm(model, device, spec.world_size).to(device)
        self.channels_last = spec.channels_last
        if self.channels_last:
            # Unlike DeepSpeed, DDP accepts NHWC parameters: no layout change inside convolutions.
            model = model.to(memory_format=torch.channels_last)
        if spec.compile_mode:
            # In place, as DeepSpeed's engine.compile() does: state_dict keys stay unprefixed.
            model.compile(backend=speed.COMPILE_BACKEND, **speed.compile_kwargs(spec.compile_mode))
        # BN buffers are averaged before evaluation and saving, exactly as for DeepSpeed.
        # A parameter the forward never uses (a spare head, a ViT block past the last out_index)
        # stopped DDP at its second step ("Expected to have finished reduction ...
        # find_unused_parameters=True"), where DeepSpeed trains it; DDP then looks for them.
        self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda' else None,
                                           find_unused_parameters=bool(unused_parameters),
                                           **NO_BUFFER_SYNC_PER_FORWARD)
        hook = _COMPRESS_HOOKS.get(str(ds_config.get('communication_data_type')).lower())
        if hook is not None:
            # The JSON's communication_data_type: gradients reduced in 16 bits, as DeepSpeed does
            # (and as fast); it was ignored, DDP reducing in fp32.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            self.ddp.register_comm_hook(None, getattr(default_hooks, hook))
        param_groups = build_param_groups(model, optim_cfg)
        self.param_group_layout = group_layout(param_groups)
        self.optimizer = build_optimizer(param_groups, ds_config.get('optimizer', {'type': 'AdamW'}), device)
        self.optimizer_impl = speed.optimizer_impl(self.optimizer, spec.device)
        self.scheduler = build_scheduler(self.optimizer, ds_config.get('scheduler'))
        scale_lr_by_group(self.optimizer, self.scheduler)  # optim.layer_decay / paramwise multipliers
        self.scaler = None
        if self.amp_dtype == torch.float16:
            # A JSON's fp16 block scales as DeepSpeed's fp16 optimizers do (its static loss_scale,
            # hysteresis, min_loss_scale...); torch_autocast fp16 as DeepSpeed's ZeRO-0 does, with
            # a default torch GradScaler.
            self.scaler = (DeepSpeedLossScale(ds_config.get('fp16') or {}) if spec.json_precision == 'fp16'
                           else TorchLossScale(device))
        self.micro_step = 0
        self._skipped = 0
        self._grad_norm = None

    @property
    def module(self):
        return self.ddp.module

    @staticmethod
    def construction_context(spec):
        return contextlib.nullcontext()

    def state_holders(self):
        """(module, optimizer, inner torch optimizer) for ds_seg.memory."""
        return self.ddp.module, self.optimizer, self.optimizer

    def resume_refusal(self, marker, where):
        """Why this run cannot continue a DDP checkpoint ``marker`` describes, or None."""
        return None   # any DDP checkpoint of the same model (the checkpointer checks that)

    def train(self):
        self.ddp.train()

    def eval(self):
        self.ddp.eval()

    def is_boundary(self):
        return (self.micro_step + 1) % self.grad_accum == 0

    def forward(self, images_BCHW):
        if self.channels_last:
            images_BCHW = speed.to_channels_last(images_BCHW)
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            if self.ddp.training and not self.is_boundary():
                with self.ddp.no_sync():  # reduce once per optimizer step, as DeepSpeed ZeRO-0/1 does
                    return self.ddp(images_BCHW)
            return self.ddp(images_BCHW)

    def backward(self, loss):
        loss = loss / self.grad_accum
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        if self.is_boundary():
            loss.backward()
        else:
            with self.ddp.no_sync():
                loss.backward()

    def step(self, want_grad_norm=False):
        boundary = self.is_boundary()
        self.micro_step += 1
        if not boundary:
            return False
        params = [p for p in self.ddp.parameters() if p.grad is not None]
        # fp16: gradients unscaled, and whether any is not finite decided on the host (so the
        # step and the schedule skip it, as DeepSpeed's do); bf16/fp32 steps read nothing.
        norm, overflow = self.scaler.unscale(self.optimizer, params) if self.scaler is not None else (None, False)
        # The norm stays a device tensor until grad_norm() is called at a log step.
        if overflow:
            self._grad_norm = torch.tensor(float('inf'))
        elif self.clip > 0:
            if norm is None:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            # What clip_grad_norm_ does, with the norm fp16's overflow check already took.
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm)
            self._grad_norm = norm
        elif want_grad_norm:
            self._grad_norm = norm if norm is not None else torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.scaler is not None:
            self.scaler.step(self.optimizer, overflow)
        else:
            self.optimizer.step()
        applied = not overflow
        self.optimizer.zero_grad(set_to_none=True)
        if applied:
            if self.scheduler is not None:
                self.scheduler.step()
        else:
            self._skipped += 1
        return applied

    def grad_norm(self):
        return None if self._grad_norm is None else float(self._grad_norm)

    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler is not None else None

    def lr(self):
        return float(self.optimizer.param_groups[0]['lr'])

    @property
    def skipped_steps(self):
        return self._skipped

    def sync_buffers(self):
        average_buffers(self.ddp.module)

    # -- checkpoints: every rank calls these; rank 0 writes ------------------------------------
    def save(self, directory, tag, client_state):
        path = os.path.join(directory, tag)
        try:
            if distributed.is_main():
                os.makedirs(path, exist_ok=True)
                torch.save({'module': self.ddp.module.state_dict(),
                            'optimizer': self.optimizer.state_dict(),
                            'scheduler': self.scheduler.state_dict() if self.scheduler is not None else None,
                            'scaler': self.scaler.state_dict() if self.scaler is not None else None,
                            'micro_step': self.micro_step, 'skipped_steps': self._skipped,
                            'client_state': client_state},
                           os.path.join(path, 'ddp_state.pt'))
        finally:
            # Also after a failed write: the other ranks wait here for rank 0, and all of them
            # then learn of the failure together (checkpoint.save), not at the timeout.
            distributed.barrier()

    def load(self, directory, tag):
        path = os.path.join(directory, tag, 'ddp_state.pt')
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
        except pickle.UnpicklingError as exc:
            from .checkpoint import UnsafeFileError
            raise UnsafeFileError(path) from exc
        self.ddp.module.load_state_dict(state['module'])
        with kept_implementation(self.optimizer):  # e.g. fused on a GPU, from a CPU run's checkpoint
            self.optimizer.load_state_dict(state['optimizer'])
        if self.scheduler is not None and state['scheduler'] is not None:
            self.scheduler.load_state_dict(state['scheduler'])
            apply_schedule_now(self.scheduler)
        if self.scaler is not None and state['scaler'] is not None:
            self.scaler.load_state_dict(state['scaler'])
        # Checkpoints are taken at optimizer-step boundaries: the next micro-step starts an
        # accumulation window. The saved count, under another grad_accum (a resume on fewer ranks
        # at the same global batch), put every later boundary in the wrong place: steps mixing two
        # windows' gradients and the last micro-batch never applied (DeepSpeed resets it too).
        self.micro_step = 0
        self._skipped = state['skipped_steps']
        return state['client_state']
