"""``geompi.DistributedOptimizer``: a user's own ``torch.optim`` optimizer, synchronized by geompi.

The optimizer object stays the user's: its class is swapped in place for a subclass whose
``step()`` takes part in the chosen algorithm, so ``isinstance`` checks, lr schedulers,
``GradScaler``, ``state_dict()`` and param groups all keep working.

- **FSA**: gradient buckets are pushed from backward hooks (last layers first) while backward
  runs; when backward ends, every worker holds the sample-weighted global gradient in ``.grad``
  (a parameter no worker gave a gradient keeps ``.grad = None``, so torch skips it), and
  ``step()`` runs the user's optimizer on it: exactly one process on the concatenated batch.
- **HFA**: ``step()`` runs the user's optimizer locally; every K1 steps the datacenter averages
  its parameters and buffers, every K2-th average is global.
- **MixedSync**: gradients go to the global servers, which step asynchronously per datacenter;
  the new parameters arrive when backward ends and ``step()`` has nothing left to do.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import cast

import torch

from geompi.comm import callwatch
from geompi.config import LAN_REDUCE
from geompi.engine import (  # noqa: F401 - re-exported: their old home
    LocalEngine,
    Synchronizer,
    check_key_count,
    check_step,
    layout_spec,
    synchronized_buffers,
)
from geompi.errors import ConfigError, GeompiError, positive_number
from geompi.sync import FSA, HFA, MixedSync, resolve
from geompi.sync.hfa import uniform_weight  # noqa: F401 - re-exported: its old home


def DistributedOptimizer(  # noqa: N802 - a factory named like the class it returns, as Horovod's
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    sync: str | FSA | HFA | MixedSync = "fsa",
    *,
    bucket_mb: float = 1.0,
    max_grad_norm: float | None = None,
    backward_passes_per_step: int = 1,
    wan_bandwidth: str | None = None,
    wan_latency: str | None = None,
    lan_bandwidth: str | None = None,
    wan_compression: str | None = None,
    lan_reduce: str | None = None,
) -> GeompiOptimizer:
    """Make ``optimizer`` (built on ``model``'s parameters) train across the job. Collective:
    every worker calls it once, with the same model and settings.

    The master worker's parameters and buffers become everyone's. ``wan_*``/``lan_bandwidth``
    (emulated links, WAN compression) and ``lan_reduce`` (how a datacenter sums: "auto",
    "funnel" or "scatter") override ``geompi.init``'s for this optimizer's job.
    Returns the same optimizer object, now a subclass of its class with ``no_sync()``,
    ``synchronize()``, ``set_batch_size()`` and ``close()``.
    """
    return build(
        optimizer,
        model,
        sync,
        bucket_mb=bucket_mb,
        max_grad_norm=max_grad_norm,
        backward_passes_per_step=backward_passes_per_step,
        wan_bandwidth=wan_bandwidth,
        wan_latency=wan_latency,
        lan_bandwidth=lan_bandwidth,
        wan_compression=wan_compression,
        lan_reduce=lan_reduce,
    )


def build(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    sync: str | FSA | HFA | MixedSync = "fsa",
    *,
    start: bool = True,
    recovers: bool = True,
    bucket_mb: float = 1.0,
    max_grad_norm: float | None = None,
    backward_passes_per_step: int = 1,
    wan_bandwidth: str | None = None,
    wan_latency: str | None = None,
    lan_bandwidth: str | None = None,
    wan_compression: str | None = None,
    lan_reduce: str | None = None,
) -> GeompiOptimizer:
    """:func:`DistributedOptimizer`, with what the command line's loop decides itself:
    ``start=False`` leaves the first (INIT) round to the caller (a resume's carries the
    checkpoint: ``engine.start``), ``recovers=False`` leaves a lost rank to it (the loop agrees
    on the step and counts the lost workers' samples: ``engine.survive``)."""
    wan = {
        k: v
        for k, v in (
            ("wan_bandwidth", wan_bandwidth),
            ("wan_latency", wan_latency),
            ("lan_bandwidth", lan_bandwidth),
            ("wan_compression", wan_compression),
        )
        if v is not None
    }
    from geompi import session

    s = session.worker_session()
    server_spec: dict | None = None
    try:
        server_spec = _validate(
            optimizer, model, sync, s, bucket_mb, max_grad_norm, backward_passes_per_step, wan
        )
        if lan_reduce is not None and lan_reduce not in LAN_REDUCE:
            raise ConfigError(
                f"lan_reduce={lan_reduce!r}: choose one of {', '.join(map(repr, LAN_REDUCE))}"
            )
        if lan_reduce == "scatter" and s.cfg.on_failure == "continue":
            raise ConfigError(
                "on_failure='continue' with lan_reduce='scatter': a datacenter sums through its "
                "local server under continue; drop lan_reduce"
            )
        err = None
    except GeompiError as e:  # on every worker alike, or on some only (one model in float64)
        err = e
    settings = None
    if err is None:  # what must agree across workers, or they hang in each other's rounds
        args = (sync, bucket_mb, max_grad_norm, backward_passes_per_step, wan, lan_reduce)
        settings = _call_settings(optimizer, model, *args)
    with callwatch.call("DistributedOptimizer"):
        session.agree(s, err, "DistributedOptimizer", settings)
        try:  # its checks (the key count) come before its first collective call
            engine: Synchronizer | LocalEngine
            if s.topo.serverless:  # a world of one process: the user's own step
                engine = LocalEngine(optimizer, model, resolve(sync), s, max_grad_norm)
            else:
                engine = Synchronizer(
                    optimizer,
                    model,
                    resolve(sync),
                    s,
                    bucket_mb=bucket_mb,
                    max_grad_norm=max_grad_norm,
                    passes=backward_passes_per_step,
                    server_spec=server_spec,
                    wan=wan,
                    lan_reduce=lan_reduce,
                )
        except GeompiError as e:  # the same on every worker: the settings agree
            session.exit_identically(s, e)
        if isinstance(engine, Synchronizer):
            engine.recovers = recovers
        wrap(optimizer, engine)
        if start:
            engine.start()
    return cast(GeompiOptimizer, optimizer)  # its class swapped


def _call_settings(optimizer, model, sync, bucket_mb, max_grad_norm, passes, wan, lan_reduce):
    """What every worker must pass alike to DistributedOptimizer (JSON): the arguments, the
    optimizer's class and groups, and each parameter's and buffer's name, shape, dtype,
    trainability and group."""
    group = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return {
        "sync": repr(resolve(sync)),
        "bucket_mb": bucket_mb,
        "max_grad_norm": max_grad_norm,
        "backward_passes_per_step": passes,
        "wan settings": wan,
        "lan_reduce": lan_reduce,
        "optimizer": [type(optimizer).__name__, len(optimizer.param_groups)],
        "model": [
            [n, list(p.shape), str(p.dtype), p.requires_grad, group.get(id(p), -1)]
            for n, p in model.named_parameters()
        ],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
    }


def wrap(optimizer: torch.optim.Optimizer, engine: Synchronizer | LocalEngine) -> GeompiOptimizer:
    """Swap ``optimizer``'s class in place for one whose ``step()`` runs through ``engine``
    (DistributedOptimizer's; the CLI's loop calls the engine itself)."""
    base = type(optimizer)
    optimizer.__class__ = type(f"Distributed{base.__name__}", (GeompiOptimizer, base), {})
    wrapped = cast(GeompiOptimizer, optimizer)  # its class swapped
    wrapped._geompi_base = base  # what server_spec reads after the class swap
    wrapped._patch_step_function()  # torch's step hooks and profiling follow the new class
    _rewrap_scheduler_step(wrapped)
    wrapped._geompi = engine
    return wrapped


def _validate(optimizer, model, sync, s, bucket_mb, max_grad_norm, passes, wan) -> dict | None:
    """Check the arguments (identically on every worker); returns the global servers' spec."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"DistributedOptimizer needs a torch.optim.Optimizer, got {optimizer!r}")
    if isinstance(optimizer, GeompiOptimizer):
        raise ConfigError("this optimizer is already a geompi.DistributedOptimizer: wrap it once")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"DistributedOptimizer needs the nn.Module it trains, got {model!r}")
    algo = resolve(sync)
    if not (isinstance(passes, int) and passes >= 1):
        raise ConfigError(f"backward_passes_per_step={passes!r}: must be a whole number >= 1")
    if max_grad_norm is not None and not positive_number(max_grad_norm):
        raise ConfigError(f"max_grad_norm={max_grad_norm!r}: must be a finite number > 0")
    if not positive_number(bucket_mb):
        raise ConfigError(f"bucket_mb={bucket_mb!r}: must be a finite number > 0")
    from geompi.session import job_wan

    compression = job_wan(s.cfg, {"wan": wan}).compression  # parses (and checks) every setting
    algo.check_compression(compression)
    if s.cfg.on_failure == "continue":
        algo.check_survivable()
        if compression != "none":
            raise ConfigError(
                "on_failure='continue' with wan_compression: not supported together yet; drop "
                "wan_compression"
            )
    algo.check_clipping(max_grad_norm)
    if s.topo.replicas > 1:
        algo.check_replication()
    from geompi.state import param_names

    param_names(model, optimizer)  # every parameter it holds is the model's
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ConfigError(
                f"parameter {name} is {p.dtype}: geompi synchronizes fp32 parameters; keep "
                "the model in fp32 and use torch.autocast for bf16/fp16 compute"
            )
    return algo.server_spec(optimizer)


def _rewrap_scheduler_step(optimizer: torch.optim.Optimizer) -> None:
    """An lr scheduler built before wrapping left an instance ``step`` that calls the original
    class's step (and records that it ran): point it at the distributed step instead."""
    if "step" not in vars(optimizer):
        return
    del optimizer.step
    ref = weakref.ref(optimizer)

    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True  # what the scheduler's own wrapper records
        return type(opt).step(opt, *args, **kwargs)

    # the scheduler then sees its wrapper in place (torch's lr_scheduler marks its own so)
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # a function's attribute
    optimizer.step = step  # type: ignore[method-assign]  # an instance's, as the scheduler's


class GeompiOptimizer(torch.optim.Optimizer):
    """What ``DistributedOptimizer`` returns: the user's optimizer, its class swapped for one
    with this mixed in before its own (so torch's methods are there, and these).
    Never built directly."""

    _geompi: Synchronizer | LocalEngine
    _geompi_base: type[torch.optim.Optimizer]  # the user's class, before the swap

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Where the global servers step, a GradScaler hands step() its state (``found_inf``)
        instead of unscaling: step() then refuses it, since the servers stepped on the scaled
        gradients during backward."""
        return self._geompi.takes_scaler_state

    def step(self, closure: Callable[[], float] | None = None):
        """One training step of the chosen algorithm (the same call on every worker)."""
        return self._geompi.user_step(closure, super().step)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and send nothing."""
        self._geompi.no_sync_depth += 1
        try:
            yield
        finally:
            self._geompi.no_sync_depth -= 1

    def synchronize(self) -> None:
        """Finish this step's gradient exchange now (it normally completes as backward ends)."""
        self._geompi.synchronize()

    def set_batch_size(self, n: int) -> None:
        """This worker's sample count for the coming step, if the model's first input does not
        say it (geompi otherwise counts the leading dimension of each training forward)."""
        self._geompi.explicit_samples = int(n)

    def force_global_average(self) -> None:
        """HFA: make the next datacenter average global over every key, so every worker holds
        the global model after it (to save one under adaptive cadence or streaming, whose
        global rounds are not fixed). Every worker calls it before the same step."""
        self._geompi.force_global_average()

    @property
    def global_syncs(self) -> int:
        """How many times the global tier has synchronized so far."""
        return self._geompi.global_syncs

    @property
    def failures(self) -> list[dict]:
        """Every lost rank this job went on without (``on_failure="continue"``): the step,
        the lost ranks, the datacenters that left, the new topology, when it recovered."""
        return self._geompi.failures

    def close(self) -> dict | None:
        """End this optimizer's job (MixedSync receives the final global model); the servers
        then wait, idle, for the next DistributedOptimizer or ``geompi.finish()``. Collective.

        Returns the job's report on the master worker (None elsewhere): bytes per link class,
        the peak WAN bytes of one round, every worker's wait and wall seconds.
        """
        with callwatch.call("opt.close"):
            self._geompi.close()
        return self._geompi.report

    geompi_close = close  # what geompi.session calls, whatever the optimizer defines

    def state_dict(self) -> dict:
        """torch's ``state_dict()``, with the state the global servers hold: their optimizer's
        per-parameter state in torch's own format (FSA's servers placement, MixedSync), HFA's
        outer optimizer's state under ``"geompi_outer_momentum"`` (Adam's: under
        ``"geompi_outer_exp_avg"``, ``"geompi_outer_exp_avg_sq"``, ``"geompi_outer_step"``),
        each parameter index -> tensor. Then
        collective over the workers, and every worker gets the same dict."""
        from geompi.state import OUTER_KEYS, UPDATES_KEY, by_index

        sd = super().state_dict()
        engine = self._geompi
        if not isinstance(engine, Synchronizer) or not engine.holds_server_state:
            return sd  # (a LocalEngine holds nothing elsewhere)
        held = server_state(engine, "state_dict()")
        names = engine.param_names()
        if engine.side.servers_step:  # the workers hold none of the optimizer's state
            sd["state"] = by_index(held["optimizer"], names)
        hfa = held["algorithm"].get("hfa", {})
        for key, state_name in OUTER_KEYS.items():
            outer = hfa.get(state_name, {})
            if outer:
                sd[key] = {i: outer[n] for i, n in enumerate(names) if n in outer}
        sd[UPDATES_KEY] = int(held["algorithm"].get("global_updates", 0))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict()``; what the global servers hold (see ``state_dict``) goes
        to them in an INIT round (collective over the workers; the master's is used, and its
        parameters reach every worker)."""
        from geompi.state import split_held

        engine = self._geompi
        try:
            held, sd = split_held(engine, state_dict)
        except GeompiError as e:  # the same on every worker
            engine.stop(e)
        super().load_state_dict(sd)
        if held is not None:
            engine.restore(held, "load_state_dict()")


def server_state(engine: Synchronizer, what: str) -> dict:
    """Collective over the workers: the global servers' state by parameter name, on every
    worker (``HeldState.held_state``'s dict). ``what``: the caller, for errors."""
    from geompi.comm.transport import barrier_before_collective
    from geompi.state import gather

    engine.refuse_closed(what)
    held, _ = gather(engine, None, {}, None)  # the SAVE round; the state on the master
    comm = engine.s.comms.all_workers
    barrier_before_collective(comm, engine.s.cfg.comm_timeout, "every worker in " + what)
    return comm.bcast(held, root=0)
