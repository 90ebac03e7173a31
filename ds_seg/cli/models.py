"""Model facts: every registered model (and its presets) with parameters and forward GFLOPs.

    python launch/models.py --size 512
    python launch/models.py --size 1024 --in-channels 4 --filter UperNetViT --markdown

Models are built on the meta device (no weight memory, seconds even for ViT-g) and counted
with ``torch.utils.flop_counter.FlopCounterMode`` (a multiply-add is 2 FLOPs; published
"GFLOPs" of segmentation papers are usually multiply-adds, i.e. half these figures). The
trainer's MFU starts from the same count (``ds_seg.telemetry.image_flops``: this forward and a
backward of twice the forward of what trains).
"""
import argparse
import sys

import ds_seg  # noqa: F401  (registers every model)
from ds_seg.cli import OneLineParser
from ds_seg.models.common import meta_device
from ds_seg.registry import MODELS, build
from ds_seg.telemetry import forward_flops

# Registered names that are building blocks rather than models with defaults.
_NOT_A_MODEL = {'Segmentor', 'TemporalSegmentor'}


def zoo(name_filter=None):
    """(label, config) for every registered model and each of its presets."""
    rows = []
    for name in sorted(MODELS.module_dict):
        if name in _NOT_A_MODEL or (name_filter and name_filter.lower() not in name.lower()):
            continue
        variants = getattr(MODELS.module_dict[name], 'variants', None) or {'': {}}
        for label, kwargs in variants.items():
            rows.append((f'{name} {label}'.strip(), dict(type=name, **kwargs)))
    return rows


def model_facts(cfg, size, in_channels=3, num_classes=6):
    """``(parameters, forward FLOPs)`` of one image ``size`` x ``size``, on the meta device."""
    cfg = dict(cfg, in_channels=in_channels, num_classes=num_classes)
    with meta_device():
        params = sum(p.numel() for p in build(MODELS, cfg).parameters())
    flops = forward_flops(lambda: build(MODELS, cfg), (1, in_channels, size, size))
    return params, flops


def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--size', type=int, default=512, help='square input size in pixels')
    parser.add_argument('--in-channels', type=int, default=3)
    parser.add_argument('--num-classes', type=int, default=6)
    parser.add_argument('--filter', default=None, help='only models whose name contains this')
    parser.add_argument('--markdown', action='store_true', help='print a Markdown table')
    args = parser.parse_args(argv)

    def refuse(message):  # one line, as the other commands' mistakes (not the usage block first)
        print(f'{parser.prog}: error: {message}', file=sys.stderr)
        return 2

    for flag, value, low in (('--size', args.size, 16), ('--in-channels', args.in_channels, 1),
                             ('--num-classes', args.num_classes, 1)):
        if value < low:
            return refuse(f'{flag} must be at least {low}, got {value}')
    rows = zoo(args.filter)
    if not rows:
        return refuse(f"--filter {args.filter!r} matches no model; the models are "
                      f"{', '.join(sorted(n for n in MODELS.module_dict if n not in _NOT_A_MODEL))}")
    header = ('model', 'params (M)', f'fwd GFLOP @{args.size}')
    if args.markdown:
        print(f'| {header[0]} | {header[1]} | {header[2]} |\n|---|---:|---:|')
    else:
        print(f'{header[0]:<32} {header[1]:>12} {header[2]:>18}')
    for label, cfg in rows:
        params, flops = model_facts(cfg, args.size, args.in_channels, args.num_classes)
        gflops = 'n/a' if flops is None else f'{flops / 1e9:.1f}'
        if args.markdown:
            print(f'| {label} | {params / 1e6:.2f} | {gflops} |', flush=True)
        else:
            print(f'{label:<32} {params / 1e6:>12.2f} {gflops:>18}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
