"""HFA's outer optimizer as a torch.optim class, and an algorithm from outside the package
(examples/custom_algorithm.py), through the public API on 7 ranks: datacenters of 2 and 1
workers, 2 global servers. K1 = K2 = 2, 12 steps (3 global averages), inner SGD with momentum.

Cases (argv: out dir): ``adam``, ``nesterov`` (momentum 0.8), ``adamw`` (given as
torch.optim.AdamW, with betas and weight decay), ``clipped`` (the example's ClippedHFA), each
12 steps in one go; ``adam-files``: 4 steps, geompi.save, a new model and optimizer,
geompi.load, 8 more; ``adam-torch``: the same through opt.state_dict()/load_state_dict() at
step 8. Every worker saves its final model; worker 0 also the state_dict's geompi keys.
"""

import json
import sys

import torch

import geompi
from examples.custom_algorithm import ClippedHFA
from geompi.runtime import end_process
from tests.progs.api_common import batch

out = sys.argv[1]
geompi.init(dc_sizes=(3, 2), global_servers=2)
w = geompi.worker_rank()
loss_fn = torch.nn.CrossEntropyLoss()
STEPS = 12
CASES = {
    "adam": dict(outer_optimizer="adam", outer_lr=0.02),
    "nesterov": dict(outer_optimizer="nesterov", outer_lr=0.7, outer_kwargs={"momentum": 0.8}),
    "adamw": dict(
        outer_optimizer=torch.optim.AdamW,
        outer_lr=0.02,
        outer_kwargs={"betas": (0.8, 0.95), "weight_decay": 0.1},
    ),
}


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def build(case: str):
    model = make_model(1 + w)  # different on each worker: INIT gives the master's
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if case == "clipped":
        sync = ClippedHFA(k1=2, k2=2, clip=0.002)
    else:
        sync = geompi.HFA(k1=2, k2=2, **CASES[case])
    return model, geompi.DistributedOptimizer(inner, model, sync=sync, bucket_mb=0.0005)


def steps(model, opt, first: int, last: int) -> None:
    for t in range(first, last):
        x, y = batch(w, t)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def dump(tag: str, model) -> None:
    torch.save(model.state_dict(), f"{out}/{tag}-w{w}.pt")


for case in ("adam", "nesterov", "adamw", "clipped"):
    model, opt = build(case)
    steps(model, opt, 0, STEPS)
    opt.close()
    dump(case, model)

# save + load + continue == uninterrupted (the outer Adam's moments and step on the servers)
model, opt = build("adam")
steps(model, opt, 0, 4)
geompi.save(f"{out}/adam.h5", model=model, optimizer=opt, step=4)
opt.close()
model, opt = build("adam")
info = geompi.load(f"{out}/adam.h5", model=model, optimizer=opt)
steps(model, opt, info["step"], STEPS)
opt.close()
dump("adam-files", model)

model, opt = build("adam")
steps(model, opt, 0, 8)
held, params = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
opt.close()
model, opt = build("adam")
model.load_state_dict(params)
opt.load_state_dict(held)
steps(model, opt, 8, STEPS)
opt.close()
dump("adam-torch", model)
if w == 0:
    geompi_keys = {k: sorted(v) for k, v in held.items() if k.startswith("geompi_outer")}
    step = [float(t) for t in held["geompi_outer_step"].values()]
    with open(f"{out}/state-keys.json", "w") as f:
        json.dump({"keys": geompi_keys, "step": step}, f)
with open(f"{out}/done-w{w}.json", "w") as f:
    json.dump({"worker": w}, f)
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
