"""ds_seg: DeepSpeed training for large semantic-segmentation models on aerial imagery."""
__version__ = '0.1.0'

from .stop_signals import catch_if_training_program  # noqa: E402

catch_if_training_program()   # first: a Slurm signal during the imports below must not kill a rank

from .engine.ds_workarounds import (keep_autotuner_from_importing_mlflow, keep_zero_from_importing_muon,  # noqa: E402
                                    quiet_deprecated_collectives, quiet_scheduler_start_warning)

keep_autotuner_from_importing_mlflow()  # 3 s off every process start (see the function)
keep_zero_from_importing_muon()         # 1-2 s off every rank's start (see the function)
quiet_scheduler_start_warning()         # a warning on every run about nothing (see the function)
quiet_deprecated_collectives()          # torch's warnings about DeepSpeed's calls, a dozen per rank

# Importing the subpackages registers every model, loss, dataset and transform.
from . import data, models  # noqa: E402,F401
from .registry import DATASETS, LOSSES, MODELS, TRANSFORMS  # noqa: E402,F401
