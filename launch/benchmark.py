"""``python launch/benchmark.py ...`` = the ``ds-seg-benchmark`` console script (ds_seg/cli/benchmark.py).

Kept so that launchers taking a script path (``deepspeed launch/benchmark.py``, ``torchrun
launch/benchmark.py``) work; it only runs the installed package's command (``pip install -e .``).
"""
import sys

from ds_seg.cli.benchmark import main

if __name__ == '__main__':
    sys.exit(main())
