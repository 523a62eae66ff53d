"""The rank layout of --dc-map nodes: python -m geompi.slurm layout and the start-up check."""

from __future__ import annotations

import subprocess
import sys

from geompi.comm.topology import Topology, dc_sizes_from_hosts
from geompi.layout import plan_nodes, startup_warning

try:
    from mpirun import REPO
except ImportError:  # tests/ imported as a package
    from tests.mpirun import REPO


def _slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "geompi.slurm", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_two_nodes_of_nine_tasks_leave_a_gpu_idle():
    topo, rows = plan_nodes([9, 9], 1, [8, 8])
    assert topo.dc_sizes == (9, 8) and topo.num_global_servers == 1
    assert [len(r.workers) for r in rows] == [8, 7]
    assert [r.local_server for r in rows] == [8, 16]
    assert rows[1].global_servers == (17,) and rows[0].global_servers == ()
    r = _slurm("layout", "--nodes", "2", "--tasks-per-node", "9", "--gpus-per-node", "8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("geompi layout (--dc-map nodes): 18 ranks on 2 node(s) = 1 global")
    assert lines[2].split() == ["0", "0-8", "DC", "0", "8", "(0-7)", "8", "-", "8"], lines
    assert lines[3].split() == ["1", "9-17", "DC", "1", "7", "(9-15)", "16", "17", "8"], lines
    assert "warning: node 1 has 7 worker(s) for 8 GPU(s): 1 GPU(s) idle" in r.stdout
    assert "--tasks-per-node 9,10" in r.stdout


def test_one_more_task_on_the_last_node_fits():
    r = _slurm("layout", "--nodes", "2", "--ntasks-per-node", "9,10", "--gpus-per-node", "8")
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stdout and "16 workers" in r.stdout, r.stdout
    # The layout is the one --dc-map nodes builds from the same host list.
    hosts = ["a"] * 9 + ["b"] * 10
    assert Topology.plan(19, None, dc_sizes_from_hosts(hosts, 1), 1) == plan_nodes([9, 10])[0]


def test_layout_errors_are_one_line():
    r = _slurm("layout", "--nodes", "2", "--tasks-per-node", "9,1,3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("geompi: error: --tasks-per-node '9,1,3'"), r.stderr
    r = _slurm("layout", "--nodes", "2", "--tasks-per-node", "1,9")  # node 0: no worker
    assert r.returncode == 2 and "datacenter 0 has 1 rank(s)" in r.stderr, r.stderr


def test_startup_warning_is_one_line_per_job():
    topo = Topology.plan(18, None, (9, 8), 1)
    seen = [("n0", 8)] * 9 + [("n1", 8)] * 9
    line = startup_warning(seen, topo)
    assert line is not None and "\n" not in line
    assert line.startswith("geompi: warning: node n1 has 7 worker(s) for 8 GPU(s): 1 GPU(s) idle")
    assert startup_warning([("n0", 0)] * 9 + [("n1", 0)] * 9, topo) is None  # CPU nodes
    topo = Topology.plan(19, None, (9, 9), 1)
    assert startup_warning([("n0", 8)] * 9 + [("n1", 8)] * 10, topo) is None


def test_slurm_list_and_write():
    r = _slurm("list")
    assert r.returncode == 0, r.stderr
    assert {ln.split()[0] for ln in r.stdout.splitlines()} == {"fsa", "hfa", "mixedsync"}
    r = _slurm("write", "hfa", "--python", "/opt/my env/bin/python")
    assert r.returncode == 0, r.stderr
    baked = (
        "# Written by `python -m geompi.slurm write`: the python with geompi installed.\n"
        "export GEOMPI_PYTHON=${GEOMPI_PYTHON:-'/opt/my env/bin/python'}\n"
    )
    assert baked in r.stdout
    # Otherwise the very script a checkout submits (jobs/slurm/ links to the package's).
    assert r.stdout.replace(baked, "") == (REPO / "jobs" / "slurm" / "hfa.sbatch").read_text()
    r = _slurm("write", "nope")
    assert r.returncode == 2 and r.stderr.startswith("geompi: error: unknown script 'nope'")
    r = _slurm("common-path")
    assert r.returncode == 0 and r.stdout.strip().endswith("geompi/slurm_jobs/common.sh")
