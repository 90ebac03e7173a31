"""``python launch/models.py ...`` = the ``ds-seg-models`` console script (ds_seg/cli/models.py).

Kept so that launchers taking a script path (``deepspeed launch/models.py``, ``torchrun
launch/models.py``) work; it runs this checkout's ds_seg (launch/_checkout.py), with the dependencies
installed by ``pip install -e .``.
"""
import sys

try:
    import _checkout  # noqa: F401  (this checkout's ds_seg first)
    from ds_seg.cli.models import main
except ModuleNotFoundError as e:  # not installed in this Python
    sys.exit(f"[ds_seg] {sys.executable} cannot import {e.name!r}: install ds_seg in it (pip install -e . "
             f"in the checkout) or run the Python it is installed in")

if __name__ == '__main__':
    sys.exit(main())
