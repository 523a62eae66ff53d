"""Hold ``geompi plan`` to measurements: settings it was not fitted on, run under geompi's
emulated WAN, predicted against measured time per step, utilisation and WAN bytes.

    python bench/plan_check.py [--launcher "mpirun -n {n}"] [--batch-size 128] [--quick]

One job of ``python -m geompi.train`` runs (tests/progs/train_runs.py: Python, torch and MPI
start once), two datacenters of 2 workers + 1 local server and 1 global server (7 ranks), the
CNN on digits. Run 0 is the calibration: the same model and batch under FSA with the WAN free
(no emulation); its time per step (the mean over its last steps, from the metrics file) is the
planner's one measured input, ``c``, and nothing of the runs it predicts goes into it. Each
held-out setting is then run on its emulated link and predicted with ``geompi.plan.predict``
from ``c``, the model's parameter count and the link alone.

Measured: the time per step over whole cycles in the middle of a run (from cycle 1 to the
last-but-one, out of the metrics file's per-step ``wall_s``: no start-up, no INIT round, no
final global average), the WAN bytes per step over the same steps (all datacenters, both
directions, control included), and the utilisation as the planner defines it: the WAN-free
step time over the step time (``c / measured step``; so its error is the step time's). Also
reported, not judged: the run's own compute share (``compute_s / wall_s`` of its summary:
forward and backward only, without LAN rounds or the optimizer).

``--launcher``: the command that starts the job, ``{n}`` standing for the rank count.

``--kernel`` (root, ``ip netns``): the same settings on real links. The job runs across network
namespaces (tests/netns.py: each datacenter a host, the global server a third, MPI over TCP
only, ``--dc-map nodes``); each held-out setting's bandwidth is the kernel's (``tc tbf`` on
every datacenter's link, set before its run by tests/progs/netns_runs.py) and only its
latency stays in geompi's link model (there is no ``netem`` here). The calibration runs in the
same job on unshaped links, on the emulated link as above, so ``c`` is measured over the same
transport. The planner is not told which way a link was made. Writes
bench/results/plan_check_kernel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from geompi.comm.linkmodel import LinkModel, parse_duration, parse_rate  # noqa: E402
from geompi.plan import Setting, model_params, predict  # noqa: E402
from geompi.sync import FSA, HFA, Algorithm, MixedSync  # noqa: E402

DC_SIZES = (3, 3)
HOSTS = [("dc0", 3), ("dc1", 3), ("gs", 1)]  # --kernel: a network namespace each
# The calibration: a datacenter round every 4 steps, each one global, on an emulated link
# (so that the servers wait in the link's holds as in the runs predicted) that no held-out
# setting uses; what the link held them is measured by the local servers and taken out.
CALIBRATION = HFA(k1=4, k2=1)
CALIBRATION_LINK = ("20Mbit", "10ms")
GLOBAL_SERVERS = 1

# (algorithm, codec, bandwidth, latency): none of them is the calibration's setting
HELD_OUT: list[tuple[Algorithm, str, str, str]] = [
    (FSA(optimizer="servers"), "none", "2Mbit", "50ms"),
    (FSA(optimizer="servers"), "int8", "1Mbit", "20ms"),
    (MixedSync(), "none", "5Mbit", "30ms"),
    (MixedSync(), "bf16", "2Mbit", "40ms"),
    (HFA(k1=2, k2=2), "none", "1Mbit", "50ms"),
    (HFA(k1=1, k2=4), "fp16", "500kbit", "100ms"),
    (HFA(k1=4, k2=1), "topk:0.1", "500kbit", "40ms"),
    (HFA(k1=1, k2=2), "int4", "500kbit", "30ms"),
    (HFA(k1=2, k2=2, fragments=2), "none", "1Mbit", "50ms"),
    (HFA(k1=1, k2=4, fragments=4, overlap=True), "int8", "500kbit", "80ms"),
    # where compute is half the step or more, so the machine's CPU contention shows
    (HFA(k1=8, k2=2), "none", "20Mbit", "50ms"),
    (HFA(k1=4, k2=4, fragments=4, overlap=True), "none", "10Mbit", "50ms"),
]
QUICK = [0, 5, 9]  # --quick: one synchronous, one HFA, one streaming with overlap


def cli_args(
    algo: Algorithm, codec: str, bw: str | None, lat: str | None, kernel: bool = False
) -> list[str]:
    """The geompi.train flags of one setting (``kernel``: the bandwidth is the kernel's, only
    the latency is emulated)."""
    a = ["--sync", algo.name]
    if isinstance(algo, HFA):
        a += ["--k1", str(algo.k1), "--k2", str(algo.k2)]
        a += ["--hfa-fragments", str(algo.fragments)] + (["--hfa-overlap"] if algo.overlap else [])
    a += ["--wan-compression", codec]
    if kernel:
        a += ["--wan-latency", lat or "0ms"]
    elif bw:
        a += ["--wan-bandwidth", bw, "--wan-latency", lat or "0ms"]
    return a


def cycle_of(algo: Algorithm) -> int:
    return algo.wan_pattern(GLOBAL_SERVERS).steps


def steps_for(algo: Algorithm, codec: str, cycles: int, bw: str, lat: str, budget_s: float) -> int:
    """Whole cycles: ``cycles`` measured ones (fewer for a slow setting, at least 2) + 2."""
    wan = LinkModel(parse_rate(bw), parse_duration(lat))
    rough = predict(80_000, 0.05, Setting(algo, codec), DC_SIZES, GLOBAL_SERVERS, wan, round_s=0.05)
    cycle = cycle_of(algo)
    n = max(2, min(cycles, int(budget_s / (rough.step_s * cycle))))
    return cycle * (n + 2)


def calibrate(paths: list[pathlib.Path], warm: int = 8) -> tuple[float, float]:
    """From the calibration runs' metrics, their steps pooled: a step's compute ``c`` (the
    median time of the steps without a datacenter round) and what a round adds besides the
    link's hold ``r`` (the median time of the steps with one, less ``c`` and less the hold per
    round that the local servers measured). Medians: a burst of load on the machine moves a
    few steps, not the figure."""
    k1 = CALIBRATION.k1
    plain, rounds, held = [], [], []
    for path in paths:
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        wall = {r["step"]: r["wall_s"] for r in recs if r.get("kind") == "step"}
        summary = next(r for r in recs if r.get("kind") == "summary")
        last = max(wall) - k1  # not the final forced global round
        plain += [wall[s] - wall[s - 1] for s in range(warm + 1, last + 1) if s % k1]
        rounds += [wall[s] - wall[s - 1] for s in range(warm + 1, last + 1) if not s % k1]
        held.append(summary["time_split"]["wan_held_s"] / (max(wall) // k1))
    c = statistics.median(plain)
    return c, max(0.0, statistics.median(rounds) - c - statistics.mean(held))


def window(path: pathlib.Path, cycle: int, steps: int) -> dict:
    """Time and WAN bytes per step from the metrics file, cycle 1 to the last-but-one."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in recs if r.get("kind") == "step"}
    summary = next(r for r in recs if r.get("kind") == "summary")
    a, b = cycle, steps - cycle
    wall = (by_step[b]["wall_s"] - by_step[a]["wall_s"]) / (b - a)
    wan = (by_step[b]["wan_bytes"] - by_step[a]["wan_bytes"]) / (b - a)
    split = summary.get("time_split", {})
    return {
        "step_s": wall,
        "wan_bytes_per_step": wan,
        "compute_share": split.get("compute_s", 0.0) / max(summary["wall_s"], 1e-9),
        "window": [a, b],
    }


def launch(
    launcher: str,
    n: int,
    runs: list[list[str]],
    out: pathlib.Path,
    timeout: float,
    rates: list[float | None] | None = None,
):
    """All runs in one job of tests/progs/train_runs.py; a hard timeout kills the job.
    ``rates`` (bits/s, None: unshaped): across network namespaces instead, each run on its
    kernel-shaped links (tests/progs/netns_runs.py)."""
    spec = out / "runs.json"
    if rates is not None:
        spec.write_text(json.dumps([{"args": r, "rate": x} for r, x in zip(runs, rates)]))
        from tests import netns

        prog = str(ROOT / "tests/progs/netns_runs.py")
        with netns.Cluster(HOSTS) as cluster:
            try:
                rc = cluster.run([sys.executable, prog, str(out), str(spec)], timeout).returncode
            except TimeoutError:
                raise SystemExit(f"plan_check: the job ran past {timeout:.0f} s") from None
    else:
        spec.write_text(json.dumps([{"args": r, "env": {}} for r in runs]))
        cmd = shlex.split(launcher.format(n=n)) + [
            sys.executable,
            str(ROOT / "tests/progs/train_runs.py"),
            str(out),
            str(spec),
        ]
        from geompi.runtime import LOCAL_OPENMPI_ENV

        env = {**os.environ, **LOCAL_OPENMPI_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            why = f"plan_check: the job ran past {timeout:.0f} s and was killed"
            raise SystemExit(why) from None
    for i in range(len(runs)):
        rc_file, err_file = out / f"run{i}.rank0.rc", out / f"run{i}.rank0.err"
        if not rc_file.exists() or rc_file.read_text().strip() != "0":
            err = err_file.read_text()[-2000:] if err_file.exists() else ""
            raise SystemExit(f"plan_check: run {i} ({' '.join(runs[i])}) failed (job {rc}): {err}")


def check(
    settings: list[tuple[Algorithm, str, str, str]],
    *,
    launcher: str,
    batch: int,
    cycles: int,
    cal_steps: int,
    budget_s: float,
    out: pathlib.Path,
    timeout: float,
    kernel: bool = False,
) -> dict:
    """Calibrate, run ``settings``, and compare; returns the results (JSON-able). ``kernel``:
    across network namespaces, each setting's bandwidth shaped by the kernel."""
    n = sum(DC_SIZES) + GLOBAL_SERVERS
    common = ["--model", "cnn", "--batch-size", str(batch), "--eval-every", "0"]
    if kernel:  # one host per datacenter (and one for the global server): the hosts' layout
        common += ["--dc-map", "nodes"]
    else:
        dcs = ",".join(map(str, DC_SIZES))
        common += ["--dc-sizes", dcs, "--global-servers", str(GLOBAL_SERVERS)]
    runs, metas, rates = [], [], []
    cal = ["--steps", str(cal_steps), "--metrics", str(out / "cal.jsonl")]
    runs.append(common + cal + cli_args(CALIBRATION, "none", *CALIBRATION_LINK))
    rates.append(None)  # the calibration: the model's link on unshaped ones
    cal_end = ["--steps", str(cal_steps), "--metrics", str(out / "cal_end.jsonl")]
    for i, (algo, codec, bw, lat) in enumerate(settings):
        steps = steps_for(algo, codec, cycles, bw, lat, budget_s)
        metas.append((steps, out / f"m{i}.jsonl"))
        runs.append(
            common
            + ["--steps", str(steps), "--metrics", str(out / f"m{i}.jsonl")]
            + cli_args(algo, codec, bw, lat, kernel)
        )
        rates.append(8 * parse_rate(bw))  # bits/s, as tc takes them (parse_rate: bytes/s)
    runs.append(common + cal_end + cli_args(CALIBRATION, "none", *CALIBRATION_LINK))
    rates.append(None)
    t0 = time.time()
    cpu0 = os.times()
    launch(launcher, n, runs, out, timeout, rates if kernel else None)
    cpu1 = os.times()
    # the job's first run and its last, pooled: the load drifts
    c, r = calibrate([out / "cal.jsonl", out / "cal_end.jsonl"])
    (c0, r0), (c1, r1) = calibrate([out / "cal.jsonl"]), calibrate([out / "cal_end.jsonl"])
    params = model_params("cnn", (1, 8, 8), 10)
    rows = []
    for (algo, codec, bw, lat), (steps, metrics) in zip(settings, metas):
        wan = LinkModel(parse_rate(bw), parse_duration(lat))
        p = predict(params, c, Setting(algo, codec), DC_SIZES, GLOBAL_SERVERS, wan, round_s=r)
        m = window(metrics, cycle_of(algo), steps)
        measured_util = c / m["step_s"]
        # rank 0's step records count the datacenters that go through its rounds: under
        # MixedSync its own only (geompi.metrics)
        pred_bytes = p.wan_bytes_per_step * (1 if algo.independent_dcs else len(DC_SIZES))
        rows.append(
            {
                "method": p.method,
                "settings": Setting(algo, codec).describe(),
                "link": wan.describe(),
                "steps": steps,
                "predicted_step_s": p.step_s,
                "measured_step_s": m["step_s"],
                "step_error": p.step_s / m["step_s"] - 1,
                "predicted_utilisation": p.utilisation,
                "measured_utilisation": measured_util,
                "utilisation_error": p.utilisation / measured_util - 1,
                "predicted_wan_bytes_per_step": pred_bytes,
                "measured_wan_bytes_per_step": m["wan_bytes_per_step"],
                "bytes_error": pred_bytes / m["wan_bytes_per_step"] - 1,
                "run_compute_share": m["compute_share"],
                "window": m["window"],
            }
        )
    worst = max(max(abs(r["step_error"]), abs(r["utilisation_error"])) for r in rows)
    return {
        "topology": {"dc_sizes": list(DC_SIZES), "global_servers": GLOBAL_SERVERS, "ranks": n},
        "model": {"name": "cnn", "params": params, "batch_size": batch},
        "calibration": {
            "run": f"HFA K1=4 K2=1 on {' '.join(CALIBRATION_LINK)} less the link's measured hold; "
            "the job's first run and its last, their steps pooled",
            "first": [c0, r0],
            "last": [c1, r1],
            "steps": cal_steps,
            "compute_s": c,
            "round_s": r,
        },
        "launcher": launcher,
        "links": "kernel-shaped bandwidth (tc tbf between network namespaces, MPI over TCP), "
        "the latency in geompi's link model"
        if kernel
        else "geompi's link model (bandwidth and latency), one host",
        "rows": rows,
        "within_10pct": sum(
            abs(r["step_error"]) <= 0.1 and abs(r["utilisation_error"]) <= 0.1 for r in rows
        ),
        "settings": len(rows),
        "worst_error": worst,
        "wall_s": time.time() - t0,
        "job_cpu_s": (cpu1.children_user + cpu1.children_system)
        - (cpu0.children_user + cpu0.children_system),
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", default="mpirun -n {n} --oversubscribe", help="{n}: ranks")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--cycles", type=int, default=8, help="measured cycles per run (at most)")
    p.add_argument("--cal-steps", type=int, default=30)
    p.add_argument("--budget", type=float, default=12.0, help="rough seconds per run")
    p.add_argument("--keep", help="keep the runs' files in this directory")
    p.add_argument("--quick", action="store_true", help="3 settings only")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--kernel", action="store_true", help="kernel-shaped links (root, netns)")
    p.add_argument("--out", help="default: bench/results/plan_check[_kernel].json")
    args = p.parse_args(argv)
    name = "plan_check_kernel.json" if args.kernel else "plan_check.json"
    args.out = args.out or str(ROOT / "bench/results" / name)
    if args.kernel:
        from tests import netns

        why = netns.unavailable()
        if why:
            print(f"plan_check: skipped: {why}", file=sys.stderr)
            return 0
    mpirun = pathlib.Path(sys.executable).parent / "mpirun"
    launcher = args.launcher.replace("mpirun", str(mpirun), 1) if mpirun.exists() else args.launcher
    settings = [HELD_OUT[i] for i in QUICK] if args.quick else HELD_OUT
    with tempfile.TemporaryDirectory(prefix="plan_check.") as tmp:
        tmp = args.keep or tmp
        pathlib.Path(tmp).mkdir(parents=True, exist_ok=True)
        res = check(
            settings,
            launcher=launcher,
            batch=args.batch_size,
            cycles=args.cycles,
            cal_steps=args.cal_steps,
            budget_s=args.budget,
            out=pathlib.Path(tmp),
            timeout=args.timeout,
            kernel=args.kernel,
        )
    for r in res["rows"]:
        print(
            f"{r['method']:<14} {r['settings']:<26} {r['link']:<24} step "
            f"{r['predicted_step_s'] * 1e3:7.1f} / {r['measured_step_s'] * 1e3:7.1f} ms "
            f"({r['step_error']:+.1%})  util {r['predicted_utilisation']:.3f} / "
            f"{r['measured_utilisation']:.3f}  bytes {r['bytes_error']:+.1%}"
        )
    print(
        f"{res['within_10pct']}/{res['settings']} within 10%; calibration: compute "
        f"{res['calibration']['compute_s'] * 1e3:.1f} ms a step, a round "
        f"{res['calibration']['round_s'] * 1e3:.1f} ms; worst {res['worst_error']:.1%}"
    )
    given = argv if argv is not None else sys.argv[1:]
    command = shlex.join(["python", "bench/plan_check.py", *given])
    res = {"benchmark": "plan_check", "command": command, **res}
    pathlib.Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
