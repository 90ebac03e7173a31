"""The training loop. Read it top to bottom: ``__init__`` builds, ``fit`` loops, ``train_step``
does one optimizer step, ``evaluate`` measures. No hooks.

The parts own their concerns: the run description is resolved once (run_spec.py), the engine sits
behind one interface (backend.py), the checkpointer decides when and what to save and how to
resume (checkpointer.py), the run metrics time, log and summarise (run_metrics.py), and faults.py
owns signals, heartbeats, exit codes and failure classes.

Tensor names carry their layout: ``images_BCHW`` (batch, channels, height, width),
``labels_BHW``, ``logits_BKHW`` (K classes).
"""
import contextlib
import functools
import math
import os
import shutil
import time

import torch

from .. import distributed
from ..config import ConfigError, default_work_dir, load_from_refusal, unused_settings, with_absolute_data_paths
from ..data.loader import build_train_loader
from ..data.geotiff import content_keys
from ..data.raster import band_colours, colour_order_refusal, colours_conflict, colours_said, same_units
from ..data.prefetch import DevicePrefetcher, default_depth
from ..data.preprocess import BatchPreprocessor
from ..inference.model import native_input_size, window_refusal
from ..inputs import as_invoked, check_writable
from ..metrics import metrics_from_confusion
from ..models.common import meta_device
from ..models.losses import segmentation_loss
from ..models.pretrained import has_pretrained, without_pretrained
from ..registry import DATASETS, LOSSES, MODELS, RegistryError, arguments, build, lookup
from ..telemetry import RunLog, image_flops, peak_flops
from . import backend as backends
from . import checkpoint, param_groups
from .checkpointer import Checkpointer, data_normalisation
from .faults import USER_STOPS, CheckSchedule, Faults, describe_io_error
from .run_metrics import RunMetrics
from .run_spec import describe_run, with_monitors_in
from .speed import channels_last_for
from .workdir import WorkDirBusy, WorkDirLock, check_work_dir_entries

# Steps a compiled run keeps out of its throughput whatever train.warmup_log_steps says: the first
# compiles forward and backward, the second may recompile (gradient accumulation, DDP's sync flag).
COMPILE_WARMUP_STEPS = 2


def _first_missing(path):
    """The outermost folder of ``path`` that does not exist yet (what makedirs would create), or None."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _build_dataset(cfg, where, crop_size, seed):
    """Build a dataset; unreadable, missing or inconsistent files become one-line config errors."""
    try:
        return build(DATASETS, cfg, where=where, crop_size=crop_size, seed=seed)
    except (ConfigError, RegistryError):
        raise
    except (ValueError, OSError, RuntimeError) as exc:  # rasterio's errors derive from these
        raise ConfigError(f'{where} ({cfg.get("type")}): {exc}') from exc


def _image_files(scene):
    """A scene's image files (every date of a time series)."""
    image = scene.get('image')
    return [f for f in (image if isinstance(image, (list, tuple)) else [image]) if isinstance(f, str)]


def data_notes(train_set, val_set):
    """Lines for the start of training about the data as found: a benchmark split with tiles
    missing (a partial download), and validation scenes that are also training scenes (their
    scores are not held out: ``data.val.split='train'``, or one folder for both)."""
    notes = [f'data.{name}: {note}' for name, ds in (('train', train_set), ('val', val_set))
             for note in getattr(ds, 'notes', ())]
    sizes = [(s['height'], s['width']) for s in getattr(train_set, 'scenes', ()) if 'height' in s]
    crop = (getattr(train_set, 'crop_h', None), getattr(train_set, 'crop_w', None))
    if sizes and None not in crop and all(h < crop[0] or w < crop[1] for h, w in sizes):
        # Padded windows train, but a crop past every scene trains mostly on padding (ignored).
        h, w = max(sizes, key=lambda hw: min(hw[0], crop[0]) * min(hw[1], crop[1]))
        filled = min(h, crop[0]) * min(w, crop[1]) / (crop[0] * crop[1])
        notes.append(f'data.crop_size {crop[0]}x{crop[1]} is larger than every training scene (the largest '
                     f'{h}x{w}): at least {math.floor(1000 * (1 - filled)) / 10:g}% of each window is padding, ignored by the loss; '
                     'a crop_size within the scenes trains on more pixels per step')
    classes = getattr(train_set, 'num_classes', 0) or 0
    if classes > 255:  # it trained to the end, then predict.py refused it
        notes.append(f'data.train: {classes} classes: the run trains and evaluates, but predict.py writes uint8 class '
                     'maps (255 is their nodata), so it cannot run a model of more than 255 classes')
    if val_set is None:
        return notes
    # By content: a validation folder holding a copy of a training scene (cp), or a synthetic
    # data.val.split='train' generated into another cache folder, scored training scenes unsaid.
    files = [f for ds in (train_set, val_set) for scene in getattr(ds, 'scenes', ()) for f in _image_files(scene)]
    key_of = content_keys(files)
    keys = [{tuple(key_of[f] for f in _image_files(scene)) for scene in getattr(ds, 'scenes', ())}
            for ds in (train_set, val_set)]
    shared = keys[0] & keys[1] - {()}
    if shared:
        notes.append(f'data.val: {len(shared)} of its {len(keys[1])} scenes are also in data.train: '
                     'its scores are not held out')
    return notes


class _StoppedDuringEvaluation(Exception):
    """A stop signal agreed between two forwards of an evaluation (Trainer.evaluate)."""


def report(message):
    """One line for the user, from rank 0. (A function, not a method: the parts the trainer hands
    it to hold no reference back to the trainer.)"""
    if distributed.is_main():
        print(f'[ds_seg] {as_invoked(message)}', flush=True)


def fill_model_from_data(model_cfg, train_set, report):
    """Band count, class count and dates the model config leaves out are the training data's,
    recorded in config.json and checkpoints. The model's own defaults (3 bands, 6 classes)
    trained 5-class data to a traceback at the first evaluation, with no checkpoint written,
    and 4-band data was refused as a fault of the crop size."""
    accepted = arguments(lookup(MODELS, model_cfg.type, where='model.type')) or {}
    data_dates = getattr(train_set, 'num_dates', 1)
    filled = []
    for key, value in (('in_channels', train_set.in_channels), ('num_classes', train_set.num_classes),
                       ('num_dates', data_dates if data_dates > 1 else None)):
        if value is not None and key in accepted and model_cfg.get(key) is None:
            model_cfg[key] = value
            filled.append(f'{key}={value}')
    if filled:
        report(f"model: {', '.join(filled)} from data.train (not set in the model config)")


def refuse_rgb_weights_by_position(model_cfg, train_set):
    """Pretrained weights' first layer goes to the data's bands by position (RGB filters on bands
    1-3). Where the training files' colour tags say the red, green and blue bands are elsewhere
    (BGR files, RGB after a NIR band) and no ``model.band_map`` says otherwise, ImageNet's red
    filters ran on the blue band without a word: refused, with the band_map that puts each
    filter on its colour (``[0, 1, 2, ...]`` keeps position deliberately)."""
    colours = getattr(train_set, 'band_colours', None)
    if (not colours or not model_cfg.get('pretrained') or model_cfg.get('band_map') is not None
            or getattr(train_set, 'num_dates', 1) > 1
            or 'band_map' not in (arguments(lookup(MODELS, model_cfg.type, where='model.type')) or {})):
        return
    rgb = ('red', 'green', 'blue')
    where = {c: i for i, c in enumerate(colours) if c in rgb}
    if set(where) != set(rgb) or [where[c] for c in rgb] == [0, 1, 2]:
        return
    band_map = [rgb.index(c) if c in rgb else None for c in colours]
    said = ', '.join(f'{i + 1} {c}' for i, c in enumerate(colours) if c in rgb)
    raise ConfigError(f"model.pretrained: its first layer would go to the data's bands by position (the RGB "
                      f"filters on bands 1, 2, 3), but data.train's files tag bands {said}; set "
                      f"model.band_map={band_map} to put each filter on its colour (or band_map="
                      f"{[i if i < 3 else None for i in range(len(colours))]} to keep position)")


class Trainer:
    """Train ``cfg`` (an experiment config) with ``ds_config`` (a checked DeepSpeed dict).

    Example::

        cfg = load_config(None, ['train.max_steps=20'])
        trainer = Trainer(cfg, load_ds_config('ds_configs/zero2.json'), backend='deepspeed')
        summary = trainer.fit()
    """

    def __init__(self, cfg, ds_config, backend='deepspeed', work_dir=None, resume=None,
                 ds_config_source='DeepSpeed config'):
        self.cfg = cfg
        t_start = time.time()
        launcher = distributed.init(use_deepspeed=backends.backend_class(backend).uses_deepspeed_comm,
                                    timeout_s=cfg.train.get('dist_timeout_s'))
        self.spec = describe_run(ds_config, backend, cfg.train.max_steps, ds_config_source, launcher,
                                 compile_mode=cfg.train.compile_mode if cfg.train.get('compile') else None,
                                 channels_last=channels_last_for(cfg.model.type, cfg.train.get('channels_last')))
        self.rank, self.world_size, self.device = self.spec.rank, self.spec.world_size, self.spec.device
        self.work_dir = work_dir or default_work_dir(cfg)
        self.spec = with_monitors_in(self.spec, self.work_dir, ds_config_source)
        self.work_dir_by_default = not work_dir and not cfg.get('work_dir')
        self.exit_reason = 'running'
        self._state_memory_step = 1  # the step whose backward measures state memory (fit() sets it)
        self.error = None             # the one-line reason when the run stopped on an error
        self.step = 0                 # optimizer steps done
        self.micro_step_offset = 0    # data position - step x accumulation (non-zero after a change of ranks)
        # Built by _setup: log, train_set, val_set, criterion, backend, checkpointer, metrics;
        # by _start_loop: batches (on the device, preprocessed), profiler.
        self.log = self.train_set = self.val_set = self.criterion = self.backend = None
        self.checkpointer = self.metrics = self.batches = self.profiler = None
        # Rank 0 notes what it will create before any rank creates it: a rank that got there first
        # made the folder look like the user's, and a refused run left it behind.
        with distributed.main_process_first():
            created = _first_missing(self.work_dir) if distributed.is_main() else None
            check_writable(self.work_dir, '--work-dir', create=True)  # every rank: each writes checkpoint files
        self.lock = WorkDirLock(self.work_dir)
        self._take_work_dir()  # refused: another run's work dir (so not one this run created)
        try:
            self._setup(resume, t_start)
        except BaseException as exc:
            if self.log is not None:  # ends any tracker run already started
                self.log.close('interrupted' if isinstance(exc, KeyboardInterrupt) else 'refused')
            self.lock.release()  # a refused run leaves the work dir as it found it
            if created:  # ... and one it created, as if it had never run
                shutil.rmtree(created, ignore_errors=True)
            raise

    def _take_work_dir(self):
        """One run per work dir: rank 0 takes the lock, every rank learns whether it could."""
        failure = None
        if distributed.is_main():
            try:
                previous = self.lock.acquire()
                if previous:
                    self.print(f'took over the work-dir lock of a run that is gone ({previous})')
            except WorkDirBusy as exc:
                failure = str(exc)
        failure = distributed.first_failure(failure)
        if failure:
            if os.environ.get('SLURM_ARRAY_TASK_ID'):   # every task of an array given one WORK_DIR
                failure += (" (the tasks of a job array each need a work dir of their own: the sbatch templates "
                            "expand WORK_DIR='work_dirs/name-%a' per task)")
            raise ConfigError(f'--work-dir: {failure}')

    def _setup(self, resume, t_start):
        cfg, spec = self.cfg, self.spec
        # Every rank writes checkpoint files into it, and all agree: a folder one node cannot use
        # (node-local scratch not mounted there) stops every rank, none left waiting for it.
        try:
            failure = None
            check_work_dir_entries(self.work_dir)
        except ConfigError as exc:
            failure = str(exc)
        failure = distributed.first_failure(failure)
        if failure:
            raise ConfigError(failure)
        self.log = RunLog(self.work_dir, enabled=distributed.is_main())
        for note in (*spec.notes, *unused_settings(cfg)):
            self.print(note)
        if not cfg.train.checkpoint_interval and cfg.train.get('save_best'):
            self.print(f"train.checkpoint_interval=0: checkpoints are written at evaluations that improve "
                       f"train.save_best={cfg.train.save_best!r}, and where a signal stops the run; the last step's "
                       "weights are kept only where it is the best so far (give an interval to keep them)")
        elif not cfg.train.checkpoint_interval:  # a completed run kept no weights, and said nothing
            self.print('train.checkpoint_interval=0: no checkpoint is written unless a signal stops the run '
                       '(SIGUSR1, SIGTERM, SIGINT): the trained weights are not kept at its end; give an interval '
                       '(the max_steps keeps the last step) to keep them')
        # Which checkpoint a resume continues, and so whether load_from is read: before the data
        # (a missing load_from is refused before the datasets are scanned).
        found = checkpoint.resolve_resume(resume, self.work_dir, report=report)
        load_from = self._weights_to_load(cfg.get('load_from'), found)

        # --- data: rank 0 first, so one-off caches (synthetic scenes, band stats) are built once
        data_cfg = cfg.data
        with distributed.main_process_first():
            # data.random_scale: a per-step factor the train set derives from the micro-step (so
            # every rank agrees without communicating); None leaves the dataset's own setting.
            train_cfg = dict(data_cfg.train, **({'random_scale': data_cfg.random_scale}
                                                if data_cfg.get('random_scale') else {}))
            self.train_set = _build_dataset(train_cfg, 'data.train', data_cfg.crop_size, cfg.train.seed)
            self.val_set = (_build_dataset(data_cfg.val, 'data.val', data_cfg.crop_size, cfg.train.seed)
                            if data_cfg.get('val') else None)
        self._check_train_set_is_endless()
        for note in data_notes(self.train_set, self.val_set):
            self.print(note)
        if self.val_set is None and cfg.train.eval_interval and not cfg.train.get('save_best'):
            self.print('data.val: none (not given for this data, or None): the run does not evaluate, so it writes no '
                       'eval.jsonl; give data.val (a held-out set) for evaluations, train.save_best and evaluate.py')
        if cfg.train.get('save_best') and (self.val_set is None or not cfg.train.eval_interval):
            why = 'data.val is None' if self.val_set is None else 'train.eval_interval=0'
            raise ConfigError(f"train.save_best={cfg.train.save_best!r} keeps the checkpoint of the best evaluation, "
                              f"but this run evaluates nothing ({why}); give it evaluations, or leave save_best out.")
        self._check_model_matches_data()
        self._check_model_takes_windows()
        unused = self._check_model_output()
        self._check_windows_fit_in_memory()
        self._check_activations_fit_in_memory()
        # FLOPs of one crop, forward and training (MFU), on the meta model frozen as the run is.
        flops = image_flops(self._meta_model, (1, self.train_set.in_channels, data_cfg.crop_size, data_cfg.crop_size))
        self.__dict__.pop('_meta_built', None)  # the meta model served only the checks above
        self.criterion = build(LOSSES, cfg.loss, where='loss').to(self.device)
        self._check_loss_matches_classes()

        if param_groups.freeze_backbone_asked(cfg.get('optim')) and not (found or load_from or
                                                                        has_pretrained(cfg.model)):
            raise ConfigError('optim.paramwise.freeze_backbone=True: the backbone has no pretrained weights '
                              '(model.pretrained, or load_from=), so the heads would train on the features of '
                              'random filters; give it its weights, or leave freeze_backbone out.')

        # --- model: identical initial weights on every rank from the seed ---------------------
        # Resolved before the model is built: weights that come from a checkpoint (or load_from)
        # replace every pretrained tensor, so the pretrained file is not read. A requeued job
        # (--resume auto) whose pretrained file was purged from scratch, or is not on this node,
        # was refused although its checkpoint held every weight.
        model_cfg = without_pretrained(cfg.model) if found or load_from else cfg.model
        torch.manual_seed(cfg.train.seed)
        # Under ZeRO-3 parameters are partitioned as they are created: no rank holds the model.
        model = backends.build_model(spec, lambda: build(MODELS, model_cfg, where='model'))
        for module in model.modules():  # what each pretrained load took and adapted (models/pretrained.py)
            if getattr(module, 'pretrained_report', None):
                self.print(module.pretrained_report)
        if load_from:
            self._load_weights(model, load_from)
        frozen_line = param_groups.freeze_backbone(model, cfg.get('optim'))  # before a backend wraps it
        if frozen_line:
            self.print(frozen_line)
        if unused and spec.backend == 'ddp':
            self.print(f"model: {len(unused)} trained parameter(s) take no part in the loss ({', '.join(unused[:3])}"
                       f"{', ...' if len(unused) > 3 else ''}): DDP looks for them every step "
                       "(find_unused_parameters), a little slower")
        self.backend = backends.build_backend(spec, model, cfg.get('optim'), unused_parameters=unused)
        self.checkpointer = Checkpointer(self.work_dir, spec, self.backend, cfg, self.train_set, report)
        self.checkpointer.t_start = t_start
        self.checkpointer.check_resume(resume, found, work_dir_by_default=self.work_dir_by_default)
        # After the config, data, model and resume checks (a refused run leaves no MLflow/W&B run
        # behind, and an earlier run's status as it was), before the resume moves anything aside
        # (a tracker that cannot start refuses the run, and a refused run leaves the work dir as it
        # was). A resume logs on to its earlier steps' runs.
        # Another run's checkpoint (--resume other/checkpoints/step_N) continues that run's
        # lineage: this work dir's own logs and tracker runs are another one's, and are set aside
        # as a fresh run's are (its rows up to step N stayed live, followed by the other run's).
        own = bool(found) and checkpoint.of_this_run(self.work_dir, found[0])
        self._start_trackers(cfg, resumed=own)

        # --- resume ----------------------------------------------------------------------------
        self.step, self.micro_step_offset, set_aside = self.checkpointer.restore(resume, found)
        if own and not self.step:  # no checkpoint verified: a fresh start after all, in runs of its own
            self._start_trackers(cfg, resumed=False)
        if distributed.is_main():
            self.log.start(resumed_step=self.step if own and self.step else None, set_aside=set_aside,
                           brought_back=self.checkpointer.brought_back)
            self.log.record_tracker_runs()

        # --- telemetry -------------------------------------------------------------------------
        self.metrics = RunMetrics(spec, self.log, self.backend, report=report, flops_per_image=flops,
                                  peak_flops=peak_flops(self.device, cfg.train.get('peak_tflops')),
                                  warmup_steps=max(cfg.train.warmup_log_steps,
                                                   COMPILE_WARMUP_STEPS if spec.compile_mode else 0),
                                  max_steps=cfg.train.max_steps,
                                  train_images=len(self.train_set), t_start=t_start,
                                  earlier_wall_time_s=self.checkpointer.earlier_wall_time_s)
        record = with_absolute_data_paths(cfg.to_dict())
        listed = (cfg.get('custom_imports') or {}).get('imports') or []
        if self.checkpointer.custom_imports != list(listed):
            # A model registered by an import in the config file: evaluate.py of this config.json
            # (and any tool reading it) imports that module too.
            record['custom_imports'] = dict(cfg.get('custom_imports') or {}, imports=self.checkpointer.custom_imports)
        # ds_config.json first: its "ds_seg" block is what marks the pair as a run's
        # (workdir.check_work_dir_entries), so a run stopped between the two writes left no
        # config.json that the next run takes for the user's own.
        configs = {'ds_config.json': dict(spec.ds_config, ds_seg=spec.as_json()), 'config.json': record}
        if self.step and distributed.is_main():
            self.log.keep_replaced(configs)
        for name, obj in configs.items():
            self.log.write_json(name, obj)

    def _nonfinite_stop_message(self, longest, current):
        """What to do after a run of non-finite losses. The checkpoint saved at the step before
        the first of them holds the weights that gave it (the loss is taken before the update),
        so the one to go on from is the one before that."""
        root = self.checkpointer.root
        said = f'the loss was not finite for {longest} consecutive steps'
        first_bad = self.step - current + 1 if current else None
        tags = checkpoint.complete_tags(root)
        if not tags:
            return f'{said}; no checkpoint was written: lower the learning rate and start again, or check the data.'
        if first_bad is None or checkpoint.tag_for(first_bad - 1) not in tags:
            return (f'{said}; the last checkpoint ({os.path.join(root, tags[-1])}) is intact: go on from it with a '
                    'lower learning rate, or check the data.')
        earlier = [tag for tag in tags if tag < checkpoint.tag_for(first_bad - 1)]
        where = (f'go on from {earlier[-1]} with a lower learning rate (--resume {os.path.join(root, earlier[-1])}), '
                 'or check the data' if earlier else 'no checkpoint precedes it: lower the learning rate and '
                 'start again, or check the data')
        return (f'{said} (from step {first_bad}); the checkpoint of step {first_bad - 1} holds the weights that '
                f'gave the first of them: {where}.')

    # ------------------------------------------------------------------------------------------
    def fit(self):
        """Train until ``train.max_steps``; returns the summary written to ``summary.json``.

        Only *check steps* (:class:`CheckSchedule`'s, and log, evaluation and checkpoint steps)
        read anything back from the device or talk to the other ranks: that is where a stop
        signal or a run of non-finite losses is agreed on and acted upon.
        """
        t = self.cfg.train
        if self.step >= t.max_steps:
            kept = self.metrics.completed_summary(self.step)
            if kept is not None:  # a re-submitted or requeued job of a finished run: nothing to redo
                self.print(f'already at step {self.step} = train.max_steps: nothing to train; summary.json kept')
                self.exit_reason = 'completed'
                return kept
        # The optimizer state the measurement counts exists after the first step of a fresh run,
        # and from the start of a resumed one.
        self._state_memory_step = self.step or 1
        faults = self._start_loop()
        checks = CheckSchedule(t.get('stop_check_interval'), self.device, start_step=self.step)
        try:
            with self._classified_failures(faults):
                while self.step < t.max_steps:
                    log_now = (self.step + 1) % t.log_interval == 0 or self.step + 1 == t.max_steps
                    # This step's LR, read before its update moves the schedule on (a host float).
                    lr = self.backend.lr() if log_now else None
                    self.metrics.add_step(self.train_step(want_grad_norm=log_now))
                    self.step += 1
                    faults.after_step(self.step)
                    if log_now:
                        samples = self._data_position() * self.spec.micro_batch * self.world_size
                        self.metrics.log_window(self.step, samples_seen=samples, lr=lr)
                    evaluating, saving = self._evaluation_due(), self.checkpointer.due(self.step)
                    if not (log_now or evaluating or saving or checks.due(self.step)):
                        continue  # a plain step: nothing read back from the device, no collective
                    signalled, longest, current = faults.stop.agree(self.metrics.take_nonfinite_counts(),
                                                                    checks.seconds_per_step(self.step))
                    if longest >= t.max_nonfinite_steps:
                        self._stop('nonfinite_loss', self._nonfinite_stop_message(longest, current))
                        break
                    best = None
                    if evaluating and signalled and self.step < t.max_steps:
                        # The stop's checkpoint first: an evaluation of large scenes outlasts Slurm's
                        # wait before SIGKILL. (With the last step, the run's final one still runs.)
                        self.print(f'step {self.step}: the evaluation due is skipped: {faults.stop.describe()} '
                                   'stops the run')
                        evaluating = False
                    if evaluating:
                        record = self.evaluate(stop=None if signalled else faults.stop)
                        if record is None:   # a stop signal came during it: checkpointed now, as at a check step
                            signalled = True
                        best = record if record is not None and self.checkpointer.improves_best(record) else None
                    # A signal always checkpoints (its purpose), periodic ones when due, and a new best
                    # evaluation (train.save_best); never weights that may already be NaN: keep-N
                    # pruning would drop the good ones.
                    if current == 0 and (signalled or saving or best):
                        self.checkpointer.save(self.step, self._data_position(), best_record=best,
                                               log_window=self.metrics.window_state())
                    elif saving and not signalled:  # (a short run ended "completed" with no checkpoint, unsaid)
                        self.print(f'step {self.step}: no checkpoint: the loss was not finite for the last {current} '
                                   f'step(s), so the weights may be too; the last checkpoint is kept as it is')
                    if signalled and self.step >= t.max_steps and current == 0:
                        # The last step's checkpoint is the final one: the run's outcome is decided,
                        # so there is nothing to continue (a requeue would only say "steps N->N").
                        self.print(f'{faults.stop.agreed[0]} came with the last step: the run is complete, its final '
                                   'checkpoint saved; nothing to continue.')
                        self.exit_reason = 'completed'
                        break
                    if signalled:
                        self._stop('interrupted' if faults.stop.agreed[0] in USER_STOPS else 'preempted',
                                   f'on {faults.stop.describe()}: ' + (
                            'checkpoint saved; continue with --resume auto.' if current == 0
                            else 'no checkpoint (the loss was not finite).'))
                        break
                    checks.checked(self.step, faults.stop.slowest_step_s)
                else:
                    self.exit_reason = 'completed'
        finally:
            summary = self._end_loop(faults)
        return summary

    def _start_loop(self):
        t = self.cfg.train
        loader = build_train_loader(self.train_set, self.spec.micro_batch, self.rank, self.world_size,
                                    start_micro_step=self._data_position(),
                                    num_workers=self.cfg.data.num_workers)
        # Normalisation, nodata and flips happen on the device, after the (uint8) batch's copy,
        # for the next batches while this step runs (a side stream on CUDA).
        depth = self.cfg.data.get('prefetch_batches')
        # Starting a DataLoader iterator draws its workers' base seed from the global torch RNG. A
        # resumed run starts one after the checkpoint's RNG state is restored, the uninterrupted
        # run did so before that state was saved: one draw apart, every later dropout mask
        # differed (resume was exact only for models without dropout). The draw is put back.
        rng = torch.get_rng_state()
        batches = iter(loader)
        torch.set_rng_state(rng)
        self.batches = DevicePrefetcher(batches, BatchPreprocessor.for_dataset(self.train_set), self.device,
                                        default_depth(self.device) if depth is None else depth)
        self.print(f'training {self.cfg.model.type} | {self.spec.describe()} | steps {self.step}->{t.max_steps}'
                   f' | {self.work_dir}')
        self.backend.train()
        self.metrics.start_loop(self.step, self.checkpointer.restored_log_window)
        self.profiler = self._profiler()
        return Faults(self.step)

    def _end_loop(self, faults):
        # Dropping the loader's iterator stops its worker processes now. Left to interpreter exit,
        # multiprocessing would terminate() them with SIGTERM, which workers ignore (it is meant
        # for their rank: ds_seg.data.loader), and wait for them forever.
        self.batches = None
        if self.profiler is not None:
            self.profiler.stop()
        faults.close()
        return self.metrics.write_summary(self.exit_reason, self.step, self.error, describe_io_error,
                                          best=self.checkpointer.best_summary())

    def _data_position(self):
        """Micro-steps of the data stream consumed (in this run's micro-batches, on all ranks)."""
        return self.step * self.spec.grad_accum + self.micro_step_offset

    def _evaluation_due(self):
        t = self.cfg.train
        return self.val_set is not None and bool(t.eval_interval) and (
            self.step % t.eval_interval == 0 or self.step == t.max_steps)

    def _stop(self, exit_reason, why):
        self.exit_reason = exit_reason
        self.print(f'stopping at step {self.step}' + (' ' if why.startswith('on ') else ': ') + why)

    @contextlib.contextmanager
    def _classified_failures(self, faults):
        """A lost rank and a failed write leave the loop as LostRankError / RunIOError (their exit
        codes); anything else as itself. ``exit_reason`` says which, for summary.json."""
        try:
            yield
        except Exception as exc:
            self.exit_reason, error, self.error = faults.classify(exc, self.step, self.checkpointer.last_complete)
            if error is exc:
                raise
            raise error from exc
        except KeyboardInterrupt:  # a second Ctrl-C (faults.StopRequests): stop at once
            self.exit_reason = 'interrupted'
            raise
        except BaseException:
            self.exit_reason = 'error'
            raise

    def _profiler(self):
        """A started torch.profiler recording ``train.profile_steps`` steps after the warm-up into
        ``<work_dir>/profile/`` (one trace per rank; TensorBoard or Perfetto), or None. Profiled
        steps are slower: their throughput figures are not comparable with unprofiled runs."""
        steps = int(self.cfg.train.get('profile_steps') or 0)
        if steps <= 0:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == 'cuda' else [])
        prof = profile(activities=activities, profile_memory=True, record_shapes=True,
                       schedule=schedule(wait=max(0, self.cfg.train.warmup_log_steps - 1), warmup=1,
                                         active=steps, repeat=1),
                       on_trace_ready=self._write_profile)
        prof.start()
        return prof

    def _write_profile(self, prof):
        """The trace (TensorBoard / Perfetto) and ``rank<R>_ops.txt``: the operators ranked by
        their own device time (CPU time on a CPU), which says where a step's time goes without a viewer."""
        from torch.profiler import tensorboard_trace_handler
        folder = os.path.join(self.work_dir, 'profile')
        tensorboard_trace_handler(folder, worker_name=f'rank{self.rank}')(prof)
        sort_by = 'self_device_time_total' if self.device.type == 'cuda' else 'self_cpu_time_total'
        table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70)
        with open(os.path.join(folder, f'rank{self.rank}_ops.txt'), 'w') as f:
            f.write(table + '\n')

    def train_step(self, want_grad_norm=False):
        """One optimizer step = ``grad_accum`` micro-batches. Returns the mean loss, on the device
        (nothing here waits for the device: see faults.py for where the loop does)."""
        timer, grad_accum = self.metrics.timer, self.spec.grad_accum
        timer.start()
        loss_total = torch.zeros((), device=self.device)
        for _ in range(grad_accum):
            images_BCHW, labels_BHW = next(self.batches)
            timer.data_wait(self.batches.wait_s)
            logits_BKHW = self.backend.forward(images_BCHW)
            loss = segmentation_loss(self.criterion, logits_BKHW, labels_BHW)  # + auxiliary heads
            self.backend.backward(loss)
            if self.step == self._state_memory_step and self.backend.is_boundary():
                self.metrics.measure_state_memory()
            self.backend.step(want_grad_norm=want_grad_norm)
            loss_total += loss.detach().float()
        images = self.spec.micro_batch * grad_accum * self.world_size
        timer.stop(images=images, pixels=images * images_BCHW.shape[-2] * images_BCHW.shape[-1])
        if self.profiler is not None:
            self.profiler.step()
        return loss_total / grad_accum

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, stop=None):
        """Whole validation scenes through the same sliding-window code as launch/predict.py
        (ds_seg.inference), bands of rows split across ranks with equal forward counts; one
        all-reduced confusion matrix gives per-class IoU/F1, mIoU and OA (never an average of
        rank mIoUs). ``stop`` (the loop's StopRequests): a stop signal is agreed before each forward
        (every rank makes the same number), and one that comes cuts the evaluation short: None is
        returned, nothing recorded. An evaluation of a large scene takes minutes, and the
        checkpoint came after it, long past Slurm's SIGKILL."""
        from ..inference import evaluate_scenes
        self.backend.sync_buffers()
        self.backend.eval()
        forward = self.backend.forward
        if stop is not None:
            no_counts = torch.zeros(2, dtype=torch.int64)

            @functools.wraps(self.backend.forward)   # the model's input multiple is found through it
            def forward_unless_stopped(x):
                if stop.agree(no_counts, stop.slowest_step_s)[0]:   # a gloo all-reduce: no device wait
                    raise _StoppedDuringEvaluation
                return self.backend.forward(x)
            forward = forward_unless_stopped
        d = self.cfg.data
        tile = d.get('eval_tile') or d.crop_size
        overlap = d.get('eval_overlap')
        norm = data_normalisation(self.train_set)
        # The validation set's padding/nodata label, which every loss (each CombinedLoss member
        # included) was checked to share: a CombinedLoss has no ignore_index of its own, and the
        # 255 it defaulted to made a run with ignore_index=250 crash at its first evaluation.
        ignore_index = getattr(self.val_set, 'ignore_index', None)
        if ignore_index is None:
            ignore_index = self.cfg.loss.get('ignore_index', 255)
        try:
            result = evaluate_scenes(
                forward, self.val_set, num_classes=self.val_set.num_classes,
                # the training set's statistics: the model saw inputs normalised with them
                mean=norm['mean'], std=norm['std'], bands=self.val_set.bands,
                ignore_index=ignore_index, tile=tile,
                overlap=tile // 4 if overlap is None else overlap,
                batch_size=d.get('eval_batch_size') or self.spec.micro_batch, device=self.device)
        except _StoppedDuringEvaluation:
            self.print(f'step {self.step}: {stop.describe()} came during the evaluation: it is cut short and not '
                       'recorded; checkpointing now')
            return None
        finally:
            self.backend.train()
        return self.metrics.log_eval(self.step, metrics_from_confusion(result['confusion'], self.val_set.classes))

    # ------------------------------------------------------------------------------------------
    def _weights_to_load(self, load_from, found):
        """``load_from`` where this run reads it; None for a resume, whose checkpoint holds every
        weight (it was read, then replaced by the checkpoint's, and a requeued job whose file had
        been purged from scratch was refused)."""
        if not load_from:
            return None
        if found:
            self.print(f"load_from={load_from} is not read: the run resumes from {os.path.join(*found)}, which "
                       "holds every weight")
            return None
        refusal = load_from_refusal(load_from)
        if refusal:
            raise ConfigError(refusal)
        return load_from

    def _load_weights(self, model, path):
        try:
            payload = checkpoint.load_weights_file(path, folder_taken=False)
        except ValueError as exc:  # unreadable, not a ds_seg weights file, or carrying code
            message = str(exc)
            raise ConfigError(message if message.startswith('load_from') else f'load_from: {message}') from exc
        # Weights trained on BGR-tagged files fine-tuned on RGB-tagged ones: their first layer saw
        # the colours swapped, without a word (predict.py refuses the same pair).
        trained_colours = (payload.get('data') or {}).get('colours')
        mine = getattr(self.train_set, 'band_colours', None)
        if colours_conflict(mine, trained_colours):
            raise ConfigError(f"load_from: {path} was trained on bands holding {colours_said(trained_colours)} by their "
                              f"files' colour tags, but data.train's hold {colours_said(mine)}: its first layer would see "
                              "the colours swapped; select data.train.bands in the weights' order, or correct "
                              "the files' tags if they are wrong")
        # Fine-tuning for another class set (mmseg's load_from does the same, with a warning per
        # tensor): the classifier tensors, whose first dimension is the class count, keep their
        # fresh initialisation; any other difference is another architecture and is refused.
        weight_classes, run_classes = len(payload.get('classes') or []), self.train_set.num_classes
        fresh = []

        def keep_fresh_classifier(key, value, shape):
            if (weight_classes and weight_classes != run_classes and value.dim() == len(shape)
                    and (value.shape[0], shape[0]) == (weight_classes, run_classes)
                    and tuple(value.shape[1:]) == tuple(shape[1:])):
                fresh.append(key)
                return None
            raise ValueError(f'{key}: shape {tuple(value.shape)} in the weights, {tuple(shape)} in the model.')

        try:
            missing, unexpected = backends.load_weights(self.spec, model, payload['state_dict'],  # ZeRO-3 too
                                                        adapt=keep_fresh_classifier)
        except ValueError as exc:  # a tensor of another shape: another model size or band count
            raise ConfigError(f"load_from: {path} does not fit model {self.cfg.model.type}: {exc} "
                              f"load_from needs weights of the same architecture (the class count may "
                              f"differ: the classifier then starts fresh).") from exc
        if missing or unexpected:
            raise ConfigError(f"load_from: {path} does not fit model {self.cfg.model.type}: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}.")
        named, mine = list(payload.get('classes') or []), list(self.train_set.classes)
        if fresh:
            self.print(f'loaded weights from {path}; its {weight_classes} classes are not this run\'s '
                       f'{run_classes}, so the classifier ({", ".join(fresh)}) starts fresh')
        elif named and named != mine:
            # As many classes under other names or in another order: the classifier's channel i
            # is the file's class i, whatever this run calls it.
            hint = ("; give data.train.classes in the file's order to keep their meaning"
                    if sorted(named) == sorted(mine) else '')
            self.print(f"loaded weights from {path}; its classes ({', '.join(named)}) are not this run's "
                       f"({', '.join(mine)}): output channel i keeps the file's class i{hint}")
        else:
            self.print(f'loaded weights from {path}')

    def _check_train_set_is_endless(self):
        mode = getattr(self.train_set, 'mode', 'random')
        if mode != 'random':
            # The training stream is endless; a grid yields each window once and answers every
            # later index with all-ignore padding (meant for evaluation shards): the run went on
            # at loss 0 after its first pass. Grid mode is the default for any split but 'train'
            # (mmseg's ADE20K folders are called 'training').
            split = getattr(self.train_set, 'split', None)
            why = f"mode={mode!r}" if self.cfg.data.train.get('mode') else f"split={split!r} is not 'train'"
            raise ConfigError(f"data.train reads windows in {mode} mode ({why}): a grid gives each window once, "
                              f"then only ignored padding, so training would stop learning after "
                              f"{len(self.train_set)} samples; set data.train.mode='random'.")

    def _check_model_matches_data(self):
        m = self.cfg.model
        for key in ('in_channels', 'num_classes', 'num_dates'):  # '6' read as 6 below: "is 6 but ... has 6"
            if isinstance(m.get(key), str):
                raise ConfigError(f"model.{key}: {m[key]!r} is a string, not a number; write it without quotes.")
        fill_model_from_data(m, self.train_set, self.print)
        refuse_rgb_weights_by_position(m, self.train_set)
        if m.get('in_channels') is not None and m.in_channels != self.train_set.in_channels:
            raise ConfigError(f"model.in_channels is {m.in_channels} but data.train yields "
                              f"{self.train_set.in_channels} band(s); set model.in_channels="
                              f"{self.train_set.in_channels} or select bands in the dataset.")
        data_dates = getattr(self.train_set, 'num_dates', 1)
        # A plain file may stack every date's bands; a list of one date says it is one date (its
        # bands were read as the model's dates without a word).
        said = data_dates > 1 or getattr(self.train_set, 'dates_listed', False)
        if m.get('num_dates') is not None and said and m.num_dates != data_dates:
            raise ConfigError(f"model.num_dates is {m.num_dates} but the scenes of data.train have "
                              f"{data_dates} dates; set model.num_dates={data_dates} (and model.in_channels="
                              f"{self.train_set.in_channels}) or give {m.num_dates} dates per scene.")
        absent = getattr(self.train_set, 'rare_class_absent', ())
        if absent:
            self.print(f"data.train.sampling='rare_class': no labelled pixel of {', '.join(map(repr, absent))} "
                       f"in the training labels; never drawn (rare-class sampling can only pick classes "
                       f"that occur)")
        if self.train_set.num_classes < 2:
            # Softmax over one class is 1 everywhere: loss 0 and mIoU 1 whatever the model does, so
            # such a run "trains" and reports perfection. Binary is two classes here (softmax).
            raise ConfigError(f"data.train has one class ({', '.join(self.train_set.classes)}): the loss is 0 and "
                              f"mIoU 1 whatever the model learns; segmentation needs at least 2 classes: give "
                              f"classes=('background', {self.train_set.classes[0]!r}) with background pixels "
                              f"labelled 0 (label_map can remap file values).")
        # The sets agree first: where data.val has more classes than the training labels show
        # (classes inferred from them), its message gives the fix; model.num_classes set to the
        # training set's count would be refused next.
        if self.val_set is not None:
            self._check_val_matches_train()
        if m.get('num_classes') is not None and m.num_classes != self.train_set.num_classes:
            binary = (' (binary segmentation is 2 classes here, with a softmax, not one sigmoid output)'
                      if m.num_classes == 1 else '')
            raise ConfigError(f"model.num_classes is {m.num_classes} but data.train has "
                              f"{self.train_set.num_classes} classes ({', '.join(self.train_set.classes)}); "
                              f"set model.num_classes={self.train_set.num_classes}{binary}.")

    def _check_windows_fit_in_memory(self):
        """A batch of training windows, or of evaluation tiles, larger than this machine's memory
        (data.crop_size 10^6, a micro-batch of 10^9) trained until the allocation failed: a numpy
        traceback at the first step, or at the first evaluation with the steps before it lost.
        A guard against sizes off by orders of magnitude: it counts one batch per local rank, not
        the batches loader workers prefetch nor what else the machine runs."""
        try:
            memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
        except (AttributeError, ValueError, OSError):  # not a POSIX system: nothing to compare with
            return
        d, channels = self.cfg.data, self.train_set.in_channels
        batches = {('data.crop_size', 'train_micro_batch_size_per_gpu'): (self.spec.micro_batch, d.crop_size)}
        if self.val_set is not None:
            tile_key = 'data.eval_tile' if d.get('eval_tile') else 'data.crop_size'
            batches[(tile_key, 'data.eval_batch_size')] = (d.get('eval_batch_size') or self.spec.micro_batch,
                                                            d.get('eval_tile') or d.crop_size)
        ranks = distributed.local_world_size()  # every rank of this node holds its own batch
        for (side_key, batch_key), (count, side) in batches.items():
            need = ranks * count * channels * side * side * 4  # float32 on the way to the model
            if need > memory:
                per = f' per rank, {ranks} ranks on this machine' if ranks > 1 else ''
                raise ConfigError(f"{side_key} {side} with {batch_key} {count}: one batch of {channels}-band "
                                  f"windows takes {need / ranks / 2 ** 30:,.0f} GiB as float32{per}, more than this "
                                  f"machine's {memory / 2 ** 30:,.0f} GiB; lower {side_key} or {batch_key}.")

    def _meta_model(self):
        """The model built once on the meta device (no memory, no weights read: without its
        pretrained file), in eval mode, for the checks before training; None where it cannot be."""
        if not hasattr(self, '_meta_built'):
            try:
                with meta_device():
                    self._meta_built = build(MODELS, without_pretrained(self.cfg.model), where='model').eval()
            except Exception:
                self._meta_built = None
            if self._meta_built is not None:
                # Frozen as the real one will be: a frozen backbone keeps no activations for a
                # backward pass (the memory check refused a run 9x under the machine's memory),
                # and a model with no backbone to freeze is refused as such, first.
                param_groups.freeze_backbone(self._meta_built, self.cfg.get('optim'))
        return self._meta_built

    def _check_activations_fit_in_memory(self):
        """What a training step keeps for its backward pass (the tensors autograd saves, counted in
        a forward on the meta device: no memory, no compute) for one micro-batch of crops, against
        the device's memory. data.crop_size 5000 passed the input-batch guard above (2.4 GiB) and
        the OOM killer ended the run 100 s later with one word, "Killed". Within 20% of a real
        step's peak on the CPU (UNetTiny, 256 and 768 px); only an estimate more than twice the
        memory is refused (frozen layers or activation checkpointing the meta pass cannot see
        save less)."""
        if self.device.type == 'cuda':
            memory = torch.cuda.get_device_properties(self.device).total_memory
            ranks, where = 1, f'GPU {self.device} has'
        else:
            try:
                memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
            except (AttributeError, ValueError, OSError):
                return
            ranks, where = distributed.local_world_size(), "this machine has"
        saved = [0]

        def count(tensor):
            saved[0] += tensor.numel() * tensor.element_size()
            return tensor
        channels, side = self.train_set.in_channels, self.cfg.data.crop_size
        model = self._meta_model()
        if model is None:
            return
        try:
            images = torch.zeros(self.spec.micro_batch, channels, side, side, device='meta')
            with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
                model.train()(images)
        except Exception:  # a model the meta device cannot run: nothing to estimate with
            return
        finally:
            model.eval()
        # Half-precision steps save half the bytes of this float32 pass (about: some ops stay fp32).
        need = saved[0] * (0.5 if any(p in self.spec.precision for p in ('fp16', 'bf16')) else 1.0)
        if ranks * need > 2 * memory:
            per = f' per rank, {ranks} ranks on this machine,' if ranks > 1 else ''
            from ..inference.tiling import input_multiple
            multiple = input_multiple(model)
            # A model that pads every input to its multiple (a UNet of depth 10: 1024 px) needs as
            # much for a 16-px crop as for a 1024-px one: a smaller crop was the wrong advice.
            advice = (f"{self.cfg.model.get('type')} pads every input to a multiple of {multiple} px, so a "
                      f"{side}-px crop is computed at {-(-side // multiple) * multiple} px: a shallower model "
                      "(model.depth) or a smaller micro-batch"
                      if multiple > side else "lower data.crop_size or the micro-batch")
            raise ConfigError(
                f"data.crop_size {side} with train_micro_batch_size_per_gpu {self.spec.micro_batch}: a training "
                f"step of {self.cfg.model.get('type')} keeps about {need / 2 ** 30:,.0f} GiB of activations for its "
                f"backward pass{per} and {where} {memory / 2 ** 30:,.0f} GiB; {advice} "
                f"(gradient_accumulation_steps keeps the global batch).")

    def _check_model_takes_windows(self):
        """One forward on the meta device (no memory, no compute) of a training crop and of an
        evaluation window: a size the model cannot take (SegFormer's attention reduction below
        32 px) was a traceback at the first step, or at the first evaluation after hours of
        training, with no checkpoint written."""
        d, m = self.cfg.data, self.cfg.model
        sizes = {'data.crop_size': d.crop_size}
        if self.val_set is not None:
            sizes['data.eval_tile' if d.get('eval_tile') else 'data.crop_size (the evaluation tile)'] = \
                d.get('eval_tile') or d.crop_size
        model = self._meta_model()
        if model is None:  # cannot be built on meta: the real build below says what is wrong
            return
        for key, size in sizes.items():
            refusal = window_refusal(model, self.train_set.in_channels, size, device='meta')
            if refusal:  # the first step (or evaluation) would raise it
                reason, size_is_the_fault = refusal
                native = native_input_size(m)
                # The segmentor pads a window to its backbone's deepest stride first: that padded
                # size is what a model of one input size must be built for (img_size=100 failed on
                # the 128 px the backbone saw, blamed on "one of its values").
                divisor = getattr(getattr(model, 'backbone', None), 'size_divisor', 1) or 1
                seen = -(-size // divisor) * divisor
                if not size_is_the_fault and native is not None and native % divisor:
                    raise ConfigError(f"model.img_size {native}: the backbone sees windows padded to a multiple of "
                                      f"{divisor} (its deepest stride), so a model of one input size takes "
                                      f"img_size={seen} for {size} px windows ({key} {size}).")
                if not size_is_the_fault and (native is None or native == size or window_refusal(
                        model, self.train_set.in_channels, native, device='meta') is not None):
                    # It fails at its own size too: a value of the model's (base_channels=0, an
                    # embed_dim that num_heads does not divide) was blamed on the crop size. A
                    # model built for one size (Swin, MaxViT, CoAtNet) runs at that size.
                    given = ', '.join(f'{k}={v!r}' for k, v in m.items() if k != 'type')
                    raise ConfigError(f"model ({m.type}): fails on windows of every size ({reason}); one of "
                                      f"its values is at fault: {given or 'its defaults'}.")
                advice = (f"use a larger {key.split()[0]}" if size_is_the_fault else
                          f"a model of one fixed input size (a timm Swin, MLP-Mixer...) takes img_size={seen} "
                          f"in the model config" + (f" (the {size} px window padded to a multiple of {divisor}, its "
                                                   "deepest stride, as the backbone sees it)" if seen != size else ''))
                raise ConfigError(f"{key} {size}: the model ({m.type}) cannot take {size}x{size} windows "
                                  f"({reason}); {advice}")

    def _check_model_output(self):
        """The model's output, from one training and one evaluation forward of two crops on the
        meta device: logits ``[B, num_classes, H, W]`` at the crops' own size (in training also
        ``{'logits': ..., 'aux': [(weight, logits), ...]}``), and parameters to train. A user's
        model that returned ``{'out': ...}``, half-resolution logits or only frozen parameters
        failed at the first step in a traceback (or blamed the DeepSpeed JSON). Returns the names of
        the trained parameters the loss does not reach (:func:`_unused_in_backward`), () where
        unknown."""
        model = self._meta_model()
        if model is None:
            return ()
        name = self.cfg.model.get('type')
        if not any(p.requires_grad for p in model.parameters()):
            frozen = (' (optim.paramwise.freeze_backbone froze all of them: it has no head outside backbone.*)'
                      if param_groups.freeze_backbone_asked(self.cfg.get('optim')) else '')
            raise ConfigError(f"model ({name}): none of its parameters trains{frozen}; give it parameters with "
                              "requires_grad=True.")
        classes, side = self.train_set.num_classes, self.cfg.data.crop_size
        want = (2, classes, side, side)
        for training in (True, False):
            try:
                with torch.set_grad_enabled(training):
                    out = model.train(training)(torch.zeros(2, self.train_set.in_channels, side, side, device='meta'))
            except Exception:  # a model the meta device cannot run: the first step says what is wrong
                return ()
            finally:
                model.eval()
            mode = 'training' if training else 'evaluation'
            logits = [('', out)]
            if training and isinstance(out, dict) and 'logits' in out:
                aux = out.get('aux', ())
                pairs = aux if isinstance(aux, (list, tuple)) else [aux]
                if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
                    raise ConfigError(f"model ({name}): its 'aux' output in training is {_described(aux)}; give a "
                                      "list of (weight, logits) pairs.")
                logits = [("'logits' ", out['logits'])] + [(f"aux {i} ", p[1]) for i, p in enumerate(pairs)]
            for what, tensor in logits:
                if not isinstance(tensor, torch.Tensor):
                    dict_form = " (in training also {'logits': ..., 'aux': [(weight, logits), ...]})"
                    raise ConfigError(f"model ({name}): its {mode} forward returns {what}{_described(tensor)}; "
                                      f"ds_seg takes logits [B, num_classes, H, W]{dict_form}.")
                if tuple(tensor.shape) != want:
                    raise ConfigError(
                        f"model ({name}): its {mode} forward returns {what}logits of shape {list(tensor.shape)} for 2 "
                        f"crops of {side}x{side} px; ds_seg takes [B, num_classes={classes}, H, W] at the input's "
                        "own size (upsample the logits to it, F.interpolate).")
            if training:
                unused = _unused_in_backward(model, [t for _, t in logits])
        return unused

    def _check_val_matches_train(self):
        """The validation scenes go through the trained model as the training scenes do: the same
        dates, bands and classes, or evaluation fails (or scores the wrong classes) after training."""
        t, v = self.train_set, self.val_set
        t_dates, v_dates = getattr(t, 'num_dates', 1), getattr(v, 'num_dates', 1)
        if v_dates != t_dates:
            raise ConfigError(f"data.val has {v_dates} date(s) per scene but data.train has {t_dates}; "
                              f"give the validation scenes the same dates.")
        if v.in_channels != t.in_channels:
            raise ConfigError(f"data.val yields {v.in_channels} band(s) but data.train {t.in_channels}; "
                              f"select the same `bands` (and band count) in both.")
        if tuple(v.classes) != tuple(t.classes):
            more = (f" (both classes={len(v.classes)} where the training labels lack a class that data.val has)"
                    if len(v.classes) > len(t.classes) else '')
            raise ConfigError(f"data.val's classes ({', '.join(v.classes)}) are not data.train's "
                              f"({', '.join(t.classes)}); give both the same `classes`{more}.")
        # Evaluation normalises the validation windows with the training set's statistics, in
        # the training files' units and band order: another pixel type or order scores noise.
        t_type, v_type = getattr(t, 'file_dtype', None), getattr(v, 'file_dtype', None)
        if t_type and v_type and not same_units(t_type, v_type):
            raise ConfigError(f"data.val holds {v_type} pixels but data.train {t_type}: the model would see the "
                              f"validation scenes in other units; convert them to {t_type} (gdal_translate -ot), "
                              "or validate on scenes of the training set's type.")
        self._check_val_band_order(t, v)

    def _check_val_band_order(self, t, v):
        """data.val's selected bands must hold what data.train's do. Where both files' colour
        interpretations say (``band_colours``), they must agree, whatever `bands` each gives:
        BGR validation files read as [3, 2, 1] pass, read as [1, 2, 3] (RGB training files'
        selection) are refused. Other `bands` of files that do not say (grey/undefined bands):
        one warning line."""
        t_bands, v_bands = getattr(t, 'bands', None), getattr(v, 'bands', None)
        if t_bands is None or v_bands is None:
            return
        t_product, v_product = getattr(t, 'product_colours', None), getattr(v, 'product_colours', None)
        if t_product and v_product:
            # A benchmark's products say what their bands hold where their tags do not (ISPRS IRRG
            # files are tagged red, green, blue): an IRRG training set scored on RGB validation
            # tiles (--cfg-options data.train.modality=IRRG alone) gave mIoU 0.07, without a word.
            t_holds = [t_product[b - 1] for b in t_bands]
            v_holds = [v_product[b - 1] for b in v_bands]
            if t_holds != v_holds:
                raise ConfigError(
                    f"data.val's bands {list(v_bands)} hold {', '.join(v_holds)} ({type(v).__name__} "
                    f"modality {v.modality}), but data.train's hold {', '.join(t_holds)} ({type(t).__name__} "
                    f"modality {t.modality}); give data.val the same modality (and bands) as data.train.")
            return
        t_colours, v_colours = getattr(t, 'band_colours', None), getattr(v, 'band_colours', None)
        if t_colours and v_colours:
            if colours_conflict(v_colours, t_colours):
                scene = next(s for s in v.scenes if band_colours(s.get('colorinterp'), list(v_bands)))
                raise ConfigError(colour_order_refusal(
                    scene['image'], scene.get('colorinterp'), list(v_bands), t_colours,
                    f'data.val\'s bands {list(v_bands)}', 'data.train\'s bands hold',
                    lambda right: f'data.val.bands={right}') or
                    f"data.val's bands {list(v_bands)} hold {v_colours} by its files' colour interpretation, but "
                    f"data.train's {t_colours}; give data.val the bands that match data.train's.")
            return
        if list(t_bands) == list(v_bands) or getattr(t, 'num_file_bands', None) != getattr(v, 'num_file_bands', None):
            return
        self.print(f"data.val takes bands {list(v_bands)} of its files but data.train bands {list(t_bands)} of files "
                   "with as many bands, and the files do not say which colour each band is: check that they select "
                   "the same bands in the same order (evaluation normalises data.val with data.train's statistics)")

    # Loss buffers that hold one value per class (CrossEntropy/Ohem class_weight, Focal alpha).
    _PER_CLASS_BUFFERS = ('class_weight', 'alpha')

    def _check_loss_matches_classes(self):
        """Per-class loss weights of the wrong length fail only at the first step, after the work
        dir was written; refuse them now, for every loss (a CombinedLoss included). The same for
        each loss's ignore_index, the one a member of a CombinedLoss falls back to included."""
        classes = self.train_set.num_classes
        for module_name, module in self.criterion.named_modules():
            self._check_ignore_index(f"loss{'.' + module_name if module_name else ''}", module)
            for name in self._PER_CLASS_BUFFERS:
                value = getattr(module, name, None)
                if not isinstance(value, torch.Tensor):
                    continue
                key = f"loss{'.' + module_name if module_name else ''}.{name}"
                if value.dim() != 1:
                    raise ConfigError(f"{key} must be a flat list of numbers, one per class, got {value.tolist()}.")
                if value.numel() != classes:
                    raise ConfigError(f"{key} has {value.numel()} value(s) {value.tolist()} but data.train has "
                                      f"{classes} classes ({', '.join(self.train_set.classes)}): give one per class.")
                if not (torch.isfinite(value).all() and (value >= 0).all()):
                    raise ConfigError(f"{key} must hold finite numbers >= 0, got {value.tolist()}.")
                if not (value > 0).any():  # every pixel weighs 0: the loss is 0 for the whole run
                    raise ConfigError(f"{key} is 0 for every class, so the loss is 0 and nothing is learnt; "
                                      f"give the classes to learn a weight > 0.")
        weights = {f"loss{'.' + name if name else ''}.loss_weight": module.loss_weight
                   for name, module in self.criterion.named_modules() if hasattr(module, 'loss_weight')}
        if weights and not any(weights.values()):  # (loss.losses.0.loss_weight...: each member's)
            raise ConfigError(f"{', '.join(weights)} {'is' if len(weights) == 1 else 'are all'} 0, so the loss is 0 "
                              "and nothing is learnt; give a loss_weight > 0.")

    def _check_ignore_index(self, key, loss):
        if not hasattr(loss, 'ignore_index'):   # a container (CombinedLoss): its members are checked
            return
        ignore = loss.ignore_index
        if ignore is None:   # (was a TypeError, or an AttributeError, at the first step)
            raise ConfigError(f"{key}.ignore_index=None: give the label value of unlabelled pixels (255 usually; "
                              "a value no label holds where every pixel is labelled).")
        if isinstance(ignore, bool) or not isinstance(ignore, int):
            hint = ' (write it without quotes)' if isinstance(ignore, str) and ignore.strip().lstrip('-').isdigit() else ''
            raise ConfigError(f"{key}.ignore_index must be an integer (the label value of unlabelled pixels, 255 "
                              f"usually), got {ignore!r}{hint}.")
        for name, ds in (('data.train', self.train_set), ('data.val', self.val_set)):
            ds_ignore = getattr(ds, 'ignore_index', None)
            if ds is not None and ds_ignore is not None and ds_ignore != ignore:
                raise ConfigError(f"{key}.ignore_index is {ignore} but {name} marks padding and nodata with "
                                  f"{ds_ignore}: those pixels would be learnt as a class or crash the loss; set "
                                  f"both to the same value (e.g. {name}.ignore_index={ignore}).")

    # ------------------------------------------------------------------------------------------
    def _start_trackers(self, cfg, resumed):
        """log.trackers: names checked on every rank (a typo stops all of them), MLflow/W&B runs
        started on rank 0 only; ``resumed``: on in the runs the work dir's trackers.json names."""
        from ..trackers import build_trackers, check_trackers
        log_cfg = cfg.get('log') or {}
        names = check_trackers(log_cfg)
        self.log.tensorboard = 'tensorboard' in names
        failure = None
        if distributed.is_main():
            self.log.close_trackers('refused')  # those of an earlier call (see _setup)
            try:
                earlier, note = self.log.tracker_runs_to_continue(names) if resumed else (None, None)
                if note:
                    self.print(note)
                self.log.trackers = build_trackers(log_cfg, self.work_dir,
                                                   os.path.basename(os.path.abspath(self.work_dir)),
                                                   earlier=earlier)
                for tracker in self.log.trackers:
                    if tracker.note:
                        self.print(tracker.note)
            except ConfigError as exc:  # e.g. W&B without a login: every rank stops with rank 0's line
                failure = str(exc)
        failure = distributed.first_failure(failure)
        if failure:
            raise ConfigError(failure)

    def print(self, message):
        report(message)

    def close(self):
        self.batches = None   # stops the loader's workers (see _end_loop), also when fit() never ran
        self.log.close(self.exit_reason)
        self.lock.release()
        distributed.close()


def _unused_in_backward(model, outputs):
    """Names of the parameters that train but get no gradient from ``outputs`` (a backward on the
    meta device: no memory, no compute), or () where the meta device cannot run it."""
    try:
        torch.autograd.backward([t.float().sum() for t in outputs])
    except Exception:
        return ()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    return unused


def _described(value):
    """A model output as a user sees it in one line: a tensor's shape, a dict's keys, a type."""
    if isinstance(value, torch.Tensor):
        return f'a tensor of shape {list(value.shape)}'
    if isinstance(value, dict):
        return f"a dict of {', '.join(repr(k) for k in value) or 'no keys'}"
    if isinstance(value, (list, tuple)):
        return f'a {type(value).__name__} of {len(value)}'
    return f'a {type(value).__name__}'
