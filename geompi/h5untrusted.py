"""Opening HDF5 files from strangers: checkpoints (geompi.ckpt.reader) and --dataset hdf5 data.

Everything here looks at a file without following anything out of it: links are inspected with
h5py's low-level API before any is traversed, datasets are checked for where their bytes come
from (external storage, virtual datasets), which filters decode them, what type they hold and how
many bytes they declare, all before a byte of data is read. A problem is reported through the
caller's `fail(msg)`, which raises; the caller words the line (a checkpoint says "use a checkpoint
written by geompi", data "write the file again").
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import h5py

Fail = Callable[[str], NoReturn]

FILTER_NAMES = {
    h5py.h5z.FILTER_DEFLATE: "gzip (deflate)",
    h5py.h5z.FILTER_SHUFFLE: "shuffle",
    h5py.h5z.FILTER_FLETCHER32: "fletcher32",
    h5py.h5z.FILTER_SZIP: "szip",
    h5py.h5z.FILTER_NBIT: "nbit",
    h5py.h5z.FILTER_SCALEOFFSET: "scaleoffset",
}
TYPE_NAMES = {
    h5py.h5t.INTEGER: "integer",
    h5py.h5t.FLOAT: "float",
    h5py.h5t.TIME: "time",
    h5py.h5t.STRING: "string",
    h5py.h5t.BITFIELD: "bitfield",
    h5py.h5t.OPAQUE: "opaque",
    h5py.h5t.COMPOUND: "compound",
    h5py.h5t.REFERENCE: "reference",
    h5py.h5t.ENUM: "enum",
    h5py.h5t.VLEN: "variable-length",
    h5py.h5t.ARRAY: "array",
}


def type_name(tid: h5py.h5t.TypeID) -> str:
    return TYPE_NAMES.get(tid.get_class(), f"HDF5 class {tid.get_class()}")


def _bool_enum(tid: h5py.h5t.TypeID) -> bool:
    base = tid.get_super()
    return base.get_class() == h5py.h5t.INTEGER and base.get_size() == 1


def real_type(tid: h5py.h5t.TypeID) -> bool:
    """int (1, 2, 4, 8 bytes), float (2, 4, 8 bytes) or bool (numpy's 1-byte enum)."""
    cls = tid.get_class()
    if cls == h5py.h5t.INTEGER:
        return tid.get_size() in (1, 2, 4, 8)
    if cls == h5py.h5t.FLOAT:
        return tid.get_size() in (2, 4, 8)
    if cls == h5py.h5t.ENUM:
        return _bool_enum(tid)
    return False


def numeric_type(tid: h5py.h5t.TypeID) -> bool:
    """real_type, or complex (numpy's compound of two floats)."""
    if real_type(tid):
        return True
    if tid.get_class() == h5py.h5t.COMPOUND:
        if tid.get_nmembers() != 2:
            return False
        members = [tid.get_member_type(i) for i in range(2)]
        return all(m.get_class() == h5py.h5t.FLOAT and m.get_size() in (4, 8) for m in members)
    return False


def scalar_attr_type(tid: h5py.h5t.TypeID) -> bool:
    """text, an integer or float of at most 8 bytes, or bool."""
    cls = tid.get_class()
    if cls == h5py.h5t.STRING:
        return True  # its size is checked when it is read
    if cls in (h5py.h5t.INTEGER, h5py.h5t.FLOAT):
        return tid.get_size() <= 8
    if cls == h5py.h5t.ENUM:
        return _bool_enum(tid)
    return False


@dataclass(frozen=True)
class DatasetPolicy:
    """What a dataset may be.

    filters: the HDF5 filter codes allowed. type_ok: the types allowed, and how a refused one is
    described ("numbers", "real numbers"). max_bytes: the most bytes one dataset (and all that
    are checked, together) may declare; None: the file's size (every byte stored uncompressed).
    Compressed data may declare more than the file holds, up to max_bytes.
    """

    filters: frozenset[int]
    type_ok: Callable[[h5py.h5t.TypeID], bool]
    type_words: str
    max_bytes: int | None = None
    fix: str = "use a file written by geompi"


def check_regular_file(path: str | os.PathLike, fail: Fail) -> int:
    """The size of `path`, a regular file (a FIFO or device would block or never end)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        fail("no such file")
    except OSError as e:
        fail(f"cannot be opened ({e.strerror or e})")
    if stat.S_ISDIR(st.st_mode):
        fail("is a directory, not an HDF5 file")
    if not stat.S_ISREG(st.st_mode):
        fail("is not a regular file (a FIFO, socket or device): pass a file")
    return st.st_size


def check_link(
    gid: h5py.h5g.GroupID, raw: bytes, name: str, fail: Fail, untrusted: Callable[[str], str]
) -> None:
    """Refuse anything but a hard link: soft links (cycles, aliases), external links (other
    files: a FIFO blocks forever) and user-defined links. Nothing is followed."""
    info = gid.links.get_info(raw)
    if info.type == h5py.h5l.TYPE_SOFT:
        target = gid.links.get_val(raw).decode("utf-8", "replace")
        fail(untrusted(f"{name} is a soft link to {target}"))
    if info.type == h5py.h5l.TYPE_EXTERNAL:
        file, obj = (v.decode("utf-8", "replace") for v in gid.links.get_val(raw))
        fail(untrusted(f"{name} is an external link to {file}:{obj}"))
    if info.type != h5py.h5l.TYPE_HARD:
        fail(untrusted(f"{name} is a user-defined link (type {info.type})"))


def check_dataset(
    dsid: h5py.h5d.DatasetID,
    name: str,
    file_size: int,
    policy: DatasetPolicy,
    fail: Fail,
    untrusted: Callable[[str], str],
) -> int:
    """Structural checks of one dataset, nothing read; returns the bytes it declares."""
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        fail(untrusted(f"dataset {name} is a virtual dataset (its data is in other files)"))
    if dcpl.get_external_count() > 0:
        file = dcpl.get_external(0)[0].decode("utf-8", "replace")
        fail(untrusted(f"dataset {name} keeps its data in external storage ({file})"))
    compressed = False
    for i in range(dcpl.get_nfilters()):
        code, _, _, fname = dcpl.get_filter(i)
        if code not in policy.filters:
            what = FILTER_NAMES.get(code) or fname.decode("utf-8", "replace") or "unknown"
            allowed = ", ".join(sorted(FILTER_NAMES.get(c, str(c)) for c in policy.filters))
            fail(
                f"dataset {name} uses the {what} filter (HDF5 filter {code}); only {allowed} "
                f"{'is' if len(policy.filters) == 1 else 'are'} allowed (a compressed dataset "
                f"can expand without bound, and plugins are code): {policy.fix}"
            )
        compressed |= code != h5py.h5z.FILTER_FLETCHER32
    tid = dsid.get_type()
    if tid.committed():
        fail(untrusted(f"dataset {name} uses a committed datatype"))
    if not policy.type_ok(tid):
        what = type_name(tid)
        if numeric_type(tid) and tid.get_class() == h5py.h5t.COMPOUND:
            what = "complex"
        fail(untrusted(f"dataset {name} holds {what} data, not {policy.type_words}"))
    space = dsid.get_space()
    if space.get_simple_extent_type() != h5py.h5s.SIMPLE:
        fail(untrusted(f"dataset {name} has a scalar or null dataspace"))
    nbytes = math.prod(space.get_simple_extent_dims()) * tid.get_size()
    limit = policy.max_bytes if compressed and policy.max_bytes is not None else file_size
    if policy.max_bytes is not None:
        limit = min(limit, policy.max_bytes)
    if nbytes > limit:
        if limit == file_size:
            fail(
                f"dataset {name} declares {nbytes} bytes of data, more than the whole file "
                f"({file_size} bytes) holds uncompressed: {policy.fix}"
            )
        fail(
            f"dataset {name} declares {nbytes} bytes of data, more than the {limit} bytes "
            f"allowed: {policy.fix}"
        )
    return nbytes
