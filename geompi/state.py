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
from typing import Any

import torch

from geompi import ckpt
from geompi.errors import CheckpointError, ConfigError, GeompiError
from geompi.optimizer_json import check_checkpoint

_GROUPS = "param_groups"  # optimizer attribute: the param groups, params as names (JSON)
_NONE = "none_states"  # optimizer attribute: [param name, state name] whose value was None
_NUMBERS = "number_states"  # optimizer attribute: [param name, state name, "int"|"float"]


def save(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    epoch: int = 0,
    metrics: dict | None = None,
) -> pathlib.Path | None:
    """Write ``model`` (and ``optimizer``) to ``path``. Every worker calls it; the master writes
    and the others wait until the file is complete. Atomic: a crash never leaves a half-written
    file under ``path``. Returns the path on the master, None elsewhere."""
    from geompi import session

    s = session.current() if session._session is not None else None
    written, err = None, None
    if s is None or s.rank == 0:
        try:
            written = _write(path, model, optimizer, step, epoch, metrics, s)
        except GeompiError as e:
            err = e
    if s is None:
        if err is not None:
            raise err
        return written
    session.fail_together(s, err)
    return written


def _on_servers(optimizer, verb: str) -> None:
    """Refuse an optimizer whose state the global servers hold (they step): the workers'
    copy is empty, so saving or loading it would lose that state without a word."""
    engine = getattr(optimizer, "_geompi", None)
    if engine is None or not engine.server_side:
        return
    where = "MixedSync" if engine.algo.independent_dcs else 'FSA(optimizer="servers")'
    raise ConfigError(
        f"geompi.{verb}(optimizer=...) under {where}: the optimizer state is on the global "
        f"servers, which geompi.{verb} does not reach; pass optimizer=None (the model only), "
        "or train with FSA() (the workers step) or the CLI's --checkpoint-dir"
    )


def _write(path, model, optimizer, step, epoch, metrics, s) -> pathlib.Path:
    _on_servers(optimizer, "save")
    names = param_names(model, optimizer)
    state, attrs = {}, {"name": "none"}
    if optimizer is not None:
        state, attrs = _optimizer_tables(optimizer, names)
    algorithm, topology = "none", {}
    if s is not None:
        topology = s.topo.describe()
        if s.optimizer is not None:
            algorithm = s.optimizer._geompi.algo.name
    return ckpt.save(
        path,
        model=dict(model.state_dict()),
        optimizer=state,
        optimizer_attrs=attrs,
        step=step,
        epoch=epoch,
        algorithm_name=algorithm,
        topology=topology,
        config={"saved_by": "geompi.save"},
        metrics=metrics or {},
    )


def load(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Restore ``model`` (strictly) and ``optimizer`` from ``path`` on every worker (collective
    over the workers when geompi runs), then give the servers the restored parameters.

    Returns ``{"step": ..., "epoch": ..., "metrics": ...}``. A bad file is one error line and
    every rank stops.
    """
    from geompi import session

    s = session.current() if session._session is not None else None
    err: GeompiError | None = None
    info: dict[str, Any] = {}
    try:
        _on_servers(optimizer, "load")
        ck = ckpt.load(path)
        _restore(ck, model, optimizer)
        info = {"step": ck.step, "epoch": ck.epoch, "metrics": ck.attrs.get("metrics", {})}
    except GeompiError as e:
        err = e
    if s is None:
        if err is not None:
            raise err
        return info
    session.fail_together(s, err)
    if s.optimizer is not None:
        s.optimizer._geompi.init_round()  # the master's restored values reach every rank
    return info


def _restore(ck: ckpt.Checkpoint, model: torch.nn.Module, optimizer) -> None:
    check_checkpoint(ck, param_names(model, optimizer), optimizer)  # untrusted JSON, counters
    try:
        model.load_state_dict(ck.model, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{ck.path}: does not fit this model ({first}): load a checkpoint of the same model"
        ) from None
    if optimizer is None:
        return
    if ck.optimizer_attrs.get("name") != type(optimizer).__name__.removeprefix("Distributed"):
        raise CheckpointError(
            f"{ck.path}: holds {ck.optimizer_attrs.get('name')!r} optimizer state, but this "
            f"run's optimizer is {type(optimizer).__name__}: build the same optimizer class"
        )
    names = param_names(model, optimizer)
    sd = _torch_state(ck, names)
    for now, saved in zip(optimizer.param_groups, sd["param_groups"]):
        for k, v in saved.items():  # JSON made tuples (Adam's betas) lists: give them back
            if isinstance(now.get(k), tuple) and isinstance(v, list):
                saved[k] = tuple(v)
    try:
        optimizer.load_state_dict(sd)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{ck.path}: optimizer state does not fit this optimizer ({e}): "
            "build it with the same param groups"
        ) from None


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


def _optimizer_tables(optimizer, names: list[str]) -> tuple[dict, dict]:
    """torch's optimizer.state_dict() as /optimizer/<state>/<param> tensors plus JSON attrs."""
    sd = optimizer.state_dict()
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


def _torch_state(ck: ckpt.Checkpoint, names: list[str]) -> dict:
    """Rebuild torch's optimizer state_dict from the file's tables."""
    attrs = ck.optimizer_attrs
    try:
        groups = json.loads(attrs[_GROUPS])
        nones = json.loads(attrs.get(_NONE, "[]"))
        numbers = json.loads(attrs.get(_NUMBERS, "[]"))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"{ck.path}: its optimizer has no readable param groups: was it written by geompi.save?"
        ) from None
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, table in ck.optimizer.items():
        for pname, value in table.items():
            if pname not in index:
                raise CheckpointError(
                    f"{ck.path}: optimizer state for {pname}, which this optimizer does not "
                    "hold: build it on the same parameters"
                )
            state.setdefault(index[pname], {})[key] = value
    for pname, key in nones:
        state.setdefault(index[pname], {})[key] = None
    for pname, key, kind in numbers:
        v = state[index[pname]][key]
        state[index[pname]][key] = int(v) if kind == "int" else float(v)
    for g in groups:
        g["params"] = [index[n] for n in g["params"]]
    return {"state": state, "param_groups": groups}
