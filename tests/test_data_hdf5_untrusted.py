"""--dataset hdf5 reads files from strangers with the checkpoint reader's defences (issue 35,
item 5): each hostile file is refused in one line, before anything is allocated or followed.

Each case runs the loader in a child process with a hard timeout and a 2 GiB address-space
limit, so that on a reader without the defences a hang or an 8 GiB allocation fails the test
instead of the machine."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from geompi.data import load_dataset
from geompi.errors import DataError
from tests.mpirun import error_lines, mpirun

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
LOADER = (
    "import sys\n"
    "from geompi.data import load_dataset\n"
    "from geompi.errors import DataError\n"
    "try:\n"
    "    ds = load_dataset('hdf5', sys.argv[1])\n"
    "except DataError as e:\n"
    "    print(e, file=sys.stderr)\n"
    "    sys.exit(1)\n"
    "print('loaded', ds.num_classes)\n"
)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def load_in_child(path: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    """The loader in a child process; a hang raises (fails the test) after `timeout` s."""
    return subprocess.run(
        [sys.executable, "-c", LOADER, str(path)],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_limit_memory,
    )


def splits(f: h5py.File, skip: str = "") -> None:
    """A valid /train and /test (6 and 4 samples of 2x2, labels 0..1), but for `skip`."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("test", 4)):
        if f"/{split}/x" != skip:
            f[f"{split}/x"] = rng.random((n, 2, 2)).astype(np.float32)
        if f"/{split}/y" != skip:
            f[f"{split}/y"] = np.arange(n) % 2


def external_link_to_fifo(path: Path) -> list[str]:
    fifo = path.parent / "pipe.h5"
    os.mkfifo(fifo)
    with h5py.File(path, "w") as f:
        splits(f, skip="/train/x")
        f["train/x"] = h5py.ExternalLink(str(fifo), "/x")
    return ["/train/x", "external link"]


def gzip_declaring_8_gib(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        splits(f, skip="/train/x")
        f.create_dataset(
            "train/x",
            shape=(8 << 27, 2, 2, 2),
            dtype="u1",
            chunks=(1 << 20, 2, 2, 2),
            compression="gzip",
        )  # 8 GiB declared, no chunk written: a file of a few kB
    assert path.stat().st_size < 1 << 20
    return ["/train/x", "declares 8589934592 bytes"]


def soft_link_loop(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        f["train"] = h5py.SoftLink("/test/loop")
        f["test/loop"] = h5py.SoftLink("/train")
        f["test/x"] = np.zeros((4, 2), np.float32)
        f["test/y"] = np.zeros(4, np.int64)
    return ["/train", "soft link"]


def hard_link_cycle(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        splits(f, skip="/train/x")
        f["train/x"] = f["train"]  # /train/x is /train itself: a group inside itself
    return ["/train/x", "not a dataset"]


def complex_images(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        splits(f, skip="/train/x")
        f["train/x"] = (np.ones((6, 2, 2)) * (1 + 2j)).astype(np.complex64)
    return ["/train/x", "complex"]


def string_labels(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        splits(f, skip="/test/y")
        f["test/y"] = np.array([b"cat", b"dog", b"cat", b"dog"])
    return ["/test/y", "string"]


def object_labels(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        splits(f, skip="/test/y")
        ds = f.create_dataset("test/y", shape=(4,), dtype=h5py.vlen_dtype(np.int64))
        for i in range(4):
            ds[i] = np.arange(i + 1)
    return ["/test/y", "variable-length"]


def num_classes_text(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        splits(f)
        f.attrs["num_classes"] = "ten"
    return ["num_classes", "one integer"]


def num_classes_array(path: Path) -> list[str]:
    with h5py.File(path, "w") as f:
        splits(f)
        f.attrs["num_classes"] = np.array([2, 3])
    return ["num_classes", "one integer"]


CASES: list[Callable[[Path], list[str]]] = [
    external_link_to_fifo,
    gzip_declaring_8_gib,
    soft_link_loop,
    hard_link_cycle,
    complex_images,
    string_labels,
    object_labels,
    num_classes_text,
    num_classes_array,
]


@pytest.mark.parametrize("build", CASES, ids=lambda b: b.__name__)
def test_hostile_data_file_is_refused_in_one_line(build, tmp_path) -> None:
    path = tmp_path / "data.h5"
    words = build(path)
    res = load_in_child(path)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1 and len(lines) == 1, (res.returncode, res.stdout, res.stderr)
    assert lines[0].startswith(f"hdf5: {path}") or str(path) in lines[0], lines[0]
    assert all(w in lines[0] for w in words), (words, lines[0])


def test_gzip_data_within_the_cap_still_loads(tmp_path, monkeypatch) -> None:
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        splits(f)
        x = f["train/x"][()]
        del f["train/x"]
        f.create_dataset("train/x", data=x, compression="gzip", shuffle=True, fletcher32=True)
        f.attrs["num_classes"] = np.int64(3)
    assert load_dataset("hdf5", str(path)).num_classes == 3
    monkeypatch.setenv("GEOMPI_HDF5_MAX_BYTES", "64")  # /train/x alone declares 96 bytes
    with pytest.raises(DataError) as info:
        load_dataset("hdf5", str(path))
    msg = str(info.value)
    assert "\n" not in msg and "GEOMPI_HDF5_MAX_BYTES=64" in msg and "declares 96 bytes" in msg
    monkeypatch.setenv("GEOMPI_HDF5_MAX_BYTES", "lots")
    with pytest.raises(DataError) as info:
        load_dataset("hdf5", str(path))
    assert "GEOMPI_HDF5_MAX_BYTES='lots'" in str(info.value)


@pytest.mark.mpi
def test_external_link_to_a_fifo_through_the_cli_ends_in_one_line(tmp_path) -> None:
    """The issue's hang: every rank blocked opening the FIFO. Now one line, exit non-zero,
    well within 60 s."""
    path = tmp_path / "data.h5"
    words = external_link_to_fifo(path)
    args = ["-m", "geompi.train", "--steps", "3", "--progress-every", "1e9"]
    args += ["--dataset", "hdf5", "--data-dir", str(path)]
    res = mpirun(4, args, timeout=60, check=False)
    assert res.returncode != 0
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and all(w in lines[0] for w in words), res.stderr[-3000:]
