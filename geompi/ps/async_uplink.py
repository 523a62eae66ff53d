"""The local server's side of the one-sided global tier (MixedSync's mechanism): it deposits
its datacenter's round into every global server's RMA window without waiting for other
datacenters, and fetches the values they publish (geompi.ps.async_tier: the windows and the
global servers' side)."""

from __future__ import annotations

import os
import threading
import time

import torch

from geompi.comm import faults
from geompi.comm.rma import (
    ALL_DONE,
    DONE,
    PENDING,
    UPDATES,
    SlotWindows,
    per_dc,
)
from geompi.comm.topology import Topology
from geompi.comm.transport import (
    WAN,
    Requests,
    barrier,
    isend_state,
)
from geompi.errors import ConfigError
from geompi.ps.async_tier import TAG_REJOIN_SPEC, key_codec, open_windows, region_bytes
from geompi.ps.local_server import SyncUplink
from geompi.ps.protocol import (
    FLAG_PRESENCE,
    FLAG_SPEC,
    MAX_KEYS,
    TAG_DEPOSIT_SPEC,
    Op,
    Round,
    mean_position,
    plain_positions,
    presence_position,
)
from geompi.ps.wan import TierCodec

_LEAVE_AFTER_S = 2.0  # see AsyncUplink._leave_if_a_global_server_is_lost


class AsyncUplink:
    """A local server's side: deposit, wait for it to be applied, fetch the new parameters."""

    def __init__(
        self, sync: SyncUplink, topo: Topology, dc: int, max_staleness: int | None = None
    ) -> None:
        self.sync = sync
        self.topo = topo
        self.dc = dc
        self.max_staleness = max_staleness
        self.keys: dict[int, int] = {}  # key -> numel, from INIT rounds
        self.wins: list[SlotWindows] | None = None
        # --on-failure continue: the round of the last deposit and its hyperparameters (JSON,
        # or ""); after a recovery the workers redo the round they were in, which is not
        # deposited again if it was (redo_of), as the global servers have applied it
        self.deposited_round: int | None = None
        self.last_spec = ""
        self.redo_of: int | None = None
        self.redo = False
        # test hook (GEOMPI_FAULT_KILL_MID, set by the local server): (step, world rank) lost
        # once that step's deposit is made
        self.kill_deposited = (-1, -1)
        self._abandoned: list[SlotWindows] = []  # a lost rank's windows: never freed
        self._guard: threading.Thread | None = None
        self._guard_stop = threading.Event()

    # The same begin / send_key / end / receive steps as SyncUplink. INIT rounds go through the
    # synchronous tier; gradient rounds are collected, then deposited in one go at ``end``.
    def begin(self, rnd: Round, spec: bytes | None) -> None:
        self.rnd = rnd
        if rnd.op is Op.INIT:
            if self.wins is not None:
                raise ConfigError("with dist_async, initialize every key before the first push")
            self.keys.update(dict(rnd.keys))
            self.sync.begin(rnd, spec)
            return
        self._open()
        self.bufs: list[torch.Tensor | None] = [None] * len(rnd.keys)
        self.spec = spec  # new hyperparameters from the datacenter's first worker, or None
        self.redo, self.redo_of = self.redo_of is not None and rnd.round_id == self.redo_of, None

    def send_key(self, i: int, buf: torch.Tensor) -> None:
        if self.rnd.op is Op.INIT:
            self.sync.send_key(i, buf)
        else:
            self.bufs[i] = buf

    def end(self, weight: float) -> None:
        if self.rnd.op is Op.INIT:
            self.sync.end(weight)
            return
        if self.redo:  # deposited before a loss, and applied: receive() fetches its results
            return
        self._respect_staleness()
        keys, bufs, flags = self.rnd.keys, self.bufs, self.rnd.flags
        pos = presence_position(self.rnd)
        if self.sync.codec is not None:  # idle parameters keep their residual (_pack)
            self.sync.codec.set_presence(bufs[pos] if pos is not None else None)
        if pos is not None and not bufs[pos].numel():  # all present: deposit no presence
            keys, bufs, flags = keys[:pos], bufs[:pos], flags & ~FLAG_PRESENCE
        plain = plain_positions(Round(Op.GRAD, 0, keys, 0.0, 0, flags))
        ids = [k for k, _ in keys]
        packed = [self._pack(g, keys, bufs, plain) for g in range(len(self.wins))]
        if self.spec:  # ahead of the deposit: its owner receives it when it applies it
            flags |= FLAG_SPEC
            self.spec_sends = Requests(self.sync.link.stats, self.sync.timeout, "a spec")
            for win in self.wins:
                isend_state(
                    self.spec_sends, self.sync.link.comm, self.spec.decode(), win.owner,
                    TAG_DEPOSIT_SPEC, self.sync.link.stats,
                )  # fmt: skip
        if self.sync.codec is not None:  # weight 0: the global servers skip this deposit
            self.sync.codec.end_push(weight > 0)
        wan = self.sync.wan  # an emulated link releases the deposits one after the other
        due = [wan.up.schedule(p.numel() * 4) for p in packed] if wan is not None else None
        for g, win in enumerate(self.wins):
            if due is not None:
                self.sync.link.stats.held(WAN, wan.up.hold_until(due[g]))
            win.deposit(self.dc, packed[g].numpy(), weight, flags, ids)
        self.deposited_round = self.rnd.round_id
        self.last_spec = self.spec.decode() if self.spec else ""
        if self.rnd.step == self.kill_deposited[0]:
            faults.kill_self(self.kill_deposited[1])

    def receive(self, outs: list[torch.Tensor]) -> list[Requests]:
        if self.rnd.op is Op.INIT:
            return self.sync.receive(outs)
        keys, burst = self.rnd.keys, []
        if presence_position(self.rnd) is not None:  # the workers need no presence back
            keys = keys[:-1]
        plain = {mean_position(self.rnd)} - {None}  # the mean comes back exactly
        for g, win in enumerate(self.wins):
            win.wait_until(lambda c: per_dc(c, self.dc, PENDING) == 0, "its update")
            packed = torch.empty(self._packed_len(g, keys, self.sync.codec, plain))
            win.fetch(self.dc, packed.numpy())
            self._hold_fetch(burst, packed.numel() * 4)
            self._unpack(g, keys, outs, packed, self.sync.codec, plain)
        if self.spec and not self.redo:  # applied, so received
            self.spec_sends.wait()
        return [Requests(self.sync.link.stats) for _ in outs]  # already complete

    def _hold_fetch(self, burst: list[float], nbytes: int) -> None:
        """An emulated link: a ``Get`` is a round trip, the request's latency then the data."""
        wan = self.sync.wan
        if wan is not None:
            held = wan.down.hold_burst(burst, nbytes, delay=wan.model.latency)
            self.sync.link.stats.held(WAN, held)

    def save(self, rnd: Round, dc: int) -> None:
        """Only the master worker's datacenter asks; the others keep training."""
        if dc == 0:
            self._open()
            for win in self.wins:
                win.request_save()

    def stop(self, rnd: Round, bufs) -> None:
        """Done: wait until every datacenter is, then fetch the final global parameters."""
        self._open()
        for win in self.wins:
            win.mark_done(self.dc)
        burst = []
        for g, win in enumerate(self.wins):
            win.wait_until(lambda c: c[ALL_DONE] == 1, "the other datacenters to finish")
            if bufs:  # the final values, uncompressed
                packed = torch.empty(self._packed_len(g, rnd.keys, None))
                win.fetch(self.dc, packed.numpy())
                self._hold_fetch(burst, packed.numel() * 4)
                self._unpack(g, rnd.keys, bufs, packed, None)
        for win in self.wins:
            win.free()
        if self._guard is not None:  # no one-sided call left to watch
            self._guard_stop.set()
            self._guard.join()

    def rejoin(self, link, topo: Topology) -> None:
        """After a recovery (--on-failure continue): this datacenter renumbered, the windows
        made again over the rebuilt global tier (the global servers first apply every deposit
        made, this one's last included, with the hyperparameters sent here)."""
        self.sync.rejoin(link, topo)
        self.topo, self.dc = topo, link.comm.Get_rank()
        if self.wins is None:  # still synchronous (INIT rounds)
            return
        self._abandoned += self.wins
        self.redo_of = self.deposited_round
        sends = Requests(link.stats, None, "the global servers to take the rejoin")
        for g in range(topo.num_global_servers):
            isend_state(
                sends, link.comm, self.last_spec, topo.num_dcs + g, TAG_REJOIN_SPEC, link.stats
            )
        self.wins = None
        self._open(announce=False)
        barrier(link.comm, None, "the global servers to rejoin the asynchronous tier")
        sends.wait()

    def _open(self, announce: bool = True) -> None:
        """The windows (collective over the global tier), after an ASYNC header
        (``announce``) that moves the global servers to them."""
        if self.wins is not None:
            return
        keys = sorted(self.keys.items())
        if len(keys) > MAX_KEYS:
            raise ConfigError(
                f"the asynchronous tier carries at most {MAX_KEYS} keys: use fewer, larger ones"
            )
        if announce:
            self.sync.send_header(Round(Op.ASYNC, 0, keys))
        self.wins = open_windows(
            self.sync.link.comm,
            self.topo,
            keys,
            self.sync.link.stats,
            self.sync.timeout,
            self.sync.codec,
        )
        if self.sync.wan is not None:  # the ticket, the polls and the flags cross it too
            for win in self.wins:
                win.on_control = self._hold_control
        if faults.watching() and self._guard is None:
            self._guard = threading.Thread(
                target=self._leave_if_a_global_server_is_lost, name="geompi-rma-guard", daemon=True
            )
            self._guard.start()

    def _leave_if_a_global_server_is_lost(self) -> None:
        """--on-failure continue: a one-sided call to a lost global server never returns (Open
        MPI 5.0.11: the lock or get waits for the lost target forever, though the MPI library's
        heartbeat knows it is lost), and this server makes one every few milliseconds. A lost
        global server stops the job (faults.surviving_topology), so once the MPI library
        reports one lost, this rank ends (status 0) a moment later if the job has not stopped
        by then: the others recover without it, and stop in one line."""
        from mpi4py import MPI

        while not self._guard_stop.wait(0.5):
            comm, topo = self.sync.link.comm, self.topo  # the current ones, after a recovery
            try:
                failed = comm.Get_failed()
                lost = MPI.Group.Translate_ranks(
                    failed, list(range(failed.Get_size())), comm.Get_group()
                )
            except Exception:  # noqa: BLE001 - a communicator being rebuilt: look again
                continue
            servers = range(topo.num_dcs, topo.num_dcs + topo.num_global_servers)
            if any(r in servers for r in lost):
                time.sleep(_LEAVE_AFTER_S)
                os._exit(0)

    def _hold_control(self, trips: int) -> None:
        """An emulated link: a control operation takes ``trips`` one-way latencies (its few
        bytes take no time worth charging)."""
        held = trips * self.sync.wan.model.latency
        time.sleep(held)
        self.sync.link.stats.held(WAN, held)

    def _respect_staleness(self) -> None:
        s = self.max_staleness
        if not s:
            return
        d, ndc = self.dc, self.topo.num_dcs

        def ok(c) -> bool:
            active = [per_dc(c, e, UPDATES) for e in range(ndc) if not per_dc(c, e, DONE)]
            return not active or per_dc(c, d, UPDATES) - min(active) < s

        self.wins[0].wait_until(ok, f"slower datacenters (--max-staleness {s})")

    def _slices(self, g: int, keys, bufs):
        for (k, n), buf in zip(keys, bufs):
            lo, hi = self.topo.shard_bounds(n, g)
            yield (k, g), buf[lo:hi]

    def _packed_len(self, g: int, keys, codec: TierCodec | None, plain=frozenset()) -> int:
        sizes = [hi - lo for lo, hi in (self.topo.shard_bounds(n, g) for _, n in keys)]
        return max(
            1, sum(region_bytes(key_codec(codec, i, plain), m) for i, m in enumerate(sizes)) // 4
        )

    def _pack(self, g: int, keys, bufs, plain: set[int]) -> torch.Tensor:
        """This round's slices for global server g, compressed when the tier is (except the
        keys at positions ``plain``: presence and mean), as fp32."""
        out = torch.zeros(self._packed_len(g, keys, self.sync.codec, plain))
        raw, off = out.view(torch.uint8), 0
        for i, (rkey, piece) in enumerate(self._slices(g, keys, bufs)):
            codec = key_codec(self.sync.codec, i, plain)
            if codec is None:
                data = piece
            else:
                lo, hi = self.topo.shard_bounds(keys[i][1], g)
                data = codec.encode_push(rkey, piece, idle=codec.idle(rkey[0], lo, hi))
            data = data.contiguous().view(torch.uint8)
            raw[off : off + data.numel()] = data
            off += region_bytes(codec, piece.numel())
        return out

    def _unpack(self, g: int, keys, bufs, packed: torch.Tensor, codec, plain=frozenset()) -> None:
        raw, off = packed.view(torch.uint8), 0
        for i, (rkey, piece) in enumerate(self._slices(g, keys, bufs)):
            m = piece.numel()
            codec_i = key_codec(codec, i, plain)
            if codec_i is None:
                piece.copy_(raw[off : off + 4 * m].view(torch.float32))
            else:
                codec.decode_pull(rkey, raw[off : off + codec.nbytes(m)], piece)
            off += region_bytes(codec_i, m)
