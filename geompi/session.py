"""The job a Python script joins with ``geompi.init()``: topology, communicators, this rank's role.

Workers return from ``init()`` and run the user's loop. Server ranks stay inside ``init()``: they
wait for the workers to say which algorithm they chose (a JSON job spec broadcast by the master
worker when the DistributedOptimizer is built), serve rounds until the workers call
``geompi.finish()``, then end the process with status 0.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from geompi.comm import callwatch, faults, heartbeat
from geompi.comm.poll import Backoff, spin_until
from geompi.comm.topology import Communicators, Role, Topology, node_share
from geompi.comm.transport import LinkStats
from geompi.config import INIT_SETTINGS, RunConfig, make_config
from geompi.errors import ConfigError, GeompiError, ProtocolError

if TYPE_CHECKING:  # mpi4py's stubs; importing it at run time would start MPI
    from mpi4py.MPI import Intracomm

    from geompi.runtime import StopRequest

# Settings of ``init()`` that come from RunConfig (keywords override GEOMPI_* variables).


@dataclass
class Session:
    """What ``geompi.init()`` set up on this rank."""

    cfg: RunConfig
    topo: Topology
    comms: Communicators
    stats: LinkStats
    rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # the DistributedOptimizer the servers now serve (a geompi.optimizer.GeompiOptimizer: Any,
    # since that module imports this one)
    optimizer: Any = None
    local_rank: int = 0  # this worker's index among the workers on its node
    finished: bool = False
    stop: StopRequest | None = None  # geompi.stop_requested()'s agreement
    stop_handlers: dict | None = None  # the signal handlers it replaced

    @property
    def role(self) -> Role:
        return self.topo.role(self.rank)

    @property
    def is_worker(self) -> bool:
        return self.role is Role.WORKER

    @property
    def worker_comm(self) -> Intracomm:
        """Every worker of the job (``comms.all_workers``: a worker's, never None on one)."""
        comm = self.comms.all_workers
        if comm is None:  # pragma: no cover - servers stay inside init()
            raise ConfigError("this rank is a server: code after geompi.init() runs on workers")
        return comm

    def send_job(self, job: dict, optimizer: Any) -> None:
        """Master worker: tell every server what to serve next (collective over COMM_WORLD).

        A DistributedOptimizer still being served is closed first, so one job can train with
        several optimizers in turn.
        """
        if self.optimizer is not None:
            self.optimizer.geompi_close()
        self.optimizer = optimizer
        _bcast_json(self.comms.world, job if self.rank == 0 else None)


_session: Session | None = None


def current() -> Session:
    """The session of this process, or a clear error before ``geompi.init()``."""
    if _session is None:
        raise ConfigError("geompi.init() was not called: call it first, on every rank")
    return _session


def worker_session() -> Session:
    """The session, which must be a worker's (servers never return from ``init``)."""
    s = current()
    if not s.is_worker:  # pragma: no cover - servers stay inside init()
        raise ConfigError("this rank is a server: code after geompi.init() runs on workers only")
    return s


def start(
    settings, comm=None, *, plan=None, again: str | None = None, alone: bool = False
) -> Session:
    """The one start-up of a job, for the CLI, ``geompi.init()`` and the KVStore (collective).

    ``settings()`` returns the validated RunConfig (run inside the topology's planning, so a
    bad setting is one line from rank 0 and every rank exits 2 before any other collective);
    ``plan(cfg, comm)`` the Topology (default: geompi.runtime.plan_topology). Then each rank
    takes its share of the CPUs, the heartbeat starts (with ``comm_timeout``), and under
    ``on_failure="continue"`` the fault watch (``again``: how to run again, in its message).
    A worker's session knows its device and its index among the workers of its node.
    ``alone``: a world of one process that names no topology trains locally (no servers, no
    peer to watch: geompi.init()'s one-process mode).
    """
    from geompi.layout import check_node_gpus
    from geompi.runtime import exit_together, plan_topology, start_job, worker_device
    from geompi.threads import configure_threads

    cfg: RunConfig | None = None

    def planned(c) -> Topology:
        nonlocal cfg
        cfg = settings()
        cfg.wan_settings()  # GEOMPI_WAN_* variables: checked before any collective call
        if plan is not None:
            return plan(cfg, c)
        return plan_topology(cfg, c, alone=alone)

    try:
        comm, topo, comms, stats = start_job(planned, comm)
        # one share of the node's CPUs per rank (geompi.threads); one process: one line only
        configure_threads(comm, quiet=topo.serverless)
    except GeompiError as e:  # pragma: no cover - start_job reports and exits itself
        exit_together(e, 0)
    assert cfg is not None  # planned() made it, or start_job ended the process
    check_node_gpus(cfg.dc_map, topo, comm)  # --dc-map nodes: one warning if workers != GPUs
    if not topo.serverless:  # one process: no peer to watch, nothing to serve
        # so the watchdog can tell idle from lost, and the lost rank's datacenter speaks first
        home = [topo.dc_of(r) for r in range(comm.Get_size())]
        heartbeat.start(comm, cfg.comm_timeout, home)
        if cfg.on_failure == "continue":  # waits raise PeerLost instead of failing (ULFM)
            faults.watch(comm, again)
    s = Session(cfg, topo, comms, stats, comm.Get_rank())
    if s.is_worker:
        s.device = worker_device(comms.workers)
        s.local_rank = node_share(comms.all_workers)[0]  # geompi.local_worker_rank()
    return s


def init(comm=None, **settings) -> Session:
    """Join the job on every rank. Workers return; server ranks serve, then exit with status 0.

    ``settings`` are those of INIT_SETTINGS (else GEOMPI_* variables decide). Collective over
    ``comm`` (default COMM_WORLD).
    """
    global _session
    from geompi.runtime import install_excepthook

    if _session is not None and not _session.finished:
        raise ConfigError("geompi.init() was already called: call geompi.finish() first")
    install_excepthook()
    unknown = sorted(set(settings) - set(INIT_SETTINGS))

    def config() -> RunConfig:
        if unknown:
            raise ConfigError(
                f"geompi.init() got unknown setting(s) {', '.join(unknown)}: "
                f"choose from {', '.join(INIT_SETTINGS)}"
            )
        return make_config(**settings).validate()

    _session = start(config, comm, alone=True)  # one process: trains locally
    if _session.is_worker:
        atexit.register(_finish_at_exit)
        alone = _session.topo.serverless
        if _session.cfg.on_failure != "continue" and not alone:  # a recovery replaces it
            callwatch.start(_session.comms.all_workers, _rounds_begun, _report_mismatch)
        return _session
    serve_until_finished(_session)
    sys.exit(0)


def serve_until_finished(s: Session) -> None:
    """A server rank of any job (CLI, API): serve each job the workers announce until they
    call ``finish()``, then end (``end``)."""
    _serve(s)
    end(s)


def end(s: Session) -> None:
    """Every rank's last collective step: stop the heartbeat together, free the communicators."""
    _stop_heartbeat(s)
    s.comms.free()


def _serve(s: Session) -> None:
    """A server rank: wait for the workers' job spec, then serve it until they are done."""
    from geompi import sync
    from geompi.runtime import abort

    cfg = s.cfg
    while True:  # one job per DistributedOptimizer, until the workers call finish()
        job = _bcast_json(s.comms.world, None, idle=True)
        if job.get("sync") is None:
            return
        stats = LinkStats()  # per job: the report covers this DistributedOptimizer only
        try:
            server = sync.from_job(job).make_server(
                s.topo,
                s.comms,
                stats,
                on_nonfinite=cfg.on_nonfinite,
                timeout=cfg.comm_timeout,
                max_staleness=cfg.max_staleness,
                slowdown=cfg.dc_slowdown,
                wan=job_wan(cfg, job),
            )
            server.run()
        except Exception as e:  # noqa: BLE001 - one line, then every rank stops
            abort(e)
        s.topo, s.rank = server.topo, s.comms.world.Get_rank()  # after a recovery: the new ones
        gather_report(s, {"role": s.role.name, **stats.as_dict(), **server.report()})


def job_wan(cfg: RunConfig, job: dict):
    """The WAN settings of one job: init()'s (or GEOMPI_WAN_*), overridden by the
    DistributedOptimizer's own ``wan_*`` keywords."""
    from geompi.ps.wan import WanSettings

    over = job.get("wan") or {}
    return WanSettings.parse(
        over.get("wan_bandwidth", cfg.wan_bandwidth),
        over.get("wan_latency", cfg.wan_latency),
        over.get("lan_bandwidth", cfg.lan_bandwidth),
        over.get("wan_compression", cfg.wan_compression),
    )


def gather_report(s: Session, mine: dict) -> dict | None:
    """Collective over COMM_WORLD at the end of a job: every rank's figures reach the master,
    which returns the job's report (None elsewhere). JSON text, never pickled objects."""
    from geompi.comm.transport import barrier_before_collective

    barrier_before_collective(s.comms.world, s.cfg.comm_timeout, "every rank to end the job")
    everyone = s.comms.world.gather(json.dumps(mine), root=0)
    if everyone is None:
        return None
    ranks = [json.loads(r) for r in everyone]
    by_role = {role: [r for r in ranks if r["role"] == role] for role in {r["role"] for r in ranks}}
    local = by_role.get(Role.LOCAL_SERVER.name, [])
    workers = by_role.get(Role.WORKER.name, [])
    glob = by_role.get(Role.GLOBAL_SERVER.name, [])
    return {  # both directions, as the CLI's summary counts them, and the uplinks apart
        "wan_bytes": sum(r["wan_bytes"] for r in ranks),
        "wan_data_bytes": sum(r["wan_data_bytes"] for r in ranks),
        "wan_up_bytes": sum(r["wan_bytes"] for r in local),
        "wan_data_up_bytes": sum(r["wan_data_bytes"] for r in local),
        "global_in_bytes": sum(r["wan_received_bytes"] for r in glob),
        "lan_bytes": sum(r["lan_bytes"] for r in ranks),
        "peak_round_wan_bytes": max((r.get("peak_round_wan_bytes", 0) for r in local), default=0),
        "wan_wait_s": [r["wan_wait_s"] for r in local],
        "worker_wait_s": [r["lan_wait_s"] + r["wan_wait_s"] for r in workers],
        "worker_wall_s": [r.get("wall_s", 0.0) for r in workers],
        "per_rank": ranks,
    }


def finish() -> None:
    """End the job on this worker: release the servers (collective over every worker)."""
    s = current()
    if s.finished:
        return
    with callwatch.call("geompi.finish"):
        if s.stop is not None:  # geompi.stop_requested(): its last agreement, then the handlers
            from geompi.runtime import restore_signal_handlers

            s.stop.close()
            restore_signal_handlers(s.stop_handlers or {})
        s.send_job({"sync": None}, None)
    s.finished = True
    callwatch.stop()
    end(s)


def _rounds_begun() -> int:
    """The training rounds this worker's DistributedOptimizer has begun (callwatch)."""
    opt = _session.optimizer if _session is not None else None
    engine = getattr(opt, "_geompi", None)
    return engine.client.round_id if engine is not None else 0


def _report_mismatch(msg: str) -> None:
    """Workers waiting for each other in different calls (callwatch's thread): one line,
    then every rank stops."""
    from geompi.runtime import abort

    abort(ProtocolError(msg))


def _stop_heartbeat(s: Session) -> None:
    """Collective over COMM_WORLD at the end: beat until every rank is here, so that none
    looks lost to one still waiting, then stop."""
    from geompi.comm.transport import barrier, live_timeout

    if s.cfg.comm_timeout:  # the same on every rank, as every collective's condition must be
        barrier(s.comms.world, live_timeout(s.cfg.comm_timeout), "every rank to finish")
    heartbeat.stop()


def exit_identically(s: Session, err: GeompiError) -> NoReturn:
    """An error every worker raised alike (bad arguments): the master prints it and aborts
    the job with status 2, servers included (they serve inside ``geompi.init``, and under a
    plain ``mpirun python script.py`` workers that exit leave them waiting for ever)."""
    from geompi.runtime import abort

    s.finished = True  # no collective goodbye at exit
    if s.rank == 0:
        abort(err, code=2)
    s.worker_comm.Barrier()  # never completes: the master's abort ends this process
    raise err  # pragma: no cover


def agree(s: Session, err: GeompiError | None, what: str, settings: object = None) -> None:
    """Collective over the workers, before a call's first message to the servers: if any
    worker failed its checks, or ``settings`` (JSON-able: what must be the same on every
    worker) differ between them, the master prints one line and every rank stops, status 2.
    Errors only some workers see (one worker's model in float64) no longer hang the rest."""
    text = None if err is None else str(err)
    mine = json.dumps(settings, sort_keys=True, default=repr)
    digest = hashlib.sha256(mine.encode()).hexdigest()
    rows = s.worker_comm.allgather([text, digest])
    failed = [(w, t) for w, (t, _) in enumerate(rows) if t]
    if failed:
        w, text = failed[0]
        alike = len(failed) == len(rows) and all(t == text for _, t in failed)
        problem = text if alike else f"{text} (on worker {', '.join(str(f) for f, _ in failed)})"
        exit_identically(s, ConfigError(problem))
    if len({d for _, d in rows}) == 1:
        return
    everyone = [json.loads(d) for d in s.worker_comm.allgather(mine)]
    exit_identically(s, ConfigError(_first_difference(what, everyone)))


def _first_difference(what: str, everyone: list) -> str:
    """The first setting in which a worker differs from worker 0, as one line."""
    first = everyone[0]
    for w, other in enumerate(everyone[1:], 1):
        if other == first:
            continue
        for key in sorted(set(first) | set(other)):
            a, b = first.get(key), other.get(key)
            if a == b:
                continue
            if isinstance(a, list) and isinstance(b, list):
                pairs = [(x, y) for x, y in zip(a, b) if x != y]
                a, b = pairs[0] if pairs else (f"{len(a)} entries", f"{len(b)} entries")
            return (
                f"{what}: worker {w}'s {key} differs from worker 0's ({_brief(b)} vs "
                f"{_brief(a)}): every worker must call it with the same model, optimizer "
                "and arguments"
            )
    return f"{what}: the workers' settings differ"  # pragma: no cover


def _brief(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def stop_identically(s: Session, err: GeompiError) -> NoReturn:
    """An error every worker hits alike during training: the master prints one line and aborts
    the job; the other workers wait to be ended by that abort."""
    from geompi.runtime import abort

    s.finished = True
    if s.rank == 0:
        abort(err)
    s.worker_comm.Barrier()  # never completes: the master's abort ends this process
    raise err  # pragma: no cover


def fail_together(s: Session, err: GeompiError | None) -> None:
    """Collective over the workers: if any of them failed, the master prints one line and every
    rank of the job stops (the servers too)."""
    from geompi.runtime import abort

    msgs = s.worker_comm.allgather(None if err is None else str(err))
    failed = [m for m in msgs if m]
    if not failed:
        return
    s.finished = True
    if s.rank == 0:
        more = f" (and on {len(failed) - 1} more worker(s))" if len(failed) > 1 else ""
        abort(GeompiError(failed[0] + more))
    s.worker_comm.Barrier()  # the master's abort ends this process


def _finish_at_exit() -> None:
    if _session is not None and not _session.finished and sys.exc_info()[0] is None:
        finish()


def _bcast_json(comm, obj: dict | None, idle: bool = False) -> dict:
    """Broadcast a JSON document from rank 0 as bytes (never pickled).

    ``idle``: wait by testing and sleeping, so a server that waits for the workers' next job
    (while they train with something else) leaves the CPU to them.
    """
    import numpy as np

    data = json.dumps(obj).encode() if comm.Get_rank() == 0 else b""
    n = np.array([len(data)], dtype=np.int64)
    _bcast(comm, n, idle)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8) if data else np.empty(n[0], np.uint8)
    _bcast(comm, buf, idle)
    return json.loads(buf.tobytes())


def _bcast(comm, buf, idle: bool) -> None:
    """Ibcast on every rank (a blocking Bcast would not match a nonblocking one)."""
    req = comm.Ibcast(buf, root=0)
    if not idle:
        req.Wait()
        return
    spin_until(req.Test, "the workers' next job", timeout=None, backoff=Backoff(1e-4, 0.01))
