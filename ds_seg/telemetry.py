"""Honest step timing, throughput, FLOPs/MFU, memory, and the run's JSONL + TensorBoard logs.

Timing rules (the reason this file exists): GPU kernels run asynchronously, so a host clock read
without synchronising measures how fast work is queued, not done; synchronising every step
instead stalls the host. Steps are therefore timed with CUDA events read once per log window;
warm-up steps are excluded; time spent waiting for the data loader is measured separately.
"""
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time

import torch

# Dense bf16/fp16 peak TFLOP/s by device name (substring match, most specific first).
PEAK_TFLOPS = [
    ('H200', 989.0), ('H100 PCIe', 756.0), ('H100', 989.0), ('GH200', 989.0),
    ('A100', 312.0), ('L40S', 362.0), ('L40', 181.0), ('L4', 121.0), ('A10G', 70.0), ('A10', 125.0),
    ('V100', 125.0), ('RTX 4090', 165.0), ('RTX 3090', 71.0), ('MI300X', 1307.0), ('MI250X', 383.0),
]


def peak_flops(device, override_tflops=None):
    """Peak FLOP/s of ``device`` for MFU, or None where unknown (e.g. a CPU)."""
    if override_tflops:
        return float(override_tflops) * 1e12
    if device.type != 'cuda':
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def forward_flops(build_model, input_shape_BCHW):
    """Forward FLOPs for one input of ``input_shape_BCHW``, counted on the meta device.

    ``build_model`` is a zero-argument callable; on the meta device no weight memory is used,
    so this works for billion-parameter models too. Returns None if the model cannot run on meta.
    """
    counted = image_flops(build_model, input_shape_BCHW)
    return counted[0] if counted else None


def image_flops(build_model, input_shape_BCHW):
    """``(forward, training)`` FLOPs for one input of ``input_shape_BCHW``, counted on the meta
    device, or None if the model cannot run there. ``build_model`` returns the model as it will
    train: with ``requires_grad`` off where it will not train (a frozen backbone).

    Training is the forward plus a backward of twice the forward (the gradients of the inputs
    and of the weights) for every module that runs one: a module whose parameters are all frozen
    and whose inputs need no gradient (a frozen backbone, which the image enters first) runs
    none, and MFU counted the usual 3x for it measured work never done (a linear probe of a ViT
    counted ~2.8x its real FLOPs). Not torch's own count of a backward pass: that counts a
    grouped convolution's backward ``groups`` times over (a depthwise 3x3 conv of 64 channels:
    65x its forward)."""
    from torch.utils.flop_counter import FlopCounterMode

    from .models.common import meta_device
    try:
        with meta_device():
            model = build_model()
            x = torch.empty(*input_shape_BCHW)
        model.eval()
        with _modules_without_backward(model) as no_backward, \
                FlopCounterMode(display=False) as counter, torch.enable_grad():
            model(x)  # grad mode on: whether an input needs a gradient is what is traced
        counts = counter.get_flop_counts()
    except Exception:  # an op without a meta kernel: MFU is then simply not reported
        return None
    forward = sum(counts.get('Global', {}).values())
    # The counter names a module '<root class>.<its name in named_modules()>'.
    root = type(model).__name__
    skipped = sum(sum(counts.get(f'{root}.{name}', {}).values()) for name in no_backward)
    return int(forward), int(forward + 2 * (forward - skipped))


@contextlib.contextmanager
def _modules_without_backward(model):
    """Hooks, for one forward pass in grad mode, the frozen modules of ``model`` (parameters,
    none of them trained); yields a list that holds, after it, the outermost ones whose inputs
    needed no gradient (no backward runs through them). The hooks are removed on exit."""
    without, with_grad, handles = set(), set(), []
    for name, module in model.named_modules():
        params = list(module.parameters())
        if name and params and not any(p.requires_grad for p in params):
            def pre_hook(module, args, kwargs, name=name):
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                # One call that needs the input's gradient: this module runs a backward after all.
                (with_grad if any(t.requires_grad for t in tensors) or not tensors else without).add(name)
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
    found = []
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
    names = sorted(without - with_grad)
    found.extend(n for n in names if not any(n.startswith(f'{outer}.') for outer in names))


def mfu(flops_per_image_train, images_per_s, peak, devices=1):
    """Model FLOP utilisation: a training step's FLOPs per image (``image_flops``: ~3x the
    forward, forward + 2x for backward) at ``images_per_s``. ``images_per_s`` is the rate of all
    ``devices`` together, ``peak`` one device's: the run's images are divided over the peak of
    every device that trained them."""
    if not flops_per_image_train or not peak or not images_per_s:
        return None
    return flops_per_image_train * images_per_s / (peak * devices)


def max_memory_mb(device):
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == 'darwin' else 1024)


class StepTimer:
    """Per-step time and data wait, collected over a logging window, with no host wait per step.

    On a GPU each step's start and end are CUDA events recorded on the current stream: the
    interval is the time the device took from the moment the step could start (after any data
    wait and any work still queued from the previous step) to the end of its last kernel. The
    events are read once per window, in :meth:`summary` (a log step), so the p90 is over real
    per-step times, not queueing times. On a CPU work is synchronous and the host clock is exact.
    Data wait is the host time blocked on the loader. Warm-up steps are excluded.
    """

    def __init__(self, device, warmup_steps):
        self.cuda = device.type == 'cuda'
        self.warmup_steps = warmup_steps
        self.steps_seen = 0
        self.reset()

    def reset(self):
        self._steps = []      # (start mark, end mark, data wait s) per timed step of the window
        self.images = 0
        self.pixels = 0

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start, end):
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def data_wait(self, seconds):
        self._wait += seconds

    def start(self):
        self._wait = 0.0
        self._t0 = self._mark()

    def stop(self, images, pixels):
        end = self._mark()
        self.steps_seen += 1
        if self.steps_seen > self.warmup_steps:
            self._steps.append((self._t0, end, self._wait))
            self.images += images
            self.pixels += pixels

    def summary(self):
        """Throughput over the window's timed steps; None fields while still warming up. On a GPU
        this waits for the window's last event: call it at log steps only."""
        if not self._steps:
            return dict(images_per_s=None, megapixels_per_s=None, step_time_s=None,
                        step_time_p90_s=None, data_wait_frac=None)
        if self.cuda:
            self._steps[-1][1].synchronize()
        step_times = [self._seconds(start, end) for start, end, _ in self._steps]
        total = sum(step_times)
        times = sorted(step_times)
        return dict(images_per_s=self.images / total,
                    megapixels_per_s=self.pixels / total / 1e6,
                    step_time_s=statistics.median(times),
                    step_time_p90_s=times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))],
                    data_wait_frac=sum(wait for _, _, wait in self._steps) / total)


def new_archive(work_dir):
    """A new, empty ``previous/<time>[-N]/`` folder: two archivings within a second never share
    one (a file of the first would be replaced)."""
    base = os.path.join(work_dir, 'previous', time.strftime('%Y%m%d-%H%M%S'))
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for n in range(1000):
        path = base if n == 0 else f'{base}-{n}'
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f'{base}: 1000 archives in one second')


def differing_keys(old, new, prefix=''):
    """The dotted keys whose values differ between two JSON objects (``data.crop_size``)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [] if old == new else [prefix or '(the whole file)']
    keys = []
    for key in sorted(set(old) | set(new), key=str):
        keys += differing_keys(old.get(key), new.get(key), f'{prefix}.{key}' if prefix else str(key))
    return keys


def finite_or_none(obj):
    """``obj`` with every NaN or infinite float inside it replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


@contextlib.contextmanager
def _named_on_failure(path):
    """An OSError without a file name (a buffered write failing at close on a full disk) gets
    ``path``: the stop line said "a file: [Errno 28 ENOSPC]"."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), path) from exc
        raise


TRACKER_TITLES = {'mlflow': 'MLflow', 'wandb': 'W&B'}


def _recorded_tracker_runs(work_dir):
    try:
        with open(os.path.join(work_dir, RunLog.TRACKER_RUNS)) as f:
            runs = json.load(f)
    except (OSError, ValueError):
        return {}
    return runs if isinstance(runs, dict) else {}


class RunLog:
    """Rank 0's writer for metrics.jsonl, eval.jsonl and tb/ (other ranks get a no-op)."""

    def __init__(self, work_dir, enabled):
        self.enabled = enabled
        self.work_dir = work_dir
        self.tb = None
        self.purge_step = None    # set by a resume: TensorBoard hides what the crashed run logged from there
        self.tensorboard = True   # log.trackers without 'tensorboard' turns it off
        self.trackers = []        # MLflow / W&B (ds_seg.trackers): the same scalars, config, summary
        self.forked_from = {}     # tracker runs a copied work dir's original logs to (not continued)
        if enabled:
            os.makedirs(work_dir, exist_ok=True)

    def _writer(self):
        # Created lazily so start() can first move an earlier run's tb/ aside.
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(self.work_dir, 'tb'), purge_step=self.purge_step)
        return self.tb

    LOGS = ('metrics.jsonl', 'eval.jsonl', 'summary.json')

    def start(self, resumed_step=None, set_aside=None, brought_back=None):
        """Resumed: rows logged after the checkpoint are redone, so they leave the live logs; they
        move to ``set_aside/`` when the resume abandons a branch (a rollback), else are dropped
        (a crashed run's rows, repeated identically). ``brought_back``: the step after which an
        abandoned branch, made live again with its rows (checkpoint.bring_back_branch), had
        branched. Fresh: move an earlier run's logs aside into ``previous/<time>/`` (never delete
        them). A damaged line (a disk that filled mid-write) is moved to ``<name>.damaged``
        instead of breaking the run."""
        for name in ('metrics.jsonl', 'eval.jsonl'):
            self._repair_jsonl(name)
        if resumed_step is not None:
            branch_point = resumed_step if brought_back is None else brought_back
            # The steps after the checkpoint are redone: their TensorBoard points (each step twice,
            # the rolled-back ones beside the redone ones) are purged as the jsonl rows are; after
            # a branch point, with the other branch's points.
            self.purge_step = branch_point + 1
            kept = {}
            for name in ('metrics.jsonl', 'eval.jsonl'):
                path = os.path.join(self.work_dir, name)
                if os.path.isfile(path):
                    with open(path) as f:
                        lines = [line for line in f if line.strip()]
                    keep = [line for line in lines if json.loads(line)['step'] <= resumed_step]
                    later = [line for line in lines if json.loads(line)['step'] > resumed_step]
                    if set_aside and later:
                        with open(os.path.join(set_aside, name), 'w') as f:
                            f.writelines(later)
                    with open(path + '.tmp', 'w') as f:
                        f.writelines(keep)
                    os.replace(path + '.tmp', path)
                    if brought_back is not None:
                        kept[name] = [json.loads(line) for line in keep]
            # The abandoned branch's summary (its end, past the step resumed from) goes with its
            # rows: this run's end would write over it.
            summary = os.path.join(self.work_dir, 'summary.json')
            if set_aside and os.path.isfile(summary) and not self._summary_at_or_before(summary, branch_point):
                os.replace(summary, os.path.join(set_aside, 'summary.json'))
                self._point_best_at_set_aside(set_aside)
            # The branch brought back: its points after the branch point, purged with the other's, again.
            for name, scalars in (('metrics.jsonl', self._train_scalars), ('eval.jsonl', self._eval_scalars)):
                for record in kept.get(name, ()):
                    if record['step'] > branch_point:
                        self._to_tensorboard(scalars(record), record['step'])
            return
        # A fresh run in a used work dir: the earlier run's logs and the configs that made them
        # move to previous/<time>/ together, so neither is lost nor mistaken for this run's.
        # So do the files this run's saves write into checkpoints/ beside the step folders (a fresh
        # run holds none of those): a user's own checkpoints/latest was replaced without a word.
        from .engine.checkpoint import BESIDE_STEPS
        old = [n for n in self.LOGS + ('tb', 'config.json', 'ds_config.json', self.TRACKER_RUNS)
               + tuple(os.path.join('checkpoints', n) for n in BESIDE_STEPS)
               if os.path.lexists(os.path.join(self.work_dir, n))]
        if old:
            archive = new_archive(self.work_dir)
            for name in old:
                os.makedirs(os.path.dirname(os.path.join(archive, name)), exist_ok=True)
                os.replace(os.path.join(self.work_dir, name), os.path.join(archive, name))
            # Said, as a resume's move is: the user found their logs gone without a word.
            print(f"[ds_seg] the logs of an earlier run in {self.work_dir} ({', '.join(old)}) moved to {archive}/",
                  flush=True)

    def _point_best_at_set_aside(self, set_aside):
        """The abandoned branch's summary.json named its best as ``<work dir>/checkpoints/step_N``,
        which moved with the branch, and where the new branch saves its own step N: name where it
        is now."""
        path = os.path.join(set_aside, 'summary.json')
        try:
            with open(path) as f:
                summary = json.load(f)
            best = summary.get('best') or {}
            named = best.get('checkpoint')
        except (OSError, ValueError, AttributeError):
            return
        if not isinstance(named, str):
            return
        moved = os.path.join(set_aside, 'checkpoints', os.path.basename(named))
        live = os.path.join(self.work_dir, 'checkpoints')
        if os.path.isdir(moved) and os.path.abspath(os.path.dirname(named)) == os.path.abspath(live):
            best['checkpoint'] = moved
            with open(path + '.tmp', 'w') as f:
                json.dump(summary, f, indent=2)
            os.replace(path + '.tmp', path)

    @staticmethod
    def _summary_at_or_before(path, step):
        try:
            with open(path) as f:
                steps = json.load(f).get('steps')
        except (OSError, ValueError, AttributeError):
            return False
        return isinstance(steps, int) and steps <= step

    TRACKER_RUNS = 'trackers.json'  # the MLflow/W&B runs this work dir's steps are logged to
    RECORDED_BY = 'work_dir'          # ... and, in it, the work dir that wrote it (a copy keeps the original's)

    def tracker_runs(self):
        """What ``trackers.json`` recorded ({tracker: ids}), {} when there is none or it is unreadable."""
        return _recorded_tracker_runs(self.work_dir)

    def tracker_runs_to_continue(self, names):
        """``(runs, note)``: the tracker runs a resume logs on to, and a line when some are not. A
        copied work dir (``cp -a``, a forked experiment) whose original is still there, recording
        the same runs, is a fork: both would log their steps into one MLflow/W&B run, interleaved.
        Its steps start runs of their own; a moved, symlinked or otherwise mounted one logs on.
        ``names``: the trackers this pass starts (only those are said)."""
        runs = self.tracker_runs()
        original = runs.get(self.RECORDED_BY)
        if not isinstance(original, str) or not os.path.isdir(original):
            return runs, None
        try:
            if os.path.samefile(original, self.work_dir):
                return runs, None
        except OSError:
            return runs, None
        from .trackers import run_is_inside_work_dir
        theirs = _recorded_tracker_runs(original)
        shared = [name for name, ids in runs.items() if name != self.RECORDED_BY and theirs.get(name) == ids
                  and not run_is_inside_work_dir(name, ids)]   # (the copy holds a copy of that one)
        # Forgotten also for a tracker this pass does not start, so a later pass with it does not log on.
        self.forked_from = {name: runs.pop(name) for name in shared}
        said = '/'.join(TRACKER_TITLES.get(name, name) for name in shared if name in names)
        if not said:
            return runs, None
        return runs, (f"{said}: this work dir is a copy of {original}, which logs to the same {said} run; the "
                      "copy's resumed steps start a run of their own (the original's go on in its own)")

    def record_tracker_runs(self):
        """Add this run's tracker runs to ``trackers.json``, keeping those of trackers a pass did
        not start (a resume without W&B, then one with it again, goes on in the same W&B run),
        and the work dir that wrote it (see :meth:`tracker_runs_to_continue`)."""
        if self.trackers:
            kept = {name: ids for name, ids in self.tracker_runs().items() if name not in self.forked_from}
            runs = dict(kept, **{tracker.NAME: tracker.ids() for tracker in self.trackers})
            runs[self.RECORDED_BY] = os.path.abspath(self.work_dir)
            self.write_json(self.TRACKER_RUNS, runs)

    def keep_replaced(self, files):
        """On resume, before ``files`` ({name: object}) are written: those already in the work
        dir that would change (a longer ``max_steps``, another world size...) move to
        ``previous/<time>/``, the record of what the steps before this resume ran with."""
        if not self.enabled:
            return
        changed, keys = [], []
        for name, obj in files.items():
            try:
                with open(os.path.join(self.work_dir, name)) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                continue
            new = json.loads(json.dumps(obj, default=str))
            if old != new:
                changed.append(name)
                keys += [key for key in differing_keys(old, new) if key not in keys]
        if changed:
            archive = new_archive(self.work_dir)
            for name in changed:
                os.replace(os.path.join(self.work_dir, name), os.path.join(archive, name))
            # Which settings: a resume with another data.crop_size was said only as "differs".
            said = ', '.join(keys[:6]) + (f' and {len(keys) - 6} more' if len(keys) > 6 else '')
            print(f"[ds_seg] {' and '.join(changed)} of the run before this resume "
                  f"{'differs' if len(changed) == 1 else 'differ'} from this run's ({said}); kept in {archive}/",
                  flush=True)

    def _repair_jsonl(self, name):
        path = os.path.join(self.work_dir, name)
        if not os.path.isfile(path):
            return
        good, bad = [], []
        with open(path, 'rb') as f:
            for raw in f:
                line = raw.decode('utf-8', 'replace')
                if not line.strip():
                    continue
                try:
                    if not isinstance(json.loads(line).get('step'), int):
                        raise ValueError
                    good.append(line if line.endswith('\n') else line + '\n')
                except (ValueError, AttributeError):
                    bad.append(line if line.endswith('\n') else line + '\n')
        if bad:
            with open(path + '.damaged', 'a') as f:
                f.writelines(bad)
            with open(path + '.tmp', 'w') as f:
                f.writelines(good)
            os.replace(path + '.tmp', path)
            print(f'[ds_seg] {path}: {len(bad)} damaged line(s) (a write cut short) moved to {path}.damaged',
                  flush=True)

    def _append(self, name, record):
        path = os.path.join(self.work_dir, name)
        with _named_on_failure(path), open(path, 'a') as f:
            f.write(json.dumps(record) + '\n')

    def metrics(self, record):
        if not self.enabled:
            return
        self._append('metrics.jsonl', record)
        self._scalars(self._train_scalars(record), record['step'])

    @staticmethod
    def _train_scalars(record):
        return {f'train/{key}': value for key, value in record.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ('step',)}

    @staticmethod
    def _eval_scalars(record):
        scalars = {f'val/{key}': record[key] for key in ('mIoU', 'OA', 'mF1') if record.get(key) is not None}
        scalars.update({f'val_iou/{name}': values['iou'] for name, values in record.get('per_class', {}).items()
                        if values.get('iou') is not None})
        return scalars

    def _to_tensorboard(self, scalars, step):
        if self.tensorboard:
            for tag, value in scalars.items():
                self._writer().add_scalar(tag, value, step)

    def _scalars(self, scalars, step):
        self._to_tensorboard(scalars, step)
        self._to_trackers('scalars', {tag: float(value) for tag, value in scalars.items()}, step)

    def _to_trackers(self, method, *args):
        """``tracker.method(*args)`` for each tracker. One that fails (its server went away, its
        store was deleted) is said in one line and dropped for the rest of the run: the work dir's
        logs and TensorBoard keep every step, and a logging service is no reason to lose the
        training since the last checkpoint."""
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:
                self.trackers.remove(tracker)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                said = ('could not close its run' if method == 'close' else
                        'failed; it is left out for the rest of this run')
                print(f"[ds_seg] warning: {tracker.NAME} {said} ({first}); metrics.jsonl, eval.jsonl and TensorBoard "
                      f"in {self.work_dir} keep every step", flush=True)
                try:
                    tracker.close('error')
                except Exception:  # the same failure again: the run there stays as it is
                    pass

    def eval(self, record):
        if not self.enabled:
            return
        self._append('eval.jsonl', record)
        self._scalars(self._eval_scalars(record), record['step'])
        if self.tb is not None:
            self.tb.flush()

    def write_json(self, name, obj):
        if self.enabled:
            tmp = os.path.join(self.work_dir, f'.{name}.tmp')
            try:
                with _named_on_failure(os.path.join(self.work_dir, name)), open(tmp, 'w') as f:
                    # Strict JSON (jq, JavaScript, most parsers refuse NaN): a loss that overflowed
                    # is null in summary.json; metrics.jsonl keeps the step's NaN/Infinity.
                    json.dump(finite_or_none(obj), f, indent=2, default=str)
                os.replace(tmp, os.path.join(self.work_dir, name))
            except OSError:
                if os.path.exists(tmp):
                    os.remove(tmp)  # no temporary file left behind on a full disk
                raise
            if name in ('config.json', 'summary.json'):
                self._to_trackers('config' if name == 'config.json' else 'summary', obj)

    def close(self, exit_reason=None):
        """``exit_reason``: how the run ended (Trainer.exit_reason), the trackers' run status."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        self.close_trackers(exit_reason)

    def close_trackers(self, exit_reason):
        self._to_trackers('close', exit_reason)
        self.trackers = []


def format_eta(seconds):
    if seconds is None:
        return '?'
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f'{h}h{m:02d}m' if h else f'{m}m{s:02d}s'
