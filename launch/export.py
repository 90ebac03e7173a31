"""``python launch/export.py ...`` in a source checkout = the ``ds-seg-export`` console script.

The code is ds_seg/cli/export.py (installed with the package); this file only runs it, so launchers
that take a script path (``deepspeed launch/export.py``, ``torchrun launch/export.py``) keep working.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ds_seg
from ds_seg.cli import export as _impl  # noqa: E402

if __name__ == '__main__':
    sys.exit(_impl.main())
# Imported (``from launch import export``, or loaded from this path): the same module object as
# ds_seg.cli.export, so patching one patches what its functions see.
globals().update({k: v for k, v in vars(_impl).items() if not k.startswith('__')})
sys.modules[__name__] = _impl
