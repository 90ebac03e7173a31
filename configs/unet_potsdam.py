# Potsdam (see ds_seg/data/benchmarks.py for the expected layout and its metric convention):
# mmsegmentation's recipe, random scale 0.5-2.0 -> crop 512 (cat_max_ratio 0.75) -> flips ->
# photometric distortion, 80k iterations.
_base_ = ['./_base_/potsdam.py']
model = dict(type='UNet', in_channels=3, num_classes=6, base_channels=32, depth=4)
