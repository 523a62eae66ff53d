"""The interface every synchronization algorithm implements: ``geompi.sync.Algorithm``.

An algorithm is a small frozen dataclass of its settings. It says what its workers do around
backward and ``step()`` (``worker``: a :class:`WorkerSide` that the algorithm-free worker
engine, geompi.engine, calls) and builds the server each server rank plays (``make_server``,
from the generic round engine in geompi.ps). Nothing else in geompi tests an algorithm's name:
the registry (geompi.sync) maps names to classes.

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
from typing import Any, ClassVar, NoReturn, Protocol

import torch

from geompi.ps.policy import Assign, GlobalPolicy, LocalPolicy, UpNow
from geompi.ps.protocol import FLAG_SUM, Op


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


class Engine(Protocol):
    """What a worker side uses of the worker engine (geompi.engine.Synchronizer): its session,
    model and optimizer, the flat buckets and buffers of a round, the client to the local
    server, and a few of its mechanisms. The engine knows no algorithm; the side decides."""

    s: Any  # the session: rank, topology, communicators, configuration
    algo: Algorithm
    opt: Any  # the user's optimizer (or the CLI's stand-in)
    params: list[torch.Tensor]
    buckets: Any  # geompi.comm.buckets.Buckets
    client: Any  # geompi.ps.client.PSClient, to this datacenter's local server
    recovery: Any  # geompi.recovery.Recovery
    master: bool
    dc_first: bool  # this datacenter's first worker
    max_grad_norm: float | None
    lossy_wan: bool
    lan_flags: int
    want_stats: bool
    server_counts: Any
    aux_len: int
    aux_send: torch.Tensor
    aux_recv: torch.Tensor
    present_g: torch.Tensor
    present_out: torch.Tensor
    layout_pos: dict[int, int]
    global_syncs: int
    skipped: int
    synced: bool
    recovers: bool  # step() survives a lost rank itself (the API), else its caller (the CLI)
    rounds: Any  # geompi.gradients.GradientRounds: the gradient round under way

    @property
    def presence_key(self) -> int: ...

    def keys(self, presence: bool = True) -> list[tuple[int, int]]: ...
    def layout(self) -> list: ...
    def pack_buffers(self, out: torch.Tensor, scale: float) -> None: ...
    def unpack_buffers(self, src: torch.Tensor, scale: float) -> None: ...
    def sample_weight(self) -> float: ...
    def reset_samples(self) -> None: ...
    def synchronize(self) -> None: ...
    def survive(self, err: BaseException, step: int, redo: bool = True) -> int: ...
    def with_grad(self) -> list[torch.Tensor]: ...
    def stop(self, err: Exception) -> NoReturn: ...


class WorkerSide:
    """An algorithm's worker side: what happens around backward and ``step()`` (gradient
    rounds or parameter averages, the global cadence), the counters it saves and restores, and
    how it ends. The engine calls these; the defaults are those of a side whose every round is
    a gradient round reaching the global servers (geompi.sync.fsa's)."""

    # Backward pushes gradient buckets to a round that begins with backward (FSA, MixedSync);
    # else the engine only counts samples and passes, and the side averages parameters.
    pushes_gradients: bool = True
    # The global servers run the optimizer: the workers pull parameters, with the presence key.
    servers_step: bool = False
    fragments: int = 1  # keys cut into equal fragments (streaming HFA)
    steps = 0  # local steps taken (HFA's counter; the steps its rounds carry)
    steps_at_global = 0  # the step of the last global average
    average_due = False  # an average is due before the next forward
    cadence: Any = None  # HFA's adaptive K2 (geompi.sync.hfa.Cadence), or None

    def __init__(self, engine: Engine) -> None:
        self.e = engine

    def built(self) -> None:
        """The engine's buckets and buffers exist now."""

    def aux_len(self, nparams: int, nbuf: int) -> int:
        """The extra key's length after the buckets (0: none)."""
        return nbuf

    def buffer_slice(self, t: torch.Tensor) -> torch.Tensor:
        """Where the float buffers sit in the extra key."""
        return t

    def sends_spec(self) -> bool:
        """Whether this worker tells the servers of a change of the optimizer's hyperparameters."""
        return False

    def init_spec(self) -> dict:
        """What joins the servers' spec in the INIT round."""
        return {}

    def begin(self) -> None:
        """Training starts (after the INIT round)."""

    @property
    def holds_server_state(self) -> bool:
        """Whether the global servers hold optimizer state (a checkpoint's)."""
        return self.servers_step

    @property
    def optimizer_state_on_servers(self) -> bool:
        """Whether the global servers hold the user's optimizer's own state (they step it): a
        checkpoint takes that state from them, and the workers keep none."""
        return self.servers_step

    @property
    def takes_scaler_state(self) -> bool:
        """Whether ``step()`` takes a GradScaler's state (torch's ``_step_supports_amp_scaling``)
        instead of the scaler unscaling the gradients before it: where the gradients were
        applied before ``step()`` (by the global servers, during backward), so that
        ``check_scaler`` refuses it."""
        return self.servers_step

    def state(self) -> dict:
        """The counters a checkpoint keeps, besides the engine's ``global_syncs``."""
        return {}

    def load_state(self, state: dict) -> None:
        """Back at a checkpoint's counters."""

    # ---- around backward ------------------------------------------------------------------
    def force_global(self) -> None:
        """``force_global_average()``, allowed by ``Algorithm.check_force_global``."""

    def before_forward(self) -> None:
        """A training forward begins."""

    def backward_counts(self) -> None:
        """The first gradient of a backward pass that completes a step (no_sync and
        ``backward_passes_per_step`` allowing)."""

    def backward_ended(self) -> None:
        """Backward ended (after the round, if any, completed)."""

    def synchronize(self) -> None:
        """Complete this step's exchange now (``opt.synchronize()``)."""

    def round_flags(self) -> int:
        """A gradient round's header flags (besides the LAN's and statistics')."""
        return 0

    def push_rest(self, reqs) -> None:
        """A gradient round, after the buckets: what else this worker pushes."""

    def pull_results(self, reqs) -> None:
        """A gradient round: where its results land."""

    def after_round(self) -> None:
        """A gradient round completed: its results into the model."""

    def pulled(self) -> list[torch.Tensor]:
        """Where a gradient round's results land (kept for a recovery)."""
        return []

    # ---- the step and the end ---------------------------------------------------------------
    def check_scaler(self) -> None:
        """Refuse a GradScaler's state handed to step(), where it cannot be honoured."""

    def step(self, local_step):
        """``opt.step()``: ``local_step()`` runs the user's optimizer on this worker."""
        raise NotImplementedError

    def end_on_global(self, streaming: bool = False) -> None:
        """Collective over the workers: every worker on the global servers' model."""

    def at_global_model(self) -> bool:
        """Whether every worker holds the global servers' model now."""
        return True

    def before_close(self) -> None:
        """close(), before the servers are released."""
        self.end_on_global()

    def end(self) -> None:
        """Release the servers (close())."""
        self.e.client.stop()

    def report(self) -> dict:
        """What the job's report adds."""
        return {}

    def check_restore(self, what: str, new_model: bool) -> None:
        """Refuse (``engine.stop``) a restore of the servers' state now; ``new_model``: every
        worker has just loaded the same model."""

    # ---- after a lost rank (geompi.recovery) ------------------------------------------------
    def peers(self, comms):
        """The workers that go through the same rounds as this one."""
        return comms.all_workers

    def last_done(self, done: int) -> int:
        """The last round a surviving worker completed (``done``: the job's, as recovered)."""
        return done

    def step_label(self, at: int) -> int | str:
        """How the line about a survived loss names the step."""
        return at

    def survive(self, recovery, step: int, redo: bool) -> int:
        """Every survivor after a loss: recover and go on; returns the agreed step."""
        recovery.recover()
        return step

    def rejoined(self) -> None:
        """After a recovery, over the rebuilt communicators."""

    def trained_by_lost(self, samples: int, step: int, at: int, last_batch: int) -> int:
        """The samples each worker lost at step ``at`` had trained, as this one counts them
        (``samples`` after ``step`` steps of ``last_batch``): up to the step before the loss,
        whose round the loss cut off."""
        return samples - (step - (at - 1)) * last_batch

    # ---- a training loop's stops, checkpoints and end (the CLI's; geompi.train) -------------
    # Where the model a stop or a checkpoint keeps comes from: every round here is global, so
    # a worker holds the global model after every step, and the workers agree on a stop after
    # each one. A side whose global rounds are rarer (HFA's) answers otherwise.
    # A stop between two global rounds goes back to the last one (the global servers still
    # hold its model), rather than adding a round to reach the global model.
    rewinds_to_global: bool = False

    @property
    def final_model_at_close(self) -> bool:
        """The final model exists only once close() has run (the algorithm's
        ``final_model_at_close``: MixedSync's, from the global servers): the last checkpoint
        is written after it."""
        return self.e.algo.final_model_at_close

    def stop_in_round(self) -> bool | None:
        """How the workers agree on a stop: None after every step (a collective of its own),
        else whether the coming step's own round carries the agreement (so it costs no wait,
        and a stop is seen only there)."""
        return None

    def make_global_next(self) -> bool:
        """A checkpoint or the end follows the coming step: make its round global (every
        key), where global rounds do not fall on fixed steps. Returns whether one was made."""
        return False

    def stopped_early(self, made_global: bool) -> None:
        """The loop stopped before its last step (a signal), with no point to go back to:
        every worker onto the global model, for the checkpoint (``made_global``: the last
        step's round already was a global one)."""


@dataclass(frozen=True)
class Algorithm:
    """What every algorithm provides; the subclasses hold its settings.

    A new algorithm implements ``worker`` and ``make_server`` (or inherits a built-in one's);
    everything else has a default here. The rest of geompi never tests which algorithm runs:
    it asks questions named after a behaviour, answered by the class attributes and methods
    below and by its :class:`WorkerSide` (``optimizer_state_per_worker`` here,
    ``optimizer_state_on_servers`` and ``takes_scaler_state`` there: where the optimizer's
    state lives, for geompi.state's checkpoints, and how a GradScaler meets ``step()``), and
    GeoMX's spellings (``switch_variable``, ``switch_flag``, ``variables``, ``kvstore_type``,
    ``kvstore_takes``, ``kvstore_push``) say how geompi.config and geompi.kv reach it.
    """

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
    # GeoMX's spellings (geompi.config, geompi.kv), each read from the class itself, as
    # ``name`` (a subclass does not inherit them; ``geompi.sync.declared``):
    # an environment variable that, set to 1, chooses this algorithm as GEOMPI_SYNC=name does
    # (HFA: MXNET_KVSTORE_USE_HFA), and a command-line switch for --sync name (MixedSync:
    # --mixed-sync);
    switch_variable: ClassVar[str | None] = None
    switch_flag: ClassVar[str | None] = None
    # the environment variables of the RunConfig settings it reads: each setting's variables,
    # geompi's first, then GeoMX's (a flag wins; two variables given must agree);
    variables: ClassVar[dict[str, tuple[str, ...]]] = {}
    # the KVStore type (geompi.kv.create) that trains with it, and the types it takes over
    # when the environment chooses it (HFA: dist_sync under MXNET_KVSTORE_USE_HFA=1; another
    # type, owned by another algorithm, is then refused).
    kvstore_type: ClassVar[str | None] = None
    kvstore_takes: ClassVar[tuple[str, ...]] = ()
    # The STOP round brings every worker the final global model (MixedSync's, whose datacenters
    # end apart): a KVStore's close() pulls every key in it, the worker side's too.
    final_model_at_close: ClassVar[bool] = False

    # Its checkpoint sections: where a checkpoint keeps each worker's own optimizer state, a
    # path under /algorithm whose group holds ``worker<i>/<state>/<param>`` (HFA's
    # "hfa/local"), for an algorithm whose workers keep the optimizer's state; None where the
    # global servers hold it (under /optimizer, named by /optimizer@name). A class with
    # local_steps that names none gets "<name>/local".
    worker_state_section: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.local_steps and cls.worker_state_section is None:
            cls.worker_state_section = f"{cls.name}/local"

    @property
    def on_servers(self) -> bool:
        """Whether the global servers run the optimizer (the workers then pull parameters)."""
        return False

    @property
    def optimizer_state_per_worker(self) -> bool:
        """Whether each worker's optimizer holds a state of its own (it steps on its own
        gradients between averages): a checkpoint keeps every worker's, and each worker
        resumes from its own."""
        return self.local_steps

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

    def check_compression(self, compression: str) -> None:  # noqa: B027 - optional check
        """Refuse, in one line (ConfigError), the job's WAN codec ("none" without one) where
        this algorithm's workers cannot honour it."""

    def check_clipping(self, max_grad_norm: float | None) -> None:  # noqa: B027
        """Refuse, in one line (ConfigError), ``max_grad_norm`` where it has no meaning."""

    def check_replication(self) -> None:  # noqa: B027 - optional check
        """``global_replicas=2``: refuse, in one line (ConfigError), where this algorithm's
        global servers do not keep their mirrors (the synchronous tier does)."""

    def check_force_global(self) -> None:
        """``force_global_average()``: refused (ConfigError) where every round is global."""
        from geompi.errors import ConfigError

        raise ConfigError(
            f"force_global_average() is for HFA: under {self.name} every round already "
            "reaches the global servers"
        )

    def worker(self, engine: Engine) -> WorkerSide:
        """This algorithm's worker side around ``engine`` (built once per DistributedOptimizer
        or CLI run, before the engine's buckets: see :class:`WorkerSide`)."""
        raise NotImplementedError(
            f"{type(self).__qualname__} has no worker side: subclass FSA, HFA or MixedSync, "
            "or implement worker()"
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

    def kvstore_push(self, workers: int) -> tuple[Op, float, int]:
        """The round a KVStore's pushes make (geompi.kv, under this algorithm's
        ``kvstore_type``): its kind, each push's weight and the header's flags; ``workers``:
        the datacenter's. Here gradients, summed, which the global servers' optimizer applies
        (without one, the sum becomes the value)."""
        return Op.GRAD, 1.0, FLAG_SUM

    def server_spec(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """What the global servers need from the user's optimizer, sent in the INIT round."""
        return None

    def cli_optimizer(self, cfg, params) -> torch.optim.Optimizer:
        """The CLI's optimizer for these flags (the CLI wraps it in DistributedOptimizer with
        this algorithm, whose ``server_spec`` then reads it, as it reads a user's)."""
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

    # ---- its checkpoints (geompi.checkpointing, geompi.resume_checks) ------------------------
    def on_restore(self, algorithm: dict) -> bool:
        """A restore (``geompi.load``, ``--resume``, ``load_state_dict``) hands the global
        servers ``algorithm`` (the /algorithm sections, by name): add what this algorithm's
        servers rebuild rather than read, and return whether they need the model for it.
        Nothing by default."""
        return False

    def checkpoint_copies(self, optimizer_states: int, workers: int) -> int:
        """How many model-sized tensors of optimizer state one checkpoint holds, for an upper
        estimate of its size (``optimizer_states``: the state names the optimizer keeps per
        parameter; ``workers``: the run's): one copy of them per worker where each worker keeps
        its own (``worker_state_section``), else the global servers' one."""
        return optimizer_states * (workers if self.worker_state_section else 1)

    def checkpoint_steps_problem(
        self, steps: list[int], step: int, dc_sizes: list[int]
    ) -> str | None:
        """What is wrong, for this algorithm, with a checkpoint's /progress/steps (one step per
        worker of the run that wrote it, in all_workers order; ``dc_sizes``: that run's
        datacenters, each its workers and its local server) at the checkpoint's ``step``, in
        one line; None if nothing is. Here every worker is at that step (the workers move
        together)."""
        if any(s != step for s in steps):
            return (
                f"/progress/steps is {steps}, but every worker of --sync {self.name} is at the "
                f"checkpoint's step {step}"
            )
        return None

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


class ServerHeld(torch.optim.Optimizer):
    """An optimizer the global servers run, named by its spec (SGD, Adam, AdamW or DCASGD,
    which torch lacks): the workers' stand-in, the model's parameters in one group, never
    stepped here (the CLI's, under FSA's servers placement and MixedSync). A torch optimizer,
    so DistributedOptimizer takes it, built without torch's ``add_param_group`` wrapper, whose
    first call imports torch._dynamo: 1.7 s of CPU on every worker (measured), for nothing."""

    add_param_group = getattr(  # the same function, unwrapped
        torch.optim.Optimizer.add_param_group, "__wrapped__", torch.optim.Optimizer.add_param_group
    )

    def __init__(self, params, message: dict) -> None:
        self.message = message  # what the global servers are told (spec_message's form)
        super().__init__(params, {"lr": float(message["optimizer"].get("lr", 0.0))})

    def step(self, closure=None) -> None:  # type: ignore[override]
        raise RuntimeError("the global servers step this optimizer, not the workers")


def held_message(optimizer: torch.optim.Optimizer) -> dict | None:
    """A ServerHeld's spec (the servers run it as it is), else None: read the user's."""
    if not isinstance(optimizer, ServerHeld):
        return None
    return optimizer.message
