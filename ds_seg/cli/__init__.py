"""Command-line programs. Each module's ``main()`` is both a console script (``ds-seg-train``,
``ds-seg-predict``, ``ds-seg-evaluate``, ``ds-seg-export``, ``ds-seg-benchmark``,
``ds-seg-models``; see setup.py) and what ``launch/<name>.py`` runs in a source checkout."""
import os
import sys
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parents[2]   # the folder that holds ds_seg/


def same_package_env(**overrides):
    """``os.environ`` for a child ``python -m ds_seg.cli.<name>``, with the folder holding this
    ds_seg first on PYTHONPATH: the child then imports the same package as this process (the
    checkout being measured), not another install. ``overrides`` are further variables."""
    path = str(PACKAGE_PARENT) + os.pathsep + os.environ.get('PYTHONPATH', '')
    return dict(os.environ, PYTHONPATH=path, **overrides)


def run_command(name, body, errors):
    """Run ``body()``; an exception of ``errors`` (a user mistake: a missing file, an output that
    exists, a bad value) becomes one line ``<name>: error: ...`` on stderr and exit status 2. The
    process group is closed either way. Returns the exit status."""
    from .. import distributed
    try:
        body()
    except errors as exc:
        print(f'{name}: error: {exc}', file=sys.stderr)
        return 2
    finally:
        distributed.close()
    return 0
