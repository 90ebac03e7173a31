"""The training run's checkpoint policy: when to save, what a checkpoint carries besides the
engine's state (client state), which checkpoint a resume starts from, whether this run can
continue it, and how it is loaded (at another world size too).

Storage (atomic writes, checksums, verification, ``latest``, keep-N pruning, finding the newest
verified checkpoint for resume, export, predict and evaluate) is ds_seg/engine/checkpoint.py;
this class is the one caller of it during training.
"""
import json
import os
import time

import numpy as np
import torch

from .. import distributed
from ..config import ConfigError, dotted
from ..data.geotiff import effective_label_decoding
from ..data.raster import colours_conflict, colours_said
from . import checkpoint, reshard


def data_normalisation(train_set):
    """Bands, per-band mean/std the model's inputs were normalised with and the pixel type they
    are in the units of (saved in checkpoints and exported weights so prediction repeats them
    exactly, and refuses a scene of another type)."""
    data = dict(bands=[int(b) for b in getattr(train_set, 'bands', range(1, train_set.in_channels + 1))],
                mean=[float(v) for v in train_set.mean], std=[float(v) for v in train_set.std],
                ignore_index=int(getattr(train_set, 'ignore_index', 255)),
                dtype=getattr(train_set, 'file_dtype', None))
    if getattr(train_set, 'band_encoding', None):  # the bands' [scale, offset]: another is refused
        data['encoding'] = [list(pair) for pair in train_set.band_encoding]
    if getattr(train_set, 'band_colours', None):  # the files' colour order: a BGR scene is refused
        data['colours'] = list(train_set.band_colours)
    if getattr(train_set, 'num_file_bands', None):  # a scene of more bands is another product
        data['file_bands'] = int(train_set.num_file_bands)
        # ... but not one without the files' alpha band (RGBA training files, an RGB scene)
        scenes = getattr(train_set, 'scenes', None) or [{}]
        alpha = sorted(set(scenes[0].get('alpha') or ()) - set(data['bands']))
        if alpha:
            data['file_alpha'] = [int(b) for b in alpha]
    if getattr(train_set, 'label_decoding', None):  # label_map, reduce_zero_label, palette
        data['label_decoding'] = train_set.label_decoding
    sizes = sorted(s['pixel_size_m'] for s in getattr(train_set, 'scenes', None) or () if s.get('pixel_size_m'))
    if sizes:  # the ground resolution trained at: a scene of another is said at prediction
        data['pixel_size_m'] = float(sizes[len(sizes) // 2])
    if getattr(train_set, 'num_dates', 1) > 1:  # a model of one date (UNet) trained on their stacked bands
        data['num_dates'] = int(train_set.num_dates)
    if getattr(train_set, 'generated_from_seed', None) is not None:  # SyntheticAerial: its scenes are the seed's
        data['synthetic_seed'] = int(train_set.generated_from_seed)
    return data


def _short(values):
    """A list of floats as a --cfg-options value, rounded to what float32 holds."""
    return '[' + ','.join(f'{float(v):.7g}' for v in values or ()) + ']'


def optimizer_family(ds_config):
    """The optimizer whose state a checkpoint holds ('adam' for Adam and AdamW: same state)."""
    kind = str((ds_config.get('optimizer') or {}).get('type', '')).lower()
    return 'adam' if kind in ('adam', 'adamw') else kind


# Optimizer settings a checkpoint's optimizer state carries (its param_groups) and a resume restores
# over the DeepSpeed JSON's: a new value would be written to ds_config.json but never train. The LR
# only without a scheduler: a scheduler sets it from its own (new) parameters every step.
# decoupled_weight_decay: AdamW's, or Adam's L2 (DeepSpeed's "Adam" with adam_w_mode false); torch
# restores it with the groups, so a resume that switched kept training AdamW under a torch.Adam label.
STATE_HYPERPARAMETERS = ('weight_decay', 'betas', 'eps', 'momentum', 'dampening', 'nesterov', 'amsgrad',
                         'decoupled_weight_decay')


def restored_hyperparameters(ds_config):
    """The JSON's values of the optimizer settings a resume restores from the checkpoint."""
    optimizer = ds_config.get('optimizer') or {}
    params = optimizer.get('params') or {}
    keys = STATE_HYPERPARAMETERS + (() if ds_config.get('scheduler') else ('lr',))
    found = {k: params.get(k) for k in keys if params.get(k) is not None}
    kind = str(optimizer.get('type', '')).lower()
    if kind in ('adam', 'adamw') and params.get('weight_decay'):   # without decay the two are one
        # DeepSpeed's rule: AdamW always decoupled; Adam unless adam_w_mode is false.
        found['decoupled_weight_decay'] = kind == 'adamw' or bool(params.get('adam_w_mode', True))
    return found


# The fp16 block's loss-scaling settings: DeepSpeed's fp16 optimizers restore them, with the
# scale, from a checkpoint (a JSON that changes them on resume was recorded and never applied, or,
# dynamic -> static under ZeRO-0, crashed at the first overflow).
LOSS_SCALING_KEYS = ('loss_scale', 'loss_scale_window', 'hysteresis', 'consecutive_hysteresis', 'min_loss_scale')


def loss_scaling(ds_config):
    """The fp16 block's loss-scaling settings, DeepSpeed's defaults filled in; None without fp16."""
    block = ds_config.get('fp16') or {}
    if not block.get('enabled'):
        return None
    from deepspeed.runtime.precision_config import get_float16_config
    cfg = get_float16_config({'fp16': block})
    return {key: getattr(cfg, key) for key in LOSS_SCALING_KEYS}


def _base_lr(ds_config):
    """The optimizer's ``lr`` in the DeepSpeed JSON (the LR a schedule starts from or scales)."""
    return ((ds_config.get('optimizer') or {}).get('params') or {}).get('lr')


def _model_dict(model_cfg):
    return model_cfg.to_dict() if hasattr(model_cfg, 'to_dict') else dict(model_cfg)


def _first_group_difference(saved, now):
    """The first parameter group two layouts (param_groups.group_layout) disagree on, in words:
    the same optim settings can group another model differently (another frozen_stages...)."""
    def words(group):
        if group is None:
            return 'none'
        name, mult, decay, count = group
        return f"{name} (lr_mult {mult:g}{'' if decay is None else f', weight_decay {decay:g}'}, {count} tensors)"
    saved, now = saved or [['all', 1.0, None, '?']], now or [['all', 1.0, None, '?']]
    for i in range(max(len(saved), len(now))):
        a, b = (saved[i] if i < len(saved) else None), (now[i] if i < len(now) else None)
        if a != b:
            return f'parameter group {i + 1}: {words(a)} there, {words(b)} here'
    return 'the parameter groups differ'


class Checkpointer:
    def __init__(self, work_dir, spec, backend, cfg, train_set, report):
        self.work_dir, self.spec, self.backend, self.cfg = work_dir, spec, backend, cfg
        self.train_set, self.report = train_set, report
        # The user's modules the model comes from (custom_imports, or the module that registered
        # model.type): recorded, so predict/evaluate/export can build it where they import.
        from ..registry import MODELS, custom_modules_of
        self.custom_imports = custom_modules_of(MODELS, cfg.model.get('type'),
                                                (cfg.get('custom_imports') or {}).get('imports'))
        self.root = os.path.join(work_dir, 'checkpoints')
        self.interval = cfg.train.checkpoint_interval
        self.keep = cfg.train.keep_checkpoints
        self.max_steps = cfg.train.max_steps
        self.best_metric = cfg.train.get('save_best')  # None, or the eval.jsonl score to keep the best of
        self.best = None  # (score, step) of the best checkpointed evaluation so far
        # The metric that chose checkpoints/best: this run's save_best, or, in a run resumed
        # without it, the one recorded in the best checkpoint's marker (summary.json names it).
        self.kept_best_metric = self.best_metric
        self.restored_log_window = None  # the log window the resumed checkpoint was saved inside
        # Seconds the run's earlier passes took up to the checkpoint resumed from (requeues,
        # crashes): the summary's wall_time_total_s adds this pass's. t_start: this pass's start.
        self.earlier_wall_time_s, self.t_start = 0.0, time.time()

    def due(self, step):
        """A periodic checkpoint at this step (``train.checkpoint_interval``, and the last step)."""
        return bool(self.interval) and (step % self.interval == 0 or step == self.max_steps)

    def improves_best(self, record):
        """True when the evaluation ``record`` (all-reduced: the same on every rank) beats the best
        so far by ``train.save_best``; it is then checkpointed and named by ``checkpoints/best``."""
        score = record.get(self.best_metric) if self.best_metric else None
        return score is not None and (self.best is None or score > self.best[0])

    def best_summary(self):
        """``summary.json``'s ``best``: metric, score, step and checkpoint, or None."""
        if self.best is None:
            return None
        return dict(metric=self.kept_best_metric, value=self.best[0], step=self.best[1],
                    checkpoint=os.path.join(self.root, checkpoint.tag_for(self.best[1])))

    # -- saving ----------------------------------------------------------------------------
    def save(self, step, micro_step, best_record=None, log_window=None):
        """Every rank calls it. ``micro_step`` is the data position the samplers restart from;
        ``best_record``: this step's evaluation, a new best (see :meth:`improves_best`);
        ``log_window``: the open log window (RunMetrics.window_state), given back by a resume."""
        self.backend.sync_buffers()
        client_state = dict(log_window=log_window,
            step=step, micro_step=micro_step, micro_batch=self.spec.micro_batch, grad_accum=self.spec.grad_accum,
            rng_cpu=torch.get_rng_state(),
            rng_cuda=torch.cuda.get_rng_state() if self.spec.device.type == 'cuda' else None,
            model_cfg=_model_dict(self.cfg.model), classes=list(self.train_set.classes),
            world_size=self.spec.world_size, backend=self.spec.backend, zero_stage=self.spec.zero_stage,
            data=data_normalisation(self.train_set),
            wall_time_total_s=self.earlier_wall_time_s + time.time() - self.t_start)
        tag = checkpoint.save(self.backend, self.root, step, client_state, keep=self.keep,
                              marker_extra={'param_shapes': self.param_shapes(), 'precision': self.spec.precision,
                                            'optimizer': optimizer_family(self.spec.ds_config),
                                            'optimizer_params': restored_hyperparameters(self.spec.ds_config),
                                            'loss_scaling': loss_scaling(self.spec.ds_config),
                                            'schedule': self.spec.ds_config.get('scheduler'),
                                            'base_lr': _base_lr(self.spec.ds_config),
                                            'param_groups': self.backend.param_group_layout,
                                            'optim': _model_dict(self.cfg.get('optim') or {}),
                                            **({'custom_imports': self.custom_imports} if self.custom_imports else {}),
                                            **({'best_metric': self.best_metric} if best_record is not None else {})},
                              best=best_record is not None, report=self.report)
        if best_record is not None:
            self.best = (best_record[self.best_metric], step)
        self.report(f'saved checkpoint {self.root}/{tag}'
                    + (f' (best {self.best_metric} so far: {self.best[0]:.4f})' if best_record is not None else ''))

    def param_shapes(self):
        """Parameter name -> full shape (ZeRO-3 partitions keep the full shape in ``ds_shape``)."""
        return {name: list(getattr(p, 'ds_shape', p.shape)) for name, p in self.backend.module.named_parameters()}

    # -- resuming --------------------------------------------------------------------------
    def check_resume(self, resume, found, work_dir_by_default=False):
        """Refuse, before anything is loaded or logged (the trainer calls it before it starts the
        trackers: a refused run added a FAILED MLflow run, or marked the finished one KILLED), a
        resume this run cannot make. Arguments as :meth:`restore`'s; ``work_dir_by_default``: the
        work dir is the config's default, not one the user named."""
        held = os.listdir(self.root) if os.path.isdir(self.root) else ()
        holds_checkpoints = any(checkpoint.TAG_RE.match(n) for n in held)  # verified or not: never written over
        if found is None and resume != 'auto':
            if holds_checkpoints:
                raise ConfigError(f"--work-dir: {self.work_dir} already holds checkpoints of an earlier run; "
                                  "add --resume auto to continue it, or choose another --work-dir.")
            return
        root, tag = found or (self.root, None)
        if not tag:
            return
        if work_dir_by_default and holds_checkpoints and not checkpoint.of_this_run(self.work_dir, root):
            # Continuing another run's checkpoint sets this work dir's own run aside (restore): as a
            # fresh run there is refused, so is a fork into it that nobody asked for by name.
            raise ConfigError(f"--resume: {os.path.join(root, tag)} is another run's checkpoint, and the default "
                              f"work dir {self.work_dir} holds checkpoints of an earlier run of its own; give "
                              "--work-dir: a new folder to continue that checkpoint in, or this one to set its "
                              "checkpoints aside (moved to abandoned/, nothing deleted).")
        # Before loading (which says "resumed from"): it would "complete" at once, logging a run
        # that went backwards.
        saved_step = int(checkpoint.read_marker(os.path.join(root, tag)).get('step', 0))
        if saved_step > self.cfg.train.max_steps:
            raise ConfigError(f"--resume: {os.path.join(root, tag)} is at step {saved_step}, past train.max_steps="
                              f"{self.cfg.train.max_steps}; raise train.max_steps to train on, or export it "
                              f"as it is (launch/export.py).")
        self.check_compatible(root, tag)
        self._check_best_metric(root)

    def _check_best_metric(self, root):
        """A resume that keeps the best by another metric than the run did (train.save_best=OA
        after mIoU): its first new best moved ``best`` on, and keep_checkpoints pruned the
        checkpoint the run had kept as its best, without a word. Refused where pruning is on."""
        kept = checkpoint.read_pointer(root, 'best')
        if not self.best_metric or not self.keep or kept is None or not checkpoint.is_complete(root, kept) \
                or not checkpoint.is_own(self.work_dir, root):   # another run's: this run prunes its own only
            return
        before = checkpoint.read_marker(os.path.join(root, kept)).get('best_metric')
        if before and before != self.best_metric:
            raise ConfigError(f"--resume: {os.path.join(root, kept)} is the run's best by {before} "
                              f"(train.save_best={before!r}); keeping the best by {self.best_metric} instead would "
                              f"let train.keep_checkpoints={self.keep} delete it once another is better by "
                              f"{self.best_metric}: resume with train.save_best={before!r}, or export that "
                              "checkpoint first (launch/export.py), or set train.keep_checkpoints=0.")

    def restore(self, resume, found):
        """After :meth:`check_resume`: load the checkpoint ``--resume`` names (every rank): ``found``, what
        ``checkpoint.resolve_resume`` answered for it (None included; the trainer resolves it
        before building the model, and the SHA-256 checks are not repeated). Returns ``(step,
        micro_step_offset, set_aside)``: the step to continue from, the data position minus step x
        accumulation (non-zero after a change of ranks), and where an abandoned branch was moved
        (or None)."""
        self.brought_back = None  # the step an abandoned branch brought back had branched after
        if found is None and resume != 'auto':  # (check_resume refused a fresh run over checkpoints)
            return 0, 0, None
        root, tag = found or (self.root, None)
        branch = checkpoint.abandoned_branch_of(self.work_dir, root) if tag else None
        if branch:
            # A step of a branch this work dir abandoned: that branch becomes the live one again
            # (its checkpoints up to the step back in checkpoints/; the live ones after the
            # branch point set aside), and is resumed as the work dir's own.
            folder, after = branch
            left = checkpoint.bring_back_branch(self.work_dir, folder, after, tag) if distributed.is_main() else None
            left = distributed.from_main(left)
            self.brought_back = int(checkpoint.TAG_RE.match(after).group(1))
            self.report(f"resuming {tag} of the branch abandoned in {folder}: it is the live branch again (its "
                        f"checkpoints up to {tag} and their log rows are back in the work dir); "
                        + (f"the live branch after {after} was moved to {left} (nothing deleted)" if left else
                           f"the live branch had nothing after {after}"))
            root = self.root
        step, offset = self._load(root, tag) if tag else (0, 0)
        # Whatever the work dir holds beyond the checkpoint resumed from (a rollback's later
        # branch, damaged newer ones --resume auto passed over, or all of them when none was
        # good) moves aside: the run's own saves would otherwise overwrite them.
        set_aside = None
        if distributed.is_main():
            set_aside = checkpoint.set_aside_other_branch(self.work_dir, root, tag, partial=resume != 'auto')
        distributed.barrier()
        if branch:
            set_aside = left   # (what the log rows after the branch point go with)
        elif set_aside and tag and not checkpoint.is_own(self.work_dir, root):
            self.report(f"resuming {root}/{tag}, another run's checkpoint: this work dir's own checkpoints were "
                        f"moved to {set_aside} (nothing deleted)")
        elif set_aside and tag and resume != 'auto':
            self.report(f'resuming {tag} abandons a later branch: its checkpoints and log rows '
                        f'after step {step} were moved to {set_aside} (nothing deleted)')
        elif set_aside and tag:
            self.report(f'the damaged checkpoints passed over and the log rows after step {step} were moved '
                        f'to {set_aside} (nothing deleted)')
        elif set_aside:
            self.report(f"starting fresh: the earlier run's checkpoints, none of which verifies, were moved to "
                        f"{set_aside} (nothing deleted)")
        elif resume == 'auto' and not tag:
            self.report(f'--resume auto: no checkpoint in {self.root}; starting from step 0')
        if tag:
            best = self._best_of_live_branch if branch else self._best_of_resumed_run  # (its steps came back)
            kept = (best(step), self.kept_best_metric) if distributed.is_main() else None
            self.best, self.kept_best_metric = distributed.from_main(kept)
        return step, offset, set_aside

    def _best_of_resumed_run(self, step):
        """(score, step) of the checkpoint ``checkpoints/best`` names, at or before ``step``, its
        score read from eval.jsonl; None without one (never a best saved). A run resumed without
        save_best still reports the kept best, by the metric its marker records."""
        tag = checkpoint.read_pointer(self.root, 'best')
        if tag is None or not checkpoint.is_complete(self.root, tag):
            # A rollback past the best moved it (and its pointer) to abandoned/, or the run kept none
            # (save_best given on resume): the best is the live branch's checkpointed evaluations',
            # else the first lower score of the new branch became "best".
            return self._best_of_live_branch(step)
        metric = self.best_metric or checkpoint.read_marker(os.path.join(self.root, tag)).get('best_metric')
        best_step = int(checkpoint.TAG_RE.match(tag).group(1))
        if metric is None or best_step > step or not os.path.isfile(os.path.join(self.work_dir, 'eval.jsonl')):
            return None
        self.kept_best_metric = metric
        for row in self._eval_rows():
            if row.get('step') == best_step and row.get(metric) is not None:
                return float(row[metric]), best_step
        return None

    def _eval_rows(self):
        """The rows of the work dir's eval.jsonl, in order (none where it is missing)."""
        path = os.path.join(self.work_dir, 'eval.jsonl')
        if not os.path.isfile(path):
            return
        with open(path) as f:
            for line in f:
                try:
                    yield json.loads(line)
                except ValueError:  # a line cut short by a full disk
                    continue

    def _best_of_live_branch(self, step):
        """(score, step) of the best train.save_best score in eval.jsonl at or before ``step`` whose
        step has a complete checkpoint (the first of equal scores, as an uninterrupted run keeps
        it), with ``checkpoints/best`` pointed at it; None where there is none."""
        if not self.best_metric:
            return None
        best = None
        for row in self._eval_rows():
            score, at = row.get(self.best_metric), row.get('step')
            if (isinstance(score, (int, float)) and isinstance(at, int) and at <= step
                    and (best is None or score > best[0])
                    and checkpoint.is_complete(self.root, checkpoint.tag_for(at))):
                best = (float(score), at)
        if best is not None:
            checkpoint.write_pointer(self.root, 'best', checkpoint.tag_for(best[1]))
            self.report(f'checkpoints/best: step {best[1]} ({self.best_metric} {best[0]:.4f}), the best checkpointed '
                        'evaluation of the steps resumed from')
        return best

    def _load(self, root, tag):
        try:
            return self._load_checked(root, tag)
        except checkpoint.UnsafeFileError as exc:  # nothing in it ran; one line, not a traceback
            raise ConfigError(f'--resume: {exc}') from exc

    def _load_checked(self, root, tag):
        marker = checkpoint.read_marker(os.path.join(root, tag))
        spec = self.spec
        reshard.remove_leftover_copies(root)
        resharded = reshard.needed(marker, spec.world_size)  # another number of ranks (ds_seg/engine/reshard.py)
        state = reshard.load(self.backend, root, tag, marker) if resharded else self.backend.load(root, tag)
        saved = dict(micro_batch=state.get('micro_batch', spec.micro_batch),
                     grad_accum=state.get('grad_accum', spec.grad_accum),
                     world_size=marker.get('world_size') or spec.world_size)
        # The data stream goes on after the samples already consumed, counted in this run's
        # micro-steps: another micro-batch on as many ranks re-read (or skipped) samples before.
        start, skipped = reshard.start_micro_step(int(state.get('micro_step', 0)), saved['micro_batch'],
                                                  saved['world_size'], spec.micro_batch, spec.world_size)
        offset = start - int(state['step']) * spec.grad_accum
        if saved != dict(micro_batch=spec.micro_batch, grad_accum=spec.grad_accum, world_size=spec.world_size):
            self.report(reshard.describe(saved, spec.world_size, spec.micro_batch, spec.grad_accum,
                                         spec.global_batch, skipped, marker.get('zero_stage') if resharded else None))
        torch.set_rng_state(state['rng_cpu'])
        if state.get('rng_cuda') is not None and spec.device.type == 'cuda':
            torch.cuda.set_rng_state(state['rng_cuda'])
        step = int(state['step'])
        self.restored_log_window = state.get('log_window')
        self.earlier_wall_time_s = float(state.get('wall_time_total_s') or 0.0)  # (0: saved before it was kept)
        self.report(f'resumed from {root}/{tag} at step {step}')
        if 'schedule' in marker:  # recorded since; a resume without a scheduler is refused above
            self._say_schedule_change(marker['schedule'], marker.get('base_lr', _base_lr(self.spec.ds_config)), step)
        return step, offset

    def _say_schedule_change(self, saved, saved_lr, step):
        """A resume may change the LR schedule (its parameters are this run's, see
        param_groups.apply_schedule_now): one line says what changed and the LR it goes on at.
        A smoke test's shortened warmup, resumed with a longer train.max_steps, re-derives it
        from the JSON: the LR went back into warmup without a word. The optimizer's ``lr`` is part
        of it (WarmupCosineLR scales it; twice the lr trained at twice the LR, unsaid)."""
        now, lr = self.spec.ds_config.get('scheduler'), _base_lr(self.spec.ds_config)
        if saved == now and saved_lr == lr:
            return
        said = []
        if not saved or not now or saved.get('type') != now.get('type'):
            said.append(f"{(saved or {}).get('type', 'none')} -> {(now or {}).get('type', 'none')}")
        else:
            old, new = saved.get('params') or {}, now.get('params') or {}
            said += [f"{k} {old.get(k, '(default)')} -> {new.get(k, '(default)')}"
                     for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if saved_lr != lr:
            said.append(f'optimizer.params.lr {saved_lr} -> {lr}')
        said = ', '.join(said)
        self.report(f"--resume: the LR schedule is not the checkpoint's ({said}); from step {step + 1} it follows "
                    f"this run's: LR {self.backend.lr():.3g} at step {step + 1}")

    def check_compatible(self, root, tag):
        """Refuse, before loading anything, a checkpoint this run cannot continue."""
        where = os.path.join(root, tag)
        marker = checkpoint.read_marker(where)
        model = marker.get('model') or {}
        if model.get('type') not in (None, self.cfg.model.type):
            raise ConfigError(f"--resume: {where} holds a {model['type']} model but the config builds "
                              f"{self.cfg.model.type}; use a matching --config or a new --work-dir.")
        classes = marker.get('classes')
        if classes is not None and len(classes) != self.train_set.num_classes:
            raise ConfigError(f"--resume: {where} was trained for {len(classes)} classes but the data has "
                              f"{self.train_set.num_classes}; start a new run (load_from= an exported file "
                              "cannot help either: the classifier shape differs).")
        refusal = self._check_data(marker, classes, where)  # may adopt the checkpoint's statistics
        if refusal:
            raise ConfigError(refusal)
        if marker.get('backend') != self.spec.backend:
            raise ConfigError(f"--resume: {where} is a {marker.get('backend')} checkpoint but this run uses "
                              f"--backend {self.spec.backend}; export it (launch/export.py) and use load_from=.")
        saved, now = marker.get('optimizer'), optimizer_family(self.spec.ds_config)
        if saved is not None and saved != now:  # checkpoints from before this was recorded: not checked
            raise ConfigError(f"--resume: {where} holds the state of optimizer {saved!r} but the DeepSpeed config "
                              f"uses {now!r}; its state cannot carry over: export it (launch/export.py) and use "
                              "load_from= to start the new optimizer from its weights.")
        saved_params = marker.get('optimizer_params')  # None: a checkpoint from before this was recorded
        scheduler = self.spec.ds_config.get('scheduler')
        if saved_params is not None and 'lr' in saved_params and scheduler:  # an lr is recorded without one
            # Its schedule would start over at its first step (DeepSpeed failed loading the state).
            raise ConfigError(f"--resume: {where} was trained without an LR scheduler, but the DeepSpeed config has "
                              f"one ({scheduler.get('type')}): it would start over at its first step. Resume without "
                              "it, or start a new run from its weights (launch/export.py, then load_from=).")
        if marker.get('schedule') and not scheduler:
            lr = (self.spec.ds_config.get('optimizer') or {}).get('params', {}).get('lr')
            raise ConfigError(f"--resume: {where} was trained with an LR scheduler, but the DeepSpeed config has "
                              f"none (its scheduler block was removed): the restored optimizer state keeps the "
                              f"schedule's last LR and optimizer.params.lr={lr!r} would never apply. Resume with "
                              "the scheduler block, or start a new run from its weights (launch/export.py, then "
                              "load_from=).")
        if saved_params is not None:
            now = restored_hyperparameters(self.spec.ds_config)
            # A key the checkpoint does not record (written before a default was made explicit, or
            # a scheduled lr: refused above when the schedule is gone) is not compared.
            keys = [k for k in (*STATE_HYPERPARAMETERS, 'lr') if k in now and k in saved_params
                    and saved_params[k] != now[k]]
            if keys:
                said = ', '.join(f"{k} {saved_params[k]!r} -> {now[k]!r}" for k in keys)
                raise ConfigError(f"--resume: {where} holds optimizer state with its own {', '.join(keys)}, which a "
                                  f"resume restores, but the DeepSpeed config changes them ({said}): they would be "
                                  "recorded and never applied. Resume with the checkpoint's values, or start a new "
                                  "run from its weights (launch/export.py, then load_from=).")
        refusal = self.backend.resume_refusal(marker, where)
        if refusal:
            raise ConfigError(refusal)
        refusal = self._check_param_groups(marker, where)
        if refusal:
            raise ConfigError(refusal)
        mine = json.loads(json.dumps(_model_dict(self.cfg.model), default=str))  # tuples as the marker's lists
        show = lambda cfg, k: repr(cfg[k]) if k in cfg else '(default)'  # noqa: E731
        differing = [k for k in sorted(set(model) | set(mine)) if model and model.get(k) != mine.get(k)]
        saved_shapes = marker.get('param_shapes')
        if saved_shapes is not None:
            now = self.param_shapes()
            differ = [n for n in sorted(set(saved_shapes) | set(now)) if saved_shapes.get(n) != now.get(n)]
            if differ:
                keys = [f'{k}={show(model, k)} there, {show(mine, k)} here' for k in differing]
                shown = ', '.join(f'{n} {saved_shapes.get(n)} vs {now.get(n)}' for n in differ[:3])
                raise ConfigError(f"--resume: {where} holds a differently shaped model "
                                  f"({'; '.join(keys) or shown}); {len(differ)} tensor(s) differ, e.g. {shown}. "
                                  "Use the config it was trained with, or a new --work-dir.")
        changed = [f'model.{k} {show(model, k)} there, {show(mine, k)} here' for k in differing]
        if changed:  # the same shapes (drop_path_rate, say): it may go on, but not unsaid
            self.report(f"--resume: {where} was trained with another model config ({'; '.join(changed)}); the run "
                        "goes on with this config's")

    def _check_param_groups(self, marker, where):
        """The refusal line for a checkpoint whose optimizer groups are not this run's, or None.
        A resume restores each group's settings (``lr_mult``, ``weight_decay``) from the optimizer
        state: another ``backbone_lr_mult`` was recorded and never applied, and another grouping
        (``layer_decay``, ``no_weight_decay``) failed inside DeepSpeed's loader with a traceback."""
        if 'param_groups' not in marker:  # a checkpoint from before this was recorded: not checked
            return None
        saved, now = marker['param_groups'], self.backend.param_group_layout
        if saved == now:
            return None
        old, new = marker.get('optim') or {}, _model_dict(self.cfg.get('optim') or {})
        old, new = dotted(old), dotted(new)
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        said = ', '.join(f'optim.{k} {old.get(k, "(default)")!r} there, {new.get(k, "(default)")!r} here'
                         for k in keys) or _first_group_difference(saved, now)
        return (f"--resume: {where} was trained with other optimizer parameter groups ({said}); its optimizer "
                "state holds each group's learning-rate multiplier and weight decay, which a resume restores. "
                "Resume with the checkpoint's optim settings, or start a new run from its weights "
                "(launch/export.py, then load_from=).")

    def _check_data(self, marker, classes, where):
        """The refusal line for a checkpoint trained on other data, or None (after adopting its
        statistics where only computed ones differ). A resumed run goes on training the same
        model on the same inputs: other class names,
        another pixel type or band selection, or other normalisation statistics (the data set
        was changed, or its statistics recomputed) would change what the weights mean mid-run
        and leave the checkpoint describing neither."""
        fresh = "start a new run from its weights instead (launch/export.py, then load_from=)"
        now = list(self.train_set.classes)
        if classes is not None and list(classes) != now:
            return (f"--resume: {where} was trained with classes {', '.join(classes)} but data.train has "
                    f"{', '.join(now)}; give the same `classes` (in the same order), or {fresh}.")
        saved, mine = marker.get('data') or {}, data_normalisation(self.train_set)
        if saved.get('synthetic_seed') is not None and mine.get('synthetic_seed') is not None \
                and saved['synthetic_seed'] != mine['synthetic_seed']:
            # train.seed generates the synthetic scenes: another resumed on other training and
            # validation scenes (mIoU 0.11 -> 0.0003 at the next evaluation), said only as changed statistics.
            return (f"--resume: {where} was trained on the synthetic scenes of train.seed={saved['synthetic_seed']}, "
                    f"and train.seed={mine['synthetic_seed']} generates others (for training and validation); "
                    f"resume with train.seed={saved['synthetic_seed']}, or {fresh}.")
        if saved.get('dtype') and mine['dtype'] and saved['dtype'] != mine['dtype']:
            return (f"--resume: {where} was trained on {saved['dtype']} pixels but data.train holds {mine['dtype']}; "
                    f"resume on the data it was trained on, or {fresh}.")
        if saved.get('bands') is not None and list(saved['bands']) != mine['bands']:
            return (f"--resume: {where} was trained on bands {saved['bands']} but data.train takes {mine['bands']}; "
                    f"give data.train.bands={saved['bands']}, or {fresh}.")
        # How label files become classes (label_map, reduce_zero_label, palette): another mid-run
        # relabels the data under the same class names (file value 0 trained c1, then c0).
        # (Checkpoints written before an identity label_map was dropped from the record still hold it.)
        saved_decoding = effective_label_decoding(saved.get('label_decoding'), len(now))
        mine_decoding = json.loads(json.dumps(effective_label_decoding(mine.get('label_decoding'), len(now))))
        if saved_decoding != mine_decoding:
            said = lambda decoding: ', '.join(f'{k}={v}' for k, v in decoding.items()) if decoding else \
                'the label files as class indices'  # noqa: E731
            return (f"--resume: {where} was trained decoding labels with {said(saved_decoding)} but data.train "
                    f"decodes them with {said(mine_decoding)}; give data.train the checkpoint's, or {fresh}.")
        if saved.get('encoding') and mine.get('encoding') and saved['encoding'] != mine['encoding']:
            return (f"--resume: {where} was trained on bands scaled/offset {saved['encoding']} but data.train's are "
                    f"{mine['encoding']} ([scale, offset] per band, the files' GDAL tags); resume on data in the "
                    f"encoding it was trained on, or {fresh}.")
        if colours_conflict(mine.get('colours'), saved.get('colours')):
            return (f"--resume: {where} was trained on bands holding {colours_said(saved['colours'])} but data.train's "
                    f"hold {colours_said(mine['colours'])} by its files' colour interpretation; select the bands in the "
                    f"order it was trained on, or {fresh}.")
        differ = [key for key in ('mean', 'std') if saved.get(key) is not None and (
            len(saved[key]) != len(mine[key]) or not np.allclose(saved[key], mine[key], rtol=1e-5, atol=1e-6))]
        if not differ:
            return None
        given = [key for key in differ if self.cfg.data.train.get(key) is not None]
        if given:
            key = given[0]
            return (f"--resume: {where} normalised its inputs with data.train.{key}={_short(saved[key])} but the "
                    f"config gives {_short(mine[key])}; leave data.train.{key} out (the checkpoint's is used) to "
                    f"continue it, or {fresh}.")
        # Statistics the dataset computed (or read from stats.json): another version of ds_seg, or
        # more scenes, may compute others; the weights were trained on the checkpoint's.
        if len(saved['mean']) != len(mine['mean']) or len(saved.get('std', ())) != len(mine['std']):
            return (f"--resume: {where} normalised {len(saved['mean'])} input channel(s) but data.train has "
                    f"{len(mine['mean'])}; resume on the data it was trained on, or {fresh}.")
        self.train_set.use_statistics(saved['mean'], saved['std'])
        self.report(f"--resume: data.train's computed statistics (mean {_short(mine['mean'])}, std "
                    f"{_short(mine['std'])}) differ from those {where} was trained with; continuing with the "
                    "checkpoint's")
        return None

    def last_complete(self):
        return checkpoint.find_latest(self.root)
