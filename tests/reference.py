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
    *, dataset: str, model: str, workers: int, batch_size: int, seed: int, steps: int, make_opt
) -> dict[str, torch.Tensor]:
    """Single-process training on the concatenation of every worker's batch, per step."""
    ds, loaders = worker_loaders(dataset, workers, batch_size, seed)
    torch.manual_seed(seed)
    net = build_model(model, ds.input_shape, ds.num_classes)
    opt = make_opt(net.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(steps):
        xs, ys = zip(*(ld.next_batch() for ld in loaders))
        opt.zero_grad()
        loss_fn(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)
