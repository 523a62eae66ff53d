"""``geompi.train.train()`` from a script: writes rank 0's returned model to OUT/final.pt.

Usage: ``train_api.py OUT [--const-grad] CLI-ARGS...``. With ``--const-grad`` the model is
replaced by one whose parameters start at 0 and whose gradient is a constant per datacenter:
1 in datacenter 0, 1024 in datacenter 1 (and 1024**2 in datacenter 2). With SGD, lr 1 and no
momentum, every element of the global model is then ``-(n0 + 1024 * n1 + ...)`` where ``n_d``
is the number of datacenter d's deposits it holds: a checkpoint whose shards come from
different versions has unequal elements.
"""

import sys

import torch

import geompi.models
from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train

out, args = sys.argv[1], sys.argv[2:]
const = "--const-grad" in args
args = [a for a in args if a != "--const-grad"]


class _Const(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, c, classes, *params):
        ctx.c, ctx.shapes = c, [p.shape for p in params]
        return x.new_zeros(x.shape[0], classes)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *[torch.full(s, ctx.c) for s in ctx.shapes])


class ConstGrad(torch.nn.Module):
    def __init__(self, classes: int, c: float) -> None:
        super().__init__()
        self.classes, self.c = classes, c
        self.weight = torch.nn.Parameter(torch.zeros(20000))
        self.bias = torch.nn.Parameter(torch.zeros(7))

    def forward(self, x):
        return _Const.apply(x, self.c, self.classes, self.weight, self.bias)


if const:
    from mpi4py import MPI

    from geompi.comm.topology import Topology

    cfg0 = make_config(args)
    topo = Topology.plan(MPI.COMM_WORLD.Get_size(), cfg0.dcs, cfg0.dc_sizes, cfg0.global_servers)
    dc = topo.dc_of(MPI.COMM_WORLD.Get_rank())

    def build_model(name, input_shape, num_classes):
        return ConstGrad(num_classes, float(1024**dc))

    geompi.models.build_model = build_model

summary = train(make_config(args))
if summary is not None:
    torch.save(summary["model"], f"{out}/final.pt")
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
