"""HFA through the public API with on_failure="continue" (launched with ULFM): datacenters of
2, 1 and 2 workers, 2 global servers, momentum 0.9 and an outer Nesterov step, 12 steps. The
test kills ranks with GEOMPI_FAULT_KILL_AT (servers); every surviving worker saves its model
and what its DistributedOptimizer recorded of the loss."""

import json
import sys

import torch

import geompi
from tests.progs.api_common import batch, hfa_optimizer, make_model, use_extra

out = sys.argv[1]
geompi.init(dc_sizes=(3, 2, 3), global_servers=2, on_failure="continue")
w = geompi.worker_rank()
model = make_model(seed=1 + w)
algo = geompi.HFA(k1=2, k2=2, outer_optimizer="nesterov", outer_lr=0.7)
opt = geompi.DistributedOptimizer(hfa_optimizer(model), model, sync=algo, bucket_mb=0.002)
loss_fn = torch.nn.CrossEntropyLoss()
for t in range(12):
    x, y = batch(w, t)
    opt.zero_grad()
    loss_fn(model(x, use_extra(w, t)), y).backward()
    opt.step()
torch.save(model.state_dict(), f"{out}/w{w}.pt")
with open(f"{out}/w{w}.json", "w") as f:
    json.dump({"global_syncs": opt.global_syncs, "failures": opt.failures}, f)
geompi.finish()
