# ISPRS Potsdam-style experiment (6 classes, 512 crops): DeepLabV3+ over a dilated ResNet-101 (59 M); output_stride=8 is finer and 3x the FLOPs.
#   deepspeed launch/train.py --config configs/deeplabv3plus_potsdam.py --deepspeed_config ds_configs/zero2.json
model = dict(type='DeepLabV3Plus', backbone='resnet101', output_stride=16, in_channels=3, num_classes=6, pretrained=True)
loss = dict(type='CrossEntropyLoss', ignore_index=255)
data = dict(
    train=dict(type='Potsdam', data_root='data/potsdam', split='train'),
    val=dict(type='Potsdam', data_root='data/potsdam', split='val'),
    crop_size=512,
    num_workers=4)
train = dict(max_steps=80000, log_interval=50, eval_interval=4000, checkpoint_interval=4000,
             keep_checkpoints=3, seed=0)
