"""What the servers ask an algorithm (design.md: "servers ask the algorithm").

The round engine moves a round's keys and sums them; what a round means beyond that is the
algorithm's: which keys of a datacenter round go on to the global tier now, which stay in the
datacenter and which go up overlapped (their result merged at a later round), how a late global
result merges into a datacenter's values, and what a global server does with the average of a
value round. The local server asks a ``LocalPolicy``, the global server a ``GlobalPolicy``; the
algorithms (geompi.sync) implement them beside their worker side. This module defines the
questions and the plain answers (every key up now; the average assigned), and names no
algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from geompi.ps.protocol import Round

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
