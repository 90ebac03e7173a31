"""Samplers that give every rank distinct, reproducible sample indices.

The datasets derive a sample entirely from its index (see ``GeoTiffScenes``), so these
samplers are the whole story of *which* data a rank sees: no shuffling state, no epochs to
carry across a resume, and no dependence on the number of DataLoader workers.
"""
import math

import torch


class TrainSampler(torch.utils.data.Sampler):
    """Infinite stream of indices for one rank, laid out by global micro-step.

    Micro-step ``m`` of rank ``r`` reads indices ``(m * world_size + r) * micro_batch + j`` for
    ``j < micro_batch``: ranks never share an index, the union over ranks of the first M
    micro-steps is exactly ``range(M * world_size * micro_batch)``, and a run resumed at
    micro-step ``m`` (``start_micro_step=m``) continues the uninterrupted stream exactly.

    Example::

        sampler = TrainSampler(rank=1, world_size=2, micro_batch=4, start_micro_step=100)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)
    """

    def __init__(self, rank, world_size, micro_batch, start_micro_step=0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if micro_batch < 1 or start_micro_step < 0:
            raise ValueError(f"micro_batch must be >= 1 and start_micro_step >= 0, "
                             f"got {micro_batch} and {start_micro_step}")
        self.rank, self.world_size = int(rank), int(world_size)
        self.micro_batch, self.start_micro_step = int(micro_batch), int(start_micro_step)

    def __iter__(self):
        m = self.start_micro_step
        while True:
            first = (m * self.world_size + self.rank) * self.micro_batch
            yield from range(first, first + self.micro_batch)
            m += 1


class EvalSampler(torch.utils.data.Sampler):
    """A contiguous shard of ``range(num_items)`` per rank, all shards of equal length.

    Every rank must run the same number of forward passes (ZeRO-3 gathers parameters
    collectively in each), so the last shards are padded with indices ``num_items,
    num_items + 1, ...``, which the datasets answer with all-ignore labels: the padding
    costs a little compute and counts nothing. Contiguous shards keep a rank's windows in
    few scenes, which is kind to the file-handle and GDAL block caches.

    Example::

        sampler = EvalSampler(len(val_set), rank, world_size)
        assert len(sampler) == math.ceil(len(val_set) / world_size)
    """

    def __init__(self, num_items, rank, world_size):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.num_items, self.rank, self.world_size = int(num_items), int(rank), int(world_size)
        self.per_rank = math.ceil(self.num_items / self.world_size)

    def __iter__(self):
        return iter(range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank))

    def __len__(self):
        return self.per_rank
