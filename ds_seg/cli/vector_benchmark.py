"""Polygon output benchmark: time and peak memory of vectorising a large class map.

    python launch/vector_benchmark.py                      # 20000 x 20000, bands of 256 rows
    python launch/vector_benchmark.py --size 8000 --band-rows 512 --format fgb

A synthetic class map (4 classes: blobs with ragged edges at two scales, plus a road grid
whose roads run through every band, so regions cut at band edges must be merged) is written
once as a tiled ZSTD GeoTIFF; then ``ds_seg.vectorize.vectorize_class_map`` runs in a child
process whose peak resident memory (``ru_maxrss``) and wall time are reported. No model is
involved: this measures the vectoriser alone.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np


def make_class_map(path, size, seed=0, band=1024):
    import rasterio
    from rasterio.transform import from_origin
    rng = np.random.default_rng(seed)
    coarse = rng.random((size // 50 + 1, size // 50 + 1)).astype(np.float32)
    fine = rng.random((size // 10 + 1, size // 10 + 1)).astype(np.float32)
    profile = dict(driver='GTiff', width=size, height=size, count=1, dtype='uint8', nodata=255,
                   crs='EPSG:32632', transform=from_origin(500000, 5800000, 0.3, 0.3), tiled=True,
                   blockxsize=256, blockysize=256, compress='zstd', BIGTIFF='IF_SAFER')
    xs = np.arange(size)
    tmp = path + '.tmp.tif'
    with rasterio.open(tmp, 'w', **profile) as dst:
        dst.update_tags(classes=json.dumps(['background', 'building', 'road', 'tree']))
        for y0 in range(0, size, band):
            ys = np.arange(y0, min(y0 + band, size))
            v = coarse[ys[:, None] // 50, xs[None] // 50] + 0.35 * fine[ys[:, None] // 10, xs[None] // 10]
            cls = np.digitize(v, [0.55, 0.85, 1.05]).astype(np.uint8)
            cls[cls == 2] = 3
            cls[:, (xs % 1000) < 12] = 2
            cls[(ys % 1000) < 12] = 2
            dst.write(cls[None], window=rasterio.windows.Window(0, y0, size, len(ys)))
    os.replace(tmp, path)


def child(args):
    # The module alone, not the ds_seg package: importing that loads torch (~800 MB RSS),
    # which would hide the vectoriser's own memory.
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        'vectorize', os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'ds_seg', 'vectorize.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vectorize_class_map = module.vectorize_class_map
    import pyogrio.raw  # noqa: F401  (imported inside; counted in the baseline, not the run)
    import shapely  # noqa: F401
    baseline_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = args.out
    if os.path.exists(out):
        os.remove(out)
    t = time.perf_counter()
    info = vectorize_class_map(args.class_map, out, band_rows=args.band_rows, simplify=args.simplify)
    seconds = time.perf_counter() - t
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    print(json.dumps(dict(features=info['features'], seconds=seconds, baseline_mb=baseline_mb, peak_mb=peak_mb,
                          out_mb=os.path.getsize(out) / 2 ** 20)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--size', type=int, default=20000)
    p.add_argument('--band-rows', type=int, default=256)
    p.add_argument('--format', default='gpkg', choices=['gpkg', 'fgb', 'geojson'])
    p.add_argument('--simplify', type=float, default=0.0)
    p.add_argument('--dir', default='/tmp/ds_seg_vector_benchmark')
    p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--make', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--class-map', default=None, help=argparse.SUPPRESS)
    p.add_argument('--out', default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.make:
        return make_class_map(args.class_map, args.size)
    os.makedirs(args.dir, exist_ok=True)
    class_map = os.path.join(args.dir, f'classes_{args.size}.tif')
    if not os.path.exists(class_map):
        # In a process of its own: Linux carries a parent's peak RSS into a child across exec,
        # so generating the map here would inflate the vectoriser's figure.
        t = time.perf_counter()
        subprocess.run([sys.executable, os.path.abspath(__file__), '--make', '--class-map', class_map,
                        '--size', str(args.size)], check=True)
        print(f'[vector_benchmark] wrote {class_map} in {time.perf_counter() - t:.0f} s')
    out = os.path.join(args.dir, f'polygons_{args.size}.{args.format}')
    cmd = [sys.executable, os.path.abspath(__file__), '--child', '--class-map', class_map, '--out', out,
           '--band-rows', str(args.band_rows), '--simplify', str(args.simplify)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    if proc.returncode != 0:
        print(proc.stdout, proc.stderr, file=sys.stderr)
        return 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    peak_mb = result['peak_mb']
    print(f'[vector_benchmark] {args.size}x{args.size} class map, band {args.band_rows} rows -> '
          f'{args.format}: {result["features"]} polygons in {result["seconds"]:.0f} s, '
          f'peak RSS {peak_mb:.0f} MiB (Python + libraries before the run: {result["baseline_mb"]:.0f} MiB), '
          f'output {result["out_mb"]:.0f} MiB')
    return 0


if __name__ == '__main__':
    sys.exit(main())
