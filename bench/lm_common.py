"""The transformer language model of examples/transformer_lm.py, for the benchmarks that train
it through the public API (adaptive_wan, streaming_wan, throughput_lm): a helper, not a
benchmark of its own."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout


def load_example():
    """examples/transformer_lm.py as a module (TinyGPT, Windows, stdlib_corpus)."""
    spec = importlib.util.spec_from_file_location(
        "transformer_lm", ROOT / "examples/transformer_lm.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_and_adamw(lm, seq: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The benchmarks' model (seeded, so every side starts alike) and its AdamW."""
    torch.manual_seed(0)
    model = lm.TinyGPT(seq=seq)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train(model, opt, loader, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` steps of next-byte prediction; the loss and the wall time after each."""
    loss_fn = torch.nn.CrossEntropyLoss()
    losses, walls = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(loader)
        opt.zero_grad()
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        walls.append(time.perf_counter() - t0)
    return losses, walls
