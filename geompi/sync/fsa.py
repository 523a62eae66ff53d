"""FSA: fully synchronous at both tiers. Every step, the gradients of all workers (weighted by
their sample counts) reach the global servers' optimizer, and every worker pulls the result.

Buckets are pushed from gradient hooks in priority order, so communication overlaps backward.
After them goes the presence key: per parameter, 1 from each worker whose gradient for it
exists, one copy per global server (each sees the whole vector in its slice); it is empty when
every parameter has a gradient. The servers skip
a parameter counted 0 as ``torch.optim`` skips ``grad=None``: frozen and unused parameters keep
their values and optimizer state. The layout of every key travels once, in the INIT spec.
"""

from __future__ import annotations

import json

import torch

from geompi.comm.buckets import Buckets
from geompi.ps.protocol import FLAG_PRESENCE, Op, presence_payload
from geompi.sync.base import Strategy


def layout_spec(buckets: Buckets) -> list:
    """Every key's parameters, ``[[key, [[name, offset, numel], ...]], ...]``, in the order of
    the presence vector (what a global server needs to build one optimizer view per piece)."""
    return [[b.key, [[name, off, p.numel()] for name, p, off in b.members]] for b in buckets]


class FSA(Strategy):
    name = "fsa"
    local_optimizer = False
    op = Op.GRAD

    def attach(self, global_servers: int = 1) -> None:
        """Register the gradient hooks that push each bucket as soon as it is complete, and add
        the keys' layout and the presence key to the servers' spec."""
        self.reqs = None
        self.position: dict[int, int] = {}  # id(p) -> its place in the presence vector
        self.trainable = [0] * len(self.buckets)
        for b in self.buckets:
            for _, p, _ in b.members:
                self.position[id(p)] = len(self.position)
                if p.requires_grad:  # a frozen parameter has no hook: it never has a gradient
                    self.trainable[b.key] += 1
                    p.register_post_accumulate_grad_hook(self._on_grad)
        n = len(self.position)
        self.present = torch.zeros(global_servers, n)
        self.present_out = torch.zeros(global_servers * n)
        self.presence_key = (len(self.buckets), global_servers * n)
        self.extra_keys = [(self.presence_key, self.present.view(-1), self.present_out)]
        spec = json.loads(self.spec) if self.spec else {}
        spec.update(layout=layout_spec(self.buckets), presence_key=self.presence_key[0])
        self.spec = json.dumps(spec, sort_keys=True).encode()

    def before_backward(self, n: int) -> None:
        self.n = n
        self.ready = [0] * len(self.buckets)
        self.issued = 0
        for b in self.buckets:
            b.grads.zero_()
        self.present.zero_()
        keys = self.buckets.keys + [self.presence_key]
        self.reqs = self.client.start(self.op, keys, weight=n, flags=FLAG_PRESENCE)

    @torch.no_grad()
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.reqs is None:
            return
        bucket, off, numel = self.buckets.where[id(p)]
        torch.mul(p.grad.reshape(-1), self.n, out=bucket.grads[off : off + numel])
        p.grad = None
        self.present[:, self.position[id(p)]] = 1.0
        self.ready[bucket.key] += 1
        self._issue(complete_only=True)
        self.reqs.test()

    def _issue(self, complete_only: bool) -> None:
        """Push buckets in key order; with complete_only, stop at the first incomplete one."""
        while self.issued < len(self.buckets):
            b = self.buckets.buckets[self.issued]
            if complete_only and self.ready[b.key] < self.trainable[b.key]:
                return
            self.client.push(self.reqs, b.grads)
            self.issued += 1

    def after_backward(self) -> None:
        self._issue(complete_only=False)  # parameters without a gradient push zeros
        # ... and are counted absent; when none is, the push is empty
        self.client.push(self.reqs, presence_payload(self.present.view(-1)))
        for b in self.buckets:
            self.client.pull(self.reqs, b.params)
        self.client.pull(self.reqs, self.present_out)
        self.reqs.wait()
        self.reqs = None
        self.global_syncs += 1
