"""Pre-cut patch folders in the mmsegmentation layout: ``img_dir/<split>/`` + ``ann_dir/<split>/``.

Patches are read through the same windowed-read path as whole scenes (GDAL opens PNG, JPG and
TIFF), so random crops, random scale, nodata, label remapping and palettes work the same.
"""
import os

from ds_seg.registry import DATASETS

from .geotiff import DataError, GeoTiffScenes

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.tif', '.tiff')


def pair_folder(img_dir, ann_dir, img_suffix=IMAGE_SUFFIXES, seg_map_suffix='.png'):
    """Sorted (image, label) paths: every image in ``img_dir`` with the label of the same stem
    (and ``seg_map_suffix``) in ``ann_dir``; a missing label stops with both paths named."""
    if not os.path.isdir(img_dir):
        raise DataError(f"{img_dir}: no such directory (expected image patches)")
    if not os.path.isdir(ann_dir):
        raise DataError(f"{ann_dir}: no such directory (expected label patches)")
    suffixes = (img_suffix,) if isinstance(img_suffix, str) else tuple(img_suffix)
    images = sorted(f for f in os.listdir(img_dir) if f.lower().endswith(tuple(x.lower() for x in suffixes)))
    if not images:
        raise DataError(f"{img_dir}: no image files ending in {', '.join(suffixes)}")
    pairs, paired = [], {}
    for name in images:
        stem = name[:-len(next(x for x in suffixes if name.lower().endswith(x.lower())))]
        label = os.path.join(ann_dir, stem + seg_map_suffix)
        if not os.path.exists(label):
            raise DataError(f"{os.path.join(img_dir, name)} has no label: expected {label}")
        if label in paired:  # x.png and x.jpg: one label counted twice in every metric
            raise DataError(f"{paired[label]} and {os.path.join(img_dir, name)} both pair with the label {label}; "
                            f"keep one of the images (or narrow img_suffix)")
        paired[label] = os.path.join(img_dir, name)
        pairs.append((os.path.join(img_dir, name), label))
    return [p[0] for p in pairs], [p[1] for p in pairs]


@DATASETS.register_module()
class ImageMaskFolder(GeoTiffScenes):
    """mmsegmentation-style patch folders: ``data_root/img_dir/<split>/x.png`` with
    ``data_root/ann_dir/<split>/x.png`` (labels: class indices, or colours with ``palette``).

    Args:
        data_root: the folder holding ``img_dir`` and ``ann_dir``.
        split: sub-folder of both (None: the images lie directly in them).
        img_suffix: accepted image endings (PNG, JPG, TIF by default); seg_map_suffix: the
            label's ending, same stem as the image.
        Other keyword arguments (``classes``, ``reduce_zero_label``, ``label_map``,
        ``palette``, ``random_scale``, ...) go to :class:`GeoTiffScenes`.

    Example::

        ds = ImageMaskFolder('data/potsdam', split='train', crop_size=512,
                             classes=('impervious_surface', 'building', 'low_vegetation',
                                      'tree', 'car', 'clutter'), reduce_zero_label=True)
    """

    def __init__(self, data_root, split='train', img_dir='img_dir', ann_dir='ann_dir',
                 img_suffix=IMAGE_SUFFIXES, seg_map_suffix='.png', crop_size=512, seed=0, **kw):
        sub = () if split is None else (split,)
        images, labels = pair_folder(os.path.join(data_root, img_dir, *sub),
                                     os.path.join(data_root, ann_dir, *sub), img_suffix, seg_map_suffix)
        self.data_root = data_root
        super().__init__(images, labels, crop_size=crop_size, split=split or 'train', seed=seed, **kw)
