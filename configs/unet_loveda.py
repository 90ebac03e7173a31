# LoveDA (see ds_seg/data/benchmarks.py for the expected layout and its metric convention)
# with mmsegmentation's recipe (_base_/aerial_recipe.py).
_base_ = ['./_base_/aerial_recipe.py']
model = dict(type='UNet', in_channels=3, num_classes=7, base_channels=32, depth=4)
data = dict(train=dict(type='LoveDA', data_root='data/loveda'),
            val=dict(type='LoveDA', data_root='data/loveda', split='val'))
