# ISPRS Potsdam-style experiment (6 classes, 512 crops): UperNet over DINOv2 ViT-L/14 with 4 registers
# (304 M backbone). Weights: the DINOv2 release file or timm's state dict of
# vit_large_patch14_reg4_dinov2 (both layouts load; any crop size works).
#   deepspeed launch/train.py --config configs/upernet_dinov2_potsdam.py --deepspeed_config ds_configs/zero3.json
_base_ = ['./_base_/potsdam.py']
model = dict(type='UperNet', backbone='vit_large_patch14_reg4_dinov2', pretrained='weights/dinov2_vitl14_reg4.pth',
             in_channels=3, num_classes=6, activation_checkpointing=True)
# The ViT fine-tuning recipe (BEiT/mmseg/DINOv2): layer-wise LR decay, no weight decay on norms,
# biases, position embeddings and tokens, and the pretrained backbone at a tenth of the heads' LR.
optim = dict(layer_decay=0.9, paramwise=dict(no_weight_decay=True, backbone_lr_mult=0.1))
