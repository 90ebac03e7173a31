# ISPRS Potsdam-style experiment (6 classes, 512 crops): UperNet over ViT-L (353 M): a ZeRO-3 model; vit_huge/vit_giant or free depth/width scale it to billions.
#   deepspeed launch/train.py --config configs/upernet_vit_potsdam.py --deepspeed_config ds_configs/zero3.json
model = dict(type='UperNetViT', variant='vit_large', in_channels=3, num_classes=6, activation_checkpointing=True)
loss = dict(type='CrossEntropyLoss', ignore_index=255)
data = dict(
    train=dict(type='Potsdam', data_root='data/potsdam', split='train'),
    val=dict(type='Potsdam', data_root='data/potsdam', split='val'),
    crop_size=512,
    num_workers=4)
train = dict(max_steps=80000, log_interval=50, eval_interval=4000, checkpoint_interval=4000,
             keep_checkpoints=3, seed=0)
