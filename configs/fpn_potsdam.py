# ISPRS Potsdam-style experiment (6 classes, 512 crops): Semantic FPN over timm ResNet-50 (26 M); pretrained=True downloads timm weights once (or give a file path).
#   deepspeed launch/train.py --config configs/fpn_potsdam.py --deepspeed_config ds_configs/zero2.json
model = dict(type='FPN', backbone='resnet50', in_channels=3, num_classes=6, pretrained=True)
loss = dict(type='CrossEntropyLoss', ignore_index=255)
data = dict(
    train=dict(type='Potsdam', data_root='data/potsdam', split='train'),
    val=dict(type='Potsdam', data_root='data/potsdam', split='val'),
    crop_size=512,
    num_workers=4)
train = dict(max_steps=80000, log_interval=50, eval_interval=4000, checkpoint_interval=4000,
             keep_checkpoints=3, seed=0)
