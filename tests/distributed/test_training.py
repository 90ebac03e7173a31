"""Training invariants on 2 real CPU ranks (gloo): the same experiment under DDP and every
ZeRO stage gives the same losses, ranks agree on weights, resume equals uninterrupted, export
round-trips, fp16 overflow steps are skipped and counted."""
import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ds_seg.config import REPO_ROOT
from tests.dist import run_on_ranks
from tests.tiny import TINY_CONFIG, ds_config, logged_losses, read_jsonl, tiny_cfg


def _full_params(trainer):
    """All parameters as one flat tensor, gathered from ZeRO-3 partitions when needed."""
    params = list(trainer.backend.module.parameters())
    if trainer.backend.zero_stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().float().flatten().clone() for p in params])
    return torch.cat([p.detach().float().flatten().clone() for p in params])


def _train(tmp, backend, ds, work, resume=None, steps=12, checkpoint_interval=0, patch_fp16=False, **train):
    if patch_fp16:
        # ds_seg runs bf16 autocast for fp16 on any CPU, and DeepSpeed refuses fp16 on CPUs without
        # fp16 kernels: both are told to run it, so the fp16 code paths (loss scaling, overflow
        # skipping) run for real.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
        os.environ['DS_SEG_CPU_FP16'] = '1'
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=checkpoint_interval, **train)
    trainer = Trainer(cfg, ds, backend=backend, work_dir=os.path.join(tmp, work), resume=resume)
    try:
        initial = _full_params(trainer)
        summary = trainer.fit()
        trainer.backend.sync_buffers()
        from ds_seg.engine.common import batchnorm_buffers
        buffers = torch.cat([b.flatten().clone() for b in batchnorm_buffers(trainer.backend.module)])
        return dict(params=_full_params(trainer), initial=initial, buffers=buffers, summary=summary,
                    precision=trainer.spec.precision)
    finally:
        trainer.close()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """The same fp32 experiment under DDP and ZeRO 0-3 on 2 ranks (20 steps, accumulation 2)."""
    tmp = str(tmp_path_factory.mktemp('equal'))
    out = {}
    for name, backend, stage in [('ddp', 'ddp', 0), ('zero0', 'deepspeed', 0), ('zero1', 'deepspeed', 1),
                                 ('zero2', 'deepspeed', 2), ('zero3', 'deepspeed', 3)]:
        ranks = run_on_ranks(_train, 2, args=(tmp, backend, ds_config(stage, grad_accum=2), name, None, 20))
        out[name] = dict(ranks=ranks, losses=logged_losses(os.path.join(tmp, name)))
    return out


@pytest.mark.parametrize('name', ['zero0', 'zero1', 'zero2', 'zero3'])
def test_same_fp32_loss_sequence_as_ddp(runs, name):
    ref, got = runs['ddp']['losses'], runs[name]['losses']
    assert len(ref) == len(got) == 20
    assert ref[-1] < ref[0] * 0.9, 'the tiny run should learn something'
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f'step {step}: DDP loss {a} vs {name} {b}'


@pytest.mark.parametrize('name', ['ddp', 'zero0', 'zero1', 'zero2', 'zero3'])
def test_weights_and_bn_stats_identical_across_ranks(runs, name):
    r0, r1 = runs[name]['ranks']
    assert torch.equal(r0['params'], r1['params'])
    assert torch.equal(r0['buffers'], r1['buffers'])
    assert r0['summary']['exit_reason'] == 'completed' and r0['summary']['world_size'] == 2


@pytest.mark.parametrize('name', ['zero1', 'zero2', 'zero3'])
def test_final_weights_match_ddp(runs, name):
    ref, got = runs['ddp']['ranks'][0]['params'], runs[name]['ranks'][0]['params']
    start = runs['ddp']['ranks'][0]['initial']
    assert torch.equal(start, runs[name]['ranks'][0]['initial']), 'both runs start from the same weights'
    # The first steps are bit-identical (the losses show it); from then on last-bit differences
    # in gradient reduction order grow, and Adam, whose early updates are ~lr * sign(grad),
    # amplifies them for weights whose gradients are near zero (measured: losses equal for 4
    # steps, then 1e-7 apart growing to 1e-4; weights 0.6% (ZeRO-1) and 6.8% (ZeRO-2/3, whose
    # per-micro-batch reduce-scatter departs 3 steps earlier) of the training displacement
    # apart after 20 steps). The per-step losses above are the tight check; here the runs must
    # stay far closer than a wrong gradient (missing rank, stale partition) would leave them,
    # which moves the weights about as far as training itself does.
    moved = (ref - start).norm()
    apart = (ref - got).norm()
    print(f'{name}: |ddp - {name}| / |ddp - start| = {apart / moved:.4f}')
    assert apart < 0.15 * moved, f'{name} ends {apart / moved:.1%} of the training displacement away from DDP'


@pytest.mark.parametrize('backend, stage', [('deepspeed', 0), ('deepspeed', 1), ('deepspeed', 2),
                                            ('deepspeed', 3), ('ddp', 0)])
def test_resume_equals_uninterrupted(tmp_path, backend, stage):
    from ds_seg.engine import checkpoint
    tmp = str(tmp_path)
    ds = ds_config(stage)
    # The run's own step-12 weights are the uninterrupted result; then its newest checkpoint is
    # lost: resuming from step 6 must give the same step-12 weights as the run that never stopped.
    straight = run_on_ranks(_train, 2, args=(tmp, backend, ds, 'interrupted', None, 12, 6))
    root = os.path.join(tmp, 'interrupted', 'checkpoints')
    import shutil
    shutil.rmtree(os.path.join(root, 'step_00000012'))
    assert checkpoint.find_latest(root) == 'step_00000006'
    # A reshard's full-size copy that a run killed mid-conversion left: any later resume removes it.
    os.makedirs(os.path.join(root, '.universal-step_00000006.tmp', 'zero'))
    resumed = run_on_ranks(_train, 2, args=(tmp, backend, ds, 'interrupted', 'auto', 12, 6))
    assert not [n for n in os.listdir(root) if n.startswith('.universal-')]
    assert torch.equal(straight[0]['params'], resumed[0]['params'])
    assert torch.equal(straight[0]['buffers'], resumed[0]['buffers'])
    steps = [row['step'] for row in read_jsonl(os.path.join(tmp, 'interrupted', 'metrics.jsonl'))]
    assert steps == list(range(1, 13)), 'metrics.jsonl keeps one row per step across the resume'
    # The same configs: nothing of the interrupted run's record is set aside.
    assert not os.path.exists(os.path.join(tmp, 'interrupted', 'previous'))


def _check_load_from(tmp, weights_file, backend, stage, classes=None):
    """The parameters right after ``load_from`` (flat, or by name when fine-tuning for ``classes``:
    a subset of the synthetic scenes' class names, so the class count differs from the file's)."""
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4)
    cfg.load_from = weights_file
    if classes:
        cfg.model.num_classes = len(classes)
        cfg.data.train.classes = cfg.data.val.classes = list(classes)
    work_dir = os.path.join(tmp, f'load_{backend}{stage}{len(classes or ())}')
    trainer = Trainer(cfg, ds_config(stage), backend=backend, work_dir=work_dir)
    try:
        if not classes:
            return _full_params(trainer)
        named = dict(trainer.backend.module.named_parameters())
        import deepspeed
        with (deepspeed.zero.GatheredParameters(list(named.values())) if trainer.backend.zero_stage == 3
              else contextlib.nullcontext()):
            return {name: p.detach().clone() for name, p in named.items()}
    finally:
        trainer.close()


def _refused_load_from(tmp, weights_file):
    from ds_seg.config import ConfigError
    try:
        _check_load_from(tmp, weights_file, 'ddp', 0)
    except ConfigError as exc:
        return str(exc)
    return None


def test_export_round_trip_under_zero3_and_load_from(tmp_path):
    from ds_seg.engine import checkpoint
    tmp = str(tmp_path)
    trained = run_on_ranks(_train, 2, args=(tmp, 'deepspeed', ds_config(3), 'z3', None, 6, 6))
    out = os.path.join(tmp, 'weights.pt')
    # Through the command line, given only the work dir: it finds the newest checkpoint.
    subprocess.run([sys.executable, 'launch/export.py', os.path.join(tmp, 'z3'), '--out', out],
                   check=True, cwd=REPO_ROOT, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    payload = checkpoint.load_weights_file(out)
    assert payload['model']['type'] == 'UNetTiny' and payload['classes'][:2] == ['grass', 'road']
    from ds_seg.registry import MODELS, build
    model = build(MODELS, payload['model'])
    model.load_state_dict(payload['state_dict'])  # strict: every parameter and buffer present
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(flat, trained[0]['params'])
    bn = torch.cat([b.flatten() for name, b in model.named_buffers() if 'running' in name])
    assert torch.equal(bn, trained[0]['buffers'])
    # load_from starts training from those weights under another backend and stage.
    for backend, stage in [('ddp', 0), ('deepspeed', 3)]:
        loaded = run_on_ranks(_check_load_from, 2, args=(tmp, out, backend, stage))
        assert torch.equal(loaded[0], flat)
    # Weights trained on files whose colour tags say another band order than this run's data:
    # their first layer would see the colours swapped (predict refuses the same pair).
    swapped = os.path.join(tmp, 'bgr_weights.pt')
    torch.save(dict(payload, data=dict(payload['data'], colours=['blue', 'green', 'red'])), swapped)
    refused = run_on_ranks(_refused_load_from, 1, args=(tmp, swapped))[0]
    assert refused.startswith(f"load_from: {swapped} was trained on bands holding blue, green, red by their files' "
                              "colour tags, but data.train's hold red, green, blue"), refused
    # Fine-tuning for 3 of the 6 classes: every tensor but the classifier comes from the file;
    # the classifier keeps the fresh initialisation that the seed gives a 3-class model.
    torch.manual_seed(tiny_cfg(os.path.join(tmp, 'cache')).train.seed)
    fresh = dict(build(MODELS, dict(payload['model'], num_classes=3)).named_parameters())
    for backend, stage in [('ddp', 0), ('deepspeed', 3)]:
        tuned = run_on_ranks(_check_load_from, 2, args=(tmp, out, backend, stage, ('grass', 'building', 'road')))
        for rank in (0, 1):
            changed = {name for name, p in tuned[rank].items() if p.shape != payload['state_dict'][name].shape}
            assert changed and all(p.shape[0] == 3 for name, p in tuned[rank].items() if name in changed)
            for name, p in tuned[rank].items():
                assert torch.equal(p, fresh[name] if name in changed else payload['state_dict'][name]), name


def _warmup_cosine_lr(ds, applied):
    """DeepSpeed's WarmupCosineLR after ``applied`` scheduler steps, worked out from its
    documented formula (log warm-up from warmup_min_ratio, then cosine to cos_min_ratio), not by
    calling the scheduler under test."""
    p = ds['scheduler']['params']
    base, warmup, total = ds['optimizer']['params']['lr'], max(2, p['warmup_num_steps']), p['total_num_steps']
    last = applied - 1  # the scheduler's last_batch_iteration
    if last < 0:
        return 0.0
    if last < warmup:
        ratio = p['warmup_min_ratio'] + (1.0 - p['warmup_min_ratio']) * math.log(last + 1) / math.log(warmup)
    else:
        progress = min(1.0, (last - warmup + 1) / max(1, total - warmup))
        ratio = p['cos_min_ratio'] + (1.0 - p['cos_min_ratio']) * (1 + math.cos(math.pi * progress)) / 2
    return base * ratio


@pytest.mark.parametrize('backend, stage', [('deepspeed', 0), ('deepspeed', 2), ('ddp', 0)])
def test_fp16_overflow_steps_are_skipped_and_counted(tmp_path, backend, stage):
    tmp = str(tmp_path)
    # A loss scale of 2^24 overflows fp16 gradients at once; each overflow halves it (hysteresis 1,
    # and no growth within the 1000-step loss_scale_window).
    ds = ds_config(stage, precision='fp16')
    ds['fp16']['initial_scale_power'] = 24
    ranks = run_on_ranks(_train_fp16, 2, args=(tmp, backend, ds))
    rows = read_jsonl(os.path.join(tmp, 'fp16', 'metrics.jsonl'))
    assert ranks[0]['precision'] in ('fp16', 'fp16-autocast')
    assert [r['step'] for r in rows] == list(range(1, 21))
    skipped = [r['skipped_steps'] for r in rows]
    assert skipped[0] == 1, 'the first step overflows at 2^24'
    assert all(b - a in (0, 1) for a, b in zip([0] + skipped, skipped)), f'one step skips at most once: {skipped}'
    assert 1 < skipped[-1] < len(rows), f'several overflows, then applied steps: {skipped}'
    # The exact dynamic-scaler value: 2^24 halved once per skipped step.
    assert [r['loss_scale'] for r in rows] == [2.0 ** (24 - k) for k in skipped]
    # A skipped step does not advance the LR schedule: the LR logged at step s is the one step s
    # trained with, the schedule after the steps before it that were applied (total_num_steps =
    # the run's 20, filled in by ds_seg).
    written = json.load(open(os.path.join(tmp, 'fp16', 'ds_config.json')))
    assert written['scheduler']['params']['total_num_steps'] == 20
    for r, skipped_before in zip(rows, [0] + skipped):
        applied_before = r['step'] - 1 - skipped_before
        assert r['lr'] == pytest.approx(_warmup_cosine_lr(written, applied_before), rel=1e-12, abs=0), \
            f"step {r['step']} ({skipped_before} skipped before it): lr {r['lr']}"
    assert all(math.isfinite(r['loss']) for r in rows), 'losses stay finite while steps are skipped'
    assert rows[-1]['loss'] < rows[0]['loss'], 'applied steps train the model'


def _train_fp16(tmp, backend, ds, work='fp16', steps=20):
    return _train(tmp, backend, ds, work, None, steps, patch_fp16=True)


def test_fp16_grad_norm_is_the_norm_of_the_unscaled_gradients_in_every_mode(tmp_path):
    """ZeRO-0 native fp16 (FP16_UnfusedOptimizer, torch's AdamW: the shipped zero0.json on a GPU)
    logged the norm of the loss-scaled gradients, 1024x the real one at scale 2^10; ZeRO-0 under
    fp16 autocast logged neither grad_norm nor loss_scale. Each mode's first-step norm is the fp32
    run's, to fp16 precision (the same initial weights and batch)."""
    tmp = str(tmp_path)
    fp16 = ds_config(0, precision='fp16')
    fp16['fp16']['initial_scale_power'] = 10
    autocast = ds_config(0, torch_autocast={'enabled': True, 'dtype': 'float16'})
    modes = {'fp32': ('ddp', ds_config(0), False), 'ddp_fp16': ('ddp', fp16, True),
             'zero0_fp16': ('deepspeed', fp16, True), 'zero1_fp16': ('deepspeed', dict(fp16, zero_optimization={'stage': 1}), True),
             'zero0_autocast_fp16': ('deepspeed', autocast, True)}
    rows = {}
    for name, (backend, ds, half) in modes.items():
        ranks = run_on_ranks(_train_fp16 if half else _train, 1,
                             args=(tmp, backend, ds, name, 2) if half else (tmp, backend, ds, name, None, 2))
        assert ranks[0]['precision'] in (('fp16', 'fp16-autocast') if half else ('fp32',)), name
        rows[name] = read_jsonl(os.path.join(tmp, name, 'metrics.jsonl'))
    reference = rows['fp32'][0]['grad_norm']
    for name, got in rows.items():
        first = got[0]
        assert first['skipped_steps'] == 0, (name, first)
        assert first['grad_norm'] == pytest.approx(reference, rel=2e-2), (name, first['grad_norm'], reference)
        if name != 'fp32':
            assert first['loss_scale'] == 1024.0 if 'autocast' not in name else first['loss_scale'] > 1, (name, first)


# -- README: zero3_offload.json and native bf16 train end to end ---------------------------------

def _engine_offload(tmp, stage, precision, work):
    """Like _train_mode, plus whether the engine offloads optimizer and parameters."""
    from ds_seg.engine.common import batchnorm_buffers
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4)
    trainer = Trainer(cfg, ds_config(stage, precision=precision, grad_accum=2), backend='deepspeed',
                      work_dir=os.path.join(tmp, work))
    try:
        initial = _full_params(trainer)
        summary = trainer.fit()
        engine = trainer.backend.engine
        return dict(initial=initial, params=_full_params(trainer), summary=summary, precision=trainer.spec.precision,
                    dtypes={str(p.dtype) for p in trainer.backend.module.parameters()},
                    bn_stats={str(b.dtype) for b in batchnorm_buffers(trainer.backend.module)},
                    offloaded=(bool(engine.zero_offload_optimizer()), bool(engine.zero_offload_param())),
                    overflow_check=getattr(engine.optimizer, 'check_grad_overflow', None),
                    clip_is_ds_segs=type(engine.optimizer).unscale_and_clip_grads is _ds_seg_clip())
    finally:
        trainer.close()


def _ds_seg_clip():
    from ds_seg.engine import ds_workarounds
    return ds_workarounds._unscale_and_clip_grads


@pytest.fixture(scope='module')
def modes(runs, tmp_path_factory):
    """ds_configs/zero3_offload.json (fp32) and native bf16 under ZeRO-2 and ZeRO-3: 4 steps of the
    `runs` experiment, whose DDP run is the reference. (ZeRO-3 bf16, zero3_bf16.json, failed at its
    first step: zero.Init had made BatchNorm's running statistics bf16.)"""
    tmp = str(tmp_path_factory.mktemp('modes'))
    out = {}
    for name, stage, precision in [('offload', 'offload', 'fp32'), ('bf16', 2, 'bf16'), ('bf16_zero3', 3, 'bf16')]:
        ranks = run_on_ranks(_engine_offload, 2, args=(tmp, stage, precision, name))
        out[name] = dict(ranks=ranks, rows=read_jsonl(os.path.join(tmp, name, 'metrics.jsonl')))
    return out


@pytest.mark.parametrize('name, precision, rel', [('offload', 'fp32', 1e-6), ('bf16', 'bf16', 2e-2),
                                                   ('bf16_zero3', 'bf16', 2e-2)])
def test_offload_and_native_bf16_train_end_to_end(runs, modes, name, precision, rel):
    r0, r1 = modes[name]['ranks']
    rows = modes[name]['rows']
    assert r0['summary']['exit_reason'] == 'completed' and r0['summary']['steps'] == 4
    assert r0['precision'] == precision, 'native, not autocast'
    assert [r['step'] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r['loss']) and math.isfinite(r['grad_norm']) for r in rows), rows
    assert torch.equal(r0['params'], r1['params']), 'ranks hold the same weights'
    assert torch.isfinite(r0['params']).all() and not torch.equal(r0['params'], r0['initial']), 'weights moved'
    # The same initial weights and data as the DDP run (native bf16: the fp32 weights rounded by
    # DeepSpeed's cast), so the first loss agrees: exactly in fp32, to bf16 precision in bf16.
    start = runs['ddp']['ranks'][0]['initial']
    rounded = start if precision == 'fp32' else start.to(torch.bfloat16).float()
    if name == 'bf16_zero3':
        # zero.Init creates the parameters in bf16 and the initialisers draw into them there, not
        # into fp32 then rounded: 0.09% of the values (measured) come out otherwise.
        assert (r0['initial'] != rounded).float().mean() < 0.005
    else:
        assert torch.equal(r0['initial'], rounded)
    assert rows[0]['loss'] == pytest.approx(runs['ddp']['losses'][0], rel=rel)


def test_offload_is_active_and_bf16_casts_the_model(modes):
    # On a CPU-only machine every tensor is on the CPU anyway: what shows the offload path ran is
    # the engine's own configuration (optimizer and parameters offloaded), not a device.
    assert modes['offload']['ranks'][0]['offloaded'] == (True, True)
    assert modes['bf16']['ranks'][0]['offloaded'] == (False, False)
    for name in ('bf16', 'bf16_zero3'):
        assert modes[name]['ranks'][0]['dtypes'] == {'torch.bfloat16'}
        assert modes[name]['ranks'][0]['bn_stats'] == {'torch.float32'}, 'BatchNorm statistics stay fp32'
    assert modes['bf16_zero3']['ranks'][0]['offloaded'] == (False, False)
    # ZeRO-2 bf16 without DeepSpeed's per-step host read of its overflow flag (see resolve_ds_config)
    assert modes['bf16']['ranks'][0]['overflow_check'] is False
    # ... and its clipping without host reads (ds_workarounds.sync_free_zero_norms, installed by the backend)
    assert modes['bf16']['ranks'][0]['clip_is_ds_segs'] is True


def _train_cli(argv):
    from ds_seg.cli import train as entry
    return entry.main(argv)


def test_evaluation_ignores_the_data_ignore_index_of_a_combined_loss(tmp_path):
    """A CombinedLoss carries ignore_index in its members only; evaluation took the default 255
    instead, so a run whose data and losses agreed on ignore_index=250 trained and then crashed
    at its first evaluation ("label value 250 ... is not a class index 0..2 nor ignore_index 255")."""
    import numpy as np

    from tests.unit.test_data import write_tif
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, (1, 64, 64)).astype(np.uint8)
    label[:, :8] = 250  # unlabelled rows
    img = write_tif(tmp_path / 'img.tif', rng.integers(0, 255, (3, 64, 64), dtype=np.uint8))
    lbl = write_tif(tmp_path / 'lbl.tif', label)
    scenes = dict(type='GeoTiffScenes', images=[img], labels=[lbl], classes=3, ignore_index=250)
    config = tmp_path / 'combined.py'
    config.write_text(
        "model = dict(type='UNetTiny', in_channels=3, num_classes=3)\n"
        "loss = dict(_delete_=True, type='CombinedLoss', losses=[dict(type='CrossEntropyLoss', ignore_index=250), "
        "dict(type='DiceLoss', ignore_index=250)])\n"
        f"data = dict(train=dict({scenes!r}, split='train'), val=dict({scenes!r}, split='val'), "
        "crop_size=32, num_workers=0)\n"
        "train = dict(max_steps=2, eval_interval=2, checkpoint_interval=0)\n")
    work = str(tmp_path / 'work')
    ds = tmp_path / 'ds.json'
    ds.write_text(json.dumps(ds_config(0)))
    code = run_on_ranks(_train_cli, 1, args=(['--config', str(config), '--deepspeed_config', str(ds),
                                               '--work-dir', work],), timeout=300)[0]
    assert code == 0
    rows = read_jsonl(os.path.join(work, 'eval.jsonl'))
    assert [r['step'] for r in rows] == [2] and 0 <= rows[0]['OA'] <= 1


def _train_fpn(tmp, work, resume, stage=3, pretrained=None, load_from=None):
    """FPN over timm's test_resnet (dropout in its head), optionally from a pretrained file, 4
    steps with a checkpoint at 2, ZeRO-3 by default (built partitioned)."""
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4, checkpoint_interval=2)
    cfg.model = dict(type='FPN', backbone='test_resnet', channels=16, num_classes=6, in_channels=3,
                     pretrained=pretrained)
    cfg.load_from = load_from
    trainer = Trainer(cfg, ds_config(stage), work_dir=os.path.join(tmp, work), resume=resume)
    try:
        trainer.fit()
        return _full_params(trainer)
    finally:
        trainer.close()


def _lose_last_checkpoint(tmp, work):
    import shutil
    shutil.rmtree(os.path.join(tmp, work, 'checkpoints', 'step_00000004'))


@pytest.mark.parametrize('stage', [0, 3])
def test_resume_equals_uninterrupted_for_a_model_with_dropout(tmp_path, stage):
    """Starting the loader's iterator drew from the global RNG after a resume had restored it (the
    uninterrupted run drew before saving it): every later dropout mask differed, so resume was
    exact only for models without dropout (UNet), not for FPN, UperNet, SegFormer, DeepLabV3+."""
    tmp = str(tmp_path)
    straight = run_on_ranks(_train_fpn, 1, args=(tmp, 'interrupted', None, stage))[0]   # uninterrupted
    _lose_last_checkpoint(tmp, 'interrupted')
    resumed = run_on_ranks(_train_fpn, 1, args=(tmp, 'interrupted', 'auto', stage))[0]
    assert torch.equal(straight, resumed)


def test_resume_and_load_from_need_no_pretrained_file(tmp_path):
    """--resume auto (every sbatch requeue) and load_from take every weight from their file, yet
    the model was built reading model.pretrained again: a pretrained file purged from scratch, or
    missing on the requeued node, refused the resume of a run whose checkpoint held everything."""
    import timm
    tmp = str(tmp_path)
    pretrained = os.path.join(tmp, 'resnet.pth')
    torch.save(timm.create_model('test_resnet', pretrained=False).state_dict(), pretrained)
    straight = run_on_ranks(_train_fpn, 1, args=(tmp, 'straight', None, 3, pretrained))[0]
    run_on_ranks(_train_fpn, 1, args=(tmp, 'interrupted', None, 3, pretrained))
    _lose_last_checkpoint(tmp, 'interrupted')
    os.remove(pretrained)
    resumed = run_on_ranks(_train_fpn, 1, args=(tmp, 'interrupted', 'auto', 3, pretrained))[0]
    assert torch.equal(straight, resumed)
    from ds_seg.cli import export
    weights = os.path.join(tmp, 'straight.pt')
    assert export.main([os.path.join(tmp, 'straight'), '--out', weights]) == 0
    from_weights = run_on_ranks(_train_fpn, 1, args=(tmp, 'from_weights', None, 3, pretrained, weights))[0]
    # A requeued fine-tuning job whose load_from file was purged too: it was read (and refused
    # when missing) although the checkpoint holds every weight.
    _lose_last_checkpoint(tmp, 'from_weights')
    os.remove(weights)
    resumed = run_on_ranks(_train_fpn, 1, args=(tmp, 'from_weights', 'auto', 3, pretrained, weights))[0]
    assert torch.equal(from_weights, resumed)


def test_ddp_reduces_in_the_jsons_communication_data_type_as_deepspeed_does(tmp_path):
    """communication_data_type "bf16": DeepSpeed reduced gradients in bf16, DDP in fp32 without a
    word. Both now reduce in bf16: the same first-step gradient norm to float rounding, and not
    the fp32 one."""
    tmp = str(tmp_path)
    norms = {}
    for name, backend, comm in (('ds_bf16', 'deepspeed', 'bf16'), ('ddp_bf16', 'ddp', 'bf16'), ('ddp_fp32', 'ddp', None)):
        ds = ds_config(0, **({'communication_data_type': comm} if comm else {}))
        run_on_ranks(_train, 2, args=(tmp, backend, ds, name, None, 1))
        norms[name] = read_jsonl(os.path.join(tmp, name, 'metrics.jsonl'))[0]['grad_norm']
    assert norms['ddp_bf16'] == pytest.approx(norms['ds_bf16'], rel=1e-6), norms
    assert abs(norms['ddp_fp32'] - norms['ds_bf16']) > 20 * abs(norms['ddp_bf16'] - norms['ds_bf16']), norms


@pytest.mark.parametrize('optimizer', [{'type': 'RMSprop', 'params': {'lr': 1e-3, 'alpha': 0.9}},
                                       {'type': 'Adagrad', 'params': {'lr': 1e-2}}])
def test_a_torch_optimizer_deepspeed_builds_trains_alike_under_ddp(tmp_path, optimizer):
    """DeepSpeed builds torch.optim's class for any name it has no own optimizer for (and
    Adagrad): DDP refused them ('has no DDP equivalent'), so the same JSON could not be compared."""
    tmp = str(tmp_path)
    out = {}
    for backend in ('ddp', 'deepspeed'):
        ds = ds_config(0, optimizer=optimizer, zero_allow_untested_optimizer=True)
        ds.pop('scheduler')
        out[backend] = run_on_ranks(_train, 1, args=(tmp, backend, ds, backend, None, 3))[0]
        out[backend]['losses'] = logged_losses(os.path.join(tmp, backend))
    ddp, ds = out['ddp'], out['deepspeed']
    assert torch.equal(ddp['initial'], ds['initial'])
    assert ds['losses'] == pytest.approx(ddp['losses'], rel=1e-5)
    moved = (ddp['params'] - ddp['initial']).norm()
    assert moved > 0 and (ddp['params'] - ds['params']).norm() <= 1e-4 * moved


def _resume_with_other_loss_scaling(tmp):
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    dynamic = ds_config(0, precision='fp16')
    _train(tmp, 'deepspeed', dynamic, 'scaled', None, 2, checkpoint_interval=2, patch_fp16=True)
    static = ds_config(0, precision='fp16')
    static['fp16']['loss_scale'] = 128
    try:
        Trainer(tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4), static, work_dir=os.path.join(tmp, 'scaled'),
                resume='auto').close()
    except ConfigError as exc:
        return str(exc)
    return None


def test_a_deepspeed_resume_refuses_a_json_that_changes_its_loss_scaler(tmp_path):
    """DeepSpeed's fp16 optimizers restore their loss scaler, settings included: a dynamic ZeRO-0
    checkpoint resumed with a static loss_scale crashed at the first overflow ('>' between None and
    float); under ZeRO-1/2 the static scale was recorded in ds_config.json and never applied."""
    line = run_on_ranks(_resume_with_other_loss_scaling, 1, args=(str(tmp_path),), timeout=300)[0]
    assert line is not None and "holds DeepSpeed's fp16 loss scaler" in line and 'loss_scale 0.0 -> 128.0' in line, line


CUSTOM_MODEL = '''import torch.nn as nn
from ds_seg.registry import MODELS


@MODELS.register_module()
class OwnNet(nn.Module):
    def __init__(self, in_channels=3, num_classes=6):
        super().__init__()
        self.c = nn.Conv2d(in_channels, num_classes, 3, padding=1)

    def forward(self, x):
        return self.c(x)
'''


@pytest.mark.slow
@pytest.mark.parametrize('how', ['custom_imports', 'import'])
def test_a_model_of_ones_own_module_trains_then_predicts_and_evaluates_where_that_module_imports(tmp_path, how):
    """mmengine's custom_imports was refused as an unknown key (its advice, _custom_imports, is
    ignored by mmengine); a model registered by a plain import in the config trained, then
    predict.py, evaluate.py of the run's config.json and export --format onnx could not build it
    (the last a RegistryError traceback). Runs and checkpoints record the module: where it
    imports they build the model, elsewhere one line says which module to put on PYTHONPATH."""
    (tmp_path / 'own_models.py').write_text(CUSTOM_MODEL)
    line = ("custom_imports = dict(imports=['own_models'])" if how == 'custom_imports' else 'import own_models')
    (tmp_path / 'own.py').write_text(f"_base_ = [{TINY_CONFIG!r}]\n{line}\nmodel = dict(type='OwnNet')\n")
    cache = str(tmp_path / 'cache')
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(tmp_path))
    without = dict(env, PYTHONPATH='')
    work, scene = tmp_path / 'run', tmp_path / 'scene.tif'

    def run(script, *args, environ=env):
        return subprocess.run([sys.executable, f'launch/{script}', *args], cwd=REPO_ROOT, env=environ,
                              capture_output=True, text=True, timeout=300)
    trained = run('train.py', '--config', str(tmp_path / 'own.py'), '--work-dir', str(work), '--deepspeed_config',
                  'zero0', '--cfg-options', 'train.max_steps=2', 'train.eval_interval=2', 'data.num_workers=0',
                  f'data.train.cache_dir={cache}', f'data.val.cache_dir={cache}')
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert json.load(open(work / 'config.json'))['custom_imports']['imports'] == ['own_models']
    import shutil
    val_image = sorted((tmp_path / 'cache').rglob('image_*.tif'))[-1]
    shutil.copy(val_image, scene)
    refused = run('predict.py', '--checkpoint', str(work), '--input', str(scene), '--output', str(tmp_path / 'p0'),
                  environ=without)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"predict: error: {work}: its model 'OwnNet' comes from your module: cannot import 'own_models' "
        "(ModuleNotFoundError: No module named 'own_models'); put the folder that holds it on PYTHONPATH (or "
        "install it) where this command runs"], refused.stderr
    exported = run('export.py', str(work), '--format', 'onnx', '--out', str(tmp_path / 'own.onnx'), environ=without)
    assert exported.returncode == 2 and 'Traceback' not in exported.stderr, exported.stderr
    assert "comes from your module: cannot import 'own_models'" in exported.stderr
    predicted = run('predict.py', '--checkpoint', str(work), '--input', str(scene), '--output', str(tmp_path / 'p1'))
    assert predicted.returncode == 0 and (tmp_path / 'p1' / 'scene_classes.tif').exists(), predicted.stderr[-2000:]
    evaluated = run('evaluate.py', '--checkpoint', str(work), '--output', str(tmp_path / 'ev'))
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.load(open(tmp_path / 'ev' / 'eval.json'))['mIoU'] >= 0
