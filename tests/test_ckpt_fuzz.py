"""A seeded fuzzer: no bit flip in a checkpoint changes what it loads without being refused.

Issue 35, item 1: flips in HDF5's version-1 B-tree chunk records made a tensor read as zeros,
and a one-byte edit of JSON text in the global heap (lr 0.001 -> 0.009) passed every check.
Every mutated file must either be refused with one CheckpointError line naming the file, or load
exactly the original content (names, order, dtypes, shapes, bytes, attributes).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from geompi import ckpt
from geompi.ckpt import format as ckpt_format
from geompi.ckpt import writer as ckpt_writer
from geompi.errors import CheckpointError

CONFIG = {"lr": 0.001, "momentum": 0.9, "model": "cnn"}
GROUPS = {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08}
RANDOM_FLIPS = 200
BUDGET_S = 50.0  # the fuzzer's process, at most
HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}


def write_small(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small checkpoint whose model tensor `w` has several chunks (tiny chunks, written by the
    chunk-by-chunk path), so that it has a real chunk index."""
    monkeypatch.setattr(ckpt_format, "_CHUNK_BYTES", 1024)
    monkeypatch.setattr(ckpt_writer, "_DIRECT_MIN_BYTES", 2048)
    g = torch.Generator().manual_seed(35)
    model = {
        "w": torch.randn(40, 25, generator=g),  # 4000 bytes: 4 chunks of 10 rows
        "b": torch.randn(25, generator=g),
        "h": torch.randn(3, 4, generator=g).bfloat16(),
    }
    return ckpt.save(
        path,
        model=model,
        optimizer={"exp_avg": {"w": torch.randn(40, 25, generator=g)}},
        optimizer_attrs={"name": "adam", "param_groups": [GROUPS]},
        algorithm={"hfa": {"k1": 4, "milestone": torch.arange(3)}},
        progress={"pos": torch.arange(5)},
        step=7,
        config=CONFIG,
        metrics={"test_acc": 0.5},
    )


def content(value: Any) -> Any:
    """Everything a load returns, in order, as comparable plain values (tensors by bytes)."""
    if isinstance(value, torch.Tensor):
        t = value.contiguous()
        raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
        return ("tensor", str(t.dtype), tuple(t.shape), raw.numpy().tobytes())
    if isinstance(value, dict):
        return [(k, content(v)) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [content(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def loaded(path: Path) -> Any:
    ck = ckpt.load(path)
    attrs = {k: v for k, v in ck.attrs.items()}
    return content(
        {
            "model": ck.model,
            "optimizer": ck.optimizer,
            "optimizer_attrs": ck.optimizer_attrs,
            "algorithm": ck.algorithm,
            "progress": ck.progress,
            "attrs": attrs,
        }
    )


def chunk_index_region(path: Path, data: bytes) -> range:
    """The bytes around every record of /model/w's chunk index (found by the chunks' addresses,
    whatever HDF5 format the index has)."""
    with h5py.File(path, "r") as f:
        ds = f["model/w"]
        addrs = [ds.id.get_chunk_info(i).byte_offset for i in range(ds.id.get_num_chunks())]
    assert len(addrs) == 4
    found = [data.find(a.to_bytes(8, "little")) for a in addrs]
    assert all(p >= 0 for p in found), "the chunk index holds every chunk's address"
    return range(max(0, min(found) - 40), min(len(data), max(found) + 48))


def json_regions(data: bytes) -> list[range]:
    """The JSON texts of the config and of the optimizer's param groups, with the 16 bytes before
    each (the heap object's header: its size)."""
    out = []
    for text in (json.dumps(CONFIG), json.dumps([GROUPS])):
        pos = data.find(text.encode())
        assert pos >= 0, text
        out.append(range(max(0, pos - 16), pos + len(text)))
    return out


def check_flips(good: Path, bits: list[int], scratch: Path, progress: Path) -> dict[str, Any]:
    """Loads of `good` with each of `bits` flipped: how many were refused, and which loaded
    something else or raised anything but a one-line CheckpointError."""
    data = good.read_bytes()
    want = loaded(good)
    refused = 0
    silent: list[str] = []
    for bit in bits:
        progress.write_text(json.dumps({"bit": bit, "refused": refused, "silent": silent[:5]}))
        mutated = bytearray(data)
        mutated[bit // 8] ^= 1 << (bit % 8)
        scratch.write_bytes(mutated)
        try:
            got = loaded(scratch)
        except CheckpointError as e:
            msg = str(e)
            if "\n" in msg or str(scratch) not in msg:
                silent.append(f"bit {bit}: not one line naming the file: {msg!r}")
            refused += 1
            continue
        except Exception as e:  # a traceback for the user
            silent.append(f"bit {bit}: {type(e).__name__}: {e}")
            continue
        if got != want:
            silent.append(f"bit {bit} (byte {bit // 8:#x}): loaded different content")
    return {"refused": refused, "silent": silent}


def _child(workdir: str) -> None:
    """Run in a separate process (a corrupt file once made HDF5 itself loop forever)."""
    d = Path(workdir)
    bits = json.loads((d / "bits.json").read_text())
    result = check_flips(d / "good.h5", bits, d / "mutated.h5", d / "progress")
    (d / "result.json").write_text(json.dumps(result))


def test_no_bit_flip_changes_a_checkpoint_silently(tmp_path, monkeypatch) -> None:
    good = write_small(tmp_path / "good.h5", monkeypatch)
    monkeypatch.undo()  # the reader must not depend on the writer's tuning
    data = good.read_bytes()
    rng = random.Random(35)
    bits = [8 * byte + b for byte in chunk_index_region(good, data) for b in range(8)]
    bits += [rng.randrange(len(data) * 8) for _ in range(RANDOM_FLIPS)]
    for region in json_regions(data):
        bits += [8 * byte + b for byte in region for b in range(8)]
    (tmp_path / "bits.json").write_text(json.dumps(bits))
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_ckpt_fuzz as t; "
    code += f"t._child({str(tmp_path)!r})"
    try:
        subprocess.run([sys.executable, "-c", code], env=ENV, timeout=BUDGET_S, check=True)
    except subprocess.TimeoutExpired:
        at = json.loads((tmp_path / "progress").read_text())
        pytest.fail(
            f"loading the checkpoint with bit {at['bit']} flipped hung (or the fuzzer is slow); "
            f"before it: {at['refused']} refused, silent changes: {at['silent']}"
        )
    result = json.loads((tmp_path / "result.json").read_text())
    silent = result["silent"]
    assert not silent, (
        f"{len(silent)} of {len(bits)} single-bit flips changed what the checkpoint loads without "
        f"a one-line refusal ({result['refused']} refused), e.g. {silent[:5]}"
    )
    assert result["refused"] > 0


def test_lr_edit_in_the_json_is_refused(tmp_path, monkeypatch) -> None:
    """The issue's one-byte edit: 0.001 -> 0.009 in the optimizer's param groups and config."""
    good = write_small(tmp_path / "good.h5", monkeypatch)
    data = good.read_bytes()
    for text in (json.dumps([GROUPS]), json.dumps(CONFIG)):
        pos = data.find(text.encode())
        edited = text.replace("0.001", "0.009", 1).encode()
        bad = tmp_path / "edited.h5"
        bad.write_bytes(data[:pos] + edited + data[pos + len(edited) :])
        with pytest.raises(CheckpointError) as info:
            ckpt.load(bad)
        assert "\n" not in str(info.value) and str(bad) in str(info.value)
        assert ckpt.verify(bad), "verify must report it too"


def test_chunk_records_zeroed_tensor_is_refused(tmp_path, monkeypatch) -> None:
    """Each chunk of /model/w made unfindable in turn (its address's bytes flipped): never a
    tensor of zeros."""
    good = write_small(tmp_path / "good.h5", monkeypatch)
    data = good.read_bytes()
    with h5py.File(good, "r") as f:
        ds = f["model/w"]
        addrs = [ds.id.get_chunk_info(i).byte_offset for i in range(ds.id.get_num_chunks())]
    want = loaded(good)
    bad = tmp_path / "bad.h5"
    for addr in addrs:
        pos = data.find(addr.to_bytes(8, "little"))
        mutated = bytearray(data)
        mutated[pos + 5] ^= 0x10  # the address now points far beyond the file
        bad.write_bytes(mutated)
        try:
            got = loaded(bad)
        except CheckpointError:
            continue
        assert got == want
        assert not np.all(ckpt.load(bad).model["w"].numpy() == 0)


def test_a_file_without_the_digest_is_refused_until_resaved(tmp_path, monkeypatch) -> None:
    """A checkpoint of an older geompi (1.8 format, text in the global heap, no digest) is
    refused in one line that says how to re-save it; `resave` writes one that loads."""
    monkeypatch.setattr(ckpt_writer, "_LIBVER", ("v108", "v110"))
    monkeypatch.setattr(ckpt_writer, "DIGEST_ATTR", "no_digest_written")  # as before issue 35
    old = write_small(tmp_path / "old.h5", monkeypatch)
    with h5py.File(old, "r+") as f:  # what older geompi wrote: no digest, no sha256 attributes
        del f.attrs["no_digest_written"]
    monkeypatch.undo()
    with pytest.raises(CheckpointError) as info:
        ckpt.load(old)
    msg = str(info.value)
    assert "\n" not in msg and str(old) in msg and "content_sha256" in msg, msg
    assert "python -m geompi.ckpt resave" in msg
    new = tmp_path / "new.h5"
    assert ckpt.main(["resave", str(old), str(new)]) == 0
    assert ckpt.verify(new) == []
    assert content(ckpt.load(new).model) == content(ckpt.load(old, allow_legacy=True).model)
    assert ckpt.load(new).optimizer_attrs["param_groups"] == [GROUPS]


def test_inspect_refuses_an_edited_attribute(tmp_path, monkeypatch, capsys) -> None:
    """inspect prints the attributes: it checks the digest before showing an edited lr."""
    good = write_small(tmp_path / "good.h5", monkeypatch)
    data = good.read_bytes()
    text = json.dumps(CONFIG)
    pos = data.find(text.encode())
    bad = tmp_path / "edited.h5"
    bad.write_bytes(data[:pos] + text.replace("0.001", "0.009").encode() + data[pos + len(text) :])
    assert ckpt.main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err, err
