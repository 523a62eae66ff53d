"""State messages without pickle: a JSON header that describes a tree, then the tensors' bytes.

The checkpoint state that moves between the master worker and the global servers (snapshots,
restores) is a nested dict whose leaves are tensors, ints, floats, bools, strings and None, in
dicts and lists. ``encode`` writes it as one contiguous byte string::

    b"GMS1" | header length (8 bytes, little endian) | JSON header | payload

The header holds the tree; each tensor leaf names its dtype, shape and byte count, and its
bytes follow in the payload in the order the leaves appear. ``decode`` builds the tree back
from data only: a message that is not exactly what its header says (an unknown dtype, a size
that does not match the shape, bytes missing or left over, a header that is not JSON) raises
``MessageError``, and nothing in a message is ever run (the same rule as for checkpoints).

Tree nodes in the header, each a JSON object with one key: ``{"t": [dtype, shape, nbytes]}``
(a tensor), ``{"i": int}``, ``{"f": float.hex()}`` (exact, NaN and infinities included),
``{"b": bool}``, ``{"s": str}``, ``{"n": null}``, ``{"l": [node, ...]}`` (a list or tuple; it
comes back a list) and ``{"d": [[key, node], ...]}`` (a dict whose keys are str or int).
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch

from geompi.errors import ProtocolError

MAGIC = b"GMS1"
_PREFIX = struct.Struct("<4sQ")
MAX_DEPTH = 64  # deeper than any state geompi sends; a bound so decoding cannot recurse away

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dt: name for name, dt in DTYPES.items()}


class MessageError(ProtocolError):
    """A state message that does not decode: malformed, truncated or of unknown content."""


def encode(obj) -> np.ndarray:
    """``obj`` (dicts, lists, tensors, ints, floats, bools, str, None) as one uint8 message."""
    chunks: list[np.ndarray] = []
    tree = _node(obj, chunks, 0)
    header = json.dumps({"tree": tree, "payload": sum(c.nbytes for c in chunks)}).encode()
    out = np.empty(_PREFIX.size + len(header) + sum(c.nbytes for c in chunks), dtype=np.uint8)
    out[: _PREFIX.size] = np.frombuffer(_PREFIX.pack(MAGIC, len(header)), dtype=np.uint8)
    pos = _PREFIX.size + len(header)
    out[_PREFIX.size : pos] = np.frombuffer(header, dtype=np.uint8)
    for c in chunks:
        out[pos : pos + c.nbytes] = c
        pos += c.nbytes
    return out


def decode(buf) -> object:
    """The tree :func:`encode` wrote into ``buf``; MessageError unless it is exactly that."""
    data = memoryview(np.ascontiguousarray(np.frombuffer(buf, dtype=np.uint8))).cast("B")
    if len(data) < _PREFIX.size:
        raise MessageError(f"state message of {len(data)} bytes is shorter than its prefix")
    magic, hlen = _PREFIX.unpack(data[: _PREFIX.size])
    if magic != MAGIC:
        raise MessageError(f"state message starts with {bytes(magic)!r}, not {MAGIC!r}")
    if hlen > len(data) - _PREFIX.size:
        raise MessageError(
            f"state message header of {hlen} bytes is longer than the {len(data) - _PREFIX.size}"
            " bytes after its prefix (truncated)"
        )
    start = _PREFIX.size + hlen
    try:
        header = json.loads(bytes(data[_PREFIX.size : start]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MessageError(f"state message header is not JSON: {e}") from None
    if not isinstance(header, dict) or set(header) != {"tree", "payload"}:
        raise MessageError("state message header is not {tree, payload}")
    size = header["payload"]
    if not _is_int(size) or size != len(data) - start:
        raise MessageError(
            f"state message payload is {len(data) - start} bytes but its header says {size!r}"
            " (truncated or padded)"
        )
    cursor = [start]
    obj = _leaf(header["tree"], data, cursor, 0)
    if cursor[0] != len(data):  # the header's tensors must account for every payload byte
        raise MessageError(
            f"state message payload has {len(data) - cursor[0]} bytes no tensor of its header"
            " describes"
        )
    return obj


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _node(obj, chunks: list[np.ndarray], depth: int) -> dict:
    if depth > MAX_DEPTH:
        raise MessageError(f"state nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.dtype not in _NAMES:
            raise MessageError(f"cannot send a {t.dtype} tensor in a state message")
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        chunks.append(raw)
        return {"t": [_NAMES[t.dtype], list(t.shape), int(raw.nbytes)]}
    if isinstance(obj, (bool, np.bool_)):
        return {"b": bool(obj)}
    if isinstance(obj, (int, np.integer)):
        return {"i": int(obj)}
    if isinstance(obj, (float, np.floating)):
        return {"f": float(obj).hex()}
    if isinstance(obj, str):
        return {"s": obj}
    if obj is None:
        return {"n": None}
    if isinstance(obj, (list, tuple)):
        return {"l": [_node(v, chunks, depth + 1) for v in obj]}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, (bool, np.bool_)) or not isinstance(k, (str, int, np.integer)):
                raise MessageError(f"state message dict key {k!r} is not a str or an int")
            items.append([k if isinstance(k, str) else int(k), _node(v, chunks, depth + 1)])
        return {"d": items}
    raise MessageError(f"cannot send a {type(obj).__name__} in a state message")


def _leaf(node, data: memoryview, cursor: list[int], depth: int):
    if depth > MAX_DEPTH:
        raise MessageError(f"state message nested deeper than {MAX_DEPTH} levels")
    if not isinstance(node, dict) or len(node) != 1:
        raise MessageError(f"state message node {_short(node)} is not one tagged value")
    tag, v = next(iter(node.items()))
    if tag == "t":
        return _tensor(v, data, cursor)
    if tag == "i" and _is_int(v):
        return v
    if tag == "f" and isinstance(v, str):
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):
            raise MessageError(f"state message float {_short(v)} is not a float") from None
    if tag == "b" and isinstance(v, bool):
        return v
    if tag == "s" and isinstance(v, str):
        return v
    if tag == "n" and v is None:
        return None
    if tag == "l" and isinstance(v, list):
        return [_leaf(x, data, cursor, depth + 1) for x in v]
    if tag == "d" and isinstance(v, list):
        out = {}
        for item in v:
            if not (isinstance(item, list) and len(item) == 2):
                raise MessageError(f"state message dict item {_short(item)} is not [key, node]")
            k, x = item
            if not (isinstance(k, str) or _is_int(k)):
                raise MessageError(f"state message dict key {_short(k)} is not a str or an int")
            if k in out:
                raise MessageError(f"state message dict key {_short(k)} appears twice")
            out[k] = _leaf(x, data, cursor, depth + 1)
        return out
    raise MessageError(f"state message node {_short(node)} is of no known kind")


def _tensor(v, data: memoryview, cursor: list[int]) -> torch.Tensor:
    if not (isinstance(v, list) and len(v) == 3):
        raise MessageError(f"state message tensor {_short(v)} is not [dtype, shape, nbytes]")
    name, shape, nbytes = v
    if not isinstance(name, str) or name not in DTYPES:
        raise MessageError(
            f"state message tensor has dtype {_short(name)}, not one of {', '.join(DTYPES)}"
        )
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise MessageError(f"state message tensor shape {_short(shape)} is not a list of sizes")
    dtype = DTYPES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    want = math.prod(shape) * itemsize
    if not _is_int(nbytes) or nbytes != want:
        raise MessageError(
            f"state message {name} tensor of shape {tuple(shape)} needs {want} bytes but its "
            f"header says {_short(nbytes)}"
        )
    lo = cursor[0]
    if lo + want > len(data):
        raise MessageError(
            f"state message payload ends {lo + want - len(data)} bytes before its {name} tensor"
            f" of shape {tuple(shape)} (truncated)"
        )
    cursor[0] = lo + want
    if not want:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data[lo : lo + want]), dtype=torch.uint8)
    if dtype is torch.bool and bool((raw > 1).any()):
        raise MessageError("state message bool tensor holds bytes other than 0 and 1")
    return raw.view(dtype).reshape(shape)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
