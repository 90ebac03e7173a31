# ISPRS Potsdam-style experiment (6 classes, 512 crops): DeepLabV3+ over a dilated ResNet-101 (59 M); output_stride=8 is finer and 3x the FLOPs.
#   deepspeed launch/train.py --config configs/deeplabv3plus_potsdam.py --deepspeed_config ds_configs/zero2.json
_base_ = ['./_base_/potsdam.py']
model = dict(type='DeepLabV3Plus', backbone='resnet101', output_stride=16, in_channels=3, num_classes=6, pretrained=True)
