"""geompi.metrics: the JSON-lines log and which records become TensorBoard scalars."""

from __future__ import annotations

import json

from geompi.metrics import MetricsLog, _to_tensorboard


class RecordingWriter:
    """Stands in for torch's SummaryWriter (tensorboard is not installed here): it records
    the scalars it is given."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def add_text(self, *args) -> None:
        pass

    def flush(self) -> None:
        pass


def test_records_become_the_documented_scalars():
    tb = RecordingWriter()
    _to_tensorboard(tb, {"step": 3, "loss": 0.5})
    _to_tensorboard(tb, {"step": 4, "test_acc": 0.9, "test_loss": 0.2})
    change = {"event": "k2", "step": 8, "old_k2": 1, "new_k2": 5, "exchange_s": 0.4}
    _to_tensorboard(tb, change)
    _to_tensorboard(tb, {"step": 8, "checkpoint": "/x/ckpt-00000008.h5"})
    assert tb.scalars == [
        ("train/loss", 0.5, 3),
        ("test/acc", 0.9, 4),
        ("test/loss", 0.2, 4),
        ("hfa/k2", 5, 8),
    ]


def test_log_appends_one_json_object_per_line(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(str(path))
    log.write({"step": 1, "loss": 2.0})
    log.write({"event": "k2", "step": 2, "new_k2": 3})
    log.close()
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2] and lines[1]["new_k2"] == 3
    assert all("time" in ln for ln in lines)


def test_a_metrics_path_that_cannot_be_a_file_is_one_line(tmp_path):
    """Issue 35 item 8: ``--metrics DIR`` raised IsADirectoryError from rank 0 (a traceback)."""
    import pytest

    from geompi.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        MetricsLog(str(tmp_path))
    assert (
        str(exc.value)
        == f"--metrics {tmp_path} is a directory: give a file, e.g. {tmp_path}/m.jsonl"
    )
    with pytest.raises(ConfigError) as exc:
        MetricsLog(str(tmp_path / "missing" / "m.jsonl"))
    assert str(exc.value).startswith(
        f"--metrics {tmp_path}/missing/m.jsonl: cannot open it (No such"
    )
