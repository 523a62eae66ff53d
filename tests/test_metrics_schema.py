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
