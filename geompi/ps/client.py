"""The worker's side of a round: send the header, push keys, pull results."""

from __future__ import annotations

import torch

from geompi.comm import callwatch
from geompi.comm.transport import Link, Requests
from geompi.ps.protocol import (
    TAG_DATA,
    TAG_EXCHANGES,
    TAG_PEER_PUSH,
    TAG_PEER_RESULT,
    TAG_RESULT,
    TAG_SPEC,
    TAG_STATS,
    Op,
    Round,
    scattered_positions,
    worker_slice,
)

LOCAL_SERVER = 0  # the local server's rank in dc_comm
# "auto" reduce-scatters among the workers of a datacenter that spans nodes, from this many
# workers and this many bytes per round: below, the funnel's one message per worker and key
# costs less than the peers' W-1. Inside one node (shared memory) the funnel measured faster
# (bench/sync_overhead.py: scatter rounds 1.0-1.4x the funnel's on 2 cores, 4 workers).
SCATTER_MIN_WORKERS = 4
SCATTER_MIN_BYTES = 2**20


def scatters(mode: str, workers: int, nbytes: int, one_node: bool = False) -> bool:
    """Whether a datacenter of ``workers`` reduce-scatters a round of ``nbytes`` among its
    workers (FLAG_SCATTER) instead of funnelling every push through its local server
    (``one_node``: every worker of the datacenter is on one node)."""
    if mode == "scatter":
        return workers > 1
    big = workers >= SCATTER_MIN_WORKERS and nbytes >= SCATTER_MIN_BYTES
    return mode == "auto" and big and not one_node


class PSClient:
    """Talks to this datacenter's local server over dc_comm (LAN), and in a scattered round
    (FLAG_SCATTER) to the datacenter's other workers: it reduce-scatters each key among them,
    pushes its own summed slice, and shares its slice of the result with them. Each round is a
    :class:`ClientRound` handle (``start``), pushed, pulled and waited on through it."""

    def __init__(self, link: Link, timeout: float | None = None) -> None:
        self.link = link
        self.timeout = timeout
        self.round_id = 0
        self.done_id = 0  # the last round completed here (waited on)
        self.step = 0  # the training step, set by the training loop; travels in headers
        self.workers = link.size - 1  # dc_comm: the local server, then the workers in order
        self.me = link.rank - 1
        self._peers = Requests(link.stats, timeout, "the other workers of this datacenter")
        self._scratch: dict[tuple, torch.Tensor] = {}  # reused receive and sum buffers

    def start(
        self,
        op: Op,
        keys: list[tuple[int, int]],
        weight: float = 0.0,
        spec: bytes | None = None,
        flags: int = 0,
        k2: int = 0,
    ) -> ClientRound:
        """Post this round's header (and optimizer spec); returns the round's handle.
        ``k2``: HFA's adaptive cadence, the K2 the local server's schedule follows."""
        self.round_id += 1
        rnd = Round(
            op, self.round_id, list(keys), float(weight), len(spec or b""), flags, self.step, k2
        )
        return ClientRound(self, rnd, spec)

    def _others(self) -> list[int]:
        return [p for p in range(self.workers) if p != self.me]

    def _buffer(self, name: tuple, n: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._scratch.get(name)
        if buf is None or buf.numel() != n or buf.device != like.device:
            buf = self._scratch[name] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf

    def stop(self) -> None:
        """Tell the servers this worker is done (every worker of the job must call it)."""
        self.start(Op.STOP, []).wait()


class ClientRound(Requests):
    """One round of a worker with its local server: its requests, the buffers that must live
    until it completes (the header, the spec, a scattered round's sums), and the one place it
    is waited on (:meth:`wait`). Keys are pushed and pulled in the order the header lists."""

    def __init__(self, client: PSClient, rnd: Round, spec: bytes | None) -> None:
        super().__init__(client.link.stats, client.timeout, "the local server")
        self.client = client
        self.round_id = rnd.round_id
        self.flags = rnd.flags  # FLAG_STATS: the caller pulls the counters too
        self.header = rnd.encode()  # kept alive until the round is waited on
        link = client.link
        link.igather(self, self.header, None, LOCAL_SERVER)
        self.spec = None
        if spec:
            self.spec = torch.frombuffer(bytearray(spec), dtype=torch.uint8)
            link.isend(self, self.spec, LOCAL_SERVER, TAG_SPEC)
        self.scattered = scattered_positions(rnd)
        self.pushed = self.pulled = 0
        self.sent: list[torch.Tensor] = []  # every pushed buffer, alive until the round ends
        self.pushes: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []
        self.pulls: list[tuple[int, torch.Tensor]] = []

    def push(self, buf: torch.Tensor) -> None:
        """Contribute ``buf`` (fp32) to the datacenter sum of the next key of the round.

        Point-to-point, not ``Ireduce``: Open MPI's nonblocking reduce measured 3.5x slower
        than Isend plus a sum at the local server (bench/sync_overhead.py). In a scattered
        round each other worker gets its slice of ``buf`` now; this worker's own summed slice
        goes to the local server in :meth:`wait`.
        """
        c = self.client
        i = self.pushed
        self.pushed += 1
        self.sent.append(buf)
        if i not in self.scattered:
            c.link.isend(self, buf, LOCAL_SERVER, TAG_DATA + i)
            return
        lo, hi = worker_slice(buf.numel(), c.me, c.workers)
        parts = []  # every worker's part of this worker's slice, in worker order
        for p in range(c.workers):
            plo, phi = worker_slice(buf.numel(), p, c.workers)
            if p == c.me:
                parts.append(buf[lo:hi])
                continue
            if phi > plo:
                c.link.isend(c._peers, buf[plo:phi], 1 + p, TAG_PEER_PUSH + i)
            if hi > lo:
                part = c._buffer(("part", i, p), hi - lo, buf)
                c.link.irecv(c._peers, part, 1 + p, TAG_PEER_PUSH + i)
                parts.append(part)
        self.pushes.append((i, buf, parts))

    def pull(self, out: torch.Tensor) -> None:
        """Receive the next key's result into ``out`` when the round is waited on (in a
        scattered round, this worker's slice from the local server and the rest from its
        peers, in :meth:`wait`)."""
        c = self.client
        i = self.pulled
        self.pulled += 1
        if i not in self.scattered:
            c.link.irecv(self, out, LOCAL_SERVER, TAG_RESULT + i)
            return
        lo, hi = worker_slice(out.numel(), c.me, c.workers)
        if hi > lo:
            c.link.irecv(self, out[lo:hi], LOCAL_SERVER, TAG_RESULT + i)
        self.pulls.append((i, out))

    def pull_exchanges(self, out: torch.Tensor) -> None:
        """A round with a K2 (adaptive HFA): receive the local server's exchange times into
        ``out`` (float64: their sum and count) when the round is waited on."""
        self.client.link.irecv(self, out, LOCAL_SERVER, TAG_EXCHANGES)

    def pull_stats(self, out) -> None:
        """A round with FLAG_STATS: receive the local server's WAN counters into ``out`` (a
        float64 numpy array of STATS_LEN) when the round is waited on. Uncounted telemetry."""
        link = self.client.link
        self.add(link.comm.Irecv(out, LOCAL_SERVER, TAG_STATS), link.kind)

    def wait(self) -> None:
        """Complete the round. In a scattered one: sum the slices the peers sent and push
        that, wait for the local server, then exchange the result's slices with the peers.
        The sum runs in worker order, as the local server's does, so both give the same bits.
        A second wait completes nothing more."""
        with callwatch.round_wait(self.round_id):  # a worker of geompi.init's: watched
            self._wait()

    def _wait(self) -> None:
        c = self.client
        pushes, self.pushes = self.pushes, []
        if pushes:
            c._peers.wait()
        for i, buf, parts in pushes:
            lo, hi = worker_slice(buf.numel(), c.me, c.workers)
            if hi > lo:
                mine = c._buffer(("sum", i), hi - lo, buf).copy_(parts[0])
                for part in parts[1:]:
                    mine.add_(part)
                c.link.isend(self, mine, LOCAL_SERVER, TAG_DATA + i)
        super().wait()
        pulls, self.pulls = self.pulls, []
        for i, out in pulls:
            lo, hi = worker_slice(out.numel(), c.me, c.workers)
            for p in c._others():
                plo, phi = worker_slice(out.numel(), p, c.workers)
                if hi > lo:
                    c.link.isend(c._peers, out[lo:hi], 1 + p, TAG_PEER_RESULT + i)
                if phi > plo:
                    c.link.irecv(c._peers, out[plo:phi], 1 + p, TAG_PEER_RESULT + i)
        c._peers.wait()
        self.sent.clear()
        c.done_id = self.round_id
