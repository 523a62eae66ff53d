"""One FSA push+pull round of an N MB buffer through the server tiers, against the floor:
``MPI.Allreduce`` (and torch.distributed's gloo all_reduce) of the same buffer across the same
worker ranks. Run side by side in one job, interleaved, and reported as ratios.

    mpirun -n 16 python bench/sync_overhead.py [--sizes 1,25,100] [--reps 5]

Writes bench/results/sync_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

from geompi.comm.topology import Role, Topology, build_communicators
from geompi.comm.transport import LAN, Link, LinkStats
from geompi.ps.client import PSClient
from geompi.ps.optim import SGD, spec_to_dict
from geompi.ps.protocol import Op
from geompi.ps.servers import make_server

p = argparse.ArgumentParser()
p.add_argument("--sizes", default="1,25,100", help="MB, comma-separated")
p.add_argument("--reps", type=int, default=5)
p.add_argument("--bucket-mb", type=float, default=4.0, help="FSA's buckets (--bucket-mb)")
p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results/sync_overhead.json"))
args = p.parse_args()

world = MPI.COMM_WORLD
rank = world.Get_rank()
topo = Topology.plan(world.Get_size())
comms = build_communicators(topo, world)
role = topo.role(rank)
stats = LinkStats()
sizes = [float(s) for s in args.sizes.split(",")]
groups = []  # per size: the (key, numel) buckets that FSA would push for a buffer that large
for mb in sizes:
    total, per = int(mb * 2**20 / 4), int(args.bucket_mb * 2**20 / 4)
    first = sum(len(g) for g in groups)
    groups.append(
        [(first + j, min(per, total - off)) for j, off in enumerate(range(0, total, per))]
    )
keys = [k for g in groups for k in g]

if role is Role.WORKER:
    widx = topo.worker_index(rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = comms.all_workers.bcast(29700 + os.getpid() % 200 if widx == 0 else None, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=widx, world_size=topo.num_workers
    )
    client = PSClient(Link(comms.dc, LAN, stats))
    bufs = [torch.ones(n) for _, n in keys]
    flat = torch.ones(max(sum(n for _, n in g) for g in groups))
    spec = json.dumps({"optimizer": spec_to_dict(SGD(lr=1e-9))}).encode()
    reqs = client.start(Op.INIT, keys, spec=spec if rank == 0 else None)
    for b in bufs:
        client.push(reqs, b)
    for b in bufs:
        client.pull(reqs, b)
    reqs.wait()
else:
    server = make_server("fsa", topo, comms, stats)
    server.serve_round()  # INIT

results = {"geompi": {}, "mpi_allreduce": {}, "gloo_allreduce": {}}
for group, mb in zip(groups, sizes):
    times = {k: [] for k in results}
    for _ in range(args.reps):
        world.Barrier()
        t0 = time.perf_counter()
        if role is Role.WORKER:
            reqs = client.start(Op.GRAD, group, weight=1.0)
            for key, _ in group:
                client.push(reqs, bufs[key])
            for key, _ in group:
                client.pull(reqs, bufs[key])
            reqs.wait()
        else:
            server.serve_round()
        world.Barrier()
        times["geompi"].append(time.perf_counter() - t0)
        if role is Role.WORKER:
            b = flat[: sum(n for _, n in group)]
            comms.all_workers.Barrier()
            t0 = time.perf_counter()
            comms.all_workers.Allreduce(MPI.IN_PLACE, b.numpy(), MPI.SUM)
            times["mpi_allreduce"].append(time.perf_counter() - t0)
            comms.all_workers.Barrier()
            t0 = time.perf_counter()
            dist.all_reduce(b)
            times["gloo_allreduce"].append(time.perf_counter() - t0)
            b.fill_(1.0)
        world.Barrier()
    if rank == 0:
        for k in results:
            results[k][f"{mb:g}MB"] = statistics.median(times[k])

if role is Role.WORKER:
    PSClient.stop(client)
    dist.destroy_process_group()
else:
    server.run()
comms.free()
if rank == 0:
    ratios = {
        size: {
            "vs_mpi_allreduce": results["geompi"][size] / results["mpi_allreduce"][size],
            "vs_gloo_allreduce": results["geompi"][size] / results["gloo_allreduce"][size],
        }
        for size in results["geompi"]
    }
    out = {
        "benchmark": "sync_overhead",
        "ranks": world.Get_size(),
        "workers": topo.num_workers,
        "topology": topo.describe(),
        "reps": args.reps,
        "median_s": results,
        "ratio": ratios,
        "goal": "geompi / MPI.Allreduce <= 1.5 at 25 MB",
        "mpi": MPI.Get_library_version().splitlines()[0],
        "torch": torch.__version__,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"{'size':>8} {'geompi s':>10} {'Allreduce s':>12} {'gloo s':>10} {'ratio MPI':>10}"
        f" {'ratio gloo':>11}"
    )
    for size, r in ratios.items():
        print(
            f"{size:>8} {results['geompi'][size]:>10.4f} {results['mpi_allreduce'][size]:>12.4f}"
            f" {results['gloo_allreduce'][size]:>10.4f} {r['vs_mpi_allreduce']:>10.2f}"
            f" {r['vs_gloo_allreduce']:>11.2f}"
        )
