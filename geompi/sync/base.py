"""The interface every synchronization algorithm implements, and what they share."""

from __future__ import annotations

import torch

from geompi.comm.buckets import Buckets
from geompi.ps.client import PSClient
from geompi.ps.protocol import Op


class Strategy:
    """What a worker does around each training step. The servers are generic.

    ``before_backward(n)`` runs once the batch (of n samples) is known; ``after_backward()``
    after loss.backward(); ``after_step(n)`` after the local optimizer step (only algorithms with
    ``local_optimizer`` run one). ``start()`` gives everyone the master worker's model and
    configures the global servers; ``finish()`` stops the servers.
    """

    name = "base"
    local_optimizer = False

    def __init__(self, client: PSClient, buckets: Buckets, *, master: bool, spec: bytes) -> None:
        self.client = client
        self.buckets = buckets
        self.master = master
        self.spec = spec
        self.global_syncs = 0
        # Keys after the buckets that every round of the algorithm carries, from the INIT
        # round on: ((key, numel), push buffer, pull buffer).
        self.extra_keys: list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]] = []

    def start(self, send_restore=None) -> None:
        """INIT round: the master worker's parameters and server settings reach everyone.

        ``send_restore(reqs)`` (master worker, when resuming) adds the checkpointed server state.
        """
        extra = [key for key, _, _ in self.extra_keys]
        reqs = self.client.start(
            Op.INIT, self.buckets.keys + extra, spec=self.spec if self.master else None
        )
        for b in self.buckets:
            if self.master:
                b.grads.copy_(b.params)
            else:
                b.grads.zero_()
            self.client.push(reqs, b.grads)
        for _, push, _ in self.extra_keys:
            push.zero_()
            self.client.push(reqs, push)
        for b in self.buckets:
            self.client.pull(reqs, b.params)
        for _, _, pull in self.extra_keys:
            self.client.pull(reqs, pull)
        if send_restore is not None:
            send_restore(reqs)
        reqs.wait()

    def exchange(self, op: Op, weight: float, scale_params: bool) -> None:
        """One blocking round over all buckets: push params*weight (or the grads), pull params."""
        reqs = self.client.start(op, self.buckets.keys, weight=weight)
        for b in self.buckets:
            if scale_params:
                torch.mul(b.params, weight, out=b.grads)
            self.client.push(reqs, b.grads)
        for b in self.buckets:
            self.client.pull(reqs, b.params)
        reqs.wait()

    def before_backward(self, n: int) -> None:  # noqa: B027 - optional hook
        pass

    def after_backward(self) -> None:  # noqa: B027 - optional hook
        pass

    def after_step(self, n: int) -> None:  # noqa: B027 - optional hook
        pass

    def state(self) -> dict:
        """Per-algorithm counters for checkpoints and metrics."""
        return {"global_syncs": self.global_syncs}

    def load_state(self, state: dict) -> None:
        self.global_syncs = int(state.get("global_syncs", 0))

    def finish(self) -> None:
        self.client.stop()
