# ISPRS Potsdam (see ds_seg/data/benchmarks.py for the expected layout and its metric convention)
# with mmsegmentation's recipe (_base_/aerial_recipe.py). Family configs inherit this and set `model`.
_base_ = ['./aerial_recipe.py']
data = dict(train=dict(type='Potsdam', data_root='data/potsdam'),
            val=dict(type='Potsdam', data_root='data/potsdam', split='val'))
