"""RunConfig: every setting of a run, from CLI flags, environment variables and API keywords.

Precedence: an explicit flag or keyword, then ``GEOMPI_*`` variables, then GeoMX's ``MXNET_*``
aliases, then defaults. ``validate()`` is pure and runs on every rank before any collective call,
so an invalid configuration fails identically everywhere and nothing hangs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from numbers import Integral
from typing import Any

from geompi.errors import MAX_LR, MAX_STEPS, ConfigError
from geompi.factory import check_spec, is_spec
from geompi.logs import LEVELS
from geompi.sync.base import number as _float
from geompi.sync.base import whole_number as _int

# How a datacenter sums its workers' pushes (geompi.ps.client.scatters): "funnel" through the
# local server, "scatter" (reduce-scatter among the workers first), or "auto": scatter for big
# rounds of big datacenters that span nodes.
LAN_REDUCE = ("auto", "funnel", "scatter")

SYNCS = ("fsa", "mixed", "hfa")  # --sync's choices: geompi.sync.REGISTRY's names
ON_NONFINITE = ("abort", "skip")
LOG_LEVELS = LEVELS  # --log-level (geompi.logs)

# Bounds past which a setting is a typo, not a run (MAX_STEPS, MAX_LR: geompi.errors, which
# the algorithms' checks read too).
MAX_EPOCHS = 1e6
MAX_SEED = 2**64 - 1  # torch's generators take 64 bits
MIN_COMM_TIMEOUT = 1.0  # seconds; below it every healthy peer looks lost

# The settings geompi.init(...) takes (the job's: the algorithm comes with DistributedOptimizer)
INIT_SETTINGS = (
    "dcs",
    "dc_sizes",
    "global_servers",
    "global_replicas",
    "wan_bandwidth",
    "wan_latency",
    "lan_bandwidth",
    "wan_compression",
    "comm_timeout",
    "on_nonfinite",
    "max_staleness",
    "lan_reduce",
    "on_failure",
)


@dataclass
class RunConfig:
    """The settings of one training run. Field names match the CLI flags (dashes -> underscores)."""

    sync: str = "fsa"
    # topology
    dcs: int | None = None
    dc_sizes: tuple[int, ...] | None = None
    global_servers: int | None = None
    # 2: every global server's shard also kept, exactly, by the next global server
    global_replicas: int = 1
    dc_map: str = "blocks"
    # model, data, optimization
    model: str = "cnn"
    dataset: str = "digits"
    data_dir: str | None = None
    synthetic_size: int = 4096
    batch_size: int = 16
    lr: float | None = None
    optimizer: str = "sgd"
    momentum: float | None = None
    weight_decay: float = 0.0
    nesterov: bool = False
    epochs: float | None = None
    steps: int | None = None
    seed: int = 0
    split_by_class: bool = False
    bucket_mb: float = 1.0
    lan_reduce: str = "auto"
    # HFA
    k1: int = 4  # geompi.HFA's defaults (tests/test_defaults.py holds them equal)
    k2: int = 2
    hfa_weighting: str = "samples"
    hfa_reset_optimizer: bool = False
    outer_optimizer: str = "sgd"
    outer_lr: float = 1.0
    outer_momentum: float | None = None  # sgd: 0, nesterov: 0.9
    hfa_fragments: int = 1
    hfa_overlap: bool = False
    hfa_mix: float = 1.0
    adaptive_sync: bool = False
    k2_min: int = 1
    k2_max: int = 64
    wan_share: float = 0.1
    # MixedSync / DCASGD
    dcasgd_lambda: float = 0.04
    dcasgd_adaptive: bool = False
    max_staleness: int | None = None
    dc_slowdown: dict[int, float] = field(default_factory=dict)
    # WAN emulation and compression (geompi.ps.wan)
    wan_bandwidth: str | None = None
    wan_latency: str | None = None
    lan_bandwidth: str | None = None
    wan_compression: str = "none"
    # output
    eval_every: int = 0
    metrics: str | None = None
    tensorboard: str | None = None
    progress_every: float = 5.0
    log_level: str | None = None  # None: GEOMPI_LOG_LEVEL, else INFO (geompi.logs)
    # checkpoints
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep: int = 3
    resume: str | None = None
    # reliability
    comm_timeout: float | None = None
    on_nonfinite: str = "abort"
    on_failure: str = "abort"  # or "continue": survive lost ranks (ULFM, geompi.comm.faults)
    # the values of flags an algorithm added (Algorithm.add_arguments) outside these fields:
    # its from_config reads them (JSON values, by the flag's dest)
    algorithm_args: dict[str, Any] = field(default_factory=dict)
    # where each value came from, for messages
    sources: dict[str, str] = field(default_factory=dict, repr=False)

    # ---- derived --------------------------------------------------------------------------
    @property
    def effective_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return {"sgd": 0.05, "dcasgd": 0.1}.get(self.optimizer, 1e-3)

    @property
    def effective_momentum(self) -> float:
        """The algorithm's default (``Algorithm.default_momentum``): 0.9, but 0.5 where
        datacenters run apart (MixedSync): asynchrony already adds implicit momentum."""
        if self.momentum is not None:
            return self.momentum
        return float(self.algorithm_class.default_momentum)

    @property
    def algorithm(self):
        """The algorithm ``--sync`` names, with these flags' settings (geompi.sync)."""
        from geompi import sync

        return sync.from_config(self)

    def wan_settings(self):
        """The emulated links and WAN compressor (raises ConfigError on a bad value)."""
        from geompi.ps.wan import WanSettings

        try:
            return WanSettings.parse(
                self.wan_bandwidth, self.wan_latency, self.lan_bandwidth, self.wan_compression
            )
        except ConfigError as e:  # name the variable when the value came from the environment
            msg = str(e)
            for name in ("wan_bandwidth", "wan_latency", "lan_bandwidth", "wan_compression"):
                src = self.sources.get(name, "")
                if src.startswith("GEOMPI_"):
                    msg = msg.replace("--" + name.replace("_", "-"), src)
            raise ConfigError(msg) from None

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("sources")
        d["dc_slowdown"] = {str(k): v for k, v in self.dc_slowdown.items()}
        return json.dumps(d, sort_keys=True)

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> RunConfig:
        """Check every setting that does not need the world or the data; returns self."""
        from geompi.data import DATASETS
        from geompi.models import MODELS, TEST_MODELS
        from geompi.ps.optim import OPTIMIZERS

        self._check_sync()
        for flag, value, names in (
            ("--model", self.model, MODELS),
            ("--dataset", self.dataset, DATASETS),
        ):
            if not isinstance(value, str):
                raise ConfigError(f"{flag} {value!r}: give a name or pkg.module:factory string")
            if is_spec(value):  # imported by the workers that build it (geompi.factory)
                check_spec(flag, value)
            elif value not in names + (TEST_MODELS if flag == "--model" else ()):
                raise ConfigError(
                    f"unknown {flag} {value!r}: choose one of {', '.join(names)}, or pass "
                    "pkg.module:factory"
                )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"unknown --optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}"
            )
        self.require_whole("batch_size", "--batch-size")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr {self.lr}: the learning rate must be a finite number > 0")
        if self.lr is not None and self.lr > MAX_LR:
            raise ConfigError(f"--lr {self.lr:g}: the learning rate must be at most {MAX_LR:g}")
        self._check_bounds()
        self._check_algorithm_flags()  # a flag of another --sync: before that one's checks
        self.algorithm_class.check_config(self)  # its own flags, in their words
        for name in ("effective_momentum", "weight_decay", "dcasgd_lambda"):
            v = getattr(self, name)
            name = name.replace("effective_", "")
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"--{name.replace('_', '-')} {v}: must be a finite number >= 0")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: must be at least 1")
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ConfigError(f"--epochs {self.epochs}: must be a number > 0")
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("--steps and --epochs both given: pass only one of them")
        if self.log_level is not None and self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(
                f"unknown --log-level {self.log_level!r}: choose one of {', '.join(LOG_LEVELS)}"
            )
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"unknown --on-nonfinite {self.on_nonfinite!r}: choose abort or skip")
        self._check_on_failure()
        if self.lan_reduce not in LAN_REDUCE:
            src = self.sources.get("lan_reduce", "--lan-reduce")
            raise ConfigError(
                f"unknown {src} {self.lan_reduce!r}: choose one of {', '.join(LAN_REDUCE)}"
            )
        if self.global_replicas not in (1, 2):
            src = self.sources.get("global_replicas", "--global-replicas")
            raise ConfigError(f"{src} {self.global_replicas!r}: choose 1 or 2")
        if self.dc_map not in ("blocks", "nodes"):
            raise ConfigError(f"unknown --dc-map {self.dc_map!r}: choose blocks or nodes")
        if self.max_staleness is not None and self.max_staleness < 1:
            raise ConfigError(f"--max-staleness {self.max_staleness}: must be at least 1")
        # "not x > 0" also refuses NaN, which compares false with everything
        if not (self.bucket_mb > 0 and math.isfinite(self.bucket_mb)):
            raise ConfigError(f"--bucket-mb {self.bucket_mb}: must be a finite number > 0")
        if self.comm_timeout is not None and not (
            self.comm_timeout > 0 and math.isfinite(self.comm_timeout)
        ):
            raise ConfigError(
                f"--comm-timeout {self.comm_timeout}: must be a finite number of seconds > 0"
            )
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every {self.checkpoint_every}: must be >= 0")
        if self.keep < 1:
            raise ConfigError(f"--keep {self.keep}: keep at least 1 checkpoint")
        if (self.checkpoint_every or self.resume == "latest") and not self.checkpoint_dir:
            flag = "--checkpoint-every" if self.checkpoint_every else "--resume latest"
            raise ConfigError(f"{flag} needs --checkpoint-dir DIR")
        period = self.algorithm.period()
        if self.checkpoint_every % period:
            lo = max(period, self.checkpoint_every // period * period)
            what = "K1" if getattr(self.algorithm, "forces_global", False) else "K1*K2"
            raise ConfigError(
                f"--checkpoint-every {self.checkpoint_every} is not a multiple of {what} = "
                f"{period}: HFA checkpoints at global syncs; use {lo} or {lo + period}"
            )
        for dc, factor in self.dc_slowdown.items():
            if not (math.isfinite(factor) and factor >= 1):
                raise ConfigError(f"--dc-slowdown {dc}:{factor}: the factor must be >= 1")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                f"--tensorboard {self.tensorboard} needs the tensorboard package: "
                "pip install tensorboard (or 'geompi[tensorboard]')"
            )
        if self.nesterov and self.optimizer == "sgd" and self.effective_momentum == 0:
            raise ConfigError(
                "--nesterov with --momentum 0: Nesterov momentum needs a momentum > 0; drop "
                "--nesterov or pass --momentum 0.9"
            )
        self.wan_settings()
        self.algorithm.validate()  # its own settings (an outside algorithm's flags), last
        return self

    def _check_bounds(self) -> None:
        """Counts and sizes that would overflow, or run for ever, refused with their flag."""
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= seed <= MAX_SEED:
            src = self.sources.get("seed", "--seed")
            raise ConfigError(f"{src} {seed!r}: must be a whole number from 0 to 2**64-1")
        self.require_at_most_steps("steps")
        for name in ("k1", "k2"):  # a variable a job's scripts share: checked under any --sync
            if self.sources.get(name, "").startswith(("GEOMPI_", "MXNET_")):
                self.require_whole(name, "--" + name)
                self.require_at_most_steps(name)
        if self.epochs is not None and self.epochs > MAX_EPOCHS:
            raise ConfigError(f"--epochs {self.epochs:g}: must be at most {MAX_EPOCHS:g}")
        t = self.comm_timeout
        if t is not None and math.isfinite(t) and 0 < t < MIN_COMM_TIMEOUT:
            raise ConfigError(
                f"--comm-timeout {t:g}: at least {MIN_COMM_TIMEOUT:g} s (seconds, not "
                "milliseconds): under it every healthy peer would be taken for lost"
            )

    @property
    def family(self) -> str:
        """The built-in algorithm whose flags ``--sync`` takes (``hfa`` for an HFA variant
        named ``pkg.module:Class``)."""
        from geompi import sync

        return sync.family(self.sync)

    def _check_sync(self) -> None:
        """``--sync``: a name, or ``pkg.module:Class`` imported (and registered) here, on every
        rank before any collective, so a bad path is one line at start-up."""
        from geompi import sync

        if not isinstance(self.sync, str):
            raise ConfigError(f"--sync {self.sync!r}: give a name or pkg.module:Class")
        sync.lookup(self.sync)

    def _check_algorithm_flags(self) -> None:
        """Flags given on the command line (or keywords to make_config, not geompi.init's)
        that the chosen --sync does not read: each belongs to the algorithm class whose
        ``add_arguments`` added it, and --sync's class must be that one or derive from it."""
        chosen = self.algorithm_class
        for name, owner in flag_owners(self.sync).items():
            src = self.sources.get(name, "")
            given = src.startswith("--") or (src == name and name not in INIT_SETTINGS)
            if given and owner not in chosen.__mro__:
                raise ConfigError(
                    f"{src} is for --sync {owner.name}, not --sync {self.sync}: drop {src} or "
                    f"pass --sync {owner.name}"
                )

    def check_topology(self, num_dcs: int) -> None:
        """The settings that name datacenters, against the topology's ``num_dcs``."""
        bad = sorted(dc for dc in self.dc_slowdown if not 0 <= dc < num_dcs)
        if bad:
            raise ConfigError(
                f"--dc-slowdown {bad[0]}:{self.dc_slowdown[bad[0]]:g}: there is no datacenter "
                f"{bad[0]}; this job has {num_dcs}, numbered 0 to {num_dcs - 1}"
            )

    def _check_on_failure(self) -> None:
        """``--on-failure continue``: under a ULFM launch, without the settings whose state a
        recovery does not rebuild yet (an algorithm's own: its ``check_survivable``)."""
        from geompi.comm.faults import ON_FAILURE, check_launch

        if self.on_failure not in ON_FAILURE:
            raise ConfigError(
                f"unknown --on-failure {self.on_failure!r}: choose {' or '.join(ON_FAILURE)}"
            )
        if self.on_failure != "continue":
            return
        refused = [
            ("--comm-timeout", self.comm_timeout is not None, "ULFM detects lost ranks itself"),
            ("--wan-compression", self.wan_settings().compression != "none",
             "not supported together yet"),
            ("--hfa-fragments/--hfa-overlap", self.hfa_fragments > 1 or self.hfa_overlap,
             "not supported together yet"),
            ("--adaptive-sync", self.adaptive_sync, "not supported together yet"),
            ("--lan-reduce scatter", self.lan_reduce == "scatter",
             "a datacenter sums through its local server under continue"),
        ]  # fmt: skip
        for flag, given, why in refused:
            if given:
                raise ConfigError(f"--on-failure continue with {flag}: {why}; drop {flag}")
        check_launch()

    def require_whole(self, name: str, flag: str) -> None:
        """The setting ``name`` is a whole number >= 1, or one line naming where it came from."""
        v = getattr(self, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            src = self.sources.get(name, flag)
            raise ConfigError(f"{src} {v!r}: must be a whole number >= 1")

    def require_at_most_steps(self, name: str) -> None:
        """A count of steps (``steps``, ``k1``, ...) no larger than MAX_STEPS."""
        v = getattr(self, name)
        if isinstance(v, int) and v > MAX_STEPS:
            src = self.sources.get(name, "--" + name.replace("_", "-"))
            raise ConfigError(f"{src} {v}: must be at most {MAX_STEPS:.0e} steps")

    def show(self, setting: str, value=None, flag: str | None = None) -> str:
        """A setting as its user gave it (``--k2-max 4``, ``GEOMPI_HFA_K2 4``); without a value,
        or for a switch, its name alone."""
        name = self.sources.get(setting, flag or "--" + setting.replace("_", "-"))
        return name if value is None or value is True else f"{name} {value}"

    @property
    def algorithm_class(self):
        """``--sync``'s class (geompi.sync's registry; imported if a path)."""
        from geompi import sync

        return sync.lookup(self.sync)

    @property
    def starting_k2(self) -> int:
        """HFA's K2 at the start: --k2; with --adaptive-sync and no --k2, its default clamped
        into [--k2-min, --k2-max] (as geompi.HFA(adaptive=True) does)."""
        if self.adaptive_sync and "k2" not in self.sources:
            return min(max(self.k2, self.k2_min), self.k2_max)
        return self.k2


# ---- parsing ------------------------------------------------------------------------------
def parse_sizes(s: str, what: str = "--dc-sizes") -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} {s!r}: give comma-separated whole numbers, e.g. 5,5,5") from None


def parse_slowdown(s: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for part in s.split(","):
        if not part.strip():
            continue
        try:
            dc, factor = part.split(":")
            out[int(dc)] = float(factor)
        except ValueError:
            raise ConfigError(
                f"--dc-slowdown {s!r}: give DC:FACTOR pairs, e.g. 1:3 or 1:3,2:1.5"
            ) from None
    return out


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, reported once) instead of exiting."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.flag_owners: dict[str, type] = {}  # dest -> the algorithm class that added it
        self.switches: dict[str, tuple[str, str]] = {}  # dest -> (a switch flag, its --sync)

    def error(self, message: str):
        raise ConfigError(f"{message}: see python -m geompi.train --help")


class _AlgorithmFlags:
    """What an algorithm's ``add_arguments`` is handed: argparse's ``add_argument`` on the
    algorithm's own help group, recording which class each flag belongs to."""

    def __init__(self, group, owner: type, owners: dict[str, type]) -> None:
        self._group, self._owner, self._owners = group, owner, owners

    def add_argument(self, *args, **kwargs):
        try:
            action = self._group.add_argument(*args, **kwargs)
        except (argparse.ArgumentError, ValueError, TypeError) as e:
            raise ConfigError(
                f"--sync {self._owner.name}: its flag {args[0] if args else '?'} cannot be "
                f"added ({e}): rename it in {self._owner.__qualname__}.add_arguments"
            ) from None
        self._owners[action.dest] = self._owner
        return action


def _algorithm_classes(sync: str | None) -> list[type]:
    """The classes whose flags the parser carries: the built-in algorithms, then ``sync``'s
    class and its parents (base first) when it names another one."""
    from geompi import sync as registry
    from geompi.sync.base import Algorithm

    out: list[type] = list(registry.BUILTIN)
    if sync and sync.lower() not in {c.name for c in registry.BUILTIN}:
        try:
            cls = registry.lookup(sync)
        except ConfigError:  # validate() (or an unknown flag) says it, in its turn
            cls = Algorithm
        out += [c for c in reversed(cls.__mro__) if issubclass(c, Algorithm) and c not in out]
    return [c for c in out if c is not Algorithm and "add_arguments" in vars(c)]


def _split_builtin(classes: list[type]) -> tuple[list[type], list[type]]:
    from geompi import sync as registry

    return [c for c in classes if c in registry.BUILTIN], [
        c for c in classes if c not in registry.BUILTIN
    ]


def _add_algorithm_flags(p: _Parser, classes: list[type]) -> None:
    """Each class's flags in its own help group (outside ones after all of geompi's, so a
    name geompi has is refused as taken, whatever its group)."""
    for cls in classes:
        group = p.add_argument_group(f"--sync {cls.name}")
        cls.add_arguments(_AlgorithmFlags(group, cls, p.flag_owners))


def flag_owners(sync: str | None = None) -> dict[str, type]:
    """Each algorithm flag's ``dest`` and the class that added it (built-in ones, and
    ``sync``'s)."""
    owners: dict[str, type] = {}
    recorder = _Parser(add_help=False)
    for cls in _algorithm_classes(sync):
        cls.add_arguments(_AlgorithmFlags(recorder, cls, owners))
    return owners


def _sync_in(argv: Sequence[str]) -> str | None:
    """``--sync``'s value in ``argv``, read before the full parse (whose flags depend on it)."""
    pre = _Parser(add_help=False)
    pre.add_argument("--sync")
    ns, _ = pre.parse_known_args(list(argv))
    return ns.sync


def _one_of(names: Sequence[str]) -> str:
    return "{" + ",".join(names) + "}"


def build_parser(sync: str | None = None) -> argparse.ArgumentParser:
    """The CLI's flags. Every help line names the choices and the default (flags default to
    None here, so that an explicit flag can be told from a default; RunConfig holds those).
    The algorithms add their own (``Algorithm.add_arguments``): the built-in ones always, and
    ``sync``'s (a ``pkg.module:Class``, imported here) when it names one from outside."""
    d = RunConfig()
    p = _Parser(
        prog="python -m geompi.train",
        description="Train a PyTorch model across datacenters over MPI "
        "(run under mpirun, e.g. mpirun -n 16 python -m geompi.train).",
        epilog="GEOMPI_* environment variables (GEOMPI_SYNC, GEOMPI_DCS, GEOMPI_HFA_K1, ...) "
        "set the same values; a flag wins. GEOMPI_THREADS sets torch threads per rank.",
    )
    _algorithm_flags(p, d)
    builtin, outside = _split_builtin(_algorithm_classes(sync))
    _add_algorithm_flags(p, builtin)
    _wan_flags(p, d)
    _topology_flags(p, d)
    _model_flags(p, d)
    _output_flags(p, d)
    _add_algorithm_flags(p, outside)
    return p


def _algorithm_flags(p: _Parser, d: RunConfig) -> None:
    """The algorithm's flags that every --sync shares (each algorithm adds its own)."""
    a = p.add_argument_group("algorithm")
    a.add_argument(
        "--sync",
        metavar=_one_of(SYNCS) + "|MODULE:CLASS",
        help=f"algorithm, or pkg.module:Class for one of your own (default {d.sync})",
    )
    from geompi import sync as registry

    for cls, flag in registry.declared("switch_flag"):  # MixedSync's --mixed-sync
        try:
            action = a.add_argument(
                flag, action="store_true", help=f"GeoMX alias for --sync {cls.name}"
            )
        except (argparse.ArgumentError, ValueError, TypeError) as e:
            raise ConfigError(
                f"{cls.__qualname__}.switch_flag {flag!r} cannot be added ({e}): rename it"
            ) from None
        p.switches[action.dest] = (flag, cls.name)
    a.add_argument("--dcasgd", action="store_true", help="GeoMX alias for --optimizer dcasgd")
    a.add_argument(
        "--dcasgd-lambda", type=_float, help=f"DCASGD lambda (default {d.dcasgd_lambda:g})"
    )
    a.add_argument(
        "--dcasgd-adaptive",
        action="store_true",
        default=None,
        help="DCASGD: adaptive lambda (default off)",
    )
    a.add_argument(
        "--dc-slowdown",
        metavar="DC:FACTOR[,...]",
        help="emulation: e.g. 1:3 makes DC 1 3x slower (default none)",
    )


def _wan_flags(p: _Parser, d: RunConfig) -> None:
    """The emulated links and the WAN codec."""
    w = p.add_argument_group("WAN emulation and compression (the global tier)")
    w.add_argument(
        "--wan-bandwidth", help="emulate each datacenter's WAN link, e.g. 100Mbit (default off)"
    )
    w.add_argument("--wan-latency", help="one-way WAN latency to emulate, e.g. 25ms (default off)")
    w.add_argument(
        "--lan-bandwidth", help="emulate each local server's LAN port, e.g. 10Gbit (default off)"
    )
    w.add_argument(
        "--wan-compression",
        metavar="{none,fp16,bf16,int8,int4,topk:F,topk:F+int8}",
        help=f"compress the global tier (default {d.wan_compression})",
    )


def _topology_flags(p: _Parser, d: RunConfig) -> None:
    """Datacenters, servers, placement."""
    t = p.add_argument_group("topology")
    t.add_argument(
        "--dcs", type=_int("--dcs"), help="number of datacenters (default: from the world size)"
    )
    t.add_argument(
        "--dc-sizes",
        metavar="N,N,...",
        help="ranks per datacenter incl. its local server, e.g. 5,5,5 (default: even split)",
    )
    t.add_argument(
        "--global-servers", type=_int("--global-servers"), help="global servers (default 1)"
    )
    t.add_argument(
        "--global-replicas",
        type=_int("--global-replicas"),
        help="copies of each global server's shard: 2 keeps an exact copy on the next global "
        "server (needs --global-servers 2 or more; default 1)",
    )
    t.add_argument(
        "--dc-map",
        metavar="{blocks,nodes}",
        help=f"nodes: one datacenter per node (default {d.dc_map})",
    )
    t.add_argument(
        "--lan-reduce",
        metavar=_one_of(LAN_REDUCE),
        help="how a datacenter sums its workers' pushes: scatter = reduce-scatter among the "
        "workers, so the local server takes in one copy of the model, not one per worker; "
        "auto = scatter from 4 workers and 1 MiB per round where a datacenter spans nodes "
        f"(default {d.lan_reduce})",
    )


def _model_flags(p: _Parser, d: RunConfig) -> None:
    """Model, data and optimizer."""
    from geompi.data import DATASETS
    from geompi.models import MODELS
    from geompi.ps.optim import OPTIMIZERS

    m = p.add_argument_group("model and data")
    m.add_argument(
        "--model",
        metavar=_one_of(MODELS) + "|MODULE:FACTORY",
        help="a built-in, or your own: FACTORY(input_shape, num_classes) in MODULE returns a "
        "torch.nn.Module; MODULE must be importable on every worker, e.g. on PYTHONPATH "
        f"(default {d.model})",
    )
    m.add_argument(
        "--dataset",
        metavar=_one_of(DATASETS) + "|MODULE:FACTORY",
        help="a built-in, or your own: FACTORY(data_dir) returns (x_train, y_train, x_test, "
        f"y_test[, num_classes]) tensors or arrays (default {d.dataset})",
    )
    m.add_argument(
        "--data-dir",
        help="IDX files (mnist, fashion-mnist) or an HDF5 file (hdf5), which need it; passed "
        "to a --dataset factory (default none)",
    )
    m.add_argument(
        "--synthetic-size",
        type=_int("--synthetic-size"),
        help=f"samples of --dataset synthetic (default {d.synthetic_size})",
    )
    m.add_argument(
        "--batch-size", type=_int("--batch-size"), help=f"per worker (default {d.batch_size})"
    )
    m.add_argument(
        "--lr",
        type=_float,
        help="learning rate (default depends on --optimizer: sgd 0.05, dcasgd 0.1, adam and "
        "adamw 0.001)",
    )
    m.add_argument("--optimizer", metavar=_one_of(OPTIMIZERS), help=f"(default {d.optimizer})")
    m.add_argument(
        "--momentum",
        type=_float,
        help="SGD momentum (default depends on --sync: 0.9, but 0.5 for --sync mixed)",
    )
    m.add_argument("--weight-decay", type=_float, help=f"(default {d.weight_decay:g})")
    m.add_argument("--nesterov", action="store_true", default=None, help="(default off)")
    m.add_argument(
        "--epochs", type=_float, help="epochs to train (default 30 unless --steps is given)"
    )
    m.add_argument(
        "--steps",
        type=_int("--steps"),
        help="steps to train instead of --epochs (default none; HFA rounds up to K1*K2, or "
        "to K1 with --adaptive-sync or streaming)",
    )
    m.add_argument("--seed", type=_int("--seed"), help=f"(default {d.seed})")
    m.add_argument(
        "--split-by-class",
        action="store_true",
        default=None,
        help="label-skewed (non-IID) shards (default off)",
    )
    m.add_argument(
        "--bucket-mb", type=_float, help=f"gradient bucket size in MB (default {d.bucket_mb:g})"
    )


def _output_flags(p: _Parser, d: RunConfig) -> None:
    """Output, checkpoints and reliability."""
    o = p.add_argument_group("output, checkpoints, reliability")
    o.add_argument(
        "--eval-every",
        type=_int("--eval-every"),
        help="steps between test evaluations (default 0: at the end only)",
    )
    o.add_argument("--metrics", help="JSON-lines metrics file written by rank 0 (default none)")
    o.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write the metrics as TensorBoard scalars to DIR (needs the tensorboard "
        "package; default none)",
    )
    o.add_argument(
        "--progress-every",
        type=_float,
        help=f"seconds between progress lines (default {d.progress_every:g})",
    )
    o.add_argument(
        "--log-level",
        metavar=_one_of(LOG_LEVELS),
        help="the least severe messages shown, of the geompi logger (default: "
        "GEOMPI_LOG_LEVEL, else INFO; ERROR still shows every error)",
    )
    o.add_argument("--checkpoint-dir", help="where checkpoints go (default none)")
    o.add_argument(
        "--checkpoint-every",
        type=_int("--checkpoint-every"),
        help="steps between checkpoints (default 0: at the end only, with --checkpoint-dir)",
    )
    o.add_argument("--keep", type=_int("--keep"), help=f"checkpoints to keep (default {d.keep})")
    o.add_argument(
        "--resume",
        metavar="PATH|latest",
        help="a checkpoint file, or 'latest' in --checkpoint-dir (default: start fresh)",
    )
    o.add_argument(
        "--comm-timeout",
        type=_float,
        help="seconds a server waits for a peer (default: no watchdog)",
    )
    o.add_argument(
        "--on-nonfinite",
        metavar=_one_of(ON_NONFINITE),
        help=f"on a NaN/Inf gradient (default {d.on_nonfinite})",
    )
    o.add_argument(
        "--on-failure",
        metavar="abort|continue",
        help="on a lost rank: stop the job, or (under mpirun --with-ft ulfm) go on without it "
        f"(default {d.on_failure})",
    )


_ENV = {
    "sync": "GEOMPI_SYNC",
    "dcs": "GEOMPI_DCS",
    "dc_sizes": "GEOMPI_DC_SIZES",
    "global_servers": "GEOMPI_GLOBAL_SERVERS",
    "global_replicas": "GEOMPI_GLOBAL_REPLICAS",
    "wan_bandwidth": "GEOMPI_WAN_BANDWIDTH",
    "wan_latency": "GEOMPI_WAN_LATENCY",
    "lan_bandwidth": "GEOMPI_LAN_BANDWIDTH",
    "wan_compression": "GEOMPI_WAN_COMPRESSION",
    "lan_reduce": "GEOMPI_LAN_REDUCE",
}
_ENV_STR = (
    "sync", "wan_bandwidth", "wan_latency", "lan_bandwidth", "wan_compression", "lan_reduce",
)  # fmt: skip
# An algorithm's own variables (HFA's K1 and K2, GeoMX's switch to HFA) are its to declare:
# Algorithm.variables and switch_variable, read here from every registered algorithm.
# Variables that look like settings but are not (the docs list those that are): refused,
# so a run does not go ahead without the setting its user believes is on.
_NOT_READ = {
    "GEOMPI_MAX_STALENESS": "pass --max-staleness N (or geompi.init(max_staleness=N))",
}


def _env_int(env: Mapping[str, str], var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ConfigError(f"{var}={env[var]!r}: must be a whole number") from None


def _env_value(env: Mapping[str, str], var: str, setting: str):
    """An algorithm's variable as its RunConfig setting's type (that of the default)."""
    default = RunConfig.__dataclass_fields__[setting].default
    if isinstance(default, int) and not isinstance(default, bool):
        return _env_int(env, var)
    if isinstance(default, float):
        try:
            return float(env[var])
        except ValueError:
            raise ConfigError(f"{var}={env[var]!r}: must be a number") from None
    return env[var].strip()


def from_env(env: Mapping[str, str] | None = None) -> dict:
    """Settings from ``GEOMPI_*`` and GeoMX's ``MXNET_KVSTORE_*`` variables (each algorithm's
    own: ``Algorithm.variables`` and ``switch_variable``)."""
    from geompi import sync as registry

    env = os.environ if env is None else env
    out: dict = {}
    sources: dict[str, str] = {}
    for var, use in _NOT_READ.items():
        if env.get(var, "").strip():
            raise ConfigError(f"{var} is not read by geompi: unset it and {use}")
    for name, var in _ENV.items():
        if env.get(var, "").strip() == "":
            continue
        if name in _ENV_STR:
            out[name] = env[var].strip()
        elif name == "dc_sizes":
            out[name] = parse_sizes(env[var], var)
        else:
            out[name] = _env_int(env, var)
        sources[name] = var
    for _, variables in registry.declared("variables"):
        for name, spellings in variables.items():
            for var in spellings:  # geompi's first, then GeoMX's: two given must agree
                if env.get(var, "").strip() == "":
                    continue
                v = _env_value(env, var, name)
                if name in out and out[name] != v:
                    raise ConfigError(
                        f"{sources[name]}={out[name]} and {var}={v} disagree: unset one of them"
                    )
                out[name] = v
                sources.setdefault(name, var)
    for cls, var in registry.declared("switch_variable"):
        switch = env.get(var, "").strip()
        if switch in ("", "0"):
            continue
        if switch != "1":
            raise ConfigError(f"{var}={switch!r}: must be 0 or 1")
        if out.get("sync", cls.name) != cls.name:
            raise ConfigError(f"{sources['sync']}={out['sync']} and {var}=1 disagree: unset one")
        out["sync"] = cls.name
        sources["sync"] = var
    out["sources"] = sources
    return out


def make_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, **kwargs
) -> RunConfig:
    """Build a RunConfig from CLI args (if given), the environment and keyword arguments."""
    values = from_env(env)
    sources = values.pop("sources")
    if argv is not None:
        chosen = _sync_in(argv) or values.get("sync")
        parser = build_parser(chosen)
        ns, rest = parser.parse_known_args(list(argv))
        if rest:  # a --sync that does not import explains its flags' absence first
            if chosen:
                from geompi import sync as registry

                registry.lookup(chosen)
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        cli = {k: v for k, v in vars(ns).items() if v is not None and v is not False}
        own = {f.name for f in fields(RunConfig)}
        extra = {k: cli.pop(k) for k in list(cli) if k in parser.flag_owners and k not in own}
        if extra:
            values["algorithm_args"] = extra
            sources.update({k: "--" + k.replace("_", "-") for k in extra})
        for dest, (flag, chosen_name) in parser.switches.items():  # GeoMX's --mixed-sync
            if cli.pop(dest, False):
                if cli.get("sync", chosen_name) != chosen_name:
                    raise ConfigError(f"{flag} conflicts with --sync {cli['sync']}: drop one")
                cli["sync"] = chosen_name
        if cli.pop("dcasgd", False):
            if cli.get("optimizer", "dcasgd") != "dcasgd":
                raise ConfigError(
                    f"--dcasgd conflicts with --optimizer {cli['optimizer']}: drop one"
                )
            cli["optimizer"] = "dcasgd"
        if "dc_sizes" in cli:
            cli["dc_sizes"] = parse_sizes(cli["dc_sizes"])
        if "dc_slowdown" in cli:
            cli["dc_slowdown"] = parse_slowdown(cli["dc_slowdown"])
        for k in cli:
            sources[k] = "--" + k.replace("_", "-")
        values.update(cli)
    for k, v in kwargs.items():
        if v is not None:
            values[k] = tuple(v) if k == "dc_sizes" else v
            sources[k] = k
    known = {f.name for f in fields(RunConfig)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(sorted(unknown))}")
    cfg = RunConfig(**values)
    cfg.sources = sources
    return cfg
