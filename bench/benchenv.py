"""What every comparison benchmark shares: one device for all its sides, the machine it ran on,
and the best collective of the job as the floor.

    from benchenv import pin_device     # first, before anything imports torch
    DEVICE = pin_device()               # reads --device cpu|cuda from the command line

``--device cpu`` (the default) hides the GPU before torch is imported (``CUDA_VISIBLE_DEVICES``
empty, ``GEOMPI_DEVICE=cpu``), in every rank, since every rank runs the script's first lines: no
side trains on a GPU behind the others' backs, and nobody pays CUDA's initialisation.
``--device cuda`` puts every side on the GPU (MPI's, which is not CUDA-aware, through host
memory). :func:`machine_record` is the record each result carries: cores, ranks per core, the
CPU model, the versions and the device.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

DEVICES = ("cpu", "cuda")


def device_from_argv(argv: list[str], default: str = "cpu") -> str:
    """The value of ``--device X`` or ``--device=X`` in ``argv`` (the last one wins)."""
    device = default
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    if device not in DEVICES:
        raise SystemExit(f"--device must be one of {', '.join(DEVICES)}, not {device!r}")
    return device


def device_env(device: str) -> dict[str, str]:
    """The environment that pins ``device`` for a process started afterwards (and this one)."""
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": "", "GEOMPI_DEVICE": "cpu"}
    return {"GEOMPI_DEVICE": "cuda"}


def pin_device(argv: list[str] | None = None) -> str:
    """Read ``--device`` from ``argv`` (default: sys.argv) and pin it in this process's
    environment. Must run before torch is imported: CUDA reads its variables once."""
    device = device_from_argv(sys.argv[1:] if argv is None else argv)
    if device == "cpu" and "torch" in sys.modules:
        raise RuntimeError("pin_device('cpu') after torch was imported: the GPU stays visible")
    if device == "cuda" and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        del os.environ["CUDA_VISIBLE_DEVICES"]  # hidden by a caller: --device cuda shows it
    os.environ.update(device_env(device))
    return device


def check_device(device: str) -> Any:
    """The torch.device for ``device``; exits if CUDA was asked for and there is none."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here")
    if device == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu: the GPU is still visible (was torch imported first?)")
    return torch.device(device)


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo: cores, not hyperthreads."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in block.splitlines())
        )
        if "core id" in fields:
            cores.add((fields.get("physical id"), fields["core id"]))
    return len(cores) or None


def affinity() -> set[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def machine_record(
    device: str, comm: Any = None, ranks: int | None = None, mpi: str | None = None
) -> dict[str, Any]:
    """Where a result was measured. With ``comm`` (every rank of it must call this), the union
    of the ranks' CPU affinities is the cores the job had, and ``ranks`` its size; without,
    this process's affinity and the ``ranks`` given. ``mpi``: the MPI library's version, if
    mpi4py is not loaded here."""
    cpus = affinity()
    if comm is not None:
        ranks = comm.Get_size()
        per_rank = comm.allgather(sorted(cpus))
        cpus = set().union(*map(set, per_rank))
        narrowest = min(len(c) for c in per_rank)
    else:
        narrowest = len(cpus)
    rec: dict[str, Any] = {
        "device": device,
        "cpu_count": os.cpu_count(),
        "physical_cores": physical_cores(),
        "cores_available": len(cpus),  # the union of the ranks' sched_getaffinity
        "cores_per_rank_min": narrowest,
        "ranks": ranks,
        "ranks_per_core": None if not ranks else round(ranks / len(cpus), 3),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        rec["torch"] = torch.__version__
        rec["torch_cuda"] = torch.version.cuda
        rec["torch_threads"] = torch.get_num_threads()
        if device == "cuda" and torch.cuda.is_available():
            rec["gpu"] = torch.cuda.get_device_name()
            rec["gpus_visible"] = torch.cuda.device_count()
    if mpi is None and "mpi4py.MPI" in sys.modules:
        MPI = sys.modules["mpi4py.MPI"]
        mpi = MPI.Get_library_version().splitlines()[0].rstrip("\x00").strip()
    rec["mpi"] = mpi
    mpi4py = sys.modules.get("mpi4py")
    if mpi4py is not None:
        rec["mpi4py"] = mpi4py.__version__
    rec["visible_devices_env"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return rec


def best_floor(candidates: dict[str, float | None], lower_is_better: bool) -> tuple[str, float]:
    """The best of the job's floors (the fastest allreduce, or the highest plain-collective
    training rate): (its name, its figure). Missing figures (None) are left out."""
    known = {k: v for k, v in candidates.items() if v is not None}
    if not known:
        raise ValueError("no floor measured")
    pick = min if lower_is_better else max
    name = pick(known, key=known.__getitem__)
    return name, known[name]
