"""``--model``/``--dataset pkg.module:factory`` without MPI: what is built, and every bad input
as one line that names the flag, the spec and the fix."""

from __future__ import annotations

import pytest
import torch

from geompi.config import make_config
from geompi.data import load_dataset
from geompi.errors import ConfigError, DataError
from geompi.models import build_model

P = "tests.progs.user_factories"


def one_line(exc) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg, msg
    return msg


def test_a_factory_model_is_built_like_a_builtin():
    torch.manual_seed(0)
    ours = build_model(f"{P}:mlp", (1, 8, 8), 10)
    torch.manual_seed(0)
    builtin = build_model("mlp", (1, 8, 8), 10)
    a, b = ours.state_dict(), builtin.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours.training  # the output check leaves the mode as it was
    net = build_model(f"{P}:layernorm", (1, 1, 12), 4)
    assert "norm.weight" in dict(net.named_parameters())


def test_a_factory_dataset_is_checked_and_normalized_like_a_builtin():
    ours, builtin = load_dataset(f"{P}:digits"), load_dataset("digits")
    assert ours.name == f"{P}:digits" and ours.num_classes == builtin.num_classes == 10
    for k in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(ours, k), getattr(builtin, k)), k
    torch.manual_seed(0)
    blobs = load_dataset(f"{P}:blobs", "/ignored")
    assert blobs.input_shape == (1, 1, 12) and blobs.num_classes == 4
    assert abs(float(blobs.x_train.mean())) < 1e-5  # normalized with the train split's stats


def test_a_factory_of_two_map_style_datasets_equals_its_tensors():
    """``factory()`` returning (train_set, test_set) of (x, label) reads every sample once,
    in order: the same dataset as the tensors it was built from."""
    torch.manual_seed(0)
    sets = load_dataset(f"{P}:blob_sets")
    torch.manual_seed(0)
    tensors = load_dataset(f"{P}:blobs")
    assert sets.num_classes == tensors.num_classes == 4
    for k in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(sets, k), getattr(tensors, k)), k


def test_specs_pass_validation_and_bad_ones_are_refused_on_every_rank_alike():
    make_config(["--model", f"{P}:mlp", "--dataset", f"{P}:digits"]).validate()
    for flag, value, words in [
        ("--model", "resnet", ["unknown --model 'resnet'", "cnn", "pkg.module:factory"]),
        ("--dataset", "imagenet", ["unknown --dataset 'imagenet'", "pkg.module:factory"]),
        ("--model", "nets:", ["--model 'nets:' is not MODULE:FACTORY", "mypkg.nets:make_net"]),
        ("--dataset", "a b:c", ["--dataset 'a b:c' is not MODULE:FACTORY"]),
        ("--model", "a:b:c", ["is not MODULE:FACTORY"]),
    ]:
        with pytest.raises(ConfigError) as exc:
            make_config([flag, value]).validate()
        for w in words:
            assert w in one_line(exc), (w, one_line(exc))


MODEL_ERRORS = {
    "tests.progs.no_such_module:make": [
        "--model tests.progs.no_such_module:make: cannot import tests.progs.no_such_module",
        "PYTHONPATH on every rank",
    ],
    "tests.progs.user_bad_import:make": [
        "importing tests.progs.user_bad_import failed",
        "No module named 'geompi_no_such_dependency'",
        "install what it imports",
    ],
    f"{P}:missing": [f"{P} has no attribute 'missing'", "after the colon"],
    f"{P}:LayerNormNet.nope": [f"{P}:LayerNormNet has no attribute 'nope'"],
    f"{P}:NOT_CALLABLE": [f"{P}:NOT_CALLABLE is not callable (its type is int)"],
    f"{P}:raises": [
        "raises((1, 8, 8), 10) raised RuntimeError: the weights server is down",
    ],
    f"{P}:not_a_module": ["returned a list, not a torch.nn.Module"],
    f"{P}:no_parameters": ["has no parameters"],
    f"{P}:wrong_classes": ["to shape (2, 11), not (2, 10) logits", "10 outputs"],
    f"{P}:bad_forward": ["forward fails on a batch of shape (2, 1, 8, 8)", "RuntimeError"],
}


@pytest.mark.parametrize("spec", sorted(MODEL_ERRORS))
def test_bad_model_factories_are_one_line(spec):
    with pytest.raises(ConfigError) as exc:
        build_model(spec, (1, 8, 8), 10)
    msg = one_line(exc)
    assert msg.startswith(f"--model {spec}: "), msg
    for w in MODEL_ERRORS[spec]:
        assert w in msg, (w, msg)
    assert "second line" not in msg


DATA_ERRORS = {
    f"{P}:raises": ["raises(None) raised RuntimeError: the weights server is down"],
    f"{P}:three_parts": ["returned a 3-tuple, not (x_train, y_train, x_test, y_test"],
    f"{P}:mlp": ["mlp(None) raised TypeError"],
    f"{P}:list_labels": ["y_train is a list, not a torch tensor or numpy array"],
    f"{P}:float_labels": ["y_train has dtype torch.float32", "integer class indices"],
    f"{P}:nan_inputs": ["the test inputs hold NaN or Inf"],
    f"{P}:empty_test": ["the test split is empty"],
    f"{P}:labels_out_of_range": ["test labels span 5..6, outside 0..2"],
    f"{P}:shapes_differ": ["train samples have shape (1, 2, 2) but test samples (1, 3, 3)"],
    f"{P}:set_and_tensor": ["the test set is a Tensor, not a map-style torch Dataset"],
    f"{P}:set_of_triples": ["train_set[0] is a tuple, not an (x, label) pair"],
    f"{P}:ragged_set": ["the train set's samples have 2 shapes"],
}


@pytest.mark.parametrize("spec", sorted(DATA_ERRORS))
def test_bad_dataset_factories_are_one_line(spec):
    with pytest.raises(DataError) as exc:
        load_dataset(spec)
    msg = one_line(exc)
    assert spec in msg
    for w in DATA_ERRORS[spec]:
        assert w in msg, (w, msg)


def test_import_errors_name_the_dataset_flag():
    with pytest.raises(ConfigError) as exc:
        load_dataset("tests.progs.no_such_module:make")
    assert one_line(exc).startswith("--dataset tests.progs.no_such_module:make: cannot import")
