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
