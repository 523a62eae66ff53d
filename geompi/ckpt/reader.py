"""Reading and verifying a checkpoint."""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch

from geompi.ckpt.checksum import _fletcher32_padded
from geompi.ckpt.files import _reason
from geompi.ckpt.format import (
    _DIRECT_MIN_BYTES,
    _DTYPES,
    _JSON_KEYS,
    _JSON_ROOT_ATTRS,
    _LOCKING,
    _NUMPY_OF,
    _RESERVED_PROGRESS,
    _STORED_AS,
    FORMAT,
    FORMAT_VERSION,
    REQUIRED_ATTRS,
    REQUIRED_GROUPS,
    _chunk_buffer,
    _chunk_split,
    _chunk_walk,
    fingerprint,
)
from geompi.errors import CheckpointError


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
