"""geompi.ckpt in shared directories: temporary files are created exclusively, never through a
symlink someone planted; a missing optional package is one line (issue #13)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from geompi import ckpt


def good(path: Path) -> Path:
    model = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3).bfloat16()}
    return ckpt.save(path, model=model, step=3)


# --------------------------------------------------------------------------------------------
# temporary files in shared directories


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious data")
    return victim


def test_save_does_not_write_through_a_planted_temp_symlink(tmp_path):
    victim = _victim(tmp_path)
    d = tmp_path / "shared"
    d.mkdir()
    final = d / ckpt.checkpoint_name(1)
    (d / f".{final.name}.tmp-{os.getpid()}").symlink_to(victim)  # the old predictable name
    ckpt.save(final, model={"w": torch.zeros(3)}, step=1)
    assert victim.read_bytes() == b"precious data"
    assert ckpt.load(final).step == 1
    assert not final.is_symlink()


def test_export_does_not_write_through_a_planted_temp_symlink(tmp_path):
    victim = _victim(tmp_path)
    path = good(tmp_path / "c.h5")
    for suffix in (".pt", ".npz", ".safetensors"):
        out = tmp_path / f"model{suffix}"
        (tmp_path / f".{out.name}.tmp-{os.getpid()}").symlink_to(victim)
        ckpt.export(path, out)
        assert victim.read_bytes() == b"precious data", suffix
        assert out.is_file() and not out.is_symlink()


def test_check_writable_does_not_write_through_a_planted_symlink(tmp_path):
    from geompi.checkpointing import check_writable

    victim = _victim(tmp_path)
    d = tmp_path / "shared"
    d.mkdir()
    probe = d / f".geompi-write-test-{os.getpid()}"
    probe.symlink_to(victim)
    check_writable(str(d))
    assert victim.read_bytes() == b"precious data"
    assert probe.is_symlink()  # someone else's file: left alone
    assert sorted(p.name for p in d.iterdir()) == [probe.name]  # our own probe is gone


def test_temp_names_are_unique_and_exclusive(tmp_path, monkeypatch):
    """Two writers (nodes, or pids reused across nodes) never share a temporary name."""
    from geompi.ckpt import files

    seen = set()
    for _ in range(50):
        fd, p = files.create_temp(tmp_path, "ckpt-00000001.h5")
        os.close(fd)
        assert p.name.startswith(".ckpt-00000001.h5.tmp-") and p.name not in seen
        assert str(os.getpid()) in p.name
        seen.add(p.name)


# --------------------------------------------------------------------------------------------
# the optional safetensors package


def test_export_safetensors_without_the_package_is_one_line(tmp_path, capsys, monkeypatch):
    path = good(tmp_path / "c.h5")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now fails
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = tmp_path / "x.safetensors"
    assert ckpt.main(["export", str(path), "--to", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("geompi.ckpt: error: ") and err.count("\n") == 1, err
    assert "pip install 'geompi[safetensors]'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]


def test_rotation_follows_write_order_and_lineage(tmp_path):
    """After a resume from an older checkpoint the new files have lower steps than the
    abandoned ones: ordering by step deleted each new file right after it was written."""
    for step in (10, 20, 30, 40, 50):
        ckpt.save(tmp_path / ckpt.checkpoint_name(step), model={"w": torch.zeros(2)}, step=step)
    resumed = tmp_path / ckpt.checkpoint_name(10)
    new = tmp_path / ckpt.checkpoint_name(15)
    ckpt.save(new, model={"w": torch.ones(2)}, step=15)
    assert ckpt.latest(tmp_path) == new  # written last, although 50 has the higher step
    deleted = ckpt.prune(tmp_path, keep=2, lineage=[new, resumed])
    assert new.exists() and resumed.exists()
    assert sorted(p.name for p in deleted) == [ckpt.checkpoint_name(s) for s in (20, 30, 40, 50)]
    # keep=1: the file just written is never the one deleted
    ckpt.prune(tmp_path, keep=1, lineage=[new])
    assert ckpt.list_checkpoints(tmp_path) == [new]


def test_stale_temporaries_of_killed_writers_are_removed(tmp_path):
    from geompi.checkpointing import check_writable
    from geompi.ckpt import files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = files._host()
    stale = tmp_path / f".ckpt-00000020.h5.tmp-{host}-{dead.pid}-0123456789abcdef"
    stale.write_bytes(b"partial")
    probe = tmp_path / f".geompi-write-test-{host}-{dead.pid}-abc_12"
    probe.write_bytes(b"")
    live = tmp_path / f".ckpt-00000030.h5.tmp-{host}-{os.getpid()}-0123456789abcdef"
    live.write_bytes(b"being written")
    other = tmp_path / f".ckpt-00000040.h5.tmp-otherhost-{dead.pid}-0123456789abcdef"
    other.write_bytes(b"another node's writer")
    check_writable(str(tmp_path))
    assert not stale.exists() and not probe.exists()
    assert live.exists() and other.exists()  # a live writer, and a host we cannot ask
    day_old = time.time() - files.STALE_TEMP_S - 60
    os.utime(other, (day_old, day_old))
    assert files.remove_stale_temps(tmp_path) == [other]


def test_latest_and_rotation_go_by_recorded_write_order_not_file_times(tmp_path):
    """Issue 35 item 4: an older checkpoint dated ahead (clock skew on a shared filesystem, a
    restore, a copy in another order) was taken for the newest: --resume latest went back to
    step 10 and the rotation deleted steps 20 and 30."""
    names = {s: tmp_path / ckpt.checkpoint_name(s) for s in (10, 20, 30, 40)}
    for step, path in names.items():
        ckpt.save(path, model={"w": torch.full((2,), float(step))}, step=step)
    ahead = time.time() + 86400
    os.utime(names[10], (ahead, ahead))  # the oldest, dated a day ahead
    os.utime(names[40], (0, 0))  # the newest, dated 1970
    assert ckpt.latest(tmp_path) == names[40]
    assert ckpt.by_write_order(tmp_path) == [names[s] for s in (40, 30, 20, 10)]
    deleted = ckpt.prune(tmp_path, keep=3)
    assert deleted == [names[10]]
    assert ckpt.list_checkpoints(tmp_path) == [names[s] for s in (20, 30, 40)]
    # a resume from 40 writes 50: lineage and recorded order agree, whatever the dates
    new = tmp_path / ckpt.checkpoint_name(50)
    ckpt.save(new, model={"w": torch.zeros(2)}, step=50)
    os.utime(new, (1, 1))
    assert ckpt.prune(tmp_path, keep=2, lineage=[new, names[40]]) == [names[20], names[30]]
    assert ckpt.latest(tmp_path) == new


def test_write_order_is_recorded_in_the_file_and_a_torn_file_is_tried_first(tmp_path):
    from geompi.ckpt import files

    a, b = tmp_path / ckpt.checkpoint_name(30), tmp_path / ckpt.checkpoint_name(20)
    ckpt.save(a, model={"w": torch.zeros(2)}, step=30)
    ckpt.save(b, model={"w": torch.zeros(2)}, step=20)  # after a resume from an older one
    assert files.recorded_order(a) == (1, 30) and files.recorded_order(b) == (2, 20)
    assert ckpt.load(b).attrs["sequence"] == 2 and ckpt.verify(b) == []
    torn = tmp_path / ckpt.checkpoint_name(10)
    torn.write_bytes(a.read_bytes()[:100])
    assert files.recorded_order(torn) is None
    # --resume latest tries (and names) the unreadable file first, then the newest write
    assert ckpt.by_write_order(tmp_path) == [torn, b, a]
    # rotation drops what cannot be read before any good file
    assert ckpt.prune(tmp_path, keep=2) == [torn]


def test_a_write_order_that_is_not_an_integer_scalar_makes_the_file_unreadable(tmp_path):
    import h5py
    import numpy as np

    from geompi.ckpt import files

    path = ckpt.save(tmp_path / ckpt.checkpoint_name(5), model={"w": torch.zeros(2)}, step=5)
    with h5py.File(path, "r+") as f:
        f.attrs["sequence"] = np.arange(3)
    assert files.recorded_order(path) is None
    with h5py.File(path, "r+") as f:
        del f.attrs["sequence"]  # a file written before geompi recorded it: step alone
    assert files.recorded_order(path) == (0, 5)


def _held_like(model: dict, gen: torch.Generator) -> dict:
    return {n: torch.randn(t.shape, generator=gen) for n, t in model.items()}


def test_checkpoint_bytes_is_an_upper_estimate_of_the_files_each_algorithm_writes(tmp_path):
    """``checkpoint_bytes`` (the free space check_writable asks for) against real files holding
    what each algorithm's checkpoint holds, with Adam, 3 workers in 2 datacenters: FSA, the
    global servers' state once; HFA, each worker's own state and the outer optimizer's (the
    algorithm's ``checkpoint_copies``). Random values: nothing compresses."""
    from geompi.checkpointing import checkpoint_bytes
    from geompi.config import make_config

    gen = torch.Generator().manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    model = {n: p.detach().clone() for n, p in net.named_parameters()}
    step = {n: torch.tensor(3.0) for n in model}
    adam = {"exp_avg": _held_like(model, gen), "exp_avg_sq": _held_like(model, gen), "step": step}
    rng = {f"worker{i}": torch.get_rng_state() for i in range(3)}
    progress = {"data_positions": torch.tensor([[0, 1]] * 3), "steps": torch.tensor([1] * 3),
                "rng": rng}  # fmt: skip
    outer = {"outer_exp_avg": _held_like(model, gen), "outer_exp_avg_sq": _held_like(model, gen)}
    local = {f"worker{i}": {**adam, "exp_avg": _held_like(model, gen)} for i in range(3)}
    files = {
        "fsa": dict(optimizer=adam, optimizer_attrs={"name": "adam"}),
        "hfa": dict(optimizer_attrs={"name": "none"}, algorithm={"hfa": {**outer, "local": local}}),
    }
    for sync, parts in files.items():
        cfg = make_config(["--sync", sync, "--optimizer", "adam"])
        path = ckpt.save(tmp_path / f"{sync}.h5", model=model, progress=progress, **parts)
        size = path.stat().st_size
        need = checkpoint_bytes(net, cfg, num_workers=3, num_dcs=2)
        assert size <= need <= 1.25 * size + 512 * 1024, (sync, size, need)
