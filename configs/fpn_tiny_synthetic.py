# A seconds-long experiment for tests and CPU demos: Semantic FPN over a timm ResNet, tiny variant (FPNTiny), on small
# synthetic scenes. Train it under any ZeRO stage, e.g.
#   torchrun --nproc_per_node 2 launch/train.py --config configs/fpn_tiny_synthetic.py \
#       --deepspeed_config ds_configs/zero3.json
_base_ = ['./unet_tiny_synthetic.py']  # data and schedule
model = dict(type='FPNTiny', in_channels=3, num_classes=6)
