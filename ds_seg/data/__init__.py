"""Datasets, samplers and loaders. Importing this package registers every dataset."""
from .geotiff import GeoTiffScenes, configure_gdal_for_worker, expand_paths, grid_starts
from .loader import build_eval_loader, build_train_loader, worker_init
from .sampling import EvalSampler, TrainSampler
from .synthetic import (CLASSES, PALETTE, SyntheticAerial, default_cache_dir, generate_scene,
                        write_synthetic_scenes)

__all__ = ['CLASSES', 'PALETTE', 'EvalSampler', 'GeoTiffScenes', 'SyntheticAerial', 'TrainSampler',
           'build_eval_loader', 'build_train_loader', 'configure_gdal_for_worker',
           'default_cache_dir', 'expand_paths', 'generate_scene', 'grid_starts', 'worker_init',
           'write_synthetic_scenes']
