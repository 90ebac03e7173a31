"""A user's own model (custom_imports) that breaks the output contract is refused in one line
before any step and before the work dir is made: a dict without 'logits', logits at another
resolution, an aux output that is not (weight, logits) pairs, only frozen parameters."""
import os
import sys

import pytest

MODULE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from ds_seg.registry import MODELS


class _Base(nn.Module):
    def __init__(self, in_channels=3, num_classes=6):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_classes, 3, padding=1)


@MODELS.register_module()
class ContractDictOut(_Base):
    def forward(self, x):
        return {'out': self.conv(x)}


@MODELS.register_module()
class ContractHalfRes(_Base):
    def forward(self, x):
        return self.conv(x)[:, :, ::2, ::2]


@MODELS.register_module()
class ContractBadAux(_Base):
    def forward(self, x):
        logits = self.conv(x)
        return {'logits': logits, 'aux': [logits]} if self.training else logits


@MODELS.register_module()
class ContractEvalDict(_Base):
    def forward(self, x):
        logits = self.conv(x)
        return logits if self.training else {'logits': logits}


@MODELS.register_module()
class ContractFrozen(_Base):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.requires_grad_(False)

    def forward(self, x):
        return self.conv(x)


@MODELS.register_module()
class ContractSpareHead(_Base):
    """A head the forward never uses: DDP stopped at its second step."""
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.spare = nn.Conv2d(3, 6, 1)

    def forward(self, x):
        return self.conv(x)


@MODELS.register_module()
class ContractGood(_Base):
    """Aux logits as ds_seg's own heads give them: accepted."""
    def forward(self, x):
        logits = self.conv(x)
        aux = F.interpolate(self.conv(x)[:, :, ::2, ::2], size=x.shape[-2:])
        return {'logits': logits, 'aux': [(0.4, aux)]} if self.training else logits
'''


@pytest.fixture(scope='module')
def contract_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp('own_models')
    (folder / 'ds_seg_test_contract.py').write_text(MODULE)
    sys.path.insert(0, str(folder))
    yield 'ds_seg_test_contract'
    sys.path.remove(str(folder))


@pytest.mark.parametrize('model, line', [
    ('ContractDictOut', "model (ContractDictOut): its training forward returns a dict of 'out'; ds_seg takes "
                        "logits [B, num_classes, H, W] (in training also {'logits': ..., 'aux': "
                        "[(weight, logits), ...]})."),
    ('ContractHalfRes', 'model (ContractHalfRes): its training forward returns logits of shape [2, 6, 16, 16] for '
                        '2 crops of 32x32 px; ds_seg takes [B, num_classes=6, H, W] at the input\'s own size '
                        '(upsample the logits to it, F.interpolate).'),
    ('ContractBadAux', "model (ContractBadAux): its 'aux' output in training is a list of 1; give a list of "
                       "(weight, logits) pairs."),
    ('ContractEvalDict', "model (ContractEvalDict): its evaluation forward returns a dict of 'logits'; ds_seg "
                         "takes logits [B, num_classes, H, W] (in training also {'logits': ..., 'aux': "
                         "[(weight, logits), ...]})."),
    ('ContractFrozen', 'model (ContractFrozen): none of its parameters trains; give it parameters with '
                       'requires_grad=True.'),
    ('ContractGood', None),
])
def test_a_model_that_breaks_the_output_contract_is_refused_before_any_step(tmp_path, capsys, contract_module,
                                                                             model, line):
    from ds_seg.cli import train
    work = tmp_path / 'run'
    code = train.main(['--config', 'unet_tiny_synthetic', '--work-dir', str(work), '--cfg-options',
                       f"custom_imports=dict(imports=[{contract_module!r}])", f"model=dict(type={model!r})",
                       'train.max_steps=1', 'data.crop_size=32', 'train.eval_interval=0',
                       'train.checkpoint_interval=0', f'data.train.cache_dir={str(tmp_path)!r}',
                       f'data.val.cache_dir={str(tmp_path)!r}'])
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.startswith('ds_seg: error:')]
    if line is None:
        assert code == 0 and err == [] and os.path.isfile(work / 'summary.json')
    else:
        assert code == 2 and err == [f'ds_seg: error: {line}'] and not work.exists()


@pytest.mark.parametrize('backend', ['ddp', 'deepspeed'])
def test_a_parameter_the_forward_never_uses_trains_under_ddp_as_under_deepspeed(tmp_path, capsys, contract_module,
                                                                               backend):
    """--backend ddp stopped at its second step with DDP's "Expected to have finished reduction in
    the prior iteration ... find_unused_parameters=True" traceback, which ds_seg gave no way to
    pass; DeepSpeed trained the same run. The meta-device check finds the parameters, DDP is told."""
    from ds_seg.cli import train
    work = tmp_path / 'run'
    code = train.main(['--config', 'unet_tiny_synthetic', '--backend', backend, '--work-dir', str(work),
                       '--cfg-options', f"custom_imports=dict(imports=[{contract_module!r}])",
                       "model=dict(type='ContractSpareHead')", 'train.max_steps=3', 'data.crop_size=32',
                       'train.eval_interval=0', 'train.checkpoint_interval=0', f'data.train.cache_dir={str(tmp_path)!r}',
                       f'data.val.cache_dir={str(tmp_path)!r}'])
    out = capsys.readouterr().out
    assert code == 0 and os.path.isfile(work / 'summary.json')
    said = ('model: 2 trained parameter(s) take no part in the loss (spare.weight, spare.bias): DDP looks for them '
            'every step (find_unused_parameters), a little slower')
    assert (said in out) == (backend == 'ddp'), out
