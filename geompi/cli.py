"""``geompi``: one command for the command-line tools, and ``--version``.

    geompi train ...     train a model under mpirun (python -m geompi.train)
    geompi ckpt ...      inspect, verify, compare, export and list checkpoints
    geompi plot ...      plot the metrics files of runs
    geompi slurm ...     the Slurm batch scripts and layouts
    geompi plan ...      predict each algorithm's speed on a link, recommend settings

The older ``geompi-train``, ``geompi-ckpt``, ``geompi-plot`` and ``geompi-slurm`` commands
stay as aliases. This module imports nothing heavy (no torch, no MPI) until a subcommand runs,
so ``geompi --help`` and ``geompi --version`` work in any install.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import geompi


def _train(argv: list[str]) -> int:
    return train_main(argv)


def _ckpt(argv: list[str]) -> int:
    from geompi.ckpt.cli import main

    return main(argv)


def _plot(argv: list[str]) -> int:
    from geompi.plot import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from geompi.plan import main

    return main(argv)


def _slurm(argv: list[str]) -> int:
    from geompi.slurm import main

    return main(argv)


# name: (what it does, the function that runs it)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "train": ("train a model under mpirun (python -m geompi.train)", _train),
    "ckpt": ("inspect, verify, compare, export and list checkpoints", _ckpt),
    "plot": ("plot the --metrics files of runs (needs geompi[plot])", _plot),
    "slurm": ("print the Slurm batch scripts and rank layouts", _slurm),
    "plan": ("predict each algorithm's speed on a link and recommend settings", _plan),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser, for ``--help``, ``--version`` and a missing or unknown command;
    a known command's arguments go to that command's own parser."""
    p = argparse.ArgumentParser(
        prog="geompi",
        description="Train one PyTorch model across several datacenters over MPI.",
        epilog="`geompi COMMAND --help` shows a command's options.",
    )
    p.add_argument("--version", action="version", version=f"geompi {geompi.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (what, _) in COMMANDS.items():
        sub.add_parser(name, help=what, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``geompi COMMAND ARGS...``: run COMMAND's own command line on ARGS; returns its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]][1](args[1:])
    build_parser().parse_args(args)  # --help and --version exit 0, anything else exits 2
    return 2  # pragma: no cover - parse_args exits without a known command


def _load_train() -> Callable[[list[str]], int]:
    from geompi.train import main  # loads mpi4py.MPI, and with it the MPI library

    return main


def train_main(argv: Sequence[str] | None = None) -> int:
    """``geompi train`` and ``geompi-train``: geompi.train's command line, which without an
    MPI library still answers ``--help`` and ends a run in one line saying what to install
    (see :func:`geompi.runtime.main_needing_mpi`)."""
    from geompi.runtime import main_needing_mpi

    return main_needing_mpi(_load_train, argv)


def console() -> NoReturn:
    """The ``geompi`` console script: :func:`main`, ended by
    :func:`geompi.runtime.end_process` (no interpreter teardown: 0.35 s of CPU per rank)."""
    from geompi.runtime import end_after

    end_after(main)


def train_console() -> NoReturn:
    """The ``geompi-train`` console script: :func:`train_main`, ended likewise."""
    from geompi.runtime import end_after

    end_after(train_main)
