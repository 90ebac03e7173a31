"""What decides GPU speed, chosen the same way for both backends: compilation, memory format and
the optimizer implementation. Correctness is tested on CPU; speed is measured on a GPU
(tools/gpu_acceptance.sh).
"""
import torch

# torch.compile's backend for both engines: DeepSpeed's engine.compile() and DDP's module.compile()
# then compile the same module the same way (DeepSpeed calls module.compile(backend=...) itself).
COMPILE_BACKEND = 'inductor'

# train.channels_last=None takes the model type's entry here. Every family stays NCHW until a GPU
# measurement (tools/gpu_acceptance.sh) shows channels_last faster for it: on CPU nothing can decide.
CHANNELS_LAST_BY_MODEL = {}


def channels_last_for(model_type, setting):
    """Whether activations run channels_last: the explicit ``train.channels_last``, else the family default."""
    return bool(CHANNELS_LAST_BY_MODEL.get(model_type, False)) if setting is None else bool(setting)


def compile_kwargs(mode):
    return {'mode': mode}


def to_channels_last(images_BCHW):
    """NHWC strides, same shape: cuDNN's convolutions run natively in this layout (no transposes)."""
    return images_BCHW.contiguous(memory_format=torch.channels_last)


# -- optimizer implementation ---------------------------------------------------------------------
_ADAM_TYPES = ('adam', 'adamw')


def choose_adam_params(optimizer_cfg, device, fused_adam_prebuilt=False, offload=False):
    """The JSON's optimizer block with the fastest Adam that needs no compiler on ``device``.

    - On CUDA with DeepSpeed's FusedAdam prebuilt (``fused_adam_prebuilt``): drop ``torch_adam``,
      so DeepSpeed uses its FusedAdam (no JIT build: it is installed).
    - Else on CUDA: torch's fused AdamW (``torch_adam: true, fused: true``; DeepSpeed passes
      ``fused`` through to torch, DDP gives it to torch directly).
    DDP passes ``fused_adam_prebuilt=False``: it always runs torch's optimizers.
    - On CPU, or with the optimizer offloaded to the CPU: unchanged (torch picks its own).
    An explicit ``fused`` in the JSON is the user's choice and is kept.
    """
    cfg = dict(optimizer_cfg or {'type': 'AdamW'})
    params = dict(cfg.get('params', {}))
    if (str(cfg.get('type', 'AdamW')).lower() not in _ADAM_TYPES or torch.device(device).type != 'cuda'
            or offload or 'fused' in params):
        return cfg
    if fused_adam_prebuilt:
        params.pop('torch_adam', None)  # DeepSpeed then builds its (installed) FusedAdam
    else:
        # torch_adam: without it DeepSpeed would JIT-compile FusedAdam, which needs nvcc on the node.
        params.update(torch_adam=True, fused=True)
    cfg['params'] = params
    return cfg


def fused_adam_prebuilt():
    """Whether DeepSpeed was installed with its FusedAdam op compiled (DS_BUILD_FUSED_ADAM=1)."""
    try:
        from deepspeed.git_version_info import installed_ops
        return bool(installed_ops.get('fused_adam'))
    except Exception:  # an unusual DeepSpeed install: assume a JIT build would be needed
        return False


def optimizer_impl(optimizer, device):
    """What actually runs the update, e.g. ``torch.AdamW fused``, ``torch.AdamW single-tensor``,
    ``deepspeed FusedAdam``: recorded in metrics, summary.json and benchmark rows. ``device``:
    where the optimizer's parameters live (ZeRO-3 gives it its fp32 partitions only at step time)."""
    cls = type(optimizer)
    if not cls.__module__.startswith('torch.'):
        return f"{cls.__module__.split('.')[0]} {cls.__name__}"
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    fused, foreach = group.get('fused'), group.get('foreach')
    if fused is None and foreach is None:
        # torch's own default: foreach where every parameter lives on CUDA, single-tensor otherwise.
        from torch.optim.optimizer import _default_to_fused_or_foreach
        params = [p for g in optimizer.param_groups for p in g['params']]
        if not params:  # torch decides at step time from the parameters it then holds
            params = [torch.nn.Parameter(torch.empty(1, device=device))]
        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    how = 'fused' if fused else 'foreach' if foreach else 'single-tensor'
    return f'torch.{cls.__name__} {how}'
