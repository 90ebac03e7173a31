"""MASTER_ADDR from a Slurm node list: every rank of a job must pick the same first host, with
or without scontrol on the PATH. Expected hosts are Slurm's own expansion (checked against
`scontrol show hostnames` 23.x), hard-coded, not derived from the code under test."""
import shutil

import pytest

from ds_seg.distributed import setup_env

# nodelist -> the first host Slurm expands it to
NODELISTS = {
    'node[03-05,07]': 'node03',
    'a[1-2],b3': 'a1',
    'node07': 'node07',
    'n1,n2': 'n1',
    'x[9,10]': 'x9',
    'gpu-a100-[001-004]': 'gpu-a100-001',
    'r1n[2-3],r2n1': 'r1n2',
    'node[0-1]-[2-3]': 'node0-2',   # two bracket groups: the first of each
    'c[7]': 'c7',
}


def _slurm_env(nodelist):
    return {'SLURM_PROCID': '1', 'SLURM_STEP_ID': '0', 'SLURM_LOCALID': '1', 'SLURM_NTASKS': '4', 'SLURM_JOB_ID': '123456',
            'SLURM_JOB_NODELIST': nodelist}


@pytest.mark.parametrize('with_scontrol', [False, True], ids=['fallback-parser', 'scontrol'])
@pytest.mark.parametrize('nodelist', list(NODELISTS))
def test_master_addr_is_the_first_host_of_the_slurm_nodelist(nodelist, with_scontrol, tmp_path, monkeypatch):
    if with_scontrol and not shutil.which('scontrol'):
        pytest.skip('no scontrol on this machine')
    if not with_scontrol:
        monkeypatch.setenv('PATH', str(tmp_path))  # an empty folder: no scontrol, the built-in parser
    env = _slurm_env(nodelist)
    assert setup_env(env) == 'slurm'
    assert env['MASTER_ADDR'] == NODELISTS[nodelist]
    assert (env['RANK'], env['WORLD_SIZE'], env['LOCAL_RANK']) == ('1', '4', '1')
    assert env['MASTER_PORT'] == str(15000 + 123456 % 20000)  # every task derives the same port


def test_explicit_master_addr_and_port_win_over_the_nodelist(tmp_path, monkeypatch):
    monkeypatch.setenv('PATH', str(tmp_path))
    env = dict(_slurm_env('node[03-05]'), MASTER_ADDR='10.0.0.7', MASTER_PORT='29500')
    setup_env(env)
    assert (env['MASTER_ADDR'], env['MASTER_PORT']) == ('10.0.0.7', '29500')
