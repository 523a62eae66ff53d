"""torch threads per rank (geompi.threads): the share of the node's CPUs, and overrides."""

from __future__ import annotations

import pytest

from geompi.errors import ConfigError
from geompi.threads import choose, override, share

try:
    from mpirun import error_lines, mpirun
except ImportError:  # tests/ imported as a package
    from tests.mpirun import error_lines, mpirun

TWO = frozenset({0, 1})


def test_ranks_that_share_the_cpus_split_them():
    assert share(TWO, [TWO] * 16) == 1  # 16 ranks on a 2-core node (srun, task/none)
    assert share(frozenset(range(64)), [frozenset(range(64))] * 8) == 8
    assert share(frozenset(range(64)), [frozenset(range(64))] * 9) == 7


def test_bound_ranks_keep_their_own_cpus():
    cpus = [frozenset(range(4 * i, 4 * i + 4)) for i in range(4)]  # srun --cpu-bind, -c 4
    assert share(cpus[1], cpus) == 4
    assert share(frozenset({0}), [frozenset({0})] * 3) == 1


def test_overrides_and_slurm_cpus_per_task():
    local = [frozenset(range(16))] * 2
    assert choose(local[0], local, {}) == (8, "16 CPU(s) shared by 2 rank(s) on this node")
    assert choose(local[0], local, {"SLURM_CPUS_PER_TASK": "4"})[0] == 4
    assert choose(local[0], local, {"OMP_NUM_THREADS": "3"}) == (3, "from OMP_NUM_THREADS")
    env = {"OMP_NUM_THREADS": "3", "GEOMPI_THREADS": "5"}
    assert choose(local[0], local, env) == (5, "from GEOMPI_THREADS")
    assert override({"OMP_NUM_THREADS": "4,2"}) == (4, "OMP_NUM_THREADS")
    assert override({"OMP_NUM_THREADS": ""}) is None
    with pytest.raises(ConfigError, match="GEOMPI_THREADS='many': must be a whole number"):
        override({"GEOMPI_THREADS": "many"})


def test_absurd_thread_counts_are_refused_before_torch_is_told():
    """Issue 35 item 8: GEOMPI_THREADS=99999999 reached torch.set_num_threads, and the rank
    died on SIGSEGV."""
    assert override({"GEOMPI_THREADS": "1024"}) == (1024, "GEOMPI_THREADS")
    for var in ("GEOMPI_THREADS", "OMP_NUM_THREADS"):
        with pytest.raises(ConfigError) as exc:
            override({var: "99999999"})
        msg = str(exc.value)
        assert (
            msg.startswith(f"{var}='99999999': at most 1024 threads per rank") and "\n" not in msg
        )


@pytest.mark.mpi
def test_training_prints_and_uses_the_share():
    args = ["-m", "geompi.train", "--steps", "2", "--model", "linear"]
    res = mpirun(4, args, env={"OMP_NUM_THREADS": ""}, timeout=120)
    want = "geompi: torch threads per rank: 1 ("
    assert [ln for ln in res.stderr.splitlines() if ln.startswith(want)], res.stderr
    res = mpirun(4, args, env={"GEOMPI_THREADS": "0"}, timeout=120, check=False)
    assert res.returncode != 0
    assert error_lines(res.stderr) == [
        "geompi: error: GEOMPI_THREADS='0': must be a whole number >= 1"
    ], res.stderr


def test_wait_mode_polls_only_where_the_node_is_oversubscribed(monkeypatch):
    import os

    from geompi.comm.transport import wait_mode
    from geompi.runtime import check_wait_mode

    cpus = os.cpu_count() or 1
    assert wait_mode({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cpus + 1)}) == "poll"
    assert wait_mode({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cpus)}) == "spin"
    assert wait_mode({"SLURM_STEP_TASKS_PER_NODE": str(4 * cpus)}) == "poll"  # srun
    srun = {"SLURM_STEP_TASKS_PER_NODE": f"{cpus}(x2),{cpus + 3}", "SLURM_NODEID": "2"}
    assert wait_mode(srun) == "poll" and wait_mode({**srun, "SLURM_NODEID": "1"}) == "spin"
    assert wait_mode({"SLURM_STEP_TASKS_PER_NODE": "garbage"}) == "spin"
    assert wait_mode({}) == "spin"  # no launcher: one process
    assert wait_mode({"GEOMPI_WAIT": "spin", "MPI_LOCALNRANKS": str(cpus + 1)}) == "spin"
    assert wait_mode({"GEOMPI_WAIT": "Poll"}) == "poll"
    monkeypatch.setenv("GEOMPI_WAIT", "polll")
    with pytest.raises(ConfigError, match="GEOMPI_WAIT='polll': choose one of auto, spin, poll"):
        check_wait_mode()
