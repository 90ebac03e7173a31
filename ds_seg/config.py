"""Experiment config (mmengine Config) and DeepSpeed JSON: loading, checking, resolving.

Two configs, never a value in both: the DeepSpeed JSON owns precision, ZeRO, optimizer, LR
schedule shape, micro-batch and accumulation; the experiment config owns model, loss, data,
schedule length, evaluation and checkpointing.

Example::

    cfg = load_config('configs/unet_synthetic.py', ['train.max_steps=20'])
    ds = load_ds_config('ds_configs/zero2.json')
    ds, precision, notes = resolve_ds_config(ds, world_size=2, max_steps=cfg.train.max_steps)
"""
import copy
import difflib
import json
import os
from pathlib import Path

from mmengine.config import Config

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = Path(__file__).resolve().parent


def _shipped_dir(name):
    """``ds_seg/<name>`` in an installed wheel (setup.py maps the top-level folder there), else the
    source checkout's top-level ``<name>/`` (editable install, or ``launch/*.py``)."""
    inside = PACKAGE_DIR / name
    return inside if inside.is_dir() else REPO_ROOT / name


DS_CONFIGS_DIR = _shipped_dir('ds_configs')   # the shipped DeepSpeed JSONs
CONFIGS_DIR = _shipped_dir('configs')         # the shipped experiment configs


def find_shipped(path, folder, suffix):
    """``path`` if it is a file; else the shipped file it names (``zero2``, ``zero2.json`` or
    ``ds_configs/zero2.json`` for ``folder=DS_CONFIGS_DIR``), so a bare name works from any
    directory; else ``path`` unchanged (the caller reports it missing)."""
    p = Path(path)
    if p.is_file() or p.is_absolute() or str(p.parent) not in ('.', folder.name):
        return p
    shipped = folder / (p.name if p.name.endswith(suffix) else p.name + suffix)
    return shipped if shipped.is_file() else p


class ConfigError(ValueError):
    """A user mistake in a config file or option; the message names the file or key."""


# The embedded default experiment: a small UNet on synthetic aerial scenes. Every key a config
# may set appears here; config files and --cfg-options override these values.
DEFAULTS = dict(
    model=dict(type='UNet', in_channels=3, num_classes=6, base_channels=16, depth=4),
    loss=dict(type='CrossEntropyLoss', ignore_index=255),
    data=dict(
        train=dict(type='SyntheticAerial', split='train'),
        val=dict(type='SyntheticAerial', split='val'),
        crop_size=128,
        num_workers=1,
        eval_batch_size=None,      # None: the DeepSpeed micro-batch
        eval_tile=None,            # whole-scene evaluation window (None: crop_size)
        eval_overlap=None,         # overlap of evaluation windows (None: a quarter of the tile)
        random_scale=None,         # e.g. (0.5, 2.0): train windows of crop/scale resized to crop,
                                   # one factor per global micro-step, equal on every rank
    ),
    train=dict(
        max_steps=400,
        log_interval=10,
        eval_interval=100,
        checkpoint_interval=100,
        keep_checkpoints=2,
        seed=0,
        warmup_log_steps=2,        # first steps excluded from throughput figures (allocator, JIT)
        max_nonfinite_steps=5,     # consecutive non-finite losses that stop the run
        stop_check_interval=None,  # steps between the ranks' agreement on stop signals and non-finite
                                   # losses (None: 1 on a CPU, 10 on a GPU: no host sync in between)
        profile_steps=0,           # >0: torch.profiler trace of that many steps after warm-up
        peak_tflops=None,          # device peak for MFU (None: the telemetry table by GPU name)
        dist_timeout_s=None,       # how long a collective waits for a lost rank (default 600 s)
        compile=False,             # torch.compile the model (DeepSpeed: engine.compile(); DDP: module.compile())
        compile_mode='default',    # torch.compile mode, the same under both backends
        channels_last=None,        # conv activations in NHWC (None: the model family's default, see
                                   # ds_seg/engine/common.py CHANNELS_LAST_BY_MODEL: NCHW until measured)
    ),
    optim=dict(                    # the ViT fine-tuning recipe (ds_seg/engine/param_groups.py); the
                                   # optimizer and LR schedule themselves are the DeepSpeed JSON's
        layer_decay=None,          # e.g. 0.75: ViT block i of L trains at lr * decay ** (L - i),
                                   # embeddings and tokens at decay ** (L + 1), the heads at lr
        paramwise=dict(
            no_weight_decay=False,  # True: no weight decay on norms, biases, position embeddings, tokens
            backbone_lr_mult=1.0,   # LR of the (pretrained) backbone relative to the heads, e.g. 0.1
        ),
    ),
    log=dict(                      # experiment trackers (ds_seg/trackers.py), rank 0 only
        trackers=['tensorboard'],  # any of 'tensorboard', 'mlflow', 'wandb': same scalars, config, summary
        mlflow_tracking_uri=None,  # e.g. 'file:///scratch/mlruns' or a server URL (None: <work_dir>/mlruns)
        experiment=None,           # MLflow experiment name (None: 'ds_seg')
        wandb_project=None,        # W&B project (None: 'ds_seg'); WANDB_MODE=offline needs no network
    ),
    load_from=None,                # plain weights file (launch/export.py) to start from
    work_dir=None,                 # default: work_dirs/<config name>
)

# Sections whose dicts are built from a registry: their keys are the class's arguments, checked
# when the object is built, and a different ``type`` in a config replaces the whole dict.
_REGISTRY_SECTIONS = {'model', 'loss', 'data.train', 'data.val'}


def _merge(base, override, prefix=''):
    out = copy.deepcopy(base)
    for key, value in override.items():
        path = f'{prefix}{key}'
        if (path in _REGISTRY_SECTIONS and isinstance(value, dict) and isinstance(out.get(key), dict)
                and value.get('type', out[key].get('type')) != out[key].get('type')):
            out[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and path not in ('load_from',):
            out[key] = _merge(out[key], value, prefix=f'{path}.')
        else:
            out[key] = copy.deepcopy(value)
    return out


def _check_keys(cfg, defaults, source, prefix=''):
    for key, value in cfg.items():
        path = f'{prefix}{key}'
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else ''
            raise ConfigError(f"{source}: unknown key {path!r}.{hint} "
                              f"Known keys here: {', '.join(prefix + k for k in defaults)}.")
        if path in _REGISTRY_SECTIONS:
            if not isinstance(value, dict) and not (path == 'data.val' and value is None):  # None: no eval
                raise ConfigError(f"{source}: {path!r} must be a dict with a 'type' key, got {value!r}.")
        elif isinstance(value, dict) and isinstance(defaults[key], dict):
            _check_keys(value, defaults[key], source, prefix=f'{path}.')


def parse_cfg_options(options):
    """Turn ``['a.b=1', 'c=[1,2]']`` into a nested dict; values are Python literals or strings."""
    import ast
    nested = {}
    for item in options or []:
        if '=' not in item:
            raise ConfigError(f"--cfg-options: {item!r} is not of the form key=value.")
        key, raw = item.split('=', 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = {'true': True, 'false': False, 'none': None, 'null': None}.get(raw.lower(), raw)
        node = nested
        parts = key.split('.')
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def load_config(path=None, cfg_options=None):
    """Load an experiment config: defaults <- file <- ``--cfg-options``; return an mmengine Config.

    Python config files are executed (like any mmengine config); JSON and YAML files are only
    parsed. ``path=None`` gives the embedded default experiment.
    """
    cfg = copy.deepcopy(DEFAULTS)
    name = 'default'
    if path is not None:
        path = find_shipped(path, CONFIGS_DIR, '.py')
        if not path.is_file():
            candidates = sorted(p.name for p in CONFIGS_DIR.glob('*.py'))
            raise ConfigError(f"--config: {path} does not exist. Configs shipped in configs/: "
                              f"{', '.join(candidates) or 'none'}.")
        try:
            loaded = Config.fromfile(str(path)).to_dict()
        except Exception as exc:  # syntax errors, bad _base_ paths...
            raise ConfigError(f"{path}: cannot be loaded: {exc}") from exc
        _check_keys(loaded, DEFAULTS, str(path))
        cfg = _merge(cfg, loaded)
        name = path.stem
    options = parse_cfg_options(cfg_options)
    _check_keys(options, DEFAULTS, '--cfg-options')
    cfg = _merge(cfg, options)
    _check_values(cfg, str(path) if path else 'default config')
    cfg['config_name'] = name
    return Config(cfg)


def _int_at_least(low):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low,
            'a positive integer' if low == 1 else f'an integer >= {low}')


def _number_above(low, allow_none=False):
    return (lambda v: (allow_none and v is None)
            or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > low),
            f'a number > {low}' + (' or None' if allow_none else ''))


def _optional(rule):
    check, what = rule
    return (lambda v: v is None or check(v), f'{what} or None')


def _optional_path(v):
    return v is None or (isinstance(v, str) and v.strip() != '')


# torch.compile's modes (torch/_inductor/list_mode_options).
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')

# Every scalar key of the experiment config and what it accepts. A value that passes here
# cannot crash the run later (train.log_interval=0 used to divide by zero at the first step).
VALUE_RULES = {
    'train.max_steps': _int_at_least(1),
    'train.log_interval': _int_at_least(1),
    'train.eval_interval': (_int_at_least(0)[0], 'an integer >= 0 (0: no evaluation)'),
    'train.checkpoint_interval': (_int_at_least(0)[0], 'an integer >= 0 (0: only when signalled)'),
    'train.keep_checkpoints': (_int_at_least(0)[0], 'an integer >= 0 (0: keep all)'),
    'train.seed': _int_at_least(0),
    'train.warmup_log_steps': _int_at_least(0),
    'train.max_nonfinite_steps': _int_at_least(1),
    'train.stop_check_interval': _optional(_int_at_least(1)),
    'train.profile_steps': _int_at_least(0),
    'train.peak_tflops': _number_above(0, allow_none=True),
    'train.dist_timeout_s': _number_above(0, allow_none=True),
    'train.compile': (lambda v: isinstance(v, bool), 'True or False'),
    'train.compile_mode': (lambda v: v in COMPILE_MODES, f"one of {', '.join(map(repr, COMPILE_MODES))}"),
    'train.channels_last': (lambda v: v is None or isinstance(v, bool), 'None (the model family default), True or False'),
    'data.crop_size': _int_at_least(16),
    'data.num_workers': _int_at_least(0),
    'data.eval_batch_size': _optional(_int_at_least(1)),
    'data.eval_tile': _optional(_int_at_least(16)),
    'data.eval_overlap': _optional(_int_at_least(0)),
    'data.random_scale': (lambda v: v is None or (
        isinstance(v, (list, tuple)) and len(v) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v) and v[0] <= v[1]),
        'None or (low, high) with 0 < low <= high, e.g. (0.5, 2.0)'),
    'optim.layer_decay': (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and 0 < v <= 1), 'None or a number in (0, 1], e.g. 0.75'),
    'optim.paramwise.no_weight_decay': (lambda v: isinstance(v, bool), 'True or False'),
    'optim.paramwise.backbone_lr_mult': _number_above(0),
    'log.trackers': (lambda v: isinstance(v, (list, tuple)) and all(t in ('tensorboard', 'mlflow', 'wandb') for t in v),
                     "a list drawn from 'tensorboard', 'mlflow', 'wandb'"),
    'log.mlflow_tracking_uri': (_optional_path, 'None or a tracking URI'),
    'log.experiment': (_optional_path, 'None or an experiment name'),
    'log.wandb_project': (_optional_path, 'None or a W&B project name'),
    'load_from': (_optional_path, 'None or the path of a weights file from launch/export.py'),
    'work_dir': (_optional_path, 'None or a directory path'),
}


def _get(cfg, path):
    node = cfg
    for part in path.split('.'):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _check_values(cfg, source):
    for path in sorted(_REGISTRY_SECTIONS):
        node = _get(cfg, path)
        if node is not None and 'type' not in node:
            raise ConfigError(f"{source}: {path!r} must be a dict with a 'type' key, got {node!r}.")
    for path, (check, what) in VALUE_RULES.items():
        value = _get(cfg, path)
        if not check(value):
            raise ConfigError(f"{source}: {path} must be {what}, got {value!r}.")
    data = cfg['data']
    tile = data['eval_tile'] or data['crop_size']
    if data['eval_overlap'] is not None and data['eval_overlap'] >= tile:
        raise ConfigError(f"{source}: data.eval_overlap ({data['eval_overlap']}) must be smaller than the "
                          f"evaluation tile ({tile}, data.eval_tile or data.crop_size).")
    for split in ('train', 'val'):
        given = (_get(cfg, f'data.{split}') or {}).get('crop_size')
        if given is not None and given != data['crop_size']:
            raise ConfigError(f"{source}: data.{split}.crop_size={given!r} conflicts with data.crop_size="
                              f"{data['crop_size']!r} (the one every dataset is built with); set data.crop_size only.")
    if cfg.get('load_from') and not os.path.isfile(cfg['load_from']):
        raise ConfigError(f"{source}: load_from={cfg['load_from']!r} does not exist; give a weights file "
                          "written by launch/export.py.")


# ----------------------------------------------------------------------------------------------
# DeepSpeed JSON
# ----------------------------------------------------------------------------------------------

# Top-level keys DeepSpeed 0.19 reads (deepspeed/runtime/config.py and the feature configs it
# delegates to). DeepSpeed silently ignores any other top-level key, so a typo such as
# "gradient_clippin" would otherwise train without clipping.
DS_TOP_LEVEL_KEYS = {
    'train_batch_size', 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps',
    'optimizer', 'scheduler', 'fp16', 'bf16', 'bfloat16', 'torch_autocast', 'data_types',
    'gradient_clipping', 'prescale_gradients', 'gradient_predivide_factor', 'gradient_allreduce_op',
    'communication_data_type', 'seq_parallel_communication_data_type', 'sparse_gradients',
    'zero_optimization', 'zero_allow_untested_optimizer', 'zero_force_ds_cpu_optimizer',
    'steps_per_print', 'wall_clock_breakdown', 'memory_breakdown', 'dump_state', 'log_level',
    'flops_profiler', 'tensorboard', 'wandb', 'csv_monitor', 'comet', 'comms_logger',
    'activation_checkpointing', 'aio', 'checkpoint', 'elasticity', 'autotuning',
    'compression_training', 'data_efficiency', 'curriculum_learning', 'pipeline', 'hybrid_engine',
    'nebula', 'compile', 'sparse_attention', 'eigenvalue', 'progressive_layer_drop',
    'quantize_training', 'weight_quantization', 'timers', 'tensor_parallel', 'graph_harvesting',
    'dataloader_drop_last', 'disable_allgather', 'disable_python_gc', 'legacy_fusion',
    'use_data_before_expert_parallelism', 'vocabulary_size', 'managed_gradient_accumulation',
    'zenflow', 'amp',
}

# Schedulers whose length we fill from train.max_steps when the JSON leaves it out.
_SCHEDULERS_WITH_TOTAL = {'WarmupDecayLR', 'WarmupCosineLR'}


def load_ds_config(path):
    """Read a DeepSpeed JSON file and check it (see :func:`check_ds_config`)."""
    path = find_shipped(path, DS_CONFIGS_DIR, '.json')
    if not path.is_file():
        shipped = sorted(p.stem for p in DS_CONFIGS_DIR.glob('*.json'))
        raise ConfigError(f"--deepspeed_config: {path} does not exist. Shipped: {', '.join(shipped)}.")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}).") from exc
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object.")
    check_ds_config(ds, str(path))
    return ds


def _find_auto(node, prefix=''):
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find_auto(value, f'{prefix}.{key}' if prefix else key)
            if found:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _find_auto(value, f'{prefix}[{i}]')
            if found:
                return found
    elif isinstance(node, str) and node.strip().lower() == 'auto':
        return prefix
    return None


def check_ds_config(ds, source='DeepSpeed config'):
    """Refuse what DeepSpeed would silently misread: unknown top-level keys and ``"auto"``."""
    for key in ds:
        if key not in DS_TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(key, sorted(DS_TOP_LEVEL_KEYS), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ''
            raise ConfigError(f"{source}: unknown top-level key {key!r}.{hint} "
                              "DeepSpeed would silently ignore it; fix or remove it.")
    auto = _find_auto(ds)
    if auto:
        raise ConfigError(f"{source}: {auto!r} is \"auto\". \"auto\" is a Hugging Face convention, not a "
                          "DeepSpeed one (DeepSpeed replaces it by a default or crashes): give a value.")
    for key in ('train_batch_size', 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps'):
        if key in ds and (not isinstance(ds[key], int) or isinstance(ds[key], bool) or ds[key] < 1):
            raise ConfigError(f"{source}: {key!r} must be a positive integer, got {ds[key]!r}.")
    _check_ds_values(ds, source)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Top-level scalars DeepSpeed reads without checking their type: a string here trains wrongly
# or fails mid-run (a string gradient_clipping crashed at the first optimizer step).
_DS_SCALARS = {
    'gradient_clipping': (lambda v: _is_number(v) and v >= 0, 'a number >= 0 (0: no clipping)'),
    'gradient_predivide_factor': (lambda v: _is_number(v) and v > 0, 'a number > 0'),
    'steps_per_print': (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, 'a positive integer'),
    'prescale_gradients': (lambda v: isinstance(v, bool), 'true or false'),
    'wall_clock_breakdown': (lambda v: isinstance(v, bool), 'true or false'),
    'memory_breakdown': (lambda v: isinstance(v, bool), 'true or false'),
    'zero_allow_untested_optimizer': (lambda v: isinstance(v, bool), 'true or false'),
    'zero_force_ds_cpu_optimizer': (lambda v: isinstance(v, bool), 'true or false'),
    'dump_state': (lambda v: isinstance(v, bool), 'true or false'),
}
# Optimizer/scheduler parameters that are strings by design; every other one is a number, a
# bool or a list of numbers ("lr": "1e-3" is refused, not passed to torch as a string).
_DS_STRING_PARAMS = {'warmup_type', 'cycle_momentum_type', 'decay_type'}


def _check_ds_params(block, where, source):
    params = block.get('params', {})
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: '{where}.params' must be an object, got {params!r}.")
    for key, value in params.items():
        ok = (isinstance(value, str) if key in _DS_STRING_PARAMS else
              isinstance(value, bool) or _is_number(value) or value is None
              or (isinstance(value, list) and all(_is_number(x) for x in value)))
        if not ok:
            hint = ' (write it without quotes)' if isinstance(value, str) and _looks_numeric(value) else ''
            raise ConfigError(f"{source}: '{where}.params.{key}' must be a number, got {value!r}{hint}.")
        if key == 'betas' and not (isinstance(value, list) and len(value) == 2 and all(0 <= b < 1 for b in value)):
            raise ConfigError(f"{source}: '{where}.params.betas' must be two numbers in [0, 1), e.g. [0.9, 0.999], "
                              f"got {value!r}.")
        if key == 'lr' and _is_number(value) and value < 0:
            raise ConfigError(f"{source}: '{where}.params.lr' must be >= 0, got {value!r}.")


def _looks_numeric(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def _check_ds_values(ds, source):
    """Check values, not only keys, before any training: our rules for what DeepSpeed takes
    unchecked, then DeepSpeed's own pydantic models (ZeRO, fp16, bf16... sub-blocks), their
    failures turned into one line naming the key and what it accepts."""
    import torch
    for key, (check, what) in _DS_SCALARS.items():
        if key in ds and not check(ds[key]):
            raise ConfigError(f"{source}: {key!r} must be {what}, got {ds[key]!r}.")
    optimizer = ds.get('optimizer')
    if optimizer is not None:
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
        kind = optimizer.get('type') if isinstance(optimizer, dict) else None
        # DeepSpeed builds its own optimizers by (lower-case) name, anything else from torch.optim.
        if not isinstance(kind, str) or (kind.lower() not in DEEPSPEED_OPTIMIZERS and not (
                isinstance(getattr(torch.optim, kind, None), type)
                and issubclass(getattr(torch.optim, kind), torch.optim.Optimizer))):
            known = sorted(set(DEEPSPEED_OPTIMIZERS) | {'Adam', 'AdamW', 'SGD'})
            close = difflib.get_close_matches(str(kind).lower(), [k.lower() for k in known], n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ''
            raise ConfigError(f"{source}: 'optimizer.type' {kind!r} is not an optimizer DeepSpeed knows.{hint} "
                              f"Use one of {', '.join(known)} or a torch.optim class name.")
        _check_ds_params(optimizer, 'optimizer', source)
    scheduler = ds.get('scheduler')
    if scheduler is not None:
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
        kind = scheduler.get('type') if isinstance(scheduler, dict) else None
        if kind not in VALID_LR_SCHEDULES:
            close = difflib.get_close_matches(str(kind), VALID_LR_SCHEDULES, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ''
            raise ConfigError(f"{source}: 'scheduler.type' {kind!r} is not a DeepSpeed scheduler.{hint} "
                              f"Use one of {', '.join(VALID_LR_SCHEDULES)}.")
        _check_ds_params(scheduler, 'scheduler', source)
    _check_by_building(ds, source)
    _check_with_deepspeed(ds, source)


def _check_by_building(ds, source):
    """Build the optimizer and LR schedule the JSON describes on one dummy parameter, with the
    same code the DDP backend trains with: every value they reject (betas of the wrong length, a
    negative weight decay, eps or warmup) is one line now, not a traceback from deep inside
    ``deepspeed.initialize``."""
    import torch

    from .engine.ddp_backend import build_optimizer, build_scheduler
    param = torch.nn.Parameter(torch.zeros(1))
    block = ds.get('optimizer') or {}
    kind = str(block.get('type', '')).lower()
    try:
        if kind in ('adam', 'adamw', 'sgd') or kind in (k.lower() for k in dir(torch.optim)):
            optimizer = build_optimizer([param], block) if kind in ('adam', 'adamw', 'sgd') else \
                getattr(torch.optim, block['type'])([param], **block.get('params', {}))
        else:  # DeepSpeed's own optimizers (Lamb, Lion...) need their extensions: checked by type only
            optimizer = torch.optim.SGD([param], lr=1e-3)
    except (ValueError, TypeError, IndexError) as exc:
        raise ConfigError(f"{source}: 'optimizer.params' {block.get('params')} are refused by {block.get('type')}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}.") from exc
    scheduler = copy.deepcopy(ds.get('scheduler'))
    if scheduler:
        params = scheduler.setdefault('params', {})
        if scheduler.get('type') in _SCHEDULERS_WITH_TOTAL:  # the real length comes from train.max_steps
            warmup = params.get('warmup_num_steps', 0)
            params.setdefault('total_num_steps', max(2, warmup + 1 if isinstance(warmup, int) else 2))
        try:
            build_scheduler(optimizer, scheduler)
        except (ValueError, TypeError, IndexError, AssertionError) as exc:
            raise ConfigError(f"{source}: 'scheduler.params' are refused by DeepSpeed's {scheduler.get('type')}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}.") from exc


def _check_with_deepspeed(ds, source):
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig
    probe = copy.deepcopy(ds)
    # The batch triple is resolved later, for the real world size; here any consistent one will do.
    probe.pop('train_batch_size', None)
    probe.setdefault('train_micro_batch_size_per_gpu', 1)
    probe['train_batch_size'] = probe['train_micro_batch_size_per_gpu'] * probe.get('gradient_accumulation_steps', 1)
    try:
        DeepSpeedConfig(probe)
    except pydantic.ValidationError as exc:
        raise ConfigError(f'{source}: {_pydantic_line(exc, ds)}') from exc
    except (ValueError, TypeError, AssertionError, KeyError) as exc:
        raise ConfigError(f'{source}: DeepSpeed refuses this config: {str(exc).splitlines()[0]}') from exc


# The top-level key each of DeepSpeed's pydantic models validates (for error paths).
_DS_BLOCK_MODELS = {'DeepSpeedZeroConfig': 'zero_optimization', 'DeepSpeedFP16Config': 'fp16',
                    'DeepSpeedBF16Config': 'bf16'}


def _pydantic_line(exc, ds):
    err = exc.errors()[0]
    block = _DS_BLOCK_MODELS.get(exc.title, exc.title)
    loc = [str(p) for p in err['loc']]
    path = '.'.join([block] + loc)
    if err['type'] == 'extra_forbidden':
        parent = '.'.join([block] + loc[:-1])
        known = _known_fields(exc.title, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"Did you mean '{parent}.{close[0]}'?" if close else f"Known keys of '{parent}': {', '.join(known)}."
        return f"unknown key {path!r}. {hint}"
    return f"{path!r} is {err.get('input')!r}: {err['msg']}."


def _known_fields(model_name, loc):
    """Field names of the pydantic model at ``loc`` inside DeepSpeed's model ``model_name``."""
    import typing

    import deepspeed.runtime.precision_config as precision
    import deepspeed.runtime.zero.config as zero
    model = getattr(zero, model_name, None) or getattr(precision, model_name, None)
    for part in loc:
        field = getattr(model, 'model_fields', {}).get(part)
        if field is None:
            return []
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if hasattr(c, 'model_fields')), None)
    return sorted(getattr(model, 'model_fields', {}))


def resolve_batch(ds, world_size, source='DeepSpeed config'):
    """Return (micro_batch, grad_accum, global_batch) for this world size, or raise naming the key.

    The JSON should give micro-batch and accumulation; a ``train_batch_size`` is accepted when it
    is consistent with them (or lets the missing one be derived) at this world size.
    """
    tbs = ds.get('train_batch_size')
    mb = ds.get('train_micro_batch_size_per_gpu')
    gas = ds.get('gradient_accumulation_steps')
    if mb is None and gas is None and tbs is None:
        raise ConfigError(f"{source}: set 'train_micro_batch_size_per_gpu' (and optionally "
                          "'gradient_accumulation_steps').")
    if tbs is not None:
        if mb is None and gas is None:
            mb, gas = tbs // world_size, 1
            if mb * world_size != tbs:
                raise ConfigError(f"{source}: 'train_batch_size' {tbs} is not divisible by the world size "
                                  f"{world_size}; give 'train_micro_batch_size_per_gpu' instead.")
        elif mb is None:
            mb = tbs // (gas * world_size)
            if mb * gas * world_size != tbs:
                raise ConfigError(f"{source}: 'train_batch_size' {tbs} is not divisible by "
                                  f"gradient_accumulation_steps {gas} x world size {world_size}.")
        elif gas is None:
            gas = tbs // (mb * world_size)
            if mb * gas * world_size != tbs:
                raise ConfigError(f"{source}: 'train_batch_size' {tbs} is not divisible by "
                                  f"train_micro_batch_size_per_gpu {mb} x world size {world_size}.")
        elif mb * gas * world_size != tbs:
            raise ConfigError(f"{source}: 'train_batch_size' {tbs} != train_micro_batch_size_per_gpu {mb} x "
                              f"gradient_accumulation_steps {gas} x world size {world_size}. Remove "
                              "'train_batch_size' so it follows the number of GPUs.")
    mb = mb if mb is not None else 1
    gas = gas if gas is not None else 1
    return mb, gas, mb * gas * world_size


def device_supports(precision):
    """Whether this machine's accelerator can train in ``precision`` ('fp16' or 'bf16')."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    return acc.is_fp16_supported() if precision == 'fp16' else acc.is_bf16_supported()


def resolve_ds_config(ds, world_size, max_steps, source='DeepSpeed config', supports=device_supports):
    """Resolve a checked DeepSpeed dict for this run. Returns ``(resolved, precision, notes)``.

    * batch triple made explicit for this world size;
    * scheduler length filled from ``train.max_steps`` when absent;
    * precision the hardware cannot run replaced by the closest working mode (fp16 -> bf16
      autocast -> fp32), with one line in ``notes`` saying so.

    ``precision`` is the mode actually used: 'fp32', 'fp16', 'bf16', 'bf16-autocast' or
    'fp16-autocast'.
    """
    ds = copy.deepcopy(ds)
    notes = []
    mb, gas, tbs = resolve_batch(ds, world_size, source)
    ds['train_micro_batch_size_per_gpu'] = mb
    ds['gradient_accumulation_steps'] = gas
    ds['train_batch_size'] = tbs

    sched = ds.get('scheduler')
    if sched and sched.get('type') in _SCHEDULERS_WITH_TOTAL:
        params = sched.setdefault('params', {})
        from_run = 'total_num_steps' not in params
        params.setdefault('total_num_steps', max_steps)
        warmup = params.get('warmup_num_steps', 0)
        if from_run and warmup >= max_steps:
            # A smoke test (train.max_steps=5) with a JSON written for real runs: warm up over the
            # first fifth of the run instead of refusing it (DeepSpeed needs at least 1 step).
            params['warmup_num_steps'] = max(1, max_steps // 5)
            notes.append(f"{source}: scheduler.params.warmup_num_steps {warmup} is not shorter than the run "
                         f"({max_steps} steps); warming up over {params['warmup_num_steps']} step(s) instead.")
        elif warmup >= params['total_num_steps']:
            raise ConfigError(f"{source}: scheduler.params.warmup_num_steps ({params.get('warmup_num_steps')}) "
                              f"must be smaller than the run length ({params['total_num_steps']} steps).")

    if 'bfloat16' in ds:  # DeepSpeed's old spelling
        ds['bf16'] = ds.pop('bfloat16')
    fp16 = bool(ds.get('fp16', {}).get('enabled', False))
    bf16 = bool(ds.get('bf16', {}).get('enabled', False))
    autocast = ds.get('torch_autocast', {})
    if fp16 and bf16:
        raise ConfigError(f"{source}: 'fp16.enabled' and 'bf16.enabled' are both true; choose one.")

    if fp16 and not supports('fp16'):
        ds['fp16']['enabled'] = False
        if supports('bf16'):
            ds['torch_autocast'] = {'enabled': True, 'dtype': 'bfloat16'}
            notes.append(f"{source}: fp16 is not supported on this device; running bf16 autocast instead.")
        else:
            notes.append(f"{source}: fp16 is not supported on this device; running fp32 instead.")
    elif bf16 and not supports('bf16'):
        ds['bf16']['enabled'] = False
        notes.append(f"{source}: bf16 is not supported on this device; running fp32 instead.")

    if ds.get('fp16', {}).get('enabled'):
        precision = 'fp16'
    elif ds.get('bf16', {}).get('enabled'):
        precision = 'bf16'
    elif ds.get('torch_autocast', autocast).get('enabled'):
        dtype = str(ds['torch_autocast'].get('dtype', 'bfloat16'))
        precision = ('fp16' if dtype in ('float16', 'fp16', 'half', 'torch.float16') else 'bf16') + '-autocast'
    else:
        precision = 'fp32'
    return ds, precision, notes


def default_work_dir(cfg):
    return cfg.get('work_dir') or os.path.join('work_dirs', cfg.get('config_name', 'default'))
