"""Bytes into the global server per step as datacenters grow from 2 to 8 workers each.

    mpirun -n 37 python bench/gs_bytes.py [--steps 12] [--dcs 4]

One job of 4 datacenters x (8 workers + 1 local server) + 1 global server = 37 ranks, run
oversubscribed with a tiny model (``linear`` on digits, 650 parameters). For 2, 4, 6 and 8
workers per datacenter, the first 4 x (w + 1) + 1 ranks train FSA, MixedSync and HFA
(K1 = 2, K2 = 2) on a sub-communicator while the rest wait. The global server counts what it
receives (headers, pushes, MixedSync deposits); bytes per step come from two run lengths, so
the INIT round cancels out. A local server sums its datacenter before the WAN, so the figure
must not grow with the workers: the acceptance is max/min <= 1.05 per algorithm.
Writes bench/results/gs_bytes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from mpi4py import MPI

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
os.environ.setdefault("GEOMPI_WAIT", "poll")  # 37 ranks on a few cores: waits must sleep

from geompi.config import make_config  # noqa: E402
from geompi.train import train  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ALGOS = {"fsa": {}, "mixed": {}, "hfa": {"k1": 2, "k2": 2}}


def idle_until_done(world) -> None:
    """A rank outside this configuration: wait without taking CPU from those training."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def global_in(comm, workers: int, dcs: int, algo: str, steps: int) -> dict:
    cfg = make_config(
        env={},
        sync=algo,
        model="linear",
        dataset="digits",
        dc_sizes=(workers + 1,) * dcs,
        global_servers=1,
        steps=steps,
        batch_size=8,
        progress_every=1e9,
        **ALGOS[algo],
    )
    return train(cfg, comm)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dcs", type=int, default=4)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    sizes = [w for w in (2, 4, 6, 8) if args.dcs * (w + 1) + 1 <= world.Get_size()]
    if rank == 0 and not sizes:
        print(f"gs_bytes: needs at least {args.dcs * 3 + 1} ranks", file=sys.stderr)
    figures: dict[str, dict[int, float]] = {a: {} for a in ALGOS}
    for w in sizes:
        n = args.dcs * (w + 1) + 1
        comm = world.Split(0 if rank < n else MPI.UNDEFINED, rank)
        for algo in ALGOS:
            got = {}
            for steps in (args.steps // 2, args.steps):
                s = global_in(comm, w, args.dcs, algo, steps) if rank < n else None
                if s is not None:
                    got[steps] = s["global_in_bytes"]
            idle_until_done(world)  # every rank, once per configuration
            if rank == 0:
                figures[algo][w] = (got[args.steps] - got[args.steps // 2]) / (args.steps // 2)
                print(f"gs_bytes: {algo} {w} workers/DC: {figures[algo][w]:.0f} B/step", flush=True)
        if comm != MPI.COMM_NULL:
            comm.Free()
    if rank == 0:
        spread = {a: max(f.values()) / min(f.values()) for a, f in figures.items() if f}
        out = {
            "settings": {
                "ranks": world.Get_size(),
                "dcs": args.dcs,
                "workers_per_dc": sizes,
                "steps": [args.steps // 2, args.steps],
                "model": "linear",
                "note": "HFA (K1=K2=2): bytes per training step, one global round per 4 steps",
            },
            "bytes_per_step": {a: {str(w): v for w, v in f.items()} for a, f in figures.items()},
            "acceptance": {
                "max_over_min": spread,
                "flat_within_5_percent": all(v <= 1.05 for v in spread.values()),
            },
        }
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "gs_bytes.json").write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out["acceptance"]), flush=True)


if __name__ == "__main__":
    main()
