"""`python -m geompi.plot` and the TensorBoard sink, on the metrics of one short real run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

try:
    from mpirun import REPO, mpirun, read_jsonl
    from test_metrics_schema import check_record
except ImportError:  # tests/ imported as a package
    from tests.mpirun import REPO, mpirun, read_jsonl
    from tests.test_metrics_schema import check_record

pytestmark = pytest.mark.mpi
HAVE_TB = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """mpirun -n 5 python -m geompi.train --steps 20, with --metrics (and --tensorboard)."""
    d = tmp_path_factory.mktemp("plotrun")
    args = ["-m", "geompi.train", "--steps", "20", "--eval-every", "10", "--model", "mlp"]
    args += ["--metrics", str(d / "m.jsonl")]
    if HAVE_TB:
        args += ["--tensorboard", str(d / "tb")]
    mpirun(5, args, timeout=240)
    return d


def _python(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plot_writes_a_png_of_several_runs(run_dir):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = run_dir / "run.png"
    m = str(run_dir / "m.jsonl")
    r = _python("-m", "geompi.plot", m, m, "--label", "a", "--label", "b", "-o", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wrote" in r.stdout and "2 run(s)" in r.stdout, r.stdout
    img = matplotlib.image.imread(out)
    assert img.shape[0] >= 600 and img.shape[1] >= 900, img.shape
    assert img.std() > 0.01  # not a blank canvas


def test_plot_reads_the_runs_records(run_dir):
    from geompi.plot import read_run

    run = read_run(run_dir / "m.jsonl")
    assert [s for s, _, _ in run.loss] == list(range(1, 21))
    assert [s for s, _, _ in run.acc] == [10, 20, 20]  # two evaluations and the summary
    assert run.steps == 20 and run.wan_bytes > 0
    assert run.wan_at(10) == pytest.approx(run.wan_bytes / 2)
    assert "(fsa)" in run.label


def test_the_clis_records_follow_the_documented_schema(run_dir):
    """The CLI writes through geompi.Metrics: schema 1, the loss averaged over its 2 workers,
    bytes measured per step (the summary's are the bytes every rank sent: the same WAN
    traffic, once each way)."""
    records = read_jsonl(run_dir / "m.jsonl")
    for r in records:
        check_record(r)
    assert records[0]["kind"] == "start" and "config" in records[0]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert all(r["workers"] == 2 and r["lr"] > 0 for r in steps)
    wan = [r["wan_bytes"] for r in steps]
    assert all(b > a for a, b in zip(wan, wan[1:])), wan
    summary = records[-1]
    assert summary["kind"] == "summary" and 0.9 < wan[-1] / summary["wan_bytes"] <= 1.0


def test_plot_errors_are_one_line(tmp_path, run_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    r = _python("-m", "geompi.plot", str(bad), "-o", str(tmp_path / "x.png"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("geompi: error: ") and "bad.jsonl:1 is not JSON" in r.stderr
    # Without matplotlib (hidden from this interpreter): one line naming the extra.
    code = (
        "import sys; sys.modules['matplotlib'] = None; from geompi.plot import main; "
        f"sys.exit(main([{str(run_dir / 'm.jsonl')!r}, '-o', {str(tmp_path / 'y.png')!r}]))"
    )
    r = _python("-c", code)
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr == "geompi: error: python -m geompi.plot needs matplotlib: "
        "pip install 'geompi[plot]'\n"
    ), r.stderr


@pytest.mark.skipif(not HAVE_TB, reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_has_the_same_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "test/acc", "test/loss", "bytes/wan_bytes", "bytes/lan_bytes"):
        assert tag in tags, tags
    assert {"time/compute_s", "time/wan_wait_s", "time/lan_wait_s"} <= tags, tags
    records = read_jsonl(run_dir / "m.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    tb_loss = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))
    assert tb_loss == pytest.approx(losses, rel=1e-6)
    summary = records[-1]
    assert acc.Scalars("bytes/wan_bytes")[-1].value == pytest.approx(summary["wan_bytes"])


def test_tensorboard_missing_is_one_line():
    """Where the package is absent (hidden here): validate() says so before any collective."""
    code = (
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'tensorboard' else real(n, *a)\n"
        "from geompi.config import make_config\n"
        "make_config(['--tensorboard', 'tb']).validate()\n"
    )
    r = _python("-c", code)
    assert r.returncode != 0 and "--tensorboard tb needs the tensorboard package" in r.stderr
