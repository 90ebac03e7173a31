"""One run per work dir: a lock file held for the run's lifetime.

Two runs writing into one work dir (two submissions of the same sbatch script, a manual restart
while the job still runs) would interleave their logs and overwrite each other's checkpoints.
The lock is ``<work_dir>/.ds_seg.lock``, created with ``O_CREAT | O_EXCL`` (atomic on local
disks and on the NFS/Lustre/GPFS file systems clusters share), holding the owner's host, PID,
process start time, Slurm job id and restart count.

A lock left by a run that died is taken over only when its owner is provably gone; the rule
can never fire while the owner lives:

* same host: the PID is not running, or runs another process (a different start time);
* same Slurm job with another ``SLURM_RESTART_COUNT``: the previous incarnation of this very
  job, which Slurm ends before it starts the requeued one;
* another host with a Slurm job id: ``squeue`` says that job has no running processes;

the two Slurm rules only for an owner of this job's cluster (``SLURM_CLUSTER_NAME``): clusters
that share a file system share job ids, and one's squeue knows nothing of the other's jobs.

Anything else is refused with one line naming the owner and the file to delete if the user
knows that run is gone.
"""
import contextlib
import json
import os
import socket
import subprocess
import time

LOCK_NAME = '.ds_seg.lock'
# Slurm job states in which the job's processes may still run.
_SLURM_LIVE_STATES = {'RUNNING', 'COMPLETING', 'SUSPENDED', 'STOPPED', 'CONFIGURING', 'SIGNALING',
                      'RESIZING', 'STAGE_OUT', 'REQUEUE_HOLD', 'REQUEUE_FED', 'REQUEUED'}


class WorkDirBusy(Exception):
    """Another live run holds the work dir."""


def _process_start(pid):
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if there is none."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            # The command name (field 2) may contain spaces: split after its closing parenthesis.
            return int(f.read().rsplit(')', 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def identity():
    pid = os.getpid()
    return {'host': socket.gethostname(), 'pid': pid, 'pid_start': _process_start(pid),
            'slurm_job_id': os.environ.get('SLURM_JOB_ID'),
            'slurm_restart_count': os.environ.get('SLURM_RESTART_COUNT', '0'),
            'slurm_cluster': os.environ.get('SLURM_CLUSTER_NAME'),
            'started': time.strftime('%Y-%m-%dT%H:%M:%S%z')}


def _slurm_job_live(job_id):
    """True/False from squeue, or None when Slurm cannot be asked."""
    try:
        out = subprocess.run(['squeue', '-h', '-j', str(job_id), '-o', '%T'], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        # squeue fails with "Invalid job id" once a finished job has left the controller's memory.
        return False if 'invalid job id' in (out.stderr or '').lower() else None
    states = {line.strip() for line in out.stdout.splitlines() if line.strip()}
    return bool(states & _SLURM_LIVE_STATES)


def owner_gone(owner, me=None):
    """True only when the owner recorded in a lock file is provably not running (see module doc)."""
    me = me or identity()
    if owner.get('host') == me['host']:
        pid = owner.get('pid')
        if not isinstance(pid, int) or not _pid_alive(pid):
            return True
        start = _process_start(pid)
        return owner.get('pid_start') is not None and start is not None and start != owner['pid_start']
    job = owner.get('slurm_job_id')
    if job and owner.get('slurm_cluster') != me.get('slurm_cluster'):
        # Another cluster sharing this file system: its job ids are not this cluster's (a live
        # job there is "Invalid job id" to this squeue, or shares this job's id).
        return False
    if job and job == me['slurm_job_id']:
        return str(owner.get('slurm_restart_count', '0')) != str(me['slurm_restart_count'])
    if job:
        return _slurm_job_live(job) is False
    return False


def describe(owner):
    job = f", Slurm job {owner['slurm_job_id']}" if owner.get('slurm_job_id') else ''
    if job and owner.get('slurm_cluster'):
        job += f" of cluster {owner['slurm_cluster']}"
    return f"host {owner.get('host')} pid {owner.get('pid')}{job}, since {owner.get('started')}"


class WorkDirLock:
    """Hold ``<work_dir>/.ds_seg.lock`` for a run's lifetime (rank 0 only).

    Example::

        lock = WorkDirLock('work_dirs/default')
        took_over = lock.acquire()      # raises WorkDirBusy naming the owner
        ...
        lock.release()
    """

    def __init__(self, work_dir):
        self.path = os.path.join(work_dir, LOCK_NAME)
        self.me = None

    def acquire(self):
        """Take the lock; returns the previous owner's description when a dead run's lock was
        taken over, else None. Raises :class:`WorkDirBusy` while another run lives."""
        me = identity()
        if os.path.isdir(self.path):  # (os.remove of a "stale lock" was an IsADirectoryError traceback)
            raise WorkDirBusy(f"{self.path} is a folder, where ds_seg keeps the lock file of the run that holds "
                              f"{os.path.dirname(self.path)}; move it away, or use another --work-dir.")
        unreadable = None  # (the file's (mtime, size), when this process first saw it so)
        for _ in range(200):  # another process may hold the take-over mutex, or win the create
            try:
                created = self._create(me)
            except FileExistsError:
                owner = self._read()
                if owner is None:
                    # Being written right now? (On a network file system another node may see it
                    # empty for a while.) Read again until it has stayed as it is for the grace
                    # time, timed here: the server's mtime against this node's clock can be off
                    # by more than that.
                    seen = self._signature()
                    if unreadable is None or unreadable[0] != seen:
                        unreadable = (seen, time.monotonic())
                    if time.monotonic() - unreadable[1] < self.UNREADABLE_GRACE_S:
                        time.sleep(0.2)
                        continue
                if owner is not None and not owner_gone(owner, me):
                    raise WorkDirBusy(f"{os.path.dirname(self.path)} is in use by another run ({describe(owner)}). "
                                      f"Wait for it, use another --work-dir, or delete {self.path} if that run "
                                      "is certainly gone.")
                # Take-overs one at a time: the stale file is read again and removed while holding a
                # mutex, and only an O_EXCL create makes an owner. Two contenders that both read
                # the stale owner could otherwise each remove what was there (the second removing
                # the first's new, live lock) and both run.
                if not self._take_over(owner, me):
                    time.sleep(0.05)
                continue
            assert created
            self.me = me
            return getattr(self, '_previous', None)
        raise WorkDirBusy(f"{self.path}: could not take the work-dir lock (contended); try again.")

    # A take-over mutex older than this was left by a process that died inside one (a few
    # file operations): it is cleared.
    MUTEX_STALE_S = 30
    # A lock file that holds no owner record is a dead writer's once it has stayed so this long.
    UNREADABLE_GRACE_S = 10

    def _create(self, me):
        """Create the lock file holding ``me``, or raise FileExistsError. The record is written to a
        file of this process's own and hard-linked into place (atomic, as O_EXCL, on local and
        network file systems), so the lock is never seen empty: a contender stalled between an
        O_EXCL create and its write for longer than UNREADABLE_GRACE_S (a loaded node) had its new
        lock taken for a dead writer's, and two runs held one work dir. Where the file system has
        no hard links, an O_EXCL create and a write, as before."""
        own = f"{self.path}.{me['host']}.{me['pid']}.tmp"
        with open(own, 'w') as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(own, self.path)
            return True
        except FileExistsError:
            raise
        except OSError:   # no hard links here (some FUSE and SMB mounts)
            pass
        finally:
            with contextlib.suppress(OSError):
                os.remove(own)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, 'w') as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _signature(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _take_over(self, owner, me):
        """Remove the dead owner's lock file under the take-over mutex; False if another
        contender holds the mutex (try again)."""
        mutex = self.path + '.takeover'
        try:
            os.mkdir(mutex)
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(mutex).st_mtime > self.MUTEX_STALE_S:
                    os.rmdir(mutex)
            return False
        try:
            now = self._read()
            # Still the owner judged gone (or still unreadable), and still gone: remove it. A new
            # lock (another contender's, created while the path was free) is left alone.
            if now == owner and (now is None or owner_gone(now, me)) and os.path.exists(self.path):
                os.remove(self.path)
                self._previous = describe(owner) if owner else 'an unreadable lock'
        finally:
            os.rmdir(mutex)
        return True

    def _read(self):
        """The owner recorded in the lock file, or None where it holds no such record (being
        written, or damaged: '[1, 2]' was an AttributeError traceback)."""
        try:
            with open(self.path) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def release(self):
        """Remove the lock if it is still ours (never another run's)."""
        if self.me is None:
            return
        owner = self._read()
        if owner is not None and owner.get('pid') == self.me['pid'] and owner.get('host') == self.me['host']:
            with contextlib.suppress(OSError):
                os.remove(self.path)
        self.me = None


def check_work_dir_entries(work_dir):
    """Refuse, before any step, an entry of ``work_dir`` a run cannot use: a ``checkpoints`` the
    first save cannot write into: a symbolic link to nothing (scratch purged, a file system not mounted), a file,
    a ``latest`` or ``best`` that is a folder, a folder this process cannot write (found at the first save,
    each cost ``checkpoint_interval`` steps of training, on every requeue of the job); and a
    ``previous`` that is a file."""
    from ..config import ConfigError
    from ..inputs import broken_link_words, check_writable, refuse_inside_checkpoints, refuse_inside_run_logs
    # That run's pruning (train.keep_checkpoints) deleted the step folder this run lived in.
    refuse_inside_checkpoints(work_dir, '--work-dir')
    refuse_inside_run_logs(work_dir)
    root = os.path.join(work_dir, 'checkpoints')
    if os.path.islink(root) and not os.path.exists(root):
        raise ConfigError(f'--work-dir: {broken_link_words(root)}')
    if os.path.lexists(root) and not os.path.isdir(root):
        raise ConfigError(f'--work-dir: {root} is a file, not the folder checkpoints are written into; move it '
                          'away, or choose another --work-dir.')
    from .checkpoint import POINTERS
    for name in POINTERS:  # latest, best (train.save_best): files that name a checkpoint
        pointer = os.path.join(root, name)
        if os.path.isdir(pointer):
            what = 'the newest' if name == 'latest' else 'the best'
            raise ConfigError(f'--work-dir: {pointer} is a folder, where the name of {what} checkpoint is written; '
                              'move it away, or choose another --work-dir.')
    if os.path.isdir(root):
        check_writable(root, '--work-dir')
    # A run writes config.json and ds_config.json into its work dir, and a fresh one moves an
    # earlier run's aside as that run's logs: --work-dir . beside the user's own config.json (the
    # one this run reads) moved it into previous/ as "the logs of an earlier run".
    if not _configs_of_a_run(work_dir):
        for name in ('config.json', 'ds_config.json'):
            path = os.path.join(work_dir, name)
            if os.path.lexists(path):
                raise ConfigError(f'--work-dir: {path} is not one an earlier run wrote (the ds_config.json a run '
                                  f'writes beside it records the run under "ds_seg"), and a run writes its own '
                                  f'{name} there; choose another --work-dir (e.g. work_dirs/NAME), or move it away.')
    previous = os.path.join(work_dir, 'previous')
    if os.path.lexists(previous) and not os.path.isdir(previous):
        # An earlier run's logs are moved into it: a file there was a FileExistsError traceback.
        raise ConfigError(f'--work-dir: {previous} is a file, where the logs of earlier runs are moved to; move it '
                          'away, or choose another --work-dir.')


def _configs_of_a_run(work_dir):
    """Whether ``work_dir``'s ds_config.json is one a run wrote (it records the run under ``ds_seg``)."""
    try:
        with open(os.path.join(work_dir, 'ds_config.json')) as f:
            written = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and isinstance(written.get('ds_seg'), dict)
