"""A world of one process (issue 37): ``python script.py`` with ``geompi.init()`` and
``geompi.DistributedOptimizer``, no mpirun, trains locally, bitwise as plain torch, and its
checkpoints resume exactly; ``python -m geompi.train`` says how many ranks it needs."""

from __future__ import annotations

import json
import sys

from geompi.comm.topology import Role, Topology
from tests.mpirun import error_lines, prog, run

NOTICE = "geompi: one process, no servers: training locally"


def test_the_world_of_one_is_one_worker_and_no_server():
    t = Topology.alone()
    assert t.serverless and not Topology.plan(3).serverless
    assert t.role(0) is Role.WORKER and t.num_workers == 1 and t.all_workers == [0]
    assert t.worker_index(0) == 0 and t.dc_of(0) == 0 and t.num_dcs == 1
    assert t.global_servers == [] and t.table() == NOTICE
    assert t.describe() == {"world_size": 1, "dc_sizes": [1], "global_servers": 0, "workers": 1}


def _script(tmp_path, phase: str):
    return run([sys.executable, prog("alone_train.py"), str(tmp_path), phase], timeout=300)


def test_one_process_trains_as_plain_torch_and_resumes_exactly(tmp_path):
    res = _script(tmp_path, "full")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # one line of notice, nothing else (no topology table, no threads line)
    assert (res.stdout + res.stderr).strip().splitlines() == [NOTICE], res.stdout + res.stderr
    full = json.loads((tmp_path / "full.json").read_text())
    assert full["world"] == [0, 1, True, 0, 0, 1, "cpu"]
    assert full["all_reduce"] == [[1.5, -2.0]] * 4  # mean, sum, max, min of one worker
    assert full["broadcast"] == {"a": [1, 2]}
    assert full["sampler"] == list(range(10))  # the one worker's shard is the whole dataset
    cases = ("sgd_fsa", "adam_fsa", "sgd_hfa", "adam_mixed", "clip_fsa")
    for case in cases:
        assert full[f"{case}_same_object"] and full[f"{case}_written"], case
        assert full[f"{case}_diff"] == [], (case, full[f"{case}_diff"])
        assert full[f"{case}_syncs"] == 0 and full[f"{case}_failures"] == [], case
    assert full["clip_active"]  # max_grad_norm clipped as plain torch's clip_grad_norm_ did
    assert full["report"] == [0, 0]  # close(): the master's report, no byte sent
    # a new process: load, then the rest of the steps; equal to an uninterrupted run
    res = _script(tmp_path, "resume")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    resumed = json.loads((tmp_path / "resume.json").read_text())
    for case in cases:
        assert resumed[f"{case}_info"] == [5, 45, False], case  # step, state= it did not name
        assert resumed[f"{case}_diff"] == [], (case, resumed[f"{case}_diff"])


def test_one_process_that_names_a_topology_is_one_line(tmp_path):
    """dc_sizes given: the user meant servers, so a world of one is refused, saying both ways."""
    res = _script(tmp_path, "named")
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = error_lines(res.stderr)
    assert "mpirun -n" in line and "to train locally in one process" in line, line


def test_one_process_errors_are_python_s_own_no_mpi_abort(tmp_path):
    """A refusal is one line and status 1, as under mpirun but with no MPI_Abort banner (there
    is no other rank to end); a script's own exception is Python's traceback, status 1."""
    res = _script(tmp_path, "closure")
    assert res.returncode == 1, res.stdout + res.stderr
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert lines[0] == NOTICE and len(lines) == 2, lines
    assert lines[1].startswith("geompi: error: DistributedOptimizer.step(closure)"), lines
    res = _script(tmp_path, "raise")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.rstrip().endswith("ValueError: a bug in the user's script"), res.stderr
    assert "Traceback" in res.stderr and "geompi: error" not in res.stderr, res.stderr


def test_the_cli_in_one_process_says_how_many_ranks_it_needs(tmp_path):
    """``python -m geompi.train`` is the distributed demo (per-datacenter figures, WAN bytes):
    in one process it says, in one line, how many ranks it needs, and exits 2."""
    res = run([sys.executable, "-m", "geompi.train", "--steps", "2"], timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = error_lines(res.stderr)
    assert line.startswith("geompi: error: the world has 1 rank(s)") and "mpirun -n 3" in line
    assert "train locally" not in line  # the API's way, not the CLI's
    assert not (tmp_path / "checkpoints").exists()
