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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('checkpoint', help='a step_* folder, a checkpoints/ folder or a work dir')
    parser.add_argument('--out', default=None, help='output file (default: <work dir>/weights_<tag>.pt)')
    args = parser.parse_args(argv)
    try:
        ckpt = checkpoint.find_checkpoint(args.checkpoint, report=lambda line: print(f'export: {line}'))
        out = args.out or os.path.join(os.path.dirname(os.path.dirname(ckpt)), f'weights_{os.path.basename(ckpt)}.pt')
        if os.path.isdir(out):
            raise ValueError(f'--out: {out} is a folder; give a file name (e.g. {os.path.join(out, "weights.pt")}).')
        if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise ValueError(f'--out: the folder {os.path.dirname(os.path.abspath(out))} does not exist; create it first.')
        if os.path.exists(out):
            raise ValueError(f'--out: {out} already exists; choose another name or delete it.')
        checkpoint.export(ckpt, out)
    except (FileNotFoundError, ValueError) as exc:
        print(f'export: error: {exc}', file=sys.stderr)
        return 2
    print(f'exported {ckpt} -> {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
