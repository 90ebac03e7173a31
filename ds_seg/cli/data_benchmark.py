"""Data loading benchmark: the dataset's windows/s per worker against a raw rasterio loop.

    python launch/data_benchmark.py                         # synthetic 2048 px scenes, crop 256
    python launch/data_benchmark.py --config configs/unet_geotiff_scenes.py --crop 512
    python launch/data_benchmark.py --train-steps 0         # skip the short training run
    python launch/data_benchmark.py --bands 4 --dtype uint16 --crop 512   # multiband uint16
    python launch/data_benchmark.py --http --train-steps 0  # also: the same files over HTTP

Three figures, all from this run on the same files:

1. raw: a plain loop of ``rasterio`` windowed reads (image bands + label) at random positions,
   handles opened once: the floor cost of getting the pixels off disk.
2. dataset: ``dataset[i]`` in this process (= one worker), i.e. the same reads plus label
   decoding, nodata masking, the sample's random draws and conversion to tensors. The ratio
   dataset/raw says how much the pipeline adds (target >= 0.8x). Raw and dataset runs are
   interleaved and repeated, and the best of each is kept, so a noisy neighbour on the machine
   cannot favour one side. Normalisation and flips/rotations are not in the worker: they run
   on the device after the copy (``BatchPreprocessor``), measured separately as
   "device step" (on the GPU if there is one, else on this CPU).
   With ``--http`` the same files are also read over HTTP (a Range-honouring server on
   127.0.0.1, GDAL's /vsicurl/ with the dataset's remote settings): windows/s and bytes
   fetched per window, local vs HTTP, with ``--latency-ms`` added to every request to mimic
   object storage.
3. loader: ``build_train_loader`` with ``--workers`` workers (total and per worker), and the
   share of step time spent waiting for data inside a short ``launch/train.py`` run
   (``data_wait_frac`` from its ``metrics.jsonl``).
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ds_seg.inputs import user_path
from ds_seg.cli import OneLineParser, same_package_env
from ds_seg.config import load_config
from ds_seg.data import build_train_loader
from ds_seg.registry import DATASETS, build


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', type=user_path, default=None, help='experiment config whose data.train is measured; '
                   'default: SyntheticAerial with --num-scenes scenes of --scene-size px')
    p.add_argument('--cfg-options', nargs='+', action='extend', default=[], metavar='KEY=VALUE')
    p.add_argument('--crop', type=int, default=256)
    p.add_argument('--scene-size', type=int, default=2048)
    p.add_argument('--num-scenes', type=int, default=4)
    p.add_argument('--bands', type=int, default=3, help='synthetic scenes: band count')
    p.add_argument('--dtype', default='uint8', choices=['uint8', 'uint16'], help='synthetic scenes: pixel type')
    p.add_argument('--windows', type=int, default=300, help='windows per timed pass')
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--micro-batch', type=int, default=8)
    p.add_argument('--train-steps', type=int, default=30, help='0: skip the training run')
    p.add_argument('--cache-dir', default=None, help='where synthetic scenes are written')
    p.add_argument('--compress', nargs='+', default=['none', 'deflate'], choices=['none', 'deflate', 'zstd', 'lzw'],
                   help="file variants measured: 'none' = the files as they are; 'deflate', 'zstd', "
                   "'lzw' = tiled copies with that compression, in a temporary folder ($TMPDIR) removed "
                   "afterwards (real scenes usually are compressed)")
    p.add_argument('--http', action='store_true', help='also read every variant over HTTP from 127.0.0.1')
    p.add_argument('--latency-ms', type=float, default=0.0, help='--http: delay added to each request')
    p.add_argument('--out', type=user_path, default=None, help='also write the figures to this JSON file')
    args = p.parse_args(argv)
    for flag, low in (('crop', 16), ('scene_size', 16), ('num_scenes', 1), ('bands', 1), ('windows', 1),
                      ('repeats', 1), ('workers', 0), ('micro_batch', 1), ('train_steps', 0), ('latency_ms', 0)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    if args.out is not None:  # checked before minutes of measuring: it overwrote a file, or failed at the end
        folder = os.path.dirname(os.path.abspath(args.out))
        if not args.out or os.path.exists(args.out) or os.path.islink(args.out):
            p.error(f"--out {args.out!r}: {'already exists' if args.out else 'is empty'}; give a new file name")
        if not os.path.isdir(folder):
            from ds_seg.inputs import missing_folder
            p.error(f"--out {args.out}: {missing_folder(folder)}")
    if 0 < args.train_steps <= TRAIN_WARMUP_STEPS:  # every step would be warm-up: no figure, "failed"
        p.error(f'--train-steps {args.train_steps}: the training run\'s first {TRAIN_WARMUP_STEPS} steps are '
                f'warm-up, not timed; give at least {TRAIN_WARMUP_STEPS + 1} (or 0 to skip the training run)')
    if args.latency_ms and not args.http:  # it delays the HTTP server's replies, and there would be none
        p.error(f'--latency-ms {args.latency_ms:g} delays the --http reads, which are not asked for; add --http')
    if args.cfg_options and not args.config:  # they would be dropped: the synthetic set has its own flags
        p.error('--cfg-options needs --config; without one the scenes are set by --scene-size, '
                '--num-scenes, --bands and --dtype')
    if not args.config and args.crop > args.scene_size:  # before the scenes are written (see main)
        p.error(f'--crop {args.crop} is larger than the --scene-size {args.scene_size} scenes; '
                'give a crop that fits in a scene')
    return args


def build_dataset(args):
    if args.config:
        cfg = load_config(args.config, args.cfg_options)
        data = dict(cfg.data.train)
    else:
        data = dict(type='SyntheticAerial', split='train', num_scenes=args.num_scenes,
                    scene_size=args.scene_size, bands=args.bands, dtype=args.dtype)
        if args.cache_dir:
            data['cache_dir'] = args.cache_dir
    return build(DATASETS, data, where='data.train', crop_size=args.crop, seed=0), data


def compressed_copy(ds, compress, directory):
    """The same scenes rewritten tiled with ``compress`` into ``directory`` (a temporary folder of
    this run: copies in the data's own folder, named by file name alone, measured a second scene
    of the same name as the first's copy, and went stale when a scene changed), as a
    GeoTiffScenes with ds's settings. Tiles keep the scene's block size where it is a valid GeoTIFF
    tile (a multiple of 16); striped scenes get 256 x 256 tiles (their strip shape was refused)."""
    import rasterio
    import rasterio.shutil
    from ds_seg.data import GeoTiffScenes
    def copy(i, path):
        dst = os.path.join(directory, f'{compress}_{i}_{os.path.basename(path)}')
        with rasterio.open(path) as src:
            block = src.block_shapes[0]
        tile = block if all(b >= 16 and b % 16 == 0 for b in block) else (256, 256)
        rasterio.shutil.copy(path, dst, driver='GTiff', compress=compress, tiled=True,
                             blockxsize=tile[1], blockysize=tile[0], predictor=2)
        return dst

    images, labels = [], []
    for i, s in enumerate(ds.scenes):
        # Every date of a time series (its first alone was copied, and the 6 per-date means refused).
        dates = [copy(i, path) for path in scene_images(s)]
        images.append(dates if 'dates' in s else dates[0])
        labels.append(copy(i, s['label']))
    return GeoTiffScenes(images, labels, crop_size=ds.crop_h, classes=ds.classes, mean=ds.mean, std=ds.std,
                         bands=ds.bands, ignore_index=ds.ignore_index, palette=ds.palette)


def scene_images(s):
    """The image files a window of scene ``s`` reads: each date of a time series, else its one image."""
    return list(s.get('dates', (s['image'],)))


def http_rate(ds, args):
    """(windows/s, bytes per window) of ``ds``'s files served over HTTP from 127.0.0.1."""
    from ds_seg.data import GeoTiffScenes
    from ds_seg.data.rangeserver import RangeServer
    paths = [p for s in ds.scenes for p in (*scene_images(s), s['label'])]
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    with RangeServer(root, latency_s=args.latency_ms / 1000) as server:
        def url(p):
            return server.url(os.path.relpath(os.path.abspath(p), root))
        images = [[url(p) for p in scene_images(s)] if 'dates' in s else url(s['image']) for s in ds.scenes]
        remote = GeoTiffScenes(images, [url(s['label']) for s in ds.scenes], crop_size=ds.crop_h, classes=ds.classes,
                               mean=ds.mean, std=ds.std, bands=ds.bands, ignore_index=ds.ignore_index,
                               palette=ds.palette, check_labels=0)
        dataset_loop(remote, 5, offset=10 ** 6)  # open the files (headers) before timing
        rates, fetched = [], []
        for r in range(args.repeats):
            server.reset()
            rates.append(dataset_loop(remote, args.windows, offset=r * args.windows))
            fetched.append(server.bytes_served / args.windows)
    return rates, float(np.median(fetched))


def raw_loop(scenes, bands, label_bands, crop, n, seed, handles):
    """The reference: rasterio windowed reads of image and label, nothing else, through
    ``handles`` (path -> open dataset) kept open across passes as the dataset keeps its own:
    opening them in each timed pass timed the opens and dropped GDAL's block cache, and the
    dataset looked 1.6x faster than the plain reads it makes."""
    from rasterio.windows import Window
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for _ in range(n):
        s = scenes[int(rng.integers(len(scenes)))]
        y = int(rng.integers(0, max(s['height'] - crop, 0) + 1))
        x = int(rng.integers(0, max(s['width'] - crop, 0) + 1))
        w = Window(x, y, min(crop, s['width'] - x), min(crop, s['height'] - y))
        for path in scene_images(s):  # every date, as the dataset reads (the first alone halved the ratio)
            handles[path].read(indexes=bands, window=w)
        handles[s['label']].read(indexes=label_bands, window=w)
    return n / (time.perf_counter() - t0)


def dataset_loop(ds, n, offset):
    t0 = time.perf_counter()
    for i in range(offset, offset + n):
        ds[i]
    return n / (time.perf_counter() - t0)


def device_step_rate(ds, micro_batch, n, device):
    """Windows/s of the trainer's device step (normalise, nodata, flips) on loader batches."""
    import torch
    import torch.utils.data
    from ds_seg.data import BatchPreprocessor
    prep = BatchPreprocessor.for_dataset(ds)
    batches = [torch.utils.data.default_collate([ds[b * micro_batch + j] for j in range(micro_batch)])
               for b in range(4)]
    nbytes = sum(v.numel() * v.element_size() for v in batches[0].values() if torch.is_tensor(v))
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    prep(batches[0], device)
    sync()
    reps = max(2, n // micro_batch)
    t0 = time.perf_counter()
    for i in range(reps):
        prep(batches[i % len(batches)], device)
    sync()
    return reps * micro_batch / (time.perf_counter() - t0), nbytes


def loader_rate(ds, workers, micro_batch, n):
    loader = build_train_loader(ds, micro_batch, rank=0, world_size=1, num_workers=workers,
                                prefetch_factor=2)
    it = iter(loader)
    next(it)  # worker start-up is not throughput
    batches = max(2, n // micro_batch)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches * micro_batch / (time.perf_counter() - t0)
    del it
    return rate


TRAIN_WARMUP_STEPS = 2   # the training run's first steps, untimed (compilation, first batches)


def training_wait(args, data):
    """data_wait_frac from a short training run (``python -m ds_seg.cli.train``, what
    launch/train.py runs) on the same data."""
    from ds_seg.config import load_ds_config
    with tempfile.TemporaryDirectory() as work:
        # The model and batch measured: the config with all its --cfg-options (model ones too),
        # and --micro-batch (the run trained zero2.json's 8, and the config's model without them).
        ds = {k: v for k, v in load_ds_config('zero2').items() if k != 'train_batch_size'}
        ds.update(train_micro_batch_size_per_gpu=args.micro_batch, gradient_accumulation_steps=1)
        ds_path = os.path.join(work, 'ds_config.in.json')
        with open(ds_path, 'w') as f:
            json.dump(ds, f)
        options = [*(args.cfg_options or []), f'train.max_steps={args.train_steps}', 'train.log_interval=5',
                   'train.eval_interval=0', 'train.checkpoint_interval=0',
                   f'train.warmup_log_steps={TRAIN_WARMUP_STEPS}', f'data.crop_size={args.crop}',
                   f'data.num_workers={args.workers}', f'data.train={json.dumps(data)}']
        run = os.path.join(work, 'run')
        cmd = [sys.executable, '-m', 'ds_seg.cli.train', '--work-dir', run, '--deepspeed_config', ds_path]
        if args.config:
            cmd += ['--config', args.config]
        cmd += ['--cfg-options'] + options
        env = same_package_env(OMP_NUM_THREADS=os.environ.get('OMP_NUM_THREADS', '1'))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        path = os.path.join(run, 'metrics.jsonl')
        if proc.returncode != 0 or not os.path.exists(path):
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            return None, None, {}
        rows = [json.loads(line) for line in open(path) if line.strip()]
        waits = [r['data_wait_frac'] for r in rows if r.get('data_wait_frac') is not None]
        steps = [r['step_time_s'] for r in rows if r.get('step_time_s') is not None]
        with open(os.path.join(run, 'ds_config.json')) as f:   # what the run trained, as it recorded it
            trained = dict(micro_batch=json.load(f)['train_micro_batch_size_per_gpu'])
        with open(os.path.join(run, 'config.json')) as f:
            trained['model'] = json.load(f)['model']['type']
        return (float(np.mean(waits)) if waits else None), (float(np.median(steps)) if steps else None), trained


def passes(rates):
    return ', '.join(f'{v:.0f}' for v in rates)


def measure(ds, label_bands, args):
    import rasterio
    scenes = ds.scenes
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(rasterio.open(path))
                   for s in scenes for path in (*scene_images(s), s['label'])}
        # Warm the OS page cache and GDAL for both sides alike before timing anything.
        raw_loop(scenes, ds.bands, label_bands, args.crop, args.windows, 99, handles)
        dataset_loop(ds, args.windows, offset=10 ** 6)
        raw, mine = [], []
        for r in range(args.repeats):
            raw.append(raw_loop(scenes, ds.bands, label_bands, args.crop, args.windows, r, handles))
            mine.append(dataset_loop(ds, args.windows, offset=r * args.windows))
    return raw, mine


def measure_variant(ds, compress, copies, label_bands, args, result):
    """Print and record the figures of one file variant ('none': the files as they are)."""
    target = ds if compress == 'none' else compressed_copy(ds, compress, copies)
    raw, mine = measure(target, label_bands, args)
    raw_best, mine_best = max(raw), max(mine)
    result['variants'][compress] = dict(raw_windows_per_s=raw_best, dataset_windows_per_s=mine_best,
                                        ratio=mine_best / raw_best)
    print(f'[{compress:>7}] raw rasterio loop : {raw_best:8.1f} windows/s  (passes: {passes(raw)})')
    print(f'[{compress:>7}] dataset, 1 worker : {mine_best:8.1f} windows/s  (passes: {passes(mine)})')
    print(f'[{compress:>7}] ratio dataset/raw : {mine_best / raw_best:8.2f}x   (target >= 0.8x)')
    if args.http:
        rates, per_window = http_rate(target, args)
        size = sum(os.path.getsize(p) for s in target.scenes for p in (*scene_images(s), s['label']))
        result['variants'][compress].update(http_windows_per_s=max(rates), http_bytes_per_window=per_window,
                                            files_bytes=size, http_latency_ms=args.latency_ms)
        print(f'[{compress:>7}] dataset over HTTP : {max(rates):8.1f} windows/s  (passes: '
              f'{passes(rates)}; {per_window / 1024:.0f} KiB fetched per window, '
              f'files {size / 2 ** 20:.0f} MiB; +{args.latency_ms:g} ms per request)')


def main(argv=None):
    from ds_seg.config import ConfigError
    from ds_seg.registry import RegistryError
    args = parse_args(argv)
    try:
        ds, data = build_dataset(args)
    except (ConfigError, RegistryError, ValueError, OSError) as exc:  # the data a user pointed at
        print(f'data_benchmark: error: {exc}', file=sys.stderr)
        return 2
    scenes = ds.scenes
    vector = next((s['label'] for s in scenes if s.get('vector')), None)
    if vector:  # the raw reference reads label rasters: rasterio.open(x.gpkg) was a traceback
        print(f'data_benchmark: error: {vector}: vector labels, which the raw rasterio reference cannot read as '
              'it reads a label raster; to compare the reads, benchmark the scenes with raster labels '
              '(gdal_rasterize them once)', file=sys.stderr)
        return 2
    if all(args.crop > min(s['width'], s['height']) for s in scenes):
        # The dataset pads each window to the crop, the raw loop reads the scene: unequal work.
        print(f'data_benchmark: error: --crop {args.crop} is larger than every scene (the largest is '
              f"{max(s['width'] for s in scenes)}x{max(s['height'] for s in scenes)}); give a crop that fits "
              'in a scene', file=sys.stderr)
        return 2
    label_bands = [1, 2, 3] if getattr(ds, 'palette', None) is not None else 1
    total_px = sum(s['width'] * s['height'] for s in scenes)
    print(f'[data_benchmark] {type(ds).__name__}: {len(scenes)} scene(s), {total_px / 1e6:.1f} Mpx, '
          f'{ds.in_channels} band(s), crop {args.crop}, {args.windows} windows x {args.repeats} passes')
    result = dict(dataset=type(ds).__name__, crop=args.crop, scenes=len(scenes), variants={})
    with tempfile.TemporaryDirectory(prefix='ds_seg_benchmark_copies_') as copies:  # $TMPDIR
        for compress in args.compress:
            measure_variant(ds, compress, copies, label_bands, args, result)
    import torch
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    rate, nbytes = device_step_rate(ds, args.micro_batch, args.windows, device)
    h, w = ds[0]['label'].shape
    float_bytes = args.micro_batch * h * w * (4 * ds.in_channels + 8)  # float32 image + int64 label
    result.update(device=device.type, device_step_windows_per_s=rate, batch_bytes=nbytes,
                  batch_bytes_float32_int64=float_bytes)
    print(f'device step on {device.type:<5}   : {rate:8.1f} windows/s (normalise, nodata, flips; '
          f'{torch.get_num_threads()} thread(s))')
    print(f'batch of {args.micro_batch} crosses as  : {nbytes / 2 ** 20:8.2f} MiB  (as float32 image + int64 label: '
          f'{float_bytes / 2 ** 20:.2f} MiB)')
    if args.workers > 0:
        rate = loader_rate(ds, args.workers, args.micro_batch, args.windows * 2)
        result.update(loader_workers=args.workers, loader_windows_per_s=rate,
                      loader_windows_per_s_per_worker=rate / args.workers)
        print(f'loader, {args.workers} workers     : {rate:8.1f} windows/s total, {rate / args.workers:.1f} per worker '
              f'({os.cpu_count()} CPU cores here)')
    if args.train_steps:
        wait, step, trained = training_wait(args, data)
        result.update(train_steps=args.train_steps, data_wait_frac=wait, step_time_s=step, **trained)
        if wait is None:
            print('training run           : failed (see above)')
        else:
            print(f'training, {args.train_steps} steps   : data wait {100 * wait:.1f}% of step time '
                  f"(median step {step:.3f} s; {trained['model']}, micro-batch {trained['micro_batch']}, "
                  f'{args.workers} worker(s))')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
