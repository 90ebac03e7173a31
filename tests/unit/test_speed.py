"""The choices that decide GPU speed, made on a device argument (no GPU needed): which Adam runs,
what the run reports it ran, the memory-format default, and the config keys' checks."""
import pytest
import torch

from ds_seg.config import ConfigError, load_config
from ds_seg.engine.ddp_backend import build_optimizer
from ds_seg.engine.speed import channels_last_for, choose_adam_params, optimizer_impl

ADAMW = {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}


def test_cuda_gets_torch_fused_adamw_when_fused_adam_is_not_prebuilt():
    chosen = choose_adam_params(ADAMW, 'cuda:0')
    assert chosen['params'] == {'lr': 1e-3, 'torch_adam': True, 'fused': True}
    assert ADAMW['params'] == {'lr': 1e-3, 'torch_adam': True}  # the JSON's dict is not modified
    # A JSON without torch_adam would make DeepSpeed JIT-build FusedAdam: torch's fused instead.
    assert choose_adam_params({'type': 'Adam', 'params': {'lr': 1e-3}}, torch.device('cuda'))['params'] == {
        'lr': 1e-3, 'torch_adam': True, 'fused': True}


def test_cuda_gets_deepspeed_fused_adam_when_prebuilt():
    assert choose_adam_params(ADAMW, 'cuda', fused_adam_prebuilt=True)['params'] == {'lr': 1e-3}


@pytest.mark.parametrize('cfg, device, offload', [
    (ADAMW, 'cpu', False),                                                   # torch picks on a CPU
    (ADAMW, 'cuda', True),                                                   # the update runs on the CPU
    ({'type': 'AdamW', 'params': {'lr': 1e-3, 'fused': False}}, 'cuda', False),  # the user's choice
    ({'type': 'SGD', 'params': {'lr': 1e-3}}, 'cuda', False),
])
def test_left_as_the_json_says(cfg, device, offload):
    assert choose_adam_params(cfg, device, offload=offload) == cfg


def _params():
    return [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]


def test_ddp_optimizer_on_cpu_reports_torch_default_single_tensor():
    opt = build_optimizer(_params(), ADAMW, torch.device('cpu'))
    assert type(opt) is torch.optim.AdamW and optimizer_impl(opt, 'cpu') == 'torch.AdamW single-tensor'


def test_reported_implementation_follows_the_optimizer():
    assert optimizer_impl(torch.optim.AdamW(_params(), foreach=True), 'cpu') == 'torch.AdamW foreach'
    assert optimizer_impl(torch.optim.AdamW(_params(), fused=True), 'cpu') == 'torch.AdamW fused'  # CPU fused exists
    assert optimizer_impl(torch.optim.SGD(_params(), lr=0.1), 'cpu') == 'torch.SGD single-tensor'
    # A 'fused' key in the JSON reaches torch under DDP, as DeepSpeed passes it with torch_adam.
    fused = build_optimizer(_params(), {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True, 'fused': True}})
    assert optimizer_impl(fused, 'cpu') == 'torch.AdamW fused'


def test_an_optimizer_given_its_parameters_at_step_time_reports_what_torch_will_pick():
    # ZeRO-3 builds its torch optimizer empty and hands it the fp32 partitions at each step;
    # torch then picks from their device: the single-tensor loop on a CPU, not "foreach".
    empty = torch.optim.AdamW([{'params': []}])
    assert optimizer_impl(empty, 'cpu') == 'torch.AdamW single-tensor'


def test_channels_last_default_is_nchw_until_measured_on_a_gpu():
    assert channels_last_for('UNet', None) is False
    assert channels_last_for('UNet', True) is True and channels_last_for('UNet', False) is False


@pytest.mark.parametrize('option, key', [('train.compile=1', 'train.compile'),
                                         ('train.compile_mode=fast', 'train.compile_mode'),
                                         ("train.channels_last='yes'", 'train.channels_last')])
def test_bad_speed_keys_are_one_line_config_errors(option, key):
    with pytest.raises(ConfigError, match=f'{key} must be') as info:
        load_config(None, [option])
    assert '\n' not in str(info.value)



def test_a_compile_mode_without_compile_is_said_not_dropped():
    # It was accepted and the run went uncompiled without a word (summary.json: compile_mode None).
    from ds_seg.config import unused_settings
    assert unused_settings(load_config(None, ['train.compile_mode=max-autotune'])) == [
        "train.compile_mode='max-autotune' is not used: it takes effect only with train.compile=True"]
    # Said at training, not refused: train.compile=False is how a config's compiled run is turned off,
    # and evaluate/predict load a run's config.json that may carry it.
    assert unused_settings(load_config(None, ['train.compile=True', 'train.compile_mode=max-autotune'])) == []
    assert unused_settings(load_config(None, ['train.compile_mode=default'])) == []
