"""``python launch/models.py ...`` = the ``ds-seg-models`` console script (ds_seg/cli/models.py).

Kept so that launchers taking a script path (``deepspeed launch/models.py``, ``torchrun
launch/models.py``) work; it only runs the installed package's command (``pip install -e .``).
"""
import sys

from ds_seg.cli.models import main

if __name__ == '__main__':
    sys.exit(main())
