"""Reading and verifying a checkpoint."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import struct
from dataclasses import dataclass
from typing import Any, NoReturn

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
    DATA_DIGEST_ATTR,
    DIGEST_ATTR,
    FORMAT,
    FORMAT_VERSION,
    REQUIRED_ATTRS,
    REQUIRED_GROUPS,
    _chunk_buffer,
    _chunk_split,
    _chunk_walk,
    content_digest,
    data_digest,
    fingerprint,
)
from geompi.errors import CheckpointError, CheckpointMismatchError
from geompi.h5untrusted import (
    DatasetPolicy,
    check_dataset,
    check_link,
    numeric_type,
    scalar_attr_type,
    type_name,
)


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


# A checkpoint is untrusted input: what a file may declare, so that no file can make a reader
# allocate, recurse or follow more than this (see docs/checkpoint-format.md, "Untrusted input").
MAX_OBJECTS = 1_000_000  # groups and datasets in one file
MAX_GROUP_DEPTH = 32  # groups inside groups
MAX_ATTRS = 10_000  # attributes on one object
MAX_ATTR_BYTES = 16 << 20  # one attribute value (text or JSON)
MAX_JSON_DEPTH = 64  # nesting of [] and {} in one JSON attribute

# Errors that h5py, numpy or json raise on files they cannot make sense of: never a traceback.
_HOSTILE_ERRORS = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    RuntimeError,
    RecursionError,
    MemoryError,
    OverflowError,
)

# Checkpoint datasets: numbers, fletcher32 alone, every byte stored (no more than the file holds)
_CKPT_DATASETS = DatasetPolicy(
    filters=frozenset({h5py.h5z.FILTER_FLETCHER32}),
    type_ok=numeric_type,
    type_words="numbers",
    fix="the file was not written by geompi: use a checkpoint written by geompi",
)
# A string, or an unterminated one to the end: with the closing quote optional, a match never
# fails, so the scan is linear (a required quote made it retry from every quote: quadratic)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)


def _untrusted(what: str) -> str:
    return (
        f"{what}; geompi never writes that, so the file was not written by geompi or was "
        "altered: do not use it, use a checkpoint written by geompi"
    )


def _json_depth(text: str) -> int:
    """How deeply [] and {} nest in `text` (brackets inside JSON strings do not count)."""
    raw = np.frombuffer(_JSON_STRING.sub('""', text).encode("utf-8", "replace"), np.uint8)
    if raw.size == 0:
        return 0
    step = (raw == ord("[")).astype(np.int32) + (raw == ord("{"))
    step -= (raw == ord("]")).astype(np.int32) + (raw == ord("}"))
    return int(np.cumsum(step).max())


def _link_names(gid: h5py.h5g.GroupID, limit: int) -> list[bytes]:
    """The link names of a group, at most `limit` of them (links are not followed)."""
    names: list[bytes] = []

    def add(name: bytes) -> int | None:
        names.append(name)
        return 1 if len(names) >= limit else None

    gid.links.iterate(add)
    return names


def _chunk_problem(ds: h5py.Dataset) -> str | None:
    """What keeps HDF5 from checking every byte of a chunked dataset, or None.

    Every chunk must be stored (a missing one reads as unchecked fill values), at its full size
    plus the 4 checksum bytes, with a filter mask of 0: a mask bit tells HDF5 that the chunk
    skipped a filter, and HDF5 then reads it without checking its fletcher32.
    """
    dcpl = ds.id.get_create_plist()
    if dcpl.get_layout() != h5py.h5d.CHUNKED or ds.chunks is None:
        return None
    shape, chunks = ds.shape, ds.chunks
    expected = math.prod(-(-s // c) for s, c in zip(shape, chunks))
    n = ds.id.get_num_chunks()
    if n != expected:
        return (
            f"dataset {ds.name} has {n} of its {expected} chunks stored (the others would read "
            "as unchecked fill values): the file is incomplete or was altered; use an earlier "
            "checkpoint"
        )
    per = math.prod(chunks) * ds.dtype.itemsize + (4 if ds.fletcher32 else 0)
    file_size = ds.file.id.get_filesize()
    bad: list[Any] = []
    misplaced: list[tuple[str, tuple[int, ...]]] = []
    seen: set[tuple[int, ...]] = set()

    def visit(info: Any) -> int | None:
        offset = tuple(int(o) for o in info.chunk_offset)
        inside = len(offset) == len(shape) and all(
            0 <= o < s and o % c == 0 for o, s, c in zip(offset, shape, chunks)
        )
        if not inside or offset in seen:
            misplaced.append(("outside", offset))
            return 1
        seen.add(offset)
        if info.byte_offset is None or info.byte_offset + info.size > file_size:
            misplaced.append(("beyond", offset))
            return 1
        if info.filter_mask != 0 or info.size != per:
            bad.append(info)
            return 1
        return None

    if hasattr(ds.id, "chunk_iter"):
        ds.id.chunk_iter(visit)
    else:  # pragma: no cover - HDF5 older than 1.12.3
        for i in range(n):
            if visit(ds.id.get_chunk_info(i)) is not None:
                break
    if misplaced:
        kind, offset = misplaced[0]
        where = f"chunk {list(offset)} of dataset {ds.name}"
        what = (
            "lies outside the dataset or is stored twice"
            if kind == "outside"
            else "is stored beyond the end of the file"
        )
        return f"{where} {what}: its chunk index was damaged or altered; use an earlier checkpoint"
    if not bad:
        return None
    info = bad[0]
    where = f"chunk {list(info.chunk_offset)} of dataset {ds.name}"
    if info.filter_mask != 0:
        return (
            f"{where} is stored with filter mask {info.filter_mask:#x}, so HDF5 would read it "
            "without checking its fletcher32 checksum: its values were rewritten after geompi "
            "wrote them; use an earlier checkpoint"
        )
    return (
        f"{where} has {info.size} bytes stored, expected {per}: the file was altered; use an "
        "earlier checkpoint"
    )


LEGACY_LINE = (
    f"has no {DIGEST_ATTR} attribute, so geompi cannot check that its tensors and attributes "
    "are intact (written by an older geompi, or altered); if you trust it, re-save it with "
    "`python -m geompi.ckpt resave FILE NEW` and use NEW"
)


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


def _attr_where(path: str, key: str) -> str:
    """ "@step" for a root attribute, "/model@dtype" for others."""
    return f"{'' if path == '/' else path}@{key}"


def _attr_too_big(where: str, nbytes: int) -> str:
    return (
        f"attribute {where} holds {nbytes} bytes, more than the {MAX_ATTR_BYTES} bytes a "
        "checkpoint attribute may hold; geompi never writes that, so the file was not written by "
        "geompi or was altered: use a checkpoint written by geompi"
    )


class _Reader:
    """Reads a checkpoint, either raising the first problem or collecting all of them."""

    def __init__(
        self, path: str | os.PathLike, *, collect: bool, full: bool, legacy: bool = False
    ) -> None:
        self.path = pathlib.Path(path)
        self.legacy = legacy  # whether a file without a content digest may be read
        self.digested = True  # whether this file has one (set by open)
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

    def fatal(self, msg: str) -> NoReturn:
        self.problem(msg, fatal=True)
        raise _Problem  # (collect=False raised in problem())

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
            f = h5py.File(p, "r", **_LOCKING)
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
            raise AssertionError("unreachable") from None
        try:
            _Structure(self).scan(f, size)
            if not self.digested and not self.legacy:
                self.problem(LEGACY_LINE, fatal=True)
        except BaseException:
            f.close()
            raise
        return f

    # attributes

    def raw_attrs(self, obj: h5py.HLObject) -> dict[str, Any]:
        """An object's attributes as Python values; text longer than MAX_ATTR_BYTES is fatal."""
        out = {}
        for key in obj.attrs:
            value = _decode_attr(obj.attrs[key])
            if isinstance(value, str) and len(value) > MAX_ATTR_BYTES // 4:
                nbytes = len(value.encode("utf-8", "replace"))
                if nbytes > MAX_ATTR_BYTES:
                    self.problem(_attr_too_big(_attr_where(obj.name, key), nbytes), fatal=True)
            out[key] = value
        return out

    def json(self, text: Any, where: str) -> tuple[bool, Any]:
        """(True, value) of JSON text, or (False, None) after reporting why it is not."""
        if not isinstance(text, str):
            self.problem(f"attribute {where} is not JSON text ({type(text).__name__})")
            return False, None
        depth = _json_depth(text)
        if depth > MAX_JSON_DEPTH:
            self.problem(
                f"attribute {where} holds JSON nested {depth} levels deep, more than "
                f"{MAX_JSON_DEPTH}; geompi never writes that, so the file was not written by "
                "geompi or was altered: use a checkpoint written by geompi"
            )
            return False, None
        try:
            return True, json.loads(text)
        except (ValueError, RecursionError):
            self.problem(f"attribute {where} is not valid JSON")
            return False, None

    def attrs_of(self, obj: h5py.HLObject) -> dict[str, Any]:
        out = self.raw_attrs(obj)
        json_keys = out.pop(_JSON_KEYS, None)
        if json_keys is not None:
            where = _attr_where(obj.name, _JSON_KEYS)
            ok, keys = self.json(json_keys, where)
            if ok and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
                self.problem(
                    f"attribute {where} is not a JSON list of names: the file was altered; use "
                    "an earlier checkpoint"
                )
            elif ok:
                for key in keys:
                    if key not in out:
                        self.problem(f"attribute {_attr_where(obj.name, key)} is missing")
                        continue
                    ok, value = self.json(out[key], _attr_where(obj.name, key))
                    if ok:
                        out[key] = value
        return out

    def header(self, f: h5py.File) -> dict[str, Any]:
        attrs = self.attrs_of(f)
        attrs.pop(DIGEST_ATTR, None)
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
                ok, value = self.json(attrs[key], _attr_where("/", key))
                attrs[key] = value if ok else {}
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
        attrs = self.raw_attrs(ds)
        dtype_name = attrs.get("dtype")
        if dtype_name is None:
            self.problem(f"dataset {name} has no dtype attribute")
            dtype = next((t for t, n in _NUMPY_OF.items() if n == ds.dtype), None)
        else:
            dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
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
        unchecked = _chunk_problem(ds)
        if unchecked is not None:
            self.problem(unchecked)
            return None
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
        if self.digested and attrs.get(DATA_DIGEST_ATTR) != data_digest(arr):
            what = "has no sha256 attribute" if DATA_DIGEST_ATTR not in attrs else "do not match"
            self.problem(
                f"dataset {name}'s bytes {what} its sha256 attribute: the file was damaged or "
                "altered; use an earlier checkpoint"
                if what == "do not match"
                else f"dataset {name} {what}: the file was altered; use an earlier checkpoint"
            )
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
                except _HOSTILE_ERRORS as e:
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
                raise CheckpointMismatchError(msg)
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
        # the catch-all, after the specific checks: reported when nothing more precise was
        if not self.problems:
            self.check_digest(f)
        return Checkpoint(model, optimizer, optimizer_attrs, algorithm, progress, attrs, self.path)

    def check_digest(self, f: h5py.File) -> None:
        """Compare the file's content (but the datasets' bytes) with its content_sha256."""
        if not self.digested:
            return
        digest = f.attrs[DIGEST_ATTR]
        stored = digest.decode("utf-8", "replace") if isinstance(digest, bytes) else str(digest)
        if content_digest(f) != stored:
            self.problem(
                "its content (names, dtypes, shapes, attributes) does not match its "
                f"{DIGEST_ATTR} attribute: the file was damaged or altered; use an earlier "
                "checkpoint"
            )

    def _touch(self, obj: h5py.HLObject) -> None:
        if isinstance(obj, h5py.Dataset):
            unchecked = _chunk_problem(obj)
            if unchecked is not None:
                self.problem(unchecked)
                self.n_datasets += 1
                return
            try:
                obj[()]
            except OSError as e:
                self.problem(f"dataset {obj.name} cannot be read ({_reason(e)})")
            self.n_datasets += 1
        elif isinstance(obj, h5py.Group):
            for child in obj.values():
                self._touch(child)


class _Structure:
    """The structure of an untrusted file, checked before anything is read: problems go to
    the reader's ``problem``/``fatal``; whether the file carries a digest is set on it."""

    def __init__(self, reader: _Reader) -> None:
        self.r = reader

    def scan(self, f: h5py.File, file_size: int) -> None:
        """Refuse (fatal, one line) whatever geompi never writes, without following anything.

        Walks the groups with the low-level API: links are looked at, never traversed (an
        external link to a FIFO would block, one to another file would read foreign data); each
        object must be reached by exactly one hard link (no cycles, no aliases); datasets are
        numeric, stored in this file (no external storage, no virtual datasets), filtered by
        fletcher32 alone, and declare no more bytes than the file holds; attributes are single
        numbers or text. No dataset is read here.
        """
        try:
            self._scan(f, file_size)
        except _HOSTILE_ERRORS as e:
            self.r.problem(
                f"cannot be read ({_reason(e)}): the file is damaged or was not written by "
                "geompi; use an earlier checkpoint",
                fatal=True,
            )

    def _scan(self, f: h5py.File, file_size: int) -> None:
        self.r.digested = DIGEST_ATTR in f.attrs  # (its name only: no value is read yet)
        root = f.id
        seen = {h5py.h5o.get_info(root).addr}
        self._scan_attrs(root, "/")
        stack: list[tuple[h5py.h5g.GroupID, str, int]] = [(root, "/", 0)]
        objects = 0
        declared = 0
        while stack:
            gid, path, depth = stack.pop()
            names = _link_names(gid, MAX_OBJECTS - objects + 1)
            objects += len(names)
            if objects > MAX_OBJECTS:
                self.r.problem(f"holds more than {MAX_OBJECTS} objects", fatal=True)
            for raw in names:
                name = path.rstrip("/") + "/" + raw.decode("utf-8", "replace")
                check_link(gid, raw, name, self.r.fatal, _untrusted)
                oid = h5py.h5o.open(gid, raw)
                oinfo = h5py.h5o.get_info(oid)
                if oinfo.type == h5py.h5o.TYPE_NAMED_DATATYPE:
                    self.r.problem(_untrusted(f"{name} is a committed datatype"), fatal=True)
                if oinfo.rc != 1 or oinfo.addr in seen:
                    self.r.problem(
                        _untrusted(
                            f"{name} is one of {max(oinfo.rc, 2)} hard links to one object (a "
                            "link cycle or an alias)"
                        ),
                        fatal=True,
                    )
                seen.add(oinfo.addr)
                if oinfo.type == h5py.h5o.TYPE_GROUP:
                    if depth + 1 > MAX_GROUP_DEPTH:
                        self.r.problem(
                            f"{name} is nested too deep (more than {MAX_GROUP_DEPTH} groups "
                            "inside each other); geompi never writes that, so the file was not "
                            "written by geompi: use a checkpoint written by geompi",
                            fatal=True,
                        )
                    self._scan_attrs(oid, name)
                    stack.append((oid, name, depth + 1))
                elif oinfo.type == h5py.h5o.TYPE_DATASET:
                    declared += self._scan_dataset(oid, name, file_size)
                    if declared > file_size:
                        self.r.problem(
                            f"its datasets declare {declared} bytes in all, more than the whole "
                            f"file ({file_size} bytes); geompi stores every byte uncompressed, "
                            "so the file was not written by geompi: use a checkpoint written by "
                            "geompi",
                            fatal=True,
                        )
                    self._scan_attrs(oid, name)
                else:
                    self.r.problem(
                        _untrusted(f"{name} is an HDF5 object of type {oinfo.type}"), True
                    )

    def _scan_dataset(self, dsid: h5py.h5d.DatasetID, name: str, file_size: int) -> int:
        """Structural checks of one dataset; returns the bytes it declares."""
        return check_dataset(dsid, name, file_size, _CKPT_DATASETS, self.r.fatal, _untrusted)

    def _scan_attrs(self, oid: h5py.h5o.ObjectID, path: str) -> None:
        n = h5py.h5a.get_num_attrs(oid)
        if n > MAX_ATTRS:
            self.r.problem(f"{path} has {n} attributes, more than {MAX_ATTRS}", fatal=True)
        for i in range(n):
            aid = h5py.h5a.open(oid, index=i)
            where = _attr_where(path, aid.name.decode("utf-8", "replace"))
            tid = aid.get_type()
            if tid.committed():
                self.r.problem(_untrusted(f"attribute {where} uses a committed datatype"), True)
            kind = aid.get_space().get_simple_extent_type()
            if kind != h5py.h5s.SCALAR:
                shape = "no value" if kind == h5py.h5s.NULL else f"shape {aid.shape}"
                self.r.problem(
                    _untrusted(f"attribute {where} is an array or empty ({shape}), not one value"),
                    fatal=True,
                )
            if not scalar_attr_type(tid):
                self.r.problem(
                    _untrusted(f"attribute {where} holds {type_name(tid)} data"), fatal=True
                )
            if tid.get_class() == h5py.h5t.STRING and tid.is_variable_str() and self.r.digested:
                self.r.problem(
                    _untrusted(
                        f"attribute {where} holds variable-length text (kept in HDF5's global "
                        "heap, which has no checksum)"
                    ),
                    fatal=True,
                )
            if tid.get_class() == h5py.h5t.STRING and not tid.is_variable_str():
                if tid.get_size() > MAX_ATTR_BYTES:
                    self.r.problem(_attr_too_big(where, tid.get_size()), fatal=True)


def load(
    path: str | os.PathLike,
    *,
    verify: bool = True,
    expect_fingerprint: str | None = None,
    allow_legacy: bool = False,
) -> Checkpoint:
    """Read a whole checkpoint into memory, or raise CheckpointError (one line) and return nothing.

    Every load checks the file's content digest and each dataset's sha256 (a file written
    without them, by an older geompi, is refused unless allow_legacy=True: then only the
    checks such files allow are made). HDF5 always checks each chunk's fletcher32; verify=True
    also checks that the file is complete
    and consistent (fingerprint, filters), exactly what verify() reports.
    """
    reader = _Reader(path, collect=False, full=verify, legacy=allow_legacy)
    ck = reader.read(expect_fingerprint=expect_fingerprint)
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
