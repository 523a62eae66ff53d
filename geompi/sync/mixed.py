"""MixedSync: synchronous inside a datacenter, asynchronous between datacenters.

Worker side (MixedWorker): as FSA with the optimizer on the servers (gradient buckets pushed
from backward hooks, parameters pulled after); at the end every worker receives the final
global model.
Server side: the local server deposits its datacenter's gradient into the global servers' RMA
windows and fetches the parameters its own update produced, without waiting for the other
datacenters (the mechanism: geompi.ps.async_tier); the global servers step (the allow-list, or
DCASGD) on each deposit, with the hyperparameters of the datacenter that made it (its first
worker sends them when a schedule changes them, as a counted control message ahead of the
deposit): the policy ``MixedDeposits`` below.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from geompi.errors import ConfigError, positive_number
from geompi.ps.optim import (
    DCASGD,
    SGD,
    ServerOptimizer,
    Spec,
    spec_from_dict,
    spec_to_dict,
    step_gradient,
)
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
            reqs.pull(b.params)
        if e.aux_len:
            reqs.pull(e.aux_recv)
        reqs.wait()
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
    # stepped with its own datacenter's (MixedDeposits).
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

    def check_replication(self) -> None:
        raise ConfigError(
            f"global_replicas=2 with {self.name} is not supported yet: the one-sided global "
            "tier keeps one copy of each shard; use geompi.FSA() or HFA, or global_replicas=1"
        )

    def worker(self, engine: Engine) -> WorkerSide:
        return MixedWorker(engine)

    def on_restore(self, algorithm: dict) -> bool:
        """DCASGD: every datacenter's backup restarts from the restored model (a backup is
        the model a datacenter last fetched, which a new run has not fetched)."""
        if not self.dcasgd:
            return False
        algorithm["dcasgd"] = {"backup": True}
        return True

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
        policies = {
            "local_policy": self.local_policy(),
            "global_policy": self.global_policy(),
            "async_policy": self.async_policy(),
        }
        return build_server(topo, comms, stats, max_staleness=staleness, **policies, **common)

    def async_policy(self) -> MixedDeposits:
        """What the global servers do with each deposit (geompi.ps.policy.AsyncPolicy)."""
        return MixedDeposits()

    def wan_pattern(self, global_servers: int) -> WanPattern:
        """One deposit and one fetch a step, the whole model each way. Latencies
        (geompi.ps.async_tier, geompi.comm.rma): the deposit's data one way, then per global
        server its ticket (a round trip) and pending flag (one way) and a poll of the counters
        (a round trip), and the fetch's request and data (a round trip): 3 + 5 G."""
        return WanPattern("MixedSync", steps=1, shares=(1.0,), trips=3 + 5 * global_servers)


# ---- the server policy (geompi.ps.policy.AsyncPolicy) ------------------------------------------
DEPOSIT_LOG = "GEOMPI_TEST_DEPOSIT_LOG"
Hyper = tuple[Spec, list[Spec]]  # an optimizer's spec and its param groups' (ServerOptimizer)


class StalenessStats:
    """Staleness of the applied deposits as a histogram and per-datacenter figures.

    A list of every update grew without bound (about 1 GB a day at the soak's rate) and went
    to rank 0 as one JSON line. Exact counts up to ``EXACT``, then power-of-two buckets, so
    the size is bounded by about EXACT + 64 entries.
    """

    EXACT = 64

    def __init__(self, num_dcs: int) -> None:
        self.hist: dict[str, int] = {}
        self.count = [0] * num_dcs
        self.total = [0] * num_dcs
        self.max = [0] * num_dcs
        self.at_first_done: list[int] | None = None

    @classmethod
    def bucket(cls, s: int) -> str:
        if s < cls.EXACT:
            return str(s)
        lo = 1 << (s.bit_length() - 1)
        return f"{lo}-{2 * lo - 1}"

    def record(self, dc: int, staleness: int) -> None:
        b = self.bucket(staleness)
        self.hist[b] = self.hist.get(b, 0) + 1
        self.count[dc] += 1
        self.total[dc] += staleness
        self.max[dc] = max(self.max[dc], staleness)

    def renumber(self, kept: list[int]) -> None:
        """Keep the figures of the datacenters ``kept`` (old numbers), in their order (after a
        recovery); the histogram keeps every deposit applied."""
        self.count = [self.count[d] for d in kept]
        self.total = [self.total[d] for d in kept]
        self.max = [self.max[d] for d in kept]
        if self.at_first_done is not None:
            self.at_first_done = [self.at_first_done[d] for d in kept]

    def first_done(self, applied: list[int]) -> None:
        """The deposits applied per datacenter when the first one finished (once)."""
        if self.at_first_done is None:
            self.at_first_done = list(applied)

    def as_dict(self) -> dict:
        n = sum(self.count)
        return {
            "staleness_histogram": dict(
                sorted(self.hist.items(), key=lambda kv: int(kv[0].split("-")[0]))
            ),
            "staleness_updates": n,
            "max_staleness_seen": max(self.max, default=0),
            "mean_staleness": sum(self.total) / n if n else 0.0,
            "staleness_per_dc": [
                {"updates": c, "mean": t / c if c else 0.0, "max": m}
                for c, t, m in zip(self.count, self.total, self.max)
            ],
            "updates_at_first_done": self.at_first_done or list(self.count),
        }


class MixedDeposits:
    """MixedSync's global server policy: what one datacenter's deposit does to this shard.

    Each deposit is stepped by the hosted optimizer on its gradient averaged over the
    deposit's samples, with its datacenter's own hyperparameters (the job's until that
    datacenter's first worker sends new ones, as a schedule changes them) and its number
    (DCASGD compensates with what that datacenter last held: ``pulled``). A mean key (the
    workers' buffers) is kept per datacenter: each fetches back its own mean, so its buffers
    follow its own data as in one synchronous datacenter, and the final model carries their
    sample-weighted mean. Also the staleness figures, and the test hook
    ``GEOMPI_TEST_DEPOSIT_LOG=DIR``: the deposits in applied order (kept only then: it grows).
    """

    def __init__(self) -> None:
        self.start(None, 0)

    def start(self, optimizer: ServerOptimizer | None, num_dcs: int) -> None:
        self.optimizer = optimizer
        self.job_hyper: Hyper | None = None
        if optimizer is not None:
            self.job_hyper = (optimizer.spec, optimizer.groups)
        self.dc_hyper: dict[int, Hyper] = {}
        self.dc_means: dict[int, dict[int, tuple[float, torch.Tensor]]] = {}  # key -> dc ->
        self.mean_init: dict[int, torch.Tensor] = {}
        self.staleness = StalenessStats(num_dcs)  # bounded, however long the run
        self.deposits: list[dict] | None = [] if os.environ.get(DEPOSIT_LOG) else None
        self.dc_names = list(range(num_dcs))  # each one's number at the job's start

    def hyperparameters(self, dc: int, spec: dict | None) -> None:
        """Step ``dc``'s deposit with its own hyperparameters: ``spec`` if it brings new ones,
        else those it had before (the job's if it never sent any)."""
        if spec is not None:
            groups = [spec_from_dict(g) for g in spec.get("groups") or []] or None
            main = spec_from_dict(spec["optimizer"])
            self.dc_hyper[dc] = (main, groups or [main])
        if self.optimizer is None:
            return
        want = self.dc_hyper.get(dc, self.job_hyper)
        if want is not None and want != (self.optimizer.spec, self.optimizer.groups):
            self.optimizer.update(*want)

    def step(
        self,
        dc: int,
        key: int,
        value: torch.Tensor,
        total: torch.Tensor,
        weight: float,
        flags: int,
        present: list[bool] | None,
    ) -> None:
        step_gradient(self.optimizer, key, value, total, weight, flags, dc, present)

    def mean(
        self, dc: int, key: int, value: torch.Tensor, total: torch.Tensor, weight: float
    ) -> None:
        init = self.mean_init.setdefault(key, value.clone())  # only changed here
        means = self.dc_means.setdefault(key, {})
        if weight > 0:  # weight 0: a skipped deposit keeps what the datacenter had
            means[dc] = (weight, total / weight)
        value.copy_(means[dc][1] if dc in means else init)

    def pulled(self, dc: int, key: int, held: torch.Tensor) -> None:
        """DCASGD's backup of ``dc``: with a codec its replica, else the values themselves."""
        if self.optimizer is not None:
            self.optimizer.pulled(key, dc, held)

    def applied(
        self,
        dc: int,
        ticket: int,
        weight: float,
        keys: list[int],
        staleness: int,
        recovering: bool,
    ) -> None:
        self.staleness.record(dc, staleness)
        if self.deposits is not None:
            self.deposits.append(
                {"dc": self.dc_names[dc], "ticket": ticket, "weight": float(weight), "keys": keys,
                 "in_recovery": recovering}
            )  # fmt: skip

    def done(self, applied: list[int]) -> None:
        self.staleness.first_done(applied)

    def renumber(self, kept: list[int]) -> None:
        new = {d: i for i, d in enumerate(kept)}
        self.dc_names = [self.dc_names[d] for d in kept]
        self.dc_hyper = {new[d]: h for d, h in self.dc_hyper.items() if d in new}
        self.dc_means = {
            k: {new[d]: m for d, m in means.items() if d in new}
            for k, means in self.dc_means.items()
        }
        self.staleness.renumber(kept)
        if self.optimizer is not None:
            self.optimizer.renumber_dcs(new)

    def finish(self, values: dict[int, torch.Tensor]) -> None:
        """Every mean key's value becomes the datacenters' latest means, weighted by the
        samples of the deposit that brought each (in datacenter order, so every owner agrees)."""
        for key, means in self.dc_means.items():
            if means:
                total = sum(w for w, _ in means.values())
                value = sum(m * (w / total) for _, (w, m) in sorted(means.items()))
                values[key].copy_(cast(torch.Tensor, value))

    def report(self) -> dict:
        return self.staleness.as_dict()

    def write_log(self, index: int, bounds: dict[int, tuple[int, int]]) -> None:
        """``DIR/deposits-g<index>.json``: the applied deposits (dc, ticket, weight, keys) in
        order, and this server's slice of each key."""
        directory = os.environ.get(DEPOSIT_LOG)
        if not directory:
            return
        with open(os.path.join(directory, f"deposits-g{index}.json"), "w") as f:
            json.dump({"index": index, "bounds": bounds, "deposits": self.deposits}, f)
