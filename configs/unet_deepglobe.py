# DeepGlobeLandCover (see ds_seg/data/benchmarks.py for the expected layout and its metric convention)
# with mmsegmentation's recipe (_base_/aerial_recipe.py).
_base_ = ['./_base_/aerial_recipe.py']
model = dict(type='UNet', in_channels=3, num_classes=6, base_channels=32, depth=4)
data = dict(train=dict(type='DeepGlobeLandCover', data_root='data/deepglobe'),
            val=dict(type='DeepGlobeLandCover', data_root='data/deepglobe', split='val'))
