"""The algorithms a user picks in ``geompi.DistributedOptimizer(..., sync=...)``: their settings.

Each is a small dataclass: what the servers need to know (``job()``) and what the optimizer
spec sent to the global servers holds (``spec()``). ``resolve`` turns ``"fsa"``, ``"hfa"`` or
``"mixed"`` (or an instance) into one; it is the only place that maps names to algorithms.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from geompi.errors import ConfigError
from geompi.ps.optim import DCASGD, SGD, Adam, AdamW, Spec, spec_to_dict


@dataclass(frozen=True)
class FSA:
    """Fully synchronous: every step, the sample-weighted gradient of every worker.

    The user's optimizer runs on every worker over the aggregated gradient (as torch DDP does),
    so any ``torch.optim`` optimizer, param groups and schedulers behave exactly as in one
    process.
    """

    name: ClassVar[str] = "fsa"
    # "workers" (default): the user's optimizer on every worker over the global gradient;
    # "servers": GeoMX's placement, the optimizer and its state sharded on the global servers.
    optimizer: str = "workers"

    def job(self) -> dict:
        return {"sync": self.name}

    def validate(self) -> None:
        if self.optimizer not in ("workers", "servers"):
            raise ConfigError(f"FSA(optimizer={self.optimizer!r}): choose workers or servers")

    @property
    def on_servers(self) -> bool:
        return self.optimizer == "servers"


@dataclass(frozen=True)
class HFA:
    """Hierarchical frequency aggregation: K1 local steps of the user's optimizer, then a
    datacenter average; every K2-th datacenter average is a global one."""

    name: ClassVar[str] = "hfa"
    on_servers: ClassVar[bool] = False
    k1: int = 8
    k2: int = 4
    weighting: str = "samples"  # or "uniform": every datacenter the same (GeoMX's)
    outer_optimizer: str = "sgd"  # or "nesterov" (DiLoCo's outer step)
    outer_lr: float = 1.0
    reset_optimizer: bool = False  # clear the local optimizer state at every global average
    fragments: int = 1  # streaming: F fragments of the model, global on staggered rounds
    overlap: bool = False  # streaming: a fragment's global result merges one round later
    mix: float = 1.0  # streaming with overlap: mix * global + (1 - mix) * local

    def job(self) -> dict:
        streaming = {"fragments": self.fragments, "overlap": self.overlap, "mix": self.mix}
        return {"sync": self.name, "k2": self.k2, "streaming": streaming}

    def outer(self) -> dict:
        return {"name": self.outer_optimizer, "lr": self.outer_lr}

    def validate(self) -> None:
        for what, v in (("k1", self.k1), ("k2", self.k2)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"HFA({what}={v!r}): must be a whole number >= 1")
        if self.weighting not in ("samples", "uniform"):
            raise ConfigError(f"HFA(weighting={self.weighting!r}): choose samples or uniform")
        if self.outer_optimizer not in ("sgd", "nesterov"):
            raise ConfigError(
                f"HFA(outer_optimizer={self.outer_optimizer!r}): choose sgd or nesterov"
            )
        if not math.isfinite(self.outer_lr) or self.outer_lr <= 0:
            raise ConfigError(f"HFA(outer_lr={self.outer_lr!r}): must be a finite number > 0")
        check_streaming(self.fragments, self.overlap, self.mix, self.k2, "HFA(", ")")


def check_streaming(
    fragments: int, overlap: bool, mix: float, k2: int, pre: str = "--", post: str = ""
) -> None:
    """Streaming HFA's settings, for the API (``HFA(fragments=...)``) and the CLI flags."""

    def name(s: str) -> str:
        return f"{pre}{s if pre != '--' else 'hfa-' + s}{post}"

    if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
        raise ConfigError(f"{name('fragments')} {fragments!r}: must be a whole number >= 1")
    if not (isinstance(mix, int | float) and 0 < mix <= 1):
        raise ConfigError(f"{name('mix')} {mix!r}: must be in (0, 1] (1 replaces)")
    if overlap and k2 < 2:
        raise ConfigError(
            f"{name('overlap')} needs k2 >= 2: a fragment's global result merges at its next "
            "datacenter round, which must not be global again"
        )


@dataclass(frozen=True)
class MixedSync:
    """Synchronous inside a datacenter, asynchronous between datacenters: the global servers
    run the optimizer (SGD, Adam or AdamW as the user built it, or DCASGD) on each deposit."""

    name: ClassVar[str] = "mixed"
    on_servers: ClassVar[bool] = True
    dcasgd: bool = False  # delay-compensated SGD with the user's SGD learning rate
    dcasgd_lambda: float = 0.04
    dcasgd_adaptive: bool = False
    max_staleness: int | None = None

    def job(self) -> dict:
        return {"sync": self.name, "max_staleness": self.max_staleness}

    def validate(self) -> None:
        if self.max_staleness is not None and (
            not isinstance(self.max_staleness, int) or self.max_staleness < 1
        ):
            raise ConfigError(f"MixedSync(max_staleness={self.max_staleness!r}): must be >= 1")

    def spec(self, optimizer: torch.optim.Optimizer) -> Spec:
        """The global servers' optimizer, read from the user's (one param group)."""
        spec = server_spec(optimizer, "MixedSync")
        if self.dcasgd:
            if not isinstance(spec, SGD) or spec.momentum:
                raise ConfigError(
                    "MixedSync(dcasgd=True) takes its lr from a torch.optim.SGD without "
                    "momentum: build torch.optim.SGD(params, lr=...)"
                )
            return DCASGD(
                lr=spec.lr,
                lam=self.dcasgd_lambda,
                adaptive=self.dcasgd_adaptive,
                weight_decay=spec.weight_decay,
            )
        return spec


Algorithm = FSA | HFA | MixedSync
REGISTRY: dict[str, type] = {cls.name: cls for cls in (FSA, HFA, MixedSync)}


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
    if not isinstance(sync, FSA | HFA | MixedSync):
        raise ConfigError(f"sync={sync!r}: pass a name or geompi.FSA/HFA/MixedSync(...)")
    sync.validate()
    return sync


def server_spec(optimizer: torch.optim.Optimizer, who: str) -> Spec:
    """The JSON-able spec of a user's optimizer, for algorithms whose servers run it."""
    if len(optimizer.param_groups) != 1:
        raise ConfigError(
            f"{who} runs the optimizer on the global servers, which take one param group; "
            f"this optimizer has {len(optimizer.param_groups)}: use one group"
        )
    g = optimizer.param_groups[0]
    kind = getattr(optimizer, "_geompi_base", type(optimizer))  # the user's class
    if kind is torch.optim.SGD:
        return SGD(
            lr=float(g["lr"]),
            momentum=float(g["momentum"]),
            weight_decay=float(g["weight_decay"]),
            nesterov=bool(g["nesterov"]),
            dampening=float(g["dampening"]),
        )
    if kind in (torch.optim.Adam, torch.optim.AdamW) and not g.get("amsgrad"):
        cls = AdamW if kind is torch.optim.AdamW else Adam
        return cls(
            lr=float(g["lr"]),
            betas=tuple(float(b) for b in g["betas"]),
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
        )
    raise ConfigError(
        f"{who} runs the optimizer on the global servers, which know torch.optim.SGD, Adam and "
        f"AdamW (without amsgrad); got {kind.__name__}: use one of those, or sync='fsa'/'hfa'"
    )


def describe(sync: Algorithm) -> dict:
    """A JSON-friendly description, for checkpoints and metrics."""
    return {"name": sync.name, **asdict(sync)}


def spec_json(spec: Spec) -> dict:
    return spec_to_dict(spec)
