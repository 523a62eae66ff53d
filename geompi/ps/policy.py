"""What the servers ask an algorithm (design.md: "servers ask the algorithm").

The round engine moves a round's keys and sums them; what a round means beyond that is the
algorithm's: which keys of a datacenter round go on to the global tier now, which stay in the
datacenter and which go up overlapped (their result merged at a later round), how a late global
result merges into a datacenter's values, and what a global server does with the average of a
value round. The local server asks a ``LocalPolicy``, the global server a ``GlobalPolicy``, and a
global server of the one-sided tier (geompi.ps.async_tier) an ``AsyncPolicy`` about each deposit
it applies; the algorithms (geompi.sync) implement them beside their worker side. This module
defines the questions and the plain answers (every key up now; the average assigned), and names
no algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from geompi.ps.protocol import Round

if TYPE_CHECKING:
    from geompi.ps.optim import ServerOptimizer

# The section of a global server's snapshot (and of the state restored into it) that holds its
# policy's per-key state; geompi.checkpointing reads it under this name.
POLICY_STATE = "outer"


@dataclass(frozen=True)
class Routing:
    """How the local server routes one round, as its policy decides.

    ``up``: the positions of the round's keys that go on to the global tier now; the others are
    answered with the datacenter's own mean. ``flags``: added to the round's header to the
    global tier. ``merge_first``: a late global result of a key (see ``overlapped``) merges into
    the datacenter's values before they go up. ``overlapped``: the workers get the datacenter
    mean of the keys that go up at once; their global results merge at the keys' next round.
    ``timed``: the exchange is timed, scaled to the whole model, for the workers (TAG_EXCHANGES).
    """

    up: frozenset[int]
    flags: int = 0
    merge_first: bool = False
    overlapped: bool = False
    timed: bool = False

    @classmethod
    def all_up(cls, rnd: Round) -> Routing:
        """Every key goes on to the global tier now, the round's header as it came."""
        return cls(frozenset(range(len(rnd.keys))))


class LocalPolicy(Protocol):
    """What a local server asks about the rounds of its datacenter."""

    def route(self, rnd: Round) -> Routing:
        """Where each key of ``rnd`` (INIT, GRAD or a value round) goes; called once a round."""
        ...

    def keeps_late(self, rnd: Round) -> bool:
        """Whether late global results (of overlapped rounds) still merge after ``rnd``'s
        header came; if not they are completed and dropped before the round is served."""
        ...

    def merge(self, key: int, local: torch.Tensor, result: torch.Tensor) -> None:
        """A late global ``result`` of ``key`` arrives: merge it into the datacenter's
        ``local`` values, in place."""
        ...

    def rejoin(self) -> None:
        """After a recovery: the round cut off is redone as a global one; start counting anew."""
        ...

    def stopped(self, dc: int) -> None:
        """The workers of datacenter ``dc`` sent STOP (the job ends)."""
        ...


class GlobalPolicy(Protocol):
    """What a global server asks about the value rounds (parameter averages) it applies.

    Gradient rounds step the hosted optimizer (geompi.ps.optim) and INIT rounds assign, both
    in the round engine; a value round's datacenters' average goes to ``average``.
    """

    def configure(self, spec: dict) -> None:
        """The master worker's spec (INIT round): the policy reads its own entries."""
        ...

    def average(self, key: int, value: torch.Tensor, average: torch.Tensor) -> None:
        """This shard's slice ``value`` of ``key`` becomes the new global value, in place, given
        ``average``, the datacenters' weighted average of the same slice."""
        ...

    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        """The policy's state per key of this shard (checkpointed; undone on a recovery)."""
        ...

    def load_state_dict(self, state: dict[int, dict[str, torch.Tensor]]) -> None: ...


class AsyncPolicy(Protocol):
    """What a global server of the one-sided tier (geompi.ps.async_tier) asks about the
    deposits it applies: one datacenter's gradient round at a time, in arrival order.

    The tier moves the deposits and their results, decodes them, counts them (tickets,
    versions, the agreed cut) and handles the presence key; what a deposit does to this shard's
    values, and the figures kept about the deposits, are the policy's.
    """

    def start(self, optimizer: ServerOptimizer | None, num_dcs: int) -> None:
        """The tier begins (after the INIT rounds): this shard's hosted optimizer as the INIT
        rounds configured it (None: a deposit's sum becomes the value), ``num_dcs``
        datacenters, numbered 0 .. num_dcs - 1."""
        ...

    def hyperparameters(self, dc: int, spec: dict | None) -> None:
        """Datacenter ``dc``'s deposit is applied next; ``spec``: the hyperparameters it
        brings (the master worker's spec form: ``optimizer``, ``groups``), None if none new."""
        ...

    def step(
        self,
        dc: int,
        key: int,
        value: torch.Tensor,
        total: torch.Tensor,
        weight: float,
        flags: int,
        present: list[bool] | None,
    ) -> None:
        """A gradient key of ``dc``'s deposit: ``total`` the sum over its ``weight`` samples
        (``flags``: the deposit's round flags; ``present``: per piece of the key, whether it
        has a gradient). Updates this shard's ``value`` in place (``total`` may be reused)."""
        ...

    def mean(
        self, dc: int, key: int, value: torch.Tensor, total: torch.Tensor, weight: float
    ) -> None:
        """A mean key of ``dc``'s deposit (the workers' buffers times their weight): ``value``
        becomes what ``dc`` fetches back, in place."""
        ...

    def pulled(self, dc: int, key: int, held: torch.Tensor) -> None:
        """Datacenter ``dc`` holds ``held`` of ``key`` now: at the start and after each of its
        deposits (not for the presence key, nor after a mean key)."""
        ...

    def applied(
        self,
        dc: int,
        ticket: int,
        weight: float,
        keys: list[int],
        staleness: int,
        recovering: bool,
    ) -> None:
        """``dc``'s deposit (its ``ticket``, ``weight`` and ``keys``) is applied; ``staleness``:
        the deposits of others applied since its previous one; ``recovering``: applied after a
        loss, with the hyperparameters its local server sent then."""
        ...

    def done(self, applied: list[int]) -> None:
        """No deposit pending and a datacenter finished; ``applied``: the deposits applied per
        datacenter (this run)."""
        ...

    def renumber(self, kept: list[int]) -> None:
        """After a recovery: the datacenters ``kept`` (old numbers) are 0 .. len(kept) - 1, in
        that order; the lost ones are gone."""
        ...

    def finish(self, values: dict[int, torch.Tensor]) -> None:
        """Every datacenter finished: this shard's final ``values``, in place, before they are
        published."""
        ...

    def report(self) -> dict:
        """What the policy adds to its server's summary."""
        ...

    def write_log(self, index: int, bounds: dict[int, tuple[int, int]]) -> None:
        """The tier ended on global server ``index`` (its slice ``bounds`` of each key): a
        test hook may write what was applied."""
        ...


class UpNow:
    """The plain local policy: every key of every round goes on to the global tier now."""

    def route(self, rnd: Round) -> Routing:
        return Routing.all_up(rnd)

    def keeps_late(self, rnd: Round) -> bool:
        return False

    def merge(self, key: int, local: torch.Tensor, result: torch.Tensor) -> None:
        local.copy_(result)

    def rejoin(self) -> None:
        pass

    def stopped(self, dc: int) -> None:
        pass


class Assign:
    """The plain global policy: a value round's average becomes the global value."""

    def configure(self, spec: dict) -> None:
        pass

    def average(self, key: int, value: torch.Tensor, average: torch.Tensor) -> None:
        value.copy_(average)

    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        return {}

    def load_state_dict(self, state: dict[int, dict[str, torch.Tensor]]) -> None:
        pass
