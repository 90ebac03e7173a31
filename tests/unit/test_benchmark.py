"""launch/benchmark.py's arithmetic and output schema, MFU, and the state-memory accounting,
checked against figures worked out by hand (no training is launched here; one test stops a process group)."""
import json
import os
import statistics
import sys
import time

import pytest
import torch

from ds_seg import telemetry
from ds_seg.memory import state_memory, zero_formula
from ds_seg.cli import benchmark

MB = 2 ** 20


# -- MFU ----------------------------------------------------------------------------------------
def test_mfu_is_training_flops_per_image_over_peak():
    # 300 GFLOP per trained image (a 100 GFLOP forward and its backward), 50 img/s, 989 TFLOP/s:
    # 3e11 * 50 / 9.89e14 = 1.5167 %
    assert telemetry.mfu(3e11, 50.0, 989e12) == pytest.approx(0.0151668, rel=1e-4)
    assert telemetry.mfu(None, 50.0, 989e12) is None and telemetry.mfu(3e11, 50.0, None) is None
    # Two devices training 100 img/s together use each as much as one at 50 img/s.
    assert telemetry.mfu(3e11, 100.0, 989e12, devices=2) == pytest.approx(0.0151668, rel=1e-4)


def _two_convs(freeze_first=False, freeze_second=False):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
                                torch.nn.Conv2d(8, 4, 1, bias=False))
    model[0].requires_grad_(not freeze_first)
    model[1].requires_grad_(not freeze_second)
    return model


def test_training_flops_skip_the_backward_of_a_frozen_first_part():
    first, second = 2 * 8 * 16 * 16 * 3 * 9, 2 * 4 * 16 * 16 * 8    # 2 FLOPs per multiply-add
    shape = (1, 3, 16, 16)
    assert telemetry.image_flops(_two_convs, shape) == (first + second, 3 * (first + second))
    # A frozen first conv (the image enters it, its weights do not train): no backward through it.
    assert telemetry.image_flops(lambda: _two_convs(freeze_first=True), shape) == (first + second,
                                                                                  first + 3 * second)
    # A frozen conv after a trained one still passes the gradient back: it runs its backward.
    assert telemetry.image_flops(lambda: _two_convs(freeze_second=True), shape) == (first + second,
                                                                                   3 * (first + second))
    assert telemetry.image_flops(lambda: _two_convs(True, True), shape) == (first + second, first + second)


def test_training_flops_of_a_frozen_backbone():
    # A ViT's blocks frozen (its fresh neck trains with the heads): a linear probe's step is the
    # forward plus the backward of the neck and heads only, not 3x the forward.
    from ds_seg.engine import param_groups
    from ds_seg.registry import MODELS, build
    cfg = dict(type='UperNetViTTiny', in_channels=3, num_classes=4)
    shape = (1, 3, 64, 64)
    fwd, train = telemetry.image_flops(lambda: build(MODELS, cfg), shape)
    assert train == 3 * fwd

    def frozen():
        model = build(MODELS, cfg)
        param_groups.freeze_backbone(model, dict(paramwise=dict(freeze_backbone=True)))
        return model
    fwd_frozen, train_frozen = telemetry.image_flops(frozen, shape)
    from torch.utils.flop_counter import FlopCounterMode
    from ds_seg.models.common import meta_device
    with meta_device():  # on the CPU, torch counts no FLOPs for its own fused attention kernel
        model = build(MODELS, cfg).eval()
        image = torch.empty(shape)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(image)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    blocks = counts[f'{root}.backbone'] - counts[f'{root}.backbone.neck']
    assert fwd_frozen == fwd == counts['Global'] and 0 < blocks < fwd
    assert train_frozen == fwd + 2 * (fwd - blocks)


def test_peak_flops_table_and_override(monkeypatch):
    assert telemetry.peak_flops(torch.device('cpu')) is None
    assert telemetry.peak_flops(torch.device('cpu'), override_tflops=2.5) == 2.5e12
    cuda = torch.device('cuda', 0)  # constructing a device needs no GPU
    for name, tflops in (('NVIDIA H100 PCIe', 756.0), ('NVIDIA H100 80GB HBM3', 989.0),
                         ('NVIDIA H200', 989.0), ('NVIDIA A100-SXM4-80GB', 312.0), ('NVIDIA L40S', 362.0)):
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None, n=name: n)
        assert telemetry.peak_flops(cuda) == tflops * 1e12, name


def test_forward_flops_counts_a_conv_exactly():
    # 2 FLOPs per multiply-add: 2 * out_ch * H * W * in_ch * k * k = 2 * 8 * 16 * 16 * 3 * 9
    flops = telemetry.forward_flops(lambda: torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), (1, 3, 16, 16))
    assert flops == 2 * 8 * 16 * 16 * 3 * 9


# -- ZeRO formula and live-tensor accounting ---------------------------------------------------------
def test_zero_formula_by_stage():
    psi = 1_000_000
    ddp = zero_formula(psi, None, 4, 'fp32')
    assert (ddp['params_bytes'], ddp['grads_bytes'], ddp['master_bytes'], ddp['optim_bytes']) == (4e6, 4e6, 0, 8e6)
    assert zero_formula(psi, 0, 4, 'fp32') == ddp
    z1, z2, z3 = (zero_formula(psi, s, 4, 'fp32') for s in (1, 2, 3))
    assert (z1['grads_bytes'], z1['optim_bytes'], z1['master_bytes']) == (4e6, 2e6, 1e6)
    assert (z2['params_bytes'], z2['grads_bytes']) == (4e6, 1e6)
    assert z3['params_bytes'] == 1e6 and z3['total_bytes'] == (4 + 4 + 4 + 8) * 1e6 / 4  # fp32 + master copy
    # Mixed precision: the paper's 2Ψ + 2Ψ + 12Ψ, i.e. 16Ψ for DDP and 16Ψ/N for ZeRO-3.
    assert zero_formula(psi, 0, 4, 'bf16')['total_bytes'] == 16e6
    assert zero_formula(psi, 2, 4, 'bf16')['total_bytes'] == 2e6 + 14e6 / 4
    assert zero_formula(psi, 3, 4, 'fp16')['total_bytes'] == 16e6 / 4


class _FakeDDP:
    """What state_memory reads from a DDP backend: its (module, optimizer, inner optimizer)."""

    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer

    def state_holders(self):
        return self.module, self.optimizer, self.optimizer


def test_state_memory_counts_adam_state_and_shared_storage_once():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))  # 220 + 105 = 325 params
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    before = state_memory(_FakeDDP(model, opt))
    assert before['optim_bytes'] == 0  # Adam creates its state in the first step
    opt.step()
    model(torch.randn(3, 10)).sum().backward()
    m = state_memory(_FakeDDP(model, opt))
    assert m['num_params'] == 325
    assert (m['params_bytes'], m['grads_bytes'], m['master_bytes']) == (1300, 1300, 0)
    # exp_avg + exp_avg_sq (2 x 1300) plus one 4-byte 'step' tensor per parameter tensor
    assert m['optim_bytes'] == 2600 + 4 * 4
    # A gradient that is a view into a parameter's storage is counted once, under params.
    model[1].bias.grad = model[1].weight.data.view(-1)[:5]
    assert state_memory(_FakeDDP(model, opt))['grads_bytes'] == 1300 - 5 * 4


# -- benchmark rows -------------------------------------------------------------------------------
def _fake_run(folder, backend, zero_stage, step_times, warmup, global_batch=8, mfu_per_ips=0.001,
              precision='fp32', state=None):
    os.makedirs(folder)
    with open(os.path.join(folder, 'metrics.jsonl'), 'w') as f:
        for step, t in enumerate(step_times, 1):
            timed = step > warmup
            ips = global_batch / t if timed else None
            f.write(json.dumps(dict(step=step, step_time_s=t if timed else None, images_per_s=ips,
                                    megapixels_per_s=ips * 0.016384 if timed else None,
                                    data_wait_frac=0.1 if timed else None, max_mem_mb=100.0 + step,
                                    mfu=ips * mfu_per_ips if timed else None)) + '\n')
    json.dump(dict(zero_stage=zero_stage, precision=precision, world_size=2, global_batch=global_batch,
                   exit_reason='completed', state_memory=state), open(os.path.join(folder, 'summary.json'), 'w'))
    json.dump(dict(train_micro_batch_size_per_gpu=global_batch // 2), open(os.path.join(folder, 'ds_config.json'), 'w'))


def test_rows_have_the_design_fields_and_correct_figures(tmp_path):
    times_ddp = [9.0, 9.0, 0.5, 0.4, 0.6, 0.5, 1.0]          # 2 warm-up steps, then 5 timed
    times_z2 = [9.0, 9.0, 1.0, 0.8, 1.2, 1.0, 2.0]
    state = dict(num_params=1000, params_bytes=4000, grads_bytes=2000, master_bytes=2000, optim_bytes=4000,
                 comm_buffers_bytes=0, total_bytes=12000)
    _fake_run(tmp_path / 'ddp', 'ddp', None, times_ddp, warmup=2)
    _fake_run(tmp_path / 'zero2', 'zero2', 2, times_z2, warmup=2, state=state)
    rows = benchmark.add_speedups([benchmark.summarise_run(str(tmp_path / 'ddp'), 'ddp', 2),
                                   benchmark.summarise_run(str(tmp_path / 'zero2'), 'zero2', 2)])
    ddp, z2 = rows
    assert set(benchmark.ROW_FIELDS + benchmark.MEMORY_FIELDS) <= set(ddp)
    timed = [0.5, 0.4, 0.6, 0.5, 1.0]
    assert ddp['step_time_median_s'] == statistics.median(timed) == 0.5
    assert ddp['step_time_p90_s'] == 1.0
    assert ddp['images_per_s'] == pytest.approx(8 * 5 / sum(timed))
    assert ddp['megapixels_per_s'] == pytest.approx(ddp['images_per_s'] * 0.016384)
    assert ddp['data_wait_frac'] == pytest.approx(0.1)
    assert ddp['max_mem_mb'] == 107.0 and ddp['micro_batch'] == 4 and ddp['timed_steps'] == 5
    assert ddp['mfu'] == pytest.approx(0.001 * ddp['images_per_s'])
    assert ddp['speedup_vs_ddp'] == 1.0 and z2['speedup_vs_ddp'] == pytest.approx(0.5)
    assert z2['formula_optim_bytes'] == 4000 and z2['formula_grads_bytes'] == 2000 and z2['state_bytes'] == 12000
    assert ddp['num_params'] is None  # no measurement: None, never a made-up figure

    meta = dict(config='tiny', machine='test cpu', launcher='torchrun', nproc=2, steps=5, warmup=2,
                command='launch/benchmark.py', max_batch=32)
    benchmark.write_markdown(tmp_path / 'b.md', rows, meta)
    text = (tmp_path / 'b.md').read_text()
    assert 'test cpu' in text and '| zero2 | 2 | fp32 | 2 | 4 |' in text and '| 0.500 |' in text
    assert 'different precisions' not in text
    # --precision json with JSONs of other modes: the table says its rows compare precisions too.
    mixed = [dict(ddp, precision='bf16-autocast'), dict(z2, precision='bf16')]
    benchmark.write_markdown(tmp_path / 'mixed.md', mixed, meta)
    assert 'rows ran in different precisions (ddp bf16-autocast, zero2 bf16)' in (tmp_path / 'mixed.md').read_text()
    benchmark.write_plot(tmp_path / 'b.png', rows, meta)
    assert (tmp_path / 'b.png').read_bytes()[:4] == b'\x89PNG'
    # The plot's bars are of the statistic its speed-up labels are: the median step.
    assert ddp['global_batch'] == 8 and ddp['global_batch'] / ddp['step_time_median_s'] == 16.0


def test_find_max_batch_doubles_then_bisects(monkeypatch, tmp_path):
    tried = []

    def fake_run(args, name, work_dir, steps, warmup, micro_batch=None, extra_options=()):
        tried.append(micro_batch)
        return (0, 'ok') if micro_batch <= 13 else (1, 'torch.OutOfMemoryError: CUDA out of memory.')

    monkeypatch.setattr(benchmark, 'run_backend', fake_run)
    args = benchmark.parse_args(['--work-dir', str(tmp_path)])
    assert benchmark.find_max_batch(args, 'zero2', 2, 1024) == (13, False)
    assert tried[:4] == [2, 4, 8, 16] and tried[-1] in (13, 14)
    tried.clear()
    assert benchmark.find_max_batch(args, 'zero2', 2, 10) == (10, True)   # capped: it never failed
    monkeypatch.setattr(benchmark, 'run_backend', lambda *a, **k: (1, 'ValueError: bad config'))
    with pytest.raises(RuntimeError, match='other than memory'):
        benchmark.find_max_batch(args, 'zero2', 2, 64)


def test_a_size_search_stopped_by_a_refusal_gives_the_row_its_refusal_line(monkeypatch, tmp_path):
    """A probe refused for a reason other than memory: the row's error was the last 300
    characters of its output, cut mid-word ('ccelerator to CPU...') and the launcher's lines after."""
    noise = 'Setting ds_accelerator to cpu (auto detect)\n' * 20

    def fake_run(args, name, work_dir, steps, warmup, micro_batch=None, extra_options=()):
        if not extra_options:  # the timed run: out of memory at the configured size, so the search runs
            return 1, '[rank0]: torch.OutOfMemoryError: CUDA out of memory.'
        return 1, noise + 'ds_seg: error: model.depth 8 is too deep for data.crop_size 64\n' + noise

    monkeypatch.setattr(benchmark, 'run_backend', fake_run)
    work = tmp_path / 'bench'
    assert benchmark.main(['--work-dir', str(work), '--launcher', 'python', '--backends', 'ddp',
                           '--find-max-model', 'model.depth', '--model-start', '8', '--max-model', '32']) == 1
    (row,) = json.loads((work / 'benchmark.json').read_text())['rows']
    assert row['error'] == ('ddp: model.depth=8 failed for a reason other than memory: ds_seg: error: model.depth 8 '
                            'is too deep for data.crop_size 64'), row['error']
    assert benchmark.search_error(RuntimeError('no output')) == 'no output'


def test_largest_fitting_doubles_then_bisects_to_the_resolution():
    tried = []

    def fits(n):
        tried.append(n)
        return n <= 37
    assert benchmark.largest_fitting(fits, 8, 100) == (37, False)
    assert tried == [8, 16, 32, 64, 48, 40, 36, 38, 37]
    tried.clear()
    assert benchmark.largest_fitting(fits, 8, 100, resolution=lambda good: good // 8) == (36, False)
    assert tried == [8, 16, 32, 64, 48, 40, 36]          # 36..40 is within 36 // 8
    assert benchmark.largest_fitting(lambda n: False, 3, 20) == (0, False)


def test_find_max_model_searches_a_config_key_and_reports_the_parameters_of_the_largest(monkeypatch, tmp_path):
    tried = []

    def fake_run(args, name, work_dir, steps, warmup, micro_batch=None, extra_options=()):
        (option,) = extra_options
        key, depth = option.split('=')
        tried.append(int(depth))
        if int(depth) > 40:
            return 1, 'torch.OutOfMemoryError: CUDA out of memory.'
        os.makedirs(work_dir, exist_ok=True)
        with open(os.path.join(work_dir, 'summary.json'), 'w') as f:
            json.dump({'state_memory': {'num_params': 1000 * int(depth)}}, f)
        return 0, 'ok'

    monkeypatch.setattr(benchmark, 'run_backend', fake_run)
    args = benchmark.parse_args(['--work-dir', str(tmp_path), '--cfg-options', 'model.depth=24'])
    assert benchmark._option_value(args.cfg_options, 'model.depth') == 24
    # 24 fits, 48 does not; bisection until the gap is within 1/8 of the depth that fits.
    assert benchmark.find_max_model(args, 'ddp', 'model.depth', 24, 256) == (39, False, 39000)
    assert tried == [24, 48, 36, 42, 39]
    assert not os.path.exists(tmp_path / 'ddp_maxmodel'), 'the probe runs are removed'


def test_size_search_runs_where_the_configured_size_runs_out_of_memory(monkeypatch, tmp_path):
    """On an H100 capped to 4 GiB, DDP's timed run of ViT-L (depth 24) ran out of memory and the
    row ended there: --find-max-model never asked which depth DDP does fit. The search now starts
    from below; the row keeps its OOM line, and a search that answered is no failure of the command."""
    def fake_run(args, name, work_dir, steps, warmup, micro_batch=None, extra_options=()):
        depth = int(extra_options[0].split('=')[1]) if extra_options else 24
        if depth > 12:
            return 1, '[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 34.00 MiB.'
        os.makedirs(work_dir, exist_ok=True)
        with open(os.path.join(work_dir, 'summary.json'), 'w') as f:
            json.dump({'state_memory': {'num_params': 1000 * depth}}, f)
        return 0, 'ok'

    monkeypatch.setattr(benchmark, 'run_backend', fake_run)
    work = tmp_path / 'bench'
    assert benchmark.main(['--work-dir', str(work), '--launcher', 'python', '--backends', 'ddp',
                           '--find-max-model', 'model.depth', '--model-start', '8', '--max-model', '32',
                           '--cfg-options', 'model.depth=24']) == 0
    (row,) = json.loads((work / 'benchmark.json').read_text())['rows']
    assert row['max_model'] == 12 and row['max_model_params'] == 12000 and not row['max_model_capped']
    assert 'OutOfMemoryError' in row['error']
    table = (work / 'benchmark.md').read_text()
    assert '| ddp | out of memory at the configured size (the size search below ran): ' in table
    assert '| ddp | 12 | 0.0 M |' in table
    # The GPU acceptance report keeps a micro-batch search's answer on such a row.
    import importlib.util
    from ds_seg.config import REPO_ROOT
    spec = importlib.util.spec_from_file_location('acceptance_report', REPO_ROOT / 'tools' / 'acceptance_report.py')
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    out = tmp_path / 'acceptance'
    (out / 'max_batch').mkdir(parents=True)
    (out / 'steps.jsonl').write_text('{"step": "max_batch", "status": "ok", "seconds": 1}\n')
    (out / 'max_batch' / 'benchmark.json').write_text(json.dumps(dict(rows=[dict(
        backend='ddp', error='torch.OutOfMemoryError: CUDA out of memory.', oom=True, max_micro_batch=6)])))
    report.build_report(str(out), dry_run=False, seconds=1)
    assert ("| max_batch | ddp | out of memory at the configured size: 'torch.OutOfMemoryError: CUDA out of memory.'"
            "; largest micro-batch 6 |") in (out / 'acceptance.md').read_text()
    # Another failure of the configured size is still a failure, and no search runs.
    monkeypatch.setattr(benchmark, 'run_backend', lambda *a, **k: (1, 'ValueError: bad config'))
    assert benchmark.main(['--work-dir', str(tmp_path / 'other'), '--launcher', 'python', '--backends', 'ddp',
                           '--find-max-model', 'model.depth']) == 1
    (row,) = json.loads((tmp_path / 'other' / 'benchmark.json').read_text())['rows']
    assert 'max_model' not in row and 'bad config' in row['error']


def test_derived_config_keeps_the_run_comparable():
    ds = benchmark.derived_ds_config('zero3_offload', 4, 12, 'fp32', on_gpu=False, ds_cpu_adam=False)
    assert ds['train_micro_batch_size_per_gpu'] == 4 and 'fp16' not in ds
    assert ds['optimizer']['params']['torch_adam'] and ds['zero_force_ds_cpu_optimizer'] is False
    # The schedule's length follows the run (train.max_steps), as a training run's does.
    assert ds['scheduler']['params']['warmup_num_steps'] == 3 and 'total_num_steps' not in ds['scheduler']['params']
    # --steps 1 --warmup 0: a warmup of 1 in a schedule of 1 step was refused on every backend,
    # naming a file and a value the user never wrote.
    from ds_seg.config import resolve_ds_config
    one = benchmark.derived_ds_config('zero2', 4, 1, 'fp32', on_gpu=False, ds_cpu_adam=False)
    resolved, _, _ = resolve_ds_config(one, 1, 1, supports=lambda p: True)
    assert resolved['scheduler']['params']['total_num_steps'] == 1
    ddp, z2 = (benchmark.derived_ds_config(n, None, 40, 'json', False, False) for n in ('ddp', 'zero2'))
    for key in ('optimizer', 'scheduler', 'fp16', 'train_micro_batch_size_per_gpu', 'gradient_clipping'):
        assert ddp[key] == z2[key], key   # DDP and ZeRO differ only in zero_optimization


def test_a_backend_name_reads_the_project_s_own_json_as_training_does(tmp_path, monkeypatch, capsys):
    """ds-seg-train --deepspeed_config zero2 trained the project's ds_configs/zero2.json; the
    benchmark's --backends zero2 measured the shipped one without a word."""
    import ds_seg.config
    monkeypatch.setattr(ds_seg.config, '_SAID_SHIPPED', set())
    monkeypatch.chdir(tmp_path)
    shipped = benchmark.derived_ds_config('zero2', None, 10, 'json', False, False)
    (tmp_path / 'ds_configs').mkdir()
    (tmp_path / 'ds_configs' / 'zero2.json').write_text(json.dumps(dict(shipped, train_micro_batch_size_per_gpu=3)))
    assert benchmark.derived_ds_config('zero2', None, 10, 'json', False, False)['train_micro_batch_size_per_gpu'] == 3
    assert '(your copy)' in capsys.readouterr().err
    assert benchmark._backend('zero3')[1] == str(ds_seg.config.DS_CONFIGS_DIR / 'zero3.json')  # no copy: shipped


@pytest.mark.skipif(torch.cuda.is_available(), reason='the refusal is for a machine without a GPU')
def test_a_gpu_memory_cap_without_a_gpu_is_refused(tmp_path, capsys):
    assert benchmark.main(['--work-dir', str(tmp_path / 'bench'), '--launcher', 'python', '--gpu-memory-gib', '4']) == 2
    assert '--gpu-memory-gib caps what a rank may allocate on its GPU; this machine has none' in capsys.readouterr().err


def test_acceptance_report_compares_layouts_per_family_and_backend():
    """The table that decides speed.CHANNELS_LAST_BY_MODEL: channels_last over NCHW images/s,
    only where both rows of a family and backend ran."""
    import importlib.util
    from ds_seg.config import REPO_ROOT
    spec = importlib.util.spec_from_file_location('acceptance_report', REPO_ROOT / 'tools' / 'acceptance_report.py')
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    groups = {'unet64_512': {'rows': [{'backend': 'ddp', 'images_per_s': 40.0}, {'backend': 'zero2', 'images_per_s': 38.0}]},
              'unet64_512_channels_last': {'rows': [{'backend': 'ddp', 'images_per_s': 50.0},
                                                    {'backend': 'zero2', 'error': 'OOM'}]},
              'upernet_convnext_512': None}
    assert report.layout_lines(groups)[3:] == ['| UNet | ddp | 40.00 | 50.00 | 1.25x |']
    assert report.layout_lines({}) == []


@pytest.mark.parametrize('argv, message', [
    (['--backends', ''], "--backends '' names no backend"),
    (['--backends', 'mine=/nonexistent/zero9.json'], '--backends mine=/nonexistent/zero9.json: no such DeepSpeed JSON'),
    (['--backends', 'ddp,zero2,ddp'], '--backends names ddp twice'),
    (['--backends', 'zero4'], 'unknown backend(s) zero4'),
    (['--nproc', '0'], '--nproc must be at least 1, got 0'),
    (['--micro-batch', '0'], '--micro-batch must be at least 1, got 0'),
    (['--cfg-options', 'model.type=Nope'], "model.type 'Nope' is not a registered model"),
    (['--cfg-options', 'train.seed=-1'], '--cfg-options: train.seed must be'),
    # The benchmark's own run settings, which a user's option appended after them overrode: 3
    # window medians timed instead of 10 steps, or 2 of the 10 steps the table says.
    (['--cfg-options', 'train.log_interval=5'], '--cfg-options train.log_interval: the benchmark sets it'),
    (['--cfg-options', 'data.crop_size=64', 'train.max_steps=4'], '--cfg-options train.max_steps: the benchmark sets'),
    # ... spelt as a section: ran, then "no timed steps" (a traceback), or evaluated inside the timed steps
    (['--cfg-options', 'train=dict(max_steps=1)'], '--cfg-options train.max_steps: the benchmark sets it'),
    (['--cfg-options', 'train=dict(seed=1, eval_interval=2)'], '--cfg-options train.eval_interval: the benchmark'),
    # a config's save_best is cleared (it needs evaluations, which timed runs do not make)
    (['--cfg-options', 'train.save_best=mIoU'], '--cfg-options train.save_best: the benchmark sets it'),
    # a label is a folder under --work-dir, which was deleted before the run: never a path
    (['--backends', '../victim=ds_configs/zero1.json'], "--backends label '../victim' is not a plain name"),
    (['--backends', '/tmp/x=ds_configs/zero1.json'], "--backends label '/tmp/x' is not a plain name"),
    (['--nproc', '2'], '--launcher python starts one process, but --nproc is 2'),
    (['--backends', 'previous=ds_configs/zero1.json'], "--backends label 'previous' is not a plain name"),
    (['--backends', 'benchmark.json=ds_configs/zero1.json'], "--backends label 'benchmark.json' is not"),
    # Each run started, then failed (torchrun's report as the row's error), or was never bounded.
    (['--peak-tflops', '-5'], '--peak-tflops must be a finite number > 0'),
    (['--peak-tflops', 'nan'], '--peak-tflops must be a finite number > 0'),
    (['--gpu-memory-gib', '0'], '--gpu-memory-gib must be a number of GiB > 0'),
    (['--gpu-memory-gib', 'inf'], '--gpu-memory-gib must be a number of GiB > 0'),
    (['--timeout', '0'], '--timeout must be at least 1 s, got 0'),
    (['--profile', '-1'], '--profile must be >= 0 steps, got -1'),
    (['--max-batch', '4'], '--max-batch bounds --find-max-batch, which is not given'),
    (['--find-max-model', 'model.nope'], "--find-max-model 'model.nope': a size argument of the model"),
    # the data's: the timed run passed, then the search's every probe was refused ("failed: ccelerator...")
    (['--find-max-model', 'model.num_classes'], "--find-max-model 'model.num_classes': the training data fixes it"),
    (['--find-max-model', 'model.in_channels'], "--find-max-model 'model.in_channels': the training data fixes it"),
    (['--cfg-options', 'model.type=TinyTemporalSegFormer', '--find-max-model', 'model.num_dates'],
     "--find-max-model 'model.num_dates': the training data fixes it (data.train's dates per scene)"),
    # A switch or a name: the timed run passed, then the search's first probe failed and the row was lost.
    (['--find-max-model', 'model.bilinear'], "--find-max-model 'model.bilinear': the search doubles a whole "
     "number, and bilinear is a bool setting (default False), not a size; give a size argument of the model, "
     "model.<name>; UNet takes base_channels, depth"),
    # A shipped backend's name on another setup titled its row (and speed-up) with that backend.
    (['--backends', 'zero2=ds_configs/zero1.json'], "the label 'zero2' names the shipped zero2.json (ZeRO stage 2)"
     ", but ds_configs/zero1.json is ZeRO stage 1"),
    (['--backends', 'zero3=ds_configs/zero3_offload.json'], "is ZeRO stage 3 with offload_optimizer and offload_param"),
    (['--backends', 'ddp=ds_configs/zero0.json'], "the label 'ddp' is plain PyTorch DDP, the baseline"),
    # A key the model does not take: every backend ran and failed in turn, each with torchrun's traceback.
    (['--cfg-options', 'model.nope=3'], "model.nope: UNet has no argument 'nope'. It accepts: in_channels"),
    # A cap below the micro-batch the runs train: "largest that fits: 2" beside a row of 8.
    (['--find-max-batch', '--max-batch', '2'], "--max-batch 2 is below the micro-batch the runs train (8)"),
    # Training files that are not there: every backend's run failed in turn the same way.
    (['--cfg-options', 'data.train.type=GeoTiffScenes', 'data.train.images=/nonexistent/img/*.tif',
      'data.train.labels=/nonexistent/lab/*.tif'],
     "data.train.images: the pattern '/nonexistent/img/*.tif' matches no file"),
])
def test_what_would_fail_every_run_is_one_line_before_any(argv, message, tmp_path, capsys):
    assert benchmark.main(['--work-dir', str(tmp_path / 'bench'), '--launcher', 'python', *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith('benchmark: error: ') and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / 'bench').exists()  # no run was started, no folder made


def test_a_label_file_may_be_a_shipped_name_from_any_folder(tmp_path, monkeypatch):
    """--backends mine=zero2_bf16 (or =ds_configs/zero2_bf16.json) outside the checkout was 'no
    such DeepSpeed JSON file', where --deepspeed_config zero2_bf16 trains the shipped file."""
    from ds_seg.config import DS_CONFIGS_DIR
    monkeypatch.chdir(tmp_path)
    for given in ('zero2_bf16', 'ds_configs/zero2_bf16.json'):
        assert benchmark._backend(f'mine={given}') == ('deepspeed', str(DS_CONFIGS_DIR / 'zero2_bf16.json'))
    assert benchmark._backend('mine=/nonexistent/zero9.json') == ('deepspeed', '/nonexistent/zero9.json')


@pytest.mark.parametrize('existing', ['checkpoints', 'zero2', 'zero2_profile'])
def test_a_folder_no_benchmark_wrote_is_refused_and_left_alone(existing, tmp_path, capsys):
    """A label named like a training run's folder (checkpoints) had it deleted and replaced."""
    work = tmp_path / 'run'
    (work / existing).mkdir(parents=True)
    (work / existing / 'precious.pt').write_text('weights')
    label = existing.split('_')[0]
    backends = 'zero2' if label == 'zero2' else f'{label}=ds_configs/zero2.json'
    assert benchmark.main(['--work-dir', str(work), '--launcher', 'python', '--backends', backends]) == 2
    err = capsys.readouterr().err
    said = 'holds a training run (checkpoints)' if existing == 'checkpoints' else \
        f'already holds {existing}, which no benchmark wrote'
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert (work / existing / 'precious.pt').read_text() == 'weights'
    assert sorted(p.name for p in work.iterdir()) == [existing]


def test_a_training_runs_work_dir_is_refused(tmp_path, capsys):
    """The benchmark wrote its tables and run folders beside a training run's checkpoints and
    logs, where the README says such a folder is refused."""
    work = tmp_path / 'run'
    work.mkdir()
    (work / 'metrics.jsonl').write_text('{"step": 1}\n')
    assert benchmark.main(['--work-dir', str(work), '--launcher', 'python', '--backends', 'ddp']) == 2
    err = capsys.readouterr().err
    assert 'holds a training run (metrics.jsonl); a benchmark writes runs of its own' in err, err
    assert sorted(p.name for p in work.iterdir()) == ['metrics.jsonl']


def test_a_failed_runs_row_holds_its_refusal_line_not_the_launchers_report():
    """Under torchrun a refusal is followed by the launcher's ChildFailedError report: the row's
    error was that report's last 300 characters, lines and all, which broke benchmark.md."""
    tail = ("ds_seg: error: train.peak_tflops must be a finite number > 0, got -5.0\n"
            "Traceback (most recent call last):\n  ...\ntorch.distributed.elastic.multiprocessing.errors."
            "ChildFailedError:\n====\nlaunch/train.py FAILED\n----\nFailures:\n  <NO_OTHER_FAILURES>\n"
            "Root Cause (first observed failure):\n[0]:\n  time : 2026-11-24_07:00:00\n  exitcode  : 2 | x\n")
    assert benchmark.failure_line(tail) == 'ds_seg: error: train.peak_tflops must be a finite number > 0, got -5.0'
    assert benchmark.failure_line('a\nlast | line\n') == 'last / line'


def test_a_crashed_runs_row_holds_its_exception_and_nested_model_keys_are_searchable(tmp_path):
    """A crash that is not a refusal gave the row torchrun's '=====' banner; --find-max-model
    model.backbone_kwargs.depth (a key inside a dict argument) was refused."""
    tail = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 3\n"
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "E1124 ChildFailedError:\n============================================================\n")
    assert benchmark.failure_line(tail) == ('[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate '
                                            '2.00 GiB')
    args = benchmark.parse_args(['--work-dir', str(tmp_path / 'b'), '--backends', 'ddp', '--config',
                                 'configs/upernet_dinov2_tiny_synthetic.py', '--find-max-model',
                                 'model.backbone_kwargs.depth'])
    assert benchmark._check_args(args) is None


def test_a_shipped_backends_name_may_label_a_variant_of_its_own_setup(tmp_path):
    from ds_seg.config import DS_CONFIGS_DIR
    ds = json.loads((DS_CONFIGS_DIR / 'zero2.json').read_text())
    ds['zero_optimization']['reduce_bucket_size'] = 12345678
    tuned = tmp_path / 'tuned.json'
    tuned.write_text(json.dumps(ds))
    for backends in (f'zero2={tuned}', 'zero2=ds_configs/zero2_bf16.json', f'mine={DS_CONFIGS_DIR / "zero1.json"}'):
        args = benchmark.parse_args(['--work-dir', str(tmp_path / 'b'), '--launcher', 'python', '--backends', backends])
        assert benchmark._check_args(args) is None, backends


@pytest.mark.parametrize('change', [dict(train_micro_batch_size_per_gpu=2), dict(gradient_accumulation_steps=2)])
def test_a_json_of_another_global_batch_is_refused_before_any_run(change, tmp_path, capsys):
    # Its speed-up compared step times of unequal work: half the micro-batch read as 1.9x faster
    # than DDP at half DDP's images/s.
    from ds_seg.config import DS_CONFIGS_DIR
    ds = json.loads((DS_CONFIGS_DIR / 'zero2.json').read_text())
    ds.update(change)
    mine = tmp_path / 'mine.json'
    mine.write_text(json.dumps(ds))
    argv = ['--work-dir', str(tmp_path / 'bench'), '--launcher', 'python', '--backends', f'ddp,mine={mine}']
    assert benchmark.main(argv) == 2
    err = capsys.readouterr().err
    micro, accum = change.get('train_micro_batch_size_per_gpu', 8), change.get('gradient_accumulation_steps', 1)
    assert (f'the runs would train different global batches (ddp 8 (8 x 1 x 1), mine {micro * accum} '
            f'({micro} x {accum} x 1)') in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / 'bench').exists()
    # --micro-batch sets every run's micro-batch; another accumulation still differs.
    problem = benchmark._unequal_batches(benchmark.parse_args(argv + ['--micro-batch', '4']), ['ddp', f'mine={mine}'])
    assert (problem is None) == ('train_micro_batch_size_per_gpu' in change)


def test_a_rerun_moves_every_run_of_the_earlier_benchmark_with_its_results(tmp_path):
    # Runs of backends the new benchmark does not run stayed beside its results, while the
    # archived benchmark.json listed them.
    work = tmp_path / 'bench'
    for label in ('ddp', 'mine', 'mine_profile'):
        (work / label).mkdir(parents=True)
        (work / label / 'command.txt').write_text('launch/train.py ...')
    (work / 'users').mkdir()  # not a benchmark's: never moved
    (work / 'benchmark.json').write_text(json.dumps(dict(rows=[dict(backend='ddp'), dict(backend='mine'),
                                                               dict(backend='../x')])))
    ours, theirs = benchmark._earlier_results(str(work), ['ddp'])
    assert sorted(ours) == ['benchmark.json', 'ddp', 'mine', 'mine_profile'] and theirs == []
    archive = benchmark.set_aside_earlier_results(str(work), ours)
    assert sorted(p.name for p in work.iterdir()) == ['previous', 'users']
    assert sorted(os.listdir(archive)) == ['benchmark.json', 'ddp', 'mine', 'mine_profile']


def test_the_runs_of_a_benchmark_stopped_before_its_table_are_set_aside_too(tmp_path):
    """A benchmark interrupted during its first backend wrote no benchmark.json; its ddp/ stayed
    beside the next benchmark's results (TensorBoard showed both)."""
    work = tmp_path / 'bench'
    (work / 'ddp' / 'tb').mkdir(parents=True)
    (work / 'ddp' / 'command.txt').write_text('launch/train.py ...')
    (work / 'users').mkdir()  # not a benchmark's: never moved
    ours, theirs = benchmark._earlier_results(str(work), ['zero2'])
    assert ours == ['ddp'] and theirs == []


def test_a_run_past_its_timeout_is_stopped_with_every_process_it_started(tmp_path):
    """subprocess.run(timeout=) killed the launcher only: its ranks trained on beside the next
    backend's. The whole process group goes now, and the output is text, not bytes."""
    pid_file = tmp_path / 'grandchild.pid'
    script = ('import subprocess, sys, time\n'
              f'p = subprocess.Popen(["sleep", "300"]); open({str(pid_file)!r}, "w").write(str(p.pid))\n'
              'print("step 1 of 400", flush=True); time.sleep(300)\n')
    t0 = time.monotonic()
    rc, output = benchmark.run_child([sys.executable, '-c', script], dict(os.environ), timeout=3)
    assert rc == 124 and output == 'step 1 of 400\n' and time.monotonic() - t0 < 60
    pid = int(pid_file.read_text())
    try:
        state = open(f'/proc/{pid}/stat').read().split(')')[-1].split()[0]
    except FileNotFoundError:
        state = 'gone'
    assert state in ('gone', 'Z'), f'the rank-like grandchild {pid} is still running ({state})'



def test_acceptance_report_refuses_a_folder_the_acceptance_run_did_not_write(tmp_path, capsys):
    """A mistyped OUT_DIR gave a FileNotFoundError traceback on steps.jsonl."""
    import importlib.util
    from ds_seg.config import REPO_ROOT
    spec = importlib.util.spec_from_file_location('acceptance_report', REPO_ROOT / 'tools' / 'acceptance_report.py')
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    for folder, said in ((tmp_path / 'nowhere', 'no folder'), (tmp_path, 'no steps.jsonl in')):
        with pytest.raises(SystemExit) as stop:
            report.main([str(folder)])
        assert stop.value.code == 2
        assert f'{said} {folder}: give the OUT_DIR that tools/gpu_acceptance.sh wrote' in capsys.readouterr().err


def test_a_work_dir_inside_a_runs_checkpoints_is_refused(tmp_path, capsys):
    """That run's keep_checkpoints pruning would delete the benchmark's runs with the step folder."""
    run = tmp_path / 'run'
    (run / 'checkpoints' / 'step_00000002').mkdir(parents=True)
    for name in ('config.json', 'ds_config.json'):
        (run / name).write_text('{}')
    work = run / 'checkpoints' / 'step_00000002' / 'bench'
    assert benchmark.main(['--work-dir', str(work), '--launcher', 'python']) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'benchmark: error: --work-dir: {work} is inside the checkpoints of the run in {run}'), err
    assert not work.exists()


def test_a_second_benchmark_into_a_work_dir_in_use_is_refused(tmp_path, capsys):
    """Two benchmarks into one --work-dir: the second moved the first's running backend into
    previous/ (it died on its metrics.jsonl, or summarised the other's run) and overwrote the
    other's tables. The benchmark holds the work dir's lock; the second is one line, and the
    work dir is as it was."""
    import subprocess

    from ds_seg.engine.workdir import LOCK_NAME
    work = tmp_path / 'bench'
    (work / 'ddp').mkdir(parents=True)
    (work / 'ddp' / 'command.txt').write_text('a running benchmark')
    holder = subprocess.Popen([sys.executable, '-c', f'''
import sys, time
from ds_seg.engine.workdir import WorkDirLock
WorkDirLock({str(work)!r}).acquire(); print('held', flush=True); time.sleep(60)'''], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        assert benchmark.main(['--work-dir', str(work), '--launcher', 'python', '--backends', 'ddp']) == 2
        err = capsys.readouterr().err
        assert err.startswith(f'benchmark: error: --work-dir: {work} is in use by another run (host ') and \
            f'pid {holder.pid}' in err, err
        assert sorted(os.listdir(work)) == [LOCK_NAME, 'ddp']
    finally:
        holder.kill()
        holder.wait()


def test_a_failed_profile_run_is_said_in_the_output_the_table_and_the_json(monkeypatch, tmp_path, capsys):
    """--profile whose run failed (past --timeout): exit 0, nothing printed, nothing in the table,
    profile_dir null beside a partial trace. It is said in all three."""
    def fake_run(args, name, work_dir, steps, warmup, micro_batch=None, extra_options=()):
        if extra_options:   # the profiled run
            return 124, 'killed'
        _fake_run(tmp_path / 'bench' / 'ddp', 'ddp', None, [9.0, 9.0, 0.5, 0.4, 0.6], warmup=2)
        return 0, 'ok'
    monkeypatch.setattr(benchmark, 'run_backend', fake_run)
    work = tmp_path / 'bench'
    assert benchmark.main(['--work-dir', str(work), '--launcher', 'python', '--backends', 'ddp', '--profile', '3',
                           '--steps', '3', '--warmup', '2', '--timeout', '60']) == 0
    assert '[benchmark] ddp: the --profile run failed (exit 124): timed out after 60 s (--timeout)' in \
        capsys.readouterr().err
    (row,) = json.loads((work / 'benchmark.json').read_text())['rows']
    assert row['profile_dir'] is None and row['profile_error'] == 'timed out after 60 s (--timeout)'
    assert '| ddp | failed: timed out after 60 s (--timeout) |' in (work / 'benchmark.md').read_text()
