"""Exported weights files are verified on every load (load_from, predict, evaluate, export): a
byte changed inside a tensor, or a file that is not a torch file at all, is one line naming it."""
import re

import pytest
import torch

from ds_seg.engine.checkpoint import load_weights_file, weights_digest


def _weights(path):
    state = {'conv.weight': torch.arange(4096, dtype=torch.float32).reshape(64, 64),
             'conv.bias': torch.ones(64, dtype=torch.bfloat16), 'bn.num_batches_tracked': torch.tensor(3)}
    torch.save({'state_dict': state, 'model': {'type': 'UNetTiny'}, 'classes': ['a', 'b'],
                'sha256': weights_digest(state)}, path)
    return state


def test_a_byte_changed_inside_a_tensor_is_refused(tmp_path):
    path = tmp_path / 'w.pt'
    state = _weights(path)
    assert load_weights_file(str(path))['state_dict'].keys() == state.keys()
    data = bytearray(path.read_bytes())
    raw = state['conv.weight'].numpy().tobytes()
    at = data.find(raw)
    assert at > 0
    data[at + len(raw) // 2] ^= 0x01  # same size, one bit of one weight: torch.load notices nothing
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r'w.pt: the weights do not match the SHA-256 recorded at export'):
        load_weights_file(str(path))


def test_a_weights_file_named_safetensors_loads_as_its_bytes_say(tmp_path):
    """torch.load reads a path ending in .safetensors with safetensors: a weights file named so
    (export accepted the name) was a SafetensorError traceback in load_from, predict and evaluate."""
    state = _weights(tmp_path / 'w.safetensors')
    assert load_weights_file(str(tmp_path / 'w.safetensors'))['state_dict'].keys() == state.keys()


def test_files_written_without_a_digest_still_load(tmp_path):
    torch.save({'state_dict': {'w': torch.zeros(2)}}, tmp_path / 'old.pt')
    assert load_weights_file(str(tmp_path / 'old.pt'))['state_dict']['w'].shape == (2,)


@pytest.mark.parametrize('content, kind', [(b'{"train_micro_batch_size_per_gpu": 2}', 'a text file'),
                                           (b'II*\x00' + bytes(100), 'a TIFF raster'), (b'', 'empty (0 bytes)')])
def test_a_file_that_is_not_a_torch_file_is_named_as_such(tmp_path, content, kind):
    path = tmp_path / 'x.pt'
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f'x.pt: is {kind}, not a weights file')):
        load_weights_file(str(path))


def test_a_torch_export_program_is_named_as_such_not_as_a_damaged_file(tmp_path):
    """export.py --format torch-export writes a zip too: given to predict/evaluate/load_from it was
    called "not a readable weights file (truncated...)... your checkpoint file is corrupted"."""
    from ds_seg.inference import load_model
    program = torch.export.export(torch.nn.Conv2d(3, 2, 1), (torch.randn(1, 3, 8, 8),))
    path = str(tmp_path / 'model.pt2')
    torch.export.save(program, path)
    for load in (load_weights_file, load_model):
        with pytest.raises(ValueError, match=r'model\.pt2:? is a torch\.export program .*give the weights file') as info:
            load(path)
        assert 'corrupt' not in str(info.value) and 'truncated' not in str(info.value)


@pytest.mark.parametrize('classes, said', [
    (['a', 'b', 'c', 'd'], None),
    (['b', 'a', 'c', 'd'], "its classes (a, b, c, d) are not this run's (b, a, c, d): output channel i keeps the "
                           "file's class i; give data.train.classes in the file's order to keep their meaning"),
    (['w', 'x', 'y', 'z'], "its classes (a, b, c, d) are not this run's (w, x, y, z): output channel i keeps the "
                           "file's class i"),
])
def test_load_from_says_when_as_many_classes_are_named_or_ordered_otherwise(tmp_path, classes, said):
    """Only a class count that differs was said (the classifier then starts fresh): the file's
    'grass' channel became the run's 'road' without a word when the same names came in another order."""
    from types import SimpleNamespace

    from ds_seg.engine.trainer import Trainer
    from ds_seg.registry import MODELS, build
    cfg = dict(type='UNetTiny', in_channels=3, num_classes=4)
    state = build(MODELS, cfg).state_dict()
    path = str(tmp_path / 'w.pt')
    torch.save({'state_dict': state, 'model': cfg, 'classes': ['a', 'b', 'c', 'd'],
                'sha256': weights_digest(state)}, path)
    printed = []
    fake = SimpleNamespace(spec=SimpleNamespace(backend='ddp'), cfg=SimpleNamespace(model=SimpleNamespace(
        type='UNetTiny')), train_set=SimpleNamespace(num_classes=4, classes=classes), print=printed.append)
    model = build(MODELS, cfg)
    Trainer._load_weights(fake, model, path)
    assert printed == [f'loaded weights from {path}' + (f'; {said}' if said else '')]
    assert all(torch.equal(p, state[n]) for n, p in model.state_dict().items())
