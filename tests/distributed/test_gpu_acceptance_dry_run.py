"""tools/gpu_acceptance.sh --dry-run: the GPU acceptance script's every step on a CPU with tiny
models (issue 14), so the script that a GPU session runs once never rots in between."""
import json
import os
import subprocess

import pytest

from ds_seg.config import REPO_ROOT

GROUPS = ['unet64_512', 'unet64_1024', 'vit_large_512', 'segformer_b2_1024', 'max_batch', 'max_model']


@pytest.mark.slow
def test_dry_run_writes_every_table(tmp_path):
    out = tmp_path / 'acceptance'
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.run(['bash', str(REPO_ROOT / 'tools' / 'gpu_acceptance.sh'), '--dry-run', str(out)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads((out / 'acceptance.json').read_text())
    assert report['dry_run'] is True
    status = {s['step']: s['status'] for s in report['steps']}
    assert status.pop('unet64_512_compiled').startswith('skipped (dry run')
    for group in ('unet64_512_channels_last', 'upernet_convnext_512', 'upernet_convnext_512_channels_last'):
        assert status.pop(group).startswith('skipped (dry run')
    assert status == dict.fromkeys(['install', 'pytest_gpu', 'main'] + GROUPS, 'ok')
    assert report['main']['exit_reason'] == 'completed' and report['main']['images_per_s_median'] > 0
    backends = []
    for name in GROUPS:
        rows = report['groups'][name]['rows']
        assert rows and all(not r.get('error') and r['images_per_s'] > 0 and r['optimizer_impl'].startswith('torch.')
                            and r['precision'] == 'bf16-autocast' for r in rows), (name, rows)
        backends += [r['backend'] for r in rows]
    assert set(backends) == {'ddp', 'zero2', 'zero3', 'zero3_offload'}
    assert report['groups']['max_batch']['rows'][0]['max_micro_batch'] == 1
    # Nothing runs out of memory on a CPU: the depth search stops at --max-model 1, and the
    # parameters it reports are those of the UperNetViT built at that depth.
    from ds_seg.models.common import num_params
    from ds_seg.registry import MODELS, build
    deepest = report['groups']['max_model']['rows'][0]
    assert (deepest['max_model'], deepest['max_model_capped']) == (1, True)
    assert deepest['max_model_params'] == num_params(build(MODELS, dict(
        type='UperNetViT', variant='vit_tiny_test', img_size=64, patch_size=8, channels=32, depth=1)))
    table = (out / 'acceptance.md').read_text()
    assert f"| ddp | 1 (capped) | {deepest['max_model_params']:,} |" in table
    assert '| vit_large_512 | zero3 | bf16-autocast |' in table and '| max_batch | zero3_offload |' in table
    assert (out / 'unet64_512' / 'benchmark.md').is_file()


@pytest.mark.parametrize('env, message', [
    ({'ACCEPTANCE_STEPS': 'main,max_modle'}, "ACCEPTANCE_STEPS names 'max_modle', which is none of: pytest_gpu"),
    ({'ACCEPTANCE_PROFILE': 'unet'}, "ACCEPTANCE_PROFILE names 'unet', which is none of: unet64_512"),
    ({'ACCEPTANCE_PROFILE': 'max_model'}, "ACCEPTANCE_PROFILE names 'max_model', which is none of: unet64_512"),
    ({'ACCEPTANCE_STEP_CAP_S': '0'}, 'ACCEPTANCE_STEP_CAP_S=0: give the most seconds one step may run'),
    ({'ACCEPTANCE_STEP_CAP_S': 'abc'}, 'ACCEPTANCE_STEP_CAP_S=abc: give the most seconds one step may run'),
])
def test_a_mistyped_step_or_cap_is_one_line_before_any_step(tmp_path, env, message):
    """A typo in ACCEPTANCE_STEPS skipped every step and reported success; a cap of 0 meant no
    limit at all (timeout 0), and a word stopped the script at its first step with no report."""
    proc = subprocess.run(['bash', str(REPO_ROOT / 'tools' / 'gpu_acceptance.sh'), '--dry-run', str(tmp_path / 'out')],
                          cwd=str(tmp_path), env=dict(os.environ, **env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert message in proc.stderr and not (tmp_path / 'out' / 'steps.jsonl').read_text()
