"""FSA: fully synchronous at both tiers. Every step, the sample-weighted gradient of every
worker reaches the optimizer, and every worker continues from the same parameters.

Worker side (geompi.optimizer): gradient buckets are pushed from backward hooks in priority
order, so communication overlaps backward. With the optimizer on the workers (the default, as
DDP) the servers only sum (FLAG_RAW rounds) and every worker steps on the global gradient; with
``optimizer="servers"`` (GeoMX's placement, the CLI's) the global servers step their shard and
the workers pull parameters, with the presence key telling them which parameters had no gradient.
Server side: the synchronous local and global servers, one round per step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from geompi.errors import ConfigError
from geompi.ps.optim import SGD, Adam, AdamW, Spec, make_spec, spec_to_dict
from geompi.sync.base import Algorithm, WanPattern


@dataclass(frozen=True)
class FSA(Algorithm):
    """Fully synchronous: every step, the sample-weighted gradient of every worker.

    The user's optimizer runs on every worker over the aggregated gradient (as torch DDP does),
    so any ``torch.optim`` optimizer, param groups and schedulers behave exactly as in one
    process.
    """

    name: ClassVar[str] = "fsa"
    follows_hyperparameters: ClassVar[bool] = True
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
        worker it reached, or redone by the survivors (geompi.optimizer)."""

    @classmethod
    def from_config(cls, cfg) -> FSA:
        return cls(optimizer="servers")  # the CLI's optimizer flags name a server optimizer

    def server_spec(self, optimizer: torch.optim.Optimizer) -> dict | None:
        if not self.on_servers:
            return None
        return spec_message(optimizer, "FSA(optimizer='servers')")

    def cli_optimizer(self, cfg, params) -> tuple[object, dict]:
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


def _sync_tier(common: dict) -> dict:
    """The job's server settings that the synchronous tiers take."""
    return {k: v for k, v in common.items() if k != "max_staleness"}


def servers_optimizer(cfg, params) -> tuple[ServerHeld, dict]:
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
    return ServerHeld(params), {"optimizer": spec_to_dict(spec)}


class ServerHeld:
    """The workers' stand-in for an optimizer the global servers hold (the CLI's): the model's
    parameters in one group, never stepped here. Not a torch.optim object, whose first use
    imports torch._dynamo: about 2 s of CPU on every worker."""

    def __init__(self, params) -> None:
        self.param_groups = [{"params": list(params)}]
        self.state: dict = {}

    def step(self) -> None:
        raise RuntimeError("the global servers step this optimizer, not the workers")


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
