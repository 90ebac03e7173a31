"""DataLoaders for training (infinite, per-rank stream) and evaluation (equal shards)."""
import random
import signal

import numpy as np
import torch

from .geotiff import configure_gdal_for_worker
from .sampling import EvalSampler, TrainSampler


def worker_init(worker_id):
    """Per DataLoader worker: ignore the stop signals and Ctrl-C, bound GDAL's cache and threads, seed the RNGs.

    Slurm signals every process of a job step (``scancel --full``, preemption, ``srun``
    forwarding), workers included. SIGUSR1/SIGTERM are meant for the rank, which finishes its step
    and checkpoints (ds_seg.engine.faults.StopRequests); a worker that died of them would crash the
    rank instead. Workers still end with their rank: PyTorch's watchdog stops orphans.

    Samples do not depend on these seeds (the datasets seed from the index); seeding only
    keeps any user transform that uses global RNGs distinct per worker and reproducible.
    """
    # SIGINT and SIGHUP: a terminal's Ctrl-C, and its closing, reach the workers too
    for name in ('SIGUSR1', 'SIGTERM', 'SIGINT', 'SIGHUP'):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    configure_gdal_for_worker()
    seed = torch.initial_seed() % 2 ** 32  # torch already derives it from base seed + worker id
    np.random.seed(seed)
    random.seed(seed)


def _loader_kwargs(num_workers, pin_memory, prefetch_factor):
    kwargs = dict(num_workers=num_workers,
                  pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
                  worker_init_fn=worker_init)
    if num_workers > 0:
        # Persistent workers keep their open files and GDAL cache between epochs/evaluations.
        kwargs.update(persistent_workers=True, prefetch_factor=prefetch_factor)
    return kwargs


def build_train_loader(dataset, micro_batch, rank, world_size, start_micro_step=0, num_workers=2,
                       pin_memory=None, prefetch_factor=4):
    """Infinite loader of ``micro_batch`` samples per step for this rank.

    Resume by passing the number of micro-steps already consumed as ``start_micro_step``.
    Workers open their own raster handles (LRU), bound GDAL's cache and threads, stay alive
    between epochs (persistent) and prefetch ``prefetch_factor`` batches each; batches go to
    pinned memory when CUDA is there.

    Example::

        loader = build_train_loader(train_set, micro_batch=8, rank=rank, world_size=world)
        batch = next(iter(loader))     # dict(image=B x C x H x W, label=B x H x W)
    """
    configure_gdal_for_worker()
    if hasattr(dataset, 'set_sampling_layout'):
        # Before the workers get their copy: the dataset recovers the global micro-step from
        # each index with it, for the per-step random scale that all ranks agree on.
        dataset.set_sampling_layout(world_size, micro_batch)
    return torch.utils.data.DataLoader(
        dataset, batch_size=micro_batch, drop_last=True,
        sampler=TrainSampler(rank, world_size, micro_batch, start_micro_step),
        **_loader_kwargs(num_workers, pin_memory, prefetch_factor))


def build_eval_loader(dataset, batch_size, rank, world_size, num_workers=2, pin_memory=None,
                      prefetch_factor=2):
    """Finite loader over this rank's shard; every rank gets the same number of batches.

    Example::

        for batch in build_eval_loader(val_set, batch_size=8, rank=rank, world_size=world):
            ...   # labels of padding windows are all ignore_index
    """
    configure_gdal_for_worker()
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, drop_last=False,
        sampler=EvalSampler(len(dataset), rank, world_size),
        **_loader_kwargs(num_workers, pin_memory, prefetch_factor))
