"""geompi.Metrics from a user's loop under mpirun (tests/progs/metrics_api.py): FSA, then HFA in
one job. The mean loss is checked against the losses each worker wrote itself, averaged here;
the learning rate against the schedule's own formula; bytes grow where rounds crossed the
links; every record against the documented schema; the progress lines; a user's log handler."""

from __future__ import annotations

import importlib.util
import json

import pytest

try:
    from mpirun import error_lines, mpirun, prog, read_jsonl
    from test_metrics_schema import check_record
except ImportError:  # tests/ imported as a package
    from tests.mpirun import error_lines, mpirun, prog, read_jsonl
    from tests.test_metrics_schema import check_record

pytestmark = pytest.mark.mpi
HAVE_TB = importlib.util.find_spec("tensorboard") is not None
WORKERS, STEPS = 3, 8


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("metrics_api")
    args = ["-m", "mpi4py", prog("metrics_api.py"), str(d)] + (["tensorboard"] if HAVE_TB else [])
    res = mpirun(6, args, 300, check=False)  # it ends on a bad argument (the last test)
    (d / "stderr.txt").write_text(res.stderr)
    (d / "rc.txt").write_text(str(res.returncode))
    return d


def _losses(out, tag: str) -> dict[int, float]:
    """The mean over the workers of the loss each one computed at each step (independent of
    geompi.Metrics: plain Python over the workers' own files)."""
    per = [json.loads((out / f"loss-{tag}-w{w}.json").read_text()) for w in range(WORKERS)]
    assert {p.pop("allreduces") for p in per} == {3 if tag == "fsa" else 1}  # batches of records
    return {s: sum(float(p[str(s)]) for p in per) / WORKERS for s in range(1, STEPS + 1)}


@pytest.mark.parametrize("tag,every", [("fsa", 1), ("hfa", 2)])
def test_step_records_hold_the_workers_mean_loss_lr_bytes_and_time(out, tag, every):
    records = read_jsonl(out / f"m-{tag}.jsonl")
    for r in records:
        check_record(r)
    assert [r["kind"] for r in records][0] == "start" and records[-1]["kind"] == "summary"
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(every, STEPS + 1, every))
    mean = _losses(out, tag)
    for r in steps:
        assert r["workers"] == WORKERS
        assert r["loss"] == pytest.approx(mean[r["step"]], rel=1e-9, abs=1e-9), r
        assert r["lr"] == pytest.approx(0.2 * 0.5 ** ((r["step"] - 1) // 3))  # StepLR(3, 0.5)
        split = r["compute_s"] + r["wait_s"] + r["other_s"]
        assert r["compute_s"] > 0 and r["wait_s"] > 0 and split == pytest.approx(r["wall_s"])
    lan = [r["lan_bytes"] for r in steps]
    wan = [r["wan_bytes"] for r in steps]
    assert all(b > a for a, b in zip(lan, lan[1:])), lan  # a LAN round every record
    assert wan[0] > 0 and all(b >= a for a, b in zip(wan, wan[1:])), wan
    if tag == "fsa":  # a global round every step: the WAN count grows at each
        assert all(b > a for a, b in zip(wan, wan[1:])), wan
    else:  # HFA K1=2, K2=2: a global average at steps 4 and 8 only, none at 6
        assert wan[2] == wan[1] and wan[3] > wan[2] and wan[1] > wan[0], wan
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals == [{**evals[0], "step": 4, "accuracy": 0.5}] and evals[0]["wall_s"] > 0
    assert records.index(evals[0]) == records.index(steps[4 // every - 1]) + 1  # in step order
    assert records[-1]["note"] == tag and records[-1]["steps"] == STEPS


def test_progress_lines_and_a_users_handler(out):
    # the user attached a handler: geompi's default one printed nothing on stderr meanwhile
    assert "geompi: step" not in (out / "stderr.txt").read_text()
    lines = (out / "log-w0.txt").read_text().splitlines()
    progress = [ln for ln in lines if "geompi: step" in ln]
    assert len(progress) == 4, lines  # every 4 steps of 8, twice
    for ln in progress:
        assert ln.startswith("rank 0 INFO geompi: step ") and "/8 " in ln, ln
        assert " elapsed 0:0" in ln and " eta 0:0" in ln and "samples/s" in ln, ln
    assert "rank 0 INFO geompi: the user's own line" in lines
    assert not [ln for ln in (out / "log-w1.txt").read_text().splitlines() if "step" in ln]


@pytest.mark.skipif(not HAVE_TB, reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_from_the_api(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb-fsa"))
    acc.Reload()
    loss = [e.value for e in acc.Scalars("train/loss")]
    records = [r for r in read_jsonl(out / "m-fsa.jsonl") if r["kind"] == "step"]
    assert loss == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert {"bytes/wan_bytes", "train/lr", "time/wait_s", "eval/accuracy"} <= set(
        acc.Tags()["scalars"]
    )


def test_a_bad_argument_is_one_line_and_every_rank_stops(out):
    """After the user removed their handler, geompi's default one prints again."""
    stderr = (out / "stderr.txt").read_text()
    assert int((out / "rc.txt").read_text()) != 0
    assert error_lines(stderr) == [
        "geompi: error: geompi.Metrics(every=0): give a whole number >= 1"
    ], stderr[-3000:]
    assert "Traceback" not in stderr
