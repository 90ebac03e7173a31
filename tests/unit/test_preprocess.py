"""The device step of the data pipeline (BatchPreprocessor): normalisation, nodata, geometry."""
import numpy as np
import pytest
import torch

from ds_seg.data import BatchPreprocessor
from ds_seg.data.preprocess import apply_geom, geom_code


def test_normalisation_is_the_inference_arithmetic_and_zeroes_nodata():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 65536, (2, 4, 8, 8)).astype(np.uint16)   # values above 32767 too
    raw[0, :, 0, 0] = 65535
    nodata = np.zeros((2, 8, 8), bool)
    nodata[1, 3] = True
    mean = np.array([30000, 1000, 5, 60000], np.float32)
    std = np.array([9000, 300, 2, 100], np.float32)
    batch = dict(image=torch.from_numpy(raw), label=torch.from_numpy(rng.integers(0, 3, (2, 8, 8)).astype(np.uint8)),
                 nodata=torch.from_numpy(nodata))
    before = {k: v.clone() for k, v in batch.items()}
    image, label = BatchPreprocessor(mean, std)(batch, 'cpu')
    # Bit for bit what ds_seg.inference computes on the host for whole-scene prediction.
    expect = (raw.astype(np.float32) - mean[:, None, None]) / std[:, None, None]
    expect[1, :, 3] = 0
    assert image.dtype == torch.float32 and label.dtype == torch.int64
    np.testing.assert_array_equal(image.numpy(), expect)
    np.testing.assert_array_equal(label.numpy(), batch['label'].numpy())
    assert all(torch.equal(before[k], batch[k]) for k in batch), 'the loader batch was modified'


@pytest.mark.parametrize('dtype', [np.uint8, np.uint16, np.int16])
def test_the_usual_pixel_types_normalise_in_float32_bit_for_bit(dtype):
    """uint16 batches took the float64 path meant for uint32/int64 (widened to int32 first, then
    judged 'wide'): 5302 of 16384 values differed from the float32 arithmetic (and on a GPU
    tests/gpu's bit-exact comparison fails), at a float64 pass per batch."""
    rng = np.random.default_rng(1)
    info = np.iinfo(dtype)
    raw = rng.integers(max(info.min, -30000), min(info.max, 60000), (2, 3, 32, 32)).astype(dtype)
    mean = np.array([91.37, 1043.61, 7.123], np.float64)
    std = np.array([17.9, 313.3, 2.71], np.float64)
    got = BatchPreprocessor(mean, std).images(torch.from_numpy(raw), None, 'cpu').numpy()
    want = (raw.astype(np.float32) - mean.astype(np.float32)[:, None, None]) / std.astype(np.float32)[:, None, None]
    np.testing.assert_array_equal(got, want)


def test_geom_codes_are_numpy_flips_then_rotations():
    x = torch.arange(2 * 4 * 4).reshape(2, 4, 4)
    seen = set()
    for hflip in (0, 1):
        for vflip in (0, 1):
            for turns in range(4):
                a = x.numpy()
                a = a[..., ::-1] if hflip else a
                a = a[..., ::-1, :] if vflip else a
                a = np.rot90(a, turns, axes=(-2, -1))
                out = apply_geom(x, geom_code(hflip, vflip, turns))
                np.testing.assert_array_equal(out.numpy(), a)
                seen.add(out.numpy().tobytes())
    assert len(seen) == 8   # the dihedral group of the square: every element reachable


def test_geom_moves_image_label_and_nodata_together():
    rng = np.random.default_rng(1)
    values = rng.integers(1, 200, (3, 1, 6, 6)).astype(np.uint8)
    nodata = np.zeros((3, 6, 6), bool)
    nodata[:, 0, :2] = True                             # a nodata corner in every sample
    labels = values[:, 0].copy()
    labels[nodata] = 255
    codes = [geom_code(1, 0, 0), geom_code(0, 1, 1), geom_code(1, 1, 3)]
    batch = dict(image=torch.from_numpy(values), label=torch.from_numpy(labels), nodata=torch.from_numpy(nodata),
                 geom=torch.tensor(codes))
    image, label = BatchPreprocessor([0.0], [1.0])(batch, 'cpu')
    for i, code in enumerate(codes):
        valid = label[i] != 255
        assert torch.equal(image[i, 0][valid], label[i][valid].float())  # pixel and class travel together
        assert (image[i, 0][~valid] == 0).all() and (~valid).sum() == 2
        np.testing.assert_array_equal(label[i].numpy(), apply_geom(torch.from_numpy(labels[i]), code).numpy())


def _loader_batches(n, seed=2):
    rng = np.random.default_rng(seed)
    return [dict(image=torch.from_numpy(rng.integers(0, 256, (2, 3, 8, 8)).astype(np.uint8)),
                 label=torch.from_numpy(rng.integers(0, 4, (2, 8, 8)).astype(np.uint8)),
                 nodata=torch.from_numpy(rng.random((2, 8, 8)) < 0.1),
                 geom=torch.from_numpy(rng.integers(0, 16, 2)))
            for _ in range(n)]


class _CountingLoader:
    """The loader's iterator, counting what has been taken from it."""

    def __init__(self, batches):
        self.batches, self.taken = batches, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken == len(self.batches):
            raise StopIteration
        self.taken += 1
        return self.batches[self.taken - 1]


def test_prefetching_hands_out_the_loader_order_with_depth_batches_in_flight():
    from ds_seg.data.prefetch import DevicePrefetcher
    batches = _loader_batches(7)
    prep = BatchPreprocessor([10.0, 20.0, 30.0], [2.0, 3.0, 4.0])
    expected = [prep(b, 'cpu') for b in batches]
    for depth in (0, 1, 3):
        loader = _CountingLoader(batches)
        prefetcher = DevicePrefetcher(loader, prep, 'cpu', depth)
        got = []
        for i in range(len(batches)):
            got.append(next(prefetcher))
            # this batch plus `depth` more have been taken, never more (nor fewer: they overlap the step)
            assert loader.taken == min(i + 1 + depth, len(batches)), (depth, i, loader.taken)
        for (image, label), (want_image, want_label) in zip(got, expected):
            assert torch.equal(image, want_image) and torch.equal(label, want_label)
        with pytest.raises(StopIteration):  # a finite loader ends after its last queued batch
            next(prefetcher)


def test_prefetch_wait_is_the_loader_wait_only(monkeypatch):
    """On a fake clock: each loader batch costs 1 s, each preprocessing 100 s."""
    import types
    from ds_seg.data import prefetch
    clock = [0.0]
    monkeypatch.setattr(prefetch, 'time', types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class SlowLoader(_CountingLoader):
        def __next__(self):
            clock[0] += 1.0
            return super().__next__()

    def slow_preprocess(batch, device):
        clock[0] += 100.0
        return batch['image'], batch['label']

    prefetcher = prefetch.DevicePrefetcher(SlowLoader(_loader_batches(4)), slow_preprocess, 'cpu', 1)
    next(prefetcher)
    assert prefetcher.wait_s == 2.0    # the first call fills the queue: two loads
    next(prefetcher)
    assert prefetcher.wait_s == 1.0
