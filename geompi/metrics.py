"""The JSON-lines metrics log that rank 0 writes, and its optional TensorBoard twin."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import IO, Any

from geompi.errors import ConfigError
from geompi.runtime import say


def _open(path: str) -> IO[str]:
    """``path`` opened for appending; a ConfigError naming --metrics if it cannot be."""
    if os.path.isdir(path):
        raise ConfigError(f"--metrics {path} is a directory: give a file, e.g. {path}/m.jsonl")
    try:
        return open(path, "a")  # noqa: SIM115 - closed by MetricsLog.close
    except OSError as e:
        raise ConfigError(f"--metrics {path}: cannot open it ({e.strerror or e})") from None


class MetricsLog:
    """Append one JSON object per line to ``path`` (nothing when path is None).

    With ``tensorboard=DIR`` the same records also go to TensorBoard: ``train/loss`` per step,
    ``test/acc`` and ``test/loss`` per evaluation, ``hfa/k2`` per change of K2, and from the
    summary the byte counters (``bytes/*``) and the time split (``time/*``), at the last step.
    """

    def __init__(self, path: str | None, tensorboard: str | None = None) -> None:
        self.records = 0
        self.path = path
        self._f: IO[str] | None = _open(path) if path else None
        self._t0 = time.time()
        self._tb: Any = _summary_writer(tensorboard) if tensorboard else None

    def write(self, record: dict) -> None:
        """Append ``record``. A failed write (a full disk) stops the log, not the training:
        one warning line, then the records are counted but not written."""
        self.records += 1
        if self._f is not None:
            line = json.dumps({"time": round(time.time() - self._t0, 4), **record}) + "\n"
            try:
                self._f.write(line)
                self._f.flush()
            except OSError as e:
                self._stop(e)
        if self._tb is not None:
            _to_tensorboard(self._tb, record)

    def _stop(self, e: OSError) -> None:
        say(
            f"geompi: warning: cannot write the metrics file {self.path} ({e.strerror or e}); "
            "training goes on without metrics: free some space or pass another --metrics"
        )
        f, self._f = self._f, None
        with contextlib.suppress(OSError):
            f.close()

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as e:
                self._f = None
                say(
                    f"geompi: warning: cannot finish the metrics file {self.path} "
                    f"({e.strerror or e})"
                )
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _summary_writer(logdir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            f"--tensorboard {logdir} needs the tensorboard package: pip install tensorboard "
            "(or 'geompi[tensorboard]')"
        ) from None
    return SummaryWriter(log_dir=logdir)


def _to_tensorboard(tb: Any, record: dict) -> None:
    """The scalars of one metrics record."""
    if record.get("event") == "start":
        tb.add_text("config", json.dumps(record.get("config", {}), indent=1), 0)
        return
    if record.get("summary"):
        step = int(record.get("steps", 0))
        for k, v in record.items():
            if k.endswith("_bytes") and isinstance(v, (int, float)):
                tb.add_scalar(f"bytes/{k}", v, step)
        for k, v in record.get("time_split", {}).items():
            tb.add_scalar(f"time/{k}", v, step)
        for k in ("wall_s", "compute_s", "test_acc", "test_loss"):
            if isinstance(record.get(k), (int, float)):
                tb.add_scalar(f"summary/{k}", record[k], step)
        tb.flush()
        return
    step = record.get("step")
    if step is None:
        return
    if record.get("event") == "k2":  # --adaptive-sync chose another K2
        tb.add_scalar("hfa/k2", record["new_k2"], step)
    if "loss" in record:
        tb.add_scalar("train/loss", record["loss"], step)
    if "test_acc" in record:
        tb.add_scalar("test/acc", record["test_acc"], step)
    if "test_loss" in record:
        tb.add_scalar("test/loss", record["test_loss"], step)
