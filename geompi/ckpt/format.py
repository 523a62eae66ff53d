"""The file layout: required attributes and groups, chunk geometry, dtypes, fingerprint."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping

import h5py
import numpy as np
import torch

FORMAT = "geompi-checkpoint"
FORMAT_VERSION = 1

REQUIRED_ATTRS = (
    "format",
    "format_version",
    "geompi_version",
    "algorithm",
    "step",
    "epoch",
    "topology",
    "config",
    "created",
    "model_fingerprint",
    "metrics",
)
REQUIRED_GROUPS = ("model", "optimizer", "algorithm", "progress")
_JSON_ROOT_ATTRS = ("topology", "config", "metrics")
# Names of attributes that hold JSON text, on a group that has any (see _encode_attrs).
_JSON_KEYS = "_json_keys"
_RESERVED_PROGRESS = ("step", "epoch")

# Chunks of about this many bytes: big enough for streaming writes, small enough to stay in cache.
_CHUNK_BYTES = 4 << 20
# Datasets at least this large are checksummed here and written with H5Dwrite_chunk (faster than
# HDF5's own fletcher32 filter); smaller ones go through HDF5's filter pipeline.
_DIRECT_MIN_BYTES = 256 << 10
# The checksum sums blocks of 256 x 256 16-bit words (see _fletcher32_padded).
_CK_BLOCK_BYTES = 2 * 256 * 256

# HDF5 1.10's format: object headers, chunk indexes (fixed/extensible arrays, v2 B-trees) and
# dense attribute storage carry checksums (1.8's v1 B-tree chunk records did not); readable by
# HDF5 >= 1.10 tools
_LIBVER = ("v110", "v110")
# Root attribute, written last: sha256 (hex) of the file's whole logical content except the
# datasets' bytes (see content_digest); each dataset's bytes have their own sha256 attribute.
DIGEST_ATTR = "content_sha256"
DATA_DIGEST_ATTR = "sha256"
_LOCKING = {"locking": "best-effort"} if h5py.version.hdf5_version_tuple >= (1, 12, 1) else {}

# torch dtype -> numpy dtype it is stored as. Types numpy lacks are stored as integer bits.
_STORED_AS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _STORED_AS[getattr(torch, _name)] = torch.uint8
_NUMPY_OF: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        _NUMPY_OF[getattr(torch, _name)] = np.dtype(_np)
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt for dt in (*_NUMPY_OF, *_STORED_AS)
}
_DTYPE_NAME: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


def _geompi_version() -> str:
    try:
        import geompi

        return str(getattr(geompi, "__version__", "0.0.0"))
    except ImportError:  # pragma: no cover - geompi is always importable from here
        return "0.0.0"


def fingerprint(model: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex of the sorted lines "name:shape:dtype" of a state dict (values not included).

    Shape is comma-separated ("64,3,3,3", "" for 0-d), dtype the torch name ("float32").
    """
    lines = []
    for name, value in model.items():
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        shape = ",".join(str(int(s)) for s in t.shape)
        lines.append(f"{name}:{shape}:{str(t.dtype).removeprefix('torch.')}")
    return hashlib.sha256("\n".join(sorted(lines)).encode("utf-8")).hexdigest()


def _attr_record(path: str, key: str, value: object) -> list[object]:
    """One attribute as plain JSON values: its type and exact value (floats as hex)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    if isinstance(value, np.ndarray) or (isinstance(value, np.generic) and value.ndim):
        return ["A", path, key, "array", str(value.dtype), repr(value.tolist())]
    if isinstance(value, (bool, np.bool_)):
        return ["A", path, key, "bool", bool(value)]
    if isinstance(value, (int, np.integer)):
        return ["A", path, key, "int", int(value)]
    if isinstance(value, (float, np.floating)):
        return ["A", path, key, "float", float(value).hex()]
    if isinstance(value, str):
        return ["A", path, key, "str", value]
    return ["A", path, key, type(value).__name__, repr(value)]


def content_digest(f: h5py.File) -> str:
    """sha256 (hex) of a file's logical content but the datasets' bytes: every group and dataset
    in iteration order (the order a load returns), each dataset's dtype and shape, and every
    attribute's name, type and value (its sha256 attribute covers the dataset's bytes). The
    writer computes it from the file it has just written; the reader from the file it opens.
    Only for a file whose structure has been checked (no links but hard links, no cycles)."""
    h = hashlib.sha256()

    def emit(record: list[object]) -> None:
        h.update(json.dumps(record, ensure_ascii=True).encode("ascii") + b"\n")

    def visit(obj: h5py.HLObject, path: str) -> None:
        for key in sorted(obj.attrs):
            if path == "/" and key == DIGEST_ATTR:
                continue
            emit(_attr_record(path, key, obj.attrs[key]))
        if isinstance(obj, h5py.Dataset):
            emit(["D", path, obj.dtype.str, list(obj.shape)])
            return
        emit(["G", path, len(obj)])
        for name in obj:
            visit(obj[name], path.rstrip("/") + "/" + name)

    visit(f, "/")
    return h.hexdigest()


def data_digest(arr: np.ndarray) -> str:
    """sha256 (hex) of an array's bytes as stored (C order)."""
    return hashlib.sha256(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)).hexdigest()


def _chunk_layout(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], int]:
    """(chunk shape, split dim): chunks are whole trailing dims and a run of the split dim, so
    each chunk is one contiguous byte range of a C-ordered array."""
    for i in range(len(shape)):
        inner = math.prod(shape[i + 1 :]) * itemsize
        if inner <= _CHUNK_BYTES:
            run = max(1, min(shape[i], _CHUNK_BYTES // inner))
            return (1,) * i + (run,) + tuple(shape[i + 1 :]), i
    raise AssertionError("unreachable: the last dim has inner size itemsize")


def _chunk_buffer(shape, itemsize: int, split: int, run: int) -> tuple[int, int, np.ndarray]:
    """(chunk bytes, bytes padded for the checksum, a buffer for one chunk and its checksum)."""
    chunk_bytes = run * math.prod(shape[split + 1 :]) * itemsize
    padded = -(-chunk_bytes // _CK_BLOCK_BYTES) * _CK_BLOCK_BYTES
    return chunk_bytes, padded, np.zeros(max(padded, chunk_bytes + 4), np.uint8)


def _chunk_walk(shape, itemsize: int, split: int, run: int):
    """Every chunk of a _chunk_layout layout, in file order: (chunk offset, byte offset of its
    data in the C-ordered array, its data bytes; the last chunk of a line may be partial)."""
    inner = math.prod(shape[split + 1 :]) * itemsize
    lead_shape = shape[:split]
    line_bytes = shape[split] * inner
    tail = (0,) * (len(shape) - split - 1)
    for line in range(math.prod(lead_shape)):
        lead = tuple(int(i) for i in np.unravel_index(line, lead_shape)) if split else ()
        for start in range(0, shape[split], run):
            nbytes = min(run, shape[split] - start) * inner
            yield (*lead, start, *tail), line * line_bytes + start * inner, nbytes


def _chunk_split(shape: tuple[int, ...], chunks: tuple[int, ...] | None) -> int | None:
    """The split dim if `chunks` has the form _chunk_layout makes, else None."""
    if chunks is None:
        return None
    for i in range(len(shape)):
        if all(c == 1 for c in chunks[:i]) and tuple(chunks[i + 1 :]) == tuple(shape[i + 1 :]):
            return i
    return None
