"""Flat buckets: the model's parameters and gradients packed into a few contiguous buffers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """One contiguous fp32 buffer of parameters (the model's own storage) and one of gradients."""

    key: int
    params: torch.Tensor
    grads: torch.Tensor
    members: list[tuple[str, torch.nn.Parameter, int]] = field(default_factory=list)  # name, p, off

    @property
    def numel(self) -> int:
        return self.params.numel()


class Buckets:
    """Parameters in priority order, last layers first (backward produces their gradients first).

    After construction every parameter's ``.data`` is a view into its bucket's ``params`` buffer,
    so a receive into a bucket updates the model with no copy.
    """

    def __init__(
        self, named_params: Sequence[tuple[str, torch.nn.Parameter]], cap_bytes: int
    ) -> None:
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[Bucket, int, int]] = {}  # id(p) -> bucket, offset, numel
        group: list[tuple[str, torch.nn.Parameter]] = []
        size = 0
        for name, p in reversed(list(named_params)):
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name} is {p.dtype}; geompi trains fp32 parameters")
            if group and (size + p.numel()) * 4 > cap_bytes:
                self._close(group)
                group, size = [], 0
            group.append((name, p))
            size += p.numel()
        if group:
            self._close(group)

    def _close(self, group: list[tuple[str, torch.nn.Parameter]]) -> None:
        total = sum(p.numel() for _, p in group)
        device = group[0][1].device
        flat = torch.empty(total, dtype=torch.float32, device=device)
        bucket = Bucket(len(self.buckets), flat, torch.zeros_like(flat))
        off = 0
        for name, p in group:
            n = p.numel()
            flat[off : off + n].copy_(p.data.reshape(-1))
            p.data = flat[off : off + n].view_as(p)
            bucket.members.append((name, p, off))
            self.where[id(p)] = (bucket, off, n)
            off += n
        self.buckets.append(bucket)

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def keys(self) -> list[tuple[int, int]]:
        return [(b.key, b.numel) for b in self.buckets]

    def named_slices(self) -> dict[str, tuple[int, int, int, torch.Size]]:
        """Parameter name -> (bucket key, offset, numel, shape): how to find it in a key."""
        return {
            name: (b.key, off, p.numel(), p.shape)
            for b in self.buckets
            for name, p, off in b.members
        }
