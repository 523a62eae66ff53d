"""A worker's gradient round (FSA, MixedSync): one a step, begun by backward's first counted
gradient, its buckets pushed in key order from the backward hooks as each completes (so the
exchange overlaps backward), completed as backward ends. What goes with the buckets and where
the results land is the algorithm's worker side's (``push_rest``, ``pull_results``,
``after_round``); a lost rank met on the way is geompi.recovery's.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from geompi.comm import faults
from geompi.comm.transport import Requests
from geompi.errors import ConfigError
from geompi.ps.client import ClientRound
from geompi.ps.protocol import FLAG_STATS, Op

# Every this many rounds a worker looks through the whole model for a trainable parameter its
# hooks miss (one added after the DistributedOptimizer was built); walking the modules every
# round cost 0.17 ms of CPU a round on a worker of the digits CNN (cProfile), 4% of its step.
UNHOOKED_SCAN = 64


class GradientRounds:
    """The gradient rounds of a worker engine (its ``rounds``)."""

    def __init__(self, engine: Any) -> None:  # geompi.engine.Synchronizer (which owns it)
        self.e = e = engine
        # per parameter: (its bucket, its slice of the bucket's gradients, its column of the
        # presence rows), views made once for the backward hooks; none where the worker side
        # pushes no gradients (HFA: its streaming keys may cut parameters in two)
        self.slots = {
            key: (bucket, bucket.grads[off : off + numel], e.present_g[:, e.layout_pos[key]])
            for key, (bucket, off, numel) in e.buckets.where.items()
            if e.side.pushes_gradients
        }
        self.trainable = [sum(m.param.requires_grad for m in b.members) for b in e.buckets]
        self.weight = 1.0  # this worker's weight in the round under way (its samples)
        self.ready: list[int] = []
        self.issued = 0
        # this step's round; a stand-in that posted nothing after a lost rank (it is redone)
        self.reqs: ClientRound | Requests | None = None
        self.begun = 0  # rounds begun
        # who tells the servers of a change of the hyperparameters (the worker side says), and
        # what the servers' optimizer last heard from this worker (the INIT spec is the
        # master's, so another datacenter's first worker sends its own with its first round)
        self.spec_sender = e.side.sends_spec()
        self.sent_spec = e.server_spec if e.master else None
        self.spec: bytes | None = None  # the spec this round carries

    def on_grad(self, p: torch.Tensor) -> None:
        """A backward hook's gradient: into its bucket, and the buckets complete so far are
        pushed."""
        if self.reqs is None:
            return
        bucket = self._take_grad(p)
        self.ready[bucket.key] += 1
        recovery = self.e.recovery
        if recovery.round_lost is not None:  # the round is redone as backward ends
            return
        try:
            self._issue(complete_only=True)
            self.reqs.test()
        except Exception as err:  # noqa: BLE001 - a lost rank, under on_failure="continue"
            recovery.lost_while_pushing(err)

    def _take_grad(self, p: torch.Tensor):
        """Copy ``p``'s gradient, times this worker's weight, into its bucket, and mark it
        present; returns the bucket."""
        bucket, slot, present = self.slots[id(p)]
        assert p.grad is not None  # a post-accumulate-grad hook's parameter has one
        torch.mul(p.grad.reshape(-1), self.weight, out=slot)
        present.fill_(1.0)
        return bucket

    def begin(self) -> None:
        """Begin this step's round: the buckets take what ``.grad`` holds already, and the
        round's header is posted."""
        e = self.e
        if e.closed:
            e.stop(
                ConfigError("backward after its DistributedOptimizer was closed: build a new one")
            )
        scan = self.begun % UNHOOKED_SCAN == 0  # a parameter added since, too
        self.begun += 1
        for name, p in e.model.named_parameters() if scan else e.frozen:
            if p.requires_grad and id(p) not in e.hooked:
                e.stop(
                    ConfigError(
                        f"parameter {name} was unfrozen after DistributedOptimizer was built, so "
                        "its gradient would stay local: build it after unfreezing"
                    )
                )
        self.weight = e.sample_weight()
        self.ready = [0] * len(e.buckets)
        self.issued = 0
        for b in e.buckets:
            b.grads.zero_()
        e.present_g.zero_()
        # What .grad holds already goes in too, as torch.optim would step it: an earlier
        # micro-batch's gradient of a parameter this pass leaves alone, or the zeros that
        # zero_grad(set_to_none=False) left. The hooks of this pass overwrite their own.
        for p in e.params:
            if p.grad is not None and id(p) in e.hooked:
                self._take_grad(p)
        e.client.step = e.global_syncs + 1  # one round a step
        e.recovery.kill_point(e.client.step)
        self.spec, e.recovery.round_lost = self._changed_spec(), None
        try:
            self.reqs = self.start()
        except Exception as err:  # noqa: BLE001 - a lost rank, under on_failure="continue"
            self.reqs = Requests(e.stats, None, "the local server")  # nothing posted
            e.recovery.lost_while_pushing(err)

    def start(self) -> ClientRound:
        """Post this step's GRAD round header; returns its handle."""
        e = self.e
        flags = e.side.round_flags() | e.lan_flags | (FLAG_STATS if e.want_stats else 0)
        self.issued = 0
        return e.client.start(Op.GRAD, e.keys(), self.weight, flags=flags, spec=self.spec)

    def _changed_spec(self) -> bytes | None:
        """The optimizer on the servers: the user's hyperparameters (an lr schedule) travel
        with the next round whenever they changed, so the servers follow them."""
        e = self.e
        if not (self.spec_sender and e.follow_hyperparameters):
            return None
        now = e.algo.server_spec(e.opt)
        if now is None or now == self.sent_spec:
            return None
        self.sent_spec = now
        return json.dumps({**now, "update": True}, sort_keys=True).encode()

    def _issue(self, complete_only: bool) -> None:
        """Push buckets in key order; with complete_only, stop at the first incomplete one."""
        buckets = self.e.buckets
        while self.issued < len(buckets):
            b = buckets.buckets[self.issued]
            if complete_only and self.ready[b.key] < self.trainable[b.key]:
                return
            assert isinstance(self.reqs, ClientRound)  # begin posted the round
            self.reqs.push(b.grads)
            self.issued += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Complete the round (redone, or completed from a peer, after a lost rank), and its
        results into the model."""
        e = self.e
        try:
            if e.recovery.round_lost is not None:
                raise e.recovery.round_lost
            self.exchange()
        except Exception as err:  # noqa: BLE001 - a lost rank, under on_failure="continue"
            if not faults.is_failure(err):
                raise
            e.recovery.complete_after_loss()
        self.reqs = None
        e.synced = True
        e.reset_samples()
        e.global_syncs += 1
        e.side.after_round()

    def exchange(self) -> None:
        """Push what backward has not pushed yet and wait for the round's results."""
        e = self.e
        self._issue(complete_only=False)  # parameters without a gradient here push zeros
        reqs = self.reqs
        assert isinstance(reqs, ClientRound)  # begin posted the round
        e.side.push_rest(reqs)
        e.recovery.pull_pause()
        e.side.pull_results(reqs)
        if reqs.flags & FLAG_STATS:
            reqs.pull_stats(e.server_counts)
        reqs.wait()
        if faults.watching():
            e.recovery.keep_results()

    def now(self) -> None:
        """Complete this step's round now (a worker side's ``synchronize``)."""
        e = self.e
        if e.synced:
            return
        if e.in_backward:
            raise ConfigError("synchronize() was called inside backward: call it after")
        self.begin()  # it takes the gradients accumulated so far
        self.finish()
