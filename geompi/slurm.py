"""``python -m geompi.slurm``: the Slurm batch scripts shipped with geompi, and a layout helper.

    python -m geompi.slurm list                      the scripts and what they run
    python -m geompi.slurm write hfa > job.sbatch    a script that works from any directory
    python -m geompi.slurm common-path               where the installed common.sh is
    python -m geompi.slurm layout --nodes 2 --tasks-per-node 9 --gpus-per-node 8

The scripts live in the package (``geompi/slurm_jobs/``; a checkout's ``jobs/slurm/`` links to
them). A written script carries the path of the python that wrote it as its default
``GEOMPI_PYTHON``, and finds ``common.sh`` through that python, not through the submit directory.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from geompi.errors import ConfigError, GeompiError

PREFIX = "geompi: error: "
SCRIPTS = ("fsa", "hfa", "mixedsync")


def jobs_dir() -> Path:
    """The directory of the installed scripts and common.sh."""
    path = Path(str(resources.files("geompi") / "slurm_jobs"))
    if not (path / "common.sh").is_file():
        raise ConfigError(f"{path}/common.sh is missing: reinstall geompi (its package data)")
    return path


def script_text(name: str, python: str | None = None) -> str:
    """The batch script ``name``; with ``python``, that interpreter is its default GEOMPI_PYTHON."""
    if name not in SCRIPTS:
        raise ConfigError(f"unknown script {name!r}: choose one of {', '.join(SCRIPTS)}")
    text = (jobs_dir() / f"{name}.sbatch").read_text()
    if python:
        marker = "set -uo pipefail\n"
        line = (
            "# Written by `python -m geompi.slurm write`: the python with geompi installed.\n"
            f"export GEOMPI_PYTHON=${{GEOMPI_PYTHON:-{shlex.quote(python)}}}\n"
        )
        text = text.replace(marker, marker + line, 1)
    return text


def describe(name: str) -> str:
    """The first comment line of a script, without the ``# geompi:`` prefix."""
    first = (jobs_dir() / f"{name}.sbatch").read_text().splitlines()[1]
    return first.removeprefix("# geompi: ").strip()


def _counts(text: str, nodes: int) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"--tasks-per-node {text!r}: give a whole number, or one per node (e.g. 9,10)"
        ) from None
    if len(counts) == 1:
        counts *= nodes
    if len(counts) != nodes or min(counts) < 1:
        raise ConfigError(
            f"--tasks-per-node {text!r}: give one count >= 1, or {nodes} (one per node)"
        )
    return counts


def layout(nodes: int, tasks_per_node: str, gpus_per_node: int, global_servers: int) -> str:
    """The table and warnings that ``layout`` prints."""
    from geompi.layout import advice, gpu_warnings, layout_table, plan_nodes

    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: need at least 1 node")
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {gpus_per_node}: must be >= 0")
    counts = _counts(tasks_per_node, nodes)
    topo, rows = plan_nodes(counts, global_servers, [gpus_per_node] * nodes)
    lines = [layout_table(topo, rows)]
    found = gpu_warnings(rows)
    for w in found:
        lines.append(f"warning: {w}")
    if found:
        lines.append("  " + advice(gpus_per_node, nodes, global_servers))
    total = sum(counts)
    lines.append(
        f"sbatch: --nodes={nodes} "
        + (
            f"--ntasks-per-node={counts[0]}"
            if len(set(counts)) == 1
            else f"--ntasks={total} (uneven: see docs/slurm.md, 'Placing the servers')"
        )
        + (f" --gpus-per-node={gpus_per_node}" if gpus_per_node else "")
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m geompi.slurm", description="geompi's Slurm batch scripts and layouts."
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the shipped scripts and what each runs")
    w = sub.add_parser("write", help="print a batch script (redirect it to a file)")
    w.add_argument("name", help=f"one of {', '.join(SCRIPTS)}")
    w.add_argument(
        "--python",
        default=sys.executable,
        help="default GEOMPI_PYTHON of the script (default: this python, %(default)s)",
    )
    sub.add_parser("common-path", help="print the path of the installed common.sh")
    lay = sub.add_parser("layout", help="print the rank layout --dc-map nodes builds")
    lay.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    lay.add_argument(
        "--tasks-per-node",
        "--ntasks-per-node",
        required=True,
        help="tasks per node, or one count per node: 9,10",
    )
    lay.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
    lay.add_argument("--global-servers", type=int, default=1, help="global servers (default 1)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; errors are one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "list":
            for name in SCRIPTS:
                print(f"{name:<10} {describe(name)}")
        elif args.command == "write":
            sys.stdout.write(script_text(args.name, args.python))
        elif args.command == "common-path":
            print(jobs_dir() / "common.sh")
        else:
            print(layout(args.nodes, args.tasks_per_node, args.gpus_per_node, args.global_servers))
    except GeompiError as e:
        sys.stderr.write(PREFIX + str(e) + "\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
