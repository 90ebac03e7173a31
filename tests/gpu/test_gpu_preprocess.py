"""GPU check of the device step of the data pipeline (skipped without CUDA; CI has none):
uint8/uint16 windows from pinned memory, normalised and flipped on the GPU, must equal the
same step on the CPU bit for bit."""
import numpy as np
import pytest
import torch

from ds_seg.data import BatchPreprocessor
from ds_seg.data.preprocess import geom_code

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')]


@pytest.mark.parametrize('dtype', [np.uint8, np.uint16])
def test_gpu_device_step_equals_cpu(dtype):
    rng = np.random.default_rng(0)
    high = np.iinfo(dtype).max + 1
    raw = rng.integers(0, high, (4, 3, 32, 32)).astype(dtype)
    nodata = rng.random((4, 32, 32)) < 0.1
    batch = dict(image=torch.from_numpy(raw).pin_memory(),
                 label=torch.from_numpy(rng.integers(0, 6, (4, 32, 32)).astype(np.uint8)).pin_memory(),
                 nodata=torch.from_numpy(nodata).pin_memory(),
                 geom=torch.tensor([geom_code(1, 0, 1), 0, geom_code(0, 1, 2), geom_code(1, 1, 3)]))
    mean, std = [0.3 * high, 0.5 * high, 0.6 * high], [0.2 * high, 0.1 * high, 0.3 * high]
    prep = BatchPreprocessor(mean, std)
    gpu_image, gpu_label = prep(batch, 'cuda')
    cpu_image, cpu_label = prep(batch, 'cpu')
    assert gpu_image.is_cuda and gpu_image.dtype == torch.float32 and gpu_label.dtype == torch.int64
    assert torch.equal(gpu_image.cpu(), cpu_image) and torch.equal(gpu_label.cpu(), cpu_label)
    # Sample 1 is not flipped: the numbers themselves (uint16 above 32767 not wrapped).
    m, sd = (np.asarray(v, np.float32)[:, None, None] for v in (mean, std))
    expect = np.where(nodata[1], np.float32(0), (raw[1].astype(np.float32) - m) / sd)
    np.testing.assert_array_equal(gpu_image[1].cpu().numpy(), expect)


def test_gpu_prefetch_on_a_side_stream_equals_the_direct_step():
    """Batches copied and preprocessed on the prefetcher's stream, while the default stream is
    busy, equal the direct step: the default stream waited for them (an event, not the host)."""
    from ds_seg.data.prefetch import DevicePrefetcher
    rng = np.random.default_rng(1)
    batches = [dict(image=torch.from_numpy(rng.integers(0, 256, (4, 3, 256, 256)).astype(np.uint8)).pin_memory(),
                    label=torch.from_numpy(rng.integers(0, 6, (4, 256, 256)).astype(np.uint8)).pin_memory(),
                    geom=torch.from_numpy(rng.integers(0, 16, 4)))
               for _ in range(6)]
    prep = BatchPreprocessor([100.0, 110.0, 120.0], [50.0, 55.0, 60.0])
    expected = [prep(b, 'cpu') for b in batches]
    prefetcher = DevicePrefetcher(iter(batches), prep, 'cuda', depth=2)
    assert prefetcher.stream is not None and prefetcher.stream != torch.cuda.current_stream()
    busy = torch.randn(4096, 4096, device='cuda')
    for want_image, want_label in expected:
        busy = busy @ busy / 4096          # keep the default stream busy while the copies run
        image, label = next(prefetcher)
        total = image.sum() + label.sum()  # consumed on the default stream
        assert torch.equal(image.cpu(), want_image) and torch.equal(label.cpu(), want_label)
        assert torch.isfinite(total)
