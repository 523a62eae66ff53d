"""Checkpoints: one HDF5 file per checkpoint, written atomically, checksummed, never pickled.

The layout is described in docs/checkpoint-format.md. Use :func:`save` and :func:`load` from code,
and ``python -m geompi.ckpt {inspect,verify,diff,export,ls}`` from a shell.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import hashlib
import json
import math
import os
import pathlib
import re
import struct
import sys
import threading
import zipfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import h5py
import numpy as np
import torch

from geompi.errors import CheckpointError

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
# One helper thread prepares (copies and checksums) the next chunk while the current one is written.
_CHECKSUMS = ThreadPoolExecutor(1, thread_name_prefix="geompi-ckpt-checksum")
# While writing, a helper thread starts an fsync after this many bytes.
_FLUSH_BYTES = 64 << 20

_CKPT_RE = re.compile(r"^ckpt-(\d+)\.h5$")
_LIBVER = ("v108", "v110")  # dense attribute storage; readable by HDF5 >= 1.10 tools
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


# --------------------------------------------------------------------------------------------
# Public helpers


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


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of `step`, e.g. "ckpt-00001200.h5"."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    return f"ckpt-{int(step):08d}.h5"


def list_checkpoints(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Checkpoint files (ckpt-<step>.h5) in `directory`, oldest step first; temporaries ignored."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The checkpoint with the highest step in `directory`, or None if there is none."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def prune(directory: str | os.PathLike, keep: int) -> list[pathlib.Path]:
    """Delete all but the newest `keep` (>= 1) checkpoints of `directory`; return the deleted."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, not {keep!r}")
    old = list_checkpoints(directory)[:-keep]
    for p in old:
        p.unlink(missing_ok=True)
    return old


# --------------------------------------------------------------------------------------------
# fletcher32, exactly as HDF5's H5_checksum_fletcher32 computes it
#
# HDF5 sums big-endian 16-bit words w_0..w_{n-1} (an odd last byte is the high byte of a word):
# sum1 = sum(w_j), sum2 = sum((n - j) * w_j), each folded into 16 bits with end-around carry,
# and returns (sum2 << 16) | sum1. Folding keeps a value mod 65535, never lets a positive sum
# reach 0, and (HDF5 reduces every 360 words) never overflows, so each half is 0 for all-zero
# data and otherwise ((sum - 1) mod 65535) + 1. Since 65536 = 1 (mod 65535), a big-endian word
# is 256 times its little-endian reading, so the words can be read natively. The sums are done
# in float32 over blocks of 256 x 256 words, where every partial sum is an integer below 2**24
# and therefore exact (BLAS matrix-vector products, whatever their order). numpy, not torch:
# torch's threads crawl when MPI ranks already fill the cores.


_ONES = np.ones(256, np.float32)


def _fletcher32_padded(buf: np.ndarray, nbytes: int) -> int:
    """fletcher32 of buf[:nbytes]; len(buf) is a multiple of _CK_BLOCK_BYTES, zero after nbytes."""
    n = (nbytes + 1) // 2
    n_padded = buf.size // 2
    words = buf.view(np.uint16).astype(np.float32).reshape(-1, 256, 256)
    rows = (words @ _ONES).astype(np.int64)  # [K, 256]: sum of each row of 256 words
    cols = (_ONES @ words).astype(np.int64)  # [K, 256]: sum of each column of a block
    blocks = rows.sum(axis=1)  # [K]
    t1 = int(blocks.sum())
    if t1 == 0:
        return 0
    k = blocks.size
    idx = np.arange(256, dtype=np.int64)
    # sum2 = sum over words of (words from it to the end) * word; 65536 = 1 (mod 65535)
    weights = (k - np.arange(k, dtype=np.int64)) % 65535
    t2 = (
        int((weights * (blocks % 65535)).sum())
        - 256 * int((rows @ idx).sum())
        - int((cols @ idx).sum())
        - (n_padded - n) * t1  # the zero padding added its length times sum1 to sum2
    )
    s1 = (t1 * 256) % 65535 or 65535
    s2 = (t2 * 256) % 65535 or 65535
    return (s2 << 16) | s1


def _fletcher32(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """fletcher32 of any bytes, as HDF5's fletcher32 filter computes it."""
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    padded = max(_CK_BLOCK_BYTES, -(-raw.size // _CK_BLOCK_BYTES) * _CK_BLOCK_BYTES)
    buf = np.zeros(padded, np.uint8)
    buf[: raw.size] = raw
    return _fletcher32_padded(buf, raw.size)


# --------------------------------------------------------------------------------------------
# Writing


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str):
        raise CheckpointError(f"cannot save {where}: key {name!r} is not a string")
    if name in ("", ".") or "/" in name or "\x00" in name:
        raise CheckpointError(
            f"cannot save {where}: name {name!r} is not allowed "
            "(names must be non-empty, not '.', and contain no '/')"
        )
    return name


def _check_tensor(value: Any, where: str) -> None:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            raise CheckpointError(f"cannot save {where}: numpy dtype {value.dtype} is not numeric")
        return
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"cannot save {where}: expected a tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise CheckpointError(
            f"cannot save {where}: {value.layout} tensors are not supported; "
            "store t.to_dense() instead"
        )
    if value.is_quantized or value.device.type == "meta":
        raise CheckpointError(f"cannot save {where}: quantized and meta tensors are not supported")
    if value.dtype not in _DTYPE_NAME:
        raise CheckpointError(f"cannot save {where}: dtype {value.dtype} is not supported")


def _tensor_to_numpy(value: Any) -> tuple[np.ndarray, str, bool]:
    """(C-contiguous array to store, torch dtype name, whether the tensor was 0-d)."""
    if isinstance(value, np.ndarray):
        # (np.ascontiguousarray would turn a 0-d array into a 1-d one)
        value = torch.from_numpy(value.astype(value.dtype.newbyteorder("="), order="C", copy=False))
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    name = _DTYPE_NAME[t.dtype]
    if t.dtype in _STORED_AS:
        t = t.view(_STORED_AS[t.dtype])
    arr = t.numpy()
    scalar = arr.ndim == 0
    if scalar:
        arr = arr.reshape(1)
    return arr, name, scalar


def _json_default(obj: Any) -> Any:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _dumps(value: Any, what: str) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        return json.dumps(value, default=_json_default)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot save {what}: {e}") from None


def _encode_attrs(attrs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """HDF5 attribute values: str, bool, int64 and float64 as such, anything else as JSON text
    whose names are listed (as a JSON list) in the attribute `_json_keys`."""
    out: dict[str, Any] = {}
    json_keys = []
    for key, value in attrs.items():
        _check_name(key, where)
        if key == _JSON_KEYS:
            raise CheckpointError(f"cannot save {where}: the name {_JSON_KEYS!r} is reserved")
        if isinstance(value, str):
            out[key] = value
        elif isinstance(value, (bool, np.bool_)):
            out[key] = np.bool_(value)
        elif isinstance(value, (int, np.integer)) and -(2**63) <= int(value) < 2**63:
            out[key] = np.int64(value)
        elif isinstance(value, (float, np.floating)):
            out[key] = np.float64(value)
        else:
            out[key] = _dumps(value, f"{where}/{key}")
            json_keys.append(key)
    if json_keys:
        out[_JSON_KEYS] = json.dumps(json_keys)
    return out


@dataclass
class _Node:
    """A group to write: children are tensors, bytes or _Nodes; attrs are already encoded."""

    children: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)


def _tensor_node(tensors: Mapping[str, Any] | None, where: str) -> _Node:
    node = _Node()
    for name, value in (tensors or {}).items():
        _check_name(name, where)
        _check_tensor(value, f"{where}/{name}")
        node.children[name] = value
    return node


def _tree_node(tree: Mapping[str, Any] | None, where: str) -> _Node:
    node = _Node()
    attrs = {}
    for key, value in (tree or {}).items():
        _check_name(key, where)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            _check_tensor(value, f"{where}/{key}")
            node.children[key] = value
        elif isinstance(value, (bytes, bytearray, memoryview)):
            node.children[key] = bytes(value)
        elif isinstance(value, Mapping):
            node.children[key] = _tree_node(value, f"{where}/{key}")
        else:
            attrs[key] = value
    node.attrs = _encode_attrs(attrs, where)
    return node


def _chunk_layout(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], int]:
    """(chunk shape, split dim): chunks are whole trailing dims and a run of the split dim, so
    each chunk is one contiguous byte range of a C-ordered array."""
    for i in range(len(shape)):
        inner = math.prod(shape[i + 1 :]) * itemsize
        if inner <= _CHUNK_BYTES:
            run = max(1, min(shape[i], _CHUNK_BYTES // inner))
            return (1,) * i + (run,) + tuple(shape[i + 1 :]), i
    raise AssertionError("unreachable: the last dim has inner size itemsize")


def _write_chunks(
    ds: h5py.Dataset,
    arr: np.ndarray,
    chunks: tuple[int, ...],
    split: int,
    flusher: _Flusher | None = None,
) -> None:
    """Write `arr` chunk by chunk with our own fletcher32 (the filter is then marked applied).

    A helper thread copies and checksums chunk k+1 while this one writes chunk k (numpy and the
    write release the GIL), with two buffers taking turns.
    """
    chunk_bytes, padded, first = _chunk_buffer(arr.shape, arr.itemsize, split, chunks[split])
    bufs = [first, np.zeros_like(first)]
    flat = arr.reshape(-1).view(np.uint8)

    def prepare(buf: np.ndarray, begin: int, nbytes: int) -> np.ndarray:
        buf[:nbytes] = flat[begin : begin + nbytes]
        buf[nbytes:padded] = 0  # the fill of a partial chunk, and the checksum's padding
        struct.pack_into("<I", buf, chunk_bytes, _fletcher32_padded(buf[:padded], chunk_bytes))
        return buf

    walk = list(_chunk_walk(arr.shape, arr.itemsize, split, chunks[split]))
    pending = _CHECKSUMS.submit(prepare, bufs[0], walk[0][1], walk[0][2])
    for k, (offset, _, _) in enumerate(walk):
        buf = pending.result()
        if k + 1 < len(walk):
            pending = _CHECKSUMS.submit(prepare, bufs[(k + 1) % 2], walk[k + 1][1], walk[k + 1][2])
        ds.id.write_direct_chunk(offset, buf[: chunk_bytes + 4], 0)
        if flusher is not None:
            flusher.wrote(chunk_bytes)


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


def _read_chunks(ds: h5py.Dataset) -> np.ndarray | None:
    """Read a large dataset chunk by chunk, checking fletcher32 here (faster than HDF5's filter).

    None when the dataset is not laid out as _write_chunks writes, or when anything (including
    the checksum) differs: the caller then lets HDF5 read it and report what is wrong.
    """
    dtype = ds.dtype
    if ds.size == 0 or dtype.kind not in "iuf" or not dtype.isnative:
        return None
    if ds.size * dtype.itemsize < _DIRECT_MIN_BYTES:
        return None
    split = _chunk_split(ds.shape, ds.chunks)
    dcpl = ds.id.get_create_plist()
    if split is None or dcpl.get_nfilters() != 1:
        return None
    if dcpl.get_filter(0)[0] != h5py.h5z.FILTER_FLETCHER32:
        return None
    run = ds.chunks[split]
    chunk_bytes, padded, buf = _chunk_buffer(ds.shape, dtype.itemsize, split, run)
    out = np.empty(ds.shape, dtype)
    flat = out.reshape(-1).view(np.uint8)
    for offset, begin, nbytes in _chunk_walk(ds.shape, dtype.itemsize, split, run):
        try:
            mask, raw = ds.id.read_direct_chunk(offset, out=buf)
        except (OSError, ValueError):
            return None
        if mask != 0 or raw.nbytes != chunk_bytes + 4:
            return None
        stored = struct.unpack_from("<I", buf, chunk_bytes)[0]
        buf[chunk_bytes:padded] = 0
        if _fletcher32_padded(buf[:padded], chunk_bytes) != stored:
            return None
        flat[begin : begin + nbytes] = buf[:nbytes]
    return out


def _write_dataset(
    group: h5py.Group, name: str, value: Any, flusher: _Flusher | None = None
) -> None:
    if isinstance(value, bytes):
        arr, dtype_name, scalar = np.frombuffer(value, np.uint8), "uint8", False
    else:
        arr, dtype_name, scalar = _tensor_to_numpy(value)
    if arr.size == 0:
        ds = group.create_dataset(name, data=arr, chunks=True, fletcher32=True)
    else:
        chunks, split = _chunk_layout(arr.shape, arr.itemsize)
        if arr.nbytes >= _DIRECT_MIN_BYTES and arr.dtype.kind in "iuf":
            ds = group.create_dataset(
                name, shape=arr.shape, dtype=arr.dtype, chunks=chunks, fletcher32=True
            )
            _write_chunks(ds, arr, chunks, split, flusher)
        else:
            ds = group.create_dataset(name, data=arr, chunks=chunks, fletcher32=True)
    ds.attrs["dtype"] = dtype_name
    if scalar:
        ds.attrs["scalar"] = np.int8(1)
    if isinstance(value, bytes):
        ds.attrs["kind"] = "bytes"


def _write_node(group: h5py.Group, node: _Node, flusher: _Flusher | None = None) -> None:
    for name, child in node.children.items():
        if isinstance(child, _Node):
            _write_node(group.create_group(name, track_order=True), child, flusher)
        else:
            _write_dataset(group, name, child, flusher)
    for key, value in node.attrs.items():
        group.attrs[key] = value


class _Flusher:
    """fsyncs a file from a helper thread while it is still being written, so that the final
    fsync finds little left to do (the disk works while this thread checksums and copies)."""

    def __init__(self, path: pathlib.Path, every: int = _FLUSH_BYTES) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._every = every
        self._pending = 0
        self._wake = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="geompi-ckpt-fsync", daemon=True)
        self._thread.start()

    def wrote(self, nbytes: int) -> None:
        self._pending += nbytes
        if self._pending >= self._every:
            self._pending = 0
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._done:
                return
            try:
                os.fdatasync(self._fd)
            except OSError:
                return  # the final fsync in save() reports any real problem

    def __enter__(self) -> _Flusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._done = True
        self._wake.set()
        self._thread.join()
        os.close(self._fd)


def _fsync_path(path: pathlib.Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return  # some platforms cannot open directories; the rename itself is done
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some filesystems refuse fsync on a directory
            raise
    finally:
        os.close(fd)


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno:
        return os.strerror(e.errno)
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _utc_now() -> str:
    # timezone.utc, not datetime.UTC: setup.cfg still allows Python 3.10
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: UP017


def _int_arg(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise CheckpointError(
            f"cannot save checkpoint: {what} must be an integer >= 0, not {value!r}"
        )
    return int(value)


def save(
    path: str | os.PathLike,
    *,
    model: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    optimizer_attrs: Mapping[str, Any] | None = None,
    algorithm: Mapping[str, Any] | None = None,
    progress: Mapping[str, Any] | None = None,
    step: int = 0,
    epoch: int = 0,
    algorithm_name: str = "fsa",
    topology: Mapping | None = None,
    config: Mapping | None = None,
    metrics: Mapping | None = None,
) -> pathlib.Path:
    """Write one checkpoint file atomically (temporary file, fsync, rename, fsync of the dir).

    Returns the final path. Raises CheckpointError for bad input or an unwritable directory.
    """
    path = pathlib.Path(path)
    step = _int_arg(step, "step")
    epoch = _int_arg(epoch, "epoch")
    if not isinstance(algorithm_name, str) or not algorithm_name:
        raise CheckpointError(f"cannot save checkpoint: bad algorithm name {algorithm_name!r}")
    if not isinstance(model, Mapping):
        raise CheckpointError("cannot save checkpoint: model must be a mapping of name to tensor")

    # Check and encode everything before the file system is touched.
    root = _Node()
    root.children["model"] = _tensor_node(model, "/model")
    opt = _Node(attrs=_encode_attrs(optimizer_attrs or {}, "/optimizer"))
    for state, tensors in (optimizer or {}).items():
        _check_name(state, "/optimizer")
        if not isinstance(tensors, Mapping):
            raise CheckpointError(f"cannot save /optimizer/{state}: expected a mapping of tensors")
        opt.children[state] = _tensor_node(tensors, f"/optimizer/{state}")
    root.children["optimizer"] = opt
    root.children["algorithm"] = _tree_node(algorithm, "/algorithm")
    for key in _RESERVED_PROGRESS:
        if progress and key in progress:
            raise CheckpointError(
                f"cannot save /progress: {key!r} is reserved (pass step=/epoch= to save)"
            )
    prog = _tree_node(progress, "/progress")
    prog.attrs = {"step": np.int64(step), "epoch": np.int64(epoch), **prog.attrs}
    root.children["progress"] = prog
    root.attrs = {
        "format": FORMAT,
        "format_version": np.int64(FORMAT_VERSION),
        "geompi_version": _geompi_version(),
        "algorithm": algorithm_name,
        "step": np.int64(step),
        "epoch": np.int64(epoch),
        "topology": _dumps(topology if topology is not None else {}, "topology"),
        "config": _dumps(config if config is not None else {}, "config"),
        "created": _utc_now(),
        "model_fingerprint": fingerprint(model),
        "metrics": _dumps(metrics if metrics is not None else {}, "metrics"),
    }

    directory = path.parent
    tmp = directory / f".{path.name}.tmp-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with h5py.File(tmp, "w", libver=_LIBVER, track_order=True, **_LOCKING) as f:
            with _Flusher(tmp) as flusher:
                _write_node(f, root, flusher)
        _fsync_path(tmp)
        os.replace(tmp, path)
        _fsync_path(directory, directory=True)
    except OSError as e:
        _remove_quietly(tmp)
        raise CheckpointError(
            f"cannot write checkpoint to {directory}: {_reason(e)}; pass a writable "
            "--checkpoint-dir"
        ) from None
    except BaseException:
        _remove_quietly(tmp)
        raise
    return path


def _remove_quietly(p: pathlib.Path) -> None:
    try:
        p.unlink(missing_ok=True)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Reading


@dataclass
class Checkpoint:
    """Everything a checkpoint holds, in memory.

    `algorithm` and `progress` are nested dicts: tensors (or bytes) and sub-dicts, with the
    group attributes inline as plain values, exactly as given to save(). `attrs` holds the root
    attributes, with topology/config/metrics parsed from JSON.
    """

    model: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]]
    optimizer_attrs: dict[str, Any]
    algorithm: dict[str, Any]
    progress: dict[str, Any]
    attrs: dict[str, Any]
    path: pathlib.Path | None = None

    @property
    def step(self) -> int:
        return int(self.attrs["step"])

    @property
    def epoch(self) -> int:
        return int(self.attrs["epoch"])

    @property
    def algorithm_name(self) -> str:
        return str(self.attrs["algorithm"])

    @property
    def fingerprint(self) -> str:
        return str(self.attrs["model_fingerprint"])


class _Problem(Exception):
    """Stops a read that cannot continue (collect mode)."""


def _decode_attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [_decode_attr(v) for v in value.tolist()]
    return value


class _Reader:
    """Reads a checkpoint, either raising the first problem or collecting all of them."""

    def __init__(self, path: str | os.PathLike, *, collect: bool, full: bool) -> None:
        self.path = pathlib.Path(path)
        self.collect = collect
        self.full = full
        self.problems: list[str] = []
        self.n_datasets = 0

    def problem(self, msg: str, fatal: bool = False) -> None:
        line = " ".join(f"checkpoint {self.path}: {msg}".split("\n"))
        if not self.collect:
            raise CheckpointError(line)
        self.problems.append(line)
        if fatal:
            raise _Problem

    def open(self) -> h5py.File:
        p = self.path
        if not p.exists():
            self.problem("no such file", fatal=True)
        if p.is_dir():
            self.problem("is a directory, not a checkpoint file", fatal=True)
        try:
            size = p.stat().st_size
            if size == 0:
                self.problem("is empty (an interrupted copy?); use an earlier checkpoint", True)
            if not h5py.is_hdf5(p):
                self.problem(
                    "not an HDF5 file (no HDF5 signature), so not a geompi checkpoint", True
                )
            return h5py.File(p, "r", **_LOCKING)
        except OSError as e:
            text = str(e)
            m = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", text)
            if m:
                self.problem(
                    f"truncated ({m.group(1)} of {m.group(2)} bytes): it was cut short by an "
                    "interrupted copy or a full disk; use an earlier checkpoint",
                    fatal=True,
                )
            self.problem(f"cannot be opened ({_reason(e)})", fatal=True)
        raise AssertionError("unreachable")

    # attributes

    def attrs_of(self, obj: h5py.HLObject) -> dict[str, Any]:
        out = {k: _decode_attr(obj.attrs[k]) for k in obj.attrs}
        json_keys = out.pop(_JSON_KEYS, None)
        if json_keys is not None:
            try:
                keys = json.loads(json_keys)
            except (TypeError, ValueError):
                keys = []
                self.problem(f"attribute {obj.name}@{_JSON_KEYS} is not a JSON list")
            for key in keys:
                try:
                    out[key] = json.loads(out[key])
                except (KeyError, TypeError, ValueError):
                    self.problem(f"attribute {obj.name}@{key} is missing or not valid JSON")
        return out

    def header(self, f: h5py.File) -> dict[str, Any]:
        attrs = self.attrs_of(f)
        fmt = attrs.get("format")
        if fmt != FORMAT:
            what = "no format attribute" if fmt is None else f"its format attribute is {fmt!r}"
            self.problem(f"not a geompi checkpoint ({what}, expected {FORMAT!r})", fatal=True)
        version = attrs.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int):
            self.problem("format_version attribute is missing or not an integer", fatal=True)
        if version > FORMAT_VERSION:
            self.problem(
                f"written by format_version {version}, this geompi reads {FORMAT_VERSION}: "
                "upgrade geompi",
                fatal=True,
            )
        if version < 1:
            self.problem(f"format_version {version} is not a valid version", fatal=True)
        for key in REQUIRED_ATTRS:
            if key not in attrs:
                self.problem(
                    f"missing root attribute {key!r}: the file is incomplete or was not written "
                    "by geompi; use an earlier checkpoint"
                )
        for key in ("step", "epoch"):
            value = attrs.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int):
                self.problem(f"root attribute {key!r} is not an integer ({value!r})")
                value = 0
            attrs[key] = value
        for key in _JSON_ROOT_ATTRS:
            if key in attrs:
                try:
                    attrs[key] = json.loads(attrs[key])
                except (TypeError, ValueError):
                    self.problem(f"root attribute {key!r} is not valid JSON")
                    attrs[key] = {}
        for key, default in (("algorithm", ""), ("model_fingerprint", ""), ("created", "")):
            attrs.setdefault(key, default)
        for key in _JSON_ROOT_ATTRS:
            attrs.setdefault(key, {})
        for name in REQUIRED_GROUPS:
            if not isinstance(f.get(name, getlink=False), h5py.Group):
                self.problem(
                    f"missing group /{name}: the file is incomplete or was not written by "
                    "geompi; use an earlier checkpoint"
                )
        return attrs

    # datasets

    def dataset(self, ds: h5py.Dataset) -> torch.Tensor | bytes | None:
        self.n_datasets += 1
        name = ds.name
        attrs = {k: _decode_attr(ds.attrs[k]) for k in ds.attrs}
        dtype_name = attrs.get("dtype")
        if dtype_name is None:
            self.problem(f"dataset {name} has no dtype attribute")
            dtype = next((t for t, n in _NUMPY_OF.items() if n == ds.dtype), None)
        else:
            dtype = _DTYPES.get(dtype_name)
            if dtype is None:
                self.problem(
                    f"dataset {name} has unknown dtype {dtype_name!r} (written by a newer "
                    "geompi?): upgrade geompi"
                )
        stored = _NUMPY_OF.get(_STORED_AS.get(dtype, dtype)) if dtype is not None else None
        if dtype is not None and ds.dtype != stored:
            self.problem(f"dataset {name} holds {ds.dtype} data, but its dtype says {dtype_name}")
            dtype = None
        if self.full and not ds.fletcher32:
            self.problem(f"dataset {name} has no fletcher32 checksum")
        scalar = bool(attrs.get("scalar", 0))
        if scalar and ds.shape != (1,):
            self.problem(f"dataset {name} is marked scalar but has shape {ds.shape}")
            scalar = False
        try:
            arr = _read_chunks(ds)
            if arr is None:
                arr = ds[()]
        except OSError as e:
            if "filter" in str(e):
                self.problem(
                    f"dataset {name} is corrupt (its fletcher32 checksum does not match): the "
                    "file was damaged on disk or in transit; use an earlier checkpoint or a good "
                    "copy"
                )
            else:
                self.problem(f"dataset {name} cannot be read ({_reason(e)})")
            return None
        if dtype is None:
            return None
        if attrs.get("kind") == "bytes":
            return arr.tobytes()
        if scalar:
            arr = arr.reshape(())
        t = torch.from_numpy(arr)  # h5py returns a fresh C-ordered array
        return t.view(dtype) if dtype in _STORED_AS else t

    def tensors(self, group: h5py.Group) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, obj in group.items():
            if not isinstance(obj, h5py.Dataset):
                self.problem(f"{obj.name} should be a dataset")
                continue
            value = self.dataset(obj)
            if isinstance(value, torch.Tensor):
                out[name] = value
        return out

    def tree(self, group: h5py.Group) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, obj in group.items():
            if isinstance(obj, h5py.Group):
                out[name] = self.tree(obj)
            elif isinstance(obj, h5py.Dataset):
                value = self.dataset(obj)
                if value is not None:
                    out[name] = value
        out.update(self.attrs_of(group))
        return out

    def read(
        self, *, model_only: bool = False, expect_fingerprint: str | None = None
    ) -> Checkpoint | None:
        try:
            with self.open() as f:
                try:
                    return self._read(f, model_only, expect_fingerprint)
                except OSError as e:
                    self.problem(
                        f"cannot be read ({_reason(e)}): the file is damaged; use an earlier "
                        "checkpoint",
                        fatal=True,
                    )
        except _Problem:
            return None
        return None

    def _read(self, f: h5py.File, model_only: bool, expect_fingerprint: str | None) -> Checkpoint:
        attrs = self.header(f)
        if expect_fingerprint is not None and attrs["model_fingerprint"] != expect_fingerprint:
            msg = (
                f"checkpoint {self.path} is of a different model (fingerprint "
                f"{str(attrs['model_fingerprint'])[:12]}, expected {expect_fingerprint[:12]}): "
                "pass the same --model/--dataset as the run that wrote it"
            )
            if not self.collect:
                raise CheckpointError(msg)
            self.problems.append(msg)

        def group(name: str) -> h5py.Group | None:
            obj = f.get(name)
            return obj if isinstance(obj, h5py.Group) else None

        g = group("model")
        before = len(self.problems)
        model = self.tensors(g) if g is not None else {}
        model_ok = g is not None and len(self.problems) == before
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        optimizer_attrs: dict[str, Any] = {}
        algorithm: dict[str, Any] = {}
        progress: dict[str, Any] = {}
        if not model_only:
            g = group("optimizer")
            if g is not None:
                for state, obj in g.items():
                    if isinstance(obj, h5py.Group):
                        optimizer[state] = self.tensors(obj)
                    else:
                        self.problem(f"{obj.name} should be a group of tensors")
                optimizer_attrs = self.attrs_of(g)
            g = group("algorithm")
            algorithm = self.tree(g) if g is not None else {}
            g = group("progress")
            progress = self.tree(g) if g is not None else {}
            for key in _RESERVED_PROGRESS:
                progress.pop(key, None)
        if self.full and not model_only:
            for name, obj in f.items():  # foreign datasets still get their checksums checked
                if name not in REQUIRED_GROUPS:
                    self._touch(obj)
        if self.full and model_ok and fingerprint(model) != attrs["model_fingerprint"]:
            self.problem(
                "the model_fingerprint attribute does not match the /model tensors (the file "
                "was edited or damaged); use an earlier checkpoint"
            )
        return Checkpoint(model, optimizer, optimizer_attrs, algorithm, progress, attrs, self.path)

    def _touch(self, obj: h5py.HLObject) -> None:
        if isinstance(obj, h5py.Dataset):
            try:
                obj[()]
            except OSError as e:
                self.problem(f"dataset {obj.name} cannot be read ({_reason(e)})")
            self.n_datasets += 1
        elif isinstance(obj, h5py.Group):
            for child in obj.values():
                self._touch(child)


def load(
    path: str | os.PathLike, *, verify: bool = True, expect_fingerprint: str | None = None
) -> Checkpoint:
    """Read a whole checkpoint into memory, or raise CheckpointError (one line) and return nothing.

    HDF5 always checks each chunk's fletcher32; verify=True also checks that the file is complete
    and consistent (fingerprint, filters), exactly what verify() reports.
    """
    ck = _Reader(path, collect=False, full=verify).read(expect_fingerprint=expect_fingerprint)
    assert ck is not None
    return ck


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Only the model tensors of a checkpoint (checked like load(verify=True))."""
    ck = _Reader(path, collect=False, full=True).read(model_only=True)
    assert ck is not None
    return ck.model


def _verify(path: str | os.PathLike) -> tuple[list[str], int, int | None]:
    reader = _Reader(path, collect=True, full=True)
    ck = reader.read()
    return reader.problems, reader.n_datasets, ck.step if ck is not None else None


def verify(path: str | os.PathLike) -> list[str]:
    """All problems of a checkpoint (one line each), [] if it is good; reads every dataset."""
    return _verify(path)[0]


# --------------------------------------------------------------------------------------------
# Export


def _write_npz(path: pathlib.Path, tensors: Mapping[str, torch.Tensor]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, t in tensors.items():
            if t.dtype in _STORED_AS:  # numpy has no bfloat16/float8: widen exactly to float32
                t = t.to(torch.float32)
            with zf.open(name + ".npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, t.numpy(), allow_pickle=False)


EXPORT_SUFFIXES = (".pt", ".safetensors", ".npz")


def export(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the model of a checkpoint as .pt (torch.save), .safetensors or .npz (by suffix).

    npz has no bfloat16/float8, so those are widened (exactly) to float32 there.
    """
    out = pathlib.Path(out)
    suffix = out.suffix.lower()
    if suffix not in EXPORT_SUFFIXES:
        raise ValueError(
            f"cannot export to {out}: unknown suffix {out.suffix!r} "
            f"(use {', '.join(EXPORT_SUFFIXES)})"
        )
    ck = _Reader(path, collect=False, full=True).read(model_only=True)
    assert ck is not None
    model = ck.model
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        if suffix == ".pt":
            torch.save(model, tmp)
        elif suffix == ".safetensors":
            from safetensors.torch import save_file

            meta = {"geompi_checkpoint": str(path), "step": str(ck.step)}
            save_file(model, str(tmp), metadata=meta)
        else:
            _write_npz(tmp, model)
        os.replace(tmp, out)
    except OSError as e:
        _remove_quietly(tmp)
        raise CheckpointError(f"cannot write {out}: {_reason(e)}") from None
    except (TypeError, ValueError, RuntimeError) as e:  # e.g. a dtype safetensors lacks
        _remove_quietly(tmp)
        raise CheckpointError(f"cannot export {path} to {out}: {_reason(e)}") from None
    except BaseException:
        _remove_quietly(tmp)
        raise


# --------------------------------------------------------------------------------------------
# Command line


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _fmt(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _stats(t: torch.Tensor) -> str:
    if t.numel() == 0:
        return "empty"
    if t.is_complex():
        d = t.to(torch.complex128)
        return f"mean={complex(d.mean()):.6g} norm={float(d.abs().norm()):.6g}"
    d = t.to(torch.float64)
    return (
        f"min={float(d.min()):.6g} max={float(d.max()):.6g} mean={float(d.mean()):.6g} "
        f"norm={float(d.norm()):.6g}"
    )


def _inspect(path: str) -> int:
    reader = _Reader(path, collect=False, full=False)
    with reader.open() as f:
        attrs = reader.header(f)  # a file that cannot be interpreted raises here
        reader.collect = True  # from here on show what can be shown and report the rest
        total_tensors = total_bytes = 0
        print(f"{path}  ({os.path.getsize(path)} bytes on disk)")
        for key, value in attrs.items():
            print(f"  @{key} = {_fmt(value)}")

        def walk(group: h5py.Group, depth: int) -> None:
            nonlocal total_tensors, total_bytes
            pad = "  " * depth
            for key, value in reader.attrs_of(group).items():
                print(f"{pad}@{key} = {_fmt(value)}")
            for name, obj in group.items():
                if isinstance(obj, h5py.Group):
                    print(f"{pad}{name}/")
                    walk(obj, depth + 1)
                    continue
                value = reader.dataset(obj)
                if isinstance(value, bytes):
                    print(f"{pad}{name}  bytes  [{len(value)}]  {len(value)} B")
                    total_tensors += 1
                    total_bytes += len(value)
                elif value is not None:
                    nbytes = value.numel() * value.element_size()
                    dt = str(value.dtype).removeprefix("torch.")
                    print(f"{pad}{name}  {dt}  {list(value.shape)}  {nbytes} B  {_stats(value)}")
                    total_tensors += 1
                    total_bytes += nbytes
                else:
                    print(f"{pad}{name}  UNREADABLE (see the errors below)")

        try:
            for name, obj in f.items():
                if isinstance(obj, h5py.Group):
                    print(f"/{name}/")
                    walk(obj, 1)
        except _Problem:  # pragma: no cover - only fatal problems raise, and those came earlier
            pass
    print(f"{total_tensors} tensors, {total_bytes} bytes")
    for line in reader.problems:
        _print_error(line)
    return 1 if reader.problems else 0


def _flatten(ck: Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    attrs: dict[str, Any] = {
        f"@{k}": v for k, v in ck.attrs.items() if k not in ("created", "geompi_version")
    }
    for k, v in ck.model.items():
        tensors[f"/model/{k}"] = v
    for state, d in ck.optimizer.items():
        for k, v in d.items():
            tensors[f"/optimizer/{state}/{k}"] = v
    for k, v in ck.optimizer_attrs.items():
        attrs[f"/optimizer@{k}"] = v

    def tree(prefix: str, d: Mapping[str, Any]) -> None:
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{prefix}/{k}"] = v
            elif isinstance(v, bytes):
                tensors[f"{prefix}/{k}"] = torch.frombuffer(bytearray(v), dtype=torch.uint8)
            elif isinstance(v, Mapping):
                tree(f"{prefix}/{k}", v)
            else:
                attrs[f"{prefix}@{k}"] = v

    tree("/algorithm", ck.algorithm)
    tree("/progress", ck.progress)
    return tensors, attrs


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.is_complex():
        d = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
        both_nan = a.isnan() & b.isnan()
    else:
        x, y = a.to(torch.float64), b.to(torch.float64)
        d = (x - y).abs()
        both_nan = x.isnan() & y.isnan()
        d = torch.where((x == y) | both_nan, torch.zeros_like(d), d)  # inf == inf
        return float(d.max())
    return float(torch.where(both_nan, torch.zeros_like(d), d).max())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _diff(path_a: str, path_b: str) -> int:
    try:
        ta, aa = _flatten(load(path_a))
        tb, ab = _flatten(load(path_b))
    except CheckpointError as e:
        _print_error(str(e))
        return 2  # like diff(1): trouble is 2, different is 1
    differences = 0
    for key, a in ta.items():
        if key not in tb:
            continue
        b = tb[key]
        da, db = (str(t.dtype).removeprefix("torch.") for t in (a, b))
        if da != db:
            print(f"{key}: dtype {da} != {db}")
            differences += 1
        elif a.shape != b.shape:
            print(f"{key}: shape {list(a.shape)} != {list(b.shape)}")
            differences += 1
        else:
            same = _same_bits(a, b)
            print(f"{key}: max abs diff {_max_abs_diff(a, b):.6g}{'' if same else '  (differs)'}")
            differences += not same
    for key in ta:
        if key not in tb:
            print(f"only in A: {key}")
            differences += 1
    for key in tb:
        if key not in ta:
            print(f"only in B: {key}")
            differences += 1
    for key in dict.fromkeys([*aa, *ab]):
        if key not in ab:
            print(f"only in A: attribute {key} = {_fmt(aa[key])}")
            differences += 1
        elif key not in aa:
            print(f"only in B: attribute {key} = {_fmt(ab[key])}")
            differences += 1
        elif aa[key] != ab[key]:
            print(f"attribute {key}: {_fmt(aa[key])} != {_fmt(ab[key])}")
            differences += 1
    print("identical" if differences == 0 else f"{differences} differences")
    return 0 if differences == 0 else 1


def _ls(directory: str) -> int:
    if not os.path.isdir(directory):
        raise _UsageError(f"{directory} is not a directory")
    rows = [("NAME", "STEP", "EPOCH", "ALGORITHM", "TEST_ACC", "CREATED")]
    for p in list_checkpoints(directory):
        reader = _Reader(p, collect=False, full=False)
        try:
            with reader.open() as f:
                attrs = reader.header(f)
        except (CheckpointError, OSError) as e:
            why = str(e).split(": ", 1)[-1] if isinstance(e, CheckpointError) else _reason(e)
            rows.append((p.name, "?", "?", "?", "?", f"unreadable: {why}"))
            continue
        acc = attrs["metrics"].get("test_acc") if isinstance(attrs["metrics"], dict) else None
        acc_text = f"{acc:.4f}" if isinstance(acc, (int, float)) else "-"
        rows.append(
            (p.name, str(attrs["step"]), str(attrs["epoch"]), str(attrs["algorithm"]), acc_text,
             str(attrs["created"]))
        )  # fmt: skip
    if len(rows) == 1:
        print(f"no checkpoints in {directory}")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0


def _cmd_verify(paths: list[str]) -> int:
    bad = 0
    for path in paths:
        problems, n, step = _verify(path)
        if problems:
            bad += 1
            for line in problems:
                print(line)
        else:
            print(f"OK {path} ({n} tensors, step {step})")
    return 1 if bad else 0


def _cmd_export(path: str, out: str) -> int:
    if pathlib.Path(out).suffix.lower() not in EXPORT_SUFFIXES:
        raise _UsageError(
            f"cannot export to {out}: unknown suffix (use {', '.join(EXPORT_SUFFIXES)})"
        )
    export(path, out)
    print(f"wrote {out}")
    return 0


def _print_error(msg: str) -> None:
    print("geompi.ckpt: error: " + " ".join(str(msg).split()), file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m geompi.ckpt",
        description="Inspect, verify, compare, export and list geompi checkpoints (HDF5).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("inspect", help="attributes and tensors (shape, dtype, size, statistics)")
    p.add_argument("file")
    p = sub.add_parser("verify", help="check every checksum and attribute; exit 1 if bad")
    p.add_argument("files", nargs="+", metavar="file")
    p = sub.add_parser("diff", help="max abs difference per tensor; exit 1 if different")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("export", help="write the model as .pt, .safetensors or .npz")
    p.add_argument("file")
    p.add_argument("--to", required=True, metavar="OUT")
    p = sub.add_parser("ls", help="list the checkpoints of a directory")
    p.add_argument("directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `python -m geompi.ckpt` command line; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        _print_error(f"{e} (see python -m geompi.ckpt --help)")
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    try:
        if args.command == "inspect":
            return _inspect(args.file)
        if args.command == "verify":
            return _cmd_verify(args.files)
        if args.command == "diff":
            return _diff(args.a, args.b)
        if args.command == "export":
            return _cmd_export(args.file, args.to)
        return _ls(args.directory)
    except _UsageError as e:
        _print_error(str(e))
        return 2
    except CheckpointError as e:
        _print_error(str(e))
        return 1
    except BrokenPipeError:  # e.g. `inspect FILE | head`
        sys.stdout = open(os.devnull, "w")  # silence the flush at exit
        return 0
    except OSError as e:  # e.g. a file damaged in a way HDF5 notices late
        _print_error(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
