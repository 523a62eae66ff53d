"""Training throughput (samples/s) of geompi against torch's own tools, side by side in one job.

    mpirun -n 16 python bench/throughput.py [--steps 160] [--warmup 16] [--reps 3] [--device cpu]

Same model (``cnn``), data (``digits``, each worker on its geompi shard through ShardLoader),
per-worker batch (16), step count and 12 training processes on both sides, 1 torch thread per
process. geompi uses its default 16-rank topology (3 datacenters of 4 workers + 1 local server,
1 global server); torch gets the same 12 worker ranks in a gloo process group while the 4 server
ranks wait in an MPI barrier (polling with sleeps, so they take no CPU from torch).

  (a) geompi FSA   against torch DistributedDataParallel (gloo), SGD lr 0.05 momentum 0.9;
  (b) geompi HFA (k1=4, k2=4) against torch HierarchicalModelAverager({4: 4, 16: 12}) over
      local SGD with the same optimizer.

Beside them, once per repetition, the same loop with no communication at all (``local_only``:
each worker trains alone): the most samples/s these 12 processes reach on this machine, so
``local_only / torch`` bounds any ``geompi / torch`` ratio from above (``ceiling``). And the
same training with its exchanges as plain ``MPI.Allreduce`` calls among the workers, no
servers (``mpi_fsa``: the gradients every step; ``mpi_hfa``: the parameters every K1 steps
among a datacenter's workers, every K1*K2 among all): what MPI's own collectives reach here
(``mpi_floor``, against torch).

The floor is the best of two plain-collective trainings: the same exchanges as ``MPI.Allreduce``
(``mpi_fsa``, ``mpi_hfa``) and as gloo's ``all_reduce`` (``gloo_fsa``, ``gloo_hfa``), on the same
workers; geompi / floor is reported against the faster of the two, and against each.

``--device cpu`` (the default) hides the GPU from every rank before torch is imported, so that no
side trains on it and nobody pays CUDA's start; ``--device cuda`` puts every side on the GPU
(geompi's workers and torch's, sharing it; MPI's exchanges through host memory). The device and
the machine (cores, ranks per core, CPU model, versions) are recorded in the JSON, and so are
the CPU seconds per step summed over the ranks beside the wall time per step: on a machine with
fewer cores than ranks the CPU seconds compare where wall times do not.

Each pair runs --reps times, interleaved (the order alternates between repetitions), after one
short warm-up of every side; the median is reported. geompi's figure is its summary's
samples / train_s (the training loop, after start-up), torch's the same loop timed on rank 0.
As a check that both sides do the same training, the parameters after the warm-up are compared
(they agree to rounding), and the test accuracy after the first timed run is recorded.
On a small shared machine the figures swing by up to 2x from run to run: the JSON keeps every
run, the CPU seconds each side used, and how much of the machine other processes took meanwhile.
Writes bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import socket
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
from benchenv import best_floor, check_device, machine_record, pin_device  # noqa: E402

DEVICE = pin_device()  # before torch is imported, in every rank: --device cpu hides the GPU

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (  # noqa: E402
    HierarchicalModelAverager,
)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from geompi.comm.topology import Role, Topology, build_communicators  # noqa: E402
from geompi.config import make_config  # noqa: E402
from geompi.data import ShardLoader, evaluate, load_dataset, shard_indices  # noqa: E402
from geompi.models import build_model  # noqa: E402
from geompi.runtime import worker_device  # noqa: E402
from geompi.train import train  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=160, help="timed steps (a multiple of k1*k2 = 16)")
p.add_argument("--warmup", type=int, default=16, help="steps of the one warm-up of each side")
p.add_argument("--reps", type=int, default=3)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--k1", type=int, default=4)
p.add_argument("--k2", type=int, default=4)
p.add_argument(
    "--device",
    choices=("cpu", "cuda"),
    default="cpu",
    help="every side's device (cpu: the GPU is hidden from every rank)",
)
p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results/throughput.json"))
args = p.parse_args()
period = args.k1 * args.k2
if args.steps % period or args.warmup % period:
    p.error(f"--steps and --warmup must be multiples of k1*k2 = {period} (HFA rounds up)")

if args.device != DEVICE:
    p.error(f"--device {args.device}: pinned {DEVICE} before argparse")  # unreachable
check_device(DEVICE)
torch.set_num_threads(1)
LR, MOMENTUM, SEED = 0.05, 0.9, 0
world = MPI.COMM_WORLD
rank = world.Get_rank()
topo = Topology.plan(world.Get_size())
comms = build_communicators(topo, world)
role = topo.role(rank)
workers_per_dc = len(topo.workers(0))
if any(len(topo.workers(d)) != workers_per_dc for d in range(topo.num_dcs)):
    raise SystemExit("throughput: HierarchicalModelAverager needs equal datacenters")


def idle_barrier(comm) -> None:
    """A barrier that sleeps while it waits, so waiting ranks leave the CPU to the others."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def run_geompi(sync: str, steps: int) -> dict | None:
    """One geompi training run on every rank; rank 0 gets the summary."""
    extra = {"k1": args.k1, "k2": args.k2} if sync == "hfa" else {}
    cfg = make_config(
        env={},
        sync=sync,
        steps=steps,
        batch_size=args.batch_size,
        model="cnn",
        dataset="digits",
        seed=SEED,
        lr=LR,
        momentum=MOMENTUM,
        progress_every=1e9,
        **extra,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the topology table, printed once below
        return train(cfg)


if role is Role.WORKER:
    widx = topo.worker_index(rank)
    ds = load_dataset("digits")
    shard = shard_indices(len(ds.y_train), topo.num_workers, widx, seed=SEED, name=ds.name)
    port = None
    if widx == 0:  # a free port for gloo's rendezvous, told to the other workers over MPI
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = comms.all_workers.bcast(port, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=widx, world_size=topo.num_workers
    )
    # {K1: workers per datacenter, K1*K2: every worker}: the datacenters are contiguous blocks
    # of worker indices, as HierarchicalModelAverager's subgroups are.
    averager = HierarchicalModelAverager({args.k1: workers_per_dc, period: topo.num_workers})
    # gloo's floor (gloo_hfa): one group per datacenter's workers, made by every worker alike
    dc_groups = [
        dist.new_group([topo.worker_index(r) for r in topo.workers(d)]) for d in range(topo.num_dcs)
    ]
    my_dc_group = dc_groups[topo.dc_of(rank)]
    dev = worker_device(comms.all_workers)  # geompi's own rule: the same device as its workers
# The workers of each datacenter, without their local server (mpi_hfa's datacenter average).
dc_workers = world.Split(topo.dc_of(rank) if role is Role.WORKER else MPI.UNDEFINED, rank)


def mpi_mean(comm, tensors: list[torch.Tensor]) -> None:
    """The mean of ``tensors`` over ``comm``: one in-place MPI.Allreduce of their flat copy
    (through host memory for GPU tensors: this MPI is not CUDA-aware)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    host = flat.cpu()
    comm.Allreduce(MPI.IN_PLACE, host.numpy())
    if host is not flat:
        flat.copy_(host)
    flat /= comm.Get_size()
    for t, mean in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(mean.view_as(t))


def gloo_mean(group, tensors: list[torch.Tensor]) -> None:
    """The same mean with gloo's all_reduce over ``group`` (None: every worker)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for t, mean in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(mean.view_as(t))


def run_torch(kind: str, steps: int) -> tuple[float, dict]:
    """``steps`` of DDP, of local SGD + HierarchicalModelAverager, of local SGD alone
    (``local``: no communication), or of either with plain MPI.Allreduce (``mpi_fsa``,
    ``mpi_hfa``) or gloo all_reduce (``gloo_fsa``, ``gloo_hfa``) on a fresh model.

    Returns (seconds of the loop on this rank, final parameters). Workers only.
    """
    torch.manual_seed(SEED)
    model = build_model("cnn", ds.input_shape, ds.num_classes).to(dev)
    net = DistributedDataParallel(model) if kind == "ddp" else model
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    loader = ShardLoader(ds.x_train, ds.y_train, shard, args.batch_size, seed=SEED, shard=widx)
    loss_fn = torch.nn.CrossEntropyLoss()
    averager.step = 1  # otherwise it averages on its first call (step 0 divides every period)
    comms.all_workers.Barrier()
    t0 = time.perf_counter()
    params = list(model.parameters())
    for step in range(1, steps + 1):
        x, y = loader.next_batch()
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)  # as geompi's loop
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        if kind == "mpi_fsa":
            with torch.no_grad():
                mpi_mean(comms.all_workers, [p.grad for p in params])
        elif kind == "gloo_fsa":
            with torch.no_grad():
                gloo_mean(None, [p.grad for p in params])
        opt.step()
        if kind == "averager":
            averager.average_parameters(net.parameters())
        elif kind == "mpi_hfa" and step % args.k1 == 0:
            with torch.no_grad():
                mpi_mean(comms.all_workers if step % period == 0 else dc_workers, params)
        elif kind == "gloo_hfa" and step % args.k1 == 0:
            with torch.no_grad():
                gloo_mean(None if step % period == 0 else my_dc_group, params)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    return dt, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def torch_phase(kind: str, steps: int) -> tuple[float, dict] | None:
    """Every rank: workers run torch, servers wait; rank 0 gets (seconds, parameters)."""
    out = run_torch(kind, steps) if role is Role.WORKER else None
    idle_barrier(world)
    return out if rank == 0 else None


def cpu_by_role(fn, *a):
    """Run fn(*a) on every rank; rank 0 also gets the CPU seconds (all threads) it took on the
    workers and on the servers together: (result, {"workers": s, "servers": s})."""
    c0 = time.process_time()
    r = fn(*a)
    spent = world.gather((role is Role.WORKER, time.process_time() - c0), root=0)
    if rank != 0:
        return r, None
    return r, {
        "workers": sum(c for w, c in spent if w),
        "servers": sum(c for w, c in spent if not w),
    }


def machine_cpu() -> tuple[float, float] | None:
    """(busy, idle) CPU seconds of the whole machine so far, from /proc/stat (Linux)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq = map(int, f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, (idle + iowait) / hz


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


if rank == 0:
    print(topo.table(), flush=True)
    print(
        f"throughput: {topo.num_workers} workers, batch {args.batch_size}, {args.steps} steps, "
        f"{args.reps} reps, warm-up {args.warmup} steps",
        flush=True,
    )

# One warm-up of every side: first-use costs (allocations, connections, autograd) out of the way.
# It also checks that both sides do the same training: after these few steps the parameters agree
# to rounding. (Not after the timed runs: this training is chaotic, and a 1e-8 perturbation of the
# initial weights grows to about 1e-2 in 100 steps, so the sides drift apart to that order.)
warm = {
    "fsa": run_geompi("fsa", args.warmup),
    "ddp": torch_phase("ddp", args.warmup),
    "hfa": run_geompi("hfa", args.warmup),
    "averager": torch_phase("averager", args.warmup),
    **{
        kind: torch_phase(kind, args.warmup)
        for kind in ("local", "mpi_fsa", "mpi_hfa", "gloo_fsa", "gloo_hfa")
    },
}
# geompi's CPU seconds cover its whole train() call, start-up included: once per repetition, a
# run of the warm-up's length measures that part, so that (run - short run) / (steps - warm-up
# steps), medians, is the CPU of one training step (torch's loops have no start-up: CPU / steps).
GEOMPI_SHORT = {"fsa": "geompi_fsa", "hfa": "geompi_hfa"}
startup_cpu: dict[str, dict[str, list[float]]] = {
    g: {"workers": [], "servers": []} for g in GEOMPI_SHORT.values()
}
if rank == 0:
    same = {
        f"{g}_vs_{t}_max_abs_diff": max_diff(warm[g]["model"], warm[t][1])
        for g, t in (("fsa", "ddp"), ("hfa", "averager"))
    }
    # MPI's floors train as torch does, to rounding
    same["mpi_fsa_vs_ddp_max_abs_diff"] = max_diff(warm["mpi_fsa"][1], warm["ddp"][1])
    same["mpi_hfa_vs_averager_max_abs_diff"] = max_diff(warm["mpi_hfa"][1], warm["averager"][1])
    same["gloo_fsa_vs_ddp_max_abs_diff"] = max_diff(warm["gloo_fsa"][1], warm["ddp"][1])
    same["gloo_hfa_vs_averager_max_abs_diff"] = max_diff(warm["gloo_hfa"][1], warm["averager"][1])

pairs = {"fsa": ("geompi_fsa", "ddp", "torch_ddp"), "hfa": ("geompi_hfa", "averager", "torch_avg")}
rates: dict[str, list[float]] = {name: [] for v in pairs.values() for name in (v[0], v[2])}
references = {
    "local_only": "local",
    **{k: k for k in ("mpi_fsa", "mpi_hfa", "gloo_fsa", "gloo_hfa")},
}
rates.update({name: [] for name in references})
acc: dict[str, float] = {}
cpu_s = {name: {"workers": [], "servers": []} for name in rates}
samples = args.steps * args.batch_size * topo.num_workers
idle_barrier(world)
machine0, job0 = machine_cpu(), time.process_time()
for rep in range(args.reps):
    for name, kind in references.items():  # the ceiling (no communication), the floors
        (res, cpu) = cpu_by_role(torch_phase, kind, args.steps)
        if rank == 0:
            rates[name].append(samples / res[0])
            for who in ("workers", "servers"):
                cpu_s[name][who].append(cpu[who])
    for sync, gname in GEOMPI_SHORT.items():  # geompi's start-up CPU (see startup_cpu)
        _, cpu = cpu_by_role(run_geompi, sync, args.warmup)
        if rank == 0:
            for who in ("workers", "servers"):
                startup_cpu[gname][who].append(cpu[who])
    for sync, (gname, kind, tname) in pairs.items():
        order = ("geompi", "torch") if rep % 2 == 0 else ("torch", "geompi")
        res, cpu = {}, {}
        for side in order:
            if side == "geompi":
                res[side], cpu[gname] = cpu_by_role(run_geompi, sync, args.steps)
            else:
                res[side], cpu[tname] = cpu_by_role(torch_phase, kind, args.steps)
        if rank == 0:
            for name, c in cpu.items():
                for who in ("workers", "servers"):
                    cpu_s[name][who].append(c[who])
            g, (t_s, t_model) = res["geompi"], res["torch"]
            assert g["samples"] == samples, (g["samples"], samples)
            rates[gname].append(g["samples"] / g["train_s"])
            rates[tname].append(samples / t_s)
            if rep == 0:
                acc[gname] = g["test_acc"]
                model = build_model("cnn", ds.input_shape, ds.num_classes)
                model.load_state_dict(t_model)
                acc[tname] = evaluate(model, ds.x_test, ds.y_test)[0]
            print(
                f"rep {rep}: {gname} {rates[gname][-1]:.0f} samples/s, "
                f"{tname} {rates[tname][-1]:.0f} samples/s",
                flush=True,
            )

idle_barrier(world)
machine1 = machine_cpu()
job_cpu = world.reduce(time.process_time() - job0, root=0)
machine = machine_record(DEVICE, world)
if role is Role.WORKER:
    dist.destroy_process_group()
comms.free()
if rank == 0:
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {
        "fsa_vs_ddp": med["geompi_fsa"] / med["torch_ddp"],
        "hfa_vs_averager": med["geompi_hfa"] / med["torch_avg"],
    }
    # No geompi / torch ratio can exceed local_only / torch: training with no communication.
    ceiling = {
        "fsa_vs_ddp": med["local_only"] / med["torch_ddp"],
        "hfa_vs_averager": med["local_only"] / med["torch_avg"],
    }
    # The same training with plain MPI.Allreduce exchanges (no servers), against torch.
    mpi_floor = {
        "fsa_vs_ddp": med["mpi_fsa"] / med["torch_ddp"],
        "hfa_vs_averager": med["mpi_hfa"] / med["torch_avg"],
    }
    # geompi against the floor: the faster of the plain-MPI and the plain-gloo training
    floor, vs_floor = {}, {}
    for sync in ("fsa", "hfa"):
        by = {"mpi": med[f"mpi_{sync}"], "gloo": med[f"gloo_{sync}"]}
        best, rate = best_floor(by, lower_is_better=False)
        g = med[f"geompi_{sync}"]
        floor[sync] = {"best": best, "samples_per_s": rate}
        vs_floor[sync] = {"best": g / rate, **{f"vs_{k}": g / v for k, v in by.items()}}
    # Per training step, summed over the ranks: wall ms (the loop's seconds / steps) and CPU ms
    # (geompi's less its start-up, measured by startup_cpu above).
    per_step = {}
    for k, v in cpu_s.items():
        cpu_w, cpu_srv = (statistics.median(v[who]) for who in ("workers", "servers"))
        steps = args.steps
        if k in startup_cpu:
            if args.steps <= args.warmup:
                cpu_w = cpu_srv = None
            else:
                cpu_w -= statistics.median(startup_cpu[k]["workers"])
                cpu_srv -= statistics.median(startup_cpu[k]["servers"])
                steps = args.steps - args.warmup
        per_step[k] = {
            "wall_ms": 1e3 * samples / med[k] / args.steps,
            "cpu_ms": None if cpu_w is None else 1e3 * (cpu_w + cpu_srv) / steps,
            "cpu_ms_workers": None if cpu_w is None else 1e3 * cpu_w / steps,
            "cpu_ms_servers": None if cpu_srv is None else 1e3 * cpu_srv / steps,
        }
    out = {
        "benchmark": "throughput",
        "ranks": world.Get_size(),
        "workers": topo.num_workers,
        "topology": topo.describe(),
        "model": "cnn",
        "dataset": "digits",
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "reps": args.reps,
        "hfa": {"k1": args.k1, "k2": args.k2},
        "averager_periods": {str(args.k1): workers_per_dc, str(period): topo.num_workers},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "torch_threads": torch.get_num_threads(),
        "samples_per_s": med,
        "all_samples_per_s": rates,
        # CPU seconds (all threads) per run, summed over the worker and over the server ranks:
        # geompi's whole train() call (its start-up included), torch's timed loop + barrier.
        "cpu_s_median": {
            k: {who: statistics.median(v[who]) for who in v} for k, v in cpu_s.items()
        },
        "device": DEVICE,
        "machine": machine,
        "ratio": ratio,
        "ceiling": ceiling,
        "mpi_floor": mpi_floor,
        "floor": floor,
        "vs_floor": vs_floor,
        "per_step": per_step,
        # CPU seconds of geompi runs of --warmup steps, one per repetition (see per_step)
        "geompi_short_run_cpu_s": startup_cpu,
        "goals": {"fsa_vs_ddp": ">= 2.0", "hfa_vs_averager": ">= 1.2"},  # issue 16
        "same_training": {
            "after_steps": args.warmup,
            **same,
            "test_acc_first_rep": acc,
        },
        "mpi": MPI.Get_library_version().splitlines()[0].rstrip("\x00"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        # Other processes on the machine skew every figure: the CPU seconds the machine had,
        # used in all, and used by this job's ranks, over the timed runs (from /proc/stat).
        "machine_cpu_s": None
        if machine0 is None or machine1 is None
        else {
            "available": sum(machine1) - sum(machine0),
            "busy": machine1[0] - machine0[0],
            "this_job": job_cpu,
            "others": max(0.0, machine1[0] - machine0[0] - job_cpu),
        },
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"{'':<10}{'geompi samples/s':>18}{'torch samples/s':>17}{'ratio':>8}{'MPI':>6}"
        f"{'ceiling':>9}{'goal':>8}"
    )
    for label, g, t, r in (
        ("FSA/DDP", "geompi_fsa", "torch_ddp", "fsa_vs_ddp"),
        ("HFA/avg", "geompi_hfa", "torch_avg", "hfa_vs_averager"),
    ):
        print(
            f"{label:<10}{med[g]:>18.0f}{med[t]:>17.0f}{ratio[r]:>8.2f}{mpi_floor[r]:>6.2f}"
            f"{ceiling[r]:>9.2f}"
            f"{out['goals'][r]:>8}"
        )
    print(f"local_only (no communication): {med['local_only']:.0f} samples/s")
    for sync, f in floor.items():
        r = vs_floor[sync]
        print(
            f"{sync.upper()} geompi / floor ({f['best']}, {f['samples_per_s']:.0f} samples/s): "
            f"{r['best']:.2f} (vs MPI {r['vs_mpi']:.2f}, vs gloo {r['vs_gloo']:.2f})"
        )
    print("per step, summed over the ranks: wall ms / CPU ms")
    for k, v in per_step.items():
        cpu_ms = "?" if v["cpu_ms"] is None else f"{v['cpu_ms']:.1f}"
        print(f"  {k:<12} {v['wall_ms']:8.2f} / {cpu_ms}")
    print(f"device {DEVICE}, {machine['ranks_per_core']} ranks per core, {machine['cpu_model']}")
    print(
        f"same training: max |geompi - torch| after {args.warmup} steps: FSA/DDP "
        f"{same['fsa_vs_ddp_max_abs_diff']:.2e}, HFA/averager "
        f"{same['hfa_vs_averager_max_abs_diff']:.2e}; test accuracy after {args.steps}: "
        + ", ".join(f"{k} {v:.4f}" for k, v in acc.items())
    )
    print(f"wrote {args.out}")
