"""The README's `pytest -n 2`: the multi-process tests stay on one worker (tests/conftest.py)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from ds_seg.config import REPO_ROOT


def test_multi_process_folders_run_on_one_worker_and_the_rest_beside_them(tmp_path):
    pytest.importorskip('xdist')
    (tmp_path / 'tests').mkdir()
    shutil.copy(os.path.join(REPO_ROOT, 'tests', 'conftest.py'), tmp_path / 'tests' / 'conftest.py')
    (tmp_path / 'pytest.ini').write_text('[pytest]\ntestpaths = tests\n')
    body = 'import time\nimport pytest\n@pytest.mark.parametrize("i", range(4))\ndef test_x(i):\n    time.sleep(0.2)\n'
    for folder in ('distributed', 'slurm', 'unit'):
        (tmp_path / 'tests' / folder).mkdir()
        (tmp_path / 'tests' / folder / f'test_{folder}.py').write_text(body)
    done = subprocess.run([sys.executable, '-m', 'pytest', '-n', '2', '-v', '-p', 'no:cacheprovider'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    workers = {}
    for worker, folder in re.findall(r'\[(gw\d)\] .*PASSED tests/(\w+)/', done.stdout):
        workers.setdefault(folder, set()).add(worker)
    assert len(workers['distributed'] | workers['slurm']) == 1, workers
    assert workers['unit'] - workers['distributed'], workers   # the other worker ran in-process tests
