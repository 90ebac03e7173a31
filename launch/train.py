"""``python launch/train.py ...`` = the ``ds-seg-train`` console script (ds_seg/cli/train.py).

Kept so that launchers taking a script path (``deepspeed launch/train.py``, ``torchrun
launch/train.py``) work; it runs this checkout's ds_seg (launch/_checkout.py), with the dependencies
installed by ``pip install -e .``.
"""
import signal
import sys

if __name__ == '__main__':
    # Importing torch takes seconds; a Slurm stop signal in that time must not kill the rank
    # (Python's default for SIGUSR1/SIGTERM): remember it for ds_seg.engine.faults.StopRequests
    # (ds_seg.stop_signals does this for the ds-seg-train console script).
    # A Ctrl-C then is kept too, and said in one line (not a KeyboardInterrupt traceback from inside an import).
    # The sbatch templates start a rank with SIGUSR1/SIGTERM ignored (so that one in its first
    # moments, before this line, is not fatal): taken over here all the same.
    _early = []
    for _sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        # SIGINT ignored (a background rank) and SIGHUP ignored (nohup) stay so
        if _sig not in (signal.SIGINT, signal.SIGHUP) or signal.getsignal(_sig) is not signal.SIG_IGN:
            signal.signal(_sig, lambda signum, frame: _early.append(signal.Signals(signum).name))
    try:
        import _checkout  # noqa: F401  (this checkout's ds_seg first)
        from ds_seg.cli.train import main
    except ModuleNotFoundError as e:  # not installed in this Python
        sys.exit(f"[ds_seg] {sys.executable} cannot import {e.name!r}: install ds_seg in it (pip install -e . "
                 f"in the checkout) or run the Python it is installed in")
    from ds_seg import stop_signals
    stop_signals.catch_stop_signals(during_imports=True)  # before reading _early: one in between is kept
    _stops = [name for name in _early if name != 'SIGINT']
    stop_signals.first_signal[0] = _stops[0] if _stops else stop_signals.first_signal[0]
    stop_signals.early_interrupt[0] = stop_signals.early_interrupt[0] or 'SIGINT' in _early
    sys.exit(main())
