"""OUT_DIR/acceptance.md and acceptance.json from what tools/gpu_acceptance.sh left in OUT_DIR:
steps.jsonl (each step's status and time), main/summary.json, each benchmark group's
benchmark.json. Exits 1 when an expected file is missing (the step that writes it failed)."""
import argparse
import json
import os
import sys

from ds_seg.cli.benchmark import format_or_dash  # the benchmark's own cell format (PYTHONPATH: the checkout)

GROUPS = ['unet64_512', 'unet64_512_compiled', 'unet64_512_channels_last', 'upernet_convnext_512',
          'upernet_convnext_512_channels_last', 'unet64_1024', 'vit_large_512', 'segformer_b2_1024', 'max_batch',
          'max_model']
# (family, NCHW group, channels_last group): the pairs that decide speed.CHANNELS_LAST_BY_MODEL.
LAYOUT_PAIRS = [('UNet', 'unet64_512', 'unet64_512_channels_last'),
                ('UperNet (ConvNeXt)', 'upernet_convnext_512', 'upernet_convnext_512_channels_last')]


def layout_lines(groups):
    """channels_last / NCHW images/s per family and backend, where both rows ran."""
    lines = []
    for family, plain, nhwc in LAYOUT_PAIRS:
        rates = {}
        for name in (plain, nhwc):
            for r in (groups.get(name) or {}).get('rows', []):
                if not r.get('error') and r.get('images_per_s'):
                    rates[(name, r['backend'])] = r['images_per_s']
        for backend in sorted({b for _, b in rates}):
            if (plain, backend) in rates and (nhwc, backend) in rates:
                lines.append(f"| {family} | {backend} | {rates[(plain, backend)]:.2f} | {rates[(nhwc, backend)]:.2f} "
                             f"| {rates[(nhwc, backend)] / rates[(plain, backend)]:.2f}x |")
    if not lines:
        return []
    return ['', '| family | backend | NCHW img/s | channels_last img/s | ratio |', '|---|---|---|---|---|'] + lines


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def build_report(out, dry_run, seconds):
    with open(os.path.join(out, 'steps.jsonl')) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    main = _load(os.path.join(out, 'main', 'summary.json'))
    groups = {name: _load(os.path.join(out, name, 'benchmark.json')) for name in GROUPS}
    report = dict(dry_run=bool(dry_run), seconds=seconds, steps=steps,
                  main=None if main is None else {k: main.get(k) for k in (
                      'exit_reason', 'steps', 'images_per_s_median', 'final_loss', 'precision', 'zero_stage',
                      'optimizer_impl', 'wall_time_s')},
                  groups={name: None if g is None else dict(machine=g.get('machine'), rows=g['rows'])
                          for name, g in groups.items()})
    lines = [f"# GPU acceptance{' (dry run on a CPU: tiny sizes, not GPU figures)' if dry_run else ''}", '',
             f'Total {seconds} s.', '', '| step | status | seconds |', '|---|---|---|']
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
    if main:
        lines += ['', f"Main command (shortened): {main.get('steps')} steps, median "
                  f"{format_or_dash(main.get('images_per_s_median'), '.2f')} images/s, exit {main.get('exit_reason')}, "
                  f"optimizer {main.get('optimizer_impl')}."]
    machine = next((g.get('machine') for g in groups.values() if g), None)
    if machine:
        lines += ['', f'Machine: {machine}.']
    lines += ['', '| group | backend | precision | micro-batch | img/s | MFU | peak mem MB | data wait | optimizer '
              '| compile | compile s | NHWC | largest micro-batch |', '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    status = {s['step']: s['status'] for s in steps}
    for name, g in groups.items():
        if g is None:
            lines.append(f"| {name} | {status.get(name, 'not run')}: no benchmark.json (see {name}.log) |")
            continue
        for r in g['rows']:
            if r.get('error'):
                what = 'out of memory at the configured size' if r.get('oom') else 'failed'
                found = f"; largest micro-batch {r['max_micro_batch']}" if 'max_micro_batch' in r else ''
                lines.append(f"| {name} | {r['backend']} | {what}: {r['error'][-80:]!r}{found} |")
                continue
            lines.append(
                f"| {name} | {r['backend']} | {r['precision']} | {r['micro_batch']} | {r['images_per_s']:.2f} "
                f"| {format_or_dash(r.get('mfu'), '.1%')} | {format_or_dash(r.get('max_mem_mb'), '.0f')} | {r['data_wait_frac']:.1%} "
                f"| {r.get('optimizer_impl') or '-'} | {r.get('compile_mode') or 'off'} "
                f"| {format_or_dash(r.get('compile_time_s'), '.1f')} | {'yes' if r.get('channels_last') else 'no'} "
                f"| {r.get('max_micro_batch', '-')} |")
    lines += layout_lines(groups)
    largest = [r for r in (groups.get('max_model') or {}).get('rows', []) if 'max_model' in r]
    if largest:
        lines += ['', '| backend | largest model.depth that fits | parameters |', '|---|---|---|']
        lines += [f"| {r['backend']} | {r['max_model']}{' (capped)' if r.get('max_model_capped') else ''} "
                  f"| {format_or_dash(r.get('max_model_params'), ',')} |" for r in largest]
        params = {r['backend']: r.get('max_model_params') for r in largest}
        if params.get('ddp') and params.get('zero3_offload'):
            lines.append(f"\nZeRO-3 with offload trains {params['zero3_offload'] / params['ddp']:.2f}x the parameters "
                         'DDP fits (target >= 2x).')
    with open(os.path.join(out, 'acceptance.json'), 'w') as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out, 'acceptance.md'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('out', help='the folder tools/gpu_acceptance.sh wrote (it holds steps.jsonl)')
    p.add_argument('--dry-run', type=int, default=0)
    p.add_argument('--seconds', type=int, default=0)
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.out, 'steps.jsonl')):
        what = 'no folder' if not os.path.isdir(args.out) else 'no steps.jsonl in'
        p.error(f'{what} {args.out}: give the OUT_DIR that tools/gpu_acceptance.sh wrote')
    report = build_report(args.out, args.dry_run, args.seconds)
    missing = [name for name, g in report['groups'].items() if g is None]
    skipped = {s['step'] for s in report['steps'] if s['status'].startswith('skipped')}
    missing = [m for m in missing if m not in skipped] + ([] if report['main'] or 'main' in skipped else ['main'])
    print(open(os.path.join(args.out, 'acceptance.md')).read())
    if missing:
        print(f'acceptance: no results from {", ".join(missing)}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
