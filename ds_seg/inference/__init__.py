"""Whole-scene prediction: sliding windows, weighted blending, a band of rows in memory.

A scene of any size goes through the model as fixed-size windows (``tile``, overlapping by
``overlap``), several windows per forward call. Each window's class probabilities are
multiplied by a blending weight (linear ramp or Gaussian, so seams between windows disappear)
and added into host accumulators; the blended map is ``scores / weight_sum``. Accumulators
exist only for the *block rows* (``block`` rows of the output GeoTIFF) that some pending
window still touches: once every window over a block row has been added, the row is handed to
a sink (written to a tiled compressed GeoTIFF, or compared with labels) and freed. Memory is
therefore ``K x (tile + block) x width`` floats whatever the scene height.

Across ranks a scene is split into contiguous bands of whole block rows. A rank runs every
window that touches its band (windows straddling a band boundary run on both ranks) in the
batches a single rank runs (the global window order cut every ``batch_size`` windows, with
batch-mates from other ranks' rows where a batch straddles a band), and adds them in the same
global order, so its rows are bit-identical to a single-rank result (a model's output for a
window changes in its last bits with its batch-mates). Every rank makes the same number of
forward calls (missing ones are zero-filled dummy batches): under ZeRO-3 each forward is a
collective.

Shape legend: B batch, C bands, K classes, H/W height/width.

Example::

    model.eval()
    predict_scene(lambda x: model(x), 'scene.tif', 'scene_classes.tif', mean=[...], std=[...],
                  tile=512, overlap=128, batch_size=8, classes=['road', 'building'])
    cm = evaluate_scenes(lambda x: model(x), [('a.tif', 'a_label.tif')], num_classes=2,
                         mean=[...], std=[...])
"""
from .engine import TTA_FLIPS, SceneEngine, run_scene
from .evaluate import boundary_mask, evaluate_scenes, scene_pairs
from .model import load_model
from .predict import predict_scene
from .tiling import BLENDS, ScenePlan, blend_weights, window_starts
from .writer import CLASS_NODATA, GeoTiffRowWriter, default_palette

__all__ = ['BLENDS', 'CLASS_NODATA', 'TTA_FLIPS', 'GeoTiffRowWriter', 'SceneEngine', 'ScenePlan',
           'blend_weights', 'boundary_mask', 'default_palette', 'evaluate_scenes', 'load_model',
           'predict_scene', 'run_scene', 'scene_pairs', 'window_starts']
