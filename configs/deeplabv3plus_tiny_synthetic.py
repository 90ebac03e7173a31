# A seconds-long experiment for tests and CPU demos: DeepLabV3+ over a dilated timm ResNet, tiny variant (DeepLabV3PlusTiny), on small
# synthetic scenes. Train it under any ZeRO stage, e.g.
#   torchrun --nproc_per_node 2 launch/train.py --config configs/deeplabv3plus_tiny_synthetic.py \
#       --deepspeed_config ds_configs/zero3.json
_base_ = ['./unet_tiny_synthetic.py']  # data and schedule
model = dict(type='DeepLabV3PlusTiny', in_channels=3, num_classes=6)
