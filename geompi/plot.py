"""``python -m geompi.plot METRICS.jsonl [...] -o run.png``: compare runs from their metrics files.

Four panels: training loss (a trailing mean) and test accuracy, each against wall time and
against WAN bytes, every run on the same axes. A log of schema ``geompi.metrics/1``
(docs/metrics.md) has the cumulative WAN bytes in every step record, measured; an older log
has them only in the final summary, and the WAN axis then spreads the run's total over its
steps (``wan_bytes * step / steps``): exact at every global sync for FSA and HFA, whose syncs
all send the same bytes, an approximation for MixedSync's asynchronous deposits. A file that
holds several runs (a requeued job appends) is read from its last start. Needs matplotlib
(``pip install 'geompi[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from geompi.errors import ConfigError, DataError, GeompiError

PREFIX = "geompi: error: "


@dataclass
class Run:
    """What one metrics file says about one run."""

    label: str
    loss: list[tuple[int, float, float]] = field(default_factory=list)  # step, wall_s, loss
    acc: list[tuple[int, float, float]] = field(default_factory=list)  # step, wall_s, test_acc
    steps: int = 0
    wan_bytes: int | None = None
    wan: dict[int, int] = field(default_factory=dict)  # step -> measured cumulative WAN bytes

    def wan_at(self, step: int) -> float:
        """Cumulative WAN bytes at ``step`` (the summary's total spread over the steps)."""
        return (self.wan_bytes or 0) * step / max(1, self.steps)

    def wan_axis(self, step: int) -> float:
        """The WAN axis at ``step``: measured (the last step record at or before it) where
        the log has them, else :meth:`wan_at`."""
        if not self.wan:
            return self.wan_at(step)
        known = [s for s in self.wan if s <= step]
        return float(self.wan[max(known)]) if known else 0.0

    @property
    def has_wan(self) -> bool:
        return bool(self.wan) or self.wan_bytes is not None


def read_run(path: str | Path, label: str | None = None) -> Run:
    """Parse a metrics file (its last run); DataError on a missing or malformed file."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DataError(f"cannot read metrics file {path}: {e.strerror or e}") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise DataError(f"{path}:{n} is not JSON: pass a --metrics file of geompi") from None
    starts = [i for i, r in enumerate(records) if "start" in (r.get("event"), r.get("kind"))]
    if starts:
        records = records[starts[-1] :]
    sync = next((r["config"].get("sync") for r in records if "config" in r), None)
    run = Run(label or (f"{path.stem} ({sync})" if sync else path.stem))
    for r in records:
        kind = r.get("kind")  # schema 1; older logs: "summary", "event" and the fields
        if kind == "step" and isinstance(r.get("wan_bytes"), int):
            run.wan[int(r["step"])] = r["wan_bytes"]
        if r.get("summary") or kind == "summary":
            run.steps = int(r.get("steps", 0))
            run.wan_bytes = r.get("wan_bytes")
            if "test_acc" in r and "wall_s" in r:
                run.acc.append((run.steps, float(r["wall_s"]), float(r["test_acc"])))
        elif "step" in r and "wall_s" in r:
            if "loss" in r:
                run.loss.append((int(r["step"]), float(r["wall_s"]), float(r["loss"])))
            if "test_acc" in r:
                run.acc.append((int(r["step"]), float(r["wall_s"]), float(r["test_acc"])))
    if not run.loss and not run.acc:
        raise DataError(f"{path} has no step or test records: is it a geompi --metrics file?")
    if not run.steps:
        run.steps = max((s for s, _, _ in run.loss), default=0)
    return run


def smooth(xs: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (a minibatch loss is noisy)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(runs: Sequence[Run], out: str | Path, window: int = 20, title: str | None = None) -> Path:
    """Draw the four panels of ``runs`` into ``out`` (any format matplotlib knows)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "python -m geompi.plot needs matplotlib: pip install 'geompi[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (loss_t, acc_t), (loss_b, acc_b) = axes
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        if run.loss:
            steps, wall, loss = zip(*run.loss)
            loss = smooth(loss, window)
            loss_t.plot(wall, loss, color=color, label=run.label)
            if run.has_wan:
                loss_b.plot([run.wan_axis(s) for s in steps], loss, color=color, label=run.label)
        if run.acc:
            steps, wall, acc = zip(*sorted(run.acc))
            acc_t.plot(wall, acc, "o-", color=color, label=run.label)
            if run.has_wan:
                wan = [run.wan_axis(s) for s in steps]
                acc_b.plot(wan, acc, "o-", color=color, label=run.label)
    for ax, ylabel in ((loss_t, "training loss"), (loss_b, "training loss")):
        ax.set_ylabel(f"{ylabel} (mean of {window} steps)")
    for ax in (acc_t, acc_b):
        ax.set_ylabel("test accuracy")
    for ax in (loss_t, acc_t):
        ax.set_xlabel("wall time (s)")
    for ax in (loss_b, acc_b):
        ax.set_xlabel("WAN bytes (measured; older logs: the run's total spread over its steps)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; errors are one line on stderr and exit status 2."""
    p = argparse.ArgumentParser(
        prog="python -m geompi.plot",
        description="Loss and test accuracy of geompi runs against wall time and WAN bytes.",
    )
    p.add_argument("metrics", nargs="+", help="--metrics files of geompi.train, one per run")
    p.add_argument("-o", "--output", default="run.png", help="image to write (default run.png)")
    p.add_argument("--label", action="append", help="a run's legend label (once per file)")
    p.add_argument("--smooth", type=int, default=20, help="loss: mean over N steps (default 20)")
    p.add_argument("--title", help="figure title (default none)")
    args = p.parse_args(argv)
    try:
        labels = args.label or []
        if labels and len(labels) != len(args.metrics):
            raise ConfigError(f"{len(labels)} --label for {len(args.metrics)} files: one each")
        if args.smooth < 1:
            raise ConfigError(f"--smooth {args.smooth}: must be at least 1")
        runs = [read_run(m, labels[i] if labels else None) for i, m in enumerate(args.metrics)]
        out = plot(runs, args.output, args.smooth, args.title)
    except GeompiError as e:
        sys.stderr.write(PREFIX + str(e) + "\n")
        return 2
    print(f"geompi: wrote {out} ({len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
