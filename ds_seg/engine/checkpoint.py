"""Checkpoint directory management, auto-resume and export to one plain weights file.

Layout under ``<work_dir>/checkpoints``::

    step_00000100/        one backend checkpoint (DeepSpeed files or ddp_state.pt) + COMPLETE
    step_00000200/
    latest                the tag of the newest complete checkpoint, replaced last

A checkpoint is written under a temporary name (``.tmp-step_...``), every file is checksummed
(SHA-256) into the ``COMPLETE`` marker, files and folders are fsynced, then the folder is renamed,
so a run killed at any moment leaves either a whole checkpoint or none; ``latest`` is replaced
atomically after the rename, and old checkpoints are pruned only after that. Resuming verifies
the checksums and falls back to the previous good checkpoint, saying why.
"""
import contextlib
import errno as errno_codes
import glob
import hashlib
import json
import os
import pickle
import re
import shutil

import torch

from .. import distributed
from ..inputs import TORCH_EXPORT_PROGRAM, is_torch_export_archive, looks_like_onnx
from . import faults

TAG_RE = re.compile(r'^step_(\d{8})$')
COMPLETE = 'COMPLETE'


def tag_for(step):
    return f'step_{step:08d}'


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, read-only, I/O error); the message names the path
    and the errno, and no partial checkpoint is left behind."""


def _files(path):
    return sorted(name for name in os.listdir(path)
                  if os.path.isfile(os.path.join(path, name)) and name != COMPLETE)


def sha256_file(path, chunk=1 << 22):
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(chunk), b''):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path):
    """Flush a file's or a folder's data and metadata to the disk (a rename is only durable
    once the folder holding it is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(root, tag):
    """True if the marker exists and every file it lists is present with its recorded size, so a
    checkpoint with a missing rank file or a truncated file is never resumed from. Cheap (no
    reading of the files); :func:`verify` also compares checksums."""
    path = os.path.join(root, tag)
    try:
        with open(os.path.join(path, COMPLETE)) as f:
            marker = json.load(f)
        expected = marker['files']
        return not _unlisted_state_files(path, expected) and not _lacking_state_files(marker, expected) and \
            _marker_of_another_step(tag, marker) is None and \
            all(os.path.getsize(os.path.join(path, name)) == size for name, size in expected.items())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False


def _unlisted_state_files(path, listed):
    """The state files (:data:`STATE_FILE_RE`) in ``path`` its marker does not list. The
    marker lists every file the save wrote: one edited to drop a damaged file's entry passed the
    checks, and the resume died in DeepSpeed's loader with a traceback."""
    return [name for name in _files(path) if STATE_FILE_RE.search(name) and name not in listed]


def _marker_of_another_step(tag, marker):
    """The step a ``step_*`` folder's marker records where it is not the folder's (else None): two
    folders swapped by hand resumed "from step_00000004 at step 2", and the run's save at step 4
    then replaced the folder that held the only step-2 checkpoint."""
    match = TAG_RE.match(os.path.basename(os.path.normpath(tag)))
    step = marker.get('step')
    return step if match and isinstance(step, int) and step != int(match.group(1)) else None


def _lacking_state_files(marker, listed):
    """What the marker's own record says the save wrote, and its file list lacks, as a phrase (or
    None): a marker edited to drop a file's entry, with the file, passed every check and the resume
    died in DeepSpeed's loader ("[Errno 2] No such file ... optim_states.pt"). A DDP save writes
    ``ddp_state.pt``; DeepSpeed's, a model-states file (one per rank under ZeRO-3) and, under
    ZeRO 1-3 or its native bf16 optimizer, one optimizer-states file per rank."""
    world = marker.get('world_size')
    if not isinstance(world, int) or world < 1:
        return None
    names = [n for n in listed if STATE_FILE_RE.search(n)]
    if marker.get('backend') == 'ddp':
        return None if 'ddp_state.pt' in names else 'its marker lists no ddp_state.pt'
    if marker.get('backend') != 'deepspeed':
        return None
    stage = marker.get('zero_stage') or 0
    models = sum(n.endswith('model_states.pt') for n in names)
    optims = sum(n.endswith('optim_states.pt') for n in names)
    if models < (world if stage == 3 else 1):
        return f'its marker lists {models} model-states file(s), and a ZeRO-{stage} save of {world} rank(s) writes ' \
               f'{world if stage == 3 else 1}'
    if (stage >= 1 or optims) and optims != world:
        return f'its marker lists {optims} optimizer-states file(s), and a save of {world} rank(s) writes {world}'
    return None


# What DeepSpeed (model/optimizer states of each rank) and DDP write into a step folder; a weights
# file a user exported into it (model.pt) is not checkpoint state.
STATE_FILE_RE = re.compile(r'(model_states|optim_states)\.pt$|^ddp_state\.pt$')


def verify(root, tag):
    """None if ``root/tag`` is a whole checkpoint whose files match the sizes and SHA-256 sums
    recorded when it was saved, else the reason it is not (a short phrase)."""
    path = os.path.join(root, tag)
    try:
        with open(os.path.join(path, COMPLETE)) as f:
            marker = json.load(f)
        sizes, sums = marker['files'], marker.get('sha256', {})
        if not isinstance(sizes, dict) or not isinstance(sums, dict):  # ('files': [...] was an AttributeError)
            raise TypeError("'files' and 'sha256' are not mappings of file names")
    except FileNotFoundError:
        return f'no {COMPLETE} marker (killed mid-save?)'
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f'unreadable {COMPLETE} marker ({exc})'
    unlisted = _unlisted_state_files(path, sizes)
    if unlisted:
        return f'{unlisted[0]} is not in its {COMPLETE} marker (an edited marker?)'
    lacking = _lacking_state_files(marker, sizes)
    if lacking:
        return f'{lacking} (an edited marker?)'
    other_step = _marker_of_another_step(tag, marker)
    if other_step is not None:
        return f'its {COMPLETE} marker is of step {other_step} (a folder renamed, swapped or linked by hand?)'
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f'{name} is missing'
        if os.path.getsize(file) != size:
            return f'{name} has {os.path.getsize(file)} bytes, {size} were written'
        if name in sums and sha256_file(file) != sums[name]:
            return f'{name} does not match its recorded SHA-256 (damaged on disk)'
    return None


def complete_tags(root):
    """Complete checkpoint tags, oldest first."""
    if not os.path.isdir(root):
        return []
    tags = [t for t in os.listdir(root) if TAG_RE.match(t) and is_complete(root, t)]
    return sorted(tags)


def find_latest(root):
    """The newest complete checkpoint tag, or None. ``latest`` is a hint, not trusted blindly:
    a newer folder that fails :func:`is_complete` (killed mid-save, truncated, a rank's file
    missing) is skipped in favour of the previous complete one."""
    tags = complete_tags(root)
    return tags[-1] if tags else None


def incomplete_tags(root):
    """``step_*`` folders that are not complete (for the message that says they were skipped)."""
    if not os.path.isdir(root):
        return []
    return sorted(t for t in os.listdir(root) if TAG_RE.match(t) and not is_complete(root, t))


def save(backend, root, step, client_state, keep, marker_extra=None, best=False, report=None):
    """Save a checkpoint collectively (every rank calls this); returns the tag. ``best``: also
    point ``best`` at it. Keep-N pruning never removes the checkpoint ``best`` names (a run
    resumed without ``train.save_best`` included: the user's best weights are not deleted), nor
    files the save did not write (see :func:`_prune`; ``report(line)`` hears where they went).

    Raises :class:`CheckpointWriteError` on every rank if any rank failed to write (the
    temporary folder is removed; earlier checkpoints and ``latest`` are untouched).
    """
    tag = tag_for(step)
    tmp_tag = f'.tmp-{tag}'
    tmp_path = os.path.join(root, tmp_tag)
    failure = None
    if distributed.is_main():
        try:
            shutil.rmtree(tmp_path, ignore_errors=True)  # leftover of a killed save
            os.makedirs(root, exist_ok=True)
            failure = _no_room_for(root, tag)
        except OSError as exc:
            failure = _describe_write_failure(root, exc)
    failure = distributed.first_failure(failure)  # also the barrier before writing
    if failure is None:
        try:
            backend.save(root, tmp_tag, client_state)
        except Exception as exc:  # torch.save reports a full disk as a RuntimeError without errno
            failure = _describe_write_failure(tmp_path, exc)
        faults.fault_point('save-files', step)
        failure = distributed.first_failure(failure)  # every rank's files are written, or none
    if failure is None and distributed.is_main():
        try:
            _seal(root, tmp_tag, tag, step, backend, client_state, marker_extra)
            write_pointer(root, 'latest', tag)
            if best:
                write_pointer(root, 'best', tag)
            kept = read_pointer(root, 'best')
            for old in complete_tags(root)[:-keep] if keep > 0 else []:
                if old != kept:
                    _prune(root, old, report)
        except OSError as exc:
            failure = _describe_write_failure(tmp_path, exc)
    failure = distributed.first_failure(failure)
    if failure is not None:
        if distributed.is_main():
            shutil.rmtree(tmp_path, ignore_errors=True)  # no partial checkpoint left behind
        raise CheckpointWriteError(failure)
    return tag


def not_written_by_save(ckpt_dir):
    """Names in a ``step_*`` folder that its save did not write: files or folders a user put
    there by hand (an exported model, predictions). Without a readable marker only the state
    files (:data:`STATE_FILE_RE`) count as the save's."""
    try:
        listed = set(read_marker(ckpt_dir)['files'])
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    return sorted(name for name in os.listdir(ckpt_dir) if name != COMPLETE and
                  (name not in listed if listed is not None else not STATE_FILE_RE.search(name)))


def _prune(root, tag, report):
    """Delete checkpoint ``root/tag`` (keep-N pruning). What the save did not write there goes,
    first, to ``<work_dir>/kept_from_pruning/<tag>/``: pruning removed whole folders, and with
    them an exported model or predictions a user had put inside, without a word."""
    path = os.path.join(root, tag)
    theirs = not_written_by_save(path)
    if theirs:
        base = os.path.join(os.path.dirname(root), 'kept_from_pruning', tag)
        dest, n = base, 1
        while os.path.exists(dest):   # the same step pruned again after a rollback
            dest, n = f'{base}-{n}', n + 1
        os.makedirs(dest)
        for name in theirs:
            shutil.move(os.path.join(path, name), os.path.join(dest, name))
        fsync_path(dest)
        if report is not None:
            names = [n + '/' if os.path.isdir(os.path.join(dest, n)) else n for n in theirs]
            shown = ', '.join(names[:5]) + (f' and {len(names) - 5} more' if len(names) > 5 else '')
            report(f'train.keep_checkpoints pruned {path}; what ds_seg had not written there ({shown}) '
                   f'moved to {dest}')
    shutil.rmtree(path, ignore_errors=True)


def _no_room_for(root, tag):
    """The failure line when ``root``'s file system has less room than the newest complete
    checkpoint takes (the new one is written before keep-N pruning frees any), else None. Found
    while writing, a full disk left the ranks in different collectives (one in DeepSpeed's save,
    one reporting its failure): they waited out the whole distributed timeout and blamed the
    network. Checked first, every rank stops together, before writing anything. A write that
    fails on one rank mid-save anyway (a disk another job fills, a quota this does not see, an
    I/O error) joins the others' collectives (the backends' ``save``) and stops them at once."""
    newest = complete_tags(root)[-1:]
    if not newest:
        return None
    try:
        need = sum(read_marker(os.path.join(root, newest[0])).get('files', {}).values())
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    free = shutil.disk_usage(root).free
    if free >= need:
        return None
    code = errno_codes.ENOSPC
    return (f'writing {os.path.join(root, tag)} failed: [Errno {code} {errno_codes.errorcode[code]}] '
            f'{os.strerror(code)} (it needs about {need / 2 ** 20:.1f} MiB, as {newest[0]} took; '
            f'{free / 2 ** 20:.1f} MiB free)')


def _seal(root, tmp_tag, tag, step, backend, client_state, marker_extra):
    """Checksum and fsync every file, write the marker, rename the folder into place."""
    tmp_path = os.path.join(root, tmp_tag)
    names = _files(tmp_path)
    sums = {}
    for name in names:
        sums[name] = sha256_file(os.path.join(tmp_path, name))
        fsync_path(os.path.join(tmp_path, name))
    marker = {'step': step, 'world_size': distributed.world_size(), 'backend': backend.name,
              'zero_stage': backend.zero_stage, 'model': client_state.get('model_cfg'),
              'classes': client_state.get('classes'), 'data': client_state.get('data'),
              'files': {n: os.path.getsize(os.path.join(tmp_path, n)) for n in names}, 'sha256': sums}
    marker.update(marker_extra or {})
    with open(os.path.join(tmp_path, COMPLETE), 'w') as f:
        # Enough to export or check compatibility without unpickling anything.
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp_path)
    faults.fault_point('save-marker', step)
    final = os.path.join(root, tag)
    if os.path.exists(final):  # re-saving the same step (e.g. after a resume): replace it,
        for name in not_written_by_save(final):  # keeping what a user had put there
            if not os.path.lexists(os.path.join(tmp_path, name)):
                os.replace(os.path.join(final, name), os.path.join(tmp_path, name))
        shutil.rmtree(final)
    os.rename(tmp_path, final)
    fsync_path(root)


def write_failure(path, exc):
    """The one line of :func:`_describe_write_failure` where ``exc`` was a failed write into
    ``path``'s folder (its errno, or one a probe write there gets now: a full disk), else None."""
    line = _describe_write_failure(path, exc)
    return line if '[Errno ' in line else None


def _describe_write_failure(path, exc):
    """One line naming the path and the errno. Some writers (torch.save) lose the errno, so a
    small probe write into the same folder recovers it (ENOSPC, EROFS, EIO...)."""
    code = getattr(exc, 'errno', None)
    if code is None:
        probe_dir = path if os.path.isdir(path) else os.path.dirname(path)
        probe = os.path.join(probe_dir, f'.write_probe.{os.getpid()}')
        try:
            with open(probe, 'wb') as f:
                f.write(b'\0' * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError as probe_exc:
            code = probe_exc.errno
        finally:
            with contextlib.suppress(OSError):
                os.remove(probe)
    if code is not None:
        name = errno_codes.errorcode.get(code, str(code))
        return f'writing {path} failed: [Errno {code} {name}] {os.strerror(code)}'
    return f'writing {path} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ""}'


BEST_NEVER_WRITTEN = ("does not exist: checkpoints/best is written only by runs with train.save_best (e.g. "
                      "train.save_best='mIoU'); give a step_* folder, the checkpoints folder or the work dir instead.")


def write_pointer(root, name, tag):
    """``root/name`` (``latest`` or ``best``) now holds ``tag``, atomically."""
    tmp = os.path.join(root, f'.{name}.tmp')
    with open(tmp, 'w') as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, name))
    fsync_path(root)


def newest_verified(root):
    """``(tag, skipped)``: the newest checkpoint in ``root`` that passes :func:`verify`, or None,
    and ``[(tag, reason), ...]`` for every newer one passed over."""
    skipped = []
    candidates = sorted((t for t in os.listdir(root) if TAG_RE.match(t)), reverse=True) if os.path.isdir(root) else []
    # `latest` naming a folder that is not there (deleted or moved by hand): the run went back to
    # an older checkpoint without a word.
    latest = read_pointer(root, 'latest')
    gone = latest is not None and not os.path.isdir(os.path.join(root, latest))
    for tag in candidates:
        if gone and latest > tag:
            skipped.append((latest, "named by 'latest', but its folder is not there (deleted or moved?)"))
            gone = False
        reason = verify(root, tag)
        if reason is None:
            return tag, skipped
        skipped.append((tag, reason))
    if gone:
        skipped.append((latest, "named by 'latest', but its folder is not there (deleted or moved?)"))
    return None, skipped


def describe_skipped(skipped):
    return '; '.join(f'skipped {tag}: {reason}' for tag, reason in skipped)


POINTERS = ('latest', 'best')  # files in a checkpoints folder that hold one tag
# What saves write into a checkpoints folder beside the step folders (DeepSpeed copies its
# recovery scripts there at each save).
BESIDE_STEPS = POINTERS + ('zero_to_fp32.py', 'zero_to_torch.py')


def is_pointer_file(path):
    """True for a checkpoints folder's ``latest`` file (DeepSpeed's convention: the tag of the
    newest checkpoint) or ``best`` (``train.save_best``), which users give where a checkpoint is
    asked for."""
    return os.path.basename(path) in POINTERS and os.path.isfile(path) and os.path.getsize(path) < 256


def read_pointer(root, name):
    """The tag ``root/name`` (a pointer file) holds, or None when there is none or it holds no tag."""
    try:
        with open(os.path.join(root, name), 'rb') as f:
            tag = f.read(256).decode('ascii', 'replace').strip()  # any bytes: a tag or none
    except OSError:
        return None
    return tag if TAG_RE.fullmatch(tag) else None


def find_checkpoint(path, report=None):
    """The checkpoint a path means, the one rule that ``--resume``, export, predict and evaluate
    share: a ``step_*`` folder itself (verified), the one a ``latest``/``best`` file names
    (verified), else the newest verified checkpoint of a checkpoints folder or of a work dir.
    ``report(line)`` hears about damaged checkpoints passed over. Raises FileNotFoundError
    naming the path.

    Example::

        find_checkpoint('work_dirs/default')   # -> '.../work_dirs/default/checkpoints/step_00000400'
    """
    path = os.path.abspath(path)
    if is_pointer_file(path):
        tag = read_pointer(os.path.dirname(path), os.path.basename(path))
        if tag is None:
            raise FileNotFoundError(f"{path}: does not name a step_* checkpoint; give the checkpoints folder to "
                                    "pick the newest good one.")
        path = os.path.join(os.path.dirname(path), tag)
    if os.path.isfile(os.path.join(path, COMPLETE)) or TAG_RE.match(os.path.basename(path)):
        reason = verify(os.path.dirname(path), os.path.basename(path)) if os.path.isdir(path) else 'it does not exist'
        if reason is not None:
            raise FileNotFoundError(f"{path}: not a usable checkpoint: {reason}. Use an earlier step_* "
                                    "folder, or give the checkpoints folder to pick the newest good one.")
        return path
    if os.path.isfile(path):
        with open(path, 'rb') as f:
            head = f.read(4)
        if looks_like_onnx(path, head):
            raise FileNotFoundError(f"{path}: is an ONNX model, already exported; predict.py and evaluate.py run "
                                    "it. Exporting takes the step_* folder, checkpoints folder or work dir it came from.")
        raise FileNotFoundError(f"{path}: is a file, not a checkpoint folder (give a step_* folder, a checkpoints "
                                "folder or a work dir; weights files go to load_from= or predict/evaluate).")
    if not os.path.isdir(path):
        if os.path.basename(os.path.normpath(path)) == 'best' and os.path.isdir(os.path.dirname(os.path.normpath(path))):
            raise FileNotFoundError(f"{path}: {BEST_NEVER_WRITTEN}")
        raise FileNotFoundError(f"{path}: does not exist (give a step_* folder, a checkpoints folder or a work dir).")
    skipped_all = []
    for root in (path, os.path.join(path, 'checkpoints')):
        tag, skipped = newest_verified(root)
        skipped_all += [(os.path.join(root, t), r) for t, r in skipped]
        if tag:
            if skipped_all and report is not None:
                report(describe_skipped(skipped_all))
            return os.path.join(root, tag)
    detail = f' ({describe_skipped(skipped_all)})' if skipped_all else ''
    raise FileNotFoundError(f"{path}: no complete checkpoint here (looked for step_*/{COMPLETE}){detail}.")


def resolve_resume(resume, work_dir, report=None):
    """Turn ``--resume`` into ``(root, tag)`` or None.

    ``auto``: the newest verified checkpoint in ``<work_dir>/checkpoints`` if any (else start
    fresh; damaged newer ones are reported and passed over); a path to a checkpoints folder, a
    work dir or one ``step_*`` folder resumes from it (see :func:`find_checkpoint`).
    """
    if not resume:
        return None
    if resume == 'auto':
        root = os.path.join(work_dir, 'checkpoints')
        tag, skipped = newest_verified(root)
        if skipped and report is not None:
            report(f'--resume auto: {describe_skipped(skipped)}'
                   + (f'; resuming from {tag}' if tag else '; no good checkpoint left, starting fresh'))
        return (root, tag) if tag else None
    try:
        found = find_checkpoint(resume, report=report)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f'--resume: {exc}') from exc
    return os.path.dirname(found), os.path.basename(found)


def is_own(work_dir, root):
    """Whether checkpoints folder ``root`` is ``work_dir``'s own (not another run's)."""
    live = os.path.join(work_dir, 'checkpoints')
    return os.path.isdir(root) and os.path.isdir(live) and os.path.samefile(root, live)


def set_aside_other_branch(work_dir, root, tag, partial=True):
    """A resume from ``root/tag`` abandons whatever the work dir holds beyond it: every later
    checkpoint of the work dir (a rollback, or damaged ones ``--resume auto`` passed over), or
    all of them when ``root`` is another run's or ``tag`` is None (a fresh start over damaged
    ones). Move them (never delete: a damaged one may still hold intact weights) to
    ``<work_dir>/abandoned/<time>-after-<tag>/checkpoints``, where the run's later saves cannot
    overwrite them; return that folder, or None when nothing had to move. ``partial``: a killed
    save's ``.tmp-`` folder goes along (else the next save clears it: after a preemption it
    holds nothing a complete checkpoint does not). Rank 0 only."""
    live = os.path.join(work_dir, 'checkpoints')
    if not os.path.isdir(live):
        return None
    same = tag is not None and is_own(work_dir, root)
    names = [n for n in os.listdir(live)
             if partial and n.startswith('.tmp-step_') or TAG_RE.match(n) and (not same or n > tag)]
    if not names:
        return None
    dest = _new_branch_folder(work_dir, tag, branch=same)
    for name in sorted(names):
        os.replace(os.path.join(live, name), os.path.join(dest, 'checkpoints', name))
    if same:
        write_pointer(live, 'latest', tag)
    elif os.path.exists(os.path.join(live, 'latest')):
        os.replace(os.path.join(live, 'latest'), os.path.join(dest, 'checkpoints', 'latest'))
    if read_pointer(live, 'best') in names:  # the best checkpoint moved aside: its pointer goes with it
        os.replace(os.path.join(live, 'best'), os.path.join(dest, 'checkpoints', 'best'))
    return dest


BRANCH_RECORD = 'branch.json'   # in abandoned/<folder>/: the step of the live lineage it branched after


def _new_branch_folder(work_dir, tag, branch=True):
    """A new ``<work_dir>/abandoned/<time>-after-<tag>/`` with its ``checkpoints/``; ``branch``: it
    holds a branch of this run's lineage from after ``tag`` (recorded: --resume of one of its
    steps brings it back), not another run's lineage or a fresh start's."""
    import time
    base = os.path.join(work_dir, 'abandoned', f"{time.strftime('%Y%m%d-%H%M%S')}-after-{tag or 'nothing'}")
    dest, n = base, 1
    while os.path.exists(dest):  # two rollbacks to one tag within a second
        dest, n = f'{base}-{n}', n + 1
    os.makedirs(os.path.join(dest, 'checkpoints'))
    if branch and tag:
        with open(os.path.join(dest, BRANCH_RECORD), 'w') as f:
            json.dump({'branched_after': tag}, f)
    return dest


def of_this_run(work_dir, root):
    """Whether checkpoints folder ``root`` is of ``work_dir``'s own lineage: its live one, or a
    branch it abandoned (:func:`abandoned_branch_of`)."""
    return is_own(work_dir, root) or abandoned_branch_of(work_dir, root) is not None


def abandoned_branch_of(work_dir, root):
    """``(folder, branched_after_tag)`` where checkpoints folder ``root`` is a branch this work dir
    abandoned (``<work_dir>/abandoned/<folder>/checkpoints`` of a rollback or passed-over damaged
    checkpoints, recorded in its branch.json), else None: another run's lineage set aside there
    (or one from before the record) is no branch of this one's."""
    folder = os.path.dirname(os.path.abspath(root))
    try:
        if os.path.basename(root.rstrip(os.sep)) != 'checkpoints' or not os.path.samefile(
                os.path.dirname(folder), os.path.join(work_dir, 'abandoned')):
            return None
        with open(os.path.join(folder, BRANCH_RECORD)) as f:
            after = json.load(f).get('branched_after')
    except (OSError, ValueError, AttributeError):
        return None
    return (folder, after) if isinstance(after, str) and TAG_RE.match(after) else None


def bring_back_branch(work_dir, folder, after, tag):
    """Resuming step ``tag`` of an abandoned branch (``folder``, branched after step ``after``)
    makes it the live one again: the live checkpoints after ``after`` are set aside as a branch
    of their own, and the branch's checkpoints up to ``tag`` move back to ``checkpoints/``, so
    ``latest``, ``--resume auto`` and every command agree on it (those after ``tag`` stay in
    ``folder``). Returns where the live branch went (None when it had nothing after ``after``).
    Rank 0 only."""
    live = os.path.join(work_dir, 'checkpoints')
    os.makedirs(live, exist_ok=True)
    set_aside = set_aside_other_branch(work_dir, live, after)
    held = os.path.join(folder, 'checkpoints')
    for name in sorted(os.listdir(held)):
        if TAG_RE.match(name) and name <= tag:
            os.replace(os.path.join(held, name), os.path.join(live, name))
    for pointer in ('latest', 'best'):   # (best: re-derived from the live branch's evaluations)
        if read_pointer(held, pointer) is not None and not os.path.isdir(os.path.join(held, read_pointer(held, pointer))):
            os.remove(os.path.join(held, pointer))
    write_pointer(live, 'latest', tag)
    # The log rows go as the checkpoints do: the live ones after ``after`` with the live branch,
    # the branch's up to ``tag`` back (so the best is derived from them before the run logs).
    step, branched = int(TAG_RE.match(tag).group(1)), int(TAG_RE.match(after).group(1))
    for name in ('metrics.jsonl', 'eval.jsonl'):
        rows, theirs = _jsonl_lines(os.path.join(work_dir, name)), _jsonl_lines(os.path.join(folder, name))
        later = [line for line in rows if _row_step(line) > branched]
        if later:
            if set_aside is None:   # rows of steps never checkpointed: still the live branch's
                set_aside = _new_branch_folder(work_dir, after)
            _write_lines(os.path.join(set_aside, name), later)
        if theirs:
            _write_lines(os.path.join(folder, name), [line for line in theirs if _row_step(line) > step])
        if later or theirs:
            _write_lines(os.path.join(work_dir, name), [line for line in rows if _row_step(line) <= branched]
                         + [line for line in theirs if _row_step(line) <= step])
    return set_aside


def _jsonl_lines(path):
    """The non-blank lines of a jsonl file (none where it is missing)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [line if line.endswith('\n') else line + '\n' for line in f if line.strip()]


def _row_step(line):
    try:
        return int(json.loads(line)['step'])
    except (ValueError, KeyError, TypeError):
        return -1   # (RunLog moves damaged lines aside before; one left here stays with the live rows)


def _write_lines(path, lines):
    with open(path + '.tmp', 'w') as f:
        f.writelines(lines)
    os.replace(path + '.tmp', path)


# ----------------------------------------------------------------------------------------------
# Export: any backend's checkpoint -> one plain fp32 weights file
# ----------------------------------------------------------------------------------------------

def consolidated_state_dict(ckpt_dir):
    """Full fp32 state dict (parameters and buffers) from one ``step_*`` folder, offline."""
    ddp_file = os.path.join(ckpt_dir, 'ddp_state.pt')
    if os.path.isfile(ddp_file):
        try:
            return torch.load(ddp_file, map_location='cpu', weights_only=True)['module']
        except pickle.UnpicklingError as exc:
            raise UnsafeFileError(ddp_file) from exc
    model_files = glob.glob(os.path.join(ckpt_dir, '*model_states.pt'))
    if not model_files:
        raise FileNotFoundError(f"{ckpt_dir}: neither a DDP nor a DeepSpeed checkpoint.")
    optim_files = glob.glob(os.path.join(ckpt_dir, '*optim_states.pt'))
    if optim_files:
        # ZeRO 1-3 and bf16: the fp32 master weights live in the partitioned optimizer files.
        from deepspeed.utils import zero_to_fp32
        from .ds_workarounds import only_safe_torch_load
        root, tag = os.path.split(os.path.normpath(ckpt_dir))
        with only_safe_torch_load(zero_to_fp32):
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
        # Parameters outside the optimizer (a frozen backbone) have no fp32 master. DeepSpeed
        # records them for zero_to_fp32 from ZeRO-2 on; under ZeRO-1 they were left out of the
        # export (which then loaded nowhere). The module's own copy holds them whole below ZeRO-3.
        from .ds_workarounds import safe_torch_load
        module = safe_torch_load(sorted(model_files)[0], map_location='cpu')['module']
        state.update({k: v for k, v in module.items() if k not in state and v.numel() > 0})
        return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    # ZeRO-0 keeps the whole module in the model-states file of rank 0.
    from .ds_workarounds import safe_torch_load
    saved = safe_torch_load(sorted(model_files)[0], map_location='cpu')
    state = dict(saved['module'])
    state.update(_zero0_fp32_masters(saved))
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def _zero0_fp32_masters(saved):
    """{name: fp32 master weight} of a ZeRO-0 native bf16/fp16 checkpoint (its optimizer's
    ``fp32_groups``, or the fused fp16 optimizer's ``fp32_groups_flat``: one flat tensor per
    group), or {} (fp32 runs; an optimizer state of another form). The module holds the 16-bit
    copies: exported as they were, the weights were 3e-3 off what training had reached (argmax
    different on 0.14% of the pixels), where ZeRO 1-3 exports gave the fp32 masters.

    The groups list no names; each master is the parameter whose 16-bit copy it rounds to, of its
    shape (DeepSpeed copies every master into its 16-bit parameter after each step), matched in
    the module's order; a flat group is its parameters one after another, in the group's order."""
    optimizer = saved.get('optimizer')
    if not isinstance(optimizer, dict):
        return {}
    groups, flat_groups = optimizer.get('fp32_groups'), optimizer.get('fp32_groups_flat')
    if not groups and not flat_groups:
        return {}
    module, buffers = saved['module'], set(saved.get('buffer_names') or ())
    free = [k for k, v in module.items() if k not in buffers and v.is_floating_point()]

    def rounds_to(master, name):
        return module[name].shape == master.shape and torch.equal(master.to(module[name].dtype), module[name])

    masters = {}
    for master in (t for group in groups or () for t in group):
        name = next((k for k in free if rounds_to(master, k)), None)
        if name is None:  # not this layout after all: the module's copies, as before
            return {}
        free.remove(name)
        masters[name] = master
    for flat in flat_groups or ():
        offset = 0
        while offset < flat.numel():
            name = next((k for k in free if offset + module[k].numel() <= flat.numel()
                         and rounds_to(flat[offset:offset + module[k].numel()].view(module[k].shape), k)), None)
            if name is None:
                return {}
            free.remove(name)
            masters[name] = flat[offset:offset + module[name].numel()].view(module[name].shape).clone()
            offset += module[name].numel()
    return masters


def read_marker(ckpt_dir):
    """The ``COMPLETE`` record of a checkpoint folder (step, backend, model config, classes)."""
    path = os.path.join(ckpt_dir, COMPLETE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{ckpt_dir}: not a complete ds_seg checkpoint (no {COMPLETE} file).")
    with open(path) as f:
        return json.load(f)


def export(ckpt_dir, out_file, model_cfg=None, classes=None, extra=None):
    """Write ``{'state_dict', 'model', 'classes', ...}`` to ``out_file`` (loadable weights_only).

    ``model_cfg`` and ``classes`` default to those recorded in the checkpoint.

    Example::

        export('work_dirs/default/checkpoints/step_00000400', 'unet.pt')
    """
    marker = read_marker(ckpt_dir)
    model_cfg = model_cfg or marker.get('model')
    classes = classes if classes is not None else marker.get('classes')
    state = consolidated_state_dict(ckpt_dir)
    payload = {'state_dict': state, 'model': dict(model_cfg), 'classes': list(classes or []),
               'source': os.path.abspath(ckpt_dir), 'step': marker.get('step')}
    if marker.get('data'):
        # Bands, mean and std of training: prediction must normalise its inputs the same way.
        payload['data'] = marker['data']
    if marker.get('custom_imports'):   # the user's modules that register its model
        payload['custom_imports'] = list(marker['custom_imports'])
    payload.update(extra or {})
    payload['sha256'] = weights_digest(state)  # checked on every load: a changed byte is refused
    from ..inputs import partial_path
    tmp = partial_path(out_file)  # ds_seg's own name: '<out>.tmp' replaced a user's file of that name
    try:
        torch.save(payload, tmp)
        os.replace(tmp, out_file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a failed export leaves nothing behind
        raise
    return out_file


class UnsafeFileError(ValueError):
    """A checkpoint or weights file holds pickled Python objects other than tensors: loading it
    could run code, so it is refused (nothing in it was executed)."""

    def __init__(self, path):
        super().__init__(f"{path}: refused: the file holds Python objects other than tensors (loading "
                         "it could run code); use checkpoints written by ds_seg or export weights with launch/export.py.")


def weights_digest(state_dict):
    """SHA-256 over every tensor's name, dtype, shape and bytes (in name order): what an exported
    file records, so that bytes changed on disk are found (torch.load checks no checksum)."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f'{name}|{tensor.dtype}|{tuple(tensor.shape)}|'.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b'')
    return digest.hexdigest()


# How the files torch.save writes begin: a zip archive, or (before torch 1.6) a pickle.
_TORCH_MAGIC = (b'PK\x03\x04', b'\x80')


def not_torch_kind(head):
    """What a file whose first bytes ``head`` (up to 512) are not torch.save's is, in words."""
    if not head:
        return 'empty (0 bytes)'
    if head[:4] in (b'II*\x00', b'MM\x00*', b'II+\x00', b'MM\x00+'):  # BigTIFF too
        return 'a TIFF raster'
    text = head.decode('utf-8', errors='ignore')  # a character cut at the end is dropped
    printable = all(c.isprintable() or c in '\t\n\r\f' for c in text)
    return 'a text file' if printable and len(text.encode()) >= len(head) - 3 else 'another kind of file'


def is_torch_file(head):
    """Whether the first bytes ``head`` of a file are those torch.save writes."""
    return head.startswith(_TORCH_MAGIC)


def load_weights_file(path, folder_taken=True):
    """Read an exported weights file safely (no code execution): returns the payload dict."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_from: {path} does not exist.")
    with open(path, 'rb') as f:
        head = f.read(512)
    if not head.startswith(_TORCH_MAGIC) and looks_like_onnx(path, head):
        # Its protobuf bytes read as ASCII: it was called 'a text file', which says nothing useful.
        raise ValueError(f"{path}: is an ONNX model (launch/export.py --format onnx), not a weights file: "
                         "launch/predict.py and launch/evaluate.py run it; load_from and export take the weights file or "
                         "checkpoint it was exported from (launch/export.py WORK_DIR writes weights_<step>.pt).")
    if not head.startswith(_TORCH_MAGIC):
        raise ValueError(f"{path}: is {not_torch_kind(head)}, not a weights file (torch.save writes a zip archive); "
                         "give a file written by launch/export.py.")
    if is_torch_export_archive(path):
        raise ValueError(f"{path}: {TORCH_EXPORT_PROGRAM}")
    try:
        # From an open file, as its bytes say: torch.load reads a path ending in .safetensors with
        # safetensors (this torch file named so was a SafetensorError traceback).
        with open(path, 'rb') as f:
            payload = torch.load(f, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refuses any pickle that would construct objects or call code.
        raise UnsafeFileError(path) from exc
    except (RuntimeError, EOFError, OSError) as exc:
        raise ValueError(f"{path}: not a readable weights file (truncated, or not made by torch.save): "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if not isinstance(payload, dict) or 'state_dict' not in payload:
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isfile(os.path.join(folder, COMPLETE)):  # mp_rank_00_model_states.pt, a ZeRO shard...
            if not folder_taken:   # load_from: a weights file only
                raise ValueError(f"{path}: is one file of the checkpoint {folder}, not a weights file; export it "
                                 f"first (launch/export.py {folder}) and give the file that writes, or continue "
                                 f"that run with --resume {folder}.")
            raise ValueError(f"{path}: is one file of the checkpoint {folder}, not a weights file; give the "
                             f"folder itself ({folder}), or export it first (launch/export.py {folder}).")
        raise ValueError(f"{path}: is not a ds_seg weights file (a torch file without 'state_dict'; made by "
                         "launch/export.py).")
    recorded = payload.get('sha256')
    if recorded is not None and weights_digest(payload['state_dict']) != recorded:
        raise ValueError(f"{path}: the weights do not match the SHA-256 recorded at export (bytes changed on "
                         "disk or in transfer); export it again or copy it again.")
    return payload
