"""Surviving lost ranks (``--on-failure continue``) with MPI's fault tolerance, ULFM.

Under ``mpirun --with-ft ulfm`` the MPI library reports a lost peer as an error of the
operation that needed it. The rule here:

- **Detect.** Every wait (geompi.comm.transport.wait_for) polls, and also watches the world
  communicator: a wait that meets a lost or revoked peer, or sees the world revoked, raises
  :class:`PeerLost`.
- **Tell everyone.** :func:`recover` first revokes every communicator of the rank, the world
  included, so each other rank's next wait raises too, whatever it was waiting on.
- **Agree and shrink.** Every survivor shrinks the world (``Comm.Shrink``, itself fault
  tolerant: the survivors agree on who is gone), then the topology without the lost ranks is
  planned from the same facts on every rank (:func:`surviving_topology`). A datacenter whose
  local server, or every worker, is lost leaves the job: its remaining ranks end with status 0.
  The others get new communicators for every tier.

After a recovery, processes end without MPI_Finalize (see :func:`_skip_finalize`).

What each role then does with its half-done round is its own: see geompi.train (workers),
geompi.ps.local_server and geompi.ps.global_server.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from dataclasses import dataclass

from geompi.comm.topology import Communicators, Topology, build_communicators
from geompi.errors import ConfigError, GeompiError

FT_ENV = "OMPI_MCA_mpi_ft_enable"  # what mpirun --with-ft ulfm sets in every rank
ON_FAILURE = ("abort", "continue")


class PeerLost(Exception):
    """A wait met a lost rank, or a communicator another survivor revoked (ULFM): the round
    under way cannot finish; the caller recovers (:func:`recover`) and redoes it."""


class LostEssentialRank(GeompiError):
    """A rank the job cannot go on without was lost (a global server, the master worker)."""


def ulfm_launch(env=os.environ) -> bool:
    """Whether this process was started with MPI fault tolerance (``--with-ft ulfm``)."""
    return _on(env.get(FT_ENV))


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "enabled")


def end_without_finalize_under_heartbeat(env=os.environ) -> None:
    """Under MPI fault tolerance with Open MPI's heartbeat on its own thread (``--mca
    mpi_ft_detector_thread true``, as make train and GEOMPI_FT=1 launch --on-failure
    continue), Open MPI 5.0.11's MPI_Finalize never returns: measured on a 2-rank mpi4py
    script that only meets in a barrier, so such a run that lost nothing hung at its end.
    Under that launch, processes end without it (mpi4py is told so before it loads MPI), after
    a last barrier that lets every rank's last messages leave. Called as geompi is imported."""
    if not (_on(env.get(FT_ENV)) and _on(env.get("OMPI_MCA_mpi_ft_detector_thread"))):
        return
    if "mpi4py.MPI" in sys.modules:  # loaded first (python -m mpi4py): too late to say
        return
    import mpi4py

    mpi4py.rc.finalize = False
    atexit.register(_last_barrier)


def _last_barrier() -> None:
    """At exit without MPI_Finalize (end_without_finalize_under_heartbeat): meet every rank
    of the world (the rebuilt one after a loss), as _goodbye does."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    _goodbye(_last_world or mpi.COMM_WORLD)


def check_launch(env=os.environ) -> None:
    """Raise ConfigError unless the launch can survive a lost rank (``--on-failure
    continue``): ULFM on, and no shared-memory transport, which hangs the survivors."""
    if not ulfm_launch(env):
        raise ConfigError(
            "--on-failure continue needs MPI fault tolerance: launch with "
            "mpirun --with-ft ulfm --mca btl tcp,self (make train does)"
        )
    given = env.get("OMPI_MCA_btl", "").strip()
    btl = [b.strip() for b in given.split(",")]
    if not given or "sm" in btl or "vader" in btl:
        what = f"OMPI_MCA_btl={given}" if given else "Open MPI's default transports"
        raise ConfigError(
            f"--on-failure continue with the shared-memory transport ({what}): its survivors "
            "hang on a lost peer; pass --mca btl tcp,self to mpirun"
        )


# The world communicator the waits watch (None: failures abort, as without ULFM).
_world = None


# How to go on after a loss the job cannot survive (with checkpoints: resume the last one)
RUN_AGAIN = "run it again"
_restart = RUN_AGAIN


def watch(world, restart: str | None = None) -> None:
    """From now on, waits raise PeerLost on failures, and watch ``world`` for a revocation.
    ``restart``: what the line of a loss the job cannot survive tells the user to do."""
    global _world, _restart
    _world = world
    if restart is not None:
        _restart = restart


def unwatch() -> None:
    global _world, _restart
    _world, _restart = None, RUN_AGAIN


def watching() -> bool:
    return _world is not None


def world_revoked() -> bool:
    """Whether another survivor revoked the watched world (cheap: a local flag)."""
    return _world is not None and bool(_world.Is_revoked())


def is_failure(err: BaseException) -> bool:
    """Whether ``err`` is a lost peer that this job survives (an MPI error under watch())."""
    if isinstance(err, PeerLost):
        return True
    from mpi4py import MPI

    return _world is not None and isinstance(err, MPI.Exception)


HFA_LEFT_WITH = "their updates since the last global average"


@dataclass
class Loss:
    """What one recovery found, the same on every survivor."""

    lost: list[int]  # world ranks (before) that are gone
    left_dcs: list[int]  # datacenters (numbered as before) that left the job
    topo: Topology  # the job after
    before: Topology
    # the last round (a worker's round id) that some surviving worker completed: a global
    # server undoes a later one it began, and the workers that did not complete this one take
    # its results from one that did (FSA)
    done: int = -1
    # the numbers at the job's start of the ranks and datacenters of ``before`` (a second
    # loss is named as the first: as the user launched the job)
    rank_names: list[int] | None = None
    dc_names: list[int] | None = None

    @property
    def lost_at_start(self) -> list[int]:
        """The lost ranks, numbered as at the job's start."""
        return [self.rank_names[r] for r in self.lost] if self.rank_names else list(self.lost)

    @property
    def left_at_start(self) -> list[int]:
        """The datacenters that left, numbered as at the job's start."""
        names = self.dc_names
        return [names[d] for d in self.left_dcs] if names else list(self.left_dcs)

    @property
    def lost_global(self) -> list[int]:
        """The lost global servers, by their index before (their shards go on from mirrors)."""
        return [
            self.before.global_servers.index(r)
            for r in self.lost
            if r in self.before.global_servers
        ]

    @property
    def lost_workers(self) -> int:
        """How many workers the job lost (those of a datacenter that left included)."""
        return self.before.num_workers - self.topo.num_workers

    def describe(self, step: int | str | None = None, left_with: str = HFA_LEFT_WITH) -> str:
        """The one line a recovery prints (from the new rank 0); ``left_with``: what a
        datacenter that left took with it (the algorithm says)."""
        b = self.before
        rank = dict(zip(self.lost, self.lost_at_start))
        dc_name = self.dc_names or list(range(b.num_dcs))
        parts = []
        for r in self.lost:
            role = b.role(r).value
            dc = b.dc_of(r)
            of = "" if dc is None else f" of datacenter {dc_name[dc]}"
            parts.append(f"{rank[r]} ({role}{of})")
        at = "" if step is None else f" at step {step}"
        msg = f"geompi: lost rank(s) {', '.join(parts)}{at}"
        if self.left_dcs:
            dcs = ", ".join(map(str, self.left_at_start))
            msg += f"; datacenter(s) {dcs} left the job with {left_with}"
        if self.lost_global:
            msg += (
                f"; the shard(s) of global server(s) {', '.join(map(str, self.lost_global))} go "
                f"on from their mirrors, re-sharded over {self.topo.num_global_servers} global "
                "server(s)"
            )
        gs = set(b.global_servers)
        dropped = [
            str(rank[r]) for r in self.lost if b.dc_of(r) not in self.left_dcs and r not in gs
        ]
        if dropped:
            msg += f"; the data shard(s) of worker rank(s) {', '.join(dropped)} dropped"
        t = self.topo
        return msg + (
            f"; going on with {t.num_dcs} datacenter(s), {t.num_workers} worker(s), "
            f"{t.world_size} rank(s)"
        )


def surviving_topology(topo: Topology, lost: set[int]) -> tuple[Topology, list[int]]:
    """The job without the ``lost`` world ranks, and the datacenters that leave with them.

    A datacenter leaves when its local server or every one of its workers is lost; otherwise
    it keeps its surviving workers. A lost global server's shard goes on from its mirror
    (``replicas`` 2) on the global servers left, re-sharded over them. Raises LostEssentialRank
    for a lost global server whose shard has no surviving copy (its part of the global model
    and optimizer state is gone) and for datacenter 0 leaving or losing rank 0 (the master
    worker: metrics, evaluation, the summary). Pure: every survivor computes the same result.
    """
    g = topo.num_global_servers
    gone_gs = sorted(lost & set(topo.global_servers))
    if gone_gs:
        gone = {topo.global_servers.index(r) for r in gone_gs}
        mirrored = topo.replicas > 1 and all(topo.replica_server(i) not in gone for i in gone)
        if not mirrored:
            raise LostEssentialRank(
                f"global server rank(s) {', '.join(map(str, gone_gs))} lost: their shard of the "
                f"global model and its optimizer state are gone, so the job stops; {_restart}"
            )
        g -= len(gone)
    sizes, left = [], []
    for d in range(topo.num_dcs):
        alive = [w for w in topo.workers(d) if w not in lost]
        if topo.local_server(d) in lost or not alive:
            left.append(d)
        else:
            sizes.append(len(alive) + 1)
    if 0 in left or 0 in lost:
        raise LostEssentialRank(
            "datacenter 0 lost its local server, its workers or rank 0, the master worker "
            f"(metrics, evaluation, the summary): the job cannot go on without it, so it stops; "
            f"{_restart}"
        )
    return Topology(sum(sizes) + g, tuple(sizes), g, topo.replicas if g > 1 else 1), left


TEST_HOOKS = "GEOMPI_TEST_HOOKS"  # =1: the GEOMPI_FAULT_* test hooks are read (tests only)


def fault_step(var: str, rank: int, env=os.environ) -> int:
    """A test hook's step for this rank: ``VAR=STEP:RANK[,RANK...][;STEP:RANK...]`` (RANK
    defaults to 0), else -1. GEOMPI_FAULT_KILL_AT makes those ranks SIGKILL themselves as the
    round of STEP reaches them. Read only under ``GEOMPI_TEST_HOOKS=1``: a variable left over
    in a production environment must not kill, stop or poison a real run."""
    if env.get(TEST_HOOKS) != "1":
        return -1
    for part in env.get(var, "").split(";"):
        step, _, ranks = part.partition(":")
        if step and rank in [int(r) for r in (ranks or "0").split(",")]:
            return int(step)
    return -1


def kill_self(rank: int) -> None:
    """The lost rank of a test (GEOMPI_FAULT_KILL_AT): gone at once, as a crashed process
    (SIGKILL), or hung with its connections open, as a frozen node (SIGSTOP, with
    GEOMPI_FAULT_KILL_SIGNAL=STOP). It says when first (``time.time()``), for
    bench/failure.py's detection-to-recovery time."""
    sig = signal.SIGSTOP if os.environ.get("GEOMPI_FAULT_KILL_SIGNAL") == "STOP" else signal.SIGKILL
    sys.stderr.write(f"geompi: test hook: rank {rank} killed at {time.time():.6f}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), sig)


_finalize_skipped = False


_last_world = None  # the world the last recovery built (None on a rank that left)
# After a recovery: the job-start numbers of the world's ranks and of the datacenters
_rank_names: list[int] | None = None
_dc_names: list[int] | None = None
_GOODBYE_S = 30.0  # at most this long for every survivor to reach the end
_FLUSH_S = 0.3  # then this long driving MPI progress, so the last messages leave


def _skip_finalize() -> None:
    """Once a rank was lost, end this process without MPI_Finalize: Open MPI 5.0.11's
    finalize fence waited forever for the lost ranks in about 1 run of 4 here (every
    survivor in ompi_mpi_finalize). Instead the survivors meet in a last barrier, drive MPI
    progress a moment so that no message of theirs is still queued (a process that ended
    with one made its peer's last wait fail with PROC_FAILED, about 1 run of 3), and end
    with status 0. The hook runs before mpi4py's own (atexit runs the last registered
    first)."""
    global _finalize_skipped
    if _finalize_skipped:
        return
    _finalize_skipped = True

    def end() -> None:
        if _last_world is not None:
            _goodbye(_last_world)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    atexit.register(end)


def _goodbye(comm) -> None:
    """Meet every rank of ``comm`` in a last barrier (at most _GOODBYE_S), then drive MPI
    progress for _FLUSH_S, so that no rank ends while a peer still waits on it or a message of
    its own is still queued."""
    try:
        req, until = comm.Ibarrier(), time.monotonic() + _GOODBYE_S
        while not req.Test() and time.monotonic() < until:
            time.sleep(1e-3)
        until = time.monotonic() + _FLUSH_S
        while time.monotonic() < until:
            comm.Iprobe()
            time.sleep(1e-3)
    except Exception:  # noqa: BLE001 - lost another rank at the very end: exit anyway
        pass


_LAST_EXIT_S = 1.0  # how long the one rank that exits 1 lets the others end first


def _stop_the_job(shrunk, err: LostEssentialRank) -> None:
    """End every survivor of a loss the job cannot go on without: rank 0 of ``shrunk`` prints
    the one line, all meet (_goodbye), the others end with status 0 and then rank 0 with 1,
    which mpirun reports. Not MPI_Abort, and not every rank with status 1: with a lost rank,
    mpirun --with-ft ulfm (Open MPI 5.0.11) then hung in 8 launches of 40 here, and in none of
    40 with one late exit 1 (bench/ulfm_exit.py)."""
    first = shrunk.Get_rank() == 0
    if first:
        from geompi.errors import PREFIX, say

        say(PREFIX + str(err))
    sys.stdout.flush()
    sys.stderr.flush()
    _goodbye(shrunk)
    if not first:
        os._exit(0)
    time.sleep(_LAST_EXIT_S)
    os._exit(1)


def serve(server) -> None:
    """A local or global server's loop: serve rounds until the workers stop. Under
    ``--on-failure continue`` a lost rank ends the round under way; the survivors recover and
    the server goes on in the new topology (``server.rejoin(loss)``)."""
    while True:
        try:
            if not server.serve_round():
                return
        except Exception as e:  # noqa: BLE001 - a lost rank, under --on-failure continue
            if not is_failure(e):
                raise
            server.rejoin(recover(server.comms, server.topo))  # a leaving rank exits there


def abort_reach() -> str:
    """What MPI_Abort ends from here, as the line before it says: under ``--with-ft ulfm``
    only the calling rank before any loss (the others then meet a lost rank and, under
    ``--on-failure continue``, go on without it where they can), every rank once a recovery has
    happened (bench/ulfm_abort.py measured both)."""
    if watching() and _last_world is None:
        return "ending this rank, as --on-failure continue: the others go on where they can"
    return "aborting every rank"


def revoke_all(comms: Communicators) -> None:
    """Revoke every communicator of this rank, so every peer's next wait fails too."""
    for c in (comms.world, comms.dc, comms.glob, comms.workers, comms.all_workers):
        if c is not None:
            try:
                c.Revoke()
            except Exception:  # noqa: BLE001 - already revoked, or freed: nothing to tell
                pass


def recover(comms: Communicators, topo: Topology, done: int = -1) -> Loss:
    """Collective over the survivors: agree on who is gone, shrink, and rebuild ``comms``
    in place for the surviving topology. A rank whose datacenter leaves raises SystemExit(0)
    here, once the others no longer need it. Raises LostEssentialRank where the job cannot go
    on. ``done``: a worker's last completed round (servers: -1); every survivor learns the
    latest (``Loss.done``)."""
    import numpy as np
    from mpi4py import MPI

    global _last_world, _rank_names, _dc_names
    revoke_all(comms)
    old = comms.world
    shrunk = old.Shrink()
    survivors = MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())),
                                          old.Get_group())  # fmt: skip
    lost = set(range(old.Get_size())) - set(survivors)
    if not lost:  # an MPI error without a lost peer: not ours to survive
        raise GeompiError("an MPI operation failed, but no rank was lost")
    try:
        new_topo, left = surviving_topology(topo, lost)
    except LostEssentialRank as e:  # identical on every survivor
        _stop_the_job(shrunk, e)
    me = old.Get_rank()
    dc = topo.dc_of(me)
    leaving = dc is not None and dc in left
    staying = shrunk.Split(MPI.UNDEFINED if leaving else 0, me)
    _skip_finalize()
    if leaving:
        raise SystemExit(0)
    fresh = build_communicators(new_topo, staying)
    comms.world, comms.dc, comms.glob = fresh.world, fresh.dc, fresh.glob
    comms.workers, comms.all_workers = fresh.workers, fresh.all_workers
    watch(comms.world)
    _last_world = comms.world
    latest = np.array([done], dtype=np.int64)
    comms.world.Allreduce(MPI.IN_PLACE, latest, op=MPI.MAX)
    rank_names = _rank_names or list(range(old.Get_size()))
    dc_names = _dc_names or list(range(topo.num_dcs))
    _rank_names = comms.world.allgather(rank_names[me])
    _dc_names = [dc_names[d] for d in range(topo.num_dcs) if d not in left]
    return Loss(sorted(lost), left, new_topo, topo, int(latest[0]), rank_names, dc_names)
