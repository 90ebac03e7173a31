"""Palette decode of a 512x512 ISPRS-coded label window with JPEG-like noise (+-8): old 8-level
table vs PaletteDecoder (table + exact decision for mixed bins). Same process, interleaved."""
import argparse, ast, os, subprocess, time
import numpy as np
from ds_seg.data.transforms import PaletteDecoder, default_palette_tolerance
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument('--old-ref', default='e6dc673',
                    help='the commit whose ds_seg/data/transforms.py holds the old palette_lut/decode_palette')
ref = parser.parse_args().old_ref
# The two old functions alone, from git (the old module would register its transforms a second time).
shown = subprocess.run(['git', 'show', f'{ref}:ds_seg/data/transforms.py'], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if shown.returncode:
    parser.error(f'git show {ref}:ds_seg/data/transforms.py failed ({shown.stderr.strip()}): run this in a '
                 'git checkout of ds_seg, with a --old-ref that has that file')
old = argparse.Namespace()
namespace = {'np': np}
for node in ast.parse(shown.stdout).body:
    if isinstance(node, ast.FunctionDef) and node.name in ('palette_lut', 'decode_palette'):
        exec(ast.get_source_segment(shown.stdout, node), namespace)
        setattr(old, node.name, namespace[node.name])
if not all(hasattr(old, name) for name in ('palette_lut', 'decode_palette')):
    parser.error(f'{ref}:ds_seg/data/transforms.py has no palette_lut and decode_palette: give an older --old-ref')
pal = [(255, 255, 255), (0, 0, 255), (0, 255, 255), (0, 255, 0), (255, 255, 0), (255, 0, 0)]
rng = np.random.default_rng(0)
lab = rng.integers(0, 6, (512, 512))
rgb = np.clip(np.array(pal, np.int16)[lab].transpose(2, 0, 1) + rng.integers(-8, 9, (3, 512, 512)), 0, 255).astype(np.uint8)
tol = default_palette_tolerance(pal)
new = PaletteDecoder(pal, tol)
lut = old.palette_lut(pal, tol)
t_old = t_new = 0
for _ in range(50):
    t = time.perf_counter(); a = old.decode_palette(rgb, lut); t_old += time.perf_counter() - t
    t = time.perf_counter(); b = new(rgb); t_new += time.perf_counter() - t
print(f'old {t_old / 50 * 1e3:.2f} ms, new {t_new / 50 * 1e3:.2f} ms per window; equal {np.array_equal(a, b)}; '
      f'mixed bins {np.mean(new.lut == -2):.1%}')
grey = [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
g = rng.integers(0, 3, (512, 512)).astype(np.uint8); grgb = np.stack([g] * 3)
dg = PaletteDecoder(grey, default_palette_tolerance(grey))
t = time.perf_counter(); out = dg(grgb); dt = time.perf_counter() - t
print(f'grey codes: new {dt * 1e3:.2f} ms, exact {np.array_equal(out, g)}; old exact '
      f'{np.array_equal(old.decode_palette(grgb, old.palette_lut(grey, 1)), g)}')
