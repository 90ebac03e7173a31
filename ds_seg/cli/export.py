"""Turn a checkpoint of any backend (DDP, ZeRO 0-3) into one plain fp32 weights file, or into a
deployable ONNX file / torch.export program (dynamic batch, height and width).

    python launch/export.py work_dirs/default                       # newest checkpoint of a run
    python launch/export.py work_dirs/default/checkpoints/step_00000400 --out unet.pt
    python launch/export.py work_dirs/default --format onnx --out unet.onnx     # + unet.onnx.card.json/.md
    python launch/export.py unet.pt --format torch-export --out unet.pt2

ONNX and torch.export outputs are checked against PyTorch (max abs difference < 1e-4) and come
with a model card (classes, bands, mean/std, training config, final metrics); the ONNX file
carries it too, so ``launch/predict.py --checkpoint unet.onnx`` runs it with onnxruntime on CPU.
Export never overwrites an existing file.

The file holds ``state_dict`` (parameters and BatchNorm buffers), the model config and the class
names; ``load_from=`` in a config, launch/predict.py and launch/evaluate.py accept it. It is read
with ``torch.load(weights_only=True)``, so loading it cannot execute code.
"""
import argparse
import os
import sys

from ds_seg import deploy
from ds_seg.engine import checkpoint
from ds_seg.cli import OneLineParser
from ds_seg.inputs import check_writable, refuse_inside_checkpoints, missing_folder, user_path
from ds_seg.registry import RegistryError


def check_out(out):
    """Refuse, before any work, an output that is a folder, has no parent folder, or exists
    (with its model cards): export never overwrites and leaves nothing behind."""
    if os.path.isdir(out) or out.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        # 'exp/' names a folder even where none exists yet: its dirname check below would pass.
        example = os.path.join(out, 'weights.pt')
        if os.path.basename(os.path.dirname(os.path.abspath(example))).startswith('step_'):
            # (a step folder: the suggestion there was refused next, as inside the checkpoints)
            example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(out.rstrip(os.sep)))),
                                   os.path.basename(out.rstrip(os.sep)) + '.pt')
        raise ValueError(f'--out: {out} is a folder; give a file name (e.g. {example}).')
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise ValueError(f'--out: {missing_folder(os.path.dirname(os.path.abspath(out)))}.')
    deploy.refuse_existing(out, *deploy.card_paths(out))
    check_writable(os.path.dirname(os.path.abspath(out)), '--out')
    refuse_inside_checkpoints(os.path.abspath(out), '--out')


# What a file name says it holds: a name that says another format than --format would make the
# next reader (torch.load, onnxruntime, a colleague) fail on it, or worse, half-succeed.
SUFFIX_FORMATS = {'.pt': 'weights', '.pth': 'weights', '.onnx': 'onnx', '.pt2': 'torch-export'}


def check_suffix(out, fmt):
    if os.path.splitext(out)[1].lower() == '.safetensors':  # what torch.load and others read as safetensors
        wanted = '.pt' if fmt == 'weights' else deploy.FORMATS[fmt]
        raise ValueError(f'--out {out}: the name says safetensors, which export does not write (--format {fmt} '
                         f'writes {fmt} files); name it {os.path.splitext(out)[0]}{wanted}.')
    said = SUFFIX_FORMATS.get(os.path.splitext(out)[1].lower())
    if said and said != fmt:
        wanted = '.pt' if fmt == 'weights' else deploy.FORMATS[fmt]
        raise ValueError(f'--out {out}: the name says {said} ({os.path.splitext(out)[1]}) but --format {fmt} writes '
                         f'{fmt} files; name it {os.path.splitext(out)[0]}{wanted} or give --format {said}.')


def _export_weights(args, attempts=3):
    """(checkpoint, out file, its marker). A run still training in the work dir may prune the
    checkpoint while it is read (keep_checkpoints): given a work dir or checkpoints folder, the
    export takes the newest one again; given that step folder, it says what happened (DeepSpeed's
    own "Directory ... doesn't exist" named a folder the user never gave)."""
    for attempt in range(attempts):
        ckpt = checkpoint.find_checkpoint(args.checkpoint, report=lambda line: print(f'export: {line}'))
        out = args.out or os.path.join(os.path.dirname(os.path.dirname(ckpt)), f'weights_{os.path.basename(ckpt)}.pt')
        check_out(out)
        try:
            marker = checkpoint.read_marker(ckpt)
            checkpoint.export(ckpt, out)
            return ckpt, out, marker
        except Exception:
            if os.path.isdir(ckpt):
                raise
            if os.path.realpath(ckpt) == os.path.realpath(args.checkpoint) or attempt == attempts - 1:
                raise FileNotFoundError(f"{ckpt}: removed while this export read it (pruned by keep_checkpoints of "
                                        "the run training there?); export its newest checkpoint (give the work dir), "
                                        "or keep more (train.keep_checkpoints)") from None
            print(f'export: {ckpt} was removed while this export read it (pruned by the run training there?): '
                  'taking the newest checkpoint again')


def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('checkpoint', type=user_path, help='a step_* folder, a checkpoints/ folder or a work dir '
                        '(for onnx/torch-export also a weights file from this script)')
    parser.add_argument('--out', type=user_path, default=None, help='output file (default: <work dir>/weights_<tag>.pt, '
                        'model_<tag>.onnx or model_<tag>.pt2; from a weights file, model_<its name> beside it)')
    parser.add_argument('--format', choices=('weights',) + tuple(deploy.FORMATS), default='weights',
                        help='weights (default): plain fp32 state dict for predict/evaluate/load_from; '
                             'onnx; torch-export')
    args = parser.parse_args(argv)
    if args.out is not None and not args.out.strip():  # '' wrote the default file
        parser.error("--out is empty; give a file name, or leave --out out for the default")
    try:
        if args.out:
            check_suffix(args.out, args.format)
        if args.format == 'weights':
            ckpt, out, marker = _export_weights(args)
            info = dict(classes=marker.get('classes'), model=marker.get('model'), data=marker.get('data'),
                        source=ckpt)
            deploy.write_card(deploy.model_card(info, 'weights', out, os.path.dirname(os.path.dirname(ckpt)),
                                                marker.get('step')), out)
        else:
            ckpt, out = export_deployable(args.checkpoint, args.format, args.out)
    except (FileNotFoundError, ValueError, RegistryError) as exc:  # RegistryError: a model no module here registers
        print(f'export: error: {exc}', file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        line = checkpoint.write_failure(args.out or args.checkpoint, exc)
        if line is None:
            raise
        print(f'export: error: {line}; nothing was exported', file=sys.stderr)
        return 74
    # The file given, not the checkpoint a weights file was exported from; a pointer (latest,
    # best) as the step folder it named.
    given = os.path.isfile(args.checkpoint) and not checkpoint.is_pointer_file(args.checkpoint)
    print(f'exported {args.checkpoint if given else ckpt} -> {out}')
    return 0


def _still_holds(ckpt, payload):
    """Whether step folder ``ckpt`` (a weights file's recorded source) holds the file's weights
    still: the same step, and the same tensors (their SHA-256, as the file records it)."""
    if not os.path.isfile(os.path.join(ckpt, checkpoint.COMPLETE)) or not payload.get('sha256'):
        return False
    try:
        if checkpoint.read_marker(ckpt).get('step') != payload.get('step'):
            return False
        return checkpoint.weights_digest(checkpoint.consolidated_state_dict(ckpt)) == payload['sha256']
    except (OSError, ValueError, KeyError, RuntimeError):
        return False


def export_deployable(source, fmt, out=None):
    """``source`` (checkpoint folder, work dir or weights file) -> an ONNX / torch.export file + card."""
    from ds_seg.inference import load_model
    if fmt == 'onnx':
        deploy.require_onnx_export()
    weights_file = os.path.isfile(source) and not checkpoint.is_pointer_file(source)  # not checkpoints/latest, best
    if weights_file:
        payload = checkpoint.load_weights_file(source)
        ckpt = payload.get('source') or source
        tag = os.path.splitext(os.path.basename(source))[0]
        if not _still_holds(ckpt, payload):
            # Its run was retrained or replaced since (a default work_dirs/<config> reused): that
            # folder's config and metrics are another model's, not this file's.
            if os.path.isdir(ckpt):
                print(f'export: {ckpt}, which {source} was exported from, no longer holds its weights (retrained '
                      'or replaced since): the model card carries only what the file records', flush=True)
            ckpt = source
    else:
        ckpt = checkpoint.find_checkpoint(source, report=lambda line: print(f'export: {line}'))
        tag = os.path.basename(ckpt)
    # The run's folder (config.json, summary.json, eval.jsonl) for the model card, where it exists,
    # and the exported step: the card's metrics are that step's, not a later checkpoint's.
    marker = os.path.join(ckpt, checkpoint.COMPLETE)
    step = checkpoint.read_marker(ckpt).get('step') if os.path.isfile(marker) else None
    work_dir = os.path.dirname(os.path.dirname(ckpt)) if step is not None else None
    if weights_file and step is None:
        step = payload.get('step')   # the file's own record (no run folder to read metrics from)
    # A weights file's beside it (its run's folder may be another's by now), a checkpoint's in its work dir.
    default_folder = os.path.dirname(os.path.abspath(source)) if weights_file else work_dir
    out = out or os.path.join(default_folder or os.path.dirname(os.path.abspath(source)),
                              f'model_{tag}{deploy.FORMATS[fmt]}')
    check_out(out)  # before the model is loaded and traced
    model, info = load_model(source if weights_file else ckpt, 'cpu')
    info['source'] = os.path.abspath(ckpt)
    (deploy.export_onnx if fmt == 'onnx' else deploy.export_torch)(model, out, info, work_dir=work_dir, step=step)
    return ckpt, out


if __name__ == '__main__':
    sys.exit(main())
