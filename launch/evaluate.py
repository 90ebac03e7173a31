"""``python launch/evaluate.py ...`` = the ``ds-seg-evaluate`` console script (ds_seg/cli/evaluate.py).

Kept so that launchers taking a script path (``deepspeed launch/evaluate.py``, ``torchrun
launch/evaluate.py``) work; it only runs the installed package's command (``pip install -e .``).
"""
import sys

from ds_seg.cli.evaluate import main

if __name__ == '__main__':
    sys.exit(main())
