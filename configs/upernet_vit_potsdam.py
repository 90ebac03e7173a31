# ISPRS Potsdam-style experiment (6 classes, 512 crops): UperNet over ViT-L (353 M): a ZeRO-3 model; vit_huge/vit_giant or free depth/width scale it to billions.
#   deepspeed launch/train.py --config configs/upernet_vit_potsdam.py --deepspeed_config ds_configs/zero3.json
_base_ = ['./_base_/potsdam.py']
model = dict(type='UperNetViT', variant='vit_large', in_channels=3, num_classes=6, activation_checkpointing=True)
