"""Checks of the files and options predict, evaluate and export are given, before any work.

Each raises ``ConfigError`` with one line naming the option or file and what to do; none of
them writes anything, so a refused command leaves every file as it was. Also how outputs are
written (:func:`replaced_when_done`): under a temporary name, renamed when complete.
"""
import contextlib
import glob
import json
import os

from .config import ConfigError

# The commands an installed wheel has as console scripts (setup.py CONSOLE_SCRIPTS).
CONSOLE_COMMANDS = ('train', 'predict', 'evaluate', 'export', 'benchmark', 'models')


def as_invoked(text):
    """``text`` with the checkout's commands (``python launch/predict.py``, ``launch/export.py``)
    named as this program's user has them: a program started as a console script (``ds-seg-*``,
    an installed wheel, which has no launch/ folder) names ``ds-seg-predict``, ``python -m
    ds_seg.cli.<name>`` for the others, and after torchrun or deepspeed, which take a script path,
    their module forms (``torchrun ... -m ds_seg.cli.predict``, ``deepspeed --module ...``)."""
    import re
    import sys
    program = sys.argv[0] or ''
    # Also a module run (python -m / torchrun -m / deepspeed --module ds_seg.cli.x: its argv[0] is
    # the module's file), the forms the README gives an installed package for many ranks.
    as_module = os.path.dirname(os.path.abspath(program)) == os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cli')
    if not text or not (os.path.basename(program).startswith('ds-seg-') or as_module):
        return text

    def named(match):
        name = match.group(2)
        before = match.string[match.string.rfind('\n', 0, match.start()) + 1:match.start()]
        # The launcher's own command: its name, then only its options, then the script; not the
        # word in prose ("a deepspeed checkpoint ... export it (launch/export.py)").
        if not match.group(1) and re.search(r'\b(torchrun|deepspeed)(\s+--?[\w.-]+(=\S+|\s+[^-\s]\S*)?)*\s+$', before):
            return f"{'-m' if 'torchrun' in before else '--module'} ds_seg.cli.{name}"
        return f'ds-seg-{name}' if name in CONSOLE_COMMANDS else f'python -m ds_seg.cli.{name}'
    return re.sub(r'(python3? )?launch/(\w+)\.py', named, text)

GEOTIFF_SUFFIXES = ('.tif', '.tiff', '.gtiff')
# What a folder given as input stands for: GeoTIFFs and JPEG 2000 orthophotos (as national mapping
# agencies publish them). Not VRTs: one beside its own source tiles would count them twice.
FOLDER_SUFFIXES = GEOTIFF_SUFFIXES + ('.jp2',)
_TIFF_MAGIC = (b'II*\x00', b'MM\x00*', b'II+\x00', b'MM\x00+')  # classic TIFF and BigTIFF


def looks_like_tiff(path):
    try:
        with open(path, 'rb') as f:
            return f.read(4) in _TIFF_MAGIC
    except OSError:
        return False


def is_torch_export_archive(path):
    """Whether ``path`` is a ``torch.export.save`` archive (a zip holding ``<name>/archive_format``).
    A zip like torch.save's, so torch.load's complaint ("failed locating file data.pkl ...
    corrupted") would send the user hunting for a damaged file that is fine."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith('/archive_format') for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def looks_like_onnx(path, head):
    """An ONNX file: named ``.onnx``, or a protobuf ModelProto, which opens with field 1
    (``ir_version``, a varint: byte 0x08) as onnx writes it."""
    return path.lower().endswith('.onnx') or head[:1] == b'\x08'


# What to say of one, after its path (predict/evaluate/export's --checkpoint, load_from).
TORCH_EXPORT_PROGRAM = ('is a torch.export program (launch/export.py --format torch-export; run it with '
                        'torch.export.load(path).module()), not a weights file; give the weights file '
                        '(launch/export.py --format weights), an .onnx export or the run instead')


def written_by_predict(path):
    """Whether ``path`` is a class map (``*_classes.tif``) or probabilities (``*_probs.tif``)
    that predict wrote: by its name and the tags predict gives them."""
    import rasterio
    name = os.path.basename(path).lower()
    if not name.endswith(('_classes.tif', '_probs.tif')):
        return False
    try:
        with rasterio.open(path) as src:
            tags = src.tags()
    except rasterio.errors.RasterioError:
        return False
    return 'classes' in tags and ('nodata_class' in tags or tags.get('scale') == '1/250')


def split_dates(item):
    """The dates of one ``--input`` scene joined by commas (``a_may.tif,a_aug.tif``), where a
    comma inside a URL's query (a signed URL: ``...?X-Amz-Credential=a,b``) belongs to the URL;
    a part that is neither a URL nor an existing file goes on the URL before it.

    Example::

        split_dates('a.tif,b.tif')                    # ['a.tif', 'b.tif']
        split_dates('https://h/a.tif?sig=x,y')        # ['https://h/a.tif?sig=x,y']
    """
    from .data.raster import is_remote
    dates = []
    for part in item.split(','):
        if (dates and is_remote(dates[-1]) and '?' in dates[-1] and not is_remote(part)
                and not os.path.exists(os.path.expanduser(part))):
            dates[-1] += ',' + part
        else:
            dates.append(part)
    return dates


def folder_rasters(folder, what=None):
    """The GeoTIFFs and JPEG 2000 files directly inside ``folder``, sorted: what a folder given
    for scenes (predict, evaluate, a dataset's images/labels) stands for. Hidden files are not
    scenes, as a shell's or Python's ``*.tif`` glob has it (macOS leaves ``._a.tif`` beside
    ``a.tif`` on other disks: not a raster). A symbolic link to nothing among them is refused,
    naming ``what`` (the option or key): it was left out without a word, and the metrics of a
    folder of links into a partly unmounted dataset covered fewer scenes."""
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(FOLDER_SUFFIXES) and not n.startswith('.'))
    for name in names:
        refuse_dangling_link(os.path.join(folder, name), what)
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


def refuse_dangling_link(path, what=None):
    """One line where ``path`` is a symbolic link whose target does not exist."""
    if os.path.islink(path) and not os.path.exists(path):
        from .data.raster import DataError
        raise DataError(f"{what + ': ' if what else ''}{path} is a symbolic link to {os.readlink(path)}, which does not "
                        "exist (a disk not mounted, a file moved?); restore it, or remove the link.")


def expand_inputs(paths, option='--input'):
    """Paths as given, with a directory standing for the GeoTIFFs directly inside it (sorted).
    Each file must exist, be non-empty and readable to its last pixel (a truncated download
    fails here, not hours later).

    Example::

        expand_inputs(['scenes/', 'extra.tif'])   # -> ['scenes/a.tif', 'scenes/b.tif', 'extra.tif']
    """
    import rasterio
    from rasterio.windows import Window

    from .data.raster import gdal_message, gdal_path, is_remote, opening_env, read_error

    def scenes_only(path, found):
        """Scenes, not predict's own outputs: a folder (or glob) predicted into itself holds the
        earlier run's class maps. Labels (evaluate's --labels) may well be class maps."""
        if option == '--labels':
            return found, []
        earlier = [f for f in found if written_by_predict(f)]
        if earlier and os.environ.get('RANK', '0') == '0':  # before any process group: one rank says it
            print(f"[ds_seg] {option}: {path}: left out {len(earlier)} class map(s) or probabilities an earlier "
                  f"predict wrote ({', '.join(os.path.basename(f) for f in earlier[:3])}"
                  f"{', ...' if len(earlier) > 3 else ''})", flush=True)
        return [f for f in found if f not in earlier], earlier

    files = []
    for path in paths:
        refuse_dangling_link(path, option)
        if os.path.isdir(path):
            found, earlier = scenes_only(path, folder_rasters(path, option))
            if not found:
                raise ConfigError(f"{option}: folder {path} holds no GeoTIFF or JPEG 2000 raster "
                                  f"({', '.join(FOLDER_SUFFIXES)})" + (" but predict's own outputs" if earlier else "")
                                  + "; give other rasters (.vrt, .png...) by name or glob.")
            files += found
        elif not os.path.exists(path) and not is_remote(path) and glob.has_magic(path):
            # A quoted glob (the shell left it alone): what the datasets and evaluate.py expand too.
            matches = sorted(glob.glob(os.path.expanduser(path)))
            for match in matches:
                refuse_dangling_link(match, option)
            found, earlier = scenes_only(path, [f for f in matches if os.path.isfile(f)])
            if not found:
                raise ConfigError(f"{option}: the pattern {path} matches no file"
                                  + (" but predict's own outputs." if earlier else "."))
            files += found
        elif (not os.path.exists(path) and ',' in path
              and (all(os.path.exists(p) for p in path.split(',')) if not is_remote(path)
                   else len(split_dates(path)) > 1)):
            # URLs too (a comma in a signed URL's query is the URL's): they were fetched as one, a 404.
            raise ConfigError(f"{option}: {path} joins files by commas, which predict.py reads as the dates of "
                              "one scene; here give a time series by --config whose data.val has "
                              "images=[[a_may.tif, a_aug.tif], ...].")
        elif not os.path.exists(path) and not is_remote(path):
            raise ConfigError(f'{option}: {path} does not exist.')
        else:
            files.append(path)
    for path in files:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise ConfigError(f'{option}: {path} is empty (0 bytes); copy or download it again.')
        try:
            with opening_env(path), rasterio.open(gdal_path(path)) as src:
                src.read(1, window=Window(src.width - 1, src.height - 1, 1, 1))
        except rasterio.errors.RasterioError as exc:
            if is_remote(path):
                raise ConfigError(f'{option}: {path} cannot be read: {read_error(path, exc)}') from exc
            kind = _not_a_raster(path)
            if kind:
                advice = ("give --config instead, whose data.val reads it (GeoTiffScenes with stac=... or "
                          "labels='....gpkg')" if option in ('--images', '--labels') else
                          "give the rasters it points to (files or URLs)")
                raise ConfigError(f"{option}: {path} is {kind}, not a raster; {advice}.") from exc
            # GDAL's own words (a VRT's missing source file), not rasterio's "See previous exception"
            raise ConfigError(f'{option}: {path} is not a readable raster (truncated or corrupt?): '
                              f'{gdal_message(exc)}') from exc
    return files


def _not_a_raster(path):
    """'a STAC document' or 'a vector layer' for files of those kinds, else None."""
    lower = path.lower()
    if lower.endswith(('.gpkg', '.geojson', '.fgb', '.shp', '.parquet')):
        return 'a vector layer'
    if lower.endswith('.json'):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return None
        if isinstance(doc, dict) and ('stac_version' in doc or doc.get('type') == 'FeatureCollection'):
            return 'a STAC document' if 'stac_version' in doc or any(
                'stac_version' in (feat or {}) for feat in doc.get('features') or []) else 'a vector layer'
    return None


def _name_parts(path):
    """The folder and file names that can name an output: a URL's path without its query
    (``https://h/x/a.tif?token=...`` -> ``x``, ``a.tif``), else the absolute path's."""
    if '://' in path:
        from urllib.parse import unquote, urlsplit
        url = urlsplit(path)
        return [url.netloc] + [unquote(n) for n in url.path.split('/') if n]
    return os.path.normpath(os.path.abspath(path)).split(os.sep)


def output_stems(inputs):
    """One output name stem per input, unique even when two inputs share a file name (parent
    folder names are prepended to the clashing ones: ``a/x.tif``, ``b/x.tif`` -> ``a_x``, ``b_x``)
    or differ only in the extension (``x.tif``, ``x.png`` -> ``x_tif``, ``x_png``). Only the
    same file given twice is refused. An input may be a list of dates (one scene of a time
    series): named after its first date, refused only when every date repeats another scene's."""
    from .data.raster import same_file_key
    scenes = [tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in inputs]
    keys = [tuple(same_file_key(d) for d in scene) for scene in scenes]
    for key in keys:
        twice = [','.join(scenes[j]) for j, other in enumerate(keys) if other == key]
        if len(twice) > 1:
            what = 'scene' if len(key) > 1 else 'file'
            raise ConfigError(f'--input: {", ".join(twice)} are the same {what} given twice; give it once.')
    inputs = [scene[0] for scene in scenes]
    parts = [_name_parts(p) for p in inputs]
    # x.tif next to x.png: no parent folder tells them apart, the extension does
    roots = [os.path.splitext(os.sep.join(q))[0] for q in parts]
    keep_ext = [sum(r == other and p != q for other, q in zip(roots, parts)) > 0 for r, p in zip(roots, parts)]
    depth = [1] * len(inputs)

    def stem(i):
        names = parts[i][-depth[i]:]
        root, ext = os.path.splitext(names[-1])
        names[-1] = root + (ext.replace('.', '_') if keep_ext[i] else '')
        return '_'.join(n for n in names if n)

    def bare(i):  # the stem without the extension that may tell it from a neighbour
        names = parts[i][-depth[i]:]
        return '_'.join([*names[:-1], os.path.splitext(names[-1])[0]])

    while True:
        # Files of one name in other folders take their folder names, whatever else shares the
        # name (a/x.tif, b/x.tif, a/x.TIF -> a_x_tif, b_x, a_x_TIF). Scenes of one first date (two
        # time series sharing a baseline) cannot be told apart by its name: numbered below.
        clashing = [i for i in range(len(inputs)) if depth[i] < len(parts[i]) and
                    any(bare(j) == bare(i) and roots[j] != roots[i] for j in range(len(inputs)))]
        if not clashing:
            break
        for i in clashing:
            depth[i] += 1
    stems = [stem(i) for i in range(len(inputs))]
    # Different files whose joined names still clash (/d/a/x.tif, /d/a_x.tif): numbered, with a
    # number no other input's name already has (a_x_2 next to a file named a_x_2.tif).
    taken, unique = set(stems), []
    for i, s in enumerate(stems):
        if s in stems[:i]:
            n = stems[:i].count(s) + 1
            while f'{s}_{n}' in taken:
                n += 1
            s = f'{s}_{n}'
            taken.add(s)
        unique.append(s)
    return unique


def check_outputs(outputs, inputs, overwrite=False, option='--output'):
    """Refuse outputs that would replace an input, or (without ``overwrite``) an existing file."""
    real_inputs = {os.path.realpath(p) for p in inputs if os.path.exists(p)}
    other = 'another output folder' if option == '--output' else 'another name'
    for out in outputs:
        if os.path.realpath(out) in real_inputs:
            raise ConfigError(f'{option}: writing {out} would replace the input of the same name; choose {other}.')
        if os.path.islink(out):   # even one to nothing: found only after the whole prediction, as "written by another process"
            raise ConfigError(f'{option}: {out} is a link (to {os.readlink(out)}); an output never replaces a link '
                              f'or writes through one: remove it or choose {other}.')
        if os.path.isdir(out):
            raise ConfigError(f'{option}: {out} is a folder; move it or choose {other}.')
        if os.path.exists(out) and not overwrite:
            flag = 'add --overwrite' if option.startswith('--') else 'pass overwrite=True'
            raise ConfigError(f'{option}: {out} already exists; choose {other}, delete it, or {flag}.')


# Names that say "a file": given as a folder that does not exist yet, a folder of that name would
# be made (pred.tif/scene_classes.tif), which is not what the name asked for.
_FILE_SUFFIXES = GEOTIFF_SUFFIXES + ('.png', '.jpg', '.jpeg', '.vrt', '.json', '.gpkg', '.geojson', '.fgb')


def missing_folder(folder):
    """Why ``folder`` (which is no folder) cannot be written into, in words: it does not exist,
    or a file stands where it or a folder above it would be (``scene.tif/sub``)."""
    folder = os.path.abspath(folder)
    above = folder
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if os.path.exists(above) and not os.path.isdir(above):
        return f'{above} is a file, not a folder: nothing can be written under it; choose another path'
    return f'the folder {folder} does not exist; create it first'


def check_output_folder(folder, option='--output'):
    if not folder.strip():  # '' failed after the model was loaded: "[Errno 2] No such file or directory: ''"
        raise ConfigError(f'{option} is empty; give a folder for the outputs.')
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f'{option}: {folder} is a file, not a folder; give a folder for the outputs.')
    if not os.path.exists(folder) and folder.lower().endswith(_FILE_SUFFIXES):
        raise ConfigError(f'{option}: {folder} names a file, but {option} is the folder the outputs are written '
                          f'into; give a folder, e.g. {os.path.splitext(folder)[0]}/')
    parent = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(parent):
        raise ConfigError(f'{option}: {missing_folder(parent).replace("the folder", "the parent folder")}.')


def user_path(text):
    """argparse ``type`` of a path option: ``~`` and ``~user`` expanded. A shell leaves them as
    they are in ``--work-dir=~/runs`` and inside quotes (``"$WORK_DIR"`` in a batch script): a
    folder named ``~`` was created in the current directory (an invitation to ``rm -rf ~``)."""
    return os.path.expanduser(text)


def run_folder_holding(path, folders):
    """``(work dir, folder)`` of another run one of whose ``folders`` (names inside its work dir:
    'checkpoints', 'tb'...) is ``path`` or holds it, or None."""
    path = os.path.realpath(path)
    while True:
        parent = os.path.dirname(path)
        # A ds_seg run's: its resolved configs beside the folder (a user's own 'checkpoints'
        # folder under a project with some tool's config.json is not one).
        if os.path.basename(path) in folders and all(
                os.path.isfile(os.path.join(parent, name)) for name in ('config.json', 'ds_config.json')):
            return parent, os.path.basename(path)
        if parent == path:
            return None
        path = parent


def run_whose_checkpoints_hold(work_dir):
    """The work dir of another run whose ``checkpoints`` folder is ``work_dir`` or holds it, or None."""
    found = run_folder_holding(work_dir, ('checkpoints',))
    return found and found[0]


def refuse_inside_run_logs(work_dir):
    """Refuse a ``--work-dir`` inside another run's ``tb`` or ``previous`` folder: TensorBoard
    showed the nested run as the other's, whose next fresh start moves ``tb`` (with the nested
    run's checkpoints) into ``previous/<time>/``."""
    found = run_folder_holding(work_dir, ('tb', 'previous'))
    if found is not None:
        run, folder = found
        raise ConfigError(f"--work-dir: {work_dir} is inside the {folder}/ folder of the run in {run}, which that run "
                          f"{'logs its TensorBoard events to and moves aside' if folder == 'tb' else 'keeps earlier runs in'}"
                          f"; choose a folder outside {os.path.join(run, folder)}.")


def refuse_inside_checkpoints(path, option):
    """Refuse an output ``path`` inside a ds_seg run's ``checkpoints`` folder: that run's saves,
    rollbacks and keep_checkpoints pruning move and delete its step folders, and with them
    anything written there (an export beside its checkpoint, an evaluation of it)."""
    run = run_whose_checkpoints_hold(path)
    if run is not None:
        raise ConfigError(f"{option}: {path} is inside the checkpoints of the run in {run}, whose saves, rollbacks "
                          f"and keep_checkpoints pruning move and delete folders there (and what they hold); "
                          f"choose a folder outside {os.path.join(run, 'checkpoints')}"
                          + ('.' if option == '--work-dir' else f", e.g. {os.path.join(run, 'exports')}"))


def broken_link_words(path):
    """Why the symbolic link ``path`` leads nowhere, as the end of a refusal: to nothing, or
    round a loop (``ln -s x x`` was said to point at something "purged, or not mounted")."""
    import errno
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (f'{path} is a symbolic link that leads round a loop back to itself ({path} -> '
                    f'{os.readlink(path)}); remove the link, or point it at a folder.')
    return (f'{path} is a symbolic link to {os.readlink(path)}, which does not exist (purged, or not mounted '
            'here); mount or create it, or remove the link.')


def check_writable(folder, option='--output', create=False):
    """Refuse, before any work, a folder this process cannot write into (a read-only mount, a
    path under a file, /proc): a probe file (or, for a folder still to be made, a probe folder
    in its parent) is created and removed, so root is judged by what the file system does,
    not by permission bits. Nothing is left behind, unless ``create``: the folder (and its
    parents) is made first, as a training run's work dir is."""
    import tempfile
    if os.path.islink(folder) and not os.path.exists(folder):
        raise ConfigError(f'{option}: {broken_link_words(folder)}')
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise ConfigError(f'{option}: {folder} is a file, not a folder; give a folder (a new one is created).')
    where = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
    try:
        if create:
            os.makedirs(folder, exist_ok=True)
        if os.path.isdir(folder):
            fd, probe = tempfile.mkstemp(prefix='.ds_seg_write_test', dir=folder)
            os.close(fd)
            os.remove(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix='.ds_seg_write_test', dir=where))
    except OSError as exc:
        # The probe's errno, said as the probe's: "/proc is not writable (No such file or directory)"
        # read as if /proc were missing.
        tried = ('making it' if create and not os.path.isdir(folder) else 'creating a file in it'
                 if os.path.isdir(folder) else f'creating a folder in {where}')
        raise ConfigError(f'{option}: {folder} is not writable ({tried} failed: {exc.strerror or exc}); choose a '
                          'folder you can write to.') from exc


def run_token():
    """This process's mark in its temporary names: a hash of the host and the process id. Two
    commands writing the same output at once each write their own file, and a leftover of a killed
    one is told apart from a live one's (:func:`remove_stale_partials`)."""
    import socket
    import zlib
    return f'{zlib.crc32(socket.gethostname().encode()):08x}-{os.getpid()}'


PARTIAL = '.ds_seg-partial'
_NAME_MAX = 255


def partial_path(path, token=None):
    """Where an output is written until it is complete (``a_classes.tif`` ->
    ``a_classes.ds_seg-partial-<host>-<pid>.tif``: same folder, and the extension stays for the
    format's driver). A name of ds_seg's own: a user's ``survey.partial.gpkg`` beside ``--vector
    survey.gpkg`` was deleted without a word when partial names were plain ``.partial``. Two runs
    writing one output at once wrote one partial file: each run now has its own (``token``, the
    same on every rank of a run: :func:`run_token` of rank 0). A name too long for the file system
    with the mark gets a short hidden one."""
    root, ext = os.path.splitext(path)
    name = f'{root}{PARTIAL}-{token or run_token()}{ext}'
    if len(os.path.basename(name)) + len('.part000') <= _NAME_MAX:  # a rank's part file is longer still
        return name
    import hashlib
    short = hashlib.sha1(os.path.basename(path).encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(path), f'{PARTIAL}-{token or run_token()}-{short}{ext}')


def remove_stale_partials(path):
    """Remove what killed runs left of ``path`` (partial files and ranks' part files): those of
    this host whose process is gone, and the unmarked ones of older versions. Live runs' files,
    here or on other hosts sharing the folder, stay."""
    import glob
    import hashlib
    import re
    folder, name = os.path.split(path)
    root, ext = os.path.splitext(name)
    short = hashlib.sha1(name.encode()).hexdigest()[:16]
    host = run_token().split('-')[0]
    part = r'(\.part\d+)?'
    for old in glob.glob(os.path.join(glob.escape(folder or '.'), f'*{PARTIAL}*')):
        base = os.path.basename(old)
        if re.fullmatch(re.escape(root + PARTIAL + ext) + part, base):   # an older version's
            remove_quietly(old)
            continue
        m = (re.fullmatch(re.escape(root + PARTIAL) + r'-([0-9a-f]{8})-(\d+)' + re.escape(ext) + part, base)
             or re.fullmatch(re.escape(PARTIAL) + r'-([0-9a-f]{8})-(\d+)-' + short + re.escape(ext) + part, base))
        if m and m.group(1) == host and not _alive(int(m.group(2))):
            remove_quietly(old)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_quietly(*paths):
    """Remove what a failed write left (files that may not exist)."""
    for path in paths:
        if path and os.path.exists(path):
            os.remove(path)


def publish(moves, overwrite):
    """Give finished outputs their final names: ``moves`` = [(partial, final), ...], all or none.
    With ``overwrite`` a final name is replaced. Without it, one that another process wrote while
    this one worked (a second command into the same folder) is never replaced: a hard link takes
    the name only where it is free; this run's finals linked so far are removed again, its
    partials are left to the caller, and one line says what happened."""
    done = []
    try:
        for tmp, final in moves:
            if overwrite:
                os.replace(tmp, final)
                continue
            try:
                os.link(tmp, final)
            except FileExistsError:
                raise FileExistsError(f'{final} was written by another process while this run worked (two runs '
                                      f'into one output folder?); it is kept as it is, and this run wrote none of '
                                      f'its outputs') from None
            except OSError:  # a file system without hard links: the check and the rename are two steps
                if os.path.lexists(final):
                    raise FileExistsError(f'{final} was written by another process while this run worked; it is '
                                          f'kept as it is, and this run wrote none of its outputs') from None
                os.replace(tmp, final)
                done.append(final)
                continue
            done.append(final)
            os.remove(tmp)
    except BaseException:
        remove_quietly(*done)
        raise


@contextlib.contextmanager
def replaced_when_done(path, overwrite=True):
    """Yield :func:`partial_path` of ``path`` to write; give it the name ``path`` when the block
    succeeds (:func:`publish`), remove it when it fails (an error, Ctrl-C). An interrupted run
    leaves no valid-looking file under the final name, and an older file (``--overwrite``) is
    replaced only by the rename of a finished one.

    Example::

        with replaced_when_done('out/eval.json') as tmp, open(tmp, 'w') as f:
            json.dump(record, f)
    """
    remove_stale_partials(path)
    tmp = partial_path(path)
    try:
        yield tmp
        publish([(tmp, path)], overwrite)
    except BaseException:
        remove_quietly(tmp)
        raise


MAX_BLOCK = 4096  # px: the largest GeoTIFF tile (and block row) predict/evaluate write


def check_window_options(tile, overlap, batch_size, block=None, tile_said=None):
    """``tile_said``: how the overlap's refusal names a tile the user did not give with --tile."""
    if tile < 16:
        raise ConfigError(f'--tile must be at least 16 pixels, got {tile}.')
    if overlap is not None and not 0 <= overlap < tile:
        raise ConfigError(f'--overlap must be >= 0 and smaller than {tile_said or f"--tile ({tile})"}, got {overlap}: '
                          'each window has to move forward.')
    if batch_size < 1:
        raise ConfigError(f'--batch-size must be at least 1, got {batch_size}.')
    if block is not None and (block < 16 or block % 16):
        raise ConfigError(f'--block must be a multiple of 16 (GeoTIFF tiles), got {block}.')
    if block is not None and block > MAX_BLOCK:
        # Every reader of the class map (GDAL, QGIS, this tool) decodes a whole tile at once: a
        # 100000 px one took 10 GB to write a 384 px scene and as much to read it back.
        raise ConfigError(f'--block {block}: GeoTIFF tiles (and the rows held before a write) of at most '
                          f'{MAX_BLOCK} px; the default, 256, is what GDAL and QGIS read best.')


def check_checkpoint_option(path, option='--checkpoint'):
    """Name the usual mix-ups (a raster, a missing path) before anything is unpickled."""
    if not os.path.exists(path):
        folder, name = os.path.split(os.path.normpath(path))
        if name == 'best' and os.path.isdir(folder):  # said as export.py says it
            from .engine.checkpoint import BEST_NEVER_WRITTEN
            raise ConfigError(f"{option}: {path} {BEST_NEVER_WRITTEN}")
        raise ConfigError(f'{option}: {path} does not exist (give a weights file from launch/export.py, a step_* '
                          'folder, a checkpoints folder or a work dir).')
    if os.path.isfile(path) and looks_like_tiff(path):
        raise ConfigError(f'{option}: {path} is a TIFF raster, not model weights; did you swap --checkpoint and '
                          '--input?')
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ConfigError(f'{option}: {path} is empty (0 bytes).')
    if os.path.isfile(path) and is_torch_export_archive(path):
        raise ConfigError(f'{option}: {path} {TORCH_EXPORT_PROGRAM}')


def check_bands(path, bands, in_channels=None, option='--input', colours=None):
    """The bands the model was trained on must exist in the raster; ``colours``: what they held
    in the training files by their colour interpretation (checkpoint ``data.colours``), refused
    where this raster's tags say the selection holds others (a BGR scene for an RGB model)."""
    from .data.raster import alpha_as_data_refusal, colour_order_refusal, open_raster, pixel_type_refusal
    from rasterio.enums import ColorInterp
    # open_raster: a URL republished or gone since the inputs were checked is one line, not a traceback
    with open_raster(path) as src:
        count = src.count
        refusal = pixel_type_refusal(path, src.dtypes)
        if refusal:
            raise ConfigError(f'{option}: {refusal}')
        # One band of colour-table indices: the colours the model was trained on are in the table
        palette = count == 1 and src.colorinterp[0] == ColorInterp.palette
        wanted = list(bands) if bands else list(range(1, count + 1))
        if min(wanted) < 1 or max(wanted) > count:
            hint = (' It is a palette image (one band of colour-table indices): expand it to RGB first '
                    f'(gdal_translate -expand rgb {path} rgb.tif).' if palette else '')
            raise ConfigError(f'{option}: {path} has band(s) 1..{count} but the model reads bands {wanted} '
                              f'(recorded at training, or --bands).{hint}')
        if in_channels is not None and len(wanted) != in_channels:
            raise ConfigError(f'{option}: the model takes {in_channels} band(s) but {len(wanted)} are selected from '
                              f'{path} ({wanted}); give --bands with {in_channels} band numbers.')
        # As training refuses it: predict wrote nodata and evaluate left out every pixel where the band was 0.
        refusal = alpha_as_data_refusal(path, src, wanted, f'the bands the model reads ({wanted})') or \
            colour_order_refusal(path, [c.name for c in src.colorinterp], wanted, colours,
                                 f'the bands the model reads ({" ".join(map(str, wanted))})',
                                 'the model was trained on bands holding',
                                 lambda right: '--bands ' + ' '.join(map(str, right)))
        if refusal:
            raise ConfigError(f'{option}: {refusal}')
