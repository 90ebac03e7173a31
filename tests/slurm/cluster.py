"""A real Slurm cluster on this machine for the sbatch-template tests (shared/notes/slurm.md).

Debian's slurm-wlm and munge: one controller and four node daemons (``slurmd -N n1`` ... ``n4``)
on this host, so the multi-node template runs over two Slurm nodes, and preemption has nodes of
its own. Needs root (CI runs as root). ``start()`` returns a :class:`Cluster` that stops only the
daemons it started; a cluster that already answers is used as it is and left running.

    python -m tests.slurm.cluster start | stop     # by hand, for debugging a template
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

NODES = ('n1', 'n2', 'n3', 'n4')
# n1, n2: partition 'debug', whose jobs are never preempted. n3, n4: partition 'preemptible', whose
# jobs a job of partition 'urgent' (higher PriorityTier, same nodes) preempts: SIGTERM to the job
# steps' tasks, GRACE_TIME_S to stop, then Slurm's kill sequence (SIGTERM, KillWait, SIGKILL) and
# a requeue.
GRACE_TIME_S = 10
CPUS_PER_NODE = 8      # claimed (SlurmdParameters=config_overrides): the test jobs all run at once
SPOOL = '/var/spool/slurm-ds_seg'
CONF_DIR = '/etc/slurm'
PIDS = {'munged': '/run/munge/munged.pid', 'slurmctld': '/run/slurmctld-ds_seg.pid',
        **{n: f'/run/slurmd-{n}.pid' for n in NODES}}
# A requeued job may start again only once the credentials of its previous run have expired: Slurm
# sets its begin time `cred_expire` (default 120 s) ahead. Released earlier, in the same second as
# the requeue, a node daemon still holds the old credential as revoked and kills the new start
# ("Job credential revoked", the job ends FAILED). The test cluster shortens the lifetime instead.


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be started here (not installed, not root, daemons fail)."""


def _conf(host):
    nodes = '\n'.join(f'NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={17001 + i} '
                      f'CPUs={CPUS_PER_NODE} RealMemory=8000 State=UNKNOWN' for i, n in enumerate(NODES))
    return f"""# written by ds_seg's tests/slurm/cluster.py
ClusterName=dsseg
SlurmctldHost={host}
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation={SPOOL}/ctld
SlurmdSpoolDir={SPOOL}/d-%n
SlurmctldPidFile={PIDS['slurmctld']}
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile={SPOOL}/slurmctld.log
SlurmdLogFile={SPOOL}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
MpiDefault=none
KillWait=30
MinJobAge=600
{nodes}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF
PartitionName=preemptible Nodes=n3,n4 MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_TIME_S}
PartitionName=urgent Nodes=n3,n4 MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def _run(*cmd, timeout=30, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


def answers():
    """Whether a controller answers and both test nodes are usable."""
    if not shutil.which('sinfo'):
        return False
    try:
        out = _run('sinfo', '-h', '-N', '-o', '%N %t', timeout=10).stdout.split('\n')
    except (subprocess.SubprocessError, OSError):
        return False
    states = dict(line.split() for line in out if line.strip())
    return all(states.get(n, '').rstrip('*') in ('idle', 'mix', 'alloc') for n in NODES)


class Cluster:
    def __init__(self, started):
        self.started = started   # names of the daemons this object started (keys of PIDS)

    def log_tail(self, n=40):
        out = []
        for name in ('slurmctld.log', *(f'slurmd-{x}.log' for x in NODES)):
            path = os.path.join(SPOOL, name)
            if os.path.exists(path):
                with open(path) as f:
                    out.append(f'--- {path}\n' + ''.join(f.readlines()[-n:]))
        return '\n'.join(out)

    def stop(self):
        for name in reversed(self.started):
            try:
                with open(PIDS[name]) as f:
                    pid = int(f.read().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.2)
        self.started = []


def start(timeout=60):
    """Start (or reuse) the test cluster; raises :class:`SlurmUnavailable` with the reason."""
    if answers():
        return Cluster([])
    missing = [b for b in ('slurmctld', 'slurmd', 'sbatch', 'munged') if not shutil.which(b)
               and not os.path.exists(f'/usr/sbin/{b}')]
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        raise SlurmUnavailable('starting slurmctld/slurmd needs root')
    host = socket.gethostname()
    with open('/etc/hosts') as f:
        hosts = f.read()
    missing_names = [n for n in NODES if not any(n in line.split()[1:] for line in hosts.splitlines()
                                                   if line.strip() and not line.startswith('#'))]
    if missing_names:
        with open('/etc/hosts', 'a') as f:
            f.write(''.join(f'127.0.0.1 {n}\n' for n in missing_names))
    for d in (f'{SPOOL}/ctld', *(f'{SPOOL}/d-{n}' for n in NODES)):
        os.makedirs(d, exist_ok=True)
    os.makedirs(CONF_DIR, exist_ok=True)
    conf = os.path.join(CONF_DIR, 'slurm.conf')
    if os.path.exists(conf) and not open(conf).read().startswith("# written by ds_seg's"):
        shutil.copy(conf, conf + '.before-ds_seg')  # someone's own config: keep a copy
    with open(conf, 'w') as f:
        f.write(_conf(host))
    started = []
    cluster = Cluster(started)
    try:
        if subprocess.run(['pgrep', '-x', 'munged'], capture_output=True).returncode != 0:
            os.makedirs('/run/munge', exist_ok=True)
            shutil.chown('/run/munge', 'munge', 'munge')
            if not os.path.exists('/etc/munge/munge.key'):
                _run('/usr/sbin/mungekey', '--create', check=False)
                shutil.chown('/etc/munge/munge.key', 'munge', 'munge')
            _run('su', '-s', '/bin/sh', 'munge', '-c', '/usr/sbin/munged')
            started.append('munged')
        _run('/usr/sbin/slurmctld')
        started.append('slurmctld')
        for n in NODES:
            _run('/usr/sbin/slurmd', '-N', n)
            started.append(n)
        deadline = time.time() + timeout
        while not answers():
            if time.time() > deadline:
                raise SlurmUnavailable('the nodes did not come up:\n' + cluster.log_tail())
            time.sleep(1)
    except (subprocess.SubprocessError, OSError) as exc:
        cluster.stop()
        detail = getattr(exc, 'stderr', '') or ''
        raise SlurmUnavailable(f'cannot start Slurm: {exc} {detail}\n{cluster.log_tail()}') from exc
    except SlurmUnavailable:
        cluster.stop()
        raise
    return cluster


if __name__ == '__main__':
    if sys.argv[1:] == ['start']:
        c = start()
        print('started:', c.started or 'nothing (a cluster already answers)')
    elif sys.argv[1:] == ['stop']:
        Cluster(list(PIDS)).stop()
    else:
        sys.exit(__doc__)
