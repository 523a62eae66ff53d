"""geompi's link model against a kernel-shaped link: FSA, HFA, streaming HFA and MixedSync at
100 Mbit/s and 1 Gbit/s, side by side.

    python bench/real_wan.py [--steps 200] [--reps 3] [--rates 100mbit,1gbit] [--methods fsa,...]

Root only (network namespaces, tests/netns.py). 7 ranks: 2 datacenters of 2 workers + a local
server, 1 global server; the default model (the GeoMX CNN) on digits, batch 32, the same seed
for every run. Each method and rate runs in three ways:

- ``kernel``: every datacenter in its own network namespace (``--dc-map nodes``), MPI over TCP
  only, each datacenter's veth limited to the rate by ``tc tbf`` in both directions (a queue of
  100 ms at the rate), no link model;
- ``model_tcp``: the same namespaces, links unshaped, geompi's link model at the rate
  (``--wan-bandwidth``): the emulation on the same transport;
- ``model``: one host as users run it (shared memory), the link model at the rate.

No latency anywhere: there is no ``netem`` on this kernel (tc takes tbf and htb, not netem), so
a kernel-shaped link has no latency to compare with ``--wan-latency``; latency stays in the link
model alone. Each repeat is one namespace job (kernel and model_tcp runs) and one host job
(model runs), in turn, so that the machine's load drifts over all three alike.

Figures per method, rate and way: the training's wall time (the metrics summary's ``wall_s``),
WAN bytes (geompi's ``wan_bytes``; for namespace runs also the kernel's bytes through the
datacenters' veths, with and without packet headers), and link utilisation
``wan_bytes / (2 directions x 2 datacenters x rate x wall_s)``; medians and the range of the
repeats. ``model / kernel`` is the link model's wall time over the kernel-shaped one's: below 1,
the model predicts a faster run than the kernel-shaped link gives.

Writes bench/results/real_wan.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import netns  # noqa: E402
from tests.mpirun import mpirun_path, read_jsonl, train_runs  # noqa: E402

HOSTS = [("dc0", 3), ("dc1", 3), ("gs", 1)]
RANKS = sum(k for _, k in HOSTS)
DCS = 2
HEADERS = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps: per packet the kernel counts
METHODS = {
    "fsa": ["--sync", "fsa"],
    "hfa": ["--sync", "hfa", "--k1", "4", "--k2", "2"],
    "streaming_hfa": ["--sync", "hfa", "--k1", "4", "--k2", "2", "--hfa-fragments", "2"]
    + ["--hfa-overlap"],
    "mixed": ["--sync", "mixed"],
}
WAYS = ("kernel", "model_tcp", "model")


def rate_bits(text: str) -> float:
    return netns._rate(text)


def common(steps: int) -> list[str]:
    return ["--steps", str(steps), "--batch-size", "32", "--seed", "1", "--eval-every", "0"]


def ns_job(rates: list[str], steps: int, out: pathlib.Path, timeout: float) -> list[dict]:
    """One job across namespaces: every method at every rate, kernel-shaped, then modelled."""
    spec, keys = [], []
    for rate in rates:
        for m, margs in METHODS.items():
            for way in ("kernel", "model_tcp"):
                i = len(spec)
                args = ["--dc-map", "nodes", *margs, *common(steps)]
                args += ["--metrics", str(out / f"m{i}.jsonl")]
                if way == "model_tcp":
                    args += ["--wan-bandwidth", rate]
                spec.append({"args": args, "rate": rate_bits(rate) if way == "kernel" else None})
                keys.append((m, rate, way))
    (out / "spec.json").write_text(json.dumps(spec))
    prog = str(ROOT / "tests/progs/netns_runs.py")
    with netns.Cluster(HOSTS) as c:
        res = c.run([sys.executable, prog, str(out), str(out / "spec.json")], timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(
            f"real_wan: the namespace job exited {res.returncode}\n{res.stderr[-3000:]}"
        )
    rows = []
    for i, (m, rate, way) in enumerate(keys):
        net = json.loads((out / f"run{i}.net.json").read_text())
        row = record(read_jsonl(out / f"m{i}.jsonl")[-1], m, rate, way)
        moved = [
            {k: net["after"][h][k] - net["before"][h][k] for k in netns.COUNTERS}
            for h in range(DCS)
        ]
        kb = sum(d["rx_bytes"] + d["tx_bytes"] for d in moved)
        packets = sum(d["rx_packets"] + d["tx_packets"] for d in moved)
        row.update(kernel_bytes=kb, kernel_payload_bytes=kb - HEADERS * packets)
        rows.append(row)
    return rows


def host_job(rates: list[str], steps: int, out: pathlib.Path, timeout: float) -> list[dict]:
    """One job on this host over shared memory: every method at every rate, modelled."""
    runs, keys = [], []
    for rate in rates:
        for m, margs in METHODS.items():
            i = len(runs)
            args = ["--dc-sizes", "3,3", "--global-servers", "1", *margs, *common(steps)]
            args += ["--wan-bandwidth", rate, "--metrics", str(out / f"m{i}.jsonl")]
            runs.append((args, {}))
            keys.append((m, rate, "model"))
    train_runs(RANKS, runs, out, timeout=timeout)
    return [
        record(read_jsonl(out / f"m{i}.jsonl")[-1], m, rate, way)
        for i, (m, rate, way) in enumerate(keys)
    ]


def record(summary: dict, method: str, rate: str, way: str) -> dict:
    wall = summary["wall_s"]
    return {
        "method": method,
        "rate": rate,
        "way": way,
        "wall_s": wall,
        "wan_bytes": summary["wan_bytes"],
        "utilisation": summary["wan_bytes"] / (2 * DCS * rate_bits(rate) / 8 * wall),
        "wan_wait_s": summary["time_split"]["wan_wait_s"],
        "test_acc": summary.get("test_acc"),
        "steps": summary["steps"],
        "topology": summary["topology"]["dc_sizes"],
    }


def summarise(rows: list[dict], rates: list[str]) -> dict:
    out: dict = {}
    for rate in rates:
        for m in METHODS:
            cell: dict = {}
            for way in WAYS:
                sel = [r for r in rows if (r["method"], r["rate"], r["way"]) == (m, rate, way)]
                if not sel:
                    continue
                walls = [r["wall_s"] for r in sel]
                cell[way] = {
                    "wall_s": statistics.median(walls),
                    "wall_min_s": min(walls),
                    "wall_max_s": max(walls),
                    "wan_bytes": statistics.median(r["wan_bytes"] for r in sel),
                    "utilisation": statistics.median(r["utilisation"] for r in sel),
                    "repeats": len(sel),
                }
                if way != "model":
                    cell[way]["kernel_bytes"] = statistics.median(r["kernel_bytes"] for r in sel)
                    cell[way]["kernel_payload_bytes"] = statistics.median(
                        r["kernel_payload_bytes"] for r in sel
                    )
            if "kernel" in cell:
                k = cell["kernel"]["wall_s"]
                cell["model_over_kernel"] = cell["model"]["wall_s"] / k if "model" in cell else None
                cell["model_tcp_over_kernel"] = (
                    cell["model_tcp"]["wall_s"] / k if "model_tcp" in cell else None
                )
            out[f"{m}@{rate}"] = cell
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--methods", default=",".join(METHODS), help="of " + ", ".join(METHODS))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mpirun job")
    p.add_argument("--out", default=str(ROOT / "bench/results/real_wan.json"))
    args = p.parse_args(argv)
    rates = args.rates.split(",")
    try:
        for r in rates:
            rate_bits(r)
        for m in set(METHODS) - set(args.methods.split(",")):
            del METHODS[m]
        if not METHODS or set(args.methods.split(",")) - set(METHODS):
            raise ValueError(
                f"--methods {args.methods!r}: choose from fsa, hfa, streaming_hfa, mixed"
            )
    except ValueError as e:
        print(f"real_wan: error: {e}", file=sys.stderr)
        return 2
    why = netns.unavailable()
    if why:
        print(f"real_wan: skipped: {why}", file=sys.stderr)
        return 0
    rows: list[dict] = []
    loads = [os.getloadavg()[0]]
    t0 = time.time()
    try:
        for rep in range(args.reps):
            for job in (ns_job, host_job):
                with tempfile.TemporaryDirectory(prefix="real_wan-") as tmp:
                    new = job(rates, args.steps, pathlib.Path(tmp), args.timeout)
                for r in new:
                    r["repeat"] = rep
                rows += new
                loads.append(os.getloadavg()[0])
                print(f"real_wan: repeat {rep} {job.__name__} done, {time.time() - t0:.0f} s")
    except netns.Stopped as e:
        print(f"real_wan: stopped by signal {e.signum}", file=sys.stderr)
        return 128 + e.signum
    mpi = subprocess.run([mpirun_path(), "--version"], capture_output=True, text=True)
    import torch

    result = {
        "benchmark": "real_wan",
        "command": "python bench/real_wan.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "ranks": RANKS,
        "mpi": mpi.stdout.splitlines()[0] if mpi.stdout else "",
        "torch": torch.__version__,
        "kernel": os.uname().release,
        "load_1min": loads,
        "steps": args.steps,
        "reps": args.reps,
        "methods": {m: " ".join(a) for m, a in METHODS.items()},
        "latency": "none (no netem on this kernel; latency stays in the link model)",
        "summary": summarise(rows, rates),
        "runs": rows,
    }
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for key, cell in result["summary"].items():
        parts = [
            f"{w} {c['wall_s']:.2f}s ({c['wall_min_s']:.2f}-{c['wall_max_s']:.2f}) "
            f"util {c['utilisation']:.2f}"
            for w, c in ((w, cell[w]) for w in WAYS if w in cell)
        ]
        print(f"{key:24} " + " | ".join(parts) + f" | model/kernel {cell.get('model_over_kernel')}")
    print(f"(wrote {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
