"""The command line: python -m geompi.ckpt {inspect,verify,diff,export,ls}."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

import h5py
import torch

from geompi.ckpt.export import EXPORT_SUFFIXES, NothingToExport, export
from geompi.ckpt.files import _reason, list_checkpoints
from geompi.ckpt.reader import Checkpoint, _Problem, _Reader, _verify, load
from geompi.ckpt.writer import save
from geompi.errors import CheckpointError


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _fmt(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


INSPECT_SCHEMA = 1  # inspect --json's "schema": raised when a key changes meaning or goes


def _stats_of(t: torch.Tensor) -> dict[str, Any] | None:
    """min, max, mean, norm (complex: mean as [re, im], norm); None for an empty tensor."""
    if t.numel() == 0:
        return None
    if t.is_complex():
        d = t.to(torch.complex128)
        m = complex(d.mean())
        return {"mean": [m.real, m.imag], "norm": float(d.abs().norm())}
    d = t.to(torch.float64)
    return {k: float(getattr(d, k)()) for k in ("min", "max", "mean", "norm")}


def _stats(t: torch.Tensor) -> str:
    st = _stats_of(t)
    if st is None:
        return "empty"
    if t.is_complex():
        return f"mean={complex(*st['mean']):.6g} norm={st['norm']:.6g}"
    return " ".join(f"{k}={v:.6g}" for k, v in st.items())


def _walk(reader: _Reader, f: h5py.File) -> list[tuple[str, dict]]:
    """The groups and datasets under the root, in file order (a group before its children):
    ("group", {"path", "attributes"}) and ("dataset", {"path", "kind": "tensor"|"bytes"|
    "unreadable", "dtype", "shape", "bytes", "stats"}), as inspect shows them."""
    events: list[tuple[str, dict]] = []

    def walk(group: h5py.Group) -> None:
        events.append(("group", {"path": group.name, "attributes": reader.attrs_of(group)}))
        for obj in group.values():
            if isinstance(obj, h5py.Group):
                walk(obj)
                continue
            value = reader.dataset(obj)
            row: dict[str, Any] = {"path": obj.name, "kind": "unreadable"}
            if isinstance(value, bytes):
                row.update(kind="bytes", dtype="bytes", shape=[len(value)], bytes=len(value))
                row["stats"] = None
            elif value is not None:
                row.update(kind="tensor", dtype=str(value.dtype).removeprefix("torch."))
                row.update(shape=list(value.shape), bytes=value.numel() * value.element_size())
                row["stats"] = _stats_of(value)
                row["_tensor"] = value
            events.append(("dataset", row))

    try:
        for obj in f.values():
            if isinstance(obj, h5py.Group):
                walk(obj)
    except _Problem:  # pragma: no cover - only fatal problems raise, and those came earlier
        pass
    return events


def _inspect(path: str, as_json: bool = False) -> int:
    reader = _Reader(path, collect=False, full=False)
    with reader.open() as f:
        attrs = reader.header(f)  # a file that cannot be interpreted raises here
        reader.collect = True  # from here on show what can be shown and report the rest
        events = _walk(reader, f)
        if not reader.problems:  # shown, but flagged: attributes or structure changed
            reader.check_digest(f)
    datasets = [row for kind, row in events if kind == "dataset"]
    readable = [d for d in datasets if d["kind"] != "unreadable"]
    total_bytes = sum(d["bytes"] for d in readable)
    if as_json:
        doc = {
            "schema": INSPECT_SCHEMA,
            "file": path,
            "file_bytes": os.path.getsize(path),
            "attributes": attrs,
            "groups": {row["path"]: row["attributes"] for kind, row in events if kind == "group"},
            "tensors": [{k: v for k, v in d.items() if k != "_tensor"} for d in datasets],
            "total_tensors": len(readable),
            "total_bytes": total_bytes,
            "problems": reader.problems,
        }
        print(json.dumps(_plain(doc), indent=1, allow_nan=False))
    else:
        _print_inspect(path, attrs, events)
        print(f"{len(readable)} tensors, {total_bytes} bytes")
    for line in reader.problems:
        _print_error(line)
    return 1 if reader.problems else 0


def _plain(value: Any) -> Any:
    """JSON-safe: a non-finite float as the string "nan", "inf" or "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _print_inspect(path: str, attrs: dict, events: list[tuple[str, dict]]) -> None:
    print(f"{path}  ({os.path.getsize(path)} bytes on disk)")
    for key, value in attrs.items():
        print(f"  @{key} = {_fmt(value)}")
    for kind, row in events:
        depth = row["path"].count("/")
        name = row["path"] if depth == 1 else row["path"].rsplit("/", 1)[1]
        if kind == "group":
            print(f"{'  ' * (depth - 1)}{name}/")
            for key, value in row["attributes"].items():
                print(f"{'  ' * depth}@{key} = {_fmt(value)}")
            continue
        pad = "  " * (depth - 1)
        if row["kind"] == "bytes":
            print(f"{pad}{name}  bytes  [{row['bytes']}]  {row['bytes']} B")
        elif row["kind"] == "tensor":
            stats = _stats(row["_tensor"])
            print(f"{pad}{name}  {row['dtype']}  {row['shape']}  {row['bytes']} B  {stats}")
        else:
            print(f"{pad}{name}  UNREADABLE (see the errors below)")


def _flatten(ck: Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    attrs: dict[str, Any] = {
        f"@{k}": v
        for k, v in ck.attrs.items()
        if k not in ("created", "geompi_version", "sequence")
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
                # frombuffer refuses an empty buffer, which save() writes fine
                raw = torch.frombuffer(bytearray(v), dtype=torch.uint8) if v else torch.empty(0)
                tensors[f"{prefix}/{k}"] = raw.to(torch.uint8)
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


def _outside(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    """Whether some element differs by more than atol + rtol * |b| (NaN matches NaN only)."""
    if a.numel() == 0:
        return False
    kind = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    x, y = a.to(kind), b.to(kind)
    return not bool(torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all())


def _diff_tensor(key: str, a: torch.Tensor, b: torch.Tensor, tol: tuple | None) -> int:
    """Print one tensor's line of diff; 1 if it counts as a difference."""
    da, db = (str(t.dtype).removeprefix("torch.") for t in (a, b))
    if da != db:
        print(f"{key}: dtype {da} != {db}")
        return 1
    if a.shape != b.shape:
        print(f"{key}: shape {list(a.shape)} != {list(b.shape)}")
        return 1
    diff = _max_abs_diff(a, b)
    if tol is None:
        same = _same_bits(a, b)
        print(f"{key}: max abs diff {diff:.6g}{'' if same else '  (differs)'}")
        return int(not same)
    if _outside(a, b, *tol):
        print(f"{key}: max abs diff {diff:.6g}  (differs beyond atol={tol[0]:g} rtol={tol[1]:g})")
        return 1
    print(f"{key}: max abs diff {diff:.6g}{'  (within tolerance)' if diff else ''}")
    return 0


def _diff(path_a: str, path_b: str, tol: tuple[float, float] | None = None) -> int:
    """``tol``: (atol, rtol), else every tensor must be bitwise the same."""
    try:
        ta, aa = _flatten(load(path_a))
        tb, ab = _flatten(load(path_b))
    except CheckpointError as e:
        _print_error(str(e))
        return 2  # like diff(1): trouble is 2, different is 1
    differences = 0
    offending = []
    for key, a in ta.items():
        if key in tb and _diff_tensor(key, a, tb[key], tol):
            differences += 1
            offending.append(key)
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
    if offending:
        print(f"tensors that differ: {' '.join(offending)}")
    print("identical" if differences == 0 else f"{differences} differences")
    return 0 if differences == 0 else 1


def _tolerance(atol: str | None, rtol: str | None) -> tuple[float, float] | None:
    """(atol, rtol) from the command line, None for neither (exact); a bad value is a
    _UsageError."""
    if atol is None and rtol is None:
        return None
    out = []
    for flag, text in (("--atol", atol), ("--rtol", rtol)):
        try:
            value = float(text) if text is not None else 0.0
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise _UsageError(f"{flag} {text}: must be a finite number >= 0")
        out.append(value)
    return out[0], out[1]


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


def _cmd_export(path: str, out: str, optimizer: bool = False) -> int:
    if pathlib.Path(out).suffix.lower() not in EXPORT_SUFFIXES:
        raise _UsageError(
            f"cannot export to {out}: unknown suffix (use {', '.join(EXPORT_SUFFIXES)})"
        )
    try:
        export(path, out, optimizer=optimizer)
    except NothingToExport as e:
        raise _UsageError(str(e)) from None
    print(f"wrote {out}")
    return 0


def _cmd_resave(path: str, out: str) -> int:
    """Read a checkpoint written without a content digest (older geompi), with every check such
    a file allows, and write it again in today's format (digest, sha256 per dataset)."""
    if pathlib.Path(out).resolve() == pathlib.Path(path).resolve():
        raise _UsageError("resave writes a new file: pass an OUT other than FILE")
    ck = load(path, allow_legacy=True)
    a = ck.attrs
    save(
        out,
        model=ck.model,
        optimizer=ck.optimizer,
        optimizer_attrs=ck.optimizer_attrs,
        algorithm=ck.algorithm,
        progress=ck.progress,
        step=ck.step,
        epoch=ck.epoch,
        algorithm_name=ck.algorithm_name,
        topology=a.get("topology"),
        config=a.get("config"),
        metrics=a.get("metrics"),
    )
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
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p = sub.add_parser("verify", help="check every checksum and attribute; exit 1 if bad")
    p.add_argument("files", nargs="+", metavar="file")
    p = sub.add_parser("diff", help="max abs difference per tensor; exit 1 if different")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", metavar="X", help="equal within |a-b| <= X + RTOL*|b| (default exact)")
    p.add_argument("--rtol", metavar="X", help="relative tolerance (default exact)")
    p = sub.add_parser("export", help="write the model as .pt, .safetensors or .npz")
    p.add_argument("file")
    p.add_argument("--to", required=True, metavar="OUT")
    p.add_argument(
        "--optimizer",
        action="store_true",
        help='.pt only: {"model": ..., "optimizer": ...} in torch\'s formats',
    )
    p = sub.add_parser(
        "resave", help="write a checkpoint of an older geompi (no content digest) again"
    )
    p.add_argument("file")
    p.add_argument("out")
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
            return _inspect(args.file, args.json)
        if args.command == "verify":
            return _cmd_verify(args.files)
        if args.command == "diff":
            return _diff(args.a, args.b, _tolerance(args.atol, args.rtol))
        if args.command == "export":
            return _cmd_export(args.file, args.to, args.optimizer)
        if args.command == "resave":
            return _cmd_resave(args.file, args.out)
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
