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

    def __init__(self, comm, period: float, home: list[int | None] | None = None) -> None:
        self.comm = comm.Dup()
        self.home = home  # each rank's datacenter (None: a global server), for stagger()
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


def start(comm, timeout: float | None, home: list[int | None] | None = None) -> Heartbeat | None:
    """Start this rank's heartbeat for a watchdog of ``timeout`` seconds (collective).
    ``home``: each rank's datacenter (None for a global server), so that a loss is reported
    first by its own datacenter (:func:`stagger`).

    None (and no heartbeat) without a timeout or without MPI_THREAD_MULTIPLE.
    """
    global _current
    if not timeout or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return None
    _current = Heartbeat(comm, period=min(1.0, timeout / 5), home=home)
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


STAGGER_S = 1.0  # per step of distance between a lost rank and a waiter
STAGGER_RANKS = 8  # at most this many steps of rank distance


def stagger(rank: int) -> float:
    """How much longer than its timeout this rank waits before it reports ``rank`` lost.
    Every rank sees the same silence, so the nearest reports first: a rank of the lost one's
    own datacenter at once (its local server is the one waiting on it), others 1 s later per
    rank between them plus 1 s (at most 9 s). 0 without a heartbeat."""
    hb = _current
    if hb is None:
        return 0.0
    if hb.home is not None and hb.home[rank] is not None and hb.home[rank] == hb.home[hb.rank]:
        return 0.0
    return STAGGER_S * (1 + min(abs(hb.rank - rank), STAGGER_RANKS))


def active() -> bool:
    """Whether a heartbeat runs, so waits may outlast silence."""
    return _current is not None
