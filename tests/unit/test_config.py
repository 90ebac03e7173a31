"""Experiment-config and DeepSpeed-JSON checks: every user mistake named before training."""
import json
import os
from pathlib import Path

import pytest

import ds_seg  # noqa: F401 -- registers everything
from ds_seg.config import (DEFAULTS, DS_CONFIGS_DIR, REPO_ROOT, ConfigError, load_config, load_ds_config,
                           resolve_batch, resolve_ds_config)
from ds_seg.registry import DATASETS, LOSSES, MODELS, RegistryError, build, lookup

SHIPPED = sorted((REPO_ROOT / 'ds_configs').glob('*.json'))


def test_registries_hold_core_entries():
    assert {'UNet', 'UNetTiny'} <= set(MODELS.module_dict)
    assert {'SyntheticAerial', 'GeoTiffScenes'} <= set(DATASETS.module_dict)
    assert 'CrossEntropyLoss' in LOSSES.module_dict


def test_unknown_registry_name_lists_known_and_close_matches():
    with pytest.raises(RegistryError) as err:
        build(MODELS, dict(type='Unet'), where='model')
    msg = str(err.value)
    assert "model.type: 'Unet' is not a registered model" in msg
    assert "Did you mean 'UNet'" in msg and 'UNetTiny' in msg


def test_unknown_model_argument_is_named():
    with pytest.raises(RegistryError, match=r"model.base_channel: UNet has no argument 'base_channel'.*"
                                            r"Did you mean 'base_channels'"):
        build(MODELS, dict(type='UNet', base_channel=8), where='model')


def test_lookup_returns_class():
    assert lookup(LOSSES, 'CrossEntropyLoss').__name__ == 'CrossEntropyLoss'


def test_default_config_without_file():
    cfg = load_config(None)
    assert cfg.model.type == DEFAULTS['model']['type']
    assert cfg.data.train.type == 'SyntheticAerial'
    assert cfg.config_name == 'default'


def test_cfg_options_override_and_type_change_replaces_section():
    cfg = load_config(None, ['train.max_steps=7', 'model.type=UNetTiny', 'data.crop_size=64'])
    assert cfg.train.max_steps == 7 and cfg.data.crop_size == 64
    assert dict(cfg.model) == {'type': 'UNetTiny'}  # UNet's base_channels must not leak into UNetTiny


def test_config_file_merges_over_defaults(tmp_path):
    path = tmp_path / 'exp.py'
    path.write_text("train = dict(max_steps=11)\nmodel = dict(base_channels=8)\n")
    cfg = load_config(str(path))
    assert cfg.train.max_steps == 11 and cfg.train.log_interval == DEFAULTS['train']['log_interval']
    assert cfg.model.base_channels == 8 and cfg.model.type == 'UNet'
    assert cfg.config_name == 'exp'


def test_delete_marker_replaces_the_default_section_as_in_mmengine(tmp_path):
    """``_delete_=True`` (mmengine's marker) replaces the default instead of merging into it; it
    never reaches the built object (CombinedLoss has no argument '_delete_')."""
    path = tmp_path / 'exp.py'
    path.write_text("loss = dict(_delete_=True, type='CrossEntropyLoss', label_smoothing=0.1)\n"
                    "model = dict(type='UNet', base_channels=8)\n")
    cfg = load_config(str(path))
    assert dict(cfg.loss) == {'type': 'CrossEntropyLoss', 'label_smoothing': 0.1}  # no default ignore_index
    assert cfg.model.base_channels == 8 and cfg.model.depth == DEFAULTS['model']['depth']  # merged
    merged = load_config(None, ['loss.label_smoothing=0.1'])
    assert merged.loss.ignore_index == DEFAULTS['loss']['ignore_index']
    path.write_text("loss = dict(_delete_=False, label_smoothing=0.1)\n")
    assert dict(load_config(str(path)).loss) == dict(DEFAULTS['loss'], label_smoothing=0.1)
    path.write_text("loss = dict(_delete_=True, type='CombinedLoss', losses=[dict(_delete_=True, type='DiceLoss')])\n")
    assert dict(load_config(str(path)).loss) == {'type': 'CombinedLoss', 'losses': [{'type': 'DiceLoss'}]}
    # A section without a type has nothing to be replaced by: its other keys would go missing.
    path.write_text("train = dict(_delete_=True, max_steps=5)\n")
    with pytest.raises(ConfigError, match=r"'train._delete_': only a section with a 'type' .* in train give only"):
        load_config(str(path))


@pytest.mark.parametrize('options, message', [
    (['train.max_step=3'], r"--cfg-options: unknown key 'train.max_step'. Did you mean 'train.max_steps'"),
    (['trian.max_steps=3'], r"unknown key 'trian'. Did you mean 'train'"),
    (['train.max_steps=0'], r'train.max_steps must be a positive integer'),
    (['data.crop_size=8'], r'data.crop_size must be an integer >= 16'),
    (['model=3'], r"'model' must be a dict with a 'type' key"),
    (['train=1', 'train.max_steps=2'],
     r"'train.max_steps=2' sets a key inside train, which an earlier option set to 1"),
    (['train.dist_timeout_s=1e999'], r'train.dist_timeout_s must be a finite number > 0 or None, got inf'),
    # data.random_scale silently replaced the training set's own
    (['data.random_scale=(0.5, 2.0)', 'data.train.random_scale=(1.0, 1.5)'],
     r'data.train.random_scale=\(1.0, 1.5\) conflicts with data.random_scale=\(0.5, 2.0\) \(which replaces it\)'),
    # mmengine's key: a plain "unknown key"
    (['resume=True'], r"unknown key 'resume'\. In ds_seg a run is continued by the command's --resume auto"),
    # "no scaling" given for the training set: trained at the inherited data.random_scale all the same
    (['data.random_scale=(0.5, 2.0)', 'data.train.random_scale=None'],
     r'data.train.random_scale=None conflicts with data.random_scale=\(0.5, 2.0\) .* set data.random_scale=None'),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, options)


@pytest.mark.parametrize('text, option, message', [
    ('train = 5\n', 'train.max_steps=4', r"--cfg-options: train.max_steps sets a key inside train, which is 5 there; "
                                          r"give train as a dict of its keys. \(the value set by .*bad.py\)"),
    ('data = 3\n', 'data.crop_size=64', r"--cfg-options: data.crop_size sets a key inside data, which is 3 there"),
])
def test_an_option_inside_a_section_the_file_made_a_value_is_one_line(tmp_path, text, option, message):
    """The options replaced the file's scalar section with a dict of their keys alone: a KeyError
    traceback ('seed') deep inside the trainer. (The file alone was refused in one line.)"""
    path = tmp_path / 'bad.py'
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), [option])


@pytest.mark.parametrize('name, text, message', [
    ('list.json', '[1, 2, 3]', r'list.json: an experiment config is a mapping of sections .* this file is a list \(\[1, 2, 3\]\)'),
    ('word.yaml', '"hello"\n', r'word.yaml: an experiment config is a mapping .* this file is a str'),
    ('null.yaml', 'null\n', r'null.yaml: an experiment config is a mapping .* this file is empty'),
    ('call.py', 'import numpy as np\ntrain = dict(max_steps=np.int64(4))\n',
     r'call.py: cannot be loaded: RuntimeError without a message; a config that calls a function of an imported '
     r'module needs that call replaced by its value'),
    # A config's sys.exit() ended the run silently, with the config's status (3: "non-finite losses").
    ('exits.py', 'import sys\nsys.exit(3)\n', r'exits.py: cannot be loaded: it calls sys.exit\(3\); a config only sets values'),
    ('exit0.py', 'exit()\n', r'exit0.py: cannot be loaded: it calls sys.exit\(None\)'),
])
def test_config_files_of_the_wrong_shape_say_what_they_are(tmp_path, name, text, message):
    """"'list' object has no attribute 'get'", and for a config calling np.int64(4) nothing at all
    after "cannot be loaded:" (mmengine's bare RuntimeError)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


@pytest.mark.parametrize('base', [False, True])
def test_a_yaml_config_never_runs_what_its_tags_name(tmp_path, base):
    """A YAML config (or a YAML _base_ of one) with !!python/object/apply:os.system ran the command
    (mmengine reads YAML with yaml's full Loader), then was refused for its value. Now it is read
    with the SafeLoader: refused in one line, and nothing ran."""
    marker = tmp_path / 'ran'
    evil = tmp_path / 'evil.yaml'
    evil.write_text(f'train: !!python/object/apply:os.system ["touch {marker}"]\n')
    path = evil
    if base:
        path = tmp_path / 'child.py'
        path.write_text("_base_ = ['evil.yaml']\ntrain = dict(max_steps=3)\n")
    with pytest.raises(ConfigError, match=r"cannot be loaded: could not determine a constructor for the tag "
                                          r"'tag:yaml.org,2002:python/object/apply:os.system'.*plain values"):
        load_config(str(path))
    assert not marker.exists()
    (tmp_path / 'plain.yaml').write_text('train:\n  max_steps: 3\n  seed: 7\n')  # plain YAML still loads
    assert load_config(str(tmp_path / 'plain.yaml')).train.seed == 7


def test_a_relative_mlflow_store_is_made_absolute_once_as_data_paths_are(tmp_path, monkeypatch):
    """log.mlflow_tracking_uri=myruns followed the folder the command ran in: a resume started from
    another folder opened a second store and split the run's history."""
    monkeypatch.chdir(tmp_path)
    for given, want in (('myruns', str(tmp_path / 'myruns')), ('~/mlruns', os.path.expanduser('~/mlruns')),
                        ('file:///abs/mlruns', 'file:///abs/mlruns'), ('http://127.0.0.1:5000', 'http://127.0.0.1:5000'),
                        ('databricks', 'databricks')):
        cfg = load_config(None, [f'log.mlflow_tracking_uri={given}'])
        assert cfg.log.mlflow_tracking_uri == want, given


def test_a_yaml_number_without_a_dot_is_a_number_as_in_json_and_python(tmp_path):
    """YAML 1.1 reads 9e-1 and 1e-4 as text (its floats need a dot): refused as "got '9e-1'", or a
    string where a number was meant. Quoted, it stays text."""
    (tmp_path / 'c.yaml').write_text("data:\n  train:\n    type: SyntheticAerial\n    cat_max_ratio: 9e-1\n"
                                     "    max_nodata_ratio: 5E-1\n    classes: ['1e5', e5]\ntrain:\n  max_steps: 2\n")
    train = load_config(str(tmp_path / 'c.yaml')).data.train
    assert (train.cat_max_ratio, train.max_nodata_ratio, list(train.classes)) == (0.9, 0.5, ['1e5', 'e5'])


def test_an_mmseg_optimizer_block_in_a_config_file_is_pointed_to_the_deepspeed_json(tmp_path):
    """The same in a config file, where a bare unknown key is otherwise taken for a helper variable."""
    (tmp_path / 'mmseg_style.py').write_text("optimizer = dict(type='AdamW', lr=6e-5)\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer'. In ds_seg the optimizer is set in the DeepSpeed "
                                          r"JSON .*: its 'optimizer' block\. Known keys"):
        load_config(str(tmp_path / 'mmseg_style.py'))


@pytest.mark.parametrize('options, message', [
    (['optim.lr=0.1'], r"unknown key 'optim.lr'. In ds_seg the optimizer's lr is set in the DeepSpeed JSON "
                       r"\(--deepspeed_config; .*\): optimizer.params.lr\."),
    (["optim_wrapper=dict(type='OptimWrapper')"], r"unknown key 'optim_wrapper'.*the DeepSpeed JSON.*'optimizer' block"),
    (['param_scheduler=[]'], r"'param_scheduler'.*the DeepSpeed JSON.*'scheduler' block"),
    (['data.samples_per_gpu=4'], r"'data.samples_per_gpu'.*train_micro_batch_size_per_gpu and gradient_accumulation"),
    (['fp16=True'], r"'fp16'.*precision is set in the DeepSpeed JSON"),
    (['train.max_iters=80000'], r"'train.max_iters'. In ds_seg the run's length is train.max_steps\."),
])
def test_settings_of_the_deepspeed_json_are_pointed_there(options, message):
    """mmsegmentation users look for the learning rate, schedule, batch and precision in the
    config; ds_seg keeps them in the DeepSpeed JSON, and the refusal says where."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, options)
    # the places named exist in a shipped JSON
    ds = json.load(open(os.path.join(DS_CONFIGS_DIR, 'zero2.json')))
    assert {'lr', 'weight_decay'} <= set(ds['optimizer']['params']) and 'scheduler' in ds
    assert {'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps', 'gradient_clipping', 'fp16'} <= set(ds)


def test_home_in_work_dir_and_load_from_is_expanded(tmp_path, monkeypatch):
    """work_dir='~/runs/x' in a config made a folder literally named '~' in the current directory;
    load_from='~/w.pt' was reported missing. Both now mean the home directory, as in a shell."""
    monkeypatch.setenv('HOME', str(tmp_path))
    (tmp_path / 'w.pt').write_bytes(b'')
    config = tmp_path / 'c.py'
    config.write_text("work_dir = '~/runs/x'\nload_from = '~/w.pt'\n")
    for cfg in (load_config(str(config)), load_config(None, ["work_dir='~/runs/x'", "load_from='~/w.pt'"])):
        assert cfg.work_dir == str(tmp_path / 'runs' / 'x') and cfg.load_from == str(tmp_path / 'w.pt')


def test_cfg_options_given_twice_both_apply():
    from ds_seg.cli.train import parse_args
    args = parse_args(['--cfg-options', 'train.max_steps=2', '--cfg-options', 'train.checkpoint_interval=2'])
    cfg = load_config(None, args.cfg_options)
    assert (cfg.train.max_steps, cfg.train.checkpoint_interval) == (2, 2)


def test_a_section_dict_after_keys_inside_it_keeps_them_unless_it_names_another_type():
    """'train.seed=2 train=dict(max_steps=5)' trained with seed 0: the dict replaced the option
    before it. Both apply now, the later winning on a key; a model of another type is whole."""
    from ds_seg.cli.train import parse_args
    args = parse_args(['--cfg-options', 'train.seed=2', 'train=dict(max_steps=5, seed=3)', 'train.log_interval=4',
                       'model.base_channels=8', 'model=dict(depth=3)', '--cfg-options', 'train=dict(max_steps=6)'])
    cfg = load_config(None, args.cfg_options)
    assert (cfg.train.seed, cfg.train.max_steps, cfg.train.log_interval) == (3, 6, 4)
    assert (cfg.model.base_channels, cfg.model.depth) == (8, 3)
    assert load_config(None, ['model.base_channels=8', "model=dict(type='FPNTiny')"]).model == dict(type='FPNTiny')


def test_cfg_options_unbracketed_commas_make_a_list_as_in_mmengine():
    from ds_seg.config import parse_cfg_options
    options = parse_cfg_options(["a=x.tif,y.tif", 'b=1,2', "c=['x,y']", 'd=x', "e='x,y'", 'f=true,none,0.5'])
    assert options == {'a': ['x.tif', 'y.tif'], 'b': (1, 2), 'c': ['x,y'], 'd': 'x', 'e': 'x,y',
                       'f': [True, None, 0.5]}
    cfg = load_config(None, ["data.train.classes=grass,building,road,water,tree,bare"])
    assert list(cfg.data.train.classes) == ['grass', 'building', 'road', 'water', 'tree', 'bare']
    # Brackets of unquoted words (the shell takes the quotes off) are lists and tuples too, as in
    # mmengine: [B04,B03] was one string, the asset name '[B04,B03]'.
    options = parse_cfg_options(['a=[B04,B03,B08_20m]', 'b=[[may.tif,aug.tif],[x.tif,y.tif]]', 'c=(1,word)',
                                 'd=[ab]*.tif', 'e=[a, 0.5, none]', 'f=[]'])
    assert options == {'a': ['B04', 'B03', 'B08_20m'], 'b': [['may.tif', 'aug.tif'], ['x.tif', 'y.tif']],
                       'c': (1, 'word'), 'd': '[ab]*.tif', 'e': ['a', 0.5, None], 'f': []}
    assert parse_cfg_options(["x=[a, 'b,c']"]) == {'x': ['a', 'b,c']}  # a quoted comma is the item's
    for typo in ('x=[B04,[B03,B08]', 'x=[a,b]]'):  # an item lost to a typo, refused as in mmengine
        with pytest.raises(ConfigError, match='unbalanced brackets'):
            parse_cfg_options([typo])


def test_cfg_options_set_an_item_of_a_list_by_its_index_as_in_mmengine():
    """data.train.transforms.0.prob=0.5 (mmengine's list keys) was refused with advice that could
    not work: "give data.train.transforms as a dict of its keys" (it is a list)."""
    base = str(REPO_ROOT / 'configs' / 'unet_potsdam.py')
    assert load_config(base, []).data.train.transforms == [dict(type='PhotoMetricDistortion')]
    cfg = load_config(base, ['data.train.transforms.0.brightness_delta=16'])
    assert cfg.data.train.transforms == [dict(type='PhotoMetricDistortion', brightness_delta=16)]
    # An item of another type replaces the old one whole (none of its settings kept).
    cfg = load_config(base, ['data.train.transforms.0.brightness_delta=16', "data.train.transforms.0=dict(type='X')"])
    assert cfg.data.train.transforms == [dict(type='X')]
    with pytest.raises(ConfigError, match=r'^--cfg-options: data.train.transforms.3: data.train.transforms has 1 '
                                          r'item\(s\) \(indices 0 to 0\); give an index below 1, or the whole list'):
        load_config(base, ['data.train.transforms.3.prob=0.5'])
    with pytest.raises(ConfigError, match=r'data.train.transforms.type sets a key inside data.train.transforms, which '
                                          r'is a list there .*; give the whole list \(data.train.transforms=\[...\]\), '
                                          r'or one item by its index \(data.train.transforms.0.type=...\)'):
        load_config(base, ["data.train.transforms.type=RandomFlip"])


def test_cfg_options_take_dict_calls_as_config_files_write_them():
    """model=dict(type='UperNet', backbone=...) (how every mmseg config and the README write a
    section) was split at its commas into a list of strings and refused as 'must be a dict'.
    Calls of literals read as the dict they build, nested ones too; any other call stays a string."""
    from ds_seg.config import parse_cfg_options
    options = parse_cfg_options(["model=dict(type='UperNet', backbone='convnext_tiny', kw=dict(a=[1, dict(b=-2)]))",
                                 'y=dict(**z)', 'w=scene(1).tif'])
    assert options == {'model': {'type': 'UperNet', 'backbone': 'convnext_tiny', 'kw': {'a': [1, {'b': -2}]}},
                       'y': 'dict(**z)', 'w': 'scene(1).tif'}
    cfg = load_config(None, ["model=dict(type='UNetTiny', in_channels=3, num_classes=6)"])
    assert cfg.model.to_dict() == {'type': 'UNetTiny', 'in_channels': 3, 'num_classes': 6}


def test_helper_variables_of_a_config_file_begin_with_an_underscore(tmp_path):
    """mmseg configs compute settings from helper variables (crop_size = (512, 512)); here those
    begin with '_' and are not settings. A bare one is an unknown key, and the message says so."""
    (tmp_path / 'helpers.py').write_text("_crop = 96\ndata = dict(crop_size=_crop)\n")
    cfg = load_config(str(tmp_path / 'helpers.py'))
    assert cfg.data.crop_size == 96 and '_crop' not in cfg
    (tmp_path / 'bare.py').write_text("crop = 96\ndata = dict(crop_size=crop)\n")
    with pytest.raises(ConfigError, match=r"unknown key 'crop'.*begin its name with '_', as in _crop = "):
        load_config(str(tmp_path / 'bare.py'))


def test_missing_config_file_lists_shipped(tmp_path):
    with pytest.raises(ConfigError, match=r'does not exist. Configs shipped in configs/'):
        load_config(str(tmp_path / 'nope.py'))


def test_a_bare_name_takes_the_users_copy_in_the_current_folder_first(tmp_path, monkeypatch):
    # The README's copy-out recipe, then an edit: `--config unet_tiny_synthetic` trained the
    # shipped file and ignored the edit without a word.
    from ds_seg.config import CONFIGS_DIR
    monkeypatch.chdir(tmp_path)
    text = (CONFIGS_DIR / 'unet_tiny_synthetic.py').read_text()
    (tmp_path / 'unet_tiny_synthetic.py').write_text(text.replace("type='UNetTiny'", "type='FPNTiny'"))
    assert "type='UNetTiny'" in text
    assert load_config('unet_tiny_synthetic').model.type == 'FPNTiny'
    assert load_config('upernet_tiny_synthetic').model.type == 'UperNetTiny'  # no copy here: the shipped one


def test_a_config_path_without_its_suffix_is_the_file_with_it(tmp_path):
    """`--config cfgs/mine` (cfgs/mine.py there) and a shipped config's full path without .py were
    'does not exist', where a bare shipped name works."""
    from ds_seg.config import CONFIGS_DIR
    (tmp_path / 'cfgs').mkdir()
    text = (CONFIGS_DIR / 'unet_tiny_synthetic.py').read_text().replace("type='UNetTiny'", "type='FPNTiny'")
    (tmp_path / 'cfgs' / 'mine.py').write_text(text)
    assert load_config(str(tmp_path / 'cfgs' / 'mine')).model.type == 'FPNTiny'
    assert load_config(str(CONFIGS_DIR / 'upernet_tiny_synthetic')).model.type == 'UperNetTiny'
    (tmp_path / 'ds.json').write_text(json.dumps({'train_micro_batch_size_per_gpu': 3, 'optimizer': {
        'type': 'AdamW', 'params': {'lr': 0.001}}}))
    assert load_ds_config(str(tmp_path / 'ds'))['train_micro_batch_size_per_gpu'] == 3
    with pytest.raises(ConfigError, match='does not exist'):
        load_config(str(tmp_path / 'cfgs' / 'other'))


def test_a_shipped_config_copied_out_without_its_bases_says_what_to_copy(tmp_path):
    from ds_seg.config import CONFIGS_DIR
    (tmp_path / 'my_potsdam.py').write_text((CONFIGS_DIR / 'unet_potsdam.py').read_text())
    with pytest.raises(ConfigError, match=r"my_potsdam.py: cannot be loaded: .*; it inherits the shipped "
                                          r"_base_/potsdam.py: copy it beside the config, keeping files of yours \(cp -rn .*_base_ ") as err:
        load_config(str(tmp_path / 'my_potsdam.py'))
    hint = str(err.value).split('(cp -rn ')[1].rstrip(')').split()
    import shutil
    shutil.copytree(hint[0], os.path.join(hint[1], os.path.basename(hint[0])))  # what the line says to do
    assert load_config(str(tmp_path / 'my_potsdam.py')).model.type == 'UNet'


# -- DeepSpeed JSON ---------------------------------------------------------------------------

@pytest.mark.parametrize('path', SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_ds_configs_pass_and_resolve_at_any_world_size(path):
    ds = load_ds_config(path)
    assert 'train_batch_size' not in ds, 'a hard-coded global batch breaks when the GPU count changes'
    for world in (1, 2, 3, 8):
        resolved, precision, _ = resolve_ds_config(ds, world, max_steps=1000, supports=lambda p: True)
        assert resolved['train_batch_size'] == (ds['train_micro_batch_size_per_gpu']
                                                * ds['gradient_accumulation_steps'] * world)
        assert precision in ('fp16', 'bf16')
    if 'fp16' in ds:
        assert ds['fp16']['enabled'] and ds['fp16']['loss_scale'] == 0  # dynamic loss scaling


def _write(tmp_path, obj):
    path = tmp_path / 'ds.json'
    path.write_text(json.dumps(obj))
    return path


def test_unknown_top_level_key_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown top-level key 'gradient_clippin'. Did you mean 'gradient_clipping'"):
        load_ds_config(_write(tmp_path, {'train_micro_batch_size_per_gpu': 2, 'gradient_clippin': 1.0}))


def test_auto_anywhere_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"'bf16.enabled' is \"auto\""):
        load_ds_config(_write(tmp_path, {'train_micro_batch_size_per_gpu': 2, 'bf16': {'enabled': 'auto'}}))
    with pytest.raises(ConfigError, match=r"'optimizer.params.betas\[1\]' is \"auto\""):
        load_ds_config(_write(tmp_path, {'optimizer': {'type': 'AdamW', 'params': {'betas': [0.9, 'auto']}}}))


def test_invalid_json_named(tmp_path):
    path = tmp_path / 'bad.json'
    path.write_text('{"train_micro_batch_size_per_gpu": 2,}')
    with pytest.raises(ConfigError, match=r'bad.json: not valid JSON'):
        load_ds_config(path)


def _shipped_zero0(**change):
    ds = json.loads((DS_CONFIGS_DIR / 'zero0.json').read_text())
    for path, value in change.items():
        *parents, key = path.split('__')
        node = ds
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
    return ds


# One step past the obvious in each class of DeepSpeed JSON value: what DeepSpeed's models would
# convert leniently, a true/false read as 1/0, a schedule that goes negative, a typo in a block
# other than zero/fp16/bf16. Each is one line naming the key.
DS_VALUE_REFUSALS = {
    'stage_quoted': (dict(zero_optimization__stage='2'), "'zero_optimization.stage' must be a number, got \"2\" (write it without quotes)"),
    'stage_4': (dict(zero_optimization__stage=4), "'zero_optimization.stage' is 4: use one of 0, 1, 2, 3."),
    'fp16_yes': (dict(fp16__enabled='yes'), "'fp16.enabled' must be true or false, got \"yes\""),
    'flag_as_number': (dict(zero_optimization__overlap_comm=1), "'zero_optimization.overlap_comm' must be true or false, got 1"),
    'number_as_flag': (dict(fp16__initial_scale_power=True), "'fp16.initial_scale_power' must be a number, got true"),
    'nested_quoted': (dict(zero_optimization__stage=3, zero_optimization__offload_param={'device': 'cpu', 'pin_memory': 'true'}),
                      "'zero_optimization.offload_param.pin_memory' must be true or false"),
    'lr_true': (dict(optimizer__params__lr=True), "'optimizer.params.lr' must be a number, got true"),
    'warmup_true': (dict(scheduler__params__warmup_num_steps=True), "'scheduler.params.warmup_num_steps' must be a number, got true"),
    'ratio_negative': (dict(scheduler__params__warmup_min_ratio=-0.5), "'scheduler.params.warmup_min_ratio' must be a number in [0, 1], got -0.5"),
    'ratio_above_one': (dict(scheduler__params__cos_min_ratio=2), "'scheduler.params.cos_min_ratio' must be a number in [0, 1], got 2"),
    'warmup_backwards': (dict(scheduler={'type': 'WarmupLR', 'params': {'warmup_min_lr': 0.01, 'warmup_max_lr': 0.001}}),
                         "'scheduler.params.warmup_min_lr' (0.01) is above 'warmup_max_lr' (0.001); the WarmupLR schedule "
                         "would run backwards"),
    'warmup_min_above_default_max': (dict(scheduler={'type': 'WarmupDecayLR', 'params': {'warmup_min_lr': 0.01,
                                                                                          'total_num_steps': 10}}),
                                     "'scheduler.params.warmup_min_lr' (0.01) is above 'warmup_max_lr' (0.001)"),
    'one_cycle_backwards': (dict(scheduler={'type': 'OneCycle', 'params': {'cycle_min_lr': 0.01, 'cycle_max_lr': 0.001}}),
                            "'scheduler.params.cycle_min_lr' (0.01) is above 'cycle_max_lr' (0.001)"),
    'warmup_type_unknown': (dict(scheduler__params__warmup_type='exp'),
                            "'scheduler.params.warmup_type' must be 'log' or 'linear', got 'exp'"),
    'flag_quoted': (dict(optimizer__params__torch_adam='false'),
                    "'optimizer.params.torch_adam' must be true or false, got 'false' (write it without quotes)"),
    'grad_accum_fp8': (dict(data_types={'grad_accum_dtype': 'fp8'}),
                       "'data_types.grad_accum_dtype' must be one of 'fp16', 'float16', 'half', 'fp32'"),
    'total_steps_fraction': (dict(scheduler={'type': 'WarmupDecayLR', 'params': {'warmup_max_lr': 0.001,
                                                                                 'total_num_steps': 6.5}}),
                             "'scheduler.params.total_num_steps' counts steps: it must be an integer, got 6.5"),
    'stage_fraction': (dict(zero_optimization__stage=2.5), "'zero_optimization.stage' is 2.5: use one of 0, 1, 2, 3."),
    'node_local_yes': (dict(checkpoint={'use_node_local_storage': 'yes'}),
                       "'checkpoint.use_node_local_storage' must be true or false, got \"yes\" (write it without quotes)"),
    'comms_logger_typo': (dict(comms_logger={'enabeld': True}), "unknown key 'comms_logger.enabeld'. Did you mean 'comms_logger.enabled'?"),
    'tensorboard_typo': (dict(tensorboard={'enabeld': True}), "unknown key 'tensorboard.enabeld'. Did you mean 'tensorboard.enabled'?"),
    # Blocks DeepSpeed reads as plain dicts (no pydantic model): keys from its constants modules.
    'checkpoint_typo': (dict(checkpoint={'tag_validaton': 'Warn'}), "unknown key 'checkpoint.tag_validaton'. Did you mean 'checkpoint.tag_validation'?"),
    'checkpoint_writer_typo': (dict(checkpoint={'writer': {'tpye': 'fast'}}), "unknown key 'checkpoint.writer.tpye'. Did you mean 'checkpoint.writer.type'?"),
    'aio_typo': (dict(aio={'queue_dept': 8}), "unknown key 'aio.queue_dept'. Did you mean 'aio.queue_depth'?"),
    'flops_profiler_typo': (dict(flops_profiler={'enabeld': True}), "unknown key 'flops_profiler.enabeld'. Did you mean 'flops_profiler.enabled'?"),
    'data_types_typo': (dict(data_types={'grad_acum_dtype': 'fp32'}), "unknown key 'data_types.grad_acum_dtype'. Did you mean 'data_types.grad_accum_dtype'?"),
    'timers_typo': (dict(timers={'throughput': {'enabld': True}}), "unknown key 'timers.throughput.enabld'. Did you mean 'timers.throughput.enabled'?"),
    'optimizer_block_typo': (dict(optimizer__parms={}), "unknown key 'optimizer.parms'. Did you mean 'optimizer.params'?"),
    'torch_autocast_typo': (dict(torch_autocast={'enabeld': True}), "unknown key 'torch_autocast.enabeld'. Did you mean 'torch_autocast.enabled'?"),
    'act_ckpt_typo': (dict(activation_checkpointing={'partition_activatons': True}),
                      "unknown key 'activation_checkpointing.partition_activatons'. Did you mean 'activation_checkpointing.partition_activations'?"),
    'act_ckpt_set': (dict(activation_checkpointing={'partition_activations': True}),
                     "'activation_checkpointing' in the DeepSpeed JSON has no effect in ds_seg"),
    'removed_block': (dict(nebula={'enabled': True}), "DeepSpeed refuses this config: Nebula checkpointing has been removed"),
    # Top-level flags DeepSpeed reads without a type check (rule derived from its constants'
    # true/false defaults): a quoted "false" would be a true value.
    'drop_last_quoted': (dict(dataloader_drop_last='false'), "'dataloader_drop_last' must be true or false, got \"false\""),
    'allgather_object': (dict(disable_allgather={}), "'disable_allgather' must be true or false, got {}"),
    'python_gc_number': (dict(disable_python_gc=1), "'disable_python_gc' must be true or false, got 1"),
    'log_level_unknown': (dict(log_level='verbose'), "'log_level' must be one of 'debug', 'info', 'warning', 'error', 'critical', got \"verbose\""),
    # Infinity, NaN and 1e999 are read by Python's JSON reader: "lr": Infinity passed every
    # check and turned the weights to NaN at the first step.
    'lr_infinity': (dict(optimizer__params__lr=float('inf')), "'optimizer.params.lr' is Infinity; give a finite number."),
    'clip_infinity': (dict(gradient_clipping=float('inf')), "'gradient_clipping' is Infinity; give a finite number."),
    'betas_nan': (dict(optimizer__params__betas=[0.9, float('nan')]), "'optimizer.params.betas[1]' is not finite"),
    # DeepSpeed reads torch_autocast as a plain dict by truth value: "false" turned autocast on.
    'autocast_quoted': (dict(torch_autocast={'enabled': 'false'}),
                        "'torch_autocast.enabled' must be true or false, got \"false\" (write it without quotes)"),
    'autocast_number': (dict(torch_autocast={'enabled': 1}), "'torch_autocast.enabled' must be true or false, got 1"),
    'autocast_modules': (dict(torch_autocast={'enabled': True, 'lower_precision_safe_modules': 'torch.nn.Linear'}),
                         "'torch_autocast.lower_precision_safe_modules' must be a list"),
    # A block given as null/true/a list: "bf16": null crashed with a traceback, "scheduler": null
    # (meaning "none") drew DeepSpeed's "'NoneType' object has no attribute 'keys'".
    'bf16_null': (dict(bf16=None), "'bf16' must be an object ({...}), got null; remove the key to leave bf16 out."),
    'scheduler_null': (dict(scheduler=None), "'scheduler' must be an object ({...}), got null; remove the key"),
    'zero_number': (dict(zero_optimization=2), "'zero_optimization' must be an object ({...}), got 2"),
    'optimizer_list': (dict(optimizer=[]), "'optimizer' must be an object ({...}), got []; give one such as"),
    'autocast_true': (dict(torch_autocast=True), "'torch_autocast' must be an object ({...}), got true"),
    # WarmupDecayLR peaks at DeepSpeed's 0.001 whatever the optimizer's lr: 10x the 1e-4 written.
    'decay_peak': (dict(optimizer__params__lr=1e-4, scheduler={'type': 'WarmupDecayLR', 'params': {'warmup_num_steps': 2}}),
                   "WarmupDecayLR without 'scheduler.params.warmup_max_lr' peaks at DeepSpeed's default 0.001, "
                   "not at 'optimizer.params.lr' (0.0001); give \"warmup_max_lr\": 0.0001"),
    # LRRangeTest starts at its own 0.001 whatever the optimizer's lr: 10x the 1e-4 written.
    'range_test_start': (dict(optimizer__params__lr=1e-4, scheduler={'type': 'LRRangeTest', 'params': {}}),
                         "LRRangeTest without 'scheduler.params.lr_range_test_min_lr' starts at DeepSpeed's default "
                         "0.001, not at 'optimizer.params.lr' (0.0001); give \"lr_range_test_min_lr\": 0.0001"),
    # DeepSpeed ignores offload blocks its stage does not implement: no offload, no word.
    'offload_param_stage2': (dict(zero_optimization={'stage': 2, 'offload_param': {'device': 'cpu'}}),
                             "'zero_optimization.offload_param' (device 'cpu') needs ZeRO stage 3, and DeepSpeed "
                             "ignores it at stage 2"),
    'offload_optimizer_stage0': (dict(zero_optimization={'stage': 0, 'offload_optimizer': {'device': 'cpu'}}),
                                 "'zero_optimization.offload_optimizer' (device 'cpu') needs ZeRO stage 1, 2 or 3"),
    # DeepSpeed's older names for the two blocks passed the check above: trained, nothing offloaded.
    'cpu_offload_param_stage2': (dict(zero_optimization={'stage': 2, 'cpu_offload_param': True}),
                                 "'zero_optimization.cpu_offload_param' (DeepSpeed's older name for 'offload_param') "
                                 "needs ZeRO stage 3, and DeepSpeed ignores it at stage 2"),
    'cpu_offload_stage0': (dict(zero_optimization={'stage': 0, 'cpu_offload': True}),
                           "'zero_optimization.cpu_offload' (DeepSpeed's older name for 'offload_optimizer') needs "
                           "ZeRO stage 1, 2 or 3"),
    # 'sgd' was told "Did you mean 'sgd'?": the suggestion is as torch spells it.
    'optimizer_sgd_lower': (dict(optimizer={'type': 'sgd', 'params': {'lr': 0.1}}),
                            "'optimizer.type' 'sgd' is torch.optim's SGD; spell it 'SGD'."),
    # torch's names in another case passed the check, then failed in it (getattr(torch.optim, 'nadam')).
    'optimizer_nadam_lower': (dict(optimizer={'type': 'nadam', 'params': {'lr': 0.1}}),
                              "'optimizer.type' 'nadam' is torch.optim's NAdam; spell it 'NAdam'."),
    # Names DeepSpeed lists and the refusal offered: a traceback at the first step or in deepspeed.initialize.
    'optimizer_muon': (dict(optimizer={'type': 'muon', 'params': {'lr': 0.1}}),
                       "'optimizer.type' 'muon' is DeepSpeed's Muon, which orthogonalises 2-D weight matrices"),
    'optimizer_musgd': (dict(optimizer={'type': 'musgd', 'params': {'lr': 0.1}}),
                        "'optimizer.type' 'musgd' is one of mup's (muP) optimizers"),
    # NVMe: ignored below stage 3 (exit 0, nothing offloaded), a TypeError traceback without a
    # path, a JIT-build traceback without libaio.
    'nvme_stage2': (dict(zero_optimization={'stage': 2, 'offload_optimizer': {'device': 'nvme', 'nvme_path': '/nvme'}}),
                    "'zero_optimization.offload_optimizer.device' \"nvme\" needs ZeRO stage 3"),
    'nvme_no_path': (dict(zero_optimization={'stage': 3, 'offload_optimizer': {'device': 'nvme'}}),
                     "no 'zero_optimization.offload_optimizer.nvme_path' names the local NVMe folder"),
    # Features that act through parts of DeepSpeed ds_seg does not use: accepted, they changed
    # nothing (data sampling, drop_last of DeepSpeed's loader) or failed after training started.
    'data_efficiency_on': (dict(data_efficiency={'enabled': True, 'data_routing': {'enabled': True, 'random_ltd': {
        'enabled': True}}}), "'data_efficiency' is switched on, but it has no effect in ds_seg (its data sampling"),
    'random_ltd_nested': (dict(data_efficiency={'data_routing': {'random_ltd': {'enabled': True}}}),
                          "'data_efficiency' is switched on"),
    'drop_last_on': (dict(dataloader_drop_last=True), "'dataloader_drop_last' is switched on, but it has no effect "
                                                      "in ds_seg (it sets DeepSpeed's own data loader"),
    'hybrid_engine_on': (dict(hybrid_engine={'enabled': True}),
                         "'hybrid_engine' is switched on, but it has no effect in ds_seg (it is DeepSpeed's "
                         "generation"),
    # A run's own ds_config.json given back: "unknown top-level key 'ds_seg'".
    'run_record': (dict(ds_seg={'backend': 'deepspeed', 'precision': 'fp32', 'world_size': 2, 'launcher': 'python'}),
                   "is the record a run wrote of the DeepSpeed config it used"),
    # DeepSpeed then read ds_seg's own checkpoints as universal ones: --resume died in a traceback.
    'load_universal_on': (dict(checkpoint={'load_universal': True}),
                          "'checkpoint.load_universal' is true, but ds_seg saves ordinary DeepSpeed checkpoints"),
    # ds_seg took 'bfloat16' (off) where DeepSpeed takes 'bf16' (on): the two disagreed.
    'bf16_twice': (dict(bf16={'enabled': True}, bfloat16={'enabled': False}),
                   "both 'bf16' and its old name 'bfloat16' are given; keep only 'bf16'."),
}


@pytest.mark.parametrize('case', sorted(DS_VALUE_REFUSALS))
def test_ds_json_values_are_refused_by_type_and_range(tmp_path, case):
    change, message = DS_VALUE_REFUSALS[case]
    with pytest.raises(ConfigError) as info:
        load_ds_config(_write(tmp_path, _shipped_zero0(**change)))
    assert message in str(info.value) and str(tmp_path) in str(info.value)


def test_ds_json_plain_dict_blocks_with_right_keys_are_accepted(tmp_path, capsys):
    load_ds_config(_write(tmp_path, _shipped_zero0(
        checkpoint={'tag_validation': 'Warn', 'load_universal': False, 'writer': {'type': 'fast'}},
        aio={'block_size': 1048576, 'queue_depth': 8}, flops_profiler={'enabled': False, 'profile_step': 1},
        data_efficiency={'enabled': False}, dataloader_drop_last=False,
        data_types={'grad_accum_dtype': 'fp32'}, timers={'throughput': {'enabled': True}})))
    # Only defaults: no effect either way, one warning line instead of a refusal.
    load_ds_config(_write(tmp_path, _shipped_zero0(activation_checkpointing={'partition_activations': False})))
    assert capsys.readouterr().err.count("'activation_checkpointing' in the DeepSpeed JSON has no effect") == 1


def test_ds_json_optimizers_the_refusal_offers_are_accepted(tmp_path):
    """'adagrad', which the refusal of an unknown type lists (DeepSpeed's name), ended in
    getattr(torch.optim, 'adagrad') failing inside the check; torch's own names as spelt pass."""
    for kind in ('adagrad', 'Adagrad', 'NAdam', 'RMSprop', 'lamb', 'lion'):
        load_ds_config(_write(tmp_path, _shipped_zero0(optimizer={'type': kind, 'params': {'lr': 0.01}})))


def test_ds_json_integers_in_exponent_notation_are_accepted(tmp_path):
    """Bucket sizes as DeepSpeed's docs and Hugging Face's ZeRO templates write them (5e8) are JSON
    floats with integer values: they are the integers they say."""
    load_ds_config(_write(tmp_path, _shipped_zero0(zero_optimization={
        'stage': 3, 'reduce_bucket_size': 5e8, 'allgather_bucket_size': 5e8, 'stage3_prefetch_bucket_size': 5e7,
        'stage3_max_live_parameters': 1e9, 'sub_group_size': 1e9})))


def test_ds_json_booleans_by_design_are_accepted(tmp_path):
    load_ds_config(_write(tmp_path, _shipped_zero0(optimizer__params__amsgrad=True, optimizer__params__foreach=False)))


def test_ds_json_duplicate_keys_and_binary_files_are_named(tmp_path):
    path = tmp_path / 'dup.json'
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ConfigError, match=r"dup.json: key 'train_micro_batch_size_per_gpu' is given twice"):
        load_ds_config(path)
    path.write_bytes(b'\xff\xfe\x00 not text')
    with pytest.raises(ConfigError, match=r'dup.json: not a text file'):
        load_ds_config(path)


def test_a_json_without_optimizer_cannot_train():
    from ds_seg.engine.run_spec import describe_run
    with pytest.raises(ConfigError, match=r"x.json: no 'optimizer' block"):
        describe_run({'train_micro_batch_size_per_gpu': 2}, 'deepspeed', 10, source='x.json')


def test_batch_triple():
    assert resolve_batch({'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 2}, 3) == (4, 2, 24)
    assert resolve_batch({'train_batch_size': 16, 'train_micro_batch_size_per_gpu': 4}, 2) == (4, 2, 16)
    assert resolve_batch({'train_batch_size': 16, 'gradient_accumulation_steps': 2}, 2) == (4, 2, 16)
    with pytest.raises(ConfigError, match=r"'train_batch_size' 16 != train_micro_batch_size_per_gpu 4 x "
                                          r"gradient_accumulation_steps 2 x world size 3"):
        resolve_batch({'train_batch_size': 16, 'train_micro_batch_size_per_gpu': 4,
                       'gradient_accumulation_steps': 2}, 3)
    with pytest.raises(ConfigError, match=r"'train_batch_size' 10 is not divisible"):
        resolve_batch({'train_batch_size': 10, 'train_micro_batch_size_per_gpu': 4}, 2)
    # Accumulation alone trained at micro-batch 1 without a word (DeepSpeed refuses it).
    with pytest.raises(ConfigError, match=r"set 'train_micro_batch_size_per_gpu' .*'gradient_accumulation_steps' 4 "
                                          r"alone leaves the micro-batch unsaid"):
        resolve_batch({'gradient_accumulation_steps': 4}, 2)


def test_native_bf16_skips_deepspeeds_per_step_overflow_read_unless_the_json_asks():
    """DeepSpeed's ZeRO-1/2 read an inf/NaN flag on the host after every bf16 backward (its
    default), a device synchronisation per step seen on an H100; ds_seg turns it off where the
    JSON does not say, and keeps the JSON's own value."""
    ds = {'train_micro_batch_size_per_gpu': 2, 'bf16': {'enabled': True}, 'zero_optimization': {'stage': 2}}
    resolved, precision, _ = resolve_ds_config(ds, 1, 10, supports=lambda p: True)
    assert precision == 'bf16' and resolved['bf16']['check_grad_overflow'] is False
    asked = dict(ds, bf16={'enabled': True, 'check_grad_overflow': True})
    resolved, _, _ = resolve_ds_config(asked, 1, 10, supports=lambda p: True)
    assert resolved['bf16']['check_grad_overflow'] is True
    fp16 = {'train_micro_batch_size_per_gpu': 2, 'fp16': {'enabled': True}}
    resolved, _, _ = resolve_ds_config(fp16, 1, 10, supports=lambda p: True)
    assert 'bf16' not in resolved   # fp16's overflow check drives its loss scale: untouched


def test_precision_fallback_recorded():
    ds = {'train_micro_batch_size_per_gpu': 2, 'fp16': {'enabled': True}}
    resolved, precision, notes = resolve_ds_config(ds, 1, 10, supports=lambda p: p == 'bf16')
    assert precision == 'bf16-autocast' and not resolved['fp16']['enabled']
    assert resolved['torch_autocast'] == {'enabled': True, 'dtype': 'bfloat16'}
    assert len(notes) == 1 and 'fp16 is not supported' in notes[0]
    resolved, precision, notes = resolve_ds_config(ds, 1, 10, supports=lambda p: False)
    assert precision == 'fp32' and 'running fp32' in notes[0]
    _, precision, notes = resolve_ds_config(ds, 1, 10, supports=lambda p: True)
    assert precision == 'fp16' and not notes
    # The JSON's own autocast settings survive the fallback (they were replaced by the whole block).
    safe = dict(ds, torch_autocast={'enabled': False, 'lower_precision_safe_modules': ['torch.nn.Conv2d']})
    resolved, precision, _ = resolve_ds_config(safe, 1, 10, supports=lambda p: p == 'bf16')
    assert resolved['torch_autocast'] == {'enabled': True, 'dtype': 'bfloat16',
                                          'lower_precision_safe_modules': ['torch.nn.Conv2d']}


def test_fp16_never_runs_on_a_cpu_even_where_deepspeed_says_it_can(monkeypatch):
    """DeepSpeed's CPU accelerator says fp16 on Xeons with AVX512-FP16, where its fp16 training
    ran at 0.2 img/s (bf16 autocast: 34.5): the README's first command estimated 5 hours. On a
    CPU fp16 falls back as the README says; DS_SEG_CPU_FP16=1 (tests of the fp16 paths) runs it."""
    from deepspeed.accelerator import get_accelerator

    from ds_seg.config import device_supports
    accelerator = get_accelerator()
    assert accelerator.device_name() == 'cpu'
    monkeypatch.setattr(accelerator, 'is_fp16_supported', lambda: True)
    monkeypatch.delenv('DS_SEG_CPU_FP16', raising=False)
    assert device_supports('fp16') is False
    monkeypatch.setenv('DS_SEG_CPU_FP16', '1')
    assert device_supports('fp16') is True


def test_scheduler_length_from_max_steps_and_warmup_check():
    ds = {'train_micro_batch_size_per_gpu': 2,
          'scheduler': {'type': 'WarmupCosineLR', 'params': {'warmup_num_steps': 5}}}
    resolved, _, notes = resolve_ds_config(ds, 1, 50)
    assert resolved['scheduler']['params']['total_num_steps'] == 50 and not notes
    # A schedule length the JSON fixes itself must still hold its warmup.
    fixed = {'train_micro_batch_size_per_gpu': 2,
             'scheduler': {'type': 'WarmupCosineLR', 'params': {'warmup_num_steps': 5, 'total_num_steps': 5}}}
    with pytest.raises(ConfigError, match='warmup_num_steps'):
        resolve_ds_config(fixed, 1, 5)


@pytest.mark.parametrize('kind', ['WarmupDecayLR', 'WarmupCosineLR'])
def test_a_schedule_shorter_than_the_run_is_refused(kind):
    """total_num_steps 4 with train.max_steps 10 trained the last 6 steps at the schedule's final
    LR (0 for WarmupDecayLR) without a word; a longer schedule (cut short on purpose) is kept."""
    ds = {'train_micro_batch_size_per_gpu': 2,
          'scheduler': {'type': kind, 'params': {'warmup_num_steps': 1, 'total_num_steps': 4}}}
    with pytest.raises(ConfigError, match=r"x.json: scheduler.params.total_num_steps \(4\) is shorter than the run "
                                          r"\(train.max_steps=10\): its last 6 step\(s\) would train at"):
        resolve_ds_config(ds, 1, 10, source='x.json')
    for max_steps in (4, 3):
        resolved, _, _ = resolve_ds_config(ds, 1, max_steps)
        assert resolved['scheduler']['params']['total_num_steps'] == 4


def test_warmup_lr_longer_than_the_run_is_shortened_with_a_note():
    """WarmupLR has no length and warms up over 1000 steps unless told: a 400-step run never
    reached warmup_max_lr. It now warms up over a fifth of the run, as the other schedules."""
    for params, note in (({'warmup_max_lr': 1e-3}, 'warmup_num_steps 1000 (the WarmupLR default) is not shorter'),
                         ({'warmup_num_steps': 500}, 'warmup_num_steps 500 is not shorter')):
        ds = {'train_micro_batch_size_per_gpu': 2, 'scheduler': {'type': 'WarmupLR', 'params': dict(params)}}
        resolved, _, notes = resolve_ds_config(ds, 1, 400, source='x.json')
        assert resolved['scheduler']['params']['warmup_num_steps'] == 80
        assert notes == [f'x.json: scheduler.params.{note} than the run (400 steps); warming up over 80 step(s) instead.']
    kept = {'train_micro_batch_size_per_gpu': 2, 'scheduler': {'type': 'WarmupLR', 'params': {'warmup_num_steps': 50}}}
    resolved, _, notes = resolve_ds_config(kept, 1, 400)
    assert resolved['scheduler']['params']['warmup_num_steps'] == 50 and not notes


@pytest.mark.parametrize('kind', ['WarmupDecayLR', 'WarmupCosineLR'])
def test_a_schedule_left_at_deepspeeds_default_warmup_is_shortened_with_a_note(kind):
    """WarmupCosineLR / WarmupDecayLR without warmup_num_steps warmed up over DeepSpeed's default
    1000 steps: a 10-step run ended at 6.4e-4 of a 2e-3 peak and never decayed, with only
    DeepSpeed's own warning. They are shortened as a warmup_num_steps the JSON gives."""
    for params in (None, {}, {'warmup_max_lr': 2e-3} if kind == 'WarmupDecayLR' else {'warmup_min_ratio': 0.0}):
        sched = {'type': kind} if params is None else {'type': kind, 'params': dict(params)}
        ds = {'train_micro_batch_size_per_gpu': 2, 'scheduler': sched}
        resolved, _, notes = resolve_ds_config(ds, 1, 400, source='x.json')
        assert resolved['scheduler']['params']['warmup_num_steps'] == 80
        assert resolved['scheduler']['params']['total_num_steps'] == 400
        assert notes == [f'x.json: scheduler.params.warmup_num_steps 1000 (the {kind} default) is not shorter than '
                         f'the run (400 steps); warming up over 80 step(s) instead.']
    # A length the JSON gives is the user's: the default warm-up not inside it is refused.
    ds = {'train_micro_batch_size_per_gpu': 2, 'scheduler': {'type': kind, 'params': {'total_num_steps': 500}}}
    with pytest.raises(ConfigError, match=rf"x.json: scheduler.params.warmup_num_steps \(1000, the {kind} default\) "
                                          r"must be smaller than the run length \(500 steps\)"):
        resolve_ds_config(ds, 1, 400, source='x.json')
    long_run = {'train_micro_batch_size_per_gpu': 2, 'scheduler': {'type': kind}}
    resolved, _, notes = resolve_ds_config(long_run, 1, 5000)
    assert 'warmup_num_steps' not in resolved['scheduler']['params'] and not notes


def test_one_cycle_of_the_default_length_spans_a_shorter_run_with_a_note():
    """OneCycle's default cycle is 2 x 2000 steps: a 100-step run only rose towards cycle_max_lr
    and ended at its peak region. The cycle now spans the run: up to the peak at its middle, back
    to cycle_min_lr at its end. An explicit cycle length is the user's, and kept."""
    import torch

    from ds_seg.engine.ddp_backend import build_scheduler
    ds = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},
          'scheduler': {'type': 'OneCycle', 'params': {'cycle_min_lr': 1e-4, 'cycle_max_lr': 1e-3,
                                                       'cycle_momentum': False}}}
    resolved, _, notes = resolve_ds_config(ds, 1, 100, source='x.json')
    assert notes == ['x.json: scheduler.params.cycle_first_step_size 2000 (the OneCycle default) makes a cycle of '
                     '4000 steps, longer than the run (100 steps); cycling over the run instead (50 step(s) up, '
                     '50 down).']
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = build_scheduler(optimizer, resolved['scheduler'])
    lrs = []
    for _ in range(100):
        lrs.append(optimizer.param_groups[0]['lr'])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-4) and max(lrs) == pytest.approx(1e-3) and lrs.index(max(lrs)) == 50
    assert optimizer.param_groups[0]['lr'] == pytest.approx(1e-4)  # the cycle ends with the run
    # A second half given in the JSON is kept; the first takes the rest of the run.
    ds['scheduler']['params']['cycle_second_step_size'] = 30
    params = resolve_ds_config(ds, 1, 100)[0]['scheduler']['params']
    assert (params['cycle_first_step_size'], params['cycle_second_step_size']) == (70, 30)
    ds['scheduler']['params']['cycle_first_step_size'] = 500
    resolved, _, notes = resolve_ds_config(ds, 1, 100, source='x.json')
    # ... kept, and said: the run logged an LR that only rose, without a word.
    assert resolved['scheduler']['params']['cycle_first_step_size'] == 500
    assert notes == ['x.json: scheduler.params.cycle_first_step_size 500 makes a cycle of 530 steps, longer than the '
                     'run (100 steps): the run ends before its peak (cycle_max_lr, at step 500); fit the step sizes '
                     'to the run, or leave cycle_first_step_size out to cycle over it.']
    ds['scheduler']['params'].update(cycle_first_step_size=60, cycle_second_step_size=60)
    assert resolve_ds_config(ds, 1, 100)[2] == [
        'DeepSpeed config: scheduler.params.cycle_first_step_size 60 makes a cycle of 120 steps, longer than the run '
        '(100 steps): the run ends part-way down from its peak; fit the step sizes to the run, or leave '
        'cycle_first_step_size out to cycle over it.']
    ds['scheduler']['params'].update(cycle_first_step_size=50, cycle_second_step_size=50)
    assert resolve_ds_config(ds, 1, 100)[2] == []


@pytest.mark.parametrize('name', sorted(p.stem for p in DS_CONFIGS_DIR.glob('*.json')))
@pytest.mark.parametrize('max_steps', [1, 5])
def test_short_runs_shorten_the_warmup_of_every_shipped_json(name, max_steps):
    """train.max_steps=5 (a smoke test) with any shipped JSON: the warmup shrinks to fit, one note says so."""
    ds = load_ds_config(name)  # a bare shipped name, as `ds-seg-train --deepspeed_config zero2` passes it
    warmup = ds['scheduler']['params']['warmup_num_steps']
    assert warmup >= 5  # the shipped JSONs are written for real runs: otherwise this test proves nothing
    resolved, _, notes = resolve_ds_config(ds, 2, max_steps, source=name, supports=lambda p: True)
    params = resolved['scheduler']['params']
    assert params['total_num_steps'] == max_steps and params['warmup_num_steps'] == max(2, max_steps // 5)
    # What ds_config.json records is what DeepSpeed's scheduler runs (it warms up over 2 steps at
    # least: a recorded 1 ran as 2).
    import torch
    from deepspeed.runtime import lr_schedules
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = getattr(lr_schedules, resolved['scheduler']['type'])(optimizer, **params)
    assert scheduler.warmup_num_steps == params['warmup_num_steps']
    assert [n for n in notes if 'warmup' in n] == [
        f'{name}: scheduler.params.warmup_num_steps {warmup} is not shorter than the run ({max_steps} steps); '
        f'warming up over {params["warmup_num_steps"]} step(s) instead.' if max_steps > 2 else
        f"{name}: scheduler.params.warmup_num_steps {warmup} is not shorter than the run ({max_steps} steps); "
        "warming up over DeepSpeed's minimum of 2 steps instead: the whole run, which never reaches the peak "
        "learning rate (its one step trains at learning rate 0)."]


def test_nvme_offload_needs_the_async_io_op(tmp_path, monkeypatch):
    """Where DeepSpeed's async_io op cannot be built (no libaio, as on this machine) an nvme
    offload was a JIT-build traceback at engine creation; where it can, the block is accepted."""
    import ds_seg.config as config
    nvme = dict(zero_optimization={'stage': 3, 'offload_param': {'device': 'nvme', 'nvme_path': str(tmp_path)}})
    monkeypatch.setattr(config, '_async_io_available', lambda: False)
    with pytest.raises(ConfigError, match="needs DeepSpeed's async_io op, which cannot be built here"):
        load_ds_config(_write(tmp_path, _shipped_zero0(**nvme)))
    monkeypatch.setattr(config, '_async_io_available', lambda: True)
    load_ds_config(_write(tmp_path, _shipped_zero0(**nvme)))


@pytest.mark.parametrize('name, text, key', [
    ('dup.yaml', "train: {max_steps: 6}\ntrain: {seed: 3}\n", 'train'),
    ('dup.yml', "train:\n  max_steps: 6\n  max_steps: 8\n", 'max_steps'),
    ('dup.json', '{"train": {"max_steps": 6, "max_steps": 8}}', 'max_steps'),
])
def test_an_experiment_config_with_a_key_twice_is_refused(tmp_path, name, text, key):
    """YAML and JSON parsers keep the last of two equal keys: train: {max_steps: 6} followed by
    train: {seed: 3} trained the default 20 steps, exit 0."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{name}: the key '{key}' is given twice in one mapping"):
        load_config(str(path))
    path.write_text("train: {max_steps: 6, seed: 3}\n" if name != 'dup.json' else '{"train": {"max_steps": 6}}')
    assert load_config(str(path)).train.max_steps == 6


def test_a_config_name_that_is_a_path_is_refused(tmp_path):
    """config_name (a run's config.json names the config it came from) names work_dirs/<name>:
    '../../escaped' put the default work dir outside work_dirs."""
    path = tmp_path / 'mine.py'
    path.write_text("config_name = '../../escaped'\ntrain = dict(max_steps=3)\n")
    with pytest.raises(ConfigError, match=r"config_name '\.\./\.\./escaped' must be a plain name"):
        load_config(str(path))
    path.write_text("config_name = 'unet_run'\ntrain = dict(max_steps=3)\n")
    assert load_config(str(path)).train.max_steps == 3


def test_ds_config_json_under_ddp_records_the_autocast_that_runs():
    """Under --backend ddp a native bf16 JSON runs as bf16 autocast: ds_config.json's ds_seg block
    said bf16-autocast while the JSON beside it still said bf16.enabled true (an fp16 JSON on a CPU
    was rewritten, a bf16 one not)."""
    from ds_seg.config import REPO_ROOT, load_ds_config
    from ds_seg.engine.run_spec import describe_run
    ds = load_ds_config(str(REPO_ROOT / 'ds_configs' / 'zero2_bf16.json'))
    spec = describe_run(ds, 'ddp', 10, source='zero2_bf16.json')
    assert spec.precision == 'bf16-autocast'
    assert spec.ds_config['bf16']['enabled'] is False
    assert spec.ds_config['torch_autocast'] == {'enabled': True, 'dtype': 'bfloat16'}
    native = describe_run(ds, 'deepspeed', 10, source='zero2_bf16.json')
    assert native.precision == 'bf16' and native.ds_config['bf16']['enabled'] is True


def test_config_paths_that_are_no_file_say_what_they_are(tmp_path):
    """A folder given as --deepspeed_config, and a symlink loop as either config, were said not to
    exist; a pipe (bash's <(...)) was refused as missing although it reads like a file."""
    from ds_seg.config import REPO_ROOT, load_ds_config
    (tmp_path / 'a').symlink_to(tmp_path / 'b')
    (tmp_path / 'b').symlink_to(tmp_path / 'a')
    with pytest.raises(ConfigError, match=r'^--deepspeed_config: .* is a folder, not a DeepSpeed JSON\. Shipped'):
        load_ds_config(str(tmp_path))
    for load, option in ((load_ds_config, '--deepspeed_config'), (load_config, '--config')):
        with pytest.raises(ConfigError, match=rf'^{option}: .*a link that leads to no file \(a missing target, '
                                              r'or a loop\)'):
            load(str(tmp_path / 'a'))
    read, write = os.pipe()
    with os.fdopen(write, 'w') as f:
        f.write((REPO_ROOT / 'ds_configs' / 'zero2.json').read_text())
    try:
        assert load_ds_config(f'/dev/fd/{read}')['train_micro_batch_size_per_gpu'] == 8
    finally:
        os.close(read)


def test_a_config_that_is_a_pipe_says_so(tmp_path):
    """A FIFO given as --config was said not to exist."""
    fifo = tmp_path / 'config'
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r'^--config: .*config is not a regular file \(a pipe\?\); give a config file \(\.py'):
        load_config(str(fifo))


def test_deepspeeds_defaults_are_made_explicit_for_both_backends():
    """A JSON without gradient_clipping was clipped at 1.0 by DeepSpeed and not at all by DDP; an
    Adam(W) without weight_decay decayed 0 in DeepSpeed's own optimizers and 0.01 in torch's (DDP,
    or DeepSpeed with torch_adam). The resolved config, which both backends build from and
    ds_config.json records, holds DeepSpeed's values."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from ds_seg.config import resolve_ds_config
    ds = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}}}
    resolved, _, _ = resolve_ds_config(ds, 1, 10)
    assert resolved['gradient_clipping'] == GRADIENT_CLIPPING_DEFAULT
    assert resolved['optimizer']['params']['weight_decay'] == 0.0
    given = dict(ds, gradient_clipping=0.0, optimizer={'type': 'Adam', 'params': {'lr': 1e-3, 'weight_decay': 0.05}})
    resolved, _, _ = resolve_ds_config(given, 1, 10)
    assert resolved['gradient_clipping'] == 0.0 and resolved['optimizer']['params']['weight_decay'] == 0.05
    sgd = dict(ds, optimizer={'type': 'SGD', 'params': {'lr': 0.1}})
    assert 'weight_decay' not in resolve_ds_config(sgd, 1, 10)[0]['optimizer']['params']


def test_a_native_fp16_run_on_a_cpu_resumes_with_the_way_back_named():
    """A work dir trained in native fp16 on a CPU (before fp16 fell back there) is refused by a
    resume in bf16 autocast, as any change of optimizer-state kind is; the line names the switch
    that runs native fp16 again. Elsewhere the line is as before."""
    from types import SimpleNamespace

    from ds_seg.engine.deepspeed_backend import DeepSpeedBackend
    marker = {'zero_stage': 2, 'precision': 'fp16'}
    for device, hinted in (('cpu', True), ('cuda', False)):
        run = SimpleNamespace(zero_stage=2, precision='bf16-autocast', device_type=device)
        line = DeepSpeedBackend.resume_refusal(run, marker, 'step_00000010')
        assert line.startswith('--resume: step_00000010 was saved in fp16 but this run uses bf16-autocast')
        assert ('DS_SEG_CPU_FP16=1 runs native fp16 on a CPU again' in line) is hinted, line


@pytest.mark.parametrize('text', ["train = dict(max_steps=3)\n", "model = dict(type='UNet', base_channels=32)\n"])
def test_a_config_that_leaves_the_counts_out_gets_the_datas_not_the_defaults(tmp_path, text):
    """The embedded default's in_channels=3, num_classes=6 were merged into a config that gave no
    model (or the default UNet without them): 4-band data was refused ('model.in_channels is 3'),
    where the README says counts left out are the data's."""
    path = tmp_path / 'mine.py'
    path.write_text(text)
    cfg = load_config(str(path))
    assert cfg.model.type == 'UNet' and 'in_channels' not in cfg.model and 'num_classes' not in cfg.model
    # ... and the trainer then builds the model for 4-band, 5-class data.
    from types import SimpleNamespace

    import torch

    from ds_seg.engine.trainer import fill_model_from_data
    from ds_seg.registry import MODELS, build
    said = []
    fill_model_from_data(cfg.model, SimpleNamespace(in_channels=4, num_classes=5, num_dates=1), said.append)
    assert said == ['model: in_channels=4, num_classes=5 from data.train (not set in the model config)']
    assert build(MODELS, cfg.model)(torch.zeros(1, 4, 32, 32)).shape == (1, 5, 32, 32)


def test_deepspeeds_own_monitors_are_said_to_do_nothing_under_ddp():
    from ds_seg.engine.run_spec import describe_run
    ds = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},
          'tensorboard': {'enabled': True, 'output_path': 'tb'}, 'csv_monitor': {'enabled': False}}
    notes = describe_run(ds, 'ddp', 10, source='x.json').notes
    assert [n for n in notes if 'monitor' in n] == [
        "x.json: 'tensorboard': DeepSpeed's own monitor(s), which run under --backend deepspeed only; ds_seg's "
        "TensorBoard log (<work dir>/tb) and log.trackers cover both backends"]
    assert not [n for n in describe_run(ds, 'deepspeed', 10, source='x.json').notes if 'monitor' in n]


@pytest.mark.parametrize('scheduler, said', [(None, True), ({'type': 'WarmupCosineLR', 'params': {}}, True),
                                             ({'type': 'WarmupLR', 'params': {'warmup_max_lr': 1e-3}}, False)])
def test_an_lr_of_zero_that_trains_nothing_is_said(scheduler, said):
    """"lr": 0 trained the whole run at LR 0 without a line (negative and NaN were refused)."""
    ds = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0}}}
    if scheduler:
        ds['scheduler'] = scheduler
    _, _, notes = resolve_ds_config(ds, 1, 100, source='x.json', supports=lambda p: True)
    assert any('optimizer.params.lr is 0' in n and 'weights never change' in n for n in notes) is said


def test_stage3_keys_at_a_lower_stage_are_named_once():
    """A JSON copied from a ZeRO-3 one and set to stage 2 keeps keys only stage 3 reads; DeepSpeed
    drops them without a word. One note names them; at stage 3, and for keys stage 2 reads, none."""
    import json
    from pathlib import Path
    shipped = json.loads((Path(__file__).parents[2] / 'ds_configs' / 'zero3.json').read_text())
    lowered = dict(shipped, zero_optimization=dict(shipped['zero_optimization'], stage=2,
                                                   sub_group_size=1000, zero_quantized_weights=True))
    _, _, notes = resolve_ds_config(lowered, 1, 1000, source='z.json', supports=lambda p: True)
    assert notes == ["z.json: zero_optimization.stage3_param_persistence_threshold, "
                     "zero_optimization.stage3_prefetch_bucket_size, zero_optimization.sub_group_size, "
                     "zero_optimization.zero_quantized_weights are read only by ZeRO stage 3, and DeepSpeed "
                     "ignores them at stage 2; remove them or set 'zero_optimization.stage' to 3."]
    for name in ('zero3.json', 'zero2.json', 'zero1.json', 'zero0.json'):
        ds = json.loads((Path(__file__).parents[2] / 'ds_configs' / name).read_text())
        assert resolve_ds_config(ds, 1, 1000, supports=lambda p: True)[2] == [], name
    one = dict(shipped, zero_optimization={'stage': 0, 'max_live_parameters': 10})
    assert resolve_ds_config(one, 1, 1000, source='o.json', supports=lambda p: True)[2] == [
        "o.json: zero_optimization.max_live_parameters is read only by ZeRO stage 3, and DeepSpeed ignores it "
        "at stage 0; remove it or set 'zero_optimization.stage' to 3."]


def test_a_json_or_yaml_config_never_runs_a_python_base(tmp_path):
    """The README says JSON and YAML configs are only parsed; a .py file among their _base_ files
    ran (a run's config.json handed on with a _base_ added, say)."""
    ran = tmp_path / 'ran'
    (tmp_path / 'evil.py').write_text(f"__import__('pathlib').Path({str(ran)!r}).touch()\ntrain = dict(max_steps=3)\n")
    (tmp_path / 'mid.yaml').write_text("_base_: ./evil.py\n")
    (tmp_path / 'top.json').write_text(json.dumps({'_base_': './mid.yaml', 'train': {'seed': 1}}))
    for top in ('top.json', 'mid.yaml'):
        with pytest.raises(ConfigError, match=r"inherits the Python config .*evil.py through _base_, which would run"):
            load_config(str(tmp_path / top))
    assert not ran.exists()
    # ... nor under a Python config that inherits the JSON (a run's config.json handed on)
    (tmp_path / 'mine.py').write_text("_base_ = './top.json'\n")
    with pytest.raises(ConfigError, match=r"top.json: inherits the Python config .*evil.py through _base_"):
        load_config(str(tmp_path / 'mine.py'))
    assert not ran.exists()
    (tmp_path / 'top.py').write_text("_base_ = './evil.py'\n")   # a Python config runs its bases, as it runs itself
    assert load_config(str(tmp_path / 'top.py')).train.max_steps == 3 and ran.exists()


def test_a_key_twice_in_an_inherited_json_or_yaml_file_is_refused(tmp_path):
    """Checked in the file given as --config only: a base's repeated key was kept silently."""
    (tmp_path / 'dup.json').write_text('{"model": {"type": "UNet", "base_channels": 8, "base_channels": 4}}')
    (tmp_path / 'dup.yaml').write_text("train:\n  max_steps: 3\ntrain:\n  seed: 2\n")
    for base in ('dup.json', 'dup.yaml'):
        (tmp_path / 'top.py').write_text(f"_base_ = './{base}'\n")
        with pytest.raises(ConfigError, match=rf"{base}: the key '\w+' is given twice in one mapping"):
            load_config(str(tmp_path / 'top.py'))


def test_a_base_configs_sections_follow_the_rules_of_the_defaults(tmp_path):
    """A section of another type replaces the base's, and _delete_ replaces it and the defaults,
    as they do against the defaults: through _base_ an FPN kept the base UperNet's backbone and
    channels, and _delete_ brought the default UNet's base_channels and depth back."""
    (tmp_path / 'base.py').write_text("model = dict(type='UperNet', backbone='resnet18', channels=32, aux_head=False)\n"
                                      "data = dict(train=dict(type='GeoTiffScenes', images='a/*.tif', labels='b/*.tif'))\n")
    files = {'fpn.py': "model = dict(type='FPN')\n",
             'wider.py': "model = dict(channels=64)\n",
             'fresh.py': "model = dict(_delete_=True, type='UNet', bilinear=True)\n",
             'synthetic.py': "data = dict(train=dict(type='SyntheticAerial', split='train'))\n"}
    for name, text in files.items():
        (tmp_path / name).write_text("_base_ = './base.py'\n" + text)
    (tmp_path / 'on_fresh.py').write_text("_base_ = './fresh.py'\nmodel = dict(depth=3)\n")
    model = {name: dict(load_config(str(tmp_path / name)).model) for name in (*files, 'on_fresh.py')}
    assert model['fpn.py'] == dict(load_config(None, ["model=dict(type='FPN')"]).model) == {'type': 'FPN'}
    assert model['wider.py'] == {'type': 'UperNet', 'backbone': 'resnet18', 'channels': 64, 'aux_head': False}
    assert model['fresh.py'] == {'type': 'UNet', 'bilinear': True}
    assert model['on_fresh.py'] == {'type': 'UNet', 'bilinear': True, 'depth': 3}
    assert dict(load_config(str(tmp_path / 'synthetic.py')).data.train) == {'type': 'SyntheticAerial', 'split': 'train'}
    # A base section that names no type holds settings for the type a config inheriting it gives:
    # merged into it, not replaced by it (the shipped recipe's cat_max_ratio and transforms were
    # dropped from every benchmark config this way).
    (tmp_path / 'recipe.py').write_text("data = dict(train=dict(split='train', cat_max_ratio=0.75))\n")
    (tmp_path / 'dataset.py').write_text("_base_ = './recipe.py'\ndata = dict(train=dict(type='GeoTiffScenes', "
                                         "images='a/*.tif', labels='b/*.tif'))\n")
    assert dict(load_config(str(tmp_path / 'dataset.py')).data.train) == {
        'type': 'GeoTiffScenes', 'images': 'a/*.tif', 'labels': 'b/*.tif', 'split': 'train', 'cat_max_ratio': 0.75}
    # _delete_ in a section without a type replaces the base's section, as mmengine does (it was
    # refused as "only a section with a 'type'" once the marker was kept for every section).
    (tmp_path / 'run.py').write_text("train = dict(max_steps=9, seed=3)\n")
    (tmp_path / 'steps.py').write_text("_base_ = './run.py'\ntrain = dict(_delete_=True, max_steps=4)\n")
    train = load_config(str(tmp_path / 'steps.py')).train
    assert (train.max_steps, train.seed) == (4, load_config(None).train.seed)


def test_a_runs_config_json_gives_its_sections_back_whole(tmp_path):
    """A run with `--cfg-options "model=dict(_delete_=True, type='UNet', depth=2)"` (a base-64 UNet)
    wrote its model without the marker; retrained from that config.json, the defaults' base_channels
    16 came back: another model."""
    cfg = load_config(None, ["model=dict(_delete_=True, type='UNet', depth=2)"])
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(cfg.to_dict()))
    again = load_config(str(path))
    assert dict(again.model) == dict(cfg.model) == {'type': 'UNet', 'depth': 2}
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize('native', ['fp16', 'bf16'])
def test_native_precision_with_torch_autocast_is_refused(native):
    """bf16.enabled with torch_autocast fp16: DeepSpeed ran bf16 weights under fp16 autocast (35x
    slower on a CPU) recorded as 'bf16', and DDP rewrote the autocast dtype."""
    ds = {'train_micro_batch_size_per_gpu': 2, native: {'enabled': True},
          'torch_autocast': {'enabled': True, 'dtype': 'float16'}}
    with pytest.raises(ConfigError, match=rf"ds.json: '{native}.enabled' and 'torch_autocast.enabled' are both "
                                          r"true; choose one"):
        resolve_ds_config(ds, 1, 10, source='ds.json', supports=lambda p: True)
    off = dict(ds, torch_autocast={'enabled': False, 'dtype': 'float16'})
    assert resolve_ds_config(off, 1, 10, supports=lambda p: True)[1] == native


def test_fp16_autocast_falls_back_as_native_fp16_does():
    """torch_autocast fp16 on a CPU ran at 2.8 img/s against 115 for bf16 autocast, without a
    word, where native fp16 falls back to bf16 autocast."""
    ds = {'train_micro_batch_size_per_gpu': 2,
          'torch_autocast': {'enabled': True, 'dtype': 'float16', 'lower_precision_safe_modules': ['torch.nn.Conv2d']}}
    resolved, precision, notes = resolve_ds_config(ds, 1, 10, source='ds.json', supports=lambda p: p == 'bf16')
    assert precision == 'bf16-autocast' and resolved['torch_autocast'] == dict(ds['torch_autocast'], dtype='bfloat16')
    assert notes == ['ds.json: fp16 autocast is not supported on this device; running bf16 autocast instead.']
    resolved, precision, notes = resolve_ds_config(ds, 1, 10, source='ds.json', supports=lambda p: False)
    assert precision == 'fp32' and not resolved['torch_autocast']['enabled'] and 'running fp32' in notes[0]
    _, precision, notes = resolve_ds_config(ds, 1, 10, supports=lambda p: True)
    assert precision == 'fp16-autocast' and not notes


def test_a_compile_block_without_deepspeeds_compile_is_refused():
    """DeepSpeed reads its 'compile' block (DeepCompile, its offloads) only in engine.compile(),
    which ds_seg calls with train.compile=True under DeepSpeed: the block did nothing, unsaid."""
    from ds_seg.engine.run_spec import describe_run
    ds = dict(load_ds_config(DS_CONFIGS_DIR / 'zero2.json'), compile={'deepcompile': True, 'double_buffer': True})
    for backend, compile_mode in (('deepspeed', None), ('ddp', None), ('ddp', 'default')):
        with pytest.raises(ConfigError, match=r"x.json: the 'compile' block sets deepcompile=true, which DeepSpeed "
                                              r"applies only in engine.compile\(\).*train.compile=True under "
                                              r"--backend deepspeed"):
            describe_run(ds, backend, 10, source='x.json', compile_mode=compile_mode)
    assert describe_run(ds, 'deepspeed', 10, compile_mode='default').ds_config['compile']['deepcompile'] is True
    defaults_only = dict(ds, compile={'deepcompile': False})
    assert describe_run(defaults_only, 'ddp', 10).backend == 'ddp'


def test_a_python_config_assigning_a_key_twice_is_refused(tmp_path):
    """train = dict(max_steps=3) then train = dict(seed=5): the second replaced the first whole (a
    20-step run, not 3), where the same in JSON or YAML is refused. dict(train, ...) is on purpose."""
    base = REPO_ROOT / 'configs' / 'unet_tiny_synthetic.py'
    twice = tmp_path / 'twice.py'
    twice.write_text(f"_base_ = [{str(base)!r}]\ntrain = dict(max_steps=3)\n_x = 1\nmodel = dict(base_channels=8)\n"
                     "train = dict(seed=5)\n")
    with pytest.raises(ConfigError, match=r"twice.py: line 5 assigns 'train' again \(first at line 2\); the second "
                                          r"would silently replace the first whole"):
        load_config(str(twice))
    (tmp_path / 'child.py').write_text(f"_base_ = [{str(twice)!r}]\n")   # found through _base_ too
    with pytest.raises(ConfigError, match=r"twice.py: line 5 assigns 'train' again"):
        load_config(str(tmp_path / 'child.py'))
    changed = tmp_path / 'changed.py'
    changed.write_text(f"_base_ = [{str(base)!r}]\ntrain = dict(max_steps=3)\n_x = 1\n_x = 2\n"
                       "train = dict(train, seed=5)\n")
    cfg = load_config(str(changed))
    assert (cfg.train.max_steps, cfg.train.seed) == (3, 5)


def test_a_config_path_not_under_the_folder_says_it_takes_the_shipped_file(tmp_path, monkeypatch, capsys):
    """`--config configs/x.py` from a folder without configs/ trains the shipped x.py (so the
    README's commands work anywhere); a user who mistyped the path to an edited copy got the
    shipped file without a word. A bare name is the shipped file, as documented: nothing said."""
    from ds_seg.config import CONFIGS_DIR, DS_CONFIGS_DIR, find_shipped
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('RANK', raising=False)
    for path, folder, suffix in (('configs/unet_tiny_synthetic.py', CONFIGS_DIR, '.py'),
                                 ('ds_configs/zero2.json', DS_CONFIGS_DIR, '.json')):
        assert find_shipped(path, folder, suffix) == folder / os.path.basename(path)
        assert find_shipped(path, folder, suffix) == folder / os.path.basename(path)
        said = [line for line in capsys.readouterr().err.splitlines() if path in line]
        assert said == [f'[ds_seg] {path} is not under {tmp_path}: using the shipped {folder / os.path.basename(path)}']
    assert find_shipped('zero2', DS_CONFIGS_DIR, '.json') == DS_CONFIGS_DIR / 'zero2.json'
    assert capsys.readouterr().err == ''
    (tmp_path / 'configs').mkdir()
    (tmp_path / 'configs' / 'mine.py').write_text('')
    assert find_shipped('configs/mine.py', CONFIGS_DIR, '.py') == Path('configs/mine.py')
    assert capsys.readouterr().err == ''
    # A project laid out like the checkout, with edited copies: a bare name trained the shipped
    # file without a word. The copy is used, and said; './zero2' is a path, never the shipped file.
    (tmp_path / 'ds_configs').mkdir()
    (tmp_path / 'ds_configs' / 'zero2.json').write_text('{}')
    (tmp_path / 'configs' / 'unet_tiny_synthetic.py').write_text('')
    for name, folder, mine in (('zero2', DS_CONFIGS_DIR, 'ds_configs/zero2.json'),
                               ('unet_tiny_synthetic', CONFIGS_DIR, 'configs/unet_tiny_synthetic.py')):
        assert find_shipped(name, folder, Path(mine).suffix) == Path(mine)
        assert capsys.readouterr().err.splitlines() == [
            f'[ds_seg] {name}: using {mine} in {tmp_path} (your copy), not the shipped {folder / Path(mine).name}']
    assert find_shipped('./zero2', DS_CONFIGS_DIR, '.json') == Path('zero2')
    # Said as typed: "unet_tiny_synthetic does not exist" stood beside a list holding it.
    with pytest.raises(ConfigError, match=r'^--config: \./unet_tiny_synthetic \(\./ names a file in .*; a shipped one '
                                          r'is named without it\) does not exist'):
        load_config('./unet_tiny_synthetic')
    with pytest.raises(ConfigError, match=r'^--deepspeed_config: \./zero2 \(\./ names a file in '):
        load_ds_config('./zero2')


def test_a_config_of_its_own_training_data_does_not_keep_the_defaults_synthetic_val(tmp_path):
    """A config giving only data.train (its own GeoTIFF scenes) kept the embedded default's
    SyntheticAerial data.val: refused for class names it never wrote, or, with the synthetic
    names, validated on synthetic scenes (eval.jsonl, best, evaluate.py) without a word. Such a
    config has no validation set; one that gives data.val, or trains on synthetic data, keeps it."""
    own = dict(type='GeoTiffScenes', images=str(tmp_path / 'img'), labels=str(tmp_path / 'lab'), classes=6)
    path = tmp_path / 'own.py'
    path.write_text(f'data = dict(train={own!r})\n')
    assert load_config(str(path)).data.val is None
    assert load_config(None, [f"data.train={json.dumps(own)}"]).data.val is None
    given = dict(own, images=str(tmp_path / 'val'))
    path.write_text(f'data = dict(train={own!r}, val={given!r})\n')
    assert load_config(str(path)).data.val['images'] == given['images']
    assert load_config(str(tmp_path / 'own.py'), ['data.val.split=val']).data.val['type'] == 'GeoTiffScenes'
    path.write_text(f'data = dict(train={own!r})\n')
    assert load_config(str(path), ['data.val.type=SyntheticAerial', 'data.val.split=val']).data.val == \
        DEFAULTS['data']['val']
    # Synthetic training data of other settings keeps the synthetic validation set.
    assert load_config(None, ['data.train.dates=4']).data.val == DEFAULTS['data']['val']
    assert load_config(None).data.val == DEFAULTS['data']['val']


def test_swapped_config_and_deepspeed_json_are_named_as_swapped(tmp_path):
    """--config ds_configs/zero2.json was "unknown key 'train_micro_batch_size_per_gpu'", and
    --deepspeed_config configs/x.py "not valid JSON": both say which option the file belongs to."""
    with pytest.raises(ConfigError, match=r"^--config: .*zero2.json is a DeepSpeed JSON \(it sets "
                                          r"train_micro_batch_size_per_gpu.*\); give it as --deepspeed_config"):
        load_config(str(DS_CONFIGS_DIR / 'zero2.json'))
    with pytest.raises(ConfigError, match=r"^--deepspeed_config: .*unet_tiny_synthetic.py is an experiment config "
                                          r"\(.py\), not a DeepSpeed JSON; give it as --config"):
        load_ds_config(str(REPO_ROOT / 'configs' / 'unet_tiny_synthetic.py'))


def test_small_lines_name_what_they_are_about():
    """The resume line gave only the new batch layout; the synthetic data.val's hint named
    data.train."""
    from ds_seg.data import SyntheticAerial
    from ds_seg.engine import reshard
    saved = dict(micro_batch=8, grad_accum=1, world_size=1)
    assert reshard.describe(saved, 1, 4, 2, 8, 0).startswith(
        'resuming a checkpoint of 1 rank(s) on 1: micro-batch 8 x accum 1 -> 4 x 2, global batch 8;')
    assert reshard.describe(saved, 2, 8, 1, 16, 0).startswith(
        'resuming a checkpoint of 1 rank(s) on 2: micro-batch 8 x accum 1, global batch 8 -> 16;')
    with pytest.raises(ValueError, match=r'data.val.type=GeoTiffScenes data.val.images=\.\.\.'):
        SyntheticAerial(split='val', images='x/*.tif')


def test_export_to_a_step_folder_suggests_a_file_it_would_take(tmp_path):
    """export --out RUN/checkpoints/step_N suggested step_N/weights.pt, which export then refused
    (inside the run's checkpoints)."""
    from ds_seg.cli.export import check_out
    step = tmp_path / 'run' / 'checkpoints' / 'step_00000004'
    step.mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"is a folder; give a file name \(e.g. {tmp_path / 'run' / 'step_00000004.pt'}\)"):
        check_out(str(step))
    with pytest.raises(ValueError, match=rf"is a folder; give a file name \(e.g. {tmp_path / 'weights.pt'}\)"):
        check_out(str(tmp_path))


def test_a_base_reference_inside_an_expression_is_said_as_such(tmp_path):
    """max_steps={{_base_.train.max_steps}} * 2: mmengine substitutes a base's value only where it
    is a whole value, and the run was refused with "must be a positive integer, got
    '_train.max_steps_5f53ce_train.max_steps_5f53ce'" (its placeholder, doubled)."""
    (tmp_path / 'base.py').write_text('train = dict(max_steps=4)\ndata = dict(crop_size=64)\n')
    child = tmp_path / 'child.py'
    child.write_text("_base_ = ['./base.py']\ntrain = dict(max_steps={{_base_.train.max_steps}} * 2)\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(child))
    assert str(refused.value) == (
        f"{child}: train.max_steps: {{{{_base_.train.max_steps}}}} is used inside an expression; mmengine gives a "
        "base's value only as a whole value (key = {{_base_.x}}): write the value itself, or a new-style config "
        "(read_base()) that computes it in Python.")
    # Whole values work; a file name that only looks like a placeholder is a name.
    child.write_text("_base_ = ['./base.py']\n_steps = {{_base_.train.max_steps}}\n"
                     "train = dict(checkpoint_interval=_steps)\nwork_dir = 'runs/x_train_abc123_train_abc123'\n")
    cfg = load_config(str(child))
    assert cfg.train.checkpoint_interval == 4 and cfg.work_dir == 'runs/x_train_abc123_train_abc123'


@pytest.mark.parametrize('block, refused', [
    ({'output_path': 'tb'}, "tensorboard writes into {w}/tb/DeepSpeedJobName (output_path 'tb', job_name "
                            "'DeepSpeedJobName'), inside the work dir's tb/"),
    ({'output_path': '.', 'job_name': 'tb'}, "inside the work dir's tb/"),
    ({'output_path': 'checkpoints'}, "inside the work dir's checkpoints/"),
    ({'output_path': '{w}/previous'}, "inside the work dir's previous/"),
    ({'output_path': '..'}, "tensorboard.output_path '..' leaves the work dir ({p}/DeepSpeedJobName)"),
    ({'output_path': 'ds'}, None), ({'output_path': '.', 'job_name': 'run1'}, None), ({'output_path': '{p}/elsewhere'}, None),
])
def test_deepspeeds_monitors_may_not_write_among_the_work_dirs_own_files(tmp_path, block, refused):
    """DeepSpeed's TensorBoard monitor in <work dir>/tb had its events moved to previous/ as an
    earlier run's logs at the start, and its writer thread's failure ended the run as a disk error
    (exit 74); '..' wrote into the folder beside the work dir, a sibling run's."""
    from ds_seg.engine.run_spec import describe_run, with_monitors_in
    work = tmp_path / 'run'
    fill = dict(w=str(work), p=str(tmp_path))
    block = {k: v.format(**fill) for k, v in block.items()}
    ds = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},
          'tensorboard': dict(block, enabled=True)}
    spec = describe_run(ds, 'deepspeed', 10, source='x.json')
    if refused is None:
        assert with_monitors_in(spec, str(work), 'x.json').ds_config['tensorboard']['output_path']
        return
    with pytest.raises(ConfigError) as caught:
        with_monitors_in(spec, str(work), 'x.json')
    said = str(caught.value)
    assert said.startswith('x.json: ') and refused.format(**fill) in said and '\n' not in said, said


def test_a_summed_gradient_reduction_is_refused_under_ddp_which_averages():
    """'gradient_allreduce_op': 'sum' trained at twice the gradient norm on 2 ranks under
    DeepSpeed, and as 'mean' under --backend ddp, which never read it: one JSON, two trainings."""
    from ds_seg.engine.run_spec import describe_run
    ds = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},
          'gradient_allreduce_op': 'sum'}
    with pytest.raises(ConfigError, match=r"^x\.json: 'gradient_allreduce_op' 'sum' is DeepSpeed's; --backend ddp "
                                          r"averages gradients over ranks"):
        describe_run(ds, 'ddp', 10, source='x.json')
    assert describe_run(ds, 'deepspeed', 10, source='x.json').backend == 'deepspeed'
    assert describe_run(dict(ds, gradient_allreduce_op='mean'), 'ddp', 10, source='x.json').backend == 'ddp'


def test_variables_in_work_dir_and_load_from_are_expanded_and_an_unset_one_is_refused(tmp_path, monkeypatch):
    """work_dir: $SCRATCH/runs/exp (a cluster's habit) created ./$SCRATCH/runs/exp and wrote the
    run's checkpoints there; only ~ was expanded."""
    monkeypatch.setenv('SCRATCH', str(tmp_path))
    monkeypatch.delenv('NOT_SET_HERE', raising=False)
    cfg = load_config(None, ['work_dir=$SCRATCH/runs/exp', 'load_from=${SCRATCH}/w.pt'])
    assert (cfg.work_dir, cfg.load_from) == (f'{tmp_path}/runs/exp', f'{tmp_path}/w.pt')
    with pytest.raises(ConfigError, match=r"work_dir='\$NOT_SET_HERE/runs': \$NOT_SET_HERE is not set in this "
                                          r"environment; set it, or write the path out"):
        load_config(None, ['work_dir=$NOT_SET_HERE/runs'])
    # The MLflow store, a folder made absolute the same way: './$SCRATCH/mlruns' before
    cfg = load_config(None, ['log.mlflow_tracking_uri=$SCRATCH/mlruns'])
    assert cfg.log.mlflow_tracking_uri == f'{tmp_path}/mlruns'


def test_an_experiment_config_in_json_given_as_the_deepspeed_config_is_said_to_be_one(tmp_path):
    """.py and .yaml experiment configs there got the swap hint; a .json one was told "unknown
    top-level key 'model'. DeepSpeed would silently ignore it"."""
    path = tmp_path / 'exp.json'
    path.write_text(json.dumps({'model': {'type': 'UNetTiny'}, 'train': {'max_steps': 2}}))
    with pytest.raises(ConfigError, match=r"exp\.json: is an experiment config \(it sets model, train\), not a "
                                          r"DeepSpeed JSON; give it as --config"):
        load_ds_config(str(path))
