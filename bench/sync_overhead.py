"""One FSA push+pull round of an N MB buffer through the server tiers, against the floor:
``MPI.Allreduce`` (and torch.distributed's gloo all_reduce) of the same buffer across the same
worker ranks. Run side by side in one job, interleaved, and reported as ratios.

A third comparison, ``raw_two_tier``, moves the same buckets along the same path as geompi
(workers -> local server -> global server(s) and back) in plain mpi4py on numpy arrays, with a
sum at each server and an SGD step at the global one. geompi / raw_two_tier is the cost of
geompi's own code; raw_two_tier / Allreduce is the cost of the two-tier design on this machine.

    mpirun -n 16 python bench/sync_overhead.py [--sizes 1,25,100] [--runs 5] [--device cpu]

Each run times --reps rounds of every size, interleaved (the order turns each repetition),
and keeps their median; the ratios reported are the median over --runs runs, with their range.
gloo's all_reduce is timed after the others, in the same job, on the workers, interleaved with
MPI.Allreduce again (``allreduce_beside_gloo_vs_alone`` compares the two Allreduce figures):
once gloo's all_reduce has run, the other rounds of the job are slower (see below). On an
oversubscribed node the CPU time of every rank decides a round, so the CPU seconds per round
summed over the ranks are reported beside the wall times.

The floor is the faster of the job's two allreduces, MPI.Allreduce and gloo's all_reduce, size by
size (``floor``; ``ratio``'s ``vs_floor``), beside the ratio against each.

``--device cpu`` (the default) hides the GPU from every rank before torch is imported;
``--device cuda`` puts the workers' buffers on the GPU for every kind of round (geompi stages
them through host memory, MPI.Allreduce and the raw two-tier round copy them to the host and
back, gloo reduces them as they are). The device and the machine are recorded in the JSON.

Writes bench/results/sync_overhead.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pathlib
import pstats
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
from benchenv import best_floor, check_device, machine_record, pin_device  # noqa: E402

DEVICE = pin_device()  # before torch is imported, in every rank: --device cpu hides the GPU

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

from geompi.comm.topology import Role, Topology, build_communicators  # noqa: E402
from geompi.comm.transport import LAN, Link, LinkStats  # noqa: E402
from geompi.ps.client import PSClient  # noqa: E402
from geompi.ps.optim import SGD, spec_to_dict  # noqa: E402
from geompi.ps.protocol import FLAG_SCATTER, Op  # noqa: E402
from geompi.ps.servers import build_server  # noqa: E402
from geompi.runtime import worker_device  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--sizes", default="1,25,100", help="MB, comma-separated")
p.add_argument("--reps", type=int, default=11, help="rounds per size and run (the median is kept)")
p.add_argument("--runs", type=int, default=5, help="runs of every size; ratios: median and range")
p.add_argument("--bucket-mb", type=float, default=4.0, help="FSA's buckets (--bucket-mb)")
p.add_argument(
    "--pull-into",
    choices=("same", "separate"),
    default="same",
    help="same: the result lands in the pushed buffer, as Allreduce's does (the pull is posted "
    "once the push completed: MPI forbids receiving into a buffer that a pending send reads); "
    "separate: pull into another buffer, as FSA does with gradients and parameters",
)
p.add_argument(
    "--profile",
    action="store_true",
    help="print the share of the geompi rounds that rank 0, its local server and the first "
    "global server spend waiting in MPI (cProfile; profiling slows the Python part)",
)
p.add_argument(
    "--device",
    choices=("cpu", "cuda"),
    default="cpu",
    help="the workers' buffers' device, for every kind of round (cpu: the GPU is hidden)",
)
p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results/sync_overhead.json"))
args = p.parse_args()
check_device(DEVICE)

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
    dev = worker_device(comms.all_workers)  # geompi's own rule: the GPU, or the CPU
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    client = PSClient(Link(comms.dc, LAN, stats))
    grads = [torch.ones(n, device=dev) for _, n in keys]  # pushed, as gradients are
    params = grads if args.pull_into == "same" else [torch.ones(n, device=dev) for _, n in keys]
    flat = torch.ones(max(sum(n for _, n in g) for g in groups), device=dev)
    spec = json.dumps({"optimizer": spec_to_dict(SGD(lr=1e-9))}).encode()
    reqs = client.start(Op.INIT, keys, spec=spec if rank == 0 else None)
    for g in grads:
        reqs.push(g)
    reqs.wait()
    for p in params:
        reqs.pull(p)
    reqs.wait()
else:
    server = build_server(topo, comms, stats)  # FSA's: synchronous, one round per step
    server.serve_round()  # INIT


def sum_into(total: np.ndarray, parts: list[np.ndarray]) -> None:
    """``total = sum(parts)``: a copy and one add per further part, as geompi's local server."""
    np.copyto(total, parts[0])
    for b in parts[1:]:
        np.add(total, b, out=total)


def raw_two_tier(sizes: list[int], bufs: dict) -> None:
    """One round of the same buckets along geompi's path, in plain mpi4py (see the docstring)."""
    if role is Role.WORKER:
        grad = bufs.setdefault("wg", [np.ones(n, np.float32) for n in sizes])
        param = (
            grad if args.pull_into == "same" else bufs.setdefault("wp", [g.copy() for g in grad])
        )
        on_gpu = None
        if dev.type == "cuda":  # the buffers live on the GPU: to the host and back, as staged
            on_gpu = bufs.setdefault("wd", [torch.ones(n, device=dev) for n in sizes])
            for g, d in zip(grad, on_gpu):
                torch.from_numpy(g).copy_(d)
        reqs = [comms.dc.Isend(b, 0, i) for i, b in enumerate(grad)]
        if param is grad:
            MPI.Request.Waitall(reqs)
        reqs += [comms.dc.Irecv(b, 0, 1000 + i) for i, b in enumerate(param)]
        MPI.Request.Waitall(reqs)
        for d, b in zip(on_gpu or (), param):
            d.copy_(torch.from_numpy(b))
    elif role is Role.LOCAL_SERVER:
        nw, gs = comms.dc.Get_size() - 1, range(topo.num_dcs, comms.glob.Get_size())
        per = bufs.setdefault("ls", [[np.empty(n, np.float32) for _ in range(nw)] for n in sizes])
        tot = bufs.setdefault("lst", [np.empty(n, np.float32) for n in sizes])
        res = bufs.setdefault("lsr", [np.empty(n, np.float32) for n in sizes])  # as geompi's
        recv = [[comms.dc.Irecv(b, 1 + j, i) for j, b in enumerate(p)] for i, p in enumerate(per)]
        sends, back = [], []
        for i, (p, t, out) in enumerate(zip(per, tot, res)):
            MPI.Request.Waitall(recv[i])
            sum_into(t, p)
            for g, r in enumerate(gs):
                lo, hi = topo.shard_bounds(t.size, g)
                sends.append(comms.glob.Isend(t[lo:hi], r, i))
                back.append(comms.glob.Irecv(out[lo:hi], r, 1000 + i))
        MPI.Request.Waitall(sends)
        for i, out in enumerate(res):
            MPI.Request.Waitall(back[len(gs) * i : len(gs) * (i + 1)])
            sends += [comms.dc.Isend(out, 1 + j, 1000 + i) for j in range(nw)]
        MPI.Request.Waitall(sends)
    else:
        nd, g = topo.num_dcs, comms.glob.Get_rank() - topo.num_dcs
        shard = [topo.shard_bounds(n, g) for n in sizes]
        per = bufs.setdefault(
            "gs", [[np.empty(hi - lo, np.float32) for _ in range(nd)] for lo, hi in shard]
        )
        par = bufs.setdefault("gsp", [np.ones(hi - lo, np.float32) for lo, hi in shard])
        tot = bufs.setdefault("gst", [np.empty(hi - lo, np.float32) for lo, hi in shard])
        recv = [[comms.glob.Irecv(b, d, i) for d, b in enumerate(p)] for i, p in enumerate(per)]
        sends = []
        for i, (p, t, w) in enumerate(zip(per, tot, par)):
            MPI.Request.Waitall(recv[i])
            sum_into(t, p)
            t *= -1e-9 / topo.num_workers  # SGD: w -= lr * mean gradient
            w += t
            sends += [comms.glob.Isend(w, d, 1000 + i) for d in range(nd)]
        MPI.Request.Waitall(sends)


def geompi_round(group: list[tuple[int, int]], flags: int = 0) -> None:
    """One FSA round of ``group`` through geompi's client and servers (``FLAG_SCATTER``: the
    workers reduce-scatter inside the datacenter first, as ``--lan-reduce scatter``)."""
    if role is not Role.WORKER:
        server.serve_round()
        return
    reqs = client.start(Op.GRAD, group, weight=1.0, flags=flags)
    for key, _ in group:
        reqs.push(grads[key])
    if params is grads:
        reqs.wait()
    for key, _ in group:
        reqs.pull(params[key])
    reqs.wait()


raw_bufs: list[dict] = [{} for _ in groups]
KINDS = (
    "geompi",
    "geompi_scatter",
    "raw_two_tier",
    "mpi_allreduce",
    "gloo_allreduce",
    "mpi_allreduce_beside_gloo",
)
profiles = {mb: cProfile.Profile() for mb in sizes}


def timed(kind: str, times: dict, cpu: dict, fn, comm=world) -> None:
    """Run ``fn`` between two barriers of ``comm``: rank 0's wall time and this rank's CPU."""
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if role is Role.WORKER and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    comm.Barrier()
    times[kind].append(time.perf_counter() - t0)
    cpu[kind].append(time.process_time() - c0)


def allreduce(b: torch.Tensor) -> None:
    host = b.cpu()  # this MPI is not CUDA-aware: a GPU buffer goes through host memory
    comms.all_workers.Allreduce(MPI.IN_PLACE, host.numpy(), MPI.SUM)
    if host is not b:
        b.copy_(host)


def measure(kinds: list[tuple[str, object, bool]], comm, rep_shift: int) -> dict:
    """Every kind's rounds of every size, --reps of each, interleaved; per kind and size the
    median wall time (rank 0) and the median CPU per round summed over ``comm``'s ranks.
    ``kinds``: (name, round(group, size index), workers only)."""
    wall: dict = {k: {} for k, _, _ in kinds}
    cpu_sum: dict = {k: {} for k, _, _ in kinds}
    for g, (group, mb) in enumerate(zip(groups, sizes)):
        times: dict = {k: [] for k in wall}
        cpu: dict = {k: [] for k in wall}
        for rep in range(args.reps):
            # The order turns by one each repetition: no kind always follows the same one.
            shift = (rep + rep_shift) % len(kinds)
            for kind, fn, workers_only in kinds[shift:] + kinds[:shift]:
                if workers_only and role is not Role.WORKER:
                    continue
                profiling = args.profile and kind == "geompi" and rep and rep_shift == 0
                if profiling:  # not the first round: torch's lazy imports
                    profiles[mb].enable()
                timed(
                    kind,
                    times,
                    cpu,
                    partial(fn, group, g),
                    comms.all_workers if workers_only else comm,
                )
                profiles[mb].disable()
            if role is Role.WORKER:
                flat.fill_(1.0)
            comm.Barrier()
        size = f"{mb:g}MB"
        for k in wall:  # this rank's median CPU per round, summed over the ranks
            mine = statistics.median(cpu[k]) if cpu[k] else 0.0
            cpu_sum[k][size] = comm.allreduce(mine)
            if rank == 0:
                wall[k][size] = statistics.median(times[k])
    return {"wall": wall, "cpu": cpu_sum}


def worker_flat(group: list[tuple[int, int]]) -> torch.Tensor:
    return flat[: sum(n for _, n in group)]


SERVER_TIER = [
    ("geompi", lambda group, g: geompi_round(group), False),
    ("geompi_scatter", lambda group, g: geompi_round(group, FLAG_SCATTER), False),
    ("raw_two_tier", lambda group, g: raw_two_tier([n for _, n in group], raw_bufs[g]), False),
    ("mpi_allreduce", lambda group, g: allreduce(worker_flat(group)), True),
]
runs = [measure(SERVER_TIER, world, run) for run in range(args.runs)]

if role is Role.WORKER:
    PSClient.stop(client)
    # gloo's all_reduce runs after the others, in the same job, on the workers alone. Interleaved
    # with them (as it was until 2026-12-03), it slowed the other rounds, in whatever order they
    # ran: the CPU of a geompi round, summed over the 16 ranks, went from 7.7 to 13.9 ms at
    # 0.25 MB and from 18.4 to 23.6 ms at 1 MB, MPI.Allreduce's from 2.3 to 2.8 and 7.2 to 7.5 ms
    # (a gloo process group that is set up but never called: 8.7 ms for geompi at 0.25 MB).
    # MPI.Allreduce runs again beside it, as the common reference.
    port = comms.all_workers.bcast(29700 + os.getpid() % 200 if widx == 0 else None, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=widx, world_size=topo.num_workers
    )
    TORCH_TIER = [
        ("gloo_allreduce", lambda group, g: dist.all_reduce(worker_flat(group)), False),
        ("mpi_allreduce_beside_gloo", lambda group, g: allreduce(worker_flat(group)), False),
    ]
    for run in runs:
        beside = measure(TORCH_TIER, comms.all_workers, -1)
        for part in ("wall", "cpu"):
            run[part].update(beside[part])
    dist.destroy_process_group()
else:
    server.run()
comms.free()
machine = machine_record(DEVICE, world)
if args.profile and rank in (0, topo.local_server(0), topo.global_servers[0]):
    for mb, prof in profiles.items():
        st = pstats.Stats(prof)
        wait = sum(ct for (_, _, fn), (_, _, _, ct, _) in st.stats.items() if fn == "wait_for")
        share = 100 * wait / st.total_tt
        print(
            f"profile: rank {rank} ({role.name.lower()}), {mb:g} MB: {share:.0f}% of its geompi "
            "rounds waiting in MPI",
            flush=True,
        )
if rank == 0:
    names = {
        "vs_mpi_allreduce": ("geompi", "mpi_allreduce"),
        "scatter_vs_mpi_allreduce": ("geompi_scatter", "mpi_allreduce"),
        "vs_raw_two_tier": ("geompi", "raw_two_tier"),
        "raw_two_tier_vs_mpi_allreduce": ("raw_two_tier", "mpi_allreduce"),
        "vs_gloo_allreduce": ("geompi", "gloo_allreduce"),
        "allreduce_beside_gloo_vs_alone": ("mpi_allreduce_beside_gloo", "mpi_allreduce"),
    }
    labels = [f"{mb:g}MB" for mb in sizes]
    per_run = {  # size -> ratio -> one figure per run
        size: {
            r: [w[a][size] / w[b][size] for w in (x["wall"] for x in runs)]
            for r, (a, b) in names.items()
        }
        for size in labels
    }
    # The floor: the faster of the job's two allreduces, run by run (MPI's timed alone)
    floors = {"mpi": "mpi_allreduce", "gloo": "gloo_allreduce"}
    for size in labels:
        per_run[size]["vs_floor"] = [
            w["geompi"][size]
            / best_floor({k: w[v][size] for k, v in floors.items()}, lower_is_better=True)[1]
            for w in (x["wall"] for x in runs)
        ]
        per_run[size]["scatter_vs_floor"] = [
            w["geompi_scatter"][size]
            / best_floor({k: w[v][size] for k, v in floors.items()}, lower_is_better=True)[1]
            for w in (x["wall"] for x in runs)
        ]
    ratios = {
        size: {r: statistics.median(v) for r, v in rs.items()} for size, rs in per_run.items()
    }
    results = {
        k: {size: statistics.median(x["wall"][k][size] for x in runs) for size in labels}
        for k in KINDS
    }
    cpu_s = {
        k: {size: statistics.median(x["cpu"][k][size] for x in runs) for size in labels}
        for k in KINDS
    }
    floor = {}  # by the medians: which allreduce is the floor at each size
    for size in labels:
        best, secs = best_floor(
            {k: results[v][size] for k, v in floors.items()}, lower_is_better=True
        )
        floor[size] = {"best": best, "median_s": secs}
    out = {
        "benchmark": "sync_overhead",
        "ranks": world.Get_size(),
        "workers": topo.num_workers,
        "topology": topo.describe(),
        "reps": args.reps,
        "runs": args.runs,
        "pull_into": args.pull_into,
        "median_s": results,
        "ratio": ratios,
        "ratio_runs": per_run,
        "cpu_s_per_round": cpu_s,
        "floor": floor,
        "goal": "geompi / MPI.Allreduce <= 1.2 at 25 MB and <= 1.5 at 1 MB",
        "goal_issue_38": "geompi / the best allreduce <= 2.0 at 1 MB and <= 1.2 at 25 MB",
        "device": DEVICE,
        "machine": machine,
        "mpi": MPI.Get_library_version().splitlines()[0],
        "torch": torch.__version__,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"{'size':>8} {'geompi s':>10} {'scatter s':>10} {'raw 2-tier s':>13} "
        f"{'Allreduce s':>12} {'gloo s':>10} {'ratio MPI':>10} {'scatter/MPI':>12} "
        f"{'ratio raw':>10} {'ratio gloo':>11}"
    )
    for size, r in ratios.items():
        print(
            f"{size:>8} {results['geompi'][size]:>10.4f} {results['geompi_scatter'][size]:>10.4f}"
            f" {results['raw_two_tier'][size]:>13.4f} {results['mpi_allreduce'][size]:>12.4f}"
            f" {results['gloo_allreduce'][size]:>10.4f} {r['vs_mpi_allreduce']:>10.2f}"
            f" {r['scatter_vs_mpi_allreduce']:>12.2f} {r['vs_raw_two_tier']:>10.2f}"
            f" {r['vs_gloo_allreduce']:>11.2f}"
        )
    for size, f in floor.items():
        print(
            f"{size}: floor {f['best']} ({f['median_s']:.4f} s); geompi / floor "
            f"{ratios[size]['vs_floor']:.2f} (scatter {ratios[size]['scatter_vs_floor']:.2f})"
        )
    print(
        f"device {DEVICE}, {machine['ranks']} ranks, {machine['ranks_per_core']} ranks per core, "
        f"{machine['cpu_model']}"
    )
    for size, rs in per_run.items():
        lo, hi = min(rs["vs_mpi_allreduce"]), max(rs["vs_mpi_allreduce"])
        c = {k: cpu_s[k][size] * 1e3 for k in ("geompi", "raw_two_tier", "mpi_allreduce")}
        print(
            f"{size}: geompi / MPI over {args.runs} runs {lo:.2f} to {hi:.2f}; CPU ms per round "
            f"(all ranks): geompi {c['geompi']:.1f}, raw two-tier {c['raw_two_tier']:.1f}, "
            f"Allreduce {c['mpi_allreduce']:.1f}"
        )
