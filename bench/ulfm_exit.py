"""How often ``mpirun --with-ft ulfm`` hangs when the survivors of a lost rank end the job,
for each way of ending it (why geompi.comm.faults._stop_the_job ends as it does).

    python bench/ulfm_exit.py                  # 40 launches of each way, 10 ranks
    python bench/ulfm_exit.py --runs 100 --ranks 16

Each launch: rank 2 SIGKILLs itself, the survivors Revoke and Shrink the world, then end:

- **all_exit_1**: every survivor at once with status 1;
- **barrier_all_exit_1**: a last barrier over the survivors first, then every one with 1;
- **one_late_exit_1** (geompi's): the barrier, every survivor but one with 0, then the first
  with 1, a second later;
- **all_exit_0**: the barrier, every survivor with 0 (the control).

A launch that is still running after ``--timeout`` seconds counts as a hang (its process group
is killed). Writes bench/results/ulfm_exit.json: per way, launches, hangs, and the exit
statuses mpirun returned.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

WAYS = ("all_exit_1", "barrier_all_exit_1", "one_late_exit_1", "all_exit_0")
HERE = pathlib.Path(__file__).resolve()


def rank_side(way: str) -> None:
    """What each rank of one launch does (run under mpirun)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    world.Barrier()
    if world.Get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    try:
        world.Barrier()
    except MPI.Exception:
        pass  # the lost rank
    world.Revoke()
    survivors = world.Shrink()
    if way == "all_exit_1":
        os._exit(1)
    req, until = survivors.Ibarrier(), time.monotonic() + 10
    while not req.Test() and time.monotonic() < until:
        time.sleep(1e-3)
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        survivors.Iprobe()
        time.sleep(1e-3)
    if way == "barrier_all_exit_1":
        os._exit(1)
    if way == "one_late_exit_1" and survivors.Get_rank() == 0:
        time.sleep(1.0)
        os._exit(1)
    os._exit(0)


def launch(mpirun: str, ranks: int, way: str, timeout: float) -> int | None:
    """One launch; its exit status, or None where it hung."""
    env = {
        **os.environ,
        "OMPI_MCA_btl": "self,tcp",
        "OMPI_MCA_pml": "ob1",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        "OMPI_MCA_mpi_yield_when_idle": "1",
    }
    cmd = [mpirun, "-n", str(ranks), "--with-ft", "ulfm", sys.executable, str(HERE)]
    cmd += ["--rank-side", way]
    p = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--ranks", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=25.0)
    ap.add_argument("--rank-side", choices=WAYS, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "ulfm_exit.json"))
    args = ap.parse_args()
    if args.rank_side:
        rank_side(args.rank_side)
        return
    mpirun = str(pathlib.Path(sys.executable).parent / "mpirun")
    results = {}
    for way in WAYS:  # one way after the other: a hung launch's ranks are gone before the next
        codes = [launch(mpirun, args.ranks, way, args.timeout) for _ in range(args.runs)]
        hangs = sum(c is None for c in codes)
        statuses = collections.Counter(str(c) for c in codes if c is not None)
        results[way] = {"launches": args.runs, "hangs": hangs, "exit_statuses": statuses}
        print(f"{way:20s} {hangs:3d} hang(s) in {args.runs}, exit statuses {dict(statuses)}")
    out = {
        "benchmark": "ulfm_exit",
        "command": " ".join(["python", "bench/ulfm_exit.py", *sys.argv[1:]]),
        "ranks": args.ranks,
        "timeout_s": args.timeout,
        "ways": results,
    }
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
