"""The synchronization algorithms, one module each (its worker-side settings and its servers),
on the interface of :class:`geompi.sync.Algorithm`. The registry here is the one place that maps
a name to an algorithm: the CLI's ``--sync``, ``DistributedOptimizer(sync=...)`` and the
servers' job. An algorithm from outside the package joins it with :func:`register` (or is named
on the CLI as ``--sync pkg.module:Class``, which imports and registers it on every rank)."""

from __future__ import annotations

import importlib
import re
from typing import Any

from geompi.errors import ConfigError
from geompi.sync.base import Algorithm, ServerHeld, WorkerSide, number, whole_number
from geompi.sync.fsa import FSA
from geompi.sync.hfa import HFA
from geompi.sync.mixed import MixedSync

BUILTIN: tuple[type[Algorithm], ...] = (FSA, HFA, MixedSync)
REGISTRY: dict[str, type[Algorithm]] = {cls.name: cls for cls in BUILTIN}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` (a subclass of :class:`Algorithm` with its own ``name``) known to
    ``--sync``, ``DistributedOptimizer(sync=...)`` and the servers; returns it, so it can
    decorate the class. Registering the same class again is harmless; another class under a
    name already taken is a ConfigError."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)) or cls is Algorithm:
        raise ConfigError(
            f"geompi.sync.register({cls!r}): pass a subclass of geompi.sync.Algorithm"
        )
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name or ":" in name:
        raise ConfigError(
            f"geompi.sync.register({cls.__qualname__}): give the class its own name, e.g. "
            "name: ClassVar[str] = 'my-hfa' (no colon)"
        )
    known = REGISTRY.get(name.lower())
    if known is not None and known is not cls and _path(known) != _path(cls):
        raise ConfigError(
            f"geompi.sync.register({cls.__qualname__}): the name {name!r} is taken by "
            f"{_path(known)}: choose another"
        )
    REGISTRY[name.lower()] = cls
    return cls


def _path(cls: type) -> str:
    """``module:QualName``, how the servers import a class the registry lacks."""
    return f"{cls.__module__}:{cls.__qualname__}"


_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"


def load(spec: str, flag: str = "--sync") -> type[Algorithm]:
    """Import ``pkg.module:Class`` (every failure one ConfigError line) and register it."""
    where = f"{flag} {spec}"
    if not re.fullmatch(rf"{_DOTTED}:{_DOTTED}", spec):
        raise ConfigError(f"{where}: write MODULE:CLASS, e.g. mypkg.algos:MyHFA")
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module: one line
        text = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"{where}: cannot import {module} ({type(e).__name__}: {text}): put its directory "
            "on PYTHONPATH on every rank (mpirun -x PYTHONPATH)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {module} has no attribute {attr!r}: check the name")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Algorithm)):
        raise ConfigError(f"{where}: {attr} is not a subclass of geompi.sync.Algorithm")
    return register(obj)


def lookup(sync: str, flag: str = "--sync") -> type[Algorithm]:
    """The class of a ``--sync`` value: a registered name or ``pkg.module:Class``."""
    if ":" in sync:
        return load(sync, flag)
    cls = REGISTRY.get(sync.lower())
    if cls is None:
        raise ConfigError(
            f"unknown {flag} {sync!r}: choose one of {', '.join(REGISTRY)}, or pass "
            "pkg.module:Class (a geompi.sync.Algorithm)"
        )
    return cls


def family(sync: str) -> str:
    """The built-in algorithm a ``--sync`` value derives from (its flags are that one's):
    ``hfa`` for a subclass of HFA; an algorithm built on the base alone: its own name."""
    cls = lookup(sync)
    return next((c.name for c in cls.__mro__ if c in BUILTIN), cls.name)


def resolve(sync: str | Algorithm) -> Algorithm:
    """An algorithm from its name (``fsa``, ``hfa``, ``mixed``, a registered one) or an
    instance of a registered class, validated."""
    if isinstance(sync, str):
        sync = lookup(sync, "sync")()
    if not isinstance(sync, Algorithm) or type(sync) not in REGISTRY.values():
        if isinstance(sync, Algorithm):
            raise ConfigError(
                f"sync={type(sync).__qualname__}(...): register the class first "
                "(geompi.sync.register, or decorate it with @geompi.sync.register)"
            )
        raise ConfigError(f"sync={sync!r}: pass a name or geompi.FSA/HFA/MixedSync(...)")
    sync.validate()
    return sync


def from_config(cfg) -> Algorithm:
    """The algorithm of the CLI's flags (``--sync`` and its settings)."""
    return lookup(cfg.sync).from_config(cfg)


def declared(attr: str) -> list[tuple[type[Algorithm], Any]]:
    """Each registered class that itself gives a GeoMX spelling (``switch_variable``,
    ``switch_flag``, ``variables``, ``kvstore_type``, ``kvstore_takes``: see
    :class:`Algorithm`), with its value, in the order of registration. As ``name``, a class's
    own, not one it inherits: a subclass of HFA is not chosen by HFA's variable."""
    out = []
    for cls in dict.fromkeys(REGISTRY.values()):
        value = vars(cls).get(attr)
        if value:
            out.append((cls, value))
    return out


def kvstore_types() -> list[str]:
    """The KVStore types the registered algorithms train (``geompi.kv.create``'s choices)."""
    return [kind for _, kind in declared("kvstore_type")]


def for_kvstore(kind: str, cfg: Any = None) -> type[Algorithm]:
    """The algorithm a KVStore of type ``kind`` trains (geompi.kv.create): the one whose
    ``kvstore_type`` it is (an unknown type: one ConfigError line), unless the environment's
    algorithm (``cfg.sync``, a RunConfig's, as spelt) takes it over (``kvstore_takes``: HFA,
    chosen by MXNET_KVSTORE_USE_HFA=1, takes ``dist_sync``). An algorithm that takes types
    over refuses, in one line, a type it does not take: the two disagree."""
    own = {kind_: cls for cls, kind_ in declared("kvstore_type")}
    if kind not in own:
        raise ConfigError(
            f"unknown KVStore type {kind!r}: choose one of {', '.join(kvstore_types())}"
        )
    chosen = None if cfg is None else REGISTRY.get(cfg.sync)
    if chosen is None or chosen is own[kind]:
        return own[kind]
    takes = vars(chosen).get("kvstore_takes", ())
    if kind in takes:
        return chosen
    if takes:
        source = cfg.sources.get("sync", "sync")
        value = 1 if source == vars(chosen).get("switch_variable") else cfg.sync
        raise ConfigError(
            f"{kind} and {chosen.__qualname__} ({source}={value}) disagree: unset one"
        )
    return own[kind]


def from_job(job: dict) -> Algorithm:
    """The algorithm the master worker announced to the servers (``Algorithm.job()``); one
    from outside the package is imported from the path the job carries."""
    cls = REGISTRY.get(job["sync"])
    if cls is None or ("path" in job and _path(cls) != job["path"]):
        module, _, attr = job["path"].partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        cls = register(obj)  # refuses what is not an Algorithm subclass, in one line
    return cls.from_settings(job.get("settings", {}))


__all__ = [
    "FSA",
    "HFA",
    "REGISTRY",
    "Algorithm",
    "MixedSync",
    "declared",
    "family",
    "for_kvstore",
    "from_config",
    "from_job",
    "kvstore_types",
    "load",
    "lookup",
    "number",
    "register",
    "resolve",
    "ServerHeld",
    "whole_number",
    "WorkerSide",
]
