"""Export a trained model for deployment: ONNX (onnxruntime on CPU, any runtime) or a
``torch.export`` program, with dynamic batch, height and width, a numerical check against
PyTorch, and a model card (JSON + Markdown) that says what the model expects and how it scored.

The ONNX file carries the card in its metadata (``ds_seg``), so the ``.onnx`` alone is enough
for ``launch/predict.py --checkpoint model.onnx`` on a CPU-only machine.

Example::

    model, info = load_model('work_dirs/default/weights_step_00000400.pt')
    export_onnx(model, 'unet.onnx', info)          # + unet.onnx.card.json, unet.onnx.card.md
    forward, info = load_onnx('unet.onnx')          # forward(images_BCHW) -> logits_BKHW
"""
import contextlib
import io
import json
import os
import time

import torch

from .config import ConfigError, extra_hint
from .inference.model import fixed_input_size, window_refusal
from .inference.tiling import input_multiple

INPUT, OUTPUT = 'images_BCHW', 'logits_BKHW'
FORMATS = {'onnx': '.onnx', 'torch-export': '.pt2'}
TOLERANCE = 1e-4  # max abs difference of logits allowed between the export and PyTorch


def _sample_sizes(model):
    """Input sizes for an export: the traced one, then the ones it is checked at (another
    multiple of the model's size divisor, and a size that is a multiple of nothing, so a graph
    that kept the traced size's padding or resizing is caught). Every side is at least twice the
    coarsest stride: torch.export takes a dynamic dimension to be at least 2 (sizes 0 and 1 are
    specialised), so a program traced at 64 px holds from 64 px on."""
    divisor = max(32, input_multiple(model))
    return (2 * divisor, 2 * divisor), (3 * divisor, 4 * divisor), (3 * divisor + 5, 2 * divisor + 3)


def _export_sizes(model, info):
    """``(traced, checked, dims)``: the input size traced, the sizes the export is checked at, and
    the input dimensions left dynamic. A model built for one input size (a Swin's ``img_size``)
    refuses every other, so it is traced and checked at that size with only the batch dynamic;
    it failed to export at all."""
    first, *others = _sample_sizes(model)
    fixed = fixed_input_size(info.get('model'))
    # Probed at a size other than its own: one built for the trace size (img_size=64) took it, was
    # exported with H and W dynamic, and failed its check at another size in a traceback.
    probe = next((h for h, _ in (first, *others) if h != fixed), 2 * (fixed or 32))
    if fixed and window_refusal(model, _in_channels(model, info), probe) is not None:
        return (fixed, fixed), [(fixed, fixed)] * 2, ('B',)
    return first, others, ('B', 'H', 'W')


def _in_channels(model, info):
    bands = (info.get('data') or {}).get('bands')
    return int(getattr(model, 'in_channels', None) or (len(bands) if bands else 3))


def refuse_existing(*paths):
    """Export never overwrites: a file a user has (an earlier export, a card) stays as it is."""
    for path in paths:
        if os.path.lexists(path):  # a link to nothing too: writing replaced the user's link with a file
            raise ConfigError(f'--out: {path} already exists; choose another --out or move it away '
                              '(export never overwrites).')


def card_paths(out):
    """The model card beside an export: ``unet.onnx`` -> ``unet.onnx.card.json``, ``.card.md``."""
    return f'{out}.card.json', f'{out}.card.md'


def model_card(info, fmt, out, work_dir=None, step=None, dynamic=('B', 'H', 'W')):
    """The facts a deployment needs: classes, bands, normalisation, model and training configs,
    final metrics (from the run's ``summary.json``/``eval.jsonl`` when ``work_dir`` has them).

    ``step`` is the exported checkpoint's step: the metrics are those of the evaluation at that
    step (or the last one before it, named by ``eval_step``), never those of a later checkpoint of
    the same run (exporting ``step_00000200`` of a 400-step run must not claim step 400's mIoU);
    ``summary.json``'s fields (steps, final loss, exit reason) only when the run ended at ``step``."""
    data = info.get('data') or {}
    card = dict(format=fmt, file=os.path.basename(out), created=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
                input=dict(name=INPUT, layout='B, C, H, W float32, normalised: (value - mean) / std per band',
                           dynamic=list(dynamic)),
                output=dict(name=OUTPUT, layout='B, K, H, W float32 logits (argmax over K = class index)'),
                classes=list(info.get('classes') or []), bands=data.get('bands'), mean=data.get('mean'),
                std=data.get('std'), ignore_index=data.get('ignore_index'), dtype=data.get('dtype'),
                file_bands=data.get('file_bands'), colours=data.get('colours'),
                label_decoding=data.get('label_decoding'), file_alpha=data.get('file_alpha'),
                num_dates=data.get('num_dates'), pixel_size_m=data.get('pixel_size_m'),
                # predict's windows start on it, as they do for the PyTorch model
                input_multiple=info.get('input_multiple'),
                model=info.get('model'), source=info.get('source'), step=step, training_config=None,
                final_metrics=None, torch=torch.__version__)
    if work_dir:
        config = os.path.join(work_dir, 'config.json')
        if os.path.isfile(config):
            with open(config) as f:
                card['training_config'] = json.load(f)
        metrics = {}
        summary = os.path.join(work_dir, 'summary.json')
        if os.path.isfile(summary):
            with open(summary) as f:
                s = json.load(f)
            if step is None or s.get('steps') == step:
                metrics.update({k: s.get(k) for k in ('steps', 'final_loss', 'exit_reason')})
        evals = os.path.join(work_dir, 'eval.jsonl')
        if os.path.isfile(evals):
            with open(evals) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            rows = [r for r in rows if step is None or (r.get('step') is not None and r['step'] <= step)]
            if rows:
                metrics.update({k: rows[-1].get(k) for k in ('mIoU', 'OA', 'mF1', 'per_class')})
                metrics['eval_step'] = rows[-1].get('step')
        card['final_metrics'] = metrics or None
    return card


def card_markdown(card):
    lines = [f"# Model card: {card['file']}", '',
             f"- format: {card['format']} (input `{INPUT}` {card['input']['layout']}; output `{OUTPUT}`)",
             f"- model: `{json.dumps(card['model'])}`",
             f"- classes: {', '.join(card['classes']) or 'not recorded'}",
             f"- bands: {card['bands']}", f"- mean: {card['mean']}", f"- std: {card['std']}",
             *([f"- input size: from {card['input']['min_size'][0]} x {card['input']['min_size'][1]} px (H x W) up; "
                "smaller inputs may fail torch's shape guards"] if card['input'].get('min_size') else []),
             f"- source: {card['source']}", f"- created: {card['created']} (torch {card['torch']})", '']
    metrics = card.get('final_metrics') or {}
    if metrics:
        lines += ['## Final metrics', '', '| metric | value |', '|---|---|']
        lines += [f'| {k} | {v} |' for k, v in metrics.items() if k != 'per_class']
        for name, values in (metrics.get('per_class') or {}).items():
            lines.append(f"| IoU {name} | {values.get('iou')} |")
        lines.append('')
    if card.get('training_config'):
        lines += ['## Training config', '', '```json', json.dumps(card['training_config'], indent=2), '```', '']
    return '\n'.join(lines)


def write_card(card, out):
    json_path, md_path = card_paths(out)
    with open(json_path, 'w') as f:
        json.dump(card, f, indent=2, default=str)
    with open(md_path, 'w') as f:
        f.write(card_markdown(card))
    return json_path, md_path


def require_onnx_export():
    """One line naming the install when a package of ``--format onnx`` is missing: the exporter
    (onnx, onnxscript) or the runtime that checks its file (onnxruntime). Called before a
    checkpoint is read, so a missing package costs no model load and no trace."""
    for name in ('onnx', 'onnxscript', 'onnxruntime'):
        try:
            __import__(name)
        except ImportError as exc:
            raise ConfigError(f"--format onnx needs the {name} package: {extra_hint('onnx')}.") from exc


def export_onnx(model, out, info, work_dir=None, step=None):
    """Write ``model`` as ONNX (opset 18, torch.export-based exporter) with dynamic batch, height
    and width (the batch alone for a model of one input size, at that size), the card in its
    metadata, and the card files beside it. The file is checked with
    onnxruntime against PyTorch (max abs difference < 1e-4) at sizes other than the traced one,
    including sizes that are not a multiple of the model's size divisor, and removed if it differs.

    Example: ``export_onnx(model, 'out/unet.onnx', info, work_dir='work_dirs/default')``
    """
    require_onnx_export()
    import onnx
    from torch.export import Dim

    from .inputs import partial_path, remove_quietly
    # A model over 2 GB keeps its weights in <out>.data beside the graph (protobuf's limit).
    refuse_existing(out, f'{out}.data', *card_paths(out))
    model = model.eval().cpu()
    first, others, dims = _export_sizes(model, info)
    # Batch 2: torch.export specialises a dimension traced at size 1.
    x = torch.randn(2, _in_channels(model, info), *first)
    # ds_seg's own partial name: a fixed '<out>.tmp' replaced a user's file of that name.
    tmp = partial_path(out)
    moved = []  # the external weights file, once at its final name
    try:
        try:
            with torch.no_grad(), _quiet_exporter():
                program = torch.onnx.export(model, (x,), dynamo=True, opset_version=18, input_names=[INPUT],
                                            output_names=[OUTPUT], verbose=False,
                                            dynamic_shapes=({'BCHW'.index(d): Dim.DYNAMIC for d in dims},))
        except Exception as exc:  # an op without an ONNX form, or a size torch.export cannot keep dynamic
            raise ConfigError(f'--format onnx: {type(model).__name__} ({(info.get("model") or {}).get("type")}) '
                              f'does not export to ONNX with dynamic sizes: {str(exc).splitlines()[0][:200]}.') from exc
        # Outside the check above: a failed write (a full disk) is the disk's, not the model's
        # (export.py: exit 74 with the errno).
        with _quiet_exporter():
            program.save(tmp)
        card = model_card(dict(info, input_multiple=input_multiple(model)), 'onnx', out, work_dir, step, dims)
        # The graph alone: external weights stay in their file (loading them would pass protobuf's
        # 2 GB limit when saved again), and are named for the final file.
        proto = onnx.load(tmp, load_external_data=False)
        entry = proto.metadata_props.add()
        entry.key, entry.value = 'ds_seg', json.dumps(card, default=str)
        external = _point_external_data_at(proto, f'{os.path.basename(out)}.data')
        if external:
            os.replace(f'{tmp}.data', f'{out}.data')
            moved.append(f'{out}.data')
        onnx.save(proto, tmp)
        check_onnx(model, tmp, x.shape[1], others)
    except BaseException:  # a failed or interrupted export leaves nothing behind
        remove_quietly(tmp, f'{tmp}.data', *moved)
        raise
    os.replace(tmp, out)
    write_card(card, out)
    return out


class _WriteErrorKept(io.RawIOBase):
    """A file for torch.export.save that keeps the first failed write's OSError for the caller to
    raise: torch's zip writer, told of a failed write (a full disk), left itself unfinished, and
    its destructor then aborted the process (C++ terminate, a core dump) after the error line."""

    def __init__(self, file):
        super().__init__()
        self.file, self.error = file, None

    def writable(self):
        return True

    def seekable(self):  # torch.export.save wants a seekable buffer (it seeks to 0 at the end)
        return True

    def write(self, data):
        if self.error is None:
            try:
                self.file.write(data)
            except OSError as exc:
                self.error = exc
        return len(data)

    def seek(self, offset, whence=io.SEEK_SET):
        return self.file.seek(offset, whence) if self.error is None else 0


def _point_external_data_at(proto, location):
    """Rename the file the graph's external tensors live in to ``location``; whether any do."""
    found = False
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == 'location':
                entry.value, found = location, True
    return found


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter prints its progress lines to stdout; keep export's output to its own lines."""
    with open(os.devnull, 'w') as sink, contextlib.redirect_stdout(sink):
        yield


def check_onnx(model, path, in_channels, sizes):
    """Max abs difference of the ONNX file's logits vs PyTorch at each ``(H, W)``; raises over 1e-4."""
    forward, _ = load_onnx(path)
    worst = 0.0
    for batch, (h, w) in zip((1, 3, 2), sizes):
        x = torch.randn(batch, in_channels, h, w)
        with torch.no_grad():
            expected = model(x)
        got = forward(x)
        if got.shape != expected.shape:
            raise ConfigError(f'--format onnx: the export gives shape {tuple(got.shape)} for input {tuple(x.shape)}, '
                              f'PyTorch {tuple(expected.shape)}; this model cannot be exported with dynamic sizes.')
        worst = max(worst, float((got - expected).abs().max()))
    if worst >= TOLERANCE:
        raise ConfigError(f'--format onnx: the export differs from PyTorch by {worst:.2e} (>= {TOLERANCE}) at '
                          'another input size; refusing to write it (this model traces shape-dependent code).')
    return worst


class OnnxForward:
    """``forward(images_BCHW) -> logits_BKHW`` on torch tensors through an onnxruntime session
    (CPU), so :func:`ds_seg.inference.predict_scene` runs an exported model like a module."""

    def __init__(self, path, threads=None):
        import onnxruntime as ort
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(path, options, providers=['CPUExecutionProvider'])

    def __call__(self, images_BCHW):
        array = images_BCHW.detach().to('cpu', torch.float32).contiguous().numpy()
        logits = self.session.run([OUTPUT], {INPUT: array})[0]
        return torch.from_numpy(logits).to(images_BCHW.device)


def load_onnx(path, threads=None):
    """An exported ``.onnx`` file -> ``(forward, info)`` with ``info`` as
    :func:`ds_seg.inference.load_model` gives it (classes, model, data: bands/mean/std).

    Example::

        forward, info = load_onnx('unet.onnx')
        logits_BKHW = forward(torch.randn(1, 3, 512, 512))
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f'--checkpoint: {path} does not exist')
    try:
        import onnxruntime  # noqa: F401
    except ImportError:  # the file may be fine: the runtime is what is missing
        raise ConfigError(f"--checkpoint {path}: running an ONNX model needs onnxruntime, which is not installed: "
                          f"{extra_hint('onnx')}") from None
    try:
        forward = OnnxForward(path, threads)
    except Exception as exc:  # onnxruntime's InvalidProtobuf, InvalidGraph, Fail: not a model it runs
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f'--checkpoint: {path} is not an ONNX model onnxruntime can load ({reason}); give a '
                          'file from ds-seg-export (launch/export.py) --format onnx') from None
    meta = forward.session.get_modelmeta().custom_metadata_map
    card = json.loads(meta['ds_seg']) if 'ds_seg' in meta else {}
    data = {k: card.get(k) for k in ('bands', 'mean', 'std', 'ignore_index', 'dtype', 'file_bands', 'colours',
                                     'label_decoding', 'file_alpha', 'num_dates', 'pixel_size_m')} \
        if card.get('mean') else None
    forward.size_divisor = int(card.get('input_multiple') or 1)   # (see ds_seg.inference.tiling.input_multiple)
    return forward, dict(classes=card.get('classes') or None, model=card.get('model'), data=data)


def export_torch(model, out, info, work_dir=None, step=None):
    """Write ``model`` as a ``torch.export`` program (``torch.export.load(out).module()``) with the
    batch, height and width left dynamic where the model allows (``Dim.AUTO``; the batch alone for
    a model of one input size), and the card.

    Example: ``export_torch(model, 'out/unet.pt2', info)``
    """
    from torch.export import Dim
    refuse_existing(out, *card_paths(out))
    model = model.eval().cpu()
    # The config's model type (UperNet), not the class that wraps it (Segmentor).
    name = (info.get('model') or {}).get('type') or type(model).__name__
    first, others, dims = _export_sizes(model, info)
    x = torch.randn(2, _in_channels(model, info), *first)
    try:
        program = torch.export.export(model, (x,), dynamic_shapes=({'BCHW'.index(d): Dim.AUTO for d in dims},))
    except Exception as exc:
        raise ConfigError(f'--format torch-export: {name} cannot be exported: '
                          f'{str(exc).splitlines()[0][:200]}') from exc
    try:
        worst = 0.0
        for size in others:
            y = torch.randn(1, x.shape[1], *size)
            with torch.no_grad():
                worst = max(worst, float((program.module()(y) - model(y)).abs().max()))
    except Exception as exc:  # torch.export specialised a size (a shape guard failed)
        raise ConfigError(f'--format torch-export: {name} does not keep height/width dynamic '
                          f'({str(exc).splitlines()[0][:160]}).') from exc
    if worst >= TOLERANCE:
        raise ConfigError(f'--format torch-export: the program differs from the model by {worst:.2e}.')
    from .inputs import partial_path, remove_quietly
    tmp = partial_path(out)  # ds_seg's own name: '<out>.tmp.pt2' replaced a user's file of that name
    try:
        with open(tmp, 'wb') as f:
            sink = _WriteErrorKept(f)
            torch.export.save(program, sink)
            if sink.error is not None:
                raise sink.error
    except BaseException as exc:  # e.g. a Python math op on sizes the serialiser does not know
        remove_quietly(tmp)
        if not isinstance(exc, Exception) or isinstance(exc, OSError):  # a failed write: the disk's
            raise
        raise ConfigError(f'--format torch-export: {name} exports but cannot be saved '
                          f'({str(exc).splitlines()[0][:160]}); use --format onnx.') from exc
    os.replace(tmp, out)
    card = model_card(dict(info, input_multiple=input_multiple(model)), 'torch-export', out, work_dir, step, dims)
    if 'H' in dims:  # traced at twice the coarsest stride: checked to hold from there up; below it
        # a program may fail with torch's raw shape guard (SegFormer's at 61 px, UNet's not at 8)
        card['input']['min_size'] = list(first)
    write_card(card, out)
    return out

