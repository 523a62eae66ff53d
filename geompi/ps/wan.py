"""The global tier's WAN settings, and how its data rounds are compressed on either side.

Push (local server -> global servers): a datacenter's gradient sum, compressed with error
feedback per key slice (a parameter none of its workers had a gradient for stays out of the
push and keeps its residual: the global servers would not step it); or for an HFA average,
its weighted parameter sum less ``weight x replica``, where what compression leaves out stays
in the datacenter's model.
Pull (global servers -> local servers): the change of the global values since what the
datacenters last received (their *replica*), compressed; both ends add the same decoded change
to their replica, so what a compressor drops now goes out with the next pull (error feedback
through the replica, as in GeoMX's bi-sparse compression). INIT rounds travel uncompressed and
set the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from geompi.comm.compression import Compressor, ErrorFeedback, make_compressor
from geompi.comm.linkmodel import LinkModel, parse_duration, parse_rate


@dataclass(frozen=True)
class WanSettings:
    """The emulated WAN (and LAN) links and the WAN compressor of a run."""

    wan: LinkModel = field(default_factory=LinkModel)
    lan: LinkModel = field(default_factory=LinkModel)
    compression: str = "none"

    @classmethod
    def parse(
        cls,
        wan_bandwidth: str | None = None,
        wan_latency: str | None = None,
        lan_bandwidth: str | None = None,
        compression: str | None = None,
    ) -> WanSettings:
        """From the CLI strings; raises ConfigError naming the flag on bad input."""
        wan = LinkModel(
            parse_rate(wan_bandwidth) if wan_bandwidth else None,
            parse_duration(wan_latency) if wan_latency else 0.0,
        )
        lan = LinkModel(parse_rate(lan_bandwidth, "--lan-bandwidth") if lan_bandwidth else None)
        return cls(wan, lan, make_compressor(compression).name)

    def compressor(self) -> Compressor:
        return make_compressor(self.compression)


class TierCodec:
    """One side of the compressed global tier. Keys are whatever identifies a slice on this
    side: ``(key, shard)`` at a local server, ``key`` or ``(key, dc)`` at a global server."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.feedback = ErrorFeedback(compressor)
        self.replica: dict = {}
        self.kept: dict = {}  # HFA: the part of the last push compression left out
        # Gradient rounds with presence (FSA on the servers, MixedSync), at a local server: per
        # key, its parameters as (offset, numel, presence index), from the INIT spec's layout;
        # and this round's per-parameter counts in the datacenter, None when all are present.
        self.layout: dict[int, list[tuple[int, int, int]]] = {}
        self.present: torch.Tensor | None = None

    def nbytes(self, n: int) -> int:
        return self.compressor.payload_nbytes(n)

    def set_replica(self, rkey, values: torch.Tensor) -> None:
        """After an uncompressed round (INIT, or a forced global one): both ends hold exactly
        ``values``, and nothing a push left out is owed any more (it went up whole)."""
        self.replica[rkey] = values.detach().clone()
        self.kept.pop(rkey, None)

    def _replica(self, rkey, n: int) -> torch.Tensor:
        r = self.replica.get(rkey)
        if r is None or r.numel() != n:
            r = self.replica[rkey] = torch.zeros(n, dtype=torch.float32)
        return r

    # ---- sender of pushes: the local server ---------------------------------------------
    def set_layout(self, layout: list) -> None:
        """The INIT spec's ``layout`` (``[[key, [[name, offset, numel, ...], ...]], ...]``, in
        the order of the presence vector)."""
        self.layout, index = {}, 0
        for key, params in layout:
            self.layout[int(key)] = [
                (int(p[1]), int(p[2]), index + j) for j, p in enumerate(params)
            ]
            index += len(params)

    def set_presence(self, counts: torch.Tensor | None) -> None:
        """This round's presence key as the datacenter summed it (its first copy counts each
        parameter's workers with a gradient); None or empty: every parameter is present."""
        n = sum(len(params) for params in self.layout.values())
        if counts is None or not counts.numel() or not n or bool((counts[:n] > 0).all()):
            self.present = None
        else:
            self.present = counts[:n].clone()

    def idle(self, key: int, lo: int, hi: int) -> torch.Tensor | None:
        """Over the slice ``[lo, hi)`` of ``key``: which values belong to a parameter no worker
        of this datacenter produced a gradient for this round (None: none do)."""
        if self.present is None:
            return None
        mask = None
        for off, n, index in self.layout.get(key, ()):
            a, b = max(lo, off), min(hi, off + n)
            if b > a and not self.present[index] > 0:
                if mask is None:
                    mask = torch.zeros(hi - lo, dtype=torch.bool)
                mask[a - lo : b - lo] = True
        return mask

    def encode_push(
        self, rkey, x: torch.Tensor, ref_weight: float = 0.0, idle: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A push's payload.

        A gradient (``ref_weight`` 0) goes out with error feedback, its residual staged until
        ``end_push``; the values ``idle`` marks (parameters without a gradient this round,
        which the global servers do not step) stay out of it and keep their residual. An HFA
        average (``x`` the
        datacenter's parameters times ``ref_weight``) goes out as its change from the replica;
        what compression leaves out stays in the datacenter's model (see ``decode_pull``) and
        so goes out with the next global round: error feedback through the model.
        """
        if not ref_weight:
            return self.feedback.compress(rkey, x, idle)
        delta = x - ref_weight * self._replica(rkey, x.numel())
        payload = self.compressor.compress(delta)
        kept = delta.sub_(self.compressor.decompress(payload, x.numel())).div_(ref_weight)
        self.kept[rkey] = kept
        return payload

    def end_push(self, delivered: bool) -> None:
        """A round's pushes are all encoded: keep their residuals if the global servers use
        them (``delivered``), else roll back, so a skipped round loses no gradient."""
        if delivered:
            self.feedback.commit()
        else:
            self.feedback.discard()

    def decode_pull(self, rkey, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Apply a pulled change to the replica; ``out`` becomes the new replica plus what
        this datacenter's last push left out."""
        r = self._replica(rkey, out.numel())
        r.add_(self.compressor.decompress(payload, out.numel()))
        out.copy_(r)
        kept = self.kept.pop(rkey, None)
        if kept is not None:
            out.add_(kept)

    # ---- sender of pulls: the global server ---------------------------------------------
    def decode_push(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return self.compressor.decompress(payload, n)

    def reference(self, rkey, n: int) -> torch.Tensor:
        """What the receiving datacenters hold for this slice (the pushes' reference)."""
        return self._replica(rkey, n)

    def encode_pull(self, rkey, values: torch.Tensor) -> torch.Tensor:
        """The payload of ``values - replica``; the replica moves by what the payload says."""
        r = self._replica(rkey, values.numel())
        payload = self.compressor.compress(values - r)
        r.add_(self.compressor.decompress(payload, values.numel()))
        return payload
