"""The speed features change nothing but speed (issue 14): a compiled run and a channels_last run
give the losses of the plain run under DDP and DeepSpeed, with gradient accumulation, on one real
CPU rank; the run records which optimizer implementation did the update, and how long compilation
took. ``DS_SEG_TEST_COMPILE_STAGE=3`` runs the DeepSpeed cases under ZeRO-3."""
import os
import shutil

import pytest

from tests.dist import run_on_ranks
from tests.tiny import ds_config, logged_losses, read_jsonl, tiny_cfg

STEPS = 6
# Accumulation runs micro-steps without the gradient exchange (DDP's no_sync, DeepSpeed's
# non-boundary steps): a compiled graph must not bake either in. ZeRO-3 (parameters fetched by
# hooks around every module: 23 graphs for UNetTiny) passes this test too, but its cold inductor
# build costs about 150 s more than ZeRO-2's, so CI runs ZeRO-2 (the module docstring says how to run it).
STAGE = {'ddp': 2, 'deepspeed': int(os.environ.get('DS_SEG_TEST_COMPILE_STAGE', 2))}
GRAD_ACCUM = 2
# Measured on this CPU (UNetTiny, AdamW lr 2e-3): channels_last losses equal NCHW ones to ~1e-7
# relative over 8 steps; 1e-4 leaves room for other CPUs' kernels.
REL_TOL = 1e-4
# Compiled vs eager (inductor fuses and reorders float32 reductions), measured: step 1 (a forward
# of identical weights) 1e-7 relative; then Adam amplifies the rounding: 2e-6 at step 4, 2e-5 at
# step 6, 5e-4 at step 8. So over 6 steps: step 1 within 1e-5, the rest within 1e-3; a real
# change of computation (a missed step, wrong weights) moves the loss by far more than that.
COMPILED_TOL = [1e-5] + [1e-3] * (STEPS - 1)


def _train(tmp, backend, work, train):
    from ds_seg.engine.trainer import Trainer
    train = dict({'max_steps': STEPS}, **train)
    cfg = tiny_cfg(os.path.join(tmp, 'cache'), **train)
    trainer = Trainer(cfg, ds_config(STAGE[backend], grad_accum=GRAD_ACCUM), backend=backend, work_dir=os.path.join(tmp, work))
    import torch
    conv = next(m for m in trainer.backend.module.modules() if isinstance(m, torch.nn.Conv2d))
    layouts = []  # whether the first convolution's input was NHWC, per forward

    def nhwc(t):
        return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    if not train.get('compile'):
        conv.register_forward_hook(lambda m, args, out: layouts.append(nhwc(args[0])))
    try:
        summary = trainer.fit()
        from torch._dynamo.utils import counters
        # Graphs dynamo captured in this process: 0 means the model ran eagerly.
        return dict(summary=summary, weight_nhwc=nhwc(conv.weight), input_nhwc=set(layouts),
                    graphs=counters['stats']['unique_graphs'])
    finally:
        trainer.close()


@pytest.fixture(scope='module')
def plain(tmp_path_factory):
    """plain(backend): the uncompiled NCHW run both tests compare with, run once per backend."""
    tmp, runs = str(tmp_path_factory.mktemp('plain')), {}

    def run(backend):
        if backend not in runs:
            runs[backend] = run_on_ranks(_train, 1, args=(tmp, backend, backend, {}))[0]
            runs[backend]['losses'] = logged_losses(os.path.join(tmp, backend))
        return runs[backend]
    return run


def _assert_same_losses(ref, got, what, tolerances):
    assert len(ref) == len(got) == len(tolerances)
    for step, (a, b, tol) in enumerate(zip(ref, got, tolerances), 1):
        assert abs(a - b) <= tol * abs(a), f'step {step}: plain loss {a} vs {what} {b}'


def _compile_works():
    """torch.compile on CPU needs a C++ compiler (inductor writes and builds C++ kernels)."""
    return shutil.which('g++') or shutil.which('c++') or shutil.which('clang++')


@pytest.mark.slow
@pytest.mark.skipif(not _compile_works(), reason='torch.compile (inductor) on CPU needs a C++ compiler (g++/c++)')
@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_compiled_run_gives_the_plain_losses(tmp_path, plain, backend):
    tmp = str(tmp_path)
    plain = plain(backend)
    compiled = run_on_ranks(_train, 1, args=(tmp, backend, 'compiled', {'compile': True}), timeout=420)[0]
    assert plain['graphs'] == 0 and compiled['graphs'] > 0
    _assert_same_losses(plain['losses'], logged_losses(os.path.join(tmp, 'compiled')), 'compiled', COMPILED_TOL)
    plain, compiled = plain['summary'], compiled['summary']
    assert plain['compile_mode'] is None and plain['compile_time_s'] is None
    assert compiled['compile_mode'] == 'default' and compiled['compile_time_s'] > 0
    # Compilation is kept out of throughput: the first two steps are warm-up whatever the config says.
    rows = read_jsonl(os.path.join(tmp, 'compiled', 'metrics.jsonl'))
    assert [r['images_per_s'] is None for r in rows[:3]] == [True, True, False]


@pytest.mark.slow
@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_channels_last_run_gives_the_plain_losses(tmp_path, plain, backend):
    tmp = str(tmp_path)
    plain = plain(backend)
    nhwc = run_on_ranks(_train, 1, args=(tmp, backend, 'nhwc', {'channels_last': True}))[0]
    _assert_same_losses(plain['losses'], logged_losses(os.path.join(tmp, 'nhwc')), 'channels_last', [REL_TOL] * STEPS)
    assert not plain['summary']['channels_last'] and nhwc['summary']['channels_last']
    assert not plain['weight_nhwc'] and plain['input_nhwc'] == {False}
    assert nhwc['input_nhwc'] == {True}
    # DeepSpeed views parameters as flat bytes: only DDP may hold them channels_last.
    assert nhwc['weight_nhwc'] == (backend == 'ddp')
    # The optimizer that ran is recorded: on a CPU torch's default is the single-tensor loop.
    assert nhwc['summary']['optimizer_impl'] == 'torch.AdamW single-tensor'
    assert all(r['optimizer_impl'] == 'torch.AdamW single-tensor' for r in read_jsonl(os.path.join(tmp, 'nhwc', 'metrics.jsonl')))
