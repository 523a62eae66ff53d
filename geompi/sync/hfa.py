"""HFA: hierarchical frequency aggregation. Each worker takes K1 local steps of the user's
optimizer, then its datacenter averages parameters (weighted by samples, or uniformly); every
K2-th datacenter average goes on to the global servers, which average across datacenters
(optionally through an outer optimizer, as in DiLoCo) and hold the global model.

Server side: the local server averages its datacenter every round and forwards every K2-th
average (streaming: one fragment of the model per round, on a staggered schedule, optionally
merged one round later); the global servers average datacenters and step the outer optimizer.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from geompi.errors import MAX_LR, MAX_STEPS, ConfigError, positive_number
from geompi.ps.fragments import fragment_plan, is_global, shift
from geompi.ps.optim import SGD, Adam, AdamW, make_spec, torch_optimizer
from geompi.ps.policy import Routing
from geompi.ps.protocol import (
    FLAG_EXACT,
    FLAG_FLUSH,
    FLAG_GLOBAL,
    FLAG_MEAN,
    FLAG_STATS,
    MAX_KEYS,
    Op,
    Round,
)
from geompi.sync.base import Algorithm, Engine, WanPattern, WorkerSide, number, whole_number
from geompi.sync.fsa import _sync_tier

# HFA's default K2; with adaptive cadence, a K2 left at it starts clamped into [k2_min, k2_max]
K2_DEFAULT = 2


@dataclass(frozen=True)
class HFA(Algorithm):
    """Hierarchical frequency aggregation: K1 local steps of the user's optimizer, then a
    datacenter average; every K2-th datacenter average is a global one."""

    name: ClassVar[str] = "hfa"
    local_steps: ClassVar[bool] = True
    # GeoMX's: MXNET_KVSTORE_USE_HFA=1 chooses HFA, and with it a KVStore's dist_sync
    switch_variable: ClassVar[str | None] = "MXNET_KVSTORE_USE_HFA"
    variables: ClassVar[dict[str, tuple[str, ...]]] = {
        "k1": ("GEOMPI_HFA_K1", "MXNET_KVSTORE_HFA_K1"),
        "k2": ("GEOMPI_HFA_K2", "MXNET_KVSTORE_HFA_K2"),
    }
    kvstore_type: ClassVar[str | None] = "dist_sync_hfa"
    kvstore_takes: ClassVar[tuple[str, ...]] = ("dist_sync",)
    worker_state_section: ClassVar[str | None] = "hfa/local"  # each worker's own optimizer's
    k1: int = 4  # the one default of K1 and K2: the CLI's and the Slurm script's too
    k2: int = K2_DEFAULT
    weighting: str = "samples"  # or "uniform": every datacenter the same (GeoMX's)
    # The global servers' outer optimizer (DiLoCo's outer step), stepped on their shards with
    # (global model before the round - average of the datacenters) as its gradient: "sgd"
    # (lr 1 and no momentum: the plain average), "nesterov", "adam" or "adamw", or one of the
    # torch.optim classes SGD, Adam, AdamW; ``outer_kwargs``: its other settings (momentum,
    # dampening, weight_decay for SGD; betas, eps, weight_decay for Adam/AdamW).
    outer_optimizer: str = "sgd"
    outer_lr: float = 1.0
    outer_kwargs: dict = field(default_factory=dict)
    reset_optimizer: bool = False  # clear the local optimizer state at every global average
    fragments: int = 1  # streaming: F fragments of the model, global on staggered rounds
    overlap: bool = False  # streaming: a fragment's global result merges one round later
    mix: float = 1.0  # streaming with overlap: mix * global + (1 - mix) * local
    # Adaptive cadence: K2 (starting at k2) is re-chosen after every global average from the
    # time the local servers measured for a global exchange of the whole model and the compute
    # time of a datacenter round, so that exchanges take about ``wan_share`` of the wall time
    # (with overlap, of the link's: they hide behind compute): K2 = ceil(exchange / (wan_share
    # * round compute)), within [k2_min, k2_max]. Streaming's fragments go on the same cycle.
    adaptive: bool = False
    k2_min: int = 1
    k2_max: int = 64
    wan_share: float = 0.1

    def period(self) -> int:
        """Steps between the rounds where training may stop on one global model: K1*K2, or
        K1 with adaptive cadence or streaming (there the caller makes such a round global)."""
        return self.k1 if self.forces_global else self.k1 * self.k2

    @property
    def forces_global(self) -> bool:
        """Whether the CLI makes its checkpoint rounds and the last one global (FLAG_GLOBAL):
        no fixed round of adaptive cadence or streaming holds one global model."""
        return self.adaptive or self.streaming

    @property
    def streaming(self) -> bool:
        return self.fragments > 1 or self.overlap

    def __post_init__(self) -> None:
        # a torch.optim class of the allow-list stands for its name (the job is JSON)
        names = {cls: n for n, (cls, _) in OUTER_OPTIMIZERS.items() if n != "nesterov"}
        if isinstance(self.outer_optimizer, type) and self.outer_optimizer in names:
            object.__setattr__(self, "outer_optimizer", names[self.outer_optimizer])
        if isinstance(self.outer_kwargs, dict) and isinstance(
            self.outer_kwargs.get("betas"), list
        ):  # back from JSON
            kw = {**self.outer_kwargs, "betas": tuple(self.outer_kwargs["betas"])}
            object.__setattr__(self, "outer_kwargs", kw)

    def checkpoint_copies(self, optimizer_states: int, workers: int) -> int:
        """Each worker's own optimizer state, and the outer optimizer's on the global servers
        (at most two model-sized tensors: Adam's moments)."""
        return super().checkpoint_copies(optimizer_states, workers) + 2

    def outer(self) -> dict:
        """The outer optimizer's spec, as the global servers get it."""
        return {"name": self.outer_optimizer, "lr": self.outer_lr, **self.outer_kwargs}

    @property
    def outer_stateful(self) -> bool:
        """Whether the outer optimizer keeps state on the global servers (a checkpoint's)."""
        return bool(outer_state_names(self.outer()))

    def validate(self) -> None:
        counts = [("k1", self.k1), ("k2", self.k2)]
        if self.adaptive:
            counts += [("k2_min", self.k2_min), ("k2_max", self.k2_max)]
        for what, v in counts:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"HFA({what}={v!r}): must be a whole number >= 1")
        if self.weighting not in ("samples", "uniform"):
            raise ConfigError(f"HFA(weighting={self.weighting!r}): choose samples or uniform")
        if not positive_number(self.outer_lr):
            raise ConfigError(f"HFA(outer_lr={self.outer_lr!r}): must be a finite number > 0")
        check_outer(self.outer_optimizer, self.outer_kwargs)
        check_streaming(self.fragments, self.overlap, self.mix, self.k2, "HFA(", ")")
        if self.adaptive:
            given = None if self.k2 == K2_DEFAULT else self.k2  # the default is clamped
            check_adaptive(
                given, self.k2_min, self.k2_max, self.wan_share, self.overlap, _show_keyword
            )

    def check_survivable(self) -> None:
        if self.streaming or self.adaptive:
            raise ConfigError(
                "on_failure='continue' with HFA(fragments=..., overlap=True or adaptive=True): "
                "not supported together yet; drop them"
            )

    def check_force_global(self) -> None:
        """Allowed: the next datacenter average goes global (HFAWorker.force_global)."""

    def worker(self, engine: Engine) -> WorkerSide:
        return HFAWorker(engine)

    def next_k2(self, exchange_s: float, round_compute_s: float) -> int:
        """The K2 that makes a global exchange of ``exchange_s`` about ``wan_share`` of the wall
        time, when a datacenter round computes for ``round_compute_s`` (adaptive cadence)."""
        if exchange_s <= 0:
            return self.k2_min
        k2 = math.ceil(exchange_s / (self.wan_share * max(round_compute_s, 1e-9)))
        return max(self.k2_min, min(self.k2_max, k2))

    def kvstore_push(self, workers: int) -> tuple[Op, float, int]:
        """Parameters, which GeoMX's users push divided by ``kv.num_workers``: the local server
        sums them into the datacenter's average, and every K2-th one goes global."""
        return Op.AVG, 1.0 / workers, 0

    @classmethod
    def from_config(cls, cfg) -> HFA:
        return cls(
            k1=cfg.k1,
            k2=cfg.starting_k2,
            weighting=cfg.hfa_weighting,
            outer_optimizer=cfg.outer_optimizer,
            outer_lr=cfg.outer_lr,
            outer_kwargs={} if cfg.outer_momentum is None else {"momentum": cfg.outer_momentum},
            reset_optimizer=cfg.hfa_reset_optimizer,
            fragments=cfg.hfa_fragments,
            overlap=cfg.hfa_overlap,
            mix=cfg.hfa_mix,
            adaptive=cfg.adaptive_sync,
            k2_min=cfg.k2_min,
            k2_max=cfg.k2_max,
            wan_share=cfg.wan_share,
            **cls.flag_settings(cfg),  # a subclass's own flags (its add_arguments)
        )

    @classmethod
    def check_config(cls, cfg) -> None:
        """HFA's flags, in their words (the API's ``HFA(...)`` is checked by ``validate``)."""
        if cfg.optimizer == "dcasgd":
            raise ConfigError(
                "--optimizer dcasgd runs at the global server of --sync mixed (or fsa): "
                "use --sync mixed, or another --optimizer with hfa"
            )
        for name in ("k1", "k2"):
            cfg.require_whole(name, "--" + name)
            cfg.require_at_most_steps(name)
        if cfg.k1 * cfg.k2 > MAX_STEPS:
            raise ConfigError(
                f"--k1 {cfg.k1} x --k2 {cfg.k2} = {cfg.k1 * cfg.k2} steps between global "
                f"averages: must be at most {MAX_STEPS:.0e}"
            )
        if not positive_number(cfg.outer_lr):
            raise ConfigError(f"--outer-lr {cfg.outer_lr}: must be a finite number > 0")
        if cfg.outer_lr > MAX_LR:
            raise ConfigError(f"--outer-lr {cfg.outer_lr:g}: must be at most {MAX_LR:g}")
        check_streaming(cfg.hfa_fragments, cfg.hfa_overlap, cfg.hfa_mix, cfg.k2)
        if cfg.adaptive_sync:
            cfg.require_whole("k2_min", "--k2-min")
            cfg.require_whole("k2_max", "--k2-max")
            flags = {"adaptive": "--adaptive-sync", "fragments": "--hfa-fragments"}
            flags["overlap"] = "--hfa-overlap"

            def show(setting: str, value=None) -> str:
                return cfg.show(setting, value, flags.get(setting))

            k2 = cfg.k2 if "k2" in cfg.sources else None  # else its default, clamped
            check_adaptive(k2, cfg.k2_min, cfg.k2_max, cfg.wan_share, cfg.hfa_overlap, show)
        given = [f for f in ("k2_min", "k2_max", "wan_share") if f in cfg.sources]
        if given and not cfg.adaptive_sync:
            flags_given = "/".join(cfg.sources[f] for f in given)
            raise ConfigError(f"{flags_given} set --adaptive-sync's bounds: add --adaptive-sync")
        if cfg.hfa_weighting not in ("samples", "uniform"):
            raise ConfigError(
                f"unknown --hfa-weighting {cfg.hfa_weighting!r}: choose samples or uniform"
            )
        _check_outer_flags(cfg.outer_optimizer, cfg.outer_momentum)

    @classmethod
    def add_arguments(cls, parser) -> None:
        """HFA's flags (and streaming's, and adaptive cadence's); their values land in the
        RunConfig fields of the same names, which ``from_config`` reads."""
        add = parser.add_argument
        add(
            "--k1",
            type=whole_number("--k1"),
            help=f"local steps per datacenter average (default {cls.k1})",
        )
        add(
            "--k2",
            type=whole_number("--k2"),
            help=f"datacenter averages per global one (default {cls.k2})",
        )
        add(
            "--hfa-weighting",
            metavar="{samples,uniform}",
            help=f"uniform = GeoMX, every datacenter counts the same (default {cls.weighting})",
        )
        add(
            "--hfa-reset-optimizer",
            action="store_true",
            default=None,
            help="reset the local optimizer's state at each global sync (default off)",
        )
        add(
            "--outer-optimizer",
            metavar="{" + ",".join(OUTER_OPTIMIZERS) + "}",
            help="the global servers' outer optimizer, stepped on (global model - average of the "
            f"datacenters) (default {cls.outer_optimizer}: with lr 1, the plain average)",
        )
        add(
            "--outer-momentum",
            type=number,
            help="the outer sgd/nesterov optimizer's momentum (default 0 for sgd, 0.9 for "
            "nesterov)",
        )
        add("--outer-lr", type=number, help=f"outer learning rate (default {cls.outer_lr:g})")
        add(
            "--hfa-fragments",
            type=whole_number("--hfa-fragments"),
            help="streaming HFA: F fragments of the model, each global once per K2 datacenter "
            f"rounds on its own staggered round (default {cls.fragments}: plain HFA)",
        )
        add(
            "--hfa-overlap",
            action="store_true",
            default=None,
            help="streaming HFA: a fragment's global exchange runs during the next K1 local steps "
            "and merges at the next datacenter round (needs --k2 >= 2; default off)",
        )
        add(
            "--hfa-mix",
            type=number,
            help="streaming HFA with overlap: mix * global + (1 - mix) * local "
            f"(default {cls.mix:g}: replace)",
        )
        add(
            "--adaptive-sync",
            action="store_true",
            default=None,
            help="re-choose K2 after every global average from the measured WAN exchange and "
            "datacenter-round compute, so the exchange takes about --wan-share of the time "
            "(default off; starts at --k2, whose default is clamped into [--k2-min, --k2-max]; "
            "with streaming too)",
        )
        add(
            "--k2-min",
            type=whole_number("--k2-min"),
            help=f"--adaptive-sync: smallest K2 (default {cls.k2_min})",
        )
        add(
            "--k2-max",
            type=whole_number("--k2-max"),
            help=f"--adaptive-sync: largest K2 (default {cls.k2_max})",
        )
        add(
            "--wan-share",
            type=number,
            help="--adaptive-sync: the share of wall time the WAN exchange may take (with "
            "--hfa-overlap, of the link's time: it hides behind compute) "
            f"(default {cls.wan_share:g})",
        )

    def server_spec(self, optimizer: torch.optim.Optimizer) -> dict | None:
        return {"outer": self.outer()}

    def cli_optimizer(self, cfg, params) -> torch.optim.Optimizer:
        """Each worker's inner optimizer, from the same spec a global server would use."""
        spec = make_spec(
            cfg.optimizer, cfg.effective_lr, cfg.effective_momentum, cfg.weight_decay, cfg.nesterov
        )
        return torch_optimizer(spec, params)

    def outer_rule(
        self, value: torch.Tensor, average: torch.Tensor, spec: dict, state: dict
    ) -> None:
        """The global servers' step on one key of their shard at a global average: ``value``
        (this shard's slice of the global model before the round) becomes the new global
        model, in place; ``average``: the datacenters' average of the same slice; ``spec``:
        ``self.outer()``; ``state``: this key's own, kept between rounds (checkpointed under
        the names of torch's state: outer_momentum, outer_exp_avg, outer_exp_avg_sq,
        outer_step). This one steps the outer optimizer; a subclass may write its own rule
        (elementwise: each server holds one slice of every key)."""
        outer_step(value, average, spec, state)

    def local_policy(self) -> HFALocal:
        # adaptive: every round brings the K2 the workers chose (Round.k2), never this one
        k2 = 2**31 if self.adaptive else self.k2
        return HFALocal(k2, self.fragments, self.overlap, self.mix)

    def global_policy(self) -> OuterStep:
        return OuterStep(self.outer_rule)

    def make_server(self, topo, comms, stats, **common):
        from geompi.ps.servers import build_server  # MPI loads with the servers, not before

        policies = {"local_policy": self.local_policy(), "global_policy": self.global_policy()}
        return build_server(topo, comms, stats, **policies, **_sync_tier(common))

    def wan_pattern(self, global_servers: int) -> WanPattern:
        """A cycle of K2 datacenter rounds of K1 steps: plain HFA sends the whole model at the
        K2-th; streaming sends each fragment at its staggered round (geompi.ps.fragments), so
        the rounds that go global are the fragments' distinct shifts, each with its fragments'
        share; with overlap an exchange runs behind the next K1 steps."""
        f = self.fragments
        shifts = [shift(i, f, self.k2) for i in range(f)]  # equal fragments assumed
        shares = tuple(shifts.count(s) / f for s in sorted(set(shifts)))
        label = "HFA" if f == 1 and not self.overlap else "streaming HFA"
        return WanPattern(
            label,
            steps=self.k1 * self.k2,
            shares=shares,
            trips=2,
            hidden_steps=self.k1 if self.overlap else 0,
            lan_rounds=self.k2,
            sync_every=self.k1 * self.k2,
        )


class HFAWorker(WorkerSide):
    """HFA's worker side: ``step()`` runs the user's optimizer locally; after every K1-th step
    the datacenter averages its parameters and float buffers (an AVG round, weighted by samples
    or uniformly), and every K2-th average (adaptive: the K2 the workers chose, ``Cadence``)
    is global. Backward sends nothing: the engine counts samples and passes, and this side
    counts the steps."""

    pushes_gradients = False

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        algo = engine.algo
        assert isinstance(algo, HFA)  # HFA.worker built it
        self.algo = algo
        self.fragments = algo.fragments  # streaming: keys cut into equal fragments
        self.steps = 0
        self.dc_rounds = 0  # datacenter averages since the last forced global one
        self.samples = 0  # since the last average
        self.round_samples = 0.0  # the weight of the last average
        self.steps_at_global = 0  # the step of the last global average
        self.exact_at = 0  # the step of the last forced (uncompressed) global average
        self.cadence: Cadence | None = None  # adaptive: which averages go global
        if algo.adaptive:
            self.cadence = Cadence(algo, engine.s.comms.all_workers)
        # the next datacenter average goes global, every key (force_global_average: the CLI's
        # checkpoint rounds under adaptive cadence or streaming)
        self.global_next = False
        self.window_closes = False  # this backward completes a step
        self.average_due = False  # K1 steps done, the datacenter average not yet
        self.pushed_weight: float | None = None  # an average's weight, while under way
        # A stop between two global averages goes back to the last one, where there is one to
        # go back to: K2 > 1 (or adaptive) without streaming, whose fragments are global on
        # staggered rounds (no recent round holds one global model).
        self.rewinds_to_global = (algo.k2 > 1 or algo.adaptive) and not algo.streaming

    @property
    def holds_server_state(self) -> bool:
        return self.algo.outer_stateful

    def begin(self) -> None:
        if self.cadence is not None:
            self.cadence.start()

    def state(self) -> dict:
        out: dict = {"steps": self.steps, "dc_rounds": self.dc_rounds, "samples": self.samples}
        if self.cadence is not None:
            out["k2"] = self.cadence.k2
        return out

    def load_state(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))
        self.dc_rounds = int(state.get("dc_rounds", 0))
        self.steps_at_global = self.steps  # HFA's checkpoints are at global averages
        self.exact_at = self.steps
        self.samples = int(state.get("samples", 0))
        if self.cadence is not None:  # at a global average: K2 as it was chosen then
            self.cadence.restart(state.get("k2"))

    def force_global(self) -> None:
        self.global_next = True

    def before_forward(self) -> None:
        if self.average_due:  # a GradScaler skipped step() on this worker
            self.average_now()

    def backward_counts(self) -> None:
        self.window_closes = True

    def backward_ended(self) -> None:
        if not self.window_closes:
            return
        self.window_closes = False  # one step's gradients are complete on every worker
        self.steps += 1
        self.samples += int(self.e.sample_weight())
        self.e.reset_samples()
        self.average_due = self.steps % self.algo.k1 == 0

    def step(self, local_step):
        e = self.e
        if e.max_grad_norm is not None:  # the inner optimizer's own, local gradient
            torch.nn.utils.clip_grad_norm_(e.with_grad(), e.max_grad_norm)
        out = local_step()
        if self.average_due:
            try:
                self.average_now()
            except Exception as err:  # noqa: BLE001 - a lost rank, under on_failure="continue"
                if not e.recovers:
                    raise
                e.survive(err, self.steps - 1)  # the steps before this one, as the CLI counts
        return out

    def end_on_global(self, streaming: bool = False) -> None:
        """Collective over the workers: every worker ends on the global servers' model,
        bitwise. One more global average, uncompressed, of what changed since the last one,
        or under a lossy codec of what compression held back (a datacenter's replica plus its
        residual is not the servers' model). Nothing if the last global average was already
        such a round. Streaming ends on its last datacenter round (the CLI forces that one
        global: ``force_global_average``), unless ``streaming``: then every fragment now."""
        if self.steps == self.exact_at:
            return
        if self.algo.streaming and not streaming:
            return
        if self.steps != self.steps_at_global or self.algo.streaming:
            self.average_now(final=True)
        elif self.e.lossy_wan:
            self.average_now(final=True, flush=True)

    def at_global_model(self) -> bool:
        """Whether every worker holds the global servers' model now (after a global average
        that was uncompressed, or under a lossless codec; streaming: a forced one)."""
        if self.steps == self.exact_at:
            return True
        return not (self.algo.streaming or self.e.lossy_wan) and self.steps == self.steps_at_global

    def before_close(self) -> None:
        if self.average_due:
            self.average_now()
        self.end_on_global()

    def report(self) -> dict:
        if self.cadence is None:
            return {}
        return {"k2": self.cadence.k2, "k2_changes": self.cadence.changes}

    def check_restore(self, what: str, new_model: bool) -> None:
        if new_model:  # every worker has just loaded the same model
            self.steps_at_global = self.exact_at = self.steps
        if not self.at_global_model():
            self.e.stop(
                ConfigError(
                    f"{what} under HFA between global averages: the workers hold different "
                    "models; call opt.force_global_average() before the step, or call it at a "
                    "multiple of K1*K2 steps"
                )
            )

    def survive(self, recovery, step: int, redo: bool) -> int:
        """Every survivor: rejoin, agree on the step (a worker that finished its round before
        the loss may be K1 steps ahead), say what was lost, and (``redo``) make the average cut
        off a global one over the surviving datacenters, from the parameters each worker had
        before it (see rejoined)."""
        loss = recovery.rejoin_survivors()
        agreed = recovery.agree_on_step(step)
        self.steps += agreed - step
        recovery.record(loss, agreed + 1 if redo else agreed)  # the step trained, or saved
        if redo:
            self.average_globally()
        return agreed

    @torch.no_grad()
    def rejoined(self) -> None:
        """An average cut off mid-way leaves this worker's parameters as it pushed them (a
        part of the results may have landed)."""
        e = self.e
        if self.cadence is not None:
            self.cadence.comm = e.s.comms.all_workers
        if self.pushed_weight is not None:
            for b in e.buckets:
                torch.div(b.grads, self.pushed_weight, out=b.params)
            if e.aux_len:
                e.unpack_buffers(e.aux_send, 1.0 / self.pushed_weight)
            self.pushed_weight = None

    def trained_by_lost(self, samples: int, step: int, at: int, last_batch: int) -> int:
        """A loss is met at a datacenter average: the lost workers had trained as far as this
        one (``samples``, counted before the step whose average it cut off)."""
        return samples

    def stop_in_round(self) -> bool | None:
        """The workers agree on a stop at every datacenter average (K1 steps), completed with
        it, so a signal is acted on within K1 steps, not K1*K2, at no added wait."""
        return self.average_due

    def make_global_next(self) -> bool:
        """Adaptive cadence and streaming have no fixed global rounds: the rounds a checkpoint
        or the end follows are made global (every key), so each holds one global model."""
        if not self.algo.forces_global:
            return False
        self.force_global()
        return True

    def stopped_early(self, made_global: bool) -> None:
        """Streaming stopped by a signal: one more global round of every key (it has no
        recent round with one global model to go back to)."""
        if self.algo.streaming and not made_global:
            self.average_globally()

    def average_globally(self) -> None:
        """Right after a datacenter average: one more, global over every key, so every worker
        holds the global model (the CLI's stop under streaming HFA)."""
        self.average_now(final=True)

    def average_now(self, final: bool = False, flush: bool = False) -> None:
        """The datacenter average that the K1-th step made due (every K2-th is global).
        ``final`` (close() between global averages): one global average of every worker,
        weighted by its samples since the last average, or if none by that average's.
        ``flush`` (with ``final``, no step since the last global average): it only delivers
        what a lossy codec held back, with no outer step."""
        algo, e = self.algo, self.e
        self.average_due = False
        uniform = algo.weighting == "uniform"
        samples = float(self.samples or (self.round_samples or 1.0 if final else 0))
        weight = uniform_weight(e.client) if uniform else samples
        cadence = self.cadence
        forced = final or self.global_next  # every key global now (FLAG_GLOBAL)
        self.global_next = False
        if cadence is None:  # every K2-th is global: the local servers count too
            go_global = forced or (self.dc_rounds + 1) % algo.k2 == 0
            self._average(weight, forced, flush=flush)
        else:  # adaptive: the workers choose K2; the local servers' schedule follows it
            go_global = forced or cadence.next_is_global()
            cadence.begin()
            self._average(weight, forced, cadence)
            cadence.end(go_global, self.steps, decide=not final)
        self.round_samples = samples
        self.samples = 0
        # after a forced global round the local servers count K2 (and streaming's staggered
        # schedule) from the start again, and so do the workers
        self.dc_rounds = 0 if forced else self.dc_rounds + 1
        if forced:  # uncompressed both ways: every worker holds the servers' model
            self.exact_at = self.steps
        if go_global:
            self.steps_at_global = self.steps
            e.global_syncs += 1
            if algo.reset_optimizer:
                e.opt.state.clear()

    @torch.no_grad()
    def _average(
        self, weight: float, force_global: bool = False, cadence=None, flush: bool = False
    ) -> None:
        """The datacenter average (every K2-th one global, or every key now with
        ``force_global``) of parameters and float buffers; with adaptive ``cadence``, its
        K2 goes to the local server and the exchange times it measured come back."""
        e = self.e
        flags = (FLAG_GLOBAL if force_global else 0) | (FLAG_FLUSH if flush else 0)
        flags |= e.lan_flags | (FLAG_STATS if e.want_stats else 0)
        if e.aux_len:  # the buffers: averaged by the global servers, never outer-stepped
            flags |= FLAG_MEAN
        for b in e.buckets:
            torch.mul(b.params, weight, out=b.grads)
        if e.aux_len:
            e.pack_buffers(e.aux_send, weight)
        self.pushed_weight = weight  # the results land in the parameters: see rejoined()
        k2 = cadence.k2 if cadence is not None else 0
        reqs = e.client.start(Op.AVG, e.keys(), weight=weight, flags=flags, k2=k2)
        if k2:
            reqs.pull_exchanges(cadence.told)
        for b in e.buckets:
            reqs.push(b.grads)
        if e.aux_len:
            reqs.push(e.aux_send)
        for b in e.buckets:
            reqs.pull(b.params)
        if e.aux_len:
            reqs.pull(e.aux_recv)
        if flags & FLAG_STATS:
            reqs.pull_stats(e.server_counts)
        reqs.wait()
        self.pushed_weight = None
        if e.aux_len:
            e.unpack_buffers(e.aux_recv, 1.0)


def uniform_weight(client) -> float:
    """GeoMX's uniform weighting for HFA: every datacenter counts the same and, inside one,
    every worker (its local server divides by its own workers), so a worker weighs 1 / its
    datacenter's workers. The KVStore's HFA pushes use the same weight."""
    return 1.0 / (client.link.comm.Get_size() - 1)


def check_outer(name, kwargs) -> None:
    """HFA's outer optimizer and its settings (the API's and the CLI's), in one line each."""
    if not (isinstance(name, str) and name in OUTER_OPTIMIZERS):
        raise ConfigError(
            f"HFA(outer_optimizer={name!r}): choose one of {', '.join(OUTER_OPTIMIZERS)} "
            "(or torch.optim.SGD, Adam, AdamW)"
        )
    if not isinstance(kwargs, dict):
        raise ConfigError(f"HFA(outer_kwargs={kwargs!r}): pass a dict of settings")
    for k, v in kwargs.items():
        values = v if k == "betas" and isinstance(v, tuple | list) else [v]
        ok = (k != "betas" or len(values) == 2) and all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for x in values
        )
        if not ok or (k in ("momentum", "betas", "dampening") and any(x >= 1 for x in values)):
            raise ConfigError(
                f"HFA(outer_kwargs={{{k!r}: {v!r}}}): must be finite and >= 0 (momentum, "
                "dampening and betas below 1; betas a pair)"
            )
    spec = outer_spec({"name": name, **kwargs})  # unknown settings: one line
    if isinstance(spec, SGD) and spec.nesterov and (not spec.momentum or spec.dampening):
        raise ConfigError(
            f"HFA(outer_optimizer='nesterov', outer_kwargs={kwargs!r}): Nesterov needs a "
            "momentum > 0 and no dampening"
        )
    if getattr(spec, "eps", 1.0) <= 0:
        raise ConfigError(f"HFA(outer_kwargs={kwargs!r}): eps must be > 0")


# Streaming HFA's most fragments: each is at least one key of the rounds (protocol.MAX_KEYS).
MAX_FRAGMENTS = 64


def _check_outer_flags(optimizer: str, momentum: float | None) -> None:
    """``--outer-optimizer`` and ``--outer-momentum``, in the flags' words."""
    if optimizer not in OUTER_OPTIMIZERS:
        raise ConfigError(
            f"unknown --outer-optimizer {optimizer!r}: choose one of {', '.join(OUTER_OPTIMIZERS)}"
        )
    if momentum is None:
        return
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        raise ConfigError(f"--outer-momentum {momentum}: must be a number in [0, 1)")
    if optimizer not in ("sgd", "nesterov"):
        raise ConfigError(
            f"--outer-momentum is for --outer-optimizer sgd or nesterov, not {optimizer}: drop "
            "it (Adam's betas are its own)"
        )
    if momentum == 0 and optimizer == "nesterov":
        raise ConfigError("--outer-optimizer nesterov with --outer-momentum 0: give it > 0")


def check_streaming(
    fragments: int, overlap: bool, mix: float, k2: int, pre: str = "--", post: str = ""
) -> None:
    """Streaming HFA's settings, for the API (``HFA(fragments=...)``) and the CLI flags."""

    def name(s: str) -> str:
        return f"{pre}{s if pre != '--' else 'hfa-' + s}{post}"

    if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
        raise ConfigError(f"{name('fragments')} {fragments!r}: must be a whole number >= 1")
    if fragments > MAX_FRAGMENTS:
        raise ConfigError(
            f"{name('fragments')} {fragments}: at most {MAX_FRAGMENTS} (each fragment is one "
            f"or more of the keys of a round, which carries at most {MAX_KEYS})"
        )
    if not (isinstance(mix, int | float) and 0 < mix <= 1):
        raise ConfigError(f"{name('mix')} {mix!r}: must be in (0, 1] (1 replaces)")
    if mix != 1 and not overlap:
        raise ConfigError(
            f"{name('mix')} {mix!r} mixes an overlapped global result into the local one: add "
            f"{name('overlap')}, or drop {name('mix')}"
        )
    if overlap and k2 < 2:
        raise ConfigError(
            f"{name('overlap')} needs k2 >= 2: a fragment's global result merges at its next "
            "datacenter round, which must not be global again"
        )


def _show_keyword(setting: str, value=None) -> str:
    """A setting of ``HFA(...)`` as the API's user wrote it, e.g. ``HFA(k2_max=4)``; without a
    value, its name."""
    return setting if value is None else f"HFA({setting}={value!r})"


def check_adaptive(
    k2: int | None, k2_min: int, k2_max: int, wan_share: float, overlap: bool, show
) -> None:
    """Adaptive cadence's settings, for the API (``HFA(adaptive=True, ...)``) and the CLI's
    flags (each checks the whole numbers itself). ``show(setting, value)`` writes a setting as
    its user gave it, ``show(setting)`` names it; ``k2`` None: no starting K2 was given."""
    if k2_min > k2_max:
        raise ConfigError(f"{show('k2_min', k2_min)} is above {show('k2_max', k2_max)}")
    if k2 is not None and not k2_min <= k2 <= k2_max:
        raise ConfigError(
            f"{show('k2', k2)}: the starting k2 must lie within {show('k2_min', k2_min)} and "
            f"{show('k2_max', k2_max)}"
        )
    if not (isinstance(wan_share, int | float) and 0 < wan_share < 1):
        raise ConfigError(f"{show('wan_share', wan_share)}: must be in (0, 1)")
    if overlap and k2_min < 2:
        raise ConfigError(
            f"{show('overlap')} with {show('adaptive', True)} needs {show('k2_min')} >= 2: a "
            "fragment's global result merges at its next datacenter round, which must not be "
            "global again"
        )


class Cadence:
    """HFA's adaptive K2 on the workers (``HFA(adaptive=True)``). Each datacenter average
    carries the current K2 to the local server, whose (staggered) schedule follows it, and
    brings back the global exchanges it timed since the last; each worker times its own
    compute. After each cycle of K2 rounds the workers agree on the smallest K2 any of them
    asks for (a MIN over every worker), so every datacenter changes it at the same round. The
    smallest: a datacenter that reaches the global tier before another also times its wait for
    that one; the last to arrive times the exchange alone."""

    WINDOW = 5  # the median of the last few measurements of each kind

    def __init__(self, algo: HFA, all_workers) -> None:
        self.algo, self.comm = algo, all_workers
        self.k2 = min(max(algo.k2, algo.k2_min), algo.k2_max)  # a default K2: clamped
        self.since_global = 0  # datacenter averages since the last cycle's end
        # the local server's exchange times, scaled to the whole model (TAG_EXCHANGES)
        self.told = torch.zeros(2, dtype=torch.float64)  # their sum and count, per round
        self.exchanges: list[float] = []  # their mean, per round that had any
        self.computes: list[float] = []  # between one average's end and the next one's start
        self.t_end: float | None = None
        self.changes: list[dict] = []  # every change of K2, with what it was decided on

    def start(self) -> None:
        """Training starts now: the first datacenter round's compute counts from here."""
        self.t_end = time.perf_counter()

    def restart(self, k2: int | None) -> None:
        """Back at a global average (a resume, a rewind), with the K2 chosen by then (if
        known), kept within this run's bounds."""
        if k2 is not None:
            self.k2 = max(self.algo.k2_min, min(self.algo.k2_max, int(k2)))
        self.since_global = 0

    def next_is_global(self) -> bool:
        return self.since_global + 1 >= self.k2

    def begin(self) -> None:
        """An average starts now (after a datacenter round's compute)."""
        if self.t_end is not None:
            self.computes.append(time.perf_counter() - self.t_end)

    def end(self, was_global: bool, step: int, decide: bool = True) -> None:
        """The average is done (``told`` holds what its local server timed); after a cycle's
        last one (or a forced global one), choose K2."""
        self.t_end = time.perf_counter()
        total, count = self.told.tolist()
        if count:
            self.exchanges.append(total / count)
        if not was_global:
            self.since_global += 1
            return
        self.since_global = 0
        if decide:
            self._decide(step)

    def _decide(self, step: int) -> None:
        import numpy as np
        from mpi4py import MPI

        def recent(values: list[float]) -> float:
            return statistics.median(values[-self.WINDOW :]) if values else 0.0

        exchange = recent(self.exchanges)
        compute = recent(self.computes)
        # A worker none of whose exchanges has come back yet (overlap) still takes part in the
        # one collective every worker makes here, asking for nothing (the MIN ignores it)
        none = np.iinfo(np.int64).max
        asked = self.algo.next_k2(exchange, compute) if self.exchanges else none
        wanted = np.array([asked], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, wanted, op=MPI.MIN)  # every worker: the same K2
        k2 = int(wanted[0])
        if k2 == none:  # no worker has one: keep K2
            return
        if k2 != self.k2:
            self.changes.append(
                {
                    "step": step,
                    "exchange_s": exchange,
                    "round_compute_s": compute,
                    "old_k2": self.k2,
                    "new_k2": k2,
                }
            )
            self.k2 = k2


# ---- the outer optimizer, stepped by the global servers (OuterStep) -----------------------------
# HFA's outer optimizers (DiLoCo's outer step): the torch.optim classes allowed, by name, and
# the settings each takes besides lr (``HFA(outer_kwargs=...)``, ``--outer-momentum``).
OUTER_OPTIMIZERS: dict[str, tuple[type, tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, ("momentum", "dampening", "weight_decay")),
    "nesterov": (torch.optim.SGD, ("momentum", "dampening", "weight_decay")),
    "adam": (torch.optim.Adam, ("betas", "eps", "weight_decay")),
    "adamw": (torch.optim.AdamW, ("betas", "eps", "weight_decay")),
}
# The state each keeps on a global server, per key slice, as torch names it (``outer_``+name
# on the servers, in checkpoints and in ``DistributedOptimizer.state_dict``'s geompi keys).
OUTER_STATE = {"momentum_buffer": "outer_momentum", "exp_avg": "outer_exp_avg"}
OUTER_STATE |= {"exp_avg_sq": "outer_exp_avg_sq", "step": "outer_step"}


def outer_spec(spec: Mapping) -> SGD | Adam:
    """The torch optimizer an outer spec (``{"name", "lr", ...settings}``) describes, as a
    spec of this module: ``nesterov`` is SGD with Nesterov momentum (0.9 unless given)."""
    d = dict(spec)
    name = d.pop("name", "sgd")
    if name not in OUTER_OPTIMIZERS:
        raise ConfigError(f"outer optimizer {name!r}: choose one of {', '.join(OUTER_OPTIMIZERS)}")
    lr = float(d.pop("lr", 1.0))
    if not math.isfinite(lr):
        raise ConfigError(f"--outer-lr {lr}: must be a finite number")
    unknown = set(d) - set(OUTER_OPTIMIZERS[name][1])
    if unknown:
        raise ConfigError(
            f"outer optimizer {name}: unknown setting {', '.join(sorted(unknown))} (it takes "
            f"{', '.join(OUTER_OPTIMIZERS[name][1])})"
        )
    if "betas" in d:
        d["betas"] = tuple(float(b) for b in d["betas"])
    if name == "nesterov":
        return SGD(lr=lr, nesterov=True, **{"momentum": 0.9, **d})
    return {"sgd": SGD, "adam": Adam, "adamw": AdamW}[name](lr=lr, **d)


def outer_state_names(spec: Mapping | None) -> set[str]:
    """The state names (``outer_...``) the outer optimizer of ``spec`` keeps; none for the
    plain average."""
    s = None if spec is None else outer_spec(spec)
    if s is None or (isinstance(s, SGD) and not s.momentum):
        return set()
    if isinstance(s, SGD):
        return {"outer_momentum"}
    return {"outer_exp_avg", "outer_exp_avg_sq", "outer_step"}


@torch.no_grad()
def outer_step(
    value: torch.Tensor, average: torch.Tensor, spec: Mapping | None, state: dict[str, torch.Tensor]
) -> None:
    """HFA's outer optimizer: one step of the torch optimizer ``spec`` names on ``value``, with
    ``value - average`` as its gradient (DiLoCo's pseudo-gradient); its state in ``state``.

    torch's own single-tensor step (what ``torch.optim``'s ``step`` runs with
    ``foreach=False``) on this server's slice: the arithmetic of ``torch.optim`` elementwise.
    Plain averaging (no spec, or SGD with lr 1, no momentum, no weight decay) assigns the
    average exactly.
    """
    s = SGD(lr=1.0) if spec is None else outer_spec(spec)
    if isinstance(s, SGD) and s.lr == 1.0 and not s.momentum and not s.weight_decay:
        value.copy_(average)
        return
    grad = value - average
    if isinstance(s, SGD):
        bufs: list[torch.Tensor | None] = [state.get("outer_momentum")] if s.momentum else []
        sgd(
            [value], [grad], bufs, foreach=False, weight_decay=s.weight_decay,
            momentum=s.momentum, lr=s.lr, dampening=s.dampening, nesterov=s.nesterov,
            maximize=False,
        )  # fmt: skip
        if s.momentum and bufs[0] is not None:  # torch made it on the first step
            state["outer_momentum"] = bufs[0]
        return
    if "outer_step" not in state:  # torch's lazy state: a step count and two zero moments
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["outer_step"] = torch.tensor(0.0, dtype=scalar)
        state["outer_exp_avg"] = torch.zeros_like(value)
        state["outer_exp_avg_sq"] = torch.zeros_like(value)
    beta1, beta2 = s.betas
    adam(
        [value], [grad], [state["outer_exp_avg"]], [state["outer_exp_avg_sq"]], [],
        [state["outer_step"]], foreach=False, decoupled_weight_decay=s.decoupled_weight_decay,
        amsgrad=False, beta1=beta1, beta2=beta2, lr=s.lr, weight_decay=s.weight_decay,
        eps=s.eps, maximize=False,
    )  # fmt: skip


# ---- the server policies (geompi.ps.policy) ---------------------------------------------------
ROUND_LOG = "GEOMPI_TEST_ROUND_LOG"


class HFALocal:
    """HFA's local server policy. Every value round is a datacenter average; every K2-th one
    of a key (counted per key: GeoMX users push one key per round) goes on to the global tier.
    K2 is the workers' where they choose it (adaptive cadence: ``Round.k2``), else ``k2``.

    Streaming: the keys make ``fragments`` fragments (``fragment_plan`` at INIT), global on
    staggered rounds; with ``overlap`` a fragment's global result is not waited for but merged
    at its next datacenter round, as ``mix * global + (1 - mix) * local``. A round the workers
    force global (FLAG_GLOBAL: close(), the CLI's checkpoints) sends every key up now, exactly
    (FLAG_EXACT), merges late results first and waits for its own, so the round ends on one
    global model, and the counting starts again after it.

    Test hook: ``GEOMPI_TEST_ROUND_LOG=DIR`` writes, per datacenter, the keys that went global
    at each value round and the fragment plan, when the workers stop.
    """

    def __init__(self, k2: int, fragments: int = 1, overlap: bool = False, mix: float = 1.0):
        self.k2, self.fragments, self.overlap, self.mix = k2, fragments, overlap, mix
        self.rounds: dict[int, int] = {}  # per key: datacenter averages since its cycle began
        self.fragment_of: dict[int, int] = {}
        self.staggered = 1  # the fragments the keys make, staggered over K2 rounds
        self.round_log: list[list[int]] | None = [] if os.environ.get(ROUND_LOG) else None

    def route(self, rnd: Round) -> Routing:
        if rnd.op is Op.INIT:  # fewer fragments than asked where the keys are fewer
            self.fragment_of = fragment_plan(rnd.keys, self.fragments)
            self.staggered = max(self.fragment_of.values(), default=0) + 1
        if rnd.op is not Op.AVG:
            return Routing.all_up(rnd)
        forced = bool(rnd.flags & FLAG_GLOBAL)
        k2 = rnd.k2 or self.k2
        for k, _ in rnd.keys:
            self.rounds[k] = self.rounds.get(k, 0) + 1
        up = frozenset(
            i
            for i, (k, _) in enumerate(rnd.keys)
            if forced or is_global(self.rounds[k], self.fragment_of.get(k, 0), self.staggered, k2)
        )
        if forced:
            self.rounds.update({k: 0 for k, _ in rnd.keys})
        elif rnd.k2:  # a chosen K2 may change after a cycle: every fragment went up once in it
            self.rounds.update({k: 0 for k, _ in rnd.keys if self.rounds[k] >= k2})
        if self.round_log is not None:
            self.round_log.append([rnd.keys[i][0] for i in sorted(up)])
        return Routing(
            up,
            flags=FLAG_GLOBAL | (FLAG_EXACT if forced else 0),  # exact: whole values both ways
            merge_first=forced,
            overlapped=self.overlap and not forced,
            timed=bool(rnd.k2),
        )

    def keeps_late(self, rnd: Round) -> bool:
        return rnd.op is Op.AVG  # the end or a save drops the results never merged

    def merge(self, key: int, local: torch.Tensor, result: torch.Tensor) -> None:
        if self.mix == 1.0:
            local.copy_(result)
        else:
            local.mul_(1.0 - self.mix).add_(result, alpha=self.mix)

    def rejoin(self) -> None:
        self.rounds.clear()

    def stopped(self, dc: int) -> None:
        if self.round_log is None:
            return
        path = os.path.join(os.environ[ROUND_LOG], f"rounds-dc{dc}.jsonl")
        with open(path, "a") as f:  # one line per job (per DistributedOptimizer)
            log = {"global_keys": self.round_log, "fragment_of": self.fragment_of}
            f.write(json.dumps(log) + "\n")
        self.round_log = []


class OuterStep:
    """HFA's global server policy: at a global average each key of this shard takes a step of
    ``rule`` (``HFA.outer_rule``: the outer optimizer), from the average of the datacenters,
    with the spec the INIT round brings (``"outer"``) and the key's own state."""

    def __init__(self, rule=outer_step) -> None:
        self.rule = rule
        self.spec: dict | None = None
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    def configure(self, spec: dict) -> None:
        if "outer" in spec:
            self.spec = spec["outer"]

    def average(self, key: int, value: torch.Tensor, average: torch.Tensor) -> None:
        self.rule(value, average, self.spec, self.state.setdefault(key, {}))

    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.state

    def load_state_dict(self, state: dict[int, dict[str, torch.Tensor]]) -> None:
        self.state = {k: dict(st) for k, st in state.items()}
