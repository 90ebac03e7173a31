"""A mistyped option of any command is one line (prog: error: ...), exit 2, as every other mistake."""
import importlib

import pytest

from tests.tiny import argparse_refusal


@pytest.mark.parametrize('command, argv, said', [
    ('train', ['--backend', 'DDP'], "train.py: error: argument --backend: invalid choice: 'DDP'"),
    ('predict', ['--bogus'], 'predict.py: error: the following arguments are required'),
    ('evaluate', ['--checkpoint'], 'evaluate.py: error: argument --checkpoint: expected one argument'),
    ('export', [], 'export.py: error: the following arguments are required: checkpoint'),
    ('benchmark', ['--bogus'], 'benchmark.py: error: unrecognized arguments: --bogus'),
    ('models', ['--size', 'big'], "models.py: error: argument --size: invalid int value: 'big'"),
])
def test_a_mistyped_option_is_one_line_without_the_usage_block(command, argv, said, capsys, monkeypatch):
    """argparse printed its 7-line usage block before the error, once per rank under torchrun."""
    monkeypatch.setattr('sys.argv', [f'{command}.py'] + argv)   # the program name argparse says
    code, err = argparse_refusal(importlib.import_module(f'ds_seg.cli.{command}').main, argv, capsys)
    assert code == 2 and err.count('\n') == 1 and err.startswith(said), err
