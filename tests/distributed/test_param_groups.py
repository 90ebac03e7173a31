"""The ViT fine-tuning recipe (optim.layer_decay, optim.paramwise) reaches the optimizer as the same
parameter groups under DeepSpeed (ZeRO-2) and DDP, and the LR schedule scales every group
proportionally at every step (2 CPU ranks, a tiny DINOv2-reg4 UperNet, 4 steps). ZeRO-3 builds the
model partitioned (every parameter an empty 1-D tensor) and gets the same groups."""
import os

import pytest

from ds_seg.config import REPO_ROOT, load_config
from tests.dist import run_on_ranks
from tests.tiny import ds_config

STEPS = 4
RECIPE = dict(layer_decay=0.5, backbone_lr_mult=0.1)


def _group_lrs(tmp, backend, stage=2):
    """Train STEPS steps, recording (name, lr, weight_decay) of every group after each."""
    from ds_seg.engine.trainer import Trainer
    cache = os.path.join(tmp, 'cache')
    cfg = load_config(str(REPO_ROOT / 'configs' / 'upernet_dinov2_tiny_synthetic.py'), [
        f'data.train.cache_dir={cache!r}', f'data.val.cache_dir={cache!r}', 'data.train.scene_size=128',
        'data.val.scene_size=128', 'data.crop_size=64', f'train.max_steps={STEPS}', 'train.eval_interval=0',
        'train.checkpoint_interval=0', f'optim.layer_decay={RECIPE["layer_decay"]}',
        'optim.paramwise.no_weight_decay=True', f'optim.paramwise.backbone_lr_mult={RECIPE["backbone_lr_mult"]}'])
    ds = ds_config(stage, micro_batch=1)
    trainer = Trainer(cfg, ds, backend=backend, work_dir=os.path.join(tmp, f'{backend}{stage}'))
    rows = []
    step = trainer.backend.step

    def recording_step(*args, **kwargs):
        applied = step(*args, **kwargs)
        rows.append([(g['name'], g['lr'], g.get('weight_decay'), len(g['params']))
                     for g in trainer.backend.optimizer.param_groups])
        return applied

    trainer.backend.step = recording_step
    try:
        summary = trainer.fit()
    finally:
        trainer.log.close()
    assert summary['exit_reason'] == 'completed'
    return rows


def _both(tmp):
    """On each rank, one process group (process start-up dominates): DeepSpeed, DDP, ZeRO-3."""
    return dict(deepspeed=_group_lrs(tmp, 'deepspeed'), ddp=_group_lrs(tmp, 'ddp'),
                zero3=_group_lrs(tmp, 'deepspeed', stage=3))


@pytest.fixture(scope='module')
def lrs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp('groups'))
    return run_on_ranks(_both, 2, args=(tmp,), timeout=300)[0]


@pytest.mark.parametrize('engine', ['deepspeed', 'zero3'])
def test_group_lrs_per_step_equal_under_deepspeed_and_ddp(lrs, engine):
    """ZeRO-3 put every parameter in a no-decay group (its partitions are 1-D): no_weight_decay
    switched weight decay off for every weight."""
    ds, ddp = lrs[engine], lrs['ddp']
    assert len(ds) == len(ddp) == STEPS
    for step, (a, b) in enumerate(zip(ds, ddp)):
        assert [(n, wd) for n, _, wd, _ in a] == [(n, wd) for n, _, wd, _ in b], step
        assert [lr for _, lr, _, _ in a] == pytest.approx([lr for _, lr, _, _ in b], rel=1e-12), step


def test_schedule_applies_to_every_group_proportionally(lrs):
    rows = lrs['deepspeed']
    depth = 2  # the tiny config's ViT: embeddings (layer 0), blocks 0-1, then norm/heads (layer 3)
    decay, backbone = RECIPE['layer_decay'], RECIPE['backbone_lr_mult']
    expected = {'layer0_backbone': backbone * decay ** 3, 'layer1_backbone': backbone * decay ** 2,
                'layer2_backbone': backbone * decay, 'layer3_backbone': backbone, 'layer3': 1.0}
    heads = []
    for row in rows:
        head = row[0][1]                     # groups[0]: the heads, at the base schedule
        heads.append(head)
        assert row[0][0] == 'layer3'
        for name, lr, wd, _ in row:
            assert lr == pytest.approx(head * expected[name.replace('_no_decay', '')], rel=1e-9), name
            assert (wd == 0.0) == name.endswith('_no_decay'), name
    assert heads[0] < heads[1] < heads[2] > heads[3]   # the schedule moved it: warm-up, then cosine decay
    names = {name for name, *_ in rows[0]}
    assert {'layer0_backbone_no_decay', 'layer1_backbone_no_decay', 'layer3_no_decay'} <= names
    assert depth + 2 == len({n.split('_')[0] for n in names})
