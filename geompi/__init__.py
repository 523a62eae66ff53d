"""geompi: train one PyTorch model across several datacenters over MPI (FSA, MixedSync, HFA).

The Python API, for a user's own torch loop::

    geompi.init()                                   # server ranks serve in here, then exit 0
    model = Net().to(geompi.device())
    opt = geompi.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model, sync="fsa")
    sampler = geompi.DistributedSampler(train_set)  # a disjoint shard per worker
    ...                                             # the usual loop: backward, opt.step()
    geompi.finish()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Before anything loads MPI: a fault-tolerant launch's MPI_Finalize may never return
from geompi.comm.faults import end_without_finalize_under_heartbeat  # noqa: E402

end_without_finalize_under_heartbeat()

__all__ = [
    "FSA",
    "HFA",
    "DistributedOptimizer",
    "DistributedSampler",
    "Metrics",
    "all_reduce",
    "broadcast_object",
    "local_worker_rank",
    "MixedSync",
    "device",
    "dc",
    "finish",
    "init",
    "is_master",
    "latest",
    "load",
    "num_dcs",
    "num_workers",
    "save",
    "stop_requested",
    "worker_rank",
]

# Names resolved on first use, so ``import geompi`` stays light (no MPI, no h5py) until needed.
_LAZY = {
    "FSA": "geompi.sync",
    "HFA": "geompi.sync",
    "MixedSync": "geompi.sync",
    "DistributedOptimizer": "geompi.optimizer",
    "DistributedSampler": "geompi.sampler",
    "Metrics": "geompi.metrics",
    "save": "geompi.state",
    "latest": "geompi.state",
    "all_reduce": "geompi.collectives",
    "broadcast_object": "geompi.collectives",
    "local_worker_rank": "geompi.collectives",
    "stop_requested": "geompi.collectives",
    "load": "geompi.state",
}
_SUBMODULES = ("kv", "optim", "ckpt", "train", "comm", "ps", "sync", "config", "errors", "data")

if TYPE_CHECKING:  # pragma: no cover
    from geompi.collectives import (
        all_reduce,
        broadcast_object,
        local_worker_rank,
        stop_requested,
    )
    from geompi.metrics import Metrics
    from geompi.optimizer import DistributedOptimizer
    from geompi.sampler import DistributedSampler
    from geompi.state import latest, load, save
    from geompi.sync import FSA, HFA, MixedSync


# Collective calls over the workers, watched for a worker that calls them alone (callwatch).
_COLLECTIVE = {
    "save": "geompi.save",
    "load": "geompi.load",
    "latest": "geompi.latest",
    "all_reduce": "geompi.all_reduce",
    "broadcast_object": "geompi.broadcast_object",
    "stop_requested": "geompi.stop_requested",
}
_wrapped: dict = {}


def __getattr__(name: str):
    if name in _COLLECTIVE:
        if name not in _wrapped:
            from geompi.comm import callwatch

            fn = getattr(importlib.import_module(_LAZY[name]), name)
            _wrapped[name] = callwatch.collective(_COLLECTIVE[name], fn)
        return _wrapped[name]
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:  # geompi.kv.create(...) after a plain `import geompi`, as mx.kv
        return importlib.import_module(f"geompi.{name}")
    raise AttributeError(f"module 'geompi' has no attribute {name!r}")


def init(comm=None, **settings) -> None:
    """Join the job (collective over COMM_WORLD). Workers return; server ranks serve rounds
    until the workers call ``finish()``, then exit with status 0.

    Every keyword is optional; one given overrides its ``GEOMPI_*`` variable where it has one
    (``GEOMPI_DCS``, ``GEOMPI_DC_SIZES``, ``GEOMPI_GLOBAL_SERVERS``, ``GEOMPI_WAN_BANDWIDTH``,
    ``GEOMPI_WAN_LATENCY``, ``GEOMPI_LAN_BANDWIDTH``, ``GEOMPI_WAN_COMPRESSION``,
    ``GEOMPI_LAN_REDUCE``). Any other keyword is refused in one line.

    In a world of one process (``python script.py``, no mpirun) that names no topology, it
    prints one line and the script trains locally: one worker, no server, and the
    DistributedOptimizer's ``step()`` is the optimizer's own.

    Args:
        comm (mpi4py.MPI.Comm): the communicator of the job (default ``MPI.COMM_WORLD``).

    Other Parameters:
        dcs (int): number of datacenters (``--dcs``; default: 3 when 6 or more ranks remain
            beside the global servers, 2 when 4 or 5 do, else 1).
        dc_sizes (list[int]): ranks per datacenter, each counting its local server
            (``--dc-sizes``).
        global_servers (int): global servers, each holding a slice of every key
            (``--global-servers``; default 1).
        global_replicas (int): 2 keeps an exact copy of each global server's shard (values,
            optimizer and outer state) on the next global server, which receives the same
            slices from the local servers (``--global-replicas``; default 1; FSA and HFA, with
            2 or more global servers).
        wan_bandwidth (str): emulated WAN bandwidth per datacenter, e.g. ``"100Mbit"``.
        wan_latency (str): emulated one-way WAN latency, e.g. ``"25ms"``.
        lan_bandwidth (str): emulated LAN bandwidth, e.g. ``"10Gbit"``.
        wan_compression (str): WAN codec, e.g. ``"topk:0.01"``, ``"fp16"``, ``"int8"``.
        comm_timeout (float): seconds of silence from a rank before a wait gives up
            (``--comm-timeout``; default off).
        on_nonfinite (str): ``"abort"`` (default) or ``"skip"`` on a NaN/Inf gradient.
        max_staleness (int): under MixedSync, a datacenter this many updates or more ahead
            of the slowest active one waits (``--max-staleness``; default unbounded).
        lan_reduce (str): how a datacenter sums its workers' pushes: ``"auto"`` (default),
            ``"funnel"`` or ``"scatter"`` (``--lan-reduce``).
        on_failure (str): on a lost rank, ``"abort"`` (default) or ``"continue"`` without it
            (needs ``mpirun --with-ft ulfm``; ``--on-failure``).
    """
    from geompi import session

    session.init(comm, **settings)


def finish() -> None:
    """End training on this worker and release the servers (every worker calls it)."""
    from geompi import session

    session.finish()


def device():
    """This worker's torch device: its GPU (round-robin over the node's GPUs), else the CPU."""
    from geompi import session

    return session.worker_session().device


def worker_rank() -> int:
    """This worker's position among all workers of the job (0 .. num_workers() - 1)."""
    from geompi import session

    s = session.worker_session()
    return s.topo.worker_index(s.rank)


def num_workers() -> int:
    """How many workers the job has (servers excluded)."""
    from geompi import session

    return session.worker_session().topo.num_workers


def dc() -> int:
    """This worker's datacenter."""
    from geompi import session

    s = session.worker_session()
    dc = s.topo.dc_of(s.rank)
    assert dc is not None  # a worker's
    return dc


def num_dcs() -> int:
    """How many datacenters the job has."""
    from geompi import session

    return session.worker_session().topo.num_dcs


def is_master() -> bool:
    """Whether this is the master worker (world rank 0: it prints, evaluates, writes files)."""
    from geompi import session

    return session.worker_session().rank == 0
