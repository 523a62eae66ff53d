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
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn, cast

import numpy as np
import torch

from geompi.comm import callwatch, faults
from geompi.comm.buckets import Buckets
from geompi.comm.buffers import all_finite
from geompi.comm.compression import make_compressor
from geompi.comm.topology import node_share
from geompi.comm.transport import LAN, Link, LinkStats, Requests, worker_timeout
from geompi.config import LAN_REDUCE
from geompi.errors import ConfigError, GeompiError, NonFiniteError, positive_number
from geompi.ps.client import PSClient, scatters
from geompi.ps.protocol import (
    FLAG_FLUSH,
    FLAG_GLOBAL,
    FLAG_MEAN,
    FLAG_PRESENCE,
    FLAG_RAW,
    FLAG_SCATTER,
    FLAG_STATS,
    MAX_KEYS,
    STATS_LEN,
    Op,
    presence_payload,
)
from geompi.sync import FSA, HFA, Algorithm, MixedSync, resolve

if TYPE_CHECKING:
    from geompi.sync.hfa import Cadence

# Every this many rounds a worker looks through the whole model for a trainable parameter its
# hooks miss (one added after the DistributedOptimizer was built); walking the modules every
# round cost 0.17 ms of CPU a round on a worker of the digits CNN (cProfile), 4% of its step.
UNHOOKED_SCAN = 64


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
        wrap(optimizer, engine)
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
    if not algo.on_servers and not algo.local_steps and compression != "none":
        raise ConfigError(
            "WAN compression with FSA's worker-side optimizer is not supported yet: "
            "use geompi.FSA(optimizer='servers'), 'hfa' or 'mixed' with compression, or drop "
            "wan_compression"
        )
    if s.cfg.on_failure == "continue":
        algo.check_survivable()
        if compression != "none":
            raise ConfigError(
                "on_failure='continue' with wan_compression: not supported together yet; drop "
                "wan_compression"
            )
    if algo.independent_dcs and max_grad_norm is not None:
        raise ConfigError(
            f"max_grad_norm with {algo.name} is not supported: each deposit is one datacenter's "
            "gradient, not the global one; clip under geompi.FSA() or HFA"
        )
    from geompi.state import param_names

    param_names(model, optimizer)  # every parameter it holds is the model's
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ConfigError(
                f"parameter {name} is {p.dtype}: geompi synchronizes fp32 parameters; keep "
                "the model in fp32 and use torch.autocast for bf16/fp16 compute"
            )
    return algo.server_spec(optimizer)


def check_key_count(buckets: Buckets, bucket_mb: float) -> None:
    """A round's header holds at most MAX_KEYS keys: the buckets, the extra (buffers) key and
    the presence key. Many parameters in small buckets (or many fragments) need more."""
    count = len(buckets.keys) + 2
    if count > MAX_KEYS - 1:
        raise ConfigError(
            f"the model makes {len(buckets.keys)} buckets at bucket_mb={bucket_mb:g} "
            f"(--bucket-mb), but a round carries at most {MAX_KEYS - 3}: raise bucket_mb (or "
            "use fewer HFA fragments)"
        )


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
        return self._geompi.server_side

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
        from geompi.state import OUTER_KEYS, UPDATES_KEY

        sd = super().state_dict()
        engine = self._geompi
        if not isinstance(engine, Synchronizer) or not engine.holds_server_state:
            return sd  # (a LocalEngine holds nothing elsewhere)
        held = engine.server_state("state_dict()")
        names = engine.param_names()
        if engine.server_side:
            sd["state"] = {}
            for state_name, named in held["optimizer"].items():
                for i, name in enumerate(names):
                    if name in named:
                        sd["state"].setdefault(i, {})[state_name] = named[name]
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
            engine._stop(e)
        super().load_state_dict(sd)
        if held is not None:
            engine.restore(held, "load_state_dict()")


def layout_spec(buckets: Buckets, group_of: dict[int, int] | None = None) -> list:
    """Every key's parameters, ``[[key, [[name, offset, numel(, group)], ...]], ...]``, in the
    order of the presence vector (what a global server needs to build one optimizer view per
    piece). ``group_of`` (``id(p)`` -> the optimizer's param group, -1 if it holds none): a
    fourth element per parameter, where it is not all group 0."""
    group_of = group_of or {}
    grouped = bool(set(group_of.values()) - {0})  # once, not per parameter

    def entry(m):
        return [m.name, m.offset, m.numel] + ([group_of.get(id(m.param), 0)] if grouped else [])

    return [[b.key, [entry(m) for m in b.members]] for b in buckets]


def uniform_weight(client: PSClient) -> float:
    """GeoMX's uniform weighting for HFA: every datacenter counts the same and, inside one,
    every worker (its local server divides by its own workers), so a worker weighs 1 / its
    datacenter's workers. The KVStore's HFA pushes use the same weight."""
    return 1.0 / (client.link.comm.Get_size() - 1)


def synchronized_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers geompi keeps equal on every worker: the floating-point ones in the model's
    state_dict (BatchNorm statistics and the like). Non-persistent buffers (masks, tables
    computed at construction) are constants and stay as each worker built them."""
    out = []
    for module in model.modules():
        skip = module._non_persistent_buffers_set
        for name, b in module._buffers.items():
            if b is not None and name not in skip and b.is_floating_point():
                out.append(b)
    return out


class Synchronizer:
    """The worker side of one algorithm around a user's model and optimizer."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        algo: Algorithm,
        session,
        *,
        bucket_mb: float,
        max_grad_norm: float | None,
        passes: int,
        server_spec: dict | None = None,
        wan: dict | None = None,
        stats: LinkStats | None = None,
        follow_hyperparameters: bool = True,
        lan_reduce: str | None = None,
    ) -> None:
        self.opt, self.model, self.algo, self.s = optimizer, model, algo, session
        self.server_spec = server_spec
        self.wan = wan or {}
        # a lossy WAN codec: datacenters hold a replica of the global model plus what their
        # last push left out, so HFA's close() ends on one more, exact, global round
        from geompi.session import job_wan

        self.lossy_wan = make_compressor(job_wan(session.cfg, {"wan": self.wan}).compression).lossy
        self.stats = stats or LinkStats()  # this job's own counters (see report)
        # The servers' optimizer follows the user's hyperparameters (an lr schedule) where the
        # algorithm allows it. The CLI's are fixed, and may be DCASGD's, which torch lacks.
        self.follow_hyperparameters = follow_hyperparameters and algo.follows_hyperparameters
        self.report: dict | None = None  # the job's figures, on the master after close()
        self.t_start = time.perf_counter()
        self.max_grad_norm = max_grad_norm
        self.passes = passes
        self.master = session.rank == 0
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        # streaming HFA: keys cut into equal fragments (its rounds exchange parameters only)
        fragments = getattr(algo, "fragments", 1) if algo.local_steps else 1
        self.buckets = Buckets(named, int(bucket_mb * 2**20), fragments)
        check_key_count(self.buckets, bucket_mb)  # the same on every worker, before any collective
        self.float_buffers = synchronized_buffers(model)
        self.client = PSClient(
            Link(session.comms.dc, LAN, self.stats), worker_timeout(session.cfg.comm_timeout)
        )
        device = self.params[0].device if self.params else torch.device("cpu")
        nbuf = sum(b.numel() for b in self.float_buffers)
        # GRAD and AVG rounds reduce-scatter among the datacenter's workers (--lan-reduce)
        nbytes = 4 * sum(b.numel for b in self.buckets)
        workers = session.comms.workers  # the node query on every worker, whatever its mode
        one_node = node_share(workers)[1] == workers.Get_size()
        scatter = scatters(
            lan_reduce or session.cfg.lan_reduce, self.client.workers, nbytes, one_node
        )
        # on_failure="continue": every datacenter sums through its local server, whose rounds
        # a recovery redoes (a reduce-scatter among the workers is not rebuilt after a loss)
        self.lan_flags = FLAG_SCATTER if scatter and not faults.watching() else 0
        # The extra key after the buckets. FSA: [samples, per-parameter "had a gradient",
        # buffers x samples]; HFA: [buffers x weight]. Where the global servers step (FSA's
        # "servers" placement, MixedSync): buffers x samples as a mean key (FLAG_MEAN: the
        # servers average it, MixedSync's per datacenter until the end), then the presence key,
        # per parameter 1 from each worker with a gradient, one copy per global server
        # (geompi.sync.fsa); its layout travels in the INIT spec.
        self.server_side = algo.on_servers
        # FSA's default placement: every worker steps on the global gradient
        self.grads_to_workers = not algo.on_servers and not algo.local_steps
        g = session.topo.num_global_servers
        # Per parameter, in the layout's (bucket) order: 1 if this worker has its gradient this
        # round, one row per global server (the presence key); FSA's aux carries row 0.
        self.present_g = torch.zeros(g, len(self.params))
        self.layout_pos = {
            id(m.param): i for i, m in enumerate(m for b in self.buckets for m in b.members)
        }
        self.present_out = torch.zeros(g * len(self.params))
        # Gradient rounds (FSA, MixedSync), per parameter: (its bucket, its slice of the
        # bucket's gradients, its column of present_g), views made once for the backward hooks.
        # HFA exchanges parameters, never gradients (its streaming keys may cut parameters).
        self.slots = {
            key: (bucket, bucket.grads[off : off + numel], self.present_g[:, self.layout_pos[key]])
            for key, (bucket, off, numel) in self.buckets.where.items()
            if not algo.local_steps
        }
        self.trainable = [sum(m.param.requires_grad for m in b.members) for b in self.buckets]
        # Who tells the servers of a hyperparameter change: the master worker, and under
        # MixedSync each datacenter's first worker, since each deposit is stepped with its own
        # datacenter's hyperparameters (the datacenters are at different steps of a schedule).
        dc = session.topo.dc_of(session.rank)
        first = session.topo.workers(dc)[0] == session.rank if dc is not None else False
        self.spec_sender = self.master or (algo.independent_dcs and first)
        self.dc_first = first
        # what the servers' optimizer last heard from this worker (the INIT spec is the
        # master's, so another datacenter's first worker sends its own with its first round)
        self.sent_spec = server_spec if self.master else None
        if self.server_side:  # the mean key: buffers x samples (FLAG_MEAN)
            self.aux_len = nbuf
        elif self.grads_to_workers:
            self.aux_len = 1 + len(self.params) + nbuf
        elif algo.local_steps:
            self.aux_len = nbuf
        else:
            self.aux_len = 0
        self.aux_send = torch.zeros(self.aux_len, device=device)
        self.aux_recv = torch.zeros(self.aux_len, device=device)
        self.results = [torch.zeros_like(b.params) for b in self.buckets]  # FSA's global grads
        self.no_sync_depth = 0
        self.explicit_samples: int | None = None
        self.samples = 0  # since the last exchange
        self.passes_done = 0
        self.in_backward = False
        self.window_closes = False
        self.reqs: Requests | None = None
        self.synced = False
        self.steps = 0
        self.dc_rounds = 0
        self.hfa_samples = 0
        self.round_samples = 0.0  # the weight of HFA's last average
        self.steps_at_global = 0  # HFA: the step of the last global average
        self.exact_at = 0  # HFA: the step of the last forced (uncompressed) global average
        # HFA(adaptive=True): which averages go global (geompi.sync.hfa.Cadence)
        self.cadence: Cadence | None = None
        if algo.local_steps and cast(HFA, algo).adaptive:
            from geompi.sync.hfa import Cadence

            self.cadence = Cadence(cast(HFA, algo), session.comms.all_workers)
        self.global_syncs = 0
        # the next datacenter average goes global, every key (the CLI's checkpoint rounds
        # under adaptive cadence or streaming)
        self.global_next = False
        self.skipped = 0
        self.closed = False
        self.average_due = False  # HFA: K1 steps done, the datacenter average not yet
        self.pushed_weight: float | None = None  # HFA: an average's weight, while under way
        self.failures: list[dict] = []  # on_failure="continue": every loss survived
        # whether step() recovers from a lost rank itself (the public API), or leaves it to
        # its caller (the CLI's loop, which rebuilds its own state too)
        self.recovers = True
        # the caller's own rebuilding after a recovery (the CLI's loop: its topology, its stop
        # agreement), called with the faults.Loss before the workers agree on anything
        self.rejoined: Callable[[faults.Loss], None] | None = None
        self.on_rejoin: list[Callable[[], None]] = []  # at the same point, every survivor
        # FSA under on_failure="continue": a lost rank met while pushing this round (the round
        # is redone at backward's end), the optimizer spec the round carried, and the last
        # completed round's results (its id, and copies), which a worker that the loss cut off
        # before they reached it takes from one they did reach
        self._round_lost: BaseException | None = None
        self._round_spec: bytes | None = None
        self._kept_round = -1
        self._kept: list[torch.Tensor] = []
        # test hook: this worker pauses before it receives that step's results, so that a
        # loss next step finds it without them (GEOMPI_FAULT_SLOW_PULL=STEP:RANK)
        self._slow_at = faults.fault_step("GEOMPI_FAULT_SLOW_PULL", session.rank)
        # test hook: this worker is lost as it begins that step's FSA round (the CLI's loop
        # has its own, before the step's batch)
        self._kill_at = faults.fault_step("GEOMPI_FAULT_KILL_AT", session.rank)
        # removed at close(), so a DistributedOptimizer built later on the same model is the
        # only one that sees its forwards and gradients
        self.hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True)]
        self.hooked = {id(p) for p in self.params if p.requires_grad}
        # the parameters that were frozen when it was built: if one is unfrozen, its gradient
        # would stay local (checked every round; the whole model every UNHOOKED_SCAN rounds)
        self.frozen = [(name, p) for name, p in named if not p.requires_grad]
        self.rounds_begun = 0
        # geompi.Metrics: rounds ask the local server for its WAN counters (FLAG_STATS), and
        # the training forwards and backwards are timed, less the waits inside them
        self.want_stats = False
        self.server_counts = np.zeros(STATS_LEN, dtype=np.float64)
        self.compute_s = 0.0
        self._compute_from: tuple[float, float] | None = None  # (clock, LAN wait) at forward
        for p in self.params:
            if p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ---- keys -----------------------------------------------------------------------------
    @property
    def aux_key(self) -> int:
        return len(self.buckets)

    @property
    def presence_key(self) -> int:
        """Where the servers step: the presence key, after the mean key (if any), last."""
        return self.aux_key + (1 if self.aux_len else 0)

    def keys(self, presence: bool = True) -> list[tuple[int, int]]:
        keys = self.buckets.keys
        keys = keys + [(self.aux_key, self.aux_len)] if self.aux_len else keys
        if self.server_side and presence:
            keys = keys + [(self.presence_key, self.present_out.numel())]
        return keys

    def _pack_buffers(self, out: torch.Tensor, scale: float) -> None:
        off = 0
        for b in self.float_buffers:
            n = b.numel()
            out[off : off + n].copy_(b.detach().reshape(-1)).mul_(scale)
            off += n

    @torch.no_grad()
    def _unpack_buffers(self, src: torch.Tensor, scale: float) -> None:
        off = 0
        for b in self.float_buffers:
            n = b.numel()
            b.copy_((src[off : off + n] * scale).view_as(b))
            off += n

    def _buffer_slice(self, t: torch.Tensor) -> torch.Tensor:
        return t[1 + len(self.params) :] if self.grads_to_workers else t

    # ---- start and end --------------------------------------------------------------------
    def start(self, extra_spec: dict | None = None, send_restore=None) -> None:
        """Tell the servers the algorithm, then the INIT round: the master's values for all
        (``begin``). The API's optimizer and the CLI's loop start their servers alike."""
        owner = self.opt if isinstance(self.opt, GeompiOptimizer) else None
        self.s.send_job({**self.algo.job(), "wan": self.wan}, owner)
        self.begin(extra_spec, send_restore)

    def begin(self, extra_spec: dict | None = None, send_restore=None) -> None:
        """The INIT round, once the servers know the job. ``extra_spec`` joins the servers'
        spec; ``send_restore(reqs)`` (the CLI's master, on resume) adds their saved state."""
        spec = {**(self.server_spec or {}), **(extra_spec or {})}
        if self.server_side and self.max_grad_norm is not None:  # the servers clip (FSA)
            spec["max_grad_norm"] = float(self.max_grad_norm)
        if self.server_side:
            held = {id(p): i for i, g in enumerate(self.opt.param_groups) for p in g["params"]}
            group_of = {id(p): held.get(id(p), -1) for p in self.params}
            spec.update(layout=layout_spec(self.buckets, group_of), presence_key=self.presence_key)
        self.init_round(spec, send_restore)
        self.stats.reset_time()  # the report's waits and wall time cover training, not INIT
        self.t_start = time.perf_counter()
        if self.cadence is not None:
            self.cadence.start()

    def state(self) -> dict:
        """The counters a checkpoint keeps (the names are those of the file format)."""
        out = {"global_syncs": self.global_syncs}
        if self.algo.local_steps:
            out.update(steps=self.steps, dc_rounds=self.dc_rounds, samples=self.hfa_samples)
        if self.cadence is not None:
            out["k2"] = self.cadence.k2
        return out

    def load_state(self, state: dict) -> None:
        self.global_syncs = int(state.get("global_syncs", 0))
        self.steps = int(state.get("steps", 0))
        self.dc_rounds = int(state.get("dc_rounds", 0))
        self.steps_at_global = self.steps  # HFA's checkpoints are at global averages
        self.exact_at = self.steps
        self.hfa_samples = int(state.get("samples", 0))
        if self.cadence is not None:  # at a global average: K2 as it was chosen then
            self.cadence.restart(state.get("k2"))

    @torch.no_grad()
    def init_round(self, spec: dict | None = None, send_restore=None) -> None:
        """Every worker gets the master worker's parameters and buffers (collective)."""
        import json

        payload = json.dumps(spec, sort_keys=True).encode() if spec and self.master else None
        if spec and "layout" in spec and self.dc_first and not self.master:
            # every local server's codec needs the layout (idle parameters keep their residual)
            payload = json.dumps({"layout": spec["layout"]}).encode()
        reqs = self.client.start(Op.INIT, self.keys(), spec=payload)
        for b in self.buckets:
            if self.master:
                b.grads.copy_(b.params)
            else:
                b.grads.zero_()
            self.client.push(reqs, b.grads)
        if self.aux_len:
            self.aux_send.zero_()
            if self.master:
                self._pack_buffers(self._buffer_slice(self.aux_send), 1.0)
            self.client.push(reqs, self.aux_send)
        if self.server_side:
            self.present_g.zero_()
            self.client.push(reqs, self.present_g.view(-1))
        for b in self.buckets:
            self.client.pull(reqs, b.params)
        if self.aux_len:
            self.client.pull(reqs, self.aux_recv)
        if self.server_side:
            self.client.pull(reqs, self.present_out)
        if send_restore is not None:
            send_restore(reqs)
        self.client.wait(reqs)
        if self.aux_len:
            self._unpack_buffers(self._buffer_slice(self.aux_recv), 1.0)

    def close(self, report: bool = True) -> None:
        """Release the servers; MixedSync first receives the final global model. ``report``:
        then gather the job's figures (collective over COMM_WORLD, servers included)."""
        if self.closed:
            return
        self.closed = True
        for hook in self.hooks:
            hook.remove()
        if self.average_due:
            self._average_now()
        self.end_on_global()
        if self.algo.independent_dcs:  # the datacenters end apart: the model at the end
            reqs = self.client.start(Op.STOP, self.keys(presence=False))
            for b in self.buckets:
                self.client.pull(reqs, b.params)
            if self.aux_len:  # and the datacenters' buffers, averaged
                self.client.pull(reqs, self.aux_recv)
            self.client.wait(reqs)
            if self.aux_len:
                self._unpack_buffers(self.aux_recv, 1.0)
        else:
            self.client.stop()
        if not report:
            return
        from geompi.session import gather_report

        wall = time.perf_counter() - self.t_start
        self.report = gather_report(
            self.s, {"role": "WORKER", **self.stats.as_dict(), "wall_s": wall}
        )
        if self.report is not None and self.cadence is not None:
            self.report.update(k2=self.cadence.k2, k2_changes=self.cadence.changes)

    def end_on_global(self, streaming: bool = False) -> None:
        """HFA (collective over the workers): every worker ends on the global servers' model,
        bitwise. One more global average, uncompressed, of what changed since the last one,
        or under a lossy codec of what compression held back (a datacenter's replica plus its
        residual is not the servers' model). Nothing if the last global average was already
        such a round. Streaming ends on its last datacenter round (the CLI forces that one
        global: ``force_global_average``), unless ``streaming``: then every fragment now."""
        algo = cast(HFA, self.algo)  # read only where it steps locally
        if not algo.local_steps or self.steps == self.exact_at:
            return
        if algo.streaming and not streaming:
            return
        if self.steps != self.steps_at_global or algo.streaming:
            self._average_now(final=True)
        elif self.lossy_wan:
            self._average_now(final=True, flush=True)

    # ---- state the global servers hold (geompi.save/load, state_dict) ---------------------
    @property
    def holds_server_state(self) -> bool:
        """Whether this job's global servers hold optimizer state: their optimizer's (FSA's
        servers placement, MixedSync) or an outer optimizer's (HFA's momentum or moments)."""
        return self.server_side or bool(getattr(self.algo, "outer_stateful", False))

    def at_global_model(self) -> bool:
        """HFA: whether every worker holds the global servers' model now (after a global
        average that was uncompressed, or under a lossless codec; streaming: a forced one)."""
        if not self.algo.local_steps or self.steps == self.exact_at:
            return True
        streaming = cast(HFA, self.algo).streaming
        return not (streaming or self.lossy_wan) and self.steps == self.steps_at_global

    def param_names(self) -> list[str]:
        """The model's name of each parameter the optimizer holds, in torch's index order."""
        from geompi.state import param_names

        return param_names(self.model, self.opt)

    def server_state(self, what: str) -> dict:
        """Collective over the workers: the global servers' state by parameter name, on every
        worker (``Checkpointing.held_state``'s dict). ``what``: the caller, for errors."""
        from geompi.checkpointing import Checkpointing
        from geompi.comm.transport import barrier_before_collective

        self._refuse_closed(what)
        reqs = self.client.start(Op.SAVE, [])
        reqs.wait()
        held = Checkpointing.for_engine(self).held_state() if self.master else None
        comm = self.s.comms.all_workers
        barrier_before_collective(comm, self.s.cfg.comm_timeout, "every worker in " + what)
        return comm.bcast(held, root=0)

    def restore(self, held: dict | None, what: str, new_model: bool = False) -> None:
        """Collective over the workers: the INIT round (the master's parameters and buffers
        reach every worker), handing the global servers ``held`` (the master's, by parameter
        name as :meth:`server_state` gives it) when they keep state. ``new_model``: every
        worker has just loaded the same model (geompi.load), so HFA's workers are together."""
        self._refuse_closed(what)
        if new_model and self.algo.local_steps:
            self.steps_at_global = self.exact_at = self.steps
        if self.algo.independent_dcs and self.rounds_begun:
            self._stop(
                ConfigError(
                    f"{what} under MixedSync after training started: the datacenters are "
                    "asynchronous by then; call it before the first step"
                )
            )
        if self.algo.local_steps and not self.at_global_model():
            self._stop(
                ConfigError(
                    f"{what} under HFA between global averages: the workers hold different "
                    "models; call opt.force_global_average() before the step, or call it at a "
                    "multiple of K1*K2 steps"
                )
            )
        send = None
        if self.master and held is not None and self.holds_server_state:
            from geompi.checkpointing import Checkpointing

            io = Checkpointing.for_engine(self)
            states = io.shard_states(
                held.get("optimizer", {}), held.get("algorithm", {}), held.get("model", {})
            )
            if states is not None:
                send = lambda reqs: io.send_server_states(reqs, states)  # noqa: E731
        self.init_round({"restore": True} if send is not None else None, send)

    def _refuse_closed(self, what: str) -> None:
        if self.closed:
            self._stop(
                ConfigError(
                    f"{what} after this DistributedOptimizer was closed: the global servers no "
                    "longer hold its state; call it before close() (or geompi.finish())"
                )
            )

    # ---- hooks ----------------------------------------------------------------------------
    def _before_forward(self, module, args, kwargs) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self._compute_from is None:
            self._compute_from = (time.perf_counter(), self.stats.wait_s[LAN])
        self.synced = False  # a new training forward: its gradients are still to be exchanged
        if self.average_due:  # HFA: a GradScaler skipped step() on this worker
            self._average_now()
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                self.samples += int(x.shape[0])
                return

    def _weight(self) -> float:
        if self.explicit_samples is not None:
            return float(self.explicit_samples)
        return float(self.samples or 1)

    def _on_grad(self, p: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # backward(create_graph=True): copy outside autograd
            with torch.no_grad():
                self._on_grad(p)
            return
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self.synced = False  # new gradients: the previous exchange is spent
            self.passes_done += 1
            counts = self.no_sync_depth == 0 and self.passes_done >= self.passes
            if counts and self.algo.local_steps:
                self.window_closes = True
            elif counts:
                self._begin_round()
        if self.reqs is None:
            return
        bucket = self._take_grad(p)
        self.ready[bucket.key] += 1
        if self._round_lost is not None:  # the round is redone as backward ends
            return
        try:
            self._issue(complete_only=True)
            self.reqs.test()
        except Exception as e:  # noqa: BLE001 - a lost rank, under on_failure="continue"
            self._lost_while_pushing(e)

    def _take_grad(self, p: torch.Tensor):
        """Copy ``p``'s gradient, times this worker's weight, into its bucket, and mark it
        present; returns the bucket."""
        bucket, slot, present = self.slots[id(p)]
        assert p.grad is not None  # a post-accumulate-grad hook's parameter has one
        torch.mul(p.grad.reshape(-1), self.weight, out=slot)
        present.fill_(1.0)
        return bucket

    def _lost_while_pushing(self, err: Exception) -> None:
        """A lost rank met by a push from a backward hook (on_failure="continue"): backward
        goes on filling the buckets, and the round is redone as it ends (_finish_round). Open
        MPI 5.0.11 reports a revoked communicator only at the round's wait (measured: pushes
        after the revocation posted without error), other MPI libraries may as the push is
        posted."""
        if not faults.is_failure(err):
            raise err
        self._round_lost = err

    def _stop(self, err: GeompiError) -> NoReturn:
        """An error every worker meets at the same point: one line from the master, all stop."""
        from geompi import session

        session.stop_identically(self.s, err)

    def _begin_round(self) -> None:
        if self.closed:
            self._stop(
                ConfigError("backward after its DistributedOptimizer was closed: build a new one")
            )
        scan = self.rounds_begun % UNHOOKED_SCAN == 0  # a parameter added since, too
        self.rounds_begun += 1
        for name, p in self.model.named_parameters() if scan else self.frozen:
            if p.requires_grad and id(p) not in self.hooked:
                self._stop(
                    ConfigError(
                        f"parameter {name} was unfrozen after DistributedOptimizer was built, so "
                        "its gradient would stay local: build it after unfreezing"
                    )
                )
        self.weight = self._weight()
        self.ready = [0] * len(self.buckets)
        self.issued = 0
        for b in self.buckets:
            b.grads.zero_()
        self.present_g.zero_()
        # What .grad holds already goes in too, as torch.optim would step it: an earlier
        # micro-batch's gradient of a parameter this pass leaves alone, or the zeros that
        # zero_grad(set_to_none=False) left. The hooks of this pass overwrite their own.
        for p in self.params:
            if p.grad is not None and id(p) in self.hooked:
                self._take_grad(p)
        if not self.algo.local_steps:  # FSA, MixedSync: one round a step
            self.client.step = self.global_syncs + 1
            if self.client.step == self._kill_at:
                faults.kill_self(self.s.rank)
        self._round_spec, self._round_lost = self._changed_spec(), None
        try:
            self.reqs = self._start_round()
        except Exception as e:  # noqa: BLE001 - a lost rank, under on_failure="continue"
            self.reqs = Requests(self.stats, None, "the local server")  # nothing posted
            self._lost_while_pushing(e)

    def _start_round(self):
        """Post this step's GRAD round header (FSA, MixedSync); returns its requests."""
        flags = (FLAG_PRESENCE if self.server_side else FLAG_RAW) | self.lan_flags
        flags |= FLAG_STATS if self.want_stats else 0
        if self.server_side and self.aux_len:  # buffers: a sample-weighted mean
            flags |= FLAG_MEAN
        self.issued = 0
        return self.client.start(
            Op.GRAD, self.keys(), self.weight, flags=flags, spec=self._round_spec
        )

    def _changed_spec(self) -> bytes | None:
        """The optimizer on the servers (FSA's "servers" placement, MixedSync): the user's
        hyperparameters (an lr schedule) travel with the next round whenever they changed, so
        the servers follow them."""
        if not (self.spec_sender and self.server_side and self.follow_hyperparameters):
            return None
        now = self.algo.server_spec(self.opt)
        if now is None or now == self.sent_spec:
            return None
        import json

        self.sent_spec = now
        return json.dumps({**now, "update": True}, sort_keys=True).encode()

    def _issue(self, complete_only: bool) -> None:
        """Push buckets in key order; with complete_only, stop at the first incomplete one."""
        while self.issued < len(self.buckets):
            b = self.buckets.buckets[self.issued]
            if complete_only and self.ready[b.key] < self.trainable[b.key]:
                return
            assert self.reqs is not None  # _begin_round posted the round
            self.client.push(self.reqs, b.grads)
            self.issued += 1

    def _end_backward(self) -> None:
        self.in_backward = False
        if self.reqs is not None:
            self._finish_round()
        if self._compute_from is not None:  # forward to here, less the waits for the round
            t0, waited = self._compute_from
            took = time.perf_counter() - t0 - (self.stats.wait_s[LAN] - waited)
            self.compute_s += max(0.0, took)
            self._compute_from = None
        if self.window_closes:  # HFA: one step's gradients are complete on every worker
            self.window_closes = False
            self.steps += 1
            self.hfa_samples += int(self._weight())
            self.samples, self.passes_done, self.explicit_samples = 0, 0, None
            self.average_due = self.steps % cast(HFA, self.algo).k1 == 0

    @torch.no_grad()
    def _finish_round(self) -> None:
        try:
            if self._round_lost is not None:
                raise self._round_lost
            self._exchange()
        except Exception as e:  # noqa: BLE001 - a lost rank, under on_failure="continue"
            if not faults.is_failure(e):
                raise
            self._complete_after_loss()
        self._after_round()

    def _exchange(self) -> None:
        """Push what backward has not pushed yet and wait for the round's results."""
        self._issue(complete_only=False)  # parameters without a gradient here push zeros
        reqs = self.reqs
        assert reqs is not None  # _begin_round posted the round
        fsa = self.grads_to_workers
        if fsa:
            self.aux_send[0] = self.weight
            self.aux_send[1 : 1 + len(self.params)].copy_(self.present_g[0])
            self._pack_buffers(self._buffer_slice(self.aux_send), self.weight)
            self.client.push(reqs, self.aux_send)
            self._pull_pause()
            # fresh tensors: a .grad the user kept from the last step (a view) keeps its values
            self.results = [torch.empty_like(t) for t in self.results]
            for out in self.results:
                self.client.pull(reqs, out)
            self.client.pull(reqs, self.aux_recv)
        else:  # the servers stepped: the new parameters land in the model
            if self.aux_len:
                self._pack_buffers(self.aux_send, self.weight)
                self.client.push(reqs, self.aux_send)
            self.client.push(reqs, presence_payload(self.present_g.view(-1)))
            self._pull_pause()
            for b in self.buckets:
                self.client.pull(reqs, b.params)
            if self.aux_len:
                self.client.pull(reqs, self.aux_recv)
            self.client.pull(reqs, self.present_out)
        if self.client.flags & FLAG_STATS:
            self.client.pull_stats(reqs, self.server_counts)
        self.client.wait(reqs)
        if faults.watching():
            self._keep_results()

    def _pull_pause(self) -> None:
        """GEOMPI_FAULT_SLOW_PULL: a pause that still drives MPI progress (the others' stop
        agreement, a nonblocking collective, needs this worker's)."""
        if self.client.step != self._slow_at:
            return
        from mpi4py import MPI

        self._slow_at, until = -1, time.monotonic() + 4.0
        while time.monotonic() < until:
            MPI.COMM_SELF.Iprobe()
            time.sleep(1e-3)

    def _after_round(self) -> None:
        """The round's results into the model: the global gradient (FSA) or the parameters
        the servers stepped (which the pulls already wrote), and the buffers."""
        fsa = self.grads_to_workers
        self.reqs = None
        self.synced = True
        self.samples, self.passes_done, self.explicit_samples = 0, 0, None
        self.global_syncs += 1
        if not fsa:
            if self.aux_len:  # the servers' mean of the buffers
                self._unpack_buffers(self.aux_recv, 1.0)
            return
        total = float(self.aux_recv[0])
        counts = self.aux_recv[1 : 1 + len(self.params)].tolist()  # in the layout's order
        for out in self.results:
            out.div_(total)
        for p in self.params:
            if counts[self.layout_pos[id(p)]] == 0:
                p.grad = None  # no worker had a gradient: torch.optim leaves it alone
            else:
                bucket, off, numel = self.buckets.where[id(p)]
                p.grad = self.results[bucket.key][off : off + numel].view_as(p)
        self._unpack_buffers(self._buffer_slice(self.aux_recv), 1.0 / total)

    def synchronize(self) -> None:
        """Complete the gradient exchange of this step now, on every worker (FSA, MixedSync)."""
        if self.algo.local_steps or self.synced:
            return
        if self.in_backward:
            raise ConfigError("synchronize() was called inside backward: call it after")
        self._begin_round()  # it takes the gradients accumulated so far
        self._finish_round()

    # ---- the step -------------------------------------------------------------------------
    def user_step(self, closure, local_step):
        """``opt.step()`` of a DistributedOptimizer (the CLI's loop calls :meth:`step`)."""
        self.client.step = self.steps  # HFA's rounds say which step they average
        return self.step(closure, local_step)

    def step(self, closure, local_step):
        check_step(self, closure)
        if self.server_side and getattr(self.opt, "found_inf", None) is not None:
            where = "MixedSync" if self.algo.independent_dcs else 'FSA(optimizer="servers")'
            self._stop(
                ConfigError(
                    f"a GradScaler with {where}: the global servers step during backward, on "
                    "the scaled gradients; use torch.autocast without a GradScaler, or FSA() "
                    "(the workers step)"
                )
            )
        if self.algo.local_steps:
            return self._hfa_step(local_step)
        self.synchronize()
        if self.server_side:
            return None  # the global servers stepped; the parameters arrived with backward
        if not self._finite():
            return None
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._with_grad(), self.max_grad_norm)
        return local_step()

    def _with_grad(self) -> list[torch.Tensor]:
        return [p for p in self.params if p.grad is not None]

    def _finite(self) -> bool:
        """Whether the global gradient is finite; on NaN/Inf apply ``on_nonfinite`` (every
        worker sees the same sum, so all decide alike)."""
        if all(all_finite(p.grad) for p in self.params if p.grad is not None):
            return True
        if self.s.cfg.on_nonfinite == "skip":
            self.skipped += 1
            return False
        self._stop(
            NonFiniteError(
                # FSA (the only caller): one round a step, this one counted
                f"non-finite global gradient at step {self.global_syncs}: lower the lr, check the "
                "data, use a torch.amp.GradScaler, or pass on_nonfinite='skip' to geompi.init"
            )
        )

    def _hfa_step(self, local_step):
        if self.max_grad_norm is not None:  # the inner optimizer's own, local gradient
            torch.nn.utils.clip_grad_norm_(self._with_grad(), self.max_grad_norm)
        out = local_step()
        if self.average_due:
            try:
                self._average_now()
            except Exception as e:  # noqa: BLE001 - a lost rank, under on_failure="continue"
                if not self.recovers:
                    raise
                self.survive(e, self.steps - 1)  # the steps before this one, as the CLI counts
        return out

    def force_global_average(self) -> None:
        """The next datacenter average goes global, every key (HFA only)."""
        check_force_global(self)
        self.global_next = True

    def average_globally(self) -> None:
        """HFA, right after a datacenter average: one more, global over every key, so every
        worker holds the global model (the CLI's stop under streaming HFA)."""
        self._average_now(final=True)

    def _average_now(self, final: bool = False, flush: bool = False) -> None:
        """HFA: the datacenter average that the K1-th step made due (every K2-th is global).
        ``final`` (close() between global averages): one global average of every worker,
        weighted by its samples since the last average, or if none by that average's.
        ``flush`` (with ``final``, no step since the last global average): it only delivers
        what a lossy codec held back, with no outer step."""
        algo = cast(HFA, self.algo)  # HFA's settings: only it averages
        self.average_due = False
        uniform = algo.weighting == "uniform"
        samples = float(self.hfa_samples or (self.round_samples or 1.0 if final else 0))
        weight = uniform_weight(self.client) if uniform else samples
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
        self.hfa_samples = 0
        # after a forced global round the local servers count K2 (and streaming's staggered
        # schedule) from the start again, and so do the workers
        self.dc_rounds = 0 if forced else self.dc_rounds + 1
        if forced:  # uncompressed both ways: every worker holds the servers' model
            self.exact_at = self.steps
        if go_global:
            self.steps_at_global = self.steps
            self.global_syncs += 1
            if algo.reset_optimizer:
                self.opt.state.clear()

    @torch.no_grad()
    def _average(
        self, weight: float, force_global: bool = False, cadence=None, flush: bool = False
    ) -> None:
        """HFA's datacenter average (every K2-th one global, or every key now with
        ``force_global``) of parameters and float buffers; with adaptive ``cadence``, its
        K2 goes to the local server and the exchange times it measured come back."""
        flags = (FLAG_GLOBAL if force_global else 0) | (FLAG_FLUSH if flush else 0)
        flags |= self.lan_flags | (FLAG_STATS if self.want_stats else 0)
        if self.aux_len:  # the buffers: averaged by the global servers, never outer-stepped
            flags |= FLAG_MEAN
        for b in self.buckets:
            torch.mul(b.params, weight, out=b.grads)
        if self.aux_len:
            self._pack_buffers(self.aux_send, weight)
        self.pushed_weight = weight  # the results land in the parameters: see rejoin()
        k2 = cadence.k2 if cadence is not None else 0
        reqs = self.client.start(Op.AVG, self.keys(), weight=weight, flags=flags, k2=k2)
        if k2:
            self.client.pull_exchanges(reqs, cadence.told)
        for b in self.buckets:
            self.client.push(reqs, b.grads)
        if self.aux_len:
            self.client.push(reqs, self.aux_send)
        for b in self.buckets:
            self.client.pull(reqs, b.params)
        if self.aux_len:
            self.client.pull(reqs, self.aux_recv)
        if flags & FLAG_STATS:
            self.client.pull_stats(reqs, self.server_counts)
        self.client.wait(reqs)
        self.pushed_weight = None
        if self.aux_len:
            self._unpack_buffers(self.aux_recv, 1.0)

    @torch.no_grad()
    def rejoin(self, topo) -> None:
        """HFA after a recovery (geompi.comm.faults, ``--on-failure continue``): talk to the
        local server over the rebuilt communicators; an average cut off mid-way leaves this
        worker's parameters as it pushed them (a part of the results may have landed)."""
        s = self.s
        s.topo, s.rank = topo, s.comms.world.Get_rank()
        old = self.client
        self.client = PSClient(Link(s.comms.dc, LAN, self.stats), old.timeout)
        self.client.round_id, self.client.done_id, self.client.step = (
            old.round_id,
            old.done_id,
            old.step,
        )
        if self.cadence is not None:
            self.cadence.comm = s.comms.all_workers
        if self.pushed_weight is not None:
            for b in self.buckets:
                torch.div(b.grads, self.pushed_weight, out=b.params)
            if self.aux_len:
                self._unpack_buffers(self.aux_send, 1.0 / self.pushed_weight)
            self.pushed_weight = None
        self.closed = False  # close() may have been cut off too: it runs again

    def survive(self, err: BaseException, step: int, redo: bool = True) -> int:
        """``on_failure="continue"``: a rank was lost during this worker's round (``err``).
        Every survivor recovers (geompi.comm.faults), the workers agree on the step (the
        caller's count, returned agreed), rank 0 says what was lost, and (``redo``) the round
        cut off becomes a global average over the surviving datacenters, from the parameters
        each worker had before it (FSA: see _recover). Re-raises ``err`` where it is not a lost
        rank."""
        while True:
            if not faults.is_failure(err):
                raise err
            if not self.algo.local_steps:  # FSA: the round itself was completed or redone
                try:
                    self._recover()
                    return step
                except Exception as again:  # noqa: BLE001 - lost another rank meanwhile
                    err = again
                    continue
            loss = self._rejoin_survivors()
            try:
                step = self.agree_on_step(step)
                self._record(loss, step + 1 if redo else step)  # the step trained, or saved
                if redo:
                    self.average_globally()
                return step
            except Exception as again:  # noqa: BLE001 - lost another rank meanwhile
                err = again

    def _pulled(self) -> list[torch.Tensor]:
        """Where a GRAD round's results land (FSA, MixedSync)."""
        if self.grads_to_workers:
            return [*self.results, self.aux_recv]
        out = [b.params for b in self.buckets]
        return [*out, self.aux_recv, self.present_out] if self.aux_len else [*out, self.present_out]

    def _keep_results(self) -> None:
        """FSA under on_failure="continue": a copy of the round's results, for a worker that a
        loss cuts off before they reach it (see _catch_up)."""
        pulled = self._pulled()
        if len(self._kept) != len(pulled):
            self._kept = [torch.empty_like(t) for t in pulled]
        for kept, t in zip(self._kept, pulled):
            kept.copy_(t)
        self._kept_round = self.client.done_id

    def _complete_after_loss(self) -> None:
        """FSA: a rank was lost during this worker's round. Every survivor recovers; if some
        worker completed the round, its results reach the others (_catch_up), else the
        survivors redo it with the gradients they pushed (the lost workers' left out)."""
        pending = self.client.round_id
        while True:
            try:
                self._recover()
                if self.client.done_id == pending:  # completed from a peer
                    return
                self.reqs = self._start_round()  # the round again, in the new topology
                self._exchange()
                return
            except Exception as again:  # noqa: BLE001 - lost another rank meanwhile
                if not faults.is_failure(again):
                    raise

    def _rejoin_survivors(self) -> faults.Loss:
        """Every survivor's first steps after a loss: recover (geompi.comm.faults; a rank whose
        datacenter leaves exits in there), then this worker's and its caller's rebuilding."""
        loss = faults.recover(self.s.comms, self.s.topo, self.client.done_id)
        self.rejoin(loss.topo)
        if self.rejoined is not None:
            self.rejoined(loss)
        for again in self.on_rejoin:  # geompi.Metrics: its own communicator, rebuilt here
            again()
        return loss

    def _recover(self) -> faults.Loss:
        """FSA's one recovery, on every worker wherever the loss met it (a round, or the CLI's
        stop agreement, checkpoint or close): recover, rejoin, complete the last round on the
        workers it did not reach, and say what was lost. Every worker's next round is then
        the first after the last completed one."""
        loss = self._rejoin_survivors()
        caught_up = self._catch_up()
        self.client.round_id = self._last_done(loss)
        # the first step trained without the lost ranks (a worker that caught up counts the
        # round it completed as the others did)
        self._record(loss, self.global_syncs + 1 + caught_up, caught_up)
        return loss

    def _last_done(self, loss: faults.Loss) -> int:
        """The last round a surviving worker completed: FSA's rounds are the job's (``loss``
        knows it); MixedSync's datacenters count their own, so it is this one's (collective
        over its workers)."""
        if not self.algo.independent_dcs:
            return loss.done
        import numpy as np
        from mpi4py import MPI

        done = np.array([self.client.done_id], dtype=np.int64)
        self.s.comms.workers.Allreduce(MPI.IN_PLACE, done, op=MPI.MAX)
        return int(done[0])

    def peers(self):
        """The workers that went through the same rounds: every worker (FSA, HFA), or this
        datacenter's (MixedSync); geompi.Metrics averages over them."""
        c = self.s.comms
        return c.workers if self.algo.independent_dcs else c.all_workers

    @torch.no_grad()
    def _catch_up(self) -> bool:
        """Collective over the workers after a recovery (FSA, MixedSync: over _peers): the
        workers that the loss cut off before their round's results arrived take them from the
        lowest-ranked worker they reached (a loss cuts a round off between the two at most).
        Returns whether this one did."""
        import numpy as np
        from mpi4py import MPI

        comm = self.peers()
        ids = np.array([self._kept_round, -self._kept_round], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, ids, op=MPI.MAX)
        latest, earliest = int(ids[0]), -int(ids[1])
        if latest == earliest:
            return False
        behind = self._kept_round != latest
        # the lowest rank that has the results, and whether a worker behind is not in that
        # round (never expected: then every worker stops alike)
        mine = np.array(
            [comm.Get_rank() if not behind else comm.Get_size(),
             -int(behind and self.client.round_id != latest)], dtype=np.int64,
        )  # fmt: skip
        comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MIN)
        if mine[1]:
            raise GeompiError(
                f"after a lost rank some workers completed round {latest} and others are not "
                "in it: the job cannot go on; run it again from its last checkpoint"
            )
        if not self._kept:
            self._kept = [torch.empty_like(t) for t in self._pulled()]
        for kept in self._kept:
            host = kept.detach().cpu()
            comm.Bcast(host.numpy(), root=int(mine[0]))
            kept.copy_(host)
        if behind:
            for t, kept in zip(self._pulled(), self._kept):
                t.copy_(kept)
            self._kept_round = self.client.done_id = latest
        return behind

    def _record(self, loss: faults.Loss, at: int, caught_up: bool = False) -> None:
        """A survived loss in ``failures``, and its one line (from the master worker).
        ``caught_up``: this worker took the last round's results from another (FSA)."""
        self.failures.append(
            {"step": at, "lost_ranks": loss.lost_at_start, "left_dcs": loss.left_at_start,
             "lost_workers": loss.lost_workers, "topology": loss.topo.describe(),
             "results_from_peer": caught_up, "recovered_at": time.time()}
        )  # fmt: skip
        if self.master:
            from geompi.runtime import say

            # MixedSync's datacenters are each at their own step: the line gives the master's
            step = f"{at} of datacenter 0" if self.algo.independent_dcs else at
            say(loss.describe(step, self.algo.left_with))

    def agree_on_step(self, step: int) -> int:
        """Collective over every worker after a recovery: the latest step any of them reached
        (one that finished its round before the loss may be K1 steps ahead) and round number,
        which every worker takes on."""
        import numpy as np
        from mpi4py import MPI

        mine = np.array([step, self.client.round_id], dtype=np.int64)
        self.s.comms.all_workers.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        self.steps += int(mine[0]) - step
        self.client.round_id = int(mine[1])
        return int(mine[0])


def check_step(engine: Synchronizer | LocalEngine, closure) -> None:
    """What ``step()`` refuses, under mpirun and in one process alike (one line, all stop)."""
    if engine.closed:
        engine._stop(
            ConfigError(
                "this DistributedOptimizer was closed (geompi.finish(), or a newer one was "
                "built): build a new one to train on"
            )
        )
    if closure is not None:
        engine._stop(
            ConfigError(
                "DistributedOptimizer.step(closure) is not supported: call backward, then step()"
            )
        )


def check_force_global(engine: Synchronizer | LocalEngine) -> None:
    """``force_global_average()`` is HFA's, in one process too (a script that calls it under
    another algorithm would fail under mpirun)."""
    if not engine.algo.local_steps:
        engine._stop(
            ConfigError(
                f"force_global_average() is for HFA: under {engine.algo.name} every round "
                "already reaches the global servers"
            )
        )


class LocalEngine:
    """The engine of a world of one process (``python script.py``, no mpirun): no servers, so
    ``step()`` is the user's optimizer's own, on the local gradients (clipped to
    ``max_grad_norm`` where given), as one FSA worker's would be. The algorithm's settings were
    checked as under mpirun; there is nothing to synchronize (HFA's averages of one model, its
    outer optimizer, MixedSync's server-side step: none run). ``geompi.save``/``load`` write and
    read the same file as one worker would."""

    server_side = False  # the user's step runs here: a GradScaler unscales as usual
    holds_server_state = False  # nothing held elsewhere: state_dict() is torch's own
    lossy_wan = False  # no WAN codec

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        algo: Algorithm,
        session,
        max_grad_norm: float | None,
    ) -> None:
        self.opt, self.model, self.algo, self.s = optimizer, model, algo, session
        self.max_grad_norm = max_grad_norm
        self.params = list(model.parameters())
        self.stats = LinkStats()  # stays at zero: the report says no byte moved
        self.t_start = time.perf_counter()
        self.report: dict | None = None
        self.no_sync_depth = 0  # no_sync(): nothing is sent anyway
        self.explicit_samples: int | None = None
        self.steps = 0
        self.global_syncs = 0
        self.failures: list[dict] = []
        self.closed = False

    def start(self) -> None:
        """As a worker's: a DistributedOptimizer still open is closed first."""
        self.s.send_job({**self.algo.job(), "wan": {}}, self.opt)
        self.t_start = time.perf_counter()

    def user_step(self, closure, local_step):
        check_step(self, closure)
        if self.max_grad_norm is not None:
            grads = [p for p in self.params if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        self.steps += 1
        return local_step()

    def synchronize(self) -> None:
        """Nothing to exchange."""

    def force_global_average(self) -> None:
        check_force_global(self)

    def end_on_global(self, streaming: bool = False) -> None:
        """The one model is the global model."""

    def state(self) -> dict:
        return {"global_syncs": self.global_syncs}

    def load_state(self, state: dict) -> None:
        self.global_syncs = int(state.get("global_syncs", 0))

    def restore(self, held: dict | None, what: str, new_model: bool = False) -> None:
        """After ``geompi.load``: no other worker or server to tell."""
        if self.closed:
            self._stop(ConfigError(f"{what} after this DistributedOptimizer was closed"))

    def close(self, report: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if not report:
            return
        from geompi.session import gather_report

        wall = time.perf_counter() - self.t_start
        mine = {"role": "WORKER", **self.stats.as_dict(), "wall_s": wall}
        self.report = gather_report(self.s, mine)

    def _stop(self, err: GeompiError) -> NoReturn:
        from geompi import session

        session.stop_identically(self.s, err)
