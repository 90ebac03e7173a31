# ISPRS Potsdam-style experiment (6 classes, 512 crops): SegFormer-B2 (27 M). ImageNet MiT weights: add pretrained='path/mit_b2.pth' (NVlabs release).
#   deepspeed launch/train.py --config configs/segformer_potsdam.py --deepspeed_config ds_configs/zero2.json
_base_ = ['./_base_/potsdam.py']
model = dict(type='SegFormer', variant='mit_b2', in_channels=3, num_classes=6)
