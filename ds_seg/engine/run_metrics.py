"""What a run reports: step timing, the loss of a log window, MFU, non-finite losses, the JSONL
and TensorBoard rows (through :class:`ds_seg.telemetry.RunLog`) and ``summary.json``.

Between log steps everything stays on the device: the loss is added into a device tensor, and
non-finite losses are counted there too (consecutive run and its longest stretch), so a plain
step reads nothing back. A log step does one all-reduce of the window's loss and reads the
timer's events.
"""
import json
import os
import statistics
import time

import torch

from .. import distributed
from ..memory import state_memory
from ..telemetry import StepTimer, format_eta, max_memory_mb, mfu


class RunMetrics:
    def __init__(self, spec, log, backend, *, flops_per_image, peak_flops, warmup_steps, max_steps,
                 train_images, report, t_start, earlier_wall_time_s=0.0):
        self.spec, self.log, self.backend = spec, log, backend
        # (forward, training) FLOPs of one image (telemetry.image_flops), or None where uncounted
        self.flops_per_image_fwd, self.flops_per_image_train = flops_per_image or (None, None)
        self.peak_flops = peak_flops
        self.max_steps, self.train_images, self.report = max_steps, train_images, report
        self.timer = StepTimer(spec.device, warmup_steps=warmup_steps)
        self.state_memory = None        # per-rank state bytes, measured once (second step)
        self.last_eval = None
        self._loss_sum = torch.zeros((), device=spec.device)
        # [longest run of consecutive non-finite steps since the last check, current run]
        self._nonfinite = torch.zeros(2, dtype=torch.int64, device=spec.device)
        self._skipped_at_last_log = 0
        self.t_start = t_start          # when this pass began (summary's wall time)
        self.earlier_wall_time_s = earlier_wall_time_s  # the earlier passes', to the checkpoint resumed
        self.compile_time_s = None      # compiled runs: loop start to the end of the first step

    def start_loop(self, step, window=None):
        """``window``: the log window a resumed checkpoint was saved inside (:meth:`window_state`),
        so that the first row after a resume averages the same steps as the uninterrupted run's
        (it held only the steps since the checkpoint, another number)."""
        self.t_loop, self.loop_start_step, self.window_start_step = time.time(), step, step
        if window and window['start'] < step:
            sums = window['loss_sums']
            rank, size = distributed.rank(), self.spec.world_size
            # Each rank its own sum (the same additions as before). At another number of ranks,
            # rank 0 holds them all, scaled to this many ranks: the row divides by steps x ranks.
            mine = sums[rank] if len(sums) == size else (sum(sums) * size / len(sums) if rank == 0 else 0.0)
            self._loss_sum.fill_(mine)
            self.window_start_step = window['start']

    def window_state(self):
        """The open log window, for a checkpoint: where it started and every rank's loss sum (a
        collective: every rank checkpoints; one host read, at a checkpoint)."""
        sums = torch.zeros(self.spec.world_size, dtype=self._loss_sum.dtype, device=self._loss_sum.device)
        sums[distributed.rank()] = self._loss_sum
        distributed.all_reduce_sum(sums)
        return dict(start=self.window_start_step, loss_sums=sums.tolist())

    # -- every step: device operations only -----------------------------------------------
    def add_step(self, loss):
        if self.spec.compile_mode and self.compile_time_s is None:
            # The one host read outside check steps, on a compiled run's first step only: waiting
            # for its loss makes the figure include compilation and the first compiled kernels.
            float(loss)
            self.compile_time_s = time.time() - self.t_loop
        self._loss_sum += loss.detach()
        nonfinite = (~torch.isfinite(loss.detach())).to(torch.int64)
        current = (self._nonfinite[1] + 1) * nonfinite          # reset to 0 by a finite loss
        self._nonfinite = torch.stack([torch.maximum(self._nonfinite[0], current), current])

    def measure_state_memory(self):
        """Once, inside the second step after its backward: Adam state exists after the first
        step and gradients live until the step frees them. Reads tensor sizes, not values."""
        if self.state_memory is None:
            self.state_memory = state_memory(self.backend)

    # -- check steps ----------------------------------------------------------------------
    def take_nonfinite_counts(self):
        """The counters for faults.StopRequests.agree. The longest run restarts at 0 (a run already
        reported is not reported again once it has ended); the current run carries on."""
        counts = self._nonfinite
        self._nonfinite = torch.stack([torch.zeros_like(counts[1]), counts[1]])
        return counts

    # -- log steps ------------------------------------------------------------------------
    def log_window(self, step, samples_seen, lr):
        """Write the row for the steps since the last log (a window cut short by a resume holds
        only the steps since it); returns the window's mean loss over all ranks. ``samples_seen``:
        the training samples consumed so far (the epoch; a resume at another global batch counted
        the earlier steps at the new one, and the epoch went backwards); ``lr``: the LR this step
        trained with (read before its update, which moves the schedule on to the next step's)."""
        steps_in_window = step - self.window_start_step
        self.window_start_step = step
        # One all-reduce per log interval: the loss of all ranks, not only rank 0's.
        loss = distributed.all_reduce_sum(self._loss_sum.clone()).item() / (steps_in_window * self.spec.world_size)
        self._loss_sum.zero_()
        window = self.timer.summary()
        self.timer.reset()
        done = step - self.loop_start_step
        eta = (time.time() - self.t_loop) / done * (self.max_steps - step) if done else None
        backend = self.backend
        record = dict(
            step=step, epoch=samples_seen / max(1, self.train_images),
            loss=loss, lr=lr, grad_norm=backend.grad_norm(),
            loss_scale=backend.loss_scale(), skipped_steps=backend.skipped_steps,
            images_per_s=window['images_per_s'], megapixels_per_s=window['megapixels_per_s'],
            step_time_s=window['step_time_s'], step_time_p90_s=window['step_time_p90_s'],
            data_wait_frac=window['data_wait_frac'], max_mem_mb=max_memory_mb(self.spec.device),
            mfu=mfu(self.flops_per_image_train, window['images_per_s'], self.peak_flops, self.spec.world_size),
            backend=self.spec.backend, zero_stage=self.spec.zero_stage, world_size=self.spec.world_size,
            precision=self.spec.precision, state_memory=self.state_memory,
            optimizer_impl=backend.optimizer_impl, compile_mode=self.spec.compile_mode,
            channels_last=self.spec.channels_last)
        self.log.metrics(record)
        skipped = record['skipped_steps'] - self._skipped_at_last_log
        self._skipped_at_last_log = record['skipped_steps']
        if steps_in_window >= 4 and skipped > steps_in_window // 2:
            self.report(f'warning: fp16 overflow storm: {skipped} of the last {steps_in_window} steps were skipped; '
                        f'loss scale now {record["loss_scale"]}. Consider bf16, a lower learning rate or clipping.')
        ips = f"{record['images_per_s']:.1f} img/s" if record['images_per_s'] else 'warming up'
        wait = f" | data {100 * record['data_wait_frac']:.0f}%" if record['data_wait_frac'] is not None else ''
        self.report(f"step {step}/{self.max_steps} | loss {loss:.4f} | lr {record['lr']:.2e}"
                    f" | {ips}{wait} | ETA {format_eta(eta)}")
        return loss

    def log_eval(self, step, metrics):
        record = dict(step=step, **metrics)
        self.log.eval(record)
        self.last_eval = record
        self.report(f"eval step {step} | mIoU {metrics['mIoU']:.4f} | OA {metrics['OA']:.4f} | "
                    + ' '.join(f"{n} {v['iou']:.2f}" for n, v in metrics['per_class'].items() if v['iou'] is not None))
        return record

    # -- the end ---------------------------------------------------------------------------
    def completed_summary(self, step):
        """``summary.json`` of a run that completed at ``step`` (on every rank), else None."""
        try:
            with open(os.path.join(self.log.work_dir, 'summary.json')) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            return None
        return summary if summary.get('exit_reason') == 'completed' and summary.get('steps') == step else None

    def _last_logged_eval(self, step):
        """The last row of eval.jsonl at or before ``step``: a resumed run that has not evaluated
        yet reports the evaluation its weights descend from, not null."""
        path = os.path.join(self.log.work_dir, 'eval.jsonl')
        last = None
        if os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row.get('step'), int) and row['step'] <= step:
                        last = row
        return last

    def write_summary(self, exit_reason, step, error, describe_io_error, best=None):
        last = self.last_eval or (self._last_logged_eval(step) if distributed.is_main() else None)
        rows = []
        path = os.path.join(self.log.work_dir, 'metrics.jsonl')
        if distributed.is_main() and os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:  # a line cut short by a full disk
                        continue
        # This run's configuration only: rows of a pass at another world size (before a resume
        # on other ranks) measured another throughput.
        ips = [r['images_per_s'] for r in rows if r.get('images_per_s') and r.get('world_size', self.spec.world_size)
               == self.spec.world_size]
        summary = dict(
            exit_reason=exit_reason, steps=step, wall_time_s=time.time() - self.t_start,
            wall_time_total_s=self.earlier_wall_time_s + time.time() - self.t_start,
            backend=self.spec.backend, zero_stage=self.spec.zero_stage, precision=self.spec.precision,
            world_size=self.spec.world_size, global_batch=self.spec.global_batch,
            images_per_s_median=statistics.median(ips) if ips else None,  # (the upper middle one was taken)
            final_loss=rows[-1]['loss'] if rows else None, skipped_steps=self.backend.skipped_steps,
            mIoU=last['mIoU'] if last else None, OA=last['OA'] if last else None,
            mF1=last['mF1'] if last else None, flops_per_image_fwd=self.flops_per_image_fwd,
            flops_per_image_train=self.flops_per_image_train,
            state_memory=self.state_memory, error=error,
            optimizer_impl=self.backend.optimizer_impl, compile_mode=self.spec.compile_mode,
            compile_time_s=self.compile_time_s, channels_last=self.spec.channels_last, best=best)
        try:
            self.log.write_json('summary.json', summary)
        except OSError as exc:  # the disk that stopped the run may refuse this too
            self.report(f'could not write summary.json: {describe_io_error(exc)}')
        return summary
