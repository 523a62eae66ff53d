"""MixedSync against FSA with one datacenter slowed 3x (emulation), side by side in one job.

    mpirun -n 16 python bench/mixed_slowdown.py [--steps 150] [--slowdown 3]

Reports (1) how many updates each datacenter completed by the time the fast datacenter 0 finished
its steps (fast / slow should be >= 2), and (2) the wall time for the fast datacenters to reach
the step count, FSA / MixedSync (should be >= 1.8). Writes bench/results/mixed_slowdown.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from mpi4py import MPI

from geompi.config import make_config
from geompi.train import train

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=150)
p.add_argument("--slowdown", type=float, default=3.0)
p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results/mixed_slowdown.json"))
args = p.parse_args()

runs = {}
for sync in ("fsa", "mixed"):
    s = train(
        make_config(
            env={}, sync=sync, steps=args.steps, dc_slowdown={1: args.slowdown}, progress_every=1e9
        )
    )
    if s is not None:
        runs[sync] = s

if MPI.COMM_WORLD.Get_rank() == 0:
    mixed, fsa = runs["mixed"], runs["fsa"]
    # deposits applied per datacenter when the first (the fast) datacenter finished
    by_then = dict(enumerate(mixed["updates_at_first_done"]))
    slow = by_then[1]
    fast = min(by_then[d] for d in by_then if d != 1)
    out = {
        "benchmark": "mixed_slowdown",
        "steps": args.steps,
        "slowdown": {"dc": 1, "factor": args.slowdown, "kind": "emulation (sleep)"},
        "updates_when_dc0_done": by_then,
        "fast_over_slow_updates": fast / max(slow, 1),
        "fsa_train_s": fsa["train_s"],
        "mixed_dc0_train_s": mixed["train_s"],
        "fsa_over_mixed_time_to_steps": fsa["train_s"] / mixed["train_s"],
        "test_acc": {"fsa": fsa["test_acc"], "mixed": mixed["test_acc"]},
        "mean_staleness": mixed["mean_staleness"],
        "goals": {"fast_over_slow_updates": ">= 2", "fsa_over_mixed_time_to_steps": ">= 1.8"},
    }
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
