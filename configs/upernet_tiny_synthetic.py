# A seconds-long experiment for tests and CPU demos: UperNet over a timm ConvNeXt, tiny variant (UperNetTiny), on small
# synthetic scenes. Train it under any ZeRO stage, e.g.
#   torchrun --nproc_per_node 2 launch/train.py --config configs/upernet_tiny_synthetic.py \
#       --deepspeed_config ds_configs/zero3.json
model = dict(type='UperNetTiny', in_channels=3, num_classes=6)
data = dict(
    train=dict(type='SyntheticAerial', split='train', num_scenes=2, scene_size=128),
    val=dict(type='SyntheticAerial', split='val', num_scenes=1, scene_size=128),
    crop_size=64,
    num_workers=0)
train = dict(max_steps=20, log_interval=5, eval_interval=20, checkpoint_interval=20, warmup_log_steps=1)
