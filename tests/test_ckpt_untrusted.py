"""geompi.ckpt reads untrusted files: hostile HDF5 structures are refused with one line, never
followed, never a traceback (issue #13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from geompi import ckpt
from geompi.errors import CheckpointError

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def make_model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "features.0.weight": torch.randn(4, 3, generator=g),
        "big.weight": torch.randn(300, 500, generator=g),  # 600 kB: the chunk-by-chunk path
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "mask": torch.tensor([True, False, True]),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64),
    }


def good(path: Path, seed: int = 0) -> Path:
    return ckpt.save(
        path,
        model=make_model(seed),
        algorithm={"hfa": {"k1": 4, "milestone": torch.arange(3)}},
        progress={"pos": torch.arange(5)},
        step=3,
        config={"lr": 0.1},
        metrics={"test_acc": 0.5},
    )


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "geompi.ckpt", *args],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------------------------
# hostile files: each builder edits a good checkpoint and returns words the refusal must contain


def soft_link(f: h5py.File, tmp: Path) -> list[str]:
    f["model/alias"] = h5py.SoftLink("/model/features.0.weight")
    return ["/model/alias", "soft link"]


def dangling_soft_link(f: h5py.File, tmp: Path) -> list[str]:
    f["progress/dangling"] = h5py.SoftLink("/nowhere")
    return ["/progress/dangling", "soft link"]


def external_link_to_foreign_file(f: h5py.File, tmp: Path) -> list[str]:
    other = good(tmp / "foreign.h5", seed=7)  # same names and shapes: same fingerprint
    del f["model/big.weight"]
    f["model/big.weight"] = h5py.ExternalLink(str(other), "/model/big.weight")
    return ["/model/big.weight", "external link"]


def hard_link_cycle(f: h5py.File, tmp: Path) -> list[str]:
    f["algorithm/hfa/loop"] = f["algorithm"]
    return ["hard link"]


def hard_link_alias(f: h5py.File, tmp: Path) -> list[str]:
    f["progress/alias"] = f["model/features.0.weight"]
    return ["hard link"]


def external_storage(f: h5py.File, tmp: Path) -> list[str]:
    victim = tmp / "secret.txt"
    victim.write_bytes(b"secret-password!")
    ds = f.create_dataset("progress/leak", shape=(16,), dtype="u1", external=[(str(victim), 0, 16)])
    ds.attrs["dtype"] = np.bytes_(b"uint8")
    return ["/progress/leak", "external storage"]


def virtual_dataset(f: h5py.File, tmp: Path) -> list[str]:
    other = good(tmp / "foreign.h5", seed=7)
    layout = h5py.VirtualLayout(shape=(5,), dtype="i8")
    layout[:] = h5py.VirtualSource(str(other), "progress/pos", shape=(5,))
    del f["progress/pos"]
    f.create_virtual_dataset("progress/pos", layout)
    f["progress/pos"].attrs["dtype"] = np.bytes_(b"int64")
    return ["/progress/pos", "virtual"]


def gzip_dataset(f: h5py.File, tmp: Path) -> list[str]:
    ds = f.create_dataset(
        "progress/bomb", data=np.zeros(1 << 20, np.uint8), compression="gzip", fletcher32=True
    )
    ds.attrs["dtype"] = np.bytes_(b"uint8")
    return ["/progress/bomb", "gzip", "filter"]


def shuffle_filter(f: h5py.File, tmp: Path) -> list[str]:
    ds = f.create_dataset("progress/shuf", data=np.arange(100), shuffle=True, fletcher32=True)
    ds.attrs["dtype"] = np.bytes_(b"int64")
    return ["/progress/shuf", "shuffle", "filter"]


def committed_datatype(f: h5py.File, tmp: Path) -> list[str]:
    f["algorithm/named"] = np.dtype("<f4")
    return ["/algorithm/named", "committed datatype"]


def dataset_of_committed_type(f: h5py.File, tmp: Path) -> list[str]:
    f["algorithm/named"] = np.dtype("<i8")
    ds = f["algorithm"].create_dataset("x", shape=(2,), dtype=f["algorithm/named"])
    ds.attrs["dtype"] = np.bytes_(b"int64")
    return ["committed datatype"]


def reference_dataset(f: h5py.File, tmp: Path) -> list[str]:
    ds = f.create_dataset("progress/ref", data=np.array([f["model"].ref]), dtype=h5py.ref_dtype)
    ds.attrs["dtype"] = np.bytes_(b"int64")
    return ["/progress/ref", "reference"]


def vlen_dataset(f: h5py.File, tmp: Path) -> list[str]:
    ds = f.create_dataset("progress/v", shape=(2,), dtype=h5py.vlen_dtype(np.int32))
    ds[0] = np.arange(3, dtype=np.int32)
    ds.attrs["dtype"] = np.bytes_(b"int32")
    return ["/progress/v", "variable-length"]


def reference_attribute(f: h5py.File, tmp: Path) -> list[str]:
    f["model"].attrs["r"] = f["model"].ref
    return ["/model@r", "reference"]


def array_root_attribute(f: h5py.File, tmp: Path) -> list[str]:
    f.attrs["step"] = np.arange(3)
    return ["@step", "array"]


def array_dtype_attribute(f: h5py.File, tmp: Path) -> list[str]:
    f["model/features.0.weight"].attrs["dtype"] = np.array([1, 2])
    return ["/model/features.0.weight@dtype", "array"]


def deeply_nested_json(f: h5py.File, tmp: Path) -> list[str]:
    f.attrs["config"] = np.bytes_(b"[" * 100_000 + b"]" * 100_000)
    return ["@config", "nested"]


def json_keys_not_a_list(f: h5py.File, tmp: Path) -> list[str]:
    f["algorithm/hfa"].attrs["_json_keys"] = np.bytes_(b"5")
    return ["/algorithm/hfa@_json_keys"]


json_keys_not_a_list.outside_model = True  # export (the model alone) does not read it


def huge_attribute(f: h5py.File, tmp: Path) -> list[str]:
    f.attrs["metrics"] = np.bytes_(json.dumps("x" * (17 << 20)).encode())
    return ["@metrics", "bytes"]


def huge_declared_dataset(f: h5py.File, tmp: Path) -> list[str]:
    ds = f.create_dataset(
        "progress/huge", shape=(1 << 40,), dtype="f4", chunks=(1 << 16,), fletcher32=True
    )
    ds.attrs["dtype"] = np.bytes_(b"float32")
    return ["/progress/huge", "declares"]


def deep_groups(f: h5py.File, tmp: Path) -> list[str]:
    g = f["algorithm"]
    for _ in range(1100):
        g = g.create_group("a")
    return ["deep"]


def missing_chunks(f: h5py.File, tmp: Path) -> list[str]:
    ds = f.create_dataset(
        "progress/partial", shape=(1000,), dtype="f4", chunks=(100,), fletcher32=True
    )
    ds[:100] = 1.0  # the other 9 chunks are not stored and would read as unchecked zeros
    ds.attrs["dtype"] = np.bytes_(b"float32")
    return ["/progress/partial", "chunks"]


missing_chunks.outside_model = True


def _unchecked_chunk(name: str) -> Callable[[h5py.File, Path], list[str]]:
    def edit(f: h5py.File, tmp: Path) -> list[str]:
        ds = f[name]
        chunk = tuple(ds.chunks)
        new = np.full(chunk, 7.0, np.float32)  # rewritten values, filter mask: fletcher32 off
        ds.id.write_direct_chunk((0,) * len(chunk), new.tobytes(), filter_mask=1)
        return [name, "fletcher32"]

    edit.__name__ = f"unchecked_chunk_{name.rsplit('/', 1)[-1].replace('.', '_')}"
    return edit


HOSTILE = [
    soft_link,
    dangling_soft_link,
    external_link_to_foreign_file,
    hard_link_cycle,
    hard_link_alias,
    external_storage,
    virtual_dataset,
    gzip_dataset,
    shuffle_filter,
    committed_datatype,
    dataset_of_committed_type,
    reference_dataset,
    vlen_dataset,
    reference_attribute,
    array_root_attribute,
    array_dtype_attribute,
    deeply_nested_json,
    json_keys_not_a_list,
    huge_attribute,
    huge_declared_dataset,
    deep_groups,
    missing_chunks,
    _unchecked_chunk("/model/features.0.weight"),
    _unchecked_chunk("/model/big.weight"),
]


def hostile(tmp_path: Path, build) -> tuple[Path, list[str]]:
    path = good(tmp_path / "ckpt-00000003.h5")
    with h5py.File(path, "r+") as f:
        words = build(f, tmp_path)
    return path, words


@pytest.mark.parametrize("build", HOSTILE, ids=lambda b: b.__name__)
def test_hostile_file_is_refused_in_one_line(tmp_path, capsys, build):
    path, words = hostile(tmp_path, build)

    assert ckpt.main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1 and err == "", (out, err)
    assert lines[0].startswith(f"checkpoint {path}: ")
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert ckpt.verify(path) == lines

    if getattr(build, "outside_model", False):  # a damaged dataset, not a hostile structure
        # export reads /model alone, and is refused too: the content digest covers every object
        assert ckpt.main(["export", str(path), "--to", str(tmp_path / "m.pt")]) == 1
        err = capsys.readouterr().err
        assert "content_sha256" in err and err.count("\n") == 1, err
    for argv in (["inspect", str(path)], ["export", str(path), "--to", str(tmp_path / "m.pt")]):
        if argv[0] == "export" and getattr(build, "outside_model", False):
            continue
        assert ckpt.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith(f"geompi.ckpt: error: checkpoint {path}: ") and err.count("\n") == 1
        assert all(w in err for w in words), (words, err)
    assert not (tmp_path / "m.pt").exists()

    for verify in (True, False):
        with pytest.raises(CheckpointError) as info:
            ckpt.load(path, verify=verify)
        assert "\n" not in str(info.value) and all(w in str(info.value) for w in words)


def test_structural_refusals_name_the_fix(tmp_path):
    path, _ = hostile(tmp_path, external_storage)
    (line,) = ckpt.verify(path)
    assert "not written by geompi" in line and "use a checkpoint written by geompi" in line


def test_external_link_to_fifo_does_not_hang(tmp_path):
    path = good(tmp_path / ckpt.checkpoint_name(1))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with h5py.File(path, "r+") as f:
        del f["model/big.weight"]
        f["model/big.weight"] = h5py.ExternalLink(str(fifo), "/x")
    for args in (["verify", str(path)], ["inspect", str(path)], ["ls", str(tmp_path)]):
        r = run_cli(*args)  # raises TimeoutExpired (fails) if the FIFO is opened
        assert "Traceback" not in r.stderr, r.stderr
        if args[0] == "ls":
            assert r.returncode == 0 and "external link" in r.stdout
            continue
        assert r.returncode == 1
        text = r.stdout if args[0] == "verify" else r.stderr
        assert text.count("\n") == 1 and "external link" in text, (r.stdout, r.stderr)


def test_external_link_does_not_load_foreign_data(tmp_path):
    path, _ = hostile(tmp_path, external_link_to_foreign_file)
    r = run_cli("verify", str(path))
    assert r.returncode == 1 and r.stdout.count("\n") == 1 and "external link" in r.stdout
    assert "Traceback" not in r.stderr


def test_good_files_still_pass(tmp_path):
    path = good(tmp_path / "c.h5")
    assert ckpt.verify(path) == []
    ck = ckpt.load(path)
    for k, v in make_model().items():
        assert torch.equal(ck.model[k], v), k


def test_an_unterminated_json_string_is_refused_without_a_hang(tmp_path):
    """``"\\"\\"\\"...`` with no closing quote: finding the JSON strings used to retry from every
    quote (quadratic: about 20 minutes for these 600 kB); now one pass, one line."""
    path = good(tmp_path / ckpt.checkpoint_name(3))
    with h5py.File(path, "r+") as f:
        f.attrs["metrics"] = np.bytes_(b'"' + b'\\"' * 300_000)
    for args, rc in ((["verify", str(path)], 1), (["ls", str(tmp_path)], 0)):  # ls: a row
        r = run_cli(*args, timeout=60)  # raises TimeoutExpired (fails) on the quadratic scan
        assert r.returncode == rc, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "@metrics is not valid JSON" in r.stdout, r


def test_diff_of_files_with_an_empty_bytes_value(tmp_path):
    """save() writes b"" fine; diff compared it through torch.frombuffer, which refuses it."""
    a, b = (
        ckpt.save(tmp_path / f"{n}.h5", model=make_model(), progress={"blob": b""}, step=1)
        for n in ("a", "b")
    )
    r = run_cli("diff", str(a), str(b))
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
