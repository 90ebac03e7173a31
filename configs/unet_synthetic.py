# The embedded default experiment, what `launch/train.py` trains without --config: a UNet of base
# width 16 (depth 4; 3 bands in, 6 classes out: the data's) on procedurally generated aerial scenes read back
# from tiled GeoTIFFs, crop 128, 400 steps, evaluation and a checkpoint every 100 steps.
#
# Its values are defined once, in ds_seg/config.py (DEFAULTS); this file sets nothing, so
# `--config configs/unet_synthetic.py` is exactly the default (every resolved value is written to
# config.json in the work dir). Copy it to start your own experiment and set only what differs:
#
#   model = dict(type='UNet', base_channels=32, depth=4)   # in_channels, num_classes: the data's
#   train = dict(max_steps=2000)
