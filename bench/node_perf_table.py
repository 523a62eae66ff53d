"""Issue 38's table from the results of bench/node_perf.sh: one table per device.

    python bench/node_perf_table.py DIR [--out DIR/summary.md] [--skipped "a;b"]

DIR holds throughput_{cpu,cuda}.json, sync_overhead_{cpu,cuda}.json and startup_{cpu,cuda}.json
(any may be missing: its rows say so). Every ratio is geompi against the floor, the best
collective of the same job (the faster of plain MPI and plain gloo), with the ratio against
MPI alone beside it; each figure is a median over the runs of its JSON. Beside the wall times,
CPU milliseconds per step or round summed over the ranks (which do not depend on the core
count). The goals are issue 38's acceptance.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
from typing import Any

BENCH = pathlib.Path(__file__).resolve().parent


def _make_table() -> Any:
    spec = importlib.util.spec_from_file_location("make_table", BENCH / "make_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_mt = _make_table()
meets, num, table = _mt.meets, _mt.num, _mt.table

# issue 38's acceptance: geompi / floor, judged on the medians
GOALS = {"fsa": ">= 0.90", "hfa": ">= 0.95", "1MB": "<= 2.0", "25MB": "<= 1.2"}
DEVICES = ("cpu", "cuda")


def load(folder: pathlib.Path) -> dict[str, dict[str, dict]]:
    """{device: {benchmark: data}} for every readable ``BENCHMARK_DEVICE.json`` in ``folder``."""
    found: dict[str, dict[str, dict]] = {}
    for device in DEVICES:
        for bench in ("throughput", "sync_overhead", "startup"):
            path = folder / f"{bench}_{device}.json"
            try:
                found.setdefault(device, {})[bench] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
    return {d: v for d, v in found.items() if v}


def machine_line(results: dict[str, dict]) -> str:
    m: dict = next((d["machine"] for d in results.values() if "machine" in d), {})
    if not m:
        return "Machine: not recorded."
    parts = [
        m.get("cpu_model"),
        f"{m.get('cores_available')} cores available of {m.get('cpu_count')} CPUs "
        f"({m.get('physical_cores')} physical)",
        f"{m.get('ranks')} ranks, {m.get('ranks_per_core')} ranks per core",
        f"GPU {m['gpu']}" if m.get("gpu") else None,
        f"torch {m.get('torch')}",
        (m.get("mpi") or "MPI ?").split(",")[0],
        f"Python {m.get('python')}",
        f"CUDA_VISIBLE_DEVICES={m.get('visible_devices_env')!r}",
    ]
    return "Machine: " + ", ".join(str(p) for p in parts if p) + "."


def throughput_rows(d: dict) -> tuple[list[list], list[list]]:
    sps, per_step = d["samples_per_s"], d.get("per_step", {})
    rows, cpu_rows = [], []
    for sync, torch_name, label in (
        ("fsa", "torch_ddp", "FSA CNN samples/s (torch: DDP)"),
        ("hfa", "torch_avg", "HFA CNN samples/s (torch: averager)"),
    ):
        g = sps[f"geompi_{sync}"]
        floor = d.get("floor", {}).get(sync, {})
        vs = d.get("vs_floor", {}).get(sync, {})
        rows.append(
            [
                label,
                num(g, 0),
                num(sps.get(f"mpi_{sync}"), 0),
                num(sps.get(f"gloo_{sync}"), 0),
                num(sps.get(torch_name), 0),
                floor.get("best", ""),
                num(vs.get("best")),
                num(vs.get("vs_mpi", g / sps[f"mpi_{sync}"])),
                GOALS[sync],
                meets(vs.get("best"), GOALS[sync]),
            ]
        )
        names = [f"geompi_{sync}", f"mpi_{sync}", f"gloo_{sync}", torch_name]
        cpu_rows.append(
            [f"{sync.upper()} step"]
            + [
                f"{num(per_step[n]['wall_ms'])} / {num(per_step[n]['cpu_ms'])}"
                if n in per_step
                else ""
                for n in names
            ]
        )
    return rows, cpu_rows


def round_rows(d: dict) -> tuple[list[list], list[list]]:
    med, ratio, cpu = d["median_s"], d["ratio"], d.get("cpu_s_per_round", {})
    rows, cpu_rows = [], []
    for size, r in ratio.items():
        floor = d.get("floor", {}).get(size, {})
        goal = GOALS.get(size, "")
        rows.append(
            [
                f"push+pull round, {size}",
                f"{num(1e3 * med['geompi'][size], 1)} ms",
                f"{num(1e3 * med['mpi_allreduce'][size], 1)} ms",
                f"{num(1e3 * med['gloo_allreduce'][size], 1)} ms",
                f"raw two-tier {num(1e3 * med['raw_two_tier'][size], 1)} ms",
                floor.get("best", ""),
                num(r.get("vs_floor")),
                num(r["vs_mpi_allreduce"]),
                goal,
                meets(r.get("vs_floor"), goal),
            ]
        )
        cpu_rows.append(
            [f"round, {size}"]
            + [
                f"{num(1e3 * med[k][size], 1)} / {num(1e3 * cpu[k][size], 1)}" if k in cpu else ""
                for k in ("geompi", "mpi_allreduce", "gloo_allreduce", "raw_two_tier")
            ]
        )
    return rows, cpu_rows


def startup_row(d: dict) -> list:
    goal = "<= 1.3"  # issue 16's, still the start-up's goal
    return [
        f"{d['ranks']}-rank one-step start",
        f"{num(d['geompi_one_step']['median_s'])} s",
        f"floor {num(d['floor']['median_s'])} s",
        "",
        "",
        "import + barrier",
        num(d["ratio_of_medians"]),
        "",
        goal,
        meets(d["ratio_of_medians"], goal),
    ]


def render(found: dict[str, dict[str, dict]], skipped: list[str] | None = None) -> str:
    lines = ["# Issue 38's table, by bench/node_perf.sh", ""]
    if not found:
        lines.append("No results: every run failed or was skipped.")
    for device, results in found.items():
        hidden = " (the GPU hidden from every rank)" if device == "cpu" else " (every side on it)"
        lines += [f"## --device {device}{hidden}", "", machine_line(results), ""]
        rows: list[list] = []
        cpu_rows: list[list] = []
        missing = []
        if "throughput" in results:
            r, c = throughput_rows(results["throughput"])
            rows += r
            cpu_rows += c
        else:
            missing.append("throughput")
        if "sync_overhead" in results:
            r, c = round_rows(results["sync_overhead"])
            rows += r
            cpu_rows += c
        else:
            missing.append("sync_overhead")
        if "startup" in results:
            rows.append(startup_row(results["startup"]))
        else:
            missing.append("startup")
        lines += table(
            ["measure", "geompi", "plain MPI", "plain gloo", "torch", "floor",
             "geompi / floor", "geompi / MPI", "goal", "met"],
            rows,
        )  # fmt: skip
        if cpu_rows:
            lines += [
                "",
                "Wall ms / CPU ms per step or round, the CPU summed over the ranks "
                "(geompi's steps less its start-up):",
                "",
                *table(["measure", "geompi", "plain MPI", "plain gloo", "torch or raw"], cpu_rows),
            ]
        tp = results.get("throughput")
        if tp:
            same = tp.get("same_training", {})
            lines += [
                "",
                f"Throughput: {tp.get('ranks')} ranks ({tp.get('workers')} workers), "
                f"{tp.get('steps')} steps, median of {tp.get('reps')} runs; same training after "
                f"{same.get('after_steps')} steps: FSA/DDP "
                f"{num(same.get('fsa_vs_ddp_max_abs_diff'))}, HFA/averager "
                f"{num(same.get('hfa_vs_averager_max_abs_diff'))}.",
            ]
        so = results.get("sync_overhead")
        if so:
            lines += [
                "",
                f"Rounds: median of {so.get('reps')} per run, median over {so.get('runs')} runs.",
            ]
        if missing:
            lines += ["", "Not measured: " + ", ".join(missing) + "."]
        lines.append("")
    if skipped:
        lines += ["Skipped or failed runs: " + "; ".join(skipped) + ".", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--out", default=None, help="default: FOLDER/summary.md")
    ap.add_argument("--skipped", default="", help="runs skipped or failed, ';'-separated")
    a = ap.parse_args(argv)
    folder = pathlib.Path(a.folder)
    skipped = [s.strip() for s in a.skipped.split(";") if s.strip()]
    text = render(load(folder), skipped)
    out = pathlib.Path(a.out) if a.out else folder / "summary.md"
    out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
