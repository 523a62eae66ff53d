"""The job a Python script joins with ``geompi.init()``: topology, communicators, this rank's role.

Workers return from ``init()`` and run the user's loop. Server ranks stay inside ``init()``: they
wait for the workers to say which algorithm they chose (a JSON job spec broadcast by the master
worker when the DistributedOptimizer is built), serve rounds until the workers call
``geompi.finish()``, then end the process with status 0.
"""

from __future__ import annotations

import atexit
import json
import sys
from dataclasses import dataclass, field

import torch

from geompi.comm.topology import Communicators, Role, Topology
from geompi.comm.transport import LinkStats
from geompi.config import RunConfig, make_config
from geompi.errors import ConfigError, GeompiError

# Settings of ``init()`` that come from RunConfig (keywords override GEOMPI_* variables).
INIT_SETTINGS = (
    "dcs",
    "dc_sizes",
    "global_servers",
    "wan_bandwidth",
    "wan_latency",
    "lan_bandwidth",
    "wan_compression",
    "comm_timeout",
    "on_nonfinite",
    "max_staleness",
)


@dataclass
class Session:
    """What ``geompi.init()`` set up on this rank."""

    cfg: RunConfig
    topo: Topology
    comms: Communicators
    stats: LinkStats
    rank: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    optimizer: object | None = None  # the DistributedOptimizer the servers now serve
    finished: bool = False

    @property
    def role(self) -> Role:
        return self.topo.role(self.rank)

    @property
    def is_worker(self) -> bool:
        return self.role is Role.WORKER

    def send_job(self, job: dict, optimizer: object | None) -> None:
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


def init(comm=None, **settings) -> Session:
    """Join the job on every rank. Workers return; server ranks serve, then exit with status 0.

    ``settings`` are those of INIT_SETTINGS (else GEOMPI_* variables decide). Collective over
    ``comm`` (default COMM_WORLD).
    """
    global _session
    from geompi.runtime import exit_together, install_excepthook, start_job
    from geompi.threads import configure_threads
    from geompi.train import plan_topology, worker_device

    if _session is not None and not _session.finished:
        raise ConfigError("geompi.init() was already called: call geompi.finish() first")
    install_excepthook()
    unknown = sorted(set(settings) - set(INIT_SETTINGS))
    cfg = None

    def plan(c) -> Topology:
        nonlocal cfg
        if unknown:
            raise ConfigError(
                f"geompi.init() got unknown setting(s) {', '.join(unknown)}: "
                f"choose from {', '.join(INIT_SETTINGS)}"
            )
        cfg = make_config(**settings).validate()
        cfg.wan_settings()  # GEOMPI_WAN_* variables: checked before any collective call
        return plan_topology(cfg, c)

    try:
        comm, topo, comms, stats = start_job(plan, comm)
        configure_threads(comm)  # one share of the node's CPUs per rank (geompi.threads)
    except GeompiError as e:  # pragma: no cover - start_job reports and exits itself
        exit_together(e, 0)
    rank = comm.Get_rank()
    _session = Session(cfg, topo, comms, stats, rank)
    if topo.role(rank) is Role.WORKER:
        _session.device = worker_device(comms.workers)
        atexit.register(_finish_at_exit)
        return _session
    _serve(_session)
    comms.free()
    sys.exit(0)


def _serve(s: Session) -> None:
    """A server rank: wait for the workers' job spec, then serve it until they are done."""
    from geompi.ps.servers import make_server
    from geompi.runtime import abort

    cfg = s.cfg
    while True:  # one job per DistributedOptimizer, until the workers call finish()
        job = _bcast_json(s.comms.world, None)
        if job.get("sync") is None:
            return
        try:
            make_server(
                job["sync"],
                s.topo,
                s.comms,
                s.stats,
                k2=int(job.get("k2", 1)),
                on_nonfinite=cfg.on_nonfinite,
                timeout=cfg.comm_timeout,
                max_staleness=job.get("max_staleness", cfg.max_staleness),
                wan=cfg.wan_settings(),
            ).run()
        except Exception as e:  # noqa: BLE001 - one line, then every rank stops
            abort(e)


def finish() -> None:
    """End the job on this worker: release the servers (collective over every worker)."""
    s = current()
    if s.finished:
        return
    s.send_job({"sync": None}, None)
    s.finished = True
    s.comms.free()


def exit_identically(s: Session, err: GeompiError) -> None:
    """An error every worker raised alike (bad arguments): the master prints it, every worker
    exits with status 2 (the launcher then stops the servers)."""
    from geompi.runtime import exit_together

    s.finished = True  # no collective goodbye at exit
    exit_together(err, s.rank)


def fail_together(s: Session, err: GeompiError | None) -> None:
    """Collective over the workers: if any of them failed, the master prints one line and every
    rank of the job stops (the servers too)."""
    from geompi.runtime import abort

    msgs = s.comms.all_workers.allgather(None if err is None else str(err))
    failed = [m for m in msgs if m]
    if not failed:
        return
    s.finished = True
    if s.rank == 0:
        more = f" (and on {len(failed) - 1} more worker(s))" if len(failed) > 1 else ""
        abort(GeompiError(failed[0] + more))
    s.comms.all_workers.Barrier()  # the master's abort ends this process


def _finish_at_exit() -> None:
    if _session is not None and not _session.finished and sys.exc_info()[0] is None:
        finish()


def _bcast_json(comm, obj: dict | None) -> dict:
    """Broadcast a JSON document from rank 0 as bytes (never pickled)."""
    import numpy as np

    data = json.dumps(obj).encode() if comm.Get_rank() == 0 else b""
    n = np.array([len(data)], dtype=np.int64)
    comm.Bcast(n, root=0)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8) if data else np.empty(n[0], np.uint8)
    comm.Bcast(buf, root=0)
    return json.loads(buf.tobytes())
