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
import os
import re
import zlib

from ds_seg.registry import DATASETS

from .geotiff import DataError, GeoTiffScenes

ISPRS_CLASSES = ('impervious_surface', 'building', 'low_vegetation', 'tree', 'car', 'clutter')
ISPRS_PALETTE = ((255, 255, 255), (0, 0, 255), (0, 255, 255), (0, 255, 0), (255, 255, 0), (255, 0, 0))
# Black is the eroded boundary of the ISPRS "noBoundary" labels: excluded from evaluation.
ISPRS_IGNORE = ((0, 0, 0),)
# The ISPRS and DeepGlobe palettes use only 0/255 per channel: matching each noisy colour to its
# nearest corner within 127 is thresholding every channel at 128, the organisers' own decoding.
_CORNER_TOLERANCE = 127


def _where(data_root):
    """Where a relative data_root was looked for (the folder the run started in)."""
    return '' if os.path.isabs(os.path.expanduser(str(data_root))) else f' (relative to {os.getcwd()})'


def _files(data_root, what):
    """Every file under ``data_root``, in sorted order (symbolic links to folders followed once),
    or a DataError when ``data_root`` is not a folder."""
    if not os.path.isdir(data_root):
        raise DataError(f"{what}: data_root {data_root} is not a directory{_where(data_root)}")
    found, seen = [], set()
    for folder, dirs, names in os.walk(data_root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        found.extend(os.path.join(folder, n) for n in sorted(names))
    return found


def _named(files, pattern):
    """``{first group: [paths]}`` of the files whose name is ``pattern`` (a regex), in any letter
    case: an archive extracted on another system may spell ``.TIF`` or ``.JPG``."""
    found = {}
    for path in files:
        m = re.fullmatch(pattern, os.path.basename(path), re.IGNORECASE)
        if m:
            found.setdefault(m.group(1), []).append(path)
    return found


def _same_content(a, b):
    """Byte-equal files, or rasters of equal pixels (the same ground truth shipped in two archives,
    written apart: Vaihingen's gts_for_participants/ and its ground_truth_COMPLETE archive)."""
    import filecmp
    if os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False):
        return True
    import numpy as np
    import rasterio
    try:
        with rasterio.open(a) as x, rasterio.open(b) as y:
            return ((x.count, x.height, x.width, x.transform) == (y.count, y.height, y.width, y.transform)
                    and np.array_equal(x.read(), y.read()))
    except rasterio.errors.RasterioError:
        return False


def _distinct(paths):
    """``paths`` less the copies of an earlier one (sorted: the choice does not depend on listing order)."""
    kept = []
    for path in sorted(paths):
        if not any(_same_content(path, k) for k in kept):
            kept.append(path)
    return kept


def _one_copy(paths, what, data_root):
    """The one path of an official file name; two copies under ``data_root`` (the tree extracted
    twice, a backup) of the same content are one file, and copies that differ are refused: which
    one to read would be a guess, and an image of one copy could pair with a label of the other."""
    if len(paths) > 1:
        paths = _distinct(paths)
    if len(paths) > 1:
        raise DataError(f"{what}: {os.path.basename(paths[0])} is under {data_root} {len(paths)} times "
                        f"({paths[0]}; {paths[1]}); keep one copy of the dataset there, or point data_root at one")
    return paths[0]


def _ids(given, name):
    """``tiles='2_10'`` is one tile, not the tiles '2', '_', '1', '0'; ``areas=[1, 3]`` are '1', '3'."""
    return (str(given),) if isinstance(given, (str, int)) else tuple(str(g) for g in given)


def _partial_split(what, split, wanted, found, unit):
    """The line that says a split is incomplete (a partial download or extraction), or None."""
    missing = [t for t in wanted if t not in found]
    if not missing:
        return None
    listed = ', '.join(missing[:6]) + (', ...' if len(missing) > 6 else '')
    return (f"{what} {split}: {len(wanted) - len(missing)} of the split's {len(wanted)} {unit} found "
            f"(missing {listed}); using those found")


def _partial_count(what, split, found, official, unit):
    if found >= official:
        return None
    return (f"{what} {split}: {found} of the official {official} {unit} found; a partial download "
            f"or extraction? using those found")


def _split_for(split, names):
    if split not in names:
        raise ValueError(f"split must be one of {sorted(names)}, got {split!r}")
    return names[split]


# The band contents of the ISPRS products, band 1 first.
PRODUCT_COLOURS = {'RGB': ['red', 'green', 'blue'], 'RGBIR': ['red', 'green', 'blue', 'nir'],
                   'IRRG': ['nir', 'red', 'green']}


@DATASETS.register_module()
class Potsdam(GeoTiffScenes):
    """ISPRS Potsdam: 38 tiles of 6000x6000 px at 5 cm, colour-coded labels, 6 classes.

    Files (official names): ``top_potsdam_{i}_{j}_{RGB|RGBIR|IRRG}.tif`` (``2_Ortho_RGB/``,
    ``4_Ortho_RGBIR/``, ``3_Ortho_IRRG/``) and ``top_potsdam_{i}_{j}_label.tif``
    (``5_Labels_all/``) or ``..._label_noBoundary.tif`` (``5_Labels_all_noBoundary/``).
    Split: mmsegmentation's 24 training tiles and 14 test tiles (``'val'`` == ``'test'``).

    ``modality``: which image product to read ('RGB', 'RGBIR' 4 bands, 'IRRG').
    ``eroded``: use the ``noBoundary`` labels (boundaries ignored), as mmsegmentation does for
    every split (its converter reads only ``5_Labels_all_noBoundary.zip``) and the ISPRS
    evaluation does; ``eroded=False`` reads the full labels of ``5_Labels_all``.

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

    # Found under data_root or fixed by the benchmark (ds_seg.registry refuses them as keys).
    SETS_ITSELF = ('images', 'labels', 'classes', 'palette', 'palette_ignore')

    def __init__(self, data_root, split='train', crop_size=512, seed=0, modality='RGB', eroded=True,
                 tiles=None, **kw):
        if modality not in ('RGB', 'RGBIR', 'IRRG'):
            raise ValueError(f"modality must be 'RGB', 'RGBIR' or 'IRRG', got {modality!r}")
        tiles = _ids(tiles, 'tiles') if tiles else _split_for(split, self.SPLITS)
        suffix = '_label_noBoundary.tif' if eroded else '_label.tif'
        files = _files(data_root, 'Potsdam')
        present = _named(files, rf'top_potsdam_(\d+_\d+)_{modality}\.tif')
        label_files = _named(files, rf'top_potsdam_(\d+_\d+){re.escape(suffix)}')
        images, labels = [], []
        for t in tiles:
            if t not in present:
                continue  # a subset of the tiles (e.g. a smaller download) is fine...
            images.append(_one_copy(present[t], 'Potsdam', data_root))
            if t not in label_files:
                where = ('5_Labels_all_noBoundary; eroded=False reads the full labels of 5_Labels_all' if eroded
                         else '5_Labels_all')
                raise DataError(f"Potsdam: top_potsdam_{t}{suffix} not found under {data_root} ({where})")
            labels.append(_one_copy(label_files[t], 'Potsdam', data_root))
        if not images:  # ...but not none of them
            others = [m for m in ('RGB', 'RGBIR', 'IRRG')
                      if m != modality and _named(files, rf'top_potsdam_(\d+_\d+)_{m}\.tif')]
            hint = f"; there are *_{others[0]}.tif files: modality='{others[0]}'" if others else ''
            raise DataError(f"Potsdam: no top_potsdam_*_{modality}.tif of the {split} split under "
                            f"{data_root} (tiles {', '.join(tiles[:4])}, ...){hint}")
        self.data_root, self.tiles = data_root, [t for t in tiles if t in present]
        # What the product's bands hold, whatever its tags say (the IRRG files are tagged red, green,
        # blue): an IRRG training set beside an RGB validation set is refused (Trainer).
        self.modality, self.product_colours = modality, PRODUCT_COLOURS[modality]
        self.notes = [n for n in [_partial_split('Potsdam', split, tiles, present, 'tiles')] if n]
        kw.setdefault('palette_tolerance', _CORNER_TOLERANCE)
        super().__init__(images, labels, crop_size=crop_size, split=split, seed=seed,
                         classes=self.CLASSES, palette=self.PALETTE, palette_ignore=ISPRS_IGNORE, **kw)


@DATASETS.register_module()
class Vaihingen(GeoTiffScenes):
    """ISPRS Vaihingen: 33 IRRG areas (1281-3816 px, 9 cm), colour-coded labels, 6 classes.

    Files (official names): images ``top/top_mosaic_09cm_area{N}.tif``
    (ISPRS_semantic_labeling_Vaihingen.zip), full labels with the same file name in any other
    folder (..._ground_truth_COMPLETE.zip; the training areas' copies in gts_for_participants/
    are the same pixels, so either or both may be there), eroded labels ``top_mosaic_09cm_area{N}_noBoundary.tif``
    (..._ground_truth_eroded_COMPLETE.zip). Split: the 16 training / 17 test areas of the
    challenge (mmsegmentation's lists); ``'val'`` == ``'test'``. ``eroded`` (default, as
    mmsegmentation for every split): the eroded labels; ``eroded=False``: the full ones.

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

    # Found under data_root or fixed by the benchmark (ds_seg.registry refuses them as keys).
    SETS_ITSELF = ('images', 'labels', 'classes', 'palette', 'palette_ignore')

    def __init__(self, data_root, split='train', crop_size=512, seed=0, eroded=True, areas=None, **kw):
        areas = _ids(areas, 'areas') if areas else _split_for(split, self.SPLITS)
        files = _files(data_root, 'Vaihingen')
        named = _named(files, r'top_mosaic_09cm_area(\d+)\.tif')
        eroded_files = _named(files, r'top_mosaic_09cm_area(\d+)_noBoundary\.tif')
        images, labels, used = [], [], []
        for a in areas:
            name = f'top_mosaic_09cm_area{a}.tif'
            tops = [h for h in named.get(a, ()) if os.path.basename(os.path.dirname(h)).lower() == 'top']
            if not tops:
                continue
            if eroded:
                if a not in eroded_files:
                    raise DataError(f"Vaihingen: top_mosaic_09cm_area{a}_noBoundary.tif not found under {data_root} "
                                    f"(the ground_truth_eroded_COMPLETE archive; eroded=False reads the full labels)")
                label = _one_copy(eroded_files[a], 'Vaihingen', data_root)
            else:
                others = _distinct([h for h in named[a] if h not in tops])
                if not others:
                    raise DataError(f"Vaihingen: no full label {name} (outside top/) under {data_root}; "
                                    f"unzip the ground_truth_COMPLETE archive or use eroded=True")
                if len(others) > 1:  # a copy of the images, or labels that differ: either would be a guess
                    raise DataError(f"Vaihingen: {name} is under {data_root} outside top/ {len(others)} times, "
                                    f"with other pixels ({others[0]}; {others[1]}); keep only the full ground "
                                    "truth there")
                label = others[0]
            images.append(_one_copy(tops, 'Vaihingen', data_root))
            labels.append(label)
            used.append(a)
        if not images:
            raise DataError(f"Vaihingen: no top/top_mosaic_09cm_area*.tif of the {split} split under {data_root}")
        self.data_root, self.areas = data_root, used
        self.modality, self.product_colours = 'IRRG', PRODUCT_COLOURS['IRRG']
        self.notes = [n for n in [_partial_split('Vaihingen', split, areas, used, 'areas')] if n]
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

    # Images per split and domain in the official release (the LoveDA paper, Table 2).
    OFFICIAL_COUNTS = {('Train', 'Urban'): 1156, ('Train', 'Rural'): 1366, ('Val', 'Urban'): 677,
                       ('Val', 'Rural'): 992}

    # Found under data_root or fixed by the benchmark (ds_seg.registry refuses them as keys).
    SETS_ITSELF = ('images', 'labels', 'classes')

    def __init__(self, data_root, split='train', crop_size=512, seed=0, domain='both', reduce_zero_label=True, **kw):
        folder = _split_for(split, {'train': 'Train', 'val': 'Val', 'test': 'Test'})
        if split == 'test':
            raise DataError("LoveDA: the Test split has no public masks; train on 'train', evaluate on "
                            "'val', and predict Test with launch/predict.py")
        domains = _split_for(domain, {'urban': ('Urban',), 'rural': ('Rural',), 'both': ('Urban', 'Rural')})
        images, labels, self.notes = [], [], []
        for d in domains:
            img_dir = self._locate(data_root, folder, d)
            found = [n for n in sorted(os.listdir(img_dir)) if n.lower().endswith('.png') and not n.startswith('.')]
            for name in found:
                images.append(os.path.join(img_dir, name))
                labels.append(os.path.join(os.path.dirname(img_dir), 'masks_png', name))
                if not os.path.exists(labels[-1]):
                    raise DataError(f"LoveDA: {images[-1]} has no mask: expected {labels[-1]}")
            note = _partial_count(f'LoveDA {d}', split, len(found), self.OFFICIAL_COUNTS[folder, d], 'images')
            self.notes += [note] if note else []
        if not images:
            raise DataError(f"LoveDA: no images_png/*.png in {folder}/{'+'.join(domains)} under {data_root}")
        self.data_root, self.domain = data_root, domain
        super().__init__(images, labels, crop_size=crop_size, split=split, seed=seed,
                         classes=self.CLASSES, reduce_zero_label=reduce_zero_label, **kw)
        if reduce_zero_label:
            self._refuse_converted_masks(labels)

    @staticmethod
    def _refuse_converted_masks(labels):
        """Masks converted already (classes 0-6, 255 no-data: mmseg's and others' preprocessed
        copies) were reduced a second time without a word: background ignored, every other class
        learnt as the one before it. The official masks never hold 255; such a value says so.
        (The histograms are the ones the label check just read, from its cache.)"""
        from .geotiff import cached_label_histograms
        for path, histogram in zip(labels, cached_label_histograms(labels)):
            if histogram and 255.0 in histogram:
                raise DataError(f"LoveDA: {path} holds the value 255, which the official masks never do (0 no-data, "
                                "1-7 the classes): these masks look converted already (classes 0-6, 255 no-data), "
                                "and would be shifted once more (background ignored, each class read as the one "
                                "before it). Give LoveDA(..., reduce_zero_label=False) for converted masks, or use "
                                "the official ones.")

    @staticmethod
    def _locate(data_root, folder, domain):
        """``<folder>/<domain>/images_png`` at any depth (an archive extracted one level deeper:
        ``Train/Train/Urban``), in any letter case; one copy only."""
        if not os.path.isdir(data_root):
            raise DataError(f"LoveDA: data_root {data_root} is not a directory{_where(data_root)}")
        wanted = (folder.lower(), domain.lower(), 'images_png')
        hits = []
        for path, dirs, _ in os.walk(data_root, followlinks=True):
            dirs.sort()
            if tuple(p.lower() for p in path.split(os.sep)[-3:]) == wanted:
                hits.append(path)
                dirs[:] = []   # nothing to find among the images
            elif path.count(os.sep) - data_root.count(os.sep) >= 8:
                dirs[:] = []   # deeper than any extraction puts it (and no link loop runs forever)
        if not hits:
            raise DataError(f"LoveDA: {folder}/{domain}/images_png not found under {data_root}")
        if len(hits) > 1:
            raise DataError(f"LoveDA: {folder}/{domain}/images_png is under {data_root} twice ({hits[0]}; "
                            f"{hits[1]}); keep one copy of the dataset there, or point data_root at one")
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

    # Found under data_root or fixed by the benchmark (ds_seg.registry refuses them as keys).
    SETS_ITSELF = ('images', 'labels', 'classes', 'label_map')

    def __init__(self, data_root, split='train', crop_size=512, seed=0, val_tiles=5, **kw):
        _split_for(split, {'train': 0, 'val': 0})
        files = [f for f in _files(data_root, 'InriaAerial')
                 if [p.lower() for p in f.split(os.sep)[-3:-1]] == ['train', 'images']]
        tiles = _named(files, r'([a-z-]+?\d+)\.tif')
        images, labels = [], []
        for tile, paths in sorted(tiles.items()):
            m = re.fullmatch(r'([a-z-]+?)(\d+)', tile.lower())
            if m.group(1) not in self.CITIES:
                continue
            if (int(m.group(2)) <= val_tiles) != (split == 'val'):
                continue
            path = _one_copy(paths, 'InriaAerial', data_root)
            label = os.path.join(os.path.dirname(os.path.dirname(path)), 'gt', os.path.basename(path))
            images.append(path)
            labels.append(label)
        if not images:
            raise DataError(f"InriaAerial: no train/images/{{city}}{{n}}.tif of the {split} split under {data_root}")
        self.data_root = data_root
        official = len(self.CITIES) * (val_tiles if split == 'val' else 36 - val_tiles)
        self.notes = [n for n in [_partial_count('InriaAerial', split, len(images), official, 'tiles')] if n]
        super().__init__(images, labels, crop_size=crop_size, split=split, seed=seed,
                         classes=self.CLASSES, label_map={255: 1}, **kw)


@DATASETS.register_module()
class DeepGlobeLandCover(GeoTiffScenes):
    """DeepGlobe 2018 Land Cover: 803 labelled 2448x2448 JPG images with colour PNG masks.

    Files (official layout): ``train/{id}_sat.jpg`` with ``train/{id}_mask.png``. The
    challenge's valid/test folders have no masks, so the labelled images are split
    deterministically, by the id alone (:meth:`is_val`): ids that are multiples of 5 are
    ``'val'``, the rest ``'train'``; ``'all'``
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
    METRIC = '6-class mIoU, unknown ignored (challenge convention); val is the ids that are multiples of 5'

    OFFICIAL_COUNT = 803   # labelled images in the challenge's train folder

    # Found under data_root or fixed by the benchmark (ds_seg.registry refuses them as keys).
    SETS_ITSELF = ('images', 'labels', 'classes', 'palette', 'palette_ignore')

    def __init__(self, data_root, split='train', crop_size=512, seed=0, **kw):
        _split_for(split, {'train': 0, 'val': 0, 'all': 0})
        files = [f for f in _files(data_root, 'DeepGlobeLandCover')
                 if os.path.basename(os.path.dirname(f)).lower() == 'train']
        sats = _named(files, r'(.+)_sat\.jpg')
        masks = _named(files, r'(.+)_mask\.png')
        other_masks = _named(files, r'(.+)_mask\.(?!png$)[^.]+')
        images, labels = [], []
        for id_, paths in sorted(sats.items()):
            if split != 'all' and self.is_val(id_) != (split == 'val'):
                continue
            images.append(_one_copy(paths, 'DeepGlobeLandCover', data_root))
            # The mask beside the image, in whatever case it is spelt; named as expected if none.
            beside = [m for m in masks.get(id_, ()) if os.path.dirname(m) == os.path.dirname(images[-1])]
            if not beside:
                self._refuse_missing_mask(images[-1], other_masks.get(id_, ()), data_root)
            labels.append(beside[0])
        if not images:
            raise DataError(f"DeepGlobeLandCover: no train/*_sat.jpg for split {split} under {data_root}")
        self.data_root = data_root
        self.notes = [n for n in [_partial_count('DeepGlobeLandCover', 'train folder', len(sats),
                                                 self.OFFICIAL_COUNT, 'labelled images')] if n]
        kw.setdefault('palette_tolerance', _CORNER_TOLERANCE)
        super().__init__(images, labels, crop_size=crop_size, split='train' if split == 'all' else split,
                         seed=seed, classes=self.CLASSES, palette=self.PALETTE, palette_ignore=self.UNKNOWN,
                         **kw)

    @staticmethod
    def _refuse_missing_mask(image, others, data_root):
        expected = image[:-len('_sat.jpg')] + '_mask.png'
        other = next((o for o in others if os.path.dirname(o) == os.path.dirname(image)), None)
        if other and other.lower().endswith(('.jpg', '.jpeg')):
            # JPEG's lossy compression blends the colour codes at every class edge: not a label.
            raise DataError(f"DeepGlobeLandCover: {other} is a JPEG mask, whose compression changes the colour "
                            f"codes along every class edge; use the official PNG masks ({os.path.basename(expected)})")
        raise DataError(f"DeepGlobeLandCover: {image} has no mask {os.path.basename(expected)} beside it"
                        f"{f' (found {os.path.basename(other)})' if other else ' (a partial extraction?)'}; "
                        f"extract the official train/ folder, images and masks, under {data_root}")

    @staticmethod
    def is_val(image_id):
        """Whether an id is in ``'val'``: its number is a multiple of 5 (a CRC-32 for an id that is
        not a number). Decided by the id alone: the position in the sorted list moved ids between
        train and val when one file was missing or added, so a resumed run or a later evaluation
        scored images it had trained on."""
        number = int(image_id) if image_id.isdigit() else zlib.crc32(image_id.encode())
        return number % 5 == 0
