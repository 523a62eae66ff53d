"""The CUDA path in one short run, for a machine with a GPU (skips cleanly without one).

    mpirun -n 5 python bench/gpu_check.py        # 2 datacenters of 1 worker + 1 global server

Checks: (1) whether the MPI library is CUDA-aware (detected, not assumed); (2) CUDA tensors
through MPI, directly where CUDA-aware and through pinned staging buffers otherwise, with
the values checked; (3) FSA training on the GPU, compared with the same run on the CPU.
Writes bench/results/gpu_check.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import torch
from mpi4py import MPI

from geompi.comm.buffers import Staging, cuda_aware_mpi
from geompi.comm.transport import LAN, Link, LinkStats, Requests
from geompi.config import make_config
from geompi.train import train

world = MPI.COMM_WORLD
rank = world.Get_rank()
out = pathlib.Path(__file__).parent / "results/gpu_check.json"
result: dict = {
    "cuda_available": torch.cuda.is_available(),
    "cuda_aware_mpi": cuda_aware_mpi(),
    "mpi": MPI.Get_library_version().splitlines()[0],
    "ranks": world.Get_size(),
}
if not torch.cuda.is_available():
    if rank == 0:
        result["skipped"] = "no CUDA device on this machine"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print("gpu_check: skipped, no CUDA device")
    raise SystemExit(0)

dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)
result["gpu"] = f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
stats = LinkStats()
modes = {"staged": Staging(force=True)}
if cuda_aware_mpi():
    modes["direct"] = Staging()
n = world.Get_size()
for name, staging in modes.items():  # a ring of 32 MB CUDA tensors, as the tiers move them
    link = Link(world, LAN, stats, staging)
    x = torch.full((8 << 20,), float(rank + 1), device=dev)
    y = torch.empty_like(x)
    world.Barrier()
    t0 = time.perf_counter()
    reqs = Requests(stats)
    link.isend(reqs, x, (rank + 1) % n, 5)
    link.irecv(reqs, y, (rank - 1) % n, 5)
    reqs.wait()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ok = bool(torch.all(y == float((rank - 1) % n + 1)).item())
    ok = world.allreduce(ok, op=MPI.LAND)
    result[f"send_recv_32MB_{name}"] = {"ok": ok, "seconds": dt}

common = dict(
    env={},
    steps=20,
    model="cnn",
    batch_size=32,
    seed=0,
    dc_sizes=(2, 2),
    global_servers=1,
    progress_every=1e9,
)
# TF32 (on by default for cuDNN's convolutions) rounds to 10 mantissa bits, which alone moves the
# CNN's weights by about 1e-3 in 20 steps: the comparison is of geompi's path, so in full fp32.
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
result["tf32"] = False
models = {}
for device in ("cuda", "cpu"):
    os.environ["GEOMPI_DEVICE"] = device
    t0 = time.perf_counter()
    s = train(make_config(**common))
    if s is not None:
        models[device] = s["model"]
        result[f"fsa_20_steps_{device}_s"] = time.perf_counter() - t0
if rank == 0:
    diff = max(float((models["cuda"][k] - models["cpu"][k]).abs().max()) for k in models["cpu"])
    result["fsa_gpu_vs_cpu_max_abs_diff"] = diff
    result["fsa_gpu_matches_cpu"] = diff < 1e-3
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
