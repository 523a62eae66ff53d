"""The default job on the bundled dataset: `mpirun -n 16 python -m geompi.train` (FSA) and HFA."""

import pytest

from tests.mpirun import mpirun, read_jsonl

pytestmark = pytest.mark.mpi


def test_default_fsa_job_reaches_095(tmp_path):
    metrics = tmp_path / "m.jsonl"
    res = mpirun(16, ["-m", "geompi.train", "--metrics", str(metrics)], timeout=240)
    assert "geompi topology: 16 ranks = 1 global server(s) + 3 datacenter(s), 12 workers" in (
        res.stdout
    )
    records = read_jsonl(metrics)
    summary = records[-1]
    for key in ("test_acc", "steps", "samples", "wall_s", "lan_bytes", "wan_bytes"):
        assert key in summary, key
    assert summary["test_acc"] >= 0.95
    assert summary["samples"] == summary["steps"] * 12 * 16
    assert f"test_acc={summary['test_acc']:.4f}" in res.stderr
    assert summary["global_syncs"] == summary["steps"]


def test_hfa_on_default_dataset_reaches_093(tmp_path):
    metrics = tmp_path / "m.jsonl"
    mpirun(
        16,
        [
            "-m",
            "geompi.train",
            "--sync",
            "hfa",
            "--k1",
            "4",
            "--k2",
            "2",
            "--metrics",
            str(metrics),
        ],
        timeout=240,
    )
    summary = read_jsonl(metrics)[-1]
    assert summary["test_acc"] >= 0.93
    assert summary["global_syncs"] == summary["steps"] // 8
