"""Which rank does what on which node under ``--dc-map nodes``, and whether it fits the GPUs.

``--dc-map nodes`` makes each node one datacenter: the ranks of a node are its workers followed
by its local server, and the global servers take the last ranks of the job, so they come off the
last node. With G GPUs per node, one worker per GPU therefore needs G + 1 tasks on every node and
G + 1 + (global servers) on the last one. ``python -m geompi.slurm layout`` prints the plan
before a job is submitted; :func:`check_node_gpus` prints the same warning at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from geompi.comm.topology import Role, Topology, dc_sizes_from_hosts


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of one node and their roles."""

    node: int
    ranks: tuple[int, ...]
    dc: int | None
    workers: tuple[int, ...]
    local_server: int | None
    global_servers: tuple[int, ...]
    gpus: int = 0
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or f"node {self.node}"


def plan_nodes(
    tasks_per_node: Sequence[int], global_servers: int = 1, gpus: Sequence[int] | None = None
) -> tuple[Topology, list[NodeLayout]]:
    """The topology ``--dc-map nodes`` builds for these task counts, and each node's share.

    Raises TopologyError (one line) when a node would get a local server but no worker.
    """
    hosts = [f"node{i}" for i, n in enumerate(tasks_per_node) for _ in range(n)]
    topo = Topology.plan(
        len(hosts), None, dc_sizes_from_hosts(hosts, global_servers), global_servers
    )
    gpus = list(gpus) if gpus is not None else [0] * len(tasks_per_node)
    rows, start = [], 0
    for i, n in enumerate(tasks_per_node):
        ranks = tuple(range(start, start + n))
        start += n
        roles = {r: topo.role(r) for r in ranks}
        dcs = {topo.dc_of(r) for r in ranks} - {None}
        ls = [r for r in ranks if roles[r] is Role.LOCAL_SERVER]
        rows.append(
            NodeLayout(
                node=i,
                ranks=ranks,
                dc=min(dcs) if dcs else None,
                workers=tuple(r for r in ranks if roles[r] is Role.WORKER),
                local_server=ls[0] if ls else None,
                global_servers=tuple(r for r in ranks if roles[r] is Role.GLOBAL_SERVER),
                gpus=gpus[i],
            )
        )
    return topo, rows


def gpu_warnings(rows: Sequence[NodeLayout]) -> list[str]:
    """One sentence per node whose workers and GPUs differ (nodes without GPUs are fine)."""
    out = []
    for row in rows:
        w, g = len(row.workers), row.gpus
        if g == 0 or w == g:
            continue
        what = f"{g - w} GPU(s) idle" if w < g else f"{w - g} worker(s) share a GPU"
        out.append(f"{row.label} has {w} worker(s) for {g} GPU(s): {what}")
    return out


def advice(gpus_per_node: int, nodes: int, global_servers: int = 1) -> str:
    """How to give every GPU one worker under ``--dc-map nodes``."""
    per = gpus_per_node + 1
    last = per + global_servers
    counts = ",".join([str(per)] * (nodes - 1) + [str(last)])
    return (
        f"for one worker per GPU run {per} tasks per node ({gpus_per_node} workers + the local "
        f"server) and {last} on the last node (+ {global_servers} global server(s)): "
        f"--tasks-per-node {counts}; see docs/slurm.md"
    )


def _span(ranks: Sequence[int]) -> str:
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def layout_table(topo: Topology, rows: Sequence[NodeLayout]) -> str:
    """The table ``python -m geompi.slurm layout`` prints."""
    lines = [
        f"geompi layout (--dc-map nodes): {topo.world_size} ranks on {len(rows)} node(s) = "
        f"{topo.num_global_servers} global server(s) + {topo.num_dcs} datacenter(s), "
        f"{topo.num_workers} workers",
        f"  {'node':<6}{'ranks':<9}{'datacenter':<12}{'workers':<16}{'local server':<14}"
        f"{'global servers':<16}GPUs",
    ]
    for r in rows:
        workers = f"{len(r.workers)} ({_span(r.workers)})" if r.workers else "0"
        lines.append(
            f"  {r.node:<6}{_span(r.ranks):<9}{'-' if r.dc is None else f'DC {r.dc}':<12}"
            f"{workers:<16}{'-' if r.local_server is None else r.local_server:<14}"
            f"{_span(r.global_servers):<16}{r.gpus}"
        )
    return "\n".join(lines)


def node_gpus() -> int:
    """GPUs this rank would train on (0 with GEOMPI_DEVICE=cpu or without CUDA)."""
    if os.environ.get("GEOMPI_DEVICE", "").lower() == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def startup_warning(seen: Sequence[tuple[str, int]], topo: Topology) -> str | None:
    """The one warning line for ``(host, GPUs)`` of every rank in rank order, or None."""
    hosts: list[str] = []
    for h, _ in seen:
        if h not in hosts:
            hosts.append(h)
    gpus = dict(seen)
    workers = dict.fromkeys(hosts, 0)
    for rank, (h, _) in enumerate(seen):
        if topo.role(rank) is Role.WORKER:
            workers[h] += 1
    rows = [
        NodeLayout(i, (), None, tuple(range(workers[h])), None, (), gpus[h], f"node {h}")
        for i, h in enumerate(hosts)
    ]
    found = gpu_warnings(rows)
    if not found:
        return None
    hint = advice(max(gpus.values()), len(hosts), topo.num_global_servers)
    return f"geompi: warning: {'; '.join(found)}; {hint} (python -m geompi.slurm layout)"


def check_node_gpus(dc_map: str, topo: Topology, comm) -> str | None:
    """At start-up with ``--dc-map nodes``: rank 0 prints one warning line when a node's workers
    and GPUs differ. Collective over ``comm`` (every rank, only with ``dc_map == "nodes"``)."""
    if dc_map != "nodes":
        return None
    import socket

    line = startup_warning(comm.allgather((socket.gethostname(), node_gpus())), topo)
    if line and comm.Get_rank() == 0:
        from geompi.runtime import say

        say(line)
    return line
