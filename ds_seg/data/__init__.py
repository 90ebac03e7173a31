"""Datasets, samplers, loaders and transforms. Importing this package registers every dataset
and transform."""
from . import transforms  # noqa: F401  (registers TRANSFORMS)
from .benchmarks import DeepGlobeLandCover, InriaAerial, LoveDA, Potsdam, Vaihingen
from .folders import ImageMaskFolder
from .geotiff import DataError, GeoTiffScenes, configure_gdal_for_worker, expand_paths, grid_starts
from .loader import build_eval_loader, build_train_loader, worker_init
from .preprocess import BatchPreprocessor
from .sampling import EvalSampler, TrainSampler
from .synthetic import (CLASSES, PALETTE, SyntheticAerial, default_cache_dir, generate_scene,
                        write_synthetic_scenes)
from .transforms import PhotoMetricDistortion, RandomFlip, RandomRotate90, scale_for_micro_step

__all__ = ['BatchPreprocessor', 'CLASSES', 'PALETTE', 'DataError', 'DeepGlobeLandCover', 'EvalSampler', 'GeoTiffScenes',
           'ImageMaskFolder', 'InriaAerial', 'LoveDA', 'PhotoMetricDistortion', 'Potsdam',
           'RandomFlip', 'RandomRotate90', 'SyntheticAerial', 'TrainSampler', 'Vaihingen',
           'build_eval_loader', 'build_train_loader', 'configure_gdal_for_worker',
           'default_cache_dir', 'expand_paths', 'generate_scene', 'grid_starts',
           'scale_for_micro_step', 'worker_init', 'write_synthetic_scenes']
