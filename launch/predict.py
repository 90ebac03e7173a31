"""``python launch/predict.py ...`` = the ``ds-seg-predict`` console script (ds_seg/cli/predict.py).

Kept so that launchers taking a script path (``deepspeed launch/predict.py``, ``torchrun
launch/predict.py``) work; it only runs the installed package's command (``pip install -e .``).
"""
import sys

from ds_seg.cli.predict import main

if __name__ == '__main__':
    sys.exit(main())
