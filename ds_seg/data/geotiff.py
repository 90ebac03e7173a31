"""Fixed-size windows read from GeoTIFF (or any GDAL raster) image/label scene pairs.

Scenes are never read whole: every sample is one ``rasterio`` windowed read, so a 6000x6000
scene costs the same per sample as a 512x512 one (tiled files make that read touch only the
blocks under the window).

Two modes:

- ``'random'`` (training): sample ``index`` is a pure function of ``(seed, index)``: the scene,
  the position and the augmentations come from a generator seeded with ``(seed, index)``.
  The sampler decides which indices a rank reads, so the stream is reproducible whatever the
  number of workers or ranks, and resuming means asking for the same indices again.
- ``'grid'`` (evaluation): a stride = crop grid that covers every pixel of every scene; pixels
  already covered by an earlier window are ``ignore_index`` in the later one, so a confusion
  matrix accumulated over all windows counts each scene pixel exactly once.

Random scale (``random_scale=(0.5, 2.0)``) reads a window of ``crop / scale`` pixels and resizes
it to ``crop``, so every sample has the crop's shape. The factor is a function of the *global
micro-step*, which the dataset recovers from the index: :class:`~ds_seg.data.TrainSampler`
gives rank ``r`` at micro-step ``m`` the indices ``(m * world + r) * micro_batch + j``, so
``m = index // (world * micro_batch)``. ``build_train_loader`` tells the dataset ``world`` and
``micro_batch`` (:meth:`GeoTiffScenes.set_sampling_layout`); every rank then reads windows of
the same size at every step (equal read cost, equal shapes) without any communication, and a
resumed run draws the same factors.

Example::

    ds = GeoTiffScenes('scenes/*_rgb.tif', 'scenes/*_label.tif', crop_size=512,
                       classes=('road', 'building', 'tree'))
    sample = ds[0]

Samples are windows as read: ``image`` C x H x W in the file's dtype (uint8, uint16, ...;
float32 for types torch lacks), ``label`` H x W in the smallest integer type that holds the
classes and ``ignore_index`` (uint8 usually), ``nodata`` H x W bool, and in random mode with
augmentation ``geom`` (the flip/rotation code). Normalisation with the dataset's ``mean``/``std``,
zeroing nodata and the flips/rotations happen on the device after the copy:
:class:`~ds_seg.data.preprocess.BatchPreprocessor`, which the trainer applies to every batch
(a float32 image is 4x the bytes of a uint8 one through the loader and the host-to-device copy,
and normalising or flipping on the host costs a worker about as much as the read).
"""
import bisect
import contextlib
import glob
import hashlib
import inspect
import json
import math
import os
import random
import re
import warnings
from collections import Counter, OrderedDict

import numpy as np
import rasterio
import torch
from rasterio.enums import Resampling
from rasterio.errors import NotGeoreferencedWarning
from rasterio.transform import array_bounds
from rasterio.windows import Window

from ds_seg.config import ConfigError
from ds_seg.registry import DATASETS

from .preprocess import geom_code, host_dtype
from .raster import (FILL_MAGNITUDE, DataError, StackedRaster, alpha_as_data_refusal, alpha_bands, band_colours,
                     boundary_mask, colours_conflict, file_identity, gdal_message, gdal_path, is_remote, label_nodata,
                     nodata_mask, open_raster, opening_env, pin_versions, pixel_grid, pixel_size_m, pixel_type_refusal,
                     raster_env, read_error, read_label_band, read_window, refuse_lost_world_file, same_file_key,
                     same_pixels, same_value, unreadable, untagged_fill, user_cache_dir, uses_mask_band)
from .rare_class import class_index, class_probabilities
from .stac import stac_scenes
from .vector_labels import VectorLabels, is_vector
from .transforms import (Compose, PaletteDecoder, check_colours, check_random_scale, default_palette_tolerance,
                         resize, scale_for_micro_step)

STATS_FILE = 'stats.json'            # written by dataset generators/converters next to images
STATS_CACHE_FILE = '.ds_seg_stats.json'  # our own cache of statistics computed on first use
# Of how statistics are computed: 2 leaves out masked/alpha pixels and reads every scene (up to
# STATS_SCENES); 3 sums about the first read's mean (no cancellation where the mean dwarfs the
# spread); 5: an untagged fill of a signed integer type is refused, not averaged in. A cache of an
# earlier version is computed again.
STATS_VERSION = 5
STATS_SETS_KEPT = 8  # sets of scenes whose statistics a folder's cache holds (train, val, subsets...)
LABELS_CACHE_FILE = '.ds_seg_labels.json'  # per label file: value histogram of a full scan
LABELS_VERSION = 2  # 2: pixels a label's mask band hides are not counted
_MAX_OPEN_FILES = 16
_CHECK_PIXELS = 256                  # long side of the decimated label read at construction


def configure_gdal_for_worker(cache_mb=64):
    """Bound GDAL's per-process block cache and threads; call before opening any raster.

    GDAL's default cache is a share of RAM *per process*, multiplied by DataLoader workers x
    ranks; and its internal threads compete with the workers that already parallelise reads.
    GDAL reads these variables when it first needs them, so set them before the first read.
    """
    os.environ['GDAL_CACHEMAX'] = str(int(cache_mb))  # values below 100000 are megabytes
    os.environ['GDAL_NUM_THREADS'] = '1'
    _keep_large_buffers_in_heap()


_MALLOC_TUNED = []


def _keep_large_buffers_in_heap():
    """Serve the per-sample buffers (~1 MB each) from the heap instead of fresh mmaps.

    glibc mmaps every allocation above its threshold and unmaps it on free, so each sample's
    float image would start as untouched pages: measured, the page faults made converting a
    256x256x3 window to float32 cost 0.5 ms instead of 0.02 ms, doubling the time per sample.
    A 64 MB threshold keeps such buffers in the (reused) heap. Harmless where it fails.
    """
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED.append(True)
    try:
        import ctypes
        libc = ctypes.CDLL('libc.so.6')
        libc.mallopt(-3, 64 << 20)   # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD: do not hand freed heap back at once
    except (OSError, AttributeError):
        pass


def _dtype_range(dtype):
    info = np.iinfo(dtype) if np.dtype(dtype).kind in 'iu' else np.finfo(dtype)
    return info.min, info.max


def _read_cache(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(path, obj):
    """Best effort: a read-only dataset folder just recomputes next time."""
    tmp = f'{path}.{os.getpid()}.tmp'
    try:
        with open(tmp, 'w') as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def label_histogram(path, band_rows=1024):
    """``{file value: pixel count}`` over a whole single-band label raster, read in bands of
    rows so memory stays bounded on any scene size; pixels its mask band hides are not counted."""
    counts = {}
    with open_raster(path) as src:
        integer_16 = np.dtype(src.dtypes[0]) in (np.dtype(np.uint8), np.dtype(np.uint16))
        total = np.zeros(65536, np.int64) if integer_16 else None
        for y in range(0, src.height, band_rows):
            block, hidden = read_label_band(src, Window(0, y, src.width, min(band_rows, src.height - y)))
            if hidden is not None:
                block = block[~hidden]
            if not block.size:  # rows the mask band hides whole (an unlabelled margin)
                continue
            if integer_16:
                total[:int(block.max()) + 1] += np.bincount(block.ravel())
            else:
                values, n = np.unique(block, return_counts=True)
                for v, c in zip(values.tolist(), n.tolist()):
                    counts[v] = counts.get(v, 0) + c
    if total is not None:
        counts = {int(v): int(total[v]) for v in np.flatnonzero(total)}
    return counts


def cached_label_histograms(label_paths):
    """``[{file value: pixel count}]`` of every label file (None for URLs: a full scan would
    download them whole), from one full read each (:func:`label_histogram`), cached by file
    identity in ``.ds_seg_labels.json`` next to the first, so later runs pay nothing. Shared by
    training's label check and evaluation's."""
    if not label_paths:
        return []
    cache_path = os.path.join(os.path.dirname(os.path.abspath(label_paths[0])), LABELS_CACHE_FILE)
    cache = _read_cache(cache_path)
    changed, out = False, []
    for path in label_paths:
        if is_remote(path):
            out.append(None)
            continue
        ident = file_identity(path)  # None: a VRT of sources whose version is unknown, not cached
        entry = cache.get(ident['path']) if ident else None
        if entry is None or entry.get('identity') != ident or entry.get('version') != LABELS_VERSION:
            try:
                histogram = label_histogram(path)
            except rasterio.errors.RasterioError as e:
                raise DataError(unreadable(path, e)) from e
            entry = {'identity': ident, 'version': LABELS_VERSION,
                     'values': {str(v): n for v, n in histogram.items()}}
            if ident:
                cache[ident['path']] = entry
                changed = True
        out.append({float(v): n for v, n in entry['values'].items()})
    if changed:
        _write_cache(cache_path, cache)
    return out


def expand_paths(spec, what, folders=False):
    """A path, a glob or a list of either -> list of paths (each glob sorted); URLs as given. With
    ``folders``, a folder -> the GeoTIFFs directly inside it (sorted), as predict.py reads one."""
    from ..inputs import FOLDER_SUFFIXES, folder_rasters
    if isinstance(spec, (str, os.PathLike)):
        spec = [spec]
    paths = []
    for position, item in enumerate(spec):
        item = os.fspath(item)
        if not item.strip():   # a trailing comma ('a.tif,b.tif,'): was "ds_seg: error: : no such file"
            raise DataError(f"{what}: entry {position + 1} of {len(spec)} is an empty path (a stray comma?); "
                            "remove it")
        if not is_remote(item):
            item = os.path.expanduser(item)  # '~/data/*.tif' in a config: no shell expands it
        # (A vector dataset may be a folder: a partitioned .parquet.)
        if folders and not is_remote(item) and os.path.isdir(item) and not is_vector(item):
            found = folder_rasters(item, what)
            if not found:
                raise DataError(f"{what}: folder {item} holds no GeoTIFF or JPEG 2000 raster "
                                f"({', '.join(FOLDER_SUFFIXES)}); give other rasters by name or glob")
            paths.extend(found)
        else:
            paths.extend(_glob_matches(item, f"{what}: the pattern {item!r} matches no file") or [item])
    if not paths:
        raise DataError(f"{what}: no files given")
    return paths


def _glob_matches(item, none_said):
    """The sorted matches of ``item`` where it is a local glob, else None (a file that exists is
    that file, '[' in its name included: as a glob, 'tile[1].tif' matched tile1.tif, another scene;
    '?' in a URL is a query). A glob that matches nothing raises ``none_said``."""
    if not glob.has_magic(item) or is_remote(item) or os.path.exists(item):
        return None
    matches = sorted(glob.glob(item))
    if not matches:
        raise DataError(none_said)
    return matches


def _stems(paths):
    """File names without folder, extension or URL query."""
    return [os.path.splitext(os.path.basename(os.fspath(p).split('?')[0]))[0] for p in paths]


def _name_keys(paths):
    """The part of each file name that varies along the list: the stems (no folder, extension or
    URL query) without what they all begin and end with. ``x1.tif, x10.tif`` -> ``1, 10``;
    ``x10_mask.tif, x1_mask.tif`` -> ``10, 1``."""
    rests = _name_rests(paths)
    suffix = os.path.commonprefix([r[::-1] for r in rests])[::-1]
    return [r[:len(r) - len(suffix)] for r in rests]


def _name_rests(paths):
    """The stems without what they all begin with: ``x1_mask, x10_mask, x2_lab`` -> ``1_mask,
    10_mask, 2_lab``."""
    stems = _stems(paths)
    prefix = os.path.commonprefix(stems)
    return [s[len(prefix):] for s in stems]


def _char_class(c):
    return 'digit' if c.isdigit() else 'letter' if c.isalpha() else None


def _names_key(text, key):
    """``key`` occurs in ``text`` as a whole token: not inside a longer run of digits or of
    letters (``1`` names ``1_mask`` and ``a1b``, not ``10_mask``)."""
    start = text.find(key) if key else -1
    while start >= 0:
        end = start + len(key)
        before, after = text[start - 1:start], text[end:end + 1]
        if all(not c or _char_class(c) is None or _char_class(c) != _char_class(k)
               for c, k in ((before, key[0]), (after, key[-1]))):
            return True
        start = text.find(key, start + 1)
    return False


def pair_by_name(images, labels):
    """``labels`` in the order of ``images``, matched by name where the names say how.

    Lists are paired by position, but a sorted glob orders ``x1, x10, x2`` and
    ``x10_mask, x1_mask, x2_mask`` differently: when the varying parts of the names
    (:func:`_name_keys`) are the same set on both sides, labels are reordered to match. Else each
    image's varying part is looked for, as a whole token, in the label names (less what they all
    begin with): ``x2_lab`` is x2's label beside ``x1_mask, x10_mask``. One label per image, each
    once: reordered to match; some matched and not all, or an image matching several labels: a
    label is missing, extra or ambiguous, refused naming one of each. Names that share nothing
    (``img_001`` with ``gt_a``) keep the position pairing."""
    if len(images) < 2 or len(set(labels)) < 2:  # one scene, or one vector file for all
        return labels
    image_keys, label_keys = _name_keys(images), _name_keys(labels)
    if len(set(image_keys)) < len(images) or len(set(label_keys)) < len(labels):
        # The same name in several folders (img/x/s.tif, img/y/s.tif): the folders under each
        # list's common one say it where both lists have the same ones; else by position.
        image_keys, label_keys = _folder_keys(images), _folder_keys(labels)
        if image_keys and label_keys and len(set(image_keys)) == len(images) and set(image_keys) == set(label_keys):
            by_key = dict(zip(label_keys, labels))
            return [by_key[k] for k in image_keys]
        return labels
    if set(image_keys) == set(label_keys):
        by_key = dict(zip(label_keys, labels))
        return [by_key[k] for k in image_keys]
    rests = _name_rests(labels)
    found = [[j for j, rest in enumerate(rests) if _names_key(rest, key)] for key in image_keys]
    named = {j for js in found for j in js}
    if not named:
        return labels
    if len(images) == len(labels) and all(len(js) == 1 for js in found) and len(named) == len(labels):
        return [labels[js[0]] for js in found]
    unmatched_images = [i for i, js in zip(images, found) if not js]
    unmatched_labels = [lbl for j, lbl in enumerate(labels) if j not in named]
    ambiguous = [(i, [labels[j] for j in js]) for i, js in zip(images, found) if len(js) > 1]
    if ambiguous:  # (which explains an image left without one)
        image, several = ambiguous[0]
        raise DataError(f"images and labels are named alike but do not match one to one: image {image!r} is "
                        f"named in labels {several[0]!r} and {several[1]!r}; give one label per image, named alike")
    raise DataError(f"images and labels are named alike but do not match one to one: image "
                    f"{unmatched_images[0]!r} has no label named like it"
                    + (f", and label {unmatched_labels[0]!r} no image" if unmatched_labels else '')
                    + f" ({len(unmatched_images)} of {len(images)} unmatched); give one label per image")


def _folder_keys(paths):
    """Each local path below the list's common folder, without its suffix (``x/s`` for
    ``img/x/s.tif``); None where a path is remote or not a plain name."""
    if not all(isinstance(p, (str, os.PathLike)) and not is_remote(str(p)) for p in paths):
        return None
    full = [os.path.abspath(os.fspath(p)) for p in paths]
    root = os.path.commonpath(full)
    return [os.path.splitext(os.path.relpath(p, root))[0] for p in full]


_NAME_DATE = re.compile(r'(?<!\d)((?:19|20)\d\d)[-_]?(0[1-9]|1[0-2])(?:[-_]?(0[1-9]|[12]\d|3[01]))?(?!\d)')


def _name_dates(path):
    """Every date in a file name, in the order they appear, as sortable ``(year, month, day)``
    (``LC09_L2SP_200011_20220510_20220512`` gives its path/row read as 2000-11, the acquisition,
    the processing date: the same first one for a scene's dates, then the acquisition decides)."""
    return tuple((m[1], m[2], m[3] or '00') for m in _NAME_DATE.finditer(_stems([path])[0]))


def dates_out_of_name_order(dates):
    """A note where the file names of a scene's dates carry dates (2021-05, 20210815) in another
    order than given: nothing sorts them, and a misordered scene fed concat/diff pooling its dates
    swapped, without a word. None where they are in order or the names carry no dates."""
    for files in dates:
        when = [_name_dates(f) for f in files]
        if len(files) < 2 or not all(when):
            continue
        if when != sorted(when):
            names = ', '.join(os.path.basename(f) for f in files)
            return (f"the dates of a scene are given as {names}, which their names place in another order; the "
                    "order given is the order used (nothing sorts them): check that every scene lists its dates "
                    "in the same order")
    return None


def _expand_dates(dates):
    """A scene's dates with each glob among them replaced by its matches in time order: by the
    dates in their names where every name carries one (``[['b_2021-*.tif']]`` is scene b at each of
    its dates), else by name. (The glob was taken as a file name, or its first date expanded into
    scenes of one date each.) Matches whose names do not sort in time are refused
    (:func:`_unsortable_dates`). Sorted by name, Landsat 8 and 9 scenes (LC08_..., LC09_...) and
    Sentinel-2A and 2B products came in order of satellite, not of date, without a word."""
    out = []
    for path in dates:
        matches = _glob_matches(path, f"images: the pattern {path!r} among a scene's dates matches no file")
        refusal = matches and _unsortable_dates(path, matches)
        if refusal:
            raise DataError(refusal)
        if matches and all(_name_dates(m) for m in matches):
            matches = sorted(matches, key=lambda m: (_name_dates(m), m))
        out.extend(matches or [path])
    return out


def _unsortable_dates(pattern, matches):
    """The line for a glob among a scene's dates whose matches' names do not sort in time, or
    None. Names sort in time where each carries a zero-padded date (2021-05-01, 20210501) or
    where the parts in which they differ are numbers of one width (t0/t1, 2021135); month words
    (may, aug), unpadded dates (2021-5-1, 2021-10-1), or t1/t10/t2 sorted by name came out of time
    order, without a word."""
    if len(matches) < 2 or all(_NAME_DATE.search(stem) for stem in _stems(matches)):
        return None
    varying = _name_keys(matches)
    if all(v.isdigit() for v in varying) and len({len(v) for v in varying}) == 1:
        return None
    names = [os.path.basename(m) for m in matches]
    return (f"images: the pattern {pattern!r} among a scene's dates matches {', '.join(names)}, which sorted by "
            "name need not be in time order (only zero-padded dates, 2021-05-01 or 20210501, and numbers of one "
            "width, t01, sort in time); list the scene's dates in time order instead of the pattern")


def _scene_keys(paths):
    """{path: what two spellings of one file share}: :func:`same_file_key`, and for http(s) URLs
    that differ only in their query (signed URLs: a new signature each time one is made) the
    address without it and the ETag the server gives now, where it gives one (asked only of
    addresses given more than once: a query may also name the file, ``download?id=7``)."""
    from .raster import _version_precondition
    keys = {p: same_file_key(p) for p in paths}
    bases = {}
    for p in paths:
        if isinstance(p, str) and p.startswith(('http://', 'https://')) and '?' in p:
            bases.setdefault(p.partition('?')[0], set()).add(p)
    for base, urls in bases.items():
        if len(urls) + sum(u == base for u in paths) < 2:
            continue
        for url in urls:
            version = _version_precondition(url)
            if version and version.startswith('If-Match: '):
                keys[url] = (base, version)
        if base in keys:   # the same address without a query
            version = _version_precondition(base)
            if version and version.startswith('If-Match: '):
                keys[base] = (base, version)
    return keys


COPY_SAMPLE_BYTES = 4096   # read at each end of a file whose size another's shares, before comparing all


def _key_copies_alike(paths, keys):
    """Give a local file that is a byte-for-byte copy of another (``cp a.tif a_copy.tif``: another
    inode) the other's key in ``keys``: a validation scene copied under a second name counted twice
    in every metric, without a word. Only files of one size are compared: first their two ends (a small read, as
    opening the raster is), then, where those agree, every byte."""
    import filecmp
    by_size = {}
    for p in dict.fromkeys(paths):
        if isinstance(p, (str, os.PathLike)) and not is_remote(p) and isinstance(keys[p], tuple) and os.path.isfile(p):
            by_size.setdefault(os.path.getsize(p), []).append(p)
    for size, group in by_size.items():
        if len({keys[p] for p in group}) < 2:
            continue
        by_ends = {}
        for p in group:
            with open(p, 'rb') as f:
                head = f.read(COPY_SAMPLE_BYTES)
                f.seek(max(0, size - COPY_SAMPLE_BYTES))
                by_ends.setdefault(hashlib.sha256(head + f.read()).digest(), []).append(p)
        for alike in by_ends.values():
            originals = []
            for p in alike:
                first = next((o for o in originals if keys[o] == keys[p] or filecmp.cmp(o, p, shallow=False)), None)
                if first is None:
                    originals.append(p)
                else:
                    keys[p] = keys[first]


def content_keys(paths):
    """{path: key}, one key for one file however it is named (links, two spellings, signed URLs)
    and for byte-for-byte copies of it (:func:`_key_copies_alike`)."""
    keys = _scene_keys(paths)
    _key_copies_alike(paths, keys)
    return keys


def refuse_repeated_scenes(images, what, labels=None, dates=None):
    """Evaluation scenes each once: overlapping globs (``'val/*.tif' 'val/a*.tif'``) or one file
    under two spellings would count its pixels twice in every metric. With ``labels``, a scene is
    an image with its label (one image under two label files is two scenes); with ``dates``, its
    every date (two time series sharing a baseline date are two scenes). A scene whose files are
    byte-for-byte copies of another's (other names, other inodes) is not refused: a benchmark may
    hold a tile twice, and its metric counts it twice; the line for it is returned, to be said."""
    repeated = repeated_scene(images, labels, dates)
    if repeated:
        image, also = repeated
        raise DataError(f"{what}: {image} is given twice{also}, by overlapping globs or paths; its pixels "
                        f"would count twice in every metric. Give each scene once")
    copied = repeated_scene(images, labels, dates, copies=True)
    if copied:
        return (f"{what}: {copied[0]} is given twice{copied[1]}: its pixels count twice in every metric; give it "
                "once, unless the set holds it twice on purpose")
    return None


def repeated_scene(images, labels=None, dates=None, copies=False):
    """``(image, ' (also as <first>)')`` for the first scene given twice (see
    :func:`refuse_repeated_scenes`), the second part empty where both spellings are one; else None.
    ``copies``: a scene whose files are byte-for-byte copies of another's counts as given twice."""
    every = [f for i, image in enumerate(images) for f in (dates[i] if dates is not None else [image])]
    every += list(labels or [])
    spelling = _scene_keys(every)       # one file however it is named (links, signed URLs)
    key_of = dict(spelling)
    if copies:
        _key_copies_alike(every, key_of)

    def scene_key(i, keys):
        files = dates[i] if dates is not None else [images[i]]
        return tuple(keys[f] for f in files), keys[labels[i]] if labels is not None else None
    seen = {}
    for i, image in enumerate(images):
        key = scene_key(i, key_of)
        if key in seen:
            first = seen[key]
            if images[first] == image:
                return image, ''
            if scene_key(first, spelling) == scene_key(i, spelling):
                return image, f' (also as {images[first]})'
            return image, f' (a copy of {images[first]}: the same bytes under another name)'
        seen[key] = i
    return None


def grid_starts(length, crop):
    """Window starts with stride ``crop`` covering ``[0, length)``; the last one flush with the end."""
    if length <= crop:
        return [0]
    return list(range(0, length - crop, crop)) + [length - crop]


def inspect_pair(image, label, palette=None):
    """Open an image and its label and check they can be paired (size, geotransform, CRS, label
    bands); returns what the dataset needs to know of the scene. Shared with evaluation."""
    img, lbl = open_raster(image), open_raster(label)
    with img, lbl:
        if same_file_key(image) == same_file_key(label):  # images and labels given the same glob
            raise DataError(f"label {label} is the image itself; point labels at the ground-truth rasters")
        refusal = pixel_type_refusal(image, img.dtypes) or pixel_type_refusal(label, lbl.dtypes)
        if refusal:
            raise DataError(refusal)
        if (img.width, img.height) != (lbl.width, lbl.height):
            raise DataError(f"image {image} is {img.width}x{img.height} but label {label} is "
                            f"{lbl.width}x{lbl.height}; they must have the same size")
        # A raster without any georeference (PNG/JPG patches, some benchmark label TIFFs)
        # has the identity transform: it can only be aligned pixel for pixel, as checked
        # above. Two georeferenced rasters (by geotransform or by ground control points) must
        # also agree on where those pixels are.
        (img_transform, img_crs, img_residual), (lbl_transform, lbl_crs, lbl_residual) = pixel_grid(img), pixel_grid(lbl)
        georeferenced = all(crs is not None or not transform.is_identity
                            for transform, crs in ((img_transform, img_crs), (lbl_transform, lbl_crs)))
        # An affine fit to ground control points is off by as much as their residuals: the
        # tolerance grows by those (a half-pixel shift of exactly fitting points is refused).
        fitted = [r for r in (img_residual, lbl_residual) if r is not None]
        tol_px = 0.01 + sum(fitted)
        if georeferenced and not same_pixels(img_transform, lbl_transform, img.width, img.height, tol_px):
            raise DataError(f"image {image} and label {label} have different geotransforms "
                            f"({tuple(img_transform)[:6]} vs {tuple(lbl_transform)[:6]}"
                            f"{f'; from ground control points, largest residual {max(fitted):.2f} px' if fitted else ''}); "
                            f"they must cover the same pixels")
        if img_crs and lbl_crs and img_crs != lbl_crs:
            raise DataError(f"image {image} ({img_crs}) and label {label} ({lbl_crs}) have "
                            f"different CRS; reproject one of them")
        if palette is None and lbl.count != 1:
            raise DataError(f"label {label} has {lbl.count} bands; expected one band of class "
                            f"indices (image {image}); colour-coded labels need the dataset's `palette` "
                            f"(evaluate.py: --config with data.val.palette)")
        if palette is not None and lbl.count < 3:
            # A paletted file (a colour table, as GDAL writes class maps) shows colours but holds indices.
            indexed = lbl.count == 1 and lbl.colorinterp[0] == rasterio.enums.ColorInterp.palette
            raise DataError(f"label {label} has {lbl.count} band(s) but `palette` expects RGB "
                            f"colour-coded labels (image {image})" + (
                                "; this one is a paletted file: its pixels are class indices already, shown in "
                                "colour by its colour table, so leave `palette` out" if indexed else ''))
        if palette is not None and _same_corner(img, lbl):
            raise DataError(f"label {label} holds the same pixels as its image {image}: a copy of the image, "
                            f"not its labels; point the label at the ground truth")
        return dict(image_facts(image, img), label=label, label_nodata=lbl.nodata)


def image_facts(image, img):
    """What a dataset keeps of a scene's image file (``img``: it opened)."""
    return dict(image=image, width=img.width, height=img.height, count=img.count, nodata=img.nodata,
                masked=uses_mask_band(img), alpha=alpha_bands(img), dtype=img.dtypes[0],
                floating=np.dtype(img.dtypes[0]).kind == 'f', colorinterp=[c.name for c in img.colorinterp],
                encoding=[[float(a), float(b)] for a, b in zip(img.scales, img.offsets)],
                pixel_size_m=pixel_size_m(img))


def _same_corner(img, lbl, size=64):
    """True when an image and its label hold the same, non-constant pixels in their top-left
    corner (the rows any format decodes first): a copy of the image taken as its colour label,
    which a decoding with a wide tolerance turns into classes without a word. (Asked of colour
    labels only: a one-band image of class values is a test's way to see alignment.)"""
    if img.count != lbl.count or img.dtypes != lbl.dtypes:
        return False
    window = Window(0, 0, min(size, img.width), min(size, img.height))
    corner = img.read(window=window)
    return bool(np.ptp(corner) > 0) and np.array_equal(corner, lbl.read(window=window))


def label_nodata_message(label, value, class_index, class_name, ignore_index, colour=None):
    """The one line for a label file whose nodata tag is also a class (see GeoTiffScenes);
    ``colour``: the palette colour it is, for colour-coded labels."""
    what = f'and {colour} is the palette colour of' if colour else 'which is also'
    return (f"{label}: its nodata tag is {value:.10g}, {what} class {class_index} ({class_name!r}); "
            f"ds_seg learns and scores pixels by value, GDAL tools (overviews, warps, QGIS) treat them as empty. "
            f"If {value:.10g} is that class, remove the tag (gdal_edit.py -unsetnodata {label}); if those pixels "
            f"hold no label, rewrite them as ignore_index {ignore_index} (or map the value with `label_map`)")


def _ratio(name, value, low_open):
    """None or a share in (0, 1] (``low_open``) or [0, 1], as a float; else a ValueError."""
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (0 < value if low_open else 0 <= value) and value <= 1):
        raise ValueError(f"{name} must be None or a share in {'(0, 1]' if low_open else '[0, 1]'} "
                         f"(e.g. 0.75, not 75), got {value!r}")
    return float(value)


def _whole_number(name, value, low):
    """``value`` as an int >= ``low``; a bool, a fraction or a string is a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    return int(value)


def _equals_default(value, default):
    """``value`` equals ``default`` (a list given for a tuple default, (0.5, 2.0) for [0.5, 2.0])."""
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) == list(default)
    try:
        return bool(value == default)
    except Exception:  # an array or an object without equality: given, so not the default
        return False


def _listed(values, shown=6):
    """'class 3', 'classes 3, 4, 5' or 'classes 3, 4, 5, 6, 7, 8 and 4 more'."""
    head = ', '.join(map(str, values[:shown]))
    more = f' and {len(values) - shown} more' if len(values) > shown else ''
    return f"class{'es' if len(values) > 1 else ''} {head}{more}"


def effective_label_decoding(decoding, num_classes):
    """A dataset's ``label_decoding`` (label_map, reduce_zero_label, palette) less what changes
    nothing: label_map entries that map a class index to itself (all the classes listed in their
    own order, as SyntheticAerial's ``classes`` gives them). None where nothing is left: labels read
    as class indices. Compared on resume and by evaluate.py, where an identity label_map was
    refused as a change of decoding."""
    decoding = dict(decoding or {})
    if not decoding.get('reduce_zero_label') and decoding.get('label_map'):
        kept = {k: v for k, v in decoding['label_map'].items()
                if not (str(k).strip().isdigit() and int(k) == int(v) < (num_classes or 0))}
        decoding['label_map'] = kept or None
    decoding = {k: v for k, v in decoding.items() if v is not None}
    return decoding or None


def check_class_names(classes, what='classes'):
    """``classes``: a count >= 1 or a sequence of distinct, non-empty names in class-index order
    -> the tuple of names (``class_0``... for a count). ``what`` names the setting in the refusal."""
    if isinstance(classes, str):
        # ('building') without its comma is a string: tuple() would make one class per letter.
        raise ValueError(f"{what}={classes!r} is a string, which would be {len(classes)} one-letter classes; "
                         f"give a tuple of names (one name needs a trailing comma: ({classes!r},)) or a count")
    if isinstance(classes, dict):
        # {'bg': 0, 'road': 2, 'building': 1} was read as its names in written order: file value 1
        # trained and scored as 'road'.
        try:
            order = sorted(classes.items(), key=lambda kv: int(kv[1]))
        except (TypeError, ValueError):
            order = list(classes.items())
        names = tuple(k for k, _ in order)
        lut = {v: i for i, (_, v) in enumerate(order)}
        raise ValueError(f"{what} is a mapping {classes!r}; give the names in class-index order (class 0 first), "
                         f"e.g. classes={names!r}, and map file values to those indices with "
                         f"label_map={lut!r} where they differ")
    if isinstance(classes, (int, np.integer)) and not isinstance(classes, bool):
        if classes < 1:
            raise ValueError(f"{what} must be a tuple of names or a class count >= 1, got {classes!r}")
        return tuple(f'class_{i}' for i in range(int(classes)))
    if isinstance(classes, (bool, float)) or not isinstance(classes, (list, tuple)) or not classes:
        # 3.0 -> "'float' object is not iterable"; [] -> "class index 0..-1"
        raise ValueError(f"{what} must be a tuple of names or a class count >= 1, got {classes!r}")
    for i, name in enumerate(classes):
        if not isinstance(name, str):
            # YAML 1.1 reads on/off/yes/no as booleans: config.json kept True, eval.jsonl 'true'.
            why = (" (YAML reads on/off/yes/no/true/false as booleans: quote the name, 'on')"
                   if isinstance(name, bool) else '')
            raise ValueError(f"{what}[{i}] is {name!r}, a {type(name).__name__}, not a name{why}; class names "
                             "are text")
        if not name.strip():
            raise ValueError(f"{what}[{i}] is {name!r}, an empty name; give every class a name")
    classes = tuple(classes)
    twice = sorted({c for c in classes if classes.count(c) > 1})
    if twice:  # eval.jsonl's per_class is keyed by name: one would overwrite the other
        raise ValueError(f"{what} gives {', '.join(map(repr, twice))} more than once; "
                         "give each class its own name")
    return classes


@DATASETS.register_module()
class GeoTiffScenes(torch.utils.data.Dataset):
    """Crops of ``crop_size`` from image scenes paired with a label raster each.

    Args:
        images, labels: paths, URLs or glob patterns (globs are sorted); paired by position, or by
            name where the names differ only in a common prefix/suffix (see :func:`pair_by_name`).
            ``labels`` may be a vector file (``.gpkg``, ``.geojson``, ``.fgb``, ``.shp``), one
            for all images or one each: rasterised per window in the image's grid.
        stac, stac_bands, stac_label: instead of images/labels, a STAC Item or ItemCollection
            (JSON file or URL), the image asset name(s) (one asset, or several stacked in order,
            every band of each) and the label asset name; see :mod:`ds_seg.data.stac`.
        label_field: vector labels: the attribute with the class (index, or name in
            ``classes``); None: every feature is class 1. ``label_fill``: class of pixels
            under no feature (default 0; ``ignore_index`` to learn only from labelled areas).
            ``label_layer``: the layer of a file with several (a GeoPackage), else refused.
        crop_size: int or (height, width) of every sample; smaller scenes are padded.
        mode: ``'random'`` or ``'grid'``; None: random for split 'train', grid otherwise.
        classes: tuple of class names or a class count; None: from ``stats.json`` next to the
            first image, or ``len(palette)``, else ``max label + 1`` from a scan of the labels.
        mean, std: per selected band, in the file's units; None: ``stats.json`` next to the
            first image, else computed once from a decimated read and cached.
        bands: 1-based band indices to read (GDAL convention); None: all bands.
        augment: joint flips and 90-degree rotations in random mode (drawn here, applied on
            the device: ``sample['geom']``); None: on for 'random'.
        label_map: ``{file value: class index or ignore_index}`` applied before anything else.
        reduce_zero_label: 0 becomes ignore and ``k`` becomes ``k - 1`` (LoveDA, mmseg style).
        palette: RGB colour per class when labels are colour-coded 3-band rasters;
            ``palette_ignore``: colours that mean ignore (e.g. black eroded boundaries);
            ``palette_tolerance``: L-inf distance still matched (JPEG-like noise), default
            half the closest two colours' distance, at most 60. Unmatched colours are ignored
            in training; more than ``palette_max_unmatched`` of them in a checked file stops.
        transforms: list of ``TRANSFORMS`` dicts applied jointly after cropping (random mode).
        random_scale: ``(low, high)``: per-step factor (see the module docstring).
        cat_max_ratio: redraw a random window (up to ``max_retries`` times) until it holds 2+
            classes, none covering this share of its labelled pixels (mmseg RandomCrop rule).
        max_nodata_ratio: redraw a random window while more than this share is nodata/padding.
        boundary_ignore: pixels within this many pixels (a disk) of a class boundary become
            ignore: ISPRS-style eroded labels computed on the fly, the pixels ``evaluate --erode``
            leaves out whatever the window (a boundary just outside it counts).
        sampling: ``'uniform'`` (positions uniform over the scenes' area) or ``'rare_class'``
            (random mode: a class drawn with ``p ∝ exp((1 - f_c) / rare_class_temperature)``,
            then a window holding one of its pixels; see :mod:`ds_seg.data.rare_class`).
        check_labels: how many label files (evenly spaced) are checked at construction with a
            decimated read, plus a one-block read of the image; None: all; 0: none.

    Nodata (the image's nodata value in every band, a GDAL mask/alpha, or any non-finite float)
    becomes ``ignore_index`` in the label and is marked in ``sample['nodata']``, which makes it
    0 in the normalised input; so does padding.

    Example::

        ds = GeoTiffScenes(['a.tif'], ['a_label.tif'], crop_size=256, classes=6, mode='grid')
        buildings = GeoTiffScenes('tiles/*.tif', 'buildings.gpkg', label_field='class', classes=2)
        remote = GeoTiffScenes(['https://host/scene_cog.tif'], ['s3://bucket/scene_label.tif'])
        assert ds[0]['image'].shape == (ds.in_channels, 256, 256)
        train = GeoTiffScenes('scenes/*_rgbn.tif', 'scenes/*_cls.tif', classes=('a', 'b'),
                              bands=[1, 2, 3, 4], random_scale=(0.5, 2.0), cat_max_ratio=0.75,
                              transforms=[dict(type='PhotoMetricDistortion')])
    """

    def __init__(self, images=None, labels=None, crop_size=256, mode=None, split='train', classes=None,
                 mean=None, std=None, bands=None, ignore_index=255, seed=0, augment=None,
                 label_map=None, reduce_zero_label=False, palette=None, palette_ignore=(),
                 palette_tolerance=None, palette_max_unmatched=0.02, transforms=None,
                 random_scale=None, cat_max_ratio=None, max_nodata_ratio=None, max_retries=10,
                 boundary_ignore=0, check_labels=16, label_field=None, label_layer=None, label_fill=0,
                 sampling='uniform', rare_class_temperature=0.01, stac=None, stac_bands=None,
                 stac_label='label'):
        configure_gdal_for_worker()
        # Lines for the start of training about the data as found (unused options, copies...); a
        # benchmark subclass may have set its own (a partial download) before calling this.
        self.notes = list(getattr(self, 'notes', ()))
        if stac is not None:
            if images is not None or labels is not None:
                raise ConfigError("give either `stac` or `images`/`labels`, not both (over a config that "
                                  "sets images: --cfg-options data.train.images=None data.train.labels=None)")
            if stac_bands is None:
                raise ConfigError(f"stac={stac!r}: name the image asset(s) with `stac_bands` "
                                  f"(one multi-band asset, or one asset per band)")
            images, labels = stac_scenes(stac, stac_bands, stac_label)
        if images is None or labels is None:
            raise ConfigError("GeoTiffScenes needs `images` and `labels` (or `stac`)")
        pin_versions([images, labels])  # remote files: read at the version served now, for the whole run
        # A scene given as a list of paths is a time series: co-registered dates, stacked
        # date-major (T x C bands read as T*C channels; see StackedRaster).
        dates = None
        if not isinstance(images, (str, os.PathLike)) and any(isinstance(i, (list, tuple)) for i in images):
            dates = [_expand_dates([p if is_remote(p) else os.path.expanduser(p)  # '~/ts/a_may.tif': no shell does
                                    for p in map(os.fspath, [i] if isinstance(i, (str, os.PathLike)) else i)])
                     for i in images]
            if len({len(d) for d in dates}) != 1:
                # Name a scene of the rarer count: the one missing (or with an extra) date.
                counts = [len(d) for d in dates]
                odd = min(set(counts), key=lambda n: (counts.count(n), n))
                first = next(d for d in dates if len(d) != odd)
                raise DataError(f"images: every scene needs the same number of dates, got {sorted(set(counts))}: "
                                f"scene {counts.index(odd)} has {odd} ({dates[counts.index(odd)]}), scene "
                                f"{dates.index(first)} has {len(first)} ({first})")
            images = [d[0] for d in dates]
            unordered = dates_out_of_name_order(dates)
            if unordered:
                self.notes = [*self.notes, unordered]
        nested = (None if isinstance(labels, (str, os.PathLike)) else
                  next((x for x in labels if isinstance(x, (list, tuple))), None))
        if nested is not None:  # "expected str, bytes or os.PathLike object, not list"
            raise DataError(f"labels: {list(nested)!r} is a list; a scene has one label file, which all its dates "
                            "share: give labels as one file per scene (dates are lists of images only)")
        images = expand_paths(images, 'images', folders=True)
        labels = expand_paths(labels, 'labels', folders=True)
        if len(labels) == 1 and is_vector(labels[0]):
            labels = labels * len(images)  # one vector layer labels every image
        if len(images) != len(labels):
            from ..inputs import written_by_predict
            # predict.py --output into the images folder: its class maps and probabilities read
            # as images, and the line told the user to fix the labels.
            outputs = [os.path.basename(p) for p in images if isinstance(p, str) and written_by_predict(p)]
            said = (f"; {len(outputs)} of the images are outputs predict.py wrote there ({', '.join(outputs[:3])}"
                    f"{', ...' if len(outputs) > 3 else ''}): move them out of the images' folder" if outputs else '')
            raise DataError(f"{len(images)} images but {len(labels)} labels: they are paired by "
                            f"position, give one label file per image (first image {images[0]!r}){said}")
        labels = pair_by_name(images, labels)
        if mode is None:
            mode = 'random' if split == 'train' else 'grid'
        if mode not in ('random', 'grid'):
            raise ValueError(f"mode must be 'random' or 'grid', got {mode!r}")
        if isinstance(crop_size, int):
            crop_size = (crop_size, crop_size)
        self.crop_h, self.crop_w = (int(c) for c in crop_size)
        if mode == 'grid':  # evaluation windows: a scene twice would weigh twice in the metrics
            copied = refuse_repeated_scenes(images, 'images', labels, dates)
            if copied:
                self.notes = [*self.notes, copied]
        else:   # training: drawn twice as often, without a word (a link beside it, overlapping globs, a copy)
            repeated = repeated_scene(images, labels, dates, copies=True)
            if repeated:
                self.notes = [*self.notes, (
                    f"images: {repeated[0]} is given twice{repeated[1]}: its windows are drawn twice as often as "
                    "another scene's; give it once, unless that weighting is meant")]
        self.mode = mode
        self.split = split
        self.ignore_index = int(ignore_index)
        self.seed = int(seed)
        # Evaluation windows are never augmented or rescaled: their labels are compared pixel
        # for pixel with the scene.
        if augment is not None and not isinstance(augment, bool):  # augment='false' was truthy: on
            raise ValueError(f"augment must be True, False or None (on in random mode), got {augment!r}")
        self.augment = mode == 'random' and (augment is None or augment)
        self.transforms = Compose(transforms) if mode == 'random' else Compose(None)
        self.random_scale = check_random_scale(random_scale) if mode == 'random' else None
        # Shares, not percentages: cat_max_ratio=75 or max_nodata_ratio=50 would never reject a
        # window (no effect at all), a ratio <= 0 every window (each sample read max_retries + 1 times).
        self.cat_max_ratio = _ratio('cat_max_ratio', cat_max_ratio, low_open=True)
        self.max_nodata_ratio = _ratio('max_nodata_ratio', max_nodata_ratio, low_open=False)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        self.max_retries = max_retries
        # int() truncated: boundary_ignore=1.7 eroded 1 pixel, label_fill=1.9 filled class 1.
        self.boundary_ignore = _whole_number('boundary_ignore', boundary_ignore, low=0)
        self.palette = None if palette is None else check_colours(palette, 'palette')
        self._world_size, self._micro_batch = 1, 1

        self._scenes = [self._inspect(img, lbl) for img, lbl in zip(images, labels)]
        self.num_dates = 1 if dates is None else len(dates[0])
        self.dates_listed = dates is not None   # each scene given as its list of dates (one may be all)
        if dates is not None:
            for s, d in zip(self._scenes, dates):
                StackedRaster.check(d)
                s['dates'] = tuple(d)
        self.label_field, self.label_layer = label_field, label_layer
        self.label_fill = _whole_number('label_fill', label_fill, low=0)
        self._vectors = self._load_vectors(classes)
        for v in {v.path: v for v in self._vectors.values()}.values():  # a file read once per image CRS
            if getattr(v, 'without_geometry', 0):
                self.notes = [*self.notes, (
                    f"labels {v.path}: {v.without_geometry} feature(s) have no geometry (null or empty) and label "
                    "no pixel; give them their shapes, or drop them to silence this")]
        count = self._scenes[0]['count']
        for s in self._scenes:
            if s['count'] != count:
                raise DataError(f"{s['image']}: {s['count']} bands, but {images[0]} has {count}; "
                                f"all scenes of a dataset need the same bands")
        self.num_file_bands = count
        if bands is not None and (not isinstance(bands, (list, tuple)) or any(
                isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in bands)):
            # int(2.9) read band 2 without a word
            raise DataError(f"bands={bands!r}: give a list of whole band numbers, 1-based ({images[0]} has bands "
                            f"1..{count}), e.g. bands=[3, 2, 1]")
        self.bands = list(range(1, count + 1)) if bands is None else [int(b) for b in bands]
        if not self.bands or min(self.bands) < 1 or max(self.bands) > count:
            raise DataError(f"bands={bands!r}: {images[0]} has bands 1..{count} (1-based)")
        self._check_band_coding(bands)
        self.band_colours = self._check_band_colours(bands)
        self.in_channels = len(self.bands)

        stats = self._stats_file(images[0])
        if classes is None and self.palette is not None:
            classes = len(self.palette)
        if classes is None and (label_map or reduce_zero_label) and 'classes' not in stats:
            raise ValueError("give `classes` when using label_map or reduce_zero_label: the class "
                             "count cannot be inferred from remapped values")
        if classes is None and self._vectors and 'classes' not in stats:
            # The class count from the values, as from a raster's: ignore_index is no class, and a
            # value past it is a mistake (301 classes inferred, then blamed on ignore_index).
            top = max(self._vectors.values(), key=lambda v: v.max_value)
            if 0 <= self.ignore_index < top.max_value:
                raise DataError(f"labels {top.path}: field {self.label_field!r} holds the value {top.max_value}, "
                                f"above ignore_index {self.ignore_index}; fix the file, or give `classes` "
                                "(the class names or count) so values out of range are named")
            classes = max([int(x) for v in self._vectors.values() for x in v.values if x != self.ignore_index] +
                          [self.label_fill if self.label_fill != self.ignore_index else -1]) + 1
        self.classes = self._resolve_classes(classes, stats)
        self.num_classes = len(self.classes)
        if 0 <= self.ignore_index < self.num_classes:
            raise DataError(f"ignore_index {self.ignore_index} is also class {self.ignore_index} "
                            f"({self.classes[self.ignore_index]!r}): padding and nodata would be learnt as that "
                            f"class and the class never counted; use an ignore_index outside 0..{self.num_classes - 1} "
                            "(255 usually)")
        if self.palette is not None:
            if len(self.palette) != self.num_classes:
                raise ValueError(f"palette has {len(self.palette)} colours for {self.num_classes} classes")
            twice = sorted({c for c in self.palette if self.palette.count(c) > 1})
            if twice:  # which class would those pixels be?
                raise ValueError(f"palette gives the colour {twice[0]} to more than one class "
                                 f"({', '.join(self.classes[i] for i, c in enumerate(self.palette) if c == twice[0])})")
            if palette_tolerance is not None and (isinstance(palette_tolerance, bool) or not isinstance(
                    palette_tolerance, (int, float)) or not 0 <= palette_tolerance <= 255):
                # -1 matched no colour at all: the line blamed the palette, (0, 0, 0) its first entry
                raise DataError(f"palette_tolerance={palette_tolerance!r}: give how far (0..255 per channel) a "
                                "label colour may be from its palette colour, or leave it out for half the "
                                "distance between the closest two")
            if isinstance(palette_max_unmatched, bool) or not isinstance(palette_max_unmatched, (int, float)) \
                    or not 0 <= palette_max_unmatched <= 1:
                raise DataError(f"palette_max_unmatched={palette_max_unmatched!r}: give the share (0..1) of label "
                                "pixels that may match no palette colour")
            tol = default_palette_tolerance(self.palette) if palette_tolerance is None else int(palette_tolerance)
            self._decode_palette = PaletteDecoder(self.palette, tol, check_colours(palette_ignore, 'palette_ignore'),
                                                  self.ignore_index)
            self.palette_max_unmatched = float(palette_max_unmatched)
        self._label_lut = self._build_label_lut(label_map, reduce_zero_label)
        named = next((v for v in self._vectors.values() if v.named), None)
        if named is not None and (label_map or reduce_zero_label):
            # Names are already class indices: decoding them as label values shifted every class
            # by one (reduce_zero_label: 'building' trained as 'background'), without a word.
            raise DataError(f"labels {named.path}: field {self.label_field!r} holds class names, which name their "
                            f"classes directly; {'reduce_zero_label' if reduce_zero_label else 'label_map'} decodes "
                            "label values and would shift them: leave it out (label_fill=" f"{self.ignore_index} "
                            "leaves the pixels under no feature ignored)")
        for v in self._vectors.values():
            values = np.append(v.values, self.label_fill)
            bad = (values < 0) | (values > 65535) | (self._label_lut[np.clip(values, 0, 65535)] < 0)
            if bad.any():
                raise DataError(f"labels {v.path}: value {values[bad][0]} (field {self.label_field!r} or "
                                f"label_fill) is not a class index 0..{self.num_classes - 1} nor "
                                f"ignore_index {self.ignore_index}; check `classes` or `label_map`")
        self._note_vector_coverage()
        self._identity_labels = self.palette is None and not label_map and not reduce_zero_label
        # How label files become class indices where they are not class indices already; the
        # checkpoint records it, so labels given to evaluate.py are not scored as raw values.
        self.label_decoding = None if self._identity_labels else effective_label_decoding({
            k: v for k, v in (('label_map', {str(k): int(v) for k, v in (label_map or {}).items()} or None),
                              ('reduce_zero_label', bool(reduce_zero_label) or None),
                              ('palette', None if self.palette is None else [list(c) for c in self.palette]))
            if v is not None}, self.num_classes)
        mean, std = self._resolve_stats(mean, std, stats)
        if self.num_dates > 1 and mean.size == self.in_channels:  # the same per band for every date
            mean, std = np.tile(mean, self.num_dates), np.tile(std, self.num_dates)
        self.in_channels = mean.size
        self.file_dtype = str(self._scenes[0]['dtype'])  # one for every scene (_check_band_coding)
        self.image_dtype = host_dtype(self.file_dtype)
        self.use_statistics(mean, std)
        # The smallest integer type that holds every class index and ignore_index: labels
        # cross the loader's shared memory and the host-to-device copy at 1 byte a pixel.
        self.label_dtype = next(t for t in (np.uint8, np.int16, np.int32)
                                if _dtype_range(t)[0] <= min(0, self.ignore_index)
                                and max(self.num_classes - 1, self.ignore_index) <= _dtype_range(t)[1])

        # Small numpy tables rather than lists of objects: cheap to pickle to every worker.
        self._areas = np.array([s['height'] * s['width'] for s in self._scenes], dtype=np.float64)
        self._scene_p = self._areas / self._areas.sum()
        self._scene_cdf = np.cumsum(self._scene_p).tolist()  # scene by area, one uniform draw
        self._num_random = int(sum(max(1, s['height'] // self.crop_h) * max(1, s['width'] // self.crop_w)
                                   for s in self._scenes))
        self._grid = self._build_grid()

        self._handles = None  # opened lazily per process: rasterio handles cannot be pickled
        self._pid = None
        self._labelled_share = None   # of the label files' pixels, where every one was scanned
        self._check_files(check_labels)
        self._init_sampling(sampling, rare_class_temperature)
        self._note_unused_options(locals())
        self._note_sparse_labels()

    def use_statistics(self, mean, std):
        """Normalise with these per-channel ``mean``/``std`` (file units): the dataset's own, or
        those a resumed checkpoint was trained with."""
        # float64: the float32 mean of a uint32 band around 2**30 is off by half its spread.
        self.mean, self.std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
        # What padding, and nodata before a resize, are filled with: the band mean, i.e. 0
        # once normalised, so neither darkens the valid pixels a resize blends them with.
        self._fill = (self.mean if self.image_dtype.kind == 'f' else np.clip(
            np.rint(self.mean), *_dtype_range(self.image_dtype))).astype(self.image_dtype)
        self.transforms.bind_image_stats(self.mean, self.std, num_dates=self.num_dates)

    # ------------------------------------------------------------------ construction helpers
    def _check_band_coding(self, bands):
        """One band type for every scene (one mean/std, one cast: a uint16 scene among uint8 ones
        would be normalised with the wrong statistics), and no selected band that the file tags
        as alpha (GDAL reads its zeros as nodata: a NIR band tagged so hides every dark pixel)."""
        first = self._scenes[0]
        encoding = lambda s: [s['encoding'][b - 1] for b in self.bands]  # noqa: E731
        # The files' band scale and offset (GDAL's, value = raw x scale + offset; Sentinel-2 since
        # baseline 04.00 stores reflectance + 1000 with offset -1000): ds_seg trains on the raw
        # values, so every scene must share one encoding; the model records it (predict refuses
        # a scene of another).
        self.band_encoding = encoding(first)
        for s in self._scenes:
            if s['dtype'] != first['dtype']:
                raise DataError(f"{s['image']} holds {s['dtype']} pixels but {first['image']} {first['dtype']}; "
                                f"give every scene of a dataset one type (gdal_translate -ot)")
            if encoding(s) != self.band_encoding:
                raise DataError(f"{s['image']}: its bands' scale/offset {encoding(s)} differ from {first['image']}'s "
                                f"{self.band_encoding} ([scale, offset] per selected band); ds_seg trains on the raw "
                                f"values, so the two encodings would be mixed: give every scene one encoding "
                                f"(gdal_translate -unscale -ot Float32 writes the scaled values)")
            if set(s.get('alpha', ())) & set(self.bands):
                with open_raster(s['image']) as src:
                    raise DataError(alpha_as_data_refusal(s['image'], src, self.bands,
                                                          f"bands={bands if bands is not None else 'all'}"))

    def _check_band_colours(self, bands):
        """What the selected bands hold by the files' colour interpretation (['red', 'green',
        'blue', None]), recorded with the model so predict and evaluate can refuse a scene of
        another order; None where no file says. A file whose tags say another order than an
        earlier one on a band both name (a BGR file among RGB ones, any date of a time series) is
        refused: one `bands` selection reads them all."""
        first, merged = None, None
        for s in self._scenes:
            for i, path in enumerate(s.get('dates', (s['image'],))):
                if i == 0:
                    interp = s.get('colorinterp')
                else:
                    with open_raster(path) as src:
                        interp = [c.name for c in src.colorinterp]
                said = band_colours(interp, self.bands)
                if said is None:
                    continue
                if first is None:
                    first, merged = (path, said), list(said)
                elif colours_conflict(said, merged):
                    selected = f"bands={bands}" if bands is not None else 'one selection of all bands'
                    raise DataError(f"{path}: its bands {self.bands} hold {', '.join(c or '(unsaid)' for c in said)} "
                                    f"by the file's colour interpretation, but {first[0]}'s hold "
                                    f"{', '.join(c or '(unsaid)' for c in first[1])}; {selected} reads every scene, "
                                    "so write them in one band order (gdal_translate -b ...), or correct the tags if "
                                    "they are wrong (gdal_edit.py -colorinterp_1 ...).")
                else:  # a band the first file left unsaid, named by this one
                    merged = [m or c for m, c in zip(merged, said)]
        return merged

    def _inspect(self, image, label):
        if is_vector(label):
            if self.palette is not None:
                raise DataError(f"labels {label}: a vector file has no colours; drop `palette`")
            with open_raster(image) as img:
                refusal = pixel_type_refusal(image, img.dtypes)
                if refusal:
                    raise DataError(refusal)
                # A scene located by ground control points: placed by their affine fit, as raster
                # labels are paired (it was refused as having no georeferencing at all).
                transform, crs, residual = pixel_grid(img)
                if residual is not None and residual > 1.0:
                    raise DataError(f"image {image} is located by ground control points that no affine grid fits "
                                    f"within a pixel (largest residual {residual:.2f} px), so vector labels cannot be "
                                    f"placed on its pixels; warp it (gdalwarp -t_srs EPSG:<code> {image} warped.tif)")
                return dict(image_facts(image, img), label=label, vector=True, crs=crs, transform=transform)
        return inspect_pair(image, label, self.palette)

    def _load_vectors(self, classes):
        """Each vector label file read once per image CRS; scenes point at theirs by key."""
        vectors, areas = {}, {}
        for s in self._scenes:
            if s.get('vector'):
                s['vector_key'] = (s['label'], s['crs'].to_wkt() if s['crs'] else None)
                xs, ys = zip(*(s['transform'] * (c, r) for c in (0, s['width']) for r in (0, s['height'])))
                areas.setdefault(s['vector_key'], []).append((min(xs), min(ys), max(xs), max(ys)))
        for s in self._scenes:
            key = s.get('vector_key')
            if key is not None and key not in vectors:
                names = classes if isinstance(classes, (list, tuple)) else None
                vectors[key] = VectorLabels(s['label'], self.label_field, s['crs'], names, self.label_layer,
                                            areas=areas[key])
        # A file whose features all lie off its images (or no feature in any file) would label
        # every pixel label_fill: a wrong file, or coordinates read in the wrong CRS. A file
        # without features is fine on its own (a tile without buildings).
        everything_empty = bool(vectors) and all(v.file_count == 0 for v in vectors.values())
        for s in self._scenes:
            v = vectors.get(s.get('vector_key'))
            if v is not None and v.file_crs_declared and s['crs'] is None and s['transform'].is_identity:
                # Map coordinates read as pixel positions: labels in the wrong place, or none.
                raise DataError(f"labels {v.path} are in {v.file_crs.to_string()}, but image {s['image']} has no "
                                f"georeferencing (no CRS, no geotransform): its features cannot be placed on the "
                                f"image's pixels; georeference the image (gdal_edit.py -a_srs EPSG:<code> -a_ullr "
                                f"<ulx> <uly> <lrx> <lry> {s['image']}), or give labels in pixel coordinates")
        for key, v in vectors.items():
            scenes = [s for s in self._scenes if s.get('vector_key') == key]
            if (v.file_count == 0 and not everything_empty) or any(
                    v.overlaps(s['transform'], s['width'], s['height']) for s in scenes):
                continue
            s = scenes[0]
            west, south, east, north = array_bounds(s['height'], s['width'], s['transform'])
            box = tuple(round(c, 6) for c in (min(west, east), min(south, north), max(west, east), max(south, north)))
            if v.bounds():
                features = f"its features span {tuple(round(b, 6) for b in v.bounds())}"
            elif v.file_count:   # all of them far from the images: dropped before reprojection
                features = (f"its {v.file_count} feature(s) lie far from it: they span "
                            f"{tuple(round(b, 6) for b in v.file_bounds)} in {v.file_crs.to_string()}")
            else:
                features = "it holds no feature"
            if s['crs'] is not None:
                img_crs = s['crs'].to_string()
            elif s['transform'].is_identity:
                img_crs = 'pixel coordinates (the image has no georeferencing)'
            else:
                img_crs = "the image's map units (it declares no CRS)"
            if v.file_crs is None:
                how = "; the file declares no CRS, so its coordinates were taken to be the image's"
            elif s['crs'] is None:
                how = (f"; the image declares no CRS, so the file's coordinates ({v.file_crs.to_string()}) were "
                       f"taken as they are")
            elif v.file_crs != s['crs']:
                how = f"; reprojected from the file's CRS {v.file_crs.to_string()}"
            else:
                how = ''
            both = 'in' if v.file_count and not v.bounds() else 'both in'   # the far features' span: the file's CRS
            raise DataError(f"labels {v.path}: no feature lies on image {s['image']}"
                            f"{f' or the {len(scenes) - 1} other(s)' if len(scenes) > 1 else ''} "
                            f"({features}, the image spans {box}, {both} {img_crs}{how}); "
                            f"check the vector file and its CRS")
        return vectors

    def _note_vector_coverage(self):
        """Notes, at the start, for one vector file over many images (``tiles/*.tif`` with
        ``buildings.gpkg``): images outside the extent of all its features train as label_fill
        everywhere (an annotated area smaller than the mosaic: confident background where nobody
        looked), and classes no feature holds are never seen. An image inside the extent with no
        feature on it is a tile without objects, not said."""
        for v in self._vectors.values():
            box = v.bounds()
            scenes = [s for s in self._scenes if s.get('vector_key') and self._vectors[s['vector_key']] is v]
            if box is None or len(scenes) < 2:
                continue
            outside = []
            for s in scenes:
                west, south, east, north = array_bounds(s['height'], s['width'], s['transform'])
                if (min(east, west) > box[2] or max(east, west) < box[0] or min(north, south) > box[3]
                        or max(north, south) < box[1]):
                    outside.append(os.path.basename(s['image']))
            if outside:
                fill = (f"ignore_index {self.ignore_index}, so they add nothing" if self.label_fill == self.ignore_index
                        else f"label_fill {self.label_fill} ({self.classes[self.label_fill]!r}) everywhere")
                shown = ', '.join(outside[:4]) + (f' and {len(outside) - 4} more' if len(outside) > 4 else '')
                self.notes = [*self.notes, (
                    f"labels {v.path}: {len(outside)} of {len(scenes)} images lie outside the extent of all its "
                    f"features ({shown}); they train as {fill}; if the file does not cover them (an annotated "
                    "area smaller than the images), leave them out")]
        held = {int(self._label_lut[int(x)]) for v in self._vectors.values() for x in np.unique(v.values)
                if 0 <= x < len(self._label_lut)}
        if self._vectors and self.label_fill != self.ignore_index:
            held.add(int(self._label_lut[self.label_fill]))
        empty = [self.classes[c] for c in range(self.num_classes) if c not in held]
        # (Training sets only: a small validation area often lacks a class.)
        if self._vectors and empty and self.split == 'train' and all(s.get('vector') for s in self._scenes):
            files = sorted({v.path for v in self._vectors.values()})
            self.notes = [*self.notes, (
                f"labels {files[0]}{' and the other vector files' if len(files) > 1 else ''}: no feature holds "
                f"{'class' if len(empty) == 1 else 'classes'} {', '.join(map(repr, empty))}, so the model never sees "
                f"{'it' if len(empty) == 1 else 'them'}; check `classes` and label_field {self.label_field!r}")]

    def _vector_window(self, s, window):
        v = self._vectors[s['vector_key']]
        top = max(v.max_value, self.label_fill, self.ignore_index)
        return v.rasterize(s['transform'], window, self.label_fill, 'uint8' if top < 256 else 'int32')

    def _stats_file(self, first_image):
        """The ``stats.json`` beside the first image (mean/std per file band, and class names),
        as a dict; {} where there is none. Its path stays in ``_stats_path`` for the lines that use it."""
        self._stats_path = None
        if is_remote(first_image):
            return {}
        path = os.path.join(os.path.dirname(os.path.abspath(first_image)), STATS_FILE)
        self._stats_path = path
        if os.path.exists(path):
            try:
                with open(path) as f:
                    stats = json.load(f)
            except ValueError as exc:
                raise DataError(f"{path}: not valid JSON ({exc}); fix it, or move it away to have the "
                                f"statistics computed from the images") from exc
            if not isinstance(stats, dict):
                raise DataError(f"{path}: expected a JSON object with mean/std (and classes), got "
                                f"{type(stats).__name__}; fix it, or move it away")
            return stats
        return {}

    def _resolve_classes(self, classes, stats):
        self._classes_from_file = classes is None and stats.get('classes') is not None
        self._classes_inferred_from = None   # (largest label value, its file) where the count came from them
        if classes is None:
            classes = stats.get('classes')
        if classes is None:
            # One-time full read of the labels: slow for big datasets, so name the option.
            top = -1
            for s in self._scenes:
                with open_raster(s['label']) as src:
                    lbl, hidden = read_label_band(src)
                # Neither ignore_index nor the file's nodata tag (-9999, 65535, NaN) is a class,
                # nor what pixels the mask band hides hold.
                unlabelled = label_nodata(lbl, s.get('label_nodata'), hidden)
                valid = lbl[(lbl != self.ignore_index) & (True if unlabelled is None else ~unlabelled)]
                if lbl.dtype.kind == 'f':
                    valid = valid[np.isfinite(valid)]
                if valid.size and int(valid.max()) > top:
                    top, top_label = int(valid.max()), s['label']
            if 0 <= self.ignore_index < top:
                # Classes above ignore_index would make it a class (256 classes from one stray 256).
                raise DataError(f"{top_label}: label value {top} is above ignore_index {self.ignore_index}, so "
                                f"{top + 1} classes would be inferred, ignore_index among them; if {top} is a stray "
                                "value, fix the file or give `classes` (the class names or count) so values out of "
                                f"range are named; else use an ignore_index outside 0..{top}")
            classes = top + 1
            self._classes_inferred_from = (top, top_label)
        return check_class_names(classes, f"{self._stats_path}: 'classes'" if self._classes_from_file else 'classes')

    def _decoding_note(self):
        """Under label_map or reduce_zero_label the file values that are classes are not 0..K-1:
        say which they are (a LoveDA mask's 8 was 'not a class index 0..6', though its 7 is one)."""
        if self._identity_labels or self._label_lut is None:
            return ''
        def spans(values):
            values, out = sorted(int(v) for v in values), []
            for v in values:
                if out and v == out[-1][1] + 1:
                    out[-1][1] = v
                else:
                    out.append([v, v])
            return ', '.join(f'{a}' if a == b else f'{a}..{b}' for a, b in out)
        lut = self._label_lut
        classes = np.flatnonzero((lut >= 0) & (lut != self.ignore_index))
        ignored = np.flatnonzero(lut == self.ignore_index)
        how = ' and '.join(k for k in ('reduce_zero_label', 'label_map') if (self.label_decoding or {}).get(k))
        return (f"; with {how} the file values that are classes are {spans(classes)}"
                + (f" and {spans(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored" if len(ignored) else ''))

    def _build_label_lut(self, label_map, reduce_zero_label):
        """File value -> class index / ignore_index / -1 (not allowed), for values 0..65535."""
        if self.palette is not None:
            return None
        lut = np.full(65536, -1, np.int16)
        if reduce_zero_label:
            lut[0] = self.ignore_index
            lut[1:self.num_classes + 1] = np.arange(self.num_classes)
        else:
            lut[:self.num_classes] = np.arange(self.num_classes)
        if 0 <= self.ignore_index < 65536:
            lut[self.ignore_index] = self.ignore_index
        for k, v in (label_map or {}).items():
            v = int(v)
            # A negative key would index the table from its end (-1 remapping 65535). JSON/YAML
            # configs give keys as text: '255' is 255.
            key = int(k) if isinstance(k, (int, np.integer)) and not isinstance(k, bool) or \
                str(k).strip().isdigit() else -1
            if not 0 <= key < 65536:
                raise ValueError(f"label_map key {k!r}: keys are label file values 0..65535; convert labels "
                                 f"outside that range first (gdal_calc.py, or gdal_translate -scale)")
            if not (0 <= v < self.num_classes or v == self.ignore_index):
                raise ValueError(f"label_map maps {k} to {v}, which is neither a class index "
                                 f"0..{self.num_classes - 1} nor ignore_index {self.ignore_index}")
            lut[key] = v
        return lut

    def _select(self, values, what):
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if self.num_dates > 1 and values.size == self.in_channels * self.num_dates == self.num_file_bands:
            as_file_bands = np.tile(values[np.array(self.bands) - 1], self.num_dates)
            if not np.array_equal(as_file_bands, values):
                # 6-band files, bands [1, 2, 3], 2 dates: six values read either way, and read
                # per band and date without a word where stats.json's layout is per file band.
                self.notes = [*getattr(self, 'notes', []),
                              f"{what} has {values.size} values, as many as the file's bands and as the selected "
                              f"bands of every date: taken per band and date ({self.in_channels} for each of "
                              f"{self.num_dates} dates, in order); for one value per file band give the "
                              f"{self.in_channels} of the selected bands, {_short_list(as_file_bands[:self.in_channels])}"]
        if values.size in (self.in_channels, self.in_channels * self.num_dates):
            return values  # per selected band, or per band of every date
        if values.size == self.num_file_bands:
            return values[np.array(self.bands) - 1]
        raise ValueError(f"{what} has {values.size} values; expected one per selected band "
                         f"({self.in_channels}), per file band ({self.num_file_bands}) or per "
                         f"band and date ({self.in_channels * self.num_dates})")

    def _resolve_stats(self, mean, std, stats):
        """Per selected band (per band and date with dates) mean/std in file units. Given ones
        are the user's; computed ones and ``stats.json``'s are per band of the file, taken for
        ``bands`` in their order (a permutation of every band has as many values as the file)."""
        given = {'mean': mean, 'std': std}
        for key, value in given.items():
            if value is None:
                continue
            try:
                values = np.asarray(value, dtype=np.float64).reshape(-1)
            except (TypeError, ValueError):
                values = np.array([np.nan])
            if not np.isfinite(values).all() or (key == 'std' and (values <= 0).any()):
                rule = 'a finite number > 0' if key == 'std' else 'a finite number'
                raise ValueError(f"{key}={value!r}: each band's {key} must be {rule}, in the file's units")
            given[key] = self._select(values, key)
        self._refuse_unit_scaled_stats(given['mean'], given['std'])
        if mean is None or std is None:
            from_file = 'mean' in stats and 'std' in stats
            file_stats = stats if from_file else self._cached_or_computed_stats()
            try:
                for key in ('mean', 'std'):
                    if given[key] is None:
                        given[key] = self._file_band_values(file_stats[key], key, from_file)
                if from_file:  # the same unit check as given values: 0-1 ImageNet values from a converter
                    self._refuse_unit_scaled_stats(given['mean'], given['std'])
            except ValueError as exc:
                if not from_file:
                    raise
                raise DataError(f"{self._stats_path}: {exc}; fix the file, or move it away to have the "
                                "statistics computed from the images") from None
            if from_file:  # a file the user may not know is there (a converter's) decides the inputs
                used = [k for k in ('mean', 'std') if (mean, std)[k == 'std'] is None]
                named = ' and the class names' if self._classes_from_file else ''
                self.notes = [*self.notes,
                              f"{'/'.join(used)}{named} from {self._stats_path} (move it away to have them "
                              "computed from the images)"]
        # A constant band (computed std 0) normalises to 0, not to inf.
        std = np.where(given['std'] > 0, given['std'], 1.0)
        return given['mean'], std

    def _file_band_values(self, value, key, from_file):
        """Computed or ``stats.json`` values, per file band (of each date), for ``bands`` in their order."""
        try:
            values = np.asarray(value, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise ValueError(f"{key} is {value!r}, not a list of numbers") from None
        if from_file and (not np.isfinite(values).all() or (key == 'std' and (values <= 0).any())):
            raise ValueError(f"{key} {values.tolist()}: each band's {key} must be a finite number"
                             + (' > 0' if key == 'std' else ''))
        if values.size == self.num_file_bands * self.num_dates:  # per file band (of each date)
            values = values.reshape(self.num_dates, self.num_file_bands)
            return values[:, np.array(self.bands) - 1].reshape(-1)
        if values.size == self.num_file_bands:  # one per file band: follow `bands`
            return values[np.array(self.bands) - 1]
        return self._select(values, key)

    def _refuse_unit_scaled_stats(self, mean, std):
        """``mean=[0.485, ...], std=[0.229, ...]`` (ImageNet's, in 0-1 units: a timm or torchgeo
        habit) for integer images: inputs came out hundreds of sigma wide, and the run trained."""
        dtype = np.dtype(self._scenes[0]['dtype'])
        if std is None or dtype.kind not in 'ui' or not (std < 1).all():
            return
        if mean is not None and (np.abs(mean) > 1).any():
            return
        top = np.iinfo(dtype).max
        raise ValueError(f"std={std.tolist()} is below 1 in every band of {dtype} images (0-{top}): mean and std "
                         f"are in the file's units, not 0-1 (ImageNet's 0-1 values x 255 for 8-bit images); "
                         f"or leave them out to have them computed")

    # Scenes read for computed statistics: all of a set up to this many, else this many spread
    # evenly over it (a decimated read each, once; the result is cached).
    STATS_SCENES = 32

    def _stats_scenes(self):
        n = len(self._scenes)
        if n <= self.STATS_SCENES:
            return list(range(n))
        return sorted({int(round(i)) for i in np.linspace(0, n - 1, self.STATS_SCENES)})

    def _cached_or_computed_stats(self):
        # Keyed to the files' identity, not their names: rewritten images (or a republished URL:
        # its ETag / Last-Modified) get new statistics. A URL's cache is a user cache; a URL
        # whose version the server does not tell is read again every time. The cache of a
        # folder holds several sets: train and val scenes of one folder replaced each other's.
        chosen = [self._scenes[i] for i in self._stats_scenes()]
        dates = [[s.get('dates', (s['image'],))[d] for s in chosen] for d in range(self.num_dates)]
        key = [file_identity(path) for paths in dates for path in paths]
        if None in key:
            cache = None
        elif is_remote(chosen[0]['image']):
            digest = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16]
            folder = user_cache_dir()
            cache = folder and os.path.join(folder, f'stats-{digest}.json')
        else:
            cache = os.path.join(os.path.dirname(key[0]['path']), STATS_CACHE_FILE)
        # Which pixels count depends on the selected bands (nodata in each of them), not on their
        # order; selecting them all is an entry without this key, as before it existed.
        masked_by = sorted(set(self.bands))
        masked_by = None if masked_by == list(range(1, self.num_file_bands + 1)) else masked_by
        held = _read_cache(cache) if cache else {}
        sets = held.get('sets', []) if held.get('version') == STATS_VERSION else []
        found = next((entry for entry in sets if entry.get('images') == key
                      and entry.get('nodata_bands') == masked_by), None)
        if found is not None and np.isfinite(found.get('std', [])).all() and (
                np.abs(np.asarray(found.get('mean', []) + found.get('std', []), np.float64)) < FILL_MAGNITUDE).all():
            return found   # (statistics of an untagged fill value, cached before it was refused, are read again)
        # Every date's own statistics, one after the other (per band and date): a series was
        # normalised with its first date's only, later dates reaching the model several sigma off.
        per_date = [self._band_statistics(chosen, paths) for paths in dates]
        result = dict(images=key, mean=[v for m, _ in per_date for v in m], std=[v for _, v in per_date for v in v],
                      **({'nodata_bands': masked_by} if masked_by else {}))
        if cache:
            _write_cache(cache, dict(version=STATS_VERSION, sets=(sets + [result])[-STATS_SETS_KEPT:]))
        return result

    def _band_statistics(self, chosen, paths):
        """(mean, std) per file band of ``paths`` (one file of each of the ``chosen`` scenes),
        over the pixels the training windows count as data."""
        # Sums of x - shift, shift = the first read's mean: sum(x^2)/n - mean^2 of the raw values
        # cancels to noise (even below 0, then a std of 1) where the mean dwarfs the spread
        # (uint32 counts around 2^30 with a spread of 300).
        total = np.zeros(self.num_file_bands)
        total_sq = np.zeros(self.num_file_bands)
        shift = None
        n = 0
        for s, path in zip(chosen, paths):
            # A decimated read (GDAL picks overviews if any) is enough for normalisation stats.
            f = max(1.0, max(s['height'], s['width']) / 512)
            shape = (max(1, int(s['height'] / f)), max(1, int(s['width'] / f)))
            try:
                with open_raster(path) as src:
                    x = src.read(out_shape=(s['count'],) + shape).reshape(s['count'], -1).astype(np.float64)
                    # Pixels the training windows mark invalid are not data: nodata, NaN, and
                    # those a GDAL mask band or an alpha band hides.
                    # ... judged on the selected bands only, as the windows are: a file's other
                    # band holding data there does not make the pixel data.
                    invalid = nodata_mask(x[np.array(self.bands) - 1], s['nodata'], dtype=s['dtype'])
                    if s['masked']:
                        invalid |= src.dataset_mask(out_shape=shape).reshape(-1) == 0
            except rasterio.errors.RasterioError as e:
                raise DataError(unreadable(path, e)) from e
            x = x[:, ~invalid]
            refusal = untagged_fill(x[np.array(self.bands) - 1], path, s['dtype'], self.bands, s['nodata'])
            if refusal:
                raise DataError(refusal)
            if not x.shape[1]:
                continue
            if shift is None:
                shift = x.mean(1)
            x -= shift[:, None]
            total += x.sum(1)
            total_sq += (x * x).sum(1)
            n += x.shape[1]
        offset = total / max(n, 1)
        mean = offset + (0 if shift is None else shift)
        std = np.sqrt(np.maximum(total_sq / max(n, 1) - offset * offset, 0))
        return mean.tolist(), std.tolist()

    def _check_files(self, check_labels):
        """Stop before training on unreadable files or labels outside the class list.

        A decimated (nearest) read of a sample of label files and a one-block read of their
        images: cheap for tiled scenes, and it catches the usual mistakes (wrong label
        encoding, truncated download) in seconds rather than hours into a run. Files not in
        the sample are still checked window by window while training.
        """
        n = len(self._scenes)
        self._check_label_nodata()
        if check_labels == 0:
            return
        count = n if check_labels is None or check_labels < 0 else min(n, int(check_labels))
        picks = sorted(set(np.linspace(0, n - 1, count).round().astype(int).tolist()))
        for i in picks:
            s = self._scenes[i]
            try:
                with open_raster(s['image']) as src:
                    src.read(1, window=Window(s['width'] - 1, s['height'] - 1, 1, 1))
            except rasterio.errors.RasterioError as e:
                raise DataError(unreadable(s['image'], e)) from e
            if s.get('vector'):  # its class values were checked when it was read
                continue
            f = max(1.0, max(s['height'], s['width']) / _CHECK_PIXELS)
            shape = (max(1, int(s['height'] / f)), max(1, int(s['width'] / f)))
            # GDAL serves a decimated read from the file's overviews, nearest or not: labels with
            # averaged overviews (gdaladdo -r average) showed values the file does not hold. A
            # finding is confirmed on the full-resolution pixels before it refuses the file.
            # (A VRT's sources serve theirs too, whatever the VRT is opened with: the confirming
            # read takes whole rows at full resolution.)
            refusal = self._decimated_label_refusal(s, shape, native=False)
            if refusal:
                refusal = self._decimated_label_refusal(s, shape, native=True)
            if refusal:
                raise DataError(refusal)
        if self.palette is None:
            self._check_label_values()
        self._check_labelled_valid_pixels()

    def _decimated_label_refusal(self, s, shape, native):
        """Why the label file of scene s is refused, or None, from a nearest read decimated to
        ``shape``: by GDAL (from overviews where the file has them), or with ``native`` from
        whole rows of the full-resolution pixels, sampled as GDAL's nearest samples them."""
        try:
            with open_raster(s['label']) as src:
                if not native:
                    if self.palette is not None:
                        raw = src.read([1, 2, 3], out_shape=(3,) + shape, resampling=Resampling.nearest)
                    else:
                        raw, hidden = read_label_band(src, out_shape=shape)
                else:
                    ys = ((np.arange(shape[0]) + 0.5) * src.height / shape[0]).astype(int)
                    xs = ((np.arange(shape[1]) + 0.5) * src.width / shape[1]).astype(int)
                    rows, masks = [], []
                    for y in ys:
                        row = Window(0, int(y), src.width, 1)
                        if self.palette is not None:
                            rows.append(src.read([1, 2, 3], window=row)[:, 0, xs])
                        else:
                            values, hidden_row = read_label_band(src, row)
                            rows.append(values[0, xs])
                            masks.append(None if hidden_row is None else hidden_row[0, xs])
                    raw = np.stack(rows, axis=-2)
                    hidden = (None if self.palette is not None or all(m is None for m in masks) else
                              np.stack([np.zeros(len(xs), bool) if m is None else m for m in masks]))
        except rasterio.errors.RasterioError as e:
            raise DataError(unreadable(s['label'], e)) from e
        if self.palette is not None:
            bad = self._palette_labels(raw, s.get('label_nodata')) < 0
            if bad.mean() <= self.palette_max_unmatched:
                return None
            colour, _ = Counter(map(tuple, raw[:, bad].T.tolist())).most_common(1)[0]
            return (f"{s['label']}: {100 * bad.mean():.1f}% of the label pixels match no palette "
                    f"colour (most common: {colour}); palette is {self.palette}; fix `palette`, "
                    f"`palette_ignore` or `palette_tolerance`")
        decoded = self._map_labels(raw, s.get('label_nodata'), hidden)
        if not (decoded < 0).any():
            return None
        value = raw[decoded < 0].flat[0]
        return (f"{s['label']}: label value {value} is not a class index 0..{self.num_classes - 1} "
                f"nor ignore_index {self.ignore_index} (classes: {', '.join(self.classes)}{self._decoding_note()}); "
                f"check `classes`, or remap with `label_map` / `reduce_zero_label`")

    def _palette_labels(self, raw_3HW, nodata):
        """Class indices of colour-coded label pixels; those holding the label file's nodata tag
        in every band (no palette colour: :meth:`_check_label_nodata`) are ignore_index. They
        were off-palette noise before: more than palette_max_unmatched of them refused the file."""
        label = self._decode_palette(raw_3HW)
        if nodata is not None and not math.isnan(nodata):
            label[(raw_3HW == nodata).all(axis=0)] = self.ignore_index
        return label

    def _check_label_nodata(self):
        """A label file whose nodata tag is a class value is ambiguous (is that class real, or
        are those pixels unlabelled?): refused, from the file header alone."""
        if self.palette is not None:
            for s in self._scenes:
                value = s.get('label_nodata')
                grey = (int(value),) * 3 if value is not None and float(value).is_integer() else None
                if grey in self.palette:
                    mapped = self.palette.index(grey)
                    raise DataError(label_nodata_message(s['label'], float(value), mapped, self.classes[mapped],
                                                         self.ignore_index, colour=grey))
            return
        for s in self._scenes:
            value = s.get('label_nodata')
            if value is None or not float(value).is_integer() or not 0 <= value < len(self._label_lut):
                continue
            mapped = int(self._label_lut[int(value)])
            if 0 <= mapped < self.num_classes:
                raise DataError(label_nodata_message(s['label'], float(value), mapped, self.classes[mapped],
                                                     self.ignore_index))

    def label_decoding_digest(self):
        """A digest of everything that turns label file values into class indices, the key of
        caches of figures computed from decoded labels: a changed label_map, palette, ignore_index
        or class list (the names a vector field's values are looked up in) must not reuse them."""
        lut = self._label_lut
        return hashlib.sha1((lut.tobytes() if lut is not None else b'') + repr((
            self.palette, self.ignore_index, list(self.classes), getattr(self, 'label_field', None),
            getattr(self, 'label_fill', None), getattr(self, 'label_layer', None))).encode()).hexdigest()

    def _labelled_valid(self, s, window=None, out_shape=None, images=True):
        """How many pixels of ``window`` (or of a decimated read to ``out_shape``) of scene ``s``
        are labelled with a class and valid (not nodata/NaN/masked) at every date; labelled
        whatever the images hold with ``images=False``."""
        invalid = None
        for path in s.get('dates', (s['image'],)) if images else ():
            bad = self._no_data(path, s, window, out_shape)
            if bad is not None:
                invalid = bad if invalid is None else invalid | bad
        with open_raster(s['label']) as src:
            if self.palette is not None:
                label = self._palette_labels(src.read([1, 2, 3], window=window, out_shape=None if out_shape is None
                                                      else (3,) + out_shape), s.get('label_nodata'))
            else:
                label = self._map_labels(*self._label_values(src, s, window, out_shape))
        labelled = (label >= 0) & (label != self.ignore_index)
        if invalid is not None:
            labelled &= ~invalid
        return int(np.count_nonzero(labelled))

    def _no_data(self, path, s, window=None, out_shape=None):
        """The pixels of one image file (a date) of scene ``s`` that hold no data in the selected
        bands (the nodata value, a non-finite value, or hidden by the mask band), in ``window``
        or a read decimated to ``out_shape``; None where nothing can mark one."""
        with open_raster(path) as src:
            raw = src.read(self.bands, window=window, out_shape=None if out_shape is None
                           else (len(self.bands),) + out_shape)
            bad = nodata_mask(raw, s['nodata']) if s['nodata'] is not None or raw.dtype.kind == 'f' else None
            if s['masked']:
                hidden = src.dataset_mask(window=window, out_shape=out_shape) == 0
                bad = hidden if bad is None else bad | hidden
        return bad

    def _check_labelled_valid_pixels(self, band_rows=1024):
        """Refuse a dataset in which no pixel is both labelled with a class and valid in its image
        (an all-nodata or all-NaN image over its labels would train to loss 0 and report
        "completed"). A decimated read of image and label per scene settles the usual case at
        the first scene; only where none shows such a pixel are the scenes read whole, row band
        by row band, with the count cached by the files' identity next to the labels."""
        unsure = False
        for s in self._scenes:
            if s.get('vector'):
                unsure = True
                continue
            f = max(1.0, max(s['height'], s['width']) / 512)
            shape = (max(1, int(s['height'] / f)), max(1, int(s['width'] / f)))
            try:
                if self._labelled_valid(s, out_shape=shape):
                    return
            except rasterio.errors.RasterioError as e:
                raise DataError(f"{s['image']} / {s['label']}: cannot be read (corrupt or truncated?): "
                                f"{gdal_message(e)}") from e
        cache_path = os.path.join(os.path.dirname(os.path.abspath(self._scenes[0]['label'])), LABELS_CACHE_FILE)
        cache = _read_cache(cache_path)
        changed = found = False
        for s in self._scenes:
            if s.get('vector') or any(is_remote(p) for p in (s['label'], *s.get('dates', (s['image'],)))):
                unsure = True  # a full scan would download them whole
                continue
            key = 'labelled_valid:' + os.path.abspath(s['image'])
            ident = [file_identity(p) for p in (s['label'], *s.get('dates', (s['image'],)))]
            entry = None if None in ident else cache.get(key)  # an unknown version is never trusted
            if entry is None or entry.get('identity') != ident or entry.get('bands') != self.bands \
                    or entry.get('decoding') != self.label_decoding_digest():
                count = 0
                for y in range(0, s['height'], band_rows):
                    count += self._labelled_valid(s, Window(0, y, s['width'], min(band_rows, s['height'] - y)))
                    if count:
                        break
                entry = cache[key] = {'identity': ident, 'bands': self.bands, 'count': count,
                                      'decoding': self.label_decoding_digest()}
                changed = True
            if entry['count']:
                found = True
                break
        if changed:
            _write_cache(cache_path, cache)
        if not (found or unsure) and not any(
                self._labelled_valid(s, Window(0, y, s['width'], min(band_rows, s['height'] - y)), images=False)
                for s in self._scenes for y in range(0, s['height'], band_rows)):
            # The labels themselves hold no class (all palette_ignore colours, say): not the images.
            names = [s['label'] for s in self._scenes[:3]]
            more = f" and {len(self._scenes) - 3} more" if len(self._scenes) > 3 else ''
            said = 'colours of `palette_ignore`, unknown colours' if self.palette is not None else 'ignore_index'
            raise DataError(f"{', '.join(names)}{more}: no pixel is labelled with a class (all are {said} or nodata); "
                            "nothing can be learnt or measured from them; check the label files"
                            f"{', `palette` or `palette_ignore`' if self.palette is not None else ' or `label_map`'}")
        if not (found or unsure):
            names = [self._scene_name_without_data(s) for s in self._scenes[:3]]
            more = f" and {len(self._scenes) - 3} more" if len(self._scenes) > 3 else ''
            raise DataError(
                f"{', '.join(names)}{more}: no pixel is both labelled with a class and valid in the image "
                f"(every labelled pixel is nodata{'/NaN' if any(s['floating'] for s in self._scenes) else ''} "
                f"or masked in bands {self.bands}); nothing can be learnt or measured. Check the images' "
                "nodata value (gdal_edit.py -unsetnodata / -a_nodata), `bands`, or the image/label pairing")
        remote = [s for s in self._scenes if not s.get('vector') and any(
            is_remote(p) for p in (s['label'], *s.get('dates', (s['image'],))))]
        if not found and remote:  # not read whole (a download): said, where a local set is refused
            names = ', '.join(self._scene_name_without_data(s) for s in remote[:3])
            more = f" and {len(remote) - 3} more" if len(remote) > 3 else ''
            self.notes = [*self.notes,
                          f"{names}{more}: a decimated read shows no pixel both labelled with a class and valid in "
                          "the image, and remote scenes are not read whole; if they hold none, training learns "
                          "nothing (loss 0). Check the images' nodata value, `bands`, or the image/label pairing"]

    def _scene_name_without_data(self, s, size=512):
        """A scene's name in a line about its missing data: its image, or for a time series the
        dates that hold no valid pixel (by a read decimated to ``size``), else every date."""
        dates = s.get('dates')
        if not dates:
            return s['image']
        shape = (min(size, s['height']), min(size, s['width']))
        empty = []
        for path in dates:
            bad = self._no_data(path, s, out_shape=shape)
            if bad is not None and bad.all():
                empty.append(path)
        return (', '.join(f'{p} (date {dates.index(p) + 1} of {len(dates)})' for p in empty) if empty
                else ','.join(dates))

    def _check_label_values(self):
        """Every pixel of every label file, not a sample: a value that is no class anywhere
        stops the run here, and a dataset without a single labelled pixel (which would train to
        loss 0 and report "completed") is refused. One read of each label file, cached by file
        identity next to the labels, so later runs pay nothing."""
        scanned = [s for s in self._scenes if not s.get('vector')]
        labelled, checked, pixels = 0, 0, 0
        listed = {int(k) for k in ((self.label_decoding or {}).get('label_map') or {})}
        merged = {}   # class -> file values read as it: listed ones, and unlisted ones passed through
        seen = set()  # classes with a pixel
        for s, histogram in zip(scanned, cached_label_histograms([s['label'] for s in scanned])):
            # Vector labels were checked when read; remote ones are checked window by window.
            if histogram is None:
                continue
            checked += 1
            nodata = s.get('label_nodata')
            pixels += sum(histogram.values())
            for value, count in histogram.items():
                if same_value(value, nodata):
                    continue  # unlabelled (see _map_labels)
                mapped = (int(self._label_lut[int(value)]) if value.is_integer() and 0 <= value < len(self._label_lut)
                          else -1)
                if mapped < 0:
                    raise DataError(
                        f"{s['label']}: {count} pixel(s) have label value {value:.10g}, which is not a class index "
                        f"0..{self.num_classes - 1} nor ignore_index {self.ignore_index} (classes: "
                        f"{', '.join(self.classes)}{self._decoding_note()}); check `classes`, or remap with "
                        "`label_map` / `reduce_zero_label`")
                if mapped != self.ignore_index:
                    labelled += count
                    seen.add(mapped)
                    if listed:
                        merged.setdefault(mapped, set()).add(int(value))
        # label_map={1: 0, 2: 1, 3: 2} (a shift, 0 unlisted): file value 0 passed through as class 0,
        # joining file value 1 there without a word.
        for cls, values in sorted(merged.items()):
            passed = sorted(v for v in values if v not in listed and v == cls)
            if passed and any(v in listed for v in values):
                mapped_here = sorted(v for v in values if v in listed)
                self.notes = [*self.notes, (
                    f"label_map: file value {passed[0]} is not listed, so it is read as class {cls} "
                    f"({self.classes[cls]!r}), as is file value {mapped_here[0]}, which label_map maps there; "
                    f"if {passed[0]} is no class, list it: label_map={{..., {passed[0]}: {self.ignore_index}}}")]
        # A stray 7 in 3-class labels, no `classes` given: 8 classes, 3..6 empty, trained and scored
        # (their IoU undefined) without a word.
        empty = [c for c in range(self.num_classes) if c not in seen]
        if self._classes_inferred_from and checked == len(self._scenes) and labelled and empty:
            top, where = self._classes_inferred_from
            self.notes = [*self.notes, (
                f"classes: {self.num_classes} counted from the largest label value, {top} (in {where}), and "
                f"{_listed(empty)} {'holds' if len(empty) == 1 else 'hold'} no pixel of any label file; if {top} "
                "is a stray value, fix that file or give `classes` (the class names or count)")]
        if checked == len(self._scenes) and pixels:
            self._labelled_share = labelled / pixels
        if labelled == 0 and checked:
            raise DataError(f"{self._scenes[0]['label']}{' and the other label files' if len(self._scenes) > 1 else ''}: "
                            f"no pixel is labelled with a class (all are ignore_index {self.ignore_index}); "
                            "nothing can be learnt or measured from them; check the label files or `label_map`")

    def _build_grid(self):
        rows = []
        for i, s in enumerate(self._scenes):
            ys = grid_starts(s['height'], self.crop_h)
            xs = grid_starts(s['width'], self.crop_w)
            for r, y in enumerate(ys):
                # Rows of this window already seen by the window above (same for columns).
                top = ys[r - 1] + self.crop_h - y if r else 0
                for c, x in enumerate(xs):
                    left = xs[c - 1] + self.crop_w - x if c else 0
                    rows.append((i, y, x, max(top, 0), max(left, 0)))
        return np.array(rows, dtype=np.int64).reshape(-1, 5)

    def _note_unused_options(self, given):
        """A note per option given a value other than its default that does nothing here, because
        what it acts through is absent: vector-label options with raster labels, palette options
        without a palette, sampling and window options in grid mode (evaluation reads every window
        as it is). They were dropped without a word (stac_bands without stac read every band).
        Noted, not refused, as with unused tracker settings: a command line turning the other
        setting off (stac=None) is how a config is overridden."""
        defaults = {n: p.default for n, p in inspect.signature(GeoTiffScenes.__init__).parameters.items()}
        needs = []
        if not self._vectors:
            needs += [(k, 'vector labels (a .gpkg, .geojson, .shp... label file)')
                      for k in ('label_field', 'label_layer', 'label_fill')]
        if given['stac'] is None:
            needs += [('stac_bands', '`stac` (a STAC Item or ItemCollection); give `bands` for a raster\'s bands'),
                      ('stac_label', '`stac`')]
        if self.palette is None:
            needs += [(k, '`palette` (colour-coded labels)')
                      for k in ('palette_tolerance', 'palette_max_unmatched', 'palette_ignore')]
        if self.mode == 'random' and self.sampling != 'rare_class':
            needs += [('rare_class_temperature', "sampling='rare_class'")]
        if self.mode == 'grid':  # evaluation: every window once, as it is
            needs += [(k, "random (training) windows; this set reads grid windows (mode='grid', every window "
                          "once, never redrawn, rescaled or augmented)")
                      for k in ('cat_max_ratio', 'max_nodata_ratio', 'max_retries', 'random_scale',
                                'boundary_ignore', 'transforms', 'augment', 'sampling', 'rare_class_temperature')]
        for key, what in needs:
            value = given[key]
            if value is not None and not _equals_default(value, defaults[key]):
                self.notes = [*self.notes, f"{key}={value!r} is not used: it takes effect only "
                              f"with {what}"]

    SPARSE_LABELS = 0.1   # a labelled share below which uniform random windows mostly hold no label

    def _note_sparse_labels(self):
        """An annotated area inside a large orthomosaic (the rest ignore_index): uniform random
        windows mostly held no labelled pixel, and those steps trained on nothing (loss 0), unsaid."""
        share = self._labelled_share
        if self.mode == 'random' and self.sampling == 'uniform' and share is not None and share < self.SPARSE_LABELS:
            self.notes = [*self.notes, (
                f"only {share:.1%} of the label files' pixels are labelled with a class (the rest are ignore_index "
                f"{self.ignore_index} or nodata): most uniform random windows hold none, and their steps train on "
                "nothing (loss 0); sampling='rare_class' draws every window around a labelled pixel, or crop the "
                "scenes to the annotated area")]

    def _init_sampling(self, sampling, temperature):
        if sampling not in ('uniform', 'rare_class'):
            raise ConfigError(f"sampling={sampling!r}: use 'uniform' (positions uniform over the "
                              f"scenes' area) or 'rare_class' (DAFormer rare-class sampling)")
        self.sampling = sampling if self.mode == 'random' else 'uniform'
        self._rcs_classes = None
        self.rare_class_absent = ()
        if self.sampling != 'rare_class':
            return
        try:  # before the class index, which reads every label once
            bad = not float(temperature) > 0
        except (TypeError, ValueError):
            bad = True
        if bad:
            raise ConfigError(f"rare_class_temperature={temperature!r}: must be a number > 0 (DAFormer "
                              f"uses 0.01; larger values sample classes more evenly)")
        # An eighth of the crop: any window drawn around a candidate pixel holds ~64 grid
        # points, so the grid finds every region a window could be centred on.
        stride = max(1, min(self.crop_h, self.crop_w) // 8)
        counts, self._rcs_locations = class_index(self, stride)
        counts = np.where([len(loc) > 0 for loc in self._rcs_locations], counts, 0)
        if not counts.any():
            raise DataError(f"sampling='rare_class': no labelled pixel in the labels "
                            f"({self._scenes[0]['label']}, ...); use sampling='uniform'")
        p = class_probabilities(counts, float(temperature))
        # Classes without a labelled pixel are never drawn (p = 0): the trainer says so.
        self.rare_class_absent = tuple(self.classes[c] for c in np.flatnonzero(counts == 0).tolist())
        self.class_frequencies = counts / counts.sum()
        self.class_probabilities = p
        self._rcs_classes = np.flatnonzero(p > 0).tolist()
        self._rcs_cdf = np.cumsum(p[self._rcs_classes]).tolist()

    def _rare_class_window(self, rng, h, w):
        """(scene, y, x) of an ``h`` x ``w`` window around a pixel of a class drawn by rarity."""
        i = min(bisect.bisect_right(self._rcs_cdf, rng.random() * self._rcs_cdf[-1]),
                len(self._rcs_classes) - 1)
        locs = self._rcs_locations[self._rcs_classes[i]]
        scene, py, px = (int(v) for v in locs[rng.randrange(len(locs))])
        s = self._scenes[scene]
        y = min(max(py - rng.randrange(h), 0), max(s['height'] - h, 0))
        x = min(max(px - rng.randrange(w), 0), max(s['width'] - w, 0))
        return scene, y, x

    # ------------------------------------------------------------------ sampling layout
    def set_sampling_layout(self, world_size, micro_batch):
        """Tell the dataset how the train sampler lays out indices, so it can recover the
        global micro-step of an index (for the per-step random scale). Called by
        ``build_train_loader``; without it every index is its own micro-step."""
        self._world_size, self._micro_batch = int(world_size), int(micro_batch)

    def micro_step_of(self, index):
        return int(index) // (self._world_size * self._micro_batch)

    def scale_for_index(self, index):
        """The random-scale factor used for training sample ``index`` (1.0 when off)."""
        return scale_for_micro_step(self.seed, self.micro_step_of(index), self.random_scale)

    # ------------------------------------------------------------------ reading
    def __getstate__(self):
        state = self.__dict__.copy()
        state['_handles'] = None
        state['_pid'] = None
        return state

    def _open(self, path):
        # Handles opened in a parent process are not safe to use after fork: start afresh.
        if self._pid != os.getpid():
            self._handles = OrderedDict()
            self._pid = os.getpid()
        src = self._handles.get(path)
        if src is None:
            with warnings.catch_warnings(), opening_env(path):
                warnings.simplefilter('ignore', NotGeoreferencedWarning)
                src = rasterio.open(gdal_path(path))
            refuse_lost_world_file(path, src)
            self._handles[path] = src
            if len(self._handles) > _MAX_OPEN_FILES:
                self._handles.popitem(last=False)[1].close()
        else:
            self._handles.move_to_end(path)
        return src

    def _read(self, path, window, indexes, scene=None):
        """Bands ``indexes`` of ``window``; given the ``scene`` (its dict) the image is read
        with its nodata mask, as :func:`~ds_seg.data.raster.read_window` returns them."""
        try:
            src = self._open(path)
            with raster_env(path):  # a no-op for local files
                if scene is not None:
                    return read_window(src, window, indexes, scene['nodata'], scene['masked'])
                return src.read(indexes=indexes, window=window)
        except Exception as e:  # a worker's traceback alone would not say which file broke
            raise DataError(f"{path}: cannot read window {window}: {read_error(path, e)}") from e

    @staticmethod
    def _label_values(src, scene, window=None, out_shape=None):
        """``(raw, nodata, hidden)`` of a label window: what :meth:`_map_labels` takes."""
        raw, hidden = read_label_band(src, window, out_shape)
        return raw, scene.get('label_nodata'), hidden

    def _read_label_values(self, scene, window):
        """:meth:`_label_values` through this worker's open files, the file named on a failure."""
        path = scene['label']
        try:
            src = self._open(path)
            with raster_env(path):
                return self._label_values(src, scene, window)
        except Exception as e:
            raise DataError(f"{path}: cannot read window {window}: {read_error(path, e)}") from e

    def _map_labels(self, raw, nodata=None, hidden=None):
        """File values -> int16 class indices, ignore_index, or -1 where not allowed; the label
        file's ``nodata`` value (one that is no class: see _check_label_nodata) and the pixels
        its mask band ``hidden`` -> ignore_index."""
        unlabelled = label_nodata(raw, nodata, hidden)
        if unlabelled is not None:
            mapped = self._map_labels(np.where(unlabelled, 0, raw)).astype(np.int16)
            mapped[unlabelled] = self.ignore_index
            return mapped
        if (self._identity_labels and raw.dtype.kind == 'u' and self.ignore_index <= np.iinfo(raw.dtype).max
                and raw.max(initial=0) < self.num_classes):
            return raw  # the common case, without a per-pixel table lookup
        if raw.dtype in (np.uint8, np.uint16):
            return self._label_lut[raw]
        with np.errstate(invalid='ignore'):  # NaN (no nodata tag says so) becomes no class: refused
            values = np.rint(raw).astype(np.int64) if raw.dtype.kind == 'f' else raw.astype(np.int64)
        inside = (values >= 0) & (values < 65536)
        out = np.full(values.shape, -1, np.int16)
        out[inside] = self._label_lut[values[inside]]
        return out

    def read_label(self, scene_index, window):
        """Class indices (``ignore_index`` for off-palette colours) of ``window`` of scene
        ``scene_index``, decoded as for training (a raster through ``label_map`` and
        ``reduce_zero_label``, a palette decode, or vector features rasterised in the image's
        grid); nodata and ``boundary_ignore`` are not applied. Label values that are no class
        stop with the file named.

        Example::

            label = ds.read_label(0, Window(0, 0, 512, 512))
        """
        s = self._scenes[scene_index]
        if self.palette is not None:
            label = self._palette_labels(self._read(s['label'], window, [1, 2, 3]), s.get('label_nodata'))
            label[label < 0] = self.ignore_index  # off-palette noise: ignored, not an error
        else:
            label = (self._map_labels(self._vector_window(s, window)) if s.get('vector')
                     else self._map_labels(*self._read_label_values(s, window)))
            if label.min(initial=0) < 0:
                raw_label = self._read(s['label'], window, 1)
                raise DataError(
                    f"{s['label']}: label value {raw_label[label < 0].flat[0]} in window {window} is "
                    f"not a class index 0..{self.num_classes - 1} nor ignore_index "
                    f"{self.ignore_index}; check `classes` or remap the labels")
        return label

    def _read_window(self, scene, y, x, h, w):
        """Image in file units, label, nodata mask (None: none) and nodata share of the ``h`` x
        ``w`` window at (y, x), padded past the scene's edge (padding counts as nodata).

        Nodata pixels are ``ignore_index`` in the label here; zeroing them in the input happens
        after normalisation, on the device (:class:`~ds_seg.data.preprocess.BatchPreprocessor`).
        """
        s = self._scenes[scene]
        rh = min(h, s['height'] - y)
        rw = min(w, s['width'] - x)
        window = Window(int(x), int(y), int(rw), int(rh))
        reads = [self._read(p, window, self.bands, s) for p in s.get('dates', (s['image'],))]
        raw = reads[0][0] if len(reads) == 1 else np.concatenate([r for r, _ in reads])
        invalid = None
        for _, bad in reads:  # a pixel that holds no data at any one date is invalid
            if bad is not None:
                invalid = bad if invalid is None else invalid | bad
        label = self._label_with_boundaries(scene, window)
        if raw.dtype != self.image_dtype:
            raw = raw.astype(self.image_dtype)
        nodata_pixels = 0
        if invalid is not None:
            nodata_pixels = int(np.count_nonzero(invalid))
            if nodata_pixels:
                label[invalid] = self.ignore_index
            else:
                invalid = None
        if (rh, rw) != (h, w):
            padded = np.empty((raw.shape[0], h, w), raw.dtype)
            padded[:] = self._fill.reshape(-1, 1, 1)
            padded[:, :rh, :rw] = raw
            padded_label = np.full((h, w), self.ignore_index, label.dtype)
            padded_label[:rh, :rw] = label
            padded_invalid = np.ones((h, w), bool)
            padded_invalid[:rh, :rw] = False if invalid is None else invalid
            raw, label, invalid = padded, padded_label, padded_invalid
            nodata_pixels += h * w - rh * rw
        return raw, label, invalid, nodata_pixels / float(h * w)

    def _label_with_boundaries(self, scene, window):
        """The label of ``window`` with ``boundary_ignore`` applied: the pixels ``evaluate --erode``
        leaves out, whatever the window. The boundary is found on the label read ``r`` pixels past
        the window (a class edge just outside it counts), with a disk, before nodata is marked
        (ignore pixels and nodata are no class: they make no boundary)."""
        r = self.boundary_ignore
        if not r:
            return self.read_label(scene, window)
        s = self._scenes[scene]
        y0, x0 = max(0, window.row_off - r), max(0, window.col_off - r)
        y1 = min(s['height'], window.row_off + window.height + r)
        x1 = min(s['width'], window.col_off + window.width + r)
        halo = self.read_label(scene, Window(x0, y0, x1 - x0, y1 - y0))
        edge = boundary_mask(halo, r, self.ignore_index)
        inside = (slice(window.row_off - y0, window.row_off - y0 + window.height),
                  slice(window.col_off - x0, window.col_off - x0 + window.width))
        label = halo[inside].copy()
        label[edge[inside]] = self.ignore_index
        return label

    def __len__(self):
        return self._num_random if self.mode == 'random' else len(self._grid)

    def __getitem__(self, index):
        index = int(index)
        if index < 0:
            raise IndexError(f"negative index {index}")
        if self.mode == 'random':
            return self._random_sample(index)
        return self._grid_sample(index)

    def _acceptable(self, label, nodata_frac):
        if self.max_nodata_ratio is not None and nodata_frac > self.max_nodata_ratio:
            return False
        if self.cat_max_ratio is not None:
            counts = np.bincount(label[label != self.ignore_index].ravel().astype(np.int64))
            counts = counts[counts > 0]
            # mmseg's RandomCrop rule: accept only windows with 2+ classes, none above the ratio.
            if len(counts) < 2 or counts.max() / counts.sum() >= self.cat_max_ratio:
                return False
        return True

    def _random_sample(self, index):
        # One generator per sample, a pure function of (seed, index). Python's Mersenne Twister
        # rather than numpy's: seeding it costs 5 us instead of 16, which matters at ~150 us a
        # window. The three augmentation draws come first and are always taken, so turning
        # augmentation (or retries) on or off leaves the positions unchanged.
        rng = random.Random((self.seed % 2 ** 64) << 64 | index)
        hflip, vflip, turn = rng.random() < 0.5, rng.random() < 0.5, rng.randrange(4)
        scale = self.scale_for_index(index)
        h = max(1, int(round(self.crop_h / scale)))
        w = max(1, int(round(self.crop_w / scale)))
        retries = self.max_retries if (self.cat_max_ratio is not None or self.max_nodata_ratio is not None) else 0
        for attempt in range(retries + 1):
            if self._rcs_classes is not None:
                scene, y, x = self._rare_class_window(rng, h, w)
            else:
                scene = min(bisect.bisect_right(self._scene_cdf, rng.random()), len(self._scenes) - 1)
                s = self._scenes[scene]
                y = rng.randrange(max(s['height'] - h, 0) + 1)
                x = rng.randrange(max(s['width'] - w, 0) + 1)
            image, label, invalid, nodata_frac = self._read_window(scene, y, x, h, w)
            if attempt == retries or self._acceptable(label, nodata_frac):
                break  # like mmseg: after the last retry, keep what we have
        if (h, w) != (self.crop_h, self.crop_w):
            if invalid is not None:
                image[:, invalid] = self._fill[:, None]  # so nodata does not bleed into its neighbours
            image, label, invalid = resize(image, label, invalid, (self.crop_h, self.crop_w))
        if self.transforms:
            image, label, invalid = self.transforms(image, label, np.random.default_rng([self.seed, index, 1]), invalid)
        sample = self._sample(image, label, invalid)
        if self.augment:
            # Flips and rotations run on the device (BatchPreprocessor): here they would cost a
            # worker as much as the read. Non-square crops turn by 180 degrees only.
            sample['geom'] = geom_code(hflip, vflip, turn if self.crop_h == self.crop_w else 2 * (turn % 2))
        if self.random_scale is not None:
            sample['scale'] = scale  # what was used: lets tests and users check rank agreement
        return sample

    def _sample(self, image, label, invalid):
        image = torch.from_numpy(np.ascontiguousarray(image))
        label = torch.from_numpy(np.ascontiguousarray(label, dtype=self.label_dtype))
        nodata = (torch.from_numpy(np.zeros(label.shape, bool)) if invalid is None
                  else torch.from_numpy(np.ascontiguousarray(invalid)))
        return dict(image=image, label=label, nodata=nodata)

    def _grid_sample(self, index):
        scene, y, x, top, left = (int(v) for v in self._grid[index % len(self._grid)])
        image, label, invalid, _ = self._read_window(scene, y, x, self.crop_h, self.crop_w)
        if index >= len(self._grid):
            label[:] = self.ignore_index  # padding for equal shards across ranks: counts nothing
        else:
            label[:top] = self.ignore_index
            label[:, :left] = self.ignore_index
        return self._sample(image, label, invalid)

    def window(self, index):
        """(image path, label path, rasterio Window) of grid window ``index``; for stitching."""
        scene, y, x, _, _ = (int(v) for v in self._grid[index % len(self._grid)])
        s = self._scenes[scene]
        return s['image'], s['label'], Window(x, y, min(self.crop_w, s['width'] - x),
                                              min(self.crop_h, s['height'] - y))

    @property
    def scenes(self):
        """Per-scene ``dict(image, label, width, height, count, nodata, masked, dtype, floating)``."""
        return [dict(s) for s in self._scenes]


def _short_list(values):
    """Numbers as a config writes them: [100.0, 200.0]."""
    return '[' + ', '.join(f'{float(v):g}' for v in values) + ']'
