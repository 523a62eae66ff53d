"""Checks of what ``geompi.load`` reads from a checkpoint before torch sees it: the optimizer's
param groups and state lists (JSON attributes, which no checksum covers), its hyperparameters,
and the counters (the file's step and epoch, each parameter's ``step``).

Everything is refused here, in one line naming the file, rather than later as a KeyError from
the rebuild, a TypeError inside torch's step, or a run that stops at its first non-finite
gradient and blames the learning rate. Kept apart from ``geompi.state`` so the rules live in
one place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from geompi.ckpt.reader import Checkpoint
from geompi.errors import CheckpointError

_GROUPS = "param_groups"  # optimizer attribute: the param groups, params as names (JSON)
_NONE = "none_states"  # optimizer attribute: [param name, state name] whose value was None
_NUMBERS = "number_states"  # optimizer attribute: [param name, state name, "int"|"float"]

# A counter beyond this is no real run (a trillion steps): a file claiming 2**62 would resume
# and "finish" without training.
MAX_COUNTER = 10**12
# Hyperparameters torch's optimizers and schedulers keep in a param group, with the values a
# run can use. Anything else numeric in a group must be finite and at most MAX_MAGNITUDE.
MAX_MAGNITUDE = 1e12
_LR = (0.0, 1e4, "a learning rate")
_FRACTION = (0.0, 1.0, "a fraction from 0 to 1")
RANGES: dict[str, tuple[float, float, str]] = {
    "lr": _LR,
    "initial_lr": _LR,  # lr schedulers
    "max_lr": _LR,
    "min_lr": _LR,
    "momentum": _FRACTION,
    "dampening": _FRACTION,
    "base_momentum": _FRACTION,
    "max_momentum": _FRACTION,
    "weight_decay": (0.0, 1e4, "a decay from 0"),
    "eps": (0.0, 1e4, "an epsilon from 0"),
}
_SAME_GROUPS = "build the optimizer with the same param groups"
_SETTINGS = (bool, str, type(None))  # flags and names: foreach, fused, line_search_fn, ...


def check_checkpoint(ck: Checkpoint, names: Sequence[str], optimizer: Any) -> None:
    """Refuse, in one line naming ``ck``'s file, counters or optimizer data that cannot be
    resumed: ``names`` are the parameter names of ``optimizer`` (None: the model only)."""
    for what in ("step", "epoch"):
        _counter(ck.path, what, ck.attrs.get(what, 0))
    attrs = ck.optimizer_attrs
    if optimizer is None or attrs.get("name") != type(optimizer).__name__.removeprefix(
        "Distributed"
    ):
        return  # the model only, or another optimizer class, which geompi.state refuses
    groups = _json(ck.path, attrs, _GROUPS, required=True)
    check_param_groups(ck.path, groups, optimizer.param_groups, names)
    _check_states(ck, names)


def _check_states(ck: Checkpoint, names: Sequence[str]) -> None:
    """The file's none/number state lists and its state tensors (finite, counters in range)."""
    attrs = ck.optimizer_attrs
    nones = _json(ck.path, attrs, _NONE)
    numbers = _json(ck.path, attrs, _NUMBERS)
    known = {(p, k) for k, table in ck.optimizer.items() for p in table}
    _state_lists(ck.path, nones, numbers, names, known)
    kinds = {(p, k): kind for p, k, kind in numbers}
    for key, table in ck.optimizer.items():
        for pname, value in table.items():
            _state_value(ck.path, pname, key, value, kinds.get((pname, key)))


def check_param_groups(
    path: object, groups: object, current: Sequence[dict], names: Sequence[str]
) -> None:
    """The file's param groups: one per group of this optimizer, each a JSON object whose
    ``params`` name this optimizer's parameters of that group, in order, and whose values are
    of the kind this optimizer holds and within the ranges a run can use."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        _refuse(path, "its optimizer param_groups are not a list of JSON objects")
    if len(groups) != len(current):
        _refuse(
            path,
            f"its optimizer has {len(groups)} param group(s), this one {len(current)}",
            _SAME_GROUPS,
        )
    start = 0
    for i, (saved, now) in enumerate(zip(groups, current)):
        want = list(names[start : start + len(now["params"])])
        start += len(now["params"])
        if saved.get("params") != want:
            _refuse(
                path,
                f"its optimizer param group {i} holds {_short(saved.get('params'))}, this "
                f"optimizer's holds {_short(want)}",
                _SAME_GROUPS,
            )
        for key, value in saved.items():
            if key != "params":
                _hyperparameter(path, i, key, value, now.get(key, _ABSENT))


class _Absent:
    pass


_ABSENT = _Absent()


def _hyperparameter(path: object, i: int, key: str, value: object, now: object) -> None:
    where = f"optimizer param group {i}'s {key}={_short(value)}"
    if isinstance(now, torch.Tensor):  # an lr held as a tensor: saved as its number
        now = now.item() if now.numel() == 1 else _ABSENT
    if isinstance(now, tuple | list) or isinstance(value, list):
        if not isinstance(value, list) or not all(_is_number(v) for v in value):
            _refuse(path, f"{where}: not a list of numbers")
        if isinstance(now, tuple | list) and len(value) != len(now):
            _refuse(path, f"{where}: {len(now)} values expected")
        for v in value:
            _number(path, where, v, key)
        return
    if _is_number(now) or (now is _ABSENT and _is_number(value)):
        if not _is_number(value):
            _refuse(path, f"{where}: not a number")
        _number(path, where, value, key)
        return
    if isinstance(now, bool) and not isinstance(value, bool):
        _refuse(path, f"{where}: not true or false")
    if not isinstance(value, _SETTINGS):
        _refuse(path, f"{where}: not a setting torch reads")


def _number(path: object, where: str, value: float, key: str) -> None:
    if not math.isfinite(value):
        _refuse(path, f"{where}: not a finite number")
    if key == "betas":
        lo, hi, what = 0.0, 1.0, "betas from 0 to below 1"
        if not lo <= value < hi:
            _refuse(path, f"{where}: must be {what}")
        return
    lo, hi, what = RANGES.get(key, (-MAX_MAGNITUDE, MAX_MAGNITUDE, "a sane number"))
    if not lo <= value <= hi:
        _refuse(path, f"{where}: outside [{lo:g}, {hi:g}] for {what}")


def torch_state(ck: Checkpoint, names: list[str]) -> dict:
    """Rebuild torch's optimizer state_dict from the file's tables (``names``: the parameter
    name of each index, in torch's order)."""
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


def exported_state(ck: Checkpoint) -> dict:
    """The optimizer of a ``geompi.save`` file as torch's ``state_dict()``, for ``python -m
    geompi.ckpt export --optimizer``: what ``load_state_dict`` of the same ``torch.optim``
    class, built on ``model.parameters()``'s param groups, accepts. Checked as ``geompi.load``
    checks it (the file is untrusted); the parameters' order is the param groups' own."""
    groups = _json(ck.path, ck.optimizer_attrs, _GROUPS, required=True)
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        _refuse(ck.path, "its optimizer param_groups are not a list of JSON objects with params")
    names = [n for g in groups for n in g["params"]]
    if not all(isinstance(n, str) and n in ck.model for n in names) or len(set(names)) != len(
        names
    ):
        _refuse(ck.path, f"its optimizer param_groups name {_short(names)}, not /model's tensors")
    check_param_groups(ck.path, groups, groups, names)  # the ranges a run can use
    _check_states(ck, names)
    sd = torch_state(ck, names)
    for g in sd["param_groups"]:  # JSON made torch's tuples (Adam's betas) lists
        for k, v in g.items():
            if k != "params" and isinstance(v, list):
                g[k] = tuple(v)
    return sd


def _state_lists(
    path: object, nones: object, numbers: object, names: Sequence[str], known: set
) -> None:
    """``none_states``: [param, state] pairs; ``number_states``: [param, state, "int"|"float"]
    triples naming a state the file holds, of a parameter of this optimizer."""
    for attr, rows, width in (("none_states", nones, 2), ("number_states", numbers, 3)):
        if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == width and all(isinstance(x, str) for x in r)
            for r in rows
        ):
            _refuse(path, f"its optimizer {attr} is not a list of {width}-string lists")
        for row in rows:
            if row[0] not in names:
                _refuse(path, f"its optimizer {attr} names {row[0]!r}, no parameter it holds")
    for pname, key, kind in numbers:  # type: ignore[misc]
        if kind not in ("int", "float") or (pname, key) not in known:
            _refuse(path, f"its optimizer number_states entry {[pname, key, kind]} is not valid")


def _state_value(path: object, pname: str, key: str, value: torch.Tensor, kind: str | None) -> None:
    """Optimizer state: finite; a counter (``step``, or a saved int) an integer in range."""
    where = f"optimizer state {key} of {pname}"
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        _refuse(path, f"{where} is not finite", "use an earlier checkpoint")
    if key == "step" or kind == "int":
        if value.numel() != 1:
            _refuse(path, f"{where} is a counter but holds {value.numel()} values")
        _counter(path, where, value.item())


def _counter(path: object, what: str, value: object) -> None:
    if (
        not _is_number(value)
        or not math.isfinite(value)  # type: ignore[arg-type]
        or value != int(value)  # type: ignore[arg-type]
        or not 0 <= value <= MAX_COUNTER  # type: ignore[operator]
    ):
        _refuse(path, f"its {what} is {value!r}: a counter is an integer from 0 to {MAX_COUNTER}")


def _json(path: object, attrs: dict, name: str, required: bool = False) -> Any:
    raw = attrs.get(name)
    if raw is None and not required:
        return []
    try:
        return json.loads(raw)  # NaN and Infinity parse, and are refused where read
    except (TypeError, ValueError) as e:
        _refuse(path, f"its optimizer {name} is not readable JSON ({type(e).__name__})")


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(
    path: object, what: str, fix: str = "use a checkpoint written by geompi.save"
) -> NoReturn:
    raise CheckpointError(f"{path}: {what}: {fix}")
