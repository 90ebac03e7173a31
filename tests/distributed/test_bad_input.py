"""Every user mistake stops launch/train.py before training with one line (exit status 2) that
names the file or key: one test per case, all run through the real entry point in one fresh
process (so the cost of importing DeepSpeed is paid once)."""
import contextlib
import io
import json
import os

import numpy as np
import pytest

from ds_seg.config import REPO_ROOT
from tests.dist import run_on_ranks
from tests.tiny import TINY_CONFIG

pytestmark = pytest.mark.slow


def _write_tif(path, array_CHW, nodata=None):
    import rasterio
    from rasterio.transform import from_origin
    count, h, w = array_CHW.shape
    with rasterio.open(path, 'w', driver='GTiff', width=w, height=h, count=count, dtype=array_CHW.dtype,
                       crs='EPSG:32632', transform=from_origin(500000, 5000000, 0.1, 0.1), nodata=nodata,
                       photometric='MINISBLACK' if count != 3 else 'RGB') as dst:
        dst.write(array_CHW)
    return str(path)


def _bgr_copy(path, out):
    """``path``'s pixels in a file whose colour interpretation says blue, green, red."""
    import rasterio
    from rasterio.enums import ColorInterp
    with rasterio.open(path) as src:
        _write_tif(out, src.read())
    with rasterio.open(out, 'r+') as dst:
        dst.colorinterp = [ColorInterp.blue, ColorInterp.green, ColorInterp.red]
    return out



def _dangling_link(tmp):
    link = os.path.join(tmp, 'scratch_link')
    if not os.path.islink(link):
        os.symlink(os.path.join(tmp, 'purged_scratch'), link)
    return link

def _geotiff_data(images, labels, classes=6):
    data = repr(dict(type='GeoTiffScenes', images=images, labels=labels, classes=classes))
    return [f'data.train={data}', 'data.val=None']


def _train_val(train, val):
    """data.train and data.val GeoTiffScenes of (images, labels, classes)."""
    return [f"data.{name}={dict(type='GeoTiffScenes', images=i, labels=l, classes=c)!r}"
            for name, (i, l, c) in (('train', train), ('val', val))]


def _cases(tmp):
    rng = np.random.default_rng(0)
    d = os.path.join(tmp, 'data')
    os.makedirs(d, exist_ok=True)
    img = _write_tif(os.path.join(d, 'img.tif'), rng.integers(0, 255, (3, 64, 64), dtype=np.uint8))
    lbl = _write_tif(os.path.join(d, 'lbl.tif'), rng.integers(0, 6, (1, 64, 64), dtype=np.uint8))
    lbl4 = _write_tif(os.path.join(d, 'lbl4.tif'), rng.integers(0, 4, (1, 64, 64), dtype=np.uint8))
    img4 = _write_tif(os.path.join(d, 'img4.tif'), rng.integers(0, 255, (4, 64, 64), dtype=np.uint8))
    # a second date of img's grid (img itself as two dates is refused: one file given twice)
    img_date2 = _write_tif(os.path.join(d, 'img_date2.tif'), rng.integers(0, 255, (3, 64, 64), dtype=np.uint8))
    lbl_bad = _write_tif(os.path.join(d, 'lbl_bad.tif'), np.full((1, 64, 64), 9, dtype=np.uint8))
    lbl_small = _write_tif(os.path.join(d, 'lbl_small.tif'), np.zeros((1, 32, 32), dtype=np.uint8))
    img_nodata = _write_tif(os.path.join(d, 'img_nodata.tif'), np.zeros((3, 64, 64), dtype=np.uint8), nodata=0)
    img_nan = _write_tif(os.path.join(d, 'img_nan.tif'), np.full((3, 64, 64), np.nan, dtype=np.float32))
    lbl_nodata0 = _write_tif(os.path.join(d, 'lbl_nodata0.tif'), rng.integers(0, 6, (1, 64, 64), dtype=np.uint8),
                             nodata=0)
    lbl_one_class = _write_tif(os.path.join(d, 'lbl_one_class.tif'), np.zeros((1, 64, 64), dtype=np.uint8))
    lbl2 = _write_tif(os.path.join(d, 'lbl2.tif'), rng.integers(0, 2, (1, 64, 64), dtype=np.uint8))
    img16 = _write_tif(os.path.join(d, 'img16.tif'), rng.integers(0, 4000, (3, 64, 64), dtype=np.uint16))
    img_bgr = _bgr_copy(img, os.path.join(d, 'img_bgr.tif'))
    truncated = os.path.join(d, 'resnet_cut.pth')
    with open(truncated, 'wb') as f:   # the first half of a real weights file (a download cut short)
        import timm
        import torch
        buffer = io.BytesIO()
        torch.save(timm.create_model('test_resnet', pretrained=False).state_dict(), buffer)
        f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
    corrupt = os.path.join(d, 'corrupt.tif')
    with open(corrupt, 'wb') as f:
        f.write(b'II*\x00' + os.urandom(2000))
    ds_dir = os.path.join(tmp, 'ds')
    os.makedirs(ds_dir, exist_ok=True)

    def ds_json(name, obj):
        path = os.path.join(ds_dir, name)
        with open(path, 'w') as f:
            json.dump(obj, f)
        return path

    base = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}}
    tiny = ['model.type=UNetTiny', 'train.eval_interval=0', 'train.checkpoint_interval=24',
            'data.crop_size=32']
    def combined_loss(name, *members):   # a config whose loss is a CombinedLoss of these members
        path = os.path.join(tmp, name)
        with open(path, 'w') as f:
            f.write(f"_base_ = [{TINY_CONFIG!r}]\nloss = dict(_delete_=True, type='CombinedLoss', losses={list(members)!r})\n")
        return ['--config', path]

    a_file = os.path.join(tmp, 'a_file')
    open(a_file, 'w').close()
    return {
        # case: (extra cfg-options, DeepSpeed JSON, extra argv)
        'missing_file': (_geotiff_data([os.path.join(d, 'missing.tif')], [lbl]), None, []),
        'corrupt_geotiff': (_geotiff_data([corrupt], [lbl]), None, []),
        'label_values': (_geotiff_data([img], [lbl_bad]), None, []),
        'size_mismatch': (_geotiff_data([img], [lbl_small]), None, []),
        'band_count': (_geotiff_data([img4], [lbl]) + ['model.in_channels=3'], None, []),
        'unknown_model': (['model.type=Unett'], None, []),
        'ds_typo': ([], ds_json('typo.json', {**base, 'gradient_clippin': 1.0}), []),
        'ds_auto': ([], ds_json('auto.json', {**base, 'bf16': {'enabled': 'auto'}}), []),
        'ds_batch': ([], ds_json('batch.json', {**base, 'train_batch_size': 7}), []),
        # no pixel both labelled and valid in its image: would train to loss 0 and "complete"
        'image_all_nodata': (_geotiff_data([img_nodata], [lbl]), None, []),
        'image_all_nan': (_geotiff_data([img_nan], [lbl]), None, []),
        'label_nodata_is_class': (_geotiff_data([img], [lbl_nodata0]), None, []),
        'ds_block_typo': ([], ds_json('block_typo.json', {**base, 'checkpoint': {'tag_validaton': 'Warn'}}), []),
        # passes ds_seg's checks; DeepSpeed refuses it while building the engine
        # DeepSpeed's fused CUDA optimizers on the CPU: "DeepSpeed cannot build this engine (This op
        # had not been implemented on CPU backend.)" said neither which optimizer nor what runs there
        'ds_lamb_on_cpu': ([], ds_json('lamb.json', {**base, 'optimizer': {'type': 'Lamb', 'params': {'lr': 0.001}}}),
                           []),
        'ds_engine_refuses': ([], ds_json('untested.json', {
            **base, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.01}},
            'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'cpu'}}}), []),
        # windows past the machine's memory: a numpy traceback at the first step, or at the first
        # evaluation with the steps before it lost
        'crop_past_memory': (['data.crop_size=1000000'], None, []),
        # A batch of inputs a twelfth of the memory passes the guard above; UNetTiny's activations (36 to
        # 72 times its input) do not: the OOM killer ended such a run ("Killed") 100 s into training.
        'activations_past_memory': ([f'data.crop_size={_crop_of_a_twelfth_of_memory()}'], None, []),
        'eval_tile_past_memory': (['data.eval_tile=1000000', 'train.eval_interval=2'], None, []),
        'micro_batch_past_memory': ([], ds_json('huge_batch.json', {**base, 'train_micro_batch_size_per_gpu': 10 ** 9}), []),
        'ds_act_ckpt': ([], ds_json('act_ckpt.json', {**base, 'activation_checkpointing': {'partition_activations': True}}), []),
        'loss_ignore_str': (['loss.ignore_index=\'255\''], None, []),
        # a TypeError (CE) or AttributeError (Dice, OHEM) at the first step
        'loss_ignore_none': (['loss.ignore_index=None'], None, []),
        # trained at loss 0 (no pixel kept) for the whole run
        'loss_ohem_thresh': (['loss.type=OhemCrossEntropyLoss', 'loss.thresh=-1'], None, []),
        # the last 20 steps trained at the schedule's final LR
        'ds_schedule_short': ([], ds_json('short.json', {**base, 'scheduler': {
            'type': 'WarmupDecayLR', 'params': {'warmup_num_steps': 1, 'total_num_steps': 4}}}), []),
        # DeepSpeed reads "false" as true
        'ds_autocast_quoted': ([], ds_json('autocast.json', {**base, 'torch_autocast': {'enabled': 'false'}}), []),
        'ds_scheduler_null': ([], ds_json('null.json', {**base, 'scheduler': None}), []),
        # every pixel weighs 0: trained at loss 0 for the whole run
        'class_weight_zero': (['loss.class_weight=[0, 0, 0, 0, 0, 0]'], None, []),
        'class_weight_nested': (['loss.class_weight=[[1, 1, 1, 1, 1, 2]]'], None, []),
        # loss 0 and gradient 0 at every step, exit 0
        'loss_weight_zero': (['loss.loss_weight=0'], None, []),
        'combined_weights_zero': ([], None, combined_loss('zero.py', dict(type='CrossEntropyLoss', loss_weight=0),
                                                          dict(type='DiceLoss', loss_weight=0.0))),
        # a grid gives each window once, then all-ignore padding: trained at loss 0 after that
        # (grid is the default for a split other than 'train', e.g. mmseg's ADE20K 'training')
        'train_grid': ([f"data.train={dict(type='GeoTiffScenes', images=[img], labels=[lbl], classes=6, split='training')!r}",
                        'data.val=None'], None, []),
        # a misspelt flip direction never flipped
        'flip_typo': (["data.train.transforms=[{'type': 'RandomFlip', 'direction': 'horizonal'}]"], None, []),
        'load_from_folder': ([f'load_from={tmp}'], None, []),
        # a checkpoints folder's pointer file (the 6-class run's, written before these cases run)
        # refused by the trainer (a resumed run never reads it), still before any step
        'load_from_missing': ([f"load_from={os.path.join(tmp, 'gone.pt')!r}"], None, []),
        'load_from_pointer': ([f"load_from={os.path.join(tmp, 'trained6', 'checkpoints', 'latest')}"], None, []),
        # one rank file of a checkpoint: the line said to give the folder, which load_from refuses
        'load_from_rank_file': ([f"load_from={os.path.join(tmp, 'trained6', 'checkpoints', 'step_00000024', 'mp_rank_00_model_states.pt')!r}"],
                                None, []),
        # the 6-class run's exported weights (see _run_cases) into a wider UNet: another
        # architecture (another class count is fine-tuning: tests/distributed/test_training.py)
        'load_from_width': (_geotiff_data([img], [lbl]) + tiny[1:] +
                            ['model.type=UNet', 'model.base_channels=16', 'model.depth=3',
                             f"load_from={os.path.join(tmp, 'trained6.pt')!r}"], None, []),
        # the members of a CombinedLoss: each one's ignore_index, its class default included
        'combined_member_ignore_str': ([], None, combined_loss('str.py', dict(type='CrossEntropyLoss'),
                                                              dict(type='DiceLoss', ignore_index='255'))),
        'combined_member_ignore_other': ([], None, combined_loss('other.py', dict(type='CrossEntropyLoss', ignore_index=0),
                                                                dict(type='DiceLoss'))),
        'work_dir': ([], None, ['--work-dir', os.path.join(a_file, 'run')]),
        'work_dir_is_a_file': ([], None, ['--work-dir', a_file]),
        # a link to nothing ('is a file, not a folder' said of it)
        'work_dir_dangling_link': ([], None, ['--work-dir', _dangling_link(tmp)]),
        # a softmax over one class: loss 0 and mIoU 1 whatever is learnt (it trained, "perfectly")
        'one_class': (_geotiff_data([img], [lbl_one_class], classes=1) + ['model.num_classes=1'], None, []),
        'binary_one_output': (_geotiff_data([img], [lbl2], classes=2) + ['model.num_classes=1'], None, []),
        'backbone_typo': (['model.type=UperNet', 'model.backbone=convnxt_tiny'], None, []),
        # linear probing of what has no backbone, or of random filters
        'freeze_unet': (['optim.paramwise.freeze_backbone=True'], None, []),
        'freeze_random': (['model.type=FPN', 'model.backbone=test_resnet', 'model.channels=16',
                           'optim.paramwise.freeze_backbone=True'], None, []),
        'pretrained_truncated': (['model.type=FPN', 'model.backbone=test_resnet', 'model.channels=16',
                                  f'model.pretrained={truncated}'], None, []),
        # a validation set the trained model cannot take: found after training, before this check
        'val_bands': (_train_val(([img], [lbl], 6), ([img4], [lbl], 6)), None, []),
        'val_classes': (_train_val(([img], [lbl], 6), ([img], [lbl4], 4)), None, []),
        # classes inferred from labels: the training labels lack a class the validation ones have;
        # the advice was model.num_classes=4, refused next for data.val
        'val_more_classes_inferred': (_train_val(([img], [lbl4], None), ([img], [lbl], None)) + ['model.num_classes=6'],
                                      None, []),
        'val_dates': (_train_val(([img], [lbl], 6), ([[img, img_date2]], [lbl], 6)), None, []),
        # evaluated with the training set's statistics and band order: scored noise, exit 0
        'val_dtype': (_train_val(([img], [lbl], 6), ([img16], [lbl], 6)), None, []),
        'val_band_order': (_train_val(([img], [lbl], 6), ([img], [lbl], 6)) + ['data.val.bands=[3,2,1]'], None, []),
        # trained first (see _run_cases), then resumed with another model / class count
        'resume_model': (_geotiff_data([img], [lbl]) + tiny[1:] + ['model.type=UNet', 'model.base_channels=8'],
                         None, ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        'resume_classes': (_geotiff_data([img], [lbl4], classes=4) + tiny + ['model.num_classes=4'],
                           None, ['--resume', os.path.join(tmp, 'trained6', 'checkpoints'),
                                  '--work-dir', os.path.join(tmp, 'other')]),
        # resumed on other data: the weights' meaning changed mid-run without a word
        'resume_class_names': (_geotiff_data([img], [lbl], classes=tuple('abcdef')) + tiny, None,
                               ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        'resume_dtype': (_geotiff_data([img16], [lbl]) + tiny, None,
                         ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        'resume_bands': (_geotiff_data([img], [lbl]) + tiny + ['data.train.bands=[3,2,1]'], None,
                         ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        # file value 0 trained class_0, then class_1: the same names, relabelled data
        'resume_label_map': (_geotiff_data([img], [lbl]) + tiny + ['data.train.label_map={0:1,1:0}'], None,
                             ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        'resume_colours': (_geotiff_data([img_bgr], [lbl]) + tiny, None,
                           ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        'resume_stats': (_geotiff_data([img], [lbl]) + tiny + ['data.train.mean=[1,2,3]'], None,
                         ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        # the stats cache edited as another version's statistics would differ: continues (see below)
        '_resume_recomputed_stats': (_geotiff_data([img], [lbl]) + tiny + ['train.max_steps=26'], None,
                                     ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        # the same again: the run is finished (what a requeued or re-submitted job does); a label_map of
        # every class to itself decodes as the run did (it was refused as a change of decoding)
        '_resume_finished': (_geotiff_data([img], [lbl]) + tiny + ['train.max_steps=26', 'data.train.label_map='
                                                                   '{0:0,1:1,2:2,3:3,4:4,5:5}'], None,
                             ['--resume', 'auto', '--work-dir', os.path.join(tmp, 'trained6')]),
        '_train6': (_geotiff_data([img], [lbl]) + tiny, None, ['--work-dir', os.path.join(tmp, 'trained6')]),
    }


def _run_cases(tmp, names):
    """Run the train command's main() (ds_seg/cli/train.py, what launch/train.py runs) for each
    case in this process; (exit status, stderr lines)."""
    from ds_seg.cli import train as entry
    cases = _cases(tmp)
    results = {}
    for name in names:
        options, ds, extra = cases[name]
        if name == 'load_from_width':
            from ds_seg.cli import export
            assert export.main([os.path.join(tmp, 'trained6'), '--out', os.path.join(tmp, 'trained6.pt')]) == 0
        argv = ['--config', TINY_CONFIG, '--deepspeed_config', ds or str(REPO_ROOT / 'ds_configs' / 'zero0.json')]
        argv += ['--work-dir', os.path.join(tmp, 'work', name)] if '--work-dir' not in extra else []
        argv += extra + ['--cfg-options', f'data.train.cache_dir={tmp}/cache', f'data.val.cache_dir={tmp}/cache',
                         'train.max_steps=24', *options]
        if name == '_resume_recomputed_stats':  # img.tif's statistics, cached as other than trained with
            from ds_seg.data.geotiff import STATS_CACHE_FILE, STATS_VERSION
            from ds_seg.data.raster import file_identity
            from ds_seg.engine import checkpoint
            data = checkpoint.read_marker(os.path.join(tmp, 'trained6', 'checkpoints', 'step_00000024'))['data']
            with open(os.path.join(tmp, 'data', STATS_CACHE_FILE), 'w') as f:
                json.dump(dict(version=STATS_VERSION, sets=[dict(
                    images=[file_identity(os.path.join(tmp, 'data', 'img.tif'))],
                    mean=[m + 5 for m in data['mean']], std=data['std'])]), f)
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = entry.main(argv)
        fresh_work_dir = None if '--work-dir' in extra else os.path.exists(os.path.join(tmp, 'work', name))
        results[name] = (code, err.getvalue().strip().splitlines(), fresh_work_dir, out.getvalue(), tmp)
    return results


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp('bad'))
    # A run that trains closes its process group, so it gets a process of its own; the failing
    # cases stop before training and share one (resume cases last: they get furthest).
    trained = run_on_ranks(_run_cases, 1, args=(tmp, ['_train6']), timeout=300)[0]
    names = sorted(EXPECTED, key=lambda n: n.startswith('resume'))
    refused = run_on_ranks(_run_cases, 1, args=(tmp, names), timeout=300)[0]
    resumed = run_on_ranks(_run_cases, 1, args=(tmp, ['_resume_recomputed_stats']), timeout=300)[0]
    with open(os.path.join(tmp, 'trained6', 'summary.json')) as f:
        resumed['_summary_at_26'] = json.load(f)
    finished = run_on_ranks(_run_cases, 1, args=(tmp, ['_resume_finished']), timeout=300)[0]
    return {**trained, **refused, **resumed, **finished}


EXPECTED = {
    'missing_file': ['missing.tif'],
    'corrupt_geotiff': ['corrupt.tif'],
    'label_values': ['lbl_bad.tif', '9'],
    'size_mismatch': ['img.tif', 'lbl_small.tif'],
    'band_count': ['model.in_channels is 3', '4 band'],
    'unknown_model': ["'Unett' is not a registered model", "Did you mean 'UNet'"],
    'ds_typo': ["unknown top-level key 'gradient_clippin'", "'gradient_clipping'"],
    'ds_auto': ["'bf16.enabled' is \"auto\""],
    'ds_batch': ["'train_batch_size' 7"],
    'work_dir': ['--work-dir', 'not writable'],
    'work_dir_is_a_file': ['--work-dir: ', 'a_file is a file, not a folder'],
    'work_dir_dangling_link': ['--work-dir: ', 'scratch_link is a symbolic link to', 'purged_scratch, which does not '
                               'exist', 'mount or create it, or remove the link'],
    'one_class': ['data.train has one class (class_0)', 'at least 2 classes'],
    'binary_one_output': ['model.num_classes is 1 but data.train has 2 classes', 'set model.num_classes=2',
                          'not one sigmoid output'],
    'backbone_typo': ["model.backbone: timm has no model 'convnxt_tiny'", "Did you mean 'convnext_tiny'"],
    'freeze_unet': ['optim.paramwise.freeze_backbone: model UNetTiny has no backbone'],
    'freeze_random': ['optim.paramwise.freeze_backbone=True: the backbone has no pretrained weights'],
    'pretrained_truncated': ['resnet_cut.pth is not a readable weights file (truncated'],
    'image_all_nodata': ['img_nodata.tif', 'no pixel is both labelled with a class and valid in the image'],
    'image_all_nan': ['img_nan.tif', 'no pixel is both labelled with a class and valid', 'NaN'],
    'label_nodata_is_class': ['lbl_nodata0.tif', 'nodata tag is 0', "class 0 ('class_0')", 'gdal_edit.py -unsetnodata'],
    'ds_block_typo': ["unknown key 'checkpoint.tag_validaton'", "Did you mean 'checkpoint.tag_validation'?"],
    'ds_lamb_on_cpu': ["--deepspeed_config: 'optimizer.type' Lamb is a DeepSpeed CUDA op with no CPU version",
                       'on the CPU use AdamW, Adam, SGD or Adagrad'],
    'ds_engine_refuses': ['--deepspeed_config: DeepSpeed cannot build this engine (AssertionError: You are using '
                          'an untested ZeRO Optimizer'],
    'crop_past_memory': ['data.crop_size 1000000 with train_micro_batch_size_per_gpu 8: one batch of 3-band windows '
                         'takes', "GiB as float32, more than this machine's", 'lower data.crop_size'],
    'activations_past_memory': ['with train_micro_batch_size_per_gpu 8: a training step of UNetTiny keeps about',
                                'GiB of activations for its backward pass and this machine has',
                                'lower data.crop_size or the micro-batch'],
    'eval_tile_past_memory': ['data.eval_tile 1000000 with data.eval_batch_size 8', 'lower data.eval_tile'],
    'micro_batch_past_memory': ['with train_micro_batch_size_per_gpu 1000000000', 'or train_micro_batch_size_per_gpu'],
    'ds_act_ckpt': ["'activation_checkpointing' in the DeepSpeed JSON has no effect in ds_seg", 'partition_activations'],
    'loss_ignore_str': ['loss.ignore_index must be an integer', "'255'", 'without quotes'],
    'loss_ignore_none': ['loss.ignore_index=None: give the label value of unlabelled pixels (255 usually'],
    'loss_ohem_thresh': ['loss (OhemCrossEntropyLoss)', 'thresh must be a number in (0, 1], got -1'],
    'ds_schedule_short': ['short.json: scheduler.params.total_num_steps (4) is shorter than the run (train.max_steps=24)'],
    'ds_autocast_quoted': ["autocast.json: 'torch_autocast.enabled' must be true or false, got \"false\""],
    'ds_scheduler_null': ["null.json: 'scheduler' must be an object ({...}), got null"],
    'class_weight_zero': ['loss.class_weight is 0 for every class, so the loss is 0'],
    'class_weight_nested': ['loss.class_weight must be a flat list of numbers, one per class'],
    'loss_weight_zero': ['loss.loss_weight is 0, so the loss is 0 and nothing is learnt'],
    'combined_weights_zero': ['loss.losses.0.loss_weight, loss.losses.1.loss_weight are all 0, so the loss is 0'],
    'train_grid': ["data.train reads windows in grid mode (split='training' is not 'train')",
                   "set data.train.mode='random'"],
    'flip_typo': ['transforms[0] (RandomFlip)', "direction must be one or both of 'horizontal', 'vertical'"],
    'load_from_folder': ['load_from=', 'is a folder', 'launch/export.py'],
    'load_from_missing': ["load_from='", "gone.pt' does not exist; give a weights file written by launch/export.py"],
    'load_from_rank_file': ['load_from: ', 'mp_rank_00_model_states.pt: is one file of the checkpoint', 'export it first '
                            '(launch/export.py', 'continue that run with --resume'],
    'load_from_pointer': ['load_from=', 'names a checkpoint of a run, not a weights file', 'launch/export.py'],
    'load_from_width': ['load_from: ', 'trained6.pt does not fit model UNet:', 'in the weights',
                        'same architecture (the class count may differ'],
    'combined_member_ignore_str': ['loss.losses.1.ignore_index must be an integer', "'255'", 'without quotes'],
    'combined_member_ignore_other': ['loss.losses.0.ignore_index is 0', 'data.train marks padding and nodata with 255'],
    'val_bands': ['data.val yields 4 band(s) but data.train 3'],
    'val_classes': ["data.val's classes (class_0, class_1, class_2, class_3) are not data.train's"],
    'val_more_classes_inferred': ["data.val's classes (class_0, class_1, class_2, class_3, class_4, class_5) are not "
                                  "data.train's (class_0, class_1, class_2, class_3); give both the same `classes` "
                                  "(both classes=6 where"],
    'val_dates': ['data.val has 2 date(s) per scene but data.train has 1'],
    'resume_model': ['--resume', 'holds a UNetTiny model', 'builds UNet'],
    'resume_classes': ['--resume', 'trained for 6 classes', 'data has 4'],
    'val_dtype': ['data.val holds uint16 pixels but data.train uint8', 'gdal_translate -ot'],
    'val_band_order': ["img.tif: data.val's bands [3, 2, 1] hold blue, green, red by the file's colour interpretation",
                       "but data.train's bands hold red, green, blue", 'Select data.val.bands=[1, 2, 3]'],
    'resume_class_names': ['--resume', 'trained with classes class_0, class_1', 'data.train has a, b, c, d, e, f',
                           'load_from='],
    'resume_dtype': ['--resume', 'trained on uint8 pixels but data.train holds uint16'],
    'resume_bands': ['--resume', 'trained on bands [1, 2, 3] but data.train takes [3, 2, 1]',
                     'give data.train.bands=[1, 2, 3]'],
    'resume_label_map': ['--resume', 'was trained decoding labels with the label files as class indices but '
                         "data.train decodes them with label_map={'0': 1, '1': 0}"],
    'resume_colours': ['--resume', 'trained on bands holding red, green, blue but data.train\'s hold blue, green, red'],
    'resume_stats': ['--resume', 'normalised its inputs with data.train.mean=[', 'but the config gives [1,2,3]',
                     'leave data.train.mean out'],
}


def _crop_of_a_twelfth_of_memory():
    """The crop side at which a batch of 8 three-band float32 windows takes a twelfth of this
    machine's memory."""
    memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    return int((memory / 12 / (8 * 3 * 4)) ** 0.5)


def test_the_reference_run_trains(outcomes):
    assert outcomes['_train6'][0] == 0


def test_a_resume_whose_computed_statistics_differ_continues_with_the_checkpoints(outcomes):
    """Statistics computed by another version (more scenes read, masked pixels left out) or from
    changed scenes refused the resume of a run that was given no mean/std; it now continues with
    the statistics the weights were trained with, and says so."""
    from ds_seg.engine import checkpoint
    code, lines, _, out, tmp = outcomes['_resume_recomputed_stats']
    assert code == 0, lines
    assert 'differ from those' in out and "continuing with the checkpoint's" in out
    root = os.path.join(tmp, 'trained6', 'checkpoints')
    first, last = (checkpoint.read_marker(os.path.join(root, t))['data'] for t in ('step_00000024', 'step_00000026'))
    assert last['mean'] == first['mean'] and last['std'] == first['std']


def test_resuming_a_finished_run_keeps_its_summary(outcomes):
    """--resume auto of a run at train.max_steps (a requeued or re-submitted job) rewrote
    summary.json with mIoU/OA/mF1 and state_memory null."""
    code, lines, _, out, tmp = outcomes['_resume_finished']
    assert code == 0, lines
    assert 'already at step 26 = train.max_steps: nothing to train; summary.json kept' in out
    with open(os.path.join(tmp, 'trained6', 'summary.json')) as f:
        assert json.load(f) == outcomes['_summary_at_26']
    assert outcomes['_summary_at_26']['exit_reason'] == 'completed'
    # The resumed segment (24 -> 26) measured the state and reports it, not null.
    assert outcomes['_summary_at_26']['state_memory']['num_params'] > 0


@pytest.mark.parametrize('case', sorted(EXPECTED))
def test_bad_input_stops_with_one_line_naming_it(outcomes, case):
    code, lines, work_dir_exists = outcomes[case][:3]
    assert not work_dir_exists, 'a refused run left the work dir it created behind'
    assert code == 2, lines
    errors = [line for line in lines if line.startswith('ds_seg: error:')]
    assert len(errors) == 1 and not any('Traceback' in line for line in lines), lines
    for fragment in EXPECTED[case]:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize('case', ['crop_past_memory', 'activations_past_memory', 'micro_batch_past_memory'])
def test_the_benchmarks_size_search_reads_the_memory_refusals_as_not_fitting(outcomes, case):
    """The trainer's own lines, not copies: reworded, the benchmark's search would call them errors."""
    from ds_seg.cli.benchmark import _is_oom
    errors = [line for line in outcomes[case][1] if line.startswith('ds_seg: error:')]
    assert errors and _is_oom(errors[0]), errors
    assert not _is_oom(next(line for line in outcomes['backbone_typo'][1] if line.startswith('ds_seg: error:')))
