"""The metrics schema (geompi.metrics.FIELDS) is the one docs/metrics.md documents, field by
field; ``check_record`` validates an emitted record against it (the MPI tests call it on the
records of real runs, the CLI's and the API's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from geompi.metrics import FIELDS, SCHEMA, MetricsLog, duration, progress_line

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def doc_tables() -> dict[str, dict[str, tuple[bool, str]]]:
    """The field tables of docs/metrics.md: '### Every record' is kind 'all'."""
    out: dict[str, dict[str, tuple[bool, str]]] = {}
    kind = None
    for line in DOC.read_text().splitlines():
        head = re.match(r"^### (?:`(\w+)`|(Every record))$", line)
        if head:
            kind = head.group(1) or "all"
            out[kind] = {}
            continue
        row = re.match(r"^\| `([\w*]+)` \| (yes|no) \| (.+) \|$", line)
        if row and kind is not None:
            out[kind][row.group(1)] = (row.group(2) == "yes", row.group(3))
    return out


def test_the_doc_documents_every_field_of_the_schema_and_no_other():
    assert doc_tables() == FIELDS


def documented(kind: str, name: str) -> bool:
    fields = {**FIELDS["all"], **FIELDS[kind]}
    if name in fields or "*" in fields:
        return True
    return any(f.endswith("*") and name.startswith(f[:-1]) for f in fields)


def check_record(r: dict) -> None:
    """Every field of ``r`` documented for its kind, every field marked always there."""
    assert r.get("schema") == SCHEMA, r
    kind = r.get("kind")
    assert kind in FIELDS and kind != "all", r
    for name, (always, _) in {**FIELDS["all"], **FIELDS[kind]}.items():
        if always:
            assert name in r, (name, r)
    for name in r:
        assert documented(kind, name), (name, kind)


def test_check_record_finds_a_missing_or_undocumented_field():
    step = {"schema": SCHEMA, "kind": "step", "time": 0.1, "step": 1, "loss": 0.5, "lr": 0.1}
    step.update(workers=2, lan_bytes=10, wan_bytes=5, wall_s=1.0, compute_s=0.5, wait_s=0.2)
    step["other_s"] = 0.3
    check_record(step)
    with pytest.raises(AssertionError):
        check_record({k: v for k, v in step.items() if k != "wan_bytes"})
    with pytest.raises(AssertionError):
        check_record({**step, "loss_of_rank0": 0.4})
    check_record({"schema": SCHEMA, "kind": "summary", "time": 1, "summary": True, "steps": 1,
                  "wall_s": 2.0, "staleness_max": 3})  # fmt: skip


def test_the_log_stamps_schema_and_time_first(tmp_path):
    log = MetricsLog(str(tmp_path / "m.jsonl"))
    log.write({"kind": "eval", "step": 3, "wall_s": 1.0, "test_acc": 0.5})
    log.close()
    (line,) = (tmp_path / "m.jsonl").read_text().splitlines()
    assert list(json.loads(line))[:3] == ["schema", "time", "kind"]
    check_record(json.loads(line))


def test_progress_line_elapsed_and_eta():
    assert duration(0.4) == "0:00" and duration(75) == "1:15" and duration(3725) == "1:02:05"
    # 10 steps of 100 at 2 steps/s: 45 s left
    line = progress_line(10, 100, 5.0, 2.0, (9, 0.25), "epoch 1", 640.0)
    assert line == (
        "geompi: step 10/100 epoch 1 loss 0.2500 (step 9) 640 samples/s elapsed 0:05 eta 0:45"
    )
    assert progress_line(3, None, 1.0, 3.0) == "geompi: step 3 elapsed 0:01"  # no total: no ETA


def test_a_step_record_becomes_the_documented_scalars():
    try:
        from test_metrics import RecordingWriter
    except ImportError:  # tests/ imported as a package
        from tests.test_metrics import RecordingWriter
    from geompi.metrics import _to_tensorboard

    tb = RecordingWriter()
    step = {"schema": SCHEMA, "kind": "step", "step": 5, "loss": 0.5, "lr": 0.1, "workers": 2}
    step.update(lan_bytes=10, wan_bytes=4, wall_s=1.0, compute_s=0.5, wait_s=0.3, other_s=0.2)
    _to_tensorboard(tb, step)
    _to_tensorboard(tb, {"schema": SCHEMA, "kind": "eval", "step": 5, "wall_s": 1.0, "f1": 0.7})
    assert tb.scalars == [
        ("train/loss", 0.5, 5), ("train/lr", 0.1, 5), ("bytes/lan_bytes", 10, 5),
        ("bytes/wan_bytes", 4, 5), ("time/compute_s", 0.5, 5), ("time/wait_s", 0.3, 5),
        ("time/other_s", 0.2, 5), ("eval/f1", 0.7, 5),
    ]  # fmt: skip


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_plotter_reads_both_schemas(tmp_path):
    """Schema 1: the WAN axis is each step record's measured bytes; a log from before it (no
    schema, WAN bytes in the summary only): the total spread over the steps."""
    from geompi.plot import read_run

    old = [{"event": "start", "config": {"sync": "fsa"}}]
    old += [{"step": s, "loss": 1.0 / s, "wall_s": 0.1 * s} for s in (1, 2, 3, 4)]
    old += [{"summary": True, "steps": 4, "wan_bytes": 400, "wall_s": 0.5, "test_acc": 0.9}]
    run = read_run(_jsonl(tmp_path / "old.jsonl", old))
    assert [s for s, _, _ in run.loss] == [1, 2, 3, 4] and run.acc == [(4, 0.5, 0.9)]
    assert [run.wan_axis(s) for s in (1, 2, 4)] == [100.0, 200.0, 400.0]
    new = [{"schema": SCHEMA, "kind": "start", "event": "start", "config": {"sync": "hfa"}}]
    for s, wan in ((2, 50), (4, 50), (6, 300)):  # measured: flat between global rounds
        new.append({"schema": SCHEMA, "kind": "step", "step": s, "loss": 1.0, "wall_s": s,
                    "wan_bytes": wan})  # fmt: skip
    new.append({"schema": SCHEMA, "kind": "eval", "step": 6, "wall_s": 6.5, "test_acc": 0.8})
    new.append({"schema": SCHEMA, "kind": "summary", "summary": True, "steps": 6,
                "wan_bytes": 333, "wall_s": 7.0})  # fmt: skip
    run = read_run(_jsonl(tmp_path / "new.jsonl", new))
    assert run.label == "new (hfa)" and [s for s, _, _ in run.loss] == [2, 4, 6]
    assert [run.wan_axis(s) for s in (2, 4, 5, 6)] == [50.0, 50.0, 50.0, 300.0]
    assert run.acc == [(6, 6.5, 0.8)]
