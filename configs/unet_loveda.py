# LoveDA (see ds_seg/data/benchmarks.py for the expected layout and its metric convention):
# mmsegmentation's recipe, random scale 0.5-2.0 -> crop 512 (cat_max_ratio 0.75) -> flips ->
# photometric distortion, 80k iterations.
model = dict(type='UNet', in_channels=3, num_classes=7, base_channels=32, depth=4)
loss = dict(type='CrossEntropyLoss', ignore_index=255)
data = dict(
    train=dict(type='LoveDA', data_root='data/loveda', split='train', cat_max_ratio=0.75,
               transforms=[dict(type='PhotoMetricDistortion')]),
    val=dict(type='LoveDA', data_root='data/loveda', split='val'),
    crop_size=512,
    random_scale=(0.5, 2.0),
    num_workers=4)
train = dict(max_steps=80000, log_interval=50, eval_interval=8000, checkpoint_interval=4000,
             keep_checkpoints=3, seed=0)
