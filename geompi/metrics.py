"""Training metrics: the JSON-lines log (schema ``geompi.metrics/1``, docs/metrics.md), its
optional TensorBoard twin, and the progress lines, for the Python API and the CLI alike.

:class:`Metrics` is the one path: the CLI's loop calls it as a user's loop does. Every worker
calls :meth:`Metrics.step` at the same steps; the workers average the loss among themselves
(a nonblocking allreduce, completed a step or more later, so it adds no wait), and rank 0
writes the record. :data:`FIELDS` lists every field of every kind of record; the docs table
and a test are checked against it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from geompi.comm.transport import LAN, wait_for
from geompi.errors import ConfigError, GeompiError
from geompi.logs import get_logger

if TYPE_CHECKING:  # pragma: no cover
    from geompi.optimizer import GeompiOptimizer

SCHEMA = "geompi.metrics/1"
LOG = get_logger("geompi.metrics")
# Batches of records started and not yet complete on a worker before it waits for the
# oldest: how far a fast MixedSync datacenter may run ahead of a slow one while metrics are on.
MAX_PENDING = 1024
# Step records are averaged in batches covering this many steps by default (every=1: 8
# records per allreduce): a collective at every step costs a step of fast local training
# (HFA's) several per cent on a loaded node, and records only need to arrive in order.
BATCH_STEPS = 8

# Every field of every kind of record: name -> (always present, meaning). docs/metrics.md
# has the same table (tests/test_metrics_schema.py compares them, and emitted records).
# A name ending in "*" stands for every field with that prefix.
FIELDS: dict[str, dict[str, tuple[bool, str]]] = {
    "all": {
        "schema": (True, 'the schema of the record, "geompi.metrics/1"'),
        "kind": (True, "start, step, eval, checkpoint, k2, failure or summary"),
        "time": (True, "seconds since rank 0 opened the log"),
    },
    "start": {
        "event": (True, '"start" (the name of the kind before schema 1)'),
        "topology": (True, "world_size, dc_sizes, global_servers, workers"),
        "workers": (True, "the workers that average each step record"),
        "every": (True, "steps between step records"),
        "total_steps": (True, "the steps the run will take (null where not told)"),
        "config": (False, "the CLI: every setting of the run"),
    },
    "step": {
        "step": (True, "the step just done (as the caller counts)"),
        "loss": (
            True,
            "the training loss at this step, the mean over every worker (MixedSync: the "
            "master's datacenter)",
        ),
        "lr": (True, "the learning rate of the first parameter group (null if none)"),
        "workers": (True, "how many workers the mean is over"),
        "lan_bytes": (True, "bytes the workers sent and received on their LAN, cumulative"),
        "wan_bytes": (True, "bytes the local servers sent and received on the WAN, cumulative"),
        "wall_s": (True, "seconds since training began, the mean over the workers"),
        "compute_s": (True, "of wall_s: forward and backward, less waits (mean)"),
        "wait_s": (True, "of wall_s: waiting on the local server (LAN and WAN rounds; mean)"),
        "other_s": (True, "of wall_s: the rest (optimizer steps, data, evaluation; mean)"),
    },
    "eval": {
        "step": (True, "the step evaluated"),
        "wall_s": (True, "rank 0's seconds since training began (the API: since Metrics)"),
        "test_acc": (False, "the CLI: rank 0's accuracy on the test set"),
        "test_loss": (False, "the CLI: rank 0's loss on the test set"),
        "*": (False, "the API: the names and numbers the caller passed"),
    },
    "checkpoint": {
        "step": (True, "the step checkpointed"),
        "checkpoint": (True, "the file written"),
        "test_acc": (False, "rank 0's test accuracy at that step"),
        "test_loss": (False, "rank 0's test loss at that step"),
    },
    "k2": {
        "event": (True, '"k2"'),
        "step": (True, "the step HFA's adaptive cadence chose another K2 at"),
        "old_k2": (True, "K2 before"),
        "new_k2": (True, "K2 after"),
        "exchange_s": (True, "the measured time of one global exchange"),
        "round_compute_s": (True, "the measured compute time of one datacenter round"),
        "wall_s": (True, "rank 0's seconds since training began"),
    },
    "failure": {
        "event": (True, '"failure"'),
        "step": (True, "the step a lost rank was met at"),
        "lost_ranks": (True, "the ranks lost (world ranks at start-up)"),
        "left_dcs": (True, "the datacenters that left with them"),
        "lost_workers": (True, "how many workers were lost"),
        "topology": (True, "the topology training goes on in"),
        "results_from_peer": (True, "this worker took the last round's results from a peer"),
        "recovered_at": (True, "the Unix time the survivors recovered"),
    },
    "summary": {
        "summary": (True, "true (the marker of the summary before schema 1)"),
        "steps": (True, "the steps trained (the API: the last step recorded)"),
        "wall_s": (True, "seconds the loop took, to the final model (the API: to close())"),
        "compute_s": (False, "the CLI: rank 0's forward and backward, less waits"),
        "train_s": (False, "the CLI: wall_s before waiting for the other datacenters"),
        "preempted": (False, "the CLI: stopped by a signal before the last step"),
        "stopped_at": (False, "the CLI: the step it stopped at (HFA: may follow steps)"),
        "checkpointed": (False, "the CLI: a checkpoint of the end was written"),
        "global_syncs": (False, "the CLI: synchronizations of the global tier"),
        "signal": (False, 'the CLI: the stop signal received, or ""'),
        "failures": (False, "the CLI: every lost rank survived (--on-failure continue)"),
        "k2": (False, "the CLI, --adaptive-sync: the K2 it ended with"),
        "k2_changes": (False, "the CLI, --adaptive-sync: how many times K2 changed"),
        "test_acc": (False, "the CLI: rank 0's final test accuracy"),
        "test_loss": (False, "the CLI: rank 0's final test loss"),
        "lan_bytes": (False, "the CLI: bytes sent on LAN links by every rank"),
        "wan_bytes": (False, "the CLI: bytes sent on WAN links by every rank"),
        "wan_data_bytes": (False, "the CLI: wan_bytes less headers, trailers and specs"),
        "global_in_bytes": (False, "the CLI: bytes the global servers received"),
        "skipped_nonfinite": (False, "the CLI: rounds skipped for a NaN/Inf (--on-nonfinite)"),
        "global_updates": (False, "the CLI: updates global server 0 applied"),
        "dc_updates": (False, "the CLI, MixedSync: deposits applied per datacenter"),
        "samples_applied": (False, "the CLI, MixedSync: the samples of those deposits"),
        "staleness_*": (False, "the CLI, MixedSync: the deposits' staleness figures"),
        "updates_at_*": (False, "the CLI, MixedSync: updates applied at given points"),
        "time_split": (False, "the CLI: compute_s, lan_wait_s, wan_wait_s, other_s, held"),
        "samples": (False, "the CLI: the samples the final model has seen"),
        "sync": (False, "the CLI: the algorithm"),
        "topology": (False, "the CLI: the topology at the end"),
        "*": (False, "the API: the names and values given to close()"),
    },
}


def _open(path: str) -> IO[str]:
    """``path`` opened for appending; a ConfigError naming --metrics if it cannot be."""
    if os.path.isdir(path):
        raise ConfigError(f"--metrics {path} is a directory: give a file, e.g. {path}/m.jsonl")
    try:
        return open(path, "a")  # noqa: SIM115 - closed by MetricsLog.close
    except OSError as e:
        raise ConfigError(f"--metrics {path}: cannot open it ({e.strerror or e})") from None


class MetricsLog:
    """Rank 0's sink: one JSON object per line to ``path`` (nothing when path is None), each
    with ``schema`` and ``time`` first, and with ``tensorboard=DIR`` the same records as
    TensorBoard scalars (:func:`_to_tensorboard`)."""

    def __init__(self, path: str | None, tensorboard: str | None = None) -> None:
        self.records = 0
        self.path = path
        self._f: IO[str] | None = _open(path) if path else None
        self._t0 = time.time()
        self._tb: Any = _summary_writer(tensorboard) if tensorboard else None

    def write(self, record: dict) -> None:
        """Append ``record``. A failed write (a full disk) stops the log, not the training:
        one warning line, then the records are counted but not written."""
        self.records += 1
        if self._f is not None:
            head = {"schema": SCHEMA, "time": round(time.time() - self._t0, 4)}
            line = json.dumps({**head, **record}) + "\n"
            try:
                self._f.write(line)
                self._f.flush()
            except OSError as e:
                self._stop(e)
        if self._tb is not None:
            _to_tensorboard(self._tb, record)

    def _stop(self, e: OSError) -> None:
        LOG.warning(
            f"geompi: warning: cannot write the metrics file {self.path} ({e.strerror or e}); "
            "training goes on without metrics: free some space or pass another --metrics"
        )
        f, self._f = self._f, None
        with contextlib.suppress(OSError):
            if f is not None:
                f.close()

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as e:
                self._f = None
                LOG.warning(
                    f"geompi: warning: cannot finish the metrics file {self.path} "
                    f"({e.strerror or e})"
                )
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _summary_writer(logdir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            f"--tensorboard {logdir} needs the tensorboard package: pip install tensorboard "
            "(or 'geompi[tensorboard]')"
        ) from None
    return SummaryWriter(log_dir=logdir)


_STEP_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "lan_bytes": "bytes/lan_bytes",
    "wan_bytes": "bytes/wan_bytes",
    "compute_s": "time/compute_s",
    "wait_s": "time/wait_s",
    "other_s": "time/other_s",
}


def _to_tensorboard(tb: Any, record: dict) -> None:
    """The scalars of one metrics record (of schema 1, or of the records before it)."""
    kind = record.get("kind")
    if kind == "start" or record.get("event") == "start":
        tb.add_text("config", json.dumps(record.get("config", {}), indent=1), 0)
        return
    if kind == "summary" or record.get("summary"):
        step = int(record.get("steps", 0))
        for k, v in record.items():
            if k.endswith("_bytes") and isinstance(v, (int, float)):
                tb.add_scalar(f"bytes/{k}", v, step)
        for k, v in record.get("time_split", {}).items():
            tb.add_scalar(f"time/{k}", v, step)
        for k in ("wall_s", "compute_s", "test_acc", "test_loss"):
            if isinstance(record.get(k), (int, float)):
                tb.add_scalar(f"summary/{k}", record[k], step)
        tb.flush()
        return
    at: Any = record.get("step")
    if at is None:
        return
    step = int(at)
    if kind == "k2" or record.get("event") == "k2":  # --adaptive-sync chose another K2
        tb.add_scalar("hfa/k2", record["new_k2"], step)
    for k, tag in _STEP_SCALARS.items():
        if isinstance(record.get(k), (int, float)) and (k == "loss" or kind == "step"):
            tb.add_scalar(tag, record[k], step)
    if "test_acc" in record:
        tb.add_scalar("test/acc", record["test_acc"], step)
    if "test_loss" in record:
        tb.add_scalar("test/loss", record["test_loss"], step)
    for k, v in record.items():  # an API evaluation's own figures
        if kind == "eval" and k not in ("step", "wall_s", "test_acc", "test_loss"):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                tb.add_scalar(f"eval/{k}", v, step)


def duration(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS`` (``M:SS`` under an hour)."""
    s = max(0, int(round(seconds)))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(
    step: int,
    total: int | None,
    elapsed: float,
    rate: float,
    loss: tuple[int, float] | None = None,
    note: str = "",
    samples_per_s: float | None = None,
) -> str:
    """One progress line: the step (of ``total``), ``note``, the last mean loss (with its own
    step where that is behind), samples/s, the elapsed time and, from the step ``rate`` (steps
    per second), the time left."""
    parts = [f"geompi: step {step}" + (f"/{total}" if total else "")]
    if note:
        parts.append(note)
    if loss is not None:
        at, value = loss
        parts.append(f"loss {value:.4f}" + (f" (step {at})" if at != step else ""))
    if samples_per_s is not None:
        parts.append(f"{samples_per_s:.0f} samples/s")
    parts.append(f"elapsed {duration(elapsed)}")
    if total and rate > 0:
        parts.append(f"eta {duration(max(0, total - step) / rate)}")
    return " ".join(parts)


class _Batch:
    """Step records averaged together: one nonblocking allreduce of all their values, started
    once the batch is full (or at a flush), so that the workers meet once per batch rather
    than at every record. Open (``req`` None) while records are still added to it."""

    __slots__ = ("comm", "steps", "lrs", "rows", "after", "send", "recv", "req")

    def __init__(self, comm) -> None:
        self.comm = comm
        # rank 0's own records made while the batch is open, each after the step record it
        # followed: (that record's position in the batch, the record)
        self.after: list[tuple[int, dict]] = []
        self.steps: list[int] = []
        self.lrs: list[float | None] = []
        self.rows: list[list[float]] = []
        self.send: np.ndarray | None = None
        self.recv: np.ndarray | None = None
        self.req: Any = None

    def add(self, step: int, lr: float | None, values: list[float]) -> None:
        self.steps.append(step)
        self.lrs.append(lr)
        self.rows.append(values)

    def start(self) -> None:
        from mpi4py import MPI

        self.send = np.array(self.rows, dtype=np.float64)
        self.recv = np.zeros_like(self.send)
        self.req = self.comm.Iallreduce(self.send, self.recv, MPI.SUM)

    def records(self) -> Iterator[tuple[bool, dict]]:
        """(a step record?, the record), in the order they were made."""
        assert self.recv is not None  # started, and complete
        after = iter(self.after)
        nxt = next(after, None)
        for i, (step, lr, row) in enumerate(zip(self.steps, self.lrs, self.recv.tolist())):
            yield True, _step_record(step, lr, row)
            while nxt is not None and nxt[0] == i:
                yield False, nxt[1]
                nxt = next(after, None)


def _step_record(step: int, lr: float | None, summed: list[float]) -> dict:
    """A step record from its values summed over the workers (the last one counts them)."""
    loss, lan, wan, compute, wait, wall, n = summed
    n = max(1.0, n)
    wall, compute, wait = wall / n, compute / n, wait / n
    known = compute == compute  # NaN: no optimizer known, no bytes or time split (null)
    return {
        "kind": "step",
        "step": step,
        "loss": loss / n,
        "lr": lr,
        "workers": int(n),
        "lan_bytes": int(lan) if known else None,
        "wan_bytes": int(wan) if known and wan == wan else None,  # NaN: not asked of servers
        "wall_s": wall,
        "compute_s": compute if known else None,
        "wait_s": wait if known else None,
        "other_s": max(0.0, wall - compute - wait) if known else None,
    }


class Metrics:
    """Training metrics of the Python API (and of the CLI, which uses this class): a
    JSON-lines log, optionally TensorBoard, and progress lines with elapsed time and ETA.

    Build it on every worker after the ``DistributedOptimizer``, with the same arguments, and
    call :meth:`step` after each ``optimizer.step()``, with the same step numbers on every
    worker; servers need nothing. Every ``every`` steps a record of kind ``step`` carries the
    loss averaged over every worker, the learning rate, the cumulative LAN and WAN bytes and
    the time split (docs/metrics.md lists every field). The averages are nonblocking
    allreduces among the workers, one per ``batch`` records, completed when they are done, so
    the record of a step is written some steps later (in step order) and training never
    waits for it. Rank 0 writes::

        metrics = geompi.Metrics("m.jsonl", optimizer=opt, every=10, total_steps=1000,
                                 tensorboard="tb/", progress_steps=100)
        for step in range(1, 1001):
            ...; loss.backward(); opt.step()
            metrics.step(step, loss)
        metrics.close(test_acc=acc)       # every worker: the last records, then the summary

    Args:
        path: the JSON-lines file rank 0 appends to (None: no file).
        optimizer: the ``DistributedOptimizer``; without it (here or at :meth:`step`) the
            records have no learning rate, bytes or time split (null).
        tensorboard: a directory for TensorBoard scalars as well (needs ``tensorboard``).
        every: steps between records (a step record when ``step % every == 0``).
        batch: step records averaged in one allreduce (default: those of 8 steps, at least
            one); the records of a batch are written once the last of them is averaged.
        total_steps: the steps the loop will take, for the ETA of the progress lines.
        progress_steps: rank 0 prints a progress line every this many steps (None: never).
        progress_s: or every this many seconds (None: never).
        start: more fields for the ``start`` record (JSON-friendly).

    A bad argument is one line from rank 0 and every rank stops, as the other API errors.
    Use it as a context manager, or call :meth:`close` on every worker.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        optimizer: GeompiOptimizer | None = None,
        tensorboard: str | os.PathLike | None = None,
        every: int = 1,
        batch: int | None = None,
        total_steps: int | None = None,
        progress_steps: int | None = None,
        progress_s: float | None = None,
        start: dict | None = None,
        _agree: bool = True,
        _engine: Any = None,
        _wan_stats: bool = True,
    ) -> None:
        self._engine = _engine if _engine is not None else _engine_of(optimizer)
        session = self._engine.s if self._engine is not None else _session()
        self._session = session
        self.master = session.rank == 0
        self.every, self.total_steps = every, total_steps
        self.progress_steps, self.progress_s = progress_steps, progress_s
        err = _check(every, total_steps, progress_steps, progress_s, batch)
        self.batch = batch or (max(1, BATCH_STEPS // every) if err is None else 1)
        # the local servers' WAN counters with each round (the CLI without a metrics file
        # or TensorBoard does without: no record is written, so no byte count is needed)
        self._wan_stats = _wan_stats
        self._log: MetricsLog | None = None
        if err is None and self.master:
            try:
                self._log = MetricsLog(
                    None if path is None else os.fspath(path),
                    None if tensorboard is None else os.fspath(tensorboard),
                )
            except GeompiError as e:
                err = e
        if not _agree:  # the CLI agrees with the servers too (runtime.agree_or_exit)
            if err is not None:
                raise err
        else:
            from geompi.session import fail_together

            fail_together(session, err if self.master else None)
        self._base = None  # the workers' communicator the averages run over (duplicated)
        self._comm: Any = None
        self._queue: deque = deque()  # _Batch, or rank 0's records waiting behind one
        self._open: _Batch | None = None  # the batch that records are added to
        self.last: dict | None = None  # the last step record completed (on every worker)
        self._t0 = self._last_line = time.perf_counter()
        self._first: tuple[int, float] | None = None  # the first step seen, and when
        self._samples = 0
        # After a lost rank, survivors may each redo a different number of steps before the
        # one the loss met: records start again from it, as geompi.runtime.StopRequest does.
        self._resume_at: int | None = 0
        self.closed = False
        self._attach()
        topo = session.topo
        self.record(
            "start",
            event="start",
            topology=topo.describe(),
            workers=topo.num_workers,
            every=every,
            total_steps=total_steps,
            **(start or {}),
        )

    # ---- every worker ---------------------------------------------------------------------
    def step(
        self,
        step: int,
        loss: float | Any,
        *,
        optimizer: GeompiOptimizer | None = None,
        lr: float | None = None,
        samples: int | None = None,
        note: str = "",
    ) -> None:
        """Collective over the workers, at the same steps on each: record ``step`` (its
        ``loss``, a float or a one-element tensor, is averaged over the workers) if
        ``step % every == 0``, and print a progress line when one is due.

        Args:
            step: the step just done.
            loss: this worker's training loss at it.
            optimizer: the ``DistributedOptimizer``, if not given to the constructor.
            lr: the learning rate to record (default: the optimizer's first group's).
            samples: this worker's samples in this step, for samples/s in progress lines.
            note: text for the progress line, after the step (the CLI: the epoch).
        """
        if self.closed:
            raise ConfigError("Metrics.step() after close(): build a new geompi.Metrics")
        if optimizer is not None:
            self.attach(optimizer)
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        self._samples += samples or 0
        if self._resume_at is None:  # after a recovery: the step every survivor goes on from
            failures = self._engine.failures if self._engine is not None else []
            self._resume_at = failures[-1]["step"] if failures else 0
        if step % self.every == 0 and step >= self._resume_at:
            self._start(step, _scalar(loss), lr)
        self._drain(block=len(self._queue) > MAX_PENDING)
        if self.master and self._progress_due(step, now):
            self._last_line = now
            LOG.info(self._line(step, now, note))

    def flush(self) -> None:
        """Collective over the workers, at the same step on each (as :meth:`step`): average
        the records of the batch under way now, and wait until every record is complete (and
        written)."""
        if self._open is not None:
            self._open.start()
            self._open = None
        self._drain(block=True)

    def close(self, **summary: Any) -> None:
        """Every worker: complete the records under way; rank 0 then writes a ``summary``
        record (``steps``, ``wall_s`` and the fields given) and closes the file."""
        if self.closed:
            return
        self.flush()
        self.closed = True
        if self.master:
            steps = self.last["step"] if self.last else (self._first or (0, 0))[0]
            head = {"summary": True, "steps": steps, "wall_s": time.perf_counter() - self._t0}
            self._emit({"kind": "summary", **head, **summary})
            if self._log is not None:
                self._log.close()
        if self._comm is not None:
            with contextlib.suppress(Exception):  # after a lost rank, nothing to free
                self._comm.Free()
            self._comm = None
        if self._engine is not None:
            self._engine.want_stats = False
            with contextlib.suppress(ValueError):
                self._engine.on_rejoin.remove(self._rejoin)

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()

    # ---- rank 0 ---------------------------------------------------------------------------
    def record(self, kind: str, **fields: Any) -> None:
        """Rank 0 writes one record of ``kind`` (``"eval"``, or a kind of your own) with
        ``fields``, after the step records still under way; a no-op on the other workers.
        Not collective. An ``eval`` record gets ``wall_s`` (seconds since this object was
        built) unless given."""
        if self.master:
            if kind == "eval" and "wall_s" not in fields:
                fields["wall_s"] = time.perf_counter() - self._t0
            record = {"kind": kind, **fields}
            if self._open is not None:  # after the step records made so far
                self._open.after.append((len(self._open.rows) - 1, record))
            else:
                self._queue.append(record)
            self._drain(block=False)

    def attach(self, optimizer: GeompiOptimizer) -> None:
        """Follow ``optimizer`` from now on, for a Metrics built before it (its rounds then
        report the WAN counters); ``step(optimizer=...)`` does it at the first step."""
        if self._engine is None:
            self._engine = _engine_of(optimizer)
            self._attach()

    # ---- inside ---------------------------------------------------------------------------
    def _attach(self) -> None:
        """Ask the engine's rounds for the WAN counters, and rebuild the communicator where
        every survivor of a lost rank rebuilds its own (on_failure="continue")."""
        if self._engine is not None:
            self._engine.want_stats = self._wan_stats
            self._engine.on_rejoin.append(self._rejoin)

    def _rejoin(self) -> None:
        """After a recovery, at the same point on every survivor: the records under way are
        dropped (a lost worker is in them), the survivors' communicator duplicated, and records
        start again at the step the loss met (before it, survivors may redo different steps)."""
        self._drop_pending()
        self._resume_at = None  # known once the loss is recorded (engine.failures)
        if self._base is not None and self._engine is not None:
            self._base = self._engine.peers()
            self._comm = self._base.Dup()

    def _start(self, step: int, loss: float, lr: float | None) -> None:
        e = self._engine
        # the workers that went through the same rounds: every worker, or under MixedSync (whose
        # datacenters run apart, a resumed one from its own step) this worker's datacenter
        base = e.peers() if e is not None else self._session.comms.all_workers
        if base is not self._base:  # the first record, or after a recovery (lost ranks)
            self._drop_pending()
            self._base, self._comm = base, base.Dup()
        rate: Any = lr
        if rate is None and e is not None and e.opt.param_groups:
            rate = e.opt.param_groups[0].get("lr")
        ok = isinstance(rate, (int, float)) or hasattr(rate, "item")  # a tensor lr too
        lr = float(rate) if ok else None
        vals = [loss, math.nan, math.nan, math.nan, math.nan, time.perf_counter() - self._t0]
        if e is not None:
            st = e.stats
            if not self._wan_stats:  # not asked of the local servers: no count (null)
                wan = math.nan
            else:
                wan = float(e.server_counts.sum()) if e.dc_first else 0.0
            vals = [loss, st.sent[LAN] + st.received[LAN], wan, e.compute_s, st.wait_s[LAN]]
            vals.append(time.perf_counter() - e.t_start)
        if self._open is None:
            self._open = _Batch(self._comm)
            self._queue.append(self._open)
        self._open.add(step, lr, [*vals, 1.0])
        if len(self._open.rows) >= self.batch:  # at the same record on every worker
            self._open.start()
            self._open = None

    def _drain(self, block: bool) -> None:
        """Write what is complete, in order; with ``block``, wait for all of it."""
        timeout = self._session.cfg.comm_timeout
        while self._queue:
            head = self._queue[0]
            if isinstance(head, _Batch):
                if head.req is None:  # still open: started at the same record everywhere
                    return
                try:
                    if block:
                        wait_for([head.req], timeout, "the other workers' metrics")
                    elif not head.req.Test():
                        return
                except Exception as e:  # noqa: BLE001 - a lost rank (on_failure="continue")
                    from geompi.comm import faults

                    if not faults.is_failure(e):
                        raise
                    self._drop_pending()
                    return
                self._queue.popleft()
                for is_step, record in head.records():
                    if is_step:
                        self.last = record
                    self._emit(record)
                continue
            self._queue.popleft()
            self._emit(head)

    def _drop_pending(self) -> None:
        """A lost rank cut off the averages under way: their step records are written with
        this worker's own values (``workers``: 1), in order, with rank 0's own records among
        them, rather than lost (a batch holds up to ``batch`` steps)."""
        self._open = None
        kept: deque = deque()
        for r in self._queue:
            if isinstance(r, _Batch) and r.rows:
                r.recv = np.array(r.rows, dtype=np.float64)
                kept.extend(rec for _, rec in r.records())
                LOG.debug("geompi: metrics: %d step records of this worker alone", len(r.rows))
            elif isinstance(r, _Batch):
                kept.extend(rec for _, rec in r.after)
            else:
                kept.append(r)
        self._queue = kept

    def _emit(self, record: dict) -> None:
        if self._log is not None:
            self._log.write(record)

    def _progress_due(self, step: int, now: float) -> bool:
        by_steps = self.progress_steps is not None and step % self.progress_steps == 0
        by_time = self.progress_s is not None and now - self._last_line >= self.progress_s
        return by_steps or by_time

    def _line(self, step: int, now: float, note: str) -> str:
        first, t_first = self._first or (step, now)
        rate = (step - first) / (now - t_first) if now > t_first else 0.0
        loss = (self.last["step"], self.last["loss"]) if self.last else None
        workers = self._session.topo.num_workers
        sps = self._samples * workers / (now - self._t0) if self._samples else None
        return progress_line(step, self.total_steps, now - self._t0, rate, loss, note, sps)


def _scalar(loss: Any) -> float:
    """A float of ``loss``: a number or a one-element tensor (detached; on a GPU, one sync)."""
    if hasattr(loss, "detach"):
        loss = loss.detach()
        if loss.numel() != 1:
            raise ConfigError(
                f"Metrics.step(loss=...): a tensor of {loss.numel()} elements; give the loss "
                "itself, one number"
            )
    return float(loss)


def _engine_of(optimizer: Any) -> Any:
    """The worker engine of a DistributedOptimizer."""
    if optimizer is None:
        return None
    engine = getattr(optimizer, "_geompi", None)
    if engine is None:
        raise ConfigError(
            f"geompi.Metrics(optimizer=...) takes a DistributedOptimizer, not a "
            f"{type(optimizer).__name__}"
        )
    return engine


def _session() -> Any:
    from geompi.session import worker_session

    return worker_session()


def _check(
    every: Any, total_steps: Any, progress_steps: Any, progress_s: Any, batch: Any = None
) -> GeompiError | None:
    """The one-line error for a bad argument of Metrics (the same on every worker), or None."""

    def count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if not count(every):
        return ConfigError(f"geompi.Metrics(every={every!r}): give a whole number >= 1")
    named = (("total_steps", total_steps), ("progress_steps", progress_steps), ("batch", batch))
    for name, v in named:
        if v is not None and not count(v):
            return ConfigError(f"geompi.Metrics({name}={v!r}): give a whole number >= 1 or None")
    ok = isinstance(progress_s, (int, float)) and not isinstance(progress_s, bool)
    if progress_s is not None and not (ok and math.isfinite(progress_s) and progress_s > 0):
        return ConfigError(f"geompi.Metrics(progress_s={progress_s!r}): give seconds > 0 or None")
    return None
