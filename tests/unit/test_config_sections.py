"""The experiment config's typed sections: every key has its default, documentation and value
check in one place, and a wrong value is refused with one line naming the dotted key."""
from dataclasses import MISSING, asdict, fields, is_dataclass
from typing import List, Optional, Tuple

import pytest

from ds_seg.config import (DEFAULTS, REPO_ROOT, SECTIONS, ConfigError, DataSection, ExperimentSection, LogSection,
                           OptimSection, ParamwiseSection, TrainSection, load_config)

# Where each section sits in the experiment config, written out here rather than read from the
# sections, so a section moved or renamed by mistake fails the tests below.
PREFIXES = {TrainSection: 'train.', DataSection: 'data.', OptimSection: 'optim.',
            ParamwiseSection: 'optim.paramwise.', LogSection: 'log.', ExperimentSection: ''}

# Values that every key of the declared type must refuse, whatever its range (some int keys
# accept 0, so 0 is not here; see EDGES).
BAD_BY_TYPE = {
    int: [-1, 'two', True, 2.5, None],
    Optional[int]: [-1, 'two', True, 2.5],
    float: [0, -1, 'fast', True, None],
    Optional[float]: [0, -1.5, 'fast', True],
    bool: [1, 0, 'yes', None],
    Optional[bool]: [1, 'yes'],
    str: ['fast', 1, None],
    Optional[str]: ['', '  ', 3],
    List[str]: ['tensorboard', ['tensorbord'], None],
    Optional[Tuple[float, float]]: [(2.0, 0.5), (0, 1), (1.0,), 'big', (True, 2.0)],
    ParamwiseSection: [3, None, 'lots'],
    Optional[dict]: [['my_models'], 'my_models', {'imports': 'my_models'}, {'imports': [3]},
                     {'import': ['my_models']}, {'imports': ['a'], 'allow_failed_imports': 'yes'}],
}

# Values just outside a key's range, where the type alone does not tell it.
EDGES = {
    'train.max_steps': 0, 'train.log_interval': 0, 'train.max_nonfinite_steps': 0,
    'train.stop_check_interval': 0, 'data.crop_size': 15, 'data.eval_tile': 15, 'data.eval_batch_size': 0,
    'optim.layer_decay': 1.5, 'data.num_workers': 129, 'data.prefetch_batches': 17,
}


def _all_fields():
    return [(section, f) for section in PREFIXES for f in fields(section)]


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory()


def test_sections_cover_the_config():
    # ParamwiseSection is checked through OptimSection, which holds it.
    assert set(SECTIONS) | {ParamwiseSection} == set(PREFIXES)


@pytest.mark.parametrize('section, f', _all_fields(), ids=[f'{s.__name__}.{f.name}' for s, f in _all_fields()])
def test_every_key_has_a_doc_and_a_rule_its_default_passes(section, f):
    assert isinstance(f.metadata.get('doc'), str) and f.metadata['doc'].strip(), f'{section.__name__}.{f.name}'
    check, what = f.metadata['rule']
    assert callable(check) and isinstance(what, str) and what.strip()
    assert check(_default(f))


def _bad_cases():
    cases = []
    for section, f in _all_fields():
        key = PREFIXES[section] + f.name
        assert f.type in BAD_BY_TYPE, f'{key}: add bad values for {f.type} to BAD_BY_TYPE'
        values = BAD_BY_TYPE[f.type] + ([EDGES[key]] if key in EDGES else [])
        cases += [pytest.param(section, f.name, key, value, id=f'{key}={value!r}') for value in values]
    assert set(EDGES) <= {case.values[2] for case in cases}, 'an EDGES key is no field of any section'
    return cases


@pytest.mark.parametrize('section, name, key, value', _bad_cases())
def test_a_wrong_value_is_refused_naming_the_key(section, name, key, value):
    with pytest.raises(ConfigError) as built:
        section(**{name: value})
    assert str(built.value) == f'{key} must be {section.__dataclass_fields__[name].metadata["rule"][1]}, ' \
                               f'got {value!r}.'
    with pytest.raises(ConfigError) as loaded:  # what a user sees
        load_config(None, [f'{key}={value!r}'])
    assert str(loaded.value).startswith(f'--cfg-options: {key} must be ') and '\n' not in str(loaded.value)
    assert str(loaded.value).endswith(f'got {value!r}.')


@pytest.mark.parametrize('option, message', [
    ('train=3', '--cfg-options: train must be a dict with the keys max_steps, log_interval,'),
    ('optim.paramwise=3', '--cfg-options: optim.paramwise must be a dict of no_weight_decay, backbone_lr_mult and freeze_backbone'),
    ('data.eval_overlap=32', '--cfg-options: data.eval_overlap (32) must be smaller than the evaluation tile (32'),
    # A missing file is refused by the trainer (a resumed run never reads it); a folder never is one.
    (f'load_from={str(REPO_ROOT / "configs")!r}', f"--cfg-options: load_from={str(REPO_ROOT / 'configs')!r} is a "
                                                   "folder; give the weights file"),
    ('load_from="https://host/w.pt"', "--cfg-options: load_from='https://host/w.pt' is a URL; download the file"),
])
def test_whole_sections_and_cross_field_checks(option, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ['data.crop_size=32', option])
    assert str(err.value).startswith(message)


def test_a_bad_value_is_blamed_on_where_it_came_from(tmp_path):
    """The file that set it, or --cfg-options; an option that fixes the file's value is accepted."""
    path = tmp_path / 'mine.py'
    path.write_text("train = dict(log_interval=0)\n")
    with pytest.raises(ConfigError, match=rf'^{path}: train.log_interval must be a positive integer, got 0'):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r'^--cfg-options: train.keep_checkpoints must be'):
        load_config(str(path), ['train.log_interval=5', "train.keep_checkpoints='two'"])
    assert load_config(str(path), ['train.log_interval=5']).train.log_interval == 5


def test_a_folder_or_a_cycle_of_bases_is_named(tmp_path):
    (tmp_path / 'a.py').write_text("_base_ = ['b.py']\n")
    (tmp_path / 'b.py').write_text("_base_ = ['a.py']\n")
    with pytest.raises(ConfigError, match=r'a.py: cannot be loaded: its _base_ files inherit from each other'):
        load_config(str(tmp_path / 'a.py'))
    with pytest.raises(ConfigError, match=r'is a folder, not a config file'):
        load_config(str(tmp_path))


def test_typed_view_of_a_loaded_config():
    cfg = load_config(None, ['train.max_steps=7', 'optim.paramwise.backbone_lr_mult=0.1'])
    assert TrainSection.from_cfg(cfg).max_steps == 7
    assert OptimSection.from_cfg(cfg).paramwise == ParamwiseSection(no_weight_decay=False, backbone_lr_mult=0.1)


def test_defaults_are_what_the_shipped_default_config_loads_to():
    loaded = load_config(str(REPO_ROOT / 'configs' / 'unet_synthetic.py')).to_dict()
    assert loaded.pop('config_name') == 'unet_synthetic'
    assert loaded == DEFAULTS
    assert load_config(None).to_dict() == {**DEFAULTS, 'config_name': 'default'}
    for section, f in _all_fields():
        node = DEFAULTS
        for part in (PREFIXES[section] + f.name).split('.'):
            node = node[part]
        assert node == (asdict(f.default) if is_dataclass(f.default) else _default(f))
    # What the shipped file's header promises.
    # (in_channels and num_classes are the data's: 3 bands and 6 classes for the synthetic scenes)
    assert DEFAULTS['model'] == dict(type='UNet', base_channels=16, depth=4)
    assert (DEFAULTS['data']['crop_size'], DEFAULTS['train']['max_steps']) == (128, 400)
    assert DEFAULTS['train']['eval_interval'] == DEFAULTS['train']['checkpoint_interval'] == 100


@pytest.mark.parametrize('options, said', [
    (['log.experiment=potsdam'], ["log.experiment='potsdam' is not used: it takes effect only with 'mlflow' in "
                                  "log.trackers"]),
    (['log.mlflow_tracking_uri=file:///tmp/mlruns', 'log.wandb_project=p'],
     ["log.mlflow_tracking_uri='file:///tmp/mlruns' is not used: it takes effect only with 'mlflow' in log.trackers",
      "log.wandb_project='p' is not used: it takes effect only with 'wandb' in log.trackers"]),
    (['log=dict(trackers=["mlflow"],experiment="x",wandb_project="p")'],
     ["log.wandb_project='p' is not used: it takes effect only with 'wandb' in log.trackers"]),
    (['log=dict(trackers=["mlflow","wandb"],experiment="x",wandb_project="p")'], []),
])
def test_a_trackers_options_without_the_tracker_are_said_at_training(options, said):
    # They were dropped without a word: the user looked for a run in a store nothing wrote to.
    from ds_seg.config import unused_settings
    assert unused_settings(load_config(None, options)) == said
