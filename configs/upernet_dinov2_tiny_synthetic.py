# A seconds-long experiment for tests and CPU demos: UperNet over timm's DINOv2 with 4 registers
# (patch 14) at depth 2 / width 32, on synthetic scenes at a 512 crop (padded to 518 for the
# patch-14 grid). The shipped configs/upernet_dinov2_potsdam.py is the full-size model.
#   torchrun --nproc_per_node 2 launch/train.py --config configs/upernet_dinov2_tiny_synthetic.py \
#       --deepspeed_config ds_configs/zero3.json
_base_ = ['./unet_tiny_synthetic.py']  # schedule
model = dict(type='UperNet', backbone='vit_small_patch14_reg4_dinov2', in_channels=3, num_classes=6, channels=32,
             aux_head=dict(type='FCNHead', in_index=2, channels=16, loss_weight=0.4),
             backbone_kwargs=dict(depth=2, embed_dim=32, num_heads=2))
data = dict(train=dict(scene_size=512), val=dict(scene_size=512), crop_size=512)
