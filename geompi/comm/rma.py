"""One-sided deposit slots: the asynchronous global tier of MixedSync over MPI RMA windows.

Each global server (the *owner*) exposes two windows on the global communicator:

- ``data``: one slot per datacenter, ``slot_len`` float32 each. A local server (a *client*)
  ``Put``s its gradient into its own slot; the owner applies it and writes the resulting
  parameters back into the same slot, which the client then ``Get``s.
- ``ctrl``: float64 counters. Global: version (updates applied), ticket counter (arrival
  order), all-done flag. Per datacenter: pending ticket, weight, updates applied, done flag.
  These come first (the *header*: what a client polls, 16 words for 2 datacenters); then each
  datacenter's list of the keys in its deposit, which only the owner reads.

No rank ever takes a lock on a target. Every rank opens one ``Lock_all(MODE_NOCHECK)`` epoch on
both windows when they are made and keeps it until they are freed; clients complete each
operation with ``Flush`` (at the target: remote completion), and the owner never addresses its
own window with an RMA call: it reads and writes its memory directly (the MPI-3 *unified*
model, checked at creation), with ``Win.Sync`` as the barrier between its loads and stores and
the clients' operations. Open MPI's osc/rdma over btl/tcp granted the owner no lock on its own
window while clients polled it (its own target is not addressable over TCP: open-mpi/ompi#7830),
and a lock over TCP needs the target inside an MPI call. Here no lock is asked for at all.

Order replaces mutual exclusion. A deposit writes the slot and the deposit's fields (weight,
flags, keys), flushes, takes a ticket (``Fetch_and_op``), and only then writes the ticket into
PENDING: an owner that sees PENDING set sees the rest (it reads PENDING first, then the rest,
see :meth:`SlotWindows.counters`). The owner writes its results and counters, then clears
PENDING last; a client that reads PENDING clear fetches complete results. A datacenter deposits
again only after its last deposit's PENDING was cleared, so owner and client never write the
same word at once.

Over TCP a one-sided operation moves only while its target is inside an MPI call: the owner
drives MPI's progress (:meth:`SlotWindows.progress`) every time it polls its counters. Nothing
here knows about training.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from geompi.comm.poll import Backoff, Poller
from geompi.comm.transport import WAN, LinkStats
from geompi.errors import ConfigError

# ctrl layout: the header (global words, then each datacenter's fields), then the key lists
VERSION, TICKETS, ALL_DONE, SAVE_REQUEST = 0, 1, 2, 3
_GLOBAL = 4
UPDATES, DONE, PENDING, WEIGHT, FLAGS, NKEYS = 0, 1, 2, 3, 4, 5  # a deposit writes WEIGHT..
_FIELDS = 6
MAX_DEPOSIT_KEYS = 256  # per datacenter: the ids of the keys in its deposit, in slot order

_PROGRESS_TAG = 32767  # an Iprobe on COMM_SELF for a message never sent: MPI's progress only


def _dc(d: int, field: int) -> int:
    return _GLOBAL + _FIELDS * d + field


def _header(num_dcs: int) -> int:
    """Words before the key lists: what a client polls."""
    return _GLOBAL + _FIELDS * num_dcs


def _keys_at(num_dcs: int, d: int) -> int:
    return _header(num_dcs) + MAX_DEPOSIT_KEYS * d


class SlotWindows:
    """The two windows of one owner, created collectively over ``comm`` by owner and clients."""

    def __init__(
        self,
        comm,
        owner: int,
        num_dcs: int,
        slot_len: int,
        stats: LinkStats,
        timeout: float | None = None,
    ) -> None:
        self.comm = comm
        self.owner = owner
        self.num_dcs = num_dcs
        self.slot_len = slot_len
        self.stats = stats
        self.timeout = timeout
        self.is_owner = comm.Get_rank() == owner
        if self.is_owner:
            self.data = np.zeros(num_dcs * slot_len, dtype=np.float32)
            self.ctrl = np.zeros(_header(num_dcs) + MAX_DEPOSIT_KEYS * num_dcs, np.float64)
        else:
            self.data = np.zeros(0, dtype=np.float32)
            self.ctrl = np.zeros(0, dtype=np.float64)
        self.win_data = MPI.Win.Create(self.data, 4, comm=comm)
        self.win_ctrl = MPI.Win.Create(self.ctrl, 8, comm=comm)
        for win in (self.win_data, self.win_ctrl):
            model = win.Get_attr(MPI.WIN_MODEL)
            if model != MPI.WIN_UNIFIED:  # the owner's direct loads and stores need it
                raise ConfigError(
                    "MixedSync needs MPI windows of the unified memory model (MPI_WIN_UNIFIED); "
                    f"this MPI made one of model {model}"
                )
            win.Lock_all(MPI.MODE_NOCHECK)  # the one epoch, until free(): no lock traffic
        self._one = np.ones(1, dtype=np.float64)
        self._scratch = np.zeros(_header(num_dcs), dtype=np.float64)
        # An emulated WAN's charge for a control operation: called with the one-way trips it
        # takes (a Get or Fetch_and_op is a round trip: 2; a Put: 1, its Flush's answer aside).
        self.on_control: Callable[[int], None] | None = None

    def _control(self, nbytes: int, trips: int) -> None:
        """A control operation moved ``nbytes`` over the WAN in ``trips`` one-way trips."""
        self.stats.count(WAN, nbytes, control=True)
        if self.on_control is not None:
            self.on_control(trips)

    # ---- client side ----------------------------------------------------------------------
    def read_ctrl(self) -> np.ndarray:
        """A copy of the owner's header (each word as it was at some moment of the read)."""
        self.win_ctrl.Get(self._scratch, self.owner)
        self.win_ctrl.Flush(self.owner)
        self._control(self._scratch.nbytes, 2)
        return self._scratch.copy()

    def deposit(
        self, dc: int, grad: np.ndarray, weight: float, flags: int, keys: list[int]
    ) -> None:
        """Put a gradient (``keys`` packed in order) into dc's slot and mark it pending."""
        self.stats.count(WAN, grad.nbytes)
        self.win_data.Put(grad, self.owner, dc * self.slot_len)
        fields = np.array([weight, flags, len(keys)], dtype=np.float64)
        ids = np.array(keys or [0], dtype=np.float64)
        self.win_ctrl.Put(fields, self.owner, _dc(dc, WEIGHT))
        self.win_ctrl.Put(ids, self.owner, _keys_at(self.num_dcs, dc))
        self.win_data.Flush(self.owner)  # data and fields in place before the ticket says so
        self.win_ctrl.Flush(self.owner)
        ticket = np.zeros(1, dtype=np.float64)
        self.win_ctrl.Fetch_and_op(self._one, ticket, self.owner, TICKETS, MPI.SUM)
        self.win_ctrl.Flush(self.owner)
        self._control(self._one.nbytes + ticket.nbytes, 2)  # the ticket comes back: a round trip
        pending = np.array([ticket[0] + 1], dtype=np.float64)
        self.win_ctrl.Put(pending, self.owner, _dc(dc, PENDING))
        self.win_ctrl.Flush(self.owner)
        self._control(pending.nbytes + fields.nbytes + 8 * len(keys), 1)

    def wait_until(self, ready, what: str) -> np.ndarray:
        """Poll the counters until ``ready(ctrl)``; returns them."""
        poller = Poller(f"{what} (from the global server)", self.timeout, Backoff(2e-5, 2e-3))
        t0, held0 = time.perf_counter(), self.stats.held_s[WAN]
        while True:
            ctrl = self.read_ctrl()
            if ready(ctrl):  # an emulated poll's hold is in wait_s already (LinkStats.held)
                held = self.stats.held_s[WAN] - held0
                self.stats.wait_s[WAN] += time.perf_counter() - t0 - held
                return ctrl
            poller.pause()

    def fetch(self, dc: int, out: np.ndarray) -> None:
        """Get datacenter dc's slot (the parameters the owner left there)."""
        self.win_data.Get(out, self.owner, dc * self.slot_len)
        self.win_data.Flush(self.owner)
        self.stats.count(WAN, out.nbytes)  # counted at the owner's side of the link

    def mark_done(self, dc: int) -> None:
        self._put_one(_dc(dc, DONE))

    def request_save(self) -> None:
        """Ask the owner for a snapshot of its state (it answers between two updates)."""
        self._put_one(SAVE_REQUEST)

    def _put_one(self, index: int) -> None:
        one = np.ones(1, dtype=np.float64)
        self.win_ctrl.Put(one, self.owner, index)
        self.win_ctrl.Flush(self.owner)
        self._control(one.nbytes, 1)

    # ---- owner side -----------------------------------------------------------------------
    @staticmethod
    def progress() -> None:
        """Let MPI move the clients' operations on this rank's windows (over TCP they move
        only while their target is inside an MPI call)."""
        MPI.COMM_SELF.Iprobe(0, _PROGRESS_TAG)

    def sync(self) -> None:
        """The barrier between the owner's direct loads and stores and the clients' operations
        (``Win.Sync`` on both windows)."""
        self.win_data.Sync()
        self.win_ctrl.Sync()

    def counters(self) -> np.ndarray:
        """The owner's copy of its counters: each datacenter's deposit fields as they were
        when its PENDING was read, or later (PENDING is read first, the rest after a barrier;
        a deposit writes them before PENDING)."""
        self.progress()
        self.sync()
        first = self.ctrl.copy()
        self.sync()
        ctrl = self.ctrl.copy()
        for d in range(self.num_dcs):
            ctrl[_dc(d, PENDING)] = first[_dc(d, PENDING)]
        return ctrl

    def slot(self, dc: int) -> np.ndarray:
        """The owner's view of datacenter dc's slot (read it after the deposit's PENDING was
        seen, write it before PENDING is cleared)."""
        return self.data[dc * self.slot_len : (dc + 1) * self.slot_len]

    def free(self) -> None:
        """Collective over the communicator."""
        for win in (self.win_data, self.win_ctrl):
            win.Unlock_all()
        self.win_data.Free()
        self.win_ctrl.Free()


def per_dc(ctrl: np.ndarray, d: int, field: int) -> float:
    return float(ctrl[_dc(d, field)])


def deposit_keys(ctrl: np.ndarray, d: int) -> list[int]:
    """The keys of datacenter d's deposit, from the owner's whole ``ctrl``."""
    n, at = (
        int(ctrl[_dc(d, NKEYS)]),
        _keys_at((len(ctrl) - _GLOBAL) // (_FIELDS + MAX_DEPOSIT_KEYS), d),
    )
    return [int(k) for k in ctrl[at : at + n]]


def set_per_dc(ctrl: np.ndarray, d: int, field: int, value: float) -> None:
    ctrl[_dc(d, field)] = value
