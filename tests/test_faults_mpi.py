"""Faults: a killed worker or server ends the whole job quickly, naming the lost rank, and
``--resume latest`` continues from the last checkpoint."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from geompi import ckpt
from tests.mpirun import MPI_ENV, REPO, mpirun, mpirun_path, pid_alive

pytestmark = pytest.mark.mpi
EVERY = 20


def _pid_of_rank(rank: int, tag: str) -> int | None:
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = env_file.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"GEOMPI_TEST_TAG={tag}".encode() in env and (
            f"OMPI_COMM_WORLD_RANK={rank}".encode() in env
        ):
            return int(env_file.parent.name)
    return None


def _launch(args: list[str], tag: str, merge_stderr: bool) -> subprocess.Popen:
    """A long 9-rank training job in the background, its ranks tagged for _pid_of_rank."""
    cmd = [
        mpirun_path(),
        "-n",
        "9",
        sys.executable,
        "-m",
        "geompi.train",
        "--model",
        "mlp",
        "--steps",
        "100000",
        *args,
    ]
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(REPO), "GEOMPI_TEST_TAG": tag}
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize("victim,rank", [("worker", 3), ("global server", 8)])
def test_killed_rank_aborts_job_and_resume_continues(tmp_path, victim, rank):
    tag = uuid.uuid4().hex
    d = tmp_path / "ck"
    p = _launch(
        ["--checkpoint-dir", str(d), "--checkpoint-every", str(EVERY), "--progress-every", "1e9"],
        tag,
        merge_stderr=True,
    )
    try:
        deadline = time.monotonic() + 90
        while len(ckpt.list_checkpoints(d)) < 2 if d.exists() else True:
            assert time.monotonic() < deadline and p.poll() is None, "no checkpoints appeared"
            time.sleep(0.2)
        pid = _pid_of_rank(rank, tag)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=60)  # every other rank must be gone within 60 s
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode != 0 and elapsed < 60
    assert f"rank {rank}" in out, out  # the launcher names the lost rank
    last = ckpt.latest(d)
    step = ckpt.load(last).step
    assert step % EVERY == 0 and step >= 2 * EVERY
    res = mpirun(
        9,
        [
            "-m",
            "geompi.train",
            "--model",
            "mlp",
            "--steps",
            str(step + 10),
            "--checkpoint-dir",
            str(d),
            "--resume",
            "latest",
            "--progress-every",
            "1e9",
        ],
        timeout=120,
    )
    assert f"resumed from {last} at step {step}" in res.stderr
    assert f"steps={step + 10}" in res.stderr


def test_comm_timeout_watchdog_catches_a_stuck_rank(tmp_path):
    """A stopped (not dead) worker: Open MPI cannot notice it, the servers' watchdog does.

    The stopped process cannot be killed by the abort until it runs again, so the test resumes
    it after the watchdog should have fired: had nobody noticed, the job would train on.
    """
    tag = uuid.uuid4().hex
    metrics = tmp_path / "m.jsonl"
    p = _launch(["--comm-timeout", "5", "--metrics", str(metrics)], tag, merge_stderr=False)
    try:
        deadline = time.monotonic() + 120
        # the watchdog guards the servers' waits during training: wait until training runs
        while not metrics.exists() or metrics.read_text().count('"loss"') < 20:
            assert time.monotonic() < deadline and p.poll() is None, "training did not start"
            time.sleep(0.2)
        pid, master = _pid_of_rank(3, tag), _pid_of_rank(0, tag)
        os.kill(pid, signal.SIGSTOP)
        # The local server's watchdog fires after 5 s and the abort ends the running ranks,
        # the master among them; without it the master trains on and this waits out 30 s.
        until = time.monotonic() + 30
        while time.monotonic() < until and pid_alive(master):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):  # the abort may have ended it already
            os.kill(pid, signal.SIGCONT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    errs = [ln for ln in err.splitlines() if ln.startswith("geompi: error:")]
    assert p.returncode != 0
    assert len(errs) == 1 and "no answer for 5 s" in errs[0], err[-3000:]
    assert "the workers of datacenter 1" in errs[0]
