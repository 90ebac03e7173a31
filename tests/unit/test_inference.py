"""Whole-scene inference: stitching reproduces a reference map exactly, outputs are
georeferenced like the input, blending weights add up, evaluation counts what it should."""
import json
import os
import re
import tempfile

import numpy as np
import pytest
import rasterio
import torch
from affine import Affine
from rasterio.transform import from_origin

from ds_seg import inference as inf
from ds_seg.metrics import metrics_from_confusion

K = 5
NODATA = 9999
TRANSFORM = from_origin(431_000.0, 5_412_000.0, 0.25, 0.25)


class LookupModel:
    """Position-independent fake model: class = (value of band 1) mod K, with one-hot logits.

    With mean 0 and std 1 the network sees raw pixel values, so the reference map is a pure
    function of the input: any misplaced window, lost row or wrong blend changes the output.
    Counts its forward calls (ranks must make equal numbers).
    """

    def __init__(self):
        self.calls = 0
        self.batch_sizes = []

    def __call__(self, images_BCHW):
        self.calls += 1
        self.batch_sizes.append(images_BCHW.shape[0])
        cls = images_BCHW[:, 0].round().long().remainder(K)
        return torch.nn.functional.one_hot(cls, K).permute(0, 3, 1, 2).float() * 8.0


def write_scene(path, height, width, bands=2, nodata=NODATA, seed=0, block=64):
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 3000, (bands, height, width)).astype(np.uint16)
    if nodata is not None:
        img[:, 5:9, :] = nodata                  # a nodata stripe across the scene
        img[:, :, width - 3:] = nodata
    with rasterio.open(path, 'w', driver='GTiff', width=width, height=height, count=bands, dtype='uint16',
                       crs='EPSG:32632', transform=TRANSFORM, nodata=nodata, tiled=True,
                       blockxsize=block, blockysize=block, photometric='MINISBLACK') as dst:
        dst.write(img)
    ref = (img[0].astype(np.int64) % K).astype(np.uint8)
    if nodata is not None:
        ref[(img == nodata).all(0)] = inf.CLASS_NODATA
    return img, ref


def predict_classes(model, scene, folder, **kw):
    """The class map ``predict_scene`` writes for ``scene`` (to a new GeoTIFF under ``folder``),
    read back, and its summary."""
    out = os.path.join(tempfile.mkdtemp(dir=str(folder)), 'classes.tif')
    stats = inf.predict_scene(model, scene, out, **kw)
    with rasterio.open(out) as dst:
        return dst.read(1), stats


@pytest.fixture(scope='module')
def scene(tmp_path_factory):
    path = str(tmp_path_factory.mktemp('scene') / 'scene.tif')
    img, ref = write_scene(path, 203, 157)
    return path, img, ref


def test_window_starts_cover_the_scene_with_the_last_window_flush():
    assert inf.window_starts(10, 4, 1) == [0, 3, 6]
    assert inf.window_starts(11, 4, 1) == [0, 3, 6, 7]
    assert inf.window_starts(3, 8, 2) == [0]
    with pytest.raises(ValueError, match='overlap'):
        inf.window_starts(10, 4, 4)


@pytest.mark.parametrize('tile, overlap, batch_size, blend, block, tta', [
    (64, 16, 3, 'gaussian', 64, 'none'),
    (50, 0, 1, 'linear', 32, 'none'),
    (96, 40, 7, 'linear', 48, 'h'),
    (37, 20, 16, 'none', 16, 'hv'),
    (512, 128, 4, 'gaussian', 256, 'none'),    # larger than the scene: one window of the scene's size
    ((40, 72), 12, 5, 'gaussian', 32, 'none'),  # non-square tiles
])
def test_fake_model_reproduces_reference_at_any_tiling(scene, tmp_path, tile, overlap, batch_size, blend, block,
                                                      tta):
    path, _, ref = scene
    model = LookupModel()
    classes, out = predict_classes(model, path, tmp_path, mean=[0, 0], std=[1, 1], tile=tile, overlap=overlap,
                                   batch_size=batch_size, blend=blend, block=block, tta=tta)
    np.testing.assert_array_equal(classes, ref)
    flips = {'none': 0, 'h': 1, 'hv': 3}[tta]
    with rasterio.open(path) as src:  # a tile past the scene is first tried at the scene's size
        probe = int(any(t > n for t, n in zip(np.broadcast_to(tile, 2), (src.height, src.width))))
    assert model.calls == out['forward_calls'] == np.ceil(out['windows'] / batch_size) * (1 + flips) + probe
    assert max(model.batch_sizes) <= batch_size


def _block_rows(model, path, rank, world_size, **kw):
    """``{y0: (scores, wsum, nodata)}`` of the block rows ``rank`` hands over, and the summary."""
    rows = {}

    def sink(y0, scores, wsum, nodata):
        rows[y0] = (scores.copy(), wsum.copy(), nodata.copy())

    return rows, inf.run_scene(model, path, sink, rank=rank, world_size=world_size, **kw)


class BatchMates(LookupModel):
    """LookupModel plus a little of the batch's mean: a window's output depends on its batch-mates,
    as a real model's does in its last bits (the kernels a batch size picks)."""

    def __call__(self, images_BCHW):
        logits = super().__call__(images_BCHW)
        logits[:, 0] += 1e-3 * images_BCHW.mean()  # one class only: softmax ignores a shift of all
        return logits


@pytest.mark.parametrize('model_class', [LookupModel, BatchMates])
def test_ranks_split_bands_with_equal_forward_calls_and_identical_rows(scene, model_class):
    # In-process "ranks" (no process group): each computes only its band; together their block
    # rows are the single-rank rows bit for bit, and every rank makes the same number of
    # forward calls. Each rank runs the single rank's batches (batch-mates from other ranks'
    # rows included): batched from its own first window, a batch-dependent model differed.
    path, _, ref = scene
    # 5 windows a row: batches of 7 straddle rows, and so the ranks' bands.
    kw = dict(mean=[0, 0], std=[1, 1], tile=48, overlap=12, batch_size=7, block=32)
    single, _ = _block_rows(model_class(), path, 0, 1, **kw)
    for world in (2, 3, 8):  # 8 ranks > 7 block rows: some ranks own nothing but still run
        stitched = {}
        calls = []
        for r in range(world):
            model = model_class()
            rows, out = _block_rows(model, path, r, world, **kw)
            a, b = out['band']
            assert all(a <= y0 < b for y0 in rows), (out['band'], sorted(rows))
            stitched.update(rows)
            calls.append(model.calls)
        assert sorted(stitched) == sorted(single)
        for y0, arrays in single.items():
            for mine, theirs in zip(stitched[y0], arrays):
                np.testing.assert_array_equal(mine, theirs)
        assert len(set(calls)) == 1, f'forward calls per rank differ: {calls}'
    classes = np.concatenate([single[y0][0].argmax(0) for y0 in sorted(single)])
    classes[np.concatenate([single[y0][2] for y0 in sorted(single)])] = inf.CLASS_NODATA
    np.testing.assert_array_equal(classes, ref)


def test_output_geotiff_keeps_georeference_nodata_and_block_layout(scene, tmp_path):
    path, _, ref = scene
    out, probs = str(tmp_path / 'classes.tif'), str(tmp_path / 'probs.tif')
    names = ['road', 'building', 'tree', 'water', 'car']
    inf.predict_scene(LookupModel(), path, out, mean=[0, 0], std=[1, 1], classes=names, probs_path=probs,
                      tile=64, overlap=16, block=64)
    with rasterio.open(path) as src, rasterio.open(out) as dst:
        assert dst.crs == src.crs and dst.transform == src.transform
        assert (dst.width, dst.height, dst.count, dst.dtypes[0]) == (src.width, src.height, 1, 'uint8')
        assert dst.nodata == inf.CLASS_NODATA
        assert dst.profile['tiled'] and dst.block_shapes == [(64, 64)]
        assert dst.compression is not None
        np.testing.assert_array_equal(dst.read(1), ref)
        assert json.loads(dst.tags()['classes']) == names
        assert dst.colormap(1)[1] == tuple(inf.default_palette(K)[1]) + (255,)
        assert dst.descriptions == ('class',)
    with rasterio.open(probs) as p:
        assert p.count == K and p.descriptions == tuple(names) and p.transform == TRANSFORM
        prob = p.read()
        valid = ref != inf.CLASS_NODATA
        # one-hot logits of 8: the true class has probability e^8/(e^8+4) = 0.9993 -> 250
        assert (prob.argmax(0)[valid] == ref[valid]).all() and (prob.max(0)[valid] == 250).all()
        assert (prob[:, ~valid] == 255).all()


class _BreaksAfter(LookupModel):
    """LookupModel that fails at its ``n``-th forward call: a run interrupted mid-scene."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def __call__(self, images_BCHW):
        if self.calls + 1 >= self.n:
            raise KeyboardInterrupt('interrupted')
        return super().__call__(images_BCHW)


def test_an_interrupted_prediction_keeps_the_old_output_and_leaves_no_partial_file(scene, tmp_path):
    path, _, ref = scene
    out, probs = str(tmp_path / 'classes.tif'), str(tmp_path / 'probs.tif')
    kw = dict(mean=[0, 0], std=[1, 1], classes=list('abcde'), probs_path=probs, tile=64, overlap=16, block=64,
              batch_size=2)
    inf.predict_scene(LookupModel(), path, out, **kw)
    before = {n: open(tmp_path / n, 'rb').read() for n in ('classes.tif', 'probs.tif')}
    # Block rows have been written when the model breaks: the old files must still be the old ones.
    with pytest.raises(KeyboardInterrupt):
        inf.predict_scene(_BreaksAfter(5), path, out, overwrite=True, **kw)
    assert sorted(os.listdir(tmp_path)) == ['classes.tif', 'probs.tif'], 'no partial file is left'
    assert {n: open(tmp_path / n, 'rb').read() for n in before} == before
    # Into a new name: nothing at all appears under the final name.
    with pytest.raises(KeyboardInterrupt):
        inf.predict_scene(_BreaksAfter(5), path, str(tmp_path / 'new.tif'), overwrite=True, **kw)   # (probs.tif exists)
    assert sorted(os.listdir(tmp_path)) == ['classes.tif', 'probs.tif']


def test_a_gcp_located_scene_gives_its_gcps_to_the_outputs(tmp_path):
    from rasterio.control import GroundControlPoint
    gcps = [GroundControlPoint(row, col, 500000 + col * 0.5, 5000000 - row * 0.5)
            for row, col in ((0, 0), (0, 60), (70, 0), (70, 60))]
    path = str(tmp_path / 'gcp.tif')
    img = np.random.default_rng(0).integers(0, 3000, (2, 70, 60)).astype(np.uint16)
    with rasterio.open(path, 'w', driver='GTiff', width=60, height=70, count=2, dtype='uint16', gcps=gcps,
                       crs='EPSG:32632') as dst:
        dst.write(img)
    out, probs = str(tmp_path / 'classes.tif'), str(tmp_path / 'probs.tif')
    inf.predict_scene(LookupModel(), path, out, mean=[0, 0], std=[1, 1], classes=list('abcde'),
                      probs_path=probs, tile=32, overlap=8, block=32)
    for written in (out, probs):
        with rasterio.open(written) as dst:
            got, crs = dst.gcps
            assert crs == 'EPSG:32632' and [(g.row, g.col, g.x, g.y) for g in got] == \
                [(g.row, g.col, g.x, g.y) for g in gcps]


def test_a_pixel_is_point_scene_gives_its_outputs_the_same_raster_type(tmp_path):
    """The class map of a PixelIsPoint scene was tagged PixelIsArea: equal corners under GDAL's
    default, half a pixel apart for a reader that takes the raster type as written."""
    path = str(tmp_path / 'point.tif')
    with rasterio.open(path, 'w', driver='GTiff', width=30, height=40, count=1, dtype='uint8', crs='EPSG:32632',
                       transform=rasterio.Affine(0.5, 0, 500000, 0, -0.5, 5000000)) as dst:
        dst.write(np.arange(1200, dtype=np.uint8).reshape(1, 40, 30) % 5)
        dst.update_tags(AREA_OR_POINT='Point')
    out, probs = str(tmp_path / 'classes.tif'), str(tmp_path / 'probs.tif')
    inf.predict_scene(LookupModel(), path, out, mean=[0], std=[1], classes=list('abcde'), probs_path=probs,
                      tile=16, overlap=4, block=16)
    for env in ({}, {'GTIFF_POINT_GEO_IGNORE': 'TRUE'}):
        with rasterio.Env(**env), rasterio.open(path) as src:
            for written in (out, probs):
                with rasterio.open(written) as dst:
                    assert dst.tags()['AREA_OR_POINT'] == 'Point' and dst.transform == src.transform, (env, written)
    # An area scene's stays the default.
    area = str(tmp_path / 'area.tif')
    with rasterio.open(area, 'w', driver='GTiff', width=30, height=40, count=1, dtype='uint8', crs='EPSG:32632',
                       transform=rasterio.Affine(0.5, 0, 500000, 0, -0.5, 5000000)) as dst:
        dst.write(np.zeros((1, 40, 30), np.uint8))
    inf.predict_scene(LookupModel(), area, str(tmp_path / 'area_classes.tif'), mean=[0], std=[1],
                      classes=list('abcde'), tile=16, overlap=4, block=16)
    with rasterio.open(tmp_path / 'area_classes.tif') as dst:
        assert dst.tags()['AREA_OR_POINT'] == 'Area'


class BlockMeanModel(torch.nn.Module):
    """A model whose every output is its input's mean over aligned 4x4 blocks (a pooling stage with
    nothing else): it pads to a multiple of 4, as ds_seg's models pad to theirs, so a window off
    that grid sees other blocks than a whole-scene pass, and a window on it sees the same ones."""
    size_divisor = 4

    def forward(self, images_BCHW):
        from ds_seg.models.padding import crop_padding, pad_to_multiple
        x, pad_h, pad_w = pad_to_multiple(images_BCHW[:, :1], 4)
        pooled = torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(x, 4), scale_factor=4)
        return crop_padding(torch.cat([pooled, -pooled], 1) / 500.0, pad_h, pad_w)


def test_windows_start_on_the_models_input_multiple_so_stitching_equals_a_whole_scene_pass(tmp_path):
    """The last window row and column were flush with the scene's end (777 - 128 = 649, off the
    4-pixel grid of a depth-2 UNet): the bottom and right strips were predicted at another pooling
    phase, 70x as far from a whole-scene pass as the rest. Every window on the grid: equal."""
    path = str(tmp_path / 's.tif')
    write_scene(path, 777, 653, bands=1, nodata=None)

    def scores(tile, overlap):
        rows = {}
        inf.run_scene(BlockMeanModel(), path, lambda y0, s, w, nd: rows.update({y0: s / w}), mean=[0], std=[1],
                      tile=tile, overlap=overlap, block=64, blend='gaussian')
        return np.concatenate([rows[y] for y in sorted(rows)], axis=1)

    whole = scores(1024, 0)
    for tile, overlap in ((128, 32), (96, 17), (100, 30)):
        np.testing.assert_allclose(scores(tile, overlap), whole, rtol=1e-5, atol=1e-7, err_msg=f'{tile}/{overlap}')
    assert inf.window_starts(777, 128, 32, align=4) == [0, 96, 192, 288, 384, 480, 576, 652]
    # A multiple larger than the stride (a 16 px tile for a 32 px encoder) would leave gaps: not aligned.
    assert inf.window_starts(50, 16, 4, align=32) == inf.window_starts(50, 16, 4) == [0, 12, 24, 34]
    assert inf.window_starts(653, 100, 30, align=4) == list(range(0, 556, 68)) + [556]


def test_float_input_nan_counts_as_nodata(tmp_path):
    path = str(tmp_path / 'f.tif')
    img = np.arange(40 * 30, dtype=np.float32).reshape(1, 40, 30) % 7
    img[0, 3, 4] = np.nan
    with rasterio.open(path, 'w', driver='GTiff', width=30, height=40, count=1, dtype='float32',
                       crs='EPSG:4326', transform=TRANSFORM) as dst:
        dst.write(img)
    out, _ = predict_classes(LookupModel(), path, tmp_path, mean=[0], std=[1], tile=16, overlap=4, block=16)
    assert out[3, 4] == inf.CLASS_NODATA
    ok = np.ones(out.shape, bool)
    ok[3, 4] = False
    np.testing.assert_array_equal(out[ok], (np.nan_to_num(img[0]).astype(int) % K)[ok])


def _weight_sums(tmp_path, height, width, tile, overlap, blend):
    path = str(tmp_path / f'w{height}x{width}.tif')
    write_scene(path, height, width, bands=1, nodata=None)
    sums = np.zeros((height, width), np.float64)

    def sink(y0, scores, wsum, nodata):
        sums[y0:y0 + wsum.shape[0]] = wsum

    inf.run_scene(LookupModel(), path, sink, mean=[0], std=[1], tile=tile, overlap=overlap,
                  blend=blend, block=16, batch_size=4)
    return sums


def test_linear_weights_sum_to_one_everywhere_including_edges_and_corners(tmp_path):
    # 3 x 4 windows of 32 with overlap 8 (stride 24) fit exactly: the ramps of neighbours are
    # a partition of unity and border sides are not faded, so the sum is 1 at every pixel.
    sums = _weight_sums(tmp_path, 32 + 2 * 24, 32 + 3 * 24, 32, 8, 'linear')
    np.testing.assert_allclose(sums, 1.0, rtol=0, atol=1e-6)
    assert sums[0, 0] == sums[-1, -1] == sums[0, -1] == sums[-1, 0] == 1.0


@pytest.mark.parametrize('blend', ['gaussian', 'linear', 'none'])
def test_weights_positive_everywhere_and_corners_not_faded(tmp_path, blend):
    sums = _weight_sums(tmp_path, 71, 53, 32, 12, blend)  # irregular: last windows overlap more
    # Gaussian weights are floored at 1e-3 of the peak: far from every window centre the sum
    # is small but never 0, so the division by it is always defined.
    assert sums.min() >= (0.999e-3 if blend == 'gaussian' else 0.05)
    w = inf.blend_weights((32, 32), 12, blend, borders=(True, False, True, False))
    assert w[0, 0] == w.max()  # a scene corner keeps full weight
    inner = inf.blend_weights((32, 32), 12, blend)
    assert inner.min() > 0 and np.allclose(inner, inner[::-1, ::-1])


class WindowModel:
    """Logits that differ between overlapping windows at the same scene pixel: each pixel's own
    value plus ramps over the window's rows and columns plus the window's mean. A blend that
    weighs the windows wrongly (or not at all) therefore changes the result, unlike with a
    model whose output at a pixel is the same in every window."""

    def __call__(self, images_BCHW):
        b, _, h, w = images_BCHW.shape
        rows = torch.linspace(-1.5, 1.5, h).view(1, h, 1)
        cols = torch.linspace(-1.5, 1.5, w).view(1, 1, w)
        mean = images_BCHW.mean(dim=(1, 2, 3)).view(b, 1, 1)
        x = images_BCHW[:, 0]
        return torch.stack([x + rows, images_BCHW[:, 1] - cols, 4 * mean + rows * cols], 1)


def _numpy_blend(image_CHW, model, tile, overlap, blend):
    """Blended probabilities ``[K, H, W]`` computed window by window in float64 NumPy, with the
    engine's window starts and weights but none of its accumulation code."""
    _, height, width = image_CHW.shape
    ys, xs = inf.window_starts(height, tile, overlap), inf.window_starts(width, tile, overlap)
    scores, wsum = np.zeros((3, height, width)), np.zeros((height, width))
    for r, y in enumerate(ys):
        for c, x in enumerate(xs):
            window = torch.from_numpy(image_CHW[None, :, y:y + tile, x:x + tile].copy())
            logits = model(window)[0].numpy().astype(np.float64)
            probs = np.exp(logits - logits.max(0))
            probs /= probs.sum(0)
            weights = inf.blend_weights((tile, tile), overlap, blend,
                                        borders=(r == 0, r == len(ys) - 1, c == 0, c == len(xs) - 1))
            scores[:, y:y + tile, x:x + tile] += probs * weights
            wsum[y:y + tile, x:x + tile] += weights
    return scores / wsum


@pytest.mark.parametrize('blend', ['gaussian', 'linear', 'none'])
def test_blend_equals_a_numpy_blend_of_window_dependent_outputs(tmp_path, blend):
    # A float GeoTIFF in [0, 1) normalised with mean 0, std 1: the model sees the file's values.
    # 75 x 61 with tiles of 24 and overlap 10: the last window of each row and column overlaps
    # its neighbour more than the others do, so the weights do not form a regular pattern.
    path = str(tmp_path / 'scene.tif')
    image = np.random.default_rng(1).random((2, 75, 61)).astype(np.float32)
    with rasterio.open(path, 'w', driver='GTiff', width=61, height=75, count=2, dtype='float32',
                       crs='EPSG:32632', transform=TRANSFORM) as dst:
        dst.write(image)
    kw = dict(mean=[0, 0], std=[1, 1], tile=24, overlap=10, blend=blend, block=16, batch_size=5)
    expected = _numpy_blend(image, WindowModel(), 24, 10, blend)
    if blend != 'none':  # the weights matter: the unweighted mean of the windows is far off
        assert np.abs(expected - _numpy_blend(image, WindowModel(), 24, 10, 'none')).max() > 0.05

    rows, _ = _block_rows(WindowModel(), path, 0, 1, **kw)
    blended = np.concatenate([rows[y0][0] / rows[y0][1] for y0 in sorted(rows)], axis=1)
    np.testing.assert_allclose(blended, expected, rtol=0, atol=1e-5)

    # The probabilities GeoTIFF holds round(p * 250): equal to the reference's except where
    # p * 250 is within float32 noise of a rounding boundary.
    probs_path = str(tmp_path / 'probs.tif')
    predict_classes(WindowModel(), path, tmp_path, probs_path=probs_path, **kw)
    with rasterio.open(probs_path) as src:
        written = src.read().astype(np.int64)
    scaled = expected * 250
    on_boundary = np.abs(scaled - np.floor(scaled) - 0.5) < 1e-3
    assert (written == np.rint(scaled))[~on_boundary].all()
    assert np.abs(written - np.rint(scaled)).max() <= 1


def test_memory_is_bounded_by_a_band_of_block_rows(tmp_path):
    # Block rows are handed over as soon as no pending window reaches them: the sink sees row
    # y0 while the first window row below y0 + block + tile has not been read yet.
    path = str(tmp_path / 'tall.tif')
    write_scene(path, 600, 40, bands=1, nodata=None)
    seen = []
    model = LookupModel()
    inf.run_scene(model, path, lambda y0, s, w, n: seen.append((y0, model.calls)), mean=[0], std=[1],
                  tile=32, overlap=8, block=16, batch_size=2)
    assert [y for y, _ in seen] == list(range(0, 600, 16))
    # windows are 2 per window row, stride 24: row y0 is flushed within ~ (block + tile) / 24 rows
    for y0, calls in seen[:-1]:
        assert calls <= (y0 + 16 + 32) / 24 + 2, (y0, calls)


# ---------------------------------------------------------------------------------- evaluation
def test_boundary_mask_hand_computed():
    lbl = np.array([[0, 0, 0, 1, 1],
                    [0, 0, 0, 1, 1],
                    [255, 255, 0, 0, 0]])
    expected_r1 = np.array([[0, 0, 1, 1, 0],
                            [0, 0, 1, 1, 1],
                            [0, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(inf.boundary_mask(lbl, 1), expected_r1)
    assert not inf.boundary_mask(lbl, 0).any()
    # radius 2 is a disk: (0, 1) is 2 px from the 1 at (0, 3), (0, 0) is 3 px away; ignore
    # pixels (255) below (0, 0) create no boundary
    r2 = inf.boundary_mask(lbl, 2)
    assert r2[0, 1] and not r2[0, 0] and r2[2, 2]


def _write_label(path, label):
    with rasterio.open(path, 'w', driver='GTiff', width=label.shape[1], height=label.shape[0], count=1,
                       dtype='uint8', crs='EPSG:32632', transform=TRANSFORM) as dst:
        dst.write(label.astype(np.uint8)[None])


def test_evaluation_leaves_out_label_pixels_the_label_mask_band_hides(tmp_path):
    """The label's mask band marks pixels without a label (GDAL, QGIS): they were scored as the
    values they held (here class 1: the matrix had 12 pixels instead of 5)."""
    img = np.array([[0, 1, 2, 3], [1, 1, 1, 1], [2, 0, 3, 1]], np.uint16)[None]
    lbl = np.array([[0, 1, 2, 0], [1, 1, 1, 1], [2, 1, 1, 1]], np.uint8)
    hidden = np.array([[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1]], bool)
    ip, lp = str(tmp_path / 'i.tif'), str(tmp_path / 'l.tif')
    with rasterio.open(ip, 'w', driver='GTiff', width=4, height=3, count=1, dtype='uint16', crs='EPSG:32632',
                       transform=TRANSFORM) as dst:
        dst.write(img)
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True):
        with rasterio.open(lp, 'w', driver='GTiff', width=4, height=3, count=1, dtype='uint8', crs='EPSG:32632',
                           transform=TRANSFORM) as dst:
            dst.write(lbl[None])
            dst.write_mask(np.where(hidden, 0, 255).astype(np.uint8))
    cm = inf.evaluate_scenes(LookupModel(), [(ip, lp)], num_classes=K, mean=[0], std=[1], tile=2, overlap=1,
                             block=16)['confusion'].numpy()
    expected = np.zeros((K, K), int)
    for t, p in zip(lbl[~hidden], img[0][~hidden] % K):
        expected[t, p] += 1
    assert expected.sum() == 5
    np.testing.assert_array_equal(cm, expected)


def test_evaluation_counts_equal_hand_computed_confusion(tmp_path):
    # Image values choose the prediction (value % K); class 4 is absent from truth and
    # prediction, a row of the image is nodata, one label pixel is ignore.
    img = np.array([[0, 1, 1, 2],
                    [NODATA, NODATA, NODATA, NODATA],
                    [3, 3, 0, 1]], np.uint16)[None]
    lbl = np.array([[0, 1, 2, 2],
                    [0, 0, 0, 0],
                    [3, 255, 1, 1]])
    ip, lp = str(tmp_path / 'i.tif'), str(tmp_path / 'l.tif')
    with rasterio.open(ip, 'w', driver='GTiff', width=4, height=3, count=1, dtype='uint16', crs='EPSG:32632',
                       transform=TRANSFORM, nodata=NODATA) as dst:
        dst.write(img)
    _write_label(lp, lbl)
    res = inf.evaluate_scenes(LookupModel(), [(ip, lp)], num_classes=K, mean=[0], std=[1], tile=2, overlap=1,
                              block=16, batch_size=3, preview_size=4)
    cm = res['confusion']
    # counted pixels (truth -> prediction): (0->0) (1->1) (2->1) (2->2) (3->3) (1->0) (1->1)
    expected = np.zeros((K, K), int)
    for t, p in [(0, 0), (1, 1), (2, 1), (2, 2), (3, 3), (1, 0), (1, 1)]:
        expected[t, p] += 1
    np.testing.assert_array_equal(cm.numpy(), expected)
    m = metrics_from_confusion(cm, ['a', 'b', 'c', 'd', 'e'], exclude=('d',))
    assert m['OA'] == pytest.approx(5 / 7)
    assert m['per_class']['b']['iou'] == pytest.approx(2 / 4)       # tp 2, fn 1, fp 1
    assert m['per_class']['e']['iou'] is None                        # absent class
    # mIoU over a, b, c (d excluded, e undefined): (1/2 + 2/4 + 1/2) / 3
    assert m['mIoU'] == pytest.approx(0.5)
    assert m['per_class']['d']['iou'] == 1.0
    prev = res['previews'][0]
    assert prev['step'] == 1 and prev['prediction'][1].tolist() == [255] * 4
    assert prev['truth'][2].tolist() == [3, 255, 1, 1]


def test_evaluation_ignores_eroded_boundaries(tmp_path):
    # Truth: left half 0, right half 1. Prediction = truth shifted by one column, so only the
    # two columns next to the boundary are wrong; eroding by 1 px removes exactly them.
    h, w = 6, 8
    lbl = np.zeros((h, w), int)
    lbl[:, 4:] = 1
    pred = np.zeros((h, w), int)
    pred[:, 5:] = 1
    ip, lp = str(tmp_path / 'i.tif'), str(tmp_path / 'l.tif')
    with rasterio.open(ip, 'w', driver='GTiff', width=w, height=h, count=1, dtype='uint16', crs='EPSG:32632',
                       transform=TRANSFORM) as dst:
        dst.write(pred.astype(np.uint16)[None])
    _write_label(lp, lbl)
    kw = dict(num_classes=2, mean=[0], std=[1], tile=4, overlap=2, block=16)

    def model(x):
        return LookupModel()(x)[:, :2]

    plain = inf.evaluate_scenes(model, [(ip, lp)], **kw)['confusion'].numpy()
    assert plain.tolist() == [[24, 0], [6, 18]]
    eroded = inf.evaluate_scenes(model, [(ip, lp)], erode_boundary=1, **kw)['confusion'].numpy()
    # columns 3 and 4 (the pixels within 1 px of the boundary) are no longer counted
    assert eroded.tolist() == [[18, 0], [0, 18]]


def _cli_files(tmp_path, model_type, **model_kwargs):
    """Weights of an untrained ``model_type`` (3 bands, K classes 'a'..'e'), a 3-band uint16
    scene and its label, as the command-line programs take them."""
    from ds_seg.registry import MODELS, build
    cfg = dict(type=model_type, in_channels=3, num_classes=K, **model_kwargs)
    weights = str(tmp_path / 'w.pt')
    torch.manual_seed(0)
    torch.save({'state_dict': build(MODELS, cfg).state_dict(), 'model': cfg, 'classes': list('abcde'),
                'data': {'bands': [1, 2, 3], 'mean': [1500.0] * 3, 'std': [900.0] * 3, 'dtype': 'uint16'}},
               weights)
    scene = str(tmp_path / 'scene.tif')
    write_scene(scene, 70, 50, bands=3)
    label = str(tmp_path / 'label.tif')
    _write_label(label, np.arange(70 * 50).reshape(70, 50) % K)
    return weights, scene, label


def _register_min_size_net():
    """A model that, like SegFormer before the segmentor padded its inputs, cannot take windows
    under 32 px (every shipped model takes any size now): what the window checks exist for."""
    from torch import nn

    from ds_seg.registry import MODELS

    class MinSizeNet(nn.Module):
        def __init__(self, in_channels=3, num_classes=K):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, num_classes, 1)

        def forward(self, images_BCHW):
            if min(images_BCHW.shape[-2:]) < 32:
                raise RuntimeError(f'Calculated padded input size per channel: {tuple(images_BCHW.shape[-2:])}. '
                                   'Kernel size: (32 x 32)')
            return self.conv(images_BCHW)
    MODELS.register_module(name='MinSizeNet', module=MinSizeNet, force=True)


@pytest.mark.parametrize('program', ['predict', 'evaluate'])
def test_a_tile_the_model_cannot_take_is_one_line_before_any_scene(tmp_path, capsys, program):
    """A model that needs windows of at least 32 px (SegFormer's attention reduction did): --tile 24
    was a torch traceback at the first window (after earlier scenes of the list were written); now
    one line naming --tile and the model, before anything is written. 32 px works, and SegFormer
    itself, whose inputs are padded to 32 now, takes 24."""
    from ds_seg.cli import evaluate, predict
    _register_min_size_net()
    weights, scene, label = _cli_files(tmp_path, 'MinSizeNet')
    out = str(tmp_path / 'out')

    def run(tile):
        common = ['--checkpoint', weights, '--output', out, '--tile', str(tile), '--overlap', '0']
        if program == 'predict':
            return predict.main(common + ['--input', scene])
        return evaluate.main(common + ['--images', scene, '--labels', label, '--previews', '0'])

    assert run(24) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
    assert err.startswith(f'{program}: error: --tile 24: the model (MinSizeNet) cannot take 24x24 windows'), err
    assert not os.path.exists(out)
    assert run(32) == 0
    (tmp_path / 'segformer').mkdir()
    weights, scene, label = _cli_files(tmp_path / 'segformer', 'SegFormerTiny')
    out = str(tmp_path / 'segformer' / 'out')
    assert run(24) == 0


@pytest.mark.parametrize('args, message', [
    (['--exclude', 'clutter'], "--exclude: unknown class 'clutter'; classes are a, b, c, d, e"),
    (['--erode', '-2'], '--erode must be >= 0'),
    (['--previews', '-1'], '--previews must be >= 0 (0 writes none), got -1'),  # wrote none, exit 0
    (['--exclude', 'b', 'b'], '--exclude names b twice; name each class once'),
    # ids as predict.py's --exclude-classes takes them: '1' is class b
    (['--exclude', '1', 'b'], '--exclude names b twice; name each class once'),
    (['--exclude', '7'], '--exclude: class id 7 is not one of 0..4 (a, b, c, d, e)'),
    (['--classes', 'x', 'y', 'z'], '3 classes given (x, y, z) but the model predicts 5'),
])
def test_evaluate_refuses_class_and_erosion_options_before_any_window(tmp_path, capsys, args, message):
    """An unknown --exclude name was refused only when the metrics were computed, after every
    scene was predicted; --erode -2 was an IndexError traceback; three --classes for a 5-class
    model were blamed on the label values. Now one line each, before any window is predicted."""
    from ds_seg.cli import evaluate
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    out = str(tmp_path / 'out')
    code = evaluate.main(['--checkpoint', weights, '--images', scene, '--labels', label, '--output', out,
                          '--tile', '32', *args])
    captured = capsys.readouterr()
    assert code == 2 and len(captured.err.strip().splitlines()) == 1 and 'Traceback' not in captured.err
    assert captured.err.startswith(f'evaluate: error: {message}'), captured.err
    assert 'windows' not in captured.out and not os.path.exists(out), captured.out


def test_cpu_threads_below_one_is_one_line_and_a_window_out_of_memory_says_smaller(tmp_path, capsys):
    """--cpu-threads -1 was torch's RuntimeError traceback; a --tile whose one window does not
    fit in memory (a CUDA out-of-memory error, raised here by the forward as torch raises it) was a
    traceback too, and must not be told to use a *larger* tile."""
    from ds_seg.cli import predict
    from ds_seg.config import ConfigError
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    for threads in ('-1', '0'):
        code = predict.main(['--checkpoint', weights, '--input', scene, '--output', str(tmp_path / 'out'),
                             '--tile', '32', '--cpu-threads', threads])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f'predict: error: --cpu-threads must be at least 1, got {threads}'), err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / 'out').exists()

    def out_of_memory(x):
        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 96.00 GiB')
    with pytest.raises(ConfigError, match=r'--tile 4096: one 4096x4096 window of the model \(UNetTiny\) does not fit '
                                          r'in the memory of meta .*use a smaller --tile'):
        predict.check_tile_fits(out_of_memory, {'model': {'type': 'UNetTiny', 'in_channels': 3}}, 4096, None,
                                'meta')


def test_a_palette_image_and_band_zero_are_refused_with_what_to_do(tmp_path, capsys):
    """A one-band colour-table (palette) image for an RGB model was refused as 'has 1 band(s)',
    without saying why the colours are not bands; --bands 0 passed the check and was refused only
    inside the engine. Both are one line before the model runs, the palette one saying how to
    expand it."""
    from ds_seg.cli import predict
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    palette = str(tmp_path / 'palette.tif')
    with rasterio.open(palette, 'w', driver='GTiff', width=20, height=20, count=1, dtype='uint8', crs='EPSG:32632',
                       transform=TRANSFORM, photometric='PALETTE') as dst:
        dst.write(np.arange(400, dtype=np.uint8).reshape(1, 20, 20))
        dst.write_colormap(1, {i: (i, 255 - i, 0, 255) for i in range(256)})
    for args, message in ((['--input', palette], f'{palette} has band(s) 1..1 but the model reads bands [1, 2, 3]'
                                                 f' (recorded at training, or --bands). It is a palette image'),
                          (['--input', scene, '--bands', '0', '1', '2'], 'reads bands [0, 1, 2]')):
        code = predict.main(['--checkpoint', weights, '--output', str(tmp_path / 'out'), '--tile', '32', *args])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
        assert 'gdal_translate -expand rgb' in err or '--bands' in args
    assert not (tmp_path / 'out').exists()


def test_a_huge_block_is_refused_and_tiles_never_exceed_the_scene(tmp_path, capsys):
    """--block 100000 wrote one 100000 px tile for a 384 px scene: 10 GB to write it and as much for
    every reader. Above 4096 px it is refused in one line; below, a scene smaller than the block
    gets tiles of its own size (rounded up to 16), and the same classes."""
    from ds_seg.cli import predict
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    common = ['--checkpoint', weights, '--input', scene, '--tile', '32', '--device', 'cpu']
    assert predict.main(common + ['--output', str(tmp_path / 'huge'), '--block', '100000']) == 2
    err = capsys.readouterr().err
    assert err.startswith('predict: error: --block 100000: GeoTIFF tiles') and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / 'huge').exists()
    classes = {}
    for block in (4096, 32):
        assert predict.main(common + ['--output', str(tmp_path / f'b{block}'), '--block', str(block)]) == 0
        with rasterio.open(tmp_path / f'b{block}' / 'scene_classes.tif') as dst:
            assert dst.block_shapes[0] == ((80, 80) if block == 4096 else (32, 32))   # 70 x 50 px scene
            classes[block] = dst.read(1)
    np.testing.assert_array_equal(classes[4096], classes[32])


def test_an_output_under_a_file_says_the_file_is_in_the_way(tmp_path, capsys):
    """--output scene.tif/sub said "the parent folder scene.tif does not exist; create it first",
    which it did, as a file: creating it fails."""
    from ds_seg.cli import evaluate, predict
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    said = f'{scene} is a file, not a folder: nothing can be written under it; choose another path'
    assert predict.main(['--checkpoint', weights, '--input', scene, '--output', f'{scene}/sub/deeper']) == 2
    assert evaluate.main(['--checkpoint', weights, '--images', scene, '--labels', label, '--output',
                          f'{scene}/sub']) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 2 and all(said in e for e in errs), errs


def test_a_png_scene_is_predicted_without_warning_lines(tmp_path):
    """A PNG has no georeferencing, which is fine for a class map: predict.py printed rasterio's
    NotGeoreferencedWarning (two lines each, with rasterio's source path) three times, which
    read like an error. Run as a user runs it, in its own process."""
    import subprocess
    import sys

    from ds_seg.config import REPO_ROOT
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    with rasterio.open(scene) as src:
        pixels = src.read()
    png = str(tmp_path / 'scene.png')
    with rasterio.open(png, 'w', driver='PNG', width=pixels.shape[2], height=pixels.shape[1], count=3,
                       dtype='uint16') as dst:
        dst.write(pixels)
    proc = subprocess.run([sys.executable, 'launch/predict.py', '--checkpoint', weights, '--input', png,
                           '--output', str(tmp_path / 'out'), '--tile', '32', '--device', 'cpu'],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert 'NotGeoreferencedWarning' not in proc.stderr + proc.stdout, proc.stderr
    assert (tmp_path / 'out' / 'scene_classes.tif').exists()


@pytest.mark.parametrize('option, key', [('data.eval_tile=24', 'data.eval_tile 24'),
                                         ('data.crop_size=24', 'data.crop_size 24')])
def test_training_refuses_windows_the_model_cannot_take_before_any_step(tmp_path, option, key):
    """A model that needs 32 px windows (SegFormerTiny did) with 24 px evaluation windows trained
    every step and then died with a torch traceback at the first periodic evaluation, no
    checkpoint written (24 px crops: at the first step). Now one line naming the key, before the
    work dir is made. 32 px trains; SegFormerTiny, padded to 32 now, takes 24."""
    from ds_seg.config import ConfigError, load_config
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import TINY_CONFIG, ds_config
    _register_min_size_net()
    cache = str(tmp_path / 'cache')
    common = [f'data.train.cache_dir={cache!r}', f'data.val.cache_dir={cache!r}', 'data.num_workers=0',
              'data.eval_overlap=0']
    model = [f'model={dict(type="MinSizeNet", in_channels=3, num_classes=6)!r}']
    work = tmp_path / 'work'
    with pytest.raises(ConfigError, match=rf'^{key}: the model \(MinSizeNet\) cannot take 24x24 windows .*'
                                          rf'use a larger {key.split()[0]}$'):
        Trainer(load_config(TINY_CONFIG, common + model + [option]), ds_config(0), backend='ddp', work_dir=str(work))
    assert not work.exists()
    trainer = Trainer(load_config(TINY_CONFIG, common + model + ['data.crop_size=32', 'data.eval_tile=32']),
                      ds_config(0), backend='ddp', work_dir=str(work))
    trainer.close()
    segformer = [f'model={dict(type="SegFormerTiny", in_channels=3, num_classes=6)!r}']
    trainer = Trainer(load_config(TINY_CONFIG, common + segformer + [option]), ds_config(0), backend='ddp',
                      work_dir=str(tmp_path / 'segformer'))
    trainer.close()


def test_training_refuses_a_model_of_one_fixed_input_size_before_any_step(tmp_path):
    """UperNet over a timm Swin built for 224 px trained to a torch traceback at the first step
    ('Input height (64) doesn't match model (224)'), after the work dir was written: a model that
    fails at every window size was let through the start-up check. Now one line that says how
    such a model takes the crop size; with img_size=64 it passes the check."""
    from ds_seg.config import ConfigError, load_config
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import TINY_CONFIG, ds_config
    cache = str(tmp_path / 'cache')
    swin = dict(type='UperNet', backbone='swin_tiny_patch4_window7_224', num_classes=6, channels=32)
    common = [f'data.train.cache_dir={cache!r}', f'data.val.cache_dir={cache!r}', 'data.num_workers=0',
              'data.crop_size=64']
    work = tmp_path / 'work'
    with pytest.raises(ConfigError, match=r"^data.crop_size 64: the model \(UperNet\) cannot take 64x64 windows "
                                          r"\(Input height \(64\) doesn't match model \(224\)\.\); .* takes "
                                          r"img_size=64 in the model config$"):
        Trainer(load_config(TINY_CONFIG, common + [f'model={swin!r}']), ds_config(0), backend='ddp',
                work_dir=str(work))
    assert not work.exists()
    trainer = Trainer(load_config(TINY_CONFIG, common + [f'model={dict(swin, img_size=64)!r}']), ds_config(0),
                      backend='ddp', work_dir=str(work))
    trainer.close()
    # A crop that is no multiple of the deepest stride (32) is padded to one before the backbone
    # sees it: img_size=100 for 100 px crops was advised, and then failed as "fails on windows of
    # every size". The advice names the padded size; img_size=100 says why it cannot be.
    common[-1] = 'data.crop_size=100'
    with pytest.raises(ConfigError, match=r"^data.crop_size 100: .* takes img_size=128 in the model config \(the "
                                          r"100 px window padded to a multiple of 32, its deepest stride, as the "
                                          r"backbone sees it\)$"):
        Trainer(load_config(TINY_CONFIG, common + [f'model={swin!r}']), ds_config(0), backend='ddp',
                work_dir=str(work))
    with pytest.raises(ConfigError, match=r"^model.img_size 100: the backbone sees windows padded to a multiple of "
                                          r"32 \(its deepest stride\), so a model of one input size takes "
                                          r"img_size=128 for 100 px windows \(data.crop_size 100\)\.$"):
        Trainer(load_config(TINY_CONFIG, common + [f'model={dict(swin, img_size=100)!r}']), ds_config(0),
                backend='ddp', work_dir=str(work))
    trainer = Trainer(load_config(TINY_CONFIG, common + [f'model={dict(swin, img_size=128)!r}']), ds_config(0),
                      backend='ddp', work_dir=str(work))
    trainer.close()


@pytest.mark.parametrize('program', ['predict', 'evaluate'])
def test_a_model_of_one_input_size_predicts_in_windows_of_that_size(tmp_path, capsys, program):
    """A Swin trained at img_size=64 (it takes 64 px windows only) was refused by predict and
    evaluate without --tile: their 512 px default did not fit it, and the line said nothing of
    the size it takes. Without --tile its img_size is the window now, and a --tile of another
    size names the one that works."""
    from ds_seg.cli import evaluate, predict
    swin = dict(backbone='swin_tiny_patch4_window7_224', img_size=64, channels=16,
                backbone_kwargs=dict(embed_dim=24, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1)))
    weights, scene, label = _cli_files(tmp_path, 'UperNet', **swin)

    def run(out, *tile):
        common = ['--checkpoint', weights, '--output', str(tmp_path / out), *tile]
        if program == 'predict':
            return predict.main(common + ['--input', scene])
        return evaluate.main(common + ['--images', scene, '--labels', label, '--previews', '0'])

    assert run('a', '--tile', '128') == 2
    err = capsys.readouterr().err
    assert err == (f"{program}: error: --tile 128: the model (UperNet) cannot take 128x128 windows (Input height "
                   f"(128) doesn't match model (64).); it takes 64 px windows only (its img_size): --tile 64\n"), err
    assert not (tmp_path / 'a').exists()
    assert run('b') == 0
    assert f"[{program}] windows of 64 px: the model's img_size" in capsys.readouterr().out
    assert run('c', '--tile', '64') == 0
    if program == 'predict':  # the same windows as --tile 64: the same class map
        with rasterio.open(tmp_path / 'b' / 'scene_classes.tif') as b, \
                rasterio.open(tmp_path / 'c' / 'scene_classes.tif') as c:
            assert np.array_equal(b.read(), c.read())
    else:
        assert json.loads((tmp_path / 'b' / 'eval.json').read_text())['settings']['tile'] == 64


def test_a_model_that_fails_at_every_size_is_blamed_not_the_crop(tmp_path):
    """UNet base_channels=0 fails at any window size; the start-up check said 'data.crop_size 64:
    the model cannot take 64x64 windows ... takes img_size=64 in the model config', advice for a
    fixed-size model. Now the line names the model's values."""
    from ds_seg.config import ConfigError, load_config
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import TINY_CONFIG, ds_config
    cache = str(tmp_path / 'cache')
    common = [f'data.train.cache_dir={cache!r}', f'data.val.cache_dir={cache!r}', 'data.num_workers=0',
              'data.crop_size=64', "model=dict(type='UNet', base_channels=0, depth=3)"]
    with pytest.raises(ConfigError, match=r"^model \(UNet\): fails on windows of every size \(.*\); one of its "
                                          r"values is at fault: base_channels=0, depth=3, in_channels=3, "
                                          r"num_classes=6\.$"):
        Trainer(load_config(TINY_CONFIG, common), ds_config(0), backend='ddp', work_dir=str(tmp_path / 'work'))
    assert not (tmp_path / 'work').exists()


def test_a_model_config_without_bands_or_classes_takes_the_datas(tmp_path, capsys):
    """model=dict(type='UNetTiny') on 4-band, 2-class data: the model's defaults (3 bands, 6
    classes) were a refusal that blamed the crop size, or, for the classes, a run that trained to
    a traceback at its first evaluation with no checkpoint. The data's counts are taken, said, and
    recorded in config.json and the checkpoint."""
    from ds_seg.config import load_config
    from ds_seg.engine.trainer import Trainer
    from tests.tiny import TINY_CONFIG, ds_config
    cache = str(tmp_path / 'cache')
    two = "dict(classes=('grass', 'building'), bands=4)"
    config = tmp_path / 'mine.py'  # a user's config: the model named, nothing else
    config.write_text(open(TINY_CONFIG).read().replace("model = dict(type='UNetTiny', in_channels=3, num_classes=6)",
                                                       "model = dict(type='UNetTiny')"))
    options = [f'data.train.cache_dir={cache!r}', f'data.val.cache_dir={cache!r}', 'data.num_workers=0',
               f'data.train={two}', f'data.val={two}', 'train.max_steps=2',
               'train.eval_interval=2', 'train.checkpoint_interval=2', 'train.log_interval=1']
    cfg = load_config(str(config), options)
    assert 'in_channels' not in cfg.model
    work = tmp_path / 'work'
    trainer = Trainer(cfg, ds_config(0), backend='ddp', work_dir=str(work))
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    printed = capsys.readouterr().out
    assert 'model: in_channels=4, num_classes=2 from data.train (not set in the model config)' in printed
    assert summary['exit_reason'] == 'completed'
    assert json.loads((work / 'config.json').read_text())['model'] == dict(type='UNetTiny', in_channels=4,
                                                                          num_classes=2)
    rows = [json.loads(line) for line in (work / 'eval.jsonl').read_text().splitlines()]
    assert [r['step'] for r in rows] == [2] and sorted(rows[0]['per_class']) == ['building', 'grass']


def test_evaluate_refuses_raw_labels_for_a_model_trained_on_decoded_ones(tmp_path, capsys):
    """Trained with label_map={0: 1, 1: 0}, a model was evaluated on --labels read as class
    indices: mIoU 0.02 where its run said 0.15, without a word. The checkpoint records the
    decoding (from the dataset), and evaluate --images/--labels refuses it in one line."""
    from ds_seg.cli import evaluate
    from ds_seg.data.geotiff import GeoTiffScenes
    from ds_seg.engine.checkpointer import data_normalisation
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    train_set = GeoTiffScenes(images=[scene], labels=[label], classes=list('abcde'), label_map={0: 1, 1: 0},
                              crop_size=32)
    recorded = data_normalisation(train_set)
    assert recorded['label_decoding'] == {'label_map': {'0': 1, '1': 0}}
    plain = GeoTiffScenes(images=[scene], labels=[label], classes=list('abcde'), crop_size=32)
    assert 'label_decoding' not in data_normalisation(plain)
    payload = torch.load(weights)
    payload['data']['label_decoding'] = recorded['label_decoding']
    torch.save(payload, weights)
    common = ['--checkpoint', weights, '--images', scene, '--labels', label, '--tile', '32', '--previews', '0']
    assert evaluate.main(common + ['--output', str(tmp_path / 'a')]) == 2
    err = capsys.readouterr().err
    assert err == ("evaluate: error: --labels: the model was trained on labels decoded with "
                   "label_map={'0': 1, '1': 0}, and --labels are read as class indices; evaluate through a config that decodes them: "
                   "--checkpoint <the run's work dir> --cfg-options data.val.images=... data.val.labels=... (a "
                   "benchmark type such as Potsdam: data.val.data_root=...), or --config with the same label "
                   "settings\n"), err
    assert not (tmp_path / 'a').exists()
    payload['data'].pop('label_decoding')
    torch.save(payload, weights)
    assert evaluate.main(common + ['--output', str(tmp_path / 'b')]) == 0


@pytest.mark.parametrize('program', ['predict', 'evaluate'])
def test_a_scene_of_more_bands_than_the_training_files_needs_bands(tmp_path, capsys, program):
    """A model trained on every band of 3-band files read the first 3 bands of a 5-band scene
    without a word. The checkpoint records the training files' band count; such a scene needs
    --bands, and with it runs. evaluate named --input in its pixel-type refusal; it is --images."""
    from ds_seg.cli import evaluate, predict
    weights, _, label = _cli_files(tmp_path, 'UNetTiny')
    payload = torch.load(weights)
    payload['data']['file_bands'] = 3
    torch.save(payload, weights)
    wide = str(tmp_path / 'wide, five bands.tif')  # a comma in the name: one scene, not two dates
    write_scene(wide, 70, 50, bands=5)

    def run(out, *extra):
        common = ['--checkpoint', weights, '--output', str(tmp_path / out), '--tile', '32', *extra]
        if program == 'predict':
            return predict.main(common + ['--input', wide])
        return evaluate.main(common + ['--images', wide, '--labels', label, '--previews', '0'])

    option = '--input' if program == 'predict' else '--images'
    assert run('a') == 2
    assert capsys.readouterr().err == (
        f"{program}: error: {option} {wide} has 5 bands, but the model was trained on files of 3 (its bands 1 2 3); "
        f"say which of this scene's bands those are with --bands (e.g. --bands 1 2 3)\n")
    assert not (tmp_path / 'a').exists()
    assert run('b', '--bands', '1', '2', '3') == 0
    payload['data']['dtype'] = 'uint8'
    torch.save(payload, weights)
    assert run('c', '--bands', '1', '2', '3') == 2
    assert capsys.readouterr().err.startswith(f"{program}: error: {option} {wide} holds uint16 pixels but the model "
                                              "was trained on uint8")


def test_a_model_of_rgba_files_takes_an_rgb_scene_without_bands(tmp_path, capsys):
    """Trained on bands 1-3 of RGBA files (the alpha band left out, its mask used): a plain RGB
    scene of the same bands was refused as a scene of other bands until --bands 1 2 3 was given.
    The checkpoint records the files' alpha band; a scene of only the other bands runs, and one of
    more bands than the files is still refused."""
    from ds_seg.cli import predict
    from ds_seg.data.geotiff import GeoTiffScenes
    from ds_seg.engine.checkpointer import data_normalisation
    rgba = str(tmp_path / 'rgba.tif')
    with rasterio.open(rgba, 'w', driver='GTiff', width=40, height=40, count=4, dtype='uint8', photometric='RGB',
                       alpha='YES', crs='EPSG:32632', transform=TRANSFORM) as dst:
        dst.write(np.full((4, 40, 40), 200, np.uint8))
    label = str(tmp_path / 'label.tif')
    with rasterio.open(label, 'w', driver='GTiff', width=40, height=40, count=1, dtype='uint8', crs='EPSG:32632',
                       transform=TRANSFORM) as dst:
        dst.write(np.zeros((1, 40, 40), np.uint8))
    data = data_normalisation(GeoTiffScenes([rgba], [label], classes=2, crop_size=32, bands=[1, 2, 3]))
    assert (data['file_bands'], data['file_alpha'], data['bands']) == (4, [4], [1, 2, 3])
    weights, _, _ = _cli_files(tmp_path, 'UNetTiny')
    payload = torch.load(weights)
    payload['data'].update(file_bands=4, file_alpha=[4])
    torch.save(payload, weights)
    rgb, wide = str(tmp_path / 'rgb.tif'), str(tmp_path / 'wide.tif')
    write_scene(rgb, 40, 40, bands=3)
    write_scene(wide, 40, 40, bands=5)
    common = ['--checkpoint', weights, '--tile', '32']
    assert predict.main(common + ['--input', rgb, '--output', str(tmp_path / 'a')]) == 0
    capsys.readouterr()
    assert predict.main(common + ['--input', wide, '--output', str(tmp_path / 'b')]) == 2
    assert 'has 5 bands, but the model was trained on files of 4' in capsys.readouterr().err


def _resolution_notes(weights, trained_m, scene, out, capsys):
    """predict.py of ``scene`` with the weights file saying it trained at ``trained_m`` metres: its
    ground-resolution notes."""
    from ds_seg.cli import predict
    payload = torch.load(weights)
    payload['data']['pixel_size_m'] = trained_m
    torch.save(payload, weights)
    assert predict.main(['--checkpoint', weights, '--input', scene, '--output', str(out), '--tile', '32']) == 0
    return [line for line in capsys.readouterr().out.splitlines() if 'm the model was trained at' in line]


def test_a_scene_of_another_ground_resolution_than_training_is_said(tmp_path, capsys):
    """A 0.1 m scene through a model trained at 0.5 m predicted without a word (the checkpoint held
    no pixel size). Checkpoints record the training scenes' ground resolution; predict says a scene
    more than 1.5x finer or coarser, and runs it."""
    from ds_seg.data.geotiff import GeoTiffScenes
    from ds_seg.engine.checkpointer import data_normalisation
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    with rasterio.open(scene) as src:
        size = abs(src.res[0])
    assert data_normalisation(GeoTiffScenes([scene], [label], classes=K, crop_size=32))['pixel_size_m'] == size
    for trained, said in ((size, None), (size * 1.4, None), (size * 5, 'finer'), (size / 2, 'coarser')):
        out = tmp_path / f'out_{trained}'
        notes = _resolution_notes(weights, trained, scene, out, capsys)
        if said is None:
            assert not notes, notes
        else:
            ratio = f'{trained / size:.2g}x finer' if said == 'finer' else f'{size / trained:.2g}x coarser'
            assert notes == [f'[predict] note: --input {scene}: its pixels are {size:.3g} m, {ratio} than the '
                             f'{trained:.3g} m the model was trained at, so objects appear at another size than in '
                             f'training; for the accuracy training measured, resample it to {trained:.3g} m (gdalwarp '
                             f'-tr {trained:.3g} {trained:.3g} -r bilinear IN OUT)'], notes
            assert (out / 'scene_classes.tif').exists()


def test_ground_resolution_is_ground_metres_in_web_mercator_and_degrees(tmp_path, capsys):
    """Web Mercator's metres are ground metres only at the equator: at 60 degrees north a 0.6 m
    EPSG:3857 pixel is 0.3 m on the ground. The note compared nominal units, so a model trained
    on 0.3 m UTM tiles was told such a scene is 2x coarser (and the reverse for the same ground
    size), and its gdalwarp advice was in the wrong units for a degree or Mercator scene."""
    from rasterio.transform import from_origin

    from ds_seg.data.raster import pixel_size_m
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    img = rasterio.open(scene).read()
    # 60 deg N in Web Mercator: y = R ln(tan(pi/4 + lat/2)); 0.6 m nominal is 0.3 m on the ground.
    y60 = 6378137.0 * np.log(np.tan(np.pi / 4 + np.radians(60) / 2))
    merc, geo = str(tmp_path / 'merc.tif'), str(tmp_path / 'geo.tif')
    for path, crs, transform in ((merc, 'EPSG:3857', from_origin(1_113_194.9, y60 + 21, 0.6, 0.6)),
                                 (geo, 'EPSG:4326', from_origin(10.0, 60.0002, 0.3 / 55_660.0, 0.3 / 110_574.0))):
        with rasterio.open(path, 'w', driver='GTiff', width=img.shape[2], height=img.shape[1], count=3,
                           dtype='uint16', crs=crs, transform=transform) as dst:
            dst.write(img)
        with rasterio.open(path) as src:
            assert pixel_size_m(src) == pytest.approx(0.3, rel=1e-3)
    for trained, path, said in ((0.3, merc, None), (0.3, geo, None), (0.9, merc, 'finer'), (0.9, geo, 'finer')):
        notes = _resolution_notes(weights, trained, path, tmp_path / f'out_{trained}_{os.path.basename(path)[:-4]}',
                                  capsys)
        if said is None:
            assert not notes, notes
            continue
        assert len(notes) == 1 and 'its pixels are 0.3 m, 3x finer than the 0.9 m' in notes[0], notes
        # -tr in the scene's own units: 3x its pixel size, whatever the units are.
        with rasterio.open(path) as src:
            tr = f'-tr {3 * src.res[0]:.3g} {3 * src.res[1]:.3g} '
        assert tr in notes[0], (tr, notes)


def test_predict_outputs_in_a_training_images_folder_are_named_by_the_refusal(tmp_path):
    """predict.py --output into the training images' folder: the next training said "3 images but
    1 labels ... give one label file per image", sending the user to the labels. It names the
    files predict wrote there."""
    import shutil

    from ds_seg.cli import predict
    from ds_seg.data.geotiff import GeoTiffScenes
    from ds_seg.data.raster import DataError
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    images, labels = tmp_path / 'img', tmp_path / 'lab'
    images.mkdir()
    labels.mkdir()
    shutil.copy(scene, images / 'a.tif')
    shutil.copy(label, labels / 'a.tif')
    assert predict.main(['--checkpoint', weights, '--input', str(images), '--output', str(images), '--tile', '32',
                         '--probs']) == 0
    with pytest.raises(DataError, match=r"^3 images but 1 labels: .*; 2 of the images are outputs predict.py wrote "
                                        r"there \(a_classes.tif, a_probs.tif\): move them out of the images' folder$"):
        GeoTiffScenes(str(images), str(labels), crop_size=32, classes=K)


def test_evaluate_overwrite_leaves_no_preview_of_an_earlier_evaluation(tmp_path):
    """An evaluation of 3 scenes, then --overwrite with 1: preview_1.png and preview_2.png of the
    first run stayed beside the new eval.json, as if they were its scenes. Without --overwrite
    (a new folder) a preview_<n>.png that is not this run's is left alone."""
    from ds_seg.cli import evaluate
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    out = tmp_path / 'out'
    common = ['--checkpoint', weights, '--output', str(out), '--tile', '32']
    copies = []
    for i in range(3):
        (tmp_path / f's{i}').mkdir()
        copies.append((str(tmp_path / f's{i}' / 'scene.tif'), str(tmp_path / f's{i}' / 'label.tif')))
        for src, dst in zip((scene, label), copies[-1]):
            with open(src, 'rb') as f, open(dst, 'wb') as g:
                g.write(f.read())
    assert evaluate.main(common + ['--images', *[c[0] for c in copies], '--labels', *[c[1] for c in copies]]) == 0
    assert sorted(p.name for p in out.iterdir()) == ['confusion.png', 'eval.json', 'preview_0.png',
                                                     'preview_1.png', 'preview_2.png']
    # A user's own files named like previews stay (they were all removed): a text file, and a
    # real PNG of another program's.
    (out / 'preview_12.png').write_bytes(b'mine')
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig = plt.figure()
    fig.savefig(out / 'preview_5.png')
    plt.close(fig)
    mine = (out / 'preview_5.png').read_bytes()
    assert evaluate.main(common + ['--images', scene, '--labels', label, '--overwrite']) == 0
    assert sorted(p.name for p in out.iterdir()) == ['confusion.png', 'eval.json', 'preview_0.png',
                                                     'preview_12.png', 'preview_5.png']
    assert (out / 'preview_12.png').read_bytes() == b'mine' and (out / 'preview_5.png').read_bytes() == mine
    record = json.loads((out / 'eval.json').read_text())
    assert record['scenes'] == [scene] and record['labels'] == [label]  # the pairing, to check afterwards
    other = tmp_path / 'other'
    other.mkdir()
    (other / 'preview_7.png').write_bytes(b'mine')
    assert evaluate.main(['--checkpoint', weights, '--output', str(other), '--tile', '32', '--images', scene,
                          '--labels', label]) == 0
    assert (other / 'preview_7.png').read_bytes() == b'mine'


def _two_scene_folders(tmp_path):
    """A trained UNetTiny's weights, and img/a1.tif, img/b1.tif with lbl/a1.tif, lbl/b1.tif."""
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    for folder in ('img', 'lbl'):
        (tmp_path / folder).mkdir()
        for name in ('a1', 'b1'):
            with open(scene if folder == 'img' else label, 'rb') as f:
                (tmp_path / folder / f'{name}.tif').write_bytes(f.read())
    return weights


def test_evaluate_refuses_a_scene_given_twice(tmp_path, capsys):
    """Overlapping globs ('img/*.tif' 'img/a*.tif') evaluated a1.tif twice: its pixels counted
    twice in the confusion matrix and every metric, without a word. Now one line, nothing
    written; the same file under another spelling (a/../a1.tif) too."""
    from ds_seg.cli import evaluate
    weights = _two_scene_folders(tmp_path)
    out = tmp_path / 'out'
    for images, labels in (([f'{tmp_path}/img/*.tif', f'{tmp_path}/img/a*.tif'],
                            [f'{tmp_path}/lbl/*.tif', f'{tmp_path}/lbl/a*.tif']),
                           ([f'{tmp_path}/img/a1.tif', f'{tmp_path}/img/../img/a1.tif'],
                            [f'{tmp_path}/lbl/a1.tif', f'{tmp_path}/lbl/b1.tif'])):
        code = evaluate.main(['--checkpoint', weights, '--output', str(out), '--tile', '32',
                              '--images', *images, '--labels', *labels])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert 'a1.tif is given twice' in err and 'count twice in every metric' in err, err
        assert not out.exists()


def test_a_vrt_whose_source_is_missing_names_the_missing_file(tmp_path, capsys):
    """A VRT mosaic whose tile was moved: the one line said rasterio's 'Read failed. See previous
    exception for details.', not which file; now GDAL's own words, naming the missing source."""
    from ds_seg.cli import predict
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    vrt = tmp_path / 'mosaic.vrt'
    bands = ''.join(f'<VRTRasterBand dataType="UInt16" band="{b}"><SimpleSource><SourceFilename relativeToVRT="1">'
                    f'moved.tif</SourceFilename><SourceBand>{b}</SourceBand></SimpleSource></VRTRasterBand>'
                    for b in (1, 2, 3))
    vrt.write_text(f'<VRTDataset rasterXSize="50" rasterYSize="70"><SRS>EPSG:32632</SRS>'
                   f'<GeoTransform>431000, 0.25, 0, 5412000, 0, -0.25</GeoTransform>{bands}</VRTDataset>')
    code = predict.main(['--checkpoint', weights, '--input', str(vrt), '--output', str(tmp_path / 'out'),
                         '--tile', '32'])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f'{vrt} is not a readable raster' in err and 'moved.tif: No such file or directory' in err, err


@pytest.mark.parametrize('program, name', [('predict', 'pred.tif'), ('evaluate', 'eval.json')])
def test_an_output_that_names_a_file_is_refused_not_made_a_folder(tmp_path, capsys, program, name):
    """--output pred.tif (as mmseg's --out takes a file) made a folder called pred.tif holding
    scene_classes.tif; --output eval.json a folder eval.json holding eval.json. One line now."""
    from ds_seg.cli import evaluate, predict
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    out = str(tmp_path / name)
    common = ['--checkpoint', weights, '--output', out, '--tile', '32']
    code = (predict.main(common + ['--input', scene]) if program == 'predict'
            else evaluate.main(common + ['--images', scene, '--labels', label]))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f'--output: {out} names a file, but --output is the folder' in err, err
    assert not os.path.exists(out)


def test_evaluate_takes_folders_as_predict_does(tmp_path, capsys):
    """--images img/ --labels lbl/ was refused as "img: not a readable raster (corrupt or not an
    image)"; a folder means the GeoTIFFs in it, as predict.py's --input, and gives the metrics of
    the same files given by globs."""
    from ds_seg.cli import evaluate
    weights = _two_scene_folders(tmp_path)
    common = ['--checkpoint', weights, '--tile', '32', '--previews', '0']
    assert evaluate.main(common + ['--output', str(tmp_path / 'by_folder'), '--images', str(tmp_path / 'img'),
                                   '--labels', str(tmp_path / 'lbl')]) == 0, capsys.readouterr().err
    assert evaluate.main(common + ['--output', str(tmp_path / 'by_glob'), '--images', f'{tmp_path}/img/*.tif',
                                   '--labels', f'{tmp_path}/lbl/*.tif']) == 0
    by_folder, by_glob = (json.loads((tmp_path / o / 'eval.json').read_text()) for o in ('by_folder', 'by_glob'))
    assert by_folder['scenes'] == by_glob['scenes'] == [str(tmp_path / 'img' / f'{n}.tif') for n in ('a1', 'b1')]
    assert by_folder['confusion'] == by_glob['confusion']


@pytest.mark.parametrize('extra, message', [
    (['--config', 'configs/unet_tiny_synthetic.py'], '--config evaluates its data.val, so --images/--labels would be '
                                                     'ignored'),
    (['--cfg-options', 'data.val.split=val'], "--cfg-options change --config's data.val"),
    (['--drop-images'], '--labels without --images'),
    (['--drop-images', '--drop-labels', '--classes', 'a', 'b', 'c', 'd', 'e'], '--classes names the classes of'),
])
def test_evaluate_refuses_options_it_would_ignore(tmp_path, capsys, extra, message):
    """--config beside --images/--labels evaluated the config's data.val (the synthetic scenes)
    and reported their metrics as if they were the scenes given; --cfg-options beside --images,
    --labels alone (the default experiment's data.val then) and --classes for a config's data.val
    were ignored the same way."""
    from ds_seg.cli import evaluate
    from ds_seg.config import REPO_ROOT
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    images = [] if '--drop-images' in extra else ['--images', scene]
    labels = [] if '--drop-labels' in extra else ['--labels', label]
    extra = [str(REPO_ROOT / e) if e.startswith('configs/') else e for e in extra if not e.startswith('--drop-')]
    out = tmp_path / 'out'
    code = evaluate.main(['--checkpoint', weights, '--output', str(out), '--tile', '32', *images, *labels, *extra])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and f'evaluate: error: {message}' in err, err
    assert not out.exists()


def test_a_torch_export_program_as_checkpoint_is_named_not_called_corrupt(tmp_path, capsys):
    """export.py --format torch-export writes a .pt2 program; given to predict.py it was refused
    as 'not a readable weights file ... your checkpoint file is corrupted' (torch.load's words).
    Now one line saying what it is and what predict.py runs."""
    from ds_seg.cli import predict
    _, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    program = str(tmp_path / 'model.pt2')
    conv = torch.nn.Conv2d(3, K, 1).eval()
    torch.export.save(torch.export.export(conv, (torch.zeros(1, 3, 32, 32),)), program)
    code = predict.main(['--checkpoint', program, '--input', scene, '--output', str(tmp_path / 'out')])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f'--checkpoint: {program} is a torch.export program' in err and 'corrupted' not in err, err


def test_a_folder_input_takes_jpeg2000_orthophotos(tmp_path, capsys):
    """National orthophotos often come as JPEG 2000: a folder of them was "holds no GeoTIFF".
    A lossless .jp2 copy of a scene predicts what the GeoTIFF does."""
    import rasterio

    from ds_seg.cli import predict
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    folder = tmp_path / 'ortho'
    folder.mkdir()
    with rasterio.open(scene) as src:
        profile = dict(src.profile, driver='JP2OpenJPEG', QUALITY=100, REVERSIBLE='YES')
        for key in ('tiled', 'blockxsize', 'blockysize', 'interleave', 'compress', 'photometric'):
            profile.pop(key, None)
        with rasterio.open(folder / 'scene.jp2', 'w', **profile) as dst:
            dst.write(src.read())
    common = ['--checkpoint', weights, '--tile', '32']
    assert predict.main(common + ['--input', str(folder), '--output', str(tmp_path / 'jp2')]) == 0, \
        capsys.readouterr().err
    assert predict.main(common + ['--input', scene, '--output', str(tmp_path / 'tif')]) == 0
    with rasterio.open(tmp_path / 'jp2' / 'scene_classes.tif') as a, \
            rasterio.open(tmp_path / 'tif' / 'scene_classes.tif') as b:
        assert a.crs == b.crs and a.transform == b.transform
        assert np.array_equal(a.read(), b.read())


def test_a_folder_predicted_into_itself_can_be_predicted_again(tmp_path, capsys):
    """--input F --output F: the second run took the first's scene_classes.tif as a scene, and was
    refused even with --overwrite ("would replace the input"). predict's own class maps and
    probabilities in a folder are left out, said in one line; a user's file named so is a scene."""
    import shutil

    import rasterio

    from ds_seg.cli import evaluate, predict
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    folder = tmp_path / 'area'
    folder.mkdir()
    shutil.copy(scene, folder / 'a.tif')
    shutil.copy(scene, folder / 'b_classes.tif')  # a user's scene with such a name: not predict's
    common = ['--checkpoint', weights, '--input', str(folder), '--output', str(folder), '--tile', '32']
    assert predict.main(common + ['--probs']) == 0, capsys.readouterr().err
    with rasterio.open(folder / 'a_classes.tif') as src:
        first = src.read()
    capsys.readouterr()
    assert predict.main(common + ['--probs', '--overwrite']) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert ('left out 4 class map(s) or probabilities an earlier predict wrote (a_classes.tif, a_probs.tif, '
            'b_classes_classes.tif, ...)') in out, out
    assert sorted(p.name for p in folder.iterdir()) == ['a.tif', 'a_classes.tif', 'a_probs.tif', 'b_classes.tif',
                                                         'b_classes_classes.tif', 'b_classes_probs.tif']
    with rasterio.open(folder / 'a_classes.tif') as src:
        assert np.array_equal(src.read(), first)
    # A quoted glob of that folder is the same scenes.
    assert predict.main(common[:2] + ['--input', str(folder / '*.tif')] + common[4:] + ['--probs', '--overwrite']) == 0
    # Class maps are what evaluate's --labels may hold: a folder of predictions scores (itself: 1.0).
    preds = tmp_path / 'preds'
    assert predict.main(['--checkpoint', weights, '--input', str(folder / 'a.tif'), '--output', str(preds),
                         '--tile', '32']) == 0
    assert evaluate.main(['--checkpoint', weights, '--images', str(folder / 'a.tif'), '--labels', str(preds),
                          '--output', str(tmp_path / 'ev'), '--tile', '32', '--previews', '0']) == 0, \
        capsys.readouterr().err
    assert json.load(open(tmp_path / 'ev' / 'eval.json'))['mIoU'] == 1.0


def test_a_signed_url_with_commas_in_its_query_is_one_scene(tmp_path, capsys):
    """predict reads 'a.tif,b.tif' as the dates of one scene: a signed URL's query with a comma
    was split there too ('--input: b&X-Amz-Date=1 does not exist'). A comma after a URL's '?'
    belongs to it unless what follows is a URL or a file; dates of URLs still split."""
    import shutil

    import rasterio

    from ds_seg.cli import predict
    from ds_seg.data.rangeserver import RangeServer
    from ds_seg.inputs import split_dates
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    served = tmp_path / 'served'
    served.mkdir()
    shutil.copy(scene, served / 'a.tif')
    assert split_dates(f'{scene},{scene}') == [scene, scene]
    assert split_dates('https://h/a.tif?s=1,2,https://h/b.tif?s=3') == ['https://h/a.tif?s=1,2', 'https://h/b.tif?s=3']
    assert split_dates(f'https://h/a.tif?s=1,{scene}') == ['https://h/a.tif?s=1', scene]
    with RangeServer(served) as server:
        url = server.url('a.tif') + '?X-Amz-Signature=a,b&X-Amz-Date=1'
        code = predict.main(['--checkpoint', weights, '--input', url, '--output', str(tmp_path / 'out'),
                             '--tile', '32'])
    assert code == 0, capsys.readouterr().err
    (written,) = list((tmp_path / 'out').iterdir())
    with rasterio.open(written) as src, rasterio.open(scene) as ref:
        assert src.transform == ref.transform and src.shape == ref.shape


def test_overwrite_without_probs_removes_the_earlier_runs_probabilities(tmp_path, capsys):
    """An --overwrite run without --probs left the earlier run's scene_probs.tif beside its new
    class map, as if it were that map's; it is removed once the new map is written."""
    from ds_seg.cli import predict
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    out = tmp_path / 'out'
    common = ['--checkpoint', weights, '--input', scene, '--output', str(out), '--tile', '32']
    assert predict.main(common + ['--probs']) == 0
    assert (out / 'scene_probs.tif').exists()
    assert predict.main(common) == 2  # without --overwrite nothing is touched
    assert (out / 'scene_probs.tif').exists()
    capsys.readouterr()
    assert predict.main(common + ['--overwrite']) == 0
    assert not (out / 'scene_probs.tif').exists() and (out / 'scene_classes.tif').exists()
    assert 'removed' in capsys.readouterr().out
    # The earlier run's polygons go the same way; a file of that name that predict did not
    # write (the user's own), and an input of this run, are never removed.
    assert predict.main(common + ['--overwrite', '--vector', 'gpkg']) == 0
    assert (out / 'scene_classes.gpkg').exists()
    assert predict.main(common + ['--overwrite']) == 0
    assert not (out / 'scene_classes.gpkg').exists()
    (out / 'scene_probs.tif').write_bytes(b'my own notes')
    assert predict.main(common + ['--overwrite']) == 0
    assert (out / 'scene_probs.tif').read_bytes() == b'my own notes'
    import shutil
    shutil.copy(scene, out / 'x.tif')
    assert predict.main(common + ['--probs', '--input', str(out / 'x.tif'), '--overwrite']) == 0
    probs_as_input = out / 'x_probs.tif'
    assert probs_as_input.exists()
    capsys.readouterr()
    assert predict.main(common + ['--input', str(probs_as_input), str(out / 'x.tif'), '--overwrite',
                                  '--mean', '0', '0', '0', '--std', '1', '1', '1']) == 0
    assert probs_as_input.exists(), 'an input of the run was removed'
    assert (out / 'scene_probs.tif').read_bytes() == b'my own notes'
    assert 'removed' not in capsys.readouterr().out


def test_window_refusal_blames_the_size_only_when_a_larger_window_runs():
    """Shared by training's start-up check and predict/evaluate's --tile check: a model that
    fails at every size (another fault) must not be told to use a larger window."""
    from ds_seg.inference.model import window_refusal

    def needs_32(x):
        if x.shape[-1] < 32:
            raise RuntimeError('window too small for the attention reduction')
        return x

    def broken(x):
        raise RuntimeError('mat1 and mat2 shapes cannot be multiplied')

    assert window_refusal(needs_32, 3, 32) is None
    assert window_refusal(needs_32, 3, 24) == ('window too small for the attention reduction', True)
    assert window_refusal(broken, 3, 24) == ('mat1 and mat2 shapes cannot be multiplied', False)
    assert window_refusal(needs_32, 3, 24, device='meta')[1] is True
    assert window_refusal(broken, 3, 24, device='meta') == ('mat1 and mat2 shapes cannot be multiplied', False)

    def no_meta_kernel(x):  # what torch raises for an op the meta device cannot run
        raise NotImplementedError("Could not run 'aten::foo' with arguments from the 'Meta' backend.")

    def reads_a_value(x):
        return x.sum().item()

    # The meta device cannot tell: no refusal (the real run says what is wrong, if anything).
    assert window_refusal(no_meta_kernel, 3, 24, device='meta') is None
    assert window_refusal(reads_a_value, 3, 24, device='meta') is None
    assert window_refusal(no_meta_kernel, 3, 24) == ("Could not run 'aten::foo' with arguments from the "
                                                     "'Meta' backend.", False)


def test_the_library_calls_take_a_trainable_module_as_the_readme_shows(scene, tmp_path):
    """predict_scene(model, ...) and evaluate_scenes(model, ...) with a module whose parameters
    require gradients stopped at "Can't call numpy() on Tensor that requires grad": only the
    CLIs, which wrap them in inference_mode, worked."""
    path, img, _ = scene
    torch.manual_seed(0)
    model = torch.nn.Conv2d(2, K, 1)
    assert all(p.requires_grad for p in model.parameters())
    got, _ = predict_classes(model, path, tmp_path, mean=[1500, 1500], std=[900, 900], tile=64, overlap=16)
    with torch.no_grad():
        x = (torch.from_numpy(img.astype(np.float32))[None] - 1500) / 900
        expect = model(x).argmax(1)[0].numpy()
    valid = ~(img == NODATA).all(0)
    np.testing.assert_array_equal(got[valid], expect[valid])  # a 1x1 conv: tiling cannot change it
    label = str(tmp_path / 'label.tif')
    _write_label(label, expect.astype(np.uint8))
    res = inf.evaluate_scenes(model, [(path, label)], num_classes=K, mean=[1500, 1500], std=[900, 900], tile=64)
    assert int(res['confusion'].trace()) == int(valid.sum()) == int(res['confusion'].sum())


def test_predict_refuses_complex_pixels(tmp_path, capsys):
    from ds_seg.cli import predict
    weights, _, _ = _cli_files(tmp_path, 'UNetTiny')
    scene = str(tmp_path / 'slc.tif')
    with rasterio.open(scene, 'w', driver='GTiff', width=40, height=40, count=3, dtype='complex64',
                       crs='EPSG:32632', transform=TRANSFORM) as dst:
        dst.write((np.ones((3, 40, 40)) + 2j).astype(np.complex64))
    assert predict.main(['--checkpoint', weights, '--input', scene, '--output', str(tmp_path / 'out'),
                         '--mean', '0', '0', '0', '--std', '1', '1', '1']) == 2
    err = capsys.readouterr().err
    assert 'slc.tif holds complex (complex64) pixels' in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / 'out').exists()


def test_a_scene_of_bands_of_several_pixel_types_is_one_line_naming_it(tmp_path, capsys):
    """A VRT stacking 8-bit RGB with a 16-bit NIR (gdalbuildvrt -separate) stopped training,
    predict and evaluate with rasterio's "more than one 'dtype' found", which names no file."""
    from ds_seg.cli import evaluate, predict
    from ds_seg.data import GeoTiffScenes
    from ds_seg.data.raster import DataError
    weights, _, _ = _cli_files(tmp_path, 'UNetTiny')
    sources = []
    for name, dtype in (('rgb.tif', 'uint8'), ('nir.tif', 'uint16')):
        count = 3 if dtype == 'uint8' else 1
        with rasterio.open(tmp_path / name, 'w', driver='GTiff', width=40, height=40, count=count, dtype=dtype,
                           crs='EPSG:32632', transform=TRANSFORM) as dst:
            dst.write(np.ones((count, 40, 40), dtype))
        sources += [(name, b, dtype) for b in range(1, count + 1)]
    gdal_type = {'uint8': 'Byte', 'uint16': 'UInt16'}
    bands = ''.join(f'<VRTRasterBand dataType="{gdal_type[t]}" band="{i + 1}"><SimpleSource><SourceFilename '
                    f'relativeToVRT="1">{n}</SourceFilename><SourceBand>{b}</SourceBand></SimpleSource></VRTRasterBand>'
                    for i, (n, b, t) in enumerate(sources))
    with rasterio.open(tmp_path / 'rgb.tif') as src:
        geo = ', '.join(str(v) for v in src.transform.to_gdal())
        srs = src.crs.to_wkt()
    scene = tmp_path / 'stack.vrt'
    scene.write_text(f'<VRTDataset rasterXSize="40" rasterYSize="40"><SRS>{srs}</SRS>'
                     f'<GeoTransform>{geo}</GeoTransform>{bands}</VRTDataset>')
    label = str(tmp_path / 'label.tif')
    _write_label(label, np.zeros((40, 40), np.uint8))
    said = r'stack.vrt has bands of several pixel types \(uint8, uint8, uint8, uint16\).*gdal_translate -ot UInt16'
    with pytest.raises(DataError, match=said):
        GeoTiffScenes([str(scene)], [label], crop_size=32, classes=2)
    common = ['--checkpoint', weights, '--mean', '0', '0', '0', '--std', '1', '1', '1', '--bands', '1', '2', '4']
    assert predict.main([*common, '--input', str(scene), '--output', str(tmp_path / 'out')]) == 2
    assert evaluate.main([*common, '--images', str(scene), '--labels', label, '--output', str(tmp_path / 'ev')]) == 2
    for err in capsys.readouterr().err.strip().splitlines():
        assert re.search(said, err), err
    assert not (tmp_path / 'out').exists() and not (tmp_path / 'ev').exists()


def test_evaluate_refuses_labels_without_a_class_pixel_before_predicting(tmp_path, capsys):
    """Every window of every scene was predicted (hours on real scenes) before the refusal of a
    label that is all ignore_index, which the label scan at start-up already knew."""
    from ds_seg.cli import evaluate
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    _write_label(label, np.full((70, 50), 255))
    assert evaluate.main(['--checkpoint', weights, '--images', scene, '--labels', label, '--output',
                          str(tmp_path / 'ev'), '--tile', '32']) == 2
    out = capsys.readouterr()
    assert 'windows' not in out.out + out.err                    # no progress line: nothing predicted
    assert out.err.strip().splitlines() == [f'evaluate: error: no pixel of the labels ({label}) is a class: all are '
                                            'ignore_index, nodata; nothing can be measured. Check the label files, '
                                            '--ignore-index or --erode.']
    assert not (tmp_path / 'ev').exists()


def test_evaluate_names_the_images_when_they_hold_no_data(tmp_path, capsys):
    """An image that is nodata everywhere left nothing to score, and the line blamed its labels
    (all classes) and said to check --ignore-index or --erode."""
    from ds_seg.cli import evaluate
    weights, _, label = _cli_files(tmp_path, 'UNetTiny')
    empty = str(tmp_path / 'empty.tif')
    with rasterio.open(empty, 'w', driver='GTiff', width=50, height=70, count=3, dtype='uint16', crs='EPSG:32632',
                       transform=TRANSFORM, nodata=0) as dst:
        dst.write(np.zeros((3, 70, 50), np.uint16))
    assert evaluate.main(['--checkpoint', weights, '--images', empty, '--labels', label, '--output',
                          str(tmp_path / 'ev'), '--tile', '32']) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f'evaluate: error: no pixel of the images ({empty}) holds data: all are '
                                            'nodata (their nodata value, mask or alpha band); nothing can be '
                                            'measured. Check the image files'), err
    assert not (tmp_path / 'ev').exists()


def test_evaluate_of_a_data_val_with_other_classes_names_the_config_not_classes_given(tmp_path, capsys,
                                                                                      monkeypatch):
    """A 5-class model evaluated without --config or --images (its file is not in a run's work
    dir) read the embedded default's data.val: "6 classes given (grass, ...)", and "give one
    --classes name per class", an option that does not apply to a config's data.val."""
    from ds_seg.cli import evaluate
    monkeypatch.setenv('DS_SEG_CACHE', str(tmp_path / 'cache'))
    weights, _, _ = _cli_files(tmp_path, 'UNetTiny')
    assert evaluate.main(['--checkpoint', weights, '--output', str(tmp_path / 'ev')]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ('evaluate: error: data.val of the embedded default config (synthetic scenes) has 6 classes (grass, '
                   'road, building, tree, water, car) but the model predicts 5: it was trained on other data; give its '
                   "run's config (--config), or the scenes to evaluate with --images/--labels"), err


def test_inputs_one_step_past_the_obvious_get_lines_that_say_what_to_do(tmp_path, capsys):
    """A quoted glob 'did not exist'; a STAC item or a vector layer was 'not a readable raster
    (truncated or corrupt?)'; evaluate --images a,b (predict's date syntax) 'did not exist'; a
    checkpoint's own shard was 'not a ds_seg weights file' named as load_from; an ONNX file given
    to export was 'a file, not a checkpoint folder'."""
    import pyogrio
    import shapely

    from ds_seg.cli import evaluate, export, predict
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    scenes = tmp_path / 'scenes'
    scenes.mkdir()
    for name in ('a.tif', 'b.tif'):
        write_scene(str(scenes / name), 40, 30, bands=3)
    assert predict.main(['--checkpoint', weights, '--input', str(scenes / '*.tif'), '--output', str(tmp_path / 'glob'),
                         '--tile', '32']) == 0
    assert sorted(os.listdir(tmp_path / 'glob')) == ['a_classes.tif', 'b_classes.tif']
    item = tmp_path / 'item.json'
    item.write_text(json.dumps({'type': 'Feature', 'stac_version': '1.0.0', 'id': 'x', 'assets': {}}))
    layer = str(tmp_path / 'labels.gpkg')
    pyogrio.raw.write(layer, shapely.to_wkb([shapely.box(0, 0, 1, 1)]), field_data=[np.array([1])],
                      fields=['class'], geometry_type='Polygon', crs='EPSG:32632')
    shard_dir = tmp_path / 'run' / 'checkpoints' / 'step_00000004'
    shard_dir.mkdir(parents=True)
    (shard_dir / 'COMPLETE').write_text('{}')
    torch.save({'module': {}, 'buffer_names': []}, shard_dir / 'mp_rank_00_model_states.pt')
    onnx_file = tmp_path / 'model.onnx'
    onnx_file.write_bytes(b'\x08\x09\x12\x07pytorch')   # an ONNX protobuf's first fields
    out = str(tmp_path / 'out')
    cases = [
        (predict, ['--checkpoint', weights, '--input', str(item), '--output', out],
         'item.json is a STAC document, not a raster; give the rasters it points to'),
        (evaluate, ['--checkpoint', weights, '--images', scene, '--labels', layer, '--output', out],
         'labels.gpkg is a vector layer, not a raster; give --config instead, whose data.val reads it'),
        (evaluate, ['--checkpoint', weights, '--images', f'{scene},{scene}', '--labels', label, '--output', out],
         'joins files by commas, which predict.py reads as the dates of one scene'),
        # URLs too: fetched as one URL, a 404 that said to check the address
        (evaluate, ['--checkpoint', weights, '--images', 'http://127.0.0.1:9/a_may.tif,http://127.0.0.1:9/a_aug.tif',
                    '--labels', label, '--output', out],
         'joins files by commas, which predict.py reads as the dates of one scene'),
        (predict, ['--checkpoint', str(shard_dir / 'mp_rank_00_model_states.pt'), '--input', scene, '--output', out],
         f'mp_rank_00_model_states.pt: is one file of the checkpoint {shard_dir}, not a weights file; give the folder'),
        (export, [str(onnx_file), '--out', str(tmp_path / 'w.pt')], 'model.onnx: is an ONNX model, already exported'),
    ]
    for program, argv, message in cases:
        capsys.readouterr()
        assert program.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
        assert not os.path.exists(out)


def test_polygons_of_a_scene_without_a_crs_say_so(tmp_path, capsys):
    """area_m2 of a scene with a geotransform but no CRS was in unknown units without a word."""
    from ds_seg.cli import predict
    weights, _, _ = _cli_files(tmp_path, 'UNetTiny')
    scene = str(tmp_path / 'nocrs.tif')
    with rasterio.open(scene, 'w', driver='GTiff', width=40, height=40, count=3, dtype='uint16',
                       transform=TRANSFORM) as dst:
        dst.write(np.full((3, 40, 40), 1500, np.uint16))
    assert predict.main(['--checkpoint', weights, '--input', scene, '--output', str(tmp_path / 'out'),
                         '--tile', '32', '--vector', 'gpkg']) == 0
    assert 'nocrs.tif has a geotransform but no CRS' in capsys.readouterr().out
    assert (tmp_path / 'out' / 'nocrs_classes.gpkg').exists()


def test_an_erode_radius_past_the_label_compares_only_what_is_there():
    """--erode 100000 looped over 4e10 offsets on a 128 px scene (hours); offsets past the array
    compare nothing, so any radius beyond it gives what the array's own size gives."""
    from ds_seg.inference.evaluate import boundary_mask
    rng = np.random.default_rng(0)
    lbl = rng.integers(0, 3, (20, 30))
    lbl[0, 0] = 255
    far = boundary_mask(lbl, 100000)   # 4e10 offsets before; pytest's timeout ends a run that loops
    np.testing.assert_array_equal(far, boundary_mask(lbl, 36))   # 36 > the diagonal of 20 x 30
    assert far.sum() == (lbl != 255).sum()


def test_evaluate_refuses_an_erode_radius_past_its_limit(tmp_path, capsys):
    from ds_seg.cli import evaluate
    from ds_seg.cli.evaluate import MAX_ERODE
    status = evaluate.main(['--checkpoint', str(tmp_path), '--images', 'a.tif', '--labels', 'b.tif',
                            '--output', str(tmp_path / 'ev'), '--erode', str(MAX_ERODE + 1)])
    assert status == 2 and f'--erode must be at most {MAX_ERODE} px' in capsys.readouterr().err


def test_the_api_scores_and_predicts_with_the_training_normalisation_of_a_loaded_model(tmp_path):
    """README: evaluate_scenes(model, val_set) with a model from load_model normalised with the
    validation set's own statistics (computed from its scenes): a confusion matrix other than
    evaluate.py's for the same files, without a word."""
    from ds_seg.data import GeoTiffScenes
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    model, info = inf.load_model(weights)
    assert model.training_normalisation == info['data']

    class Threshold(torch.nn.Module):   # class 0 where band 1 is above its mean: any other mean shows
        def forward(self, x):
            return torch.cat([x[:, :1], -x[:, :1], torch.zeros_like(x[:, :3])], 1)
    thresholded = Threshold()
    thresholded.training_normalisation = info['data']
    val_set = GeoTiffScenes([scene], [label], classes=info['classes'], crop_size=32, mode='grid', split='val')
    assert not np.allclose(val_set.mean, info['data']['mean'])   # the test can fail
    kw = dict(tile=32, overlap=8)
    got = inf.evaluate_scenes(thresholded, val_set, **kw)['confusion']
    want = inf.evaluate_scenes(thresholded, val_set, mean=info['data']['mean'], std=info['data']['std'],
                               **kw)['confusion']
    own = inf.evaluate_scenes(lambda x: thresholded(x), val_set, **kw)['confusion']   # a plain callable: the dataset's
    assert torch.equal(got, want) and not torch.equal(got, own)
    inf.predict_scene(thresholded, scene, str(tmp_path / 'a.tif'), classes=info['classes'], **kw)
    inf.predict_scene(thresholded, scene, str(tmp_path / 'b.tif'), mean=info['data']['mean'],
                      std=info['data']['std'], classes=info['classes'], **kw)
    with rasterio.open(tmp_path / 'a.tif') as a, rasterio.open(tmp_path / 'b.tif') as b:
        np.testing.assert_array_equal(a.read(), b.read())
    # The loaded model's class names too: predict_scene tagged class_0.. where predict.py wrote them.
    inf.predict_scene(model, scene, str(tmp_path / 'c.tif'), **kw)
    with rasterio.open(tmp_path / 'c.tif') as c:
        assert json.loads(c.tags()['classes']) == info['classes']
    assert inf.evaluate_scenes(model, [(scene, label)], **kw)['confusion'].shape == (len(info['classes']),) * 2


def test_a_scene_smaller_than_the_tile_is_one_pass_at_its_own_size(tmp_path):
    """A 40x52 scene in 512 px windows was padded to 512 (as nodata): the padding reached the
    scene's pixels through the receptive field. It now goes through the model once at its own
    size, as mmseg's slide inference does: exactly the model's own forward on the scene. A model
    that takes one size only keeps the padded window."""
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(2, 8, 5, padding=2), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, K, 9, padding=4)).eval()
    path = str(tmp_path / 's.tif')
    write_scene(path, 40, 52, nodata=None)
    with rasterio.open(path) as src:
        pixels = torch.from_numpy(src.read().astype(np.float32))
    mean, std = [1500.0, 1400.0], [800.0, 900.0]
    x = (pixels - torch.tensor(mean).view(2, 1, 1)) / torch.tensor(std).view(2, 1, 1)
    with torch.no_grad():
        expect = conv(x[None]).argmax(1)[0].numpy()
    classes, out = predict_classes(conv, path, tmp_path, mean=mean, std=std, tile=512, overlap=128)
    np.testing.assert_array_equal(classes, expect)
    assert out['windows'] == 1

    def only_512(images_BCHW):
        if images_BCHW.shape[-2:] != (512, 512):
            raise RuntimeError('this graph takes 512x512 inputs only')
        return conv(images_BCHW)

    padded, out = predict_classes(only_512, path, tmp_path, mean=mean, std=std, tile=512, overlap=128)
    assert out['windows'] == 1 and 0 < (padded != expect).mean() < 0.2  # the padding does change the edges



def test_the_api_refuses_what_the_command_line_refuses_before_any_window(tmp_path):
    """predict_scene wrote its class map over the scene it read (and a probs_path equal to out_path
    was a GDAL error); a uint16 scene through a uint8 model's own normalisation was predicted
    without a word; evaluate_scenes scored a label on another grid (size alone was checked).
    predict.py and evaluate.py refused each of them; the API now does too."""
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    model, info = inf.load_model(weights)
    kw = dict(tile=32, overlap=8)
    before = open(scene, 'rb').read()
    with pytest.raises(ValueError, match='would replace the input of the same name'):
        inf.predict_scene(model, scene, scene, **kw)
    assert open(scene, 'rb').read() == before
    out = str(tmp_path / 'same.tif')
    with pytest.raises(ValueError, match='probs_path and out_path are both'):
        inf.predict_scene(model, scene, out, probs_path=out, **kw)
    # A uint8 copy of the uint16 scene (the model's statistics are in uint16 units).
    with rasterio.open(scene) as src:
        profile, pixels = src.profile, src.read()
    small = str(tmp_path / 'uint8.tif')
    with rasterio.open(small, 'w', **dict(profile, dtype='uint8', nodata=None)) as dst:
        dst.write((pixels // 16).astype(np.uint8))
    with pytest.raises(ValueError, match='holds uint8 pixels but the model was trained on uint16'):
        inf.predict_scene(model, small, str(tmp_path / 'p.tif'), **kw)
    with pytest.raises(ValueError, match='holds uint8 pixels but the model was trained on uint16'):
        inf.evaluate_scenes(model, [(small, label)], **kw)
    inf.predict_scene(model, small, str(tmp_path / 'p.tif'), mean=[90.0] * 3, std=[50.0] * 3, **kw)  # its units
    # A 5-band product for a model of every band of 3-band files: its first 3 bands were read.
    wide = str(tmp_path / 'wide.tif')
    with rasterio.open(wide, 'w', **dict(profile, count=5)) as dst:
        dst.write(np.concatenate([pixels, pixels[:2]]))
    model.training_normalisation = dict(info['data'], file_bands=3)
    with pytest.raises(ValueError, match=r'wide.tif has 5 bands, but the model was trained on files of 3 .* with '
                                         r'bands= \(e.g. bands=\[1, 2, 3\]\)'):
        inf.predict_scene(model, wide, str(tmp_path / 'w.tif'), **kw)
    inf.predict_scene(model, wide, str(tmp_path / 'w.tif'), bands=[3, 2, 1], **kw)  # told which bands
    # A label 100 km away on the same size of grid.
    with rasterio.open(label) as src:
        lprofile, lpixels = src.profile, src.read()
    moved = str(tmp_path / 'moved.tif')
    shifted = lprofile['transform'] * Affine.translation(1e5, 0)
    with rasterio.open(moved, 'w', **dict(lprofile, transform=shifted)) as dst:
        dst.write(lpixels)
    with pytest.raises(ValueError, match='different geotransforms'):
        inf.evaluate_scenes(model, [(scene, moved)], **kw)
    assert inf.evaluate_scenes(model, [(scene, label)], **kw)['confusion'].sum() > 0


@pytest.mark.parametrize('factor', [0.5, 2])
def test_a_model_whose_logits_are_not_the_windows_size_is_named(tmp_path, factor):
    """Half-size logits died in numpy's broadcasting; double-size ones were cut to their top-left
    quarter and written without a word."""
    path = str(tmp_path / 's.tif')
    write_scene(path, 64, 64)

    def resized(x):
        return torch.nn.functional.interpolate(LookupModel()(x), scale_factor=factor)

    with pytest.raises(ValueError, match=f'the model returns {int(32 * factor)}x{int(32 * factor)} logits for 32x32 '
                                         'windows'):
        predict_classes(resized, path, tmp_path, mean=[0, 0], std=[1, 1], tile=32, overlap=8)


@pytest.mark.parametrize('value', [1.5, float('nan')])
def test_evaluate_scenes_refuses_a_fractional_label_value_with_the_value(tmp_path, value):
    """evaluate_scenes(model, [(image, label)]): a float label's 1.5 was cast to class 1 and counted
    (NaN without a nodata tag to whatever int64 made of it); the refusal said the cast value."""
    import ds_seg.inference as inf
    ip, lp = str(tmp_path / 'img.tif'), str(tmp_path / 'lbl.tif')
    lbl = np.zeros((1, 3, 4), np.float32)
    lbl[0, 1, 2] = value
    for path, array in ((ip, np.arange(12, dtype=np.uint16).reshape(1, 3, 4)), (lp, lbl)):
        with rasterio.open(path, 'w', driver='GTiff', width=4, height=3, count=1, dtype=array.dtype,
                           crs='EPSG:32632', transform=TRANSFORM) as dst:
            dst.write(array)
    with pytest.raises(ValueError, match=rf'lbl.tif: label value {value} in .* is not a class index 0..4'):
        inf.evaluate_scenes(LookupModel(), [(ip, lp)], num_classes=K, mean=[0], std=[1], tile=2, overlap=1, block=16)


@pytest.mark.parametrize('given', [['--mean', '0', '0', '0'], ['--std', '1', '1', '1']])
def test_mean_without_std_or_std_without_mean_is_refused(tmp_path, capsys, given):
    """--mean alone was combined with the checkpoint's std (statistics of two datasets), silently."""
    from ds_seg.cli import predict
    weights, scene, _ = _cli_files(tmp_path, 'UNetTiny')
    assert predict.main(['--checkpoint', weights, '--input', scene, '--output', str(tmp_path / 'out'), *given]) == 2
    missing = '--std' if given[0] == '--mean' else '--mean'
    err = capsys.readouterr().err
    assert f'{given[0]} without {missing}: the two describe one set of scenes and go together' in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / 'out').exists()


def test_evaluate_progress_names_each_scene(tmp_path, capsys):
    """Two scenes printed '[evaluate] evaluation: 1/1 windows (100%)' twice, alike."""
    import shutil
    from ds_seg.cli import evaluate
    weights, scene, label = _cli_files(tmp_path, 'UNetTiny')
    for name in ('a', 'b'):
        shutil.copy(scene, tmp_path / f'{name}.tif')
        shutil.copy(label, tmp_path / f'{name}_label.tif')
    assert evaluate.main(['--checkpoint', weights, '--images', str(tmp_path / 'a.tif'), str(tmp_path / 'b.tif'),
                          '--labels', str(tmp_path / 'a_label.tif'), str(tmp_path / 'b_label.tif'),
                          '--output', str(tmp_path / 'e'), '--tile', '64', '--previews', '0']) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if 'windows (100%)' in line]
    assert [line.split(':')[0] for line in lines] == ['[evaluate] a.tif (1/2)', '[evaluate] b.tif (2/2)'], lines


def test_evaluate_refuses_a_missing_checkpoint_before_saying_which_scenes_it_would_score(tmp_path, capsys):
    """`evaluate --checkpoint nope.pt` first said it would score the embedded default's scenes,
    then that nope.pt does not exist."""
    from ds_seg.cli import evaluate
    assert evaluate.main(['--checkpoint', str(tmp_path / 'nope.pt'), '--output', str(tmp_path / 'e')]) == 2
    said = capsys.readouterr()
    assert said.out == '' and said.err.strip() == (f'evaluate: error: --checkpoint: {tmp_path}/nope.pt does not exist '
                                                   '(give a weights file from launch/export.py, a step_* folder, a '
                                                   'checkpoints folder or a work dir).'), said


def test_a_digit_names_one_class_for_evaluate_and_predict_alike():
    """Classes named by codes: evaluate --exclude 0 left out the class named '0', predict
    --exclude-classes 0 the class of id 0. One rule for both: a name first, digits included."""
    from ds_seg.vectorize import exclude_ids
    assert exclude_ids(['background', '3'], ['background', 'building', 'road', 'tree']) == [0, 3]
    assert exclude_ids(['7'], ['a', '7', 'b']) == [1]          # a name only (no class 7)
    assert exclude_ids(['0'], ['2', '1', '0']) == [2]          # the class named '0', not id 0
    assert exclude_ids(['2', 'b'], ['a', 'b', 'c']) == [2, 1]  # no class named '2': the id


def test_float_scenes_take_statistics_of_another_float_type_and_integer_ones_do_not(tmp_path):
    """A float32 scene for a model of float64 scenes was refused ('convert the scene'): the same
    physical values, only the precision differs; uint16 for uint8 still is (another range)."""
    from ds_seg.data.raster import same_units
    from ds_seg.inference.model import trained_dtype_refusal
    for dtype in ('float32', 'float64', 'uint16'):
        path = str(tmp_path / f'{dtype}.tif')
        with rasterio.open(path, 'w', driver='GTiff', width=8, height=8, count=1, dtype=dtype,
                           transform=rasterio.transform.from_origin(0, 8, 1, 1), crs='EPSG:32632') as dst:
            dst.write(np.ones((1, 8, 8), dtype=dtype))
    assert trained_dtype_refusal('float64', str(tmp_path / 'float32.tif')) is None
    assert trained_dtype_refusal('float32', str(tmp_path / 'float64.tif')) is None
    assert trained_dtype_refusal('uint8', str(tmp_path / 'uint16.tif')).endswith(
        'holds uint16 pixels but the model was trained on uint8 (its mean/std are in those units); convert the scene '
        '(gdal_translate -ot)')
    assert same_units('float16', 'float64') and not same_units('int16', 'uint16') and not same_units('uint8', 'float32')


@pytest.mark.parametrize('count', [1, 2, 3, 4])
def test_evaluates_preview_draws_scenes_of_any_band_count(tmp_path, count):
    """Two-band scenes (Sentinel-1 VV/VH, or dates of two bands) stopped evaluate.py after its
    scores were written (matplotlib: 'Invalid shape (128, 128, 2) for image data'), so its rerun
    needed --overwrite and failed the same way. Two bands show the first in grey."""
    import rasterio
    from PIL import Image
    from ds_seg.cli.evaluate import save_preview_png
    path = str(tmp_path / 'scene.tif')
    data = np.stack([np.full((16, 16), 10 * (b + 1), np.uint8) for b in range(count)])
    data[:, :, 8:] += 100
    with rasterio.open(path, 'w', driver='GTiff', width=16, height=16, count=count, dtype='uint8') as dst:
        dst.write(data)
    truth = np.zeros((16, 16), np.uint8)
    save_preview_png(dict(prediction=truth, truth=truth, step=1, image=path), ['a', 'b'], str(tmp_path / 'p.png'))
    png = np.asarray(Image.open(tmp_path / 'p.png').convert('RGB'))
    assert png.shape[2] == 3 and png.std() > 0


def test_the_library_call_refuses_to_replace_an_existing_output_unless_asked(scene, tmp_path):
    """predict_scene's default was overwrite=True: a second call replaced the first's class map
    without a word (predict.py refuses without --overwrite)."""
    from ds_seg.config import ConfigError
    path, _, _ = scene
    out = str(tmp_path / 'classes.tif')
    kw = dict(mean=[0, 0], std=[1, 1], classes=list('abcde'), tile=64, overlap=16, block=64, batch_size=2)
    inf.predict_scene(LookupModel(), path, out, **kw)
    first = open(out, 'rb').read()
    with pytest.raises(ConfigError, match=r"^predict_scene: .*classes\.tif already exists; choose another name, "
                                          r"delete it, or pass overwrite=True\.$"):
        inf.predict_scene(LookupModel(), path, out, **kw)
    assert open(out, 'rb').read() == first
    inf.predict_scene(LookupModel(), path, out, overwrite=True, **kw)
