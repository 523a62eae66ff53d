"""FSA: fully synchronous at both tiers. Every step, the gradients of all workers (weighted by
their sample counts) reach the global servers' optimizer, and every worker pulls the result.

Buckets are pushed from gradient hooks in priority order, so communication overlaps backward.
"""

from __future__ import annotations

import torch

from geompi.ps.protocol import Op
from geompi.sync.base import Strategy


class FSA(Strategy):
    name = "fsa"
    local_optimizer = False
    op = Op.GRAD

    def attach(self) -> None:
        """Register the gradient hooks that push each bucket as soon as it is complete."""
        self.reqs = None
        for b in self.buckets:
            for _, p, _ in b.members:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def before_backward(self, n: int) -> None:
        self.n = n
        self.ready = [0] * len(self.buckets)
        self.issued = 0
        for b in self.buckets:
            b.grads.zero_()
        self.reqs = self.client.start(self.op, self.buckets.keys, weight=n)

    @torch.no_grad()
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.reqs is None:
            return
        bucket, off, numel = self.buckets.where[id(p)]
        torch.mul(p.grad.reshape(-1), self.n, out=bucket.grads[off : off + numel])
        p.grad = None
        self.ready[bucket.key] += 1
        self._issue(complete_only=True)
        self.reqs.test()

    def _issue(self, complete_only: bool) -> None:
        """Push buckets in key order; with complete_only, stop at the first incomplete one."""
        while self.issued < len(self.buckets):
            b = self.buckets.buckets[self.issued]
            if complete_only and self.ready[b.key] < len(b.members):
                return
            self.client.push(self.reqs, b.grads)
            self.issued += 1

    def after_backward(self) -> None:
        self._issue(complete_only=False)  # parameters without a gradient push zeros
        for b in self.buckets:
            self.client.pull(self.reqs, b.params)
        self.reqs.wait()
        self.reqs = None
        self.global_syncs += 1
