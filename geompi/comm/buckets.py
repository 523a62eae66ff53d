"""Flat buckets: the model's parameters and gradients packed into a few contiguous buffers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from geompi.errors import ConfigError


class Member(NamedTuple):
    """A parameter's values in one bucket: ``numel`` of them from ``start`` of the flattened
    parameter, at ``offset`` in the bucket (the whole parameter unless the buckets are cut
    into fragments, see Buckets)."""

    name: str
    param: torch.nn.Parameter
    offset: int
    start: int
    numel: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == self.param.numel()

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """This member's part of ``t``, a tensor shaped as the parameter (a view)."""
        return t.reshape(-1)[self.start : self.start + self.numel]


@dataclass
class Bucket:
    """One contiguous fp32 buffer of parameters (the model's own storage) and one of gradients."""

    key: int
    params: torch.Tensor
    grads: torch.Tensor
    members: list[Member] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.params.numel()


class Buckets:
    """Parameters in priority order, last layers first (backward produces their gradients first).

    After construction every parameter's ``.data`` is a view into its bucket's ``params`` buffer,
    so a receive into a bucket updates the model with no copy.

    ``fragments`` F > 1 (streaming HFA, whose rounds exchange parameters, never gradients):
    the model is one flat buffer cut into F runs of equal size (to one value), each run into
    buckets of at most ``cap_bytes``; a parameter that straddles a run's end is cut there and
    is a member of two buckets. So each fragment of the model crosses the WAN with 1/F of its
    bytes, whatever its parameters' sizes. Gradient rounds need whole parameters (``where``).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        cap_bytes: int,
        fragments: int = 1,
    ) -> None:
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[Bucket, int, int]] = {}  # id(p) -> bucket, offset, numel
        order = list(reversed(list(named_params)))
        for name, p in order:
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {name} is {p.dtype}; geompi trains fp32 parameters")
        if fragments > 1 and order:
            self._cut(order, cap_bytes, fragments)
            return
        group: list[tuple[str, torch.nn.Parameter]] = []
        size = 0
        for name, p in order:
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
            bucket.members.append(Member(name, p, off, 0, n))
            self.where[id(p)] = (bucket, off, n)
            off += n
        self.buckets.append(bucket)

    def _cut(
        self, order: list[tuple[str, torch.nn.Parameter]], cap_bytes: int, fragments: int
    ) -> None:
        """One flat buffer for the whole model, cut into ``fragments`` equal runs, and each run
        into buckets: at a parameter's end where the next one would pass the cap, and
        anywhere at a run's end."""
        total = sum(p.numel() for _, p in order)
        if fragments > total:
            raise ConfigError(
                f"streaming HFA with {fragments} fragments of a model of {total} values: at "
                f"most one fragment per value; use {total} or fewer fragments"
            )
        flat = torch.empty(total, dtype=torch.float32, device=order[0][1].device)
        grads = torch.zeros_like(flat)
        spans: list[tuple[str, torch.nn.Parameter, int]] = []  # name, p, its offset in flat
        off = 0
        for name, p in order:
            n = p.numel()
            flat[off : off + n].copy_(p.data.reshape(-1))
            p.data = flat[off : off + n].view_as(p)
            spans.append((name, p, off))
            off += n
        run_ends = sorted({total * f // fragments for f in range(1, fragments + 1)} - {0})
        cuts = [0]
        for end in run_ends:  # the runs' ends, and within a run the cap's cuts
            for _, p, at in spans:
                if cuts[-1] < at < end and (min(at + p.numel(), end) - cuts[-1]) * 4 > cap_bytes:
                    cuts.append(at)
            cuts.append(end)
        for lo, hi in zip(cuts, cuts[1:]):
            bucket = Bucket(len(self.buckets), flat[lo:hi], grads[lo:hi])
            for name, p, at in spans:
                a, b = max(lo, at), min(hi, at + p.numel())
                if b > a:
                    bucket.members.append(Member(name, p, a - lo, a - at, b - a))
            self.buckets.append(bucket)
        for bucket in self.buckets:  # gradients go by whole parameters only
            for m in bucket.members:
                if m.whole:
                    self.where[id(m.param)] = (bucket, m.offset, m.numel)

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def keys(self) -> list[tuple[int, int]]:
        return [(b.key, b.numel) for b in self.buckets]

    def named_slices(self) -> dict[str, tuple[torch.Size, list[tuple[int, int, int, int]]]]:
        """Parameter name -> (shape, its pieces ``(bucket key, offset in the key, start in the
        parameter, numel)`` in key order): how to find it in the keys."""
        out: dict[str, tuple[torch.Size, list[tuple[int, int, int, int]]]] = {}
        for b in self.buckets:
            for m in b.members:
                out.setdefault(m.name, (m.param.shape, []))[1].append(
                    (b.key, m.offset, m.start, m.numel)
                )
        return out
