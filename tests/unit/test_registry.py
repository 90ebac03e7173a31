"""The user's modules that register models (custom_imports)."""
import pytest


def test_custom_imports_find_a_module_in_the_folder_of_the_command(tmp_path, monkeypatch):
    """`python -m ds_seg.cli.train` found a project's my_models.py in the folder it ran in (-m puts
    it on sys.path); ds-seg-train, the sbatch template and ds-seg-predict refused it."""
    import sys

    from ds_seg.config import ConfigError
    from ds_seg.registry import import_custom_modules
    (tmp_path / 'ds_seg_test_own_models.py').write_text('LOADED = True\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, 'path', [p for p in sys.path if p not in ('', str(tmp_path))])
    monkeypatch.delitem(sys.modules, 'ds_seg_test_own_models', raising=False)
    import_custom_modules(['ds_seg_test_own_models'])
    assert sys.modules['ds_seg_test_own_models'].LOADED and sys.path[-1] == str(tmp_path)
    with pytest.raises(ConfigError, match=r"^custom_imports: cannot import 'ds_seg_test_nowhere' "):
        import_custom_modules(['ds_seg_test_nowhere'])
    sys.modules.pop('ds_seg_test_own_models', None)


@pytest.mark.parametrize('source, line', [
    ('def build(:\n    pass\n',
     "custom_imports: cannot import 'ds_seg_test_bad': {path}:1: SyntaxError: invalid syntax; fix that line"),
    # A class named as one of ds_seg's: mmengine's KeyError traceback (44 lines) before.
    ('import torch\nfrom ds_seg.registry import MODELS\n\n\n@MODELS.register_module()\n'
     'class UNetTiny(torch.nn.Module):\n    pass\n',
     "custom_imports: 'ds_seg_test_bad' registers a model named UNetTiny, a name ds_seg.models.unet already "
     "registered; give the class another name (or register_module(force=True) to replace that one)"),
    ('WIDTH = 4\nraise RuntimeError("no weights folder")\n',
     "custom_imports: importing 'ds_seg_test_bad' failed at {path}:2 (RuntimeError: no weights folder); "
     "fix the module"),
])
def test_a_module_whose_own_import_fails_is_said_in_one_line(tmp_path, monkeypatch, source, line):
    """A syntax error, a clashing registered name or the module's own error at import: a
    traceback of 40+ lines before, where a module that imports something missing got one line."""
    import sys

    import ds_seg.models  # noqa: F401 -- ds_seg's own models registered, as in every program
    from ds_seg.config import ConfigError
    from ds_seg.registry import MODELS, import_custom_modules
    path = tmp_path / 'ds_seg_test_bad.py'
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, 'ds_seg_test_bad', raising=False)
    with pytest.raises(ConfigError) as refused:
        import_custom_modules(['ds_seg_test_bad'])
    assert str(refused.value) == line.format(path=path)
    assert MODELS.get('UNetTiny').__module__ == 'ds_seg.models.unet'
    sys.modules.pop('ds_seg_test_bad', None)
