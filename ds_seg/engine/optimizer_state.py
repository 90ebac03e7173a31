"""Optimizer state restored from a checkpoint, fitted to the optimizer this run built.

A resume restores Adam's moments and step count into whatever implementation this run uses,
which need not be the one that saved them: ds_seg picks torch's fused AdamW or DeepSpeed's
FusedAdam by device and install (speed.choose_adam_params), and ``torch_adam`` may change. The
state means the same in each; its bookkeeping differs:

- torch's ``load_state_dict`` replaces every group's settings with the saved ones, so the saved
  implementation's flags (``fused``, ``foreach``, ``capturable``...) came back and this run's own
  were lost (DeepSpeed's FusedAdam then failed at its first step on a missing ``bias_correction``);
- torch keeps each parameter's step as a tensor, DeepSpeed's ops as a Python int.

The settings a resume does restore (lr, betas, eps, weight_decay...) are the checkpoint's, as
before; the checkpointer refuses a resume whose JSON changes them.

Example::

    with kept_implementation(base_optimizer(engine.optimizer)):
        engine.load_checkpoint(root, tag=tag)
"""
import contextlib

import torch

# Group keys that say how the update runs, not what it computes: this run's values are kept.
IMPLEMENTATION_KEYS = ('fused', 'foreach', 'capturable', 'differentiable')


def base_optimizer(optimizer):
    """The optimizer holding the state under DeepSpeed's wrappers (ZeRO, fp16/bf16)."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, 'optimizer'):
        optimizer = optimizer.optimizer
    return optimizer


def _settings(group):
    return {k: v for k, v in group.items() if k != 'params'}


@contextlib.contextmanager
def kept_implementation(optimizer):
    """Restore optimizer state inside this block; on leaving it, ``optimizer``'s groups hold this
    run's implementation settings (and any key its class needs that the saved groups lacked) and
    each parameter's step is in the form its class steps with."""
    built = [_settings(g) for g in optimizer.param_groups]
    hook = optimizer.register_load_state_dict_pre_hook(_count_per_parameter)
    try:
        yield
    finally:
        hook.remove()
    for group, mine in zip(optimizer.param_groups, built):
        for key, value in mine.items():
            if key in IMPLEMENTATION_KEYS or key not in group:
                group[key] = value
    fit_steps(optimizer)


def _count_per_parameter(optimizer, state_dict):
    """A saved state with int step counts (DeepSpeed's ops) as per-parameter counts.

    DeepSpeed's FusedAdam counts one step per group, in the state of the group's last parameter
    only (the others keep the count they started with); torch counts each parameter's steps. Each
    parameter of such a group takes the group's count. Before torch's own loading, which turns
    int counts into tensors as they are."""
    state = dict(state_dict['state'])
    for group in state_dict['param_groups']:
        held = [i for i in group['params'] if i in state]
        counts = [state[i]['step'] for i in held if not torch.is_tensor(state[i].get('step', torch.zeros(())))]
        if counts:
            for i in held:
                if 'step' in state[i] and not torch.is_tensor(state[i]['step']):
                    state[i] = dict(state[i], step=max(counts))
    return dict(state_dict, state=state)


def fit_steps(optimizer):
    """Each parameter's ``step`` as ``optimizer``'s class keeps it: a float32 tensor for torch's
    optimizers (on the parameter's device where fused or capturable, as torch places it), a
    Python int for DeepSpeed's ops. A state without a step takes its group's."""
    torch_kind = type(optimizer).__module__.startswith('torch.')
    # ZeRO-3 hands its optimizer the fp32 partitions only at step time: a state's parameter may
    # be in no group now, and then takes the first group's settings.
    group_of = {id(p): g for g in optimizer.param_groups for p in g['params']}
    first = optimizer.param_groups[0] if optimizer.param_groups else {}
    for param, state in optimizer.state.items():
        group = group_of.get(id(param), first)
        step = state.get('step', group.get('step'))
        if step is None:
            continue
        if torch_kind:
            on_device = bool(group.get('fused') or group.get('capturable'))
            count = float(step.item() if torch.is_tensor(step) else step)
            state['step'] = torch.tensor(count, dtype=torch.float32, device=param.device if on_device else 'cpu')
        else:
            state['step'] = int(step.item()) if torch.is_tensor(step) else step
