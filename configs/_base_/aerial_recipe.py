# mmsegmentation's aerial recipe, shared by the benchmark configs: random scale 0.5-2.0 -> crop
# 512 (cat_max_ratio 0.75) -> flips -> photometric distortion, 80k iterations. A config that
# inherits it sets `model` and the dataset (`data.train.type`, `data_root`, and `data.val`).
loss = dict(type='CrossEntropyLoss', ignore_index=255)
data = dict(
    train=dict(split='train', cat_max_ratio=0.75, transforms=[dict(type='PhotoMetricDistortion')]),
    crop_size=512,
    random_scale=(0.5, 2.0),
    num_workers=4)
train = dict(max_steps=80000, log_interval=50, eval_interval=8000, checkpoint_interval=4000,
             keep_checkpoints=3, seed=0)
