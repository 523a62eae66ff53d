"""``geompi.init(comm_timeout=1)`` and a worker loop that idles 3 s between rounds, as one
evaluating or writing a checkpoint does (issue #13 point 6). Without a heartbeat the servers'
watchdog took that silence for a lost rank and aborted the job. Rank 0 prints one JSON line."""

import json
import time

import torch
from torch import nn

import geompi
from geompi.comm import heartbeat

geompi.init(dc_sizes=(3,), global_servers=1, comm_timeout=1)
beating = heartbeat.active()
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
for _ in range(3):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    time.sleep(3.0)  # idle: far past --comm-timeout, but every rank is alive
geompi.finish()
if geompi.worker_rank() == 0:
    print(json.dumps({"beating": beating, "after_finish": heartbeat.active()}), flush=True)
