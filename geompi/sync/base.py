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

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch

from geompi.ps.policy import Assign, GlobalPolicy, LocalPolicy, UpNow


@dataclass(frozen=True)
class WanPattern:
    """What an algorithm's settings send over one datacenter's WAN link, for the planner
    (geompi.plan): a cycle of ``steps`` training steps holds one global-tier round per entry of
    ``shares``, each carrying that share of the model's values up and the same share back.

    A round waits ``trips`` one-way latencies besides its bytes (geompi.comm.linkmodel's
    hold: a transfer arrives ``latency + bytes / bandwidth`` after it could start, each
    direction queued). ``hidden_steps``: the steps of compute a round's exchange runs behind
    (0: the workers wait for it). ``lan_rounds``: the datacenter rounds of the cycle (each
    moves the whole model from every worker to its local server and back). ``sync_every``:
    steps between two global syncs of the same value (the planner's measure of how far the
    settings stray from synchronous training).
    """

    method: str
    steps: int
    shares: tuple[float, ...]
    trips: int
    hidden_steps: int = 0
    lan_rounds: int = 1
    sync_every: int = 1


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
    # The CLI's --momentum when not given (RunConfig.effective_momentum).
    default_momentum: ClassVar[float] = 0.9
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
        """The algorithm the CLI's flags (a RunConfig) describe: the class's defaults, and the
        value of each flag of its own (``add_arguments``) whose ``dest`` names one of its
        fields."""
        return cls(**cls.flag_settings(cfg))

    @classmethod
    def add_arguments(cls, parser: Any) -> None:  # noqa: B027 - optional
        """Add the command-line flags this class itself defines, with ``parser.add_argument``
        (argparse's signature). The CLI calls it once for each class of ``--sync``'s method
        resolution order that defines it (so do not call ``super()``: the parent's flags are
        already there), and for the built-in algorithms always, so that ``--help`` lists
        them and a flag given with another ``--sync`` is refused in one line. Give each flag
        ``default=None`` (the defaults are the fields'), and a ``dest`` equal to the field
        it sets: ``from_config`` reads it from there. See ``whole_number`` and ``number``
        for argument types whose errors are one line."""

    @classmethod
    def check_config(cls, cfg) -> None:  # noqa: B027 - optional
        """Check the CLI's settings this algorithm reads (a RunConfig), in the words its user
        gave them (``cfg.show(setting, value)``: the flag or variable); one ConfigError line.
        Runs in ``RunConfig.validate`` on every rank before any collective; ``validate()`` of
        the built algorithm runs after it."""

    @classmethod
    def flag_settings(cls, cfg) -> dict:
        """The values of the flags given on the command line that set fields of ``cls``
        (``cfg.algorithm_args``: the flags ``add_arguments`` added outside RunConfig)."""
        names = {f.name for f in fields(cls)}
        given = getattr(cfg, "algorithm_args", None) or {}
        return {k: v for k, v in given.items() if k in names}

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

    def wan_pattern(self, global_servers: int) -> WanPattern:
        """The message pattern of these settings over a datacenter's WAN link, with
        ``global_servers`` shards (geompi.plan asks; an algorithm without one is not planned)."""
        raise NotImplementedError(f"{self.name} gives no WAN pattern to plan with")


def whole_number(flag: str) -> Callable[[str], int]:
    """An argparse ``type`` for a whole-number flag: a bad value is one line naming it."""

    def parse(s: str) -> int:
        try:
            return int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, not {s!r}") from None

    return parse


def number(s: str) -> float:
    """An argparse ``type`` for a real-number flag."""
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {s!r}") from None
