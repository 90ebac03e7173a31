"""A training program's stop signals are kept from its first moment, not fatal (imports nothing heavy).

Python's default action for SIGUSR1 and SIGTERM ends the process. Importing ds_seg (torch,
DeepSpeed, the models) takes seconds, and a Slurm signal in that time (``scancel --full``, a
time-limit warning at a requeued start) would kill the rank instead of stopping it after its
first step: :mod:`ds_seg.engine.faults` picks the kept signal up when the run starts. The
``ds-seg-train`` console script gets this from ``ds_seg/__init__.py``, before anything heavy is
imported; ``launch/train.py`` does the same for itself before it imports ds_seg.
"""
import os
import signal
import sys
import threading

STOP_SIGNALS = ('SIGUSR1', 'SIGTERM')
TRAINING_PROGRAMS = ('ds-seg-train',)   # console scripts whose process is a training rank
first_signal = [None]                   # the first stop signal that came before the run began


def remember(signum, frame):
    first_signal[0] = first_signal[0] or signal.Signals(signum).name


def catch_stop_signals():
    """Keep SIGUSR1/SIGTERM in :data:`first_signal` instead of dying of them."""
    if threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), remember)


def catch_if_training_program():
    """Called as ds_seg is imported: only the ``ds-seg-train`` program (``sys.argv[0]``, its
    script) takes the signals over; a Python program importing ds_seg keeps its own handling."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ''
    if program in TRAINING_PROGRAMS:
        catch_stop_signals()
