"""The one helper that starts ``mpirun`` from pytest: a subprocess with a timeout.

A hang then fails its test (the whole process group is killed) instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from geompi.runtime import LOCAL_OPENMPI_ENV

REPO = Path(__file__).resolve().parent.parent


def install_copy(tmp_path: Path) -> Path:
    """``pip install --target`` of a copy of the checkout (so the build leaves nothing in the
    checkout); returns the target directory, to put on PYTHONPATH."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "geompi", src / "geompi", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--target", str(site), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return site


PROGS = Path(__file__).resolve().parent / "progs"
BIN = Path(sys.executable).parent

MPI_ENV = {**LOCAL_OPENMPI_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def mpirun_path() -> str:
    local = BIN / "mpirun"
    return str(local) if local.exists() else (shutil.which("mpirun") or "mpirun")


class Hang(AssertionError):
    pass


# mpirun's own start-up failures, before any rank runs (seen in CI about once in 300 launches on
# a loaded 2-core machine; lfortran/lfortran#8610 sees the same): the launch is tried again, since
# no code under test ran. Anything else that fails is the test's failure.
LAUNCH_FAILURES = ("The PMIx server's listener thread failed to start",)
LAUNCH_TRIES = 3


def run(
    cmd: list[str], timeout: float, env: dict | None = None, cwd=None
) -> subprocess.CompletedProcess:
    """Run CMD with the MPI test environment and a hard timeout; a launch that mpirun itself
    could not start (LAUNCH_FAILURES) is tried again."""
    for _ in range(LAUNCH_TRIES):
        res = _run_once(cmd, timeout, env, cwd)
        if not _failed_to_launch(res):
            break
        print(f"mpirun could not start; trying again: {res.stderr.strip()}", file=sys.stderr)
    return res


def _failed_to_launch(res: subprocess.CompletedProcess) -> bool:
    return (
        res.returncode != 0
        and not res.stdout.strip()
        and any(msg in res.stderr for msg in LAUNCH_FAILURES)
    )


def _run_once(
    cmd: list[str], timeout: float, env: dict | None = None, cwd=None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(REPO), **(env or {})}
    p = subprocess.Popen(
        cmd,
        cwd=cwd or REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise Hang(
            f"{' '.join(cmd)} still running after {timeout} s (hang?)\n{out}\n{err}"
        ) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def mpirun(
    n: int,
    args: list[str],
    timeout: float = 180,
    env: dict | None = None,
    cwd=None,
    check: bool = True,
    launcher: list[str] | tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``mpirun -n N [LAUNCHER...] python ARGS`` with this test's Python; raises on hang (and
    on failure)."""
    cmd = [mpirun_path(), "-n", str(n), *launcher, sys.executable, *args]
    res = run(cmd, timeout, env, cwd)
    if check and res.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {res.returncode}\n--- stdout\n{res.stdout[-4000:]}"
            f"\n--- stderr\n{res.stderr[-6000:]}"
        )
    return res


# MPI fault tolerance (ULFM) as --on-failure continue needs it: no shared-memory transport
ULFM = ("--with-ft", "ulfm")
ULFM_ENV = {"OMPI_MCA_btl": "self,tcp"}
# geompi reads its GEOMPI_FAULT_* test hooks only with this switch (geompi.comm.faults)
HOOKS = {"GEOMPI_TEST_HOOKS": "1"}


def prog(name: str) -> str:
    return str(PROGS / name)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def error_lines(stderr: str) -> list[str]:
    """geompi's error lines. Open MPI may interleave its abort banner with a rank's output and
    leave a blank before the line: that is still one line."""
    return [ln.strip() for ln in stderr.splitlines() if ln.lstrip().startswith("geompi: error:")]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def train_runs(
    n: int, runs: list[tuple[list, dict]], out: Path, timeout: float, check: bool = True
) -> list[subprocess.CompletedProcess]:
    """Several ``geompi.train`` runs on N ranks, one after another in ONE mpirun job
    (tests/progs/train_runs.py: one start of Python, torch and MPI on each rank instead of one
    per run). ``runs``: (the CLI's arguments, extra environment) for each. Returns, for each
    run, its exit status (the highest of its ranks') and its stdout and stderr (every rank's,
    rank after rank), as ``mpirun`` would return them for that run alone. Raises, naming the
    run, if a run does not end on every rank (an abort ends the job), or exits non-zero while
    CHECK, or if the job hangs (TIMEOUT: the sum of the runs' own). Where a run could have
    left state in the process that the next needs, the tests order the runs so that it would
    be the wrong state (a resume comes after a run that ended at another step)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "runs.json"
    spec.write_text(json.dumps([{"args": [str(a) for a in a_], "env": e} for a_, e in runs]))
    res = mpirun(n, [prog("train_runs.py"), str(out), str(spec)], timeout=timeout, check=False)

    def text(i: int, kind: str) -> str:
        return "".join(
            p.read_text() if p.exists() else ""
            for p in (out / f"run{i}.rank{r}.{kind}" for r in range(n))
        )

    done = []
    for i, (args, _) in enumerate(runs):
        rcs = [out / f"run{i}.rank{r}.rc" for r in range(n)]
        if not all(p.exists() for p in rcs):
            raise AssertionError(
                f"train_runs: run {i} ({' '.join(map(str, args))}) did not end on every rank; "
                f"mpirun exited {res.returncode}\n--- its stderr\n{text(i, 'err')[-6000:]}"
                f"\n--- mpirun's stderr\n{res.stderr[-3000:]}"
            )
        rc = max(int(p.read_text()) for p in rcs)
        if check and rc != 0:
            raise AssertionError(
                f"train_runs: run {i} ({' '.join(map(str, args))}) exited {rc}"
                f"\n--- its stderr\n{text(i, 'err')[-6000:]}"
            )
        done.append(subprocess.CompletedProcess(args, rc, text(i, "out"), text(i, "err")))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return done
