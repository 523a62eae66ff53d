"""FSA: fully synchronous at both tiers. Every step, the sample-weighted gradient of every
worker reaches the optimizer, and every worker continues from the same parameters.

Worker side (FSAWorker, FSAServersWorker; geompi.engine calls them): gradient buckets are
pushed from backward hooks in priority order, so communication overlaps backward. With the
optimizer on the workers (the default, as DDP) the servers only sum (FLAG_RAW rounds) and every
worker steps on the global gradient; with ``optimizer="servers"`` (GeoMX's placement, the
CLI's) the global servers step their shard and the workers pull parameters, with the presence
key telling them which parameters had no gradient.
Server side: the synchronous local and global servers, one round per step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from geompi.comm.buffers import all_finite
from geompi.errors import ConfigError, NonFiniteError
from geompi.ps.optim import SGD, Adam, AdamW, Spec, make_spec, spec_to_dict
from geompi.ps.protocol import FLAG_MEAN, FLAG_PRESENCE, FLAG_RAW, presence_payload
from geompi.sync.base import Algorithm, Engine, ServerHeld, WanPattern, WorkerSide, held_message


@dataclass(frozen=True)
class FSA(Algorithm):
    """Fully synchronous: every step, the sample-weighted gradient of every worker.

    The user's optimizer runs on every worker over the aggregated gradient (as torch DDP does),
    so any ``torch.optim`` optimizer, param groups and schedulers behave exactly as in one
    process.
    """

    name: ClassVar[str] = "fsa"
    follows_hyperparameters: ClassVar[bool] = True
    kvstore_type: ClassVar[str | None] = "dist_sync"
    # "workers" (default): the user's optimizer on every worker over the global gradient;
    # "servers": GeoMX's placement, the optimizer and its state sharded on the global servers.
    optimizer: str = "workers"

    def validate(self) -> None:
        if self.optimizer not in ("workers", "servers"):
            raise ConfigError(f"FSA(optimizer={self.optimizer!r}): choose workers or servers")

    @property
    def on_servers(self) -> bool:
        return self.optimizer == "servers"

    def check_survivable(self) -> None:
        """A lost worker or datacenter is survived: the round it cut off is completed from a
        worker it reached, or redone by the survivors (geompi.recovery)."""

    def check_compression(self, compression: str) -> None:
        if not self.on_servers and compression != "none":
            raise ConfigError(
                "WAN compression with FSA's worker-side optimizer is not supported yet: "
                "use geompi.FSA(optimizer='servers'), 'hfa' or 'mixed' with compression, or "
                "drop wan_compression"
            )

    def worker(self, engine: Engine) -> WorkerSide:
        return FSAServersWorker(engine) if self.on_servers else FSAWorker(engine)

    @classmethod
    def from_config(cls, cfg) -> FSA:
        return cls(optimizer="servers")  # the CLI's optimizer flags name a server optimizer

    def server_spec(self, optimizer: torch.optim.Optimizer) -> dict | None:
        if not self.on_servers:
            if isinstance(optimizer, ServerHeld):
                raise ConfigError(
                    "FSA(optimizer='workers') steps the optimizer on the workers: a ServerHeld "
                    "optimizer needs FSA(optimizer='servers')"
                )
            return None
        held = held_message(optimizer)
        return held if held is not None else spec_message(optimizer, "FSA(optimizer='servers')")

    def cli_optimizer(self, cfg, params) -> torch.optim.Optimizer:
        return servers_optimizer(cfg, params)

    def make_server(self, topo, comms, stats, **common):
        from geompi.ps.servers import build_server  # MPI loads with the servers, not before

        policies = {"local_policy": self.local_policy(), "global_policy": self.global_policy()}
        return build_server(topo, comms, stats, **policies, **_sync_tier(common))

    def wan_pattern(self, global_servers: int) -> WanPattern:
        """One round a step, the whole model up (gradients) and back (gradients or parameters):
        the upload's last byte leaves, a latency, the results come back, a latency. Buckets go
        up during backward, but the planner counts no overlap (a model within one bucket, as
        the planner's examples, has none)."""
        return WanPattern("FSA", steps=1, shares=(1.0,), trips=2)


class FSAWorker(WorkerSide):
    """FSA's worker side with the optimizer on the workers (as DDP): each step one gradient
    round, begun by backward's first gradient and completed as backward ends; the servers only
    sum (FLAG_RAW), and every worker steps the user's optimizer on the global gradient.

    The extra key after the buckets: [samples, per parameter "had a gradient", buffers x
    samples]; the results come back summed, and are divided by the job's samples here."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.results: list[torch.Tensor] = []  # the global gradient, a tensor per bucket

    def built(self) -> None:
        self.results = [torch.zeros_like(b.params) for b in self.e.buckets]

    def aux_len(self, nparams: int, nbuf: int) -> int:
        return 1 + nparams + nbuf

    def buffer_slice(self, t: torch.Tensor) -> torch.Tensor:
        return t[1 + len(self.e.params) :]

    def backward_counts(self) -> None:
        self.e.rounds.begin()

    def synchronize(self) -> None:
        self.e.rounds.now()

    def round_flags(self) -> int:
        return FLAG_RAW

    def push_rest(self, reqs) -> None:
        e = self.e
        e.aux_send[0] = e.rounds.weight
        e.aux_send[1 : 1 + len(e.params)].copy_(e.present_g[0])
        e.pack_buffers(self.buffer_slice(e.aux_send), e.rounds.weight)
        reqs.push(e.aux_send)

    def pull_results(self, reqs) -> None:
        # fresh tensors: a .grad the user kept from the last step (a view) keeps its values
        self.results = [torch.empty_like(t) for t in self.results]
        for out in self.results:
            reqs.pull(out)
        reqs.pull(self.e.aux_recv)

    def after_round(self) -> None:
        """The global gradient into ``.grad`` (None where no worker had one: torch.optim then
        leaves the parameter alone), and the buffers' sample-weighted mean."""
        e = self.e
        total = float(e.aux_recv[0])
        counts = e.aux_recv[1 : 1 + len(e.params)].tolist()  # in the layout's order
        for out in self.results:
            out.div_(total)
        for p in e.params:
            if counts[e.layout_pos[id(p)]] == 0:
                p.grad = None
            else:
                bucket, off, numel = e.buckets.where[id(p)]
                p.grad = self.results[bucket.key][off : off + numel].view_as(p)
        e.unpack_buffers(self.buffer_slice(e.aux_recv), 1.0 / total)

    def pulled(self) -> list[torch.Tensor]:
        return [*self.results, self.e.aux_recv]

    def step(self, local_step):
        e = self.e
        e.synchronize()
        if not self._finite():
            return None
        if e.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(e.with_grad(), e.max_grad_norm)
        return local_step()

    def _finite(self) -> bool:
        """Whether the global gradient is finite; on NaN/Inf apply ``on_nonfinite`` (every
        worker sees the same sum, so all decide alike)."""
        e = self.e
        if all(all_finite(p.grad) for p in e.params if p.grad is not None):
            return True
        if e.s.cfg.on_nonfinite == "skip":
            e.skipped += 1
            return False
        e.stop(
            NonFiniteError(
                # one round a step, this one counted
                f"non-finite global gradient at step {e.global_syncs}: lower the lr, check the "
                "data, use a torch.amp.GradScaler, or pass on_nonfinite='skip' to geompi.init"
            )
        )


class FSAServersWorker(FSAWorker):
    """FSA's worker side with the optimizer on the global servers (GeoMX's placement, the
    CLI's): the round's results are the parameters the servers stepped, pulled into the model
    as backward ends, so ``step()`` has nothing left to do. The extra key is the buffers x
    samples (a mean key, FLAG_MEAN), then the presence key: per parameter 1 from each worker
    with a gradient, one copy per global server. The master worker tells the servers of a
    change of the hyperparameters (an lr schedule)."""

    servers_step = True
    where = 'FSA(optimizer="servers")'  # what a refusal calls it

    def built(self) -> None:
        """No global gradient comes back here."""

    def aux_len(self, nparams: int, nbuf: int) -> int:
        return nbuf

    def buffer_slice(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def sends_spec(self) -> bool:
        return self.e.master

    def init_spec(self) -> dict:
        e = self.e
        spec: dict = {}
        if e.max_grad_norm is not None:  # the servers clip
            spec["max_grad_norm"] = float(e.max_grad_norm)
        spec.update(layout=e.layout(), presence_key=e.presence_key)
        return spec

    def round_flags(self) -> int:
        return FLAG_PRESENCE | (FLAG_MEAN if self.e.aux_len else 0)  # buffers: a weighted mean

    def push_rest(self, reqs) -> None:
        e = self.e
        if e.aux_len:
            e.pack_buffers(e.aux_send, e.rounds.weight)
            reqs.push(e.aux_send)
        reqs.push(presence_payload(e.present_g.view(-1)))

    def pull_results(self, reqs) -> None:
        e = self.e
        for b in e.buckets:
            reqs.pull(b.params)
        if e.aux_len:
            reqs.pull(e.aux_recv)
        reqs.pull(e.present_out)

    def after_round(self) -> None:
        if self.e.aux_len:  # the servers' mean of the buffers
            self.e.unpack_buffers(self.e.aux_recv, 1.0)

    def pulled(self) -> list[torch.Tensor]:
        e = self.e
        out = [b.params for b in e.buckets]
        return [*out, e.aux_recv, e.present_out] if e.aux_len else [*out, e.present_out]

    def check_scaler(self) -> None:
        if getattr(self.e.opt, "found_inf", None) is not None:
            self.e.stop(
                ConfigError(
                    f"a GradScaler with {self.where}: the global servers step during backward, "
                    "on the scaled gradients; use torch.autocast without a GradScaler, or FSA() "
                    "(the workers step)"
                )
            )

    def step(self, local_step):
        self.e.synchronize()
        return None  # the global servers stepped; the parameters arrived with backward


def _sync_tier(common: dict) -> dict:
    """The job's server settings that the synchronous tiers take."""
    return {k: v for k, v in common.items() if k != "max_staleness"}


def servers_optimizer(cfg, params) -> ServerHeld:
    """The CLI with the optimizer on the global servers: the flags' spec (which may be
    DCASGD, which torch lacks) goes to the servers; the workers hold only a stand-in."""
    spec = make_spec(
        cfg.optimizer,
        cfg.effective_lr,
        cfg.effective_momentum,
        cfg.weight_decay,
        cfg.nesterov,
        cfg.dcasgd_lambda,
        cfg.dcasgd_adaptive,
    )
    return ServerHeld(params, {"optimizer": spec_to_dict(spec)})


def spec_message(optimizer: torch.optim.Optimizer, who: str) -> dict:
    """What the global servers are told of a user's optimizer: its first param group's spec,
    and with several groups every group's (each parameter's group travels in the layout)."""
    specs = [group_spec(optimizer, g, who) for g in optimizer.param_groups]
    out: dict[str, Any] = {"optimizer": spec_to_dict(specs[0])}
    if len(specs) > 1:
        out["groups"] = [spec_to_dict(s) for s in specs]
    return out


def server_spec(optimizer: torch.optim.Optimizer, who: str) -> Spec:
    """The JSON-able spec of a user's optimizer of one param group (DCASGD's case)."""
    if len(optimizer.param_groups) != 1:
        raise ConfigError(
            f"{who} takes one param group; this optimizer has "
            f"{len(optimizer.param_groups)}: use one group"
        )
    return group_spec(optimizer, optimizer.param_groups[0], who)


# What the global servers do with each option (constructor argument) of torch's SGD, Adam and
# AdamW, as a param group holds it. Carried: the servers run torch's functional step with it.
# Ignored: how torch computes the step (one kernel per tensor, foreach, fused, CUDA-graph
# capturable), not what it computes; the servers always run the single-tensor CPU step. Any other
# option (amsgrad, differentiable, or one a later torch adds) is refused unless it holds the
# constructor's default, as the servers would otherwise step without it and say nothing.
_ADAM = frozenset(("lr", "betas", "eps", "weight_decay", "maximize", "decoupled_weight_decay"))
CARRIED = {
    torch.optim.SGD: frozenset(
        ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
    ),
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAM,
}
IGNORED = frozenset({"foreach", "fused", "capturable"})


def group_spec(optimizer: torch.optim.Optimizer, g: dict, who: str) -> Spec:
    """The spec of one param group of a user's optimizer, for the global servers to run."""
    kind = getattr(optimizer, "_geompi_base", type(optimizer))  # the user's class
    if kind not in CARRIED:
        raise ConfigError(
            f"{who} runs the optimizer on the global servers, which know torch.optim.SGD, Adam "
            f"and AdamW; got {kind.__name__}: use one of those, or sync='fsa'/'hfa'"
        )
    _refuse_options(kind, optimizer, g, who)
    if kind is torch.optim.SGD:
        return SGD(
            lr=float(g["lr"]),
            momentum=float(g["momentum"]),
            weight_decay=float(g["weight_decay"]),
            nesterov=bool(g["nesterov"]),
            dampening=float(g["dampening"]),
            maximize=bool(g.get("maximize", False)),
        )
    cls = AdamW if kind is torch.optim.AdamW else Adam
    return cls(
        lr=float(g["lr"]),
        betas=(float(g["betas"][0]), float(g["betas"][1])),
        eps=float(g["eps"]),
        weight_decay=float(g["weight_decay"]),
        maximize=bool(g.get("maximize", False)),
        decoupled_weight_decay=bool(g.get("decoupled_weight_decay", cls is AdamW)),
    )


def _refuse_options(kind: type, optimizer: torch.optim.Optimizer, g: dict, who: str) -> None:
    """Refuse, in one line, an option of the group that the servers would drop. A key that is
    no option of the class (a scheduler's ``initial_lr``, a user's own label) is not read by
    torch's step either, so it passes."""
    options = inspect.signature(kind).parameters
    known = set(getattr(optimizer, "defaults", {})) | set(options)
    for key, value in g.items():
        if key == "params" or key in CARRIED[kind] or key in IGNORED or key not in known:
            continue
        default = options[key].default if key in options else inspect.Parameter.empty
        if default is not inspect.Parameter.empty and _same(value, default):
            continue
        raise ConfigError(
            f"{who} runs the optimizer on the global servers, which do not implement "
            f"{kind.__name__}'s {key}={value!r}: leave {key} at its default, or use "
            "sync='fsa'/'hfa' (the workers step with torch itself)"
        )


def _same(value: object, default: object) -> bool:
    try:
        return bool(value == default)
    except (RuntimeError, TypeError, ValueError):  # a tensor of several values
        return False
