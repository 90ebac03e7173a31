"""Resume a checkpoint at another number of ranks (a requeued job on a different allocation).

* DDP and DeepSpeed ZeRO-0 (fp32/fp16) hold whole, replicated state: it loads as it is.
* ZeRO-1/2/3 (and bf16, whose optimizer is partitioned) are converted once to a DeepSpeed
  *universal* checkpoint (``deepspeed.checkpoint.ds_to_universal``: one fp32 file per parameter
  with its Adam moments) next to the original, ``<root>/.universal-<tag>/``, which every rank
  then loads with ``load_universal`` into its new partition. The conversion drops module buffers,
  so BatchNorm running statistics are put back from the original checkpoint.
* The data position is remapped: the samples consumed so far (``step x accumulation x
  micro-batch x old ranks``) are where the new layout's stream starts, so the resumed run
  neither repeats nor skips samples of the epoch. The micro-batch per rank is kept (it is what
  fits a GPU), so the global batch follows the number of ranks; :func:`describe` says so.

Example::

    if reshard.needed(marker, world_size):
        client_state = reshard.load(backend, root, tag, marker)
"""
import argparse
import contextlib
import io
import os
import shutil

import torch

from .. import distributed
from . import checkpoint
from .optimizer_state import base_optimizer, kept_implementation
from .param_groups import apply_schedule_now


def needed(marker, world_size):
    return marker.get('world_size') not in (None, world_size)


def start_micro_step(saved_micro_step, saved_micro_batch, saved_world_size, micro_batch, world_size):
    """First micro-step of the new layout: the samples already consumed, in new micro-steps.

    Returns ``(micro_step, skipped)``; ``skipped`` samples (fewer than one new micro-step's
    worth, only when the counts do not divide) are left out rather than repeated."""
    consumed = saved_micro_step * saved_micro_batch * saved_world_size
    per_micro_step = micro_batch * world_size
    micro_step = -(-consumed // per_micro_step)  # round up: never read a sample twice
    return micro_step, micro_step * per_micro_step - consumed


def describe(saved, world_size, micro_batch, grad_accum, global_batch, skipped, zero_stage=None):
    """The one line a resumed run prints; ``saved``: micro_batch, grad_accum, world_size of the checkpoint."""
    old_global = saved['micro_batch'] * saved['grad_accum'] * saved['world_size']
    batch = f'global batch {old_global} -> {global_batch}' if old_global != global_batch else f'global batch {global_batch}'
    was = (saved['micro_batch'], saved['grad_accum'])
    layout = (f"micro-batch {micro_batch} x accum {grad_accum}" if was == (micro_batch, grad_accum) else
              f"micro-batch {was[0]} x accum {was[1]} -> {micro_batch} x {grad_accum}")
    return (f"resuming a checkpoint of {saved['world_size']} rank(s) on {world_size}: {layout}, {batch}; optimizer state "
            + ('repartitioned through a DeepSpeed universal checkpoint' if zero_stage else 'kept')
            + ('' if not skipped else f'; {skipped} sample(s) of the epoch skipped to align the data stream'))


def _to_universal(ckpt_dir, out_dir):
    from deepspeed.checkpoint import ds_to_universal
    tmp = out_dir + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=ckpt_dir, output_folder=tmp, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:
        # Its progress bars (tqdm's, on stderr) are not the user's business; a failure is the exception's.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal.main(args)
    except BaseException:   # a Ctrl-C or a full disk mid-conversion: no full-size copy left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out_dir)
    stray = os.path.join(os.path.dirname(out_dir), 'latest_universal')  # the converter's pointer to tmp
    if os.path.isfile(stray) and open(stray).read().strip().startswith('.universal-'):
        os.remove(stray)


def remove_leftover_copies(root):
    """Rank 0, at every resume: the universal copies a run killed mid-reshard left in ``root``
    (full-size, and a later reshard of their tag must not reuse one: a rollback may have saved
    the tag again since, and its weights were loaded without a word)."""
    if distributed.is_main() and os.path.isdir(root):
        for leftover in os.listdir(root):
            if leftover.startswith('.universal-'):
                shutil.rmtree(os.path.join(root, leftover), ignore_errors=True)


def load(backend, root, tag, marker):
    """Load ``root/tag`` into ``backend`` at this run's world size; returns the client state."""
    if not backend.state_partitioned:
        return backend.load(root, tag)
    ckpt_dir = os.path.join(root, tag)
    name = f'.universal-{tag}'
    out_dir = os.path.join(root, name)
    try:
        return _load_universal(backend, root, ckpt_dir, name, out_dir)
    finally:
        if distributed.is_main():
            shutil.rmtree(out_dir, ignore_errors=True)  # a derived copy: the original stays the checkpoint


def _load_universal(backend, root, ckpt_dir, name, out_dir):
    if distributed.is_main():
        _to_universal(ckpt_dir, out_dir)
    distributed.barrier()
    engine = backend.engine
    engine._config.load_universal_checkpoint = True
    try:
        with kept_implementation(base_optimizer(backend.optimizer)):
            path, client_state = engine.load_checkpoint(root, tag=name)
    finally:
        engine._config.load_universal_checkpoint = False
    if path is None:
        raise RuntimeError(f'{ckpt_dir}: DeepSpeed could not load its universal form {out_dir}.')
    apply_schedule_now(backend.scheduler)  # as backend.load does
    # Universal checkpoints carry parameters only: BatchNorm running statistics come from the original.
    state = checkpoint.consolidated_state_dict(ckpt_dir)
    with torch.no_grad():
        for key, buf in engine.module.named_buffers():
            if key in state:
                buf.copy_(state[key].to(buf.dtype))
    distributed.barrier()
    return client_state
