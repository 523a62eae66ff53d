"""Single-process tests of geompi.data and geompi.models."""

from __future__ import annotations

import gzip
import struct

import h5py
import numpy as np
import pytest
import torch

from geompi.data import (
    DATASETS,
    IDX_FILES,
    Dataset,
    ShardLoader,
    digits_split,
    evaluate,
    load_dataset,
    read_idx,
    shard_indices,
)
from geompi.errors import CheckpointError, ConfigError, DataError
from geompi.models import MODELS, build_model


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


# --- digits and synthetic -----------------------------------------------------------------------


def test_digits_split_sizes_and_no_overlap(digits: Dataset) -> None:
    from sklearn.datasets import load_digits

    assert DATASETS == ("digits", "mnist", "fashion-mnist", "hdf5", "synthetic")
    assert digits.x_train.shape == (1437, 1, 8, 8) and digits.x_test.shape == (360, 1, 8, 8)
    assert digits.x_train.dtype == torch.float32 and digits.y_train.dtype == torch.int64
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    # Normalized with the train split's statistics.
    assert abs(float(digits.x_train.mean())) < 1e-4
    assert abs(float(digits.x_train.std()) - 1.0) < 1e-3
    # Stratified: every class is in the test split in proportion (1797 * 0.2 ~ 36 each).
    counts = torch.bincount(digits.y_test, minlength=10)
    assert int(counts.min()) >= 34 and int(counts.max()) <= 38
    # Train and test are disjoint index sets that together cover the bundled data.
    bunch = load_digits()
    train_idx, test_idx = digits_split(bunch.target)
    assert len(np.intersect1d(train_idx, test_idx)) == 0
    assert sorted(np.concatenate([train_idx, test_idx]).tolist()) == list(range(1797))
    # And the tensors are exactly those rows, scaled to [0, 1] and standardized with train stats.
    raw = bunch.images[:, None].astype(np.float64) / 16.0
    mean, std = raw[train_idx].mean(), raw[train_idx].std(ddof=1)
    np.testing.assert_allclose(digits.x_train.numpy(), (raw[train_idx] - mean) / std, atol=1e-4)
    np.testing.assert_allclose(digits.x_test.numpy(), (raw[test_idx] - mean) / std, atol=1e-4)
    assert digits.y_train.tolist() == bunch.target[train_idx].tolist()
    assert digits.y_test.tolist() == bunch.target[test_idx].tolist()


def test_digits_loads_without_importing_sklearn() -> None:
    """Every worker loads the digits at start-up: reading the CSV saves a second per rank."""
    import subprocess
    import sys

    code = (
        "import sys; from geompi.data import load_dataset; ds = load_dataset('digits'); "
        "print(len(ds.x_train), any(m.startswith('sklearn') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1437", "False"], out.stderr[-2000:]


def test_datasets_are_deterministic(digits: Dataset) -> None:
    again = load_dataset("digits", seed=123)  # the digits split ignores the seed
    assert torch.equal(again.x_train, digits.x_train) and torch.equal(again.y_test, digits.y_test)
    a = load_dataset("synthetic", synthetic_size=256, seed=3)
    b = load_dataset("synthetic", synthetic_size=256, seed=3)
    c = load_dataset("synthetic", synthetic_size=256, seed=4)
    assert a.x_train.shape == (256, 1, 8, 8) and a.x_test.shape == (64, 1, 8, 8)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert set(a.y_train.tolist()) == set(range(10)) and a.num_classes == 10


def test_synthetic_is_learnable() -> None:
    ds = load_dataset("synthetic", synthetic_size=2048, seed=0)
    torch.manual_seed(0)
    model = build_model("linear", ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ShardLoader(ds.x_train, ds.y_train, torch.arange(2048), 32, seed=0, shard=0)
    for _ in range(200):
        xb, yb = loader.next_batch()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    acc, loss = evaluate(model, ds.x_test, ds.y_test)
    assert acc >= 0.8 and loss < 1.0


def test_unknown_names_and_missing_data_dir() -> None:
    with pytest.raises(ConfigError) as exc:
        load_dataset("cifar")
    assert "cifar" in one_line(exc) and "digits, mnist, fashion-mnist, hdf5, synthetic" in str(
        exc.value
    )
    with pytest.raises(ConfigError) as exc:
        build_model("resnet", (1, 8, 8), 10)
    assert one_line(exc) == (
        "unknown --model 'resnet': choose one of linear, mlp, cnn, or pass pkg.module:factory"
    )
    for name in ("mnist", "fashion-mnist", "hdf5"):
        with pytest.raises(DataError) as exc:
            load_dataset(name)
        assert "--data-dir" in one_line(exc)


# --- IDX ----------------------------------------------------------------------------------------


def _idx_bytes(arr: np.ndarray) -> bytes:
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D}[arr.dtype]
    header = struct.pack(">BBBB", 0, 0, code, arr.ndim)
    header += b"".join(struct.pack(">I", d) for d in arr.shape)
    return header + arr.tobytes()


def _write_mnist(directory, n_train=20, n_test=8, gz=False, size=28):
    rng = np.random.RandomState(1)
    arrays = {
        "x_train": rng.randint(0, 256, (n_train, size, size)).astype(np.uint8),
        "y_train": rng.randint(0, 10, n_train).astype(np.uint8),
        "x_test": rng.randint(0, 256, (n_test, size, size)).astype(np.uint8),
        "y_test": rng.randint(0, 10, n_test).astype(np.uint8),
    }
    for key, stem in IDX_FILES.items():
        data = _idx_bytes(arrays[key])
        if gz:
            (directory / (stem + ".gz")).write_bytes(gzip.compress(data))
        else:
            (directory / stem).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_idx_reading(tmp_path, gz: bool, name: str) -> None:
    arrays = _write_mnist(tmp_path, gz=gz)
    ds = load_dataset(name, str(tmp_path))
    assert ds.name == name and ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.x_test.shape == (8, 1, 28, 28)
    assert ds.y_train.tolist() == arrays["y_train"].tolist()
    assert ds.y_test.tolist() == arrays["y_test"].tolist()
    # Pixels are x/255 then standardized with the train mean/std: undo and compare.
    raw = arrays["x_train"].astype(np.float64) / 255.0
    expect = (raw - raw.mean()) / raw.std(ddof=1)
    np.testing.assert_allclose(ds.x_train[:, 0].double().numpy(), expect, atol=1e-4)


def test_idx_mixed_plain_and_gz_and_int_dtype(tmp_path) -> None:
    _write_mnist(tmp_path, gz=True)
    # A plain file next to .gz ones is fine; a non-uint8 IDX type is parsed too.
    labels = (np.arange(20) % 10).astype(">i4")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(labels))
    assert read_idx(tmp_path / "train-labels-idx1-ubyte").tolist() == labels.tolist()
    ds = load_dataset("mnist", str(tmp_path))
    assert ds.y_train.tolist() == labels.tolist()


def test_idx_errors(tmp_path) -> None:
    _write_mnist(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte"
    good = images.read_bytes()

    images.write_bytes(b"\x12\x34" + good[2:])  # bad magic
    with pytest.raises(DataError) as exc:
        load_dataset("mnist", str(tmp_path))
    assert "corrupt (bad magic number 0x12340803)" in one_line(exc)
    assert str(images) in str(exc.value) and "download it again" in str(exc.value)

    images.write_bytes(good[:-100])  # truncated
    with pytest.raises(DataError) as exc:
        load_dataset("mnist", str(tmp_path))
    assert "truncated" in one_line(exc)

    images.write_bytes(b"\x00\x00")  # shorter than a header
    with pytest.raises(DataError) as exc:
        load_dataset("mnist", str(tmp_path))
    assert "corrupt" in one_line(exc)

    gz = tmp_path / "bad.gz"
    gz.write_bytes(gzip.compress(good)[:50])  # truncated gzip stream
    with pytest.raises(DataError) as exc:
        read_idx(gz, "mnist")
    assert "download it again" in one_line(exc)

    images.write_bytes(good)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(_idx_bytes(np.zeros(19, dtype=np.uint8)))  # count mismatch
    with pytest.raises(DataError) as exc:
        load_dataset("mnist", str(tmp_path))
    assert "20 images" in one_line(exc) and "19 labels" in str(exc.value)

    labels.unlink()
    with pytest.raises(DataError) as exc:
        load_dataset("fashion-mnist", str(tmp_path))
    assert one_line(exc) == (
        f"fashion-mnist: {labels}(.gz) not found: pass --data-dir with the four Fashion-MNIST "
        "IDX files"
    )

    with pytest.raises(DataError) as exc:
        load_dataset("mnist", str(tmp_path / "nowhere"))
    assert "not a directory" in one_line(exc)


def test_idx_empty_test_split_and_nan_inputs(tmp_path) -> None:
    """An empty test split and NaN in float images are refused in one line each."""
    empty = tmp_path / "empty"
    empty.mkdir()
    _write_mnist(empty, n_test=0)
    with pytest.raises(DataError) as exc:
        load_dataset("mnist", str(empty))
    assert "test split is empty" in one_line(exc)
    nan = tmp_path / "nan"
    nan.mkdir()
    _write_mnist(nan)
    x = np.random.RandomState(0).rand(20, 28, 28).astype(">f4")
    x[3, 4, 5] = np.nan
    (nan / IDX_FILES["x_train"]).write_bytes(_idx_bytes(x))
    with pytest.raises(DataError) as exc:
        load_dataset("mnist", str(nan))
    assert "train inputs hold NaN" in one_line(exc)


def test_hdf5_absurd_labels_and_empty_test_split(tmp_path) -> None:
    rng = np.random.RandomState(0)
    x = rng.rand(12, 4).astype(np.float32)
    y = rng.randint(0, 3, 12).astype(np.uint16)
    y[5] = 65535  # a sentinel (uint16 -1), not a class: it once built a 65536-class layer
    _write_h5(tmp_path / "a.h5", x, y, x[:4], y[:4] % 3)
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(tmp_path / "a.h5"))
    assert "label 65535 but only 4 distinct labels" in one_line(exc)
    _write_h5(tmp_path / "b.h5", x, y % 3, x[:4], y[:4] % 3, num_classes=10**9)
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(tmp_path / "b.h5"))
    assert "num_classes=1000000000" in one_line(exc)
    _write_h5(tmp_path / "c.h5", x, y % 3, x[:0], (y % 3)[:0])
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(tmp_path / "c.h5"))
    assert "empty" in one_line(exc)
    # a missing class with the attribute declared is fine
    _write_h5(tmp_path / "d.h5", x, y % 3, x[:4], y[:4] % 3, num_classes=40)
    assert load_dataset("hdf5", str(tmp_path / "d.h5")).num_classes == 40


# --- HDF5 ---------------------------------------------------------------------------------------


def _write_h5(path, x_train, y_train, x_test, y_test, **attrs) -> None:
    with h5py.File(path, "w") as fh:
        fh["train/x"], fh["train/y"] = x_train, y_train
        fh["test/x"], fh["test/y"] = x_test, y_test
        fh.attrs.update(attrs)


def test_hdf5_layouts(tmp_path) -> None:
    rng = np.random.RandomState(0)
    # (N, H, W) uint8, found as the only .h5 file of a directory.
    xtr = rng.randint(0, 256, (30, 6, 5)).astype(np.uint8)
    ytr = rng.randint(0, 3, 30)
    _write_h5(tmp_path / "any-name.h5", xtr, ytr, xtr[:7], ytr[:7])
    ds = load_dataset("hdf5", str(tmp_path))
    assert ds.input_shape == (1, 6, 5) and ds.num_classes == 3
    assert ds.y_train.tolist() == ytr.tolist() and ds.y_train.dtype == torch.int64
    raw = xtr.astype(np.float64) / 255.0
    expect = (raw - raw.mean()) / raw.std(ddof=1)
    np.testing.assert_allclose(ds.x_train[:, 0].double().numpy(), expect, atol=1e-4)
    np.testing.assert_allclose(ds.x_test[:, 0].double().numpy(), expect[:7], atol=1e-4)

    # (N, C, H, W) float with a declared class count, passed as a file path.
    f2 = tmp_path / "sub" / "data.hdf5"
    f2.parent.mkdir()
    x4 = rng.randn(12, 3, 4, 4).astype(np.float32)
    _write_h5(f2, x4, np.arange(12) % 4, x4[:4], np.arange(4), num_classes=5)
    ds = load_dataset("hdf5", str(f2))
    assert ds.input_shape == (3, 4, 4) and ds.num_classes == 5 and len(ds.y_test) == 4

    # (N, F) features become (N, 1, 1, F), and the models still build and run on them.
    f3 = tmp_path / "feat.h5"
    xf = rng.randn(16, 10)
    _write_h5(f3, xf, np.arange(16) % 2, xf[:4], np.arange(4) % 2)
    ds = load_dataset("hdf5", str(f3))
    assert ds.input_shape == (1, 1, 10) and ds.num_classes == 2
    for name in MODELS:
        assert build_model(name, ds.input_shape, 2)(ds.x_test).shape == (4, 2)


def test_hdf5_errors(tmp_path) -> None:
    x = np.zeros((4, 2, 2), dtype=np.uint8)
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as fh:
        fh["train/x"], fh["train/y"], fh["test/x"] = x, np.zeros(4), x
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(bad))
    assert "has no dataset /test/y" in one_line(exc)

    _write_h5(bad, x, np.zeros(3), x, np.zeros(4))
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(bad))
    assert "/train/y has shape (3,)" in one_line(exc)

    (tmp_path / "other.hdf5").write_bytes(b"not hdf5 at all")
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(tmp_path))
    assert "2 .h5/.hdf5 files" in one_line(exc)
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(tmp_path / "other.hdf5"))
    assert "cannot open" in one_line(exc)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as exc:
        load_dataset("hdf5", str(empty))
    assert "no .h5/.hdf5 file" in one_line(exc)


# --- shards and loader --------------------------------------------------------------------------


def test_shards_disjoint_and_covering() -> None:
    n, w = 1437, 16
    shards = [shard_indices(n, w, s, seed=7) for s in range(w)]
    assert all(len(s) == n // w and s.dtype == torch.int64 for s in shards)
    joined = torch.cat(shards)
    assert len(set(joined.tolist())) == (n // w) * w  # disjoint
    assert int(joined.min()) >= 0 and int(joined.max()) < n
    # Deterministic from the seed, different for another seed, not just contiguous ranges.
    assert torch.equal(shard_indices(n, w, 3, seed=7), shards[3])
    assert not torch.equal(shard_indices(n, w, 3, seed=8), shards[3])
    assert not torch.equal(torch.sort(shards[0]).values, torch.arange(n // w))
    # Even split: every sample is used.
    assert sorted(torch.cat([shard_indices(100, 4, s, seed=0) for s in range(4)]).tolist()) == list(
        range(100)
    )


def test_split_by_class_shards_see_few_classes(digits: Dataset) -> None:
    y = digits.y_train
    w = 10
    iid = [shard_indices(len(y), w, s, seed=0, labels=y) for s in range(w)]
    skew = [shard_indices(len(y), w, s, seed=0, labels=y, split_by_class=True) for s in range(w)]
    assert all(len(torch.unique(y[s])) >= 8 for s in iid)
    assert all(len(torch.unique(y[s])) <= 3 for s in skew)
    joined = torch.cat(skew)
    assert len(set(joined.tolist())) == len(joined) == (len(y) // w) * w
    # Same kept samples as the IID split, only regrouped.
    assert set(joined.tolist()) == set(torch.cat(iid).tolist())
    # Ties within a class are seed-shuffled rather than left in index order.
    other = shard_indices(len(y), w, 0, seed=1, labels=y, split_by_class=True)
    assert not torch.equal(torch.sort(other).values, torch.sort(skew[0]).values)
    with pytest.raises(ConfigError):
        shard_indices(len(y), w, 0, seed=0, split_by_class=True)


def test_too_many_shards_and_bad_shard() -> None:
    with pytest.raises(DataError) as exc:
        shard_indices(10, 16, 0, seed=0, name="digits")
    assert one_line(exc) == (
        "dataset digits has 10 training samples, too few for 16 workers: use fewer workers or a "
        "larger dataset"
    )
    with pytest.raises(ConfigError):
        shard_indices(10, 2, 2, seed=0)


def _loader(x, y, idx, bs=10, seed=5, shard=1):
    return ShardLoader(x, y, idx, bs, seed=seed, shard=shard)


def test_loader_epochs_and_rollover() -> None:
    x = torch.arange(200, dtype=torch.float32).view(200, 1, 1, 1)
    y = torch.arange(200)
    idx = shard_indices(200, 4, 1, seed=0)  # 50 samples
    loader = _loader(x, y, idx, bs=16)
    assert loader.steps_per_epoch == 3  # 50 // 16, last partial batch dropped
    seen = []
    for step in range(3):
        assert (loader.epoch, loader.position) == (0, step)
        xb, yb = loader.next_batch()
        assert xb.shape == (16, 1, 1, 1) and torch.equal(xb.view(-1).long(), yb)
        seen.append(yb)
    assert (loader.epoch, loader.position) == (1, 0)  # rolled over
    epoch0 = torch.cat(seen)
    assert len(set(epoch0.tolist())) == 48 and set(epoch0.tolist()) <= set(idx.tolist())
    epoch1 = torch.cat([loader.next_batch()[1] for _ in range(3)])
    assert loader.epoch == 2
    assert not torch.equal(epoch0, epoch1)  # reshuffled each epoch
    # Another worker's shard with the same seed is shuffled differently; same args repeat exactly.
    same = _loader(x, y, idx, bs=16)
    assert torch.equal(same.next_batch()[1], seen[0])
    other = _loader(x, y, idx, bs=16, shard=2)
    assert not torch.equal(other.next_batch()[1], seen[0])


def test_loader_state_dict_resume() -> None:
    x = torch.randn(300, 1, 2, 2)
    y = torch.randint(0, 10, (300,))
    idx = shard_indices(300, 3, 0, seed=1)
    a = _loader(x, y, idx, bs=32, seed=9, shard=0)
    for _ in range(7):  # into the second epoch (3 steps per epoch)
        a.next_batch()
    state = a.state_dict()
    assert state == {"epoch": 2, "position": 1}
    expect = [a.next_batch() for _ in range(5)]
    b = _loader(x, y, idx, bs=32, seed=9, shard=0)
    b.load_state_dict(dict(state))
    for xe, ye in expect:
        xb, yb = b.next_batch()
        assert torch.equal(xb, xe) and torch.equal(yb, ye)
    assert b.state_dict() == a.state_dict()
    with pytest.raises(CheckpointError):
        b.load_state_dict({"epoch": 0, "position": 3})
    with pytest.raises(CheckpointError):
        b.load_state_dict({"epoch": 0})


def test_loader_batch_size_errors() -> None:
    x, y = torch.zeros(200, 1, 1, 1), torch.zeros(200, dtype=torch.int64)
    idx = torch.arange(112)
    with pytest.raises(DataError) as exc:
        _loader(x, y, idx, bs=500)
    assert one_line(exc) == (
        "--batch-size 500 is larger than a worker's shard (112 samples): use --batch-size 112 or "
        "less"
    )
    with pytest.raises(DataError):
        _loader(x, y, idx, bs=0)
    assert _loader(x, y, idx, bs=112).steps_per_epoch == 1


# --- models -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 5, 7)])
def test_model_forward_shapes(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, shape, 10)
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, 10) and torch.isfinite(out).all()


def test_model_sizes_and_layouts() -> None:
    def count(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    assert count(build_model("linear", (1, 8, 8), 10)) == 64 * 10 + 10
    assert 10_000 <= count(build_model("mlp", (1, 8, 8), 10)) <= 30_000
    small, mnist = build_model("cnn", (1, 8, 8), 10), build_model("cnn", (1, 28, 28), 10)
    assert small.conv_padding == 2 and mnist.conv_padding == 0
    # Classic MNIST layout: 28 -> 24 -> 12 -> 8 -> 4, so fc1 sees 32 * 4 * 4 inputs.
    assert mnist.classifier[0].in_features == 32 * 4 * 4
    assert small.classifier[0].in_features == 32 * 2 * 2
    with pytest.raises(ConfigError):
        build_model("cnn", (1, 0, 8), 10)


def test_models_deterministic_under_seed() -> None:
    for name in MODELS:
        torch.manual_seed(42)
        a = build_model(name, (1, 28, 28), 10).state_dict()
        torch.manual_seed(42)
        b = build_model(name, (1, 28, 28), 10).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_evaluate() -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]).view(3, 1, 1, 2)
    y = torch.tensor([0, 1, 1])
    model.train()
    acc, loss = evaluate(model, x, y, batch_size=2)
    expect = torch.nn.functional.cross_entropy(x.view(3, 2), y).item()
    assert acc == pytest.approx(2 / 3) and loss == pytest.approx(expect)
    assert model.training  # mode restored


def test_cnn_learns_digits(digits: Dataset) -> None:
    """An honest check: single-process SGD on the digits train split generalizes to test."""
    torch.manual_seed(0)
    model = build_model("cnn", digits.input_shape, digits.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    idx = torch.arange(len(digits.x_train))
    loader = ShardLoader(digits.x_train, digits.y_train, idx, 32, seed=0, shard=0)
    acc0, _ = evaluate(model, digits.x_test, digits.y_test)
    for _ in range(300):
        xb, yb = loader.next_batch()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    acc, loss = evaluate(model, digits.x_test, digits.y_test)
    assert acc0 < 0.3
    assert acc >= 0.9, f"cnn reached only {acc:.3f} test accuracy on digits"
    assert loss < 0.4
