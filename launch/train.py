"""``python launch/train.py ...`` in a source checkout = the ``ds-seg-train`` console script.

The code is ds_seg/cli/train.py (installed with the package); this file only runs it, so launchers
that take a script path (``deepspeed launch/train.py``, ``torchrun launch/train.py``) keep working.
"""
import os
import signal
import sys

if __name__ == '__main__':
    # Importing torch takes seconds; a Slurm stop signal in that time must not kill the rank
    # (Python's default for SIGUSR1/SIGTERM): remember it for ds_seg.engine.faults.StopRequests.
    _early = []
    for _sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(_sig, lambda signum, frame: _early.append(signal.Signals(signum).name))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ds_seg
from ds_seg.cli import train as _impl  # noqa: E402

if __name__ == '__main__':
    from ds_seg.engine import faults
    faults._early_signal[0] = faults._early_signal[0] or (_early[0] if _early else None)
    sys.exit(_impl.main())
# Imported (``from launch import train``, or loaded from this path): the same module object as
# ds_seg.cli.train, so patching one patches what its functions see.
globals().update({k: v for k, v in vars(_impl).items() if not k.startswith('__')})
sys.modules[__name__] = _impl
