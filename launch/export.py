"""``python launch/export.py ...`` = the ``ds-seg-export`` console script (ds_seg/cli/export.py).

Kept so that launchers taking a script path (``deepspeed launch/export.py``, ``torchrun
launch/export.py``) work; it only runs the installed package's command (``pip install -e .``).
"""
import sys

from ds_seg.cli.export import main

if __name__ == '__main__':
    sys.exit(main())
