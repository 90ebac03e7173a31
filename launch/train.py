"""``python launch/train.py ...`` = the ``ds-seg-train`` console script (ds_seg/cli/train.py).

Kept so that launchers taking a script path (``deepspeed launch/train.py``, ``torchrun
launch/train.py``) work; it only runs the installed package's command (``pip install -e .``).
"""
import signal
import sys

if __name__ == '__main__':
    # Importing torch takes seconds; a Slurm stop signal in that time must not kill the rank
    # (Python's default for SIGUSR1/SIGTERM): remember it for ds_seg.engine.faults.StopRequests
    # (ds_seg.stop_signals does this for the ds-seg-train console script).
    _early = []
    for _sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(_sig, lambda signum, frame: _early.append(signal.Signals(signum).name))
    from ds_seg.cli.train import main
    from ds_seg import stop_signals
    stop_signals.catch_stop_signals()   # before reading _early: a signal in between is kept, not lost
    stop_signals.first_signal[0] = _early[0] if _early else stop_signals.first_signal[0]
    sys.exit(main())
