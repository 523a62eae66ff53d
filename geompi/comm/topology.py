"""Who is who: the role of every rank, and the communicators of each tier.

Layout of ``COMM_WORLD`` (blocks of consecutive ranks, so a datacenter maps onto nodes)::

    [ DC 0: workers..., local server ][ DC 1: ... ] ... [ global server 0 ... G-1 ]

Rank 0 is therefore always the first worker of datacenter 0, the "master worker" that prints,
evaluates and writes metrics. ``--dc-sizes`` counts every rank of a datacenter, its local server
included.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from geompi.errors import TopologyError

if TYPE_CHECKING:  # mpi4py's stubs; importing it at run time would start MPI
    from mpi4py.MPI import Intracomm


class Role(enum.Enum):
    """The one role a rank plays."""

    WORKER = "worker"
    LOCAL_SERVER = "local server"
    GLOBAL_SERVER = "global server"


def _default_num_dcs(ranks_for_dcs: int) -> int:
    if ranks_for_dcs >= 6:
        return 3
    if ranks_for_dcs >= 4:
        return 2
    return 1


def _even_split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class Topology:
    """The datacenters, their sizes and the global servers for one world size.

    Pure data: every rank computes the same Topology from the same settings, so validation
    errors are raised identically everywhere before any collective call.
    """

    world_size: int
    dc_sizes: tuple[int, ...]
    num_global_servers: int
    # copies of each global server's shard (2: the next global server mirrors it)
    replicas: int = 1

    @classmethod
    def plan(
        cls,
        world_size: int,
        dcs: int | None = None,
        dc_sizes: Sequence[int] | None = None,
        global_servers: int | None = None,
        replicas: int = 1,
    ) -> Topology:
        """Validate the settings and choose a sensible default for whatever is not given."""
        g = 1 if global_servers is None else int(global_servers)
        if g < 1:
            raise TopologyError(f"--global-servers {g}: need at least 1 global server")
        if replicas > 1 and g < 2:
            raise TopologyError(
                f"--global-replicas {replicas} keeps each shard's copy on another global server: "
                "pass --global-servers 2 or more"
            )
        if dcs is not None and dcs < 1:
            raise TopologyError(f"--dcs {dcs}: need at least 1 datacenter")
        if world_size < g + 2:
            raise TopologyError(
                f"the world has {world_size} rank(s), too few for {g} global server(s), "
                f"1 local server and 1 worker: run mpirun -n {g + 2} or more"
            )
        rest = world_size - g
        if dc_sizes is not None:
            sizes = [int(s) for s in dc_sizes]
            if dcs is not None and dcs != len(sizes):
                raise TopologyError(
                    f"--dcs {dcs} but --dc-sizes lists {len(sizes)} datacenters: "
                    "give one size per datacenter, or drop --dcs"
                )
            if sum(sizes) != rest:
                raise TopologyError(
                    f"--dc-sizes {','.join(map(str, sizes))} adds up to {sum(sizes)} ranks, "
                    f"but {world_size} ranks minus {g} global server(s) leaves {rest}: "
                    f"make the sizes add up to {rest}"
                )
        else:
            n = _default_num_dcs(rest) if dcs is None else dcs
            if 2 * n > rest:
                raise TopologyError(
                    f"{n} datacenters need at least {2 * n} ranks (a local server and a worker "
                    f"each), but only {rest} remain after {g} global server(s): "
                    f"run mpirun -n {2 * n + g} or more, or use fewer --dcs"
                )
            sizes = _even_split(rest, n)
        for d, s in enumerate(sizes):
            if s < 2:
                raise TopologyError(
                    f"datacenter {d} has {s} rank(s) and so no worker: every datacenter needs "
                    "its local server plus at least 1 worker (size >= 2 in --dc-sizes)"
                )
        return cls(world_size, tuple(sizes), g, int(replicas))

    @classmethod
    def alone(cls) -> Topology:
        """A world of one process (``python script.py``, no mpirun): one worker and no server;
        it trains locally (only ``geompi.init`` plans it, never the CLI or the KVStore)."""
        return cls(1, (1,), 0)

    @property
    def serverless(self) -> bool:
        """Whether this is :meth:`alone`'s world: its one datacenter has no local server."""
        return self.num_global_servers == 0

    # ---- derived layout -------------------------------------------------------------------
    @property
    def num_dcs(self) -> int:
        return len(self.dc_sizes)

    def dc_start(self, dc: int) -> int:
        """First world rank of datacenter ``dc``."""
        return sum(self.dc_sizes[:dc])

    def workers(self, dc: int) -> list[int]:
        """World ranks of the workers of datacenter ``dc``."""
        start = self.dc_start(dc)
        return list(range(start, start + self.dc_sizes[dc] - (0 if self.serverless else 1)))

    def local_server(self, dc: int) -> int:
        """World rank of the local server of datacenter ``dc``."""
        return self.dc_start(dc) + self.dc_sizes[dc] - 1

    @property
    def global_servers(self) -> list[int]:
        first = sum(self.dc_sizes)
        return list(range(first, first + self.num_global_servers))

    @property
    def num_workers(self) -> int:
        return sum(self.dc_sizes) - (0 if self.serverless else self.num_dcs)

    @property
    def all_workers(self) -> list[int]:
        return [r for d in range(self.num_dcs) for r in self.workers(d)]

    def role(self, rank: int) -> Role:
        if self.serverless:
            return Role.WORKER
        if rank >= sum(self.dc_sizes):
            return Role.GLOBAL_SERVER
        dc = self.dc_of(rank)
        is_server = dc is not None and rank == self.local_server(dc)
        return Role.LOCAL_SERVER if is_server else Role.WORKER

    def dc_of(self, rank: int) -> int | None:
        """The datacenter of a worker or local server; None for a global server."""
        start = 0
        for d, s in enumerate(self.dc_sizes):
            if rank < start + s:
                return d
            start += s
        return None

    def worker_index(self, rank: int) -> int:
        """Position of a worker among all workers (its data shard)."""
        return self.all_workers.index(rank)

    def shard_bounds(self, numel: int, server: int) -> tuple[int, int]:
        """The slice [lo, hi) of a flat key of ``numel`` elements owned by server ``server``."""
        g = self.num_global_servers
        return server * numel // g, (server + 1) * numel // g

    def replica_server(self, server: int) -> int:
        """Under replication: the global server (its index) that mirrors shard ``server``,
        the next one round the ring."""
        return (server + 1) % self.num_global_servers

    def mirrored_shard(self, server: int) -> int:
        """Under replication: the shard that global server ``server`` mirrors."""
        return (server - 1) % self.num_global_servers

    def describe(self) -> dict:
        """A JSON-friendly summary, stored in checkpoints and metrics."""
        return {
            "world_size": self.world_size,
            "dc_sizes": list(self.dc_sizes),
            "global_servers": self.num_global_servers,
            "workers": self.num_workers,
        }

    def table(self) -> str:
        """The human-readable table rank 0 prints at start (one line for a world of one)."""
        if self.serverless:
            return "geompi: one process, no servers: training locally"
        lines = [
            f"geompi topology: {self.world_size} ranks = {self.num_global_servers} global "
            f"server(s) + {self.num_dcs} datacenter(s), {self.num_workers} workers",
            f"  {'tier':<14}{'local server':>13}  workers",
        ]
        for d in range(self.num_dcs):
            w = self.workers(d)
            lines.append(f"  {'DC ' + str(d):<14}{self.local_server(d):>13}  {_ranges(w)}")
        lines.append(f"  {'global':<14}{'':>13}  servers {_ranges(self.global_servers)}")
        return "\n".join(lines)


def _ranges(ranks: Sequence[int]) -> str:
    if not ranks:
        return "-"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks[0]}-{ranks[-1]} ({len(ranks)})"


def dc_sizes_from_hosts(hosts: Sequence[str], num_global_servers: int) -> list[int]:
    """Datacenters from node names (``--dc-map nodes``): consecutive ranks on one host form one.

    The global servers take the last ranks, so they are removed from the last host(s).
    """
    sizes: list[int] = []
    prev = None
    for h in hosts[: len(hosts) - num_global_servers]:
        if h != prev:
            sizes.append(0)
            prev = h
        sizes[-1] += 1
    return sizes


@dataclass
class Communicators:
    """The communicators of one rank. Absent ones are None."""

    world: Intracomm
    dc: Intracomm | None  # local server (rank 0 in it) + the workers of this datacenter
    glob: Intracomm | None  # local servers (ranks 0..D-1) + global servers (ranks D..D+G-1)
    workers: Intracomm | None  # the workers of this datacenter only
    all_workers: Intracomm | None  # every worker of the job (control messages only)

    def free(self) -> None:
        for c in (self.dc, self.glob, self.workers, self.all_workers):
            if c is not None:
                c.Free()


def node_share(comm) -> tuple[int, int]:
    """This rank's index among ``comm``'s ranks on its node, and how many share the node
    (collective over ``comm``)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    share = local.Get_rank(), local.Get_size()
    local.Free()
    return share


def build_communicators(topo: Topology, world) -> Communicators:
    """Split ``world`` into the per-tier communicators. Collective: every rank must call it."""
    from mpi4py import MPI

    rank = world.Get_rank()
    role = topo.role(rank)
    dc = topo.dc_of(rank)
    # dc_comm: the local server first, then the workers in rank order (none: no local server).
    if dc is None or topo.serverless:  # a global server, or the one process
        dc_comm = world.Split(MPI.UNDEFINED, 0)
    else:
        key = 0 if role is Role.LOCAL_SERVER else 1 + topo.workers(dc).index(rank)
        dc_comm = world.Split(dc, key)
    # global_comm: local servers by datacenter, then global servers.
    if role is Role.WORKER:
        glob = world.Split(MPI.UNDEFINED, 0)
    elif role is Role.LOCAL_SERVER:
        glob = world.Split(0, dc)
    else:
        glob = world.Split(0, topo.num_dcs + topo.global_servers.index(rank))
    workers = world.Split(dc if role is Role.WORKER else MPI.UNDEFINED, rank)
    all_workers = world.Split(0 if role is Role.WORKER else MPI.UNDEFINED, rank)
    none = MPI.COMM_NULL
    return Communicators(
        world=world,
        dc=None if dc_comm == none else dc_comm,
        glob=None if glob == none else glob,
        workers=None if workers == none else workers,
        all_workers=None if all_workers == none else all_workers,
    )
