"""geompi.stop_requested() under mpirun (6 ranks: datacenters of 2 and 1 workers, 1 global
server). In one job: an uninterrupted run of STEPS steps; a run where one worker sends itself
SIGTERM after step SIGNAL_AT and every worker stops, saves and records the step it stopped at;
then a fresh model and optimizer resume from that file and run to STEPS. Rank 0 writes OUT/full.pt
and OUT/resumed.pt, each worker OUT/stop-w<i>.txt.

Run: mpirun -n 6 python -m mpi4py tests/progs/api_stop.py OUT
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import geompi

out = sys.argv[1]
STEPS, SIGNAL_AT, SIGNALLED = 14, 5, 1  # worker 1 is signalled after step 5


def batch(w: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + w)
    return torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, geompi.DistributedOptimizer(adam, model, sync="fsa")


def step(model, opt, w: int, t: int) -> None:
    x, y = batch(w, t)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


geompi.init(dc_sizes=(3, 2), global_servers=1)
w = geompi.worker_rank()
model, opt = setup()
for t in range(STEPS):
    step(model, opt, w, t)
opt.close()
if geompi.is_master():
    torch.save(model.state_dict(), f"{out}/full.pt")

model, opt = setup()
stopped = None
for t in range(STEPS):
    step(model, opt, w, t)
    if w == SIGNALLED and t + 1 == SIGNAL_AT:
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal, once stop_requested ran
    if geompi.stop_requested():
        stopped = t + 1
        geompi.save(f"{out}/stop.h5", model=model, optimizer=opt, step=stopped)
        break
with open(f"{out}/stop-w{w}.txt", "w") as f:
    f.write(str(stopped))
opt.close()

model, opt = setup()
start = geompi.load(f"{out}/stop.h5", model=model, optimizer=opt)["step"]
for t in range(start, STEPS):
    step(model, opt, w, t)
opt.close()
if geompi.is_master():
    torch.save(model.state_dict(), f"{out}/resumed.pt")
geompi.finish()
