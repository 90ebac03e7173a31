"""DeepSpeed backend: the only call of ``deepspeed.initialize`` in ds_seg.

The trainer sees the same small interface from this class and from :class:`DDPBackend`:
``forward``, ``backward``, ``step``, ``is_boundary``, ``grad_norm``, ``loss_scale``, ``lr``,
``skipped_steps``, ``save``/``load`` and ``module``.
"""
import os

import torch

from .common import average_batchnorm_buffers, global_grad_norm, keep_batchnorm_fp32, prepare_batchnorm
from .param_groups import build_param_groups, scale_lr_by_group


def safe_torch_load(path, map_location=None):
    """``torch.load`` that cannot run code from the file: plain tensors and containers plus the
    few DeepSpeed classes its checkpoints hold (DeepSpeed itself loads with weights_only=False).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
        # torch.serialization.load, not torch.load: export temporarily routes torch.load here.
        return torch.serialization.load(path, map_location=map_location, weights_only=True)


class DeepSpeedBackend:
    name = 'deepspeed'

    def __init__(self, model, ds_config, precision, device, world_size, optim_cfg=None):
        import deepspeed
        self.precision = precision
        self.zero_stage = int(ds_config.get('zero_optimization', {}).get('stage', 0))
        self.micro_batch = ds_config['train_micro_batch_size_per_gpu']
        self.grad_accum = ds_config['gradient_accumulation_steps']
        self.global_batch = ds_config['train_batch_size']
        self.ds_config = ds_config
        model = prepare_batchnorm(model, device, world_size)
        if precision in ('fp16', 'bf16'):
            # DeepSpeed casts parameters to half but not buffers: keep BN maths and stats in fp32.
            keep_batchnorm_fp32(model)
        # Parameters must stay contiguous (not channels_last): DeepSpeed views them as flat bytes.
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=build_param_groups(model, optim_cfg), config=ds_config)
        scale_lr_by_group(self.optimizer, self.scheduler)  # optim.layer_decay / paramwise multipliers
        # Resuming reads files that may come from elsewhere: never unpickle arbitrary objects.
        self.engine.checkpoint_engine.load = safe_torch_load
        self.input_dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(precision)
        self._grad_norm = None
        # DeepSpeed 0.19 scales the loss in engine.backward only for ZeRO optimizers; its ZeRO-0
        # fp16 optimizers still unscale gradients and check them for overflow in step(), so an
        # unscaled loss would train with gradients divided by the loss scale and never see an
        # overflow. We apply the scale ourselves in exactly that case.
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
        scale_cfg = getattr(self.optimizer, 'loss_scale_config', None)
        self._scale_loss_here = (precision == 'fp16' and not isinstance(self.optimizer, ZeROOptimizer)
                                 and scale_cfg is not None and scale_cfg.use_grad_scaling)

    @property
    def module(self):
        return self.engine.module

    def train(self):
        self.engine.train()

    def eval(self):
        self.engine.eval()

    def forward(self, images_BCHW):
        # Native fp16/bf16 expect inputs in the parameters' dtype; autocast modes take fp32.
        if self.input_dtype is not None:
            images_BCHW = images_BCHW.to(self.input_dtype)
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
        if boundary and want_grad_norm and self.zero_stage == 0 and self.precision in ('fp32', 'bf16-autocast'):
            # DeepSpeed records no norm for fp32 ZeRO-0; gradients are reduced by now.
            self._grad_norm = global_grad_norm(self.engine.module.parameters())
        self.engine.step()
        return boundary and self.engine.was_step_applied()

    def grad_norm(self):
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return self._grad_norm
        return float(norm)

    def loss_scale(self):
        if self.precision != 'fp16':
            return None
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

    def sync_batchnorm_stats(self):
        average_batchnorm_buffers(self.engine.module)

    # -- checkpoints: every rank must call these --------------------------------------------
    def save(self, directory, tag, client_state):
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)

    def load(self, directory, tag):
        path, client_state = self.engine.load_checkpoint(directory, tag=tag)
        if path is None:
            raise RuntimeError(f"{os.path.join(directory, tag)}: DeepSpeed could not load this checkpoint.")
        return client_state


# -- building large models --------------------------------------------------------------------
def model_init_context(ds_config):
    """The context to build the model in: ``deepspeed.zero.Init`` under ZeRO-3, so each parameter
    is partitioned as soon as its module is constructed and no rank ever holds the full model;
    otherwise a no-op.

    Example::

        with model_init_context(ds_config):
            model = build(MODELS, cfg.model)
    """
    import contextlib
    if int((ds_config or {}).get('zero_optimization', {}).get('stage', 0)) != 3:
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.Init(config_dict_or_path=ds_config)


def load_state_dict_gathered(model, state_dict, adapt=None):
    """``model.load_state_dict(state_dict, strict=False)`` that also works on a model built under
    ZeRO-3: module by module, only that module's own parameters are gathered (peak memory is the
    largest single module, not the model), filled, and re-partitioned from rank 0's copy.

    Every rank must call it (the gathers are collectives). ``adapt(key, tensor, shape)`` may
    return a tensor of the model's shape for a mismatching one (or raise). Returns
    ``(missing, unexpected)`` key lists.

    Example::

        missing, unexpected = load_state_dict_gathered(model, torch.load('weights.pt')['state_dict'])
    """
    import contextlib
    expected = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            prefix = f'{prefix}.' if prefix else ''
            params = list(module.parameters(recurse=False))
            partitioned = any(hasattr(p, 'ds_id') for p in params)
            if partitioned:
                import deepspeed
                gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
            else:
                gather = contextlib.nullcontext()
            with gather:
                named = list(module.named_parameters(recurse=False)) + [
                    (n, b) for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set]
                for name, tensor in named:
                    key = prefix + name
                    expected.add(key)
                    if key not in state_dict:
                        continue
                    value = state_dict[key]
                    if value.shape != tensor.shape:
                        if adapt is None:
                            raise ValueError(f'{key}: shape {tuple(value.shape)} in the weights, '
                                             f'{tuple(tensor.shape)} in the model.')
                        value = adapt(key, value, tensor.shape)
                    tensor.copy_(value.to(tensor.dtype))
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    return missing, unexpected
