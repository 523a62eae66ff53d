"""``--model``/``--dataset pkg.module:factory`` under mpirun (FSA, 5 ranks: 2 datacenters of one
worker each): a hand-made copy of a built-in trains exactly like it, a model and data no
built-in has train and land in the checkpoint, and a resume with another --model is refused."""

import json

import h5py
import pytest
import torch

from tests.mpirun import error_lines, mpirun, read_jsonl, train_runs

pytestmark = pytest.mark.mpi
P = "tests.progs.user_factories"
TRAIN = ["-m", "geompi.train", "--progress-every", "1e9", "--batch-size", "16"]


def _train(tmp_path, name, *args, check=True):
    out = tmp_path / name
    res = mpirun(
        5,
        TRAIN + ["--metrics", str(out / "m.jsonl"), "--checkpoint-dir", str(out), *args],
        timeout=120,
        check=check,
    )
    return out, res


def _model(directory) -> dict[str, torch.Tensor]:
    (path,) = sorted(directory.glob("ckpt-*.h5"))
    with h5py.File(path, "r") as f:
        return {k: torch.from_numpy(v[()]) for k, v in f["model"].items()}


def test_a_factory_copy_of_a_builtin_trains_exactly_like_it(tmp_path):
    common = ["--optimizer", "adam", "--steps", "6"]
    ours, builtin = tmp_path / "ours", tmp_path / "builtin"
    train_runs(  # both in one mpirun job (the ranks start once), the copy first
        5,
        [
            ([*TRAIN[2:], "--metrics", d / "m.jsonl", "--checkpoint-dir", d, *spec, *common], {})
            for d, spec in [
                (ours, ["--model", f"{P}:mlp", "--dataset", f"{P}:digits"]),
                (builtin, ["--model", "mlp", "--dataset", "digits"]),
            ]
        ],
        tmp_path / "runs",
        timeout=240,
    )
    a, b = _model(ours), _model(builtin)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
    losses = [
        [r["loss"] for r in read_jsonl(d / "m.jsonl") if "loss" in r] for d in (ours, builtin)
    ]
    assert len(losses[0]) == 6 and losses[0] == pytest.approx(losses[1], abs=1e-6)
    summaries = [read_jsonl(d / "m.jsonl")[-1] for d in (ours, builtin)]
    assert summaries[0]["test_acc"] == summaries[1]["test_acc"]


def test_a_user_model_and_dataset_train_and_are_what_the_checkpoint_holds(tmp_path):
    spec = [
        "--model",
        f"{P}:layernorm",
        "--dataset",
        f"{P}:blobs",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
    ]
    out, _ = _train(tmp_path, "ln", *spec, "--steps", "40")
    rows = read_jsonl(out / "m.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert rows[-1]["test_acc"] > 0.6  # 4 classes: chance is 0.25
    model = _model(out)
    # LayerNorm's parameters: no built-in has them; 12 inputs: the blobs' (N, F) features
    assert {"norm.weight", "norm.bias"} <= model.keys()
    assert model["embed.weight"].shape == (32, 12) and model["head.weight"].shape == (4, 32)
    (path,) = sorted(out.glob("ckpt-*.h5"))
    with h5py.File(path, "r") as f:
        config = json.loads(f.attrs["config"])
    assert config["model"] == f"{P}:layernorm" and config["dataset"] == f"{P}:blobs"

    # the same parameters under another spec: told apart by the recorded --model
    again = ["--model", f"{P}:layernorm_again", *spec[2:], "--steps", "45", "--resume", "latest"]
    res = mpirun(5, TRAIN + ["--checkpoint-dir", str(out), *again], timeout=120, check=False)
    errs = error_lines(res.stderr)
    assert res.returncode != 0 and len(errs) == 1 and "Traceback" not in res.stderr, res.stderr
    assert (
        f"written by --model {P}:layernorm but this run uses --model {P}:layernorm_again"
        in (errs[0])
    )
    assert f"resume with --model {P}:layernorm" in errs[0]
