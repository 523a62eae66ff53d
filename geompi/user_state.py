"""The objects and values a user's script keeps beside its model (``geompi.save(state=...)``):
an lr scheduler, a GradScaler, a sampler's position, RNG states, plain numbers and text.

Each value becomes a JSON *skeleton* (never pickled) plus its tensors: a tensor or numpy array
``{"t": id}`` (its data in the file's tensors), a dict with text keys ``{"d": {...}}``, other
keys ``{"m": [[key, value], ...]}``, a list ``{"l": [...]}``, a tuple ``{"u": [...]}``, a
number, text, bool or None ``{"v": value}``, a non-finite float ``{"f": "nan"}``. Reading is
untrusted: every node is checked, depth and size are bounded, and a tensor id must exist.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from geompi.errors import CheckpointError, ConfigError

MAX_DEPTH = 64
MAX_SKELETON_BYTES = 64 * 2**20


def value_of(obj: Any) -> Any:
    """What is saved for ``obj``: its ``state_dict()`` if it has one, else itself."""
    sd = getattr(obj, "state_dict", None)
    return sd() if callable(sd) else obj


def encode(value: Any, where: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    """``value`` as (skeleton JSON bytes, tensors by id); a ConfigError names what cannot be
    saved (``where``: its place in the state, for the message)."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any, at: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ConfigError(f"cannot save {at}: nested more than {MAX_DEPTH} deep")
        if isinstance(v, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = v.detach().cpu().contiguous().clone()
            return {"t": key}
        if isinstance(v, np.ndarray):
            key = str(len(tensors))
            tensors[key] = torch.from_numpy(np.ascontiguousarray(v).copy())
            return {"t": key, "np": True}
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return {"v": v}
        if isinstance(v, (int, np.integer)):
            return {"v": int(v)}
        if isinstance(v, (float, np.floating)):
            f = float(v)
            return {"v": f} if math.isfinite(f) else {"f": repr(f)}
        if isinstance(v, Mapping):
            if all(isinstance(k, str) for k in v):
                return {"d": {k: enc(x, f"{at}[{k!r}]", depth + 1) for k, x in v.items()}}
            return {
                "m": [
                    [enc(k, f"{at} key", depth + 1), enc(x, f"{at}[{k!r}]", depth + 1)]
                    for k, x in v.items()
                ]
            }
        if isinstance(v, (list, tuple)):
            items = [enc(x, f"{at}[{i}]", depth + 1) for i, x in enumerate(v)]
            return {"u": items} if isinstance(v, tuple) else {"l": items}
        raise ConfigError(
            f"cannot save {at}: a {type(v).__name__} is neither a tensor, an array, a number, "
            "text, a list, a tuple nor a dict; give it a state_dict() or save its values"
        )

    skeleton = json.dumps(enc(value, where, 0), allow_nan=False).encode()
    return skeleton, tensors


def decode(skeleton: Any, tensors: Mapping[str, Any], path: str, where: str) -> Any:
    """The value ``encode`` made, from an untrusted file: a CheckpointError names ``path``."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: its saved state {where} is damaged ({what})")

    if isinstance(skeleton, np.ndarray):
        skeleton = skeleton.tobytes()
    if isinstance(skeleton, torch.Tensor):
        skeleton = skeleton.numpy().tobytes()
    if not isinstance(skeleton, (bytes, bytearray)) or len(skeleton) > MAX_SKELETON_BYTES:
        raise bad("no readable skeleton")
    try:
        tree = json.loads(bytes(skeleton))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad("its skeleton is not JSON") from None

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) not in (1, 2):
            raise bad("an unknown node")
        if "t" in node:
            key = node["t"]
            if not isinstance(key, str) or key not in tensors:
                raise bad(f"no tensor {key!r}")
            t = tensors[key]
            t = t if isinstance(t, torch.Tensor) else torch.as_tensor(np.asarray(t))
            return t.numpy().copy() if node.get("np") is True else t.clone()
        if len(node) != 1:
            raise bad("an unknown node")
        ((tag, body),) = node.items()
        if tag == "v" and (body is None or isinstance(body, (bool, int, float, str))):
            return body
        if tag == "f" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "d" and isinstance(body, dict):
            return {k: dec(v, depth + 1) for k, v in body.items()}
        if tag == "m" and isinstance(body, list):
            out = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise bad("a mapping entry is not a pair")
                key = dec(pair[0], depth + 1)
                try:
                    out[key] = dec(pair[1], depth + 1)
                except TypeError:  # an unhashable key
                    raise bad("a mapping key cannot be a key") from None
            return out
        if tag in ("l", "u") and isinstance(body, list):
            items = [dec(x, depth + 1) for x in body]
            return tuple(items) if tag == "u" else items
        raise bad(f"an unknown node {tag!r}")

    try:
        return dec(tree, 0)
    except RecursionError:
        raise bad("nested too deep") from None


def restore(state: dict, saved: Mapping[str, Any], path: str) -> dict:
    """Into ``state`` in place: an object with ``load_state_dict`` loads its saved value, any
    other entry is replaced by it. Returns what the file holds that ``state`` did not name."""
    missing = [k for k in state if k not in saved]
    if missing:
        raise CheckpointError(
            f"{path}: holds no saved state {missing[0]!r} (it holds {sorted(saved)}): pass the "
            "names geompi.save(state=...) was given"
        )
    for name in state:
        loader = getattr(state[name], "load_state_dict", None)
        if callable(loader):
            try:
                loader(saved[name])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(
                    f"{path}: saved state {name!r} does not fit {type(state[name]).__name__} "
                    f"({e}): pass an object of the kind that was saved"
                ) from None
        else:
            state[name] = saved[name]
    return {k: v for k, v in saved.items() if k not in state}
