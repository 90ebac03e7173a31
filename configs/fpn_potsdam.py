# ISPRS Potsdam-style experiment (6 classes, 512 crops): Semantic FPN over timm ResNet-50 (26 M); pretrained=True downloads timm weights once (or give a file path).
#   deepspeed launch/train.py --config configs/fpn_potsdam.py --deepspeed_config ds_configs/zero2.json
_base_ = ['./_base_/potsdam.py']
model = dict(type='FPN', backbone='resnet50', in_channels=3, num_classes=6, pretrained=True)
