import os

import pytest

from tests.slurm.cluster import SlurmUnavailable, start


@pytest.fixture(scope='session')
def slurm_cluster():
    """A real Slurm (four nodes) on this machine; skipped with the reason where it cannot start,
    except in CI (CI=true), where .ci/run installs it and these tests must run."""
    try:
        cluster = start()
    except SlurmUnavailable as exc:
        if os.environ.get('CI') == 'true':
            pytest.fail(f'Slurm must run in CI: {exc}')
        pytest.skip(f'no Slurm here: {exc}')
    yield cluster
    cluster.stop()
