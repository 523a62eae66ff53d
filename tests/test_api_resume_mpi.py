"""Exact resume through the public API (tests/progs/api_resume.py): 4 steps, save, a new model
and optimizer, load, 4 more steps equals 8 steps in one go, bitwise, where the state that must
travel is the servers' (HFA's outer Nesterov momentum, FSA's Adam on the global servers) and
every worker's own (HFA's inner momentum, different on each worker)."""

import json

import pytest
import torch

from tests.mpirun import mpirun, prog

pytestmark = pytest.mark.mpi
WORKERS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("api_resume")
    res = mpirun(7, ["-m", "mpi4py", prog("api_resume.py"), str(out), "resume"], 300, check=False)
    assert (out / "done-resume-w0.json").exists(), res.stderr[-3000:]
    (out / "stderr.txt").write_text(res.stderr)
    return out


def models(out, tag: str) -> list[dict]:
    return [torch.load(out / f"{tag}-w{w}.pt") for w in range(WORKERS)]


@pytest.mark.parametrize(
    "whole, resumed",
    [
        ("hfa-whole", "hfa-resumed"),  # outer momentum and each worker's inner state
        ("fsa-whole", "fsa-resumed"),  # the global servers' Adam through geompi.save/load
        ("fsa-whole", "fsa-torch"),  # the same through opt.state_dict()/load_state_dict()
    ],
)
def test_a_resumed_run_equals_the_run_in_one_go(run, whole, resumed):
    for a, b in zip(models(run, whole), models(run, resumed)):
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", ["fsa", "mixed"])
def test_state_dict_holds_the_servers_adam_state(run, name):
    """Where the global servers step, torch's state_dict() has their per-parameter state
    (it was empty: a torch checkpoint then restarted Adam's moments)."""
    state = json.loads((run / f"{name}-state.json").read_text())
    assert len(state) >= 6
    assert all(v == ["exp_avg", "exp_avg_sq", "step"] for v in state.values())


@pytest.mark.parametrize("name", ["hfa", "fsa"])
def test_each_worker_gets_its_own_saved_state_back(run, name):
    """geompi.save(state=...) keeps every worker's own values (RNG states differ per worker)."""
    for w in range(WORKERS):
        got = json.loads((run / f"{name}-state-w{w}.json").read_text())
        assert {k: got[k] for k in ("who", "rng")} == {"who": w, "rng": True}, (w, got)


def test_a_directory_of_checkpoints_keep_and_latest(run):
    """geompi.save(directory, keep=1) named each file by its step and kept the newest;
    geompi.latest found none before the first, then skipped a torn newer file for it (one
    line) on every worker, and the run resumed from it equals the run in one go (above)."""
    ck = run / "fsa-ck"
    assert sorted(p.name for p in ck.iterdir()) == ["ckpt-00000004.h5", "ckpt-00000009.h5"]
    for w in range(WORKERS):
        got = json.loads((run / f"fsa-state-w{w}.json").read_text())
        assert got["first"] is None and got["latest"] == str(ck / "ckpt-00000004.h5"), got
    said = [line for line in (run / "stderr.txt").read_text().splitlines() if "latest" in line]
    assert len(said) == 1 and said[0].startswith(
        "geompi: geompi.latest: skipped 1 unusable checkpoint(s), newest ckpt-00000009.h5"
    ), said


def test_load_between_close_and_the_next_optimizer(run):
    """geompi.load after opt.close() waited forever in the closed optimizer's INIT round."""
    assert (run / "after-close-w2.pt").exists()


def test_loading_a_closed_optimizer_whose_state_the_servers_held_is_refused(tmp_path):
    res = mpirun(
        7, ["-m", "mpi4py", prog("api_resume.py"), str(tmp_path), "closed"], 120, check=False
    )
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if "geompi.load(optimizer=...)" in ln]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "after opt.close()" in lines[0]


def test_collectives_among_the_workers(run):
    """all_reduce (bf16 reduced in float64, ints in int64), broadcast_object from worker 1,
    local_worker_rank (one node: 0, 1, 2), against the values computed here."""
    for w in range(WORKERS):
        got = json.loads((run / f"collectives-w{w}.json").read_text())
        assert got["mean"] == [3.0, -1.0]  # (1.5 + 3 + 4.5) / 3, (0 - 1 - 2) / 3
        assert got["sum"] == [9.0, -3.0]
        assert got["max"] == [2, 10]
        assert got["min_dtype"] == "torch.int64"
        assert got["obj"] == {"from": 1, "items": [1, "x"]}
        assert got["local"] == w


def test_a_collective_with_different_shapes_is_one_line_and_stops_every_rank(tmp_path):
    res = mpirun(
        7, ["-m", "mpi4py", prog("api_resume.py"), str(tmp_path), "mismatch"], 120, check=False
    )
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if "geompi: error:" in ln]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "worker 1 passed (3,) torch.float32 op=mean but worker 0 passed (2,)" in lines[0]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    out = tmp_path_factory.mktemp("api_replicated")
    dumps = out / "mirrors"
    dumps.mkdir()
    env = {"GEOMPI_TEST_MIRROR_DUMP": str(dumps)}
    args = ["-m", "mpi4py", prog("api_resume.py"), str(out), "replicated"]
    res = mpirun(7, args, 300, env=env, check=False)
    assert (out / "trained-w0.json").exists(), res.stderr[-3000:]
    (out / "stderr.txt").write_text(res.stderr)
    (out / "rc.txt").write_text(str(res.returncode))
    return out


@pytest.mark.parametrize("tag", ["hfa-whole", "hfa-resumed", "fsa-whole", "fsa-resumed"])
def test_replicated_global_servers_train_as_one_copy_and_resume_exactly(run, replicated, tag):
    """global_replicas=2: the models equal those of the run without replicas, bitwise (the
    mirrors answer nothing), through a checkpoint and its restore too (HFA's outer momentum,
    FSA's Adam on the servers)."""
    for a, b in zip(models(run, tag), models(replicated, tag)):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_every_mirror_holds_exactly_what_its_shard_holds(replicated):
    """Each global server's mirror of the other's shard at the end of each job (4 per server:
    HFA and FSA in one go and through files, the resumed ones restored from the checkpoint
    with the mirrored shard's state), bitwise: values, optimizer state, outer momentum."""
    dumps = replicated / "mirrors"
    for job in range(4):
        snaps = [torch.load(dumps / f"gs{g}-{job}.pt") for g in (0, 1)]
        for g in (0, 1):
            own, mirror = snaps[1 - g]["own"], snaps[g]["mirror"]
            assert mirror["index"] == own["index"] == 1 - g
            assert mirror["updates"] == own["updates"] > 0
            _same(mirror, own)
    assert any(torch.load(dumps / f"gs0-{j}.pt")["own"]["outer"] for j in range(4))
    assert any(torch.load(dumps / f"gs0-{j}.pt")["own"]["state"] for j in range(4))


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_mixedsync_refuses_replicas_in_one_line(replicated):
    """The one-sided tier keeps no mirrors yet: one line, every rank ends, non-zero."""
    err = (replicated / "stderr.txt").read_text()
    lines = [ln for ln in err.splitlines() if ln.startswith("geompi: error:")]
    assert lines == [
        "geompi: error: global_replicas=2 with mixed is not supported yet: the one-sided "
        "global tier keeps one copy of each shard; use geompi.FSA() or HFA, or global_replicas=1"
    ], err[-2000:]
    assert (replicated / "rc.txt").read_text() != "0"
    assert not list(replicated.glob("done-*"))
