"""FSA, HFA or MixedSync through the public API with on_failure="continue" (launched with
ULFM): datacenters of 2, 1 and 2 workers, 2 global servers, 12 steps. HFA: SGD with momentum 0.9
and an outer Nesterov step; FSA: the user's Adam on every worker, batches of a size that differs
per worker and step; MixedSync: the user's SGD with momentum on the global servers, closed
before the models are saved (each worker then holds the final global model). The test loses
ranks with the GEOMPI_FAULT_* hooks; every surviving worker saves its model and what its
DistributedOptimizer recorded of the losses.

    api_dc_lost.py OUT [hfa|fsa|mixed]"""

import json
import os
import sys

import torch

import geompi
from geompi.runtime import end_process
from tests.progs.api_common import batch, hfa_optimizer, make_model, use_extra

out = sys.argv[1]
replicas = int(os.environ.get("TEST_GLOBAL_REPLICAS", "1"))  # 2: a lost server's mirror goes on
geompi.init(dc_sizes=(3, 2, 3), global_servers=2, global_replicas=replicas, on_failure="continue")
w = geompi.worker_rank()
model = make_model(seed=1 + w)  # the master's parameters reach every worker
if sys.argv[2:] == ["fsa"]:
    algo, inner = geompi.FSA(), torch.optim.Adam(model.parameters(), lr=0.01)
elif sys.argv[2:] == ["mixed"]:
    algo, inner = geompi.MixedSync(), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # a new learning rate every step: each deposit brings its hyperparameters (a message a loss
    # can cut off, sent again as the survivors rejoin)
    schedule = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.97)
else:
    algo = geompi.HFA(k1=2, k2=2, outer_optimizer="nesterov", outer_lr=0.7)
    inner = hfa_optimizer(model)
opt = geompi.DistributedOptimizer(inner, model, sync=algo, bucket_mb=0.002)
loss_fn = torch.nn.CrossEntropyLoss()
for t in range(12):
    x, y = batch(w, t)
    opt.zero_grad()
    loss_fn(model(x, use_extra(w, t)), y).backward()
    opt.step()
    if sys.argv[2:] == ["mixed"]:
        schedule.step()
if sys.argv[2:] == ["mixed"]:
    opt.close()  # every datacenter done: the final global model on every worker
torch.save(model.state_dict(), f"{out}/w{w}.pt")
with open(f"{out}/w{w}.json", "w") as f:
    json.dump({"global_syncs": opt.global_syncs, "failures": opt.failures}, f)
geompi.finish()
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
