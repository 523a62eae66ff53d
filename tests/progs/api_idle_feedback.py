"""Error feedback with a parameter that some steps get no gradient (issue #34, 3), through the
public API: 2 datacenters of one worker each (uneven batches), 1 global server, SGD with
momentum on the servers, ``topk:0.25`` on the WAN. Rank 0 saves its final parameters.

Usage: ``mpirun -n 5 python -m mpi4py api_idle_feedback.py OUT fsa|mixed``. The model and its
data are plain torch, shared with the reference in tests/test_wan_idle_feedback_mpi.py.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

LR, MOMENTUM, STEPS, COMPRESSION = 0.1, 0.9, 8, "topk:0.25"
BATCH = (3, 5)  # per worker (= per datacenter): uneven
# the steps at which each worker's forward uses ``b``: at step 4 neither does; at 1 and 5 only
# worker 0, at 2 and 7 only worker 1
USES_B = ({0, 1, 3, 5, 6}, {0, 2, 3, 6, 7})


class Net(nn.Module):
    """``a`` always gets a gradient, ``b`` only on the steps USES_B lists; linear, so the
    gradients are the data's and do not depend on the model."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.a = nn.Parameter(torch.randn(5, generator=g))
        self.b = nn.Parameter(torch.randn(3, generator=g))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = (x[:, :5] * self.a).sum(1)
        if use_b:
            out = out + (x[:, 5:] * self.b).sum(1)
        return out


def data(worker: int, step: int) -> torch.Tensor:
    """``b``'s inputs are larger, so its residual is what top-k sends first."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(BATCH[worker], 8, generator=g)
    x[:, 5:] *= 3.0
    return x


def main(out: str, algo: str) -> None:
    import geompi

    geompi.init(dc_sizes=(2, 2), global_servers=1)
    w = geompi.worker_rank()
    model = Net()
    sync = geompi.MixedSync() if algo == "mixed" else geompi.FSA(optimizer="servers")
    opt = geompi.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        model,
        sync=sync,
        wan_compression=COMPRESSION,
    )
    for t in range(STEPS):
        opt.zero_grad()
        model(data(w, t), t in USES_B[w]).mean().backward()
        opt.step()
    opt.close()
    if w == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
    geompi.finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
