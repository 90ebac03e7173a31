"""Imported first by every ``launch/*.py``: this checkout's ds_seg (the folder above launch/) comes
before any other on ``sys.path``. Python puts only launch/ there, so ``python launch/train.py`` in a
second clone, another branch or beside an installed wheel of another version ran whichever ds_seg
was installed, without a word."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_ROOT, 'ds_seg', '__init__.py')) and _ROOT not in sys.path[:2]:
    sys.path.insert(0, _ROOT)
