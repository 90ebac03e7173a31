"""Turn a checkpoint of any backend (DDP, ZeRO 0-3) into one plain fp32 weights file.

    python launch/export.py work_dirs/default                       # newest checkpoint of a run
    python launch/export.py work_dirs/default/checkpoints/step_00000400 --out unet.pt

The file holds ``state_dict`` (parameters and BatchNorm buffers), the model config and the class
names; ``load_from=`` in a config, launch/predict.py and launch/evaluate.py accept it. It is read
with ``torch.load(weights_only=True)``, so loading it cannot execute code.
"""
import argparse
import os
import sys

from ds_seg.engine import checkpoint


def find_checkpoint(path):
    """A step folder, a checkpoints folder, or a work dir -> the newest complete step folder."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, checkpoint.COMPLETE)):
        return path
    for root in (path, os.path.join(path, 'checkpoints')):
        tag = checkpoint.find_latest(root)
        if tag:
            return os.path.join(root, tag)
    raise FileNotFoundError(f"{path}: no complete checkpoint here (looked for step_*/{checkpoint.COMPLETE}).")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('checkpoint', help='a step_* folder, a checkpoints/ folder or a work dir')
    parser.add_argument('--out', default=None, help='output file (default: <work dir>/weights_<tag>.pt)')
    args = parser.parse_args(argv)
    try:
        ckpt = find_checkpoint(args.checkpoint)
        out = args.out or os.path.join(os.path.dirname(os.path.dirname(ckpt)), f'weights_{os.path.basename(ckpt)}.pt')
        checkpoint.export(ckpt, out)
    except (FileNotFoundError, ValueError) as exc:
        print(f'export: error: {exc}', file=sys.stderr)
        return 2
    print(f'exported {ckpt} -> {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
