"""FSA, HFA, streaming HFA and streaming HFA with int4, side by side in one job, under an
emulated WAN, training the transformer of examples/transformer_lm.py through the public API.

    mpirun -n 7 python bench/streaming_wan.py [--steps 96] [--hfa-steps 288] [--fsa-slow-steps 16]
        [--hfa-fast-steps N] [--floor-steps N] [--corpus-bytes N]

Two datacenters of 2 workers + 1 local server, 1 global server. Every method trains the same
model (AdamW, the standard library's source) from the same start. Two emulated links: 100 Mbit/s
and 1 Gbit/s, both 50 ms one way.

- The algorithms here are deterministic, so a method's loss after step s is the same on both
  links: only the time differs. FSA runs ``--steps`` steps on the 1 Gbit/s link; on the
  100 Mbit/s link (where its every step moves the whole model) it runs ``--fsa-slow-steps`` and
  its time to the target is its median step time there times its steps to the target. The HFA
  methods run ``--hfa-steps`` on both links (local steps learn less each than synchronous
  ones, so they get the room to reach FSA's loss, and their time to it is measured); on the
  1 Gbit/s link they may run fewer (``--hfa-fast-steps``), and their time to the target there
  is then, as FSA's on the slow link, their median step time times their steps to it.
- Every method's loss curve is that of its longest run (the same curve on both links).
- The target loss is FSA's final loss (the mean of its last 8 steps); a method's steps to the
  target are the first step whose 8-step mean is at or below it.
- WAN data bytes are what the local servers sent up (``opt.close()``'s
  ``wan_data_up_bytes``). The bytes to the target are the start-up's (the INIT round, measured
  by a job of the same method that takes no step) in full, plus the rest of the run's bytes
  times the share of its steps needed (they accrue evenly by datacenter round; the final
  global average of ``close()`` is in that rest, pro rata). int4's ratio to FSA is given with
  the start-up and without it (both methods send the same fp32 model once; what remains is the
  synchronisation's own traffic, which is what DiLoCo's figures count). Peak bytes per
  datacenter round: the most one local server sent up in one round. Utilisation:
  1 - (a worker's wait in MPI) / (its wall time), averaged over workers.
- Each run reads its worker's share of ``--corpus-bytes`` of text at most once (a longer run is
  refused before it starts), so no method is scored on windows it has already seen.
- The floor, in the same job: the same local steps with each datacenter's average one raw
  ``MPI.Allreduce`` of the parameters among its workers (no servers, no global tier): what this
  machine allows any method. Its wait is the whole Allreduce and the division after it, where
  geompi's is only its time in MPI waits, so the comparison does not favour the floor.

Writes bench/results/streaming_wan.json (and a plot, with matplotlib, afterwards).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from lm_common import ROOT, load_example, model_and_adamw, train
from mpi4py import MPI

import geompi
from geompi.comm.buckets import Buckets
from geompi.session import current as current_session

lm = load_example()

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=96)
p.add_argument("--fsa-slow-steps", type=int, default=16)
p.add_argument("--hfa-steps", type=int, default=288, help="a multiple of k1*k2")
p.add_argument("--hfa-fast-steps", type=int, help="HFA methods' steps on 1 Gbit/s (default: all)")
p.add_argument("--floor-steps", type=int, help="the raw MPI floor's steps (default: --hfa-steps)")
p.add_argument("--k1", type=int, default=8)
p.add_argument("--k2", type=int, default=4)
p.add_argument("--fragments", type=int, default=4)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--latency", default="50ms")
p.add_argument(
    "--corpus-bytes", type=int, default=1 << 20, help="bytes of the standard library's source"
)
p.add_argument("--out", default=str(ROOT / "bench/results/streaming_wan.json"))
args = p.parse_args()

torch.set_num_threads(1)
data = lm.stdlib_corpus(args.corpus_bytes)
dataset = lm.Windows(data, args.seq)
# Every run reads one pass at most, so no method sees a window twice: refuse a run longer than
# that before anything collective (every rank finds the same, so all stop together).
most_steps = max(
    args.steps, args.fsa_slow_steps, args.hfa_steps, args.hfa_fast_steps or 0, args.floor_steps or 0
)
DC_SIZES = (3, 3)  # ranks per datacenter: one local server, the rest workers
per_worker = len(dataset) // sum(n - 1 for n in DC_SIZES) // args.batch_size
if most_steps > per_worker:
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(
            f"streaming_wan: error: {most_steps} steps need more than the {per_worker} batches per "
            f"worker of {len(data)} bytes of text; raise --corpus-bytes (at most "
            f"{lm.stdlib_corpus(1 << 30).numel()}) or lower the steps",
            file=sys.stderr,
        )
    sys.exit(2)
geompi.init(dc_sizes=DC_SIZES, global_servers=1)  # server ranks serve in here
widx = geompi.worker_rank()
LINKS = {"100Mbit": "100Mbit", "1Gbit": "1Gbit"}
METHODS = {
    "fsa": ("fsa", None),
    "hfa": (geompi.HFA(k1=args.k1, k2=args.k2), None),
    "streaming_hfa": (
        geompi.HFA(k1=args.k1, k2=args.k2, fragments=args.fragments, overlap=True),
        None,
    ),
    "streaming_hfa_int4": (
        geompi.HFA(k1=args.k1, k2=args.k2, fragments=args.fragments, overlap=True),
        "int4",
    ),
}


def build(method: str, **wan) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its geompi optimizer for ``method`` (``wan``: the emulated link)."""
    sync, compression = METHODS[method]
    model, opt = model_and_adamw(lm, args.seq)
    opt = geompi.DistributedOptimizer(
        opt, model, sync=sync, bucket_mb=1, wan_compression=compression, **wan
    )
    return model, opt


def run(method: str, link: str, steps: int) -> dict:
    model, opt = build(method, wan_bandwidth=LINKS[link], wan_latency=args.latency)
    sampler = geompi.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler))
    losses, walls = train(model, opt, loader, steps)
    report = opt.close()
    if report is None:
        return {}
    util = [1 - w / t for w, t in zip(report["worker_wait_s"], report["worker_wall_s"]) if t]
    return {
        "steps": steps,
        "loss": losses,  # the master worker's, per step
        "wall_s": walls,
        "wan_data_bytes": report["wan_data_up_bytes"],
        "peak_round_wan_bytes": report["peak_round_wan_bytes"],
        "utilisation": statistics.mean(util),
    }


def startup_bytes(method: str) -> int:
    """The WAN data bytes of a job of ``method`` that takes no step: its INIT round."""
    report = build(method)[1].close()
    return report["wan_data_up_bytes"] if report is not None else 0


class RawAverage:
    """The floor to measure utilisation against: AdamW as it is, and after every K1-th step
    each datacenter's average as one in-place ``MPI.Allreduce`` of the parameters among its
    workers (no local server, no global tier: the datacenters drift apart, so only the time
    counts). The parameters are views of one flat buffer: geompi's bucketing with no cap."""

    def __init__(self, opt: torch.optim.Optimizer, model: torch.nn.Module, comm, k1: int):
        self.opt, self.comm, self.k1 = opt, comm, k1
        self.steps, self.wait_s = 0, 0.0
        (bucket,) = Buckets(list(model.named_parameters()), cap_bytes=1 << 62)
        self.flat = bucket.params

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()
        self.steps += 1
        if self.steps % self.k1 == 0:
            t0 = time.perf_counter()
            self.comm.Allreduce(MPI.IN_PLACE, self.flat.numpy(), MPI.SUM)
            self.flat.div_(self.comm.Get_size())
            self.wait_s += time.perf_counter() - t0


def raw_floor(steps: int) -> dict:
    """Utilisation and time per step of the same local steps averaged by raw MPI."""
    workers = current_session().comms.all_workers
    dc_workers = workers.Split(geompi.dc(), widx)
    model, opt = model_and_adamw(lm, args.seq)
    raw = RawAverage(opt, model, dc_workers, args.k1)
    sampler = geompi.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler))
    _, walls = train(model, raw, loader, steps)
    dc_workers.Free()
    util = workers.gather(1 - raw.wait_s / walls[-1], root=0)
    return {"steps": steps, "wall_s": walls, "utilisation": util and statistics.mean(util)}


startup = {method: startup_bytes(method) for method in METHODS}
results: dict[str, dict[str, dict]] = {link: {} for link in LINKS}
for link in ("1Gbit", "100Mbit"):
    for method in METHODS:
        if method == "fsa":
            steps = args.fsa_slow_steps if link == "100Mbit" else args.steps
        else:
            fast_steps = args.hfa_fast_steps or args.hfa_steps
            steps = args.hfa_steps if link == "100Mbit" else fast_steps
        results[link][method] = run(method, link, steps)
        if widx == 0:
            r = results[link][method]
            print(
                f"{link:>8} {method:<20} {steps:>4} steps {r['wall_s'][-1]:8.1f} s "
                f"util {r['utilisation']:.3f} wan {r['wan_data_bytes'] / 1e6:9.1f} MB "
                f"peak/round {r['peak_round_wan_bytes'] / 1e6:7.2f} MB "
                f"loss {r['loss'][-1]:.4f}",
                flush=True,
            )
floor = raw_floor(args.floor_steps or args.hfa_steps)
if widx == 0:
    print(f"raw MPI floor {floor['steps']:>4} steps util {floor['utilisation']:.3f}", flush=True)
geompi.finish()
if widx != 0:
    sys.exit(0)


def smooth(xs: list[float], n: int = 8) -> list[float]:
    return [statistics.mean(xs[max(0, i - n + 1) : i + 1]) for i in range(len(xs))]


def median_step_s(walls: list[float]) -> float:
    """The median time of one step, from the wall times after each step."""
    return statistics.median(b - a for a, b in zip([0.0] + walls[:-1], walls))


# The longest run of each method: its loss curve and its bytes (the same on both links).
longest = {m: max((results[ln][m] for ln in ("1Gbit", "100Mbit")), key=lambda r: r["steps"])
           for m in METHODS}  # fmt: skip
target = smooth(longest["fsa"]["loss"])[-1]
summary: dict[str, dict] = {}
for link, runs in results.items():
    for method, r in runs.items():
        curve = smooth(longest[method]["loss"])
        reach = next((i + 1 for i, v in enumerate(curve) if v <= target), None)
        per_step = median_step_s(r["wall_s"])
        once = startup[method]  # counted in full: it is all sent before the first step
        full_bytes = (longest[method]["wan_data_bytes"] - once) * (
            r["steps"] / longest[method]["steps"]
        )
        summary.setdefault(link, {})[method] = {
            "utilisation": r["utilisation"],
            "peak_round_wan_bytes": r["peak_round_wan_bytes"],
            "steps_to_target": reach,
            "time_to_target_s": None
            if reach is None
            else (r["wall_s"][reach - 1] if reach <= r["steps"] else reach * per_step),
            "wan_data_bytes_to_target": None
            if reach is None
            else once + full_bytes * reach / r["steps"],
            "startup_wan_data_bytes": once,
            "final_loss": curve[-1],
        }
s100 = summary["100Mbit"]
fsa_bytes = s100["fsa"]["wan_data_bytes_to_target"]
goals = {
    "streaming_utilisation": s100["streaming_hfa"]["utilisation"],
    "hfa_utilisation": s100["hfa"]["utilisation"],
    "int4_fewer_wan_bytes_to_target_than_fsa": None
    if not s100["streaming_hfa_int4"]["wan_data_bytes_to_target"]
    else fsa_bytes / s100["streaming_hfa_int4"]["wan_data_bytes_to_target"],
    # The same without the start-up, which every method sends alike (the fp32 model, once):
    # the bytes of the synchronisation itself, as DiLoCo counts them.
    "int4_fewer_wan_bytes_after_startup_than_fsa": None
    if not s100["streaming_hfa_int4"]["wan_data_bytes_to_target"]
    else (fsa_bytes - startup["fsa"])
    / (s100["streaming_hfa_int4"]["wan_data_bytes_to_target"] - startup["streaming_hfa_int4"]),
    "int4_final_loss_vs_fsa": s100["streaming_hfa_int4"]["final_loss"] / target,
    "streaming_peak_round_vs_hfa": s100["streaming_hfa"]["peak_round_wan_bytes"]
    / s100["hfa"]["peak_round_wan_bytes"],
}
out = {
    "benchmark": "streaming_wan",
    "model": f"TinyGPT {sum(p.numel() for p in lm.TinyGPT(seq=args.seq).parameters())} params",
    "settings": vars(args),
    "command": " ".join(["mpirun -n 7 python bench/streaming_wan.py", *sys.argv[1:]]),
    "target_loss": target,
    "summary": summary,
    "goals": goals,
    "goal_bounds": {
        "streaming_utilisation": ">= 0.95",
        "int4_fewer_wan_bytes_to_target_than_fsa": ">= 1000",
        "int4_fewer_wan_bytes_after_startup_than_fsa": ">= 1000",
        "int4_final_loss_vs_fsa": "<= 1.01",
        "streaming_peak_round_vs_hfa": f"<= 1/{args.fragments} (+ headers)",
        "adaptive_sync": "measured by bench/adaptive_wan.py",
    },
    "floor": {
        "what": "the same local steps, each datacenter's average one MPI.Allreduce of the "
        "parameters among its workers, no servers",
        "utilisation": floor["utilisation"],
        "s_per_step": median_step_s(floor["wall_s"]),
    },
    "runs": results,
}
path = pathlib.Path(args.out)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps({"target_loss": target, "goals": goals}, indent=2))
print(f"wrote {path}")
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("streaming_wan: no matplotlib; skipped the plot (pip install matplotlib)")
    sys.exit(0)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
for method, r in results["100Mbit"].items():
    f = longest[method]
    walls = r["wall_s"] if r["steps"] == f["steps"] else None
    if walls is None:  # FSA on the slow link: its steps at the measured step time
        per = median_step_s(r["wall_s"])
        walls = [per * (i + 1) for i in range(f["steps"])]
    ax1.plot(walls, smooth(f["loss"]), label=method)
    once = startup[method]
    per_step_bytes = (f["wan_data_bytes"] - once) / f["steps"]
    sent = [(once + per_step_bytes * (i + 1)) / 1e6 for i in range(f["steps"])]
    ax2.plot(sent, smooth(f["loss"]), label=method)
ax1.set_xlabel("wall time (s), 100 Mbit/s 50 ms WAN")
ax2.set_xlabel("WAN data (MB)")
ax2.set_xscale("log")
for ax in (ax1, ax2):
    ax.set_ylabel("training loss (8-step mean)")
    ax.axhline(target, color="grey", lw=0.5)
    ax.legend()
fig.tight_layout()
png = path.with_suffix(".png")
fig.savefig(png, dpi=100)
print(f"wrote {png}")
