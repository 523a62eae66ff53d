"""MixedSync's global tier: local servers deposit into global servers' RMA windows, without
waiting for other datacenters; each global server applies deposits in arrival order.

The start (INIT rounds) is synchronous. A local server's first gradient round sends an ASYNC
header to every global server, after which all of them create the windows together.

Checkpoints are one version across shards: on a save request each owner stops applying
deposits, the owners agree on a *cut* (per datacenter, the most deposits any owner has applied;
the others are at most one behind, as a datacenter deposits again only after every owner
answered), each catches up to it, and then snapshots. See docs/checkpoint-format.md.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import torch

from geompi.comm import faults, heartbeat
from geompi.comm.poll import Backoff, Poller
from geompi.comm.rma import (
    ALL_DONE,
    DONE,
    FLAGS,
    PENDING,
    SAVE_REQUEST,
    TICKETS,
    UPDATES,
    VERSION,
    WEIGHT,
    SlotWindows,
    deposit_keys,
    per_dc,
    set_per_dc,
)
from geompi.comm.topology import Topology
from geompi.comm.transport import (
    WAN,
    Requests,
    barrier,
    isend_state,
    live_timeout,
    recv_state,
)
from geompi.errors import ConfigError, ProtocolError
from geompi.ps.global_server import GlobalServer
from geompi.ps.local_server import SyncUplink
from geompi.ps.optim import spec_from_dict
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


def region_bytes(codec: TierCodec | None, m: int) -> int:
    """Bytes a slice of ``m`` values takes in a slot during training (4-byte aligned)."""
    return 4 * m if codec is None else -(-codec.nbytes(m) // 4) * 4


def _open_windows(comm, topo: Topology, keys: list[tuple[int, int]], stats, timeout, codec):
    """Collective over global_comm: one SlotWindows per global server. A slot holds either a
    training round's data (each key compressed or, a presence key, not) or, at the end, the
    full final values."""
    d = topo.num_dcs
    # Win.Create cannot be waited on: a watched barrier first, so a server lost before the
    # windows exist is reported (heartbeat-aware: another datacenter may rightly be slow)
    barrier(comm, live_timeout(timeout), "every server to open the asynchronous tier's windows")
    wins = []
    for g in range(topo.num_global_servers):
        sizes = [hi - lo for lo, hi in (topo.shard_bounds(n, g) for _, n in keys)]
        slot_len = sum(max(4 * m, region_bytes(codec, m)) for m in sizes) // 4
        wins.append(SlotWindows(comm, d + g, d, max(slot_len, 1), stats, timeout))
    return wins


class StalenessStats:
    """Staleness of the applied deposits as a histogram and per-datacenter figures.

    A list of every update grew without bound (about 1 GB a day at the soak's rate) and went
    to rank 0 as one JSON line. Exact counts up to ``EXACT``, then power-of-two buckets, so
    the size is bounded by about EXACT + 64 entries.
    """

    EXACT = 64

    def __init__(self, num_dcs: int) -> None:
        self.hist: dict[str, int] = {}
        self.count = [0] * num_dcs
        self.total = [0] * num_dcs
        self.max = [0] * num_dcs
        self.at_first_done: list[int] | None = None

    @classmethod
    def bucket(cls, s: int) -> str:
        if s < cls.EXACT:
            return str(s)
        lo = 1 << (s.bit_length() - 1)
        return f"{lo}-{2 * lo - 1}"

    def record(self, dc: int, staleness: int) -> None:
        b = self.bucket(staleness)
        self.hist[b] = self.hist.get(b, 0) + 1
        self.count[dc] += 1
        self.total[dc] += staleness
        self.max[dc] = max(self.max[dc], staleness)

    def renumber(self, kept: list[int]) -> None:
        """Keep the figures of the datacenters ``kept`` (old numbers), in their order (after a
        recovery); the histogram keeps every deposit applied."""
        self.count = [self.count[d] for d in kept]
        self.total = [self.total[d] for d in kept]
        self.max = [self.max[d] for d in kept]
        if self.at_first_done is not None:
            self.at_first_done = [self.at_first_done[d] for d in kept]

    def first_done(self, applied: list[int]) -> None:
        """The deposits applied per datacenter when the first one finished (once)."""
        if self.at_first_done is None:
            self.at_first_done = list(applied)

    def as_dict(self) -> dict:
        n = sum(self.count)
        return {
            "staleness_histogram": dict(
                sorted(self.hist.items(), key=lambda kv: int(kv[0].split("-")[0]))
            ),
            "staleness_updates": n,
            "max_staleness_seen": max(self.max, default=0),
            "mean_staleness": sum(self.total) / n if n else 0.0,
            "staleness_per_dc": [
                {"updates": c, "mean": t / c if c else 0.0, "max": m}
                for c, t, m in zip(self.count, self.total, self.max)
            ],
            "updates_at_first_done": self.at_first_done or list(self.count),
        }


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
        self.wins = _open_windows(
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
            1, sum(region_bytes(_codec(codec, i, plain), m) for i, m in enumerate(sizes)) // 4
        )

    def _pack(self, g: int, keys, bufs, plain: set[int]) -> torch.Tensor:
        """This round's slices for global server g, compressed when the tier is (except the
        keys at positions ``plain``: presence and mean), as fp32."""
        out = torch.zeros(self._packed_len(g, keys, self.sync.codec, plain))
        raw, off = out.view(torch.uint8), 0
        for i, (rkey, piece) in enumerate(self._slices(g, keys, bufs)):
            codec = _codec(self.sync.codec, i, plain)
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
            codec_i = _codec(codec, i, plain)
            if codec_i is None:
                piece.copy_(raw[off : off + 4 * m].view(torch.float32))
            else:
                codec.decode_pull(rkey, raw[off : off + codec.nbytes(m)], piece)
            off += region_bytes(codec_i, m)


_LEAVE_AFTER_S = 2.0  # see AsyncUplink._leave_if_a_global_server_is_lost

TAG_CUT = 23  # on global_comm, between global servers: the deposits each has applied
# on global_comm after a recovery: a local server's last deposit's hyperparameters (or "")
TAG_REJOIN_SPEC = 26


def _codec(codec: TierCodec | None, i: int, plain) -> TierCodec | None:
    """Key ``i``'s codec: none for the keys at positions ``plain`` (presence and mean), which
    travel exactly."""
    return None if i in plain else codec


class AsyncGlobalServer(GlobalServer):
    """A global server of MixedSync: sync INIT rounds, then apply deposits as they arrive."""

    final_snapshot = False  # the spec's ``final_snapshot``: a last snapshot once all are done

    def configure(self, spec: dict) -> None:
        super().configure(spec)
        if "final_snapshot" in spec:
            self.final_snapshot = bool(spec["final_snapshot"])

    def snapshot(self) -> dict:
        """The base snapshot plus its version: the deposits applied per datacenter."""
        return {**super().snapshot(), "cut": list(getattr(self, "applied", []))}

    def run(self) -> None:
        while True:  # synchronous until every local server sent ASYNC (or STOP)
            try:
                rnd = self.serve_round()
                if rnd is None:
                    return
                if rnd.op is Op.ASYNC:
                    self._start_async(rnd.keys)
                    break
            except Exception as e:  # noqa: BLE001 - a lost rank, under --on-failure continue
                if not faults.is_failure(e):
                    raise
                self.rejoin(faults.recover(self.comms, self.topo))
        while True:
            try:
                self._serve_async()
                break
            except Exception as e:  # noqa: BLE001 - a lost rank, under --on-failure continue
                if not faults.is_failure(e):
                    raise
                self._rejoin_async(faults.recover(self.comms, self.topo))
        self._write_deposit_log()
        if self.final_snapshot:  # every deposit of every datacenter: the same on every owner
            self.send_snapshot()

    def _start_async(self, keys: list[tuple[int, int]]) -> None:
        """The windows, and the per-datacenter state of the asynchronous tier."""
        self.key_sizes = keys
        self.offsets = {}
        off = 0
        for k, n in keys:
            lo, hi = self.topo.shard_bounds(n, self.index)
            self.offsets[k] = (off, hi - lo)
            off += hi - lo
        self.wins = _open_windows(self.link.comm, self.topo, keys, self.stats, None, self.codec)
        for k in self.offsets:  # every datacenter received the INIT values exactly
            for d in range(self.topo.num_dcs):
                if self.codec is not None:
                    self.codec.set_replica((k, d), self.values[k])
                self._pulled(k, d)  # DCASGD: w_bak[d] starts at w0 (also after a resume)
        self.win = self.wins[self.index]
        self.staleness = StalenessStats(self.topo.num_dcs)  # bounded, however long the run
        self.last_version = [0] * self.topo.num_dcs
        self.applied = [0] * self.topo.num_dcs  # deposits applied per datacenter (this run)
        self.samples_applied = 0.0  # their weights: the samples the model has seen (this run)
        # Each datacenter's deposits are stepped with its own hyperparameters: the job's
        # until its first worker sends new ones (FLAG_SPEC), as a schedule changes them.
        opt = self.optimizer
        self.job_hyper = None if opt is None else (opt.spec, opt.groups)
        self.dc_hyper: dict[int, tuple] = {}
        self.dc_means: dict[int, dict[int, tuple[float, torch.Tensor]]] = {}  # key -> dc ->
        self.mean_init: dict[int, torch.Tensor] = {}
        # applied order: what GEOMPI_TEST_DEPOSIT_LOG writes (kept only then: it grows)
        self.deposits: list[dict] | None = [] if os.environ.get("GEOMPI_TEST_DEPOSIT_LOG") else None
        self.dc_names = list(range(self.topo.num_dcs))  # each one's number at the job's start
        self._abandoned: list[SlotWindows] = []  # a lost rank's windows: never freed

    def _rejoin_async(self, loss: faults.Loss) -> None:
        """After a recovery (--on-failure continue): every deposit already made is applied (the
        lost datacenters' too), the surviving datacenters are renumbered as the new topology
        numbers them, and the windows are made again over the rebuilt global tier, holding what
        the old ones held: each datacenter's last results, its counters."""
        kept = [d for d in range(self.topo.num_dcs) if d not in loss.left_dcs]
        self._before = None  # nothing to undo: each applied deposit stands
        self.rejoin(loss)
        comm = self.link.comm
        what = "the local servers to rejoin the asynchronous tier"
        specs = [
            recv_state(comm, ls, TAG_REJOIN_SPEC, self.stats, None, what)
            for ls in range(len(kept))  # the surviving local servers, renumbered
        ]
        ctrl = self._counters()
        for d in range(len(self.dc_names)):
            if per_dc(ctrl, d, PENDING) > 0:  # a lost datacenter's new hyperparameters: gone
                self._apply_deposit(d, ctrl, spec=specs[kept.index(d)] if d in kept else "")
        self._renumber(kept)
        self._reopen_windows(kept)
        barrier(comm, None, what)

    def _counters(self) -> np.ndarray:
        """A copy of this owner's counters (see SlotWindows.counters)."""
        return self.win.counters()

    def _reopen_windows(self, kept: list[int]) -> None:
        """New windows over the rebuilt global tier (collective), holding what the old one held
        for the datacenters ``kept`` (old numbers), renumbered: each one's last results and
        counters; no deposit pending, no save requested."""
        old, ctrl = self.win, self._counters()
        self._abandoned += self.wins
        self.wins = _open_windows(
            self.link.comm, self.topo, self.key_sizes, self.stats, None, self.codec
        )
        self.win = new = self.wins[self.index]
        # written before the local servers pass the barrier that follows: none reads them yet
        new.ctrl[VERSION], new.ctrl[TICKETS] = ctrl[VERSION], ctrl[TICKETS]
        for i, d in enumerate(kept):
            for field in (UPDATES, DONE):
                set_per_dc(new.ctrl, i, field, per_dc(ctrl, d, field))
        for i, d in enumerate(kept):
            new.slot(i)[:] = old.slot(d)
        new.sync()

    def _renumber(self, kept: list[int]) -> None:
        """Per-datacenter state, for the datacenters ``kept`` (old numbers), in their order."""
        new = {d: i for i, d in enumerate(kept)}
        self.dc_names = [self.dc_names[d] for d in kept]
        self.last_version = [self.last_version[d] for d in kept]
        self.applied = [self.applied[d] for d in kept]
        self.dc_hyper = {new[d]: h for d, h in self.dc_hyper.items() if d in new}
        self.dc_means = {
            k: {new[d]: m for d, m in means.items() if d in new}
            for k, means in self.dc_means.items()
        }
        self.staleness.renumber(kept)
        if self.optimizer is not None:
            self.optimizer.renumber_dcs(new)

    def _serve_async(self) -> None:
        win, ndc = self.win, self.topo.num_dcs
        # Deposits may legitimately not come for long (a slowed datacenter): only a heartbeat
        # can tell that from a lost one, so without one this loop waits as before.
        timeout = getattr(self, "timeout", None) if heartbeat.active() else None
        poller = Poller("deposits from the datacenters", timeout, Backoff(2e-5, 1e-3))
        while True:
            poller.check()
            ctrl = self._counters()
            if ctrl[SAVE_REQUEST]:
                self._save_at_cut()
                win.ctrl[SAVE_REQUEST] = 0
                win.sync()
                continue  # ctrl is stale: the catch-up applied deposits
            pending = sorted(
                (per_dc(ctrl, d, PENDING), d) for d in range(ndc) if per_dc(ctrl, d, PENDING) > 0
            )
            if not pending:
                done = [per_dc(ctrl, d, DONE) for d in range(ndc)]
                if any(done):
                    self.staleness.first_done(self.applied)
                if all(done):
                    break
                poller.backoff.sleep()
                continue
            poller.reset()
            for _, d in pending:
                self._apply_deposit(d, ctrl)
        self._publish_final()
        for w in self.wins:  # collective, in the same order on every rank
            w.free()

    def _save_at_cut(self) -> None:
        """Snapshot after the same deposits as every other owner (the agreed cut)."""
        cut = self._agree_cut()
        poller = Poller("the deposits of the agreed cut", None, Backoff(2e-5, 1e-3))
        while self.applied != cut:
            ctrl = self._counters()
            due = [
                d
                for d in range(self.topo.num_dcs)
                if self.applied[d] < cut[d] and per_dc(ctrl, d, PENDING) > 0
            ]
            for d in due:  # the one deposit this owner still lacks from d
                self._apply_deposit(d, ctrl)
            if not due:
                poller.pause()
        self.send_snapshot()

    def _agree_cut(self) -> list[int]:
        """Exchange the applied counts with the other owners; the cut is their maximum."""
        comm, ndc = self.link.comm, self.topo.num_dcs
        me = ndc + self.index
        others = [ndc + g for g in range(self.topo.num_global_servers) if ndc + g != me]
        mine = [int(a) for a in self.applied]
        timeout = live_timeout(getattr(self, "timeout", None))
        sends = Requests(self.stats, timeout, "the other global servers to take the cut")
        for o in others:  # a state message, counted: no pickles between ranks
            isend_state(sends, comm, mine, o, TAG_CUT, self.stats)
        cut = mine
        for o in others:
            theirs = recv_state(
                comm, o, TAG_CUT, self.stats, timeout,
                f"global server {o} to agree on the last snapshot",
            )  # fmt: skip
            if not (isinstance(theirs, list) and len(theirs) == len(mine)):
                raise ProtocolError(f"global server {o} sent a cut of another shape: {theirs!r}")
            cut = [max(a, int(b)) for a, b in zip(cut, theirs)]
        sends.wait()
        return cut

    def _apply_deposit(self, d: int, ctrl: np.ndarray, spec: str | None = None) -> None:
        """Apply datacenter d's pending deposit (``spec``: its new hyperparameters where they
        cannot be received, after a recovery; see _use_hyperparameters)."""
        win = self.win
        keys = deposit_keys(ctrl, d)
        weight, flags = per_dc(ctrl, d, WEIGHT), int(per_dc(ctrl, d, FLAGS))
        slot = torch.from_numpy(win.slot(d)).view(torch.uint8)
        rnd = Round(Op.GRAD, 0, [(k, 0) for k in keys], weight, 0, flags)
        pos, mean, plain = presence_position(rnd), mean_position(rnd), plain_positions(rnd)
        regions, off = [], 0  # (key, offset in the slot, codec), presence first
        for i, k in enumerate(keys):
            codec = _codec(self.codec, i, plain)
            regions.append((k, off, codec))
            off += region_bytes(codec, self.offsets[k][1])
        mean_key = None if mean is None else keys[mean]
        if pos is not None:
            regions.insert(0, regions.pop(pos))
        self._present = None
        self._use_hyperparameters(d, flags, spec)
        win.sync()  # the slot as deposited (its PENDING was seen: the data is in place)
        version = int(win.ctrl[VERSION])
        for k, at, codec in regions:
            n = self.offsets[k][1]
            if codec is None:
                total = slot[at : at + 4 * n].view(torch.float32).clone()
            else:
                total = codec.decode_push(slot[at : at + codec.nbytes(n)].clone(), n)
            if k == mean_key:
                self.apply_mean(k, total, weight, dc=d)
            else:
                self.apply(rnd, k, total, weight, dc=d)
            result = self.values[k] if codec is None else codec.encode_pull((k, d), self.values[k])
            if k != mean_key:  # also after a skipped (weight 0) deposit: d fetches w anyway
                self._pulled(k, d)
            result = result.contiguous().view(torch.uint8)
            slot[at : at + result.numel()] = result
        win.sync()
        self.stats.received[WAN] += off  # what the deposit brought in (counted here, at the owner)
        self.staleness.record(d, version - self.last_version[d])
        ticket = int(per_dc(ctrl, d, PENDING))
        if self.deposits is not None:
            self.deposits.append(
                {"dc": self.dc_names[d], "ticket": ticket, "weight": float(weight), "keys": keys,
                 "in_recovery": spec is not None}
            )  # fmt: skip
        win.ctrl[VERSION] = version + 1
        set_per_dc(win.ctrl, d, UPDATES, per_dc(win.ctrl, d, UPDATES) + 1)
        win.sync()
        set_per_dc(win.ctrl, d, PENDING, 0)  # last: d's results and counters are in place
        win.sync()
        self.last_version[d] = version + 1
        self.applied[d] += 1
        self.samples_applied += weight
        if sum(self.applied) == self._kill_at:  # test hook (GEOMPI_FAULT_KILL_AT=N:RANK): lost
            # once it has applied N deposits
            faults.kill_self(self.world.Get_rank())

    def apply_mean(self, key: int, total: torch.Tensor, weight: float, dc=None) -> None:
        """A datacenter's buffers (a mean key): kept per datacenter, and what it fetches back
        is its own mean, so its buffers follow its own data as in one synchronous datacenter.
        The final model carries their sample-weighted mean (``_publish_final``)."""
        init = self.mean_init.setdefault(key, self.values[key].clone())  # only changed here
        means = self.dc_means.setdefault(key, {})
        if weight > 0:  # weight 0: a skipped deposit keeps what the datacenter had
            means[dc] = (weight, total / weight)
        self.values[key].copy_(means[dc][1] if dc in means else init)

    def _final_means(self) -> None:
        """Every mean key's value becomes the datacenters' latest means, weighted by the
        samples of the deposit that brought each (in datacenter order, so every owner agrees)."""
        for key, means in self.dc_means.items():
            if means:
                total = sum(w for w, _ in means.values())
                value = sum(m * (w / total) for _, (w, m) in sorted(means.items()))
                self.values[key].copy_(value)

    def _use_hyperparameters(self, d: int, flags: int, text: str | None = None) -> None:
        """Step datacenter d's deposit with its own hyperparameters (received first, if this
        deposit brings new ones and ``text`` is not them). ``text`` "": they cannot arrive (a
        lost datacenter's last deposit), so it is stepped with those it had before."""
        if flags & FLAG_SPEC and text != "":
            if text is None:
                text = recv_state(
                    self.link.comm, d, TAG_DEPOSIT_SPEC, self.stats,
                    live_timeout(getattr(self, "timeout", None)),
                    f"the hyperparameters of datacenter {d}",
                )  # fmt: skip
            if not isinstance(text, str):
                raise ProtocolError(f"datacenter {d} sent hyperparameters that are not JSON text")
            spec = json.loads(text)
            groups = [spec_from_dict(g) for g in spec.get("groups") or []] or None
            main = spec_from_dict(spec["optimizer"])
            self.dc_hyper[d] = (main, groups or [main])
        if self.optimizer is None:
            return
        want = self.dc_hyper.get(d, self.job_hyper)
        if want != (self.optimizer.spec, self.optimizer.groups):
            self.optimizer.update(*want)

    def _pulled(self, k: int, d: int) -> None:
        """Tell the optimizer what datacenter d holds of key k now: with a codec its replica
        (what ``decode_pull`` gave it), else the values themselves."""
        if self.optimizer is None or k == self.presence_key:
            return
        n = self.offsets[k][1]
        held = self.values[k] if self.codec is None else self.codec.reference((k, d), n)
        self.optimizer.pulled(k, d, held)

    def _write_deposit_log(self) -> None:
        """Test hook: ``GEOMPI_TEST_DEPOSIT_LOG=DIR`` writes the applied deposits (dc, ticket,
        weight, keys) in order, and this server's slice of each key, to DIR/deposits-g<i>.json."""
        directory = os.environ.get("GEOMPI_TEST_DEPOSIT_LOG")
        if not directory:
            return
        bounds = {k: self.topo.shard_bounds(n, self.index) for k, n in self.key_sizes}
        with open(os.path.join(directory, f"deposits-g{self.index}.json"), "w") as f:
            json.dump({"index": self.index, "bounds": bounds, "deposits": self.deposits}, f)

    def _publish_final(self) -> None:
        """Every slot gets the final parameters, then ALL_DONE releases the local servers."""
        win = self.win
        self._final_means()
        for d in range(self.topo.num_dcs):
            slot = torch.from_numpy(win.slot(d))
            for k, (off, n) in self.offsets.items():
                slot[off : off + n] = self.values[k]
        win.sync()
        win.ctrl[ALL_DONE] = 1  # after the slots: a local server that sees it fetches them
        win.sync()

    def report(self) -> dict:
        if not hasattr(self, "win"):
            return super().report()
        ctrl = self.win.ctrl
        return {
            **super().report(),
            **self.staleness.as_dict(),
            "dc_updates": [int(per_dc(ctrl, d, UPDATES)) for d in range(self.topo.num_dcs)],
            "samples_applied": int(self.samples_applied),
        }
