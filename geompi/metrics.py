"""The JSON-lines metrics log that rank 0 writes."""

from __future__ import annotations

import contextlib
import json
import time
from typing import IO

from geompi.runtime import say


class MetricsLog:
    """Append one JSON object per line to ``path`` (nothing when path is None)."""

    def __init__(self, path: str | None) -> None:
        self.records = 0
        self.path = path
        self._f: IO[str] | None = open(path, "a") if path else None  # noqa: SIM115
        self._t0 = time.time()

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
