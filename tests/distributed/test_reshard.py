"""Resume at another number of ranks (a requeued job on another allocation): 2 ranks -> 1 -> 2 on
CPU, for DDP and every ZeRO stage. Optimizer state comes back (Adam's step count and moments are
there before the first resumed step), the data stream continues where it was, and the loss goes on
from where it was instead of jumping back to the start."""
import os

import pytest
import torch

from tests.dist import run_on_ranks
from tests.tiny import ds_config, fit_and_close, read_jsonl, tiny_cfg

pytestmark = pytest.mark.slow


def _base_optimizer(backend):
    opt = backend.optimizer if backend.name == 'ddp' else backend.engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, 'optimizer'):
        opt = opt.optimizer
    return opt


def _run(tmp, backend, stage, steps, resume, precision='fp32'):
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=steps)
    trainer = Trainer(cfg, ds_config(stage, precision), backend=backend, work_dir=os.path.join(tmp, 'work'), resume=resume)
    try:
        states = list(_base_optimizer(trainer.backend).state.values())
        adam = dict(steps=sorted({int(torch.as_tensor(s['step']).item()) for s in states}),
                    moments=bool(states) and all(float(s['exp_avg_sq'].abs().sum()) > 0 for s in states))
        start = trainer.step * trainer.spec.grad_accum + trainer.micro_step_offset
        master_start = _fp32_master(trainer.backend)
        trainer.fit()
        return dict(adam=adam, start_micro_step=start, world_size=trainer.world_size,
                    master_start=master_start, master_end=_fp32_master(trainer.backend))
    finally:
        trainer.close()


def _fp32_master(backend):
    """DeepSpeed's fp32 master copy of every weight (gathered across the ranks' partitions), by
    name: the parameter itself where DeepSpeed keeps none (ZeRO-0 in fp32); None under DDP."""
    if backend.name == 'ddp':
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    def master(p):
        full = safe_get_full_fp32_param(p)
        return (p.detach() if full is None else full).float().clone()
    return {name: master(p) for name, p in backend.engine.module.named_parameters()}


@pytest.mark.parametrize('backend, stage, precision', [
    ('ddp', 0, 'fp32'), ('deepspeed', 0, 'fp32'), ('deepspeed', 1, 'fp32'), ('deepspeed', 3, 'fp32'),
    # ZeRO-2 in native bf16 (DeepSpeed keeps fp32 master weights beside the bf16 ones): the fp32
    # ZeRO-2 path is the same partitioned optimizer, checked by ZeRO-1 here.
    ('deepspeed', 2, 'bf16'),
])
def test_resume_at_another_world_size(tmp_path, backend, stage, precision):
    tmp = str(tmp_path)
    saved = run_on_ranks(_run, 2, args=(tmp, backend, stage, 6, None, precision))   # 2 ranks, checkpoint at 6
    one = run_on_ranks(_run, 1, args=(tmp, backend, stage, 9, 'auto', precision))   # 2 -> 1, checkpoint at 9
    two = run_on_ranks(_run, 2, args=(tmp, backend, stage, 12, 'auto', precision))  # 1 -> 2, to step 12
    # Adam's state was loaded (a fresh optimizer has none before its first step).
    assert one[0]['adam'] == dict(steps=[6], moments=True), one[0]['adam']
    assert two[0]['adam'] == dict(steps=[9], moments=True) == two[1]['adam'], two
    # Data position: 6 steps x 2 ranks x micro-batch 2 = 24 samples = 12 one-rank micro-steps;
    # then 12 + 3 = 15 one-rank micro-steps = 30 samples = 7.5 two-rank micro-steps: 8, 2 samples skipped.
    if backend == 'deepspeed':  # the master weights come back exactly, not rebuilt from bf16 copies
        for before, after in ((saved[0]['master_end'], one[0]['master_start']),
                              (one[0]['master_end'], two[0]['master_start'])):
            assert before.keys() == after.keys()
            assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before
                                                                          if not torch.equal(before[k], after[k])]
        if precision == 'bf16':  # ...which matters: they hold more than bf16 can
            assert any(not torch.equal(w, w.bfloat16().float()) for w in one[0]['master_start'].values())
    assert one[0]['start_micro_step'] == 12
    assert two[0]['start_micro_step'] == 8 == two[1]['start_micro_step']
    rows = read_jsonl(os.path.join(tmp, 'work', 'metrics.jsonl'))
    assert [r['step'] for r in rows] == list(range(1, 13))
    assert [r['world_size'] for r in rows] == [2] * 6 + [1] * 3 + [2] * 3
    # The epoch counts the samples consumed (4 a step on 2 ranks, 2 on 1, the 2 skipped ones too): it
    # recounted every earlier step at the new global batch, and went backwards after 2 -> 1.
    samples = [round(r['epoch'] / rows[0]['epoch'] * 4, 6) for r in rows]
    assert samples == [4, 8, 12, 16, 20, 24, 26, 28, 30, 36, 40, 44], samples
    loss = {r['step']: r['loss'] for r in rows}
    # The loss goes on from where it was: much nearer the step before the resume than the start.
    for before, after in ((6, 7), (9, 10)):
        assert abs(loss[after] - loss[before]) < 0.5 * (loss[1] - loss[before]), loss


def _run_micro(tmp, micro_batch, steps, resume):
    from ds_seg.engine.trainer import Trainer
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=steps)
    trainer = Trainer(cfg, ds_config(0, micro_batch=micro_batch), work_dir=os.path.join(tmp, 'work'), resume=resume)
    try:
        start = trainer._data_position()
        trainer.fit()
        return start
    finally:
        trainer.close()


def test_resume_at_another_micro_batch_goes_on_after_the_samples_consumed(tmp_path):
    # The data position was kept in the old micro-batch's units: 3 steps of 4 samples, resumed at
    # micro-batch 2, read samples 6-11 a second time (and 2 -> 4 skipped them).
    tmp = str(tmp_path)
    assert run_on_ranks(_run_micro, 1, args=(tmp, 4, 3, None))[0] == 0
    assert run_on_ranks(_run_micro, 1, args=(tmp, 2, 6, 'auto'))[0] == 6  # 12 samples = 6 micro-steps of 2
    rows = read_jsonl(os.path.join(tmp, 'work', 'metrics.jsonl'))
    samples = [round(r['epoch'] / rows[0]['epoch'] * 4, 6) for r in rows]
    assert samples == [4, 8, 12, 14, 16, 18], samples


def _resumed_at_another_accumulation(tmp, backend):
    """3 steps of micro-batch 2, then a resume to 5 at micro-batch 1 x accumulation 2 (the same
    global batch, as on half the ranks): the weights at the resume and at the end. Plain SGD at
    a small LR (tests/distributed/test_sgd_equality.py): the step is -lr x the gradient, so a
    step of the wrong micro-batches moves the weights by a fraction of the displacement, while
    correct backends differ by float32 rounding. Under Adam at lr 2e-3 this tiny UNet multiplied
    a 6e-8 rounding difference at the resume into 2e-4 two steps later (an AMD EPYC)."""
    from ds_seg.engine.checkpoint import consolidated_state_dict
    from ds_seg.engine.trainer import Trainer
    work = os.path.join(tmp, backend)
    for steps, micro, accum, resume in ((3, 2, 1, None), (5, 1, 2, 'auto')):
        cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=steps)
        ds = ds_config(0, micro_batch=micro, grad_accum=accum)
        ds['optimizer'] = {'type': 'SGD', 'params': {'lr': 1e-4, 'momentum': 0.0, 'weight_decay': 0.0}}
        ds['gradient_clipping'] = 0.0
        ds.pop('scheduler', None)
        ds['zero_allow_untested_optimizer'] = True
        fit_and_close(Trainer(cfg, ds, backend=backend, work_dir=work, resume=resume))
    return [consolidated_state_dict(os.path.join(work, 'checkpoints', f'step_{step:08d}')) for step in (3, 5)]


def test_a_resume_at_another_accumulation_steps_at_the_new_boundaries_under_ddp(tmp_path):
    # DDP restored its micro-step count: 6 micro-steps at accumulation 1, then boundaries at odd
    # counts under accumulation 2, each step mixing two windows' gradients (and the last
    # micro-batch never applied). DeepSpeed starts every resumed window afresh.
    tmp = str(tmp_path)
    ddp = run_on_ranks(_resumed_at_another_accumulation, 1, args=(tmp, 'ddp'))[0]
    ds = run_on_ranks(_resumed_at_another_accumulation, 1, args=(tmp, 'deepspeed'))[0]
    keys = [k for k, v in ds[1].items() if v.is_floating_point() and not k.endswith(('running_mean', 'running_var'))]
    moved = max((ds[1][k] - ds[0][k]).abs().max().item() for k in keys)
    apart = max((ddp[1][k] - ds[1][k]).abs().max().item() for k in keys)
    assert moved > 0 and apart <= 1e-5 * moved, (apart, moved)


def _fit_or_refusal(cfg, ds, **kwargs):
    """Train ``cfg`` to the end: the (closed) trainer, or the refusal line if it was refused."""
    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    try:
        trainer = Trainer(cfg, ds, **kwargs)
    except ConfigError as exc:
        return str(exc)
    fit_and_close(trainer)
    return trainer


def _resume_with(tmp, params, scheduler, backend='deepspeed', scheduler_on_resume=None):
    """Two steps, then a resume to four with ``params`` merged into optimizer.params (and the
    scheduler kept or removed; ``scheduler_on_resume``: another choice for the resume): the
    refusal line, or the LRs the resumed steps logged."""
    work = os.path.join(tmp, 'work')
    resumed_scheduler = scheduler if scheduler_on_resume is None else scheduler_on_resume
    for steps, resume, extra, scheduled in ((2, None, {}, scheduler), (4, 'auto', params, resumed_scheduler)):
        ds = ds_config(0, micro_batch=2)
        extra = dict(extra)
        ds['optimizer']['type'] = extra.pop('type', ds['optimizer']['type'])
        ds['optimizer']['params'].update(extra)
        if not scheduled:
            ds.pop('scheduler')
        cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=2)
        trainer = _fit_or_refusal(cfg, ds, backend=backend, work_dir=work, resume=resume)
        if isinstance(trainer, str):
            return trainer
    return [r['lr'] for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))]


def _fresh_with(tmp, params):
    """The LRs of four uninterrupted steps with ``params`` from the start."""
    from ds_seg.engine.trainer import Trainer
    ds = ds_config(0, micro_batch=2)
    params = dict(params)
    ds['optimizer']['type'] = params.pop('type', ds['optimizer']['type'])
    ds['optimizer']['params'].update(params)
    trainer = Trainer(tiny_cfg(os.path.join(tmp, 'cache'), max_steps=4), ds, work_dir=os.path.join(tmp, 'fresh'))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [r['lr'] for r in read_jsonl(os.path.join(tmp, 'fresh', 'metrics.jsonl'))]


@pytest.mark.parametrize('params, scheduler, refused', [
    (dict(weight_decay=0.3), True, "weight_decay 0.01 -> 0.3"),
    (dict(betas=[0.5, 0.9]), True, "betas [0.9, 0.999] -> [0.5, 0.9]"),
    (dict(lr=0.005), False, "lr 0.002 -> 0.005"),  # no scheduler: the restored param_groups' LR stays
    (dict(lr=0.005), True, None),                  # a scheduler sets the LR from its (new) parameters
    # AdamW -> Adam's L2 decay: torch restores decoupled_weight_decay with the groups (AdamW went on).
    (dict(type='Adam', adam_w_mode=False), True, 'decoupled_weight_decay True -> False'),
    (dict(type='Adam'), True, None),               # DeepSpeed's Adam is AdamW unless adam_w_mode is false
])
def test_a_resume_that_changes_restored_optimizer_settings_is_refused(tmp_path, params, scheduler, refused):
    # They were written to ds_config.json and never applied: the optimizer state's param_groups
    # (weight decay, betas, an unscheduled LR) came back from the checkpoint.
    got = run_on_ranks(_resume_with, 1, args=(str(tmp_path), params, scheduler))[0]
    if refused is None:
        # The resumed steps train on the new schedule from the first one: as a run that had it
        # from the start. (Step 3 trained at the old schedule's LR, which the checkpoint's
        # param_groups held, and the new one began a step late.)
        fresh = run_on_ranks(_fresh_with, 1, args=(str(tmp_path), params))[0]
        assert isinstance(got, list) and len(got) == 4, got
        assert got[2:] == fresh[2:], (got, fresh)
    else:
        assert isinstance(got, str) and got.startswith('--resume: ') and refused in got, got
        assert 'Resume with the checkpoint\'s values' in got


def _resume_with_optim(tmp, backend, stage, model, before, after):
    """Two steps with the ``optim`` options ``before``, then a resume to 3 with ``after``: the
    refusal line, or the resumed run's groups as (name, lr_mult)."""
    from ds_seg.config import REPO_ROOT, load_config
    cache = os.path.join(tmp, 'cache')
    config = dict(unet='unet_tiny_synthetic.py', dinov2='upernet_dinov2_tiny_synthetic.py')[model]
    for steps, resume, optim in ((2, None, before), (3, 'auto', after)):
        cfg = load_config(str(REPO_ROOT / 'configs' / config), [
            f'data.train.cache_dir={cache!r}', f'data.val.cache_dir={cache!r}', 'data.train.scene_size=128',
            'data.val.scene_size=128', 'data.crop_size=64', f'train.max_steps={steps}', 'train.eval_interval=0',
            'train.checkpoint_interval=2', *[f'optim.{k}={v!r}' for k, v in optim.items()]])
        trainer = _fit_or_refusal(cfg, ds_config(stage, micro_batch=1), backend=backend,
                                  work_dir=os.path.join(tmp, 'w'), resume=resume)
        if isinstance(trainer, str):
            return trainer
    return [(g['name'], g['lr_mult']) for g in _base_optimizer(trainer.backend).param_groups]


@pytest.mark.parametrize('backend, stage, model, before, after, refused', [
    ('deepspeed', 2, 'dinov2', {'paramwise.backbone_lr_mult': 0.1}, {'paramwise.backbone_lr_mult': 0.5},
     'optim.paramwise.backbone_lr_mult 0.1 there, 0.5 here'),
    ('ddp', 0, 'unet', {}, {'paramwise.no_weight_decay': True},
     'optim.paramwise.no_weight_decay False there, True here'),
    ('deepspeed', 3, 'dinov2', {'paramwise.backbone_lr_mult': 0.1}, {'paramwise.backbone_lr_mult': 0.1}, None),
])
def test_a_resume_with_other_parameter_groups_is_refused(tmp_path, backend, stage, model, before, after, refused):
    """The optimizer state holds each group's lr_mult and weight decay, and a resume restores them:
    another backbone_lr_mult trained at the old one while config.json said the new one, and
    another grouping (no_weight_decay, layer_decay) was a traceback from the optimizer's loader."""
    got = run_on_ranks(_resume_with_optim, 1, args=(str(tmp_path), backend, stage, model, before, after))[0]
    if refused is None:
        assert isinstance(got, list) and ('layer0_backbone', 0.1) in got and ('layer0', 1.0) in got, got
    else:
        assert isinstance(got, str) and got.startswith('--resume: ') and refused in got, got
        assert "Resume with the checkpoint's optim settings" in got


def _resume_fused(tmp, backend, stage):
    """Two steps with torch's default AdamW, then a resume with ``fused: true`` (a run moved to a
    node where ds_seg picks the fused one): the base optimizer's fused flag and step counts as the
    resumed run starts, and the implementation its summary names."""
    import json

    from ds_seg.engine.optimizer_state import base_optimizer
    from ds_seg.engine.trainer import Trainer
    work = os.path.join(tmp, 'work')
    for steps, resume, fused in ((2, None, False), (3, 'auto', True)):
        ds = ds_config(stage, micro_batch=2)
        if fused:
            ds['optimizer']['params']['fused'] = True
        cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=2)
        trainer = Trainer(cfg, ds, backend=backend, work_dir=work, resume=resume)
        try:
            opt = base_optimizer(trainer.backend.optimizer)
            started = ([g.get('fused') for g in opt.param_groups],
                       sorted({float(s['step']) for s in opt.state.values()}))
            trainer.fit()
        finally:
            trainer.close()
    with open(os.path.join(work, 'summary.json')) as f:
        return started, json.load(f)['optimizer_impl']


@pytest.mark.parametrize('backend, stage', [('ddp', 0), ('deepspeed', 0), ('deepspeed', 2)])
def test_a_resume_runs_the_optimizer_implementation_this_run_chose(tmp_path, backend, stage):
    # The checkpoint's param_groups came back whole, fused=None included: the resumed run stepped
    # single-tensor while its summary said fused (and DeepSpeed's FusedAdam, resumed from torch's
    # state, failed at its first step on a missing 'bias_correction').
    (fused, steps), impl = run_on_ranks(_resume_fused, 1, args=(str(tmp_path), backend, stage))[0]
    assert set(fused) == {True} and steps == [2.0], (fused, steps)
    assert impl == 'torch.AdamW fused'


def _passes(tmp, passes):
    """Train each ``(max_steps, resume, lr)`` of ``passes`` in turn in one work dir (a checkpoint
    every 2 steps; ``resume`` None, 'auto' or a step tag; ``lr`` the optimizer's, None for the
    JSON's): what the last pass printed, and the LRs every logged step trained at."""
    import contextlib
    import io

    from ds_seg.engine.trainer import Trainer
    work, printed = os.path.join(tmp, 'work'), io.StringIO()
    for i, (steps, resume, lr) in enumerate(passes):
        ds = ds_config(0, micro_batch=2)
        if lr is not None:
            ds['optimizer']['params']['lr'] = lr
        if resume not in (None, 'auto'):
            resume = os.path.join(work, 'checkpoints', resume)
        cfg = tiny_cfg(os.path.join(tmp, 'cache'), max_steps=steps, checkpoint_interval=2)
        with contextlib.redirect_stdout(printed if i == len(passes) - 1 else io.StringIO()):
            trainer = Trainer(cfg, ds, work_dir=work, resume=resume)
            try:
                trainer.fit()
            finally:
                trainer.close()
    return printed.getvalue(), [r['lr'] for r in read_jsonl(os.path.join(work, 'metrics.jsonl'))]


def test_a_resume_on_another_schedule_says_what_changed_and_the_lr_it_goes_on_at(tmp_path):
    # The smoke test's warmup (2 steps, DeepSpeed's minimum) was re-derived from the JSON (3 steps) for the longer run:
    # the LR fell from the peak back into warmup at the first resumed step, without a word.
    # A smoke test of 2 steps (the JSON's 3-step warmup shortened to fit), resumed to 6 steps.
    printed, lrs = run_on_ranks(_passes, 1, args=(str(tmp_path), [(2, None, None), (6, 'auto', None)]))[0]
    lines = [line for line in printed.splitlines() if "the LR schedule is not the checkpoint's" in line]
    assert len(lines) == 1, printed
    assert 'warmup_num_steps 2 -> 3' in lines[0] and 'total_num_steps 2 -> 6' in lines[0], lines
    assert lines[0].endswith(f'from step 3 it follows this run\'s: LR {lrs[2]:.3g} at step 3'), (lines, lrs)


@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_a_scheduler_added_on_resume_is_refused(tmp_path, backend):
    # DeepSpeed failed loading the scheduler state (a TypeError traceback); DDP started the new
    # schedule over at its first step, at step 3 of the run, without a word.
    said = run_on_ranks(_resume_with, 1, args=(str(tmp_path), {}, False, backend, True))[0]
    assert isinstance(said, str) and said.startswith('--resume: ') and 'was trained without an LR scheduler' in said, said


@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_a_scheduler_removed_on_resume_is_refused_as_such(tmp_path, backend):
    # It was refused as a change of "lr (scheduled) -> 0.002", which did not say the block was gone.
    said = run_on_ranks(_resume_with, 1, args=(str(tmp_path), {}, True, backend, False))[0]
    assert isinstance(said, str) and said.startswith('--resume: '), said
    assert 'was trained with an LR scheduler, but the DeepSpeed config has none (its scheduler block was removed)' \
        in said and 'optimizer.params.lr=0.002 would never apply' in said, said


def test_a_resume_at_another_optimizer_lr_says_so(tmp_path):
    """The schedule scales the optimizer's lr: twice the lr trained at twice the LR from the first
    resumed step, and no line said so (only a change of the scheduler block was said)."""
    # 4 steps at lr 0.002, then step 2 resumed at lr 0.004 (the same schedule block).
    printed, lrs = run_on_ranks(_passes, 1, args=(str(tmp_path), [(4, None, 0.002), (4, 'step_00000002', 0.004)]))[0]
    lines = [line for line in printed.splitlines() if "the LR schedule is not the checkpoint's" in line]
    assert len(lines) == 1 and 'optimizer.params.lr 0.002 -> 0.004' in lines[0], printed
    assert lines[0].endswith(f"from step 3 it follows this run's: LR {lrs[2]:.3g} at step 3"), (lines, lrs)


def test_a_universal_folder_left_by_a_killed_resume_is_never_loaded(tmp_path):
    """``.universal-<tag>`` is the checkpoint converted for another number of ranks, removed after
    the load; a run killed in between left it, and a rollback then saved that tag again with
    other weights: the next resume loaded the left folder, the abandoned branch's weights. Here a
    left folder holds step 3's weights under step 6's name; the resume must start from step 6."""
    from ds_seg.engine import reshard
    tmp = str(tmp_path)
    run_on_ranks(_run, 2, args=(tmp, 'deepspeed', 1, 3, None))
    saved = run_on_ranks(_run, 2, args=(tmp, 'deepspeed', 1, 6, 'auto'))
    root = os.path.join(tmp, 'work', 'checkpoints')
    reshard._to_universal(os.path.join(root, 'step_00000003'), os.path.join(root, '.universal-step_00000006'))
    one = run_on_ranks(_run, 1, args=(tmp, 'deepspeed', 1, 7, 'auto'))
    before, after = saved[0]['master_end'], one[0]['master_start']
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), \
        [k for k in before if not torch.equal(before[k], after[k])]
    assert not os.path.exists(os.path.join(root, '.universal-step_00000006'))
