"""Fixtures for every test."""
import os

import pytest

# What ds_seg.distributed.setup_env writes into os.environ when a test builds a Trainer or runs a
# program in the pytest process.
_LAUNCHER_VARS = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')


@pytest.fixture(autouse=True)
def _launcher_environment_restored():
    """A test's rank variables do not outlive it: a later test's subprocess inherited MASTER_PORT
    of a port this process still held, and its run failed to meet itself (EADDRINUSE)."""
    before = {name: os.environ.get(name) for name in _LAUNCHER_VARS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# The README's test command runs two pytest workers (pytest-xdist, `-n 2`). Every test under these
# folders starts ranks, launchers or Slurm jobs that use both cores of the 2-core CI machine: they
# stay together on one worker, one after another as in a serial run (two 2-rank runs side by side
# ran slower than in turn, and their timing-bound steps got closer to their limits). The other
# worker runs the in-process tests, one core each, beside them: those fill the cores the
# multi-process tests leave idle while they wait on starts, signals and Slurm.
_ONE_AT_A_TIME = {'distributed', 'slurm', 'gpu'}


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist, which may not be installed
def pytest_xdist_make_scheduler(config, log):
    """xdist's own `--dist loadgroup` reads xdist_group marks by renaming test ids, which pytest 9.2
    no longer allows (every test ran ungrouped); this groups by folder, in xdist's public API."""
    if config.getvalue('dist') != 'load':   # the default of -n; another --dist is the user's choice
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneAtATimeByFolder(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            folders = nodeid.split('::', 1)[0].split('/')[:2]
            return 'one_at_a_time' if _ONE_AT_A_TIME & set(folders) else nodeid

    return OneAtATimeByFolder(config, log)
