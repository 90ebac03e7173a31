"""Whole-scene prediction benchmark: peak resident memory and windows/s of launch/predict.py.

    python launch/predict_benchmark.py                       # 20000 x 20000 x 3 uint8, UNetTiny
    python launch/predict_benchmark.py --size 4096 --tile 512 --batch-size 2 --model UNetTiny
    python launch/predict_benchmark.py --model BenchPixelNet      # the I/O and blending path alone

Writes the scene once (block row by block row, so generating it needs little memory either)
under ``$DS_SEG_CACHE/benchmark`` (default ``~/.cache/ds_seg/benchmark``), exports a randomly
initialised model to a weights file (speed and memory do not depend on the weights), then runs
``launch/predict.py`` as a child process and prints its peak resident memory (the child's own
``VmHWM``, so neither the scene generation nor this process counts), the windows/s and
megapixels/s, and checks that the output is georeferenced like the input.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import rasterio
import torch
from rasterio.transform import from_origin

from ds_seg.cli import OneLineParser, same_package_env


def make_scene(path, size, bands=3, block=256, source=2048, seed=0):
    """A ``size`` x ``size`` tiled GeoTIFF built from one ``source``-pixel synthetic scene,
    repeated with per-copy flips so neighbouring copies differ; written by block rows."""
    if os.path.exists(path):
        return path
    from ds_seg.data.synthetic import generate_scene
    tile, _ = generate_scene(np.random.default_rng(seed), min(source, size), bands=bands)
    s = tile.shape[1]
    tmp = f'{path}.tmp-{os.getpid()}'
    with rasterio.open(tmp, 'w', driver='GTiff', width=size, height=size, count=bands, dtype='uint8',
                       crs='EPSG:32632', transform=from_origin(500_000, 5_600_000, 0.1, 0.1),
                       tiled=True, blockxsize=block, blockysize=block, photometric='RGB' if bands == 3 else 'MINISBLACK',
                       interleave='pixel', BIGTIFF='IF_SAFER') as dst:
        for y0 in range(0, size, block):
            h = min(block, size - y0)
            rows = np.empty((bands, h, size), np.uint8)
            for x0 in range(0, size, s):
                w = min(s, size - x0)
                for i in range(h):
                    y = y0 + i
                    copy = tile[:, :, ::-1] if ((y // s) + (x0 // s)) % 2 else tile
                    rows[:, i, x0:x0 + w] = copy[:, y % s, :w]
            dst.write(rows, window=rasterio.windows.Window(0, y0, size, h))
    os.replace(tmp, path)
    return path


def _register_pixel_model():
    """``BenchPixelNet``: two 1x1 convolutions, so the benchmark measures the streaming,
    blending and writing of predict.py (and their memory) rather than a CNN on 2 CPU cores."""
    from ds_seg.registry import MODELS
    if 'BenchPixelNet' in MODELS.module_dict:
        return

    @MODELS.register_module()
    def BenchPixelNet(in_channels=3, num_classes=6):
        return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 16, 1), torch.nn.ReLU(),
                                   torch.nn.Conv2d(16, num_classes, 1))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ['--child']:
        # predict.py's own main, in a process whose peak memory is measured alone
        _register_pixel_model()
        from ds_seg.cli import predict
        from ds_seg.cli.vector_benchmark import peak_rss_mb
        status = predict.main(argv[1:])
        print(f'[benchmark] child peak_rss_mb {peak_rss_mb():.0f}', flush=True)
        return status
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--size', type=int, default=20000, help='scene width and height (default 20000)')
    parser.add_argument('--model', default='UNetTiny',
                        help='a registered model, or BenchPixelNet (1x1 convs; default UNetTiny)')
    parser.add_argument('--tile', type=int, default=512)
    parser.add_argument('--overlap', type=int, default=None, help='overlap of windows (default tile/8)')
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--threads', type=int, default=2, help='torch CPU threads (default 2)')
    parser.add_argument('--extra', nargs=argparse.REMAINDER, default=[], help='more predict.py options')
    args = parser.parse_args(argv)
    # Before the scene is written: a bad value was numpy's or the child's traceback, after minutes.
    for flag, low in (('size', 16), ('tile', 16), ('batch_size', 1), ('threads', 1)):
        if getattr(args, flag) < low:
            parser.error(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    if args.overlap is None:  # a fixed 64 was refused by the child for any tile of 64 or less
        args.overlap = args.tile // 8
    if not 0 <= args.overlap < args.tile:
        parser.error(f"--overlap must be >= 0 and smaller than --tile ({args.tile}), got {args.overlap}")
    # Options the benchmark gives predict itself: one in --extra replaced its (the scene, the
    # folder it reads the result back from: a rasterio traceback) or its record (--tile...).
    own = {'--checkpoint': 'its own random model', '--input': 'its own scene', '--output': 'a folder of its own',
           '--device': 'the CPU', '--tile': 'its --tile', '--overlap': 'its --overlap',
           '--batch-size': 'its --batch-size', '--cpu-threads': 'its --threads'}
    for token in args.extra:
        name = token.split('=', 1)[0]
        taken = next((option for option in own if len(name) > 2 and option.startswith(name)), None)
        if token.startswith('--') and taken:
            parser.error(f"--extra: {token} sets predict's {taken}, which the benchmark sets to {own[taken]}; "
                         f"leave it out of --extra")
    from ds_seg.registry import MODELS, RegistryError, lookup
    _register_pixel_model()
    try:
        lookup(MODELS, args.model, where='--model')
    except RegistryError as exc:
        parser.error(str(exc))

    from ds_seg.data.synthetic import default_cache_dir
    from ds_seg.registry import MODELS, build
    _register_pixel_model()
    cache = os.path.join(default_cache_dir(), 'benchmark')
    os.makedirs(cache, exist_ok=True)
    t0 = time.perf_counter()
    scene = make_scene(os.path.join(cache, f'scene_{args.size}.tif'), args.size)
    print(f'[benchmark] scene {scene} ({args.size}x{args.size}x3 uint8) ready in {time.perf_counter() - t0:.0f} s',
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = dict(type=args.model, in_channels=3, num_classes=6)
        model = build(MODELS, cfg)
        weights = os.path.join(tmp, 'weights.pt')
        torch.save({'state_dict': model.state_dict(), 'model': cfg, 'classes': [f'c{i}' for i in range(6)],
                    'data': {'bands': [1, 2, 3], 'mean': [110.0, 115.0, 100.0], 'std': [50.0, 45.0, 45.0]}},
                   weights)
        out = os.path.join(tmp, 'out')
        cmd = [sys.executable, '-m', 'ds_seg.cli.predict_benchmark', '--child', '--checkpoint', weights,
               '--input', scene, '--output', out, '--tile', str(args.tile), '--overlap', str(args.overlap),
               '--batch-size', str(args.batch_size), '--device', 'cpu', '--cpu-threads', str(args.threads)]
        cmd += args.extra
        print('[benchmark] ' + ' '.join(cmd), flush=True)
        env = same_package_env(OMP_NUM_THREADS=str(args.threads))
        t1 = time.perf_counter()
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        predict_s = peak_mb = None
        for line in child.stdout:  # shown as it comes; predict's own time read from its last line
            print(line, end='', flush=True)
            # Its rate, not its seconds: those are printed to 0.1 s, and "0.0 s" divided by the
            # child's whole wall time instead (100x off for a fast scene).
            found = re.search(r'(\d+) windows in [\d.]+ s \(([\d.]+) windows/s\)', line)
            if found and float(found[2]) > 0:
                predict_s = int(found[1]) / float(found[2])
            found = re.match(r'\[benchmark\] child peak_rss_mb (\d+)', line)
            if found:
                # The child's own VmHWM: its ru_maxrss (RUSAGE_CHILDREN) starts at this process's
                # peak (Linux carries it across the fork and exec), torch and the scene included.
                peak_mb = float(found[1])
        if child.wait():  # the child said why (predict's one line); not a traceback here
            return 2
        wall = time.perf_counter() - t1
        from ds_seg.inference import ScenePlan
        plan = ScenePlan(args.size, args.size, args.tile, args.overlap)
        windows = len(plan.ys) * len(plan.xs)
        result = os.path.join(out, os.path.splitext(os.path.basename(scene))[0] + '_classes.tif')
        with rasterio.open(scene) as src, rasterio.open(result) as dst:
            same_geo = (src.crs == dst.crs and src.transform == dst.transform
                        and (src.width, src.height) == (dst.width, dst.height))
            out_mb = os.path.getsize(result) / 2 ** 20
        summary = dict(size=args.size, model=args.model, tile=args.tile, overlap=args.overlap,
                       batch_size=args.batch_size, threads=args.threads, windows=windows,
                       # wall: the child process end to end (its start-up included); the rates:
                       # predict's own time for the scene, without the interpreter's start-up.
                       wall_s=round(wall, 1), predict_s=None if predict_s is None else round(predict_s, 3),
                       windows_per_s=round(windows / (predict_s or wall), 2),
                       megapixels_per_s=round(args.size ** 2 / (predict_s or wall) / 1e6, 2),
                       peak_rss_mb=None if peak_mb is None else round(peak_mb),
                       georeferenced_like_input=same_geo, output_mb=round(out_mb, 1))
        print('[benchmark] ' + json.dumps(summary), flush=True)
        return 0 if same_geo else 1


if __name__ == '__main__':
    sys.exit(main())
