"""HFA: hierarchical frequency aggregation. Each worker takes K1 local steps of the user's
optimizer, then its datacenter averages parameters (weighted by samples, or uniformly); every
K2-th datacenter average goes on to the global servers, which average across datacenters
(optionally through an outer optimizer, as in DiLoCo) and hold the global model.

Server side: the local server averages its datacenter every round and forwards every K2-th
average (streaming: one fragment of the model per round, on a staggered schedule, optionally
merged one round later); the global servers average datacenters and step the outer optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from geompi.errors import ConfigError
from geompi.ps.optim import make_spec, torch_optimizer
from geompi.sync.base import Algorithm
from geompi.sync.fsa import _sync_tier


@dataclass(frozen=True)
class HFA(Algorithm):
    """Hierarchical frequency aggregation: K1 local steps of the user's optimizer, then a
    datacenter average; every K2-th datacenter average is a global one."""

    name: ClassVar[str] = "hfa"
    local_steps: ClassVar[bool] = True
    k1: int = 8
    k2: int = 4
    weighting: str = "samples"  # or "uniform": every datacenter the same (GeoMX's)
    outer_optimizer: str = "sgd"  # or "nesterov" (DiLoCo's outer step)
    outer_lr: float = 1.0
    reset_optimizer: bool = False  # clear the local optimizer state at every global average
    fragments: int = 1  # streaming: F fragments of the model, global on staggered rounds
    overlap: bool = False  # streaming: a fragment's global result merges one round later
    mix: float = 1.0  # streaming with overlap: mix * global + (1 - mix) * local

    def period(self) -> int:
        return self.k1 * self.k2

    @property
    def streaming(self) -> bool:
        return self.fragments > 1 or self.overlap

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

    @classmethod
    def from_config(cls, cfg) -> HFA:
        return cls(
            k1=cfg.k1,
            k2=cfg.k2,
            weighting=cfg.hfa_weighting,
            outer_optimizer=cfg.outer_optimizer,
            outer_lr=cfg.outer_lr,
            reset_optimizer=cfg.hfa_reset_optimizer,
            fragments=cfg.hfa_fragments,
            overlap=cfg.hfa_overlap,
            mix=cfg.hfa_mix,
        )

    def server_spec(self, optimizer: torch.optim.Optimizer) -> dict | None:
        return {"outer": self.outer()}

    def cli_optimizer(self, cfg, params) -> tuple[object, dict]:
        """Each worker's inner optimizer, from the same spec a global server would use."""
        spec = make_spec(
            cfg.optimizer, cfg.effective_lr, cfg.effective_momentum, cfg.weight_decay, cfg.nesterov
        )
        return torch_optimizer(spec, params), self.server_spec(None)

    def make_server(self, topo, comms, stats, **common):
        from geompi.ps.servers import build_server  # MPI loads with the servers, not before

        streaming = {"fragments": self.fragments, "overlap": self.overlap, "mix": self.mix}
        return build_server(
            topo, comms, stats, k2=self.k2, streaming=streaming, **_sync_tier(common)
        )


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
