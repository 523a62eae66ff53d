"""The local server's load as a datacenter grows: the funnel (every worker's full push into the
local server, which sums them) against the reduce-scatter among the workers
(``lan_reduce="scatter"``: the local server takes in one copy of the model per round), side by
side in one job, through the public API.

    mpirun -n 6 python bench/local_server_scaling.py     # 4 workers in the datacenter
    mpirun -n 10 python bench/local_server_scaling.py    # 8
    mpirun -n 18 python bench/local_server_scaling.py    # 16 (--oversubscribe on a small machine)

One datacenter of W workers (the world less its local server and 1 global server), FSA with
SGD on a model of --mb MB (linear layers), --steps steps per run; the two ways alternate for
--reps repetitions. Reported per way: the LAN bytes into the busiest process of the datacenter
per step (counted by geompi's link counters on every rank, less a run of 0 steps, which holds
the start and end of a job), the same for the local server, and the median round time (step
wall time, the master worker's), with the spread over repetitions; and the ratios scatter /
funnel. Results are merged into bench/results/local_server_scaling.json under W.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from mpi4py import MPI

import geompi

ROOT = pathlib.Path(__file__).resolve().parents[1]
p = argparse.ArgumentParser()
p.add_argument("--mb", type=float, default=8.0, help="model size in MB")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--reps", type=int, default=5)
p.add_argument("--out", default=str(ROOT / "bench/results/local_server_scaling.json"))
args = p.parse_args()

torch.set_num_threads(1)
size = MPI.COMM_WORLD.Get_size()
geompi.init(dc_sizes=(size - 1,), global_servers=1)  # server ranks serve in here
widx = geompi.worker_rank()
workers = size - 2
width = 512
layers = max(1, round(args.mb * 2**20 / 4 / (width * width)))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def run(way: str, steps: int) -> dict | None:
    """One job of ``steps`` steps; on the master worker its report and the step times."""
    net = model()
    opt = geompi.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01), net, lan_reduce=way, bucket_mb=4.0
    )
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(widx))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    report = opt.close()
    if report is None:
        return None
    ranks = report["per_rank"]
    received = [r["lan_received_bytes"] for r in ranks]  # world order: dc ranks, then the GS
    local = [r["lan_received_bytes"] for r in ranks if r["role"] == "LOCAL_SERVER"]
    return {"received": received[: workers + 1], "local": local[0], "times": times}


per_way: dict[str, list[dict]] = {"funnel": [], "scatter": []}
base = run("funnel", 0)  # INIT and STOP only
for rep in range(args.reps):
    for way in ("funnel", "scatter") if rep % 2 == 0 else ("scatter", "funnel"):
        r = run(way, args.steps)
        if r is None:
            continue
        busiest = max(
            (a - b) / args.steps for a, b in zip(r["received"], base["received"], strict=True)
        )
        per_way[way].append(
            {
                "busiest_bytes_per_step": busiest,
                "local_server_bytes_per_step": (r["local"] - base["local"]) / args.steps,
                "round_s": statistics.median(r["times"][1:]),
            }
        )
geompi.finish()
if widx != 0:
    sys.exit(0)


def summary(runs: list[dict], key: str) -> dict:
    vals = [r[key] for r in runs]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


figures = {way: {k: summary(runs, k) for k in runs[0]} for way, runs in per_way.items() if runs}
model_bytes = 4 * sum(p.numel() for p in model().parameters())
out_w = {
    "workers": workers,
    "model_bytes": model_bytes,
    "settings": vars(args),
    "figures": figures,
    "ratios_scatter_over_funnel": {
        k: figures["scatter"][k]["median"] / figures["funnel"][k]["median"]
        for k in figures["funnel"]
    },
}
path = pathlib.Path(args.out)
path.parent.mkdir(parents=True, exist_ok=True)
results = json.loads(path.read_text()) if path.exists() else {"benchmark": "local_server_scaling"}
results.setdefault("by_workers", {})[str(workers)] = out_w
path.write_text(json.dumps(results, indent=2) + "\n")
for way, f in figures.items():
    print(
        f"W={workers} {way:<8} busiest {f['busiest_bytes_per_step']['median'] / 1e6:8.2f} MB/step "
        f"local server {f['local_server_bytes_per_step']['median'] / 1e6:8.2f} MB/step "
        f"round {f['round_s']['median'] * 1e3:7.1f} ms "
        f"({f['round_s']['min'] * 1e3:.1f}-{f['round_s']['max'] * 1e3:.1f})",
        flush=True,
    )
print(json.dumps(out_w["ratios_scatter_over_funnel"], indent=2))
