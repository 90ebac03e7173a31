"""Checkpoint directory management, auto-resume and export to one plain weights file.

Layout under ``<work_dir>/checkpoints``::

    step_00000100/        one backend checkpoint (DeepSpeed files or ddp_state.pt) + COMPLETE
    step_00000200/
    latest                the tag of the newest complete checkpoint, replaced last

A checkpoint is written under a temporary name (``.tmp-step_...``), marked ``COMPLETE`` and then
renamed, so a run killed at any moment leaves either a whole checkpoint or none; ``latest`` is
replaced atomically after the rename, and old checkpoints are pruned only after that.
"""
import contextlib
import glob
import json
import os
import re
import shutil

import torch

from .. import distributed

TAG_RE = re.compile(r'^step_(\d{8})$')
COMPLETE = 'COMPLETE'


def tag_for(step):
    return f'step_{step:08d}'


def _file_sizes(path):
    return {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, name)) and name != COMPLETE}


def is_complete(root, tag):
    """True if the marker exists and every file it lists is present with its recorded size, so a
    checkpoint with a missing rank file or a truncated file is never resumed from."""
    path = os.path.join(root, tag)
    try:
        with open(os.path.join(path, COMPLETE)) as f:
            expected = json.load(f)['files']
        return all(os.path.getsize(os.path.join(path, name)) == size for name, size in expected.items())
    except (OSError, ValueError, KeyError, AttributeError):
        return False


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


def save(backend, root, step, client_state, keep):
    """Save a checkpoint collectively (every rank calls this); returns the tag."""
    tag = tag_for(step)
    tmp_tag = f'.tmp-{tag}'
    if distributed.is_main():
        shutil.rmtree(os.path.join(root, tmp_tag), ignore_errors=True)  # leftover of a killed save
        os.makedirs(root, exist_ok=True)
    distributed.barrier()
    backend.save(root, tmp_tag, client_state)
    distributed.barrier()  # every rank's files are written
    if distributed.is_main():
        tmp_path = os.path.join(root, tmp_tag)
        with open(os.path.join(tmp_path, COMPLETE), 'w') as f:
            # Enough to export or check compatibility without unpickling anything.
            json.dump({'step': step, 'world_size': distributed.world_size(), 'backend': backend.name,
                       'zero_stage': backend.zero_stage, 'model': client_state.get('model_cfg'),
                       'classes': client_state.get('classes'), 'data': client_state.get('data'),
                       'files': _file_sizes(tmp_path)}, f)
        final = os.path.join(root, tag)
        if os.path.exists(final):  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp_path, final)
        _write_latest(root, tag)
        for old in complete_tags(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    distributed.barrier()
    return tag


def _write_latest(root, tag):
    tmp = os.path.join(root, '.latest.tmp')
    with open(tmp, 'w') as f:
        f.write(tag)
    os.replace(tmp, os.path.join(root, 'latest'))


def resolve_resume(resume, work_dir):
    """Turn ``--resume`` into ``(root, tag)`` or None.

    ``auto``: the newest complete checkpoint in ``<work_dir>/checkpoints`` if any (else start
    fresh); a path to a checkpoints folder or to one ``step_*`` folder resumes from it.
    """
    if not resume:
        return None
    if resume == 'auto':
        root = os.path.join(work_dir, 'checkpoints')
        tag = find_latest(root)
        return (root, tag) if tag else None
    resume = os.path.abspath(resume)
    if os.path.isdir(resume) and is_complete(os.path.dirname(resume), os.path.basename(resume)):
        return os.path.dirname(resume), os.path.basename(resume)
    tag = find_latest(resume) if os.path.isdir(resume) else None
    if tag is None:
        raise FileNotFoundError(f"--resume: {resume} holds no complete checkpoint (a 'step_*' folder "
                                f"with a {COMPLETE} file).")
    return resume, tag


# ----------------------------------------------------------------------------------------------
# Export: any backend's checkpoint -> one plain fp32 weights file
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _only_safe_torch_load(module):
    """DeepSpeed's zero_to_fp32 unpickles with weights_only=False; route its torch.load through
    the allow-listed loader so exporting a downloaded checkpoint cannot run code."""
    from .deepspeed_backend import safe_torch_load
    original = module.torch.load
    module.torch.load = lambda path, map_location=None, **_: safe_torch_load(path, map_location=map_location)
    try:
        yield
    finally:
        module.torch.load = original


def consolidated_state_dict(ckpt_dir):
    """Full fp32 state dict (parameters and buffers) from one ``step_*`` folder, offline."""
    ddp_file = os.path.join(ckpt_dir, 'ddp_state.pt')
    if os.path.isfile(ddp_file):
        return torch.load(ddp_file, map_location='cpu', weights_only=True)['module']
    model_files = glob.glob(os.path.join(ckpt_dir, '*model_states.pt'))
    if not model_files:
        raise FileNotFoundError(f"{ckpt_dir}: neither a DDP nor a DeepSpeed checkpoint.")
    optim_files = glob.glob(os.path.join(ckpt_dir, '*optim_states.pt'))
    if optim_files:
        # ZeRO 1-3 and bf16: the fp32 master weights live in the partitioned optimizer files.
        from deepspeed.utils import zero_to_fp32
        root, tag = os.path.split(os.path.normpath(ckpt_dir))
        with _only_safe_torch_load(zero_to_fp32):
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
        return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    # ZeRO-0 keeps the whole module in the model-states file of rank 0.
    from .deepspeed_backend import safe_torch_load
    state = safe_torch_load(sorted(model_files)[0], map_location='cpu')['module']
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


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
               'source': os.path.abspath(ckpt_dir)}
    if marker.get('data'):
        # Bands, mean and std of training: prediction must normalise its inputs the same way.
        payload['data'] = marker['data']
    payload.update(extra or {})
    tmp = f'{out_file}.tmp'
    torch.save(payload, tmp)
    os.replace(tmp, out_file)
    return out_file


def load_weights_file(path):
    """Read an exported weights file safely (no code execution): returns the payload dict."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_from: {path} does not exist.")
    payload = torch.load(path, map_location='cpu', weights_only=True)
    if not isinstance(payload, dict) or 'state_dict' not in payload:
        raise ValueError(f"load_from: {path} is not a ds_seg weights file (made by launch/export.py).")
    return payload
