"""Links between ranks: nonblocking MPI operations on tensors, byte counters, one request list.

A ``Link`` wraps one communicator and knows its class, LAN (inside a datacenter) or WAN (the
global tier). Every operation returns after posting; its MPI request goes into a ``Requests``
list that is waited on in one place, which also runs any copy-back a staged receive needs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from geompi.comm import faults, heartbeat, messages
from geompi.comm.buffers import Staging, host_view
from geompi.comm.poll import Backoff, Watchdog, spin_until  # noqa: F401 - Watchdog re-exported

LAN = "lan"
WAN = "wan"


@dataclass
class LinkStats:
    """Bytes this rank sent (and posted receives for) and seconds it waited, per link class.

    ``sent`` counts every byte; ``control`` the part that was headers, trailers and specs, so
    ``sent - control`` is the data (what compression shrinks). ``held_s`` is the part of
    ``wait_s`` that an emulated link (geompi.comm.linkmodel) added.
    """

    sent: dict[str, int] = field(default_factory=lambda: {LAN: 0, WAN: 0})
    received: dict[str, int] = field(default_factory=lambda: {LAN: 0, WAN: 0})
    control: dict[str, int] = field(default_factory=lambda: {LAN: 0, WAN: 0})
    wait_s: dict[str, float] = field(default_factory=lambda: {LAN: 0.0, WAN: 0.0})
    held_s: dict[str, float] = field(default_factory=lambda: {LAN: 0.0, WAN: 0.0})
    messages: dict[str, int] = field(default_factory=lambda: {LAN: 0, WAN: 0})

    def count(self, kind: str, nbytes: int, control: bool = False) -> None:
        self.sent[kind] += int(nbytes)
        self.messages[kind] += 1
        if control:
            self.control[kind] += int(nbytes)

    def held(self, kind: str, seconds: float) -> None:
        """An emulated link held a transfer back for ``seconds``: that is waiting too."""
        self.wait_s[kind] += seconds
        self.held_s[kind] += seconds

    def reset_time(self) -> None:
        """Start the wait clocks again (after the start-up rounds), keep the byte counts."""
        for d in (self.wait_s, self.held_s):
            d.update({LAN: 0.0, WAN: 0.0})

    def as_dict(self) -> dict[str, float]:
        return {
            "lan_bytes": self.sent[LAN],
            "wan_bytes": self.sent[WAN],
            "wan_data_bytes": self.sent[WAN] - self.control[WAN],
            "wan_received_bytes": self.received[WAN],
            "lan_received_bytes": self.received[LAN],
            "lan_wait_s": self.wait_s[LAN],
            "wan_wait_s": self.wait_s[WAN],
            "wan_held_s": self.held_s[WAN],
            "lan_held_s": self.held_s[LAN],
        }


class Requests:
    """The requests of one round, waited on together; callbacks run after completion."""

    def __init__(self, stats: LinkStats, timeout: float | None = None, what: str = "") -> None:
        self.stats = stats
        self.timeout = timeout
        self.what = what
        self._reqs: list[MPI.Request] = []
        self._then: list[Callable[[], None] | None] = []
        self._kind: list[str] = []

    def add(
        self, req: MPI.Request, kind: str, then: Callable[[], None] | None = None
    ) -> MPI.Request:
        self._reqs.append(req)
        self._then.append(then)
        self._kind.append(kind)
        return req

    def add_callback(self, then: Callable[[], None]) -> None:
        """Run ``then`` after every request of the list completed (in the order added)."""
        self._then.append(then)

    def __len__(self) -> int:
        return len(self._reqs)

    def test(self) -> bool:
        """Drive progress without blocking (MPI progresses only inside MPI calls); True once
        every request has completed (callbacks run at ``wait``)."""
        return testall(self._reqs) if self._reqs else True

    def wait(self) -> None:
        """Wait for every request, then run the callbacks in the order they were added."""
        if self._reqs:
            t0 = time.perf_counter()
            wait_for(self._reqs, self.timeout, self.what)
            # A list that mixes classes charges its wait to the slower one, WAN.
            self.stats.wait_s[WAN if WAN in self._kind else LAN] += time.perf_counter() - t0
        for cb in self._then:
            if cb is not None:
                cb()
        self._reqs.clear()
        self._then.clear()
        self._kind.clear()


WAIT_MODES = ("auto", "spin", "poll")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def local_ranks(env=os.environ) -> int | None:
    """How many ranks the launcher put on this node: mpirun (Open MPI, MPICH) or srun, whose
    ``SLURM_STEP_TASKS_PER_NODE`` reads like ``4`` or ``8(x2),3`` (per node, by SLURM_NODEID)."""
    for var in _LOCAL_SIZE_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    per_node: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        count, _, times = part.partition("(x")
        if not count.isdigit() or not (times.rstrip(")").isdigit() or not times):
            return None
        per_node += [int(count)] * (int(times.rstrip(")")) if times else 1)
    node = env.get("SLURM_NODEID", "0")
    return per_node[int(node)] if node.isdigit() and int(node) < len(per_node) else None


def wait_mode(env=os.environ) -> str:
    """How ranks wait on MPI requests: ``spin`` in ``Waitall``, or ``poll`` (test, then sleep).

    ``GEOMPI_WAIT=auto`` (the default) polls where the node runs more ranks than it has CPUs,
    as the launcher tells (:func:`local_ranks`): a spinning server
    would take the core a worker needs (FSA on the transformer went from 0.91 to 0.99 of DDP's
    throughput on a 2-core node, bench/throughput_lm.py). Otherwise it spins, as MPI does.
    """
    mode = env.get("GEOMPI_WAIT", "auto").strip().lower() or "auto"
    if mode != "auto":
        return mode
    ranks = local_ranks(env)
    return "poll" if ranks is not None and ranks > (os.cpu_count() or 1) else "spin"


POLL = wait_mode() == "poll"
# A polling wait first tests and yields the core (sched_yield) for this long, then tests and
# sleeps: a round's messages usually arrive within it, and a sleep costs a timer (here about
# 30 us of CPU and 130 us of wall time even for 10 us). Waits longer than this (a server
# waiting for workers that compute) sleep and leave the cores to the workers.
YIELD_S = 2e-3


def testall(reqs: list[MPI.Request]) -> bool:
    """``Testall`` of the requests' own class: ``MPI.Request``'s, or that of an in-memory
    stand-in with mpi4py's API (tests/loopback.py), so servers run in one process in tests."""
    return not reqs or bool(type(reqs[0]).Testall(reqs))


def wait_for(reqs: list[MPI.Request], timeout: float | None, what: str = "") -> None:
    """``Waitall``, or a polling wait that sleeps between tests (``GEOMPI_WAIT=poll``, for
    oversubscribed nodes, or with a timeout) and raises CommTimeoutError once a rank is lost:
    silent on the heartbeat for ``timeout`` seconds (geompi.comm.heartbeat), or, without a
    heartbeat, no answer for ``timeout`` seconds."""
    if faults.watching():  # --on-failure continue: PeerLost where a peer is lost
        try:
            spin_until(
                lambda: testall(reqs), what, timeout=None,
                backoff=Backoff(cap=2e-4), yield_s=YIELD_S,
            )  # fmt: skip
        except MPI.Exception as e:
            raise faults.PeerLost(f"{e.Get_error_string()} while waiting for {what}") from e
        return
    if not timeout and not POLL:
        if reqs:
            type(reqs[0]).Waitall(reqs)
        return
    spin_until(
        lambda: testall(reqs), what, timeout=timeout,
        backoff=Backoff(cap=2e-4 if POLL else 1e-3), yield_s=YIELD_S,
    )  # fmt: skip


def live_timeout(timeout: float | None) -> float | None:
    """``timeout`` where a heartbeat tells idle from lost, else None: for waits that may
    rightly last long (a datacenter still training), which silence alone cannot judge."""
    return timeout if heartbeat.active() else None


def recv_state(
    comm, source: int, tag: int, stats: LinkStats, timeout: float | None, what: str = ""
) -> object:
    """Receive a state message (geompi.comm.messages), counted as WAN bytes received."""
    # Probe (testing and sleeping, through the watchdog) until the message has arrived: its
    # size is only known then. A matched probe: the message received is the one probed.
    status = MPI.Status()
    if timeout or POLL:
        probed = [None]

        def arrived() -> bool:
            probed[0] = comm.Improbe(source, tag, status)
            return probed[0] is not None

        spin_until(arrived, what, timeout=timeout)
        msg = probed[0]
    else:
        msg = comm.Mprobe(source, tag, status)
    buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
    msg.Recv([buf, MPI.BYTE])
    stats.received[WAN] += buf.nbytes
    return messages.decode(buf)


def isend_state(reqs: Requests, comm, obj, dest: int, tag: int, stats: LinkStats) -> None:
    """Post a state message of ``obj`` to ``dest`` on ``reqs``, counted as WAN control bytes."""
    # Control: checkpoint state is not training data (``wan_data_bytes``, what compression
    # shrinks), but every byte counts in ``wan_bytes``.
    buf = messages.encode(obj)
    stats.count(WAN, buf.nbytes, control=True)
    reqs.add(comm.Isend([buf, MPI.BYTE], dest, tag), WAN, then=lambda: buf)  # buf kept alive


def send_state(
    comm, obj, dest: int, tag: int, stats: LinkStats, timeout: float | None, what: str = ""
) -> None:
    """Send a state message of ``obj``, waited on through the watchdog (see isend_state)."""
    buf = messages.encode(obj)
    stats.count(WAN, buf.nbytes, control=True)
    wait_for([comm.Isend([buf, MPI.BYTE], dest, tag)], timeout, what)


def recv_object(comm, source: int, tag: int, timeout: float | None, what: str = ""):
    """``comm.recv`` of a pickled object, waited on through the watchdog: probe (testing and
    sleeping) until the message has arrived, then receive it. Only for the global servers'
    agreement on a cut (a list of ints); checkpoint state travels as state messages."""
    if timeout or POLL:
        spin_until(lambda: comm.Iprobe(source=source, tag=tag), what, timeout=timeout)
    return comm.recv(source=source, tag=tag)


def recv_buffer(comm, buf, source: int, tag: int, timeout: float | None, what: str = "") -> None:
    """``comm.Recv`` into ``buf``, waited on through the watchdog."""
    wait_for([comm.Irecv(buf, source, tag)], timeout, what)


def barrier(comm, timeout: float | None, what: str = "") -> None:
    """``comm.Barrier()``, waited on through the watchdog."""
    wait_for([comm.Ibarrier()], timeout, what)


def worker_timeout(comm_timeout: float | None) -> float | None:
    """A worker's watchdog: 4x ``--comm-timeout``, above the servers' tiers (geompi.ps.servers),
    so that the rank nearest a fault reports it."""
    return comm_timeout and 4 * comm_timeout


def barrier_before_collective(comm, comm_timeout: float | None, what: str) -> None:
    """With ``--comm-timeout``, a watched barrier before an object collective (which cannot be
    waited on with a timeout): a rank lost before it is caught, a busy one is not (heartbeat
    only). Under ``--on-failure continue`` a barrier that raises PeerLost on a loss. Nothing
    otherwise; both settings are the same on every rank."""
    if comm_timeout:
        barrier(comm, live_timeout(worker_timeout(comm_timeout)), what)
    elif faults.watching():
        barrier(comm, None, what)


class Link:
    """Nonblocking operations on tensors over one communicator of one link class."""

    def __init__(self, comm, kind: str, stats: LinkStats, staging: Staging | None = None) -> None:
        self.comm = comm
        self.kind = kind
        self.stats = stats
        self.staging = staging or Staging(force=os.environ.get("GEOMPI_FORCE_STAGING") == "1")
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def isend(
        self, reqs: Requests, t: torch.Tensor, dest: int, tag: int, control: bool = False
    ) -> None:
        self.stats.count(self.kind, t.numel() * t.element_size(), control)
        reqs.add(self.comm.Isend(self.staging.for_send(t), dest, tag), self.kind)

    def irecv(
        self, reqs: Requests, t: torch.Tensor, source: int, tag: int, count: bool = True
    ) -> None:
        """Post a receive into ``t``; ``count=False`` when the message may be shorter than
        ``t`` (the caller counts what arrived)."""
        if count:
            self.stats.received[self.kind] += t.numel() * t.element_size()
        buf, then = self.staging.for_recv(t)
        reqs.add(self.comm.Irecv(buf, source, tag), self.kind, then)

    def irecv_short(self, reqs: Requests, t: torch.Tensor, source: int, tag: int) -> None:
        """Post a receive of a message that may be shorter than CPU tensor ``t``, even empty,
        straight into ``t`` (never staged: what was not sent stays as it was). Not counted."""
        reqs.add(self.comm.Irecv(host_view(t), source, tag), self.kind)

    def igather(self, reqs: Requests, t: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        """Gather one fixed-size CPU tensor per rank into ``out`` (shape [size, ...]) at root."""
        if self.rank == root:
            reqs.add(self.comm.Igather(t.numpy(), out.numpy(), root), self.kind)
        else:
            self.stats.count(self.kind, t.numel() * t.element_size(), control=True)
            reqs.add(self.comm.Igather(t.numpy(), None, root), self.kind)
