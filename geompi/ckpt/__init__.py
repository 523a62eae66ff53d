"""Checkpoints: one HDF5 file per checkpoint, written atomically, checksummed, never pickled.

The layout is described in docs/checkpoint-format.md. Use :func:`save` and :func:`load` from code,
and ``python -m geompi.ckpt {inspect,verify,diff,export,ls}`` from a shell.

Modules, by concern: ``format`` (layout constants, dtypes, chunk geometry, fingerprint),
``checksum`` (fletcher32), ``files`` (names in a directory), ``writer`` (save), ``reader``
(load, verify), ``export`` and ``cli``.
"""

from __future__ import annotations

from geompi.ckpt.checksum import _fletcher32
from geompi.ckpt.cli import main
from geompi.ckpt.export import EXPORT_SUFFIXES, export
from geompi.ckpt.files import (
    by_write_order,
    checkpoint_name,
    latest,
    lineage,
    list_checkpoints,
    newest_readable,
    prune,
    remove_stale_temps,
    skipped_note,
)
from geompi.ckpt.format import (
    _CHUNK_BYTES,
    _DIRECT_MIN_BYTES,
    _DTYPES,
    FORMAT,
    FORMAT_VERSION,
    REQUIRED_ATTRS,
    REQUIRED_GROUPS,
    fingerprint,
)
from geompi.ckpt.reader import Checkpoint, load, load_state_dict, verify
from geompi.ckpt.writer import save

__all__ = [
    "EXPORT_SUFFIXES",
    "FORMAT",
    "FORMAT_VERSION",
    "REQUIRED_ATTRS",
    "REQUIRED_GROUPS",
    "Checkpoint",
    "by_write_order",
    "checkpoint_name",
    "export",
    "fingerprint",
    "latest",
    "lineage",
    "list_checkpoints",
    "load",
    "load_state_dict",
    "main",
    "newest_readable",
    "prune",
    "remove_stale_temps",
    "save",
    "skipped_note",
    "verify",
]
# Private names that tests and bench/ read (not part of the API).
_PRIVATE = (_CHUNK_BYTES, _DIRECT_MIN_BYTES, _DTYPES, _fletcher32)
