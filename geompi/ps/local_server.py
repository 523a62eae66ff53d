"""LocalServer: sums its datacenter's pushes and talks to the global tier for it."""

from __future__ import annotations

import json
import time
from collections import deque
from functools import partial

import numpy as np
import torch

from geompi.comm import faults
from geompi.comm.buffers import BufferPool, all_finite
from geompi.comm.linkmodel import Duplex, LinkModel
from geompi.comm.poll import Backoff, spin_until
from geompi.comm.topology import Communicators, Topology
from geompi.comm.transport import LAN, WAN, Link, LinkStats, Requests, recv_buffer
from geompi.errors import NonFiniteError
from geompi.ps.policy import LocalPolicy, Routing, UpNow
from geompi.ps.protocol import (
    FLAG_EXACT,
    FLAG_MEAN,
    FLAG_RAW,
    FLAG_SCATTER,
    FLAG_STATS,
    FLAG_WEIGHT_FINAL,
    TAG_DATA,
    TAG_EXCHANGES,
    TAG_HEADER,
    TAG_MIRROR,
    TAG_RESULT,
    TAG_SPEC,
    TAG_STATS,
    TAG_TRAILER,
    Op,
    Round,
    agree,
    expect_presence,
    header_len,
    mean_position,
    plain_positions,
    presence_payload,
    presence_position,
    received_presence,
    scattered_positions,
    sends_values,
    wire_header,
    worker_slice,
)
from geompi.ps.wan import TierCodec


class SyncUplink:
    """The synchronous global tier: point-to-point to every global server, in lock-step.

    A round is pipelined per key: ``begin`` sends the header, ``send_key`` each key as soon as
    its datacenter sum is ready, ``end`` a trailer with the datacenter's weight (0 when it
    skipped a non-finite gradient), and ``receive`` posts one receive list per key so results
    can go on to the workers key by key.

    With an emulated WAN (``link_model``), sends wait in a queue until the model releases them
    and results are held until the model delivers them. With a ``codec``, the data of gradient
    and average rounds travels compressed (geompi.ps.wan).
    """

    def __init__(
        self,
        link: Link,
        topo: Topology,
        timeout: float | None = None,
        link_model: LinkModel | None = None,
        codec: TierCodec | None = None,
    ) -> None:
        self.link = link
        self.topo = topo
        self.timeout = timeout
        self.wan = Duplex(link_model) if link_model is not None and link_model.active else None
        self.codec = codec
        self.peak_round_bytes = 0
        self._queue: deque = deque()  # (release time, requests, tensor, dest, tag, control)

    def _requests(self) -> Requests:
        return Requests(self.link.stats, self.timeout, "the global servers")

    def _compressed(self, i: int | None = None) -> bool:
        """Whether this round's data (key ``i`` of it) travels compressed: not a presence key."""
        if self.codec is None or self.rnd.op not in (Op.GRAD, Op.AVG):
            return False
        if self.rnd.flags & FLAG_EXACT:  # a forced global round: whole values both ways
            return False
        return i is None or i not in plain_positions(self.rnd)

    # ---- sends, through the emulated link when there is one -----------------------------
    def _send(self, reqs: Requests, t: torch.Tensor, dest: int, tag: int, control=False) -> None:
        if self.wan is None:
            self.link.isend(reqs, t, dest, tag, control)
            return
        due = self.wan.up.schedule(t.numel() * t.element_size())
        self._queue.append((due, reqs, t, dest, tag, control))
        self._flush(block=False)

    def _flush(self, block: bool = True) -> None:
        """Post the queued sends the link has released (all of them, waiting, if ``block``)."""
        while self._queue:
            due, reqs, t, dest, tag, control = self._queue[0]
            if time.perf_counter() < due:
                if not block:
                    return
                self.link.stats.held(WAN, self.wan.up.hold_until(due))
            self._queue.popleft()
            self.link.isend(reqs, t, dest, tag, control)

    def _deliver(self, burst: list[float], nbytes: int) -> None:
        """Hold a received result until the link delivers it. Results of one round leave the
        global servers together, so they queue on the link from the first one's arrival."""
        self.link.stats.held(WAN, self.wan.down.hold_burst(burst, nbytes))

    # ---- one round ------------------------------------------------------------------------
    @property
    def presence_first(self) -> bool:
        """Whether the local server must hand over a gradient round's presence key before its
        other keys: a lossy codec leaves idle parameters out of each push (``send_key``)."""
        return self.codec is not None and self.codec.compressor.lossy

    def begin(self, rnd: Round, spec: bytes | None) -> None:
        self.rnd = rnd
        if rnd.op is Op.INIT and spec:
            spec = self._init_spec(spec)
        if self.codec is not None:
            self.codec.set_presence(None)
        self.sends = self._requests()
        self.round_bytes = 0  # data bytes this round sends up (the peak is reported)
        hdr = wire_header(
            Round(
                rnd.op, rnd.round_id, rnd.keys, rnd.weight, len(spec or b""), rnd.flags, rnd.step
            ).encode()
        )
        spec_t = torch.frombuffer(bytearray(spec), dtype=torch.uint8) if spec else None
        self._keep = [hdr] if spec_t is None else [hdr, spec_t]  # alive until sent
        for gs in self._servers():
            self._send(self.sends, hdr, gs, TAG_HEADER, control=True)
            if spec_t is not None:
                self._send(self.sends, spec_t, gs, TAG_SPEC, control=True)

    def _init_spec(self, spec: bytes) -> bytes | None:
        """An INIT round's spec: its layout goes to the codec (every datacenter's first worker
        sends it for that); only the master's datacenter passes the spec on to the global
        servers, as only its values count."""
        if self.codec is not None and b'"layout"' in spec:
            self.codec.set_layout(json.loads(spec)["layout"])
        return spec if sends_values(self.rnd, self.link.rank) else None

    def send_key(self, i: int, buf: torch.Tensor) -> None:
        if not sends_values(self.rnd, self.link.rank):  # INIT: the master's datacenter only
            return
        key, n = self.rnd.keys[i]
        ref_weight = self.rnd.weight if self.rnd.op is Op.AVG else 0.0
        if self.codec is not None and i == presence_position(self.rnd):  # sent first
            self.codec.set_presence(buf)
        for g, gs in enumerate(self._servers()):
            lo, hi = self.topo.shard_bounds(n, g)
            if hi > lo:
                piece = buf[lo:hi]
                if self._compressed(i):
                    idle = self.codec.idle(key, lo, hi) if self.rnd.op is Op.GRAD else None
                    piece = self.codec.encode_push((key, g), piece, ref_weight, idle)
                    self._keep.append(piece)
                self._send(self.sends, piece, gs, TAG_DATA + i)
                copies = 1
                if self.topo.replicas > 1:  # the same bytes to the server mirroring the shard
                    mirror = self.topo.num_dcs + self.topo.replica_server(g)
                    self._send(self.sends, piece, mirror, TAG_MIRROR + i)
                    copies = 2
                if self.rnd.op is not Op.INIT:  # the peak of training rounds
                    self.round_bytes += copies * piece.numel() * piece.element_size()
                    self.peak_round_bytes = max(self.peak_round_bytes, self.round_bytes)
        self.sends.test()

    def end(self, weight: float) -> None:
        if self._compressed():  # a skipped gradient round (weight 0) is thrown away
            self.codec.end_push(self.rnd.op is not Op.GRAD or weight > 0)
        trailer = torch.tensor([weight], dtype=torch.float64)
        self._keep.append(trailer)
        for gs in self._servers():
            self._send(self.sends, trailer, gs, TAG_TRAILER, control=True)

    def receive(self, outs: list[torch.Tensor], block: bool = True) -> list[Requests]:
        """Post the results' receives, one request list per key; the sends complete first
        (unless ``block`` is False: then ``finish_sends`` completes them later)."""
        per_key, burst = [], []
        for i, ((key, n), out) in enumerate(zip(self.rnd.keys, outs)):
            reqs = self._requests()
            nbytes = 0
            for g, gs in enumerate(self._servers()):
                lo, hi = self.topo.shard_bounds(n, g)
                if hi <= lo:
                    continue
                if i == presence_position(self.rnd):  # answered empty: nothing to count
                    self.link.irecv_short(reqs, out[lo:hi], gs, TAG_RESULT + i)
                elif self._compressed(i):
                    payload = torch.empty(self.codec.nbytes(hi - lo), dtype=torch.uint8)
                    self.link.irecv(reqs, payload, gs, TAG_RESULT + i)
                    decode = partial(self.codec.decode_pull, (key, g), payload, out[lo:hi])
                    reqs.add_callback(decode)
                    nbytes += payload.numel()
                else:
                    self.link.irecv(reqs, out[lo:hi], gs, TAG_RESULT + i)
                    nbytes += 4 * (hi - lo)
                    if self.codec is not None and (
                        self.rnd.op is Op.INIT or self.rnd.flags & FLAG_EXACT
                    ):
                        reqs.add_callback(partial(self.codec.set_replica, (key, g), out[lo:hi]))
            if self.wan is not None:
                reqs.add_callback(partial(self._deliver, burst, nbytes))
            per_key.append(reqs)
        if not block:  # overlapped: results can arrive once the upload has left
            if self.wan is not None:
                burst.append(self.wan.up.free_at + self.wan.model.latency)
            return per_key
        self._flush()
        self.sends.wait()
        return per_key

    def finish_sends(self) -> None:
        """Complete the sends of an overlapped round (their emulated upload included)."""
        self._flush()
        self.sends.wait()

    def progress(self) -> None:
        """Post the queued sends that the emulated link has released, without waiting."""
        if self._queue:
            self._flush(block=False)
        self.sends.test()

    def stop(self, rnd: Round, bufs: list[torch.Tensor]) -> None:
        """The workers are done: tell every global server."""
        self.send_header(rnd)

    def save(self, rnd: Round, dc: int) -> None:
        """A checkpoint: every global server sends its state to the master worker."""
        self.send_header(rnd)

    def send_header(self, rnd: Round) -> None:
        reqs = self._requests()
        hdr = wire_header(rnd.encode())
        for gs in self._servers():
            self._send(reqs, hdr, gs, TAG_HEADER, control=True)
        self._flush()
        reqs.wait()

    def rejoin(self, link: Link, topo: Topology) -> None:
        """After a recovery (geompi.comm.faults): the rebuilt global tier; what was queued
        for the old one is dropped."""
        self.link, self.topo = link, topo
        self._queue.clear()

    def _servers(self) -> range:
        d = self.topo.num_dcs
        return range(d, d + self.topo.num_global_servers)


class LocalServer:
    """One per datacenter. Serves rounds until the workers send STOP.

    Each round's keys are summed over the datacenter's workers; the algorithm's ``policy``
    (geompi.ps.policy) says which go on to the global tier now, which are answered with the
    datacenter's mean, and which go up overlapped (their global result merged later).
    """

    def __init__(
        self,
        comms: Communicators,
        topo: Topology,
        stats: LinkStats,
        *,
        policy: LocalPolicy | None = None,
        on_nonfinite: str = "abort",
        timeout: float | None = None,
        uplink=None,
        slowdown: float = 1.0,
        lan_model: LinkModel | None = None,
    ) -> None:
        self.topo = topo
        self.comms = comms
        self.dc = topo.dc_of(comms.world.Get_rank())
        self.lan = Link(comms.dc, LAN, stats)
        self.uplink = uplink or SyncUplink(Link(comms.glob, WAN, stats), topo, timeout)
        self.policy: LocalPolicy = policy or UpNow()
        self.on_nonfinite = on_nonfinite
        self.timeout = timeout
        self.stats = stats
        self.bufs = BufferPool()  # key -> sum; (key, worker) -> its push; (key, "out") -> result
        # Overlapped keys (Routing.overlapped): their global result is merged at the key's next
        # round instead of being waited for: key -> (result requests, result buffer).
        self.pending: dict[int, tuple[Requests, torch.Tensor]] = {}
        # Timed exchanges (Routing.timed): each one's time, scaled to the whole model, since
        # the workers were last told (TAG_EXCHANGES)
        self.exchange_s: list[float] = []
        self.skipped = 0
        self.workers = topo.workers(self.dc)
        self.slowdown = slowdown
        self._round_end: float | None = None  # when the previous round's results went out
        # --lan-bandwidth: this server's LAN port, shared by all its workers' traffic
        self.lan_port = Duplex(lan_model) if lan_model is not None and lan_model.active else None
        self._kill_at = faults.fault_step("GEOMPI_FAULT_KILL_AT", comms.world.Get_rank())
        # test hook: lost once its first key of that step's round has gone up (a round the
        # global servers have begun to apply)
        self._kill_mid = faults.fault_step("GEOMPI_FAULT_KILL_MID", comms.world.Get_rank())
        if hasattr(self.uplink, "kill_deposited"):  # one-sided tier: lost once it has deposited
            self.uplink.kill_deposited = (self._kill_mid, comms.world.Get_rank())
            self._kill_mid = -1
        # test hook: lost as that step's checkpoint (SAVE) round reaches it
        self._kill_save = faults.fault_step("GEOMPI_FAULT_KILL_SAVE", comms.world.Get_rank())

    def run(self) -> None:
        faults.serve(self)

    def rejoin(self, loss: faults.Loss) -> None:
        """After a recovery: serve the same datacenter (renumbered) over the rebuilt
        communicators. The round cut off is dropped: the workers redo it as a global one."""
        self.topo = loss.topo
        self.dc = self.topo.dc_of(self.comms.world.Get_rank())
        self.lan = Link(self.comms.dc, LAN, self.stats)
        self.workers = self.topo.workers(self.dc)
        self.uplink.rejoin(Link(self.comms.glob, WAN, self.stats), self.topo)
        self.policy.rejoin()

    def serve_round(self) -> bool:
        """Serve one round of the datacenter's workers; False once they sent STOP."""
        reqs = Requests(self.stats, self.timeout, f"the workers of datacenter {self.dc}")
        rnd, weight, spec = self._receive_header(reqs)
        if self.pending:  # an overlapped exchange: its send buffers are reused below
            self.uplink.finish_sends()
            if not self.policy.keeps_late(rnd):  # the end (or a save): never merged, dropped
                for results, _ in self.pending.values():
                    results.wait()
                self.pending.clear()
        if rnd.op is Op.SAVE:
            self.uplink.save(rnd, self.dc)
            return True
        bufs = [self.bufs.get(k, n) for k, n in rnd.keys]
        if rnd.op is Op.STOP:  # MixedSync's STOP carries keys: the final global parameters
            self.policy.stopped(self.dc)
            self.uplink.stop(rnd, bufs)
            self._send_results(reqs, bufs)
            return False
        self._serve_keys(reqs, rnd, weight, spec, bufs)
        return True

    def _receive_header(self, reqs: Requests) -> tuple[Round, float, bytes | None]:
        """The round the workers agree on, its weight (the datacenter's), and its spec."""
        mine = torch.zeros(header_len(), dtype=torch.float64)
        headers = torch.zeros(self.lan.size, header_len(), dtype=torch.float64)
        self.lan.igather(reqs, mine, headers, 0)
        if self.pending:  # an overlapped global exchange is under way: keep it moving

            def headers_in() -> bool:
                self.uplink.progress()
                self._complete_arrived()
                return reqs.test()

            what = f"the workers of datacenter {self.dc}"
            spin_until(headers_in, what, timeout=None, backoff=Backoff(2e-4, 2e-4))
        reqs.wait()
        rnd, weight, with_spec = agree(headers[1:], self.workers, f"datacenter {self.dc}")
        if rnd.step == self._kill_at or rnd.op is Op.SAVE and rnd.step == self._kill_save:
            faults.kill_self(self.comms.world.Get_rank())  # test hooks: lost now
        spec = None
        if with_spec:
            dc_rank = 1 + self.workers.index(with_spec[0])
            spec_t = torch.empty(int(Round.decode(headers[dc_rank]).spec_len), dtype=torch.uint8)
            recv_buffer(
                self.lan.comm, spec_t.numpy(), dc_rank, TAG_SPEC, self.timeout,
                f"the spec from the master worker of datacenter {self.dc}",
            )  # fmt: skip
            spec = spec_t.numpy().tobytes()
        return rnd, weight, spec

    def _serve_keys(
        self, reqs: Requests, rnd: Round, weight: float, spec: bytes | None, bufs: list
    ) -> None:
        """An INIT, gradient or value round: sum the pushes, send up the keys the policy
        routes up, answer every worker."""
        incoming = self._receive_pushes(rnd, bufs)
        routing = self.policy.route(rnd)
        due = set(routing.up)  # the keys that go on to the global tier
        up_index = {i: u for u, i in enumerate(sorted(due))}
        if due:
            self._begin_up(rnd, weight, spec, routing)
        weight, started = self._sum_keys(rnd, weight, bufs, incoming, routing)
        outs, results = bufs, []
        if due:
            self.uplink.end(weight)
            outs = [
                self.bufs.get((k, "out"), n) if i in due else bufs[i]
                for i, (k, n) in enumerate(rnd.keys)
            ]
            up = [outs[i] for i in sorted(due)]
            results = (
                self.uplink.receive(up, block=False)
                if routing.overlapped
                else self.uplink.receive(up)
            )
            if routing.timed:  # e.g. HFA's adaptive cadence: time it, for the workers
                whole = sum(n for _, n in rnd.keys) / max(1, sum(rnd.keys[i][1] for i in due))
                self._time_exchange(results, started, whole)
        if routing.overlapped and due:  # answer with the datacenter means; merge the global later
            for i in due:
                key, n = rnd.keys[i]
                self.pending[key] = (results[up_index[i]], outs[i])
                outs[i] = self.bufs.get((key, "dc"), n)
            results, due = [], set()
        if self.slowdown > 1.0:  # emulation: hold the whole round before answering
            for r in results:
                r.wait()
            self._emulate_slowdown()
        ready = {i: results[up_index[i]] for i in due}
        pos = presence_position(rnd)
        if pos is not None:  # the workers need no presence back
            outs = [b[:0] if i == pos else b for i, b in enumerate(outs)]
        if rnd.flags & FLAG_STATS:  # before the results: no worker waits for another's
            self._tell_stats(reqs)
        self._send_results(reqs, outs, ready, scattered_positions(rnd))
        if rnd.k2:  # after the results: this round's own exchange is timed by then
            self._tell_exchanges()
        self._round_end = time.perf_counter()
        if rnd.op is Op.INIT:  # the time split covers training, not the start-up
            self.stats.reset_time()

    def _begin_up(self, rnd: Round, weight: float, spec: bytes | None, routing: Routing) -> None:
        """The header of the round's keys that go up, to the global tier."""
        flags = (rnd.flags & ~(FLAG_SCATTER | FLAG_STATS)) | routing.flags
        if mean_position(rnd) not in routing.up:  # the buffers' key stays here this round
            flags &= ~FLAG_MEAN
        if not self._may_skip(rnd):
            flags |= FLAG_WEIGHT_FINAL  # a non-finite sum raises: the weight stays
        keys = [rnd.keys[i] for i in sorted(routing.up)]
        self.uplink.begin(Round(rnd.op, rnd.round_id, keys, weight, 0, flags, rnd.step), spec)

    def _sum_keys(
        self, rnd: Round, weight: float, bufs: list, incoming: list, routing: Routing
    ) -> tuple[float, float | None]:
        """Sum each key's pushes as they arrive and send it up (or answer its datacenter mean);
        returns the round's weight (0 once a non-finite sum skips it) and when the first key
        went up."""
        due, pos = routing.up, presence_position(rnd)
        up_index = {i: u for u, i in enumerate(sorted(due))}
        started = None  # when the first key went up
        order = list(range(len(bufs)))
        if pos is not None and getattr(self.uplink, "presence_first", False):
            order.insert(0, order.pop(pos))  # it says which values each push leaves out
        for i in order:
            total, (reqs_i, per_worker) = bufs[i], incoming[i]
            reqs_i.wait()
            self._hold_arrived(total, per_worker, i == pos)
            if per_worker is not None:
                if per_worker[0] is not total:
                    total.copy_(per_worker[0])
                for buf in per_worker[1:]:
                    total.add_(buf)
            if self._judges_finite(rnd) and not all_finite(total):
                weight = self._nonfinite(rnd)  # raises, or 0: the global servers skip us
            key = rnd.keys[i][0]
            if routing.merge_first and key in self.pending:  # last round's result first
                self._merge_pending(key, total.div_(weight))
                total.mul_(weight)
            if i in due:
                started = started or time.perf_counter()
                self.uplink.send_key(up_index[i], presence_payload(total) if i == pos else total)
                if rnd.step == self._kill_mid:
                    self.uplink.sends.wait()
                    time.sleep(0.5)  # let the key reach the global servers
                    faults.kill_self(self.comms.world.Get_rank())
                if routing.overlapped:  # the workers get the datacenter mean now
                    self.bufs.get((key, "dc"), total.numel()).copy_(total).div_(weight)
            else:  # kept in the datacenter: its mean (a non-finite one raised above)
                total.div_(weight)
                self._merge_pending(key, total)
        return weight, started

    def _hold_arrived(self, total: torch.Tensor, per_worker: list | None, presence: bool) -> None:
        """--lan-bandwidth: hold until the emulated LAN port has taken in a key's pushes."""
        if per_worker is None:  # scattered: the workers' summed slices landed in place
            self._lan_hold(self.lan_port and self.lan_port.down, total.numel())
        elif presence:
            arrived = sum(received_presence(b) for b in per_worker)
            self.stats.received[LAN] += arrived
            self._lan_hold(self.lan_port and self.lan_port.down, arrived // 4)
        else:
            numel = total.numel() * len(per_worker)
            self._lan_hold(self.lan_port and self.lan_port.down, numel)

    def _time_exchange(self, results: list[Requests], started: float, whole: float) -> None:
        """Adaptive cadence: record when the last of this global exchange's results is in
        (emulated WAN holds included), as the time the whole model's would take (``whole``:
        the model's values over those exchanged)."""
        left = [len(results)]

        def arrived() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.exchange_s.append((time.perf_counter() - started) * whole)

        for r in results:
            r.add_callback(arrived)

    def _complete_arrived(self) -> None:
        """Complete the overlapped results that have arrived (so their time is taken now,
        not when they merge at the next round)."""
        for results, _ in self.pending.values():
            if results.test():
                results.wait()

    def _tell_exchanges(self) -> None:
        """Adaptive cadence: every worker gets the exchanges timed since the last round (their
        summed time and count; geompi.sync.hfa.Cadence chooses K2 from them)."""
        reqs = Requests(self.stats, self.timeout, f"the workers of datacenter {self.dc}")
        told = torch.tensor([sum(self.exchange_s), len(self.exchange_s)], dtype=torch.float64)
        self.exchange_s = []
        for j in range(len(self.workers)):
            self.lan.isend(reqs, told, 1 + j, TAG_EXCHANGES, control=True)
        reqs.wait()

    def _tell_stats(self, reqs: Requests) -> None:
        """FLAG_STATS (a geompi.Metrics on the workers): every worker gets this server's WAN
        counters, sent and received so far (this round's transfers are posted, so counted),
        posted on ``reqs`` before the results. Telemetry: not counted in the LAN bytes, so a
        run's byte figures are the same with or without metrics."""
        self._told = np.array([self.stats.sent[WAN], self.stats.received[WAN]], dtype=np.float64)
        for j in range(len(self.workers)):
            reqs.add(self.lan.comm.Isend(self._told, 1 + j, TAG_STATS), LAN)

    def _merge_pending(self, key: int, mean: torch.Tensor) -> None:
        """An overlapped key: the global result of its previous round arrives now (a delay of
        one datacenter round) and the policy merges it into the datacenter's ``mean``."""
        if key not in self.pending:
            return
        reqs, result = self.pending.pop(key)
        reqs.wait()
        self.policy.merge(key, mean, result)

    def _emulate_slowdown(self) -> None:
        """``--dc-slowdown``: hold the round so this datacenter's steps take ``slowdown`` times
        as long. Done here, by the one process that sees the whole round, so the workers never
        disagree about how long to wait (emulation, not a real slower network or GPU)."""
        if self._round_end is not None:
            time.sleep((time.perf_counter() - self._round_end) * (self.slowdown - 1.0))

    def _receive_pushes(
        self, rnd: Round, totals: list[torch.Tensor]
    ) -> list[tuple[Requests, list[torch.Tensor] | None]]:
        """Post the receives of every worker's push, one request list per key; a scattered
        key's summed slices go straight into its total (no list of pushes, None), and so does
        the first worker's push of any other key but presence."""
        out: list[tuple[Requests, list[torch.Tensor] | None]] = []
        scattered = scattered_positions(rnd)
        workers = len(self.workers)
        for i, (key, n) in enumerate(rnd.keys):
            reqs = Requests(self.stats, self.timeout, f"the workers of datacenter {self.dc}")
            if i in scattered:
                for j in range(workers):
                    lo, hi = worker_slice(n, j, workers)
                    if hi > lo:
                        self.lan.irecv(reqs, totals[i][lo:hi], 1 + j, TAG_DATA + i)
                out.append((reqs, None))
                continue
            # The first worker's push lands in the total itself (one pass less over it), except
            # for presence, whose empty message leaves a marker to read in its own buffer.
            per_worker = [
                totals[i] if j == 0 and i != presence_position(rnd) else self.bufs.get((key, j), n)
                for j in range(workers)
            ]
            for j, buf in enumerate(per_worker):
                if i == presence_position(rnd):  # may come empty: all present
                    expect_presence(buf)
                    self.lan.irecv_short(reqs, buf, 1 + j, TAG_DATA + i)
                else:
                    self.lan.irecv(reqs, buf, 1 + j, TAG_DATA + i)
            out.append((reqs, per_worker))
        return out

    def _send_results(
        self,
        reqs: Requests,
        bufs: list[torch.Tensor],
        ready: dict[int, Requests] | None = None,
        scattered: set[int] | frozenset = frozenset(),
    ) -> None:
        """Every key's result to every worker (of a scattered key, worker j's slice to worker
        j); key i waits for ``ready[i]`` (its global result)."""
        workers = len(self.workers)
        for i, b in enumerate(bufs):
            if ready and i in ready:
                ready[i].wait()
            for j in range(workers):
                part = b[slice(*worker_slice(b.numel(), j, workers))] if i in scattered else b
                if part.numel() or i not in scattered:
                    self._lan_hold(self.lan_port and self.lan_port.up, part.numel())
                    self.lan.isend(reqs, part, 1 + j, TAG_RESULT + i)
        reqs.wait()

    def _lan_hold(self, channel, numel: int) -> None:
        """--lan-bandwidth: wait until the emulated LAN port has moved ``numel`` fp32 values."""
        if channel is not None:
            self.stats.held(LAN, channel.hold_until(channel.schedule(4 * numel)))

    def report(self) -> dict:
        """What this server contributes to the run's summary."""
        peak = getattr(self.uplink, "peak_round_bytes", 0)
        return {"dc": self.dc, "skipped_nonfinite": self.skipped, "peak_round_wan_bytes": peak}

    def _may_skip(self, rnd: Round) -> bool:
        """Whether a non-finite sum skips this round (weight 0) instead of raising."""
        return self.on_nonfinite == "skip" and rnd.op is Op.GRAD and not rnd.flags & FLAG_RAW

    @staticmethod
    def _judges_finite(rnd: Round) -> bool:
        """Whether this server checks the round's sums for NaN/Inf (FLAG_RAW: the workers do)."""
        return rnd.op in (Op.GRAD, Op.AVG) and not rnd.flags & FLAG_RAW

    def _nonfinite(self, rnd: Round) -> float:
        """A NaN/Inf in this datacenter's sum: abort (default) or skip this gradient round."""
        ranks = f"ranks {self.workers[0]}-{self.workers[-1]}"
        what = "gradient" if rnd.op is Op.GRAD else "parameter average"
        if self._may_skip(rnd):
            self.skipped += 1
            return 0.0
        raise NonFiniteError(
            f"non-finite {what} from datacenter {self.dc} ({ranks}) at step {rnd.step} "
            f"(round {rnd.round_id}): lower --lr, check the data, or pass --on-nonfinite skip"
        )
