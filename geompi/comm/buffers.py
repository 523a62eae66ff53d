"""Hand torch tensors to MPI: zero-copy on the CPU, direct or staged for CUDA.

A CPU tensor becomes a numpy view of the same memory. A CUDA tensor goes to MPI directly when
the MPI library is CUDA-aware (detected, never assumed); otherwise through a reused pinned host
buffer, copied in before a send and out after a receive completes. ``BufferPool`` keeps the
servers' buffers across rounds and ``all_finite`` is their fast NaN/Inf check of a sum.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

import torch


class BufferPool:
    """Reused fp32 buffers by key, for a server's receives and sums: fresh large buffers would
    pay their page faults on every round."""

    def __init__(self) -> None:
        self._bufs: dict = {}

    def get(self, key, numel: int) -> torch.Tensor:
        """The buffer of ``key``, reallocated (zeroed) when its size changed; its contents are
        whatever the last user left."""
        b = self._bufs.get(key)
        if b is None or b.numel() != numel:
            b = self._bufs[key] = torch.zeros(numel, dtype=torch.float32)
        return b


def all_finite(t: torch.Tensor) -> bool:
    """True when no element of ``t`` is NaN or Inf.

    A NaN or Inf makes the sum non-finite, so a finite sum proves the whole buffer finite; only
    a sum that overflowed needs the exact, 40x slower, element-wise check.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi() -> bool:
    """True when the loaded MPI can read and write CUDA memory.

    ``GEOMPI_CUDA_AWARE=0|1`` overrides. Otherwise asks Open MPI's ``MPIX_Query_cuda_support``
    (the run-time answer, not the build-time one), or MPICH's ``MPIR_CVAR_ENABLE_GPU``.
    """
    env = os.environ.get("GEOMPI_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes", "on")
    try:
        from mpi4py import MPI

        version = MPI.Get_library_version()
    except Exception:  # noqa: BLE001 - no MPI means no CUDA-aware MPI
        return False
    if "Open MPI" in version:
        try:
            with open("/proc/self/maps") as f:
                libs = sorted(set(re.findall(r"(/\S*libmpi\.so\S*)", f.read())))
            for path in libs:
                query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
                if query is not None:
                    return bool(query())
        except OSError:
            return False
        return False
    if "MPICH" in version:
        return os.environ.get("MPIR_CVAR_ENABLE_GPU", "1") not in ("0", "false")
    return False


def host_view(t: torch.Tensor):
    """A numpy view of a contiguous CPU tensor (bf16 as its int16 bits), sharing memory."""
    if not t.is_contiguous():
        raise BufferError("MPI buffers must be contiguous tensors")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


class Staging:
    """Where a device tensor goes through host memory: one reused (pinned) buffer per tensor.

    ``force`` stages CPU tensors too; it exists so that this path is tested on machines without
    a GPU (an emulation of a non-CUDA-aware MPI, named as such in the tests).
    """

    def __init__(self, force: bool = False) -> None:
        self.force = force
        self._host: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def needed(self, t: torch.Tensor) -> bool:
        return self.force or (t.is_cuda and not cuda_aware_mpi())

    def host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel(), t.dtype)
        buf = self._host.get(key)
        if buf is None:
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self._host[key] = buf
        return buf

    def for_send(self, t: torch.Tensor):
        """The buffer MPI reads for sending ``t``: ``t`` itself or a host copy of it."""
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
        if not self.needed(t):
            return t.detach() if t.is_cuda else host_view(t)
        buf = self.host_buffer(t)
        buf.copy_(t.detach())
        return host_view(buf)

    def for_recv(self, t: torch.Tensor):
        """(buffer MPI writes, callback to run once the receive completes)."""
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
        if not self.needed(t):
            return (t.detach() if t.is_cuda else host_view(t)), None
        buf = self.host_buffer(t)

        def copy_back() -> None:
            with torch.no_grad():
                t.copy_(buf)

        return host_view(buf), copy_back
