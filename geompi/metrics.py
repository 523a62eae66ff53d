"""The JSON-lines metrics log that rank 0 writes."""

from __future__ import annotations

import json
import time
from typing import IO


class MetricsLog:
    """Append one JSON object per line to ``path`` (nothing when path is None)."""

    def __init__(self, path: str | None) -> None:
        self.records = 0
        self._f: IO[str] | None = open(path, "a") if path else None  # noqa: SIM115
        self._t0 = time.time()

    def write(self, record: dict) -> None:
        self.records += 1
        if self._f is not None:
            self._f.write(json.dumps({"time": round(time.time() - self._t0, 4), **record}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
