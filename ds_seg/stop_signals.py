"""A training program's stop signals are kept from its first moment, not fatal (imports nothing heavy).

Python's default action for SIGUSR1 and SIGTERM ends the process. Importing ds_seg (torch,
DeepSpeed, the models) takes seconds, and a Slurm signal in that time (``scancel --full``, a
time-limit warning at a requeued start) would kill the rank instead of stopping it after its
first step: :mod:`ds_seg.engine.faults` picks the kept signal up when the run starts. The
``ds-seg-train`` console script and ``python -m ds_seg.cli.train`` get this from
``ds_seg/__init__.py``, before anything heavy is imported; ``launch/train.py`` does the same for
itself before it imports ds_seg.
"""
import os
import signal
import sys
import threading

STOP_SIGNALS = ('SIGUSR1', 'SIGTERM', 'SIGHUP')
# SIGHUP: the terminal closed (an ssh session without nohup). Ignored where it was ignored at
# the start (nohup, a shell's disown): that choice is the user's.
HANGUP = 'SIGHUP'


def takes_over(name):
    """Whether this process may handle stop signal ``name``: not a SIGHUP it started ignoring."""
    return name != HANGUP or signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN
TRAINING_PROGRAMS = ('ds-seg-train',)   # console scripts whose process is a training rank
# The first stop signal that came before the run began. The sbatch templates pass on one that
# their batch shell had before it started the ranks as DS_SEG_STOP_SIGNAL=SIGUSR1|SIGTERM.
first_signal = [os.environ.get('DS_SEG_STOP_SIGNAL') if os.environ.get('DS_SEG_STOP_SIGNAL') in STOP_SIGNALS
                else None]


# A Ctrl-C while the program was still importing: a KeyboardInterrupt traceback from inside
# torch's or rasterio's imports (one per rank under a launcher) instead of the one line a Ctrl-C
# before training gets. Kept here until the command can say it (interrupted_during_imports).
early_interrupt = [False]


def remember(signum, frame):
    first_signal[0] = first_signal[0] or signal.Signals(signum).name


def remember_interrupt(signum, frame):
    early_interrupt[0] = True


def catch_stop_signals(during_imports=False):
    """Keep SIGUSR1/SIGTERM in :data:`first_signal` instead of dying of them; ``during_imports``:
    keep a Ctrl-C too (see :func:`interrupted_during_imports`)."""
    if threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            if takes_over(name):
                signal.signal(getattr(signal, name), remember)
        # A rank started with SIGINT ignored (in the background of a script) keeps ignoring it.
        if during_imports and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, remember_interrupt)


def interrupted_during_imports():
    """Give Ctrl-C back to Python (KeyboardInterrupt from here on) and say whether one came while
    the program was importing."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is remember_interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return early_interrupt[0]


def is_training_program():
    """The ``ds-seg-train`` script (``sys.argv[0]``), or ``python -m ds_seg.cli.train`` (what
    ``torchrun -m`` starts; ``sys.argv[0]`` is still '-m' while the package is imported)."""
    if sys.argv and os.path.basename(sys.argv[0]) in TRAINING_PROGRAMS:
        return True
    argv = getattr(sys, 'orig_argv', [])
    return '-mds_seg.cli.train' in argv or any(a == '-m' and b == 'ds_seg.cli.train' for a, b in zip(argv, argv[1:]))


def catch_if_training_program():
    """Called as ds_seg is imported: only a training program takes the signals over; another
    Python program importing ds_seg keeps its own handling."""
    if is_training_program():
        catch_stop_signals(during_imports=True)
