# ISPRS Potsdam (see ds_seg/data/benchmarks.py for the expected layout and its metric convention)
# with mmsegmentation's recipe: random scale 0.5-2.0 -> crop 512 (cat_max_ratio 0.75) -> flips ->
# photometric distortion, 80k iterations. Family configs inherit this and set `model`.
loss = dict(type='CrossEntropyLoss', ignore_index=255)
data = dict(
    train=dict(type='Potsdam', data_root='data/potsdam', split='train', cat_max_ratio=0.75,
               transforms=[dict(type='PhotoMetricDistortion')]),
    val=dict(type='Potsdam', data_root='data/potsdam', split='val'),
    crop_size=512,
    random_scale=(0.5, 2.0),
    num_workers=4)
train = dict(max_steps=80000, log_interval=50, eval_interval=8000, checkpoint_interval=4000,
             keep_checkpoints=3, seed=0)
