"""One-sided deposit slots: the asynchronous global tier of MixedSync over MPI RMA windows.

Each global server (the *owner*) exposes two windows on the global communicator:

- ``data``: one slot per datacenter, ``slot_len`` float32 each. A local server (a *client*)
  ``Put``s its gradient into its own slot; the owner applies it and writes the resulting
  parameters back into the same slot, which the client then ``Get``s.
- ``ctrl``: float64 counters. Global: version (updates applied), ticket counter (arrival
  order), all-done flag. Per datacenter: pending ticket, weight, updates applied, done flag.

Clients use passive-target locks only; the owner reads and writes its own memory under an
exclusive lock on itself. Nothing here knows about training.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from geompi.comm.poll import Backoff, Poller
from geompi.comm.transport import WAN, LinkStats

# ctrl layout
VERSION, TICKETS, ALL_DONE, SAVE_REQUEST = 0, 1, 2, 3
_GLOBAL = 4
UPDATES, DONE, PENDING, WEIGHT, FLAGS, NKEYS = 0, 1, 2, 3, 4, 5  # a deposit writes PENDING..
KEYS = 6  # then the ids of the keys in the deposit, in slot order
MAX_DEPOSIT_KEYS = 256
_PER_DC = KEYS + MAX_DEPOSIT_KEYS


def _dc(d: int, field: int) -> int:
    return _GLOBAL + _PER_DC * d + field


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
            self.ctrl = np.zeros(_GLOBAL + _PER_DC * num_dcs, dtype=np.float64)
        else:
            self.data = np.zeros(0, dtype=np.float32)
            self.ctrl = np.zeros(0, dtype=np.float64)
        self.win_data = MPI.Win.Create(self.data, 4, comm=comm)
        self.win_ctrl = MPI.Win.Create(self.ctrl, 8, comm=comm)
        self._one = np.ones(1, dtype=np.float64)
        self._scratch = np.zeros(_GLOBAL + _PER_DC * num_dcs, dtype=np.float64)
        # An emulated WAN's charge for a control operation: called with the one-way trips it
        # takes (a Get or Fetch_and_op is a round trip: 2; a Put made visible by Unlock: 1).
        self.on_control: Callable[[int], None] | None = None

    def _control(self, nbytes: int, trips: int) -> None:
        """A control operation moved ``nbytes`` over the WAN in ``trips`` one-way trips."""
        self.stats.count(WAN, nbytes, control=True)
        if self.on_control is not None:
            self.on_control(trips)

    # ---- client side ----------------------------------------------------------------------
    def read_ctrl(self) -> np.ndarray:
        """A consistent copy of the owner's counters."""
        self.win_ctrl.Lock(self.owner, MPI.LOCK_SHARED)
        self.win_ctrl.Get(self._scratch, self.owner)
        self.win_ctrl.Unlock(self.owner)
        self._control(self._scratch.nbytes, 2)
        return self._scratch.copy()

    def deposit(
        self, dc: int, grad: np.ndarray, weight: float, flags: int, keys: list[int]
    ) -> None:
        """Put a gradient (``keys`` packed in order) into dc's slot and mark it pending."""
        self.stats.count(WAN, grad.nbytes)
        self.win_data.Lock(self.owner, MPI.LOCK_SHARED)
        self.win_data.Put(grad, self.owner, dc * self.slot_len)
        self.win_data.Unlock(self.owner)  # the data is in place before the ticket says so
        ticket = np.zeros(1, dtype=np.float64)
        self.win_ctrl.Lock(self.owner, MPI.LOCK_EXCLUSIVE)
        self.win_ctrl.Fetch_and_op(self._one, ticket, self.owner, TICKETS, MPI.SUM)
        self.win_ctrl.Flush(self.owner)
        self._control(self._one.nbytes + ticket.nbytes, 2)  # the ticket comes back: a round trip
        msg = np.array([ticket[0] + 1, weight, flags, len(keys), *keys], dtype=np.float64)
        self.win_ctrl.Put(msg, self.owner, _dc(dc, PENDING))
        self.win_ctrl.Unlock(self.owner)
        self._control(msg.nbytes, 1)

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
        self.win_data.Lock(self.owner, MPI.LOCK_SHARED)
        self.win_data.Get(out, self.owner, dc * self.slot_len)
        self.win_data.Unlock(self.owner)
        self.stats.count(WAN, out.nbytes)  # counted at the owner's side of the link

    def mark_done(self, dc: int) -> None:
        self._put_one(_dc(dc, DONE))

    def request_save(self) -> None:
        """Ask the owner for a snapshot of its state (it answers between two updates)."""
        self._put_one(SAVE_REQUEST)

    def _put_one(self, index: int) -> None:
        one = np.ones(1, dtype=np.float64)
        self.win_ctrl.Lock(self.owner, MPI.LOCK_EXCLUSIVE)
        self.win_ctrl.Put(one, self.owner, index)
        self.win_ctrl.Unlock(self.owner)
        self._control(one.nbytes, 1)

    # ---- owner side -----------------------------------------------------------------------
    def lock_self(self) -> None:
        self.win_ctrl.Lock(self.owner, MPI.LOCK_EXCLUSIVE)
        self.win_ctrl.Sync()

    def unlock_self(self) -> None:
        self.win_ctrl.Sync()
        self.win_ctrl.Unlock(self.owner)

    def slot(self, dc: int) -> np.ndarray:
        """The owner's view of datacenter dc's slot (use under ``data_lock``)."""
        return self.data[dc * self.slot_len : (dc + 1) * self.slot_len]

    def data_lock(self) -> None:
        self.win_data.Lock(self.owner, MPI.LOCK_EXCLUSIVE)
        self.win_data.Sync()

    def data_unlock(self) -> None:
        self.win_data.Sync()
        self.win_data.Unlock(self.owner)

    def free(self) -> None:
        """Collective over the communicator."""
        self.win_data.Free()
        self.win_ctrl.Free()


def per_dc(ctrl: np.ndarray, d: int, field: int) -> float:
    return float(ctrl[_dc(d, field)])


def deposit_keys(ctrl: np.ndarray, d: int) -> list[int]:
    n = int(ctrl[_dc(d, NKEYS)])
    return [int(k) for k in ctrl[_dc(d, KEYS) : _dc(d, KEYS) + n]]


def set_per_dc(ctrl: np.ndarray, d: int, field: int, value: float) -> None:
    ctrl[_dc(d, field)] = value
