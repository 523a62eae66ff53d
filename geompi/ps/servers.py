"""Build the server a rank plays, from the settings an algorithm chooses (no algorithm names)."""

from __future__ import annotations

from geompi.comm.topology import Communicators, Role, Topology
from geompi.comm.transport import WAN, Link, LinkStats
from geompi.ps.async_tier import AsyncGlobalServer
from geompi.ps.async_uplink import AsyncUplink
from geompi.ps.global_server import GlobalServer
from geompi.ps.local_server import LocalServer, SyncUplink
from geompi.ps.policy import AsyncPolicy, GlobalPolicy, LocalPolicy
from geompi.ps.wan import TierCodec, WanSettings


def build_server(
    topo: Topology,
    comms: Communicators,
    stats: LinkStats,
    *,
    local_policy: LocalPolicy | None = None,
    global_policy: GlobalPolicy | None = None,
    async_policy: AsyncPolicy | None = None,
    on_nonfinite: str = "abort",
    timeout: float | None = None,
    max_staleness: int | None = None,
    slowdown: dict[int, float] | None = None,
    wan: WanSettings | None = None,
) -> LocalServer | GlobalServer:
    """The LocalServer or GlobalServer of this rank. The algorithms (geompi.sync) choose the
    settings: the policies (geompi.ps.policy; the plain ones where None) say what the local
    server does with a round (``local_policy``) and what the global server does with a value
    round (``global_policy``); an ``async_policy`` puts the one-sided global tier in, and says
    what its global servers do with each deposit.

    ``wan`` emulates the links (at the local servers, which own their datacenter's WAN link)
    and sets the global tier's compression (on both tiers' servers).
    """
    rank = comms.world.Get_rank()
    role = topo.role(rank)
    wan = wan or WanSettings()
    compressor = wan.compressor()
    codec = TierCodec(compressor) if compressor.name != "none" else None
    if role is Role.GLOBAL_SERVER:  # staggered: the local servers' watchdog speaks first
        later = timeout and 2 * timeout
        if async_policy is None:
            return GlobalServer(comms, topo, stats, later, codec, global_policy)
        return AsyncGlobalServer(
            comms, topo, stats, later, codec, global_policy, async_policy=async_policy
        )
    if role is not Role.LOCAL_SERVER:
        raise ValueError(f"rank {rank} is a worker, not a server")
    # The watchdog grows with the distance to whoever may be stuck, so the rank next to it
    # reports first: local server -> workers 1x, global -> local 2x, local -> global 3x
    # (+0.5 s per datacenter, so two local servers never report together), workers 4x.
    dc = topo.dc_of(rank)
    uplink = SyncUplink(
        Link(comms.glob, WAN, stats), topo, timeout and 3 * timeout + 0.5 * dc, wan.wan, codec
    )
    if async_policy is not None:
        uplink = AsyncUplink(uplink, topo, dc, max_staleness)
    return LocalServer(
        comms,
        topo,
        stats,
        policy=local_policy,
        on_nonfinite=on_nonfinite,
        timeout=timeout,
        uplink=uplink,
        slowdown=(slowdown or {}).get(dc, 1.0),
        lan_model=wan.lan,
    )
