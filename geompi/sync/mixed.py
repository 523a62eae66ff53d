"""MixedSync: synchronous inside a datacenter, asynchronous between datacenters.

Worker side (MixedWorker): as FSA with the optimizer on the servers (gradient buckets pushed
from backward hooks, parameters pulled after); at the end every worker receives the final
global model.
Server side: the local server deposits its datacenter's gradient into the global servers' RMA
windows and fetches the parameters its own update produced, without waiting for the other
datacenters; the global servers step (the allow-list, or DCASGD) on each deposit, with the
hyperparameters of the datacenter that made it (its first worker sends them when a schedule
changes them, as a counted control message ahead of the deposit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from geompi.errors import ConfigError, positive_number
from geompi.ps.optim import DCASGD, SGD, spec_to_dict
from geompi.ps.protocol import Op
from geompi.sync.base import Algorithm, Engine, WanPattern, WorkerSide, whole_number
from geompi.sync.fsa import (
    FSAServersWorker,
    held_message,
    server_spec,
    servers_optimizer,
    spec_message,
)


class MixedWorker(FSAServersWorker):
    """MixedSync's worker side: FSA's with the optimizer on the servers, except that the
    datacenters move apart. Each datacenter's first worker sends its own hyperparameters (a
    deposit is stepped with its datacenter's); each datacenter counts its own rounds; at the
    end every worker receives the final global model (and the datacenters' buffers, averaged)
    in the STOP round."""

    where = "MixedSync"

    def init_spec(self) -> dict:
        spec = super().init_spec()
        if self.e.s.cfg.checkpoint_dir:  # the CLI's checkpoints: the last one is written after
            spec["final_snapshot"] = True  # close(), from the servers' final state they send
        return spec

    def sends_spec(self) -> bool:
        return self.e.master or self.e.dc_first

    def end(self) -> None:
        e = self.e
        reqs = e.client.start(Op.STOP, e.keys(presence=False))
        for b in e.buckets:
            e.client.pull(reqs, b.params)
        if e.aux_len:
            e.client.pull(reqs, e.aux_recv)
        e.client.wait(reqs)
        if e.aux_len:
            e.unpack_buffers(e.aux_recv, 1.0)

    def check_restore(self, what: str, new_model: bool) -> None:
        if self.e.rounds.begun:
            self.e.stop(
                ConfigError(
                    f"{what} under MixedSync after training started: the datacenters are "
                    "asynchronous by then; call it before the first step"
                )
            )

    def peers(self, comms):
        return comms.workers  # this datacenter's

    def last_done(self, done: int) -> int:
        """Collective over this datacenter's workers: the last round one of them completed."""
        import numpy as np
        from mpi4py import MPI

        mine = np.array([self.e.client.done_id], dtype=np.int64)
        self.e.s.comms.workers.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        return int(mine[0])

    def step_label(self, at: int) -> int | str:
        return f"{at} of datacenter 0"  # each datacenter at its own step: the master's


@dataclass(frozen=True)
class MixedSync(Algorithm):
    """Synchronous inside a datacenter, asynchronous between datacenters: the global servers
    run the optimizer (SGD, Adam or AdamW as the user built it, or DCASGD) on each deposit."""

    name: ClassVar[str] = "mixed"
    independent_dcs: ClassVar[bool] = True
    # Each datacenter's first worker sends its hyperparameters when they change; a deposit is
    # stepped with its own datacenter's (geompi.ps.async_tier).
    follows_hyperparameters: ClassVar[bool] = True
    default_momentum: ClassVar[float] = 0.5  # the CLI's: asynchrony adds implicit momentum
    left_with: ClassVar[str] = "the round under way (every deposit made before it is applied)"
    switch_flag: ClassVar[str | None] = "--mixed-sync"  # GeoMX's
    kvstore_type: ClassVar[str | None] = "dist_async"
    final_model_at_close: ClassVar[bool] = True
    dcasgd: bool = False  # delay-compensated SGD with the user's SGD learning rate
    dcasgd_lambda: float = 0.04
    dcasgd_adaptive: bool = False
    max_staleness: int | None = None  # None: geompi.init's (or GEOMPI_MAX_STALENESS)

    @property
    def on_servers(self) -> bool:
        return True

    def checkpoint_steps_problem(
        self, steps: list[int], step: int, dc_sizes: list[int]
    ) -> str | None:
        """Each datacenter is at its own step (the global servers' snapshot holds a number of
        deposits of each), the same for all of its workers, and datacenter 0 (the master's, which
        writes the file) at the checkpoint's."""
        per_dc = [size - 1 for size in dc_sizes]  # a datacenter's ranks: its workers + 1 server
        if sum(per_dc) != len(steps):
            return (
                f"/progress/steps has {len(steps)} workers but the topology attribute's "
                f"datacenters {dc_sizes} hold {sum(per_dc)}"
            )
        first = 0
        for dc, n in enumerate(per_dc):
            mine = steps[first : first + n]
            first += n
            if len(set(mine)) > 1 or (dc == 0 and mine and mine[0] != step):
                at = f"the checkpoint's step {step}" if dc == 0 else "one step"
                return (
                    f"/progress/steps of datacenter {dc} are {mine}, but its workers are all at "
                    f"{at}"
                )
        return None

    def check_survivable(self) -> None:
        """A lost worker or datacenter is survived: the global servers apply every deposit
        made, and each datacenter redoes, or completes from a peer, the round cut off."""

    def check_clipping(self, max_grad_norm: float | None) -> None:
        if max_grad_norm is not None:
            raise ConfigError(
                f"max_grad_norm with {self.name} is not supported: each deposit is one "
                "datacenter's gradient, not the global one; clip under geompi.FSA() or HFA"
            )

    def worker(self, engine: Engine) -> WorkerSide:
        return MixedWorker(engine)

    def validate(self) -> None:
        if self.max_staleness is not None and (
            not isinstance(self.max_staleness, int) or self.max_staleness < 1
        ):
            raise ConfigError(f"MixedSync(max_staleness={self.max_staleness!r}): must be >= 1")
        lam = self.dcasgd_lambda
        if not (lam == 0 or positive_number(lam)) or isinstance(lam, bool):
            raise ConfigError(f"MixedSync(dcasgd_lambda={lam!r}): must be a finite number >= 0")

    @classmethod
    def from_config(cls, cfg) -> MixedSync:
        # the optimizer: cli_optimizer's spec
        return cls(max_staleness=cfg.max_staleness, **cls.flag_settings(cfg))

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument(
            "--max-staleness",
            type=whole_number("--max-staleness"),
            help="most updates a datacenter may run ahead of the slowest (default unbounded)",
        )

    def server_spec(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The global servers' optimizer, read from the user's (DCASGD: one param group)."""
        held = held_message(optimizer)
        if held is not None:  # the CLI's flags: its spec as it is (DCASGD's too)
            return held
        if not self.dcasgd:
            return spec_message(optimizer, "MixedSync")
        spec = server_spec(optimizer, "MixedSync(dcasgd=True)")
        if not isinstance(spec, SGD) or spec.momentum:
            raise ConfigError(
                "MixedSync(dcasgd=True) takes its lr from a torch.optim.SGD without "
                "momentum: build torch.optim.SGD(params, lr=...)"
            )
        if spec.maximize:
            raise ConfigError(
                "MixedSync(dcasgd=True) does not implement SGD's maximize=True: minimize the "
                "negated loss instead"
            )
        dcasgd = DCASGD(
            lr=spec.lr,
            lam=self.dcasgd_lambda,
            adaptive=self.dcasgd_adaptive,
            weight_decay=spec.weight_decay,
        )
        return {"optimizer": spec_to_dict(dcasgd)}

    def cli_optimizer(self, cfg, params) -> torch.optim.Optimizer:
        return servers_optimizer(cfg, params)

    def make_server(self, topo, comms, stats, **common):
        from geompi.ps.servers import build_server  # MPI loads with the servers, not before

        default = common.pop("max_staleness", None)
        staleness = self.max_staleness if self.max_staleness is not None else default
        policies = {"local_policy": self.local_policy(), "global_policy": self.global_policy()}
        return build_server(
            topo, comms, stats, asynchronous=True, max_staleness=staleness, **policies, **common
        )

    def wan_pattern(self, global_servers: int) -> WanPattern:
        """One deposit and one fetch a step, the whole model each way. Latencies
        (geompi.ps.async_tier, geompi.comm.rma): the deposit's data one way, then per global
        server its ticket (a round trip) and pending flag (one way) and a poll of the counters
        (a round trip), and the fetch's request and data (a round trip): 3 + 5 G."""
        return WanPattern("MixedSync", steps=1, shares=(1.0,), trips=3 + 5 * global_servers)
