"""What replicated global servers cost: bytes and time per step with ``--global-replicas`` 1 and 2.

    mpirun -n 8 python bench/replication.py [--steps 40] [--repeats 3]

One job of 8 ranks: datacenters of 3 and 3 ranks (2 workers + a local server each) and 2 global
servers. For FSA (Adam on the global servers) and HFA (K1 = 2, K2 = 1, outer Nesterov: every
datacenter round goes global, the most replication can cost), on the unshaped links of this
machine and on an emulated WAN (``--wan-bandwidth 100Mbit --wan-latency 10ms`` per
datacenter), the two settings run alternately, ``--repeats`` times each, ``--steps`` steps per
run (``cnn`` on ``digits``). Reported per run: wall seconds per step (the workers' mean), the
CPU seconds per step summed over every rank, and the WAN bytes per step
(all, and the data alone: the local servers' pushes and the global servers' results, INIT
round included); then, per case, the medians and spreads and the ratios of
replicated to plain. A mirror receives the same slices its shard's server does, so the local
servers' WAN data doubles by design; what that costs in time is what this measures.
Writes bench/results/replication.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import statistics
import sys
import time

from mpi4py import MPI

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from benchenv import machine_record, pin_device  # noqa: E402

DEVICE = pin_device()  # before torch is imported, in every rank: the CPU build's path, pinned

from geompi.config import make_config  # noqa: E402
from geompi.train import train  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ALGOS = {
    "fsa": {"optimizer": "adam", "lr": 0.001},
    "hfa": {"k1": 2, "k2": 1, "outer_optimizer": "nesterov", "outer_lr": 0.7},
}
NETS = {"unshaped": {}, "wan-100Mbit-10ms": {"wan_bandwidth": "100Mbit", "wan_latency": "10ms"}}


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def one_run(algo: str, net: str, replicas: int, steps: int) -> dict | None:
    cfg = make_config(
        env={},
        sync=algo,
        model="cnn",
        dataset="digits",
        dc_sizes=(3, 3),
        global_servers=2,
        global_replicas=replicas,
        steps=steps,
        batch_size=32,
        progress_every=1e9,
        **ALGOS[algo],
        **NETS[net],
    )
    world = MPI.COMM_WORLD
    world.Barrier()
    c0 = cpu_s()
    summary = train(cfg, world)
    used = world.reduce(cpu_s() - c0, op=MPI.SUM, root=0)
    if summary is None:
        return None
    return {
        "replicas": replicas,
        "wall_s_per_step": summary["wall_s"] / steps,
        "cpu_s_per_step": used / steps,
        "wan_data_bytes_per_step": summary["wan_data_bytes"] / steps,
        "wan_bytes_per_step": summary["wan_bytes"] / steps,
        "global_in_bytes_per_step": summary["global_in_bytes"] / steps,
        "test_acc": summary.get("test_acc"),
    }


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=("cpu",), default="cpu", help="pinned for every run")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    if world.Get_size() != 8:
        if world.Get_rank() == 0:
            print("replication: run with mpirun -n 8", file=sys.stderr)
        sys.exit(2)
    machine = machine_record(DEVICE, world)  # every rank: their cores' union
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    one_run("fsa", "unshaped", 1, 2)  # warm-up (imports, data, first allocations): not counted
    cases = {}
    for algo in ALGOS:
        for net in NETS:
            runs = []
            for r in range(args.repeats):  # alternate, the order swapped every repeat
                for replicas in (1, 2) if r % 2 == 0 else (2, 1):
                    runs.append(one_run(algo, net, replicas, args.steps))
            if world.Get_rank() != 0:
                continue
            case = {"runs": runs}
            keys = ("wall_s_per_step", "cpu_s_per_step", "wan_bytes_per_step")
            for key in keys + ("wan_data_bytes_per_step",):
                by = {n: [x[key] for x in runs if x["replicas"] == n] for n in (1, 2)}
                case[key] = {str(n): spread(v) for n, v in by.items()}
                case[key]["ratio_of_medians"] = statistics.median(by[2]) / statistics.median(by[1])
            cases[f"{algo}/{net}"] = case
            print(
                f"{algo:4} {net:18} wall/step x{case['wall_s_per_step']['ratio_of_medians']:.3f} "
                f"cpu/step x{case['cpu_s_per_step']['ratio_of_medians']:.3f} "
                f"WAN bytes/step x{case['wan_bytes_per_step']['ratio_of_medians']:.3f}",
                flush=True,
            )
    if world.Get_rank() == 0:
        out = {
            "bench": "replication",
            "command": "mpirun -n 8 python bench/replication.py "
            f"--steps {args.steps} --repeats {args.repeats}",
            "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": machine,
            "cases": cases,
        }
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "replication.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
