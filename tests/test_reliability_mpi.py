"""Issue #13: what a long run on a real cluster meets: rotation after a resume, a bad newest
checkpoint, a full disk, settings that differ between ranks, idle ranks under a watchdog."""

from __future__ import annotations

import pytest

from geompi import ckpt
from tests.mpirun import HOOKS, error_lines, mpirun, train_runs

pytestmark = pytest.mark.mpi
BASE = ["-m", "geompi.train", "--model", "mlp", "--batch-size", "12", "--progress-every", "1e9"]


def train(n, *args, timeout=120, check=True, env=None):
    return mpirun(n, BASE + [str(a) for a in args], timeout=timeout, check=check, env=env)


def train_seq(n, out, *runs, timeout=120):
    """train(n, *args, env=env) for each (args, env) of RUNS in turn, in ONE mpirun job
    (tests.mpirun.train_runs: the ranks start once, not once a run); each under TIMEOUT.
    A resume never directly follows the run whose checkpoint it reads (state a run left in
    the process would then be another step's)."""
    return train_runs(
        n, [(BASE[2:] + list(a), e) for a, e in runs], out / "runs", timeout * len(runs)
    )


def test_rotation_after_resume_from_an_older_checkpoint(tmp_path):
    d = tmp_path / "ck"
    older = d / ckpt.checkpoint_name(10)
    _, res = train_seq(
        3,
        tmp_path,
        (["--steps", 50, "--checkpoint-dir", d, "--checkpoint-every", 10, "--keep", 5], {}),
        (["--steps", 30, "--checkpoint-dir", d, "--checkpoint-every", 15, "--keep", 2,
          "--resume", older], {}),
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


def test_resume_latest_refuses_a_newer_checkpoint_of_another_model(tmp_path):
    """A good file of another model is a mistake to report, not a damaged file to skip: the
    run refused to resume from it, then wrote over it with its own checkpoint of that step."""
    d, other = tmp_path / "ck", tmp_path / "other"
    linear = ["--model", "linear", "--steps", 20, "--checkpoint-dir", other]
    train_seq(
        3,
        tmp_path,
        (["--steps", 10, "--checkpoint-dir", d, "--checkpoint-every", 10], {}),
        ([*linear, "--checkpoint-every", 20], {}),
    )
    theirs = d / ckpt.checkpoint_name(20)
    theirs.write_bytes((other / ckpt.checkpoint_name(20)).read_bytes())  # the newest file
    before = theirs.read_bytes()
    res = train(
        3, "--steps", 30, "--checkpoint-dir", d, "--checkpoint-every", 10, "--resume", "latest",
        check=False, timeout=60,
    )  # fmt: skip
    errs = error_lines(res.stderr)
    assert res.returncode == 2 and len(errs) == 1, res.stderr[-3000:]
    assert "ckpt-00000020.h5 is of a different model" in errs[0], errs
    assert theirs.read_bytes() == before  # untouched
    assert [p.name for p in ckpt.list_checkpoints(d)] == [
        ckpt.checkpoint_name(10),
        ckpt.checkpoint_name(20),
    ]


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
    """MPMD: rank 4 (the global server) alone reads GEOMPI_SYNC=hfa. Before, the job ran on
    with one rank configured differently (exit 0); a worker reading it hangs the job."""
    import sys

    from tests.mpirun import mpirun_path, run

    args = [sys.executable, *BASE, "--steps", "4"]
    cmd = [mpirun_path(), "-n", "4", *args, ":", "-n", "1", "env", "GEOMPI_SYNC=hfa", *args]
    res = run(cmd, timeout=60)
    errs = error_lines(res.stderr)
    assert res.returncode == 2 and len(errs) == 1, res.stderr[-3000:]
    assert "GEOMPI_SYNC differs between ranks (rank 0: unset, rank 4: 'hfa')" in errs[0]


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of the given size (needs root; skipped where mount is refused)."""
    import subprocess

    mounted = []

    def make(size: str):
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _fill(d, leave: int) -> None:
    import os

    st = os.statvfs(d)
    (d / "ballast").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def test_full_disk_at_start_up_is_one_line_before_training(small_fs):
    d = small_fs("1m")
    _fill(d, 64 * 1024)  # a 0-byte probe succeeds here, one checkpoint does not fit
    res = train(3, "--steps", 20, "--checkpoint-dir", d / "ck", "--momentum", "0.9", check=False)
    errs = error_lines(res.stderr)
    assert res.returncode == 2 and len(errs) == 1, res.stderr[-3000:]
    assert "free but one checkpoint needs about" in errs[0]
    assert "free some space or pass another --checkpoint-dir" in errs[0]


def test_disk_full_mid_run_keeps_training(small_fs):
    """Training goes on past checkpoints that do not fit; but a run whose last checkpoint
    could not be written ends non-zero with one line (it exited 0: the batch system recorded
    a success whose final state was lost)."""
    d = small_fs("2m")
    _fill(d, 700 * 1024)  # the start-up check passes, a few checkpoints fit, then none
    res = train(
        3, "--steps", 60, "--checkpoint-dir", d / "ck", "--checkpoint-every", 5, "--keep", 100,
        "--metrics", d / "m.jsonl", "--momentum", "0.9", check=False, timeout=180,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    errs = error_lines(res.stderr)
    assert len(errs) == 1 and "checkpoint of the last step (60) could not be written" in errs[0]
    assert "Traceback" not in res.stderr and "Segmentation" not in res.stderr
    warns = [ln for ln in res.stderr.splitlines() if "not written" in ln]
    assert warns and "No space left on device" in warns[0], res.stderr[-3000:]
    assert "training goes on, the last good checkpoint is ckpt-" in warns[0]
    assert "steps=60" in res.stderr  # trained to the end
    good = ckpt.list_checkpoints(d / "ck")
    assert good and all(ckpt.verify(p) == [] for p in good)
    assert not [p for p in (d / "ck").iterdir() if p.name.startswith(".")]  # no temporaries


def test_metrics_write_failure_does_not_stop_training(small_fs):
    d = small_fs("64k")
    _fill(d, 8 * 1024)
    res = train(3, "--steps", 300, "--metrics", d / "m.jsonl", check=False, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not error_lines(res.stderr)
    warns = [ln for ln in res.stderr.splitlines() if "cannot write the metrics file" in ln]
    assert len(warns) == 1 and "No space left on device" in warns[0], res.stderr[-3000:]
    assert "steps=300" in res.stderr


def test_mixedsync_summary_has_bounded_staleness_statistics(tmp_path):
    from tests.mpirun import read_jsonl

    m = tmp_path / "m.jsonl"
    train(5, "--sync", "mixed", "--steps", 60, "--dc-slowdown", "1:2", "--metrics", m)
    summary = read_jsonl(m)[-1]
    assert "staleness" not in summary  # the list of every update, unbounded
    hist = summary["staleness_histogram"]
    assert sum(hist.values()) == summary["staleness_updates"] == sum(summary["dc_updates"])
    assert summary["max_staleness_seen"] == max(d["max"] for d in summary["staleness_per_dc"])
    assert len(summary["updates_at_first_done"]) == 2


def test_idle_hfa_ranks_are_not_taken_for_lost(tmp_path):
    """HFA with K1=400: the global servers hear nothing for 400 steps, far beyond a 1 s
    --comm-timeout. Measuring silence aborted this healthy run ("a rank was lost")."""
    res = train(
        9, "--sync", "hfa", "--k1", 400, "--k2", 2, "--steps", 800, "--comm-timeout", 1,
        check=False, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert not error_lines(res.stderr)
    assert "steps=800" in res.stderr


def test_train_twice_in_one_process_restores_signal_handlers():
    import json

    from tests.mpirun import prog

    res = mpirun(
        3, [prog("train_twice.py"), "--model", "mlp", "--progress-every", "1e9"], timeout=180
    )
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")][-1]
    out = json.loads(line)
    assert out["first_preempted"] and not out["second_preempted"], out
    assert out["second_steps"] == 6
    assert out["sigint_default"] and out["sigusr1_default"] and out["sigterm_default"], out


def test_hfa_stops_within_k1_steps_of_sigterm_and_resumes_exactly(tmp_path):
    """Issue #13 point 8: HFA agreed on a stop only at global syncs (K1*K2 steps apart),
    and acted a poll later, far past a scheduler's grace period. Now a SIGTERM on one worker
    after step 26 (K1*K2 = 20 here) stops every rank at the next datacenter round (step 28);
    the checkpoint is of the last global sync (step 20), and a resume from it ends bitwise
    where an uninterrupted run ends."""
    from tests.test_resume_mpi import identical

    hfa = ["--sync", "hfa", "--k1", 4, "--k2", 5, "--dcs", 2, "--momentum", 0.9, "--steps", 40]
    part, full, again = tmp_path / "part", tmp_path / "full", tmp_path / "again"
    # (the resume writes to its own directory: part keeps what the stopped run left)
    res, _, resumed = train_seq(
        7,
        tmp_path,
        ([*hfa, "--checkpoint-dir", part], {**HOOKS, "GEOMPI_FAULT_SIGNAL_AT": "26:1"}),
        ([*hfa, "--checkpoint-dir", full], {}),
        ([*hfa, "--checkpoint-dir", again, "--resume", part / ckpt.checkpoint_name(20)], {}),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert not error_lines(res.stderr)
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("geompi: preempted"))
    assert "at step 20 (stopped at step 28, between global syncs" in line, line
    assert "checkpoint written" in line, line
    assert [p.name for p in ckpt.list_checkpoints(part)] == [ckpt.checkpoint_name(20)]
    res = resumed
    assert "at step 20" in res.stderr and "steps=40" in res.stderr, res.stderr[-3000:]
    name = ckpt.checkpoint_name(40)
    assert identical(again / name, full / name)
    assert not identical(again / name, part / ckpt.checkpoint_name(20))
