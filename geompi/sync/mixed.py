"""MixedSync: synchronous inside a datacenter, asynchronous between datacenters.

Workers behave as in FSA (gradient buckets pushed from backward hooks, parameters pulled after);
their local server deposits the datacenter's gradient into the global servers' RMA windows and
fetches the parameters that its own update produced, without waiting for other datacenters. At
the end every worker receives the final global model.
"""

from __future__ import annotations

from geompi.ps.protocol import Op
from geompi.sync.fsa import FSA


class MixedSync(FSA):
    name = "mixed"

    def finish(self) -> None:
        """STOP with keys: the local server answers once every datacenter is done."""
        reqs = self.client.start(Op.STOP, self.buckets.keys)
        for b in self.buckets:
            self.client.pull(reqs, b.params)
        reqs.wait()
