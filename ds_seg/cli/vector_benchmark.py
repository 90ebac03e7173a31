"""Polygon output benchmark: time and peak memory of vectorising a large class map.

    python launch/vector_benchmark.py                      # 20000 x 20000, bands of 256 rows
    python launch/vector_benchmark.py --size 8000 --band-rows 512 --format fgb

A synthetic class map (4 classes: blobs with ragged edges at two scales, plus a road grid
whose roads run through every band, so regions cut at band edges must be merged) is written
once as a tiled ZSTD GeoTIFF; then ``ds_seg.vectorize.vectorize_class_map`` runs in a child
process whose own peak resident memory (``VmHWM``) and wall time are reported. No model is
involved: this measures the vectoriser alone.
"""
# Nothing from ds_seg at module level: the measured child runs this file by path, and importing
# the package would load torch into it.
import argparse
import getpass
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


MADE_HERE = 'ds_seg_vector_benchmark'  # the class map's tag, and the --dir record of polygon files written


CLASSES = ['background', 'building', 'road', 'tree']


def made_here(class_map, size):
    """Whether ``class_map`` is the one this benchmark writes for ``size``: by its tag, or, written
    by a version before the tag, by its profile (one uint8 band of size x size, our class names)."""
    import rasterio
    try:
        with rasterio.open(class_map) as src:
            tags = src.tags()
            return tags.get(MADE_HERE) == str(size) or (
                MADE_HERE not in tags and tags.get('classes') == json.dumps(CLASSES) and src.count == 1
                and src.dtypes[0] == 'uint8' and src.width == src.height == size)
    except rasterio.errors.RasterioError:
        return False


def polygons_written(folder):
    """The polygon files earlier runs of this benchmark wrote in ``folder``: its record, and those
    of a version before the record (polygons_<size>.<format> with the vectoriser's fields)."""
    try:
        with open(os.path.join(folder, f'.{MADE_HERE}.json')) as f:
            written = set(json.load(f))
    except (OSError, ValueError, TypeError):
        written = set()
    import glob
    import pyogrio
    for path in glob.glob(os.path.join(glob.escape(folder), 'polygons_*.*')):
        try:
            if {'class_id', 'class_name', 'area_m2'} <= set(pyogrio.read_info(path)['fields']):
                written.add(os.path.basename(path))
        except Exception:  # not a vector file GDAL can read: not ours
            continue
    return written


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
        dst.update_tags(classes=json.dumps(CLASSES), **{MADE_HERE: str(size)})
        for y0 in range(0, size, band):
            ys = np.arange(y0, min(y0 + band, size))
            v = coarse[ys[:, None] // 50, xs[None] // 50] + 0.35 * fine[ys[:, None] // 10, xs[None] // 10]
            cls = np.digitize(v, [0.55, 0.85, 1.05]).astype(np.uint8)
            cls[cls == 2] = 3
            cls[:, (xs % 1000) < 12] = 2
            cls[(ys % 1000) < 12] = 2
            dst.write(cls[None], window=rasterio.windows.Window(0, y0, size, len(ys)))
    os.replace(tmp, path)


def child_command(class_map, out, band_rows, simplify):
    """The measured process: this file run by path. ``python -m ds_seg.cli.vector_benchmark``
    would import the ds_seg package first, and with it torch."""
    return [sys.executable, os.path.abspath(__file__), '--child', '--class-map', class_map, '--out', out,
            '--band-rows', str(band_rows), '--simplify', str(simplify)]


def peak_rss_mb():
    """This process's own peak resident memory (VmHWM, kB in /proc). Not ru_maxrss: Linux carries
    into that the peak of the process that started this one, which has imported the ds_seg
    package and torch (~560 MiB), and would report it instead of the vectoriser's."""
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith('VmHWM:')) / 1024


def child(args):
    # The vectoriser's modules without the package's __init__: that imports every model, and so
    # torch (~800 MB RSS), which would hide the vectoriser's own memory. A bare package object
    # stands in for it, so that the vectoriser's own relative imports (.inputs, .config) work.
    import importlib
    import types
    package = types.ModuleType('ds_seg')
    package.__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')]
    sys.modules['ds_seg'] = package
    vectorize_class_map = importlib.import_module('ds_seg.vectorize').vectorize_class_map
    import pyogrio.raw  # noqa: F401  (imported inside; counted in the baseline, not the run)
    import shapely  # noqa: F401
    baseline_mb = peak_rss_mb()
    out = args.out
    if os.path.exists(out):  # main() checked that an earlier run of this benchmark wrote it
        os.remove(out)
    t = time.perf_counter()
    info = vectorize_class_map(args.class_map, out, band_rows=args.band_rows, simplify=args.simplify)
    seconds = time.perf_counter() - t
    peak_mb = peak_rss_mb()
    print(json.dumps(dict(features=info['features'], seconds=seconds, baseline_mb=baseline_mb, peak_mb=peak_mb,
                          out_mb=os.path.getsize(out) / 2 ** 20, torch_imported='torch' in sys.modules)))


def main(argv=None):
    # argparse's own parser: ds_seg.cli.OneLineParser would import the ds_seg package (and torch)
    # into the measured child, which runs this file by path; only the help imports it, to name the
    # commands as this program's user has them.
    description = __doc__
    if not {'-h', '--help'}.isdisjoint(sys.argv[1:] if argv is None else argv):
        from ds_seg.inputs import as_invoked
        description = as_invoked(__doc__)
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--size', type=int, default=20000)
    p.add_argument('--band-rows', type=int, default=256)
    p.add_argument('--format', default='gpkg', choices=['gpkg', 'fgb', 'geojson'])
    p.add_argument('--simplify', type=float, default=0.0)
    # One per user: a fixed /tmp folder was another user's on a shared machine.
    p.add_argument('--dir', type=os.path.expanduser,
                   default=os.path.join(tempfile.gettempdir(), f'ds_seg_vector_benchmark-{getpass.getuser()}'))
    p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--make', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--class-map', default=None, help=argparse.SUPPRESS)
    p.add_argument('--out', default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    def refuse(message):  # one line, as the other commands' mistakes (not the usage block first)
        print(f'{p.prog}: error: {message}', file=sys.stderr)
        sys.exit(2)

    if args.child:
        return child(args)
    if args.make:
        return make_class_map(args.class_map, args.size)
    # Before the class map is made: these were tracebacks (or, for the band rows, accepted).
    # Each wrong one named alone (a right --size was quoted as if refused); NaN and inf too
    # (NaN is not < 0: it was the vectoriser's ValueError traceback).
    wrong = [said for bad, said in ((args.size < 16, f'--size must be at least 16 (got {args.size})'),
                                    (args.band_rows < 1, f'--band-rows must be at least 1 (got {args.band_rows})'),
                                    (not 0 <= args.simplify < float('inf'),
                                     f'--simplify must be a finite number >= 0 (got {args.simplify:g})')) if bad]
    if wrong:
        refuse('; '.join(wrong))
    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        refuse(f"--dir {args.dir} is a file; give a folder")
    os.makedirs(args.dir, exist_ok=True)
    class_map = os.path.join(args.dir, f'classes_{args.size}.tif')
    out = os.path.join(args.dir, f'polygons_{args.size}.{args.format}')
    # A user's file of one of these names was vectorised (a traceback on a 3-band image) or deleted.
    if os.path.exists(class_map) and not made_here(class_map, args.size):
        refuse(f"--dir: {class_map} is not a class map this benchmark wrote; give another --dir, or move it")
    if os.path.lexists(out) and os.path.basename(out) not in polygons_written(args.dir):
        refuse(f"--dir: {out} is not a file this benchmark wrote; give another --dir, or move it")
    if not os.path.exists(class_map):
        # In a process of its own (several hundred MiB at 20000 px), so that this process stays
        # small while the measured child runs beside it.
        t = time.perf_counter()
        subprocess.run([sys.executable, os.path.abspath(__file__), '--make', '--class-map', class_map,
                        '--size', str(args.size)], check=True)
        print(f'[vector_benchmark] wrote {class_map} in {time.perf_counter() - t:.0f} s')
    record = os.path.join(args.dir, f'.{MADE_HERE}.json')
    with open(record + '.tmp', 'w') as f:  # before the child writes it: a killed run's file is ours too
        json.dump(sorted(polygons_written(args.dir) | {os.path.basename(out)}), f)
    os.replace(record + '.tmp', record)
    proc = subprocess.run(child_command(class_map, out, args.band_rows, args.simplify), capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
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
