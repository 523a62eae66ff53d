"""The interface every synchronization algorithm implements: ``geompi.sync.Algorithm``.

An algorithm is a small frozen dataclass of its settings. It says what its workers do (the
worker-side engine, geompi.optimizer, reads the class attributes below) and builds the server
each server rank plays (``make_server``, from the generic round engine in geompi.ps). Nothing
else in geompi tests an algorithm's name: the registry (geompi.sync) maps names to classes.

A new algorithm (docs/writing-an-algorithm.md) subclasses this class or one of the built-in
ones, gives itself a ``name``, and is registered with ``geompi.sync.register``. Its settings
are dataclass fields of JSON values: the master worker sends them to the servers (``job``),
which rebuild the algorithm from them (``from_settings``) after importing its class from the
path the job carries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch

from geompi.ps.policy import Assign, GlobalPolicy, LocalPolicy, UpNow


@dataclass(frozen=True)
class Algorithm:
    """What every algorithm provides; the subclasses hold its settings."""

    name: ClassVar[str] = "base"
    # The user's optimizer steps on each worker between synchronizations, which average
    # parameters (HFA), rather than once per step on synchronized gradients.
    local_steps: ClassVar[bool] = False
    # The datacenters do not move together (MixedSync): each stops, checkpoints and ends at
    # its own pace, and the global servers hand out the final model when all are done.
    independent_dcs: ClassVar[bool] = False
    # Where the global servers run the optimizer: a change of the user's hyperparameters (an
    # lr schedule) travels with the next round and the servers update theirs in place.
    follows_hyperparameters: ClassVar[bool] = False
    # What a datacenter lost under on_failure="continue" takes with it (the line says).
    left_with: ClassVar[str] = "their updates since the last global average"  # HFA's

    @property
    def on_servers(self) -> bool:
        """Whether the global servers run the optimizer (the workers then pull parameters)."""
        return False

    def period(self) -> int:
        """Steps from one global model to the next (the CLI trains and checkpoints in these)."""
        return 1

    def validate(self) -> None:  # noqa: B027 - optional check
        """Refuse settings that make no sense, with one line (ConfigError)."""

    def check_survivable(self) -> None:
        """``on_failure="continue"``: refuse, in one line (ConfigError), settings whose state a
        recovery from a lost rank does not rebuild yet."""
        from geompi.errors import ConfigError

        raise ConfigError(
            f"on_failure='continue' is supported with FSA, HFA and MixedSync, not {self.name}: "
            "use one of those, or on_failure='abort' with checkpoints"
        )

    def job(self) -> dict:
        """What the servers are told when the workers start this algorithm (JSON)."""
        cls = type(self)  # the servers import a class from outside geompi from this path
        return {
            "sync": self.name,
            "path": f"{cls.__module__}:{cls.__qualname__}",
            "settings": asdict(self),
        }

    @classmethod
    def from_settings(cls, settings: dict) -> Algorithm:
        """The algorithm of a job (the servers' side of ``job()``), validated."""
        known = {f.name for f in fields(cls)}
        algo = cls(**{k: v for k, v in settings.items() if k in known})
        algo.validate()
        return algo

    @classmethod
    def from_config(cls, cfg) -> Algorithm:
        """The algorithm the CLI's flags (a RunConfig) describe."""
        return cls()

    def server_spec(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """What the global servers need from the user's optimizer, sent in the INIT round."""
        return None

    def cli_optimizer(self, cfg, params) -> tuple[object, dict]:
        """The CLI's workers' optimizer for these flags, and the servers' spec."""
        raise NotImplementedError

    def local_policy(self) -> LocalPolicy:
        """What this algorithm's local servers do with a round (geompi.ps.policy); here every
        key of every round goes on to the global tier now."""
        return UpNow()

    def global_policy(self) -> GlobalPolicy:
        """What this algorithm's global servers do with a value round's average (geompi.ps.policy);
        here it becomes the global value."""
        return Assign()

    def make_server(self, topo, comms, stats, **common):
        """The server this rank plays (a local or a global server) for this algorithm.

        ``common``: on_nonfinite, timeout, slowdown, wan, max_staleness (the job's defaults).
        """
        raise NotImplementedError
