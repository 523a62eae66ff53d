"""The worker's side of a round: send the header, push keys, pull results."""

from __future__ import annotations

import torch

from geompi.comm.transport import Link, Requests
from geompi.ps.protocol import TAG_DATA, TAG_RESULT, TAG_SPEC, Op, Round

LOCAL_SERVER = 0  # the local server's rank in dc_comm


class PSClient:
    """Talks to this datacenter's local server over dc_comm (LAN)."""

    def __init__(self, link: Link, timeout: float | None = None) -> None:
        self.link = link
        self.timeout = timeout
        self.round_id = 0
        self.step = 0  # the training step, set by the training loop; travels in headers

    def start(
        self,
        op: Op,
        keys: list[tuple[int, int]],
        weight: float = 0.0,
        spec: bytes | None = None,
        flags: int = 0,
    ) -> Requests:
        """Post this round's header (and optimizer spec); returns the round's request list."""
        self.round_id += 1
        self._pushed = self._pulled = 0
        reqs = Requests(self.link.stats, self.timeout, "the local server")
        rnd = Round(
            op, self.round_id, list(keys), float(weight), len(spec or b""), flags, self.step
        )
        self._header = rnd.encode()  # kept alive until the round is waited on
        self.link.igather(reqs, self._header, None, LOCAL_SERVER)
        if spec:
            self._spec = torch.frombuffer(bytearray(spec), dtype=torch.uint8)
            self.link.isend(reqs, self._spec, LOCAL_SERVER, TAG_SPEC)
        return reqs

    def push(self, reqs: Requests, buf: torch.Tensor) -> None:
        """Contribute ``buf`` (fp32) to the datacenter sum of the next key of the round.

        Point-to-point, not ``Ireduce``: Open MPI's nonblocking reduce measured 3.5x slower
        than Isend plus a sum at the local server (bench/sync_overhead.py).
        """
        self.link.isend(reqs, buf, LOCAL_SERVER, TAG_DATA + self._pushed)
        self._pushed += 1

    def pull(self, reqs: Requests, out: torch.Tensor) -> None:
        """Receive the next key's result into ``out`` when the round is waited on."""
        self.link.irecv(reqs, out, LOCAL_SERVER, TAG_RESULT + self._pulled)
        self._pulled += 1

    def stop(self) -> None:
        """Tell the servers this worker is done (every worker of the job must call it)."""
        reqs = self.start(Op.STOP, [])
        reqs.wait()
