"""Rank variables that cannot describe this process are one line before any rendezvous: a
stale RANK/WORLD_SIZE of another job, a typo, a missing MASTER_ADDR, a port in use."""
import os
import socket

import pytest

from ds_seg import distributed
from ds_seg.config import ConfigError


@pytest.mark.parametrize('env, message', [
    (dict(RANK='3', WORLD_SIZE='2'), r'RANK=3 with WORLD_SIZE=2; a rank must be below the world size'),
    (dict(RANK='0', WORLD_SIZE='abc'), r"WORLD_SIZE='abc' is not a non-negative integer"),
    (dict(RANK='0', WORLD_SIZE='1', LOCAL_RANK='-1'), r"LOCAL_RANK='-1' is not a non-negative integer"),
    (dict(RANK='0', WORLD_SIZE='2'), r'WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT not set'),
    (dict(SLURM_PROCID='2', SLURM_NTASKS='2', SLURM_STEP_ID='0', SLURM_JOB_NODELIST='n1'), r'\(slurm\): RANK=2 with WORLD_SIZE=2'),
])
def test_stale_or_broken_rank_variables_are_one_line(env, message):
    with pytest.raises(ConfigError, match=message):
        distributed.setup_env(dict(env))


def test_one_process_with_rank_variables_but_no_master_gets_a_local_one():
    env = dict(RANK='0', WORLD_SIZE='1', LOCAL_RANK='5')
    assert distributed.setup_env(env) == 'deepspeed'
    assert env['MASTER_ADDR'] == '127.0.0.1' and env['MASTER_PORT'].isdigit()


def test_a_master_port_in_use_is_one_line(monkeypatch):
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        for name in ('TORCHELASTIC_RUN_ID', 'DS_SEG_INIT_METHOD'):
            monkeypatch.delenv(name, raising=False)
        for name, value in (('RANK', '0'), ('WORLD_SIZE', '1'), ('LOCAL_RANK', '0')):  # restored afterwards
            monkeypatch.setenv(name, value)
        monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
        monkeypatch.setenv('MASTER_PORT', str(port))
        try:
            with pytest.raises(ConfigError, match=rf'rank 0 of 1 could not meet the others at 127.0.0.1:{port}'):
                distributed.init(use_deepspeed=False, timeout_s=20)
        finally:
            distributed.close()


def test_a_batch_scripts_own_python_is_one_process_not_rank_0_of_the_allocation(capsys):
    """The batch step has SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but no job step (srun's
    tasks have SLURM_STEP_ID, checked on a real Slurm 22.05): `python launch/train.py` in an sbatch
    script of --ntasks=4 waited 600 s for 3 ranks nobody started, holding SIGTERM meanwhile."""
    from ds_seg.distributed import setup_env
    env = dict(SLURM_PROCID='0', SLURM_LOCALID='0', SLURM_NTASKS='4', SLURM_JOB_ID='77', SLURM_JOB_NODELIST='n1')
    assert setup_env(env) == 'none'
    assert (env['RANK'], env['WORLD_SIZE']) == ('0', '1')
    assert 'SLURM_NTASKS=4, but this process was not started by srun' in capsys.readouterr().err
    env = dict(SLURM_PROCID='1', SLURM_LOCALID='1', SLURM_NTASKS='4', SLURM_STEP_ID='0', SLURM_JOB_ID='77',
               SLURM_JOB_NODELIST='n1')
    assert setup_env(env) == 'slurm' and (env['RANK'], env['WORLD_SIZE']) == ('1', '4')


@pytest.mark.parametrize('env, named', [
    ({'DS_SEG_DIST_TIMEOUT': 'abc'}, "DS_SEG_DIST_TIMEOUT='abc'"),
    ({'DS_SEG_DIST_TIMEOUT': 'nan'}, "DS_SEG_DIST_TIMEOUT='nan'"),
    ({'DS_SEG_DIST_TIMEOUT': 'inf'}, "DS_SEG_DIST_TIMEOUT='inf'"),
    ({'DS_SEG_DIST_TIMEOUT': '0'}, "DS_SEG_DIST_TIMEOUT='0'"),
    ({'DS_SEG_DIST_TIMEOUT': '-5'}, "DS_SEG_DIST_TIMEOUT='-5'"),
    ({'DS_SEG_DIST_TIMEOUT': '900', 'DEEPSPEED_TIMEOUT': '1.5'}, "DEEPSPEED_TIMEOUT='1.5'"),
    ({'DS_SEG_FAULT': 'sigkill@save-files:abc'}, "DS_SEG_FAULT='sigkill@save-files:abc'"),
    ({'DS_SEG_CPU_FP16': 'yes'}, "DS_SEG_CPU_FP16='yes'"),
    ({'DS_SEG_GPU_MEMORY_GIB': 'four'}, "DS_SEG_GPU_MEMORY_GIB='four'"),
    ({'DS_SEG_GPU_MEMORY_GIB': '0'}, "DS_SEG_GPU_MEMORY_GIB='0'"),
    ({'DS_SEG_GPU_MEMORY_GIB': 'inf'}, "DS_SEG_GPU_MEMORY_GIB='inf'"),
    # A traceback from every rank: torch's int() of the port, or its range check.
    ({'MASTER_PORT': 'abc'}, "MASTER_PORT='abc': give the rendezvous port"),
    ({'MASTER_PORT': '99999'}, "MASTER_PORT='99999'"),
])
def test_environment_variables_ds_seg_reads_are_one_line_before_anything_starts(monkeypatch, capsys, env, named):
    """DS_SEG_DIST_TIMEOUT=abc/nan/inf were tracebacks, 0 and -5 a rendezvous 'timed out after
    -5000ms' that blamed the port; DEEPSPEED_TIMEOUT=abc broke DeepSpeed's import; a bad
    DS_SEG_FAULT was a traceback after the model was built; DS_SEG_CPU_FP16=yes was ignored; a
    MASTER_PORT that is no port was a traceback from every rank."""
    from ds_seg.cli import train
    for key in ('DS_SEG_DIST_TIMEOUT', 'DEEPSPEED_TIMEOUT', 'DS_SEG_FAULT', 'DS_SEG_CPU_FP16', 'DS_SEG_GPU_MEMORY_GIB',
                'MASTER_PORT'):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert train.main(['--cfg-options', 'train.max_steps=1']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f'ds_seg: error: {named}'), err


def test_the_timeout_variables_give_seconds():
    import os
    saved = {k: os.environ.pop(k, None) for k in ('DS_SEG_DIST_TIMEOUT', 'DEEPSPEED_TIMEOUT')}
    try:
        assert distributed.env_timeout_s() == distributed.DEFAULT_TIMEOUT_S
        os.environ['DEEPSPEED_TIMEOUT'] = '15'
        assert distributed.env_timeout_s() == 900
        os.environ['DS_SEG_DIST_TIMEOUT'] = '30.5'
        assert distributed.env_timeout_s() == 30.5
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def test_the_gpu_memory_cap_gives_gib(monkeypatch):
    monkeypatch.delenv('DS_SEG_GPU_MEMORY_GIB', raising=False)
    assert distributed.gpu_memory_gib() is None
    monkeypatch.setenv('DS_SEG_GPU_MEMORY_GIB', '4.5')
    assert distributed.gpu_memory_gib() == 4.5


def test_more_local_ranks_than_visible_gpus_are_refused_and_one_bound_gpu_is_each_ranks_own():
    """LOCAL_RANK modulo the GPU count put local ranks 2 and 0 of a 2-GPU node on one GPU (NCCL's
    "Duplicate GPU detected", after the model was built). One visible GPU stays each rank's own:
    Slurm's --gpus-per-task shows every task its GPU as cuda:0."""
    assert [distributed.cuda_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [distributed.cuda_index(r, 1) for r in range(8)] == [0] * 8
    with pytest.raises(ConfigError, match=r'^LOCAL_RANK=2, but this node shows 2 GPUs \(cuda:0..cuda:1\): start at '
                                          r'most 2 processes per node'):
        distributed.cuda_index(2, 2)


def test_an_installed_console_script_names_the_commands_it_has(monkeypatch):
    """ds-seg-predict --help and its errors said `python launch/predict.py` and `launch/export.py`,
    which a wheel user does not have; after torchrun/deepspeed the module forms run."""
    import sys
    from ds_seg.inputs import as_invoked
    text = ('give a weights file from launch/export.py, or run python launch/predict.py; '
            'python -m ds_seg? launch/data_benchmark.py\n'
            '    torchrun --nproc_per_node 4 launch/predict.py --x\n    deepspeed --num_gpus 2 launch/train.py\n'
            '    python launch/train.py\n'
            'a deepspeed checkpoint but this run uses --backend ddp; export it (launch/export.py)')
    monkeypatch.setattr(sys, 'argv', ['/work/main/launch/predict.py'])
    assert as_invoked(text) == text
    monkeypatch.setattr(sys, 'argv', ['/venv/bin/ds-seg-predict'])
    assert as_invoked(text) == ('give a weights file from ds-seg-export, or run ds-seg-predict; '
                                'python -m ds_seg? python -m ds_seg.cli.data_benchmark\n'
                                '    torchrun --nproc_per_node 4 -m ds_seg.cli.predict --x\n'
                                '    deepspeed --num_gpus 2 --module ds_seg.cli.train\n    ds-seg-train\n'
                                'a deepspeed checkpoint but this run uses --backend ddp; export it (ds-seg-export)')
    # python -m / torchrun -m / deepspeed --module ds_seg.cli.predict: argv[0] is the module's file
    # (they said launch/export.py, which the wheel has not).
    import ds_seg.cli.predict
    monkeypatch.setattr(sys, 'argv', [ds_seg.cli.predict.__file__])
    assert as_invoked(text).startswith('give a weights file from ds-seg-export, or run ds-seg-predict; ')
    monkeypatch.setattr(sys, 'argv', ['/elsewhere/cli/predict.py'])   # a folder of the same name: not ds_seg's
    assert as_invoked(text) == text


def test_the_cache_follows_xdg_cache_home_unless_ds_seg_cache_says(monkeypatch, tmp_path):
    from ds_seg.data.raster import cache_root
    monkeypatch.delenv('DS_SEG_CACHE', raising=False)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    assert cache_root() == str(tmp_path / 'xdg' / 'ds_seg')   # torch.hub's and Hugging Face's rule
    monkeypatch.delenv('XDG_CACHE_HOME')
    assert cache_root() == os.path.join(os.path.expanduser('~'), '.cache', 'ds_seg')
    monkeypatch.setenv('DS_SEG_CACHE', str(tmp_path / 'mine'))
    assert cache_root() == str(tmp_path / 'mine')
