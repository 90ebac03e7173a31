"""Per-rank bytes of model state (parameters, gradients, optimizer state), measured from the live
tensors, next to what the ZeRO paper says they should be. This is what makes ZeRO visible on a
CPU, where there is no allocator peak to read: each rank sums the storages it actually holds.

Example::

    measured = state_memory(trainer.backend)          # after the first optimizer step
    expected = zero_formula(measured['num_params'], stage=2, world_size=2, precision='fp32')
    print(measured['optim_bytes'], expected['optim_bytes'])

Categories (a storage is counted once, in the first category that holds it):

* ``params``: the working copy the forward uses (ZeRO-3: this rank's ``ds_tensor`` partition,
  plus any parameter kept whole because it is under ``stage3_param_persistence_threshold``);
* ``grads``: ``.grad`` of parameters plus DeepSpeed's partitioned gradient buffers;
* ``master``: DeepSpeed's fp32 master partition (kept even in fp32 runs, see :func:`zero_formula`);
* ``optim``: the inner torch optimizer's state (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``);
* ``comm_buffers``: reduce/all-gather bucket buffers (``reduce_bucket_size`` sized), reported
  apart because they are a function of the config, not of the model.

Not visible from Python: DDP's C++ reducer buckets (another copy of the gradients, 4 bytes per
parameter in fp32) and allocator slack.
"""
import torch

# DeepSpeed 0.19 attribute names (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py and
# fp16/fused_optimizer.py). Name-mangled Stage-3 privates are spelled in full.
_GRAD_ATTRS = ('averaged_gradients', 'grads_in_partition', 'grad_partitions_flat_buffer',
               '_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition')
_MASTER_ATTRS = ('single_partition_of_fp32_groups', 'fp32_partitioned_groups_flat', 'fp32_groups_flat',
                 'fp32_groups_flat_partition')
_BUFFER_ATTRS = ('ipg_buffer', 'ipg_buckets')  # ipg_buckets: {dtype: IPGBucket(buffer=[...])}


def _tensors(obj, depth=0):
    """Every tensor inside nested lists/tuples/dicts (``.grad`` is collected by the callers)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)
    elif depth < 4 and hasattr(obj, 'buffer'):  # DeepSpeed's IPGBucket dataclasses
        yield from _tensors(obj.buffer, depth + 1)


class _Counter:
    """Sums storage bytes, counting each storage once across all categories."""

    def __init__(self):
        self.seen = set()

    def add(self, tensors):
        total = 0
        for t in tensors:
            if t is None or t.numel() == 0 or t.device.type == 'meta':
                continue  # ZeRO-3 frees a partitioned parameter's .data to an empty tensor
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def state_memory(backend):
    """Bytes of parameters, gradients, master weights and optimizer state this rank holds.

    Call it after the first optimizer step (Adam creates its state lazily) and after a backward
    (gradients are freed by the step). Returns a dict of ints plus ``num_params`` (the full,
    unpartitioned parameter count, equal on every rank).
    """
    module, opt, inner = backend.state_holders()
    params = list(module.parameters())
    num_params = sum(int(getattr(p, 'ds_numel', p.numel())) for p in params)
    count = _Counter()
    param_tensors = []
    for p in params:
        param_tensors.append(p.data)
        if hasattr(p, 'ds_tensor'):
            param_tensors.append(p.ds_tensor)
    out = dict(num_params=num_params, params_bytes=count.add(param_tensors))
    grads = [p.grad for p in params if p.grad is not None]
    for name in _GRAD_ATTRS:
        grads += list(_tensors(getattr(opt, name, None)))
    master = [t for name in _MASTER_ATTRS for t in _tensors(getattr(opt, name, None))]
    grads += [t.grad for t in master if t.grad is not None]
    out['grads_bytes'] = count.add(grads)
    out['master_bytes'] = count.add(master)
    out['optim_bytes'] = count.add(t for state in inner.state.values() for t in _tensors(state))
    out['comm_buffers_bytes'] = count.add(t for name in _BUFFER_ATTRS for t in _tensors(getattr(opt, name, None)))
    out['total_bytes'] = sum(out[k] for k in ('params_bytes', 'grads_bytes', 'master_bytes', 'optim_bytes'))
    return out


def zero_formula(num_params, stage, world_size, precision='fp32', optimizer='adam'):
    """Bytes per rank the ZeRO paper predicts for ``num_params`` (Ψ) parameters.

    ``stage`` None means plain DDP. Half-precision training (``fp16``/``bf16`` native) keeps
    2-byte parameters and gradients plus a 4-byte fp32 master copy; fp32 and autocast keep 4-byte
    parameters and gradients and, under DeepSpeed ZeRO >= 1, still a 4-byte fp32 master partition
    (DeepSpeed clones it even when the parameters are already fp32; DDP and ZeRO-0 fp32 have
    none). Adam's two moments are 8 bytes. ZeRO-1 partitions the optimizer state (moments and
    master), ZeRO-2 also the gradients, ZeRO-3 also the parameters, each over ``world_size``.

    Example::

        zero_formula(10_000_000, stage=2, world_size=4)['optim_bytes']   # 8 * 1e7 / 4 = 2e7
    """
    psi, n = float(num_params), float(world_size)
    half = precision in ('fp16', 'bf16')
    width = 2 if half else 4
    stage_n = -1 if stage is None else int(stage)
    master = 4 if (half or stage_n >= 1) else 0
    moments = {'adam': 8, 'adamw': 8, 'sgd': 4}.get(optimizer.lower(), 8)
    by_stage = dict(
        params_bytes=width * psi / (n if stage_n >= 3 else 1),
        grads_bytes=width * psi / (n if stage_n >= 2 else 1),
        master_bytes=master * psi / (n if stage_n >= 1 else 1),
        optim_bytes=moments * psi / (n if stage_n >= 1 else 1))
    by_stage['total_bytes'] = sum(by_stage.values())
    return {k: int(round(v)) for k, v in by_stage.items()}
