"""Behaviour of the data pipeline: GeoTIFF windows, grid coverage, samplers, loaders."""
import itertools
import multiprocessing as mp
import os

import numpy as np
import pytest
import rasterio
import torch
from rasterio.enums import ColorInterp
from rasterio.transform import from_origin

from ds_seg.data import (CLASSES, DataError, EvalSampler, GeoTiffScenes, SyntheticAerial, TrainSampler,
                         build_eval_loader, build_train_loader)
from tests.tiny import finished

IGNORE = 255


def write_tif(path, array, transform=None, nodata=None):
    """A small tiled GeoTIFF with a real CRS; ``array`` is (bands, H, W) or (H, W)."""
    array = array[None] if array.ndim == 2 else array
    with rasterio.open(path, 'w', driver='GTiff', width=array.shape[2], height=array.shape[1],
                       count=array.shape[0], dtype=array.dtype, crs='EPSG:32632',
                       transform=transform or from_origin(500_000, 5_500_000, 0.1, 0.1),
                       tiled=True, blockxsize=16, blockysize=16, photometric='MINISBLACK',
                       nodata=nodata) as dst:
        dst.write(array)
    return str(path)


def small_synthetic(tmp_path, **kw):
    args = dict(split='train', num_scenes=2, scene_size=150, crop_size=64, cache_dir=tmp_path)
    args.update(kw)
    return SyntheticAerial(**args)


def dihedral(a, k, flip):
    a = a[..., ::-1] if flip else a
    return np.rot90(a, k, axes=(-2, -1))


def test_generated_geotiffs_are_georeferenced_and_tiled(tmp_path):
    ds = small_synthetic(tmp_path, split='val')
    origins = set()
    for scene in ds.scenes:
        with rasterio.open(scene['image']) as img, rasterio.open(scene['label']) as lbl:
            assert img.crs.to_epsg() == 32632 and lbl.crs == img.crs
            assert img.transform.a == pytest.approx(0.1) and img.transform.e == pytest.approx(-0.1)
            assert lbl.transform == img.transform
            assert img.profile['tiled'] and img.block_shapes[0] == (32, 32)  # half the 64 crop
            assert img.count == 3 and lbl.dtypes[0] == 'uint8'
            assert lbl.read(1).max() < len(CLASSES)
            origins.add((img.transform.c, img.transform.f))
    assert len(origins) == 2
    assert ds.classes == CLASSES and ds.num_classes == 6 and ds.in_channels == 3
    assert os.path.exists(os.path.join(ds.directory, 'stats.json'))


def test_train_and_val_scenes_differ(tmp_path):
    train = small_synthetic(tmp_path, split='train', mode='grid')
    val = small_synthetic(tmp_path, split='val', mode='grid')
    assert train.directory != val.directory
    assert not torch.equal(train[0]['label'], val[0]['label'])


def test_size_mismatch_names_both_files(tmp_path):
    image = write_tif(tmp_path / 'scene.tif', np.zeros((3, 64, 64), np.uint8))
    label = write_tif(tmp_path / 'scene_label.tif', np.zeros((48, 64), np.uint8))
    with pytest.raises(ValueError) as err:
        GeoTiffScenes([image], [label], crop_size=32, classes=2)
    assert image in str(err.value) and label in str(err.value)


def test_same_index_gives_identical_sample_in_any_instance(tmp_path):
    a, b = small_synthetic(tmp_path), small_synthetic(tmp_path)
    for i in (0, 7, 12345):
        assert torch.equal(a[i]['image'], b[i]['image']) and torch.equal(a[i]['label'], b[i]['label'])
    assert not torch.equal(a[0]['image'], a[1]['image'])
    # Windows cross the loader as read (uint8 here) with compact labels; the device step
    # makes the float32 input and int64 labels the model and loss take.
    sample = a[3]
    assert sample['image'].dtype == torch.uint8 and sample['image'].shape == (3, 64, 64)
    assert sample['label'].dtype == torch.uint8 and sample['label'].shape == (64, 64)
    assert sample['nodata'].dtype == torch.bool and not sample['nodata'].any()
    image, label = finished(a, 3)
    assert image.dtype == torch.float32 and label.dtype == torch.int64


def test_train_sampler_ranks_disjoint_and_cover_range():
    world, micro, steps = 2, 3, 5
    streams = [list(itertools.islice(TrainSampler(r, world, micro), steps * micro)) for r in range(world)]
    assert not set(streams[0]) & set(streams[1])
    assert sorted(streams[0] + streams[1]) == list(range(steps * world * micro))


def test_train_sampler_resume_continues_the_stream():
    full = list(itertools.islice(TrainSampler(1, 4, 2), 20 * 2))
    resumed = list(itertools.islice(TrainSampler(1, 4, 2, start_micro_step=7), 13 * 2))
    assert resumed == full[7 * 2:]


def test_loader_batches_do_not_depend_on_workers(tmp_path):
    ds = small_synthetic(tmp_path)
    batches = {}
    for workers in (0, 2):
        loader = build_train_loader(ds, micro_batch=2, rank=1, world_size=2, num_workers=workers,
                                    prefetch_factor=1, start_micro_step=3)
        batches[workers] = list(itertools.islice(iter(loader), 3))
    for b0, b2 in zip(batches[0], batches[2]):
        assert torch.equal(b0['image'], b2['image']) and torch.equal(b0['label'], b2['label'])
    # ...and equal the dataset items the sampler promises for micro-step 3 of rank 1.
    assert torch.equal(batches[0][0]['label'][1], ds[(3 * 2 + 1) * 2 + 1]['label'])


def test_loader_workers_ignore_the_signals_meant_for_their_rank(tmp_path):
    """Slurm signals every process of a step (scancel --full): a worker must outlive SIGUSR1/SIGTERM
    so that its rank can finish the step and checkpoint."""
    import signal
    import time
    ds = small_synthetic(tmp_path)
    loader = build_train_loader(ds, micro_batch=2, rank=0, world_size=1, num_workers=1, prefetch_factor=1)
    it = iter(loader)
    next(it)
    worker, = it._workers
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        os.kill(worker.pid, sig)
    time.sleep(0.5)
    assert worker.is_alive() and worker.exitcode is None
    for _ in range(3):  # the stream goes on through the same worker
        assert next(it)['image'].shape[0] == 2
    it._shutdown_workers()


def test_grid_windows_count_every_pixel_once(tmp_path):
    ds = small_synthetic(tmp_path, split='val', mode='grid')  # 150 px scenes, 64 px windows
    assert len(ds) == 2 * 3 * 3
    rebuilt = [np.full((150, 150), -1, np.int64) for _ in ds.scenes]
    valid = 0
    for i in range(len(ds)):
        label = ds[i]['label'].numpy()
        keep = label != IGNORE
        valid += keep.sum()
        _, label_path, window = ds.window(i)
        scene = [s['label'] for s in ds.scenes].index(label_path)
        view = rebuilt[scene][window.row_off:window.row_off + 64, window.col_off:window.col_off + 64]
        assert (view[keep] == -1).all(), 'a pixel was counted twice'
        view[keep] = label[keep]
    assert valid == 2 * 150 * 150
    for scene, image in zip(ds.scenes, rebuilt):
        with rasterio.open(scene['label']) as src:
            np.testing.assert_array_equal(image, src.read(1))
    # Padding indices (EvalSampler) re-read a window but count nothing.
    assert (ds[len(ds) + 1]['label'] == IGNORE).all()


def test_eval_sampler_equal_shards_cover_all():
    for n, world in [(10, 3), (9, 3), (2, 4), (18, 1)]:
        shards = [list(EvalSampler(n, r, world)) for r in range(world)]
        assert len({len(s) for s in shards}) == 1
        assert len({len(EvalSampler(n, r, world)) for r in range(world)}) == 1
        flat = sorted(sum(shards, []))
        assert [i for i in flat if i < n] == list(range(n))
        assert [i for i in flat if i >= n] == list(range(n, len(flat)))


def test_eval_loader_equal_batches_per_rank(tmp_path):
    ds = small_synthetic(tmp_path, split='val', mode='grid')  # 18 windows
    counts = [len(list(build_eval_loader(ds, 4, r, 4, num_workers=0))) for r in range(4)]
    assert counts == [2, 2, 2, 2]


def test_flips_and_rotations_keep_image_and_label_aligned(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 5, (1, 96, 80)).astype(np.uint8)
    # class = pixel value: any misalignment between image and label shows up.
    image = write_tif(tmp_path / 'img.tif', values)
    label = write_tif(tmp_path / 'lbl.tif', values[0])
    kw = dict(crop_size=32, classes=5, mean=[0.0], std=[1.0])
    aug = GeoTiffScenes([image], [label], augment=True, **kw)
    plain = GeoTiffScenes([image], [label], augment=False, **kw)
    transforms_seen = set()
    for i in range(40):
        # The worker reads the same window either way (augmentation does not move positions);
        # the flip/rotation happens in the device step.
        assert torch.equal(aug[i]['image'], plain[i]['image']) and 'geom' not in plain[i]
        (a_img, a_lbl), (p_img, p_lbl) = finished(aug, i), finished(plain, i)
        np.testing.assert_array_equal(a_img[0].numpy().astype(np.int64), a_lbl.numpy())
        match = [(k, f) for k in range(4) for f in (False, True)
                 if np.array_equal(dihedral(p_lbl.numpy(), k, f), a_lbl.numpy())
                 and np.array_equal(dihedral(p_img.numpy(), k, f), a_img.numpy())]
        assert match, 'augmented crop is not a flip/rotation of the same crop'
        transforms_seen.add(match[0])
    assert len(transforms_seen) >= 4


def test_uint16_four_band_variant(tmp_path):
    ds = small_synthetic(tmp_path, bands=4, dtype='uint16')
    assert ds.in_channels == 4 and ds[0]['image'].shape == (4, 64, 64)
    with rasterio.open(ds.scenes[0]['image']) as src, rasterio.open(ds.scenes[0]['label']) as lbl:
        assert src.dtypes[0] == 'uint16' and src.count == 4
        assert ColorInterp.alpha not in src.colorinterp
        pixels, classes = src.read(), lbl.read(1)
    assert pixels.max() > 255
    vegetation = np.isin(classes, [CLASSES.index('grass'), CLASSES.index('tree')])
    nir_over_red = pixels[3].astype(float) / np.maximum(pixels[0], 1)
    assert nir_over_red[vegetation].mean() > 1.5 * nir_over_red[~vegetation].mean()  # NDVI-like cue


@pytest.mark.parametrize('dtype', [np.uint8, np.uint16])
def test_nodata_becomes_ignore_and_zero_input(tmp_path, dtype):
    """The nodata value in every band is nodata; in one band only, it is a real value of 8-bit
    imagery (a black shadow) but the reserved code of a 16-bit band without data there
    (Sentinel-2's band edges), fed to the model as a value before."""
    values = np.full((2, 40, 40), 100, dtype)
    values[:, 10:14, :] = 0          # nodata in every band
    values[0, 20, :] = 0             # zero in one band only
    image = write_tif(tmp_path / 'img.tif', values, nodata=0)
    label = write_tif(tmp_path / 'lbl.tif', np.ones((40, 40), np.uint8))
    ds = GeoTiffScenes([image], [label], crop_size=40, classes=2, mode='grid', mean=[50, 50], std=[10, 10])
    sample = ds[0]
    one_band_is_data = dtype == np.uint8
    rows = 4 if one_band_is_data else 5
    assert sample['nodata'][10:14].all() and sample['nodata'].sum() == rows * 40
    assert bool(sample['nodata'][20].any()) is not one_band_is_data
    image, label = finished(ds, 0)
    assert (label[10:14] == IGNORE).all() and (image[:, 10:14] == 0).all()
    if one_band_is_data:
        assert (label[20] == 1).all() and torch.allclose(image[0, 20], torch.tensor(-5.0))
    else:
        assert (label[20] == IGNORE).all() and (image[:, 20] == 0).all()
    assert (label == 1).sum() == 40 * (40 - rows) and torch.allclose(image[1, 0], torch.tensor(5.0))


def test_small_scene_is_padded_with_ignore(tmp_path):
    image = write_tif(tmp_path / 'img.tif', np.full((1, 20, 30), 7, np.uint8))
    label = write_tif(tmp_path / 'lbl.tif', np.zeros((20, 30), np.uint8))
    ds = GeoTiffScenes([image], [label], crop_size=32, classes=1, augment=False, mean=[5.0], std=[2.0])
    assert len(ds) == 1
    sample = ds[0]
    assert sample['image'].shape == (1, 32, 32)
    assert (sample['label'][:20, :30] == 0).all() and (sample['label'][20:] == IGNORE).all()
    assert (sample['label'][:, 30:] == IGNORE).all()
    assert sample['nodata'].sum() == 32 * 32 - 20 * 30 and not sample['nodata'][:20, :30].any()
    image, _ = finished(ds, 0)   # padding is 0 in the input, like nodata
    assert (image[:, 20:] == 0).all() and (image[:, :, 30:] == 0).all() and (image[:, :20, :30] == 1).all()


def test_stats_are_computed_and_cached_when_not_given(tmp_path):
    values = np.stack([np.full((32, 32), 10, np.uint8), np.arange(32 * 32).reshape(32, 32) % 7]).astype(np.uint8)
    image = write_tif(tmp_path / 'img.tif', values)
    label = write_tif(tmp_path / 'lbl.tif', np.zeros((32, 32), np.uint8))
    ds = GeoTiffScenes([image], [label], crop_size=32, classes=1, bands=[2])
    assert ds.in_channels == 1
    assert ds.mean[0] == pytest.approx(values[1].mean(), rel=1e-5)
    assert os.path.exists(tmp_path / '.ds_seg_stats.json')


def test_unreadable_window_names_file_and_window(tmp_path):
    image = write_tif(tmp_path / 'img.tif', np.zeros((1, 64, 64), np.uint8))
    label = write_tif(tmp_path / 'lbl.tif', np.zeros((64, 64), np.uint8))
    ds = GeoTiffScenes([image], [label], crop_size=32, classes=1)
    with open(image, 'r+b') as f:  # keep the header, destroy the pixel data
        f.truncate(600)
    with pytest.raises(DataError, match=r'img\.tif: cannot read window Window.*TIFFReadEncodedTile'):
        ds[0]


def _build_in_child(cache_dir):
    ds = SyntheticAerial(split='train', num_scenes=3, scene_size=256, crop_size=64, cache_dir=cache_dir)
    return ds.directory, ds[0]['label'].sum().item()


def test_concurrent_creation_in_one_cache_dir(tmp_path):
    with mp.get_context('spawn').Pool(2) as pool:
        results = pool.map(_build_in_child, [str(tmp_path)] * 2)
    assert results[0] == results[1]
    # One finished directory, no leftover temporary ones.
    assert os.listdir(tmp_path / 'synthetic') == [os.path.basename(results[0][0])]


def _tiles(tmp_path, image_names, label_names, spacing=100):
    """One 32x32 tile per name pair, each ``spacing`` m east of the last; the label of tile k is
    class k."""
    (tmp_path / 'img').mkdir()
    (tmp_path / 'lbl').mkdir()
    for k, (image, label) in enumerate(zip(image_names, label_names)):
        where = from_origin(500_000 + spacing * k, 5_500_000, 0.1, 0.1)
        write_tif(tmp_path / 'img' / image, np.full((3, 32, 32), 10 * k, np.uint8), where)
        write_tif(tmp_path / 'lbl' / label, np.full((32, 32), k, np.uint8), where)
    return str(tmp_path / 'img' / '*.tif'), str(tmp_path / 'lbl' / '*.tif')


def test_globs_that_sort_differently_are_paired_by_name(tmp_path):
    # sorted: x1, x10, x2 against x10_mask, x1_mask, x2_mask: by position, x1 got x10's label.
    images, labels = _tiles(tmp_path, ['x1.tif', 'x10.tif', 'x2.tif'], ['x1_mask.tif', 'x10_mask.tif', 'x2_mask.tif'])
    ds = GeoTiffScenes(images, labels, crop_size=32, classes=3, mode='grid', mean=[0] * 3, std=[1] * 3)
    pairs = [(os.path.basename(s['image']), os.path.basename(s['label'])) for s in ds.scenes]
    assert pairs == [('x1.tif', 'x1_mask.tif'), ('x10.tif', 'x10_mask.tif'), ('x2.tif', 'x2_mask.tif')]
    for i in range(3):
        sample = ds[i]
        assert int(sample['label'].unique()) == int(sample['image'][0, 0, 0]) // 10


def test_tiles_of_one_name_in_region_folders_pair_by_their_folders(tmp_path):
    """img/y/s.tif, img/x/s.tif with lab/x/s.tif, lab/y/s.tif: the names are all the same, so the
    lists were paired by position, y's image with x's label, without a word (same size and grid)."""
    where = from_origin(500_000, 5_500_000, 0.1, 0.1)
    for k, region in enumerate(('x', 'y')):
        (tmp_path / 'img' / region).mkdir(parents=True)
        (tmp_path / 'lab' / region).mkdir(parents=True)
        write_tif(tmp_path / 'img' / region / 's.tif', np.full((3, 32, 32), 10 * k, np.uint8), where)
        write_tif(tmp_path / 'lab' / region / 's.tif', np.full((32, 32), k, np.uint8), where)
    images = [str(tmp_path / 'img' / r / 's.tif') for r in ('y', 'x')]
    labels = [str(tmp_path / 'lab' / r / 's.tif') for r in ('x', 'y')]
    ds = GeoTiffScenes(images, labels, crop_size=32, classes=2, mode='grid', mean=[0] * 3, std=[1] * 3)
    assert [(s['image'], s['label']) for s in ds.scenes] == list(zip(images, labels[::-1]))
    for i in range(2):
        assert int(ds[i]['label'].unique()) == int(ds[i]['image'][0, 0, 0]) // 10


def test_one_label_named_otherwise_still_pairs_by_name_not_by_position(tmp_path):
    """x2's label named x2_lab beside x1_mask, x10_mask: the varying parts (1_mask, 10_mask, 2_lab
    against 1, 10, 2) are not one set, and the pairing fell back to position: x1 with x10_mask and
    x10 with x1_mask, scored and trained on without a word."""
    images, labels = _tiles(tmp_path, ['x1.tif', 'x10.tif', 'x2.tif'], ['x1_mask.tif', 'x10_mask.tif', 'x2_lab.tif'],
                            spacing=0)   # one grid for all: only the names can pair them
    ds = GeoTiffScenes(images, labels, crop_size=32, classes=3, mode='grid', mean=[0] * 3, std=[1] * 3)
    pairs = [(os.path.basename(s['image']), os.path.basename(s['label'])) for s in ds.scenes]
    assert pairs == [('x1.tif', 'x1_mask.tif'), ('x10.tif', 'x10_mask.tif'), ('x2.tif', 'x2_lab.tif')]
    for i in range(3):
        sample = ds[i]
        assert int(sample['label'].unique()) == int(sample['image'][0, 0, 0]) // 10


def test_a_label_named_for_two_images_is_refused(tmp_path):
    images, labels = _tiles(tmp_path, ['x1.tif', 'x2.tif', 'x3.tif'], ['x1_a.tif', 'x1_b.tif', 'x3_a.tif'], spacing=0)
    with pytest.raises(DataError, match=r"image '.*x1.tif' is named in labels '.*x1_a.tif' and '.*x1_b.tif'; give "
                                        r"one label per image"):
        GeoTiffScenes(images, labels, crop_size=32, classes=3, mean=[0] * 3, std=[1] * 3)


def test_names_that_match_only_in_part_are_refused_naming_one_of_each(tmp_path):
    images, labels = _tiles(tmp_path, ['x1.tif', 'x2.tif', 'x3.tif'], ['x1_mask.tif', 'x2_mask.tif', 'x4_mask.tif'])
    with pytest.raises(DataError) as err:
        GeoTiffScenes(images, labels, crop_size=32, classes=3, mean=[0] * 3, std=[1] * 3)
    message = str(err.value)
    assert 'x3.tif' in message and 'x4_mask.tif' in message and '1 of 3 unmatched' in message


def test_names_that_share_nothing_keep_the_position_pairing(tmp_path):
    # Chips in one place (the grids agree whatever the pairing): only the names could reorder them.
    images, labels = _tiles(tmp_path, ['scene_b.tif', 'scene_c.tif'], ['gt_2.tif', 'gt_1.tif'], spacing=0)
    ds = GeoTiffScenes(images, labels, crop_size=32, classes=2, mean=[0] * 3, std=[1] * 3)
    pairs = [(os.path.basename(s['image']), os.path.basename(s['label'])) for s in ds.scenes]
    assert pairs == [('scene_b.tif', 'gt_1.tif'), ('scene_c.tif', 'gt_2.tif')]


def test_a_file_with_brackets_in_its_name_is_that_file_and_a_folder_is_its_rasters(tmp_path):
    """'tile[1].tif' was taken as a glob: it trained on tile1.tif beside it (another scene), or was
    refused as a pattern matching nothing. A folder was refused as "not a readable raster" where
    predict.py and evaluate.py read its GeoTIFFs."""
    _tiles(tmp_path, ['tile[1].tif', 'tile1.tif'], ['tile[1].tif', 'tile1.tif'])
    ds = GeoTiffScenes(str(tmp_path / 'img' / 'tile[1].tif'), str(tmp_path / 'lbl' / 'tile[1].tif'), crop_size=32,
                       classes=2, mean=[0] * 3, std=[1] * 3)
    assert [os.path.basename(s['image']) for s in ds.scenes] == ['tile[1].tif']
    folders = GeoTiffScenes(str(tmp_path / 'img'), str(tmp_path / 'lbl'), crop_size=32, classes=2, mean=[0] * 3,
                            std=[1] * 3)
    assert [(os.path.basename(s['image']), os.path.basename(s['label'])) for s in folders.scenes] == [
        ('tile1.tif', 'tile1.tif'), ('tile[1].tif', 'tile[1].tif')]
    (tmp_path / 'empty').mkdir()
    with pytest.raises(DataError, match=r'images: folder .*empty holds no GeoTIFF or JPEG 2000 raster'):
        GeoTiffScenes(str(tmp_path / 'empty'), str(tmp_path / 'lbl'), crop_size=32, classes=2, mean=[0] * 3,
                      std=[1] * 3)


def test_a_validation_scene_given_twice_is_refused_and_training_may_repeat_one(tmp_path):
    # Evaluation windows of a scene given twice (overlapping globs) would count twice in every
    # metric; a training set may repeat a scene (it weighs it twice, as a list says).
    images, labels = _tiles(tmp_path, ['a1.tif', 'b1.tif'], ['a1.tif', 'b1.tif'])
    repeated = [images, str(tmp_path / 'img' / 'a*.tif')]
    with pytest.raises(DataError, match=r"images: .*a1.tif is given twice.*count twice in every metric"):
        GeoTiffScenes(repeated, [labels, str(tmp_path / 'lbl' / 'a*.tif')], crop_size=32, classes=2,
                      split='val', mean=[0] * 3, std=[1] * 3)
    train = GeoTiffScenes(repeated, [labels, str(tmp_path / 'lbl' / 'a*.tif')], crop_size=32, classes=2,
                          split='train', mean=[0] * 3, std=[1] * 3)
    assert len(train.scenes) == 3
    # A hard link is the same file under another name (its real path differs): refused too.
    for folder in ('img', 'lbl'):
        os.link(tmp_path / folder / 'a1.tif', tmp_path / folder / 'a1_copy.tif')
    with pytest.raises(DataError, match=r"images: .*a1_copy.tif is given twice \(also as .*a1.tif\)"):
        GeoTiffScenes([str(tmp_path / 'img' / n) for n in ('a1.tif', 'b1.tif', 'a1_copy.tif')],
                      [str(tmp_path / 'lbl' / n) for n in ('a1.tif', 'b1.tif', 'a1_copy.tif')], crop_size=32,
                      classes=2, split='val', mean=[0] * 3, std=[1] * 3)


def test_a_scene_copied_under_another_name_is_one_scene_and_files_alike_at_their_ends_are_not(tmp_path):
    """cp a1.tif a1_copy.tif (another inode): the validation set scored the scene twice, without a word."""
    import shutil
    _tiles(tmp_path, ['a1.tif', 'b1.tif'], ['a1.tif', 'b1.tif'])
    for folder in ('img', 'lbl'):
        shutil.copy(tmp_path / folder / 'a1.tif', tmp_path / folder / 'z_copy.tif')
    names = ('a1.tif', 'b1.tif', 'z_copy.tif')
    images, labels = ([str(tmp_path / folder / n) for n in names] for folder in ('img', 'lbl'))
    kw = dict(crop_size=32, classes=2, mean=[0] * 3, std=[1] * 3)
    # Said, not refused: a benchmark may hold a tile twice, and its metric counts it twice.
    val = GeoTiffScenes(images, labels, split='val', **kw)
    assert val.notes == [f"images: {images[2]} is given twice (a copy of {images[0]}: the same bytes under another "
                         "name): its pixels count twice in every metric; give it once, unless the set holds it twice "
                         "on purpose"]
    train = GeoTiffScenes(images, labels, split='train', **kw)
    assert train.notes == [f"images: {images[2]} is given twice (a copy of {images[0]}: the same bytes under another "
                           "name): its windows are drawn twice as often as another scene's; give it once, unless that "
                           "weighting is meant"]
    # The same size and the same bytes at both ends, one byte apart in the middle: two files.
    from ds_seg.data import geotiff
    a, b = tmp_path / 'x.bin', tmp_path / 'y.bin'
    body = bytes(3 * geotiff.COPY_SAMPLE_BYTES)
    a.write_bytes(body)
    b.write_bytes(body[:len(body) // 2] + b'\x01' + body[len(body) // 2 + 1:])
    keys = {str(a): (0, 1), str(b): (0, 2)}
    geotiff._key_copies_alike([str(a), str(b)], keys)
    assert keys[str(a)] != keys[str(b)]
    b.write_bytes(body)
    geotiff._key_copies_alike([str(a), str(b)], keys)
    assert keys[str(a)] == keys[str(b)]


@pytest.mark.parametrize('kw, named', [(dict(num_scenes=0), 'num_scenes must be an integer >= 1, got 0'),
                                       (dict(num_scenes=True), 'num_scenes must be an integer >= 1, got True'),
                                       (dict(dates=0), 'dates must be an integer >= 1, got 0'),
                                       # a count, as GeoTiffScenes takes: "'int' object is not iterable"
                                       (dict(classes=5), r'classes must be a list of names from .* got 5; it draws '
                                                         r'these 6 classes itself'),
                                       (dict(classes='road'), "got 'road'")])
def test_synthetic_scene_counts_that_are_no_count_are_named(tmp_path, kw, named):
    """num_scenes=True trained on one scene; 0 gave a divide-by-zero warning, then "images: no
    files given", naming neither the key nor the split."""
    from ds_seg.config import ConfigError
    from ds_seg.registry import DATASETS, build
    with pytest.raises(ConfigError, match=rf'data.train \(SyntheticAerial\): .*{named}'):
        build(DATASETS, dict(type='SyntheticAerial', cache_dir=str(tmp_path), crop_size=64, scene_size=64, **kw),
              where='data.train')


def test_a_typo_in_a_dataset_that_passes_keys_on_gets_a_suggestion(tmp_path):
    """SyntheticAerial and the benchmark datasets pass their keys on to GeoTiffScenes: a typo was
    GeoTiffScenes.__init__'s TypeError, with no "Did you mean"."""
    from ds_seg.registry import DATASETS, RegistryError, build
    with pytest.raises(RegistryError, match=r"data.train.num_scene: SyntheticAerial has no argument 'num_scene'. "
                                            r"Did you mean 'num_scenes'"):
        build(DATASETS, dict(type='SyntheticAerial', num_scene=3, cache_dir=str(tmp_path)), where='data.train')
    with pytest.raises(RegistryError, match=r"data.val.reduce_zero_labels: LoveDA has no argument "
                                            r"'reduce_zero_labels'. Did you mean 'reduce_zero_label'"):
        build(DATASETS, dict(type='LoveDA', data_root=str(tmp_path), reduce_zero_labels=True), where='data.val')


def test_an_unwritable_cache_is_named_by_the_setting_that_chose_it(monkeypatch, tmp_path):
    # "[Errno 2] No such file or directory: '/proc/x'" named neither $DS_SEG_CACHE nor what to do.
    from ds_seg.data import SyntheticAerial
    blocker = tmp_path / 'file'
    blocker.write_text('not a folder')
    monkeypatch.setenv('DS_SEG_CACHE', str(blocker / 'cache'))
    with pytest.raises(ValueError, match=r"cannot be written under .*file/cache \(\$DS_SEG_CACHE\): .*; give a "
                                         r"writable folder"):
        SyntheticAerial(split='train', num_scenes=1, scene_size=64, crop_size=32)
    with pytest.raises(ValueError, match=r"\(cache_dir\)"):
        SyntheticAerial(split='train', num_scenes=1, scene_size=64, crop_size=32, cache_dir=str(blocker / 'c'))


def test_boundary_ignore_leaves_out_the_pixels_evaluate_erode_does_whatever_the_window(tmp_path):
    """Training eroded each window on its own with a square, counting nodata as a class: a class
    edge on a window's border was not eroded, a corner lost a square, and nodata made a
    boundary. Every window now holds the evaluation's eroded label (a disk over the whole scene,
    ignore and nodata no class), cut out where the window lies."""
    from ds_seg.data.raster import boundary_mask
    h, w, r = 70, 90, 3
    label = np.zeros((h, w), np.uint8)
    label[:, 32:] = 1
    label[20:45, 50:70] = 2
    label[60:, :20] = 255                       # ignore: no class, no boundary
    image = np.full((3, h, w), 100, np.uint8)
    image[:, :, 80:] = 0                        # nodata beside class 1
    img, lbl = tmp_path / 'i.tif', tmp_path / 'l.tif'
    write_tif(img, image, nodata=0)
    write_tif(lbl, label[None])
    ds = GeoTiffScenes([str(img)], [str(lbl)], classes=3, crop_size=32, boundary_ignore=r, mean=[100] * 3,
                       std=[10] * 3)
    expect = label.copy()
    expect[boundary_mask(label, r, 255)] = 255
    expect[image[0] == 0] = 255
    assert (expect[label != 255] == 255).sum() > (expect[image[0] == 0] == 255).sum()  # the disk did mark pixels
    for y, x in [(0, 0), (10, 29), (8, 40), (38, 66), (5, 58), (38, 70)]:
        got = ds._read_window(0, y, x, 32, 32)[1]
        want = np.full((32, 32), 255, np.uint8)
        part = expect[y:y + 32, x:x + 32]
        want[:part.shape[0], :part.shape[1]] = part
        np.testing.assert_array_equal(got, want, err_msg=f'window at {(y, x)}')


def test_a_folders_hidden_files_are_not_scenes(tmp_path):
    """macOS leaves AppleDouble files (``._a.tif``, not rasters) beside the scenes on other disks:
    a folder given for images/labels was refused as '._a.tif: not a readable raster', and a hidden
    raster was trained on, where a ``*.tif`` glob of the same folder skips both."""
    _tiles(tmp_path, ['a.tif', '.c.tif'], ['a.tif', '.c.tif'])
    for folder in ('img', 'lbl'):
        (tmp_path / folder / '._a.tif').write_bytes(b'\x00\x05\x16\x07' + bytes(60))   # AppleDouble magic
    ds = GeoTiffScenes(str(tmp_path / 'img'), str(tmp_path / 'lbl'), crop_size=32, classes=2, mean=[0] * 3,
                       std=[1] * 3)
    assert [(os.path.basename(s['image']), os.path.basename(s['label'])) for s in ds.scenes] == [('a.tif', 'a.tif')]


def test_an_image_given_as_its_own_label_is_refused(tmp_path):
    """images and labels given the same glob trained a 255-class model on the pixel values."""
    images, _ = _tiles(tmp_path, ['a.tif'], ['a.tif'])
    write_tif(tmp_path / 'gray.tif', np.arange(32 * 32, dtype=np.uint8).reshape(32, 32) % 7)
    with pytest.raises(DataError, match=r'label .*gray.tif is the image itself; point labels at the ground-truth'):
        GeoTiffScenes(str(tmp_path / 'gray.tif'), str(tmp_path / 'gray.tif'), crop_size=32)
    linked = tmp_path / 'linked.tif'
    os.link(tmp_path / 'gray.tif', linked)   # one file under two names
    with pytest.raises(DataError, match='is the image itself'):
        GeoTiffScenes(str(tmp_path / 'gray.tif'), str(linked), crop_size=32)


@pytest.mark.parametrize('bands', [[2.9], [1, 2.0], 2, [True], ['2']])
def test_band_numbers_that_are_not_whole_are_refused(tmp_path, bands):
    """int(2.9) read band 2 without a word (config.json recorded [2.9])."""
    images, labels = _tiles(tmp_path, ['a.tif'], ['a.tif'])
    with pytest.raises(DataError, match=r'bands=.*give a list of whole band numbers, 1-based \(.*a.tif has bands 1..3\)'):
        GeoTiffScenes(images, labels, crop_size=32, classes=2, bands=bands, mean=[0], std=[1])


def test_a_label_value_off_a_class_is_said_exactly(tmp_path):
    """A float label's 1.0000001 was said as 'label value 1, which is not a class index 0..2'."""
    label = np.zeros((32, 32), np.float64)
    label[3, 4] = 1.0000001
    write_tif(tmp_path / 'img.tif', np.full((3, 32, 32), 5, np.uint8))
    write_tif(tmp_path / 'lbl.tif', label)
    with pytest.raises(DataError, match=r'label value 1\.0000001, which is not a class index 0..2'):
        GeoTiffScenes(str(tmp_path / 'img.tif'), str(tmp_path / 'lbl.tif'), crop_size=32, classes=3, mean=[0] * 3,
                      std=[1] * 3)



@pytest.mark.parametrize('decoding, said', [
    (dict(reduce_zero_label=True), 'with reduce_zero_label the file values that are classes are 1..3 and 0, 255 are '
                                   'ignored'),
    (dict(label_map={10: 0, 20: 1, 30: 2, 0: 255}), 'with label_map the file values that are classes are 1..2, 10, '
                                                     '20, 30 and 0, 255 are ignored')])
def test_a_label_value_off_a_decoded_class_names_the_file_values_that_are_classes(tmp_path, decoding, said):
    """Under reduce_zero_label (LoveDA) a mask's 8 was 'not a class index 0..6', though the file's
    classes are 1..7: the line now says which file values are classes and which are ignored."""
    label = np.zeros((32, 32), np.uint8)
    label[:8] = 1
    label[3, 4] = 40
    write_tif(tmp_path / 'img.tif', np.full((3, 32, 32), 5, np.uint8))
    write_tif(tmp_path / 'lbl.tif', label)
    with pytest.raises(DataError, match=r'label value 40.* is not a class index 0..2 nor ignore_index 255 \(classes: '
                                        r'class_0, class_1, class_2; ' + said + r'\)'):
        GeoTiffScenes(str(tmp_path / 'img.tif'), str(tmp_path / 'lbl.tif'), crop_size=32, classes=3, mean=[0] * 3,
                      std=[1] * 3, **decoding)

def test_scenes_of_another_band_scale_or_offset_are_refused_and_the_model_records_it(tmp_path):
    """GDAL's scale/offset tags (Sentinel-2 since baseline 04.00: reflectance + 1000, offset -1000)
    were ignored: a scene so stored trained beside raw ones (statistics averaged over both
    encodings), and predict took one without a word. Scenes must share one encoding, which
    the model records; a scene in another is refused by predict's and evaluate's check."""
    from ds_seg.engine.checkpointer import data_normalisation
    from ds_seg.inference.model import scene_refusal
    images, labels = _tiles(tmp_path, ['a.tif', 'b.tif'], ['a.tif', 'b.tif'])
    with rasterio.open(tmp_path / 'img' / 'b.tif', 'r+') as dst:
        dst.offsets = (-1000.0, -1000.0, -1000.0)
    with pytest.raises(DataError, match=r"b.tif: its bands' scale/offset \[\[1.0, -1000.0\], .* differ from .*a.tif's "
                                        r"\[\[1.0, 0.0\], \[1.0, 0.0\], \[1.0, 0.0\]\]"):
        GeoTiffScenes(images, labels, crop_size=32, classes=2, mean=[0] * 3, std=[1] * 3)
    ds = GeoTiffScenes(str(tmp_path / 'img' / 'a.tif'), str(tmp_path / 'lbl' / 'a.tif'), crop_size=32, classes=2,
                       bands=[3, 1], mean=[0] * 2, std=[1] * 2)
    data = data_normalisation(ds)
    assert data['encoding'] == [[1.0, 0.0], [1.0, 0.0]]

    class Model:
        training_normalisation = data
    assert scene_refusal(Model(), str(tmp_path / 'img' / 'a.tif'), bands_given=False) is None
    said = scene_refusal(Model(), str(tmp_path / 'img' / 'b.tif'), bands_given=False)
    assert said and "b.tif: its bands' scale/offset [[1.0, -1000.0], [1.0, -1000.0]] differ from" in said, said


def test_the_band_encoding_check_takes_a_date_file_against_a_model_of_stacked_dates(tmp_path):
    """A model of files stacking 2 dates x 3 bands records 6 [scale, offset]; predict reads one
    date's file with --bands 1 2 3 (and the reverse: a stacked file against a model of date
    files): compared as 3 against 6, such a plain file was refused."""
    from ds_seg.inference.model import band_encoding_refusal
    plain = write_tif(tmp_path / 'date.tif', np.ones((3, 16, 16), np.uint8))
    stacked = write_tif(tmp_path / 'stacked.tif', np.ones((6, 16, 16), np.uint8))
    assert band_encoding_refusal({'bands': [1, 2, 3], 'encoding': [[1.0, 0.0]] * 6}, plain) is None
    assert band_encoding_refusal({'bands': [1, 2, 3, 4, 5, 6], 'encoding': [[1.0, 0.0]] * 3}, stacked) is None
    with rasterio.open(plain, 'r+') as dst:
        dst.offsets = (-1000.0,) * 3
    assert 'differ from' in band_encoding_refusal({'bands': [1, 2, 3], 'encoding': [[1.0, 0.0]] * 6}, plain)
    assert band_encoding_refusal({'bands': [1, 2, 3], 'encoding': [[1.0, 0.0]] * 3 + [[1.0, -1000.0]] * 3},
                                 plain) is None   # the second date's encoding


def test_a_symbolic_link_to_nothing_in_a_folder_or_glob_is_refused_naming_it(tmp_path):
    """A folder of links into a dataset on a disk that is partly unmounted: the dangling ones were
    left out without a word (fewer scenes trained, predicted and scored), where the same files
    given as a glob to the datasets were refused."""
    from ds_seg.inputs import expand_inputs
    _tiles(tmp_path, ['a.tif', 'b.tif'], ['a.tif', 'b.tif'])
    for folder in ('img', 'lbl'):
        os.symlink(tmp_path / 'gone' / 'c.tif', tmp_path / folder / 'c.tif')
    said = f"is a symbolic link to {tmp_path / 'gone' / 'c.tif'}, which does not exist"
    with pytest.raises(DataError, match=f"^images: {tmp_path / 'img' / 'c.tif'} {said}"):
        GeoTiffScenes(str(tmp_path / 'img'), str(tmp_path / 'lbl'), crop_size=32, classes=2, mean=[0] * 3, std=[1] * 3)
    for given in (str(tmp_path / 'img'), str(tmp_path / 'img' / '*.tif'), str(tmp_path / 'img' / 'c.tif')):
        with pytest.raises(DataError, match=f"^--input: {tmp_path / 'img' / 'c.tif'} {said}"):
            expand_inputs([given])
    os.remove(tmp_path / 'img' / 'c.tif')
    os.remove(tmp_path / 'lbl' / 'c.tif')
    assert [os.path.basename(p) for p in expand_inputs([str(tmp_path / 'img')])] == ['a.tif', 'b.tif']


def test_a_training_scene_given_twice_is_said_once(tmp_path):
    """A link or a backup copy beside a scene in a training folder drew its windows twice as often
    without a word (validation refuses it: it would count twice in the metrics)."""
    _tiles(tmp_path, ['a.tif', 'b.tif'], ['a.tif', 'b.tif'])
    for folder in ('img', 'lbl'):
        os.symlink(tmp_path / folder / 'a.tif', tmp_path / folder / 'c.tif')
    kw = dict(crop_size=32, classes=2, mean=[0] * 3, std=[1] * 3)
    ds = GeoTiffScenes(str(tmp_path / 'img'), str(tmp_path / 'lbl'), **kw)
    assert ds.notes == [f"images: {tmp_path / 'img' / 'c.tif'} is given twice (also as {tmp_path / 'img' / 'a.tif'}): "
                        "its windows are drawn twice as often as another scene's; give it once, unless that "
                        "weighting is meant"]
    with pytest.raises(DataError, match=r'c.tif is given twice \(also as .*a.tif\), by overlapping globs'):
        GeoTiffScenes(str(tmp_path / 'img'), str(tmp_path / 'lbl'), mode='grid', **kw)
    os.remove(tmp_path / 'img' / 'c.tif')
    os.remove(tmp_path / 'lbl' / 'c.tif')
    assert not getattr(GeoTiffScenes(str(tmp_path / 'img'), str(tmp_path / 'lbl'), **kw), 'notes', None)


def test_a_label_map_of_every_class_to_itself_decodes_nothing(tmp_path):
    """All the classes listed in their own order (SyntheticAerial's classes, or label_map={0: 0, ...})
    leave the labels as class indices: recorded as no decoding, so a resume, or evaluate.py's
    --labels, was not refused as a change of decoding; a map that moves a value is kept whole
    but for its identity entries (the same table)."""
    from ds_seg.cli.evaluate import refuse_label_decoding
    from ds_seg.data.geotiff import effective_label_decoding
    from ds_seg.data.synthetic import CLASSES, SyntheticAerial
    every = SyntheticAerial(split='train', num_scenes=1, scene_size=64, crop_size=32, cache_dir=str(tmp_path),
                            classes=list(CLASSES))
    assert every.label_decoding is None
    some = SyntheticAerial(split='train', num_scenes=1, scene_size=64, crop_size=32, cache_dir=str(tmp_path),
                           classes=list(CLASSES[:3]))
    assert some.label_decoding == {'label_map': {'3': 0, '4': 0, '5': 0}}   # grass, road, building as they are
    identity = {'label_map': {str(i): i for i in range(6)}}
    assert effective_label_decoding(identity, 6) is None
    assert effective_label_decoding({'label_map': {'0': 0, '1': 0}}, 6) == {'label_map': {'1': 0}}
    assert effective_label_decoding({'label_map': {'6': 6}}, 6) == {'label_map': {'6': 6}}   # not a class
    assert effective_label_decoding(dict(identity, reduce_zero_label=True), 6) == dict(identity, reduce_zero_label=True)
    refuse_label_decoding({'classes': list('abcdef'), 'data': {'label_decoding': identity}})
    with pytest.raises(ValueError, match="label_map=\\{'1': 0\\}"):
        refuse_label_decoding({'classes': list('abcdef'), 'data': {'label_decoding': {'label_map': {'1': 0}}}})


def test_an_empty_entry_in_a_path_list_is_named_as_such(tmp_path):
    """'data.train.images=a.tif,b.tif,' (a trailing comma) parses to [..., '']: the line was
    'ds_seg: error: : no such file', naming neither the key nor the entry."""
    from ds_seg.data.geotiff import expand_paths
    from ds_seg.data.raster import DataError
    with pytest.raises(DataError, match=r"^images: entry 3 of 3 is an empty path \(a stray comma\?\); remove it$"):
        expand_paths([str(tmp_path / 'a.tif'), str(tmp_path / 'b.tif'), ''], 'images')
