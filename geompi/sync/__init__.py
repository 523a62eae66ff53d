"""The synchronization algorithms, one module each (its worker-side settings and its servers),
on the interface of geompi.sync.base. The registry here is the one place that maps a name to an
algorithm: the CLI's ``--sync``, ``DistributedOptimizer(sync=...)`` and the servers' job."""

from __future__ import annotations

from geompi.errors import ConfigError
from geompi.sync.base import Algorithm
from geompi.sync.fsa import FSA
from geompi.sync.hfa import HFA
from geompi.sync.mixed import MixedSync

REGISTRY: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FSA, HFA, MixedSync)}


def resolve(sync: str | Algorithm) -> Algorithm:
    """An algorithm from its name (``fsa``, ``hfa``, ``mixed``) or an instance, validated."""
    if isinstance(sync, str):
        cls = REGISTRY.get(sync.lower())
        if cls is None:
            raise ConfigError(
                f"unknown sync {sync!r}: choose one of {', '.join(REGISTRY)} "
                "(or pass geompi.FSA(), geompi.HFA(k1=..., k2=...), geompi.MixedSync())"
            )
        sync = cls()
    if not isinstance(sync, Algorithm) or type(sync) not in REGISTRY.values():
        raise ConfigError(f"sync={sync!r}: pass a name or geompi.FSA/HFA/MixedSync(...)")
    sync.validate()
    return sync


def from_config(cfg) -> Algorithm:
    """The algorithm of the CLI's flags (``--sync`` and its settings)."""
    cls = REGISTRY.get(cfg.sync)
    if cls is None:
        raise ConfigError(f"unknown --sync {cfg.sync!r}: choose one of {', '.join(REGISTRY)}")
    return cls.from_config(cfg)


def from_job(job: dict) -> Algorithm:
    """The algorithm the master worker announced to the servers (``Algorithm.job()``)."""
    return REGISTRY[job["sync"]].from_settings(job.get("settings", {}))


__all__ = ["FSA", "HFA", "REGISTRY", "Algorithm", "MixedSync", "from_config", "from_job", "resolve"]
