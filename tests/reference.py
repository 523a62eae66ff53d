"""Independent single-process references for the MPI tests."""

from __future__ import annotations

import torch

from geompi.data import ShardLoader, load_dataset, shard_indices
from geompi.models import build_model


def worker_loaders(
    dataset: str, workers: int, batch_size: int, seed: int, split_by_class: bool = False
) -> tuple[object, list[ShardLoader]]:
    """The exact batches each worker of a geompi run sees, rebuilt in one process."""
    ds = load_dataset(dataset, seed=seed)
    loaders = []
    for w in range(workers):
        idx = shard_indices(
            len(ds.y_train), workers, w, seed=seed, labels=ds.y_train, split_by_class=split_by_class
        )
        loaders.append(ShardLoader(ds.x_train, ds.y_train, idx, batch_size, seed=seed, shard=w))
    return ds, loaders


def large_batch_sgd(
    *,
    dataset: str,
    model: str,
    workers: int,
    batch_size: int,
    seed: int,
    steps: int,
    make_opt,
    active=None,
) -> dict[str, torch.Tensor]:
    """Single-process training on the concatenation of every worker's batch, per step
    (``active(step)``: the workers that train at that step, counted from 1; default all)."""
    ds, loaders = worker_loaders(dataset, workers, batch_size, seed)
    torch.manual_seed(seed)
    net = build_model(model, ds.input_shape, ds.num_classes)
    opt = make_opt(net.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    for t in range(1, steps + 1):
        ws = range(workers) if active is None else active(t)
        xs, ys = zip(*(loaders[w].next_batch() for w in ws))
        opt.zero_grad()
        loss_fn(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---- models for the WAN fidelity tests (tests/progs/wan_fidelity.py and its replays) ------
class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies by ``scale`` (loss scaling, as GradScaler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


class FidelityNet(torch.nn.Module):
    """A small tanh MLP; ``loss_scale`` multiplies every gradient (pushes beyond fp16's range);
    ``frozen`` makes each gradient depend on the batch only, never on the parameters
    (so asynchronous rounds can be replayed whatever order they landed in)."""

    def __init__(self, features: int, classes: int, loss_scale: float = 1.0, frozen=False):
        super().__init__()
        self.l1 = torch.nn.Linear(features, 24)
        self.l2 = torch.nn.Linear(24, classes)
        self.loss_scale = loss_scale
        self.frozen = frozen
        # fixed projections: not parameters, not buffers (the same on every rank by the seed)
        self.proj = torch.randn(features, classes) * 0.3
        self.proj_h = torch.randn(features, 24) * 0.3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if self.frozen:  # the value is x @ proj; the gradient is that of a linear model
            lin = self.l2(torch.tanh(x @ self.proj_h)) + self.l1(x)[:, : self.l2.out_features]
            out = (x @ self.proj) + lin - lin.detach()
        else:
            out = self.l2(torch.tanh(self.l1(x)))
        return _ScaleGrad.apply(out, self.loss_scale) if self.loss_scale != 1.0 else out
