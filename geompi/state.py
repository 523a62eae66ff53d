"""``geompi.save`` / ``geompi.load``: a user's model and optimizer in a geompi HDF5 checkpoint.

The file is the one ``geompi.ckpt`` writes and checks (``/model`` holds ``model.state_dict()``,
buffers included, so ``python -m geompi.ckpt export`` gives a file that loads with
``load_state_dict(strict=True)``; ``/optimizer/<state>/<param name>`` holds the optimizer's
per-parameter state, and its attributes the param groups as JSON). Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, NoReturn

import torch

from geompi import ckpt, user_state
from geompi.comm import faults
from geompi.comm.transport import barrier, barrier_before_collective
from geompi.errors import CheckpointError, ConfigError, GeompiError
from geompi.held_state import HeldState
from geompi.optimizer_json import _GROUPS, _NONE, _NUMBERS, check_checkpoint, torch_state
from geompi.ps.protocol import Op
from geompi.sync.hfa import OUTER_STATE

OUTER_KEY = "geompi_outer_momentum"  # in state_dict(): HFA's outer momentum, by param index
# In state_dict(): each state of HFA's outer optimizer (OUTER_KEY the momentum; Adam's
# geompi_outer_exp_avg, geompi_outer_exp_avg_sq, geompi_outer_step), by param index.
OUTER_KEYS = {f"geompi_{n}": n for n in OUTER_STATE.values()}
UPDATES_KEY = "geompi_global_updates"  # in state_dict(): the global servers' update count
_USER = "user_state"  # /progress/user_state/worker<i>: geompi.save(state=...)
# This process's line of checkpoints (the master's matter: it writes and prunes), for
# geompi.save(keep=) as the command line's --keep: the files written since the last
# geompi.load (newest first), and the file that load read.
_lineage: dict[str, Any] = {"written": [], "resumed_from": None}


def save(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    epoch: int = 0,
    metrics: dict | None = None,
    state: dict[str, Any] | None = None,
    keep: int | None = None,
) -> pathlib.Path | None:
    """Write ``model`` (and ``optimizer``) to ``path``. Every worker calls it; the master writes
    and the others wait until the file is complete. Atomic: a crash never leaves a half-written
    file under ``path``. Returns the path on the master, None elsewhere.

    ``path`` a directory (one that exists, or any with ``keep``): the file is
    ``ckpt-<step>.h5`` in it, as the command line names its checkpoints, and ``keep=N`` then
    deletes all but N there, as ``--keep`` does: first kept are this process's files since its
    last ``geompi.load`` (the file just written first, never deleted), the file that load read
    and the ones of lower step beside it, then the others by the order they were written (so a
    run resumed from an older checkpoint keeps its own past, not the abandoned files written
    after it). :func:`latest` finds the newest to resume from.

    With a ``DistributedOptimizer`` the file holds everything an exact resume needs: the state
    the global servers hold (their optimizer's, HFA's outer momentum), and under HFA every
    worker's own optimizer state; under HFA the workers first meet on the global model (one
    more global average if they are between two).

    ``state``: more to keep, by name: objects with ``state_dict()`` (an lr scheduler, a
    GradScaler, a sampler) and plain values (numbers, text, tensors, arrays, RNG states, and
    lists, tuples and dicts of them); each worker's own, restored to it by ``geompi.load``."""
    from geompi import session

    s = session.current() if session._session is not None else None
    engine = _engine(optimizer, s)
    err = None
    mine = None
    try:  # the same on every worker: decided before any collective call
        _check_carried(optimizer, engine, "save")
        _check_keep(keep, step)
        mine = _encode_state(state)
    except GeompiError as e:
        err = e
    if s is not None:
        session.fail_together(s, err)
    elif err is not None:
        raise err
    if engine is not None:
        engine.end_on_global(streaming=True)  # HFA: every worker on the global model
    per_worker = engine is not None and engine.algo.optimizer_state_per_worker
    own = {"local": own_optimizer_state(optimizer, model) if per_worker else {}, "state": mine}
    # the global servers' state (a SAVE round) where they run: the same file the CLI writes
    with_servers = optimizer is not None and engine is not None and engine.has_servers
    servers = engine if with_servers else None
    group = s.worker_comm if s is not None else None
    timeout = s.cfg.comm_timeout if s is not None else None
    held, everyone = gather(servers, group, own, timeout)
    written, err = None, None
    if s is None or s.rank == 0:
        try:
            target = pathlib.Path(path)
            if keep is not None or target.is_dir():
                target = target / _step_name(step)
            written = _write(
                target, model, optimizer, held, everyone, engine, step, epoch, metrics, s
            )
            _lineage["written"] = [written] + [p for p in _lineage["written"] if p != written]
            if keep is not None:
                ours = ckpt.lineage(_lineage["written"], _lineage["resumed_from"])
                try:
                    ckpt.prune(target.parent, keep, lineage=ours)
                except OSError as e:  # written: training goes on, the old files stay
                    from geompi.runtime import say

                    say(f"geompi: warning: geompi.save(keep={keep}): old checkpoints stay: {e}")
        except GeompiError as e:
            err = e
    if s is None:
        if err is not None:
            raise err
        return written
    session.fail_together(s, err)
    return written


def _check_keep(keep: Any, step: Any) -> None:
    """``geompi.save``'s ``keep`` and the step it names a file by (the same on every worker)."""
    count = isinstance(keep, int) and not isinstance(keep, bool)
    if keep is not None and not (count and keep >= 1):
        raise ConfigError(f"geompi.save(keep={keep!r}): give a whole number >= 1 or None")
    if keep is not None:
        _step_name(step)


def _step_name(step: Any) -> str:
    """The file name a directory path gets (``ckpt-<step>.h5``), or the one-line refusal of a
    step that cannot name it."""
    try:
        return ckpt.checkpoint_name(step)
    except ValueError:
        raise ConfigError(
            f"geompi.save into a directory names the file by its step: give step= a whole "
            f"number >= 0, not {step!r}"
        ) from None


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The checkpoint in ``directory`` written last that reads whole (every checksum checked),
    to resume from: as ``--resume latest``, a torn or corrupt file is skipped for the one
    written before it (one line says which), and the order is the one the files recorded as
    they were written, never file times. None where the directory holds no checkpoint (a
    first run); where none reads, its error is one line and every rank stops.

    Every worker calls it (the master reads, every worker gets its answer)::

        path = geompi.latest("ck/")
        start = geompi.load(path, model=model, optimizer=opt)["step"] if path else 0
        for step in range(start + 1, steps + 1):
            ...
            if step % 100 == 0:
                geompi.save("ck/", model=model, optimizer=opt, step=step, keep=3)
    """
    from geompi import session

    s = session.current() if session._session is not None else None
    found, err = None, None
    if s is None or s.rank == 0:
        try:
            found = ckpt.newest_readable(directory, ckpt.load)
        except GeompiError as e:
            err = e
        if found is not None and found[2]:
            from geompi.runtime import say

            say(ckpt.skipped_note("geompi.latest", found[2], found[0]))
    if s is None:
        if err is not None:
            raise err
        return found[0] if found is not None else None
    session.fail_together(s, err)
    name = s.worker_comm.bcast(str(found[0]) if found is not None else None, root=0)
    return pathlib.Path(name) if name is not None else None


def _engine(optimizer, s):
    """The open geompi engine ``optimizer`` trains through, else the session's, else None."""
    engine = getattr(optimizer, "_geompi", None)
    if engine is None and s is not None and s.optimizer is not None:
        engine = s.optimizer._geompi
    return None if engine is None or engine.closed else engine


def _check_carried(optimizer, engine, verb: str) -> None:
    """Refuse what a file could not carry, rather than lose it without a word."""
    mine = getattr(optimizer, "_geompi", None)
    if mine is not None and mine.closed and mine.holds_server_state:
        raise ConfigError(
            f"geompi.{verb}(optimizer=...) after opt.close(): the global servers held its "
            f"state and have let it go; call geompi.{verb} before close()"
        )
    held = engine is not None and engine.optimizer_state_on_servers
    if optimizer is not None and held and engine.lossy_wan:
        raise ConfigError(
            f"geompi.{verb}(optimizer=...) with a lossy wan_compression where the global "
            "servers step: the codec's residuals (held by the local servers) are not saved, so "
            "a resume would not continue this run; pass optimizer=None (the model only), or "
            "train without compression"
        )


# ---- the one checkpoint path: what every save gathers, and how it lays out the sections ----
def gather(
    engine, group, own: dict, timeout: float | None, *, final: bool = False
) -> tuple[dict | None, list[dict]]:
    """Collective over ``group`` (the workers that save together; None: this process alone)
    and, with an ``engine``, its global servers: one consistent version of the training state.

    With an ``engine``: a SAVE round (none where ``final``: MixedSync's global servers send
    their last snapshot unasked once every datacenter is done), then on ``group``'s master the
    global servers' state by parameter name (``HeldState.held_state``: model, optimizer,
    algorithm). Then every worker's ``own`` part, gathered on the master in ``group``'s order.
    Returns ``(held, everyone)`` on the master, ``(None, [])`` elsewhere. ``geompi.save`` and
    the CLI's checkpoints (geompi.checkpointing) both save through it."""
    held = None
    if engine is not None:
        if not final:
            engine.client.start(Op.SAVE, []).wait()
        if engine.master:  # before the gather: in MixedSync, other datacenters still need them
            held = HeldState.for_engine(engine).held_state()
    if group is None:
        return held, [own]
    barrier_before_collective(group, timeout, "every worker to hand in its state")
    everyone = group.gather(own, root=0)
    if faults.watching():  # the master had every part: else every worker saves again
        barrier(group, None, "every worker's state to reach the master")
    return held, everyone or []


def own_optimizer_state(optimizer, model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """This worker's own optimizer state (torch's, no SAVE round) by parameter name:
    ``{state: {param name: tensor}}``, numbers as float64 0-d tensors, None-valued entries
    left out; {} without an optimizer."""
    if optimizer is None:
        return {}
    names = param_names(model, optimizer)
    mine: dict[str, dict[str, torch.Tensor]] = {}
    base = getattr(optimizer, "_geompi_base", type(optimizer))  # torch's own: no SAVE round
    for idx, entries in base.state_dict(optimizer)["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                mine.setdefault(key, {})[names[idx]] = value.detach().cpu().clone()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                mine.setdefault(key, {})[names[idx]] = torch.tensor(value, dtype=torch.float64)
    return mine


def algorithm_sections(held: dict | None, everyone: list[dict], engine) -> dict:
    """/algorithm of a checkpoint: what the global servers hold of the algorithm (HFA's outer
    optimizer state, DCASGD's backups, the update counter), the engine's counters
    (``strategy``) and, where the workers keep optimizer state of their own, each worker's at
    the algorithm's ``worker_state_section``."""
    algorithm = dict(held["algorithm"]) if held is not None else {}
    if engine is not None:
        algorithm["strategy"] = {k: int(v) for k, v in engine.state().items()}
    local = [o.get("local") or {} for o in everyone]
    if any(local):
        section = engine.algo.worker_state_section if engine is not None else None
        put_section(algorithm, section, {f"worker{i}": st for i, st in enumerate(local)})
    return algorithm


def get_section(algorithm: dict, section: str | None) -> dict:
    """The group at ``section`` (an ``Algorithm.worker_state_section``) of a checkpoint's
    /algorithm; {} where there is none."""
    for part in section.split("/") if section else ():
        algorithm = algorithm.get(part, {})
    return algorithm if section else {}


def put_section(algorithm: dict, section: str | None, value: dict) -> None:
    """``value`` at ``section`` of /algorithm, beside what its groups already hold."""
    if section is None:
        raise CheckpointError(
            "the workers keep optimizer state of their own but the algorithm names no "
            "worker_state_section to checkpoint it in: give its class one (geompi.sync.Algorithm)"
        )
    *groups, last = section.split("/")
    for part in groups:  # copied on the way: the groups may be the servers' snapshot's own
        algorithm[part] = dict(algorithm.get(part, {}))
        algorithm = algorithm[part]
    algorithm[last] = value


def _encode_state(state: dict[str, Any] | None) -> tuple[bytes, dict] | None:
    """This worker's ``state=`` for the file (see geompi.user_state), checked here."""
    if state is None:
        return None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ConfigError("geompi.save(state=...): pass a dict from names to objects or values")
    values = {name: user_state.value_of(obj) for name, obj in state.items()}
    return user_state.encode(values, "state")


def _write(path, model, optimizer, held, everyone, engine, step, epoch, metrics, s) -> pathlib.Path:
    names = param_names(model, optimizer)
    state: dict[str, Any] = {}
    attrs: dict[str, Any] = {"name": "none"}
    if optimizer is not None:
        base = getattr(optimizer, "_geompi_base", type(optimizer))
        sd = base.state_dict(optimizer)  # torch's own: what the workers keep
        if held is not None and engine.optimizer_state_on_servers:
            sd["state"] = by_index(held["optimizer"], names)  # the global servers step
        state, attrs = _optimizer_tables(optimizer, sd, names)
    algorithm = algorithm_sections(held, everyone, engine)
    topology, name = {}, "none"
    if s is not None:
        topology = s.topo.describe()
        if engine is not None:
            name = engine.algo.name
    return ckpt.save(
        path,
        model=dict(model.state_dict()),
        optimizer=state,
        optimizer_attrs=attrs,
        algorithm=algorithm,
        step=step,
        epoch=epoch,
        algorithm_name=name,
        topology=topology,
        config={"saved_by": "geompi.save"},
        metrics=metrics or {},
        progress=_state_tree([o.get("state") for o in everyone]),
    )


def by_index(named: dict[str, dict[str, torch.Tensor]], names: list[str]) -> dict[int, dict]:
    """``{state: {param name: tensor}}`` as torch's ``{param index: {state: tensor}}`` for the
    parameters ``names`` lists (in torch's index order)."""
    out: dict[int, dict] = {}
    for state_name, per_name in named.items():
        for i, name in enumerate(names):
            if name in per_name:
                out.setdefault(i, {})[state_name] = per_name[name]
    return out


def _state_tree(users: list) -> dict:
    """/progress/user_state/worker<i>: each worker's skeleton (bytes) and its tensors (of
    the workers that passed ``state=``)."""
    if not any(u is not None for u in users):
        return {}
    return {
        _USER: {
            f"worker{i}": {"skeleton": u[0], "tensors": u[1]}
            for i, u in enumerate(users)
            if u is not None
        }
    }


def load(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore ``model`` (strictly) and ``optimizer`` from ``path`` on every worker (collective
    over the workers when geompi runs), then give the servers the restored parameters and the
    state they hold; under HFA each worker gets its own optimizer state back.

    ``state``: what ``geompi.save(state=...)`` kept, restored in place by name (an object with
    ``load_state_dict`` loads it, any other entry is replaced); each worker gets its own.

    Returns ``{"step": ..., "epoch": ..., "metrics": ..., "state": {...}}`` (``state``: what
    the file holds that ``state=`` did not name). A bad file is one error line and every rank
    stops.

    Where it goes: after ``DistributedOptimizer(...)``, with ``optimizer=`` the optimizer it
    returned, and before the training steps (under MixedSync a load after the first step is
    refused). Called between ``opt.close()`` and the next ``DistributedOptimizer``, it loads
    the model only, and that optimizer's first round gives the master's values to every
    worker.
    """
    from geompi import session

    s = session.current() if session._session is not None else None
    engine = _engine(optimizer, s)
    err: GeompiError | None = None
    info: dict[str, Any] = {}
    held: dict | None = None
    try:
        _check_carried(optimizer, engine, "load")
        ck = ckpt.load(path)
        held = _restore(ck, model, optimizer, engine, s)
        _lineage.update(written=[], resumed_from=pathlib.Path(path))  # what saves descend from
        info = {"step": ck.step, "epoch": ck.epoch, "metrics": ck.attrs.get("metrics", {})}
        info["state"] = _restore_state(ck, state, s)
    except GeompiError as e:
        err = e
    if s is None:
        if err is not None:
            raise err
        return info
    session.fail_together(s, err)
    if engine is None and s.optimizer is not None and not s.optimizer._geompi.closed:
        engine, held = s.optimizer._geompi, None  # a closed optimizer's file, a newer job
    if engine is not None:  # the master's values (and the servers' state) reach every rank
        engine.restore(held, "geompi.load", new_model=True)
    return info


def _restore(ck: ckpt.Checkpoint, model: torch.nn.Module, optimizer, engine, s) -> dict | None:
    """This worker's part of a load (no collective call): the model, the optimizer's own
    state; returns what the global servers are to hold (see ``split_held``)."""
    check_checkpoint(ck, param_names(model, optimizer), optimizer)  # untrusted JSON, counters
    try:
        model.load_state_dict(ck.model, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{ck.path}: does not fit this model ({first}): load a checkpoint of the same model"
        ) from None
    if optimizer is None:
        return None
    if ck.optimizer_attrs.get("name") != type(optimizer).__name__.removeprefix("Distributed"):
        raise CheckpointError(
            f"{ck.path}: holds {ck.optimizer_attrs.get('name')!r} optimizer state, but this "
            f"run's optimizer is {type(optimizer).__name__}: build the same optimizer class"
        )
    names = param_names(model, optimizer)
    sd = torch_state(ck, names)
    if engine is None:
        held = None
    else:
        held = held_in_file(ck, engine, names)
        if engine.optimizer_state_on_servers:
            sd["state"] = {}  # the workers keep none: the global servers step (``held``)
        local = get_section(ck.algorithm, engine.algo.worker_state_section)
        if engine.algo.optimizer_state_per_worker and local:
            me = f"worker{s.topo.worker_index(s.rank)}"
            if len(local) == s.topo.num_workers or me in local:
                sd["state"] = _indexed(local.get(me, {}), names, ck.path)
    for now, saved in zip(optimizer.param_groups, sd["param_groups"]):
        for k, v in saved.items():  # JSON made tuples (Adam's betas) lists: give them back
            if isinstance(now.get(k), tuple) and isinstance(v, list):
                saved[k] = tuple(v)
    _load_torch(optimizer, sd, ck.path)
    if engine is not None and ck.algorithm.get("strategy"):
        engine.load_state(ck.algorithm["strategy"])
    return held


def _load_torch(optimizer, sd: dict, path) -> None:
    """torch's own ``load_state_dict`` of ``optimizer`` (no round: what the workers keep)."""
    try:
        base = getattr(optimizer, "_geompi_base", type(optimizer))
        base.load_state_dict(optimizer, sd)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{path}: optimizer state does not fit this optimizer ({e}): "
            "build it with the same param groups"
        ) from None


def held_in_file(ck: ckpt.Checkpoint, engine, names: list[str] | None = None) -> dict:
    """What the global servers are to hold of a checkpoint, by parameter name (the arguments
    of ``HeldState.shard_states``): its /optimizer where they step, HFA's outer optimizer's
    state, DCASGD's backups (every datacenter restarts from /model) and the update counter.
    ``geompi.load`` and the CLI's ``--resume`` restore the servers through it. ``names``: the
    parameters the optimizer holds, which the outer state must not go beyond. An outer
    optimizer's state where this run's servers keep none is refused."""
    hfa = ck.algorithm.get("hfa", {})
    outer = [n for n in OUTER_STATE.values() if hfa.get(n)]
    if outer and not engine.holds_server_state:
        _refuse_outer(f"{ck.path}: the file")
    if names is not None:
        for state_name in outer:
            _indexed({state_name: hfa[state_name]}, names, ck.path)  # refuses an unknown name
    algorithm = dict(ck.algorithm)
    engine.algo.on_restore(algorithm)  # DCASGD: every datacenter restarts from /model
    on_servers = engine.optimizer_state_on_servers
    return {
        "optimizer": ck.optimizer if on_servers else {},
        "algorithm": algorithm,
        "model": ck.model,
    }


def _refuse_outer(what: str) -> NoReturn:
    """An outer optimizer's state for an HFA whose servers keep none (``what`` holds it): from
    a file (``held_in_file``) or a state dict (``split_held``) alike."""
    raise ConfigError(
        f"{what} holds an outer optimizer's state, but this HFA's keeps none: build it with the "
        "same outer_optimizer"
    )


def load_own_state(optimizer, model: torch.nn.Module, named: dict, path) -> None:
    """This worker's own optimizer state, ``{state: {param name: tensor}}`` as
    ``own_optimizer_state`` gives it, into ``optimizer`` (its param groups as they are)."""
    names = param_names(model, optimizer)
    base = getattr(optimizer, "_geompi_base", type(optimizer))
    sd = base.state_dict(optimizer)
    sd["state"] = _indexed(named, names, path)
    _load_torch(optimizer, sd, path)


def _restore_state(ck: ckpt.Checkpoint, state: dict | None, s) -> dict:
    """This worker's saved ``state=`` (its own, else worker 0's), into ``state``."""
    saved_all = ck.progress.get(_USER)
    if saved_all is None:
        if state:
            raise CheckpointError(
                f"{ck.path}: holds no saved state: it was written without geompi.save(state=...)"
            )
        return {}
    if not isinstance(saved_all, dict):
        raise CheckpointError(f"{ck.path}: its saved state is damaged (not a group)")
    me = f"worker{s.topo.worker_index(s.rank)}" if s is not None else "worker0"
    mine = saved_all.get(me, saved_all.get("worker0"))
    if not isinstance(mine, dict) or "skeleton" not in mine:
        raise CheckpointError(f"{ck.path}: its saved state is damaged (no {me} or worker0)")
    tensors = mine.get("tensors", {})
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{ck.path}: its saved state is damaged (tensors not a group)")
    saved = user_state.decode(mine["skeleton"], tensors, str(ck.path), "state")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ck.path}: its saved state is damaged (not a dict)")
    return user_state.restore(state if state is not None else {}, saved, str(ck.path))


def _indexed(tables: dict, names: list[str], path, only: str | None = None) -> dict:
    """``{state: {param name: tensor}}`` as torch's ``{index: {state: tensor}}`` (``only``: one
    state's tensors as ``{index: tensor}``)."""
    index = {n: i for i, n in enumerate(names)}
    out: dict = {}
    for key, table in tables.items():
        for pname, value in table.items():
            if pname not in index:
                raise CheckpointError(
                    f"{path}: optimizer state for {pname}, which this optimizer does not "
                    "hold: build it on the same parameters"
                )
            if only is not None:
                out[index[pname]] = value
            else:
                out.setdefault(index[pname], {})[key] = value
    return out


def split_held(engine, sd: dict) -> tuple[dict | None, dict]:
    """torch's state dict (with geompi's keys, see ``DistributedOptimizer.state_dict``) cut in
    two: what the global servers hold, by parameter name, and what the workers keep."""
    sd = dict(sd)
    outer = {n: v for k, n in OUTER_KEYS.items() if (v := sd.pop(k, None))}
    updates = sd.pop(UPDATES_KEY, None)
    if not engine.holds_server_state:
        if outer:
            _refuse_outer("the optimizer state")
        return None, sd
    names = engine.param_names()
    held: dict = {"optimizer": {}, "algorithm": {}, "model": {}}
    if engine.optimizer_state_on_servers:
        for i, entries in sd.get("state", {}).items():
            for state_name, value in entries.items():
                t = torch.as_tensor(value)
                held["optimizer"].setdefault(state_name, {})[names[int(i)]] = t
        sd["state"] = {}  # the workers keep none: the servers step
        if engine.algo.on_restore(held["algorithm"]):  # DCASGD: restarts from the model
            held["model"] = {n: p.detach().cpu() for n, p in engine.model.named_parameters()}
    for state_name, by_index in outer.items():
        named = {names[int(i)]: torch.as_tensor(t) for i, t in by_index.items()}
        held["algorithm"].setdefault("hfa", {})[state_name] = named
    if updates is not None:
        held["algorithm"]["global_updates"] = int(updates)
    return held, sd


def param_names(model: torch.nn.Module, optimizer) -> list[str]:
    """The model's name of each parameter the optimizer holds, in torch's state_dict order;
    a parameter outside the model is a ConfigError."""
    if optimizer is None:
        return []
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in name_of:
                raise ConfigError(
                    "the optimizer holds a parameter that is not in the model: build it on "
                    "model.parameters() (or a subset of them)"
                )
            names.append(name_of[id(p)])
    return names


def _optimizer_tables(optimizer, sd: dict, names: list[str]) -> tuple[dict, dict]:
    """torch's optimizer.state_dict() (``sd``) as /optimizer/<state>/<param> tensors plus JSON
    attrs."""
    tables: dict[str, dict[str, torch.Tensor]] = {}
    nones, numbers = [], []
    for idx, entries in sd["state"].items():
        pname = names[idx]
        for key, value in entries.items():
            if value is None:
                nones.append([pname, key])
            elif isinstance(value, torch.Tensor):
                tables.setdefault(key, {})[pname] = value.detach().cpu()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers.append([pname, key, "int" if isinstance(value, int) else "float"])
                tables.setdefault(key, {})[pname] = torch.tensor(value, dtype=torch.float64)
            else:
                raise CheckpointError(
                    f"cannot save optimizer state {key!r} of {pname}: {type(value).__name__} "
                    "is neither a tensor nor a number"
                )
    groups = []
    for g in sd["param_groups"]:
        groups.append({**g, "params": [names[i] for i in g["params"]]})
    attrs = {
        "name": type(optimizer).__name__.removeprefix("Distributed"),
        _GROUPS: json.dumps(groups, default=_number),
        _NONE: json.dumps(nones),
        _NUMBERS: json.dumps(numbers),
    }
    return tables, attrs


def _number(value: Any) -> Any:
    """JSON for a tensor-valued hyperparameter (an lr held as a 0-d tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
