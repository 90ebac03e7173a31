"""Label whole GeoTIFF scenes of any size with a trained model.

    python launch/predict.py --checkpoint work_dirs/default/weights_step_00000400.pt \\
        --input scene.tif [more.tif ...] --output predictions/ [--probs] [--tta hv]
    torchrun --nproc_per_node 4 launch/predict.py --checkpoint work_dirs/default ...   # bands of rows per rank

Per input ``<name>.tif`` it writes ``<name>_classes.tif``: uint8 class indices with the input's
CRS, transform and size, tiled and ZSTD-compressed, 255 where the input is nodata, the class
names in the tags and a colour table (opens coloured in QGIS); with ``--probs`` also
``<name>_probs.tif`` (one uint8 band per class, probability x 250); with ``--vector out.gpkg``
(or ``.geojson``, ``.fgb``) also the class regions as polygons (``class_id``, ``class_name``,
``area_m2``, ``mean_prob`` with ``--probs``; ``--simplify``, ``--min-area``, ``--exclude-classes``).
Memory is bounded by a band of ``tile + block`` rows, not by the scene. ``--checkpoint`` takes a weights file from
launch/export.py, a ``step_*`` folder, a checkpoints folder or a work dir, or an ``.onnx`` file
from ``launch/export.py --format onnx`` (run with onnxruntime on the CPU).
"""
import argparse
import math
import os
import sys
import time
import warnings

import torch

from ds_seg import distributed
from ds_seg.cli import OneLineParser, exit_without_finalization, outlive_stdout, run_command
from ds_seg.config import ConfigError
from ds_seg.data.geotiff import configure_gdal_for_worker, dates_out_of_name_order
from ds_seg.data.raster import StackedRaster, untagged_fill_refusal
from ds_seg.inference import BLENDS, TTA_FLIPS, load_model, predict_scene
from ds_seg.inference.model import fixed_input_size, window_refusal
from ds_seg.inputs import (user_path, check_bands, check_checkpoint_option, check_output_folder, check_outputs,
                           check_window_options, check_writable, refuse_inside_checkpoints, expand_inputs, output_stems,
                           split_dates, written_by_predict)
from ds_seg.telemetry import format_eta
from ds_seg.vectorize import (add_vector_args, check_vector_options, exclude_ids, vector_outputs,
                              vectorize_class_map)


DEFAULT_TILE = 512


def add_window_args(parser, tile_default=f'{DEFAULT_TILE}'):
    """The sliding-window options predict.py and evaluate.py share (``--tile`` is None when not
    given: each program says what it defaults to)."""
    parser.add_argument('--tile', type=int, default=None, help=f'window size in pixels (default {tile_default})')
    parser.add_argument('--overlap', type=int, default=None, help='overlap of windows (default tile/4)')
    parser.add_argument('--batch-size', type=int, default=8, help='windows per forward call (default 8)')
    parser.add_argument('--blend', choices=BLENDS, default='gaussian',
                        help="weights of overlapping windows: 'gaussian' (default) or 'linear' fall off towards a "
                             "window's edges; 'none' weighs every pixel of a window alike")
    parser.add_argument('--tta', choices=sorted(TTA_FLIPS), default='none',
                        help="flip test-time augmentation: 'h' (2 forwards) or 'hv' (4)")
    parser.add_argument('--block', type=int, default=256,
                        help='rows of the scene computed before they are written or scored, and the GeoTIFF '
                             'tile size of outputs; a multiple of 16 up to 4096 (default 256)')
    parser.add_argument('--mean', type=float, nargs='+', default=None,
                        help='per-band mean of training, given with --std (default: both recorded in the '
                             'checkpoint)')
    parser.add_argument('--std', type=float, nargs='+', default=None, help='per-band std of training, given with --mean')
    parser.add_argument('--bands', type=int, nargs='+', default=None, help='1-based bands to read')
    parser.add_argument('--device', default=None, help='cpu, cuda, cuda:1 (default: cuda if available)')
    parser.add_argument('--cpu-threads', type=int, default=None, help='torch threads on CPU')


def quiet_about_plain_images(body):
    """``body`` with rasterio's NotGeoreferencedWarning silenced: a PNG, JPEG or plain TIFF is a
    valid input (its class map has no georeferencing either; --vector refuses it), and each open
    of it printed two lines of warning with rasterio's source path, which read like an error."""
    from rasterio.errors import NotGeoreferencedWarning

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', NotGeoreferencedWarning)
            return body()
    return run


def window_kwargs(args, tile_said=None):
    check_window_options(args.tile, args.overlap, args.batch_size, args.block, tile_said)
    if args.cpu_threads is not None and args.cpu_threads < 1:  # was torch's traceback at setup
        raise ConfigError(f"--cpu-threads must be at least 1, got {args.cpu_threads} "
                          f"(leave it out for torch's default)")
    return dict(tile=args.tile, overlap=args.tile // 4 if args.overlap is None else args.overlap,
                batch_size=args.batch_size, blend=args.blend, tta=args.tta, block=args.block)


def setup(args):
    """Process group (only under a launcher), device, GDAL cache; returns the device."""
    if int(os.environ.get('WORLD_SIZE', '1')) > 1 or 'SLURM_NTASKS' in os.environ and int(os.environ['SLURM_NTASKS']) > 1:
        distributed.init(use_deepspeed=False)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    configure_gdal_for_worker(cache_mb=256)
    if args.device:
        return check_device(args.device)
    return distributed.device()


def check_device(name):
    """``--device`` as a torch device that exists here; a misspelt one or a GPU this machine
    does not have is one line, not a traceback at the first forward."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device; give cpu, cuda or cuda:N") from None
    if device.type == 'cuda':
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {name}: no CUDA GPU is visible on this machine; use --device cpu")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
    elif device.type == 'meta':  # shapes without data: every forward fails deep in the model
        raise ConfigError(f"--device {name}: holds no data, so nothing can be computed on it; give cpu, cuda or cuda:N")
    elif device.type != 'cpu' and not getattr(getattr(torch, device.type, None), 'is_available', lambda: False)():
        raise ConfigError(f"--device {name}: no {device.type} device is available here; use --device cpu")
    return device


def normalisation(args, info, fallback=None):
    """mean/std/bands: the command line, else the checkpoint, else ``fallback`` (a dataset)."""
    data = info.get('data') or {}
    if (args.mean is None) != (args.std is None):
        # One of the two beside the checkpoint's other: statistics of two datasets, silently.
        given, missing = ('--mean', '--std') if args.std is None else ('--std', '--mean')
        raise ConfigError(f"{given} without {missing}: the two describe one set of scenes and go together; give "
                          f"{missing} too (one per band), or neither to use the checkpoint's")
    mean = args.mean or data.get('mean') or (list(fallback.mean) if fallback is not None else None)
    std = args.std or data.get('std') or (list(fallback.std) if fallback is not None else None)
    bands = args.bands or data.get('bands') or (list(fallback.bands) if fallback is not None else None)
    if mean is None or std is None:
        raise ValueError('the checkpoint does not record the training normalisation (made before it '
                         'was saved); give --mean and --std per band, e.g. from stats.json of the '
                         'training data')
    # (value - mean) / std: a std <= 0 or a NaN turns every window into garbage or infinities.
    for name, given, values in (('--mean', args.mean, mean), ('--std', args.std, std)):
        where = name if given else f'the {name[2:]} recorded in the checkpoint'
        if not all(math.isfinite(float(v)) for v in values) or name == '--std' and min(values) <= 0:
            raise ConfigError(f"{where} ({' '.join(f'{float(v):g}' for v in values)}): every value must be "
                              f"finite{' and > 0' if name == '--std' else ''}")
    channels = (info.get('model') or {}).get('in_channels')
    for name, given, values in (('--mean', args.mean, mean), ('--std', args.std, std)):
        if given and channels and len(values) != channels:
            pick = (f" (for a scene with more bands, pick the model's {channels} with --bands, "
                    f"e.g. --bands {' '.join(str(b) for b in range(1, channels + 1))})" if len(values) > channels else '')
            raise ConfigError(f"{name} has {len(values)} value(s) but the model takes {channels} band(s); "
                              f"give one {name[2:]} per band{pick}")
    if len(mean) != len(std):
        raise ConfigError(f"--mean has {len(mean)} value(s) but --std {len(std)}; give one of each per band")
    return [float(v) for v in mean], [float(v) for v in std], bands


class Progress:
    """Prints ``windows done/total, windows/s, ETA`` every few seconds on rank 0."""

    def __init__(self, name, every_s=5.0, program='predict'):
        self.name, self.every_s, self.last, self.program = name, every_s, 0.0, program

    def __call__(self, done, total, elapsed):
        if not distributed.is_main() or (elapsed - self.last < self.every_s and done < total):
            return
        self.last = elapsed
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else None
        print(f'[{self.program}] {self.name}: {done}/{total} windows ({100 * done / max(total, 1):.0f}%) | '
              f'{rate:.1f} windows/s | ETA {format_eta(eta)}', flush=True)


def check_vector_georeference(path, out_path):
    """Polygons are written in the class map's geotransform and CRS, which are the scene's: refused
    before any window where the scene has none, or ``out_path`` (GeoJSON) cannot carry its CRS
    (see ``vectorize.georeference_refusal`` and ``geojson_crs_refusal``)."""
    from ds_seg.data.raster import open_raster
    from ds_seg.vectorize import geojson_crs_refusal, georeference_refusal
    with open_raster(path) as src:
        refusal = georeference_refusal(src, path) or geojson_crs_refusal(src.crs, path, out_path)
        if refusal:
            raise ConfigError(f"--vector: {refusal}; then predict on that scene, or leave out --vector")
        # Before the process group exists: the launcher's RANK says who prints.
        if src.crs is None and os.environ.get('RANK', '0') == '0':  # usable, but nothing says what the units are
            print(f"[predict] --vector: {path} has a geotransform but no CRS: the polygons carry none, and "
                  "area_m2 takes its map units for metres (gdal_edit.py -a_srs EPSG:<code> sets it)", flush=True)


def load_forward(path, device, threads=None):
    """``(forward, info)`` for predict.py and evaluate.py alike: an ``.onnx`` export runs in
    onnxruntime on the CPU (no model code needed), anything else is loaded as a PyTorch model."""
    from ds_seg.inputs import looks_like_onnx
    if os.path.isfile(path):
        with open(path, 'rb') as f:
            if looks_like_onnx(path, f.read(4)):
                from ds_seg.deploy import load_onnx
                return load_onnx(path, threads=threads)
    return load_model(path, device)


def window_channels(info, bands):
    """The bands of one window: the model's in_channels, else the bands recorded (or given)."""
    return (info.get('model') or {}).get('in_channels') or (len(bands) if bands else None)


def tile_from_model(args, info, forward_fn, bands, device, program):
    """--tile not given: a model built for one input size (a Swin's ``img_size``) predicts in
    windows of that size; the 512 px default was refused by a Swin trained at 256. A model that
    takes the default (a ViT resamples its position embeddings) keeps it. Returns how a refusal of
    the window options names that tile, or None where the tile stays as it was."""
    size = fixed_input_size(info.get('model'))
    channels = window_channels(info, bands)
    if (size is None or size == args.tile or not channels
            or window_refusal(forward_fn, channels, args.tile, device) is None):
        return None
    args.tile = size
    print(f"[{program}] windows of {size} px: the model's img_size (--tile sets another size)", flush=True)
    return f"the model's img_size {size} (the default tile of this model; --tile sets another)"


def check_tile_fits(forward_fn, info, tile, bands, device):
    """One forward of a blank ``tile`` x ``tile`` window before any scene is read. Every window
    the engine runs has that size (edges are padded; a scene smaller than the tile is tried at
    its own size first), so a model that cannot take it (SegFormer's
    attention reduction below 32 px, an ONNX graph of one fixed size) is one line here, not a
    traceback after the first scenes were written."""
    channels = window_channels(info, bands)
    if not channels:
        return
    name = (info.get('model') or {}).get('type', 'ONNX')
    refusal = window_refusal(forward_fn, channels, tile, device)
    if refusal is None:
        return
    reason, size_is_the_fault = refusal
    if 'allocate' in reason.lower() or 'out of memory' in reason.lower():
        raise ConfigError(f"--tile {tile}: one {tile}x{tile} window of the model ({name}) does not fit in "
                          f"the memory of {device} ({reason}); use a smaller --tile (default 512)")
    advice = '; use a larger --tile (default 512)' if size_is_the_fault else ''
    fixed = fixed_input_size(info.get('model'))
    if not size_is_the_fault and fixed not in (None, tile):
        advice = f"; it takes {fixed} px windows only (its img_size): --tile {fixed}"
    raise ConfigError(f"--tile {tile}: the model ({name}) cannot take {tile}x{tile} windows ({reason}){advice}")


def check_pixel_type(path, info, args, option='--input'):
    """Refused as :func:`ds_seg.inference.model.trained_dtype_refusal` and
    :func:`~ds_seg.inference.model.band_encoding_refusal` say, unless the command line gives the
    statistics for this scene's units."""
    from ds_seg.inference.model import band_encoding_refusal, trained_dtype_refusal
    if args.mean and args.std:
        return
    refusal = trained_dtype_refusal((info.get('data') or {}).get('dtype'), path)
    # The bands' GDAL scale/offset: raw values in another encoding are other units too.
    data = dict(info.get('data') or {}, **({'bands': list(args.bands)} if args.bands else {}))
    refusal = refusal or band_encoding_refusal(data, path)
    if refusal:
        raise ConfigError(f"{option} {refusal}, or give --mean and --std for its units")


def check_scene_values(path, info, bands, option='--input', program='predict'):
    """What a sampled read of the scene tells before any work: an untagged float fill value is
    refused (training refuses it too), another ground resolution than the model's is said."""
    refusal = untagged_fill_refusal(path, bands if bands and max(bands) <= _band_count(path) else None)
    if refusal:
        raise ConfigError(f'{option} {refusal}')
    note = ground_resolution_note(path, info, option)
    if note and distributed.is_main():
        print(f'[{program}] note: {note}', flush=True)


def ground_resolution_note(path, info, option='--input'):
    """A line when the scene's pixels are another ground size than the model was trained at (more
    than 1.5x either way), or None: objects then appear at another size than in training, which a
    segmentation model does not transfer across; the scene is not refused (a model may have been
    trained to generalise), only said."""
    from ds_seg.data.raster import ground_metres_per_unit, open_raster, pixel_size_m
    trained = (info.get('data') or {}).get('pixel_size_m')
    if not trained:
        return None
    with open_raster(path) as src:
        size = pixel_size_m(src)
        per_unit = ground_metres_per_unit(src)
        units = 'degrees' if src.crs is not None and src.crs.is_geographic else 'its CRS units'
    if not size or 1 / 1.5 <= size / trained <= 1.5:
        return None
    ratio = size / trained
    how = f'{ratio:.2g}x coarser' if ratio > 1 else f'{1 / ratio:.2g}x finer'
    # gdalwarp's -tr is in the scene's CRS units: Web Mercator or degrees are not ground metres.
    tr_x, tr_y = trained / per_unit[0], trained / per_unit[1]
    target = f'{trained:.3g} m' if (tr_x, tr_y) == (trained, trained) else f'{trained:.3g} m ({units} {tr_x:.3g} x {tr_y:.3g} here)'
    return (f"{option} {path}: its pixels are {size:.3g} m, {how} than the {trained:.3g} m the model was trained "
            f"at, so objects appear at another size than in training; for the accuracy training measured, resample "
            f"it to {target} (gdalwarp -tr {tr_x:.3g} {tr_y:.3g} -r bilinear IN OUT)")


def check_band_count(path, info, args, option='--input'):
    """Refused as :func:`ds_seg.inference.model.band_count_refusal` says, unless --bands says
    which of the scene's bands are the model's."""
    from ds_seg.inference.model import band_count_refusal
    if args.bands:
        return
    refusal = band_count_refusal(info.get('data'), path)
    if refusal:
        bands = ' '.join(map(str, info['data']['bands']))
        raise ConfigError(f"{option} {refusal} with --bands (e.g. --bands {bands})")


def _written_by_predict(path, kind):
    """Whether ``path`` is a ``kind`` ('probs' or 'vector') output of an earlier predict: its
    probability tags, or exactly the polygon fields the vectoriser writes. Anything else of that
    name (a user's own file) is not ours to remove."""
    if kind == 'probs':
        return written_by_predict(path)
    try:
        import pyogrio
        fields = list(pyogrio.read_info(path)['fields'])
        return fields in (['class_id', 'class_name', 'area_m2'], ['class_id', 'class_name', 'area_m2', 'mean_prob'])
    except Exception:  # unreadable, or not a raster/vector at all: not one of ours
        return False


def remove_earlier_outputs(out, probs, vector, inputs):
    """After ``--overwrite`` wrote the class map ``out``: an earlier run's probabilities or
    polygons of the same scene that this run did not write would sit beside it as if they were
    its own. Removed when an earlier predict wrote them and they are no input of this run."""
    from ds_seg.vectorize import DRIVERS
    stem = out[:-len('_classes.tif')]
    candidates = [] if probs else [(stem + '_probs.tif', 'probs', 'probabilities', '--probs')]
    # Polygons of another format (or of no --vector) than this run's are the earlier run's.
    candidates += [(f'{stem}_classes{ext}', 'vector', 'polygons', '--vector') for ext in DRIVERS
                   if not vector or os.path.abspath(f'{stem}_classes{ext}') != os.path.abspath(vector)]
    real_inputs = {os.path.realpath(p) for p in inputs if os.path.exists(p)}
    for path, kind, what, option in candidates:
        if (os.path.isfile(path) and os.path.realpath(path) not in real_inputs
                and _written_by_predict(path, kind)):
            os.remove(path)
            print(f"[predict] removed {path}: an earlier run's {what}, not this class map's "
                  f"(--overwrite, and this run's {option} writes none there)", flush=True)


def check_name_lengths(paths):
    """An output name longer than its file system takes (255 bytes on most) failed with a
    traceback after the model was loaded: refused before any work, naming the input to rename."""
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            limit = os.pathconf(folder if os.path.isdir(folder) else '.', 'PC_NAME_MAX')
        except (OSError, ValueError):
            limit = 255
        name = os.path.basename(path)
        if len(name.encode()) > limit:
            raise ConfigError(f"--output: the output name {name[:40]}...{name[-20:]} is {len(name.encode())} bytes, "
                              f"more than the {limit} the file system takes; give the input a shorter name (or a "
                              f"link to it)")


def _band_count(path):
    from ds_seg.data.raster import open_raster
    with open_raster(path) as src:
        return src.count


def _run(args):
    """The command after argument parsing; user errors raise (see ds_seg.cli.run_command)."""
    # Every check before any work: a refused command changes no file.
    tile_given = args.tile is not None
    if not tile_given:
        args.tile = DEFAULT_TILE
    windows = window_kwargs(args)
    # 'a_may.tif,a_aug.tif': one scene of several dates (a time series model's input)
    scenes = []
    for item in args.input:
        dates = split_dates(item) if ',' in item and not os.path.exists(item) else [item]
        if len(dates) > 1:  # a file whose name has a comma is one scene, and so is a URL's query
            dates = [os.path.expanduser(d) for d in dates]  # no shell expands '~' after a comma
            if not all(d.strip() for d in dates):
                raise ConfigError(f"--input {item!r}: an empty date; join the dates of one scene with "
                                  f"commas and no spaces (a_may.tif,a_aug.tif)")
            scenes.append(expand_inputs(dates))
            StackedRaster.check(scenes[-1])  # one grid for every date, before any work
        else:
            scenes += expand_inputs([item])
    check_vector_options(args.simplify, args.min_area, prefix='--')
    if args.vector is None and (args.exclude_classes or args.simplify or args.min_area):
        raise ConfigError("--exclude-classes, --simplify and --min-area shape the polygons of --vector; "
                          "add --vector out.gpkg (or .geojson, .fgb)")
    firsts = [s[0] if isinstance(s, list) else s for s in scenes]  # names outputs
    inputs = [p for s in scenes for p in (s if isinstance(s, list) else [s])]
    check_checkpoint_option(args.checkpoint)
    check_output_folder(args.output)
    stems = output_stems(scenes)
    outputs = [[os.path.join(args.output, f'{stem}_{kind}.tif') for kind in ('classes', 'probs')[:1 + args.probs]]
               for stem in stems]
    check_outputs([o for pair in outputs for o in pair], inputs, overwrite=args.overwrite)
    # A GeoPackage raster given as --input and --vector was replaced by the polygons (--overwrite):
    # the input is named before an existing file is.
    vectors = vector_outputs(args.vector, stems, args.output, overwrite=True)
    check_outputs([v for v in vectors if v], inputs, overwrite=args.overwrite, option='--vector')
    for folder in sorted({args.output} | {os.path.dirname(os.path.abspath(v)) for v in vectors if v}):
        check_writable(folder, '--output' if folder == args.output else '--vector')
        refuse_inside_checkpoints(folder, '--output' if folder == args.output else '--vector')
    check_name_lengths([o for pair in outputs for o in pair] + [v for v in vectors if v])
    if args.vector:
        for first, vector in zip(firsts, vectors):
            check_vector_georeference(first, vector)
    device = setup(args)
    model, info = load_forward(args.checkpoint, device, args.cpu_threads)
    mean, std, bands = normalisation(args, info)
    if not tile_given:
        windows = window_kwargs(args, tile_said=tile_from_model(args, info, model, bands, device, 'predict'))
    exclude = exclude_ids(args.exclude_classes, list(info['classes'] or ()), option='--exclude-classes') \
        if args.vector and info['classes'] else args.exclude_classes
    model_cfg = info.get('model') or {}
    for scene in scenes:
        dates = scene if isinstance(scene, list) else [scene]
        # A temporal model's own, or the training data's: a plain model (UNet) takes the stacked bands of
        # every date as its channels, trained from a time series.
        num_dates = model_cfg.get('num_dates') or (info.get('data') or {}).get('num_dates')
        channels = model_cfg.get('in_channels')
        # One file may hold every date already stacked (as many bands as the model's channels).
        stacked = len(dates) == 1 and channels and len(bands or range(_band_count(dates[0]))) == channels
        if not num_dates and len(dates) > 1:  # else its band check would blame --bands
            raise ConfigError(f"--input {','.join(dates)}: {len(dates)} dates, but the model "
                              f"({model_cfg.get('type')}) takes one scene of one date; give the scenes "
                              f"separated by spaces, not commas")
        if num_dates and len(dates) != num_dates and not stacked:
            # One file that holds every date's bands needs --bands naming all of them.
            one_file = (len(dates) == 1 and channels and _band_count(dates[0]) >= channels
                        and f"; or, if {dates[0]} stacks every date's bands, select them: --bands "
                            f"{' '.join(str(b) for b in range(1, channels + 1))}") or ''
            raise ConfigError(f"--input {','.join(dates)}: {len(dates)} date(s), but the model "
                              f"({model_cfg.get('type')}) takes {num_dates}; give the {num_dates} dates "
                              f"of the scene joined by commas (a_may.tif,a_aug.tif){one_file}")
        unordered = dates_out_of_name_order([dates])
        if unordered:  # said in training; here the model saw them swapped (pooling 'diff'/'concat'), without a word
            print(f'[predict] note: --input {",".join(dates)}: {unordered} (give them in the order the model '
                  'was trained on)', flush=True)
        per_date = channels // len(dates) if channels and len(dates) > 1 else None
        if (per_date and not args.bands and list(bands or ()) == list(range(1, channels + 1))
                and _band_count(dates[0]) == per_date):
            # Trained on one file stacking every date: its bands 1..T*C are not each date file's.
            raise ConfigError(f"--input {','.join(dates)}: the model was trained on files stacking every date's "
                              f"{channels} bands; for one file per date, select each date's bands: --bands "
                              f"{' '.join(str(b) for b in range(1, per_date + 1))}")
        for path in dates:  # the model's channels are the bands of every date
            check_bands(path, bands, channels // len(dates) if channels else None,
                        colours=(info.get('data') or {}).get('colours'))
            check_pixel_type(path, info, args)
            check_scene_values(path, info, bands)
            if not (stacked and (num_dates or 1) > 1):  # one file of every date holds more bands
                check_band_count(path, info, args)
    check_tile_fits(model, info, args.tile, bands, device)
    os.makedirs(args.output, exist_ok=True)
    t_all = time.perf_counter()
    for path, first, (out, *rest), vector in zip(scenes, firsts, outputs, vectors):
        probs = rest[0] if rest else None
        with torch.inference_mode():
            stats = predict_scene(model, path, out, mean=mean, std=std, bands=bands,
                                  classes=info['classes'], probs_path=probs, device=device,
                                  accumulate_dtype=args.accumulate_dtype, overwrite=args.overwrite,
                                  progress=Progress(os.path.basename(first)), **windows)
        if distributed.is_main():
            print(f'[predict] {path} -> {out}{" + " + probs if probs else ""} | '
                  f'{stats["windows"]} windows in {stats["seconds"]:.1f} s '
                  f'({stats["windows"] / max(stats["seconds"], 1e-9):.1f} windows/s)', flush=True)
            if args.overwrite:
                remove_earlier_outputs(out, probs, vector, inputs)
        if vector and distributed.is_main():  # the joined class map is complete here
            t = time.perf_counter()
            v = vectorize_class_map(out, vector, probs_path=probs, classes=info['classes'],
                                    simplify=args.simplify, min_area=args.min_area,
                                    exclude=exclude, overwrite=args.overwrite)
            for note in v['notes']:
                print(f'[predict] note: {note}', flush=True)
            print(f'[predict] {out} -> {vector} | {v["features"]} polygons in '
                  f'{time.perf_counter() - t:.1f} s', flush=True)
    if distributed.is_main():
        print(f'[predict] done: {len(scenes)} scene(s) in {time.perf_counter() - t_all:.1f} s')


def main(argv=None):
    if argv is None:   # the command itself: a stdout that closes does not stop it
        outlive_stdout()
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--checkpoint', type=user_path, required=True, help='weights file, step_* folder, checkpoints folder, work dir, or an .onnx export '
                        '(run with onnxruntime on the CPU)')
    parser.add_argument('--input', type=user_path, nargs='+', required=True,
                        help='GeoTIFF scene(s), folders of them, or URLs; the dates of one scene '
                             'joined by commas (a time series model)')
    parser.add_argument('--output', type=user_path, required=True, help='output folder')
    parser.add_argument('--probs', action='store_true', help='also write <name>_probs.tif')
    parser.add_argument('--overwrite', action='store_true', help='replace outputs that already exist')
    parser.add_argument('--accumulate-dtype', choices=('float32', 'float16'), default='float32',
                        help='host accumulators; float16 halves the band memory')
    add_window_args(parser, tile_default=f"{DEFAULT_TILE}, or the model's img_size")
    add_vector_args(parser)
    args = parser.parse_args(argv)
    status = run_command('predict', quiet_about_plain_images(lambda: _run(args)),
                       errors=(FileNotFoundError, FileExistsError, ValueError, KeyError),
                       output=lambda: args.output if os.path.isdir(args.output) else None)
    if argv is None:  # the program, not a call from Python: gloo threads must not meet finalization
        exit_without_finalization(status)
    return status


if __name__ == '__main__':
    sys.exit(main())
