"""Compressors for the WAN tier: turn an fp32 vector into a fixed-size byte payload and back.

A payload's size depends only on the vector's length, so the receiver can post its ``Irecv``
(or size its RMA slot) before the data exists. Payloads are plain bytes to MPI: nothing here is
ever reduced by MPI (bf16 sums are wrong in Open MPI's reductions); sums happen in fp32 torch.

``ErrorFeedback`` adds what a lossy compressor dropped to the next vector sent under the same
key, as GeoMX's bi-sparse compression (BSC) and Horovod-era top-k schemes do.
"""

from __future__ import annotations

import math

import torch

from geompi.comm.buffers import all_finite
from geompi.errors import ConfigError


class Compressor:
    """The interface: ``payload_nbytes``, ``compress``, ``decompress`` and ``ratio``."""

    name = "none"
    lossy = False

    def payload_nbytes(self, n: int) -> int:
        """The payload size for a vector of ``n`` fp32 values."""
        return 4 * n

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """A 1-D fp32 CPU tensor -> a uint8 tensor of ``payload_nbytes(x.numel())`` bytes."""
        return x.contiguous().view(torch.uint8).clone()

    def decompress(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """The payload of a vector of ``n`` values -> a new fp32 tensor of ``n`` values."""
        return payload.view(torch.float32).clone()

    def ratio(self, n: int) -> float:
        """How many times smaller than fp32 the payload of ``n`` values is."""
        return 4 * n / max(1, self.payload_nbytes(n))


class CastCompressor(Compressor):
    """fp16 or bf16: exactly half the bytes. fp16 saturates at +-65504 (like a cast does)."""

    lossy = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def payload_nbytes(self, n: int) -> int:
        return 2 * n

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).view(torch.uint8)

    def decompress(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return payload.view(self.dtype).to(torch.float32)


class TopKCompressor(Compressor):
    """The ``fraction`` largest-magnitude values, as (fp32 values, int32 indices)."""

    lossy = True

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.name = f"topk:{fraction:g}"

    def k(self, n: int) -> int:
        return 0 if n == 0 else max(1, math.ceil(self.fraction * n))

    def payload_nbytes(self, n: int) -> int:
        return 8 * self.k(n)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        k = self.k(x.numel())
        if k == 0:
            return torch.empty(0, dtype=torch.uint8)
        idx = torch.topk(x.abs(), k, sorted=False).indices
        idx, _ = idx.sort()  # a deterministic payload for equal inputs
        values = x[idx].contiguous()
        return torch.cat([values.view(torch.uint8), idx.to(torch.int32).view(torch.uint8)])

    def decompress(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        k = self.k(n)
        out = torch.zeros(n, dtype=torch.float32)
        if k:
            values = payload[: 4 * k].view(torch.float32)
            idx = payload[4 * k : 8 * k].view(torch.int32).long()
            out[idx] = values
        return out


def make_compressor(spec: str | None) -> Compressor:
    """``none``, ``fp16``, ``bf16`` or ``topk:FRACTION`` (e.g. ``topk:0.01``)."""
    spec = (spec or "none").strip().lower()
    if spec == "none":
        return Compressor()
    if spec in ("fp16", "bf16"):
        return CastCompressor(torch.float16 if spec == "fp16" else torch.bfloat16)
    if spec.startswith("topk:"):
        try:
            fraction = float(spec[5:])
        except ValueError:
            fraction = -1.0
        if 0 < fraction <= 1:
            return TopKCompressor(fraction)
    raise ConfigError(
        f"unknown --wan-compression {spec!r}: choose none, fp16, bf16 or topk:FRACTION "
        "(e.g. topk:0.01)"
    )


class ErrorFeedback:
    """Per-key residuals at a sender: what compression dropped goes out with the next vector."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.residual: dict = {}

    def compress(self, key, x: torch.Tensor) -> torch.Tensor:
        """The payload for ``x`` plus this key's residual; keeps the new residual.

        A non-finite ``x`` (a round the local server skips) leaves the residual alone.
        """
        c = self.compressor
        if not c.lossy:
            return c.compress(x)
        r = self.residual.get(key)
        if not all_finite(x):
            return c.compress(torch.zeros_like(x))
        v = x.float().clone() if r is None else r.add_(x)
        payload = c.compress(v)
        self.residual[key] = v.sub_(c.decompress(payload, v.numel()))
        return payload
