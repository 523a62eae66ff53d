"""Liveness of every rank, so that a watchdog can tell an idle peer from a dead one.

``--comm-timeout`` once measured the time since the last message, so healthy runs aborted
whenever a peer was legitimately quiet: HFA's local servers between rare global syncs, rank 0
evaluating or writing a checkpoint, a MixedSync datacenter waiting for a slowed one. Here a
helper thread on every rank sends a tiny message to every other rank each ``period`` seconds,
on a communicator of its own, and records when each peer's last one arrived. A waiter then
gives up only when some rank has been silent for longer than its timeout: that rank is dead,
stopped (SIGSTOP stops its helper thread too) or its node is gone.

It needs ``MPI_THREAD_MULTIPLE``; without it :func:`start` returns None and the waits fall
back to measuring silence.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI

TAG = 7001


class Heartbeat:
    """A helper thread that beats to every rank of ``comm`` and listens to their beats."""

    def __init__(self, comm, period: float) -> None:
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.period = period
        now = time.monotonic()
        self.last = [now] * self.size  # when each rank was last heard from
        self._out = np.zeros(1, dtype=np.int8)
        self._in = np.zeros(1, dtype=np.int8)
        self._lost_out = np.ones(1, dtype=np.int8)  # a beat that says: I report a loss
        self._announced: list[MPI.Request] = []
        self.reporter: int | None = None  # the rank that reported a loss, if any
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="geompi-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        status = MPI.Status()
        recv = self.comm.Irecv(self._in, MPI.ANY_SOURCE, TAG)
        sends: list[MPI.Request] = []
        next_beat = 0.0
        while not self._stop.is_set():
            while recv.Test(status):
                self.last[status.Get_source()] = time.monotonic()
                if self._in[0] and self.reporter is None:
                    self.reporter = status.Get_source()
                recv = self.comm.Irecv(self._in, MPI.ANY_SOURCE, TAG)
            now = time.monotonic()
            if now >= next_beat:
                sends = [r for r in sends if not r.Test()]
                if len(sends) < 4 * self.size:  # a peer that stopped reading: do not pile up
                    sends += [
                        self.comm.Isend(self._out, peer, TAG)
                        for peer in range(self.size)
                        if peer != self.rank
                    ]
                next_beat = now + self.period
            self.last[self.rank] = now
            self._stop.wait(min(0.05, self.period / 4))
        recv.Cancel()
        recv.Wait()

    def silent(self, seconds: float) -> list[tuple[int, float]]:
        """(rank, seconds since it was heard from) of every rank silent for over ``seconds``."""
        now = time.monotonic()
        return [(r, now - t) for r, t in enumerate(self.last) if now - t > seconds]

    def announce(self) -> None:
        """Tell every rank this one reports a loss, so that the others, which see the same
        silence, do not report it again before the abort ends them (one line per fault)."""
        self.reporter = self.rank
        self._announced = [
            self.comm.Isend(self._lost_out, peer, TAG)
            for peer in range(self.size)
            if peer != self.rank
        ]

    def close(self) -> None:
        """Stop beating (every rank, at the end of the job)."""
        self._stop.set()
        self._thread.join()


_current: Heartbeat | None = None


def start(comm, timeout: float | None) -> Heartbeat | None:
    """Start this rank's heartbeat for a watchdog of ``timeout`` seconds (collective).

    None (and no heartbeat) without a timeout or without MPI_THREAD_MULTIPLE.
    """
    global _current
    if not timeout or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return None
    _current = Heartbeat(comm, period=min(1.0, timeout / 5))
    return _current


def stop() -> None:
    """Stop this rank's heartbeat, if any."""
    global _current
    if _current is not None:
        _current.close()
        _current = None


def lost(timeout: float) -> list[tuple[int, float]]:
    """The ranks silent for over ``timeout`` seconds; [] if there is no heartbeat."""
    return _current.silent(timeout) if _current is not None else []


def claim_report() -> bool:
    """Whether this rank is the one to report a loss: no other rank has announced one (this
    rank then announces it). False without a heartbeat's report of another rank."""
    if _current is None:
        return True
    if _current.reporter is not None and _current.reporter != _current.rank:
        return False
    _current.announce()
    return True


def rank_distance(rank: int) -> int:
    """How far ``rank`` is from this one in the world (0 without a heartbeat)."""
    return abs(_current.rank - rank) if _current is not None else 0


def active() -> bool:
    """Whether a heartbeat runs, so waits may outlast silence."""
    return _current is not None
