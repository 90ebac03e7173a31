"""The benchmark adapters against mmsegmentation's own definitions, hard-coded here (copied from
open-mmlab/mmsegmentation: mmseg/datasets/{isprs,potsdam,loveda}.py and
tools/dataset_converters/{potsdam,vaihingen}.py), never read from the code under test: a
published mIoU is only comparable when the tiles, the class order and the colour decoding are
the same. Files are generated, 16 x 16 pixels, one per tile/area of the full benchmark."""
import os

import numpy as np
import pytest
import rasterio
from rasterio.transform import from_origin

from ds_seg.data import LoveDA, Potsdam, Vaihingen

IGNORE = 255

# mmseg/datasets/isprs.py and potsdam.py (ISPRSDataset / PotsdamDataset METAINFO), RGB order.
MMSEG_ISPRS_CLASSES = ('impervious_surface', 'building', 'low_vegetation', 'tree', 'car', 'clutter')
MMSEG_ISPRS_PALETTE = [[255, 255, 255], [0, 0, 255], [0, 255, 255], [0, 255, 0], [255, 255, 0], [255, 0, 0]]
# tools/dataset_converters/potsdam.py `splits`
MMSEG_POTSDAM_TRAIN = ['2_10', '2_11', '2_12', '3_10', '3_11', '3_12', '4_10', '4_11', '4_12', '5_10', '5_11',
                       '5_12', '6_10', '6_11', '6_12', '6_7', '6_8', '6_9', '7_10', '7_11', '7_12', '7_7', '7_8',
                       '7_9']
MMSEG_POTSDAM_VAL = ['5_15', '6_15', '6_13', '3_13', '4_14', '6_14', '5_14', '2_13', '4_15', '2_14', '5_13',
                     '4_13', '3_14', '7_13']
# tools/dataset_converters/vaihingen.py `splits` (area9 has no ground truth and is dropped there)
MMSEG_VAIHINGEN_TRAIN = ['area1', 'area11', 'area13', 'area15', 'area17', 'area21', 'area23', 'area26', 'area28',
                         'area3', 'area30', 'area32', 'area34', 'area37', 'area5', 'area7']
MMSEG_VAIHINGEN_VAL = ['area6', 'area24', 'area35', 'area16', 'area14', 'area22', 'area10', 'area4', 'area2',
                       'area20', 'area8', 'area31', 'area33', 'area27', 'area38', 'area12', 'area29']
# mmseg/datasets/loveda.py (LoveDADataset; reduce_zero_label=True: mask value k is class k - 1)
MMSEG_LOVEDA_CLASSES = ('background', 'building', 'road', 'water', 'barren', 'forest', 'agricultural')
MMSEG_LOVEDA_PALETTE = [[255, 255, 255], [255, 0, 0], [255, 255, 0], [0, 0, 255], [159, 129, 183], [0, 255, 0],
                        [255, 195, 128]]

SIZE = 16


def _tif(path, array_CHW):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    c, h, w = array_CHW.shape
    with rasterio.open(path, 'w', driver='GTiff', width=w, height=h, count=c, dtype=array_CHW.dtype,
                       crs='EPSG:32633', transform=from_origin(368_000, 5_808_000, 0.05, 0.05)) as dst:
        dst.write(array_CHW)


def _label_rgb():
    """Column j painted with mmseg's colour of class j % 6; row 0 black (an eroded boundary)."""
    index = np.tile(np.arange(SIZE) % 6, (SIZE, 1))
    rgb = np.asarray(MMSEG_ISPRS_PALETTE, np.uint8)[index].transpose(2, 0, 1).copy()
    rgb[:, 0] = 0
    expect = index.copy()
    expect[0] = IGNORE
    return rgb, expect


@pytest.fixture(scope='module')
def isprs_trees(tmp_path_factory):
    root = tmp_path_factory.mktemp('isprs')
    rng = np.random.default_rng(0)
    rgb, expect = _label_rgb()
    potsdam, vaihingen = str(root / 'potsdam'), str(root / 'vaihingen')
    for t in MMSEG_POTSDAM_TRAIN + MMSEG_POTSDAM_VAL:
        _tif(f'{potsdam}/2_Ortho_RGB/top_potsdam_{t}_RGB.tif', rng.integers(0, 255, (3, SIZE, SIZE), dtype=np.uint8))
        _tif(f'{potsdam}/5_Labels_all/top_potsdam_{t}_label.tif', rgb)
        _tif(f'{potsdam}/5_Labels_all_noBoundary/top_potsdam_{t}_label_noBoundary.tif', rgb)
    for a in MMSEG_VAIHINGEN_TRAIN + MMSEG_VAIHINGEN_VAL + ['area9']:  # area9: an image without labels
        name = f'top_mosaic_09cm_{a}'
        _tif(f'{vaihingen}/top/{name}.tif', rng.integers(0, 255, (3, SIZE, SIZE), dtype=np.uint8))
        if a != 'area9':
            _tif(f'{vaihingen}/ground_truth/{name}.tif', rgb)
            _tif(f'{vaihingen}/gts_eroded/{name}_noBoundary.tif', rgb)
    return potsdam, vaihingen, expect


@pytest.mark.parametrize('split, tiles', [('train', MMSEG_POTSDAM_TRAIN), ('val', MMSEG_POTSDAM_VAL),
                                          ('test', MMSEG_POTSDAM_VAL)])
def test_potsdam_split_classes_and_palette_are_mmsegmentations(isprs_trees, split, tiles):
    ds = Potsdam(isprs_trees[0], split=split, crop_size=SIZE)
    assert sorted(ds.tiles) == sorted(tiles) and len(ds.scenes) == len(tiles)
    assert tuple(ds.classes) == MMSEG_ISPRS_CLASSES
    assert [list(c) for c in Potsdam.PALETTE] == MMSEG_ISPRS_PALETTE


@pytest.mark.parametrize('split, areas', [('train', MMSEG_VAIHINGEN_TRAIN), ('val', MMSEG_VAIHINGEN_VAL),
                                          ('test', MMSEG_VAIHINGEN_VAL)])
def test_vaihingen_split_classes_and_palette_are_mmsegmentations(isprs_trees, split, areas):
    ds = Vaihingen(isprs_trees[1], split=split, crop_size=SIZE)
    assert sorted(f'area{a}' for a in ds.areas) == sorted(areas) and len(ds.scenes) == len(areas)
    assert tuple(ds.classes) == MMSEG_ISPRS_CLASSES
    assert [list(c) for c in Vaihingen.PALETTE] == MMSEG_ISPRS_PALETTE


@pytest.mark.parametrize('cls, which', [(Potsdam, 0), (Vaihingen, 1)])
def test_isprs_label_colours_decode_to_mmsegmentations_class_indices(isprs_trees, cls, which):
    expect = isprs_trees[2]
    for split in ('train', 'val'):
        ds = cls(isprs_trees[which], split=split, crop_size=SIZE, mode='grid')
        np.testing.assert_array_equal(ds[0]['label'].numpy(), expect, err_msg=f'{cls.__name__} {split}')


def test_loveda_classes_palette_and_zero_label_are_mmsegmentations(tmp_path):
    import cv2
    root = tmp_path / 'loveda'
    mask = np.tile(np.arange(SIZE, dtype=np.uint8) % 8, (SIZE, 1))   # 0 no-data, 1-7 the classes
    for split in ('Train', 'Val'):
        for domain in ('Urban', 'Rural'):
            os.makedirs(root / split / domain / 'images_png')
            os.makedirs(root / split / domain / 'masks_png')
            cv2.imwrite(str(root / split / domain / 'images_png' / '7.png'), np.full((SIZE, SIZE, 3), 90, np.uint8))
            cv2.imwrite(str(root / split / domain / 'masks_png' / '7.png'), mask)
    ds = LoveDA(str(root), split='val', crop_size=SIZE, mode='grid')
    assert tuple(ds.classes) == MMSEG_LOVEDA_CLASSES
    assert [list(c) for c in LoveDA.PALETTE] == MMSEG_LOVEDA_PALETTE
    expect = np.where(mask == 0, IGNORE, mask.astype(np.int64) - 1)
    np.testing.assert_array_equal(ds[0]['label'].numpy(), expect)


def test_loveda_masks_converted_already_are_refused_and_read_as_they_are_when_said(tmp_path):
    """Masks converted already (classes 0-6, 255 no-data) were reduced once more: background
    ignored and every other class learnt as the one before it, without a word."""
    import cv2

    from ds_seg.data.raster import DataError
    root = tmp_path / 'loveda'
    converted = np.tile(np.arange(SIZE, dtype=np.uint8) % 8, (SIZE, 1))
    converted[converted == 7] = 255                                   # 0-6 the classes, 255 no-data
    for domain in ('Urban', 'Rural'):
        os.makedirs(root / 'Val' / domain / 'images_png')
        os.makedirs(root / 'Val' / domain / 'masks_png')
        cv2.imwrite(str(root / 'Val' / domain / 'images_png' / '7.png'), np.full((SIZE, SIZE, 3), 90, np.uint8))
        cv2.imwrite(str(root / 'Val' / domain / 'masks_png' / '7.png'), converted)
    with pytest.raises(DataError, match=r"LoveDA: .*masks_png/7.png holds the value 255, which the official masks "
                                        r"never do .* reduce_zero_label=False"):
        LoveDA(str(root), split='val', crop_size=SIZE, mode='grid')
    ds = LoveDA(str(root), split='val', crop_size=SIZE, mode='grid', reduce_zero_label=False)
    np.testing.assert_array_equal(ds[0]['label'].numpy(), np.where(converted == 255, IGNORE, converted))
