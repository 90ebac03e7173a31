"""launch/benchmark.py end to end on 2 CPU ranks (torchrun), tiny config: every backend runs in its
own processes, the rows come back with the DESIGN.md fields, and each ZeRO stage's per-rank
optimizer state matches the ZeRO formula (measured from the live tensors inside the trainer)."""
import json
import os
import subprocess
import sys

import pytest

from ds_seg.config import REPO_ROOT
from ds_seg.cli.benchmark import MEMORY_FIELDS, ROW_FIELDS
from tests.distributed.test_launchers import _env
from tests.tiny import TINY_CONFIG, read_jsonl

pytestmark = pytest.mark.slow


def test_benchmark_ddp_and_zero_stages_two_cpu_ranks(tmp_path):
    work = tmp_path / 'bench'
    cache = tmp_path / 'cache'
    cmd = [sys.executable, 'launch/benchmark.py', '--config', TINY_CONFIG,
           '--backends', 'ddp,zero1,zero2,zero3', '--steps', '2', '--warmup', '2', '--nproc', '2',
           '--precision', 'fp32', '--micro-batch', '2', '--work-dir', str(work),
           '--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}']
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'

    result = json.loads((work / 'benchmark.json').read_text())
    rows = {r['backend']: r for r in result['rows']}
    assert list(rows) == ['ddp', 'zero1', 'zero2', 'zero3'] and result['nproc'] == 2
    for name, r in rows.items():
        assert set(ROW_FIELDS + MEMORY_FIELDS) <= set(r), name
        assert r['world_size'] == 2 and r['micro_batch'] == 2 and r['precision'] == 'fp32'
        assert r['timed_steps'] == 2 and r['images_per_s'] > 0 and r['step_time_p90_s'] >= r['step_time_median_s']
        # Throughput by hand from the same timings: the images of the timed steps (global batch
        # 2 x 2 ranks, steps after the 2 warm-up steps) over the sum of their step times.
        timed = [row['step_time_s'] for row in read_jsonl(work / name / 'metrics.jsonl') if row['step'] > 2]
        assert len(timed) == 2
        assert r['images_per_s'] == pytest.approx(4 * 2 / sum(timed), rel=1e-12)
        assert r['step_time_median_s'] == pytest.approx((timed[0] + timed[1]) / 2, rel=1e-12)
        # One TensorBoard run per backend under one parent, so `tensorboard --logdir` overlays them.
        assert os.listdir(work / name / 'tb')
        assert read_jsonl(work / name / 'metrics.jsonl')[-1]['step'] == 4
    assert rows['ddp']['zero_stage'] is None and rows['ddp']['speedup_vs_ddp'] == 1.0
    assert [rows[n]['zero_stage'] for n in ('zero1', 'zero2', 'zero3')] == [1, 2, 3]

    psi = rows['ddp']['num_params']
    assert psi > 100_000 and all(r['num_params'] == psi for r in rows.values())
    # Adam moments per rank: 8 bytes x Ψ for DDP, 8Ψ / 2 from ZeRO-1 on (within 5%: DeepSpeed pads
    # its flat partitions to alignment; the 'step' counters add a few bytes).
    assert rows['ddp']['optim_bytes'] == pytest.approx(8 * psi, rel=0.05)
    for name in ('zero1', 'zero2', 'zero3'):
        r = rows[name]
        assert r['optim_bytes'] == pytest.approx(8 * psi / 2, rel=0.05), name
        assert r['optim_bytes'] == pytest.approx(r['formula_optim_bytes'], rel=0.05), name
        assert r['master_bytes'] == pytest.approx(4 * psi / 2, rel=0.05), name
    # Gradients: whole on DDP; ZeRO-3 holds only its partition. (ZeRO-1/2 in DeepSpeed 0.19 keep
    # the partition plus the whole of any tensor that straddles the partition boundary.)
    assert rows['ddp']['grads_bytes'] == pytest.approx(4 * psi, rel=0.05)
    assert rows['zero3']['grads_bytes'] == pytest.approx(4 * psi / 2, rel=0.05)
    assert 4 * psi / 2 * 0.95 <= rows['zero2']['grads_bytes'] < 4 * psi * 0.8
    # Parameters: whole on every rank below ZeRO-3. (ZeRO-3 keeps tensors under
    # stage3_param_persistence_threshold whole besides its partition: not a formula figure.)
    for name in ('ddp', 'zero1', 'zero2'):
        assert rows[name]['params_bytes'] == pytest.approx(4 * psi, rel=0.05), name

    text = (work / 'benchmark.md').read_text()
    assert 'AMD' in text or 'Intel' in text or 'cores' in text
    assert (work / 'benchmark.png').stat().st_size > 1000


def test_profile_steps_writes_a_trace_of_exactly_those_steps(tmp_path):
    # One process is enough: the profiler wraps the trainer's loop, not the launcher.
    work, cache = tmp_path / 'work', tmp_path / 'cache'
    cmd = [sys.executable, 'launch/train.py', '--config', TINY_CONFIG, '--backend', 'ddp', '--work-dir', str(work),
           '--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}', 'train.max_steps=24',  # > the JSON's 20 LR warm-up steps
           'train.eval_interval=0', 'train.checkpoint_interval=0', 'train.warmup_log_steps=2',
           'train.profile_steps=2']
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = list((work / 'profile').glob('rank0*.pt.trace.json'))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())['traceEvents']
    steps = sorted({e['name'] for e in events if e.get('name', '').startswith('ProfilerStep#')})
    # Steps 0-1 are warm-up (untimed) and step 1 is the profiler's own warm-up: steps 2 and 3 are recorded.
    assert steps == ['ProfilerStep#2', 'ProfilerStep#3']
    assert any(e.get('name') == '[memory]' for e in events)  # profile_memory=True
    # ... and the operators ranked by their own time, readable without a trace viewer
    ops = (work / 'profile' / 'rank0_ops.txt').read_text()
    assert 'Self CPU' in ops and 'aten::' in ops


def test_deepspeed_and_python_launchers_and_a_second_benchmark_keeps_the_first(tmp_path):
    """--launcher deepspeed ran `deepspeed ... -m ds_seg.cli.train` (its runner wants --module)
    and every row failed; --launcher python failed late on its default of 2 ranks; a second
    benchmark into the same --work-dir replaced the first one's table and run folders."""
    work, cache = tmp_path / 'bench', tmp_path / 'cache'

    def bench(*argv):
        cmd = [sys.executable, 'launch/benchmark.py', '--config', TINY_CONFIG, '--backends', 'zero1',
               '--steps', '1', '--warmup', '1', '--precision', 'fp32', '--micro-batch', '2', '--work-dir', str(work),
               *argv, '--cfg-options', f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}']
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f'{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}'
        return proc.stdout, json.loads((work / 'benchmark.json').read_text())

    _, first = bench('--launcher', 'deepspeed', '--nproc', '1')
    assert first['launcher'] == 'deepspeed' and first['rows'][0]['world_size'] == 1
    assert ' --module ds_seg.cli.train ' in (work / 'zero1' / 'command.txt').read_text()
    out, second = bench('--launcher', 'python')
    assert second['launcher'] == 'python' and second['nproc'] == 1 and second['rows'][0]['images_per_s'] > 0
    (kept,) = (work / 'previous').iterdir()
    assert 'moved to' in out and str(kept) in out
    assert json.loads((kept / 'benchmark.json').read_text()) == first
    assert sorted(p.name for p in kept.iterdir()) == ['benchmark.json', 'benchmark.md', 'benchmark.png', 'zero1']
    assert 'deepspeed' in (kept / 'zero1' / 'command.txt').read_text()
