"""Batches on the device ahead of the step that needs them.

The DataLoader's workers read windows in parallel with training, and on CUDA it puts each batch in
pinned host memory. What is left on the step's critical path is the host-to-device copy and the
device preprocessing (``BatchPreprocessor``): normalisation, nodata, flips. ``DevicePrefetcher``
takes those off it by keeping ``depth`` batches already copied and preprocessed:

- on CUDA the copies (``non_blocking`` from pinned memory) and the preprocessing kernels are queued
  on a side stream while the default stream still runs the previous step; the step's stream waits
  for the batch it takes through an event, never through the host;
- elsewhere there is no second stream to overlap with, but the same queue runs (the work is only
  moved earlier), so CPU tests exercise exactly the order, ownership and resume behaviour the GPU
  path has.

Batches come out in loader order whatever the depth: the preprocessing is a function of the batch
alone (its flips travel in the batch as ``geom``), so prefetching changes no result.

``wait_s`` is the host time the last ``next()`` spent waiting for the loader: the data-wait share
the run metrics report, not the preprocessing queued behind it.

Example::

    batches = DevicePrefetcher(iter(loader), BatchPreprocessor.for_dataset(ds), device, depth=2)
    images_BCHW, labels_BHW = next(batches)
"""
import collections
import time

import torch


def default_depth(device):
    """Batches kept ahead when ``data.prefetch_batches`` is None: two on CUDA (one being copied
    while the step runs, one ready), one elsewhere."""
    return 2 if torch.device(device).type == 'cuda' else 1


class DevicePrefetcher:
    """Iterator of ``(images_BCHW, labels_BHW)`` on ``device``, ``depth`` batches ahead of the
    caller (``depth`` 0: each batch is copied and preprocessed when it is taken)."""

    def __init__(self, batches, preprocess, device, depth):
        if depth < 0:
            raise ValueError(f'prefetch depth must be >= 0, got {depth}')
        self.batches, self.preprocess = batches, preprocess
        self.device, self.depth = torch.device(device), depth
        self.stream = torch.cuda.Stream(self.device) if self.device.type == 'cuda' and depth else None
        self.ready = collections.deque()   # (images, labels, event or None), oldest first
        self.exhausted = False
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def _load(self):
        """Take the loader's next batch and queue its copy and preprocessing; returns the host
        seconds spent waiting for the loader."""
        t0 = time.perf_counter()
        batch = next(self.batches)
        waited = time.perf_counter() - t0
        if self.stream is None:
            self.ready.append((*self.preprocess(batch, self.device), None))
            return waited
        with torch.cuda.stream(self.stream):
            images, labels = self.preprocess(batch, self.device)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.ready.append((images, labels, done))
        return waited

    def __next__(self):
        waited = 0.0
        while len(self.ready) <= self.depth and not self.exhausted:  # the one taken now + depth
            try:
                waited += self._load()
            except StopIteration:   # a finite loader: hand out what is queued, then stop
                self.exhausted = True
        if not self.ready:
            raise StopIteration
        images, labels, done = self.ready.popleft()
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)   # device-side: the host does not wait
            # Made on the side stream, used on this one: the caching allocator must not hand
            # their memory back to the side stream before this stream is done with them.
            images.record_stream(current)
            labels.record_stream(current)
        self.wait_s = waited
        return images, labels
