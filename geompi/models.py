"""The models a run can train: a linear classifier, a small MLP and the GeoMX example CNN, and
``partial``, a tiny net with parameters that get no gradient (for tests).

Every model takes a batch of shape (N, C, H, W) and returns logits of shape (N, num_classes).
Construction only draws from torch's global generator, so `torch.manual_seed` fixes the weights.

``--model pkg.module:factory`` builds the user's own model instead: ``factory(input_shape,
num_classes)`` with ``input_shape`` the (C, H, W) of one sample, called like the built-ins
(after ``torch.manual_seed(--seed)``), must return a ``torch.nn.Module`` with parameters whose
forward maps (N, C, H, W) to (N, num_classes) logits; :func:`build_model` checks that on a
batch of zeros before training.
"""

from __future__ import annotations

import torch
from torch import nn

from geompi import factory
from geompi.errors import ConfigError

MODELS = ("linear", "mlp", "cnn")
TEST_MODELS = ("partial",)  # accepted by name, not offered: they exist for the test suite

# The CNN's convolutions use this kernel size; both its pools halve the spatial size.
_KERNEL = 5
# Inputs smaller than this in a spatial dimension are zero-padded up to it, so that two
# 2x2 max pools still leave at least one pixel.
_MIN_SIZE = 4


def _check_shape(input_shape: tuple[int, int, int], num_classes: int) -> tuple[int, int, int]:
    shape = tuple(int(d) for d in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(
            f"input shape {tuple(input_shape)} is not (channels, height, width) with every size "
            ">= 1: check the dataset"
        )
    if int(num_classes) < 2:
        raise ConfigError(f"num_classes is {num_classes}: a classifier needs at least 2 classes")
    return shape  # type: ignore[return-value]


class CNN(nn.Module):
    """GeoMX's example CNN: conv16(5) pool conv32(5) pool fc256 fc128 fc(num_classes), ReLUs.

    Images too small for the classic unpadded layout (e.g. 8x8 digits) get padding=2 on the
    convolutions, and are zero-padded to at least 4x4, so no feature map shrinks below 1x1.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.input_shape = (channels, height, width)
        # Pad the input up to the minimum size (left/top gets the smaller half).
        pad_h, pad_w = max(0, _MIN_SIZE - height), max(0, _MIN_SIZE - width)
        self.input_pad = (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
        height, width = height + pad_h, width + pad_w
        self.conv_padding = 0 if min(_classic_size(height), _classic_size(width)) >= 1 else 2
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, _KERNEL, padding=self.conv_padding),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, _KERNEL, padding=self.conv_padding),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        with torch.no_grad():  # a dry run on zeros gives the flattened size; it draws no RNG
            flat = self.features(torch.zeros(1, channels, height, width)).shape[1]
        self.classifier = nn.Sequential(
            nn.Linear(flat, 256),
            nn.ReLU(),
            nn.Linear(256, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the logits for a batch of shape (N, C, H, W)."""
        if any(self.input_pad):
            x = nn.functional.pad(x, self.input_pad)
        return self.classifier(self.features(x))


class Partial(nn.Module):
    """A tiny net whose parameters do not all get gradients: a frozen input layer, a ``side``
    head that training skips on every third forward, and a ``spare`` parameter never used."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.frozen = nn.Linear(features, 16).requires_grad_(False)
        self.body = nn.Linear(16, num_classes)
        self.side = nn.Linear(16, num_classes)
        self.spare = nn.Parameter(torch.randn(5))
        self.forwards = 0  # training forwards so far

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the logits for a batch of shape (N, C, H, W)."""
        h = torch.tanh(self.frozen(x.flatten(1)))
        if self.training and torch.is_grad_enabled():
            self.forwards += 1
            if self.forwards % 3 == 0:
                return self.body(h)
        return self.body(h) + self.side(h)


def _classic_size(size: int) -> int:
    """Spatial size after the unpadded conv(5), pool(2), conv(5), pool(2) stack."""
    size = (size - _KERNEL + 1) // 2
    return (size - _KERNEL + 1) // 2 if size >= _KERNEL else 0


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build model `name` (one of MODELS, or a ``module:factory`` spec) for inputs of shape
    (C, H, W) and num_classes logits."""
    if factory.is_spec(name):
        return build_user_model(name, input_shape, num_classes)
    if name not in MODELS + TEST_MODELS:
        raise ConfigError(
            f"unknown --model {name!r}: choose one of {', '.join(MODELS)}, or pass "
            "pkg.module:factory"
        )
    channels, height, width = _check_shape(input_shape, num_classes)
    features = channels * height * width
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )
    if name == "partial":
        return Partial(features, num_classes)
    return CNN((channels, height, width), num_classes)


def build_user_model(spec: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """``factory(input_shape, num_classes)`` from ``--model spec``, checked: an nn.Module with
    parameters, whose forward gives (2, num_classes) logits for a batch of 2 zero samples (in
    eval mode and without gradients, so it changes no state and draws no random numbers)."""
    shape = _check_shape(input_shape, num_classes)
    classes = int(num_classes)
    make = factory.resolve("--model", spec)
    model = factory.call("--model", spec, make, shape, classes)
    where = f"--model {spec}"
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{where}: the factory returned a {type(model).__name__}, not a torch.nn.Module: "
            "return the model itself"
        )
    if next(model.parameters(), None) is None:
        raise ConfigError(f"{where}: the model has no parameters: there is nothing to train")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            param = next(model.parameters())  # float32 inputs, as training feeds them
            out = model(torch.zeros(2, *shape, device=param.device))
    except Exception as e:  # noqa: BLE001 - the user's forward
        raise ConfigError(
            f"{where}: the model's forward fails on a batch of shape {(2, *shape)}: "
            f"{factory.brief(e)}"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, classes):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"{where}: the model maps a batch of shape {(2, *shape)} to {got}, not "
            f"(2, {classes}) logits: the dataset has {classes} classes, so give the last layer "
            f"{classes} outputs"
        )
    return model
