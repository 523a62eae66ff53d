"""User-facing error types: one subclass of GeompiError per kind of mistake.

Every message is a single line that names the problem and the fix. The entry points turn these
into one line on stderr from one rank and abort every rank together.
"""

from __future__ import annotations

import math

from geompi.logs import emit

PREFIX = "geompi: error: "  # the start of every error line a user sees

# Bounds past which a setting is a typo, not a run: refused in one line before anything starts
# (beyond them a value overflowed into a traceback, a crash, or a run of 4.6e18 steps).
MAX_STEPS = 10**9  # --steps, --k1, --k2 and K1*K2, and the steps --epochs comes to
MAX_LR = 1e4  # --lr, --outer-lr


def say(msg: str) -> None:
    """One line through the ``geompi`` logger (geompi.logs): ERROR for ``geompi: error:``,
    WARNING for ``geompi: warning:``, else INFO; by default the bare line on stderr."""
    emit(msg)


class GeompiError(Exception):
    """Base class of every error geompi reports to a user (as opposed to a bug)."""


class ConfigError(GeompiError):
    """An invalid flag, environment variable or combination of settings."""


class TopologyError(ConfigError):
    """The world size and the topology settings do not fit together."""


class DataError(GeompiError):
    """A dataset is missing, unreadable or too small for the requested run."""


class CheckpointError(GeompiError):
    """A checkpoint cannot be written, or is corrupt, truncated or of another model."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint file could not be written (full disk, quota, I/O error): the run's data
    is intact, so training can go on without that checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint of another model than this run's: refused, never skipped as a
    damaged one (``--resume latest`` would then write over it)."""


class ProtocolError(GeompiError):
    """Ranks disagree about a round (e.g. KVStore keys pushed in different orders)."""


class CommTimeoutError(GeompiError):
    """A server waited longer than --comm-timeout for a peer (a lost or stuck rank).

    ``quiet``: another rank reported the same loss; this one ends without a line."""

    quiet: bool = False


class NonFiniteError(GeompiError):
    """A NaN or Inf reached a local server while --on-nonfinite is abort."""


def positive_number(x: object) -> bool:
    """Whether ``x`` is a finite int or float above 0 (not a bool, a string or a tensor): what
    the API's numeric settings take, checked before any arithmetic can raise a traceback."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0
