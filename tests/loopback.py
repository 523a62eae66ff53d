"""A loopback communicator: a test tool, not part of geompi.

An in-memory stand-in for the part of mpi4py's ``Comm`` and ``Request`` that geompi's servers and
worker client use (``Isend``, ``Irecv``, ``Iprobe``, ``Igather``, ``Split``, ``Test``/``Wait``/
``Testall``/``Waitall``, ``Get_rank``/``Get_size``), so a local server, the global servers and
their workers can run as threads of one process (tests/test_servers_inprocess.py).

Semantics kept from MPI: a send copies its buffer when it is posted (MPI may complete a send
eagerly); messages between one pair of ranks on one communicator, with one tag, arrive in the
order sent, and a message goes to the earliest posted receive that matches it (``ANY_SOURCE``,
``ANY_TAG`` included); a message may be shorter than the receive buffer, never longer; collectives
(``Igather``, ``Split``) never match point-to-point messages. Every wait gives up after the
world's ``timeout`` and ``run_ranks`` joins every thread with a deadline, naming what each stuck
rank waits for: a bug is a diagnosis, not a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

ANY_SOURCE, ANY_TAG, UNDEFINED = MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.UNDEFINED
_COLL = "collective"  # a context's second half: collectives never meet point-to-point


class LoopbackError(RuntimeError):
    """A wait gave up (the world's timeout, or another rank failed), or a message was truncated."""


def _bytes(buf) -> np.ndarray:
    """A flat uint8 view of a send or receive buffer: an array, or mpi4py's ``[array, type]``."""
    arr = np.asarray(buf[0] if isinstance(buf, (list, tuple)) else buf)
    if not arr.flags.c_contiguous:
        raise LoopbackError("buffers must be contiguous")
    return arr.reshape(-1).view(np.uint8)


@dataclass
class Status:
    """What mpi4py's ``MPI.Status`` answers about a matched message."""

    source: int = ANY_SOURCE
    tag: int = ANY_TAG
    count: int = 0  # bytes

    def Get_source(self) -> int:  # noqa: N802 - mpi4py's names
        return self.source

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag

    def Get_count(self, datatype=None) -> int:  # noqa: N802 - bytes (MPI.BYTE) only
        return self.count


@dataclass
class Request:
    """A posted operation; done once its data moved (sends: at once)."""

    world: LoopbackWorld
    what: str
    done: bool = False
    status: Status = field(default_factory=Status)
    error: str | None = None  # a receive's truncation: raised by the receiver's Test/Wait
    _then: Callable[[], None] | None = None  # runs once, when it completes (under the lock)

    def _complete(self) -> None:
        self.done = True
        if self._then is not None:
            self._then()

    def Test(self, status: Status | None = None) -> bool:  # noqa: N802
        self.world._check()
        if self.error is not None:
            raise LoopbackError(self.error)
        if self.done and status is not None:
            status.source, status.tag, status.count = (
                self.status.source,
                self.status.tag,
                self.status.count,
            )
        return self.done

    def Wait(self, status: Status | None = None) -> None:  # noqa: N802
        Request.Waitall([self])
        self.Test(status)

    @classmethod
    def Testall(cls, reqs: Sequence[Request]) -> bool:  # noqa: N802
        return all(r.Test() for r in reqs)

    @classmethod
    def Waitall(cls, reqs: Sequence[Request]) -> None:  # noqa: N802
        if not reqs:
            return
        world = reqs[0].world
        deadline = time.monotonic() + world.timeout
        with world.cond:
            while not Request.Testall(reqs):
                world._check()
                left = deadline - time.monotonic()
                if left <= 0:
                    pending = ", ".join(r.what for r in reqs if not r.done)
                    raise LoopbackError(f"no message in {world.timeout:g} s for: {pending}")
                world.cond.wait(min(left, 0.1))


@dataclass
class _Recv:
    request: Request
    buf: np.ndarray
    source: int
    tag: int


class LoopbackWorld:
    """The shared state of ``size`` ranks: per (context, rank) the unmatched messages and the
    posted receives, under one lock. ``comm(rank)`` is rank ``rank``'s world communicator."""

    def __init__(self, size: int, timeout: float = 10.0) -> None:
        self.size = size
        self.timeout = timeout
        self.cond = threading.Condition()
        self.failed: str | None = None  # set by abort(): every wait then raises
        self._unexpected: dict[tuple, list[tuple[int, int, bytes]]] = {}
        self._posted: dict[tuple, list[_Recv]] = {}
        self._rendezvous: dict[tuple, dict[int, object]] = {}
        self.waiting: dict[int, str] = {}  # world rank -> the receive it posted last, for reports

    def comm(self, rank: int) -> Comm:
        return Comm(self, ("world",), list(range(self.size)), rank)

    def abort(self, why: str) -> None:
        """Make every wait of every rank raise (a rank failed, or the test gave up)."""
        with self.cond:
            self.failed = self.failed or why
            self.cond.notify_all()

    def _check(self) -> None:
        if self.failed is not None:
            raise LoopbackError(f"the loopback world was aborted: {self.failed}")

    @staticmethod
    def _matches(source: int, tag: int, want_source: int, want_tag: int) -> bool:
        return want_source in (ANY_SOURCE, source) and want_tag in (ANY_TAG, tag)

    def _deliver(self, ctx: tuple, dest: int, source: int, tag: int, data: bytes) -> None:
        with self.cond:
            posted = self._posted.setdefault((ctx, dest), [])
            for i, r in enumerate(posted):  # the earliest matching receive takes it
                if self._matches(source, tag, r.source, r.tag):
                    del posted[i]
                    self._fill(r, source, tag, data)
                    self.cond.notify_all()
                    return
            self._unexpected.setdefault((ctx, dest), []).append((source, tag, data))

    def _post(self, ctx: tuple, me: int, r: _Recv) -> None:
        with self.cond:
            queue = self._unexpected.setdefault((ctx, me), [])
            for i, (source, tag, data) in enumerate(queue):  # the earliest matching message
                if self._matches(source, tag, r.source, r.tag):
                    del queue[i]
                    self._fill(r, source, tag, data)
                    return
            self._posted.setdefault((ctx, me), []).append(r)

    def _probe(self, ctx: tuple, me: int, source: int, tag: int) -> tuple[int, int, int] | None:
        with self.cond:
            for s, t, data in self._unexpected.get((ctx, me), []):
                if self._matches(s, t, source, tag):
                    return s, t, len(data)
        return None

    @staticmethod
    def _fill(r: _Recv, source: int, tag: int, data: bytes) -> None:
        if len(data) > r.buf.nbytes:  # MPI_ERR_TRUNCATE, at the receiver
            r.request.error = (
                f"truncated: a message of {len(data)} bytes for a {r.buf.nbytes}-byte buffer "
                f"({r.request.what})"
            )
            r.request._complete()
            return
        r.buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        r.request.status = Status(source, tag, len(data))
        r.request._complete()

    def _exchange(self, key: tuple, me: int, value: object, n: int) -> dict[int, object]:
        """A rendezvous of ``n`` ranks (a blocking collective): every rank's value, by rank."""
        deadline = time.monotonic() + self.timeout
        with self.cond:
            slot = self._rendezvous.setdefault(key, {})
            slot[me] = value
            self.cond.notify_all()
            while len(slot) < n:
                self._check()
                if time.monotonic() > deadline:
                    raise LoopbackError(f"collective {key} never completed")
                self.cond.wait(0.1)
            return dict(slot)


class Comm:
    """One rank's view of one communicator: the ranks ``members`` (world ranks, in order)."""

    def __init__(self, world: LoopbackWorld, ctx: tuple, members: list[int], rank: int) -> None:
        self.world, self.ctx, self.members, self.rank = world, ctx, members, rank
        self._coll = 0  # collectives this rank has called on this communicator, in order

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return len(self.members)

    def Free(self) -> None:  # noqa: N802
        pass

    def _where(self, op: str, peer: int, tag: int) -> str:
        return f"{op} on {'/'.join(map(str, self.ctx))} rank {self.rank} <-> {peer} tag {tag}"

    def Isend(self, buf, dest: int, tag: int = 0) -> Request:  # noqa: N802
        data = _bytes(buf).tobytes()  # copied now: the sender may reuse its buffer at once
        self.world._deliver(self.ctx, dest, self.rank, tag, data)
        req = Request(self.world, self._where("send", dest, tag))
        req._complete()
        return req

    def Irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:  # noqa: N802
        req = Request(self.world, self._where("receive", source, tag))
        self.world.waiting[self.members[self.rank]] = req.what
        self.world._post(self.ctx, self.rank, _Recv(req, _bytes(buf), source, tag))
        return req

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> bool:  # noqa: N802
        self.world._check()
        found = self.world._probe(self.ctx, self.rank, source, tag)
        if found is not None and status is not None:
            status.source, status.tag, status.count = found
        return found is not None

    def Igather(self, sendbuf, recvbuf, root: int = 0) -> Request:  # noqa: N802
        """Every rank's ``sendbuf`` (one size) into row ``rank`` of ``recvbuf`` at ``root``."""
        ctx, tag = self.ctx + (_COLL,), self._coll
        self._coll += 1
        if self.rank != root:
            return Comm(self.world, ctx, self.members, self.rank).Isend(sendbuf, root, tag)
        rows = _bytes(recvbuf).reshape(self.Get_size(), -1)
        me = Comm(self.world, ctx, self.members, self.rank)
        reqs = [me.Irecv(rows[r], r, tag) for r in range(self.Get_size())]
        me.Isend(sendbuf, root, tag)
        gathered = Request(self.world, self._where("gather", root, tag))
        left = [len(reqs)]

        def one_more() -> None:
            left[0] -= 1
            if left[0] == 0:
                gathered._complete()

        with self.world.cond:  # receives complete under the lock: count them there too
            for r in reqs:
                if r.done:
                    one_more()
                else:
                    r._then = one_more
        return gathered

    def Split(self, color: int = 0, key: int = 0) -> Comm | MPI.Comm:  # noqa: N802
        """Collective: the ranks of one ``color`` form a communicator, ordered by ``key``;
        ``UNDEFINED`` gets ``MPI.COMM_NULL`` (as mpi4py's, so callers compare with it)."""
        seq = self._coll
        self._coll += 1
        everyone = self.world._exchange(
            (self.ctx, seq, "split"), self.rank, (color, key, self.members[self.rank]),
            self.Get_size(),
        )  # fmt: skip
        if color == UNDEFINED:
            return MPI.COMM_NULL
        same = sorted((k, r) for r, (c, k, _) in everyone.items() if c == color)
        members = [everyone[r][2] for _, r in same]
        rank = [r for _, r in same].index(self.rank)
        return Comm(self.world, self.ctx + (seq, color), members, rank)


def run_ranks(
    world: LoopbackWorld, bodies: dict[int, Callable[[], object]], timeout: float = 20.0
) -> dict[int, object]:
    """Run each world rank's ``bodies[rank]()`` in a thread; returns their results by rank.

    Every thread is joined by ``timeout``. A rank that raised aborts the world (the others'
    waits end) and its error is raised here, named by rank; ranks still running at the deadline
    are reported with the receive each posted last.
    """
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def main(rank: int) -> None:
        try:
            results[rank] = bodies[rank]()
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            errors[rank] = e
            world.abort(f"rank {rank} raised {type(e).__name__}: {e}")

    threads = {
        r: threading.Thread(target=main, args=(r,), name=f"loopback-rank-{r}", daemon=True)
        for r in bodies
    }
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads.values():
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in threads.items() if t.is_alive()]
    if stuck:
        world.abort("the test's deadline passed")
        for r in stuck:
            threads[r].join(2.0)
        waits = "; ".join(f"rank {r}: {world.waiting.get(r, 'nothing posted')}" for r in stuck)
        raise AssertionError(f"ranks {stuck} still running after {timeout:g} s ({waits})")
    first = [r for r, e in errors.items() if not isinstance(e, LoopbackError)] or sorted(errors)
    if first:
        r = first[0]
        raise AssertionError(f"rank {r} failed: {type(errors[r]).__name__}: {errors[r]}") from (
            errors[r]
        )
    return results
