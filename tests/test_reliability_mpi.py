"""Issue #13: what a long run on a real cluster meets: rotation after a resume, a bad newest
checkpoint, a full disk, settings that differ between ranks, idle ranks under a watchdog."""

from __future__ import annotations

import pytest

from geompi import ckpt
from tests.mpirun import error_lines, mpirun

pytestmark = pytest.mark.mpi
BASE = ["-m", "geompi.train", "--model", "mlp", "--batch-size", "12", "--progress-every", "1e9"]


def train(n, *args, timeout=120, check=True, env=None):
    return mpirun(n, BASE + [str(a) for a in args], timeout=timeout, check=check, env=env)


def test_rotation_after_resume_from_an_older_checkpoint(tmp_path):
    d = tmp_path / "ck"
    train(3, "--steps", 50, "--checkpoint-dir", d, "--checkpoint-every", 10, "--keep", 5)
    older = d / ckpt.checkpoint_name(10)
    res = train(
        3, "--steps", 30, "--checkpoint-dir", d, "--checkpoint-every", 15, "--keep", 2,
        "--resume", older,
    )  # fmt: skip
    assert f"resumed from {older} at step 10" in res.stderr
    # the run's own newest files survive: before, ckpt-15 was deleted right after it was written
    assert [p.name for p in ckpt.list_checkpoints(d)] == [
        ckpt.checkpoint_name(15),
        ckpt.checkpoint_name(30),
    ]
    assert ckpt.latest(d).name == ckpt.checkpoint_name(30)


def test_resume_latest_skips_a_torn_newest_checkpoint(tmp_path):
    d = tmp_path / "ck"
    train(3, "--steps", 20, "--checkpoint-dir", d, "--checkpoint-every", 10)
    newest = d / ckpt.checkpoint_name(20)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a torn file (the disk filled, a node died)
    res = train(3, "--steps", 30, "--checkpoint-dir", d, "--resume", "latest", check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "skipped 1 unusable checkpoint(s), newest ckpt-00000020.h5" in res.stderr
    assert "resumed from" in res.stderr and "at step 10" in res.stderr
    assert not error_lines(res.stderr)


def test_resume_with_another_optimizer_is_refused_before_training(tmp_path):
    d = tmp_path / "ck"
    train(3, "--steps", 4, "--checkpoint-dir", d, "--momentum", "0.9")
    res = train(
        3, "--steps", 8, "--checkpoint-dir", d, "--resume", "latest", "--optimizer", "adam",
        check=False, timeout=60,
    )  # fmt: skip
    errs = error_lines(res.stderr)
    assert res.returncode == 2 and len(errs) == 1, res.stderr[-3000:]
    assert "holds sgd optimizer state" in errs[0] and "--optimizer sgd" in errs[0]
    assert "KeyError" not in res.stderr


def test_a_geompi_setting_that_differs_on_one_rank_is_refused(tmp_path):
    """MPMD: rank 4 alone reads GEOMPI_SYNC=hfa. Before, it took HFA's path and the others
    FSA's, and the job hung in their first collective."""
    import sys

    from tests.mpirun import mpirun_path, run

    args = [sys.executable, *BASE, "--steps", "4"]
    cmd = [mpirun_path(), "-n", "4", *args, ":", "-n", "1", "env", "GEOMPI_SYNC=hfa", *args]
    res = run(cmd, timeout=60)
    errs = error_lines(res.stderr)
    assert res.returncode == 2 and len(errs) == 1, res.stderr[-3000:]
    assert "GEOMPI_SYNC differs between ranks (rank 0: unset, rank 4: 'hfa')" in errs[0]
