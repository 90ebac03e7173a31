"""DDP's fp16 loss scaling follows the JSON's fp16 block as DeepSpeed's fp16 optimizers do."""
import types

import pytest
import torch

from ds_seg.engine.ddp_backend import DeepSpeedLossScale, TorchLossScale


def _deepspeed_scaler(block, monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.precision_config import get_float16_config
    # Its overflow messages ask DeepSpeed's process group for the rank; none is needed here.
    monkeypatch.setattr(loss_scaler, 'dist', types.SimpleNamespace(get_rank=lambda: 0))
    cfg = get_float16_config({'fp16': dict(block, enabled=True)})
    return loss_scaler.CreateLossScaler(torch.half, cfg.loss_scale, cfg.loss_scale == 0, cfg.dynamic_loss_scale_args())


@pytest.mark.parametrize('block', [
    {'loss_scale': 0, 'initial_scale_power': 8, 'loss_scale_window': 3, 'hysteresis': 2, 'min_loss_scale': 16},
    {'loss_scale': 0, 'initial_scale_power': 6, 'loss_scale_window': 2, 'hysteresis': 3,
     'consecutive_hysteresis': True, 'min_loss_scale': 1},
    {'loss_scale': 0, 'initial_scale_power': 12, 'loss_scale_window': 4, 'hysteresis': 1},
    {'loss_scale': 512},
])
def test_the_scale_sequence_is_deepspeeds(block, monkeypatch):
    """torch's GradScaler under DDP doubled a static loss_scale every window (1024 -> 8192 in 6
    steps), had no hysteresis or min_loss_scale, and grew a step before DeepSpeed."""
    theirs, ours = _deepspeed_scaler(block, monkeypatch), DeepSpeedLossScale(block)
    rng = torch.Generator().manual_seed(0)
    overflows = (torch.rand(60, generator=rng) < 0.3).tolist()
    seen = []
    for overflow in overflows:
        assert ours.get_scale() == theirs.cur_scale
        seen.append(ours.get_scale())
        if overflow and theirs.cur_scale == getattr(theirs, 'min_scale', None) and theirs.cur_hysteresis == 1:
            break   # DeepSpeed stops here (an exception); so does ds_seg
        theirs.update_scale(overflow)
        ours.update_scale(overflow)
    assert len(set(seen)) > (1 if block['loss_scale'] == 0 else 0)
    if block['loss_scale']:
        assert set(seen) == {512.0}


def test_a_scale_saved_by_torchs_grad_scaler_resumes():
    ours = DeepSpeedLossScale({'loss_scale': 0, 'initial_scale_power': 16})
    ours.load_state_dict(torch.amp.GradScaler('cpu', init_scale=2.0 ** 9).state_dict())
    assert ours.get_scale() == 512.0
    again = DeepSpeedLossScale({'loss_scale': 0})
    again.load_state_dict(ours.state_dict())
    assert again.state_dict() == ours.state_dict()


def test_a_static_scale_is_the_jsons_and_states_cross_between_the_two_scalers():
    """A GradScaler checkpoint of a static loss_scale held the doubled scale: resumed, it froze the
    drifted value; a DeepSpeedLossScale state given to torch's scaler (fp16 block -> torch_autocast
    on resume) was a KeyError."""
    static = DeepSpeedLossScale({'loss_scale': 128})
    static.load_state_dict(torch.amp.GradScaler('cpu', init_scale=4096.0).state_dict())
    assert static.get_scale() == 128.0
    torch_scale = TorchLossScale(torch.device('cpu'))
    torch_scale.load_state_dict(DeepSpeedLossScale({'loss_scale': 0, 'initial_scale_power': 9}).state_dict())
    assert torch_scale.get_scale() == 512.0
