"""User factories for ``--model pkg.module:factory`` and ``--dataset pkg.module:factory``.

``mlp`` and ``digits`` rebuild the built-ins ``--model mlp`` and ``--dataset digits`` by hand,
so a run with them must equal the built-in run; ``LayerNormNet`` on ``blobs`` is a model and a
dataset no built-in has. The rest are broken on purpose, for the error tests.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def mlp(input_shape, num_classes):
    """The same layers, in the same order, as geompi.models' ``mlp``."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def digits(data_dir):
    """scikit-learn's digits, split as geompi's built-in; raw pixels (geompi normalizes)."""
    from sklearn.datasets import load_digits

    from geompi.data import digits_split

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    train, test = digits_split(y)
    return x[train], y[train], x[test], y[test]


class LayerNormNet(nn.Module):
    """Linear, LayerNorm, GELU, Linear: nonlinear, and its parameter names are its own."""

    def __init__(self, features: int, num_classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(nn.functional.gelu(self.norm(self.embed(x.flatten(1)))))


def layernorm(input_shape, num_classes):
    c, h, w = input_shape
    return LayerNormNet(c * h * w, num_classes)


layernorm_again = layernorm  # the same model under another spec, for the resume check

BLOB_FEATURES = 12
BLOB_CLASSES = 4


def blobs(data_dir):
    """Four Gaussian clusters in 12 features, (N, F) tensors, from torch's global generator
    (which geompi seeds with --seed before the call, so every worker draws the same)."""
    centers = 2.0 * torch.randn(BLOB_CLASSES, BLOB_FEATURES)

    def split(n):
        y = torch.randint(BLOB_CLASSES, (n,))
        return centers[y] + torch.randn(n, BLOB_FEATURES), y

    x_train, y_train = split(512)
    x_test, y_test = split(128)
    return x_train, y_train, x_test, y_test, BLOB_CLASSES


class Pairs(torch.utils.data.Dataset):
    """A map-style dataset of (x, label), as a user's own Dataset class is."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def blob_sets():
    """``blobs`` as the issue's form: no argument, two map-style datasets (one a user's
    class, one torch's TensorDataset), the class count inferred from the labels."""
    x_train, y_train, x_test, y_test, _ = blobs(None)
    return Pairs(x_train, y_train), torch.utils.data.TensorDataset(x_test, y_test)


# ---- broken on purpose -------------------------------------------------------------------
NOT_CALLABLE = 3


def raises(*args):
    raise RuntimeError("the weights server is down\nsecond line")


def not_a_module(input_shape, num_classes):
    return [nn.Linear(4, num_classes)]


def no_parameters(input_shape, num_classes):
    return nn.Flatten()


def wrong_classes(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes + 1))


def bad_forward(input_shape, num_classes):
    return nn.Linear(3, num_classes)  # does not flatten, and the wrong width


def three_parts(data_dir):
    x = torch.zeros(8, 1, 2, 2)
    return x, torch.zeros(8, dtype=torch.int64), x


def list_labels(data_dir):
    x = torch.zeros(8, 1, 2, 2)
    return x, [0, 1] * 4, x, torch.zeros(8, dtype=torch.int64)


def float_labels(data_dir):
    x = torch.zeros(8, 1, 2, 2)
    return x, torch.zeros(8), x, torch.zeros(8)


def nan_inputs(data_dir):
    x = torch.zeros(8, 1, 2, 2)
    y = torch.tensor([0, 1] * 4)
    return x, y, x * float("nan"), y


def empty_test(data_dir):
    x = torch.zeros(8, 1, 2, 2)
    y = torch.tensor([0, 1] * 4)
    return x, y, x[:0], y[:0]


def labels_out_of_range(data_dir):
    x = torch.zeros(8, 1, 2, 2)
    y = torch.tensor([0, 1] * 4)
    return x, y, x, y + 5, 3


def shapes_differ(data_dir):
    y = torch.tensor([0, 1] * 4)
    return torch.zeros(8, 1, 2, 2), y, torch.zeros(8, 1, 3, 3), y


def unseeded(data_dir):
    """numpy's fresh generator: other data on every worker."""
    rng = np.random.default_rng()
    x = rng.normal(size=(64, 1, 2, 2)).astype(np.float32)
    y = np.tile(np.arange(2), 32)
    return x, y, x, y


def set_and_tensor():
    return Pairs(torch.zeros(4, 2), torch.zeros(4)), torch.zeros(4, 2)


def set_of_triples():
    x = torch.zeros(4, 2)
    return torch.utils.data.TensorDataset(x, x[:, 0], x[:, 1]), Pairs(x, torch.zeros(4))


def ragged_set():
    xs = [torch.zeros(2), torch.zeros(3)]
    return Pairs(xs, torch.zeros(2)), Pairs(xs[:1], torch.zeros(1))
