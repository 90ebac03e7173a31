"""The training loop. Read it top to bottom: ``__init__`` builds, ``fit`` loops, ``train_step``
does one optimizer step, ``evaluate`` measures, ``save_checkpoint`` persists. No hooks.

Tensor names carry their layout: ``images_BCHW`` (batch, channels, height, width),
``labels_BHW``, ``logits_BKHW`` (K classes).
"""
import json
import math
import os
import time

import torch

from .. import distributed
from ..config import ConfigError, default_work_dir, resolve_ds_config, zero_stage
from ..data.loader import build_eval_loader, build_train_loader
from ..metrics import confusion_matrix, metrics_from_confusion
from ..registry import DATASETS, LOSSES, MODELS, build
from ..telemetry import RunLog, StepTimer, format_eta, forward_flops, max_memory_mb, mfu, peak_flops
from . import checkpoint


def build_backend(kind, model, ds_config, precision, device, world_size):
    if kind == 'ddp':
        from .ddp_backend import DDPBackend
        return DDPBackend(model, ds_config, precision, device, world_size)
    from .deepspeed_backend import DeepSpeedBackend
    return DeepSpeedBackend(model, ds_config, precision, device, world_size)


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
        self.launcher = distributed.init(use_deepspeed=(backend == 'deepspeed'))
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.device = distributed.device()
        self.work_dir = work_dir or default_work_dir(cfg)
        self.log = RunLog(self.work_dir, enabled=distributed.is_main())
        self.exit_reason = 'running'
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
            self.train_set = build(DATASETS, data_cfg.train, where='data.train',
                                   crop_size=data_cfg.crop_size, seed=cfg.train.seed)
            self.val_set = build(DATASETS, data_cfg.val, where='data.val', crop_size=data_cfg.crop_size,
                                 seed=cfg.train.seed) if data_cfg.get('val') else None
        self._check_model_matches_data()

        # --- model and loss: identical initial weights on every rank from the seed ------------
        torch.manual_seed(cfg.train.seed)
        model = build(MODELS, cfg.model, where='model')
        if cfg.get('load_from'):
            self._load_weights(model, cfg.load_from)
        self.criterion = build(LOSSES, cfg.loss, where='loss').to(self.device)

        self.backend = build_backend(backend, model, self.ds_config, self.precision, self.device,
                                     self.world_size)
        self.precision = self.backend.precision  # DDP reports its autocast equivalent

        # --- resume ----------------------------------------------------------------------------
        self.step = 0
        resume_from = checkpoint.resolve_resume(resume, self.work_dir)
        if resume_from is not None:
            self._load_checkpoint(*resume_from)
        elif checkpoint.complete_tags(os.path.join(self.work_dir, 'checkpoints')):
            raise ConfigError(f"--work-dir: {self.work_dir} already holds checkpoints of an earlier run; "
                              "add --resume auto to continue it, or choose another --work-dir.")
        if distributed.is_main():
            self.log.start(resumed_step=self.step if resume_from is not None else None)

        # --- telemetry -------------------------------------------------------------------------
        shape = (1, self.train_set.in_channels, data_cfg.crop_size, data_cfg.crop_size)
        self.flops_per_image = forward_flops(lambda: build(MODELS, cfg.model), shape)
        self.peak_flops = peak_flops(self.device, cfg.train.get('peak_tflops'))
        self.timer = StepTimer(self.device, warmup_steps=cfg.train.warmup_log_steps)
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
                                    start_micro_step=self.step * self.grad_accum,
                                    num_workers=self.cfg.data.num_workers)
        self.batches = iter(loader)
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
        try:
            while self.step < t.max_steps:
                log_now = (self.step + 1) % t.log_interval == 0 or self.step + 1 == t.max_steps
                loss = self.train_step(want_grad_norm=log_now)
                loss_sum += loss
                self.step += 1

                if log_now:
                    mean_loss = self.log_metrics(loss_sum, t.log_interval if self.step % t.log_interval == 0
                                                 else self.step % t.log_interval, step_at_loop_start)
                    loss_sum.zero_()
                    nonfinite_run = nonfinite_run + 1 if not math.isfinite(mean_loss) else 0
                    if nonfinite_run >= max(1, t.max_nonfinite_steps // max(1, t.log_interval)):
                        self.exit_reason = 'nonfinite_loss'
                        self.print(f'stopping: the loss was not finite for {nonfinite_run} log interval(s); '
                                   f'the last checkpoint in {self.work_dir}/checkpoints is intact.')
                        break
                if self.val_set is not None and t.eval_interval and (
                        self.step % t.eval_interval == 0 or self.step == t.max_steps):
                    self.evaluate()
                if t.checkpoint_interval and (self.step % t.checkpoint_interval == 0 or self.step == t.max_steps):
                    self.save_checkpoint()
            else:
                self.exit_reason = 'completed'
        except BaseException:
            self.exit_reason = 'error'
            raise
        finally:
            summary = self.write_summary()
        return summary

    def train_step(self, want_grad_norm=False):
        """One optimizer step = ``grad_accum`` micro-batches. Returns the mean loss (on device)."""
        self.timer.start()
        loss_total = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum):
            t0 = time.perf_counter()
            batch = next(self.batches)
            self.timer.data_wait(time.perf_counter() - t0)
            images_BCHW = batch['image'].to(self.device, non_blocking=True)
            labels_BHW = batch['label'].to(self.device, non_blocking=True)
            logits_BKHW = self.backend.forward(images_BCHW)
            loss = self.criterion(logits_BKHW, labels_BHW)
            self.backend.backward(loss)
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
            precision=self.precision)
        self.log.metrics(record)
        ips = f"{record['images_per_s']:.1f} img/s" if record['images_per_s'] else 'warming up'
        wait = f" | data {100 * record['data_wait_frac']:.0f}%" if record['data_wait_frac'] is not None else ''
        self.print(f"step {self.step}/{self.cfg.train.max_steps} | loss {loss:.4f} | lr {record['lr']:.2e}"
                   f" | {ips}{wait} | ETA {format_eta(eta)}")
        return loss

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self):
        """Grid windows over the validation scenes, split equally across ranks; one all-reduced
        confusion matrix gives per-class IoU/F1, mIoU and OA (never an average of rank mIoUs)."""
        self.backend.sync_batchnorm_stats()
        self.backend.eval()
        batch_size = self.cfg.data.get('eval_batch_size') or self.micro_batch
        loader = build_eval_loader(self.val_set, batch_size, self.rank, self.world_size,
                                   num_workers=self.cfg.data.num_workers)
        num_classes = self.val_set.num_classes
        cm = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=self.device)
        for batch in loader:
            logits_BKHW = self.backend.forward(batch['image'].to(self.device, non_blocking=True))
            cm += confusion_matrix(logits_BKHW.argmax(1), batch['label'].to(self.device), num_classes,
                                   ignore_index=self.cfg.loss.get('ignore_index', 255))
        cm = distributed.all_reduce_sum(cm.cpu())
        metrics = metrics_from_confusion(cm, self.val_set.classes)
        record = dict(step=self.step, **metrics)
        self.log.eval(record)
        self.last_eval = record
        self.print(f"eval step {self.step} | mIoU {metrics['mIoU']:.4f} | OA {metrics['OA']:.4f} | "
                   + ' '.join(f"{n} {v['iou']:.2f}" for n, v in metrics['per_class'].items() if v['iou'] is not None))
        self.backend.train()
        return record

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self):
        self.backend.sync_batchnorm_stats()
        client_state = dict(
            step=self.step,
            micro_step=self.step * self.grad_accum,  # the data position: samplers restart here
            rng_cpu=torch.get_rng_state(),
            rng_cuda=torch.cuda.get_rng_state() if self.device.type == 'cuda' else None,
            model_cfg=self.cfg.model.to_dict() if hasattr(self.cfg.model, 'to_dict') else dict(self.cfg.model),
            classes=list(self.train_set.classes), world_size=self.world_size,
            backend=self.backend.name, zero_stage=self.backend.zero_stage)
        root = os.path.join(self.work_dir, 'checkpoints')
        tag = checkpoint.save(self.backend, root, self.step, client_state, keep=self.cfg.train.keep_checkpoints)
        self.print(f'saved checkpoint {root}/{tag}')

    def _load_checkpoint(self, root, tag):
        state = self.backend.load(root, tag)
        if state.get('model_cfg', {}).get('type') not in (None, self.cfg.model.type):
            raise ConfigError(f"--resume: {root}/{tag} holds a {state['model_cfg']['type']} model, "
                              f"but the config builds {self.cfg.model.type}.")
        self.step = int(state['step'])
        torch.set_rng_state(state['rng_cpu'])
        if state.get('rng_cuda') is not None and self.device.type == 'cuda':
            torch.cuda.set_rng_state(state['rng_cuda'])
        self.print(f'resumed from {root}/{tag} at step {self.step}')

    def _load_weights(self, model, path):
        payload = checkpoint.load_weights_file(path)
        missing, unexpected = model.load_state_dict(payload['state_dict'], strict=False)
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
                rows = [json.loads(line) for line in f if line.strip()]
        ips = sorted(r['images_per_s'] for r in rows if r.get('images_per_s'))
        summary = dict(
            exit_reason=self.exit_reason, steps=self.step, wall_time_s=time.time() - self.t_start,
            backend=self.backend.name, zero_stage=self.backend.zero_stage, precision=self.precision,
            world_size=self.world_size, global_batch=self.backend.global_batch,
            images_per_s_median=ips[len(ips) // 2] if ips else None,
            final_loss=rows[-1]['loss'] if rows else None, skipped_steps=self.backend.skipped_steps,
            mIoU=last['mIoU'] if last else None, OA=last['OA'] if last else None,
            mF1=last['mF1'] if last else None, flops_per_image_fwd=self.flops_per_image)
        self.log.write_json('summary.json', summary)
        return summary

    def print(self, message):
        if distributed.is_main():
            print(f'[ds_seg] {message}', flush=True)

    def close(self):
        self.log.close()
        distributed.close()
