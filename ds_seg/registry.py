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
    cls = lookup(registry, name, where=f'{where}.type')
    for key, value in extra.items():  # what the caller injects is a default: the config wins
        kwargs.setdefault(key, value)
    _check_kwargs(cls, kwargs, where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise  # already one line naming the file or key
        # A value of the wrong type or range ('16' for an int, a list for a count): name the
        # section and its values rather than show the traceback from deep inside the class.
        given = ', '.join(f'{k}={v!r}' for k, v in cfg.items() if k != 'type')
        detail = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise ConfigError(f"{where} ({name}): cannot be built with {given or 'its defaults'}: {detail}; "
                          f"check the values under {where}.") from exc


def _check_kwargs(cls, kwargs, where):
    # A class whose __init__ passes **kw on to its base's (SyntheticAerial -> GeoTiffScenes)
    # accepts what the chain accepts; a typo there was the base's TypeError, without a suggestion.
    accepted = []
    for owner in (cls.__mro__ if inspect.isclass(cls) else (cls,)):
        target = owner.__init__ if inspect.isclass(cls) else owner
        if inspect.isclass(cls) and '__init__' not in vars(owner):
            continue
        params = inspect.signature(target).parameters
        accepted += [n for n, p in params.items() if n != 'self' and n not in accepted
                     and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    else:
        return  # **kw all the way down (or to object): anything may be meant
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ''
            raise RegistryError(f"{where}.{key}: {cls.__name__} has no argument {key!r}.{hint} "
                                f"It accepts: {', '.join(accepted)}.")
