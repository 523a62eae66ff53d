"""Collectives among the workers for a script's own metrics and decisions (servers excluded):
``geompi.all_reduce``, ``geompi.broadcast_object`` and ``geompi.local_worker_rank``, as Horovod's
``hvd.allreduce`` / ``broadcast_object`` / ``local_rank``.

Every worker calls them at the same point. Before the reduction itself the workers compare
what they pass (shape, dtype, op): a mismatch is one line from the master and every rank of
the job stops, instead of a reduction over buffers of different sizes.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from geompi.errors import ConfigError

OPS = ("mean", "sum", "max", "min")


def _session():
    from geompi import session

    return session.worker_session()


def all_reduce(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """The ``op`` ("mean", "sum", "max" or "min") of ``tensor`` over every worker, as a new
    tensor of the same shape, dtype and device on every worker. Floating tensors are reduced
    in float64 (never bf16/fp16 through MPI), integer and bool ones in int64 ("mean" of an
    integer tensor is refused: cast it first)."""
    from mpi4py import MPI

    from geompi import session
    from geompi.comm.transport import wait_for, worker_timeout

    s = _session()
    err = None
    try:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"geompi.all_reduce needs a torch.Tensor, got {type(tensor).__name__}"
            )
        if op not in OPS:
            raise ConfigError(f"geompi.all_reduce(op={op!r}): choose one of {', '.join(OPS)}")
        if tensor.is_complex():
            raise ConfigError(f"geompi.all_reduce: a {tensor.dtype} tensor cannot be reduced")
        if op == "mean" and not tensor.is_floating_point():
            raise ConfigError(
                f"geompi.all_reduce(op='mean') of a {tensor.dtype} tensor: cast it to a floating "
                "dtype first (or use op='sum')"
            )
    except ConfigError as e:
        err = e
    session.fail_together(s, err)
    comm = s.worker_comm
    mine = f"{tuple(tensor.shape)} {tensor.dtype} op={op}"
    everyone = comm.allgather(mine)
    if len(set(everyone)) > 1:
        w = next(i for i, x in enumerate(everyone) if x != everyone[0])
        session.stop_identically(
            s,
            ConfigError(
                f"geompi.all_reduce: worker {w} passed {everyone[w]} but worker 0 passed "
                f"{everyone[0]}: every worker must reduce the same shape, dtype and op"
            ),
        )
    wide = torch.float64 if tensor.is_floating_point() else torch.int64
    buf = tensor.detach().to("cpu", wide).contiguous().clone()
    mpi_op = {"mean": MPI.SUM, "sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
    req = comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=mpi_op)
    wait_for([req], worker_timeout(s.cfg.comm_timeout), "every worker in geompi.all_reduce")
    if op == "mean":
        buf /= comm.Get_size()
    return buf.to(tensor.device, tensor.dtype)


def broadcast_object(obj: Any = None, root: int = 0) -> Any:
    """``obj`` of worker ``root`` (a worker rank, 0 .. num_workers() - 1) on every worker. It
    travels pickled among the job's own workers (never read from a file)."""
    from geompi.comm.transport import barrier_before_collective

    s = _session()
    comm = s.worker_comm
    if not (isinstance(root, int) and 0 <= root < comm.Get_size()):
        from geompi import session

        session.stop_identically(
            s, ConfigError(f"geompi.broadcast_object(root={root!r}): not a worker rank")
        )
    data = None
    if comm.Get_rank() == root:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    barrier_before_collective(comm, s.cfg.comm_timeout, "every worker in broadcast_object")
    data = comm.bcast(data, root=root)
    return pickle.loads(data.tobytes())  # noqa: S301 - from a worker of this same job


def local_worker_rank() -> int:
    """This worker's index among the workers on its node (0 .. workers on the node - 1):
    the ``LOCAL_RANK`` of torchrun, for choosing a GPU or a per-node file."""
    return _session().local_rank


def stop_requested() -> bool:
    """Whether the job was asked to stop (SIGTERM, SIGINT or SIGUSR1 to any worker, e.g. a
    Slurm pre-emption or ``scancel --signal=USR1``), agreed by every worker: True at the same
    call on every worker, so all of them can ``geompi.save`` and leave the loop together.

    Collective over the workers: call it at the same point of every step (or every N steps).
    From the first call on, those signals no longer end a worker's process: they are recorded
    and answered here (the CLI's own stop works the same way). The agreement is nonblocking and
    runs one call behind: a signal is seen at the second call after it at most, with no extra
    wait in the step. ``geompi.finish()`` puts the previous signal handlers back.
    """
    from geompi.comm.transport import worker_timeout
    from geompi.runtime import StopRequest, install_signal_handlers

    s = _session()
    if s.stop is None:
        s.stop_handlers = install_signal_handlers()
        s.stop = StopRequest(s.comms.all_workers, worker_timeout(s.cfg.comm_timeout))
    return s.stop.poll()
