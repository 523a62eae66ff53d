"""Fault recovery of a worker engine (``on_failure="continue"``): what each worker does when a
rank is lost during its round, the round cut off, and the survivors' agreement afterwards.

The mechanism (revoke, shrink, the surviving topology) is geompi.comm.faults'; this module
holds the worker's side of it: the round's results kept for a worker that the loss cut off
(``keep_results``, ``catch_up``), a round completed after a loss (``complete_after_loss``), the
rejoin (new communicators, then the engine's, the algorithm's and the caller's rebuilding), the
agreement on the step, and the record of each loss survived. What the algorithm does after a
loss is its worker side's ``survive`` (geompi.sync): FSA and MixedSync complete or redo the
round (``recover``), HFA agrees on the step and makes the average cut off a global one.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from geompi.comm import faults
from geompi.comm.transport import LAN, Link, live_timeout, recv_state
from geompi.errors import GeompiError
from geompi.ps.client import PSClient
from geompi.ps.protocol import Op


class Recovery:
    """A worker engine's recovery from lost ranks (its ``recovery``)."""

    def __init__(self, engine: Any) -> None:  # geompi.engine.Synchronizer (which owns it)
        self.e = engine
        self.failures: list[dict] = []  # every loss survived
        # A lost rank met while pushing this round (the round is redone at backward's end),
        # and the last completed round's results (its id, and copies), which a worker that the
        # loss cut off before they reached it takes from one they did reach
        self.round_lost: BaseException | None = None
        self.kept_round = -1
        self.kept: list[torch.Tensor] = []
        rank = engine.s.rank
        # test hook: this worker pauses before it receives that step's results, so that a
        # loss next step finds it without them (GEOMPI_FAULT_SLOW_PULL=STEP:RANK)
        self.slow_at = faults.fault_step("GEOMPI_FAULT_SLOW_PULL", rank)
        # test hook: this worker is lost as it begins that step's gradient round (the CLI's
        # loop has its own, before the step's batch)
        self.kill_at = faults.fault_step("GEOMPI_FAULT_KILL_AT", rank)

    # ---- during a round -------------------------------------------------------------------
    def kill_point(self, step: int) -> None:
        """GEOMPI_FAULT_KILL_AT: this worker is lost as the round of ``step`` begins."""
        if step == self.kill_at:
            faults.kill_self(self.e.s.rank)

    def lost_while_pushing(self, err: Exception) -> None:
        """A lost rank met by a push from a backward hook: backward goes on filling the
        buckets, and the round is redone as it ends (``complete_after_loss``). Open MPI 5.0.11
        reports a revoked communicator only at the round's wait (measured: pushes after the
        revocation posted without error), other MPI libraries may as the push is posted."""
        if not faults.is_failure(err):
            raise err
        self.round_lost = err

    def pull_pause(self) -> None:
        """GEOMPI_FAULT_SLOW_PULL: a pause that still drives MPI progress (the others' stop
        agreement, a nonblocking collective, needs this worker's)."""
        if self.e.client.step != self.slow_at:
            return
        from mpi4py import MPI

        self.slow_at, until = -1, time.monotonic() + 4.0
        while time.monotonic() < until:
            MPI.COMM_SELF.Iprobe()
            time.sleep(1e-3)

    def keep_results(self) -> None:
        """A copy of the round's results, for a worker that a loss cuts off before they reach
        it (see catch_up)."""
        pulled = self.e.side.pulled()
        if len(self.kept) != len(pulled):
            self.kept = [torch.empty_like(t) for t in pulled]
        for kept, t in zip(self.kept, pulled):
            kept.copy_(t)
        self.kept_round = self.e.client.done_id

    def complete_after_loss(self) -> None:
        """A rank was lost during this worker's gradient round. Every survivor recovers; if
        some worker completed the round, its results reach the others (catch_up), else the
        survivors redo it with the gradients they pushed (the lost workers' left out)."""
        e = self.e
        pending = e.client.round_id
        while True:
            try:
                self.recover()
                if e.client.done_id == pending:  # completed from a peer
                    return
                e.rounds.reqs = e.rounds.start()  # the round again, in the new topology
                e.rounds.exchange()
                return
            except Exception as again:  # noqa: BLE001 - lost another rank meanwhile
                if not faults.is_failure(again):
                    raise

    # ---- after a loss ---------------------------------------------------------------------
    def survive(self, err: BaseException, step: int, redo: bool = True) -> int:
        """A rank was lost during this worker's round (``err``). Every survivor recovers
        (geompi.comm.faults), then does what its algorithm's worker side does after a loss
        (``WorkerSide.survive``: returns the caller's step count, agreed). Re-raises ``err``
        where it is not a lost rank; another loss meanwhile starts over."""
        while True:
            if not faults.is_failure(err):
                raise err
            try:
                return self.e.side.survive(self, step, redo)
            except Exception as again:  # noqa: BLE001 - lost another rank meanwhile
                err = again

    def rejoin_survivors(self) -> faults.Loss:
        """Every survivor's first steps after a loss: recover (geompi.comm.faults; a rank whose
        datacenter leaves exits in there), then this worker's and its caller's rebuilding."""
        e = self.e
        loss = faults.recover(e.s.comms, e.s.topo, e.client.done_id)
        self.rejoin(loss.topo)
        if loss.lost_global:
            self.take_over(loss)
        if e.rejoined is not None:  # the caller's (the CLI's loop)
            e.rejoined(loss)
        for again in e.on_rejoin:  # geompi.Metrics: its own communicator, rebuilt here
            again()
        return loss

    @torch.no_grad()
    def rejoin(self, topo) -> None:
        """Talk to the local server over the rebuilt communicators, then the worker side
        rebuilds its own."""
        e = self.e
        s = e.s
        s.topo, s.rank = topo, s.comms.world.Get_rank()
        old = e.client
        e.client = PSClient(Link(s.comms.dc, LAN, e.stats), old.timeout)
        e.client.round_id, e.client.done_id, e.client.step = (
            old.round_id,
            old.done_id,
            old.step,
        )
        e.side.rejoined()
        e.closed = False  # close() may have been cut off too: it runs again

    def take_over(self, loss: faults.Loss) -> None:
        """Collective over the workers (and every server) after a lost global server whose
        shard a mirror kept: the surviving global servers hand their shards and mirrors to the
        master worker, which puts the global tier's state back together as it was at the
        last round a survivor completed (``loss.done``: every copy undid a later one), and
        re-shards it over the global servers left through an INIT round (values) and a
        restore (optimizer, outer and update state), as a checkpoint's resume does."""
        from geompi.held_state import HeldState
        from geompi.ps.protocol import TAG_TAKEOVER
        from geompi.session import fail_together

        e = self.e
        values = send = err = None
        if e.master:
            shards: dict[int, dict] = {}
            for gs in loss.topo.global_servers:
                handed = recv_state(
                    e.s.comms.world, gs, TAG_TAKEOVER, e.stats, live_timeout(e.client.timeout),
                    f"the shards of global server {gs}",
                )  # fmt: skip
                assert isinstance(handed, dict)  # a state message is a dict
                for snap in handed["shards"]:  # its own shard first: a mirror's is its equal
                    shards.setdefault(int(snap["index"]), snap)
            ordered = [shards.get(i, {}) for i in range(loss.before.num_global_servers)]
            if not all(s.get("values") for s in ordered):
                # a server lost while a takeover was under way: what it handed in is gone
                err = GeompiError(
                    "a global server was lost while another's shard was being taken over: "
                    "the global model is not whole; run the job again from its last checkpoint"
                )
        fail_together(e.s, err)  # every worker stops alike, before the INIT round
        if e.master:
            io = HeldState.for_engine(e)
            model, optimizer, algorithm = io.assemble(ordered)
            algorithm["global_updates"] = int(ordered[0]["updates"])
            values = io.whole_keys(ordered)
            states = io.shard_states(optimizer, algorithm, model)
            if states is not None:
                send = lambda reqs: io.send_server_states(reqs, states)  # noqa: E731
        self._reinit_servers(values, send)

    @torch.no_grad()
    def _reinit_servers(self, values: dict[int, torch.Tensor] | None, send_restore) -> None:
        """Collective over the workers: an INIT round that gives the re-planned global servers
        the master's ``values`` of every key with the spec they began with (the optimizer's
        hyperparameters as they are now), then their state (``send_restore``). The workers
        keep their own parameters: the round's results are dropped."""
        e = self.e
        spec = dict(e.begun_spec)
        now = e.algo.server_spec(e.opt) if e.master else None
        if now is not None:
            spec.update(now)
        spec["restore"] = send_restore is not None
        keys = e.keys()
        reqs = e.client.start(Op.INIT, keys, spec=e.init_payload(spec))
        for k, n in keys:
            held = values.get(k) if values is not None else None
            reqs.push(held if held is not None else torch.zeros(n))
        for _, n in keys:
            reqs.pull(torch.empty(n))
        if send_restore is not None:
            send_restore(reqs)
        reqs.wait()

    def recover(self) -> faults.Loss:
        """A gradient round's one recovery (FSA, MixedSync), on every worker wherever the loss
        met it (a round, or the CLI's stop agreement, checkpoint or close): recover, rejoin,
        complete the last round on the workers it did not reach, and say what was lost. Every
        worker's next round is then the first after the last completed one."""
        e = self.e
        loss = self.rejoin_survivors()
        caught_up = self.catch_up()
        e.client.round_id = e.side.last_done(loss.done)
        # the first step trained without the lost ranks (a worker that caught up counts the
        # round it completed as the others did)
        self.record(loss, e.global_syncs + 1 + caught_up, caught_up)
        return loss

    @torch.no_grad()
    def catch_up(self) -> bool:
        """Collective over the workers of the same rounds (the engine's peers) after a
        recovery: the workers that the loss cut off before their round's results arrived take
        them from the lowest-ranked worker they reached (a loss cuts a round off between the
        two at most). Returns whether this one did."""
        from mpi4py import MPI

        e = self.e
        comm = e.peers()
        ids = np.array([self.kept_round, -self.kept_round], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, ids, op=MPI.MAX)
        latest, earliest = int(ids[0]), -int(ids[1])
        if latest == earliest:
            return False
        behind = self.kept_round != latest
        # the lowest rank that has the results, and whether a worker behind is not in that
        # round (never expected: then every worker stops alike)
        mine = np.array(
            [comm.Get_rank() if not behind else comm.Get_size(),
             -int(behind and e.client.round_id != latest)], dtype=np.int64,
        )  # fmt: skip
        comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MIN)
        if mine[1]:
            raise GeompiError(
                f"after a lost rank some workers completed round {latest} and others are not "
                "in it: the job cannot go on; run it again from its last checkpoint"
            )
        if not self.kept:
            self.kept = [torch.empty_like(t) for t in e.side.pulled()]
        for kept in self.kept:
            host = kept.detach().cpu()
            comm.Bcast(host.numpy(), root=int(mine[0]))
            kept.copy_(host)
        if behind:
            for t, kept in zip(e.side.pulled(), self.kept):
                t.copy_(kept)
            self.kept_round = e.client.done_id = latest
        return behind

    def record(self, loss: faults.Loss, at: int, caught_up: bool = False) -> None:
        """A survived loss in ``failures``, and its one line (from the master worker).
        ``caught_up``: this worker took the last round's results from another."""
        self.failures.append(
            {"step": at, "lost_ranks": loss.lost_at_start, "left_dcs": loss.left_at_start,
             "lost_workers": loss.lost_workers, "topology": loss.topo.describe(),
             "results_from_peer": caught_up, "recovered_at": time.time()}
        )  # fmt: skip
        if self.e.master:
            from geompi.runtime import say

            say(loss.describe(self.e.side.step_label(at), self.e.algo.left_with))

    def agree_on_step(self, step: int) -> int:
        """Collective over every worker after a recovery: the latest step any of them reached
        (one that finished its round before the loss may be K1 steps ahead) and round number;
        every worker takes the round number on, and the caller the step (returned)."""
        from mpi4py import MPI

        e = self.e
        mine = np.array([step, e.client.round_id], dtype=np.int64)
        e.s.comms.all_workers.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        e.client.round_id = int(mine[1])
        return int(mine[0])
