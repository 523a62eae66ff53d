"""Emulated links: a bandwidth and a one-way latency imposed on real MPI transfers.

On one machine every MPI transfer is fast; geompi can make the global tier (and, if asked, the
datacenter LANs) behave like a slow link. This is emulation, not a network simulator: a transfer
of B bytes is held back until at least ``latency + B / bandwidth`` after it could start, and
transfers that share a direction of a link are serialized (the second starts when the first has
finished leaving). The real MPI transfer still happens, after the hold.

One ``Channel`` models one direction of one link; the local server owns both directions of its
datacenter's WAN link (and of its LAN port), so every message of the datacenter is charged to
the same channel whichever global server it goes to.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from geompi.errors import ConfigError

_RATE_UNITS = {
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
# Emulated links within these bounds: beyond them a transfer's hold overflows time.sleep (a
# traceback) or never ends. The slowest link is 1 kbit/s, the longest one-way latency 60 s.
MIN_RATE = 1e3 / 8  # bytes per second
MAX_RATE = 1e15  # bytes per second (8 Pbit/s)
MAX_LATENCY_S = 60.0


def parse_rate(text: str, flag: str = "--wan-bandwidth") -> float:
    """``100Mbit``, ``1Gbit``, ``12.5MB`` (per second; bits or bytes) -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[-+]?\d+)?)\s*([a-zA-Z]+)(?:/s|ps)?\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _RATE_UNITS:
        raise ConfigError(f"{flag} {text!r}: give a rate with a unit, e.g. 100Mbit, 1Gbit or 50MB")
    value = float(m.group(1)) * _RATE_UNITS[unit]
    if not value > 0:
        raise ConfigError(f"{flag} {text!r}: the rate must be > 0")
    if not MIN_RATE <= value <= MAX_RATE:
        raise ConfigError(f"{flag} {text!r}: emulate a rate from 1kbit to 8000000Gbit per second")
    return value


def parse_duration(text: str, flag: str = "--wan-latency") -> float:
    """``25ms``, ``0.025s``, ``500us`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[-+]?\d+)?)\s*(s|ms|us)\s*", str(text))
    if not m:
        raise ConfigError(f"{flag} {text!r}: give a time with a unit, e.g. 25ms, 0.1s or 500us")
    value = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if not value <= MAX_LATENCY_S:
        raise ConfigError(f"{flag} {text!r}: emulate at most {MAX_LATENCY_S:g}s one way")
    return value


@dataclass(frozen=True)
class LinkModel:
    """A link's bandwidth (bytes/s; None: unlimited) and one-way latency (seconds)."""

    bandwidth: float | None = None
    latency: float = 0.0

    @property
    def active(self) -> bool:
        return self.bandwidth is not None or self.latency > 0

    def transfer_s(self, nbytes: int) -> float:
        """The time a lone transfer of ``nbytes`` takes on this link."""
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)

    def describe(self) -> str:
        bw = f"{self.bandwidth * 8 / 1e6:g} Mbit/s" if self.bandwidth else "unlimited"
        return f"{bw}, {self.latency * 1e3:g} ms one-way"


class Channel:
    """One direction of one emulated link: a queue that serializes transfers."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self.free_at = 0.0  # when the last transfer has finished leaving the sender
        self.held_s = 0.0  # seconds spent holding transfers back

    def schedule(self, nbytes: int, ready: float | None = None) -> float:
        """Queue a transfer that could start at ``ready`` (default: now); returns when it has
        arrived at the far end."""
        start = max(time.perf_counter() if ready is None else ready, self.free_at)
        self.free_at = start + (nbytes / self.model.bandwidth if self.model.bandwidth else 0.0)
        return self.free_at + self.model.latency

    def hold_until(self, t: float) -> float:
        """Sleep until ``t`` (perf_counter time); returns the seconds slept."""
        dt = t - time.perf_counter()
        if dt <= 0:
            return 0.0
        time.sleep(dt)
        self.held_s += dt
        return dt

    def hold_burst(self, burst: list[float], nbytes: int, delay: float = 0.0) -> float:
        """Hold one message of a burst that left the far end together: the queue starts at
        the first message's arrival (plus ``delay``, e.g. a request's latency); returns the
        seconds slept. ``burst`` is an empty list per burst, filled here."""
        if not burst:
            burst.append(time.perf_counter() + delay)
        return self.hold_until(self.schedule(nbytes, burst[0]))


class Duplex:
    """Both directions of one emulated link, as seen from the local server."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self.up = Channel(model)  # from this datacenter
        self.down = Channel(model)  # into this datacenter
