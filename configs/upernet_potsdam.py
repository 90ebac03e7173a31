# ISPRS Potsdam-style experiment (6 classes, 512 crops): UperNet over timm ConvNeXt-B (122 M); pretrained=True downloads timm weights once (or give a file path).
#   deepspeed launch/train.py --config configs/upernet_potsdam.py --deepspeed_config ds_configs/zero2.json
_base_ = ['./_base_/potsdam.py']
model = dict(type='UperNet', backbone='convnext_base', in_channels=3, num_classes=6, pretrained=True)
