"""Command-line programs. Each module's ``main()`` is both a console script (``ds-seg-train``,
``ds-seg-predict``, ``ds-seg-evaluate``, ``ds-seg-export``, ``ds-seg-benchmark``,
``ds-seg-models``; see setup.py) and what ``launch/<name>.py`` runs in a source checkout."""
import argparse
import errno
import os
import signal
import sys
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parents[2]   # the folder that holds ds_seg/


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose refusals are one line (``prog: error: ...``, exit 2), as every
    other mistake of these commands is: argparse printed its usage block first. Its description
    names the commands as this program's user has them (:func:`ds_seg.inputs.as_invoked`)."""

    def __init__(self, *args, description=None, **kwargs):
        from ..inputs import as_invoked
        super().__init__(*args, description=as_invoked(description), **kwargs)

    def error(self, message):
        say_once_per_node(f'{self.prog}: error: {message}')   # every rank parses the same command line
        sys.exit(2)


class _StdoutThatMayClose:
    """``sys.stdout`` of a long command: a write that fails (the reader of a pipe quit, ``| head``;
    a full disk under ``> train.log``; a closed terminal) points file descriptor 1 at /dev/null,
    says so once on stderr, and the command goes on. A training run was stopped as a lost rank
    (exit 4, every step since the last checkpoint lost), or with a traceback at its start."""

    def __init__(self, stream):
        self._stream = stream
        self._closed = False

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._lost(exc)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as exc:
            self._lost(exc)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _lost(self, exc):
        if self._closed:
            return
        self._closed = True
        try:
            where = os.readlink('/proc/self/fd/1')
        except OSError:
            where = 'stdout'
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)   # also the text still buffered, and what C code writes, goes nowhere
        os.close(null)
        try:
            self._stream.flush()
        except OSError:
            pass
        name = errno.errorcode.get(exc.errno, exc.errno)
        try:
            print(f'[ds_seg] stdout ({where}) failed: [Errno {exc.errno} {name}] {exc.strerror}: printing stops '
                  'here, the command goes on (a run logs to its metrics.jsonl)', file=sys.stderr, flush=True)
        except OSError:
            pass


def outlive_stdout():
    """Install :class:`_StdoutThatMayClose` (once): train, predict and evaluate run as commands do it
    first in ``main``, before DeepSpeed's logger takes hold of ``sys.stdout``."""
    if not isinstance(sys.stdout, _StdoutThatMayClose) and sys.stdout is not None:
        sys.stdout = _StdoutThatMayClose(sys.stdout)


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
    from ..inputs import as_invoked
    line = as_invoked(line)
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


class Terminated(BaseException):
    """SIGTERM during a command (``kill``, ``timeout``, Slurm's end of a job): raised where the
    command is, as Ctrl-C's KeyboardInterrupt is, so that its partial outputs are removed on the
    way out (the default action ended the process and left them)."""


def _raise_terminated(signum, frame):
    raise Terminated()


# An output written to a full, read-only or failing disk: one line naming the path and errno.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.EPERM,
                 errno.ENAMETOOLONG}
_WRITE_TEXTS = ('No space left on device', 'Disk quota exceeded', 'Read-only file system', 'File name too long',
                'File too large',
                'Input/output error', 'Permission denied')


def io_failure(exc):
    """One line for an OSError of a write that failed (a full disk...), or None for any other. GDAL
    reports through rasterio without an errno: its text is matched."""
    if not isinstance(exc, OSError):
        return None
    if exc.errno in _WRITE_ERRNOS:
        from ..engine.faults import describe_io_error
        return describe_io_error(exc)
    text = str(exc).strip().splitlines()
    if exc.errno is None and text and any(t in text[-1] for t in _WRITE_TEXTS):
        return text[-1][:300]
    return None


def run_command(name, body, errors, output=None):
    """Run ``body()``; an exception of ``errors`` (a user mistake: a missing file, an output that
    exists, a bad value) becomes one line ``<name>: error: ...`` on stderr and exit status 2; a
    failed write (full disk) one line and status 74; Ctrl-C and SIGTERM one line each and status
    130 and 143, after the command has removed its partial outputs. ``output()``: the folder the
    command writes, probed when a write failed without an errno (GDAL's through rasterio). The
    process group is closed either way. Returns the exit status."""
    from .. import distributed
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    try:
        body()
    except errors as exc:
        failure = io_failure(exc)
        say_once_per_node(f'{name}: error: {failure or exc}')
        return 74 if failure else 2
    except OSError as exc:
        failure = io_failure(exc)
        if failure is None and exc.errno is None and output is not None and output():
            from ..engine.checkpoint import write_failure
            failure = write_failure(output(), exc)
        if failure is None:
            raise
        say_once_per_node(f'{name}: error: {failure}; the outputs finished before it are kept, no partial one')
        return 74
    except KeyboardInterrupt:
        say_once_per_node(f'{name}: interrupted (Ctrl-C); the outputs finished before it are kept, no partial one')
        return 130
    except Terminated:
        say_once_per_node(f'{name}: stopped by SIGTERM; the outputs finished before it are kept, no partial one')
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        distributed.close()
    return 0


def _main_thread():
    import threading
    return threading.current_thread() is threading.main_thread()


def exit_without_finalization(status):
    """End a program that used a process group with ``status`` once everything it wrote is closed.

    The process groups' gloo threads outlive ``destroy_process_group`` while DDP or DeepSpeed
    still refers to the group, and interpreter finalization ends any thread that is inside
    native code by unwinding it: 'terminate called without an active exception', status -6, a
    completed run (or a prediction whose outputs were all written) reported as a failed rank (a
    Slurm job FAILED, a requeue for nothing). The caller has closed its files, trackers, loader
    workers, lock and process group: nothing is left for finalization to do."""
    import atexit
    atexit._run_exitfuncs()  # what registered itself for exit still runs (DeepSpeed's wandb/comet monitors)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
