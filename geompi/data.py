"""Datasets, per-worker shards, a resumable batch loader and evaluation.

Every dataset is loaded whole into memory as float32 tensors of shape (N, C, H, W), normalized
with the training set's per-channel mean and standard deviation. Every user-facing failure is a
one-line `DataError` (or `ConfigError`) that names the problem and the fix.

``--dataset pkg.module:factory`` loads the user's own data: ``factory(data_dir)`` (``data_dir``
is ``--data-dir``, or None) returns ``(x_train, y_train, x_test, y_test)`` or ``(x_train,
y_train, x_test, y_test, num_classes)``, torch tensors or numpy arrays, inputs of shape
(N, C, H, W), (N, H, W) or (N, F) and integer labels 0..K-1 (K = ``num_classes``, else the
largest label + 1). It runs on every worker after ``torch.manual_seed(--seed)`` and must return
the same data on each, as the built-ins do; the result goes through the same checks and
normalization as theirs (see :func:`user_dataset`).
"""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from torch import nn

from geompi import factory
from geompi.errors import CheckpointError, ConfigError, DataError

DATASETS = ("digits", "mnist", "fashion-mnist", "hdf5", "synthetic")

DIGITS_TEST_SIZE = 360
IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_PRETTY = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST"}
_HDF5_SUFFIXES = (".h5", ".hdf5")
MAX_CLASSES = 100_000  # more output classes than this is a labelling mistake, not a dataset


@dataclass
class Dataset:
    """A classification dataset in memory: float32 images (N, C, H, W) and int64 labels."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The shape (C, H, W) of one sample."""
        c, h, w = self.x_train.shape[1:]
        return (int(c), int(h), int(w))


def load_dataset(
    name: str, data_dir: str | None = None, *, synthetic_size: int = 4096, seed: int = 0
) -> Dataset:
    """Load dataset `name` (one of DATASETS, or a ``module:factory`` spec); mnist,
    fashion-mnist, hdf5 and factories read `data_dir`."""
    if factory.is_spec(name):
        return user_dataset(name, data_dir)
    if name == "digits":
        return _load_digits()
    if name in ("mnist", "fashion-mnist"):
        return _load_idx(name, data_dir)
    if name == "hdf5":
        return _load_hdf5(data_dir)
    if name == "synthetic":
        return _make_synthetic(synthetic_size, seed)
    raise ConfigError(
        f"unknown --dataset {name!r}: choose one of {', '.join(DATASETS)}, or pass "
        "pkg.module:factory"
    )


def user_dataset(spec: str, data_dir: str | None = None) -> Dataset:
    """The dataset of ``--dataset spec``: ``factory(data_dir)`` (or ``factory()`` when it
    takes no argument), checked and normalized like a built-in (both splits non-empty, finite
    inputs, labels within 0..num_classes-1). It returns tensors or arrays, or two map-style
    torch Datasets of ``(x, label)`` (and optionally ``num_classes``)."""
    make = factory.resolve("--dataset", spec)
    args = (data_dir,) if factory.accepts(make, data_dir) or not factory.accepts(make) else ()
    out = factory.call("--dataset", spec, make, *args, error=DataError)
    where = f"--dataset {spec}"
    if isinstance(out, (tuple, list)) and len(out) in (2, 3) and _is_map_dataset(out[0]):
        out = _from_datasets(where, out)
    form = "(x_train, y_train, x_test, y_test[, num_classes]) or (train_set, test_set)"
    if not isinstance(out, (tuple, list)) or len(out) not in (4, 5):
        what = f"a {len(out)}-tuple" if isinstance(out, (tuple, list)) else type(out).__name__
        raise DataError(f"{where}: the factory returned {what}, not {form}")
    parts = {}
    for key, value in zip(("x_train", "y_train", "x_test", "y_test"), out[:4], strict=False):
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise DataError(
                f"{where}: {key} is a {type(value).__name__}, not a torch tensor or numpy array: "
                f"return {form}"
            )
        try:
            parts[key] = torch.as_tensor(value).detach().cpu()
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"{where}: {key} is not numeric: {factory.brief(e)}") from None
    for split in ("train", "test"):
        x, y = parts[f"x_{split}"], parts[f"y_{split}"]
        if x.dim() == 2:
            x = x[:, None, None, :]
        elif x.dim() == 3:
            x = x[:, None, :, :]
        elif x.dim() != 4:
            raise DataError(
                f"{where}: x_{split} has shape {tuple(x.shape)}: use (N, C, H, W), (N, H, W) or "
                "(N, F)"
            )
        if x.is_complex() or not (x.is_floating_point() or x.dtype == torch.bool or _is_int(x)):
            raise DataError(f"{where}: x_{split} has dtype {x.dtype}: store real numbers")
        if y.dim() == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.dim() != 1 or len(y) != len(x):
            raise DataError(
                f"{where}: y_{split} has shape {tuple(y.shape)} but x_{split} has {len(x)} "
                "samples: return one integer label per sample"
            )
        if not _is_int(y):
            raise DataError(
                f"{where}: y_{split} has dtype {y.dtype}: labels are integer class indices 0..K-1"
            )
        parts[f"x_{split}"], parts[f"y_{split}"] = x, y.to(torch.int64)
    if parts["x_train"].shape[1:] != parts["x_test"].shape[1:]:
        raise DataError(
            f"{where}: train samples have shape {tuple(parts['x_train'].shape[1:])} but test "
            f"samples {tuple(parts['x_test'].shape[1:])}: both splits need the same sample shape"
        )
    if len(out) == 5:
        num_classes = out[4]
        if not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool):
            raise DataError(
                f"{where}: num_classes is {num_classes!r}, not a whole number: return {form}"
            )
        num_classes = int(num_classes)
    else:
        labels = [parts[k] for k in ("y_train", "y_test") if len(parts[k])]
        num_classes = max([2] + [int(y.max()) + 1 for y in labels])
    if not 2 <= num_classes <= MAX_CLASSES:
        raise DataError(
            f"{where}: {num_classes} classes: use 2..{MAX_CLASSES} (labels are class indices "
            "0..K-1)"
        )
    return _finish(
        spec, parts["x_train"], parts["y_train"], parts["x_test"], parts["y_test"], num_classes
    )


def _is_map_dataset(obj) -> bool:
    """A map-style dataset (``len`` and integer indexing), not an array of samples."""
    if isinstance(obj, (torch.Tensor, np.ndarray, str, bytes, tuple, list, dict)):
        return False
    return hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def _from_datasets(where: str, out) -> tuple:
    """``(train_set, test_set[, num_classes])`` of map-style datasets as the tensors of the
    array form: every ``(x, label)`` read once, in index order."""
    parts = []
    for split, ds in zip(("train", "test"), out[:2], strict=True):
        if not _is_map_dataset(ds):
            raise DataError(
                f"{where}: the {split} set is a {type(ds).__name__}, not a map-style torch "
                "Dataset of (x, label): return (train_set, test_set)"
            )
        xs, ys = [], []
        for i in range(len(ds)):
            item = ds[i]
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise DataError(
                    f"{where}: {split}_set[{i}] is a {type(item).__name__}, not an (x, label) "
                    "pair: make __getitem__ return (x, label)"
                )
            try:
                xs.append(torch.as_tensor(item[0]).detach().cpu())
                ys.append(torch.as_tensor(item[1]).detach().cpu().reshape(()))
            except (TypeError, ValueError, RuntimeError) as e:
                raise DataError(
                    f"{where}: {split}_set[{i}] is not (a numeric x, one label): {factory.brief(e)}"
                ) from None
        if not xs:
            parts += [torch.zeros(0, 1), torch.zeros(0, dtype=torch.int64)]
            continue
        shapes = {tuple(x.shape) for x in xs}
        if len(shapes) > 1:
            raise DataError(
                f"{where}: the {split} set's samples have {len(shapes)} shapes "
                f"({', '.join(map(str, sorted(shapes)[:3]))}): every x needs the same shape"
            )
        parts += [torch.stack(xs), torch.stack(ys)]
    return (*parts, *out[2:])


def digest(ds: Dataset) -> str:
    """A checksum of the data (shapes and bytes of both splits), to compare across workers."""
    crc = 0
    for t in (ds.x_train, ds.y_train, ds.x_test, ds.y_test):
        crc = zlib.crc32(repr(tuple(t.shape)).encode(), crc)
        crc = zlib.crc32(t.contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def _is_int(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _finish(
    name: str,
    x_train: np.ndarray | torch.Tensor,
    y_train: np.ndarray | torch.Tensor,
    x_test: np.ndarray | torch.Tensor,
    y_test: np.ndarray | torch.Tensor,
    num_classes: int,
) -> Dataset:
    """Check, convert to tensors and normalize both splits with the train split's stats.

    Every loader ends here, so the checks that hold for any dataset live here: both splits
    non-empty, finite inputs, labels within 0..num_classes-1 and a plausible class count.
    """
    xtr = torch.as_tensor(x_train, dtype=torch.float32)
    xte = torch.as_tensor(x_test, dtype=torch.float32)
    _check_split(name, "train", xtr, y_train, num_classes)
    _check_split(name, "test", xte, y_test, num_classes)
    mean = xtr.mean(dim=(0, 2, 3), keepdim=True)
    std = xtr.std(dim=(0, 2, 3), keepdim=True)
    std = torch.where(std > 1e-8, std, torch.ones_like(std))
    return Dataset(
        name=name,
        x_train=((xtr - mean) / std).contiguous(),
        y_train=torch.as_tensor(y_train, dtype=torch.int64).contiguous(),
        x_test=((xte - mean) / std).contiguous(),
        y_test=torch.as_tensor(y_test, dtype=torch.int64).contiguous(),
        num_classes=int(num_classes),
    )


def _check_split(name: str, split: str, x: torch.Tensor, y, num_classes: int) -> None:
    """One line per problem: an empty split, NaN/Inf inputs, labels out of range."""
    if len(x) == 0:
        raise DataError(
            f"{name}: the {split} split is empty: add {split} samples (accuracy needs a test split)"
        )
    if not bool(torch.isfinite(x).all()):
        raise DataError(f"{name}: the {split} inputs hold NaN or Inf: clean the data")
    y = torch.as_tensor(y)
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(
            f"{name}: the {split} labels span {int(y.min())}..{int(y.max())}, outside "
            f"0..{num_classes - 1}: store class indices 0..K-1"
        )


# --- digits -------------------------------------------------------------------------------------


def digits_split(labels: np.ndarray, test_size: int = DIGITS_TEST_SIZE) -> tuple[np.ndarray, ...]:
    """Fixed stratified split: (train indices, test indices), both sorted, from RandomState(0).

    Each class gives its proportional share of `test_size` (largest remainders round up).
    """
    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * test_size / len(labels)
    take = np.floor(quota).astype(np.int64)
    # Hand out the remaining test slots by largest fractional part (ties: lower class first).
    order = np.lexsort((classes, -(quota - take)))
    take[order[: test_size - int(take.sum())]] += 1
    rng = np.random.RandomState(0)
    test = []
    for cls, k in zip(classes, take, strict=True):
        members = np.flatnonzero(labels == cls)
        test.append(members[rng.permutation(len(members))[:k]])
    test_idx = np.sort(np.concatenate(test))
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)
    return train_idx, test_idx


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digits (pixels 0..16) and their labels, from scikit-learn's own copy
    (scikit-learn is the optional ``geompi[sklearn]`` extra).

    The CSV file is read directly: importing ``sklearn.datasets`` costs about a second per
    rank (scipy and more), which a 16-rank start pays 16 times over on a small node.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        csv = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            with gzip.open(csv, "rt") as fh:
                table = np.loadtxt(fh, delimiter=",", dtype=np.float64)
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    try:  # another layout of scikit-learn: ask it
        from sklearn.datasets import load_digits
    except ImportError:  # an optional dependency: the only dataset that needs it
        raise DataError(
            "--dataset digits needs scikit-learn (it ships the digits): "
            "pip install 'geompi[sklearn]', or choose another --dataset (synthetic needs nothing)"
        ) from None
    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def _load_digits() -> Dataset:
    images, y = _digits_arrays()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    train_idx, test_idx = digits_split(y)
    return _finish("digits", x[train_idx], y[train_idx], x[test_idx], y[test_idx], 10)


# --- MNIST-style IDX files ----------------------------------------------------------------------


def read_idx(path: str | os.PathLike[str], dataset: str = "idx") -> np.ndarray:
    """Read one IDX file (plain or gzip-compressed, by its .gz suffix) into a numpy array."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{dataset}: {path} not found: check --data-dir") from None
    except (OSError, EOFError, zlib.error) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{dataset}: cannot read {path} ({reason}); download it again") from None
    if len(raw) < 4:
        raise DataError(
            f"{dataset}: {path} is corrupt (only {len(raw)} bytes, no IDX header); "
            "download it again"
        )
    magic = int.from_bytes(raw[:4], "big")
    dtype = _IDX_DTYPES.get(raw[2])
    ndim = raw[3]
    if raw[0] != 0 or raw[1] != 0 or dtype is None or ndim == 0:
        raise DataError(
            f"{dataset}: {path} is corrupt (bad magic number 0x{magic:08x}); download it again"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{dataset}: {path} is corrupt (truncated IDX header); download it again")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    itemsize = np.dtype(dtype).itemsize
    expected = header + int(np.prod(dims, dtype=np.int64)) * itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "has trailing bytes"
        raise DataError(
            f"{dataset}: {path} is corrupt ({what}: {len(raw)} bytes, expected {expected} for "
            f"shape {dims}); download it again"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


def _find_idx(name: str, directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / (stem + ".gz")):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"{name}: {directory / stem}(.gz) not found: pass --data-dir with the four "
        f"{_PRETTY[name]} IDX files"
    )


def _load_idx(name: str, data_dir: str | None) -> Dataset:
    pretty = _PRETTY[name]
    if data_dir is None:
        raise DataError(
            f"{name} needs --data-dir: pass --data-dir with the four {pretty} IDX files "
            f"({', '.join(IDX_FILES.values())}, plain or .gz)"
        )
    directory = Path(data_dir)
    if not directory.is_dir():
        raise DataError(
            f"{name}: --data-dir {directory} is not a directory: pass the directory holding the "
            f"four {pretty} IDX files"
        )
    arrays = {}
    for key, stem in IDX_FILES.items():
        path = _find_idx(name, directory, stem)
        arr = read_idx(path, name)
        want = 3 if key.startswith("x") else 1
        if arr.ndim != want:
            raise DataError(
                f"{name}: {path} has {arr.ndim} dimensions, expected {want} ({stem} should hold "
                f"{'images' if want == 3 else 'labels'}); check the file names in --data-dir"
            )
        arrays[key] = (arr, path)
    for split in ("train", "test"):
        (x, xpath), (y, ypath) = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if len(x) != len(y):
            raise DataError(
                f"{name}: {xpath} has {len(x)} images but {ypath} has {len(y)} labels; "
                "download both again"
            )
        if len(y) and (int(y.min()) < 0 or int(y.max()) > 9):
            raise DataError(
                f"{name}: {ypath} has labels outside 0..9 ({int(y.min())}..{int(y.max())}); "
                "download it again"
            )
    if arrays["x_train"][0].shape[1:] != arrays["x_test"][0].shape[1:]:
        raise DataError(
            f"{name}: train images are {arrays['x_train'][0].shape[1:]} but test images are "
            f"{arrays['x_test'][0].shape[1:]}; download the four files from one source"
        )

    def images(key: str) -> np.ndarray:
        arr = arrays[key][0].astype(np.float32)
        if arrays[key][0].dtype == np.uint8:
            arr /= 255.0
        return arr[:, None, :, :]

    return _finish(
        name,
        images("x_train"),
        arrays["y_train"][0].astype(np.int64),
        images("x_test"),
        arrays["y_test"][0].astype(np.int64),
        10,
    )


# --- HDF5 ---------------------------------------------------------------------------------------


def _find_hdf5(data_dir: str | None) -> Path:
    hint = "a .h5 file with /train/x, /train/y, /test/x, /test/y"
    if data_dir is None:
        raise DataError(f"hdf5 needs --data-dir: pass --data-dir with {hint}")
    path = Path(data_dir)
    if path.is_file():
        return path
    if not path.is_dir():
        raise DataError(f"hdf5: --data-dir {path} not found: pass {hint} or its directory")
    if (path / "dataset.h5").is_file():
        return path / "dataset.h5"
    found = sorted(p for p in path.iterdir() if p.suffix in _HDF5_SUFFIXES and p.is_file())
    if len(found) != 1:
        what = "no .h5/.hdf5 file" if not found else f"{len(found)} .h5/.hdf5 files"
        raise DataError(f"hdf5: {path} holds {what}: pass --data-dir with the path of {hint}")
    return found[0]


# What an --dataset hdf5 file may declare, in all (its datasets are read whole into every rank)
HDF5_MAX_BYTES_VAR = "GEOMPI_HDF5_MAX_BYTES"
HDF5_MAX_BYTES = 4 << 30
# deflate expands at most about 1032:1; a dataset declaring more than that is not real data
_DEFLATE_RATIO = 1032
# Errors that h5py and HDF5 raise on damaged or hostile files: one line, never a traceback
_H5_ERRORS = (OSError, ValueError, TypeError, KeyError, RuntimeError, MemoryError, OverflowError)


def _hdf5_max_bytes() -> int:
    raw = os.environ.get(HDF5_MAX_BYTES_VAR)
    if raw is None:
        return HDF5_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise DataError(f"{HDF5_MAX_BYTES_VAR}={raw!r}: use a whole number of bytes >= 1")
    return value


def _open_hdf5(path: Path) -> tuple[Any, dict[str, Any]]:
    """The open file and its four datasets (h5py.Dataset), each checked as untrusted input
    (geompi.h5untrusted) before anything is read: no link but hard links on the way to them
    (an external link to a FIFO would block, a soft link may loop), no external storage, no
    virtual dataset, only the gzip, shuffle and fletcher32 filters, real numbers (no complex,
    compound, string or object data), and at most GEOMPI_HDF5_MAX_BYTES declared in all."""
    import h5py

    from geompi.h5untrusted import (
        DatasetPolicy,
        check_dataset,
        check_link,
        check_regular_file,
        real_type,
    )

    def fail(msg: str) -> NoReturn:
        raise DataError(f"hdf5: {path}: {msg}")

    def untrusted(what: str) -> str:
        return f"{what}, which --dataset hdf5 does not read: write the datasets themselves"

    size = check_regular_file(path, fail)
    cap = _hdf5_max_bytes()
    policy = DatasetPolicy(
        filters=frozenset(
            {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32}
        ),
        type_ok=real_type,
        type_words="real numbers (integers, floats or bools)",
        max_bytes=min(cap, max(size, 1) * _DEFLATE_RATIO),
        fix=(
            f"a file this size ({size} bytes) cannot hold it, or it exceeds "
            f"{HDF5_MAX_BYTES_VAR}={cap}; write the file again or raise {HDF5_MAX_BYTES_VAR}"
        ),
    )
    try:
        fh = h5py.File(path, "r")
    except _H5_ERRORS as exc:
        reason = str(exc).splitlines()[0] if str(exc) else "unreadable"
        raise DataError(
            f"hdf5: cannot open {path} as HDF5 ({reason}): pass an HDF5 file with /train/x, "
            "/train/y, /test/x, /test/y"
        ) from None
    try:
        datasets: dict[str, Any] = {}
        total = 0
        for split in ("train", "test"):
            for part in ("x", "y"):
                key = f"/{split}/{part}"
                gid = fh.id
                for depth, component in enumerate((split, part)):
                    raw = component.encode()
                    name = "/" + "/".join((split, part)[: depth + 1])
                    if not gid.links.exists(raw):
                        raise DataError(
                            f"hdf5: {path} has no dataset {key}: the file needs /train/x, "
                            "/train/y, /test/x and /test/y"
                        )
                    check_link(gid, raw, name, fail, untrusted)
                    oid = h5py.h5o.open(gid, raw)
                    kind = h5py.h5o.get_info(oid).type
                    want = h5py.h5o.TYPE_DATASET if depth else h5py.h5o.TYPE_GROUP
                    if kind != want:
                        raise DataError(
                            f"hdf5: {path} has no dataset {key} ({name} is not a "
                            f"{'dataset' if depth else 'group'}): the file needs /train/x, "
                            "/train/y, /test/x and /test/y"
                        )
                    gid = oid
                total += check_dataset(gid, key, size, policy, fail, untrusted)
                if total > policy.max_bytes:
                    fail(
                        f"its datasets declare {total} bytes in all, more than the "
                        f"{policy.max_bytes} bytes allowed: {policy.fix}"
                    )
                datasets[key] = fh[key]
        attrs: dict[str, Any] = {}
        if "num_classes" in fh.attrs:
            aid = h5py.h5a.open(fh.id, b"num_classes")
            cls = aid.get_type().get_class()
            if (
                cls not in (h5py.h5t.INTEGER, h5py.h5t.FLOAT)
                or aid.get_space().get_simple_extent_npoints() != 1
            ):
                fail(
                    f"its num_classes attribute holds {aid.shape or 'one'} "
                    f"{'number' if cls in (h5py.h5t.INTEGER, h5py.h5t.FLOAT) else 'non-number'}"
                    " value(s), not one integer: store the number of classes"
                )
            attrs["num_classes"] = fh.attrs["num_classes"]
    except DataError:
        fh.close()
        raise
    except _H5_ERRORS as exc:
        fh.close()
        reason = str(exc).splitlines()[0] if str(exc) else "unreadable"
        raise DataError(f"hdf5: cannot read {path} ({reason}); write the file again") from None
    return fh, {"datasets": datasets, "attrs": attrs}


def _load_hdf5(data_dir: str | None) -> Dataset:
    path = _find_hdf5(data_dir)
    fh, found = _open_hdf5(path)
    with fh:
        arrays = {}
        for key, obj in found["datasets"].items():
            try:
                arrays[key] = obj[()]
            except _H5_ERRORS as exc:
                reason = str(exc).splitlines()[0] if str(exc) else "read error"
                raise DataError(
                    f"hdf5: cannot read {key} from {path} ({reason}); write the file again"
                ) from None
        declared = found["attrs"].get("num_classes")
    xs, ys = {}, {}
    for split in ("train", "test"):
        x, y = arrays[f"/{split}/x"], arrays[f"/{split}/y"]
        xs[split] = _hdf5_images(path, split, x)
        ys[split] = _hdf5_labels(path, split, y, len(x))
    if xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise DataError(
            f"hdf5: {path} has train samples of shape {xs['train'].shape[1:]} but test samples of "
            f"shape {xs['test'].shape[1:]}: both splits need the same sample shape"
        )
    if len(ys["train"]) == 0 or len(ys["test"]) == 0:
        raise DataError(f"hdf5: {path} has an empty /train or /test split: add samples to both")
    top = int(max(ys["train"].max(), ys["test"].max())) + 1
    num_classes = max(top, 2)
    if declared is not None:
        num_classes = int(np.asarray(declared).item())
        if not 2 <= num_classes <= MAX_CLASSES:
            raise DataError(
                f"hdf5: {path} declares num_classes={num_classes}: use 2..{MAX_CLASSES}"
            )
        if top > num_classes:
            raise DataError(
                f"hdf5: {path} declares num_classes={num_classes} but has label {top - 1}: fix "
                "the num_classes attribute or the labels"
            )
    else:
        # An inferred class count is max label + 1: a sentinel such as 65535 (uint16 -1) would
        # build a 65536-way output layer. Refuse labels far beyond the classes actually seen.
        seen = len(np.union1d(ys["train"], ys["test"]))
        if top > MAX_CLASSES or (top > 16 and top > 2 * seen):
            raise DataError(
                f"hdf5: {path} has label {top - 1} but only {seen} distinct labels: store class "
                "indices 0..K-1, or declare the num_classes attribute if classes are absent"
            )
    return _finish("hdf5", xs["train"], ys["train"], xs["test"], ys["test"], num_classes)


def _hdf5_images(path: Path, split: str, x: np.ndarray) -> np.ndarray:
    if x.ndim == 2:
        x = x[:, None, None, :]
    elif x.ndim == 3:
        x = x[:, None, :, :]
    elif x.ndim != 4:
        raise DataError(
            f"hdf5: {path} /{split}/x has shape {x.shape}: use (N, F), (N, H, W) or (N, C, H, W)"
        )
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise DataError(
            f"hdf5: {path} /{split}/x has dtype {x.dtype}: store numbers (uint8 or float)"
        )
    out = x.astype(np.float32)
    if x.dtype == np.uint8:
        out /= 255.0
    if not np.isfinite(out).all():
        raise DataError(f"hdf5: {path} /{split}/x holds NaN or Inf: clean the data")
    return out


def _hdf5_labels(path: Path, split: str, y: np.ndarray, n: int) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or len(y) != n:
        raise DataError(
            f"hdf5: {path} /{split}/y has shape {y.shape} but /{split}/x has {n} samples: store "
            "one integer label per sample"
        )
    if np.issubdtype(y.dtype, np.floating):
        if not (np.isfinite(y).all() and (y == np.round(y)).all()):
            raise DataError(
                f"hdf5: {path} /{split}/y holds non-integer labels: store class indices"
            )
    elif not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"hdf5: {path} /{split}/y has dtype {y.dtype}: store integer labels")
    y = y.astype(np.int64)
    if len(y) and y.min() < 0:
        raise DataError(
            f"hdf5: {path} /{split}/y has negative label {int(y.min())}: use labels 0..K-1"
        )
    return y


# --- synthetic ----------------------------------------------------------------------------------


def _make_synthetic(size: int, seed: int) -> Dataset:
    """Ten Gaussian class clusters in 1x8x8 around smooth templates; learnable, not trivial."""
    if size < 4:
        raise ConfigError(
            f"--synthetic-size {size} is too small: use at least 4 (the test split is a quarter)"
        )
    num_classes = 10
    gen = torch.Generator().manual_seed(int(seed))
    # Smooth class templates (4x4 noise upsampled to 8x8) give the CNN spatial structure to use.
    coarse = torch.randn(num_classes, 1, 4, 4, generator=gen)
    means = 0.7 * nn.functional.interpolate(coarse, size=(8, 8), mode="bilinear")

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(num_classes, (n,), generator=gen)
        return means[y] + torch.randn(n, 1, 8, 8, generator=gen), y

    x_train, y_train = sample(size)
    x_test, y_test = sample(size // 4)
    return _finish("synthetic", x_train, y_train, x_test, y_test, num_classes)


# --- sharding and batches -----------------------------------------------------------------------


def shard_indices(
    num_samples: int,
    num_shards: int,
    shard: int,
    *,
    seed: int,
    labels: torch.Tensor | None = None,
    split_by_class: bool = False,
    name: str | None = None,
) -> torch.Tensor:
    """Indices of shard `shard` of `num_shards` equal, disjoint shards (leftovers dropped).

    IID: consecutive slices of a seeded permutation. split_by_class: the same kept samples,
    stably sorted by label, cut into contiguous slices, so each shard sees few classes.
    """
    if num_shards < 1:
        raise ConfigError(f"number of shards is {num_shards}: need at least 1 worker")
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} is outside 0..{num_shards - 1}")
    per = num_samples // num_shards
    if per == 0:
        what = f"dataset {name}" if name else "the dataset"
        raise DataError(
            f"{what} has {num_samples} training samples, too few for {num_shards} workers: "
            "use fewer workers or a larger dataset"
        )
    gen = torch.Generator().manual_seed(int(seed))
    kept = torch.randperm(num_samples, generator=gen)[: per * num_shards]
    if split_by_class:
        if labels is None or labels.dim() != 1 or len(labels) != num_samples:
            raise ConfigError(
                "split_by_class needs one label per sample: pass labels=dataset.y_train"
            )
        kept = kept[torch.argsort(labels.cpu()[kept], stable=True)]
    return kept[shard * per : (shard + 1) * per].clone()


class ShardLoader:
    """Batches over one shard, reshuffled each epoch from (seed, shard, epoch); resumable.

    `epoch` is the epoch the next batch comes from and `position` the batches already served
    in it (always < steps_per_epoch: the loader rolls over right after an epoch's last batch).
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        indices: torch.Tensor,
        batch_size: int,
        *,
        seed: int,
        shard: int,
    ) -> None:
        if len(x) != len(y):
            raise DataError(f"{len(x)} samples but {len(y)} labels: pass matching x and y")
        indices = torch.as_tensor(indices, dtype=torch.int64).cpu()
        n = len(indices)
        if n and (int(indices.min()) < 0 or int(indices.max()) >= len(x)):
            raise DataError(f"shard indices fall outside the {len(x)} samples: rebuild the shard")
        if batch_size <= 0:
            raise DataError(f"--batch-size {batch_size} must be positive: use e.g. --batch-size 32")
        if batch_size > n:
            raise DataError(
                f"--batch-size {batch_size} is larger than a worker's shard ({n} samples): "
                f"use --batch-size {n} or less"
            )
        self.x, self.y = x, y
        self.indices = indices
        self.batch_size = int(batch_size)
        self.seed, self.shard = int(seed), int(shard)
        self.steps_per_epoch = n // self.batch_size
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            mixed = np.random.SeedSequence(
                [self.seed % 2**64, self.shard % 2**64, self.epoch]
            ).generate_state(2, dtype=np.uint32)
            gen = torch.Generator().manual_seed(int(mixed[0]) << 31 | int(mixed[1]) >> 1)
            perm = torch.randperm(len(self.indices), generator=gen)
            self._order = self.indices[perm].to(self.x.device)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the next (x, y) batch and advance, rolling over into the next epoch."""
        order = self._epoch_order()
        start = self.position * self.batch_size
        idx = order[start : start + self.batch_size]
        self.position += 1
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        return self.x.index_select(0, idx), self.y.index_select(0, idx.to(self.y.device))

    def state_dict(self) -> dict[str, int]:
        """The loader's place: {"epoch", "position"}."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a place from state_dict(), so the same batches follow."""
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"loader state {state!r} lacks integer 'epoch' and 'position': use a checkpoint "
                "written by geompi"
            ) from None
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise CheckpointError(
                f"loader state epoch={epoch} position={position} does not fit "
                f"{self.steps_per_epoch} steps per epoch: resume with the same --batch-size, "
                "dataset and number of workers"
            )
        self.epoch, self.position = epoch, position


class WorkerData:
    """One worker's training data: the dataset, this worker's shard and the loader over it."""

    def __init__(self, cfg, num_workers: int, worker: int) -> None:
        self.spec = cfg.dataset
        self.ds = load_dataset(
            cfg.dataset, cfg.data_dir, synthetic_size=cfg.synthetic_size, seed=cfg.seed
        )
        # A factory's data must be the same on every worker, as a built-in's is
        # (``check_same``, the first collective of training).
        self.digest = digest(self.ds) if factory.is_spec(cfg.dataset) else None
        idx = shard_indices(
            len(self.ds.y_train),
            num_workers,
            worker,
            seed=cfg.seed,
            labels=self.ds.y_train,
            split_by_class=cfg.split_by_class,
            name=self.ds.name,
        )
        self.loader = ShardLoader(
            self.ds.x_train, self.ds.y_train, idx, cfg.batch_size, seed=cfg.seed, shard=worker
        )

    def check_same(self, all_workers, master: bool) -> None:
        """Collective over ``all_workers``, for a --dataset factory: the master refuses data
        that differ between workers (the shards would overlap and miss samples). The others
        go on into the INIT round, which waits for the master, so its abort ends them there."""
        if self.digest is None:
            return
        digests = all_workers.allgather(self.digest)
        odd = [i for i, d in enumerate(digests) if d != digests[0]]
        if odd and master:
            raise DataError(
                f"--dataset {self.spec}: the factory returned other data on worker {odd[0]} "
                f"than on worker 0 ({len(odd)} of {len(digests)} workers differ): make it "
                "deterministic (torch's generator is seeded with --seed before the call; seed "
                "numpy or random yourself)"
            )


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """Return (accuracy, mean cross-entropy loss) of `model` on (x, y), in eval mode."""
    if len(x) == 0 or len(x) != len(y):
        raise DataError(f"cannot evaluate on {len(x)} samples and {len(y)} labels: check the data")
    param = next(model.parameters(), None)
    device = param.device if param is not None else x.device
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    try:
        for start in range(0, len(x), batch_size):
            xb = x[start : start + batch_size].to(device)
            yb = y[start : start + batch_size].to(device)
            logits = model(xb)
            loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(dim=1) == yb).sum())
    finally:
        model.train(was_training)
    return correct / len(x), loss_sum / len(x)
