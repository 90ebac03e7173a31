"""Behaviour of every UNet registered in MODELS: shapes, band counts, gradients, checkpointing."""
import pytest
import torch
from torch import nn

import ds_seg  # noqa: F401  (registers everything)
from ds_seg.models import UNet
from ds_seg.registry import MODELS, build

# The registered UNets; the full-size one is shrunk so every test runs in milliseconds.
UNET_NAMES = sorted(n for n, m in MODELS.module_dict.items() if m.__module__ == 'ds_seg.models.unet')
SMALL = {'UNet': dict(base_channels=8, depth=3)}


def make(name, **kwargs):
    torch.manual_seed(0)
    return build(MODELS, dict(type=name, **SMALL.get(name, {}), **kwargs))


def test_registry_has_unets():
    assert {'UNet', 'UNetTiny'} <= set(UNET_NAMES)


def test_unet_parameter_count_matches_milesial_reference():
    # milesial/Pytorch-UNet, UNet(n_channels=3, n_classes=2, bilinear=False): 31,037,698.
    n = sum(p.numel() for p in UNet(in_channels=3, num_classes=2).parameters())
    assert abs(n - 31.04e6) / 31.04e6 < 0.01
    assert n == 31_037_698


@pytest.mark.parametrize('name', UNET_NAMES)
@pytest.mark.parametrize('bilinear', [False, True])
@pytest.mark.parametrize('size', [(64, 64), (70, 90), (33, 47), (1, 1), (5, 300)])
def test_output_is_logits_at_input_resolution(name, bilinear, size):
    model = make(name, num_classes=5, bilinear=bilinear).eval()
    with torch.no_grad():
        logits_BKHW = model(torch.randn(2, 3, *size))
    assert logits_BKHW.shape == (2, 5, *size)
    assert torch.isfinite(logits_BKHW).all()


@pytest.mark.parametrize('name', UNET_NAMES)
@pytest.mark.parametrize('in_channels', [1, 3, 4, 13])
def test_any_band_count_trains(name, in_channels):
    model = make(name, in_channels=in_channels, num_classes=6).train()
    images_BCHW = torch.randn(2, in_channels, 64, 64)
    labels_BHW = torch.randint(0, 6, (2, 64, 64))
    loss = nn.functional.cross_entropy(model(images_BCHW), labels_BHW)
    loss.backward()
    # Every parameter takes part in the loss (no dead branch).
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


def _train_step(model, images_BCHW, labels_BHW):
    loss = nn.functional.cross_entropy(model(images_BCHW), labels_BHW)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize('name', UNET_NAMES)
@pytest.mark.parametrize('bilinear', [False, True])
def test_activation_checkpointing_changes_nothing_but_memory(name, bilinear):
    plain = make(name, bilinear=bilinear).train()
    ckpt = make(name, bilinear=bilinear, activation_checkpointing=True).train()
    ckpt.load_state_dict(plain.state_dict())
    images_BCHW = torch.randn(2, 3, 70, 90)
    labels_BHW = torch.randint(0, 6, (2, 70, 90))

    buffer_ptrs = [b.data_ptr() for b in ckpt.buffers()]
    # Two steps, so a second running-stat update during recomputation would show.
    for _ in range(2):
        loss_plain, grads_plain = _train_step(plain, images_BCHW, labels_BHW)
        loss_ckpt, grads_ckpt = _train_step(ckpt, images_BCHW, labels_BHW)
        torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
        for n in grads_plain:
            torch.testing.assert_close(grads_ckpt[n], grads_plain[n], rtol=1e-6, atol=1e-7, msg=n)

    buffers_plain = dict(plain.named_buffers())
    for n, b in ckpt.named_buffers():
        torch.testing.assert_close(b, buffers_plain[n], rtol=0, atol=0, msg=n)
    assert all(b.item() == 2 for n, b in ckpt.named_buffers() if n.endswith('num_batches_tracked'))
    # The recomputation swaps scratch buffers in; the module must hold its own ones again.
    assert [b.data_ptr() for b in ckpt.buffers()] == buffer_ptrs


def test_checkpointing_wraps_every_block_only_when_training_with_grad(monkeypatch):
    import ds_seg.models.unet as unet
    calls = []

    def counting_checkpoint(block, *args, **kwargs):
        calls.append(block)
        return torch.utils.checkpoint.checkpoint(block, *args, **kwargs)

    monkeypatch.setattr(unet, 'checkpoint', counting_checkpoint)
    model = make('UNetTiny', activation_checkpointing=True)  # depth 3
    images_BCHW = torch.randn(1, 3, 32, 32)

    model.train()(images_BCHW)
    assert len(calls) == 1 + 3 + 3  # stem, 3 down blocks, 3 up blocks
    calls.clear()
    with torch.no_grad():
        model(images_BCHW)
    model.eval()(images_BCHW)
    assert calls == []


def test_unknown_argument_names_the_accepted_ones():
    with pytest.raises(KeyError, match='base_channels'):
        build(MODELS, dict(type='UNet', base_channel=8))


@pytest.mark.parametrize('cfg, message', [
    # 'False' is a non-empty string: checkpointing was turned on without a word.
    (dict(type='UNetTiny', activation_checkpointing='False'),
     r"^model\.activation_checkpointing: 'False' is a string, which is always true; write True or False"),
    (dict(type='UperNetTiny', aux_head='no'), r"^model\.aux_head: 'no' is a string"),
    # "'int' object is not iterable" from inside the pretrained loader.
    (dict(type='UperNet', backbone='resnet18', pretrained=1), r"^model\.pretrained: write True or False, got 1\.$"),
    # An unset variable in a config: trained from random weights without a word.
    (dict(type='UperNet', backbone='resnet18', pretrained=''), r"^model\.pretrained is an empty string, which loads "
                                                               r"nothing"),
    # Python's own words from inside the class: 'not all arguments converted during string formatting'.
    (dict(type='UNet', base_channels='16'), r"^model\.base_channels: '16' is a string, not a number"),
    # A count as a fraction or a bool: nn.Conv2d's "empty() received an invalid combination" traceback.
    (dict(type='UNet', base_channels=16.5), r"^model\.base_channels: write a whole number, got 16\.5\.$"),
    (dict(type='UNetTiny', num_classes=True), r"^model\.num_classes: write a whole number, got True\.$"),
    # 'bernoulli_ expects p to be in [0, 1]' at the first step, after training had started.
    (dict(type='SegFormer', variant='mit_b0', drop_path_rate=1.5),
     r'^model\.drop_path_rate is a probability, between 0 and 1; got 1\.5\.$'),
    (dict(type='UperNet', backbone='resnet18', backbone_kwargs=dict(drop_rate=-0.1)),
     r'^model\.backbone_kwargs\.drop_rate is a probability'),
    (dict(type='UperNetTiny', aux_head=dict(type='FCNHead', in_index=2, dropout=2)),
     r'^model\.aux_head\.dropout is a probability'),
    # Taken as it came: -1 ascended the aux loss, 1e999 trained on an inf loss, '0.4' a string.
    (dict(type='UperNetTiny', aux_head=dict(type='FCNHead', in_index=2, loss_weight=-1.0)),
     r'model\.aux_head loss_weight must be a number >= 0, got -1\.0'),
    (dict(type='UperNetTiny', aux_head=dict(type='FCNHead', in_index=2, loss_weight=float('inf'))),
     r'model\.aux_head loss_weight must be a number >= 0, got inf'),
    (dict(type='UperNetTiny', aux_head=dict(type='FCNHead', in_index=2, loss_weight='0.4')),
     r"model\.aux_head loss_weight must be a number >= 0, got '0\.4'"),
    # difflib's "'int' object is not iterable" traceback; a non-string argument name likewise.
    (dict(type=3), r"^model\.type: a registered model name \(a string such as '.*'\), got 3$"),
    ({'type': 'UNetTiny', 1: 2}, r"^model: argument names are strings, got 1$"),
    # ZeroDivisionError in TemporalSegmentor.
    (dict(type='TinyTemporalSegFormer', num_dates=0), r'^model\.num_dates must be a whole number of at least 1'),
    # torch's RuntimeError 'Trying to create tensor with negative dimension', a traceback (0 was refused).
    (dict(type='UNet', base_channels=-4), r'^model \(UNet\): cannot be built with base_channels=-4: .*negative'),
    (dict(type='FPN', backbone='resnet18', channels=-1), r'^model\.decode_head \(FPNHead\): cannot be built with channels=-1: .*negative'),
])
def test_values_of_the_wrong_type_or_range_are_one_line_before_anything_is_built(cfg, message):
    from ds_seg.config import ConfigError
    from ds_seg.registry import RegistryError
    with pytest.raises((ConfigError, RegistryError), match=message):
        build(MODELS, cfg, where='model')


def test_flags_and_paths_that_are_strings_still_build(tmp_path):
    """What the checks must let through: a pretrained path (the default is False), booleans,
    numbers for float arguments, and drop rates at the ends of [0, 1]."""
    build(MODELS, dict(type='UNet', base_channels=8, depth=3, bilinear=True, activation_checkpointing=False))
    build(MODELS, dict(type='SegFormer', variant='mit_b0', drop_path_rate=0, aux_head=True), where='model')
    build(MODELS, dict(type='UperNet', backbone='resnet18', channels=16, backbone_kwargs=dict(drop_rate=1.0)))
    with pytest.raises(FileNotFoundError, match=r'^resnet18 pretrained: .*missing\.pth does not exist'):
        build(MODELS, dict(type='UperNet', backbone='resnet18', pretrained=str(tmp_path / 'missing.pth')),
              where='model')


def test_a_count_of_the_model_given_as_text_is_named_before_it_is_compared_with_the_data():
    """model.num_classes='6' on 6-class data: "model.num_classes is 6 but data.train has 6 classes;
    set model.num_classes=6", the value the user had given."""
    from types import SimpleNamespace

    from mmengine.config import ConfigDict

    from ds_seg.config import ConfigError
    from ds_seg.engine.trainer import Trainer
    fake = SimpleNamespace(cfg=ConfigDict(model=dict(type='UNetTiny', in_channels=3, num_classes='6')),
                           train_set=SimpleNamespace(in_channels=3, num_classes=6), val_set=None, print=print)
    with pytest.raises(ConfigError, match=r"^model\.num_classes: '6' is a string, not a number; write it without "
                                          r"quotes\.$"):
        Trainer._check_model_matches_data(fake)


@pytest.mark.parametrize('kw, message', [
    (dict(reduce_zero_label='False'), r"^data\.train\.reduce_zero_label: 'False' is a string, which is always true"),
    (dict(crop_size='64'), r"^data\.train\.crop_size: '64' is a string, not a number"),
    (dict(seed=1.5), r"^data\.train\.seed: write a whole number, got 1\.5\.$"),
    # A list, number or None as the split was an AttributeError traceback from the scene writer.
    (dict(split=['train']), r"SyntheticAerial split must be a name, 'train' or 'val' .*, got \['train'\]"),
    (dict(split=None), r"SyntheticAerial split must be a name, 'train' or 'val' .*, got None"),
    # README's data.train.images=a.tif,b.tif on the default dataset: "got multiple values for 'images'".
    (dict(images=['a.tif', 'b.tif']), r"SyntheticAerial generates its own scenes and takes no images; for your "
                                      r"files set type='GeoTiffScenes'"),
])
def test_dataset_values_are_checked_like_the_models(tmp_path, kw, message):
    """The same class as the model's flags: a dataset's reduce_zero_label='False' turned the shift
    on without a word; crop_size='64' was Python's "unsupported operand type(s) for //"."""
    from ds_seg.config import ConfigError
    from ds_seg.registry import DATASETS
    with pytest.raises(ConfigError, match=message):
        build(DATASETS, dict(dict(type='SyntheticAerial', split='train', num_scenes=1, scene_size=64,
                                  cache_dir=str(tmp_path)), **kw), where='data.train')


_META_BUILDS = r'''
import glob, os, sys, torch
import ds_seg
from ds_seg.config import load_config
from ds_seg.models.common import meta_device
from ds_seg.models.pretrained import without_pretrained
from ds_seg.registry import MODELS, build
assert 'timm' not in sys.modules, 'ds_seg imported timm'
paths = sorted(glob.glob(os.path.join(sys.argv[1], '*.py')))
for path in sorted(paths, key=lambda p: not p.endswith('unet_tiny_synthetic.py')):   # timm-free first
    cfg = load_config(path).model
    with meta_device():
        model = build(MODELS, without_pretrained(cfg), where='model')
    devices = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    print(os.path.basename(path), sorted(devices), 'timm' in sys.modules)
import timm
meta = [f'{name}.{key}' for name, module in list(sys.modules.items()) if name.startswith('timm')
        for key, value in vars(module).items() if isinstance(value, torch.Tensor) and value.is_meta]
print('timm meta constants', meta)
print('real build', next(timm.create_model('resnet18').parameters()).device.type)
'''


def test_every_shipped_model_builds_on_the_meta_device_in_a_fresh_process():
    """The meta device builds every shipped config's model (the checks before training use it and
    skip themselves where it fails), with timm first imported under it: meta_device no longer
    imports timm for every model (1-2 s of each rank's start), so none of timm's module constants
    may be left on the meta device, and a later real build is on the CPU."""
    import glob
    import os
    import subprocess
    import sys
    from ds_seg.config import REPO_ROOT
    configs = os.path.join(REPO_ROOT, 'configs')
    done = subprocess.run([sys.executable, '-c', _META_BUILDS, configs], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.endswith((' True', ' False'))]
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(configs, '*.py')))
    assert sorted(row[0] for row in rows) == names
    assert all(row[1] == "['meta']" for row in rows), rows
    # UNetTiny imported no timm; the next model, a timm backbone, imported it under the meta device.
    assert rows[0] == ['unet_tiny_synthetic.py', "['meta']", 'False'] and rows[1][-1] == 'True', rows
    assert "timm meta constants []" in done.stdout and 'real build cpu' in done.stdout, done.stdout[-2000:]
