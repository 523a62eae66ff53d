"""The one-sided global tier (MixedSync's mechanism), the windows and the global servers' side
(the local servers' side: geompi.ps.async_uplink): local servers deposit into global servers'
RMA windows, without waiting for other datacenters; each global server applies deposits in
arrival order, as its policy (geompi.ps.policy.AsyncPolicy) says.

The start (INIT rounds) is synchronous. A local server's first gradient round sends an ASYNC
header to every global server, after which all of them create the windows together.

Checkpoints are one version across shards: on a save request each owner stops applying
deposits, the owners agree on a *cut* (per datacenter, the most deposits any owner has applied;
the others are at most one behind, as a datacenter deposits again only after every owner
answered), each catches up to it, and then snapshots. See docs/checkpoint-format.md.
"""

from __future__ import annotations

import json
from typing import Any

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
from geompi.errors import ProtocolError
from geompi.ps.global_server import GlobalServer
from geompi.ps.policy import AsyncPolicy
from geompi.ps.protocol import (
    FLAG_SPEC,
    TAG_DEPOSIT_SPEC,
    Op,
    Round,
    mean_position,
    plain_positions,
    presence_position,
)
from geompi.ps.wan import TierCodec

TAG_CUT = 23  # on global_comm, between global servers: the deposits each has applied
# on global_comm after a recovery: a local server's last deposit's hyperparameters (or "")
TAG_REJOIN_SPEC = 26


def key_codec(codec: TierCodec | None, i: int, plain) -> TierCodec | None:
    """Key ``i``'s codec: none for the keys at positions ``plain`` (presence and mean), which
    travel exactly."""
    return None if i in plain else codec


def region_bytes(codec: TierCodec | None, m: int) -> int:
    """Bytes a slice of ``m`` values takes in a slot during training (4-byte aligned)."""
    return 4 * m if codec is None else -(-codec.nbytes(m) // 4) * 4


def open_windows(comm, topo: Topology, keys: list[tuple[int, int]], stats, timeout, codec):
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


class AsyncGlobalServer(GlobalServer):
    """A global server of the one-sided tier: sync INIT rounds, then apply deposits as they
    arrive; what a deposit does to this shard, its ``async_policy`` says (geompi.ps.policy)."""

    final_snapshot = False  # the spec's ``final_snapshot``: a last snapshot once all are done
    keeps_mirror = False  # replication is refused with the one-sided tier (MixedSync)

    def __init__(self, *args: Any, async_policy: AsyncPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.async_policy = async_policy

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
        self.wins = open_windows(self.link.comm, self.topo, keys, self.stats, None, self.codec)
        self.async_policy.start(self.optimizer, self.topo.num_dcs)
        for k in self.offsets:  # every datacenter received the INIT values exactly
            for d in range(self.topo.num_dcs):
                if self.codec is not None:
                    self.codec.set_replica((k, d), self.values[k])
                self._pulled(k, d)  # DCASGD: w_bak[d] starts at w0 (also after a resume)
        self.win = self.wins[self.index]
        self.last_version = [0] * self.topo.num_dcs
        self.applied = [0] * self.topo.num_dcs  # deposits applied per datacenter (this run)
        self.samples_applied = 0.0  # their weights: the samples the model has seen (this run)
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
        for d in range(len(self.applied)):  # the datacenters before the loss
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
        self.wins = open_windows(
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
        self.last_version = [self.last_version[d] for d in kept]
        self.applied = [self.applied[d] for d in kept]
        self.async_policy.renumber(kept)

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
                    self.async_policy.done(self.applied)
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
        """Apply datacenter d's pending deposit, as the policy says (``spec``: its new
        hyperparameters where they cannot be received, after a recovery; see _deposit_spec)."""
        win = self.win
        keys = deposit_keys(ctrl, d)
        weight, flags = per_dc(ctrl, d, WEIGHT), int(per_dc(ctrl, d, FLAGS))
        slot = torch.from_numpy(win.slot(d)).view(torch.uint8)
        rnd = Round(Op.GRAD, 0, [(k, 0) for k in keys], weight, 0, flags)
        pos, mean, plain = presence_position(rnd), mean_position(rnd), plain_positions(rnd)
        regions, off = [], 0  # (key, offset in the slot, codec), presence first
        for i, k in enumerate(keys):
            codec = key_codec(self.codec, i, plain)
            regions.append((k, off, codec))
            off += region_bytes(codec, self.offsets[k][1])
        mean_key = None if mean is None else keys[mean]
        if pos is not None:
            regions.insert(0, regions.pop(pos))
        self._present = None
        self.async_policy.hyperparameters(d, self._deposit_spec(d, flags, spec))
        win.sync()  # the slot as deposited (its PENDING was seen: the data is in place)
        version = int(win.ctrl[VERSION])
        for k, at, codec in regions:
            n = self.offsets[k][1]
            if codec is None:
                total = slot[at : at + 4 * n].view(torch.float32).clone()
            else:
                total = codec.decode_push(slot[at : at + codec.nbytes(n)].clone(), n)
            if k == mean_key:
                self.async_policy.mean(d, k, self.values[k], total, weight)
            elif k == self.presence_key or k not in self.values:  # as a synchronous round
                self.apply(rnd, k, total, weight, dc=d)
            else:
                self.updates += 1
                present = self._presence(k)
                self.async_policy.step(d, k, self.values[k], total, weight, flags, present)
            result = self.values[k] if codec is None else codec.encode_pull((k, d), self.values[k])
            if k != mean_key:  # also after a skipped (weight 0) deposit: d fetches w anyway
                self._pulled(k, d)
            result = result.contiguous().view(torch.uint8)
            slot[at : at + result.numel()] = result
        win.sync()
        self.stats.received[WAN] += off  # what the deposit brought in (counted here, at the owner)
        ticket, staleness = int(per_dc(ctrl, d, PENDING)), version - self.last_version[d]
        self.async_policy.applied(d, ticket, weight, keys, staleness, spec is not None)
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

    def _deposit_spec(self, d: int, flags: int, text: str | None = None) -> dict | None:
        """The new hyperparameters datacenter d's deposit brings (received first, unless
        ``text`` is them), or None if it brings none. ``text`` "": they cannot arrive (a lost
        datacenter's last deposit), so it is stepped with those it had before."""
        if not flags & FLAG_SPEC or text == "":
            return None
        if text is None:
            text = recv_state(
                self.link.comm, d, TAG_DEPOSIT_SPEC, self.stats,
                live_timeout(getattr(self, "timeout", None)),
                f"the hyperparameters of datacenter {d}",
            )  # fmt: skip
        if not isinstance(text, str):
            raise ProtocolError(f"datacenter {d} sent hyperparameters that are not JSON text")
        return json.loads(text)

    def _pulled(self, k: int, d: int) -> None:
        """Tell the policy what datacenter d holds of key k now: with a codec its replica
        (what ``decode_pull`` gave it), else the values themselves."""
        if k == self.presence_key:
            return
        n = self.offsets[k][1]
        held = self.values[k] if self.codec is None else self.codec.reference((k, d), n)
        self.async_policy.pulled(d, k, held)

    def _write_deposit_log(self) -> None:
        """Test hook: the policy may write what was applied, with this server's slice of each
        key."""
        bounds = {k: self.topo.shard_bounds(n, self.index) for k, n in self.key_sizes}
        self.async_policy.write_log(self.index, bounds)

    def _publish_final(self) -> None:
        """Every slot gets the final parameters, then ALL_DONE releases the local servers."""
        win = self.win
        self.async_policy.finish(self.values)
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
            **self.async_policy.report(),
            "dc_updates": [int(per_dc(ctrl, d, UPDATES)) for d in range(self.topo.num_dcs)],
            "samples_applied": int(self.samples_applied),
        }
