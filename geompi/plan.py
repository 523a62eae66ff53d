"""``geompi plan``: which settings a link needs, before any run.

Given a model's size, the time a training step takes with the WAN out of the way, the
datacenters and the link, the planner predicts for each algorithm (FSA, MixedSync, HFA,
streaming HFA) and each WAN codec the time per step, the compute utilisation, the WAN bytes
per step and the peak bytes of a round, and recommends the cheapest settings that reach a
target utilisation.

The arithmetic is the emulation's (geompi.comm.linkmodel): a transfer of B bytes arrives
``latency + B / bandwidth`` after it could start. Each algorithm says what it sends
(``Algorithm.wan_pattern``): the rounds of a cycle, the share of the model each carries, the
one-way latencies a round waits for and the steps of compute an exchange runs behind. The
codec's payload sizes come from geompi.comm.compression itself. A cycle of S steps then takes

    S * c + sum over its rounds of max(0, trips * latency + (up + down) / bandwidth - hidden * c)

plus, with a LAN bandwidth, each datacenter round's transfers through the local server's port
(every worker's push in, its result out: ``2 * workers * 4 * params / lan_bandwidth``).
``c`` is the step's time with the WAN free (forward, backward, optimizer; measured here on one
process, or given); utilisation is ``S * c`` over the cycle's time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from geompi.comm.compression import make_compressor
from geompi.comm.linkmodel import LinkModel, parse_duration, parse_rate
from geompi.errors import PREFIX, ConfigError, GeompiError
from geompi.sync import FSA, HFA, Algorithm, MixedSync
from geompi.sync.base import WanPattern

#: The WAN codecs the planner tries, least lossy first (the recommendation's order).
CODECS = ("none", "fp16", "bf16", "int8", "int4", "topk:0.1", "topk:0.01", "topk:0.01+int8")
#: The method order at equal cost: synchronous before asynchronous, whole before streamed.
METHODS = ("FSA", "MixedSync", "HFA", "streaming HFA")
K1S = (1, 2, 4, 8, 16, 32, 64)
K2S = (1, 2, 4, 8, 16)
FRAGMENTS = (2, 4, 8)


@dataclass(frozen=True)
class Setting:
    """One algorithm's settings and a WAN codec."""

    algorithm: Algorithm
    codec: str = "none"

    def describe(self) -> str:
        a = self.algorithm
        parts = []
        for name, shown in (("k1", "K1"), ("k2", "K2"), ("fragments", "F")):
            value = getattr(a, name, None)
            if value is not None and (name != "fragments" or value > 1):
                parts.append(f"{shown}={value}")
        if getattr(a, "overlap", False):
            parts.append("overlap")
        parts.append(self.codec)
        return " ".join(parts)


@dataclass(frozen=True)
class Prediction:
    """What the planner expects of one setting on one link."""

    setting: Setting
    method: str
    step_s: float  # wall time per training step
    utilisation: float  # the share of wall time the workers compute
    wan_bytes_per_step: float  # one datacenter's WAN link, both directions
    peak_round_bytes: int  # the most one local server sends up in one round
    wan_s_per_step: float  # the part of step_s spent waiting on the WAN
    cost: tuple = field(compare=False, default=())

    def row(self) -> dict:
        return {
            "method": self.method,
            "settings": self.setting.describe(),
            "step_s": self.step_s,
            "utilisation": self.utilisation,
            "wan_bytes_per_step": self.wan_bytes_per_step,
            "peak_round_bytes": self.peak_round_bytes,
        }


def shard_payload(values: int, codec: str, global_servers: int) -> int:
    """The bytes one datacenter sends one way for ``values`` values of one key, sliced over
    the global servers as geompi.comm.topology slices them and encoded by ``codec``."""
    comp = make_compressor(codec)
    g = global_servers
    return sum(
        comp.payload_nbytes((s + 1) * values // g - s * values // g)
        for s in range(g)
        if (s + 1) * values // g > s * values // g
    )


def predict(
    params: int,
    compute_s: float,
    setting: Setting,
    dc_sizes: Sequence[int],
    global_servers: int = 1,
    wan: LinkModel | None = None,
    lan: LinkModel | None = None,
    round_s: float = 0.0,
) -> Prediction:
    """Predict one setting: ``params`` values in the model, ``compute_s`` seconds a step's
    compute takes, ``dc_sizes`` ranks per datacenter (each counting its local server),
    ``round_s`` what a datacenter round adds to its step with the WAN free (the LAN and the
    servers' own work: measured, or 0)."""
    _check(params, compute_s, dc_sizes, global_servers)
    wan = wan or LinkModel()
    pat: WanPattern = setting.algorithm.wan_pattern(global_servers)
    cycle = pat.steps * compute_s + pat.lan_rounds * round_s
    moved, peak = 0, 0
    for share in pat.shares:
        up = shard_payload(round(share * params), setting.codec, global_servers)
        down = up
        exchange = pat.trips * wan.latency + ((up + down) / wan.bandwidth if wan.bandwidth else 0)
        cycle += max(
            0.0, exchange - pat.hidden_steps * compute_s - (pat.hidden_steps > 0) * round_s
        )
        moved += up + down
        peak = max(peak, up)
    if lan is not None and lan.bandwidth:
        workers = max(dc_sizes) - 1  # the slowest datacenter sets the pace
        cycle += pat.lan_rounds * (2 * workers * 4 * params / lan.bandwidth + 2 * lan.latency)
    compute = pat.steps * compute_s
    rank = CODECS.index(setting.codec) if setting.codec in CODECS else len(CODECS)
    method_rank = METHODS.index(pat.method) if pat.method in METHODS else len(METHODS)
    return Prediction(
        setting=setting,
        method=pat.method,
        step_s=cycle / pat.steps,
        utilisation=compute / cycle if cycle > 0 else 1.0,
        wan_bytes_per_step=moved / pat.steps,
        peak_round_bytes=peak,
        wan_s_per_step=(cycle - compute) / pat.steps,
        cost=(pat.sync_every, rank, method_rank, len(pat.shares), pat.hidden_steps, moved),
    )


def candidates(codecs: Sequence[str] = CODECS) -> list[Setting]:
    """Every setting the recommendation considers."""
    algos: list[Algorithm] = [FSA(optimizer="servers"), MixedSync()]
    algos += [HFA(k1=k1, k2=k2) for k1 in K1S for k2 in K2S]
    algos += [
        HFA(k1=k1, k2=k2, fragments=f, overlap=o)
        for k1 in K1S
        for k2 in K2S
        for f in FRAGMENTS
        for o in (False, True)
        if k2 >= 2 and f <= k2
    ]
    algos += [HFA(k1=k1, k2=k2, overlap=True) for k1 in K1S for k2 in K2S if k2 >= 2]
    return [Setting(a, c) for a in algos for c in codecs]


def recommend(
    params: int,
    compute_s: float,
    dc_sizes: Sequence[int],
    global_servers: int = 1,
    wan: LinkModel | None = None,
    lan: LinkModel | None = None,
    target: float = 0.9,
    codecs: Sequence[str] = CODECS,
) -> dict[str, tuple[Prediction, bool]]:
    """Per method, the cheapest setting predicted to reach ``target`` utilisation (True), or,
    where none does, the one of highest utilisation (False). Cheapest: fewest steps between
    global syncs of a value (K1*K2; 1 for FSA and MixedSync), then the least lossy codec
    (``CODECS``' order), synchronous before asynchronous, fewer streamed rounds, no overlap,
    fewer WAN bytes."""
    if not 0 < target <= 1:
        raise ConfigError(f"--target {target}: give a utilisation in (0, 1], e.g. 0.9")
    best: dict[str, tuple[Prediction, bool]] = {}
    for s in candidates(codecs):
        p = predict(params, compute_s, s, dc_sizes, global_servers, wan, lan)
        ok = p.utilisation >= target
        have = best.get(p.method)
        if have is None:
            best[p.method] = (p, ok)
        elif ok and (not have[1] or p.cost < have[0].cost):
            best[p.method] = (p, True)
        elif not ok and not have[1] and p.utilisation > have[0].utilisation:
            best[p.method] = (p, False)
    return {m: best[m] for m in METHODS if m in best}


def _check(params: int, compute_s: float, dc_sizes: Sequence[int], global_servers: int) -> None:
    if not (isinstance(params, int) and params > 0):
        raise ConfigError(f"model size {params!r}: give a number of parameters > 0")
    if not (compute_s >= 0 and math.isfinite(compute_s)):
        raise ConfigError(f"--step-time {compute_s!r}: give a time >= 0, e.g. 30ms")
    if not dc_sizes or any(n < 2 for n in dc_sizes):
        raise ConfigError(
            f"--dc-sizes {','.join(map(str, dc_sizes))}: each datacenter needs a worker and "
            "its local server (>= 2 ranks)"
        )
    if global_servers < 1:
        raise ConfigError(f"--global-servers {global_servers}: must be >= 1")


# ---- the model: its size, and a step's time on one process ----------------------------------
def model_params(model: str, input_shape: tuple[int, int, int], classes: int) -> int:
    """The trainable values of ``model``: a number, a checkpoint file, a built-in model or a
    ``module:factory`` spec (built as ``geompi train --model`` builds it)."""
    text = model.strip()
    if text.isdigit():
        return int(text)
    if text.endswith((".h5", ".hdf5")) and not Path(text).is_file():
        raise ConfigError(f"--model {text}: no such checkpoint file")
    if Path(text).is_file():
        from geompi.ckpt.reader import load_state_dict

        tensors = load_state_dict(text)
        return sum(t.numel() for t in tensors.values() if t.is_floating_point())
    return sum(
        p.numel() for p in _build(text, input_shape, classes).parameters() if p.requires_grad
    )


def _build(model: str, input_shape: tuple[int, int, int], classes: int):
    from geompi.models import build_model

    return build_model(model, input_shape, classes)


def measure_step(
    model: str, input_shape: tuple[int, int, int], classes: int, batch: int, steps: int = 20
) -> float:
    """The median time of a forward, backward and SGD step of ``model`` on one random batch of
    ``batch`` samples, on this process (after 3 warm-up steps)."""
    import torch

    net = _build(model, input_shape, classes)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(batch, *input_shape)
    y = torch.randint(0, classes, (batch,))
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- the command line ------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one ConfigError line."""

    def error(self, message: str):
        raise ConfigError(f"geompi plan: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="geompi plan",
        description="Predict time per step, utilisation and WAN bytes of each algorithm and "
        "codec on a link, and recommend the cheapest settings that reach a target utilisation.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a number of parameters, a checkpoint file, cnn/mlp/linear or MODULE:FACTORY",
    )
    p.add_argument("--input-shape", default="1,8,8", help="C,H,W of a sample (default 1,8,8)")
    p.add_argument("--classes", type=int, default=10, help="classes (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="for --step-time measure")
    p.add_argument(
        "--step-time",
        default="measure",
        help="a step's time with the WAN free (e.g. 30ms), or 'measure' (one process)",
    )
    p.add_argument("--dc-sizes", default="3,3", help="ranks per datacenter (default 3,3)")
    p.add_argument("--global-servers", type=int, default=1)
    p.add_argument("--wan-bandwidth", required=True, help="e.g. 100Mbit")
    p.add_argument("--wan-latency", default="0ms", help="one way, e.g. 25ms")
    p.add_argument("--lan-bandwidth", help="each local server's LAN port (default unlimited)")
    p.add_argument("--target", type=float, default=0.9, help="utilisation to reach (0.9)")
    p.add_argument("--k1", type=int, default=4, help="the table's HFA rows (default 4)")
    p.add_argument("--k2", type=int, default=2, help="the table's HFA rows (default 2)")
    p.add_argument("--hfa-fragments", type=int, default=4, help="streaming rows (default 4)")
    p.add_argument("--hfa-overlap", action="store_true", help="streaming rows overlap")
    p.add_argument("--wan-compression", help="the table's codec (default: every codec)")
    p.add_argument("--plot", help="draw utilisation against bandwidth per method to FILE")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _table_settings(args) -> list[Setting]:
    codecs = [make_compressor(args.wan_compression).name] if args.wan_compression else CODECS
    k2s = max(args.k2, 2)
    algos: list[Algorithm] = [
        FSA(optimizer="servers"),
        MixedSync(),
        HFA(k1=args.k1, k2=args.k2),
        HFA(k1=args.k1, k2=k2s, fragments=args.hfa_fragments, overlap=args.hfa_overlap),
    ]
    for a in algos:
        a.validate()
    return [Setting(a, c) for a in algos for c in codecs]


def run(args: argparse.Namespace) -> dict:
    """Predict the table's settings and the recommendations of parsed ``geompi plan``
    arguments; returns them (JSON-able)."""
    shape = _shape(args.input_shape)
    wan = LinkModel(parse_rate(args.wan_bandwidth), parse_duration(args.wan_latency))
    lan = (
        LinkModel(parse_rate(args.lan_bandwidth, "--lan-bandwidth")) if args.lan_bandwidth else None
    )
    from geompi.config import parse_sizes

    sizes = parse_sizes(args.dc_sizes)
    params = model_params(args.model, shape, args.classes)
    if args.step_time == "measure":
        if args.model.strip().isdigit() or Path(args.model.strip()).is_file():
            raise ConfigError(
                f"--model {args.model}: a number or a checkpoint cannot be run to measure a "
                "step: give --step-time (e.g. 30ms)"
            )
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size {args.batch_size}: must be >= 1")
        compute = measure_step(args.model, shape, args.classes, args.batch_size)
    else:
        compute = parse_duration(args.step_time, "--step-time")
    settings = _table_settings(args)
    table = [predict(params, compute, s, sizes, args.global_servers, wan, lan) for s in settings]
    recs = recommend(params, compute, sizes, args.global_servers, wan, lan, args.target)
    out = {
        "params": params,
        "step_time_s": compute,
        "link": wan.describe(),
        "target": args.target,
        "table": [p.row() for p in table],
        "recommended": {m: {**p.row(), "reaches": ok} for m, (p, ok) in recs.items()},
    }
    if args.plot:
        plot_bandwidth(params, compute, settings, sizes, args.global_servers, wan, lan, args.plot)
        out["plot"] = args.plot
    return out


def _shape(text: str) -> tuple[int, int, int]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ConfigError(f"--input-shape {text!r}: give C,H,W as three whole numbers, e.g. 1,8,8")
    return dims


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def render(out: dict) -> str:
    """The tables ``geompi plan`` prints."""
    lines = [
        f"model: {out['params']:,} parameters; a step with the WAN free: "
        f"{out['step_time_s'] * 1e3:.3g} ms; link: {out['link']}",
        f"{'method':<14} {'settings':<28} {'step':>10} {'util':>6} {'WAN/step':>10} {'peak':>10}",
    ]

    def row(r: dict, mark: str = "") -> str:
        return (
            f"{r['method']:<14} {r['settings']:<28} {r['step_s'] * 1e3:>8.4g}ms "
            f"{r['utilisation']:>6.3f} {_fmt_bytes(r['wan_bytes_per_step']):>10} "
            f"{_fmt_bytes(r['peak_round_bytes']):>10}{mark}"
        )

    lines += [row(r) for r in out["table"]]
    lines.append(f"cheapest settings reaching utilisation {out['target']:g}:")
    for r in out["recommended"].values():
        lines.append(row(r, "" if r["reaches"] else "  (none reaches it: the best)"))
    return "\n".join(lines)


def plot_bandwidth(
    params: int,
    compute_s: float,
    settings: Sequence[Setting],
    dc_sizes: Sequence[int],
    global_servers: int,
    wan: LinkModel,
    lan: LinkModel | None,
    path: str,
) -> Path:
    """Utilisation against WAN bandwidth (1 Mbit/s to 100 Gbit/s, this latency) for each of
    ``settings`` (uncompressed ones, or the first codec given)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "geompi plan --plot needs matplotlib: pip install 'geompi[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codec = settings[0].codec
    rates = [1e6 / 8 * 10 ** (i / 8) for i in range(41)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in settings:
        if s.codec != codec:
            continue
        utils = [
            predict(params, compute_s, s, dc_sizes, global_servers, LinkModel(r, wan.latency), lan)
            for r in rates
        ]
        label = f"{utils[0].method} ({s.describe()})"
        ax.plot([r * 8 / 1e6 for r in rates], [u.utilisation for u in utils], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("WAN bandwidth (Mbit/s)")
    ax.set_ylabel("predicted compute utilisation")
    ax.set_ylim(0, 1.02)
    ax.set_title(
        f"{params:,} parameters, {compute_s * 1e3:.3g} ms a step, {wan.latency * 1e3:g} ms"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def main(argv: Sequence[str] | None = None) -> int:
    """``geompi plan``; an error is one line on stderr and exit status 2."""
    try:
        args = _parser().parse_args(argv)
        out = run(args)
    except GeompiError as e:
        sys.stderr.write(PREFIX + str(e) + "\n")
        return 2
    print(json.dumps(out, indent=1) if args.json else render(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
