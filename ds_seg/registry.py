"""Registries for everything a config can name, and the one way to build from them.

Example::

    from ds_seg.registry import MODELS, build
    model = build(MODELS, dict(type='UNet', in_channels=3, num_classes=6))

Registration happens by decorator where a class is defined (``@MODELS.register_module()``);
``import ds_seg`` imports every module that registers, so a lookup never fails because a file
was not imported.
"""
import difflib
import inspect

from mmengine.registry import Registry

from .config import ConfigError

MODELS = Registry('model', scope='ds_seg')
DATASETS = Registry('dataset', scope='ds_seg')
TRANSFORMS = Registry('transform', scope='ds_seg')
LOSSES = Registry('loss', scope='ds_seg')


class RegistryError(KeyError):
    """An unknown registry name or bad arguments for a registered class."""

    def __str__(self):  # KeyError would print the message with quotes around it
        return str(self.args[0])


def known_names(registry):
    return sorted(registry.module_dict)


def lookup(registry, name, where='type'):
    """Return the class registered under ``name``, or raise naming the known entries."""
    if not isinstance(name, str):  # was difflib's "'int' object is not iterable", a traceback
        raise RegistryError(f"{where}: a registered {registry.name} name (a string such as "
                            f"{known_names(registry)[0]!r}), got {name!r}")
    cls = registry.module_dict.get(name)
    if cls is None:
        known = known_names(registry)
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ''
        raise RegistryError(f"{where}: {name!r} is not a registered {registry.name}.{hint} "
                            f"Known {registry.name}s: {', '.join(known)}.")
    return cls


def build(registry, cfg, where=None, **extra):
    """Build ``cfg['type']`` from ``registry`` with the rest of ``cfg`` (and ``extra``) as kwargs.

    Unknown names and unknown keyword arguments raise :class:`RegistryError` with a message that
    names the config key (``where``), the known entries and close matches.
    """
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise RegistryError(f"{where or registry.name}: expected a dict with a 'type' key, got {cfg!r}")
    kwargs = dict(cfg)
    name = kwargs.pop('type')
    where = where or registry.name
    odd = [k for k in kwargs if not isinstance(k, str)]
    if odd:
        raise RegistryError(f"{where}: argument names are strings, got {odd[0]!r}")
    cls = lookup(registry, name, where=f'{where}.type')
    for key, value in extra.items():  # what the caller injects is a default: the config wins
        kwargs.setdefault(key, value)
    _check_kwargs(cls, kwargs, where, check_values=registry.name in VALUES_CHECKED_HERE)
    try:
        built = cls(**kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, (ConfigError, NotImplementedError, RecursionError)):
            raise  # already one line naming the file or key; or not about the values
        # A value of the wrong type or range ('16' for an int, a list for a count, a negative
        # width: torch's RuntimeError), named with the section and its values rather than shown
        # as the traceback from deep inside the class.
        given = ', '.join(f'{k}={v!r}' for k, v in cfg.items() if k != 'type')
        detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise ConfigError(f"{where} ({name}): cannot be built with {given or 'its defaults'}: {detail}; "
                          f"check the values under {where}.") from exc
    if registry is MODELS:
        # The name the config gave (UNetTiny builds a UNet): what lines about the model say.
        built.registered_as = name
    return built


def arguments(cls):
    """The keyword arguments ``cls`` (a registered class or function) accepts, name -> inspect
    parameter, or None where it takes ``**kw`` all the way down (anything may be meant). A class
    whose __init__ passes **kw on to its base's (SyntheticAerial -> GeoTiffScenes) accepts what
    the chain accepts."""
    accepted = {}
    for owner in (cls.__mro__ if inspect.isclass(cls) else (cls,)):
        target = owner.__init__ if inspect.isclass(cls) else owner
        if inspect.isclass(cls) and '__init__' not in vars(owner):
            continue
        params = inspect.signature(target).parameters
        accepted.update({n: p for n, p in params.items() if n != 'self' and n not in accepted
                         and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)})
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    else:
        return None
    # What a class gives its base itself (a benchmark's images, labels and classes) is no argument
    # of it, though the base takes it: "got multiple values for argument 'images'".
    return {n: p for n, p in accepted.items() if n not in getattr(cls, 'SETS_ITSELF', ())}


# Registries whose values are checked against the types of the arguments' defaults here
# (transforms check their own, each with its own words). A dataset's reduce_zero_label='False'
# was a true string: labels shifted by one without a word.
VALUES_CHECKED_HERE = ('model', 'backbone', 'head', 'dataset')


def _check_kwargs(cls, kwargs, where, check_values=False):
    # A typo in an argument a base class takes was the base's TypeError, without a suggestion.
    accepted = arguments(cls)
    for key, value in kwargs.items():
        if key in getattr(cls, 'SETS_ITSELF', ()):
            raise RegistryError(f"{where}.{key}: {cls.__name__} sets its {key} itself (from data_root and its "
                                f"layout); set {where}.data_root instead, or, for files of your own, "
                                f"type='GeoTiffScenes' with images and labels.")
        if accepted is not None and key not in accepted:
            close = difflib.get_close_matches(key, list(accepted), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ''
            raise RegistryError(f"{where}.{key}: {cls.__name__} has no argument {key!r}.{hint} "
                                f"It accepts: {', '.join(accepted)}.")
        if check_values:
            _check_value(f'{where}.{key}', value, accepted[key].default if accepted else inspect.Parameter.empty)


# Strings that mean a flag: 'False' from a command line or a YAML quote was a true (non-empty)
# string, so activation_checkpointing='False' turned checkpointing on without a word.
FLAG_WORDS = ('true', 'false', 'yes', 'no', 'on', 'off', '0', '1', 'none')


def _check_value(key, value, default):
    """A value against the type of its argument's default, and drop probabilities in [0, 1]:
    mistakes one step past a typo that otherwise build, then fail at the first step (drop_path_rate
    1.5: 'bernoulli_ expects p to be in [0, 1]'), train silently wrong, or fail inside the class
    with Python's words ("not all arguments converted during string formatting" for '16')."""
    if isinstance(default, bool):
        if isinstance(value, str) and value.strip().lower() in FLAG_WORDS:
            raise ConfigError(f"{key}: {value!r} is a string, which is always true; write True or False "
                              "without quotes.")
        # pretrained=1 failed inside the loader: "'int' object is not iterable".
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ConfigError(f"{key}: write True or False, got {value!r}.")
    elif isinstance(default, (int, float)) and isinstance(value, str):
        raise ConfigError(f"{key}: {value!r} is a string, not a number; write it without quotes.")
    elif isinstance(default, int) and (isinstance(value, bool)
                                       or isinstance(value, float) and not value.is_integer()):
        # A count, size or index: label_fill=1.9 became class 1 and True class 1, without a word.
        raise ConfigError(f"{key}: write a whole number, got {value!r}.")
    if key.rsplit('.', 1)[-1] == 'pretrained' and isinstance(value, str) and not value.strip():
        # An unset variable in a config ('pretrained': os.environ.get(...) or ''): random weights.
        raise ConfigError(f"{key} is an empty string, which loads nothing; give the weights file's path, True "
                          "(timm's download) or None (random initialisation).")
    if isinstance(value, dict):  # timm's keyword arguments (backbone_kwargs) hold drop rates too
        for inner, item in value.items():
            if isinstance(inner, str) and inner != 'type':
                _check_value(f'{key}.{inner}', item, inspect.Parameter.empty)
    elif 'drop' in key.rsplit('.', 1)[-1] and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and not 0 <= value <= 1:
        raise ConfigError(f"{key} is a probability, between 0 and 1; got {value}.")


def import_custom_modules(names, where='custom_imports', allow_failed=False):
    """Import the user's modules that register models or datasets (mmengine's
    ``custom_imports = dict(imports=['my_models'])``), each once; one line naming the module and
    what to do where one cannot be imported (``allow_failed``: skipped, as mmengine's
    ``allow_failed_imports``)."""
    import importlib
    import os
    import sys
    for name in names or ():
        try:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                # A module in the folder the command runs in: `python -m ds_seg.cli.train` (and
                # torchrun -m) found it there and the console scripts and sbatch jobs did not. Looked
                # for last, so it never shadows an installed module.
                here = os.getcwd()
                if exc.name != name.split('.')[0] or here in sys.path:
                    raise
                sys.path.append(here)
                importlib.import_module(name)
        except ImportError as exc:  # ModuleNotFoundError included
            if allow_failed:
                continue
            raise ConfigError(f"{where}: cannot import {name!r} ({type(exc).__name__}: {exc}); put the folder that "
                              "holds it on PYTHONPATH (or install it) where this command runs") from exc
        except Exception as exc:  # the module's own code: one line with its place, not a traceback
            raise ConfigError(_import_failure(where, name, exc)) from exc


def _import_failure(where, name, exc):
    """The line for a user's module whose import raised: a syntax error, a name its
    ``register_module()`` takes that ds_seg (or another module) already registered, or its own
    code's error, at the file and line where it happened."""
    import traceback
    if isinstance(exc, SyntaxError):
        return (f"{where}: cannot import {name!r}: {exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}; "
                "fix that line")
    said = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    if isinstance(exc, KeyError) and ' is already registered in ' in str(said):
        taken, _, rest = str(said).partition(' is already registered in ')
        registry, _, owner = rest.partition(' at ')
        return (f"{where}: {name!r} registers a {registry} named {taken}, a name {owner or 'another module'} "
                f"already registered; give the class another name (or register_module(force=True) to replace "
                "that one)")
    frames = traceback.extract_tb(exc.__traceback__)
    place = f' at {frames[-1].filename}:{frames[-1].lineno}' if frames else ''
    return f"{where}: importing {name!r} failed{place} ({type(exc).__name__}: {said}); fix the module"


def custom_modules_of(registry, name, listed=()):
    """``listed`` (a config's custom_imports) plus the module that registered ``name`` in
    ``registry`` where it is the user's own (not ds_seg's, timm's...): what a run's checkpoints
    record, so predict/evaluate/export can build its model wherever that module is importable."""
    out = list(listed or ())
    entry = registry.module_dict.get(name) if isinstance(name, str) else None
    module = getattr(entry, '__module__', None)
    if module and module.split('.')[0] != 'ds_seg' and module != '__main__' and module not in out:
        out.append(module)
    return out
