# Your own GeoTIFF scenes: one label raster (class index per pixel) per image, same size and
# geotransform (or no georeference at all). Globs are sorted and paired by position. Point the
# paths at your files, set classes (the model takes its band and class counts from the data), and run:
#   deepspeed launch/train.py --config configs/unet_geotiff_scenes.py
# Other GeoTiffScenes options: bands=[1, 2, 3, 4] (1-based), mean/std (else computed once and
# cached), label_map={file value: class}, reduce_zero_label, palette=[(r, g, b), ...] for
# colour-coded labels, boundary_ignore, check_labels.
model = dict(type='UNet', base_channels=32, depth=4)  # in_channels, num_classes: the data's
loss = dict(type='CrossEntropyLoss', ignore_index=255)
data = dict(
    train=dict(type='GeoTiffScenes', split='train',
               images='data/scenes/train/*_image.tif', labels='data/scenes/train/*_label.tif',
               classes=('background', 'building', 'road', 'vegetation', 'water'),
               cat_max_ratio=0.75, max_nodata_ratio=0.5,
               transforms=[dict(type='PhotoMetricDistortion')]),
    val=dict(type='GeoTiffScenes', split='val',
             images='data/scenes/val/*_image.tif', labels='data/scenes/val/*_label.tif',
             classes=('background', 'building', 'road', 'vegetation', 'water')),
    crop_size=512,
    random_scale=(0.5, 2.0),    # same factor on every rank at each step: equal shapes and read cost
    num_workers=4)
train = dict(max_steps=40000, log_interval=50, eval_interval=4000, checkpoint_interval=2000,
             keep_checkpoints=3, seed=0)
