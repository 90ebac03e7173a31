"""Miniature copies of the benchmark directory trees, with the official file names.

Content comes from :func:`~ds_seg.data.synthetic.generate_scene` with the synthetic classes
mapped onto each benchmark's classes and label encoding, so a model can learn something from
them. Used by the tests (no downloads) and to try a benchmark config before downloading.

Example::

    root = write_miniature('Potsdam', '/tmp/potsdam', size=128)
    ds = Potsdam(root, split='train', crop_size=64)
"""
import os

import cv2
import numpy as np
import rasterio
from rasterio.transform import from_origin

from .benchmarks import DeepGlobeLandCover, LoveDA, Potsdam, ISPRS_PALETTE
from .synthetic import BUILDING, CAR, GRASS, ROAD, TREE, WATER, generate_scene

# synthetic class -> benchmark class index
_TO_ISPRS = {GRASS: 2, ROAD: 0, BUILDING: 1, TREE: 3, WATER: 5, CAR: 4}
_TO_LOVEDA = {GRASS: 6, ROAD: 2, BUILDING: 1, TREE: 5, WATER: 3, CAR: 2}       # then + 1 in the file
_TO_DEEPGLOBE = {GRASS: 1, ROAD: 0, BUILDING: 0, TREE: 3, WATER: 4, CAR: 0}


def _map(label, table):
    lut = np.zeros(256, np.uint8)
    for k, v in table.items():
        lut[k] = v
    return lut[label]


def _colour(index_HW, palette):
    return np.asarray(palette, np.uint8)[index_HW].transpose(2, 0, 1)  # 3 x H x W


def _eroded(rgb_3HW, index_HW, radius=1):
    k = np.ones((2 * radius + 1,) * 2, np.uint8)
    edge = cv2.dilate(index_HW, k) != cv2.erode(index_HW, k)
    out = rgb_3HW.copy()
    out[:, edge] = 0  # ISPRS noBoundary files paint boundaries black
    return out


def _write_tif(path, array_CHW, transform=None, crs='EPSG:32633', photometric=None):
    import warnings
    warnings.simplefilter('ignore', rasterio.errors.NotGeoreferencedWarning)  # on purpose, see _potsdam
    import warnings
    warnings.simplefilter("ignore", rasterio.errors.NotGeoreferencedWarning)  # label TIFFs without georeference, on purpose
    os.makedirs(os.path.dirname(path), exist_ok=True)
    c, h, w = array_CHW.shape
    with rasterio.open(path, 'w', driver='GTiff', width=w, height=h, count=c, dtype=array_CHW.dtype,
                       crs=crs, transform=transform or from_origin(368_000, 5_808_000, 0.05, 0.05),
                       tiled=True, blockxsize=32, blockysize=32,
                       photometric=photometric or ('RGB' if c == 3 else 'MINISBLACK')) as dst:
        dst.write(array_CHW)


def _write_png(path, array_CHW_or_HW, jpg=False):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    a = array_CHW_or_HW
    if a.ndim == 3:
        a = a.transpose(1, 2, 0)[..., ::-1]  # RGB -> cv2's BGR
    cv2.imwrite(path, np.ascontiguousarray(a), [cv2.IMWRITE_JPEG_QUALITY, 90] if jpg else [])


def _scene(seed, i, size, bands=3):
    return generate_scene(np.random.default_rng([seed, i]), size, bands=bands)


def write_miniature(name, root, size=96, seed=0):
    """Write a miniature ``name`` tree (a DATASETS name or 'ImageMaskFolder') under ``root``.

    Returns the ``data_root`` to give the dataset. Train and val splits get 2 and 1 scene(s).
    """
    writer = {'Potsdam': _potsdam, 'Vaihingen': _vaihingen, 'LoveDA': _loveda, 'InriaAerial': _inria,
              'DeepGlobeLandCover': _deepglobe, 'ImageMaskFolder': _folder}[name]
    writer(root, size, seed)
    return root


def _potsdam(root, size, seed):
    tiles = Potsdam.SPLITS['train'][:2] + Potsdam.SPLITS['val'][:1]
    for i, t in enumerate(tiles):
        image, label = _scene(seed, i, size, bands=4)
        cls = _map(label, _TO_ISPRS)
        rgb = _colour(cls, ISPRS_PALETTE)
        transform = from_origin(368_000 + 300 * i, 5_808_000, 0.05, 0.05)
        _write_tif(f'{root}/2_Ortho_RGB/top_potsdam_{t}_RGB.tif', image[:3], transform)
        _write_tif(f'{root}/4_Ortho_RGBIR/top_potsdam_{t}_RGBIR.tif', image, transform)
        _write_tif(f'{root}/3_Ortho_IRRG/top_potsdam_{t}_IRRG.tif', image[[3, 0, 1]], transform)
        # The official label TIFFs carry no georeference; the adapter must cope with that.
        _write_tif(f'{root}/5_Labels_all/top_potsdam_{t}_label.tif', rgb, from_origin(0, 0, 1, -1), crs=None)
        _write_tif(f'{root}/5_Labels_all_noBoundary/top_potsdam_{t}_label_noBoundary.tif',
                   _eroded(rgb, cls), from_origin(0, 0, 1, -1), crs=None)


def _vaihingen(root, size, seed):
    from .benchmarks import Vaihingen
    areas = Vaihingen.SPLITS['train'][:2] + Vaihingen.SPLITS['val'][:1]
    for i, a in enumerate(areas):
        image, label = _scene(seed, 10 + i, (size, size + 17), bands=4)  # areas are not square
        cls = _map(label, _TO_ISPRS)
        rgb = _colour(cls, ISPRS_PALETTE)
        transform = from_origin(496_000 + 300 * i, 5_420_000, 0.09, 0.09)
        name = f'top_mosaic_09cm_area{a}'
        _write_tif(f'{root}/top/{name}.tif', image[[3, 0, 1]], transform)  # IRRG
        _write_tif(f'{root}/ground_truth/{name}.tif', rgb, transform)
        _write_tif(f'{root}/gts_eroded/{name}_noBoundary.tif', _eroded(rgb, cls), transform)


def _loveda(root, size, seed):
    k = 0
    for split, n in (('Train', 2), ('Val', 1)):
        for domain in ('Urban', 'Rural'):
            for j in range(n):
                image, label = _scene(seed, 20 + k, size)
                mask = _map(label, _TO_LOVEDA) + 1
                mask[: size // 8] = 0  # a no-data stripe, as along LoveDA's tile edges
                _write_png(f'{root}/{split}/{domain}/images_png/{1366 + k}.png', image)
                _write_png(f'{root}/{split}/{domain}/masks_png/{1366 + k}.png', mask)
                k += 1


def _inria(root, size, seed):
    for c, city in enumerate(('austin', 'tyrol-w')):
        for n in (1, 6, 7):  # tile 1 is validation, 6 and 7 training
            image, label = _scene(seed, 40 + 10 * c + n, size)
            gt = np.where(label == BUILDING, 255, 0).astype(np.uint8)[None]
            transform = from_origin(620_000 + 1500 * n, 3_350_000, 0.3, 0.3)
            _write_tif(f'{root}/AerialImageDataset/train/images/{city}{n}.tif', image, transform, crs='EPSG:26914')
            _write_tif(f'{root}/AerialImageDataset/train/gt/{city}{n}.tif', gt, transform, crs='EPSG:26914')
    image, _ = _scene(seed, 99, size)
    _write_tif(f'{root}/AerialImageDataset/test/images/bellingham1.tif', image, crs='EPSG:26914')


def _deepglobe(root, size, seed):
    rng = np.random.default_rng(seed)
    for k, ident in enumerate((100694, 102122, 10452, 104113, 105415)):  # 5 ids: 1 val, 4 train
        image, label = _scene(seed, 60 + k, size)
        cls = _map(label, _TO_DEEPGLOBE)
        rgb = _colour(cls, DeepGlobeLandCover.PALETTE).astype(np.int16)
        rgb[:, -size // 10:, :] = 0  # unknown strip
        # The published masks are not clean colours: add JPEG-like noise of up to +-40.
        rgb = np.clip(rgb + rng.integers(-40, 41, rgb.shape), 0, 255).astype(np.uint8)
        _write_png(f'{root}/train/{ident}_sat.jpg', image, jpg=True)
        _write_png(f'{root}/train/{ident}_mask.png', rgb)
    image, _ = _scene(seed, 70, size)
    _write_png(f'{root}/valid/999_sat.jpg', image, jpg=True)


def _folder(root, size, seed):
    for split, n in (('train', 2), ('val', 1)):
        for j in range(n):
            image, label = _scene(seed, 80 + j + 5 * (split == 'val'), size)
            _write_png(f'{root}/img_dir/{split}/{j}_0_0_{size}_{size}.png', image)
            _write_png(f'{root}/ann_dir/{split}/{j}_0_0_{size}_{size}.png', _map(label, _TO_ISPRS))


__all__ = ["write_miniature"]
