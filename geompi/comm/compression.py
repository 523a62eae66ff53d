"""Compressors for the WAN tier: turn an fp32 vector into a fixed-size byte payload and back.

A payload's size depends only on the vector's length, so the receiver can post its ``Irecv``
(or size its RMA slot) before the data exists. Payloads are plain bytes to MPI: nothing here is
ever reduced by MPI (bf16 sums are wrong in Open MPI's reductions); sums happen in fp32 torch.

``ErrorFeedback`` adds what a lossy compressor dropped to the next vector sent under the same
key, as GeoMX's bi-sparse compression (BSC) and Horovod-era top-k schemes do.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from geompi.comm.buffers import all_finite
from geompi.errors import ConfigError, NonFiniteError


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


#: Values per fp32 scale in an fp16 payload.
FP16_CHUNK = 1024
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_FP32_MAX = float(torch.finfo(torch.float32).max)


class CastCompressor(Compressor):
    """fp16 or bf16, 2 bytes a value. fp16 adds one fp32 scale per ``FP16_CHUNK`` values.

    fp16 tops out at 65504, but a push (a sum of n_i * g_i, or an HFA difference) often does
    not; each chunk is divided by a power of two that puts its largest magnitude in [2^14,
    2^15), so every finite fp32 value fits (and small ones do not underflow). bf16 has fp32's
    exponent range: its values travel as they are, clamped to bf16's largest finite value.
    A non-finite input raises NonFiniteError: nothing turns into inf on the wire.
    """

    lossy = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
        self.scaled = dtype == torch.float16

    def _chunks(self, n: int) -> int:
        return -(-n // FP16_CHUNK) if self.scaled else 0

    def payload_nbytes(self, n: int) -> int:
        """2 bytes a value, plus (fp16) 4 bytes per chunk of ``FP16_CHUNK`` values."""
        return 2 * n + 4 * self._chunks(n)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """fp16: the chunks' fp32 scales, then the scaled fp16 values; bf16: the values."""
        _refuse_nonfinite(x, self.name)
        x = x.float().reshape(-1)
        if not self.scaled:
            return x.clamp(-_BF16_MAX, _BF16_MAX).to(self.dtype).view(torch.uint8)
        n, c = x.numel(), self._chunks(x.numel())
        padded = torch.zeros(c * FP16_CHUNK, dtype=torch.float32)
        padded[:n] = x
        rows = padded.view(c, FP16_CHUNK)
        _, exp = torch.frexp(rows.abs().amax(dim=1))  # amax = m * 2^exp, m in [0.5, 1)
        # 2^(exp - 15) built from its bits, so it is exact; >= 2^-126 keeps it a normal fp32
        bits = ((exp.to(torch.int32) - 15).clamp(-126, 127) + 127) << 23
        scales = bits.view(torch.float32)
        values = rows.div_(scales[:, None]).reshape(-1)[:n].to(torch.float16)
        return torch.cat([scales.view(torch.uint8), values.view(torch.uint8)])

    def decompress(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        if not self.scaled:
            return payload.view(self.dtype).to(torch.float32)
        c = self._chunks(n)
        scales = payload[: 4 * c].view(torch.float32)
        out = torch.zeros(c * FP16_CHUNK, dtype=torch.float32)
        out[:n] = payload[4 * c : 4 * c + 2 * n].view(torch.float16)
        out.view(c, FP16_CHUNK).mul_(scales[:, None])
        return out[:n].clamp_(-_FP32_MAX, _FP32_MAX)  # a value rounded up past fp32's largest


class TopKCompressor(Compressor):
    """The ``fraction`` largest-magnitude values, as (fp32 values, int32 indices)."""

    lossy = True

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.name = f"topk:{fraction!r}"  # exactly the fraction: the servers parse it

    def k(self, n: int) -> int:
        # exact: 0.07 * 100 is 7.000000000000001 in floating point, which would keep 8
        return 0 if n == 0 else max(1, math.ceil(Fraction(repr(self.fraction)) * n))

    def payload_nbytes(self, n: int) -> int:
        return 8 * self.k(n)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        _refuse_nonfinite(x, self.name)  # topk would pick a NaN first and send it
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


#: Values per fp32 scale in an int8/int4 payload.
QUANT_CHUNK = 256


class QuantCompressor(Compressor):
    """int8 or int4: symmetric per-chunk quantization, one fp32 scale per ``QUANT_CHUNK`` values.

    Each chunk is divided by ``absmax / qmax`` (qmax 127 or 7) and rounded to the nearest
    integer, so a value comes back within half a quantization step (``absmax / (2 qmax)``).
    int4 packs two values a byte. The data bytes are exactly 1/4 (int8) or 1/8 (int4) of fp32's,
    plus the scales, which ``payload_nbytes`` counts.
    """

    lossy = True

    def __init__(self, bits: int) -> None:
        if bits not in (4, 8):
            raise ValueError(bits)
        self.bits = bits
        self.qmax = 2 ** (bits - 1) - 1
        self.name = f"int{bits}"

    def _chunks(self, n: int) -> int:
        return -(-n // QUANT_CHUNK)

    def _value_nbytes(self, n: int) -> int:
        return n if self.bits == 8 else -(-n // 2)

    def payload_nbytes(self, n: int) -> int:
        return 4 * self._chunks(n) + self._value_nbytes(n)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """The chunks' fp32 scales, then the integers (int4: two a byte, low nibble first)."""
        _refuse_nonfinite(x, self.name)
        x = x.float().reshape(-1)
        n, c = x.numel(), self._chunks(x.numel())
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        padded = torch.zeros(c * QUANT_CHUNK, dtype=torch.float32)
        padded[:n] = x
        rows = padded.view(c, QUANT_CHUNK)
        scales = rows.abs().amax(dim=1) / self.qmax
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(rows / safe[:, None]).clamp_(-self.qmax, self.qmax).reshape(-1)[:n]
        if self.bits == 8:
            values = q.to(torch.int8).view(torch.uint8)
        else:
            nib = (q.to(torch.int16) + 8).to(torch.uint8)  # 1..15
            if n % 2:
                nib = torch.cat([nib, torch.full((1,), 8, dtype=torch.uint8)])
            values = nib[0::2] | (nib[1::2] << 4)
        return torch.cat([scales.view(torch.uint8), values])

    def decompress(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        if n == 0:
            return torch.zeros(0, dtype=torch.float32)
        c = self._chunks(n)
        payload = _aligned(payload)
        scales = payload[: 4 * c].view(torch.float32)
        raw = payload[4 * c : 4 * c + self._value_nbytes(n)]
        if self.bits == 8:
            q = raw.view(torch.int8).to(torch.float32)
        else:
            q = torch.stack([raw & 0xF, raw >> 4], dim=1).reshape(-1)[:n].to(torch.float32) - 8
        out = torch.zeros(c * QUANT_CHUNK, dtype=torch.float32)
        out[:n] = q
        out.view(c, QUANT_CHUNK).mul_(scales[:, None])
        return out[:n].clamp_(-_FP32_MAX, _FP32_MAX)  # 127 * (max / 127) may round past it


class TopKQuantCompressor(Compressor):
    """``topk:F+int8``: the top-k values (as ``TopKCompressor`` picks them), int8-quantized,
    with their int32 indices: 5 bytes a kept value plus a scale per ``QUANT_CHUNK`` of them."""

    lossy = True

    def __init__(self, fraction: float, bits: int = 8) -> None:
        self.topk = TopKCompressor(fraction)
        self.quant = QuantCompressor(bits)
        self.name = f"topk:{fraction!r}+int{bits}"

    def payload_nbytes(self, n: int) -> int:
        k = self.topk.k(n)
        return self.quant.payload_nbytes(k) + 4 * k

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        _refuse_nonfinite(x, self.name)
        k = self.topk.k(x.numel())
        if k == 0:
            return torch.empty(0, dtype=torch.uint8)
        idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
        values = self.quant.compress(x[idx].contiguous())
        return torch.cat([idx.to(torch.int32).view(torch.uint8), values])  # indices first: aligned

    def decompress(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        k = self.topk.k(n)
        out = torch.zeros(n, dtype=torch.float32)
        if k:
            payload = _aligned(payload)
            idx = payload[: 4 * k].view(torch.int32).long()
            out[idx] = self.quant.decompress(payload[4 * k :], k)
        return out


def _aligned(payload: torch.Tensor) -> torch.Tensor:
    """A payload whose start allows 4-byte views (a slice of a window may not)."""
    return payload if payload.storage_offset() % 4 == 0 else payload.clone()


def _refuse_nonfinite(x: torch.Tensor, name: str) -> None:
    if not all_finite(x):
        raise NonFiniteError(
            f"--wan-compression {name} was given a NaN or Inf to send: the global tier's "
            "values diverged; lower --lr or check the data"
        )


def make_compressor(spec: str | None) -> Compressor:
    """``none``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``topk:FRACTION`` (e.g.
    ``topk:0.01``) or ``topk:FRACTION+int8``."""
    spec = (spec or "none").strip().lower()
    if spec == "none":
        return Compressor()
    if spec in ("fp16", "bf16"):
        return CastCompressor(torch.float16 if spec == "fp16" else torch.bfloat16)
    if spec in ("int8", "int4"):
        return QuantCompressor(int(spec[3:]))
    if spec.startswith("topk:"):
        body, _, quant = spec[5:].partition("+")
        try:
            fraction = float(body)
        except ValueError:
            fraction = -1.0
        if 0 < fraction <= 1 and quant in ("", "int8", "int4"):
            return (
                TopKQuantCompressor(fraction, int(quant[3:])) if quant else TopKCompressor(fraction)
            )
    raise ConfigError(
        f"unknown --wan-compression {spec!r}: choose none, fp16, bf16, int8, int4, "
        "topk:FRACTION or topk:FRACTION+int8 (e.g. topk:0.01+int8)"
    )


class ErrorFeedback:
    """Per-key residuals at a sender: what compression dropped goes out with the next vector.

    A round's new residuals are staged by ``compress`` and take effect at ``commit`` (the
    round was delivered); ``discard`` drops them (a skipped round, whose data the receiver
    throws away), so a skipped round consumes nothing.
    """

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.residual: dict = {}
        self.staged: dict = {}
        self._spare: dict = {}  # key -> a residual-sized buffer to reuse

    def compress(self, key, x: torch.Tensor, idle: torch.Tensor | None = None) -> torch.Tensor:
        """The payload for ``x`` plus this key's residual; stages the new residual.

        A non-finite ``x`` (a round the local server skips) stages nothing. ``idle`` (a bool
        mask over ``x``): values of parameters that got no gradient this round. The receiver
        does not step them, so they are left out of the payload (sent as zeros) and keep their
        residual for a round that steps them.
        """
        c = self.compressor
        if not c.lossy:
            return c.compress(x)
        if not all_finite(x):
            return c.compress(torch.zeros_like(x))
        r = self.residual.get(key)
        v = self._spare.pop(key, None)
        if v is None or v.numel() != x.numel():
            v = torch.empty(x.numel(), dtype=torch.float32)
        if r is None or r.numel() != x.numel():
            v.copy_(x.reshape(-1))
        else:
            torch.add(r, x.reshape(-1), out=v)
        kept = None
        if idle is not None:
            kept = v[idle]  # a copy: the residual these values keep
            v[idle] = 0.0
        payload = c.compress(v)
        self.staged[key] = v.sub_(c.decompress(payload, v.numel()))
        if kept is not None:
            self.staged[key][idle] = kept
        return payload

    def commit(self) -> None:
        """The staged round was delivered: its residuals become the current ones."""
        for key, v in self.staged.items():
            old = self.residual.get(key)
            if old is not None:
                self._spare[key] = old
            self.residual[key] = v
        self.staged.clear()

    def discard(self) -> None:
        """The staged round was thrown away: keep the residuals it started from."""
        for key, v in self.staged.items():
            self._spare[key] = v
        self.staged.clear()
