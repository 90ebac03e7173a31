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
