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


def say_once_per_node(line):
    """Print ``line`` to stderr, once per node and launch: ranks that hit the same start-up mistake
    (every rank checks the same config) printed it once each, N identical lines under N GPUs. The
    first rank of this launch on this node to say a line claims it with a file in the temporary
    folder (named by the launch: the launcher's process id and rendezvous, and by the line); a
    line no other rank said, or one said over a minute ago (a stale claim), is printed."""
    if int(os.environ.get('WORLD_SIZE', os.environ.get('SLURM_NTASKS', '1')) or 1) > 1:
        import hashlib
        import tempfile
        import time
        launch = [os.getppid()] + [os.environ.get(name) for name in (
            'MASTER_ADDR', 'MASTER_PORT', 'DS_SEG_INIT_METHOD', 'TORCHELASTIC_RUN_ID', 'SLURM_JOB_ID', 'SLURM_STEP_ID')]
        key = hashlib.sha1(f'{launch}\0{line}'.encode()).hexdigest()[:24]
        claim = os.path.join(tempfile.gettempdir(), f'ds_seg-said-{key}')
        _remove_old_claims(os.path.dirname(claim), time.time() - 600)
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            try:
                if time.time() - os.path.getmtime(claim) < 60:
                    return
                os.utime(claim)
            except OSError:
                pass
        except OSError:  # no writable temporary folder: every rank says it
            pass
    print(line, file=sys.stderr, flush=True)


def _remove_old_claims(folder, before):
    """Earlier launches' claims (say_once_per_node) go after ten minutes: they do not accumulate."""
    import glob
    for old in glob.glob(os.path.join(folder, 'ds_seg-said-*')):
        try:
            if os.path.getmtime(old) < before:
                os.remove(old)
        except OSError:  # another rank removed it first
            pass


def run_command(name, body, errors):
    """Run ``body()``; an exception of ``errors`` (a user mistake: a missing file, an output that
    exists, a bad value) becomes one line ``<name>: error: ...`` on stderr and exit status 2. The
    process group is closed either way. Returns the exit status."""
    from .. import distributed
    try:
        body()
    except errors as exc:
        say_once_per_node(f'{name}: error: {exc}')
        return 2
    finally:
        distributed.close()
    return 0
