"""The package as a user installs it: build the wheel, check what it holds, install it into a fresh
virtual environment, and train, export and list models with the console scripts from a directory
outside the checkout (so nothing can come from the source tree)."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib.util import find_spec

import pytest

from ds_seg.config import REPO_ROOT

pytestmark = pytest.mark.slow

SCRIPTS = ('train', 'predict', 'evaluate', 'export', 'benchmark', 'models')


def _build_wheel(tmp):
    """``pip wheel --no-deps`` of a copy of the checkout (the build leaves no files in the repo)."""
    src = os.path.join(tmp, 'src')
    skip = shutil.ignore_patterns('__pycache__', '*.pyc', '*.egg-info', 'build')
    for name in ('ds_seg', 'configs', 'ds_configs', 'launch/slurm'):
        shutil.copytree(REPO_ROOT / name, os.path.join(src, name), ignore=skip)
    for name in ('setup.py', 'README.md'):
        shutil.copy(REPO_ROOT / name, src)
    # What an earlier build of a checkout leaves behind (git ignores build/): a module since
    # deleted from the source, which setuptools went on packing into every wheel.
    os.makedirs(os.path.join(src, 'build', 'lib', 'ds_seg'))
    with open(os.path.join(src, 'build', 'lib', 'ds_seg', 'deleted_module.py'), 'w') as f:
        f.write('raise ImportError("stale")\n')
    cmd = [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '-q', '-w', os.path.join(tmp, 'dist'), src]
    if find_spec('setuptools'):
        cmd.insert(-1, '--no-build-isolation')  # no download of a build backend when one is here
    subprocess.run(cmd, check=True, timeout=300)
    wheel, = [os.path.join(tmp, 'dist', f) for f in os.listdir(os.path.join(tmp, 'dist'))]
    return wheel


def _fresh_venv(tmp, wheel):
    """A new venv (no pip, no ds_seg) that sees this interpreter's installed dependencies through a
    .pth line -- torch is not downloaded again -- with the wheel installed into it by pip.

    Directories named in a .pth file are not scanned for .pth files themselves, so an editable
    ds_seg installed beside the dependencies stays invisible to the new venv."""
    venv = os.path.join(tmp, 'venv')
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', venv], check=True, timeout=120)
    python = os.path.join(venv, 'bin', 'python')
    site = subprocess.run([python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = {sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']}
    with open(os.path.join(site, 'deps.pth'), 'w') as f:
        f.write('\n'.join(sorted(deps)) + '\n')
    subprocess.run([sys.executable, '-m', 'pip', '--python', python, 'install', '--no-deps', '-q', wheel],
                   check=True, timeout=300)
    return venv


def test_wheel_contents_and_console_scripts_from_a_fresh_venv(tmp_path):
    tmp = str(tmp_path)
    wheel = _build_wheel(tmp)
    names = set(zipfile.ZipFile(wheel).namelist())
    # The engine (issue: no __init__.py left it out), the CLI, and the shipped configs.
    for module in ('engine/__init__.py', 'engine/trainer.py', 'engine/checkpoint.py', 'engine/deepspeed_backend.py',
                   'engine/ddp_backend.py', 'cli/train.py', 'data/loader.py', 'models/unet.py',
                   'configs/unet_tiny_synthetic.py', 'configs/_base_/aerial_recipe.py'):
        assert f'ds_seg/{module}' in names, module
    shipped = sorted(p.name for p in (REPO_ROOT / 'ds_configs').glob('*.json'))
    assert len(shipped) >= 6 and {f'ds_seg/ds_configs/{n}' for n in shipped} <= names
    assert {f'ds_seg/configs/{p.name}' for p in (REPO_ROOT / 'configs').glob('*.py')} <= names
    templates = sorted(p.name for p in (REPO_ROOT / 'launch' / 'slurm').glob('*.sbatch'))
    assert len(templates) == 2 and {f'ds_seg/slurm/{n}' for n in templates} <= names
    assert not [n for n in names if n.startswith(('tests/', 'launch/'))]
    assert 'ds_seg/deleted_module.py' not in names, 'a stale build/ file was packed'
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith('entry_points.txt'))).decode()
    for name in SCRIPTS:
        assert f'ds-seg-{name} = ds_seg.cli.{name}:main' in entry_points

    venv = _fresh_venv(tmp, wheel)
    bin_dir = os.path.join(venv, 'bin')
    outside = os.path.join(tmp, 'elsewhere')  # not the checkout: relative paths cannot reach it
    os.makedirs(outside)
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH' and not k.startswith(('SLURM_', 'RANK'))}
    env.update(OMP_NUM_THREADS='1', PATH=bin_dir + os.pathsep + env.get('PATH', ''),
               DS_SEG_CACHE=os.path.join(tmp, 'cache'))

    def run(*cmd, timeout=300):
        proc = subprocess.run(cmd, cwd=outside, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    where = run(os.path.join(bin_dir, 'python'), '-c', 'import ds_seg; print(ds_seg.__file__)').strip()
    assert where.startswith(venv) and not where.startswith(str(REPO_ROOT)), where
    for name in SCRIPTS:
        assert os.path.isfile(os.path.join(bin_dir, f'ds-seg-{name}')), name

    # Bare shipped names for both configs, a five-step run of a JSON written for 20 warmup steps.
    out = run('ds-seg-train', '--deepspeed_config', 'zero2', '--config', 'unet_tiny_synthetic', '--work-dir', 'run',
              '--cfg-options', 'train.max_steps=5', 'train.eval_interval=0', 'train.checkpoint_interval=5')
    assert 'warming up over 2 step(s) instead' in out, out
    summary = json.load(open(os.path.join(outside, 'run', 'summary.json')))
    assert summary['exit_reason'] == 'completed' and summary['steps'] == 5 and summary['zero_stage'] == 2
    # A path still works (relative to where the user is), and the other console scripts run.
    shutil.copy(REPO_ROOT / 'ds_configs' / 'zero1.json', os.path.join(outside, 'mine.json'))
    out = run('ds-seg-train', '--deepspeed_config', 'mine.json', '--config', 'unet_tiny_synthetic',
              '--work-dir', 'run1', '--cfg-options', 'train.max_steps=2', 'train.eval_interval=0',
              'train.checkpoint_interval=0')
    assert json.load(open(os.path.join(outside, 'run1', 'summary.json')))['zero_stage'] == 1
    out = run('ds-seg-export', 'run', '--out', 'unet.pt')
    assert os.path.isfile(os.path.join(outside, 'unet.pt')), out
    assert 'UNetTiny' in run('ds-seg-models', '--filter', 'UNetTiny', '--size', '64')
    for name in ('predict', 'evaluate', 'benchmark', 'export', 'train', 'models'):
        said = run(f'ds-seg-{name}', '--help')
        # A wheel has no launch/ folder: its commands are named as it has them.
        assert 'usage' in said and 'launch/' not in said, said
    assert '--module ds_seg.cli.train' in run('ds-seg-train', '--help')
    for name in ('data_benchmark', 'predict_benchmark', 'vector_benchmark'):   # no console script
        said = run(os.path.join(bin_dir, 'python'), '-m', f'ds_seg.cli.{name}', '--help')
        assert f'python -m ds_seg.cli.{name}' in said and 'launch/' not in said, said
    # The sbatch templates, which a wheel user has no launch/slurm/ to copy from.
    for option, name in ((['--sbatch-template'], 'train.sbatch'), (['--sbatch-template', 'multinode'],
                                                                    'train_multinode.sbatch')):
        assert run('ds-seg-train', *option) == (REPO_ROOT / 'launch' / 'slurm' / name).read_text()


def test_the_source_distribution_holds_every_tracked_file(tmp_path):
    """MANIFEST.in promises "a checkout minus git"; the sdist left out .ci/run, the command that
    runs the README's tests from scratch. Built from a ``git archive`` of HEAD (what a clean clone
    holds), it must hold every file of HEAD but git's own."""
    if shutil.which('git') is None or not (REPO_ROOT / '.git').exists():
        pytest.skip('needs a git checkout to know the tracked files')
    src = tmp_path / 'src'
    src.mkdir()
    archive = subprocess.run(['git', '-C', str(REPO_ROOT), 'archive', 'HEAD'], check=True, capture_output=True).stdout
    subprocess.run(['tar', '-x', '-C', str(src)], input=archive, check=True)
    tracked = sorted(os.path.relpath(os.path.join(folder, name), src) for folder, _, names in os.walk(src)
                     for name in names if name not in ('.gitignore', '.gitattributes'))
    subprocess.run([sys.executable, 'setup.py', '-q', 'sdist', '-d', str(tmp_path / 'dist')], cwd=src, check=True,
                   capture_output=True, timeout=300)
    sdist, = (tmp_path / 'dist').iterdir()
    with tarfile.open(sdist) as tar:
        held = {name.split('/', 1)[1] for name in tar.getnames() if '/' in name}
    # logs/ too, where the sbatch templates write each job's output (Slurm writes none into a
    # folder that is not there)
    assert 'ds_seg/engine/trainer.py' in tracked and '.ci/run' in tracked and 'logs/.gitkeep' in tracked
    assert [name for name in tracked if name not in held] == []


def test_launch_scripts_run_by_a_python_without_ds_seg_say_so_in_one_line(tmp_path):
    """`python launch/train.py` from a fresh checkout before `pip install -e .`, or under a job's
    bare environment (sbatch --export=NONE), was a ModuleNotFoundError traceback per rank."""
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(tmp_path / 'bare')], check=True)
    python = str(tmp_path / 'bare' / 'bin' / 'python')
    scripts = sorted(p for p in os.listdir(REPO_ROOT / 'launch') if p.endswith('.py') and not p.startswith('_'))
    assert 'train.py' in scripts and len(scripts) >= 9
    for script in scripts:
        proc = subprocess.run([python, str(REPO_ROOT / 'launch' / script), '--help'], cwd=tmp_path,
                              capture_output=True, text=True, env={'PATH': os.environ['PATH']})
        assert proc.returncode == 1 and proc.stdout == '', (script, proc.stdout, proc.stderr)
        # The checkout's ds_seg is found (launch/_checkout.py); what it needs is not.
        assert proc.stderr == (f"[ds_seg] {python} cannot import 'torch': install ds_seg in it "
                               f"(pip install -e . in the checkout) or run the Python it is installed in\n"), script


def test_launch_scripts_run_their_own_checkouts_ds_seg_not_the_installed_one(tmp_path):
    """`python launch/train.py` in a second clone (another branch) ran the ds_seg installed from the
    first, without a word: Python puts launch/, not the checkout, on sys.path."""
    clone = tmp_path / 'clone'
    shutil.copytree(REPO_ROOT / 'launch', clone / 'launch', ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copytree(REPO_ROOT / 'ds_seg', clone / 'ds_seg', ignore=shutil.ignore_patterns('__pycache__'))
    (clone / 'ds_seg' / 'cli' / 'models.py').write_text(
        "import ds_seg\n\ndef main(argv=None):\n    print('models of', ds_seg.__file__)\n    return 0\n")
    proc = subprocess.run([sys.executable, str(clone / 'launch' / 'models.py')], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"models of {clone / 'ds_seg' / '__init__.py'}\n", proc.stderr
