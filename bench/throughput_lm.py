"""The transformer language model of examples/transformer_lm.py (5.1M parameters), trained
through geompi's public API against torch's own tools, side by side in one job.

    mpirun -n 9 python bench/throughput_lm.py [--steps 16] [--warmup 8] [--reps 3]

Two equal datacenters (the world minus 1 global server, halved) of workers + 1 local server.
The same model, AdamW optimizer, data (DistributedSampler shards of the standard library's
source), per-worker batch and step count on both sides, 1 torch thread per process:

  (a) geompi FSA (geompi.DistributedOptimizer, sync="fsa") against torch DDP over gloo;
  (b) geompi HFA (k1=4, k2=2) against local SGD + torch HierarchicalModelAverager.

Beside them, once per repetition, the same loop with no communication (``local_only``: each
worker trains alone), the most samples/s these workers reach on this machine: no
``geompi / torch`` ratio can exceed ``local_only / torch`` (``ceiling``).

geompi's servers wait for the next job without spinning while torch runs, and torch's gloo
group holds the workers only. Each pair runs --reps times, interleaved (the order alternates),
after one warm-up of every side; both sides are timed the same way (the training loop on worker
0, between two barriers). Reports the median samples/s, the spread and the ratios; writes
bench/results/throughput_lm.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import statistics
import time

import torch
from lm_common import ROOT, load_example, model_and_adamw

import geompi

lm = load_example()

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16, help="timed steps (a multiple of k1*k2)")
p.add_argument("--warmup", type=int, default=8)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--k1", type=int, default=4)
p.add_argument("--k2", type=int, default=2)
p.add_argument("--out", default=str(ROOT / "bench/results/throughput_lm.json"))
args = p.parse_args()
if args.steps % (args.k1 * args.k2) or args.warmup % (args.k1 * args.k2):
    p.error(f"--steps and --warmup must be multiples of k1*k2 = {args.k1 * args.k2}")

from mpi4py import MPI  # noqa: E402

size = MPI.COMM_WORLD.Get_size()
if size < 5 or (size - 1) % 2:
    raise SystemExit("throughput_lm: run an odd number of ranks >= 5 (2 equal datacenters + 1)")
torch.set_num_threads(1)
geompi.init(dc_sizes=((size - 1) // 2, (size - 1) // 2), global_servers=1)  # servers stay here
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (  # noqa: E402
    HierarchicalModelAverager,
)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

session = geompi.session.current()
workers = session.comms.all_workers
widx, nworkers = geompi.worker_rank(), geompi.num_workers()
per_dc = nworkers // 2
data = lm.stdlib_corpus(1 << 20)
dataset = lm.Windows(data, args.seq)
port = None
if widx == 0:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
port = workers.bcast(port, root=0)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=widx, world_size=nworkers
)
period = args.k1 * args.k2


def batches(steps: int):
    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=nworkers, rank=widx, shuffle=True, seed=0
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    it = iter(loader)
    return [next(it) for _ in range(steps)]


def model_and_opt():
    return model_and_adamw(lm, args.seq)


def loop(model, opt, steps, after_step=None) -> float:
    """The timed training loop, the same on both sides; seconds on this worker."""
    loss_fn = torch.nn.CrossEntropyLoss()
    data = batches(steps)
    workers.Barrier()
    t0 = time.perf_counter()
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        if after_step is not None:
            after_step(model)
    workers.Barrier()
    return time.perf_counter() - t0


def run(side: str, steps: int) -> tuple[float, dict]:
    model, opt = model_and_opt()
    if side == "geompi_fsa":
        opt = geompi.DistributedOptimizer(opt, model, sync="fsa", bucket_mb=4)
        dt = loop(model, opt, steps)
        opt.close()  # the servers wait idle while torch runs
    elif side == "geompi_hfa":
        opt = geompi.DistributedOptimizer(
            opt, model, sync=geompi.HFA(k1=args.k1, k2=args.k2), bucket_mb=4
        )
        dt = loop(model, opt, steps)
        opt.close()
    elif side == "local_only":
        dt = loop(model, opt, steps)
    elif side == "torch_ddp":
        net = DistributedDataParallel(model)
        dt = loop(net, opt, steps)
    else:
        averager = HierarchicalModelAverager({args.k1: per_dc, period: nworkers}, warmup_steps=0)
        averager.step = 1  # average after steps K1, 2*K1, ... (not on the first call)
        dt = loop(model, opt, steps, lambda m: averager.average_parameters(m.parameters()))
    return dt, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


pairs = (("geompi_fsa", "torch_ddp"), ("geompi_hfa", "torch_avg"))
warm = {side: run(side, args.warmup)[1] for pair in pairs for side in (*pair, "local_only")}
same = {f"{g}_vs_{t}": max_diff(warm[g], warm[t]) for g, t in pairs}
samples = args.steps * args.batch_size * nworkers
rates: dict[str, list[float]] = {side: [] for pair in pairs for side in pair}
rates["local_only"] = []
for rep in range(args.reps):
    rates["local_only"].append(samples / run("local_only", args.steps)[0])
    for g, t in pairs:
        for side in (g, t) if rep % 2 == 0 else (t, g):
            dt, _ = run(side, args.steps)
            rates[side].append(samples / dt)
    if widx == 0:
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
dist.destroy_process_group()
params = sum(p.numel() for p in lm.TinyGPT(seq=args.seq).parameters())
geompi.finish()
if widx == 0:
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratios = {f"{g}_vs_{t}": [a / b for a, b in zip(rates[g], rates[t])] for g, t in pairs}
    out = {
        "benchmark": "throughput_lm",
        "ranks": size,
        "workers": nworkers,
        "topology": session.topo.describe(),
        "model": f"examples/transformer_lm.py TinyGPT, {params} parameters",
        "batch_size": args.batch_size,
        "seq": args.seq,
        "steps": args.steps,
        "reps": args.reps,
        "hfa": {"k1": args.k1, "k2": args.k2},
        "optimizer": "AdamW lr 1e-3 wd 0.01",
        "samples_per_s": med,
        "all_samples_per_s": rates,
        "ratio_median": {k: statistics.median(v) for k, v in ratios.items()},
        "ratio_per_rep": ratios,
        "ceiling": {f"{g}_vs_{t}": med["local_only"] / med[t] for g, t in pairs},
        "goals": {"geompi_fsa_vs_torch_ddp": ">= 1.0", "geompi_hfa_vs_torch_avg": ">= 1.0"},
        "same_training_after_warmup_max_abs_diff": same,
        "torch": torch.__version__,
        "mpi": MPI.Get_library_version().splitlines()[0].rstrip("\x00"),
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'':<22}{'geompi samples/s':>18}{'torch samples/s':>17}{'ratio (spread)':>22}")
    for g, t in pairs:
        r = ratios[f"{g}_vs_{t}"]
        print(
            f"{g + '/' + t:<22}{med[g]:>18.1f}{med[t]:>17.1f}"
            f"{statistics.median(r):>10.2f} ({min(r):.2f}-{max(r):.2f})"
        )
    print(f"local_only (no communication): {med['local_only']:.1f} samples/s")
    print(f"same training after {args.warmup} steps: {same}")
    print(f"wrote {args.out}")
