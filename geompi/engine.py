"""The worker engine behind ``geompi.DistributedOptimizer`` and the CLI's loop: algorithm-free.

It owns what every algorithm's workers share: the flat buckets of the model, the backward and
forward hooks, the sample counting, the buffers' packing, ``no_sync``, the lifecycle (INIT
round, start, close and its report), the client to this datacenter's local server and the
gradient round's mechanics (pushed from backward hooks, completed as backward ends). What
happens around backward and ``step()`` is the algorithm's worker side
(``Algorithm.worker(engine)``, geompi.sync), which the engine calls and never tests; recovery
from a lost rank is geompi.recovery's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import NoReturn, cast

import numpy as np
import torch

from geompi.comm import faults
from geompi.comm.buckets import Buckets
from geompi.comm.compression import make_compressor
from geompi.comm.topology import node_share
from geompi.comm.transport import LAN, Link, LinkStats, worker_timeout
from geompi.errors import ConfigError, GeompiError
from geompi.gradients import GradientRounds
from geompi.ps.client import PSClient, scatters
from geompi.ps.protocol import FLAG_SCATTER, MAX_KEYS, STATS_LEN, Op
from geompi.recovery import Recovery
from geompi.sync import Algorithm


class Synchronizer:
    """The worker engine of one algorithm around a user's model and optimizer."""

    has_servers = True  # geompi.save's SAVE round reaches the global servers

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
        self.begun_spec: dict = {}  # the INIT spec the global servers began with (begin)
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
        dc = session.topo.dc_of(session.rank)
        self.dc_first = session.topo.workers(dc)[0] == session.rank if dc is not None else False
        self.recovery = Recovery(self)
        self.failures = self.recovery.failures  # on_failure="continue": every loss survived
        # whether step() recovers from a lost rank itself (the public API), or leaves it to
        # its caller (the CLI's loop, which rebuilds its own state too)
        self.recovers = True
        # the caller's own rebuilding after a recovery (the CLI's loop: its topology, its stop
        # agreement), called with the faults.Loss before the workers agree on anything
        self.rejoined: Callable[[faults.Loss], None] | None = None
        self.on_rejoin: list[Callable[[], None]] = []  # at the same point, every survivor
        self.side = algo.worker(self)  # what happens around backward and step()
        named = list(model.named_parameters())
        self.params = [p for _, p in named]
        self.buckets = Buckets(named, int(bucket_mb * 2**20), self.side.fragments)
        check_key_count(self.buckets, bucket_mb)  # the same on every worker, before any collective
        self.float_buffers = synchronized_buffers(model)
        self.client = PSClient(
            Link(session.comms.dc, LAN, self.stats), worker_timeout(session.cfg.comm_timeout)
        )
        self._buffers(session, lan_reduce)
        self.no_sync_depth = 0
        self.explicit_samples: int | None = None
        self.samples = 0  # since the last exchange
        self.passes_done = 0
        self.in_backward = False
        self.synced = False
        self.global_syncs = 0
        self.skipped = 0
        self.closed = False
        # geompi.Metrics: rounds ask the local server for its WAN counters (FLAG_STATS), and
        # the training forwards and backwards are timed, less the waits inside them
        self.want_stats = False
        self.server_counts = np.zeros(STATS_LEN, dtype=np.float64)
        self.compute_s = 0.0
        self._compute_from: tuple[float, float] | None = None  # (clock, LAN wait) at forward
        self._hook(named)
        self.rounds = GradientRounds(self)  # FSA's and MixedSync's, one a step
        self.side.built()

    def _buffers(self, session, lan_reduce: str | None) -> None:
        """The round's buffers beside the buckets: the extra key (its layout is the worker
        side's: FSA's [samples, per-parameter "had a gradient", buffers x samples], else the
        buffers alone, a mean key where the servers step), the presence key (per parameter, 1
        if this worker has its gradient this round, one row per global server) and where
        each parameter's gradient goes; and whether the datacenter reduce-scatters."""
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
        g = session.topo.num_global_servers
        self.present_g = torch.zeros(g, len(self.params))
        self.layout_pos = {
            id(m.param): i for i, m in enumerate(m for b in self.buckets for m in b.members)
        }
        self.present_out = torch.zeros(g * len(self.params))
        self.aux_len = self.side.aux_len(len(self.params), nbuf)
        self.aux_send = torch.zeros(self.aux_len, device=device)
        self.aux_recv = torch.zeros(self.aux_len, device=device)

    def _hook(self, named) -> None:
        """The forward pre-hook and each trainable parameter's gradient hook, removed at
        close(), so a DistributedOptimizer built later on the same model is the only one that
        sees its forwards and gradients."""
        self.hooks = [self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)]
        self.hooked = {id(p) for p in self.params if p.requires_grad}
        # the parameters that were frozen when it was built: if one is unfrozen, its gradient
        # would stay local (checked every round; the whole model every UNHOOKED_SCAN rounds)
        self.frozen = [(name, p) for name, p in named if not p.requires_grad]
        for p in self.params:
            if p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ---- what the worker side holds ------------------------------------------------------
    @property
    def optimizer_state_on_servers(self) -> bool:
        """Whether the global servers hold the optimizer's state (WorkerSide's question)."""
        return self.side.optimizer_state_on_servers

    @property
    def takes_scaler_state(self) -> bool:
        """Whether step() takes a GradScaler's state (WorkerSide's question)."""
        return self.side.takes_scaler_state

    # ---- keys and buffers -----------------------------------------------------------------
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
        if self.side.servers_step and presence:
            keys = keys + [(self.presence_key, self.present_out.numel())]
        return keys

    def layout(self) -> list:
        """Every key's parameters with their param group (layout_spec), for the servers."""
        held = {id(p): i for i, g in enumerate(self.opt.param_groups) for p in g["params"]}
        return layout_spec(self.buckets, {id(p): held.get(id(p), -1) for p in self.params})

    def pack_buffers(self, out: torch.Tensor, scale: float) -> None:
        off = 0
        for b in self.float_buffers:
            n = b.numel()
            out[off : off + n].copy_(b.detach().reshape(-1)).mul_(scale)
            off += n

    @torch.no_grad()
    def unpack_buffers(self, src: torch.Tensor, scale: float) -> None:
        off = 0
        for b in self.float_buffers:
            n = b.numel()
            b.copy_((src[off : off + n] * scale).view_as(b))
            off += n

    # ---- start and end --------------------------------------------------------------------
    def start(self, extra_spec: dict | None = None, send_restore=None) -> None:
        """Tell the servers the algorithm, then the INIT round: the master's values for all
        (``begin``). The API's optimizer and the CLI's loop start their servers alike."""
        owner = self.opt if getattr(self.opt, "_geompi", None) is self else None  # the API's
        self.s.send_job({**self.algo.job(), "wan": self.wan}, owner)
        self.begin(extra_spec, send_restore)

    def begin(self, extra_spec: dict | None = None, send_restore=None) -> None:
        """The INIT round, once the servers know the job. ``extra_spec`` joins the servers'
        spec; ``send_restore(reqs)`` (the CLI's master, on resume) adds their saved state."""
        spec = {**(self.server_spec or {}), **(extra_spec or {}), **self.side.init_spec()}
        self.begun_spec = spec  # what configured the global servers (a takeover sends it again)
        self.init_round(spec, send_restore)
        self.stats.reset_time()  # the report's waits and wall time cover training, not INIT
        self.t_start = time.perf_counter()
        self.side.begin()

    def state(self) -> dict:
        """The counters a checkpoint keeps (the names are those of the file format)."""
        return {"global_syncs": self.global_syncs, **self.side.state()}

    def load_state(self, state: dict) -> None:
        self.global_syncs = int(state.get("global_syncs", 0))
        self.side.load_state(state)

    def init_payload(self, spec: dict | None) -> bytes | None:
        """An INIT round's spec as this worker sends it: the master's whole, the layout alone
        from the first worker of another datacenter, nothing from the others."""
        payload = json.dumps(spec, sort_keys=True).encode() if spec and self.master else None
        if spec and "layout" in spec and self.dc_first and not self.master:
            # every local server's codec needs the layout (idle parameters keep their residual)
            payload = json.dumps({"layout": spec["layout"]}).encode()
        return payload

    @torch.no_grad()
    def init_round(self, spec: dict | None = None, send_restore=None) -> None:
        """Every worker gets the master worker's parameters and buffers (collective)."""
        payload = self.init_payload(spec)
        presence = self.side.servers_step
        reqs = self.client.start(Op.INIT, self.keys(), spec=payload)
        for b in self.buckets:
            if self.master:
                b.grads.copy_(b.params)
            else:
                b.grads.zero_()
            reqs.push(b.grads)
        if self.aux_len:
            self.aux_send.zero_()
            if self.master:
                self.pack_buffers(self.side.buffer_slice(self.aux_send), 1.0)
            reqs.push(self.aux_send)
        if presence:
            self.present_g.zero_()
            reqs.push(self.present_g.view(-1))
        for b in self.buckets:
            reqs.pull(b.params)
        if self.aux_len:
            reqs.pull(self.aux_recv)
        if presence:
            reqs.pull(self.present_out)
        if send_restore is not None:
            send_restore(reqs)
        reqs.wait()
        if self.aux_len:
            self.unpack_buffers(self.side.buffer_slice(self.aux_recv), 1.0)

    def close(self, report: bool = True) -> None:
        """Release the servers (the worker side's end: MixedSync first receives the final
        global model). ``report``: then gather the job's figures (collective over
        COMM_WORLD, servers included)."""
        if self.closed:
            return
        self.closed = True
        for hook in self.hooks:
            hook.remove()
        self.side.before_close()
        self.side.end()
        if not report:
            return
        from geompi.session import gather_report

        wall = time.perf_counter() - self.t_start
        self.report = gather_report(
            self.s, {"role": "WORKER", **self.stats.as_dict(), "wall_s": wall}
        )
        if self.report is not None:
            self.report.update(self.side.report())

    def end_on_global(self, streaming: bool = False) -> None:
        """Collective over the workers: every worker on the global servers' model, bitwise
        (HFA's one more global average; see its worker side). ``streaming``: every fragment
        now, rather than on the last forced datacenter round."""
        self.side.end_on_global(streaming)

    # ---- state the global servers hold (geompi.save/load, state_dict) ---------------------
    @property
    def holds_server_state(self) -> bool:
        """Whether this job's global servers hold optimizer state: their optimizer's (FSA's
        servers placement, MixedSync) or an outer optimizer's (HFA's momentum or moments)."""
        return self.side.holds_server_state

    def at_global_model(self) -> bool:
        """Whether every worker holds the global servers' model now."""
        return self.side.at_global_model()

    def param_names(self) -> list[str]:
        """The model's name of each parameter the optimizer holds, in torch's index order."""
        from geompi.state import param_names

        return param_names(self.model, self.opt)

    def restore(self, held: dict | None, what: str, new_model: bool = False) -> None:
        """Collective over the workers: the INIT round (the master's parameters and buffers
        reach every worker), handing the global servers ``held`` (the master's, by parameter
        name as :meth:`server_state` gives it) when they keep state. ``new_model``: every
        worker has just loaded the same model (geompi.load), so HFA's workers are together."""
        self.refuse_closed(what)
        self.side.check_restore(what, new_model)
        send = None
        if self.master and held is not None:
            from geompi.held_state import HeldState

            io = HeldState.for_engine(self)
            states = io.shard_states(
                held.get("optimizer", {}), held.get("algorithm", {}), held.get("model", {})
            )
            if states is not None:
                send = lambda reqs: io.send_server_states(reqs, states)  # noqa: E731
        self.init_round({"restore": True} if send is not None else None, send)

    def refuse_closed(self, what: str) -> None:
        if self.closed:
            self.stop(
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
        self.side.before_forward()
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                self.samples += int(x.shape[0])
                return

    def sample_weight(self) -> float:
        """This worker's weight in the coming exchange: its samples since the last one."""
        if self.explicit_samples is not None:
            return float(self.explicit_samples)
        return float(self.samples or 1)

    def reset_samples(self) -> None:
        """An exchange (or HFA's step) took the samples and passes counted so far."""
        self.samples, self.passes_done, self.explicit_samples = 0, 0, None

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
            if self.no_sync_depth == 0 and self.passes_done >= self.passes:
                self.side.backward_counts()  # a gradient round begins (or a step completes)
        self.rounds.on_grad(p)

    def stop(self, err: Exception) -> NoReturn:
        """An error every worker meets at the same point: one line from the master, all stop."""
        from geompi import session

        session.stop_identically(self.s, cast(GeompiError, err))

    def _end_backward(self) -> None:
        self.in_backward = False
        if self.rounds.reqs is not None:
            self.rounds.finish()
        if self._compute_from is not None:  # forward to here, less the waits for the round
            t0, waited = self._compute_from
            took = time.perf_counter() - t0 - (self.stats.wait_s[LAN] - waited)
            self.compute_s += max(0.0, took)
            self._compute_from = None
        self.side.backward_ended()

    def synchronize(self) -> None:
        """Complete the exchange of this step now, on every worker (FSA, MixedSync)."""
        self.side.synchronize()

    # ---- the step -------------------------------------------------------------------------
    def user_step(self, closure, local_step):
        """``opt.step()`` of a DistributedOptimizer (the CLI's loop calls :meth:`step`)."""
        self.client.step = self.side.steps  # HFA's rounds say which step they average
        return self.step(closure, local_step)

    def step(self, closure, local_step):
        check_step(self, closure)
        self.side.check_scaler()
        return self.side.step(local_step)

    def with_grad(self) -> list[torch.Tensor]:
        return [p for p in self.params if p.grad is not None]

    def force_global_average(self) -> None:
        """The next datacenter average goes global, every key (HFA only)."""
        check_force_global(self)
        self.side.force_global()

    # ---- after a lost rank ----------------------------------------------------------------
    def survive(self, err: BaseException, step: int, redo: bool = True) -> int:
        """``on_failure="continue"``: a rank was lost during this worker's round (``err``);
        see Recovery.survive. Returns the caller's step count, agreed."""
        return self.recovery.survive(err, step, redo)

    def peers(self):
        """The workers that went through the same rounds: every worker (FSA, HFA), or this
        datacenter's (MixedSync); geompi.Metrics averages over them."""
        return self.side.peers(self.s.comms)


def check_step(engine: Synchronizer | LocalEngine, closure) -> None:
    """What ``step()`` refuses, under mpirun and in one process alike (one line, all stop)."""
    if engine.closed:
        engine.stop(
            ConfigError(
                "this DistributedOptimizer was closed (geompi.finish(), or a newer one was "
                "built): build a new one to train on"
            )
        )
    if closure is not None:
        engine.stop(
            ConfigError(
                "DistributedOptimizer.step(closure) is not supported: call backward, then step()"
            )
        )


def check_force_global(engine: Synchronizer | LocalEngine) -> None:
    """``force_global_average()`` is HFA's, in one process too (a script that calls it under
    another algorithm would fail under mpirun)."""
    try:
        engine.algo.check_force_global()
    except GeompiError as e:
        engine.stop(e)


class LocalEngine:
    """The engine of a world of one process (``python script.py``, no mpirun): no servers, so
    ``step()`` is the user's optimizer's own, on the local gradients (clipped to
    ``max_grad_norm`` where given), as one FSA worker's would be. The algorithm's settings were
    checked as under mpirun; there is nothing to synchronize (HFA's averages of one model, its
    outer optimizer, MixedSync's server-side step: none run). ``geompi.save``/``load`` write and
    read the same file as one worker would."""

    optimizer_state_on_servers = False  # the user's optimizer steps here, its state with it
    takes_scaler_state = False  # the user's step runs here: a GradScaler unscales as usual
    holds_server_state = False  # nothing held elsewhere: state_dict() is torch's own
    has_servers = False  # no SAVE round: geompi.save writes this process's state
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
            self.stop(ConfigError(f"{what} after this DistributedOptimizer was closed"))

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

    def stop(self, err: Exception) -> NoReturn:
        from geompi import session

        session.stop_identically(self.s, cast(GeompiError, err))


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
