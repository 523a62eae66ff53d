"""HFA's adaptive cadence (``geompi.HFA(adaptive=True)``) on two emulated WAN links, side by
side in one job with fixed-K2 HFA.

    mpirun -n 7 python bench/adaptive_wan.py [--steps 160] [--k1 8] [--k2-max 64]

The transformer language model of examples/transformer_lm.py (5.1M parameters) trained
through the public API on 2 datacenters of 2 workers and 1 global server, AdamW, under an
emulated 50 ms WAN of 1 Gbit/s and of 100 Mbit/s. On each link: HFA with a fixed K2 (--k2) and
adaptive HFA starting from K2=1 with ``wan_share`` 0.05 (the global exchange should take about
5% of the wall time), and adaptive streaming HFA (4 fragments, overlap) starting from K2=2,
whose exchanges hide behind the next datacenter round. Reports, per run: the K2 the workers
chose and when (``k2_changes``: the measured exchange and datacenter-round compute behind each
choice), global averages, WAN data bytes sent up, utilisation (1 - a worker's wait in MPI /
its wall time, averaged over workers) and the final loss (the master worker's mean of the
last 8 steps). Writes bench/results/adaptive_wan.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch
from lm_common import ROOT, load_example, model_and_adamw, train

import geompi

lm = load_example()

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=160)
p.add_argument("--k1", type=int, default=8)
p.add_argument("--k2", type=int, default=4, help="the fixed-K2 HFA beside the adaptive one")
p.add_argument("--k2-max", type=int, default=64)
p.add_argument("--wan-share", type=float, default=0.05)
p.add_argument("--fragments", type=int, default=4, help="of the streaming run (with overlap)")
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--latency", default="50ms")
p.add_argument("--out", default=str(ROOT / "bench/results/adaptive_wan.json"))
args = p.parse_args()

torch.set_num_threads(1)
geompi.init(dc_sizes=(3, 3), global_servers=1)  # server ranks serve in here
widx = geompi.worker_rank()
dataset = lm.Windows(lm.stdlib_corpus(1 << 20), args.seq)
METHODS = {
    "hfa_fixed": geompi.HFA(k1=args.k1, k2=args.k2),
    "hfa_adaptive": geompi.HFA(
        k1=args.k1, k2=1, adaptive=True, k2_max=args.k2_max, wan_share=args.wan_share
    ),
    # streaming's overlap hides each fragment's exchange behind the next datacenter round
    "hfa_adaptive_streaming": geompi.HFA(
        k1=args.k1,
        k2=2,
        adaptive=True,
        k2_min=2,
        k2_max=args.k2_max,
        wan_share=args.wan_share,
        fragments=args.fragments,
        overlap=True,
    ),
}


def run(method: str, link: str) -> dict:
    model, opt = model_and_adamw(lm, args.seq)
    opt = geompi.DistributedOptimizer(
        opt, model, sync=METHODS[method], wan_bandwidth=link, wan_latency=args.latency
    )
    sampler = geompi.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler))
    losses, walls = train(model, opt, loader, args.steps)
    wall = walls[-1]
    report = opt.close()
    if report is None:
        return {}
    util = [1 - w / t for w, t in zip(report["worker_wait_s"], report["worker_wall_s"]) if t]
    return {
        "wall_s": wall,
        "utilisation": statistics.mean(util),
        "global_averages": opt.global_syncs,
        "k2": report.get("k2", args.k2),
        "k2_changes": report.get("k2_changes", []),
        "wan_data_up_bytes": report["wan_data_up_bytes"],
        "final_loss": statistics.mean(losses[-8:]),
    }


results: dict[str, dict[str, dict]] = {}
for link in ("1Gbit", "100Mbit"):
    for method in METHODS:
        r = results.setdefault(link, {})[method] = run(method, link)
        if widx == 0:
            print(
                f"{link:>8} {method:<22} K2 {r['k2']:>3} global {r['global_averages']:>3} "
                f"{r['wall_s']:7.1f} s util {r['utilisation']:.3f} "
                f"wan {r['wan_data_up_bytes'] / 1e6:8.1f} MB loss {r['final_loss']:.4f}",
                flush=True,
            )
geompi.finish()
if widx != 0:
    sys.exit(0)
adaptive = {link: results[link]["hfa_adaptive"] for link in results}
streaming = {link: results[link]["hfa_adaptive_streaming"] for link in results}
out = {
    "benchmark": "adaptive_wan",
    "model": f"TinyGPT {sum(p.numel() for p in lm.TinyGPT(seq=args.seq).parameters())} params",
    "settings": vars(args),
    "figures": {
        "adaptive_k2_1gbit": adaptive["1Gbit"]["k2"],
        "adaptive_k2_100mbit": adaptive["100Mbit"]["k2"],
        "k2_follows_the_link": adaptive["100Mbit"]["k2"] > adaptive["1Gbit"]["k2"],
        "adaptive_utilisation_1gbit": adaptive["1Gbit"]["utilisation"],
        "adaptive_utilisation_100mbit": adaptive["100Mbit"]["utilisation"],
        "streaming_k2_1gbit": streaming["1Gbit"]["k2"],
        "streaming_k2_100mbit": streaming["100Mbit"]["k2"],
        "streaming_k2_follows_the_link": streaming["100Mbit"]["k2"] > streaming["1Gbit"]["k2"],
        "streaming_utilisation_1gbit": streaming["1Gbit"]["utilisation"],
        "streaming_utilisation_100mbit": streaming["100Mbit"]["utilisation"],
        "goal": "K2 follows the link; utilisation >= 0.9 on both links",
    },
    "runs": results,
}
path = pathlib.Path(args.out)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps(out["figures"], indent=2))
