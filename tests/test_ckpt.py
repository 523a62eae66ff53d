"""geompi.ckpt: round trips, refusals of damaged files, the CLI, and crash safety (real HDF5)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
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
        "features.0.bias": torch.randn(4, generator=g),
        "big.weight": torch.randn(300, 500, generator=g),  # 600 kB: the chunk-by-chunk path
        "half": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "double": torch.randn(3, generator=g).double(),
        "counts": torch.tensor([1, -2, 2**62], dtype=torch.int64),
        "scalar": torch.tensor(3.25),
        "bf16_scalar": torch.tensor(-1.5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 7),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality, dtype and shape included."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def save_small(path: Path, step: int = 1, seed: int = 0, **kw) -> Path:
    kw.setdefault("metrics", {"test_acc": 0.97})
    return ckpt.save(path, model=make_model(seed), step=step, epoch=step // 10, **kw)


def flip_byte(path: Path, dataset: str, at: int = 100) -> None:
    """Flip one byte inside the stored data of `dataset`."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        offset = ds.id.get_offset()  # None for chunked datasets (ours all are):
        if offset is None:
            offset = ds.id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset + at)
        byte = fh.read(1)
        fh.seek(offset + at)
        fh.write(bytes([byte[0] ^ 0xFF]))


def refusal(path: Path, **kw) -> str:
    with pytest.raises(CheckpointError) as info:
        ckpt.load(path, **kw)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    return msg


# --------------------------------------------------------------------------------------------
# round trips


def test_round_trip_everything_bit_exact(tmp_path):
    model = make_model()
    optimizer = {
        "exp_avg": {k: v * 2 for k, v in model.items() if v.is_floating_point()},
        "step": {k: torch.tensor(7.0) for k in model},
    }
    optimizer_attrs = {"name": "adam", "step": 7, "hyperparameters": {"lr": 1e-3, "betas": [0.9]}}
    algorithm = {
        "dcasgd": {
            "backup": {"dc0": {"features.0.weight": torch.ones(4, 3)}, "dc1": {}},
            "lambda": 0.04,
            "enabled": True,
        },
        "hfa": {"k1": 4, "k2": 16, "milestone": torch.arange(5), "note": None, "dcs": [0, 1]},
    }
    rng = torch.get_rng_state()
    progress = {
        "rng": {"torch": rng, "python": list(random.getstate()[1])},
        "data_positions": torch.tensor([10, 20, 30, 40], dtype=torch.int64),
        "raw": b"\x00\xffbytes",
        "big_int": 2**70,
    }
    path = ckpt.save(
        tmp_path / ckpt.checkpoint_name(1200),
        model=model,
        optimizer=optimizer,
        optimizer_attrs=optimizer_attrs,
        algorithm=algorithm,
        progress=progress,
        step=1200,
        epoch=3,
        algorithm_name="mixedsync",
        topology={"dcs": 2, "workers_per_dc": [4, 4]},
        config={"lr": 0.1, "model": "cnn"},
        metrics={"test_acc": 0.97, "loss": 0.1},
    )
    assert path == tmp_path / "ckpt-00001200.h5"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left

    ck = ckpt.load(path, expect_fingerprint=ckpt.fingerprint(model))
    assert list(ck.model) == list(model)  # creation order kept
    for k, v in model.items():
        assert same(ck.model[k], v), k
    assert ck.model["scalar"].dim() == 0 and ck.model["bf16_scalar"].dtype == torch.bfloat16
    assert set(ck.optimizer) == {"exp_avg", "step"}
    for state, tensors in optimizer.items():
        for k, v in tensors.items():
            assert same(ck.optimizer[state][k], v), (state, k)
    assert ck.optimizer_attrs == optimizer_attrs
    assert ck.algorithm["dcasgd"]["lambda"] == 0.04 and ck.algorithm["dcasgd"]["enabled"] is True
    assert same(ck.algorithm["dcasgd"]["backup"]["dc0"]["features.0.weight"], torch.ones(4, 3))
    assert ck.algorithm["dcasgd"]["backup"]["dc1"] == {}
    assert same(ck.algorithm["hfa"]["milestone"], torch.arange(5))
    assert {k: v for k, v in ck.algorithm["hfa"].items() if k != "milestone"} == {
        "k1": 4,
        "k2": 16,
        "note": None,
        "dcs": [0, 1],
    }
    assert same(ck.progress["rng"]["torch"], rng)
    assert ck.progress["rng"]["python"] == progress["rng"]["python"]
    assert same(ck.progress["data_positions"], progress["data_positions"])
    assert ck.progress["raw"] == b"\x00\xffbytes" and ck.progress["big_int"] == 2**70
    assert "step" not in ck.progress  # it is ck.step

    a = ck.attrs
    assert a["format"] == "geompi-checkpoint" and a["format_version"] == ckpt.FORMAT_VERSION == 1
    assert (ck.step, ck.epoch, ck.algorithm_name) == (1200, 3, "mixedsync")
    assert a["topology"] == {"dcs": 2, "workers_per_dc": [4, 4]}
    assert a["config"] == {"lr": 0.1, "model": "cnn"}
    assert a["metrics"] == {"test_acc": 0.97, "loss": 0.1}
    assert a["model_fingerprint"] == ckpt.fingerprint(model) == ck.fingerprint
    assert a["created"].endswith("Z") and isinstance(a["geompi_version"], str)

    # the RNG state restores the same stream
    torch.set_rng_state(ck.progress["rng"]["torch"])
    x = torch.rand(4)
    torch.set_rng_state(rng)
    assert torch.equal(torch.rand(4), x)

    assert ckpt.verify(path) == []
    sd = ckpt.load_state_dict(path)
    assert list(sd) == list(model) and all(same(sd[k], v) for k, v in model.items())


def test_every_dataset_has_fletcher32_and_dtype(tmp_path):
    path = save_small(tmp_path / "c.h5", progress={"pos": torch.arange(3)})
    seen = []

    def check(name, obj):
        if isinstance(obj, h5py.Dataset):
            seen.append(name)
            assert obj.fletcher32 and obj.chunks is not None, name
            assert obj.attrs["dtype"].decode() in ckpt._DTYPES, name

    with h5py.File(path, "r") as f:
        f.visititems(check)
        assert f["model/bf16"].dtype == np.int16 and f["model/bf16"].attrs["dtype"] == b"bfloat16"
        assert f["model/scalar"].shape == (1,) and f["model/scalar"].attrs["scalar"] == 1
    assert "model/features.0.weight" in seen and "progress/pos" in seen


def test_chunk_by_chunk_writer_matches_hdf5(tmp_path, monkeypatch):
    """Our own fletcher32 (large datasets) must be what HDF5 checks on read, partial chunks too."""
    monkeypatch.setattr(ckpt.writer, "_DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(ckpt.format, "_CHUNK_BYTES", 1000)
    g = torch.Generator().manual_seed(1)
    model = {
        "odd_bytes": torch.randint(0, 256, (4001,), dtype=torch.uint8, generator=g),
        "rows": torch.randn(37, 11, generator=g),  # several rows per chunk, a partial last one
        "long_rows": torch.randn(3, 1001, generator=g),  # one row exceeds a chunk: split dim 1
        "cube": torch.randn(4, 5, 60, generator=g).double(),
        "bf16": torch.randn(999, generator=g).bfloat16(),
        "i16": torch.randint(-(2**15), 2**15, (777,), dtype=torch.int16, generator=g),
        "zeros": torch.zeros(3000),
        "ones_bits": torch.full((3000,), -1, dtype=torch.int32),
    }
    path = ckpt.save(tmp_path / "c.h5", model=model)
    with h5py.File(path, "r") as f:  # HDF5's own filter verifies every chunk here
        for k, v in model.items():
            ds = f["model"][k]
            assert ds.chunks is not None and ds.id.get_num_chunks() >= 2, k
            raw = ds[()]
            want = v.view(torch.int16) if v.dtype == torch.bfloat16 else v
            assert np.array_equal(raw, want.numpy()), k
    ck = ckpt.load(path)
    for k, v in model.items():
        assert same(ck.model[k], v), k


def _fletcher32_reference(data: bytes) -> int:
    """HDF5's H5_checksum_fletcher32, transcribed literally."""
    length, i, sum1, sum2 = len(data) // 2, 0, 0, 0
    while length:
        block = min(length, 360)
        length -= block
        for _ in range(block):
            sum1 += (data[i] << 8) | data[i + 1]
            i += 2
            sum2 += sum1
        sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
        sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    if len(data) % 2:
        sum1 += data[i] << 8
        sum2 += sum1
        sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
        sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    sum1 = (sum1 & 0xFFFF) + (sum1 >> 16)
    sum2 = (sum2 & 0xFFFF) + (sum2 >> 16)
    return (sum2 << 16) | sum1


@pytest.mark.parametrize("n", [0, 1, 2, 3, 719, 720, 721, 4096, 131071, 131072, 131073])
def test_fletcher32_matches_hdf5_algorithm(n):
    rng = np.random.default_rng(n)
    for data in (rng.integers(0, 256, n, dtype=np.uint8).tobytes(), bytes(n), b"\xff" * n):
        assert ckpt._fletcher32(data) == _fletcher32_reference(data)


def test_fingerprint_depends_on_names_shapes_dtypes_only():
    m = make_model(0)
    assert ckpt.fingerprint(m) == ckpt.fingerprint(make_model(1))  # other values
    assert ckpt.fingerprint(m) == ckpt.fingerprint(dict(reversed(list(m.items()))))
    assert ckpt.fingerprint(m) != ckpt.fingerprint({**m, "half": m["half"].float()})
    assert ckpt.fingerprint(m) != ckpt.fingerprint({**m, "features.0.bias": torch.zeros(5)})
    assert len(ckpt.fingerprint(m)) == 64


# --------------------------------------------------------------------------------------------
# refusals


def test_refuses_truncated_file(tmp_path):
    path = save_small(tmp_path / "c.h5")
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    assert "truncated" in refusal(path)
    assert len(ckpt.verify(path)) == 1


@pytest.mark.parametrize("dataset", ["/model/features.0.weight", "/model/big.weight"])
def test_refuses_flipped_byte(tmp_path, dataset):
    path = save_small(tmp_path / "c.h5")
    flip_byte(path, dataset, at=20)
    msg = refusal(path)
    assert dataset in msg and "checksum" in msg
    problems = ckpt.verify(path)
    assert len(problems) == 1 and dataset in problems[0]


def test_verify_reports_every_problem(tmp_path):
    path = save_small(tmp_path / "c.h5", progress={"pos": torch.arange(100)})
    flip_byte(path, "/model/features.0.bias", at=4)
    flip_byte(path, "/progress/pos", at=8)
    problems = ckpt.verify(path)
    assert len(problems) == 2, problems
    assert "/model/features.0.bias" in problems[0] and "/progress/pos" in problems[1]


def test_refuses_newer_format_version(tmp_path):
    path = save_small(tmp_path / "c.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = np.int64(7)
    msg = refusal(path)
    assert "written by format_version 7, this geompi reads 1: upgrade geompi" in msg


def test_refuses_other_format(tmp_path):
    path = save_small(tmp_path / "c.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["format"] = np.bytes_(b"something-else")
    assert "not a geompi checkpoint" in refusal(path)


def test_refuses_missing_attribute_and_group(tmp_path):
    path = save_small(tmp_path / "c.h5")
    with h5py.File(path, "r+") as f:
        del f.attrs["step"]
        del f["optimizer"]
    assert "missing root attribute 'step'" in refusal(path)
    problems = ckpt.verify(path)
    assert any("'step'" in p for p in problems) and any("/optimizer" in p for p in problems)


def test_refuses_different_model(tmp_path):
    path = save_small(tmp_path / "c.h5")
    other = {**make_model(), "classifier.weight": torch.zeros(10, 4)}
    msg = refusal(path, expect_fingerprint=ckpt.fingerprint(other))
    assert "is of a different model" in msg
    assert "pass the same --model/--dataset as the run that wrote it" in msg
    ckpt.load(path, expect_fingerprint=ckpt.fingerprint(make_model(5)))  # same shapes: fine


def test_refuses_edited_fingerprint(tmp_path):
    path = save_small(tmp_path / "c.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["model_fingerprint"] = np.bytes_(b"0" * 64)
    assert "does not match the /model tensors" in refusal(path)
    # verify=False skips the fingerprint check, not the content digest every load checks
    assert "does not match its content_sha256 attribute" in refusal(path, verify=False)


@pytest.mark.parametrize("content", [b"", b"definitely not HDF5" * 100])
def test_refuses_garbage_and_missing(tmp_path, content):
    path = tmp_path / "ckpt-00000001.h5"
    path.write_bytes(content)
    assert "empty" in refusal(path) if not content else "not an HDF5 file" in refusal(path)
    assert "no such file" in refusal(tmp_path / "missing.h5")


# --------------------------------------------------------------------------------------------
# writing: bad input, unwritable places, crash safety


def test_rejects_bad_names_and_values_before_writing(tmp_path):
    bad_inputs = [
        {"model": {"a/b": torch.zeros(1)}},
        {"model": {".": torch.zeros(1)}},
        {"model": {"w": [1.0, 2.0]}},
        {"model": {"w": torch.zeros(2, 2).to_sparse()}},
        {"model": {"w": torch.zeros(1)}, "progress": {"step": 3}},
        {"model": {"w": torch.zeros(1)}, "algorithm": {"x/y": 1}},
        {"model": {"w": torch.zeros(1)}, "config": {"bad": object()}},
    ]
    for kw in bad_inputs:
        with pytest.raises(CheckpointError) as info:
            ckpt.save(tmp_path / "c.h5", **kw)
        assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError) as info:
        save_small(blocker / "run" / "ckpt-00000001.h5")
    msg = str(info.value)
    assert msg.startswith(f"cannot write checkpoint to {blocker / 'run'}: ")
    assert msg.endswith("; pass a writable --checkpoint-dir") and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_creates_missing_directories(tmp_path):
    path = save_small(tmp_path / "run" / "checkpoints" / ckpt.checkpoint_name(3), step=3)
    assert ckpt.load(path).step == 3


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_killed_writer_leaves_previous_checkpoint_intact(tmp_path):
    final = save_small(tmp_path / ckpt.checkpoint_name(1), step=1)
    before = _sha256(final)
    child = (
        "import sys, torch\n"
        "from geompi import ckpt\n"
        "model = {f'w{i}': torch.full((5_000_000,), float(i)) for i in range(10)}\n"
        "ckpt.save(sys.argv[1], model=model, step=2)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(final)], env=ENV, cwd=REPO)
    deadline = time.monotonic() + 60

    def partial() -> bool:  # the temporary name is .NAME.tmp-HOST-PID-RANDOM
        tmps = list(tmp_path.glob(f".{final.name}.tmp-*-{proc.pid}-*"))
        return bool(tmps) and tmps[0].stat().st_size > 16 << 20  # mid-way through 200 MB

    try:
        while not partial():
            assert proc.poll() is None, "the writer finished or failed before it was killed"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert _sha256(final) == before  # the old checkpoint is untouched under its name
    assert ckpt.verify(final) == [] and ckpt.load(final).step == 1
    assert ckpt.list_checkpoints(tmp_path) == [final]  # the partial temporary is ignored
    assert ckpt.latest(tmp_path) == final
    ckpt.save(final, model=make_model(), step=5)  # and the next save replaces it fine
    assert ckpt.load(final).step == 5


def test_names_list_latest_prune(tmp_path):
    assert ckpt.checkpoint_name(1200) == "ckpt-00001200.h5"
    assert ckpt.checkpoint_name(123456789) == "ckpt-123456789.h5"
    assert ckpt.list_checkpoints(tmp_path / "nope") == [] and ckpt.latest(tmp_path) is None
    for step in (5, 7, 20, 100, 123456789):  # written in step order: latest is the last one
        ckpt.save(tmp_path / ckpt.checkpoint_name(step), model={"w": torch.zeros(2)}, step=step)
    (tmp_path / ".ckpt-00000999.h5.tmp-4242").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("x")
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == [ckpt.checkpoint_name(s) for s in (5, 7, 20, 100, 123456789)]
    assert ckpt.latest(tmp_path).name == "ckpt-123456789.h5"
    deleted = ckpt.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == [ckpt.checkpoint_name(s) for s in (5, 7, 20)]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == names[-2:]
    assert ckpt.prune(tmp_path, keep=2) == []
    assert (tmp_path / "notes.txt").exists()
    with pytest.raises(ValueError):
        ckpt.prune(tmp_path, keep=0)


# --------------------------------------------------------------------------------------------
# command line


def test_cli_verify(tmp_path, capsys):
    good = save_small(tmp_path / "good.h5", step=42)
    bad = save_small(tmp_path / "bad.h5")
    flip_byte(bad, "/model/big.weight")
    assert ckpt.main(["verify", str(good)]) == 0
    n = len(make_model())
    assert capsys.readouterr().out == f"OK {good} ({n} tensors, step 42)\n"
    assert ckpt.main(["verify", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "/model/big.weight" in out[0] and str(bad) in out[0]
    assert ckpt.main(["verify", str(good), str(bad)]) == 1
    assert ckpt.main(["verify", str(tmp_path / "missing.h5")]) == 1


def test_cli_module_entry_point(tmp_path):
    good = save_small(tmp_path / "good.h5", step=42)
    r = subprocess.run(
        [sys.executable, "-m", "geompi.ckpt", "verify", str(good)],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK {good} (") and "step 42" in r.stdout


def test_cli_usage_errors(tmp_path, capsys):
    good = save_small(tmp_path / "good.h5")
    for argv in ([], ["frobnicate"], ["export", str(good), "--to", str(tmp_path / "x.bin")]):
        assert ckpt.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("geompi.ckpt: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "x.bin").exists()
    assert ckpt.main(["ls", str(tmp_path / "missing")]) == 2
    with pytest.raises(ValueError):
        ckpt.export(good, tmp_path / "x.bin")


def test_cli_bad_checkpoint_is_exit_1(tmp_path, capsys):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"junk" * 10)
    assert ckpt.main(["inspect", str(junk)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("geompi.ckpt: error: checkpoint ") and err.count("\n") == 1


def test_cli_inspect(tmp_path, capsys):
    path = save_small(tmp_path / "c.h5", step=9, optimizer_attrs={"name": "sgd"})
    assert ckpt.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "@format = geompi-checkpoint" in out and "@step = 9" in out
    assert '@metrics = {"test_acc": 0.97}' in out and "@name = sgd" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("features.0.weight"))
    assert "float32  [4, 3]  48 B  min=" in line and "max=" in line and "mean=" in line
    assert "norm=" in line
    assert "bf16  bfloat16  [2, 3]  12 B" in out and "empty  float32  [0, 7]  0 B  empty" in out
    assert f"{len(make_model())} tensors" in out


def test_cli_diff(tmp_path, capsys):
    a = save_small(tmp_path / "a.h5")
    b = save_small(tmp_path / "b.h5")
    assert ckpt.main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "/model/big.weight: max abs diff 0" in out and out.endswith("identical\n")

    model = make_model()
    model["features.0.bias"] = model["features.0.bias"] + 0.5
    del model["half"]
    c = ckpt.save(tmp_path / "c.h5", model={**model, "extra": torch.ones(2)}, step=1, epoch=0)
    assert ckpt.main(["diff", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "/model/features.0.bias: max abs diff 0.5  (differs)" in out
    assert "only in A: /model/half" in out and "only in B: /model/extra" in out
    assert "differences" in out.splitlines()[-1]
    assert ckpt.main(["diff", str(a), str(tmp_path / "missing.h5")]) == 2


def test_cli_export(tmp_path, capsys):
    from safetensors.torch import load_file

    path = save_small(tmp_path / "c.h5")
    model = make_model()
    for suffix in (".pt", ".safetensors", ".npz"):
        out = tmp_path / f"model{suffix}"
        assert ckpt.main(["export", str(path), "--to", str(out)]) == 0
        if suffix == ".pt":
            got = torch.load(out, weights_only=True)
        elif suffix == ".safetensors":
            got = load_file(out)
        else:
            with np.load(out, allow_pickle=False) as z:
                got = {k: torch.from_numpy(z[k]) for k in z.files}
        assert sorted(got) == sorted(model), suffix  # safetensors sorts its keys
        for k, v in model.items():
            if suffix == ".npz" and v.dtype == torch.bfloat16:
                v = v.float()  # npz has no bfloat16: widened exactly
            assert same(got[k], v), (suffix, k)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c.h5",
        "model.npz",
        "model.pt",
        "model.safetensors",
    ]


def test_cli_ls(tmp_path, capsys):
    save_small(tmp_path / ckpt.checkpoint_name(100), step=100, algorithm_name="hfa")
    ckpt.save(tmp_path / ckpt.checkpoint_name(200), model={"w": torch.zeros(1)}, step=200)
    (tmp_path / ckpt.checkpoint_name(300)).write_bytes(b"junk")
    assert ckpt.main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STEP", "EPOCH", "ALGORITHM", "TEST_ACC", "CREATED"]
    assert lines[1].split()[:5] == ["ckpt-00000100.h5", "100", "10", "hfa", "0.9700"]
    assert lines[2].split()[:5] == ["ckpt-00000200.h5", "200", "0", "fsa", "-"]
    assert lines[3].startswith("ckpt-00000300.h5") and "unreadable" in lines[3]


# --------------------------------------------------------------------------------------------
# other readers


@pytest.mark.skipif(
    not (shutil.which("h5ls") and shutil.which("h5dump")),
    reason="h5ls/h5dump not installed (apt-get install hdf5-tools); CI installs them",
)
def test_hdf5_tools_read_the_file(tmp_path):
    path = save_small(tmp_path / "c.h5", algorithm={"dcasgd": {"backup": {"dc0": make_model()}}})
    ls = subprocess.run(["h5ls", "-r", str(path)], capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    assert "/model/features.0.weight Dataset {4, 3}" in ls.stdout
    assert "/algorithm/dcasgd/backup/dc0/big.weight Dataset {300, 500}" in ls.stdout
    dump = subprocess.run(["h5dump", "-A", str(path)], capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    assert '"geompi-checkpoint"' in dump.stdout and 'ATTRIBUTE "model_fingerprint"' in dump.stdout
    # h5dump checks the fletcher32 of the data it prints
    data = subprocess.run(
        ["h5dump", "-d", "/model/big.weight", str(path)], capture_output=True, timeout=60
    )
    assert data.returncode == 0, data.stderr


_FILE_SIZE_LIMIT = """
import resource, sys, torch
from geompi import ckpt
from geompi.errors import CheckpointWriteError
model = {f"layer{i}.weight": torch.randn(100, 100) for i in range(20)}
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY))
try:
    ckpt.save(sys.argv[1] + "/a.h5", model=model, step=1)
except CheckpointWriteError as e:
    print("refused:", e)
"""


def test_a_file_size_limit_is_one_error_not_tracebacks_and_a_crash(tmp_path):
    """A file-size limit (RLIMIT_FSIZE: EFBIG) met halfway through HDF5's writes leaked its
    objects: 42 'Exception ignored' tracebacks, then signal 11 at exit. The writer now has
    the whole file allocated first, so the limit is met before HDF5 writes anything."""
    res = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMIT, str(tmp_path)],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr
    assert "refused: cannot write checkpoint to" in res.stdout and "File too large" in res.stdout
    assert not list(tmp_path.iterdir())  # no temporary left behind
