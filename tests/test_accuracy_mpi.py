"""The default job on the bundled dataset: `mpirun -n 16 python -m geompi.train` (FSA) and HFA.

Both runs share one 16-rank mpirun job (tests.mpirun.train_runs: the ranks start once); each
test asserts on its own run's output and metrics."""

import pytest

from tests.mpirun import read_jsonl, train_runs

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accuracy")
    hfa = ["--sync", "hfa", "--k1", "4", "--k2", "2"]
    fsa, hfa = train_runs(
        16,
        [(["--metrics", out / "fsa.jsonl"], {}), ([*hfa, "--metrics", out / "hfa.jsonl"], {})],
        out / "runs",
        timeout=480,
    )
    return {
        "fsa": (fsa, read_jsonl(out / "fsa.jsonl")),
        "hfa": (hfa, read_jsonl(out / "hfa.jsonl")),
    }


def test_default_fsa_job_reaches_095(runs):
    res, records = runs["fsa"]
    assert "geompi topology: 16 ranks = 1 global server(s) + 3 datacenter(s), 12 workers" in (
        res.stdout
    )
    summary = records[-1]
    for key in ("test_acc", "steps", "samples", "wall_s", "lan_bytes", "wan_bytes"):
        assert key in summary, key
    assert summary["test_acc"] >= 0.95
    assert summary["samples"] == summary["steps"] * 12 * 16
    assert f"test_acc={summary['test_acc']:.4f}" in res.stderr
    assert summary["global_syncs"] == summary["steps"]


def test_hfa_on_default_dataset_reaches_093(runs):
    res, records = runs["hfa"]
    assert res.returncode == 0
    summary = records[-1]
    assert summary["test_acc"] >= 0.93
    assert summary["global_syncs"] == summary["steps"] // 8
