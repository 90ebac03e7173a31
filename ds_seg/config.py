"""Experiment config (mmengine Config) and DeepSpeed JSON: loading, checking, resolving.

Two configs, never a value in both: the DeepSpeed JSON owns precision, ZeRO, optimizer, LR
schedule shape, micro-batch and accumulation; the experiment config owns model, loss, data,
schedule length, evaluation and checkpointing.

Example::

    cfg = load_config('configs/unet_synthetic.py', ['train.max_steps=20'])
    ds = load_ds_config('ds_configs/zero2.json')
    ds, precision, notes = resolve_ds_config(ds, world_size=2, max_steps=cfg.train.max_steps)
"""
import contextlib
import copy
import difflib
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import List, Optional, Tuple

from mmengine.config import Config

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = Path(__file__).resolve().parent

# setup.py's extras, by the packages they install (a wheel user has no checkout for -e '.[x]').
_EXTRAS = {'onnx': 'onnx onnxscript onnxruntime', 'mlflow': 'mlflow-skinny', 'wandb': 'wandb'}


def extra_hint(extra):
    """How to install an optional extra, for this installation: in a checkout ``pip install -e
    '.[onnx]'``, else the packages themselves."""
    if (REPO_ROOT / 'setup.py').is_file():  # the package's parent is a checkout, not site-packages
        return f"pip install -e '.[{extra}]' in the checkout ({REPO_ROOT})"
    return f"pip install {_EXTRAS[extra]}"


def _shipped_dir(name, source=None):
    """``ds_seg/<name>`` in an installed wheel (setup.py maps the checkout's folder there), else the
    source checkout's ``source`` (default: the top-level ``<name>/``; editable install, or
    ``launch/*.py``)."""
    inside = PACKAGE_DIR / name
    return inside if inside.is_dir() else REPO_ROOT / (source or name)


DS_CONFIGS_DIR = _shipped_dir('ds_configs')   # the shipped DeepSpeed JSONs
CONFIGS_DIR = _shipped_dir('configs')         # the shipped experiment configs
SBATCH_DIR = _shipped_dir('slurm', 'launch/slurm')  # the sbatch templates (--sbatch-template)
SBATCH_TEMPLATES = {'one-node': 'train.sbatch', 'multinode': 'train_multinode.sbatch'}


def find_shipped(path, folder, suffix):
    """``path`` if it is a file; ``path`` + ``suffix`` where that is a file (``cfgs/mine`` for
    ``cfgs/mine.py``); else the shipped file it names (``zero2``, ``zero2.json`` or
    ``ds_configs/zero2.json`` for ``folder=DS_CONFIGS_DIR``), so a bare name works from any
    directory; else ``path`` unchanged (the caller reports it missing)."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.suffix and p.with_name(p.name + suffix).is_file():  # cfgs/mine for cfgs/mine.py, as for shipped names
        return p.with_name(p.name + suffix)
    # './zero2' names this folder (Path drops the './'): a path, never the shipped file.
    if p.is_absolute() or str(path).startswith(('./', '.' + os.sep)) or str(p.parent) not in ('.', folder.name):
        return p
    local = p if p.name.endswith(suffix) else p.with_name(p.name + suffix)
    if local.is_file():  # the user's copy (the README's copy-out recipe) before the shipped file
        return local
    shipped = folder / local.name
    if not shipped.is_file():
        return p
    mine = Path(folder.name) / local.name
    if str(p.parent) == '.' and mine.is_file() and not mine.resolve().samefile(shipped):
        # A bare name in a project laid out like the checkout (configs/, ds_configs/ of edited
        # copies): the shipped file trained instead of the user's copy, without a word.
        if f'{path} -> {mine}' not in _SAID_SHIPPED and os.environ.get('RANK', '0') == '0':
            _SAID_SHIPPED.add(f'{path} -> {mine}')
            print(f"[ds_seg] {path}: using {mine} in {os.getcwd()} (your copy), not the shipped {shipped}",
                  file=sys.stderr, flush=True)
        return mine
    if str(p.parent) == folder.name and str(p) not in _SAID_SHIPPED and os.environ.get('RANK', '0') == '0':
        # A path, not a bare name: a user who mistyped the path to an edited copy trained the
        # shipped file without a word.
        _SAID_SHIPPED.add(str(p))
        print(f"[ds_seg] {path} is not under {os.getcwd()}: using the shipped {shipped}", file=sys.stderr, flush=True)
    return shipped


_SAID_SHIPPED = set()  # the paths find_shipped said it replaced (once each)


def _as_given(given, path):
    """``path`` as the user wrote it where ``./`` made it a path in this folder (Path drops the
    ``./``: "unet_tiny does not exist" stood beside a list holding unet_tiny.py)."""
    if given.startswith(('./', '.' + os.sep)):
        return f'{given} (./ names a file in {os.getcwd()}; a shipped one is named without it)'
    return str(path)


class ConfigError(ValueError):
    """A user mistake in a config file or option; the message names the file or key."""


# ----------------------------------------------------------------------------------------------
# Experiment config: typed sections
# ----------------------------------------------------------------------------------------------

# A rule is (check, description): ``check(value)`` is true for the values a key accepts, and the
# description completes the refusal "<key> must be <description>, got <value>.". A value that
# passes cannot crash the run later (train.log_interval=0 used to divide by zero at the first step).

def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_at_least(low, zero_means=None, high=None, high_text=None):
    what = (f'an integer in [{low}, {high_text or high}]' if high is not None else
            'a positive integer' if low == 1 else f'an integer >= {low}')
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high),
            f'{what} (0: {zero_means})' if zero_means else what)


def checked_number(owner, name, value, low=0.0, high=math.inf, low_open=False, integer=False):
    """``value`` of the setting ``name`` of ``owner`` (a transform, a loss) if it is a finite number
    (an integer with ``integer``) in range, else a ValueError, which ``build`` turns into one line
    naming the config key. Checked when the object is built: out of range, a setting trains
    silently wrong (a prob of 1.5 is 1, a contrast of 1.5 inverts bands, a negative loss_weight
    ascends the loss), and a string fails only at the first step, after the work dir was written."""
    number = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not (number and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if low_open else value >= low) and value <= high):
        bounds = (f"{'>' if low_open else '>='} {low:g}" if high == math.inf
                  else f"in {'(' if low_open else '['}{low:g}, {high:g}]")
        raise ValueError(f"{owner} {name} must be {'an integer' if integer else 'a number'} {bounds}, got {value!r}")
    return value


def _number_above(low, allow_none=False):
    # Finite: 1e999 parses as inf, which passes "> 0" and then fails deep inside (a timeout of inf s).
    return (lambda v: (allow_none and v is None) or (_is_number(v) and math.isfinite(v) and v > low),
            f'a finite number > {low}' + (' or None' if allow_none else ''))


def _optional(rule):
    check, what = rule
    return (lambda v: v is None or check(v), f'{what} or None')


def _optional_path(v):
    return v is None or (isinstance(v, str) and v.strip() != '')


def _is_bool(v):
    return isinstance(v, bool)


def _is_scale_range(v):
    if v is None:
        return True
    from ds_seg.data.transforms import check_random_scale  # which imports this module
    try:
        return isinstance(v, (list, tuple)) and check_random_scale(v) is not None
    except ValueError:
        return False


def _is_layer_decay(v):
    return v is None or (_is_number(v) and 0 < v <= 1)


MAX_NUM_WORKERS = 128  # data.num_workers per rank
MAX_PREFETCH_BATCHES = 16
# torch.compile's modes (torch/_inductor/list_mode_options).
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')
TRACKERS = ('tensorboard', 'mlflow', 'wandb')


def setting(default, doc, rule):
    """One key of a section: its default, what it means and the rule its values must pass."""
    metadata = dict(doc=doc, rule=rule)
    if isinstance(default, list):  # a dataclass field cannot share one mutable default
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class _Section:
    """What every section shares: building one checks each field against its rule (ConfigError
    naming the dotted key), and ``from_cfg`` gives the typed view of a loaded or merged config."""
    KEY = ''  # where the section sits in the experiment config ('' = the top level)

    def __post_init__(self):
        for f in fields(self):
            check, what = f.metadata['rule']
            value = getattr(self, f.name)
            if not check(value):
                raise ConfigError(f'{self.key_of(f.name)} must be {what}, got {value!r}.')

    @classmethod
    def key_of(cls, name):
        return f'{cls.KEY}.{name}' if cls.KEY else name

    @classmethod
    def from_cfg(cls, cfg):
        """This section of ``cfg`` (an mmengine Config or a nested dict), checked."""
        cfg = cfg.to_dict() if isinstance(cfg, Config) else cfg
        node = _get(cfg, cls.KEY) if cls.KEY else cfg
        if not isinstance(node, dict):
            raise ConfigError(f"{cls.KEY} must be a dict with the keys {', '.join(f.name for f in fields(cls))}, "
                              f"got {node!r}.")
        return cls(**{f.name: node[f.name] for f in fields(cls) if f.name in node})


SAVE_BEST_METRICS = ('mIoU', 'mF1', 'OA')  # train.save_best: eval.jsonl's scores, higher is better


@dataclass(frozen=True)
class TrainSection(_Section):
    """``train``: run length, logging, evaluation and checkpoint cadence, run-time switches."""
    KEY = 'train'
    max_steps: int = setting(400, 'length of the run in optimizer steps; the LR schedule follows it',
                             _int_at_least(1))
    log_interval: int = setting(10, 'steps between logged training metrics (metrics.jsonl, trackers)',
                                _int_at_least(1))
    eval_interval: int = setting(100, 'steps between evaluations on data.val (0: no evaluation)',
                                 _int_at_least(0, zero_means='no evaluation'))
    checkpoint_interval: int = setting(100, 'steps between checkpoints (0: only when signalled)',
                                       _int_at_least(0, zero_means='only when signalled'))
    keep_checkpoints: int = setting(2, 'newest checkpoints kept in the work dir (0: keep all)',
                                    _int_at_least(0, zero_means='keep all'))
    save_best: Optional[str] = setting(
        None, "also keep the checkpoint of the best evaluation by this metric (higher is better), named by "
              "checkpoints/best; a new best is checkpointed when it is measured (None: only the newest)",
        (lambda v: v is None or v in SAVE_BEST_METRICS, f"None or one of {', '.join(map(repr, SAVE_BEST_METRICS))}"))
    seed: int = setting(0, 'seed of the model initialisation and of the datasets',
                        _int_at_least(0, high=2 ** 63 - 1, high_text='2**63 - 1'))  # torch's: a signed 64-bit int
    warmup_log_steps: int = setting(2, 'first steps excluded from throughput figures (allocator, JIT)',
                                    _int_at_least(0))
    max_nonfinite_steps: int = setting(5, 'consecutive non-finite losses that stop the run', _int_at_least(1))
    stop_check_interval: Optional[int] = setting(
        None, "steps between the ranks' agreement on stop signals and non-finite losses (None: every "
              'step on a CPU; on a GPU every 10, sooner where 10 steps take over 2 s: no host sync in between)',
        _optional(_int_at_least(1)))
    profile_steps: int = setting(0, '>0: torch.profiler trace of that many steps after warm-up', _int_at_least(0))
    peak_tflops: Optional[float] = setting(None, 'device peak for MFU (None: the telemetry table by GPU name)',
                                           _number_above(0, allow_none=True))
    dist_timeout_s: Optional[float] = setting(None, 'how long a collective waits for a lost rank (None: 600 s)',
                                              _number_above(0, allow_none=True))
    compile: bool = setting(False, 'torch.compile the model (DeepSpeed: engine.compile(); DDP: module.compile())',
                            (_is_bool, 'True or False'))
    compile_mode: str = setting('default', 'torch.compile mode, the same under both backends',
                                (lambda v: v in COMPILE_MODES, f"one of {', '.join(map(repr, COMPILE_MODES))}"))
    channels_last: Optional[bool] = setting(
        None, "conv activations in NHWC (None: the model family's default, see ds_seg/engine/speed.py "
              'CHANNELS_LAST_BY_MODEL: NCHW until measured)',
        (lambda v: v is None or _is_bool(v), 'None (the model family default), True or False'))


@dataclass(frozen=True)
class DataSection(_Section):
    """``data``'s own keys; ``data.train`` and ``data.val`` are registry dicts (see DEFAULTS)."""
    KEY = 'data'
    crop_size: int = setting(128, 'side of the square training window in pixels, every dataset is built with it',
                             _int_at_least(16))
    num_workers: int = setting(1, 'DataLoader worker processes per rank (0: load in the training process)',
                               # 100000 forked workers until the host ran out of memory, then left
                               # some behind, orphaned; a loader saturates long before this many.
                               _int_at_least(0, high=MAX_NUM_WORKERS))
    prefetch_batches: Optional[int] = setting(
        None, 'batches copied to the device and preprocessed ahead of the step, on a side CUDA stream '
              '(None: 2 on CUDA, 1 elsewhere; 0: each batch when its step takes it)',
        # More only holds more batches in memory: a million filled the host's 23 GiB before step 1.
        _optional(_int_at_least(0, high=MAX_PREFETCH_BATCHES)))
    eval_batch_size: Optional[int] = setting(None, 'evaluation batch size (None: the DeepSpeed micro-batch)',
                                             _optional(_int_at_least(1)))
    eval_tile: Optional[int] = setting(None, 'whole-scene evaluation window (None: crop_size)',
                                       _optional(_int_at_least(16)))
    eval_overlap: Optional[int] = setting(None, 'overlap of evaluation windows (None: a quarter of the tile)',
                                          _optional(_int_at_least(0)))
    random_scale: Optional[Tuple[float, float]] = setting(
        None, 'e.g. (0.5, 2.0): train windows of crop/scale resized to crop, one factor per global micro-step, '
              'equal on every rank',
        (_is_scale_range, 'None or (low, high) resize factors with 0.1 <= low <= high <= 10, e.g. (0.5, 2.0)'))

    def __post_init__(self):
        super().__post_init__()
        tile = self.eval_tile or self.crop_size
        if self.eval_overlap is not None and self.eval_overlap >= tile:
            raise ConfigError(f"data.eval_overlap ({self.eval_overlap}) must be smaller than the "
                              f"evaluation tile ({tile}, data.eval_tile or data.crop_size).")

    @classmethod
    def from_cfg(cls, cfg):
        section = super().from_cfg(cfg)
        # The datasets are built with data.crop_size; a crop_size of their own would be ignored.
        cfg = cfg.to_dict() if isinstance(cfg, Config) else cfg
        for split in ('train', 'val'):
            given = (_get(cfg, f'data.{split}') or {}).get('crop_size')
            if given is not None and given != section.crop_size:
                raise ConfigError(f"data.{split}.crop_size={given!r} conflicts with data.crop_size="
                                  f"{section.crop_size!r} (the one every dataset is built with); "
                                  "set data.crop_size only.")
        # Likewise data.random_scale replaces the training set's own random_scale when set.
        train = _get(cfg, 'data.train') or {}
        given = train.get('random_scale')
        pair = tuple(given) if isinstance(given, (list, tuple)) else (given, given)
        if given is not None and section.random_scale is not None and pair != tuple(section.random_scale):
            raise ConfigError(f"data.train.random_scale={given!r} conflicts with data.random_scale="
                              f"{section.random_scale!r} (which replaces it); set one of them.")
        if 'random_scale' in train and given is None and section.random_scale is not None:
            # Meant as "no scaling": trained at data.random_scale all the same, without a word.
            raise ConfigError(f"data.train.random_scale=None conflicts with data.random_scale="
                              f"{section.random_scale!r} (which replaces it); to train without scaling set "
                              "data.random_scale=None.")
        return section


@dataclass(frozen=True)
class ParamwiseSection(_Section):
    """``optim.paramwise``: per-parameter-group settings of the fine-tuning recipe."""
    KEY = 'optim.paramwise'
    no_weight_decay: bool = setting(False, 'True: no weight decay on norms, biases, position embeddings, tokens',
                                    (_is_bool, 'True or False'))
    backbone_lr_mult: float = setting(1.0, 'LR of the (pretrained) backbone relative to the heads, e.g. 0.1',
                                      _number_above(0))
    freeze_backbone: bool = setting(False, 'True: train the heads only (linear probing, torchgeo\'s freeze_backbone): '
                                           'the pretrained backbone keeps its weights and its norm statistics',
                                    (_is_bool, 'True or False'))


@dataclass(frozen=True)
class OptimSection(_Section):
    """``optim``: the ViT fine-tuning recipe (ds_seg/engine/param_groups.py); the optimizer and LR
    schedule themselves are the DeepSpeed JSON's."""
    KEY = 'optim'
    layer_decay: Optional[float] = setting(
        None, 'e.g. 0.75: ViT block i of L trains at lr * decay ** (L - i), embeddings and tokens at '
              'decay ** (L + 1), the heads at lr',
        (_is_layer_decay, 'None or a number in (0, 1], e.g. 0.75'))
    paramwise: ParamwiseSection = setting(
        ParamwiseSection(), 'per-parameter-group settings (no_weight_decay, backbone_lr_mult, freeze_backbone)',
        (lambda v: isinstance(v, ParamwiseSection), 'a dict of no_weight_decay, backbone_lr_mult and freeze_backbone'))

    def __post_init__(self):
        if isinstance(self.paramwise, dict):  # from a config: the nested section as a dict
            object.__setattr__(self, 'paramwise', ParamwiseSection(**self.paramwise))
        super().__post_init__()


@dataclass(frozen=True)
class LogSection(_Section):
    """``log``: experiment trackers (ds_seg/trackers.py), rank 0 only."""
    KEY = 'log'
    trackers: List[str] = setting(
        ['tensorboard'], "any of 'tensorboard', 'mlflow', 'wandb': same scalars, config, summary",
        (lambda v: isinstance(v, (list, tuple)) and all(t in TRACKERS for t in v),
         "a list drawn from 'tensorboard', 'mlflow', 'wandb'"))
    mlflow_tracking_uri: Optional[str] = setting(
        None, "e.g. 'file:///scratch/mlruns' or a server URL (None: <work_dir>/mlruns)",
        (_optional_path, 'None or a tracking URI'))
    experiment: Optional[str] = setting(None, "MLflow experiment name (None: 'ds_seg')",
                                        (_optional_path, 'None or an experiment name'))
    wandb_project: Optional[str] = setting(None, "W&B project (None: 'ds_seg'); WANDB_MODE=offline needs no network",
                                           (_optional_path, 'None or a W&B project name'))


@dataclass(frozen=True)
class ExperimentSection(_Section):
    """The top-level keys that are not sections."""
    load_from: Optional[str] = setting(None, 'plain weights file (launch/export.py) to start from',
                                       (_optional_path, 'None or the path of a weights file from launch/export.py'))
    work_dir: Optional[str] = setting(None, 'where the run writes everything (None: work_dirs/<config name>)',
                                      (_optional_path, 'None or a directory path'))
    custom_imports: Optional[dict] = setting(
        None, "your modules that register models or datasets, imported first (as mmengine's): "
              "dict(imports=['my_models'], allow_failed_imports=False)",
        (lambda v: v is None or (isinstance(v, dict) and set(v) <= {'imports', 'allow_failed_imports'}
                                 and isinstance(v.get('imports'), (list, tuple))
                                 and all(isinstance(m, str) and m for m in v['imports'])
                                 and isinstance(v.get('allow_failed_imports', False), bool)),
         "None or dict(imports=['module', ...], allow_failed_imports=False)"))

    def __post_init__(self):
        super().__post_init__()
        # A folder or a run's pointer is never a weights file. A missing file is refused by the
        # trainer, where the run reads it (load_from_refusal): a resumed run never does.
        refusal = self.load_from and (os.path.exists(self.load_from) or '://' in self.load_from) and \
            load_from_refusal(self.load_from)
        if refusal:
            raise ConfigError(refusal)


def load_from_refusal(path):
    """Why ``load_from=path`` cannot be read, or None. The trainer checks a missing file where
    the run reads it: a resumed run takes every weight from its checkpoint and never reads
    load_from (a requeued job whose file was purged from scratch was refused although it needed
    nothing of it)."""
    if '://' in path:  # as model.pretrained says of one
        return f"load_from={path!r} is a URL; download the file and give its path."
    if os.path.isdir(path):
        import glob
        found = sorted(glob.glob(os.path.join(glob.escape(path), 'weights_*.pt')))
        example = f", e.g. {found[-1]!r}" if found else ''
        return (f"load_from={path!r} is a folder; give the weights file written by launch/export.py (<work "
                f"dir>/weights_<step>.pt{example}); to continue a run use --resume.")
    if not os.path.isfile(path):
        return f"load_from={path!r} does not exist; give a weights file written by launch/export.py."
    if os.path.basename(path) in ('latest', 'best'):
        from ds_seg.engine.checkpoint import is_pointer_file
        if is_pointer_file(path):  # a checkpoints folder's pointer, as for a folder above
            return (f"load_from={path!r} names a checkpoint of a run, not a weights file; export it first "
                    f"(launch/export.py {path} --out weights.pt) and give that file; to continue the run use --resume.")
    return None


# Checked in this order; the first refusal is the one reported.
SECTIONS = (TrainSection, DataSection, OptimSection, LogSection, ExperimentSection)

# Settings that act only beside another one: (key, the one it needs, its value there, what to set).
NEEDS = (('train.compile_mode', 'train.compile', True, 'train.compile=True'),
         ('log.mlflow_tracking_uri', 'log.trackers', 'mlflow', "'mlflow' in log.trackers"),
         ('log.experiment', 'log.trackers', 'mlflow', "'mlflow' in log.trackers"),
         ('log.wandb_project', 'log.trackers', 'wandb', "'wandb' in log.trackers"))


def unused_settings(cfg):
    """One line per setting of ``cfg`` that does nothing in this run because the setting it acts
    through is off (train.compile_mode without train.compile, log.experiment without MLflow):
    they were dropped without a word, and the user looked for a compiled run, or a run in a store
    nothing wrote to. Said at the start of training, not refused: turning the other one off from
    the command line (train.compile=False) is how a config's setting is overridden."""
    cfg = cfg.to_dict() if isinstance(cfg, Config) else cfg
    lines = []
    for key, needs, value, what in NEEDS:
        given, default = _get(cfg, key), _get(DEFAULTS, key)
        other = _get(cfg, needs)
        on = value in (other or ()) if isinstance(value, str) else other == value
        if given is not None and given != default and not on:
            lines.append(f'{key}={given!r} is not used: it takes effect only with {what}')
    return lines

# The embedded default experiment: a small UNet on synthetic aerial scenes. Every key a config
# may set appears here; config files and --cfg-options override these values. The registry
# sections are plain dicts (their keys are the built class's arguments); the rest comes from
# the sections above.
DEFAULTS = dict(
    model=dict(type='UNet', base_channels=16, depth=4),  # in_channels, num_classes: the data's
    loss=dict(type='CrossEntropyLoss', ignore_index=255),
    data=dict(
        train=dict(type='SyntheticAerial', split='train'),
        val=dict(type='SyntheticAerial', split='val'),
        **asdict(DataSection()),
    ),
    train=asdict(TrainSection()),
    optim=asdict(OptimSection()),
    log=asdict(LogSection()),
    **asdict(ExperimentSection()),
)

# Sections whose dicts are built from a registry: their keys are the class's arguments, checked
# when the object is built, and a different ``type`` in a config replaces the whole dict.
_REGISTRY_SECTIONS = {'model', 'loss', 'data.train', 'data.val'}


DELETE_KEY = '_delete_'  # mmengine's marker: this dict replaces the default instead of merging into it

# Where settings that mmsegmentation or plain PyTorch users look for in the config live in ds_seg:
# the optimizer, its schedule, precision and batch size belong to the DeepSpeed JSON, so that
# one file decides them for the engine that applies them.
_DS_JSON = "in the DeepSpeed JSON (--deepspeed_config; copy one of ds_configs/ and edit it)"
_SET_ELSEWHERE = {
    **dict.fromkeys(('lr', 'learning_rate', 'weight_decay', 'betas', 'momentum', 'eps'),
                    "the optimizer's {key} is set " + _DS_JSON + ": optimizer.params.{key}"),
    **dict.fromkeys(('optimizer', 'optim_wrapper', 'optimizer_config'),
                    "the optimizer is set " + _DS_JSON + ": its 'optimizer' block"),
    **dict.fromkeys(('scheduler', 'param_scheduler', 'lr_config', 'lr_scheduler'),
                    "the learning-rate schedule is set " + _DS_JSON + ": its 'scheduler' block"),
    **dict.fromkeys(('fp16', 'bf16', 'amp', 'precision', 'mixed_precision'),
                    "precision is set " + _DS_JSON + ": its 'fp16' or 'bf16' block (ds_configs/*_bf16.json)"),
    **dict.fromkeys(('batch_size', 'samples_per_gpu', 'train_batch_size', 'train_micro_batch_size_per_gpu',
                     'gradient_accumulation_steps', 'accumulative_counts'),
                    "the batch is set " + _DS_JSON + ": train_micro_batch_size_per_gpu and "
                    "gradient_accumulation_steps"),
    **dict.fromkeys(('grad_clip', 'clip_grad', 'gradient_clipping'),
                    "gradient clipping is set " + _DS_JSON + ": gradient_clipping"),
    'zero_optimization': "ZeRO is set " + _DS_JSON + ": its 'zero_optimization' block",
    **dict.fromkeys(('max_iters', 'total_steps', 'max_epochs'), "the run's length is train.max_steps"),
    'val_interval': "the evaluation interval is train.eval_interval",
    'train_cfg': "the loop's settings are in 'train' (train.max_steps, train.eval_interval...)",
    **dict.fromkeys(('resume', 'resume_from', 'auto_resume'),
                    "a run is continued by the command's --resume auto (or --resume <checkpoint>)"),
}


def _without_delete(value):
    if isinstance(value, dict):
        return {k: _without_delete(v) for k, v in value.items() if k != DELETE_KEY}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_delete(v) for v in value)
    return copy.deepcopy(value)


def _replaces(path, value, old):
    """Whether section ``value`` at ``path`` replaces ``old`` instead of merging into it: a
    registry section of another ``type`` (against the defaults and along ``_base_`` alike). A base
    section that names no type holds settings for whatever type the section gets (the shipped
    recipe's ``cat_max_ratio`` and ``transforms``, the dataset named by the config inheriting it):
    merged, not replaced; replaced, every benchmark config lost its recipe without a word."""
    return (path in _REGISTRY_SECTIONS and isinstance(value, dict) and isinstance(old, dict)
            and old.get('type') is not None and value.get('type', old.get('type')) != old.get('type'))


def _merge(base, override, prefix=''):
    out = copy.deepcopy(base)
    for key, value in override.items():
        path = f'{prefix}{key}'
        if key == DELETE_KEY:  # _delete_=False: merge, as without it
            continue
        if isinstance(value, dict) and value.get(DELETE_KEY):
            out[key] = _without_delete(value)
        elif _replaces(path, value, out.get(key)):
            out[key] = _without_delete(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and path not in ('load_from',):
            out[key] = _merge(out[key], value, prefix=f'{path}.')
        elif isinstance(value, dict) and isinstance(out.get(key), (list, tuple)) and value \
                and all(str(k).isdigit() for k in value):
            out[key] = _merge_into_list(out[key], value, path)
        elif isinstance(value, dict) and out.get(key) is not None and not isinstance(out[key], dict) \
                and path != 'load_from':
            # 'train = 5' in a file, then train.max_steps=4: the keys would replace the section,
            # its other keys gone (a KeyError traceback later)
            inner = next((k for k in value if k != DELETE_KEY), '...')
            if isinstance(out[key], (list, tuple)):
                raise ConfigError(f"{path}.{inner} sets a key inside {path}, which is a list there "
                                  f"({out[key]!r}); give the whole list ({path}=[...]), or one item by its "
                                  f"index ({path}.0.{inner}=...).")
            raise ConfigError(f"{path}.{inner} sets a key inside {path}, which is {out[key]!r} there; "
                              f"give {path} as a dict of its keys.")
        else:
            out[key] = _without_delete(value)
    return out


def _merge_into_list(items, by_index, path):
    """``data.train.transforms.0.prob=0.5``: mmengine's list keys, an item of a list set by its
    index (merged where the item and the value are both dicts of one ``type``, else replaced:
    a transform of another type keeps none of the old one's settings)."""
    out = list(copy.deepcopy(items))
    for index, value in by_index.items():
        i = int(index)
        if i >= len(out):
            raise ConfigError(f"{path}.{index}: {path} has {len(out)} item(s) (indices 0 to {len(out) - 1}); give "
                              f"an index below {len(out)}, or the whole list ({path}=[...]).")
        if isinstance(value, dict) and isinstance(out[i], dict) and not value.get(DELETE_KEY) \
                and value.get('type', out[i].get('type')) == out[i].get('type'):
            out[i] = _merge(out[i], value, prefix=f'{path}.{index}.')
        else:
            out[i] = _without_delete(value)
    return type(items)(out) if isinstance(items, tuple) else out


def _check_keys(cfg, defaults, source, prefix=''):
    for key, value in cfg.items():
        path = f'{prefix}{key}'
        if key == DELETE_KEY:  # registry sections (model, loss, data.train...) are not walked here
            raise ConfigError(f"{source}: {path!r}: only a section with a 'type' "
                              f"({', '.join(sorted(_REGISTRY_SECTIONS))}) can be replaced with _delete_=True; "
                              f"in {prefix.rstrip('.') or 'the top level'} give only the keys to change.")
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else ''
            if key in _SET_ELSEWHERE:
                hint = f" In ds_seg {_SET_ELSEWHERE[key].format(key=key)}."
            elif not prefix and source != '--cfg-options':
                hint += f" (A helper variable of the file: begin its name with '_', as in _{key} = ...)"
            raise ConfigError(f"{source}: unknown key {path!r}.{hint} "
                              f"Known keys here: {', '.join(prefix + k for k in defaults)}.")
        if path in _REGISTRY_SECTIONS:
            if not isinstance(value, dict) and not (path == 'data.val' and value is None):  # None: no eval
                raise ConfigError(f"{source}: {path!r} must be a dict with a 'type' key, got {value!r}.")
        elif isinstance(value, dict) and isinstance(defaults[key], dict):
            _check_keys(value, defaults[key], source, prefix=f'{path}.')


def _option_value(raw):
    """A Python literal (``dict(k=v, ...)`` as in config files included), true/false/none/null,
    or the string itself."""
    import ast
    try:
        return _literal(ast.parse(raw.strip(), mode='eval').body)
    except (ValueError, SyntaxError):
        return {'true': True, 'false': False, 'none': None, 'null': None}.get(raw.lower(), raw)


def _literal(node):
    """``ast.literal_eval`` of a node, where ``dict(type='UperNet', ...)`` of literals also reads
    as the dict it builds: model=dict(...) was split at its commas into a list of strings."""
    import ast
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'dict' \
            and not node.args and all(k.arg for k in node.keywords):
        return {k.arg: _literal(k.value) for k in node.keywords}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_cfg_options(options):
    """Turn ``['a.b=1', 'c=[1,2]', 'd=x,y']`` into a nested dict; values are Python literals or
    strings, and unbracketed commas make a list of them (``d=x,y`` -> ``['x', 'y']``), as
    mmengine's ``--cfg-options`` reads them."""
    nested = {}
    for item in options or []:
        if '=' not in item:
            raise ConfigError(f"--cfg-options: {item!r} is not of the form key=value.")
        key, raw = item.split('=', 1)
        value = _option_value(raw)
        if isinstance(value, str) and raw.strip()[:1] + raw.strip()[-1:] in ('[]', '()'):
            value = _unquoted_iterable(raw.strip())  # [B04,B03]: no quotes, as a shell leaves it
        elif isinstance(value, str) and ',' in raw and not raw.strip().startswith(('[', '(', '{', '"', "'")):
            value = [_option_value(part) for part in raw.split(',')]
        node = nested
        parts = key.split('.')
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # 'train=1 train.max_steps=2': a value, then a key inside it
                raise ConfigError(f"--cfg-options: {item!r} sets a key inside {'.'.join(parts[:i + 1])}, which "
                                  f"an earlier option set to {node!r}; give one or the other.")
        node[parts[-1]] = _later_option(node.get(parts[-1]), value)
    return nested


def option_keys(options):
    """Every dotted key ``--cfg-options`` set, a section given as a dict walked into
    (``train=dict(max_steps=1)`` sets ``train.max_steps``); a section set to a value is its own
    key. Options that do not parse give none (loading them says why)."""
    try:
        return list(dotted(parse_cfg_options(options)))
    except ConfigError:
        return []


def dotted(settings, prefix=''):
    """``{'paramwise': {'backbone_lr_mult': 0.1}}`` as ``{'paramwise.backbone_lr_mult': 0.1}``
    (an empty section is a value of its own)."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(dotted(value, f'{prefix}{key}.'))
        else:
            flat[f'{prefix}{key}'] = value
    return flat


def _unquoted_iterable(raw):
    """``[a,b]`` / ``(a,[b,c])`` of unquoted words as mmengine's ``--cfg-options`` reads them: a
    list (tuple) of the items between top-level commas (not inside quotes), each a literal, a
    word or such a list. Unbalanced brackets are refused, as mmengine does: a typo dropped items."""
    inner, items, start, quote = raw[1:-1], [], 0, None
    pairs = {']': '[', ')': '('}
    opened = []
    for i, ch in enumerate(inner + ','):
        if quote:
            quote = None if ch == quote else quote
        elif ch in '\'"':
            quote = ch
        elif ch in '[(':
            opened.append(ch)
        elif ch in '])':
            if not opened or opened.pop() != pairs[ch]:
                raise ConfigError(f"--cfg-options: {raw} has unbalanced brackets; check the value")
        elif ch == ',' and not opened:
            part = inner[start:i].strip()
            if part:
                value = _option_value(part)
                nested = isinstance(value, str) and part[:1] + part[-1:] in ('[]', '()')
                items.append(_unquoted_iterable(part) if nested else value)
            start = i + 1
    if opened or quote:
        raise ConfigError(f"--cfg-options: {raw} has unbalanced brackets or quotes; check the value")
    return items if raw[0] == '[' else tuple(items)


def _later_option(earlier, later):
    """An option's value after an earlier option set the same key. A dict given after keys set
    inside it keeps them, the later winning on a key ('train.seed=2 train=dict(max_steps=5)' lost
    the seed), unless it names another ``type``: then it is another thing, whole."""
    if not (isinstance(earlier, dict) and isinstance(later, dict)) or later.get('type', earlier.get('type')) != \
            earlier.get('type'):
        return later
    merged = dict(earlier)
    for key, value in later.items():
        merged[key] = _later_option(earlier.get(key), value)
    return merged


def _not_a_file(path, kind):
    """Why ``path`` (not a readable file) cannot be read, as the end of a sentence."""
    if path.is_dir():
        return f'is a folder, not a {kind}'
    if os.path.islink(path) and not path.exists():  # a symlink loop or one to a missing file was "does not exist"
        return 'is a link that leads to no file (a missing target, or a loop)'
    if path.exists():  # a pipe (<(...)), a device
        return f'is not a regular file (a pipe?); give a {kind} (.py, .json or .yaml)'
    return 'does not exist'


def _shipped_base_hint(path, exc):
    """For a shipped config copied out without the ``_base_`` files it inherits from (the copy-out
    recipe of the README): where they are."""
    missing = getattr(exc, 'filename', None)
    if not isinstance(exc, FileNotFoundError) or not missing:
        return ''
    try:
        relative = os.path.relpath(os.path.abspath(missing), os.path.dirname(os.path.abspath(path)))
    except ValueError:
        return ''
    if relative.startswith('..') or not (CONFIGS_DIR / relative).is_file():
        return ''
    top = relative.split(os.sep)[0]
    return (f"; it inherits the shipped {relative}: copy it beside the config, keeping files of yours "
            f"(cp -rn {CONFIGS_DIR / top} {os.path.dirname(os.path.abspath(path))}/)")


# mmengine replaces {{_base_.a.b}} with the placeholder '_a.b_<6 hex digits>' while it runs the
# file, and the placeholder with the base's value afterwards, only where it is a whole value.
_BASE_PLACEHOLDER = re.compile(r'_((?:[A-Za-z_]\w*?\.)*?[A-Za-z_]\w*?)_[0-9a-f]{6}')


def _refuse_base_reference_in_expression(loaded, path, prefix=''):
    """``max_steps={{_base_.train.max_steps}} * 2`` ran with the placeholder string itself
    ('_train.max_steps_324720_train.max_steps_324720': the string doubled), refused later as
    "must be a positive integer, got '_train.max_steps_...'"."""
    for key, value in (loaded.items() if isinstance(loaded, dict) else enumerate(loaded)):
        where = f'{prefix}{key}'
        if isinstance(value, (dict, list, tuple)):
            _refuse_base_reference_in_expression(value, path, f'{where}.')
        elif isinstance(value, str):
            # The placeholder repeated (the string multiplied): a name that only looks like one
            # ('roads_tile_abc123.tif') is not a placeholder over and over.
            found = _BASE_PLACEHOLDER.match(value)
            if found and value != found.group(0) and value.replace(found.group(0), '') == '':
                raise ConfigError(f"{path}: {where}: {{{{_base_.{found.group(1)}}}}} is used inside an expression; "
                                  "mmengine gives a base's value only as a whole value (key = {{_base_.x}}): write "
                                  "the value itself, or a new-style config (read_base()) that computes it in Python.")


def load_config(path=None, cfg_options=None):
    """Load an experiment config: defaults <- file <- ``--cfg-options``; return an mmengine Config.

    Python config files are executed (like any mmengine config); JSON and YAML files are only
    parsed. ``path=None`` gives the embedded default experiment.
    """
    cfg = copy.deepcopy(DEFAULTS)
    name = 'default'
    loaded = {}
    if path is not None:
        given, path = str(path), find_shipped(path, CONFIGS_DIR, '.py')
        if not path.is_file():
            candidates = sorted(p.name for p in CONFIGS_DIR.glob('*.py'))
            what = _not_a_file(path, 'config file')
            raise ConfigError(f"--config: {_as_given(given, path)} {what}. Configs shipped in configs/: "
                              f"{', '.join(candidates) or 'none'}.")
        _check_inherited(path)
        try:
            with _yaml_parsed_safely(), _chain_merged_by_ds_seg_rules():
                # custom_imports: imported by ds_seg below, with its one-line refusal
                loaded = Config.fromfile(str(path), import_custom_modules=False).to_dict()
        except RecursionError as exc:  # mmengine follows _base_ without noticing a cycle
            raise ConfigError(f"{path}: cannot be loaded: its _base_ files inherit from each other "
                              f"(a cycle); break it") from exc
        except SystemExit as exc:  # sys.exit()/exit() in a config ended the run, its status the config's
            raise ConfigError(f"{path}: cannot be loaded: it calls sys.exit({exc.code!r}); a config only sets "
                              "values: remove the call") from exc
        except Exception as exc:  # syntax errors, bad _base_ paths...
            # mmengine's lazy imports end a config that calls an imported function (np.int64(4),
            # math.floor(4.5)) with a bare RuntimeError(): nothing after the colon.
            # A YAML parser's message spans 4 lines (what, where, what was found, where): one here.
            detail = ' '.join(str(exc).split()) or (
                f"{type(exc).__name__} without a message; a config that calls a function of an imported module "
                "needs that call replaced by its value (mmengine imports modules lazily in configs)")
            raise ConfigError(f"{path}: cannot be loaded: {detail}{_shipped_base_hint(path, exc)}") from exc
        _refuse_base_reference_in_expression(loaded, path)
        # Top-level names that begin with '_' are the file's own helper variables
        # (_crop = 512, then crop_size=_crop), not settings: every other name must be a key.
        loaded = {k: v for k, v in loaded.items() if not k.startswith('_') or k == DELETE_KEY}
        # A run's config.json (the resolved config) names the config it came from: given back as
        # --config (to evaluate or retrain that run), it keeps that name, and so work_dirs/<name>.
        recorded_name = loaded.pop('config_name', None)
        if recorded_name is not None and (not isinstance(recorded_name, str) or not recorded_name.strip()
                                          or os.path.basename(recorded_name) != recorded_name
                                          or recorded_name in ('.', '..')):
            # It names work_dirs/<config_name>: '../../x' put the default work dir anywhere.
            raise ConfigError(f"{path}: config_name {recorded_name!r} must be a plain name (no folders); it names "
                              "the default work dir work_dirs/<config_name>")
        if recorded_name is not None:
            # A run's resolved config holds every key of its sections: they replace the defaults'
            # whole. Merged, a section trained with _delete_ got the defaults back (another model).
            for section in _REGISTRY_SECTIONS:
                parent, _, key = section.rpartition('.')
                holder = loaded.get(parent) if parent else loaded
                if isinstance(holder, dict) and isinstance(holder.get(key), dict):
                    holder[key] = {**holder[key], DELETE_KEY: True}
        ds_keys = [k for k in loaded if k in DS_TOP_LEVEL_KEYS and k not in DEFAULTS]
        if len(ds_keys) >= 2 or 'zero_optimization' in ds_keys or 'train_micro_batch_size_per_gpu' in ds_keys:
            # --config and --deepspeed_config swapped: "unknown key 'train_micro_batch_size_per_gpu'".
            raise ConfigError(f"--config: {path} is a DeepSpeed JSON (it sets {', '.join(ds_keys[:3])}); give it as "
                              "--deepspeed_config, and the experiment config (configs/*.py) as --config")
        _check_keys(loaded, DEFAULTS, str(path))
        try:
            cfg = _merge(cfg, loaded)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        name = str(recorded_name) if recorded_name else path.stem
    from_file = cfg = _expand_user(cfg)
    options = parse_cfg_options(cfg_options)
    _check_keys(options, DEFAULTS, '--cfg-options')
    try:
        cfg = _expand_user(_merge(cfg, options))
    except ConfigError as exc:
        raise ConfigError(f"--cfg-options: {exc}" + (f' (the value set by {path})' if path else '')) from None
    if _default_val_left_beside_own_train(cfg, loaded, options):
        # The embedded default's validation set is its synthetic demo scenes: beside a config's
        # own training data it validated on them (eval.jsonl, best, evaluate.py) without a word.
        cfg['data']['val'] = None
    try:
        _check_values(cfg)
    except ConfigError as exc:
        # Name where the bad value came from: the option, unless the file alone is refused alike.
        try:
            _check_values(from_file)
            source = '--cfg-options'
        except ConfigError as without_options:
            source = (str(path) if path else 'default config') if str(without_options) == str(exc) \
                else '--cfg-options'
        raise ConfigError(f'{source}: {exc}') from None
    if cfg.get('custom_imports'):
        from .registry import import_custom_modules   # (registry imports this module)
        custom = cfg['custom_imports']
        import_custom_modules(custom['imports'], allow_failed=custom.get('allow_failed_imports', False))
    cfg['config_name'] = name
    return Config(cfg)


def _default_val_left_beside_own_train(cfg, *given):
    """True when ``data.train`` is no longer the default's kind of dataset and neither the file
    nor the options (``given``) set ``data.val``: it is still the default's synthetic one."""
    default = DEFAULTS['data']
    if (cfg['data'].get('train') or {}).get('type') == default['train']['type']:
        return False
    return not any(isinstance(g.get('data'), dict) and 'val' in g['data'] for g in given) \
        and cfg['data'].get('val') == default['val']


# The data sections' keys that hold local paths (a glob, a file, a folder, lists of them).
DATA_PATH_KEYS = ('images', 'labels', 'data_root', 'cache_dir', 'stac')


def with_absolute_data_paths(cfg_dict):
    """A copy of a resolved config whose relative local data paths (``DATA_PATH_KEYS`` of the
    ``data`` sections) are made absolute against the current folder: what a run's
    config.json records. Relative there, evaluate.py (which evaluates the run's config.json by
    default) read them against the folder it was started in, and found nothing from any other.
    URLs and GDAL's /vsi* names are kept."""
    def absolute(value):
        if isinstance(value, str) and value and '://' not in value and not value.startswith('/vsi'):
            return os.path.abspath(os.path.expanduser(value))
        if isinstance(value, (list, tuple)):
            return type(value)(absolute(item) for item in value)
        return value
    out = copy.deepcopy(cfg_dict)
    for section in (out.get('data') or {}).values():
        if isinstance(section, dict):
            for key in DATA_PATH_KEYS:
                if section.get(key) is not None:
                    section[key] = absolute(section[key])
    return out


def _expand_user(cfg):
    """A config is not a shell: work_dir='~/runs/x' created a folder named '~' in the current
    directory (one `rm -rf ~` away from the home directory) and load_from='~/w.pt' was missing;
    work_dir='$SCRATCH/runs/x' a folder named '$SCRATCH'. Both are expanded as a shell would; a
    variable that is not set is refused (its folder would be created in the current directory)."""
    for key in ('work_dir', 'load_from'):
        if isinstance(cfg.get(key), str):
            cfg[key] = _as_shell_expands(key, cfg[key])
    log = cfg.get('log')
    uri = log.get('mlflow_tracking_uri') if isinstance(log, dict) else None
    if isinstance(uri, str) and uri.strip() == uri != '' and ':' not in uri and uri not in ('databricks', 'databricks-uc', 'uc'):
        # A plain folder, as MLflow takes one: relative, it followed the folder the command ran in,
        # and a resume started elsewhere opened a second store. Made absolute once, as data paths are.
        log['mlflow_tracking_uri'] = os.path.abspath(_as_shell_expands('log.mlflow_tracking_uri', uri))
    return cfg


def _as_shell_expands(key, path):
    """``path`` with ``~`` and set ``$VAR``/``${VAR}`` expanded; an unset variable is refused."""
    expanded = os.path.expandvars(os.path.expanduser(path))
    unset = re.search(r'\$(\{[A-Za-z_]\w*\}|[A-Za-z_]\w*)', expanded)
    if unset:
        raise ConfigError(f"{key}={path!r}: ${unset.group(1).strip('{}')} is not set in this environment; "
                          "set it, or write the path out")
    return expanded


def _get(cfg, path):
    node = cfg
    for part in path.split('.'):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _check_values(cfg):
    """Every registry section has a type and every typed section's keys pass their rules; the
    message names the key (load_config adds the file or option it came from)."""
    for path in sorted(_REGISTRY_SECTIONS):
        node = _get(cfg, path)
        if node is not None and 'type' not in node:
            raise ConfigError(f"{path!r} must be a dict with a 'type' key, got {node!r}.")
    for section in SECTIONS:
        section.from_cfg(cfg)


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

# Top-level blocks DeepSpeed reads as objects (dicts or pydantic models): any other JSON value
# there is refused in one line.
_DS_OBJECT_BLOCKS = {
    'optimizer', 'scheduler', 'fp16', 'bf16', 'bfloat16', 'torch_autocast', 'data_types', 'zero_optimization',
    'flops_profiler', 'tensorboard', 'wandb', 'csv_monitor', 'comet', 'comms_logger', 'activation_checkpointing',
    'aio', 'checkpoint', 'autotuning', 'data_efficiency', 'pipeline', 'compile', 'timers', 'zenflow',
}

def _schedule_default(kind, param):
    """The default of ``param`` in DeepSpeed's scheduler class ``kind`` (read from its signature,
    so a DeepSpeed that changes it is followed): WarmupLR warms up over 1000 steps, WarmupDecayLR
    peaks at 0.001."""
    import inspect

    from deepspeed.runtime import lr_schedules
    return inspect.signature(getattr(lr_schedules, kind).__init__).parameters[param].default

# Schedulers whose length we fill from train.max_steps when the JSON leaves it out.
_SCHEDULERS_WITH_TOTAL = {'WarmupDecayLR', 'WarmupCosineLR'}


def load_ds_config(path):
    """Read a DeepSpeed JSON file and check it (see :func:`check_ds_config`)."""
    given, path = str(path), find_shipped(path, DS_CONFIGS_DIR, '.json')
    if not path.exists() or path.is_dir():  # a pipe (<(...)) is read as a file is
        shipped = sorted(p.stem for p in DS_CONFIGS_DIR.glob('*.json'))
        raise ConfigError(f"--deepspeed_config: {_as_given(given, path)} {_not_a_file(path, 'DeepSpeed JSON')}. "
                          f"Shipped: {', '.join(shipped)}.")
    try:
        ds = json.loads(path.read_text(), object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as exc:
        if path.suffix in ('.py', '.yaml', '.yml'):   # --config and --deepspeed_config swapped
            raise ConfigError(f"--deepspeed_config: {path} is an experiment config ({path.suffix}), not a DeepSpeed "
                              "JSON; give it as --config, and a DeepSpeed JSON (ds_configs/*.json) as "
                              "--deepspeed_config") from exc
        raise ConfigError(f"{path}: not valid JSON ({exc}).") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file ({exc.reason} at byte {exc.start}); give a DeepSpeed JSON.") from exc
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: key {exc.args[0]!r} is given twice in one object (JSON keeps only the last, "
                          "DeepSpeed refuses it); keep one.") from exc
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object.")
    check_ds_config(ds, str(path))
    return ds


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _is_auto(value):
    return isinstance(value, str) and value.strip().lower() == 'auto'


def _find_value(node, prefix='', match=_is_auto):
    """The dotted path of the first value in ``node`` that ``match`` accepts (``"auto"``), or None."""
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find_value(value, f'{prefix}.{key}' if prefix else key, match)
            if found:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found = _find_value(value, f'{prefix}[{i}]', match)
            if found:
                return found
    elif match(node):
        return prefix
    return None


def _is_nonfinite(value):
    return isinstance(value, float) and not math.isfinite(value)


def check_ds_config(ds, source='DeepSpeed config'):
    """Refuse what DeepSpeed would silently misread: unknown top-level keys and ``"auto"``."""
    if isinstance(ds.get('ds_seg'), dict) and {'backend', 'precision', 'world_size'} <= set(ds['ds_seg']):
        raise ConfigError(f"{source}: is the record a run wrote of the DeepSpeed config it used (its 'ds_seg' block "
                          "says how it ran: resolved for its world size and device); give the JSON that run was "
                          "started with (e.g. ds_configs/zero2.json), or remove the 'ds_seg' block to start from "
                          "this one.")
    experiment = [key for key in ('model', 'data', 'train', 'optim', 'loss', '_base_') if key in ds]
    if experiment and not any(key in DS_TOP_LEVEL_KEYS for key in ds):
        # An experiment config in JSON (the .py and .yaml ones get this line where they are read).
        raise ConfigError(f"{source}: is an experiment config (it sets {', '.join(experiment)}), not a DeepSpeed "
                          "JSON; give it as --config, and a DeepSpeed JSON (ds_configs/*.json) as --deepspeed_config.")
    for key in ds:
        if key not in DS_TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(key, sorted(DS_TOP_LEVEL_KEYS), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ''
            raise ConfigError(f"{source}: unknown top-level key {key!r}.{hint} "
                              "DeepSpeed would silently ignore it; fix or remove it.")
    auto = _find_value(ds)
    if auto:
        raise ConfigError(f"{source}: {auto!r} is \"auto\". \"auto\" is a Hugging Face convention, not a "
                          "DeepSpeed one (DeepSpeed replaces it by a default or crashes): give a value.")
    # Python's JSON reader takes Infinity, NaN and 1e999 (inf), which no JSON standard has: an
    # "lr": Infinity passed every check and turned the weights to NaN at the first step.
    nonfinite = _find_value(ds, match=_is_nonfinite)
    if nonfinite:
        value = _get(ds, nonfinite) if '[' not in nonfinite else None
        raise ConfigError(f"{source}: {nonfinite!r} is {json.dumps(value) if value is not None else 'not finite'}; "
                          "give a finite number.")
    for key in sorted(_DS_OBJECT_BLOCKS & set(ds)):
        if not isinstance(ds[key], dict):
            # "scheduler": null to mean "no scheduler" crashed (bf16: null with a traceback) or
            # drew DeepSpeed's "'NoneType' object has no attribute 'keys'".
            what = ('give one such as {"type": "AdamW", "params": {"lr": 0.001}}' if key == 'optimizer'
                    else f'remove the key to leave {key} out')
            raise ConfigError(f"{source}: {key!r} must be an object ({{...}}), got {json.dumps(ds[key])}; {what}.")
    if 'bf16' in ds and 'bfloat16' in ds:
        # DeepSpeed reads 'bf16' and ignores 'bfloat16' (its old name) when both are there.
        raise ConfigError(f"{source}: both 'bf16' and its old name 'bfloat16' are given; keep only 'bf16'.")
    _check_torch_autocast(ds.get('torch_autocast'), source)
    _check_block_keys(ds, source)
    for key in ('train_batch_size', 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps'):
        if key in ds and (not isinstance(ds[key], int) or isinstance(ds[key], bool) or ds[key] < 1):
            raise ConfigError(f"{source}: {key!r} must be a positive integer, got {ds[key]!r}.")
    _check_ds_values(ds, source)


def _check_torch_autocast(block, source):
    """DeepSpeed reads the torch_autocast block as a plain dict and takes "enabled" by truth
    value: "enabled": "false" would turn autocast on (and ds_seg would record it as on)."""
    if block is None:
        return
    rules = {'enabled': (lambda v: isinstance(v, bool), 'true or false'),
             'dtype': (lambda v: isinstance(v, str), 'a string such as "bfloat16" or "float16"'),
             'lower_precision_safe_modules': (lambda v: isinstance(v, list) and all(isinstance(m, str) for m in v),
                                              'a list of module class names (strings)')}
    for key, (check, what) in rules.items():
        if key in block and not check(block[key]):
            hint = ' (write it without quotes)' if key == 'enabled' and isinstance(block[key], str) else ''
            raise ConfigError(f"{source}: 'torch_autocast.{key}' must be {what}, got {json.dumps(block[key])}{hint}.")


def _constants(module, *prefixes, names=()):
    """String values of the constants of DeepSpeed's ``module`` named ``prefix...`` (not the
    ``..._DEFAULT``/``..._FORMAT``/``..._MODES`` ones) and of ``names``: the keys DeepSpeed reads."""
    import importlib
    mod = importlib.import_module(module)
    keys = {getattr(mod, n) for n in names}
    if prefixes:
        keys |= {v for n, v in vars(mod).items() if isinstance(v, str) and n.isupper() and n.startswith(prefixes)
                 and not n.endswith(('_DEFAULT', '_FORMAT', '_MODES'))}
    return keys


def _block_keys():
    """Top-level block -> the keys DeepSpeed reads in it, taken from DeepSpeed's own constants
    modules and config classes, for the blocks DeepSpeed reads as plain dicts (it ignores any
    other key there). Blocks with a pydantic model are refused by that model itself."""
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.config import get_pipeline_config
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    rc = 'deepspeed.runtime.constants'
    return {
        'optimizer': _constants(rc, names=('TYPE', 'OPTIMIZER_PARAMS', 'LEGACY_FUSION')),
        'scheduler': _constants(rc, names=('TYPE', 'SCHEDULER_PARAMS')),
        'torch_autocast': _constants(rc, 'TORCH_AUTOCAST_'),
        'data_types': _constants(rc, names=('GRAD_ACCUM_DTYPE', 'PARAM_DTYPE', 'BUFFER_DTYPE', 'KEEP_IN_FP32_MODULES')),
        'checkpoint': (_constants(rc, 'CHECKPOINT_', names=('LOAD_UNIVERSAL_CHECKPOINT', 'USE_NODE_LOCAL_STORAGE_CHECKPOINT'))
                       | _constants('deepspeed.runtime.model_checkpointing.constants', 'CHECKPOINT_')) - {'checkpoint'},
        'activation_checkpointing': set(ACT_CHKPT_DEFAULT),
        'aio': _constants('deepspeed.runtime.swap_tensor.constants', 'AIO_') - {'aio'},
        'flops_profiler': _constants('deepspeed.profiling.constants', 'FLOPS_PROFILER_') - {'flops_profiler'},
        'autotuning': _constants('deepspeed.autotuning.constants', 'AUTOTUNING_', names=('MODEL_INFO',)) - {'autotuning'},
        'data_efficiency': _constants('deepspeed.runtime.data_pipeline.constants',
                                      names=('DATA_EFFICIENCY_ENABLED', 'DATA_EFFICIENCY_SEED', 'DATA_SAMPLING',
                                             'DATA_ROUTING')),
        'pipeline': set(get_pipeline_config({})),
        'timers': {'throughput'},
        'timers.throughput': _pydantic_keys(DeepSpeedThroughputTimerConfig),
        'zenflow': _pydantic_keys(ZenFlowConfig),
    }


def _pydantic_keys(model):
    return {k for n, f in model.model_fields.items() for k in (n, f.alias) if k}


def _check_block_keys(ds, source):
    """A typo inside a block DeepSpeed reads as a plain dict is one line, as at the top level."""
    known = _block_keys()
    for where, allowed in known.items():
        node = ds
        for part in where.split('.'):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        nested = [(where, node)] + ([(f'{where}.{k}', v) for k, v in node.items() if isinstance(v, dict)]
                                    if where == 'checkpoint' else [])  # checkpoint.writer, .parallel_write
        for path, block in nested:
            for key in block:
                if key not in allowed:
                    close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
                    hint = (f"Did you mean '{path}.{close[0]}'?" if close else
                            f"Known keys of '{where}': {', '.join(sorted(allowed))}.")
                    raise ConfigError(f"{source}: unknown key '{path}.{key}'. {hint} "
                                      "DeepSpeed would silently ignore it; fix or remove it.")
    _check_plain_block_flags(ds, source)
    _check_activation_checkpointing(ds.get('activation_checkpointing'), source)
    _check_features_without_effect(ds, source)


# DeepSpeed features that act through parts of DeepSpeed ds_seg does not use (its data loader,
# language-model layers): switched on, they changed nothing without a word, or failed once
# training had started. (DeepSpeed itself refuses the blocks of features it removed.)
_DS_WITHOUT_EFFECT = {
    'data_efficiency': "its data sampling works through DeepSpeed's own data loader (deepspeed_io), which ds_seg "
                       "does not use, and its random-LTD through transformer layers DeepSpeed converts",
    'dataloader_drop_last': "it sets DeepSpeed's own data loader; ds_seg's training loader always drops a last "
                            "partial batch",
    'hybrid_engine': "it is DeepSpeed's generation engine for RLHF of language models",
}


def _switched_on(value):
    """True for ``true`` itself, or a block with ``"enabled": true`` at any depth."""
    if isinstance(value, dict):
        return value.get('enabled') is True or any(_switched_on(v) for v in value.values() if isinstance(v, dict))
    return value is True


def _check_features_without_effect(ds, source):
    for key, why in _DS_WITHOUT_EFFECT.items():
        if _switched_on(ds.get(key)):
            raise ConfigError(f"{source}: '{key}' is switched on, but it has no effect in ds_seg ({why}); remove it.")
    checkpoint = ds.get('checkpoint') if isinstance(ds.get('checkpoint'), dict) else {}
    if checkpoint.get('load_universal'):
        # DeepSpeed then loads every checkpoint as a universal one: a --resume of ds_seg's own
        # checkpoints died in a traceback (ZeRO-0: no update_lp_params; ZeRO-2: no
        # zero/optimizer_state.pt), after the data and model were built.
        raise ConfigError(f"{source}: 'checkpoint.load_universal' is true, but ds_seg saves ordinary DeepSpeed "
                          "checkpoints and converts one to a universal checkpoint itself when a run resumes at "
                          "another number of ranks; remove the key.")


def _flag_keys(*modules):
    """Keys of DeepSpeed's constants modules whose ``..._DEFAULT`` is true or false: flags."""
    import importlib
    keys = set()
    for module in modules:
        mod = importlib.import_module(module)
        keys |= {v for n, v in vars(mod).items() if n.isupper() and isinstance(v, str)
                 and isinstance(getattr(mod, f'{n}_DEFAULT', None), bool)}
    return keys


def _check_plain_block_flags(ds, source):
    """Blocks DeepSpeed reads as plain dicts take a flag by its truth: "use_node_local_storage":
    "yes" (or "false") was on. Their flags must be true or false."""
    flags = _flag_keys('deepspeed.runtime.constants', 'deepspeed.runtime.model_checkpointing.constants',
                       'deepspeed.runtime.swap_tensor.constants', 'deepspeed.profiling.constants')
    for where in ('checkpoint', 'aio', 'flops_profiler'):
        block = ds.get(where)
        for key, value in (block.items() if isinstance(block, dict) else ()):
            if key in flags and not isinstance(value, bool):
                hint = ' (write it without quotes)' if isinstance(value, str) else ''
                raise ConfigError(f"{source}: '{where}.{key}' must be true or false, got "
                                  f"{json.dumps(value, default=repr)}{hint}.")


def _check_activation_checkpointing(block, source):
    """DeepSpeed's activation_checkpointing block configures ``deepspeed.checkpointing``, which
    no ds_seg model calls: settings there would change nothing. Refused unless all defaults."""
    if block is None:
        return
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    changed = sorted(k for k, v in (block.items() if isinstance(block, dict) else [('', block)])
                     if k not in ACT_CHKPT_DEFAULT or v != ACT_CHKPT_DEFAULT[k])
    msg = ("'activation_checkpointing' in the DeepSpeed JSON has no effect in ds_seg (its models do not use "
           "deepspeed.checkpointing); set activation_checkpointing=True on the model (or its backbone) in the config instead")
    if changed:
        raise ConfigError(f"{source}: {msg} and remove the block (it sets {', '.join(changed) or block!r}).")
    print(f"ds_seg: warning: {source}: {msg}; the block holds only defaults and is ignored.", file=sys.stderr)


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


def _param_defaults(where, kind):
    """Parameter name -> default of the optimizer/scheduler class ``kind`` builds (None where
    the class is not known here): which parameters are booleans by design."""
    import inspect

    import torch
    if where == 'optimizer':
        lowered = str(kind).lower()
        cls = {'adam': torch.optim.AdamW, 'adamw': torch.optim.AdamW, 'sgd': torch.optim.SGD}.get(lowered) or \
            getattr(torch.optim, str(kind), None)
        extra = {'torch_adam': False, 'adam_w_mode': True}  # read by DeepSpeed itself
    else:
        from deepspeed.runtime import lr_schedules
        cls, extra = getattr(lr_schedules, str(kind), None), {}
    if not isinstance(cls, type):
        return None
    return {**{n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()}, **extra}


# Scheduler parameters that count steps (warmup_num_steps, cycle_first_step_size...).
_STEP_COUNT_SUFFIXES = ('_steps', '_step_size', '_stair_count', 'last_batch_iteration')
# Optimizer parameters that are numbers whatever the optimizer (for classes not known here).
_NUMERIC_PARAMS = {'lr', 'eps', 'weight_decay', 'momentum', 'dampening', 'betas', 'max_coeff', 'min_coeff'}


def _check_ds_params(block, where, source):
    params = block.get('params', {})
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: '{where}.params' must be an object, got {params!r}.")
    defaults = _param_defaults(where, block.get('type'))
    for key, value in params.items():
        ok = (isinstance(value, str) if key in _DS_STRING_PARAMS else
              isinstance(value, bool) or _is_number(value) or value is None
              or (isinstance(value, list) and all(_is_number(x) for x in value)))
        if not ok:
            flag = defaults is not None and isinstance(defaults.get(key), bool)  # "amsgrad": "yes"
            hint = (' (write it without quotes)' if isinstance(value, str) and (
                _looks_numeric(value) or value.lower() in ('true', 'false')) else '')
            raise ConfigError(f"{source}: '{where}.params.{key}' must be {'true or false' if flag else 'a number'}, "
                              f"got {value!r}{hint}.")
        # true/false where a number is meant would be read as 1/0 ("lr": true trains at LR 1).
        boolean = (isinstance(defaults[key], (bool, type(None))) if defaults and key in defaults
                   else key not in _NUMERIC_PARAMS)
        if isinstance(value, bool) and not boolean:
            raise ConfigError(f"{source}: '{where}.params.{key}' must be a number, got {json.dumps(value)}.")
        if key == 'betas' and not (isinstance(value, list) and len(value) == 2 and all(0 <= b < 1 for b in value)):
            raise ConfigError(f"{source}: '{where}.params.betas' must be two numbers in [0, 1), e.g. [0.9, 0.999], "
                              f"got {value!r}.")
        if key == 'lr' and _is_number(value) and value < 0:
            raise ConfigError(f"{source}: '{where}.params.lr' must be >= 0, got {value!r}.")
        if where == 'scheduler' and key.endswith(_STEP_COUNT_SUFFIXES) and _is_number(value) \
                and not isinstance(value, int):  # "total_num_steps": 6.5 was taken as it is
            raise ConfigError(f"{source}: 'scheduler.params.{key}' counts steps: it must be an integer, got {value!r}.")
        if where == 'scheduler' and _is_number(value) and key != 'last_batch_iteration':
            # Every DeepSpeed schedule's LRs, momenta, ratios, rates and step counts are >= 0, and
            # its ratios (fractions of the optimizer's LR) <= 1: a negative one trains at a
            # negative LR without any error.
            if value < 0 or (key.endswith('_ratio') and value > 1):
                what = 'a number in [0, 1]' if key.endswith('_ratio') else 'a number >= 0'
                raise ConfigError(f"{source}: 'scheduler.params.{key}' must be {what}, got {value!r}.")


def _looks_numeric(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def _ds_scalar_rules():
    """_DS_SCALARS, plus every other top-level flag DeepSpeed reads with a true/false default
    (its constants module names each key's default), and ``log_level``, which DeepSpeed only
    parses inside ``deepspeed.initialize``."""
    import deepspeed.runtime.constants as constants
    from deepspeed.utils.logging import log_levels
    rules = dict(_DS_SCALARS)
    for name, key in vars(constants).items():
        if (name.isupper() and isinstance(key, str) and key in DS_TOP_LEVEL_KEYS and key not in rules
                and isinstance(getattr(constants, f'{name}_DEFAULT', None), bool)):
            rules[key] = (lambda v: isinstance(v, bool), 'true or false')
    rules['log_level'] = (lambda v: isinstance(v, str) and v.lower() in log_levels,
                          f"one of {', '.join(repr(k) for k in log_levels)}")
    return rules


def _check_ds_values(ds, source):
    """Check values, not only keys, before any training: our rules for what DeepSpeed takes
    unchecked, then DeepSpeed's own pydantic models (ZeRO, fp16, bf16... sub-blocks), their
    failures turned into one line naming the key and what it accepts."""
    import torch
    for key, (check, what) in _ds_scalar_rules().items():
        if key in ds and not check(ds[key]):
            raise ConfigError(f"{source}: {key!r} must be {what}, got {json.dumps(ds[key], default=repr)}.")
    optimizer = ds.get('optimizer')
    if optimizer is not None:
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
        kind = optimizer.get('type') if isinstance(optimizer, dict) else None
        # DeepSpeed builds its own optimizers by (lower-case) name, anything else from torch.optim.
        if isinstance(kind, str) and kind.lower() in _DS_OPTIMIZERS_THAT_CANNOT_TRAIN_HERE:
            raise ConfigError(f"{source}: 'optimizer.type' {kind!r} "
                              f"{_DS_OPTIMIZERS_THAT_CANNOT_TRAIN_HERE[kind.lower()]}. Use AdamW.")
        torch_spelling = {name.lower(): name for name in dir(torch.optim)
                          if isinstance(getattr(torch.optim, name), type)
                          and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)}
        if (isinstance(kind, str) and kind.lower() not in DEEPSPEED_OPTIMIZERS and kind not in torch_spelling.values()
                and kind.lower() in torch_spelling):
            # DeepSpeed looks torch's up as spelt: 'nadam' failed inside deepspeed.initialize.
            raise ConfigError(f"{source}: 'optimizer.type' {kind!r} is torch.optim's "
                              f"{torch_spelling[kind.lower()]}; spell it {torch_spelling[kind.lower()]!r}.")
        if not isinstance(kind, str) or (kind.lower() not in DEEPSPEED_OPTIMIZERS and kind not in torch_spelling.values()):
            known = sorted((set(DEEPSPEED_OPTIMIZERS) - set(_DS_OPTIMIZERS_THAT_CANNOT_TRAIN_HERE)) | {'Adam', 'AdamW', 'SGD'})
            # Matched without case, suggested as spelt: 'sgd' got "Did you mean 'sgd'?" (torch's is SGD).
            by_lower = {}
            for name in sorted(known, key=str.islower):
                by_lower.setdefault(name.lower(), name)
            close = difflib.get_close_matches(str(kind).lower(), list(by_lower), n=1, cutoff=0.6)
            hint = f" Did you mean {by_lower[close[0]]!r}?" if close else ''
            raise ConfigError(f"{source}: 'optimizer.type' {kind!r} is not an optimizer DeepSpeed knows.{hint} "
                              f"Use one of {', '.join(known)} or a torch.optim class name.")
        _check_ds_params(optimizer, 'optimizer', source)
    _check_data_types(ds.get('data_types'), source)
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
        _check_schedule_ranges(scheduler, (ds.get('optimizer') or {}).get('params') or {}, source)
        _check_decay_peak(ds, source)
    _check_by_building(ds, source)
    _check_with_deepspeed(ds, source)


# DeepSpeed lists them as its optimizers; none trains a ds_seg model (checked with DeepSpeed 0.19).
_MUP = ("is one of mup's (muP) optimizers: DeepSpeed imports them from the mup package, and they train only "
        "a model whose base shapes mup has set, which ds_seg's models are not")
_DS_OPTIMIZERS_THAT_CANNOT_TRAIN_HERE = {
    'muon': ("is DeepSpeed's Muon, which orthogonalises 2-D weight matrices and fails at the first step on the "
             "convolution weights every ds_seg model has"),
    'muadam': _MUP, 'muadamw': _MUP, 'musgd': _MUP}

# (low, high) parameter pairs of DeepSpeed's schedules; a low above its high runs the schedule
# backwards without a word (a "warm-up" from 0.01 down to 0.001).
_SCHEDULE_RANGES = (('warmup_min_lr', 'warmup_max_lr'), ('cycle_min_lr', 'cycle_max_lr'),
                    ('cycle_min_mom', 'cycle_max_mom'))


def _schedule_default_or_none(kind, param):
    try:
        return _schedule_default(kind, param)
    except (AttributeError, KeyError):  # a schedule without that parameter
        return None


def _check_data_types(block, source):
    """"grad_accum_dtype": "fp8" failed inside the engine's build as "'fp8' is not a valid
    DtypeEnum", naming no key."""
    if not isinstance(block, dict):
        return
    from deepspeed.runtime.config import DtypeEnum
    names = [v for member in DtypeEnum for v in member._all_values if isinstance(v, str)]
    for key in ('grad_accum_dtype', 'param_dtype', 'buffer_dtype'):
        value = block.get(key)
        if value is not None and value not in names:
            short = [v for v in names if not v.startswith('torch.')]
            raise ConfigError(f"{source}: 'data_types.{key}' must be one of {', '.join(map(repr, short))}, "
                              f"got {json.dumps(value, default=repr)}.")


def _check_schedule_ranges(scheduler, optimizer_params, source):
    """Ranges that run backwards, and a ``warmup_type`` DeepSpeed only logs as unknown (it falls
    back to 'log'), are refused. A parameter left out counts at its DeepSpeed default (WarmupLR's
    warmup_max_lr: the optimizer's lr)."""
    from deepspeed.runtime.lr_schedules import WARMUP_LINEAR_RATE, WARMUP_LOG_RATE
    kind, params = scheduler.get('type'), scheduler.get('params') or {}
    for low_key, high_key in _SCHEDULE_RANGES:
        if low_key not in params and high_key not in params:
            continue
        low, high = (params[k] if k in params else _schedule_default_or_none(kind, k) for k in (low_key, high_key))
        if high is None and high_key == 'warmup_max_lr':
            high = optimizer_params.get('lr')
        if _is_number(low) and _is_number(high) and low > high:
            raise ConfigError(f"{source}: 'scheduler.params.{low_key}' ({low}) is above '{high_key}' ({high}); "
                              f"the {kind} schedule would run backwards. Swap them.")
    warmup_type = params.get('warmup_type')
    if warmup_type is not None and warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise ConfigError(f"{source}: 'scheduler.params.warmup_type' must be {WARMUP_LOG_RATE!r} or "
                          f"{WARMUP_LINEAR_RATE!r}, got {warmup_type!r} (DeepSpeed would use {WARMUP_LOG_RATE!r}).")


# Schedulers whose LR comes from a parameter with a DeepSpeed default, not from the optimizer's
# lr (as WarmupLR's does): that parameter, and what it sets.
_LR_FROM_OWN_DEFAULT = {'WarmupDecayLR': ('warmup_max_lr', 'peaks at'),
                        'LRRangeTest': ('lr_range_test_min_lr', 'starts at')}


def _check_decay_peak(ds, source):
    """DeepSpeed's WarmupDecayLR peaks at its own warmup_max_lr default (0.001), and LRRangeTest
    starts at its lr_range_test_min_lr default (0.001), not at the optimizer's lr as WarmupLR
    does: "lr": 1e-4 with them trained at 1e-3 and upwards without a word."""
    scheduler, optimizer = ds.get('scheduler') or {}, ds.get('optimizer') or {}
    params, lr = scheduler.get('params') or {}, (optimizer.get('params') or {}).get('lr')
    kind = scheduler.get('type')
    if kind not in _LR_FROM_OWN_DEFAULT or not _is_number(lr):
        return
    key, does = _LR_FROM_OWN_DEFAULT[kind]
    default = _schedule_default(kind, key)
    if key not in params and default is not None and lr != default:
        raise ConfigError(f"{source}: {kind} without 'scheduler.params.{key}' {does} DeepSpeed's "
                          f"default {default}, not at 'optimizer.params.lr' ({lr}); give "
                          f"\"{key}\": {lr} (or the LR you want) in scheduler.params.")


def _check_by_building(ds, source):
    """Build the optimizer and LR schedule the JSON describes on one dummy parameter, with the
    same code the DDP backend trains with: every value they reject (betas of the wrong length, a
    negative weight decay, eps or warmup) is one line now, not a traceback from deep inside
    ``deepspeed.initialize``."""
    import torch

    from .engine.ddp_backend import build_optimizer, build_scheduler
    param = torch.nn.Parameter(torch.zeros(1))
    block = ds.get('optimizer') or {}
    kind = str(block.get('type', ''))
    try:
        if kind.lower() in ('adam', 'adamw', 'sgd', 'adagrad') or isinstance(getattr(torch.optim, kind, None), type):
            optimizer = build_optimizer([param], block)
        else:  # DeepSpeed's own optimizers (Lamb, Lion, Muon...) need their extensions: checked by type only
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
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    probe = copy.deepcopy(ds)
    # The batch triple is resolved later, for the real world size; here any consistent one will do.
    probe.pop('train_batch_size', None)
    probe.setdefault('train_micro_batch_size_per_gpu', 1)
    probe['train_batch_size'] = probe['train_micro_batch_size_per_gpu'] * probe.get('gradient_accumulation_steps', 1)
    try:
        DeepSpeedConfig(probe)
    except pydantic.ValidationError as exc:
        raise ConfigError(f'{source}: {_pydantic_line(exc, ds)}') from exc
    except (ValueError, TypeError, AssertionError, KeyError, AttributeError, DeepSpeedConfigError) as exc:
        raise ConfigError(f'{source}: DeepSpeed refuses this config: {str(exc).splitlines()[0]}') from exc
    for key, model in _ds_models().items():
        if isinstance(ds.get(key), dict):
            _check_json_types(model, ds[key], key, source)
    _check_offload_stage(ds.get('zero_optimization') or {}, source)


def _check_offload_stage(zero, source):
    """DeepSpeed ignores an offload block its ZeRO stage does not implement: parameters are
    offloaded only by stage 3, the optimizer only by stages 1-3. The run then trains without the
    memory saving the JSON asks for, and runs out of memory where it was meant to fit."""
    stage = zero.get('stage', 0)
    # DeepSpeed's older spellings, which it turns into the blocks below with device "cpu": they
    # passed this check and trained with nothing offloaded.
    for old, block, needs, ok in (('cpu_offload_param', 'offload_param', 'stage 3', stage == 3),
                                  ('cpu_offload', 'offload_optimizer', 'stage 1, 2 or 3', stage >= 1)):
        if zero.get(old) and not ok:
            raise ConfigError(f"{source}: 'zero_optimization.{old}' (DeepSpeed's older name for '{block}') needs "
                              f"ZeRO {needs}, and DeepSpeed ignores it at stage {stage}: nothing would be offloaded; "
                              "raise 'zero_optimization.stage' or remove it.")
    for block, needs, ok in (('offload_param', 'stage 3', stage == 3),
                             ('offload_optimizer', 'stage 1, 2 or 3', stage >= 1)):
        device = (zero.get(block) or {}).get('device', 'none')
        if not ok and str(device) != 'none':
            raise ConfigError(f"{source}: 'zero_optimization.{block}' (device {device!r}) needs ZeRO {needs}, and "
                              f"DeepSpeed ignores it at stage {stage}: nothing would be offloaded; raise "
                              f"'zero_optimization.stage' or remove the block.")
        if str(device) != 'nvme':
            continue
        if stage != 3:  # stages 1-2 offload to the CPU only: 'nvme' there is ignored as well
            raise ConfigError(f"{source}: 'zero_optimization.{block}.device' \"nvme\" needs ZeRO stage 3 (stages 1-2 "
                              f"offload to \"cpu\" only, and DeepSpeed ignores nvme at stage {stage}); use \"cpu\" "
                              "or stage 3.")
        if not (zero.get(block) or {}).get('nvme_path'):
            raise ConfigError(f"{source}: 'zero_optimization.{block}.device' is \"nvme\" but no "
                              f"'zero_optimization.{block}.nvme_path' names the local NVMe folder to swap to.")
        if not _async_io_available():
            raise ConfigError(f"{source}: 'zero_optimization.{block}.device' \"nvme\" needs DeepSpeed's async_io op, "
                              "which cannot be built here (libaio missing: apt install libaio-dev, then "
                              "DS_BUILD_AIO=1 pip install deepspeed); use \"cpu\".")


# zero_optimization keys only DeepSpeed's stage-3 optimizer reads (with their stage3_* aliases).
# At stages 0-2 DeepSpeed drops them without a word: a JSON copied from a ZeRO-3 one and set to
# stage 2 still "sets" a prefetch bucket or quantised weights that nothing uses.
_STAGE3_ONLY = {
    'prefetch_bucket_size', 'param_persistence_threshold', 'model_persistence_threshold',
    'max_live_parameters', 'max_reuse_distance', 'gather_16bit_weights_on_model_save',
    'gather_fp16_weights_on_model_save', 'module_granularity_threshold',
    'use_all_reduce_for_fetch_params', 'allgather_sequential', 'sub_group_size',
    'zero_hpz_partition_size', 'zero_quantized_weights', 'zero_quantized_nontrainable_weights',
    'zero_quantized_gradients', 'log_trace_cache_warnings', 'enable_sanity_checks', 'leaf_module',
    'memory_efficient_linear', 'override_module_apply'}


def _stage3_keys_note(zero, source):
    """The line naming the zero_optimization keys the JSON's stage ignores (only stage 3 reads
    them), or None. A note, not a refusal: the run trains as the stage says; the keys do nothing."""
    stage = zero.get('stage', 0)
    ignored = sorted(k for k in zero if k in _STAGE3_ONLY or (k.startswith('stage3_') and k[7:] in _STAGE3_ONLY))
    if stage == 3 or not ignored:
        return None
    one = len(ignored) == 1
    return (f"{source}: {', '.join(f'zero_optimization.{k}' for k in ignored)} {'is' if one else 'are'} read only "
            f"by ZeRO stage 3, and DeepSpeed ignores {'it' if one else 'them'} at stage {stage}; remove "
            f"{'it' if one else 'them'} or set 'zero_optimization.stage' to 3.")


class _PythonTagInYaml(ValueError):
    pass


def _yaml_parsed_safely():
    """mmengine reads YAML configs (and their YAML _base_ files) with yaml's full Loader, which
    runs what a ``!!python/object/apply:os.system`` tag names: a config file ran a shell command.
    Within this context every YAML it reads goes through yaml's SafeLoader: plain values only."""
    import yaml
    from mmengine.fileio.handlers import file_handlers
    from mmengine.fileio.handlers.yaml_handler import YamlHandler

    class Loader(getattr(yaml, 'CSafeLoader', yaml.SafeLoader)):
        pass
    # YAML 1.1's floats need a dot: `lr: 1e-4` and `cat_max_ratio: 9e-1` were read as text (then
    # refused as "got '9e-1'"). YAML 1.2, JSON and Python read them as numbers; so does ds_seg.
    Loader.add_implicit_resolver('tag:yaml.org,2002:float',
                                 re.compile(r'^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$'), list('-+0123456789'))

    class SafeYamlHandler(YamlHandler):
        def load_from_fileobj(self, file, **kwargs):
            try:
                return yaml.load(file, Loader=Loader)
            except yaml.constructor.ConstructorError as exc:
                raise _PythonTagInYaml(f"{' '.join(str(exc).split())}; a config holds plain values (YAML tags "
                                       "that build Python objects are not run)") from None

    @contextlib.contextmanager
    def swapped():
        saved = {k: v for k, v in file_handlers.items() if isinstance(v, YamlHandler)}
        file_handlers.update({k: SafeYamlHandler() for k in saved})
        try:
            yield
        finally:
            file_handlers.update(saved)
    return swapped()


def _refuse_repeated_keys(path):
    """A JSON or YAML experiment config with a key twice in one mapping: the parsers keep the
    last silently (train: {max_steps: 6} then train: {seed: 3} trained the default 20 steps).
    The same hook as the DeepSpeed JSON's (:func:`_refuse_duplicate_keys`). A file that is not a
    mapping at the top (a list, a string, empty) is refused too: mmengine's words for it were
    "'list' object has no attribute 'get'"."""
    suffix = path.suffix.lower()
    if suffix not in ('.json', '.yaml', '.yml'):
        return
    try:
        text = path.read_text(encoding='utf-8-sig')
        if suffix == '.json':
            top = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
        else:
            import yaml

            class Loader(yaml.SafeLoader):
                pass

            def mapping(loader, node, deep=False):
                return _refuse_duplicate_keys([(loader.construct_object(k, deep=deep),
                                                loader.construct_object(v, deep=deep)) for k, v in node.value])
            Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
            top = yaml.load(text, Loader=Loader)
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: the key {exc.args[0]!r} is given twice in one mapping; the second would "
                          "silently replace the first: merge them into one.") from None
    except Exception:  # not parseable: loading it says why, in its own words
        return
    if not isinstance(top, dict):
        what = 'empty' if top is None else f'a {type(top).__name__} ({json.dumps(top, default=repr)[:60]})'
        raise ConfigError(f"{path}: an experiment config is a mapping of sections (train, data, model...), but "
                          f"this file is {what}; see configs/ for examples.")
    return top


_PARSED_SUFFIXES = ('.json', '.yaml', '.yml')


def _refuse_reassigned_python_keys(path):
    """A Python config that assigns a key twice at its top level (train = dict(max_steps=3), later
    train = dict(seed=5)): the second replaced the first whole and trained the default 20 steps,
    where the same in JSON or YAML is refused. A second assignment that reads the first
    (train = dict(train, seed=5)) changes it on purpose. Read without running the file."""
    import ast
    try:
        tree = ast.parse(path.read_text(encoding='utf-8-sig'))
    except (OSError, SyntaxError, ValueError):   # loading it says why
        return
    first = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            if not isinstance(target, ast.Name) or target.id.startswith('_'):
                continue   # the file's own helper variables
            reads_itself = any(isinstance(n, ast.Name) and n.id == target.id for n in ast.walk(node.value))
            if target.id in first and not reads_itself:
                raise ConfigError(f"{path}: line {node.lineno} assigns {target.id!r} again (first at line "
                                  f"{first[target.id]}); the second would silently replace the first whole: merge "
                                  f"them into one, or write {target.id} = dict({target.id}, ...) to change it.")
            first.setdefault(target.id, node.lineno)


def _check_inherited(path):
    """The rules of a config file for every file it loads through ``_base_`` too: no key twice in
    a JSON or YAML file anywhere in the chain, and no Python file under a JSON or YAML config,
    which is only parsed (a ``.py`` base of a JSON config ran, whoever wrote the JSON: a run's
    config.json handed on, say). Files that cannot be found or parsed are left to the loading,
    which says why in its words."""
    seen, todo = set(), [(path, None)]   # (file, the JSON/YAML file above it in the chain, if any)
    while todo:
        current, parsed_above = todo.pop()
        if (os.path.realpath(current), parsed_above is None) in seen or not current.is_file():
            continue
        seen.add((os.path.realpath(current), parsed_above is None))
        if current.suffix.lower() in _PARSED_SUFFIXES:
            bases = (_refuse_repeated_keys(current) or {}).get('_base_', [])
            parsed_above = parsed_above or current
        elif parsed_above is not None:  # (a Python config's JSON base handed on: its .py base ran too)
            raise ConfigError(f"{parsed_above}: inherits the Python config {current} through _base_, which would "
                              "run; a JSON or YAML config is only parsed. Give that base as JSON or YAML, or give "
                              "a Python config you trust as --config.")
        else:
            _refuse_reassigned_python_keys(current)
            try:
                bases = Config._get_base_files(str(current))  # its _base_ line, read without running the file
            except Exception:
                continue
        for base in [bases] if isinstance(bases, str) else bases if isinstance(bases, (list, tuple)) else []:
            if isinstance(base, str) and '::' not in base:  # (package:: bases are mmengine's packages')
                todo.append((Path(os.path.join(os.path.dirname(current), base)), parsed_above))


@contextlib.contextmanager
def _chain_merged_by_ds_seg_rules():
    """mmengine merges a config into its ``_base_`` key by key; within this context the chain
    follows the rules a section follows against the defaults (README): a registry section of
    another ``type`` replaces the base's (a base's UperNet became an FPN that kept the UperNet's
    backbone and channels), and a section with ``_delete_`` keeps the marker, so that the
    defaults are not merged back into it either (mmengine drops it)."""
    original = Config.__dict__['_merge_a_into_b']
    merge = original.__func__
    nested = []

    def mark(child, base, prefix, deleted):
        for key, value in child.items():
            if not isinstance(value, dict):
                continue
            path, old = f'{prefix}{key}', base.get(key) if isinstance(base, dict) else None
            if value.get(DELETE_KEY):
                # Kept for registry sections (and inside them), which _merge replaces by it; another
                # section's marker is refused there, and mmengine's replacement of the base is its
                # meaning (as before).
                if any(path == r or path.startswith(r + '.') for r in _REGISTRY_SECTIONS):
                    deleted.append(path)
            elif _replaces(path, value, old):
                child[key] = type(value)({**value, DELETE_KEY: True})  # mmengine's replace (it drops the marker)
            elif isinstance(old, dict):
                mark(value, old, f'{path}.', deleted)

    def merge_chain(a, b, allow_list_keys=False):
        if nested:  # mmengine's own recursion into sections
            return merge(a, b, allow_list_keys)
        deleted = []
        mark(a, b, '', deleted)
        nested.append(True)
        try:
            out = merge(a, b, allow_list_keys)
        finally:
            nested.pop()
        for path in deleted:
            node = out
            for part in path.split('.'):
                node = node[part]
            node[DELETE_KEY] = True
        return out

    Config._merge_a_into_b = staticmethod(merge_chain)
    try:
        yield
    finally:
        Config._merge_a_into_b = original


def _async_io_available():
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # no op builder at all: it cannot be built either
        return False


def _pydantic_models():
    """Every DeepSpeed config model by class name (a ValidationError names only its model)."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    found, todo = {}, [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found


def _ds_models():
    """The top-level blocks DeepSpeed validates with a pydantic model, and the model."""
    import deepspeed.runtime.precision_config as precision
    import deepspeed.runtime.zero.config as zero
    return {'zero_optimization': zero.DeepSpeedZeroConfig, 'fp16': precision.DeepSpeedFP16Config,
            'bf16': precision.DeepSpeedBF16Config, 'bfloat16': precision.DeepSpeedBF16Config}


def _check_json_types(model, block, where, source):
    """DeepSpeed's models convert leniently ("enabled": "yes" is true, "stage": "2" is 2, a number
    for a flag is a flag): refuse a JSON value whose type is not the field's, so what trains is
    what the file plainly says."""
    import enum
    import typing
    fields_by_name = {}
    for name, info in model.model_fields.items():
        fields_by_name[name] = info
        if info.alias:
            fields_by_name[info.alias] = info
    for key, value in block.items():
        info = fields_by_name.get(key)
        if info is None:
            continue  # unknown keys: DeepSpeed's own model refused them already
        path = f'{where}.{key}'
        kinds = [a for a in (typing.get_args(info.annotation) or (info.annotation,)) if a is not type(None)]
        sub = next((k for k in kinds if hasattr(k, 'model_fields')), None)
        if isinstance(value, dict) and sub is not None:
            _check_json_types(sub, value, path, source)
            continue
        enums = [k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)]
        allowed = set()
        for k in kinds:
            if k is bool:
                allowed.add(bool)
            elif k in (int, float) or (isinstance(k, type) and issubclass(k, (int, float)) and k is not bool):
                allowed.add('number')
            elif k is str or (isinstance(k, type) and issubclass(k, str)):
                allowed.add(str)
        for e in enums:
            allowed |= {'number' if isinstance(m.value, (int, float)) else str for m in e}
        if not allowed:
            continue  # lists, dicts, paths...: DeepSpeed's own model decides
        actual = bool if isinstance(value, bool) else 'number' if _is_number(value) else str if isinstance(value, str) \
            else None
        if actual is None or actual in allowed:
            continue
        what = ' or '.join(sorted({bool: 'true or false', 'number': 'a number', str: 'a string'}[a] for a in allowed))
        hint = ' (write it without quotes)' if isinstance(value, str) else ''
        raise ConfigError(f"{source}: {path!r} must be {what}, got {json.dumps(value)}{hint}.")


def _block_path(loc, ds):
    """The path from the top of the JSON of an error at ``loc`` inside some sub-model."""
    node = ds
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return list(loc)
    for key, value in ds.items():  # a model built from one top-level block
        if isinstance(value, dict) and loc and loc[0] in value:
            return [key, *loc]
    return list(loc)


def _pydantic_line(exc, ds):
    err = exc.errors()[0]
    loc = [str(p) for p in err['loc']]
    named = {}
    for key, model in _ds_models().items():  # the first key of a model ('bf16' before 'bfloat16')
        named.setdefault(model.__name__, key)
    full = [named[exc.title], *loc] if exc.title in named else _block_path(loc, ds)
    path = '.'.join(full)
    if err['type'] == 'extra_forbidden':
        parent = '.'.join(full[:-1])
        known = _known_fields(exc.title, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = (f"Did you mean '{parent}.{close[0]}'?" if close else
                f"Known keys of '{parent}': {', '.join(known)}." if known else '')
        return f"unknown key {path!r}. {hint}".strip()
    if err['type'] == 'enum':
        values = []
        for v in str(err.get('ctx', {}).get('expected', '')).replace(' or ', ', ').split(', '):
            if v and v not in values:
                values.append(v)
        return f"{path!r} is {err.get('input')!r}: use one of {', '.join(values)}."
    return f"{path!r} is {err.get('input')!r}: {err['msg']}."


def _known_fields(model_name, loc):
    """Field names of the pydantic model at ``loc`` inside DeepSpeed's model ``model_name``."""
    import typing
    model = _pydantic_models().get(model_name)
    for part in loc:
        field = getattr(model, 'model_fields', {}).get(part)
        if field is None:
            return []
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if hasattr(c, 'model_fields')), None)
    return sorted(getattr(model, 'model_fields', {}))


def _shortened_warmup_note(source, warmup, default, max_steps, shortened):
    instead = (f"warming up over {shortened} step(s) instead." if shortened < max_steps else
               f"warming up over DeepSpeed's minimum of {shortened} steps instead: the whole run, which never "
               f"reaches the peak learning rate" + (" (its one step trains at learning rate 0)" if max_steps == 1
                                                    else '') + ".")
    return (f"{source}: scheduler.params.warmup_num_steps {warmup}{default} is not shorter than the run "
            f"({max_steps} steps); {instead}")


def resolve_batch(ds, world_size, source='DeepSpeed config'):
    """Return (micro_batch, grad_accum, global_batch) for this world size, or raise naming the key.

    The JSON should give micro-batch and accumulation; a ``train_batch_size`` is accepted when it
    is consistent with them (or lets the missing one be derived) at this world size.
    """
    tbs = ds.get('train_batch_size')
    mb = ds.get('train_micro_batch_size_per_gpu')
    gas = ds.get('gradient_accumulation_steps')
    if mb is None and tbs is None:
        # Accumulation alone trained at micro-batch 1 without a word; DeepSpeed refuses it.
        raise ConfigError(f"{source}: set 'train_micro_batch_size_per_gpu' (and optionally "
                          "'gradient_accumulation_steps')" + (f"; 'gradient_accumulation_steps' {gas} alone leaves "
                                                              "the micro-batch unsaid" if gas is not None else '') + '.')
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
    """Whether this machine's accelerator can train in ``precision`` ('fp16' or 'bf16').

    Never fp16 on a CPU: DeepSpeed's CPU accelerator says fp16 where oneDNN has fp16 kernels
    (Xeons with AVX512-FP16), but its fp16 training there ran at 0.2 img/s against 34.5 for bf16
    autocast (the README's first command: 5 hours, not 2 minutes). ``DS_SEG_CPU_FP16=1`` runs it
    anyway (the tests of the fp16 code paths do, beside making DeepSpeed accept it)."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if precision != 'fp16':
        return acc.is_bf16_supported()
    if acc.device_name() == 'cpu' and os.environ.get('DS_SEG_CPU_FP16') != '1':
        return False
    return acc.is_fp16_supported()


# deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT (a test compares them): not imported here,
# config.py is read by predict and evaluate, which do not import DeepSpeed.
_DEEPSPEED_GRADIENT_CLIPPING = 1.0


FP16_NAMES = ('float16', 'fp16', 'half', 'torch.float16')   # what torch_autocast.dtype says for fp16


def resolve_ds_config(ds, world_size, max_steps, source='DeepSpeed config', supports=device_supports):
    """Resolve a checked DeepSpeed dict for this run. Returns ``(resolved, precision, notes)``.

    * batch triple made explicit for this world size, and DeepSpeed's gradient clipping and
      Adam(W) weight decay defaults (DDP trains the same experiment);
    * scheduler length filled from ``train.max_steps`` when absent;
    * precision the hardware cannot run replaced by the closest working mode (fp16 -> bf16
      autocast -> fp32), with one line in ``notes`` saying so.

    ``precision`` is the mode actually used: 'fp32', 'fp16', 'bf16', 'bf16-autocast' or
    'fp16-autocast'.
    """
    ds = copy.deepcopy(ds)
    notes = [n for n in [_stage3_keys_note(ds.get('zero_optimization') or {}, source)] if n]
    mb, gas, tbs = resolve_batch(ds, world_size, source)
    ds['train_micro_batch_size_per_gpu'] = mb
    ds['gradient_accumulation_steps'] = gas
    ds['train_batch_size'] = tbs
    # DeepSpeed's defaults made explicit: ds_config.json says what ran, and DDP, which builds its
    # own optimizer and clips by itself, trains the same experiment. Left out, DeepSpeed clipped
    # at 1.0 and DDP not at all; Adam(W)'s weight decay was 0 in DeepSpeed's own optimizers and
    # torch's 0.01 under DDP (and under DeepSpeed with torch_adam).
    ds.setdefault('gradient_clipping', _DEEPSPEED_GRADIENT_CLIPPING)
    optimizer = ds.get('optimizer')
    if isinstance(optimizer, dict) and str(optimizer.get('type', '')).lower() in ('adam', 'adamw'):
        if isinstance(optimizer.setdefault('params', {}), dict):
            optimizer['params'].setdefault('weight_decay', 0.0)

    sched = ds.get('scheduler')
    lr = (optimizer.get('params') or {}).get('lr') if isinstance(optimizer, dict) else None
    if lr == 0 and (not sched or sched.get('type') == 'WarmupCosineLR'):
        # (Negative and NaN are refused; 0 may be a throughput measurement, so it is said, not refused.)
        notes.append(f"{source}: optimizer.params.lr is 0" + (" and WarmupCosineLR scales it" if sched else "")
                     + ": every step trains at LR 0 and the weights never change.")
    if sched and sched.get('type') in _SCHEDULERS_WITH_TOTAL:
        params = sched.setdefault('params', {})
        from_run = 'total_num_steps' not in params
        params.setdefault('total_num_steps', max_steps)
        # Left out, DeepSpeed's own default (1000 steps for both) warms up: a shorter run never
        # left its warm-up, never reached the peak nor decayed, with only DeepSpeed's raw warning.
        given = 'warmup_num_steps' in params
        warmup = params['warmup_num_steps'] if given else _schedule_default(sched['type'], 'warmup_num_steps')
        if from_run and _is_number(warmup) and warmup >= max_steps:
            # A smoke test (train.max_steps=5) with a JSON written for real runs: warm up over the
            # first fifth of the run instead of refusing it (DeepSpeed's schedulers warm up over 2
            # steps at least: a 1 written here would be recorded, and 2 would run).
            params['warmup_num_steps'] = max(2, max_steps // 5)
            default = '' if given else f" (the {sched['type']} default)"
            notes.append(_shortened_warmup_note(source, warmup, default, max_steps, params['warmup_num_steps']))
        elif not from_run and _is_number(params['total_num_steps']) and params['total_num_steps'] < max_steps:
            # Past its length a schedule stays at its last LR (0 for WarmupDecayLR, the cosine
            # floor for WarmupCosineLR): the rest of the run would train at it without a word.
            total = params['total_num_steps']
            raise ConfigError(f"{source}: scheduler.params.total_num_steps ({total}) is shorter than the run "
                              f"(train.max_steps={max_steps}): its last {max_steps - total} step(s) would train at "
                              f"the schedule's final LR; remove total_num_steps so the schedule follows "
                              f"train.max_steps, or set train.max_steps={total}.")
        elif _is_number(warmup) and warmup >= params['total_num_steps']:
            raise ConfigError(f"{source}: scheduler.params.warmup_num_steps ({warmup}"
                              f"{'' if given else ', the ' + sched['type'] + ' default'}) "
                              f"must be smaller than the run length ({params['total_num_steps']} steps).")
    elif sched and sched.get('type') == 'WarmupLR':
        # WarmupLR has no length, and warms up over 1000 steps unless told: a shorter run never
        # reached warmup_max_lr. Shortened as for the schedules above.
        params = sched.setdefault('params', {})
        given = 'warmup_num_steps' in params
        warmup = params.get('warmup_num_steps', _schedule_default('WarmupLR', 'warmup_num_steps'))
        if _is_number(warmup) and warmup >= max_steps:
            params['warmup_num_steps'] = max(2, max_steps // 5)
            default = '' if given else ' (the WarmupLR default)'
            notes.append(_shortened_warmup_note(source, warmup, default, max_steps, params['warmup_num_steps']))

    elif sched and sched.get('type') == 'OneCycle':
        # OneCycle's cycle is 2 x 2000 steps unless told: a shorter run only ever rose towards
        # cycle_max_lr. Its cycle then spans the run, as the schedules above do.
        # A second half the JSON gives is kept: the first half takes the rest of the run.
        params = sched.setdefault('params', {})
        first = params.get('cycle_first_step_size', _schedule_default('OneCycle', 'cycle_first_step_size'))
        second = params.get('cycle_second_step_size')
        if ('cycle_first_step_size' not in params and _is_number(first) and (second is None or _is_number(second))
                and first + (first if second is None else second) > max_steps
                and (second is None or second < max_steps)):
            cycle = first + (first if second is None else second)
            params['cycle_first_step_size'] = max(1, max_steps // 2 if second is None else max_steps - second)
            params['cycle_second_step_size'] = max(1, max_steps - params['cycle_first_step_size'])
            notes.append(f"{source}: scheduler.params.cycle_first_step_size {first} (the OneCycle default) makes a "
                         f"cycle of {cycle} steps, longer than the run ({max_steps} steps); cycling over the run "
                         f"instead ({params['cycle_first_step_size']} step(s) up, "
                         f"{params['cycle_second_step_size']} down).")
        elif _is_number(first) and (second is None or _is_number(second)) \
                and first + (first if second is None else second) > max_steps:
            # Given in the JSON: kept, and said (a smoke test's 4 steps of a 200-step cycle
            # logged an LR that only rose, as the default's did before it was fitted to the run).
            cycle = first + (first if second is None else second)
            where = ('before its peak (cycle_max_lr, at step ' + f'{first})' if max_steps < first
                     else 'part-way down from its peak')
            notes.append(f"{source}: scheduler.params.cycle_first_step_size {first} makes a cycle of {cycle} steps, "
                         f"longer than the run ({max_steps} steps): the run ends {where}; fit the step sizes to "
                         f"the run, or leave cycle_first_step_size out to cycle over it.")

    if 'bfloat16' in ds:  # DeepSpeed's old spelling
        ds['bf16'] = ds.pop('bfloat16')
    fp16 = bool(ds.get('fp16', {}).get('enabled', False))
    bf16 = bool(ds.get('bf16', {}).get('enabled', False))
    autocast = ds.get('torch_autocast', {})
    if fp16 and bf16:
        raise ConfigError(f"{source}: 'fp16.enabled' and 'bf16.enabled' are both true; choose one.")
    if (fp16 or bf16) and isinstance(autocast, dict) and autocast.get('enabled'):
        # DeepSpeed ran both (bf16 weights under fp16 autocast: 35x slower on a CPU, recorded as
        # bf16), and DDP, which runs one precision, rewrote the autocast dtype.
        native = 'fp16' if fp16 else 'bf16'
        raise ConfigError(f"{source}: '{native}.enabled' and 'torch_autocast.enabled' are both true; choose one "
                          f"({native}: the weights in {native}; torch_autocast: fp32 weights, {native} "
                          f"computation where it is safe).")
    autocast_fp16 = (isinstance(autocast, dict) and autocast.get('enabled')
                     and str(autocast.get('dtype', 'bfloat16')) in FP16_NAMES)

    if fp16 and not supports('fp16'):
        ds['fp16']['enabled'] = False
        if supports('bf16'):
            # The JSON's own autocast settings (lower_precision_safe_modules...) are kept.
            ds['torch_autocast'] = dict(ds.get('torch_autocast') or {}, enabled=True, dtype='bfloat16')
            notes.append(f"{source}: fp16 is not supported on this device; running bf16 autocast instead.")
        else:
            notes.append(f"{source}: fp16 is not supported on this device; running fp32 instead.")
    elif bf16 and not supports('bf16'):
        ds['bf16']['enabled'] = False
        notes.append(f"{source}: bf16 is not supported on this device; running fp32 instead.")
    elif autocast_fp16 and not supports('fp16'):   # as native fp16 above: fp16 autocast too is 40x slower
        if supports('bf16'):
            ds['torch_autocast'] = dict(autocast, dtype='bfloat16')
            notes.append(f"{source}: fp16 autocast is not supported on this device; running bf16 autocast instead.")
        else:
            ds['torch_autocast'] = dict(autocast, enabled=False)
            notes.append(f"{source}: fp16 autocast is not supported on this device; running fp32 instead.")

    if ds.get('fp16', {}).get('enabled'):
        precision = 'fp16'
    elif ds.get('bf16', {}).get('enabled'):
        precision = 'bf16'
    elif ds.get('torch_autocast', autocast).get('enabled'):
        dtype = str(ds['torch_autocast'].get('dtype', 'bfloat16'))
        precision = ('fp16' if dtype in FP16_NAMES else 'bf16') + '-autocast'
    else:
        precision = 'fp32'
    if precision == 'bf16' and 'check_grad_overflow' not in ds['bf16'] and _deepspeed_bf16_has('check_grad_overflow'):
        # DeepSpeed's ZeRO-1/2 look for inf/NaN in bf16 gradients by reading a flag on the host at
        # every step (its default): a device synchronisation in every step, found on an H100. bf16
        # needs no loss scale, and ds_seg counts non-finite losses on the device instead
        # (train.max_nonfinite_steps), as under DDP. A JSON that sets the key keeps its value.
        ds['bf16']['check_grad_overflow'] = False
    return ds, precision, notes


def _deepspeed_bf16_has(key):
    """Whether the installed DeepSpeed's ``bf16`` block takes ``key`` (its config forbids unknown keys)."""
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    except ImportError:
        return False
    return key in getattr(DeepSpeedBF16Config, 'model_fields', {})


def default_work_dir(cfg):
    return cfg.get('work_dir') or os.path.join('work_dirs', cfg.get('config_name', 'default'))
