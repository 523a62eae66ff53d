"""KVStore API under mpirun: round semantics across datacenters, priorities, shapes and dtypes."""

import json

import pytest

from tests.mpirun import mpirun, prog

pytestmark = pytest.mark.mpi
DC_SIZES = "4,5"  # 3 + 4 workers, 1 global server: 10 ranks
WORKERS = 7


def _run(tmp_path, prio):
    mpirun(
        10,
        [prog("kv_semantics.py"), str(tmp_path), prio],
        timeout=120,
        env={"GEOMPI_DC_SIZES": DC_SIZES, "GEOMPI_GLOBAL_SERVERS": "1"},
    )
    return [json.loads((tmp_path / f"kv-{w}.json").read_text()) for w in range(WORKERS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a = _run(tmp_path_factory.mktemp("kv_a"), "0,0,0")
    b = _run(tmp_path_factory.mktemp("kv_b"), "-5,7,1")
    return a, b


def test_worker_attributes(runs):
    res, _ = runs
    assert [r["dc"] for r in res] == [0, 0, 0, 1, 1, 1, 1]
    assert [r["num_workers"] for r in res] == [3, 3, 3, 4, 4, 4, 4]
    assert {r["num_all_workers"] for r in res} == {WORKERS}
    assert {r["num_dcs"] for r in res} == {2}
    assert [r["master"] for r in res] == [True] + [False] * 6


def test_init_takes_master_value_and_round_sums_every_push(runs):
    res, _ = runs
    total = sum(range(1, WORKERS + 1))  # worker w pushes (w + 1) * (round + 1)
    for r in res:
        assert r["init"] == [100.0] * 12
        for rnd in range(3):
            assert r[f"sum_round{rnd}"] == [float(total * (rnd + 1))] * 12


def test_optimizer_applied_once_per_round_with_dtypes(runs):
    res, _ = runs
    push_sum = 0.25 * sum(range(1, WORKERS + 1))  # 7.0
    for r in res:
        for step in range(4):
            expect = 8.0 - push_sum * (step + 1)
            got = r[f"step{step}"]
            assert got["w16"][0] == "torch.float16" and got["b32"][0] == "torch.float32"
            for k, n in (("w16", 5), ("b32", 8), ("big", 1000)):
                assert got[k][1] == [expect] * n, (k, step)


def test_priority_does_not_change_results(runs):
    a, b = runs
    for ra, rb in zip(a, b):
        for step in range(4):
            assert ra[f"step{step}"] == rb[f"step{step}"]
