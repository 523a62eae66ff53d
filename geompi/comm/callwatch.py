"""Mismatched calls between workers, named in one line instead of a silent hang.

geompi's collective calls (``DistributedOptimizer``, ``geompi.save``/``load``, ``opt.close``,
``geompi.finish``) and its training rounds must be made by every worker in the same order. A
worker that calls ``geompi.save`` alone, stops a step early, or builds a different optimizer
waits forever in one place while the others wait forever in another, and nothing is printed.

Here each worker keeps what it is waiting in (a collective call and how many of them it has
entered, or a training round and its number), and a helper thread tells the other workers once
it has waited there for ``PATIENCE`` seconds. Two workers that have both waited that long in
places that can never meet are a mismatch; the lower of the two prints one line and aborts the
job (servers too):

- two different collective calls, each the same number of calls in (``geompi.save`` while
  another worker is in ``geompi.finish``);
- a collective call, while another worker waits in a training round beyond the rounds this one
  began (its round needs this worker, which waits for it in the call).

Waits that will complete (a worker still in the round the others have already pushed, the
master writing a large checkpoint while the others wait in the same ``geompi.save``) never
match these rules, however long they take. Needs ``MPI_THREAD_MULTIPLE``; without it nothing is
watched. Started by ``geompi.init`` on the workers only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from geompi.comm.faults import TEST_HOOKS

TAG = 7013
PATIENCE = 10.0  # seconds a worker waits in one place before it tells the others
PERIOD = 0.2  # how often the helper thread looks

ROUND = "a training round (backward or opt.step)"
LABELS = (
    ROUND,
    "DistributedOptimizer",
    "geompi.save",
    "geompi.load",
    "opt.close",
    "geompi.finish",
    "geompi.all_reduce",
    "geompi.broadcast_object",
    "geompi.stop_requested",
    "geompi.latest",
)


@dataclass(frozen=True)
class Place:
    """Where a worker waits: ``label`` (an index of LABELS), the collective calls it has
    entered (``calls``) and the training rounds it has begun (``rounds``); for a round, the
    round it waits in."""

    label: int
    calls: int
    rounds: int

    def encode(self, waiting: bool) -> np.ndarray:
        return np.array([int(waiting), self.label, self.calls, self.rounds], dtype=np.int64)

    def describe(self, worker: int) -> str:
        if self.label == 0:
            return f"worker {worker} waits in {ROUND} (round {self.rounds})"
        return (
            f"worker {worker} waits in {LABELS[self.label]} (its collective call "
            f"{self.calls}, after {self.rounds} round(s))"
        )


def conflict(a: Place, b: Place) -> bool:
    """Whether workers waiting at ``a`` and ``b`` can never both get out."""
    if a.label and b.label:  # two collective calls
        return a.calls == b.calls and a.label != b.label
    if not a.label and not b.label:  # two rounds: the servers match those (or time them out)
        return False
    call, rnd = (a, b) if a.label else (b, a)
    return rnd.calls < call.calls and rnd.rounds > call.rounds


class CallWatch:
    """This worker's place, and a helper thread that compares it with the other workers'."""

    def __init__(
        self,
        comm,
        rounds: Callable[[], int],
        report: Callable[[str], None],
        patience: float = PATIENCE,
    ) -> None:
        self.comm = comm.Dup()
        self.me, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.rounds = rounds
        self.report = report
        self.patience = patience
        self.calls = 0
        self._place: Place | None = None
        self._since = 0.0
        self._depth = 0  # nested collective calls (a DistributedOptimizer closing the last)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="geompi-callwatch", daemon=True)
        self._thread.start()

    # ---- the main thread ---------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self, label: str) -> Iterator[None]:
        """Inside a collective call over the workers."""
        self._depth += 1
        if self._depth == 1:
            self.calls += 1
            self._enter(Place(LABELS.index(label), self.calls, self._rounds()))
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._place = None

    @contextlib.contextmanager
    def round(self, number: int) -> Iterator[None]:
        """Waiting for training round ``number`` (inside a collective call: the call's)."""
        if self._depth:
            yield
            return
        self._enter(Place(0, self.calls, number))
        try:
            yield
        finally:
            self._place = None

    def _enter(self, place: Place) -> None:
        self._since = time.monotonic()
        self._place = place

    def _rounds(self) -> int:
        try:
            return int(self.rounds())
        except Exception:  # noqa: BLE001 - no engine yet
            return 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    # ---- the helper thread -------------------------------------------------------------------
    def _run(self) -> None:
        from mpi4py import MPI

        try:
            self._watch()
        except MPI.Exception:  # the job is ending under this thread (an abort elsewhere)
            return

    def _watch(self) -> None:
        from mpi4py import MPI

        peers: dict[int, Place] = {}
        told: Place | None = None
        sends: list[tuple[Any, np.ndarray]] = []
        status = MPI.Status()
        buf = np.zeros(4, dtype=np.int64)
        while not self._stop.wait(PERIOD):
            while self.comm.Iprobe(MPI.ANY_SOURCE, TAG, status):
                src = status.Get_source()
                self.comm.Recv(buf, src, TAG)
                if buf[0]:
                    peers[src] = Place(int(buf[1]), int(buf[2]), int(buf[3]))
                else:
                    peers.pop(src, None)
            sends = [(r, b) for r, b in sends if not r.Test()]
            place, since = self._place, self._since
            waited = place is not None and time.monotonic() - since >= self.patience
            now = place if waited else None
            if now != told and len(sends) < 8 * self.size:
                msg = (now or told).encode(now is not None)  # type: ignore[union-attr]
                sends += [
                    (self.comm.Isend(msg, p, TAG), msg) for p in range(self.size) if p != self.me
                ]
                told = now
            if now is None:
                continue
            for p, theirs in sorted(peers.items()):
                if p > self.me and conflict(now, theirs):
                    self.report(
                        f"{now.describe(self.me)}, while {theirs.describe(p)}, both for over "
                        f"{self.patience:g} s: every worker must make geompi's collective calls "
                        "(DistributedOptimizer, geompi.save/load, opt.close, geompi.finish) and "
                        "take its training steps in the same order"
                    )
                    return


_watch: CallWatch | None = None


def start(comm, rounds: Callable[[], int], report: Callable[[str], None]) -> CallWatch | None:
    """Watch this worker (collective over the workers' ``comm``); None without
    ``MPI_THREAD_MULTIPLE``."""
    global _watch
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return None
    _watch = CallWatch(comm, rounds, report, patience=patience())
    return _watch


def patience(env=os.environ) -> float:
    """PATIENCE; under ``GEOMPI_TEST_HOOKS=1``, ``GEOMPI_TEST_CALLWATCH_PATIENCE`` seconds (a
    test's mismatch is then named sooner: waits that will complete never match, however
    short the patience)."""
    if env.get(TEST_HOOKS) == "1" and env.get("GEOMPI_TEST_CALLWATCH_PATIENCE"):
        return float(env["GEOMPI_TEST_CALLWATCH_PATIENCE"])
    return PATIENCE


def stop() -> None:
    global _watch
    if _watch is not None:
        _watch.close()
        _watch = None


def call(label: str) -> contextlib.AbstractContextManager[None]:
    """``with call("geompi.save"):`` around a collective call (nothing when unwatched)."""
    return _watch.call(label) if _watch is not None else contextlib.nullcontext()


def round_wait(number: int) -> contextlib.AbstractContextManager[None]:
    """``with round_wait(n):`` around the wait for training round ``n``."""
    return _watch.round(number) if _watch is not None else contextlib.nullcontext()


def collective(label: str, fn: Callable) -> Callable:
    """``fn`` (a public collective call) inside ``call(label)``."""

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with call(label):
            return fn(*args, **kwargs)

    return inner
