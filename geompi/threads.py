"""torch's intra-op threads from the CPUs each rank really has on its node.

torch starts one thread per CPU it can run on. Under ``mpirun`` without binding, or ``srun`` with
``task/none``, every rank of a node sees every CPU of the node, so 16 ranks on a 2-core node run
32 threads that thrash: a 16-rank HFA job trained in 1.5 s under mpirun with one thread per rank
and in 44.8 s under srun with two. Like torchrun (which sets ``OMP_NUM_THREADS``), geompi gives
each rank its share of the CPUs it can run on: the CPUs of its affinity mask divided by the
number of ranks of the node that share them, at most ``SLURM_CPUS_PER_TASK``, at least 1.
``GEOMPI_THREADS`` or ``OMP_NUM_THREADS``, when set, win (in that order).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from geompi.errors import ConfigError

OVERRIDES = ("GEOMPI_THREADS", "OMP_NUM_THREADS")
# torch starts every thread it is told to: a typo such as GEOMPI_THREADS=99999999 crashed the
# rank (SIGSEGV) when the threads could not be made. More per rank than this is never meant.
MAX_THREADS = 1024


def affinity() -> frozenset[int]:
    """The CPUs this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return frozenset(range(os.cpu_count() or 1))


def override(env: Mapping[str, str]) -> tuple[int, str] | None:
    """``(threads, variable)`` when the user set GEOMPI_THREADS or OMP_NUM_THREADS, else None."""
    for var in OVERRIDES:
        value = env.get(var, "").strip()
        if not value:
            continue
        # OMP_NUM_THREADS may be a list ("4,2" for nested levels): its first entry counts.
        head = value.split(",")[0].strip()
        if not head.isdigit() or int(head) < 1:
            raise ConfigError(f"{var}={value!r}: must be a whole number >= 1")
        if int(head) > MAX_THREADS:
            raise ConfigError(
                f"{var}={value!r}: at most {MAX_THREADS} threads per rank (this node has "
                f"{os.cpu_count() or 1} CPUs)"
            )
        return int(head), var
    return None


def share(mine: frozenset[int], local: Sequence[frozenset[int]]) -> int:
    """This rank's share of its CPUs: ``len(mine)`` over the most ranks of the node that can run
    on any one of them (1 each when ranks are bound to their own cores)."""
    if not mine:
        return 1
    sharers = max(sum(1 for other in local if cpu in other) for cpu in mine)
    return max(1, len(mine) // max(1, sharers))


def choose(
    mine: frozenset[int],
    local: Sequence[frozenset[int]],
    env: Mapping[str, str],
) -> tuple[int, str]:
    """``(threads, why)`` for a rank with CPUs ``mine`` among the node's ranks ``local``."""
    given = override(env)
    if given is not None:
        return given[0], f"from {given[1]}"
    threads = share(mine, local)
    why = f"{len(mine)} CPU(s) shared by {len(local)} rank(s) on this node"
    cpt = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpt.isdigit() and 0 < int(cpt) < threads:
        threads = int(cpt)
        why += f", at most SLURM_CPUS_PER_TASK={cpt}"
    return threads, why


def configure_threads(comm=None, env: Mapping[str, str] | None = None, quiet: bool = False) -> int:
    """Set torch's intra-op threads for this rank and return the number.

    Collective over ``comm`` (default COMM_WORLD): the ranks of each node (MPI's shared-memory
    split) compare affinity masks. Rank 0 prints one line, e.g. ``geompi: torch threads per
    rank: 1 (2 CPU(s) shared by 16 rank(s) on this node; set GEOMPI_THREADS to change)``. A bad
    GEOMPI_THREADS/OMP_NUM_THREADS is one error line and exit 2 on every rank. ``quiet``: no
    line (a world of one process prints its own).
    """
    import torch
    from mpi4py import MPI

    from geompi.runtime import exit_together, say

    env = os.environ if env is None else env
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    mine = affinity()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local = [frozenset(s) for s in node.allgather(sorted(mine))]
    finally:
        node.Free()
    try:
        threads, why = choose(mine, local, env)
    except ConfigError as e:  # the same variables on every rank of a job
        exit_together(e, rank, comm)
    torch.set_num_threads(threads)
    if rank == 0 and not quiet:
        say(f"geompi: torch threads per rank: {threads} ({why}; set GEOMPI_THREADS to change)")
    return threads
