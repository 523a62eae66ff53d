"""User mistakes launched as the README says (``mpirun -n N python script.py``, no
``-m mpi4py``), one per run (argv: out dir, mode, algorithm). Each must end every rank, the
servers too, with one line and a non-zero exit (issue 35 item 2).

Modes: ``sync42``, ``hfa_k1_0``, ``bucket0`` (an argument every worker gets wrong alike),
``float64`` (worker 1's model alone in float64), ``save_alone`` (the master calls
geompi.save, the others train on), ``fewer_steps`` (the last worker stops a step early and
calls geompi.finish), ``save_vs_finish`` (the master saves, the others finish),
``user_raise`` (worker 1 raises an exception of its own).
"""

import sys

import torch

import geompi
from tests.progs.api_common import batch, make_model

out, mode, algo = sys.argv[1], sys.argv[2], sys.argv[3]
geompi.init(dc_sizes=(3, 2), global_servers=1)  # datacenters of 2 workers and 1
w, n = geompi.worker_rank(), geompi.num_workers()
model = make_model(1)
if mode == "float64" and w == 1:
    model = model.double()
kwargs = {"sync": geompi.HFA(k1=1, k2=1) if algo == "hfa" else algo}
if mode == "sync42":
    kwargs["sync"] = 42
elif mode == "hfa_k1_0":
    kwargs["sync"] = geompi.HFA(k1=0)
elif mode == "bucket0":
    kwargs["bucket_mb"] = 0
opt = geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, **kwargs)
loss_fn = torch.nn.CrossEntropyLoss()
steps = 6 - (1 if mode == "fewer_steps" and w == n - 1 else 0)
for t in range(steps):
    x, y = batch(w, t)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    if mode == "user_raise" and w == 1 and t == 2:
        raise RuntimeError("the user's own bug")
    if t == 2 and w == 0 and mode in ("save_alone", "save_vs_finish"):
        geompi.save(f"{out}/alone.h5", model=model)
    if t == 2 and mode == "save_vs_finish":
        break
geompi.finish()
print(f"worker {w} done", flush=True)
