"""Checkpoint file names in a directory, and small file-system helpers."""

from __future__ import annotations

import os
import pathlib
import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from geompi.errors import CheckpointError, CheckpointMismatchError

T = TypeVar("T")

_CKPT_RE = re.compile(r"^ckpt-(\d+)\.h5$")
_CREATE = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of `step`, e.g. "ckpt-00001200.h5"."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    return f"ckpt-{int(step):08d}.h5"


def list_checkpoints(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Checkpoint files (ckpt-<step>.h5) in `directory`, oldest step first; temporaries ignored."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def recorded_order(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(sequence, step)`` as the file recorded them when it was written, or None if its
    header cannot be read (a torn or foreign file).

    ``sequence`` is the write order in its directory (``next_sequence``); 0 in files written
    before geompi recorded it. File times are never used: a copy, a restore or a clock that
    runs ahead on one node of a shared filesystem dates an old checkpoint after a new one.
    """
    import h5py

    from geompi.ckpt.format import _LOCKING

    try:
        if not h5py.is_hdf5(path):
            return None
        with h5py.File(path, "r", **_LOCKING) as f:
            values = [_scalar_int(f, key) for key in ("sequence", "step")]
    except Exception:  # noqa: BLE001 - any damage: the file's order is unknown
        return None
    if values[0] is None or values[1] is None:
        return None
    return values[0], values[1]


def _scalar_int(f, key: str) -> int | None:
    """Root attribute `key` if it is a non-negative integer scalar, 0 if absent, else None;
    its type and shape are checked before anything is read (the file is not trusted)."""
    if key not in f.attrs:
        return 0
    aid = f.attrs.get_id(key)
    if aid.shape != () or aid.dtype.kind not in "iu":
        return None
    v = int(f.attrs[key])
    return v if v >= 0 else None


def next_sequence(directory: str | os.PathLike) -> int:
    """The write order the next checkpoint of `directory` records: one more than any there."""
    orders = [recorded_order(p) for p in list_checkpoints(directory)]
    return 1 + max((o[0] for o in orders if o is not None), default=0)


def _ordered(directory: str | os.PathLike) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(the readable checkpoints, newest first by recorded write order then step; the
    unreadable ones, highest step in the name first)."""
    readable, unreadable = [], []
    for p in list_checkpoints(directory):
        order = recorded_order(p)
        if order is None:
            unreadable.append((_name_step(p), p))
        else:
            readable.append((order, p))
    return (
        [p for _, p in sorted(readable, key=lambda t: t[0], reverse=True)],
        [p for _, p in sorted(unreadable, key=lambda t: t[0], reverse=True)],
    )


def _name_step(p: pathlib.Path) -> int:
    m = _CKPT_RE.match(p.name)
    return int(m.group(1)) if m else -1


def by_write_order(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Checkpoint files of `directory`, the one written last first, by the write order and
    step each file recorded (never by file times); files whose header cannot be read come
    first, so that ``--resume latest`` tries them and says why it skipped them.

    After a resume from an older checkpoint, the files this run writes have lower steps than
    the abandoned ones: the step in the name does not say which is newest, the write does.
    """
    readable, unreadable = _ordered(directory)
    return unreadable + readable


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The checkpoint of `directory` written last, or None if there is none."""
    found = by_write_order(directory)
    return found[0] if found else None


def newest_readable(
    directory: str | os.PathLike, read: Callable[[pathlib.Path], T]
) -> tuple[pathlib.Path, T, list[tuple[pathlib.Path, CheckpointError]]] | None:
    """The checkpoint of `directory` written last that `read` reads: ``(path, what read
    returned, the files skipped before it, newest first, each with its error)``; None where
    the directory holds no checkpoint. Only an unreadable file (a torn write, a corrupt one)
    is skipped: a file that does not fit (CheckpointMismatchError) is raised, and so is the
    newest file's error where none can be read. ``--resume latest`` and ``geompi.latest``."""
    skipped: list[tuple[pathlib.Path, CheckpointError]] = []
    for path in by_write_order(directory):
        try:
            got = read(path)
        except CheckpointMismatchError:
            raise
        except CheckpointError as e:
            skipped.append((path, e))
            continue
        return path, got, skipped
    if skipped:
        raise skipped[0][1]
    return None


def skipped_note(who: str, skipped: list[tuple[pathlib.Path, CheckpointError]], path) -> str:
    """The one line that says which files :func:`newest_readable` skipped for ``path``."""
    first, err = skipped[0]
    return (
        f"geompi: {who}: skipped {len(skipped)} unusable checkpoint(s), newest {first.name} "
        f"({err}); resuming from {pathlib.Path(path).name} instead"
    )


def lineage(written: Sequence[os.PathLike], resumed_from: os.PathLike | None) -> list[pathlib.Path]:
    """What a run's checkpoints descend from, newest first: the files it wrote (``written``,
    newest first), the file it resumed from, then the files of lower step than that one beside
    it. :func:`prune` keeps these before any other (the command line's runs and
    ``geompi.save(keep=)`` alike), so a run resumed from an older checkpoint keeps its own
    past rather than the abandoned files written after it."""
    out = [pathlib.Path(p) for p in written]
    if resumed_from is not None:
        base = pathlib.Path(resumed_from)
        out.append(base)
        older = [p for p in list_checkpoints(base.parent) if p.name < base.name and p not in out]
        out += reversed(older)
    return out


def prune(
    directory: str | os.PathLike, keep: int, lineage: Sequence[os.PathLike] = ()
) -> list[pathlib.Path]:
    """Delete all but the newest `keep` (>= 1) checkpoints of `directory`; return the deleted.

    `lineage` (newest first) is what this run wrote and descends from, the file just written
    first: those rank first and its first file is never deleted; the rest rank by the write
    order the files recorded, and files that cannot be read rank last.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, not {keep!r}")
    readable, unreadable = _ordered(directory)
    present = readable + unreadable
    mine = [pathlib.Path(p) for p in lineage]
    ranked = [p for p in mine if p in present]
    ranked += [p for p in present if p not in ranked]
    old = ranked[keep:][::-1]  # oldest first
    for p in old:
        p.unlink(missing_ok=True)
    return old


_TEMP_RE = re.compile(
    r"^(?:\.ckpt-\d+\.h5\.tmp|\.geompi-write-test)-(?P<host>[A-Za-z0-9._-]+?)-(?P<pid>\d+)-\w+$"
)
STALE_TEMP_S = 24 * 3600  # a temporary from another host is left alone for a day


def remove_stale_temps(directory: str | os.PathLike) -> list[pathlib.Path]:
    """Remove the temporaries (``create_temp``) and probes of writers that were killed.

    One from this host goes once its process is gone; one from another host (whose processes
    cannot be asked) once it is a day old. Returns what was removed.
    """
    d = pathlib.Path(directory)
    if not d.is_dir():
        return []
    removed = []
    now = time.time()
    for p in d.iterdir():
        m = _TEMP_RE.match(p.name)
        if not m or p.is_symlink() or not p.is_file():
            continue
        if m.group("host") == _host():
            stale = not _alive(int(m.group("pid")))
        else:
            try:
                stale = now - p.stat().st_mtime > STALE_TEMP_S
            except OSError:
                continue
        if stale:
            _remove_quietly(p)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def _fsync_path(path: pathlib.Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return  # some platforms cannot open directories; the rename itself is done
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some filesystems refuse fsync on a directory
            raise
    finally:
        os.close(fd)


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno:
        return os.strerror(e.errno)
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _remove_quietly(p: pathlib.Path | None) -> None:
    if p is None:
        return
    try:
        p.unlink(missing_ok=True)
    except OSError:
        pass


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"


def create_temp(directory: str | os.PathLike, name: str) -> tuple[int, pathlib.Path]:
    """Create a new empty file ``.NAME.tmp-HOST-PID-RANDOM`` in `directory`; (fd, path).

    O_CREAT|O_EXCL|O_NOFOLLOW: never opens what is already there (a symlink someone planted in
    a shared directory), and the name is unique across nodes and unpredictable. The mode is
    0666 less the umask, like any file the process creates.
    """
    d = pathlib.Path(directory)
    for _ in range(100):
        tmp = d / f".{name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            return os.open(tmp, _CREATE, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name} in {d}")


def same_file(fd: int, path: pathlib.Path) -> bool:
    """Whether `path` (not followed if a symlink) is still the file open as `fd`."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
