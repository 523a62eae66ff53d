"""HFA: hierarchical frequency aggregation. Each worker takes K1 local optimizer steps, then its
datacenter averages parameters (weighted by samples, or uniformly); every K2-th datacenter
average goes on to the global servers, which average across datacenters (optionally through an
outer optimizer, as in DiLoCo) and hold the full global model.
"""

from __future__ import annotations

import torch

from geompi.ps.client import PSClient
from geompi.ps.protocol import Op
from geompi.sync.base import Strategy


def uniform_weight(client: PSClient) -> float:
    """GeoMX's uniform weighting: every datacenter counts the same and, inside one, every
    worker (its local server divides by its own workers), so a worker weighs 1 / its
    datacenter's workers. The KVStore's HFA pushes use the same weight."""
    return 1.0 / (client.link.comm.Get_size() - 1)


class HFA(Strategy):
    name = "hfa"
    local_optimizer = True

    def __init__(
        self,
        *args,
        k1: int,
        k2: int,
        uniform: bool = False,
        reset_optimizer: torch.optim.Optimizer | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.k1, self.k2, self.uniform = k1, k2, uniform
        self.reset_optimizer = reset_optimizer  # the local optimizer to reset at global syncs
        self.steps = 0
        self.samples = 0
        self.dc_rounds = 0

    def after_step(self, n: int) -> None:
        self.steps += 1
        self.samples += n
        if self.steps % self.k1:
            return
        self.exchange(
            Op.AVG,
            uniform_weight(self.client) if self.uniform else float(self.samples),
            scale_params=True,
        )
        self.samples = 0
        self.dc_rounds += 1
        if self.dc_rounds % self.k2 == 0:
            self.global_syncs += 1
            if self.reset_optimizer is not None:
                self.reset_optimizer.state.clear()

    def state(self) -> dict:
        return {
            **super().state(),
            "steps": self.steps,
            "dc_rounds": self.dc_rounds,
            "samples": self.samples,
        }

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.steps = int(state.get("steps", 0))
        self.dc_rounds = int(state.get("dc_rounds", 0))
        self.samples = int(state.get("samples", 0))
