"""The run description: resolved once, after the process group exists, read by every part.

World size, device, the batch triple, the ZeRO stage, the precision that actually runs and the
resolved DeepSpeed dict are decided here and nowhere else: the backends, the checkpointer, the
metrics and the trainer read a :class:`RunSpec`; none of them re-parses DeepSpeed JSON keys.

Example::

    spec = describe_run(load_ds_config('ds_configs/zero2.json'), backend='deepspeed', max_steps=400)
    spec.micro_batch, spec.grad_accum, spec.global_batch, spec.precision, spec.zero_stage
"""
import dataclasses
import json

import torch

from .. import distributed
from ..config import ConfigError, resolve_ds_config

@dataclasses.dataclass(frozen=True)
class RunSpec:
    backend: str               # 'deepspeed' or 'ddp'
    rank: int
    world_size: int
    device: torch.device
    launcher: str              # who started the ranks (deepspeed, torchrun, slurm, python)
    micro_batch: int           # per rank and micro-step
    grad_accum: int
    global_batch: int          # micro_batch x grad_accum x world_size
    zero_stage: object         # int under DeepSpeed, None under DDP (no ZeRO)
    precision: str             # what runs: fp32, fp16, bf16, fp16-autocast, bf16-autocast
    ds_config: dict            # the resolved DeepSpeed dict (batch triple explicit, precision as run)
    notes: tuple = ()          # one line per adjustment made while resolving (printed by rank 0)
    compile_mode: object = None  # a torch.compile mode when train.compile is on, else None
    channels_last: bool = False  # activations (and DDP's parameters) in NHWC memory format
    json_precision: str = None   # what the JSON asks for (DDP runs a native fp16 block as autocast,
                                 # with that block's loss scaling)

    def describe(self):
        """``backend deepspeed ZeRO-2 | fp32 | 2 rank(s) on cpu | micro-batch 2 x accum 1 x 2 = 4``"""
        stage = '' if self.zero_stage is None else f' ZeRO-{self.zero_stage}'
        return (f'backend {self.backend}{stage} | {self.precision} | {self.world_size} rank(s) on '
                f'{self.device.type} | micro-batch {self.micro_batch} x accum {self.grad_accum} x '
                f'{self.world_size} = {self.global_batch}'
                + (f' | compiled ({self.compile_mode})' if self.compile_mode else '')
                + (' | channels_last' if self.channels_last else ''))

    def as_json(self):
        """What ``ds_config.json`` records under ``ds_seg`` next to the resolved dict."""
        return {'backend': self.backend, 'precision': self.precision, 'world_size': self.world_size,
                'launcher': self.launcher, 'compile_mode': self.compile_mode, 'channels_last': self.channels_last}


def describe_run(ds_config, backend, max_steps, source='DeepSpeed config', launcher=None, compile_mode=None,
                 channels_last=False):
    """Resolve ``ds_config`` (a checked DeepSpeed dict) for this process group and hardware.

    The backend class says what the JSON's precision becomes (under DDP native fp16/bf16 runs
    as torch.amp autocast: ``bf16-autocast``) and which ZeRO stage applies (none under DDP).
    """
    from .backend import backend_class
    engine = backend_class(backend)
    world_size = distributed.world_size()
    if not ds_config.get('optimizer'):
        # DeepSpeed would start without one and fail at the first step; DDP would invent one.
        raise ConfigError(f"{source}: no 'optimizer' block: training needs one, e.g. \"optimizer\": "
                          "{\"type\": \"AdamW\", \"params\": {\"lr\": 0.001}} (see ds_configs/zero2.json).")
    resolved, precision, notes = resolve_ds_config(ds_config, world_size, max_steps, source=source)
    native, (precision, zero_stage) = precision, (engine.precision_run(precision), engine.zero_stage_of(resolved))
    reduce_op = str(resolved.get('gradient_allreduce_op', 'mean')).lower()
    if engine.name != 'deepspeed' and reduce_op != 'mean':
        # DDP averages: the same JSON trained at another gradient scale (N x the norm under 'sum',
        # clipping biting elsewhere, SGD at N x the LR) under one backend only, unsaid.
        raise ConfigError(f"{source}: 'gradient_allreduce_op' {resolved['gradient_allreduce_op']!r} is DeepSpeed's; "
                          "--backend ddp averages gradients over ranks (DeepSpeed's 'mean'): remove it, or use "
                          "--backend deepspeed")
    if engine.name != 'deepspeed':
        # DeepSpeed's own monitors are part of its engine: under DDP they did nothing, unsaid.
        monitors = [key for key in ('tensorboard', 'wandb', 'csv_monitor', 'comet')
                    if isinstance(resolved.get(key), dict) and resolved[key].get('enabled')]
        if monitors:
            notes = list(notes) + [
                f"{source}: {', '.join(repr(k) for k in monitors)}: DeepSpeed's own monitor(s), which run under "
                "--backend deepspeed only; ds_seg's TensorBoard log (<work dir>/tb) and log.trackers cover both "
                "backends"]
    changed = _compile_block_settings(resolved.get('compile'))
    if changed and (engine.name != 'deepspeed' or compile_mode is None):
        # DeepSpeed reads the block only in engine.compile(): DeepCompile and its offloads
        # never took effect, and ds_config.json recorded them beside compile_mode null.
        raise ConfigError(f"{source}: the 'compile' block sets {', '.join(changed)}, which DeepSpeed applies only in "
                          "engine.compile(): ds_seg calls it with train.compile=True under --backend deepspeed; "
                          "set those, or remove the block.")
    if precision != native:  # DDP runs native fp16/bf16 as autocast: ds_config.json says what ran
        resolved = dict(resolved, **{native: dict(resolved[native], enabled=False)},
                        torch_autocast={'enabled': True, 'dtype': 'float16' if native == 'fp16' else 'bfloat16'})
    return RunSpec(backend=backend, rank=distributed.rank(), world_size=world_size, device=distributed.device(),
                   launcher=launcher or distributed.detect_launcher(), micro_batch=resolved['train_micro_batch_size_per_gpu'],
                   grad_accum=resolved['gradient_accumulation_steps'], global_batch=resolved['train_batch_size'],
                   zero_stage=zero_stage, precision=precision, ds_config=resolved, notes=tuple(notes),
                   compile_mode=compile_mode, channels_last=bool(channels_last), json_precision=native)


# DeepSpeed's monitors that write files, and where (``output_path``: "" is the current folder).
_FILE_MONITORS = ('tensorboard', 'csv_monitor')


# What ds_seg keeps in a work dir (DESIGN.md's work-dir contract): a monitor writing into one of these
# folders had its files moved away as an earlier run's logs (tb), or mixed into checkpoints.
_OWN_FOLDERS = ('tb', 'checkpoints', 'previous', 'abandoned')


def _refuse_monitor_among_own_files(key, block, output_path, given, work_dir, source):
    """A monitor's folder (``output_path``/``job_name``, as DeepSpeed joins them) inside one of
    ds_seg's own folders of the work dir, or, given relative, outside the work dir."""
    import os
    work = os.path.abspath(work_dir)
    folder = os.path.normpath(os.path.join(output_path, block.get('job_name', 'DeepSpeedJobName') or ''))
    inside = os.path.relpath(folder, work)
    top = inside.split(os.sep)[0]
    if top in _OWN_FOLDERS:
        raise ConfigError(f"{source}: {key} writes into {folder} (output_path {given!r}, job_name "
                          f"{block.get('job_name', 'DeepSpeedJobName')!r}), inside the work dir's {top}/, which ds_seg "
                          f"keeps for its own files; give another output_path (e.g. \"deepspeed_monitor\").")
    if not os.path.isabs(given) and (top == os.pardir or os.path.isabs(inside)):
        raise ConfigError(f"{source}: {key}.output_path {given!r} leaves the work dir ({folder}): a relative "
                          "output_path is taken inside the work dir; give an absolute path to write elsewhere.")


def with_monitors_in(spec, work_dir, source='DeepSpeed config'):
    """``spec`` with DeepSpeed's file-writing monitors (the JSON's ``tensorboard``/``csv_monitor``
    blocks) writing under ``work_dir``: their default output path is the folder the command ran
    in (the checkout), where every run appended to one CSV and put its TensorBoard events beside
    the others'. A relative ``output_path`` is taken inside the work dir; an absolute one is kept."""
    import os
    ds_config = dict(spec.ds_config)
    moved = []
    for key in _FILE_MONITORS:
        block = ds_config.get(key)
        if not (isinstance(block, dict) and block.get('enabled')):
            continue
        path = block.get('output_path') or ''
        if not os.path.isabs(path):
            ds_config[key] = dict(block, output_path=os.path.join(os.path.abspath(work_dir), path or 'deepspeed_monitor'))
            moved.append(key)
        _refuse_monitor_among_own_files(key, block, ds_config[key]['output_path'], path, work_dir, source)
    if not moved:
        return spec
    where = ', '.join(f"{key} in {ds_config[key]['output_path']}" for key in moved)
    note = (f"DeepSpeed's own monitor(s) write {where}: they log the scalars DeepSpeed keeps (its learning rate per "
            "sample); ds_seg's losses and metrics are in <work dir>/tb and metrics.jsonl")
    return dataclasses.replace(spec, ds_config=ds_config, notes=spec.notes + (note,))


def _compile_block_settings(block):
    """The keys of the DeepSpeed JSON's ``compile`` block set to other than DeepSpeed's defaults."""
    if not isinstance(block, dict) or not block:
        return []
    from deepspeed.compile.config import CompileConfig
    defaults = CompileConfig().model_dump()
    return sorted(f'{key}={json.dumps(value)}' for key, value in block.items() if defaults.get(key, object()) != value)
