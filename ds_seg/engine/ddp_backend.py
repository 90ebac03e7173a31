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
from .common import average_batchnorm_buffers, prepare_batchnorm
from .optimizer_state import kept_implementation
from .param_groups import apply_schedule_now, build_param_groups, scale_lr_by_group
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
    raise ConfigError(f"optimizer.type: {kind!r} has no DDP equivalent here; use Adam, AdamW or SGD (or --backend deepspeed).")


# No buffer broadcast at each forward (BN statistics are averaged before evaluation and saving).
# torch 2.15 deprecates broadcast_buffers with a FutureWarning on every run; its successor
# forward_sync_buffers also syncs at init, which is harmless here: every rank builds the same
# seeded model.
NO_BUFFER_SYNC_PER_FORWARD = ({'forward_sync_buffers': False}
                              if 'forward_sync_buffers' in inspect.signature(DistributedDataParallel).parameters
                              else {'broadcast_buffers': False})


def build_scheduler(optimizer, scheduler_cfg):
    if not scheduler_cfg:
        return None
    from deepspeed.runtime import lr_schedules
    cls = getattr(lr_schedules, scheduler_cfg['type'], None)
    if cls is None:
        raise ValueError(f"scheduler.type: {scheduler_cfg['type']!r} is not a DeepSpeed scheduler.")
    return cls(optimizer, **scheduler_cfg.get('params', {}))


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

    def __init__(self, model, spec, optim_cfg=None):
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
        self.ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda' else None,
                                           **NO_BUFFER_SYNC_PER_FORWARD)
        self.optimizer = build_optimizer(build_param_groups(model, optim_cfg), ds_config.get('optimizer', {'type': 'AdamW'}),
                                         device)
        self.optimizer_impl = speed.optimizer_impl(self.optimizer, spec.device)
        self.scheduler = build_scheduler(self.optimizer, ds_config.get('scheduler'))
        scale_lr_by_group(self.optimizer, self.scheduler)  # optim.layer_decay / paramwise multipliers
        fp16 = ds_config.get('fp16', {})
        self.scaler = None
        if self.amp_dtype == torch.float16:
            loss_scale = fp16.get('loss_scale', 0)
            self.scaler = torch.amp.GradScaler(
                device.type, init_scale=2.0 ** fp16.get('initial_scale_power', 16) if not loss_scale else loss_scale,
                growth_interval=fp16.get('loss_scale_window', 1000), enabled=True)
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
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.ddp.parameters() if p.grad is not None]
        # The norm stays a device tensor until grad_norm() is called at a log step.
        if self.clip > 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip)
        elif want_grad_norm:
            self._grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        applied = True
        if self.scaler is not None:
            # Dynamic loss scaling decides on the host whether the step applied (so the schedule
            # skips it, as DeepSpeed's does): fp16 steps read the scale; bf16/fp32 steps read nothing.
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale_before  # the scale drops only on overflow
        else:
            self.optimizer.step()
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
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def lr(self):
        return float(self.optimizer.param_groups[0]['lr'])

    @property
    def skipped_steps(self):
        return self._skipped

    def sync_batchnorm_stats(self):
        average_batchnorm_buffers(self.ddp.module)

    # -- checkpoints: every rank calls these; rank 0 writes ------------------------------------
    def save(self, directory, tag, client_state):
        path = os.path.join(directory, tag)
        if distributed.is_main():
            os.makedirs(path, exist_ok=True)
            torch.save({'module': self.ddp.module.state_dict(),
                        'optimizer': self.optimizer.state_dict(),
                        'scheduler': self.scheduler.state_dict() if self.scheduler is not None else None,
                        'scaler': self.scaler.state_dict() if self.scaler is not None else None,
                        'micro_step': self.micro_step, 'skipped_steps': self._skipped,
                        'client_state': client_state},
                       os.path.join(path, 'ddp_state.pt'))
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
        self.micro_step = state['micro_step']
        self._skipped = state['skipped_steps']
        return state['client_state']
