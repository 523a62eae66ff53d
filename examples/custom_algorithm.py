"""A synchronization algorithm from outside geompi, in one file: HFA whose global servers move
the global model towards the datacenters' average by at most ``clip`` per element (the
pseudo-gradient, global model - average, clipped elementwise), times the outer lr:

    global <- global - outer_lr * clamp(global - average, -clip, clip)

A datacenter whose model ran far (a bad batch, a spike) then drags the global model by at most
``clip`` per global average. Everything else is HFA's: K1 local steps, datacenter averages,
every K2-th one global.

Train with it through the Python API (this file, as a script):

    mpirun -n 7 python examples/custom_algorithm.py --steps 60

or through the CLI, from the repository root (the module is imported on every rank):

    mpirun -n 7 python -m geompi.train --sync examples.custom_algorithm:ClippedHFA \\
        --dc-sizes 3,2 --global-servers 2 --k1 2 --k2 2 --clip 0.005 --steps 40

(``--clip`` is the class's own flag: ``add_arguments`` below.)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import torch

import geompi
import geompi.sync
from geompi.errors import ConfigError


@geompi.sync.register
@dataclass(frozen=True)
class ClippedHFA(geompi.HFA):
    """HFA with an elementwise clip of the pseudo-gradient at the global servers."""

    name: ClassVar[str] = "clipped-hfa"
    clip: float = 0.01  # a setting: a dataclass field of a JSON value (it travels to the servers)

    def validate(self) -> None:
        super().validate()
        if isinstance(self.clip, bool) or not isinstance(self.clip, int | float):
            raise ConfigError(f"ClippedHFA(clip={self.clip!r}): must be a number > 0")
        if not self.clip > 0:
            raise ConfigError(f"ClippedHFA(clip={self.clip!r}): must be a number > 0")

    @classmethod
    def add_arguments(cls, parser) -> None:
        """Its own flag for the CLI (``--sync examples.custom_algorithm:ClippedHFA --clip X``):
        the dest names the field it sets; HFA's flags are there already."""
        parser.add_argument(
            "--clip",
            type=geompi.sync.number,
            default=None,
            help=f"the largest move of the global model per element and global average "
            f"(default {cls.clip:g})",
        )

    def outer_rule(
        self, value: torch.Tensor, average: torch.Tensor, spec: dict, state: dict
    ) -> None:
        """Runs on each global server, on its slice of one key: elementwise, so the shards
        need nothing from each other."""
        pseudo = (value - average).clamp_(-self.clip, self.clip)
        value.sub_(pseudo, alpha=float(spec["lr"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--clip", type=float, default=0.01)
    args = parser.parse_args()

    geompi.init(dc_sizes=(3, 2), global_servers=2)  # 2 + 1 workers, 2 local, 2 global servers
    w = geompi.worker_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = ClippedHFA(k1=2, k2=2, clip=args.clip)
    opt = geompi.DistributedOptimizer(inner, model, sync=sync)
    gen = torch.Generator().manual_seed(1 + w)  # each worker its own data
    loss_fn = torch.nn.CrossEntropyLoss()
    first = None
    for _ in range(args.steps):
        x = torch.randn(16, 8, generator=gen)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        first = float(loss) if first is None else first
    opt.close()  # ends on one global model
    total = sum(float(p.double().sum()) for p in model.parameters())
    print(
        f"custom_algorithm: worker {w} {sync.name} first_loss={first:.4f} "
        f"last_loss={float(loss):.4f} param_sum={total:.10e}",
        flush=True,
    )


if __name__ == "__main__":
    main()
