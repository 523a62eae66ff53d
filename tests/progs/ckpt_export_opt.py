"""Checkpoints for ``python -m geompi.ckpt export --optimizer`` (argv: out dir). One
datacenter of 2 workers, 2 global servers. FSA with Adam on the global servers (two param
groups, each shard's state held by its server) and HFA (K1=2, K2=2, inner Adam on each worker,
outer Nesterov): 4 steps, geompi.save, one step more; every worker writes its model after
that step (FSA: after close, the servers' model; HFA: before close, its own local step)."""

import sys

import torch

import geompi
from tests.progs.api_common import make_model, param_groups, train_steps

out = sys.argv[1]
geompi.init(dc_sizes=(3,), global_servers=2)
w = geompi.worker_rank()


def steps(model, opt, first: int, last: int) -> None:
    train_steps(model, opt, w, last, first=first)


for name in ("fsa", "hfa"):
    model = make_model(seed=1)
    if name == "fsa":
        inner = torch.optim.Adam(param_groups(model, "adam"), lr=0.01, weight_decay=0.01)
        sync = geompi.FSA(optimizer="servers")
    else:
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
        sync = geompi.HFA(k1=2, k2=2, outer_optimizer="nesterov", outer_lr=0.7)
    opt = geompi.DistributedOptimizer(inner, model, sync=sync, bucket_mb=0.002)
    steps(model, opt, 0, 4)
    geompi.save(f"{out}/{name}.h5", model=model, optimizer=opt, step=4)
    steps(model, opt, 4, 5)
    if name == "hfa":
        torch.save(model.state_dict(), f"{out}/{name}-after-w{w}.pt")
    opt.close()
    if name == "fsa":
        torch.save(model.state_dict(), f"{out}/{name}-after-w{w}.pt")
geompi.finish()
