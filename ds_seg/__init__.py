"""ds_seg: DeepSpeed training for large semantic-segmentation models on aerial imagery."""
__version__ = '0.1.0'

# Importing the subpackages registers every model, loss, dataset and transform.
from . import data, models  # noqa: E402,F401
from .registry import DATASETS, LOSSES, MODELS, TRANSFORMS  # noqa: E402,F401
