"""The command line: python -m geompi.ckpt {inspect,verify,diff,export,ls}."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

import h5py
import torch

from geompi.ckpt.export import EXPORT_SUFFIXES, export
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
        if not reader.problems:  # shown, but flagged: attributes or structure changed
            reader.check_digest(f)
    print(f"{total_tensors} tensors, {total_bytes} bytes")
    for line in reader.problems:
        _print_error(line)
    return 1 if reader.problems else 0


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
    p = sub.add_parser("verify", help="check every checksum and attribute; exit 1 if bad")
    p.add_argument("files", nargs="+", metavar="file")
    p = sub.add_parser("diff", help="max abs difference per tensor; exit 1 if different")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("export", help="write the model as .pt, .safetensors or .npz")
    p.add_argument("file")
    p.add_argument("--to", required=True, metavar="OUT")
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
            return _inspect(args.file)
        if args.command == "verify":
            return _cmd_verify(args.files)
        if args.command == "diff":
            return _diff(args.a, args.b)
        if args.command == "export":
            return _cmd_export(args.file, args.to)
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
