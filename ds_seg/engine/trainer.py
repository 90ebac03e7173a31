"""The training loop. Read it top to bottom: ``__init__`` builds, ``fit`` loops, ``train_step``
does one optimizer step, ``evaluate`` measures, ``save_checkpoint`` persists. No hooks.

Tensor names carry their layout: ``images_BCHW`` (batch, channels, height, width),
``labels_BHW``, ``logits_BKHW`` (K classes).
"""
import errno as errno_codes
import json
import math
import os
import time

import torch

from .. import distributed
from ..config import ConfigError, default_work_dir, resolve_ds_config
from ..data.loader import build_train_loader
from ..data.preprocess import BatchPreprocessor
from ..metrics import metrics_from_confusion
from ..registry import DATASETS, LOSSES, MODELS, RegistryError, build
from ..telemetry import RunLog, StepTimer, format_eta, forward_flops, max_memory_mb, mfu, peak_flops
from ..memory import state_memory
from ..models.losses import segmentation_loss
from . import checkpoint, reshard
from .workdir import WorkDirBusy, WorkDirLock
from .deepspeed_backend import load_state_dict_gathered, model_init_context


EXIT_PREEMPTED = 75   # EX_TEMPFAIL: stopped by a signal after a checkpoint; resume to continue
EXIT_NONFINITE = 3    # the loss stayed non-finite; the last checkpoint is intact
EXIT_LOST_RANK = 4    # another rank died or stopped answering
EXIT_IO_ERROR = 74    # EX_IOERR: a write or read failed (disk full, read-only, I/O error)
EXIT_CODES = {'completed': 0, 'preempted': EXIT_PREEMPTED, 'nonfinite_loss': EXIT_NONFINITE,
              'lost_rank': EXIT_LOST_RANK, 'io_error': EXIT_IO_ERROR}


class LostRankError(RuntimeError):
    """A collective failed because another rank died, hung past the timeout, or the network broke."""


class RunIOError(RuntimeError):
    """The run stopped on a failed write or read; the message names the path and the errno, and
    the last complete checkpoint is intact."""


def _describe_io_error(exc):
    if isinstance(exc, checkpoint.CheckpointWriteError):
        return str(exc)
    name = errno_codes.errorcode.get(exc.errno, exc.errno) if exc.errno else None
    where = exc.filename or 'a file'
    return f"{where}: [Errno {exc.errno} {name}] {exc.strerror or exc}" if name else f'{where}: {exc}'


def _is_collective_failure(exc):
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc).lower()
    return any(word in text for word in ('gloo', 'nccl', 'connection closed', 'connection reset',
                                         'broken pipe', 'timed out', 'timeout'))


def _check_writable(work_dir):
    try:
        os.makedirs(work_dir, exist_ok=True)
        probe = os.path.join(work_dir, f'.write_test.{os.getpid()}')
        with open(probe, 'w') as f:
            f.write('ok')
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"--work-dir: {work_dir} is not writable ({exc.strerror or exc}); "
                          "choose a directory you can write to.") from exc


def _build_dataset(cfg, where, crop_size, seed):
    """Build a dataset; unreadable, missing or inconsistent files become one-line config errors."""
    try:
        return build(DATASETS, cfg, where=where, crop_size=crop_size, seed=seed)
    except (ConfigError, RegistryError):
        raise
    except (ValueError, OSError, RuntimeError) as exc:  # rasterio's errors derive from these
        raise ConfigError(f'{where} ({cfg.get("type")}): {exc}') from exc


def build_backend(kind, model, ds_config, precision, device, world_size, optim_cfg=None):
    if kind == 'ddp':
        from .ddp_backend import DDPBackend
        return DDPBackend(model, ds_config, precision, device, world_size, optim_cfg)
    from .deepspeed_backend import DeepSpeedBackend
    return DeepSpeedBackend(model, ds_config, precision, device, world_size, optim_cfg)


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
        self.launcher = distributed.init(use_deepspeed=(backend == 'deepspeed'),
                                         timeout_s=cfg.train.get('dist_timeout_s'))
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.device = distributed.device()
        self.work_dir = work_dir or default_work_dir(cfg)
        _check_writable(self.work_dir)  # on every rank: each writes its own checkpoint files
        self.lock = WorkDirLock(self.work_dir)
        self._take_work_dir()
        try:
            self._setup(ds_config, backend, resume, ds_config_source)
        except BaseException:
            self.lock.release()  # a refused run leaves the work dir as it found it
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
            raise ConfigError(f'--work-dir: {failure}')

    def _setup(self, ds_config, backend, resume, ds_config_source):
        cfg = self.cfg
        self.log = RunLog(self.work_dir, enabled=distributed.is_main())
        self._start_trackers(cfg)
        self.exit_reason = 'running'
        self.error = None           # the one-line reason when the run stopped on an error
        self.t_start = time.time()

        # --- configs: resolve the DeepSpeed JSON for this world size and hardware ----------
        self.ds_config, self.precision, notes = resolve_ds_config(
            ds_config, self.world_size, cfg.train.max_steps, source=ds_config_source)
        for note in notes:
            self.print(note)
        self.micro_batch = self.ds_config['train_micro_batch_size_per_gpu']
        self.grad_accum = self.ds_config['gradient_accumulation_steps']

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
        self._check_model_matches_data()

        # --- model and loss: identical initial weights on every rank from the seed ------------
        torch.manual_seed(cfg.train.seed)
        # Under ZeRO-3 parameters are partitioned as they are created: no rank holds the model.
        with model_init_context(self.ds_config if backend == 'deepspeed' else None):
            model = build(MODELS, cfg.model, where='model')
        if cfg.get('load_from'):
            self._load_weights(model, cfg.load_from)
        self.criterion = build(LOSSES, cfg.loss, where='loss').to(self.device)

        self.backend = build_backend(backend, model, self.ds_config, self.precision, self.device,
                                     self.world_size, cfg.get('optim'))
        self.precision = self.backend.precision  # DDP reports its autocast equivalent

        # --- resume ----------------------------------------------------------------------------
        self.step = 0
        self.micro_step_offset = 0  # data position - step x accumulation (non-zero after a change of ranks)
        resume_from = checkpoint.resolve_resume(resume, self.work_dir, report=self.print)
        set_aside = None
        if resume_from is not None:
            self._load_checkpoint(*resume_from)
            if distributed.is_main() and resume != 'auto':
                set_aside = checkpoint.set_aside_other_branch(self.work_dir, *resume_from)
            distributed.barrier()
        elif checkpoint.complete_tags(os.path.join(self.work_dir, 'checkpoints')):
            raise ConfigError(f"--work-dir: {self.work_dir} already holds checkpoints of an earlier run; "
                              "add --resume auto to continue it, or choose another --work-dir.")
        if distributed.is_main():
            self.log.start(resumed_step=self.step if resume_from is not None else None, set_aside=set_aside)
            if set_aside:
                self.print(f'resuming {resume_from[1]} abandons a later branch: its checkpoints and log rows '
                           f'after step {self.step} were moved to {set_aside} (nothing deleted)')

        # --- telemetry -------------------------------------------------------------------------
        shape = (1, self.train_set.in_channels, data_cfg.crop_size, data_cfg.crop_size)
        self.flops_per_image = forward_flops(lambda: build(MODELS, cfg.model), shape)
        self.peak_flops = peak_flops(self.device, cfg.train.get('peak_tflops'))
        self.timer = StepTimer(self.device, warmup_steps=cfg.train.warmup_log_steps)
        self.state_memory = None  # per-rank state bytes, measured once in the second step
        self.log.write_json('config.json', cfg.to_dict())
        ds_written = dict(self.ds_config)
        ds_written['ds_seg'] = {'backend': self.backend.name, 'precision': self.precision,
                                'world_size': self.world_size, 'launcher': self.launcher}
        self.log.write_json('ds_config.json', ds_written)

    # ------------------------------------------------------------------------------------------
    def fit(self):
        """Train until ``train.max_steps``; returns the summary written to ``summary.json``."""
        t = self.cfg.train
        loader = build_train_loader(self.train_set, self.micro_batch, self.rank, self.world_size,
                                    start_micro_step=self.step * self.grad_accum + self.micro_step_offset,
                                    num_workers=self.cfg.data.num_workers)
        self.batches = iter(loader)
        # Normalisation, nodata and flips happen on the device, after the (uint8) batch's copy.
        self.preprocess = BatchPreprocessor.for_dataset(self.train_set)
        self.print(f'training {self.cfg.model.type} | backend {self.backend.name}'
                   f'{"" if self.backend.zero_stage is None else f" ZeRO-{self.backend.zero_stage}"}'
                   f' | {self.precision} | {self.world_size} rank(s) on {self.device.type}'
                   f' | micro-batch {self.micro_batch} x accum {self.grad_accum} x {self.world_size}'
                   f' = {self.backend.global_batch} | steps {self.step}->{t.max_steps} | {self.work_dir}')
        self.backend.train()
        loss_sum = torch.zeros((), device=self.device)
        nonfinite_run = 0
        self.t_loop = time.time()
        step_at_loop_start = self.step
        stop = distributed.StopRequests()       # SIGUSR1/SIGTERM: finish the step, checkpoint, exit
        heartbeat = distributed.Heartbeat()     # lets survivors name a rank that died
        profiler = self._profiler()             # None unless train.profile_steps
        try:
            while self.step < t.max_steps:
                log_now = (self.step + 1) % t.log_interval == 0 or self.step + 1 == t.max_steps
                loss = self.train_step(want_grad_norm=log_now)
                if profiler is not None:
                    profiler.step()
                loss_sum += loss
                self.step += 1
                # The step timer has synchronised the device, so reading the loss stalls nothing.
                signalled, nonfinite = stop.exchange(local_nonfinite=not math.isfinite(float(loss)))
                nonfinite_run = nonfinite_run + 1 if nonfinite else 0

                if log_now:
                    in_window = t.log_interval if self.step % t.log_interval == 0 else self.step % t.log_interval
                    # a window cut short by a resume holds only the steps since it
                    self.log_metrics(loss_sum, min(in_window, self.step - step_at_loop_start), step_at_loop_start)
                    loss_sum.zero_()
                if nonfinite_run >= t.max_nonfinite_steps:
                    self.exit_reason = 'nonfinite_loss'
                    self.print(f'stopping at step {self.step}: the loss was not finite for {nonfinite_run} '
                               f'consecutive steps; the last checkpoint in {self.work_dir}/checkpoints is intact '
                               '(lower the learning rate or check the data).')
                    break
                if self.val_set is not None and t.eval_interval and (
                        self.step % t.eval_interval == 0 or self.step == t.max_steps):
                    self.evaluate()
                # A signal always checkpoints (that is its purpose), periodic ones only when enabled;
                # never weights that may already be NaN: keep-N pruning would drop the good ones.
                saved = False
                if nonfinite_run == 0 and (signalled or t.checkpoint_interval and (
                        self.step % t.checkpoint_interval == 0 or self.step == t.max_steps)):
                    self.save_checkpoint()
                    saved = True
                if signalled:
                    self.exit_reason = 'preempted'
                    why = stop.signal_name or 'a signal received by another rank'
                    self.print(f'stopping at step {self.step} on {why}: '
                               + ('checkpoint saved; continue with --resume auto.' if saved else
                                  'no checkpoint (the loss was not finite).'))
                    break
            else:
                self.exit_reason = 'completed'
        except Exception as exc:
            if _is_collective_failure(exc):
                self.exit_reason = 'lost_rank'
                raise LostRankError(f'rank {self.rank}: {heartbeat.describe_failure()}; stopping. '
                                    f'Resume from the last complete checkpoint with --resume auto. ({exc})') from exc
            if isinstance(exc, OSError):  # disk full, read-only, I/O error: checkpoint.save cleaned up
                self.exit_reason = 'io_error'
                last = checkpoint.find_latest(os.path.join(self.work_dir, 'checkpoints'))
                self.error = (f'{_describe_io_error(exc)}; stopped at step {self.step}; the last complete '
                              f"checkpoint ({last or 'none'}) is intact; free space or fix the disk, then "
                              '--resume auto.')
                raise RunIOError(self.error) from exc
            self.exit_reason = 'error'
            raise
        except BaseException:
            self.exit_reason = 'error'
            raise
        finally:
            if profiler is not None:
                profiler.stop()
            heartbeat.close()
            stop.close()
            summary = self.write_summary()
        return summary

    def _profiler(self):
        """A started torch.profiler recording ``train.profile_steps`` steps after the warm-up into
        ``<work_dir>/profile/`` (one trace per rank; TensorBoard or Perfetto), or None. Profiled
        steps are slower: their throughput figures are not comparable with unprofiled runs."""
        steps = int(self.cfg.train.get('profile_steps') or 0)
        if steps <= 0:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == 'cuda' else [])
        prof = profile(activities=activities, profile_memory=True, record_shapes=True,
                       schedule=schedule(wait=max(0, self.cfg.train.warmup_log_steps - 1), warmup=1,
                                         active=steps, repeat=1),
                       on_trace_ready=tensorboard_trace_handler(os.path.join(self.work_dir, 'profile'),
                                                                worker_name=f'rank{self.rank}'))
        prof.start()
        return prof

    def train_step(self, want_grad_norm=False):
        """One optimizer step = ``grad_accum`` micro-batches. Returns the mean loss (on device)."""
        self.timer.start()
        loss_total = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum):
            t0 = time.perf_counter()
            batch = next(self.batches)
            self.timer.data_wait(time.perf_counter() - t0)
            images_BCHW, labels_BHW = self.preprocess(batch, self.device)
            logits_BKHW = self.backend.forward(images_BCHW)
            loss = segmentation_loss(self.criterion, logits_BKHW, labels_BHW)  # + auxiliary heads
            self.backend.backward(loss)
            if self.state_memory is None and self.step == 1 and self.backend.is_boundary():
                # Adam state exists after the first step and gradients live until this step frees them.
                self.state_memory = state_memory(self.backend)
            self.backend.step(want_grad_norm=want_grad_norm)
            loss_total += loss.detach().float()
        self.timer.stop(images=self.micro_batch * self.grad_accum * self.world_size,
                        pixels=self.micro_batch * self.grad_accum * self.world_size * images_BCHW.shape[-2]
                        * images_BCHW.shape[-1])
        return loss_total / self.grad_accum

    def log_metrics(self, loss_sum, steps_in_window, step_at_loop_start):
        # One all-reduce per log interval: the loss of all ranks, not only rank 0's.
        loss = distributed.all_reduce_sum(loss_sum.detach().clone()).item() / (steps_in_window * self.world_size)
        window = self.timer.summary()
        self.timer.reset()
        elapsed = time.time() - self.t_loop
        done = self.step - step_at_loop_start
        eta = elapsed / done * (self.cfg.train.max_steps - self.step) if done else None
        record = dict(
            step=self.step, epoch=self.step * self.backend.global_batch / max(1, len(self.train_set)),
            loss=loss, lr=self.backend.lr(), grad_norm=self.backend.grad_norm(),
            loss_scale=self.backend.loss_scale(), skipped_steps=self.backend.skipped_steps,
            images_per_s=window['images_per_s'], megapixels_per_s=window['megapixels_per_s'],
            step_time_s=window['step_time_s'], step_time_p90_s=window['step_time_p90_s'],
            data_wait_frac=window['data_wait_frac'], max_mem_mb=max_memory_mb(self.device),
            mfu=mfu(self.flops_per_image, window['images_per_s'], self.peak_flops),
            backend=self.backend.name, zero_stage=self.backend.zero_stage, world_size=self.world_size,
            precision=self.precision, state_memory=self.state_memory)
        self.log.metrics(record)
        skipped = record['skipped_steps'] - getattr(self, '_skipped_at_last_log', 0)
        self._skipped_at_last_log = record['skipped_steps']
        if steps_in_window >= 4 and skipped > steps_in_window // 2:
            self.print(f'warning: fp16 overflow storm: {skipped} of the last {steps_in_window} steps were skipped; '
                       f'loss scale now {record["loss_scale"]}. Consider bf16, a lower learning rate or clipping.')
        ips = f"{record['images_per_s']:.1f} img/s" if record['images_per_s'] else 'warming up'
        wait = f" | data {100 * record['data_wait_frac']:.0f}%" if record['data_wait_frac'] is not None else ''
        self.print(f"step {self.step}/{self.cfg.train.max_steps} | loss {loss:.4f} | lr {record['lr']:.2e}"
                   f" | {ips}{wait} | ETA {format_eta(eta)}")
        return loss

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self):
        """Whole validation scenes through the same sliding-window code as launch/predict.py
        (ds_seg.inference), bands of rows split across ranks with equal forward counts; one
        all-reduced confusion matrix gives per-class IoU/F1, mIoU and OA (never an average of
        rank mIoUs)."""
        from ..inference import evaluate_scenes
        self.backend.sync_batchnorm_stats()
        self.backend.eval()
        d = self.cfg.data
        tile = d.get('eval_tile') or d.crop_size
        overlap = d.get('eval_overlap')
        norm = self._normalisation()
        result = evaluate_scenes(
            self.backend.forward, self.val_set, num_classes=self.val_set.num_classes,
            # the training set's statistics: the model saw inputs normalised with them
            mean=norm['mean'], std=norm['std'], bands=self.val_set.bands,
            ignore_index=self.cfg.loss.get('ignore_index', 255), tile=tile,
            overlap=tile // 4 if overlap is None else overlap,
            batch_size=d.get('eval_batch_size') or self.micro_batch, device=self.device)
        metrics = metrics_from_confusion(result['confusion'], self.val_set.classes)
        record = dict(step=self.step, **metrics)
        self.log.eval(record)
        self.last_eval = record
        self.print(f"eval step {self.step} | mIoU {metrics['mIoU']:.4f} | OA {metrics['OA']:.4f} | "
                   + ' '.join(f"{n} {v['iou']:.2f}" for n, v in metrics['per_class'].items() if v['iou'] is not None))
        self.backend.train()
        return record

    def _normalisation(self):
        """Bands and per-band mean/std the model's inputs were normalised with (saved in
        checkpoints and exported weights so prediction repeats them exactly)."""
        ds = self.train_set
        return dict(bands=[int(b) for b in getattr(ds, 'bands', range(1, ds.in_channels + 1))],
                    mean=[float(v) for v in ds.mean], std=[float(v) for v in ds.std],
                    ignore_index=int(getattr(ds, 'ignore_index', 255)))

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self):
        self.backend.sync_batchnorm_stats()
        client_state = dict(
            step=self.step,
            micro_step=self.step * self.grad_accum + self.micro_step_offset,  # the data position: samplers restart here
            micro_batch=self.micro_batch, grad_accum=self.grad_accum,
            rng_cpu=torch.get_rng_state(),
            rng_cuda=torch.cuda.get_rng_state() if self.device.type == 'cuda' else None,
            model_cfg=self.cfg.model.to_dict() if hasattr(self.cfg.model, 'to_dict') else dict(self.cfg.model),
            classes=list(self.train_set.classes), world_size=self.world_size,
            backend=self.backend.name, zero_stage=self.backend.zero_stage,
            data=self._normalisation())
        root = os.path.join(self.work_dir, 'checkpoints')
        tag = checkpoint.save(self.backend, root, self.step, client_state, keep=self.cfg.train.keep_checkpoints,
                              marker_extra={'param_shapes': self._param_shapes()})
        self.print(f'saved checkpoint {root}/{tag}')

    def _param_shapes(self):
        """Parameter name -> full shape (ZeRO-3 partitions keep the full shape in ``ds_shape``)."""
        return {name: list(getattr(p, 'ds_shape', p.shape)) for name, p in self.backend.module.named_parameters()}

    def _check_resume_compatible(self, root, tag):
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
        if marker.get('backend') != self.backend.name:
            raise ConfigError(f"--resume: {where} is a {marker.get('backend')} checkpoint but this run uses "
                              f"--backend {self.backend.name}; export it (launch/export.py) and use load_from=.")
        stage = marker.get('zero_stage')
        if self.backend.name == 'deepspeed' and stage != self.backend.zero_stage:
            raise ConfigError(f"--resume: {where} was saved under ZeRO-{stage} but the DeepSpeed config "
                              f"uses ZeRO-{self.backend.zero_stage}; export it and use load_from= instead.")
        saved_shapes = marker.get('param_shapes')
        if saved_shapes is not None:
            now = self._param_shapes()
            differ = [n for n in sorted(set(saved_shapes) | set(now)) if saved_shapes.get(n) != now.get(n)]
            if differ:
                mine = self.cfg.model.to_dict() if hasattr(self.cfg.model, 'to_dict') else dict(self.cfg.model)
                show = lambda cfg, k: repr(cfg[k]) if k in cfg else '(default)'  # noqa: E731
                keys = [f'{k}={show(model, k)} there, {show(mine, k)} here'
                        for k in sorted(set(model) | set(mine)) if model.get(k) != mine.get(k)]
                shown = ', '.join(f'{n} {saved_shapes.get(n)} vs {now.get(n)}' for n in differ[:3])
                raise ConfigError(f"--resume: {where} holds a differently shaped model "
                                  f"({'; '.join(keys) or shown}); {len(differ)} tensor(s) differ, e.g. {shown}. "
                                  "Use the config it was trained with, or a new --work-dir.")

    def _load_checkpoint(self, root, tag):
        self._check_resume_compatible(root, tag)
        marker = checkpoint.read_marker(os.path.join(root, tag))
        if reshard.needed(marker, self.world_size):  # another number of ranks (ds_seg/engine/reshard.py)
            state = reshard.load(self.backend, root, tag, marker)
            saved = dict(micro_batch=state.get('micro_batch', self.micro_batch),
                         grad_accum=state.get('grad_accum', self.grad_accum), world_size=marker['world_size'])
            start, skipped = reshard.start_micro_step(int(state['micro_step']), saved['micro_batch'],
                                                      saved['world_size'], self.micro_batch, self.world_size)
            self.micro_step_offset = start - int(state['step']) * self.grad_accum
            self.print(reshard.describe(saved, self.world_size, self.micro_batch, self.grad_accum,
                                        self.backend.global_batch, skipped, marker.get('zero_stage')))
        else:
            state = self.backend.load(root, tag)
            self.micro_step_offset = int(state.get('micro_step', 0)) - int(state['step']) * self.grad_accum
        self.step = int(state['step'])
        torch.set_rng_state(state['rng_cpu'])
        if state.get('rng_cuda') is not None and self.device.type == 'cuda':
            torch.cuda.set_rng_state(state['rng_cuda'])
        self.print(f'resumed from {root}/{tag} at step {self.step}')

    def _load_weights(self, model, path):
        payload = checkpoint.load_weights_file(path)
        missing, unexpected = load_state_dict_gathered(model, payload['state_dict'])  # ZeRO-3 too
        if missing or unexpected:
            raise ConfigError(f"load_from: {path} does not fit model {self.cfg.model.type}: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}.")
        self.print(f'loaded weights from {path}')

    def _check_model_matches_data(self):
        m = self.cfg.model
        if m.get('in_channels') is not None and m.in_channels != self.train_set.in_channels:
            raise ConfigError(f"model.in_channels is {m.in_channels} but data.train yields "
                              f"{self.train_set.in_channels} band(s); set model.in_channels="
                              f"{self.train_set.in_channels} or select bands in the dataset.")
        loss_ignore = self.cfg.loss.get('ignore_index')
        for name, ds in (('data.train', self.train_set), ('data.val', self.val_set)):
            ds_ignore = getattr(ds, 'ignore_index', None)
            if ds is not None and loss_ignore is not None and ds_ignore is not None and ds_ignore != loss_ignore:
                raise ConfigError(f"loss.ignore_index is {loss_ignore} but {name} marks padding and nodata with "
                                  f"{ds_ignore}: those pixels would be learnt as a class or crash the loss; set "
                                  f"both to the same value (e.g. {name}.ignore_index={loss_ignore}).")
        if m.get('num_classes') is not None and m.num_classes != self.train_set.num_classes:
            raise ConfigError(f"model.num_classes is {m.num_classes} but data.train has "
                              f"{self.train_set.num_classes} classes ({', '.join(self.train_set.classes)}).")

    # ------------------------------------------------------------------------------------------
    def write_summary(self):
        last = getattr(self, 'last_eval', None)
        rows = []
        path = os.path.join(self.work_dir, 'metrics.jsonl')
        if distributed.is_main() and os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:  # a line cut short by a full disk
                        continue
        ips = sorted(r['images_per_s'] for r in rows if r.get('images_per_s'))
        summary = dict(
            exit_reason=self.exit_reason, steps=self.step, wall_time_s=time.time() - self.t_start,
            backend=self.backend.name, zero_stage=self.backend.zero_stage, precision=self.precision,
            world_size=self.world_size, global_batch=self.backend.global_batch,
            images_per_s_median=ips[len(ips) // 2] if ips else None,
            final_loss=rows[-1]['loss'] if rows else None, skipped_steps=self.backend.skipped_steps,
            mIoU=last['mIoU'] if last else None, OA=last['OA'] if last else None,
            mF1=last['mF1'] if last else None, flops_per_image_fwd=self.flops_per_image,
            state_memory=getattr(self, 'state_memory', None), error=self.error)
        try:
            self.log.write_json('summary.json', summary)
        except OSError as exc:  # the disk that stopped the run may refuse this too
            self.print(f'could not write summary.json: {_describe_io_error(exc)}')
        return summary

    def _start_trackers(self, cfg):
        """log.trackers: names checked on every rank (a typo stops all of them), MLflow/W&B runs
        started on rank 0 only."""
        from ..trackers import build_trackers, check_trackers
        log_cfg = cfg.get('log') or {}
        names = check_trackers(log_cfg)
        self.log.tensorboard = 'tensorboard' in names
        if distributed.is_main():
            self.log.trackers = build_trackers(log_cfg, self.work_dir, os.path.basename(os.path.abspath(self.work_dir)))

    def print(self, message):
        if distributed.is_main():
            print(f'[ds_seg] {message}', flush=True)

    def close(self):
        self.log.close()
        self.lock.release()
        distributed.close()
