"""Public aerial benchmarks, read from their official (unzipped) layouts and file names.

Every adapter is a :class:`~ds_seg.data.GeoTiffScenes` (windowed reads, random scale, grid
evaluation, nodata), takes ``(data_root, split='train', crop_size=512, seed=0, **kw)`` and
finds its files by their official names anywhere under ``data_root`` (so it does not matter
whether the archives were unzipped into sub-folders). ``split='train'`` draws random windows;
``'val'``/``'test'`` is a grid that counts every labelled pixel once. Each class's ``METRIC``
says which published convention the evaluation follows; keep it in mind when comparing mIoU.

    data = dict(train=dict(type='Potsdam', data_root='data/potsdam', split='train'),
                val=dict(type='Potsdam', data_root='data/potsdam', split='val'))
"""
import glob
import os
import re

from ds_seg.registry import DATASETS

from .geotiff import DataError, GeoTiffScenes

ISPRS_CLASSES = ('impervious_surface', 'building', 'low_vegetation', 'tree', 'car', 'clutter')
ISPRS_PALETTE = ((255, 255, 255), (0, 0, 255), (0, 255, 255), (0, 255, 0), (255, 255, 0), (255, 0, 0))
# Black is the eroded boundary of the ISPRS "noBoundary" labels: excluded from evaluation.
ISPRS_IGNORE = ((0, 0, 0),)
# The ISPRS and DeepGlobe palettes use only 0/255 per channel: matching each noisy colour to its
# nearest corner within 127 is thresholding every channel at 128, the organisers' own decoding.
_CORNER_TOLERANCE = 127


def _find(data_root, name, what):
    """The file called ``name`` anywhere under ``data_root`` (one match), or a DataError."""
    if not os.path.isdir(data_root):
        raise DataError(f"{what}: data_root {data_root} is not a directory")
    hits = sorted(glob.glob(os.path.join(glob.escape(data_root), '**', name), recursive=True))
    if not hits:
        raise DataError(f"{what}: {name} not found under {data_root}")
    return hits


def _split_for(split, names):
    if split not in names:
        raise ValueError(f"split must be one of {sorted(names)}, got {split!r}")
    return names[split]


@DATASETS.register_module()
class Potsdam(GeoTiffScenes):
    """ISPRS Potsdam: 38 tiles of 6000x6000 px at 5 cm, colour-coded labels, 6 classes.

    Files (official names): ``top_potsdam_{i}_{j}_{RGB|RGBIR|IRRG}.tif`` (``2_Ortho_RGB/``,
    ``4_Ortho_RGBIR/``, ``3_Ortho_IRRG/``) and ``top_potsdam_{i}_{j}_label.tif``
    (``5_Labels_all/``) or ``..._label_noBoundary.tif`` (``5_Labels_all_noBoundary/``).
    Split: mmsegmentation's 24 training tiles and 14 test tiles (``'val'`` == ``'test'``).

    ``modality``: which image product to read ('RGB', 'RGBIR' 4 bands, 'IRRG').
    ``eroded``: use the ``noBoundary`` labels (boundaries ignored); default: on for val/test
    (the ISPRS evaluation), off for train.

    Metric convention (``METRIC``): mmsegmentation's, mIoU over all 6 classes on the eroded
    labels (DeepLabV3+ ~77-79). GeoSeg-style papers report mIoU *without clutter* (~86-87):
    recompute from ``per_class`` in ``eval.jsonl`` to compare with those.

    Example::

        ds = Potsdam('data/potsdam', split='train', crop_size=512, random_scale=(0.5, 2.0))
    """
    CLASSES = ISPRS_CLASSES
    PALETTE = ISPRS_PALETTE
    METRIC = 'mmseg: 6-class mIoU on eroded (noBoundary) labels; GeoSeg papers exclude clutter'
    SPLITS = {
        'train': ('2_10', '2_11', '2_12', '3_10', '3_11', '3_12', '4_10', '4_11', '4_12', '5_10', '5_11',
                  '5_12', '6_10', '6_11', '6_12', '6_7', '6_8', '6_9', '7_10', '7_11', '7_12', '7_7',
                  '7_8', '7_9'),
        'val': ('5_15', '6_15', '6_13', '3_13', '4_14', '6_14', '5_14', '2_13', '4_15', '2_14', '5_13',
                '4_13', '3_14', '7_13'),
    }
    SPLITS['test'] = SPLITS['val']

    def __init__(self, data_root, split='train', crop_size=512, seed=0, modality='RGB', eroded=None,
                 tiles=None, **kw):
        if modality not in ('RGB', 'RGBIR', 'IRRG'):
            raise ValueError(f"modality must be 'RGB', 'RGBIR' or 'IRRG', got {modality!r}")
        tiles = tiles or _split_for(split, self.SPLITS)
        eroded = split != 'train' if eroded is None else eroded
        suffix = '_label_noBoundary.tif' if eroded else '_label.tif'
        images, labels = [], []
        present = self._present_tiles(data_root, modality)
        for t in tiles:
            if t not in present:
                continue  # a subset of the tiles (e.g. a smaller download) is fine...
            images.append(present[t])
            labels.append(_find(data_root, f'top_potsdam_{t}{suffix}', 'Potsdam')[0])
        if not images:  # ...but not none of them
            raise DataError(f"Potsdam: no top_potsdam_*_{modality}.tif of the {split} split under "
                            f"{data_root} (tiles {', '.join(tiles[:4])}, ...)")
        self.data_root, self.tiles = data_root, [t for t in tiles if t in present]
        kw.setdefault('palette_tolerance', _CORNER_TOLERANCE)
        super().__init__(images, labels, crop_size=crop_size, split=split, seed=seed,
                         classes=self.CLASSES, palette=self.PALETTE, palette_ignore=ISPRS_IGNORE, **kw)

    @staticmethod
    def _present_tiles(data_root, modality):
        found = {}
        for path in _find(data_root, f'top_potsdam_*_{modality}.tif', 'Potsdam'):
            m = re.fullmatch(rf'top_potsdam_(\d+_\d+)_{modality}\.tif', os.path.basename(path))
            if m:
                found[m.group(1)] = path
        return found


@DATASETS.register_module()
class Vaihingen(GeoTiffScenes):
    """ISPRS Vaihingen: 33 IRRG areas (1281-3816 px, 9 cm), colour-coded labels, 6 classes.

    Files (official names): images ``top/top_mosaic_09cm_area{N}.tif``
    (ISPRS_semantic_labeling_Vaihingen.zip), full labels with the same file name in any other
    folder (..._ground_truth_COMPLETE.zip), eroded labels ``top_mosaic_09cm_area{N}_noBoundary.tif``
    (..._ground_truth_eroded_COMPLETE.zip). Split: the 16 training / 17 test areas of the
    challenge (mmsegmentation's lists); ``'val'`` == ``'test'``.

    Metric convention (``METRIC``): mmsegmentation's 6-class mIoU on eroded labels
    (DeepLabV3+ ~72-74); papers without clutter differ.

    Example::

        ds = Vaihingen('data/vaihingen', split='val', crop_size=512)   # eroded labels, grid
    """
    CLASSES = ISPRS_CLASSES
    PALETTE = ISPRS_PALETTE
    METRIC = 'mmseg: 6-class mIoU on eroded (noBoundary) labels'
    SPLITS = {
        'train': ('1', '3', '5', '7', '11', '13', '15', '17', '21', '23', '26', '28', '30', '32', '34', '37'),
        'val': ('2', '4', '6', '8', '10', '12', '14', '16', '20', '22', '24', '27', '29', '31', '33', '35',
                '38'),
    }
    SPLITS['test'] = SPLITS['val']

    def __init__(self, data_root, split='train', crop_size=512, seed=0, eroded=None, areas=None, **kw):
        areas = areas or _split_for(split, self.SPLITS)
        eroded = split != 'train' if eroded is None else eroded
        images, labels, used = [], [], []
        for a in areas:
            name = f'top_mosaic_09cm_area{a}.tif'
            hits = glob.glob(os.path.join(glob.escape(data_root), '**', name), recursive=True)
            tops = [h for h in hits if os.path.basename(os.path.dirname(h)) == 'top']
            if not tops:
                continue
            if eroded:
                label = _find(data_root, f'top_mosaic_09cm_area{a}_noBoundary.tif', 'Vaihingen')[0]
            else:
                others = [h for h in hits if h not in tops]
                if not others:
                    raise DataError(f"Vaihingen: no full label {name} (outside top/) under {data_root}; "
                                    f"unzip the ground_truth_COMPLETE archive or use eroded=True")
                label = others[0]
            images.append(tops[0])
            labels.append(label)
            used.append(a)
        if not images:
            raise DataError(f"Vaihingen: no top/top_mosaic_09cm_area*.tif of the {split} split under {data_root}")
        self.data_root, self.areas = data_root, used
        kw.setdefault('palette_tolerance', _CORNER_TOLERANCE)
        super().__init__(images, labels, crop_size=crop_size, split=split, seed=seed,
                         classes=self.CLASSES, palette=self.PALETTE, palette_ignore=ISPRS_IGNORE, **kw)


@DATASETS.register_module()
class LoveDA(GeoTiffScenes):
    """LoveDA: 1024x1024 PNG patches, urban and rural domains, 7 classes; 0 = no-data.

    Files (official layout): ``{Train,Val,Test}/{Urban,Rural}/images_png/{id}.png`` with
    ``.../masks_png/{id}.png`` (values 0 no-data, 1-7 the classes). ``domain``: 'urban',
    'rural' or 'both'. 0 becomes ignore and 1-7 become 0-6 (mmseg's ``reduce_zero_label``).
    The test split has no public masks (evaluation is on the organisers' server).

    Metric convention (``METRIC``): mmsegmentation's 7-class mIoU with no-data ignored
    (DeepLabV3+ ~50-51 on val).

    Example::

        ds = LoveDA('data/loveDA', split='train', domain='rural', crop_size=512)
    """
    CLASSES = ('background', 'building', 'road', 'water', 'barren', 'forest', 'agricultural')  # mmseg's names
    PALETTE = ((255, 255, 255), (255, 0, 0), (255, 255, 0), (0, 0, 255), (159, 129, 183), (0, 255, 0),
               (255, 195, 128))
    METRIC = 'mmseg: 7-class mIoU, label 0 (no-data) ignored'

    def __init__(self, data_root, split='train', crop_size=512, seed=0, domain='both', **kw):
        folder = _split_for(split, {'train': 'Train', 'val': 'Val', 'test': 'Test'})
        if split == 'test':
            raise DataError("LoveDA: the Test split has no public masks; train on 'train', evaluate on "
                            "'val', and predict Test with launch/predict.py")
        domains = _split_for(domain, {'urban': ('Urban',), 'rural': ('Rural',), 'both': ('Urban', 'Rural')})
        images, labels = [], []
        for d in domains:
            img_dir = self._locate(data_root, folder, d)
            for name in sorted(os.listdir(img_dir)):
                if name.endswith('.png'):
                    images.append(os.path.join(img_dir, name))
                    labels.append(os.path.join(os.path.dirname(img_dir), 'masks_png', name))
                    if not os.path.exists(labels[-1]):
                        raise DataError(f"LoveDA: {images[-1]} has no mask: expected {labels[-1]}")
        if not images:
            raise DataError(f"LoveDA: no images_png/*.png in {folder}/{'+'.join(domains)} under {data_root}")
        self.data_root, self.domain = data_root, domain
        super().__init__(images, labels, crop_size=crop_size, split=split, seed=seed,
                         classes=self.CLASSES, reduce_zero_label=True, **kw)

    @staticmethod
    def _locate(data_root, folder, domain):
        hits = sorted(glob.glob(os.path.join(glob.escape(data_root), '**', folder, domain, 'images_png'),
                                recursive=True))
        if not hits:
            raise DataError(f"LoveDA: {folder}/{domain}/images_png not found under {data_root}")
        return hits[0]


@DATASETS.register_module()
class InriaAerial(GeoTiffScenes):
    """Inria Aerial Image Labeling: 5000x5000 RGB GeoTIFFs at 30 cm, building / not building.

    Files (official layout): ``AerialImageDataset/train/images/{city}{n}.tif`` with
    ``train/gt/{city}{n}.tif`` (0 / 255) for austin, chicago, kitsap, tyrol-w, vienna,
    n = 1..36. Split (the authors' convention): tiles 1-5 of every city are validation, 6-36
    training. The official test tiles have no public labels.

    Metric convention (``METRIC``): IoU of the building class (and overall accuracy) over
    all validation pixels, as the benchmark leaderboard; mIoU also printed, not comparable.

    Example::

        ds = InriaAerial('data/inria', split='val', crop_size=512)
    """
    CLASSES = ('background', 'building')
    METRIC = 'building-class IoU and overall accuracy (leaderboard convention)'
    CITIES = ('austin', 'chicago', 'kitsap', 'tyrol-w', 'vienna')

    def __init__(self, data_root, split='train', crop_size=512, seed=0, val_tiles=5, **kw):
        _split_for(split, {'train': 0, 'val': 0})
        found = _find(data_root, os.path.join('train', 'images', '*.tif'), 'InriaAerial')
        images, labels = [], []
        for path in found:
            m = re.fullmatch(r'([a-z-]+?)(\d+)\.tif', os.path.basename(path))
            if not m or m.group(1) not in self.CITIES:
                continue
            if (int(m.group(2)) <= val_tiles) != (split == 'val'):
                continue
            label = os.path.join(os.path.dirname(os.path.dirname(path)), 'gt', os.path.basename(path))
            images.append(path)
            labels.append(label)
        if not images:
            raise DataError(f"InriaAerial: no train/images/{{city}}{{n}}.tif of the {split} split under {data_root}")
        self.data_root = data_root
        super().__init__(images, labels, crop_size=crop_size, split=split, seed=seed,
                         classes=self.CLASSES, label_map={255: 1}, **kw)


@DATASETS.register_module()
class DeepGlobeLandCover(GeoTiffScenes):
    """DeepGlobe 2018 Land Cover: 803 labelled 2448x2448 JPG images with colour PNG masks.

    Files (official layout): ``train/{id}_sat.jpg`` with ``train/{id}_mask.png``. The
    challenge's valid/test folders have no masks, so the labelled images are split
    deterministically: every 5th id (sorted) is ``'val'``, the rest ``'train'``; ``'all'``
    is everything. Masks are decoded by nearest palette corner (thresholding at 128, as
    the organisers do), which absorbs their compression noise; 'unknown' (black) is ignored.

    Metric convention (``METRIC``): mIoU over the 6 classes, unknown ignored (the
    challenge's metric; it did not count unknown).

    Example::

        ds = DeepGlobeLandCover('data/deepglobe', split='train', crop_size=512)
    """
    CLASSES = ('urban_land', 'agriculture_land', 'rangeland', 'forest_land', 'water', 'barren_land')
    PALETTE = ((0, 255, 255), (255, 255, 0), (255, 0, 255), (0, 255, 0), (0, 0, 255), (255, 255, 255))
    UNKNOWN = ((0, 0, 0),)
    METRIC = '6-class mIoU, unknown ignored (challenge convention); val is every 5th labelled id'

    def __init__(self, data_root, split='train', crop_size=512, seed=0, **kw):
        _split_for(split, {'train': 0, 'val': 0, 'all': 0})
        sats = _find(data_root, os.path.join('train', '*_sat.jpg'), 'DeepGlobeLandCover')
        images, labels = [], []
        for k, path in enumerate(sorted(sats, key=lambda p: os.path.basename(p))):
            if split != 'all' and (k % 5 == 0) != (split == 'val'):
                continue
            images.append(path)
            labels.append(path[:-len('_sat.jpg')] + '_mask.png')
        if not images:
            raise DataError(f"DeepGlobeLandCover: no train/*_sat.jpg for split {split} under {data_root}")
        self.data_root = data_root
        kw.setdefault('palette_tolerance', _CORNER_TOLERANCE)
        super().__init__(images, labels, crop_size=crop_size, split='train' if split == 'all' else split,
                         seed=seed, classes=self.CLASSES, palette=self.PALETTE, palette_ignore=self.UNKNOWN,
                         **kw)
