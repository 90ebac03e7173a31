"""``python launch/predict_benchmark.py ...`` = ``python -m ds_seg.cli.predict_benchmark ...`` (ds_seg/cli/predict_benchmark.py).

Kept so that the command lines in README.md and docs/benchmarks.md work; it only runs the
installed package's command (``pip install -e .``).
"""
import sys

try:
    import _checkout  # noqa: F401  (this checkout's ds_seg first)
    from ds_seg.cli.predict_benchmark import main
except ModuleNotFoundError as e:  # not installed in this Python
    sys.exit(f"[ds_seg] {sys.executable} cannot import {e.name!r}: install ds_seg in it (pip install -e . "
             f"in the checkout) or run the Python it is installed in")

if __name__ == '__main__':
    sys.exit(main())
