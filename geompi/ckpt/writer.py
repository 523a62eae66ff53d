"""Writing a checkpoint: check and encode everything, then temp file, fsync, rename."""

from __future__ import annotations

import dataclasses
import enum
import errno
import hashlib
import json
import os
import pathlib
import re
import struct
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import h5py
import numpy as np
import torch

from geompi.ckpt.checksum import _fletcher32_padded
from geompi.ckpt.files import (
    _fsync_path,
    _reason,
    _remove_quietly,
    create_temp,
    next_sequence,
    same_file,
)
from geompi.ckpt.format import (
    _DIRECT_MIN_BYTES,
    _DTYPE_NAME,
    _JSON_KEYS,
    _LIBVER,
    _LOCKING,
    _RESERVED_PROGRESS,
    _STORED_AS,
    DATA_DIGEST_ATTR,
    DIGEST_ATTR,
    FORMAT,
    FORMAT_VERSION,
    _chunk_buffer,
    _chunk_layout,
    _chunk_walk,
    _geompi_version,
    content_digest,
    data_digest,
    fingerprint,
)
from geompi.errors import CheckpointError, CheckpointWriteError

# One helper thread prepares (copies and checksums) the next chunk while the current one is written.
_CHECKSUMS = ThreadPoolExecutor(1, thread_name_prefix="geompi-ckpt-checksum")
# While writing, a helper thread starts an fsync after this many bytes.
_FLUSH_BYTES = 64 << 20


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
        if isinstance(value, str) and "\x00" not in value:  # (fixed-length text drops NULs)
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


def _write_chunks(
    ds: h5py.Dataset,
    arr: np.ndarray,
    chunks: tuple[int, ...],
    split: int,
    flusher: _Flusher | None = None,
) -> str:
    """Write `arr` chunk by chunk with our own fletcher32 (the filter is then marked applied);
    returns the sha256 of its bytes (data_digest).

    A helper thread copies and checksums chunk k+1 while this one writes chunk k (numpy, hashlib
    and the write release the GIL), with two buffers taking turns. The chunks are walked in C
    order, one after the other, so the helper's sha256 sees the array's bytes in order.
    """
    digest = hashlib.sha256()
    chunk_bytes, padded, first = _chunk_buffer(arr.shape, arr.itemsize, split, chunks[split])
    bufs = [first, np.zeros_like(first)]
    flat = arr.reshape(-1).view(np.uint8)

    def prepare(buf: np.ndarray, begin: int, nbytes: int) -> np.ndarray:
        buf[:nbytes] = flat[begin : begin + nbytes]
        digest.update(buf[:nbytes])
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
    return digest.hexdigest()


def _write_dataset(
    group: h5py.Group, name: str, value: Any, flusher: _Flusher | None = None
) -> None:
    if isinstance(value, bytes):
        arr, dtype_name, scalar = np.frombuffer(value, np.uint8), "uint8", False
    else:
        arr, dtype_name, scalar = _tensor_to_numpy(value)
    sha256 = None
    if arr.size == 0:
        ds = group.create_dataset(name, data=arr, chunks=True, fletcher32=True)
    else:
        chunks, split = _chunk_layout(arr.shape, arr.itemsize)
        if arr.nbytes >= _DIRECT_MIN_BYTES and arr.dtype.kind in "iuf":
            ds = group.create_dataset(
                name, shape=arr.shape, dtype=arr.dtype, chunks=chunks, fletcher32=True
            )
            sha256 = _write_chunks(ds, arr, chunks, split, flusher)
        else:
            ds = group.create_dataset(name, data=arr, chunks=chunks, fletcher32=True)
    _set_attr(ds, "dtype", dtype_name)
    if scalar:
        ds.attrs["scalar"] = np.int8(1)
    if isinstance(value, bytes):
        _set_attr(ds, "kind", "bytes")
    _set_attr(ds, DATA_DIGEST_ATTR, sha256 or data_digest(arr))


def _set_attr(obj: h5py.HLObject, key: str, value: Any) -> None:
    """Text as fixed-length UTF-8, stored in the (checksummed) attribute message itself: h5py's
    default, variable-length text, lives in HDF5's global heap, which has no checksum."""
    if isinstance(value, str):
        raw = value.encode("utf-8")
        obj.attrs.create(key, np.array(raw), dtype=h5py.string_dtype("utf-8", max(1, len(raw))))
    else:
        obj.attrs[key] = value


def _write_node(group: h5py.Group, node: _Node, flusher: _Flusher | None = None) -> None:
    for name, child in node.children.items():
        if isinstance(child, _Node):
            _write_node(group.create_group(name, track_order=True), child, flusher)
        else:
            _write_dataset(group, name, child, flusher)
    for key, value in node.attrs.items():
        _set_attr(group, key, value)


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


def _utc_now() -> str:
    # timezone.utc, not datetime.UTC: pyproject.toml still allows Python 3.10
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: UP017


def _int_arg(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise CheckpointError(
            f"cannot save checkpoint: {what} must be an integer >= 0, not {value!r}"
        )
    return int(value)


_HDF5_ERRNO = re.compile(r"errno = (\d+)")
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _size(node: _Node) -> tuple[int, int]:
    """(payload bytes, datasets) of a tree to write."""
    nbytes = datasets = 0
    for child in node.children.values():
        if isinstance(child, _Node):
            b, d = _size(child)
            nbytes, datasets = nbytes + b, datasets + d
        elif isinstance(child, torch.Tensor):
            nbytes, datasets = nbytes + child.numel() * child.element_size(), datasets + 1
        else:
            nbytes, datasets = nbytes + len(child), datasets + 1
    return nbytes, datasets


def _check_space(directory: pathlib.Path, root: _Node) -> None:
    """Refuse to start a file the file system cannot hold: HDF5 meeting ENOSPC halfway
    leaks its objects (errors at deallocation, and a crash when the library shuts down)."""
    nbytes, datasets = _size(root)
    need = nbytes + 1024 * datasets + 64 * 1024
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)} ({free / 2**20:.2f} MiB free, the checkpoint needs "
            f"about {need / 2**20:.2f} MiB)",
        )


def _reserve(fd: int, root: _Node) -> None:
    """Have the file system allocate the whole file first (then give it back): a file-size
    limit (EFBIG) or a disk filled since ``_check_space`` fails here, as a plain OSError, and
    not halfway through HDF5's writes, which leaks its objects (a traceback per object at
    deallocation, then a crash when the library shuts down)."""
    nbytes, datasets = _size(root)
    try:
        os.posix_fallocate(fd, 0, nbytes + 1024 * datasets + 64 * 1024)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    os.ftruncate(fd, 0)


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
        # the write order in the directory: --resume latest and rotation go by it, not mtime
        "sequence": np.int64(next_sequence(path.parent)),
        "model_fingerprint": fingerprint(model),
        "metrics": _dumps(metrics if metrics is not None else {}, "metrics"),
    }

    directory = path.parent
    tmp: pathlib.Path | None = None
    fd = -1
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _check_space(directory, root)
        fd, tmp = create_temp(directory, path.name)  # exclusive: never through a symlink
        _reserve(fd, root)
        with h5py.File(tmp, "w", libver=_LIBVER, track_order=True, **_LOCKING) as f:
            if not same_file(fd, tmp):  # replaced between our create and HDF5's open
                raise CheckpointError(
                    f"cannot write checkpoint to {directory}: the temporary file {tmp.name} was "
                    "replaced by someone else while geompi wrote it; pass a --checkpoint-dir "
                    "only you can write to"
                )
            with _Flusher(tmp) as flusher:
                _write_node(f, root, flusher)
            _set_attr(f, DIGEST_ATTR, content_digest(f))  # last: it covers everything else
        _fsync_path(tmp)
        os.replace(tmp, path)
        tmp = None
        _fsync_path(directory, directory=True)
    except (OSError, RuntimeError) as e:
        # HDF5 reports a failed write (a full disk) as a RuntimeError from h5py, when the file
        # is closed: "file write failed: ... errno = 28, error message = '...'".
        code = _HDF5_ERRNO.search(str(e))
        if not isinstance(e, OSError) and code is None:
            _remove_quietly(tmp)
            raise
        _remove_quietly(tmp)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC and e.strerror:
            reason = e.strerror
        else:
            reason = os.strerror(int(code.group(1))) if code else _reason(e)
        full = (code and int(code.group(1)) in _FULL) or getattr(e, "errno", None) in _FULL
        fix = (
            "free some space or pass a writable --checkpoint-dir"
            if full
            else ("pass a writable --checkpoint-dir")
        )
        raise CheckpointWriteError(
            f"cannot write checkpoint to {directory}: {reason}; {fix}"
        ) from None
    except BaseException:
        _remove_quietly(tmp)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    return path
