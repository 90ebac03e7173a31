"""``python launch/predict_benchmark.py ...`` = ``python -m ds_seg.cli.predict_benchmark ...`` (ds_seg/cli/predict_benchmark.py).

Kept so that the command lines in README.md and docs/benchmarks.md work; it only runs the
installed package's command (``pip install -e .``).
"""
import sys

from ds_seg.cli.predict_benchmark import main

if __name__ == '__main__':
    sys.exit(main())
