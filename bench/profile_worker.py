"""Where a rank's CPU goes during training: ``geompi.train`` under cProfile with a CPU timer.

    mpirun -n 16 python bench/profile_worker.py [--sync fsa] [--steps 320] [--rank 1]

Runs the CLI's training (the digits CNN, batch 16, SGD with momentum) on every rank with
``cProfile.Profile(time.process_time)``, so waiting that sleeps costs nothing and spinning costs
what it burns. Rank ``--rank`` prints the CPU seconds of the training loop, of backward, and of
geompi's backward hook and round end inside it, then its top functions by own CPU time;
``--dump DIR`` keeps every rank's stats for ``python -m pstats``. A profiler inflates
Python-heavy code, so compare runs of this script (one commit against another), not its figures
against the benchmarks'.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pathlib
import pstats
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from geompi.config import make_config  # noqa: E402
from geompi.train import train  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--sync", default="fsa", choices=("fsa", "hfa", "mixed"))
p.add_argument("--steps", type=int, default=320)
p.add_argument("--rank", type=int, default=1, help="the rank that reports (1: a worker)")
p.add_argument("--top", type=int, default=15)
p.add_argument("--dump", default=None, help="a directory for every rank's pstats file")
args = p.parse_args()

torch.set_num_threads(1)
cfg = make_config(
    env={},
    sync=args.sync,
    steps=args.steps,
    batch_size=16,
    model="cnn",
    dataset="digits",
    seed=0,
    lr=0.05,
    momentum=0.9,
    progress_every=1e9,
)
prof = cProfile.Profile(time.process_time)
prof.enable()
with contextlib.redirect_stdout(io.StringIO()):
    train(cfg)
prof.disable()
rank = MPI.COMM_WORLD.Get_rank()
if args.dump:
    pathlib.Path(args.dump).mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(pathlib.Path(args.dump) / f"{args.sync}_{rank}.prof"))
if rank == args.rank:
    stats = pstats.Stats(prof)
    wanted = {
        "training loop": ("geompi/train.py", "run"),
        "backward": ("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
        "geompi's backward hook": ("geompi/engine.py", "_on_grad"),
        "geompi's round end": ("geompi/engine.py", "_end_backward"),
    }
    print(f"rank {rank}, --sync {args.sync}, {args.steps} steps: CPU seconds (cumulative)")
    for label, (path, func) in wanted.items():
        cum = sum(
            v[3] for (f, _, name), v in stats.stats.items() if f.endswith(path) and name == func
        )
        print(f"  {label:<24}{cum:8.3f}")
    stats.sort_stats("tottime").print_stats(args.top)
