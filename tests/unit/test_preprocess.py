"""The device step of the data pipeline (BatchPreprocessor): normalisation, nodata, geometry."""
import numpy as np
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
