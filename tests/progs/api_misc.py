"""More of the public API under mpirun, one mode per run (argv: out dir, mode).

- ``buffers``: FSA with a BatchNorm on the input; every worker logs its buffers; a checkpoint at
  step 3 is loaded into a fresh model and optimizer, which then trains on to step 6.
- ``amp``: autocast + GradScaler under FSA and HFA, with an inf injected on one worker.
- ``mixed``: MixedSync with the user's SGD (and DCASGD), and a schedule per datacenter.
- ``bad_sync`` / ``bad_mixed_optimizer`` / ``bad_checkpoint`` / ...: user errors;
  ``nan_at_4th_step``: an inf loss at FSA's 4th step.
"""

import json
import sys

import torch
from torch import nn

import geompi
from geompi.runtime import end_process
from tests.progs.api_common import (
    IN,
    OUT,
    PERDC_STEPS,
    batch,
    learnable_batch,
    make_model,
    make_optimizer,
    train_steps,
)
from tests.progs.api_misc_model import BNNet

out, mode = sys.argv[1], sys.argv[2]
small = sys.argv[3:] == ["small"]  # the error cases: 4 ranks are enough
geompi.init(dc_sizes=(3,) if small else (3, 4), global_servers=1 if small else 2)
w = geompi.worker_rank()
loss_fn = nn.CrossEntropyLoss()


def train(model, opt, steps, start=0, scaler=None, autocast=None, inf_at=None, data=batch):
    losses = []
    for t in range(start, steps):
        x, y = data(w, t)
        opt.zero_grad()
        if autocast:
            with torch.autocast("cpu", dtype=autocast):
                loss = loss_fn(model(x), y)
        else:
            loss = loss_fn(model(x), y)
        losses.append(float(loss))
        if inf_at is not None and (t, w) == inf_at:
            loss = loss * float("inf")
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    return losses


def dump(name, model, **extra):
    torch.save({"model": model.state_dict(), **extra}, f"{out}/{name}-w{w}.pt")


if mode == "buffers":
    torch.manual_seed(1 + w)
    model = BNNet()
    opt = geompi.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model)
    train(model, opt, 3)
    geompi.save(f"{out}/ck3.h5", model=model, optimizer=opt, step=3)
    dump("at3", model, opt=opt.state_dict())
    train(model, opt, 6, start=3)
    dump("full", model)
    fresh = BNNet()  # a new model and optimizer resume from the file
    opt2 = geompi.DistributedOptimizer(torch.optim.Adam(fresh.parameters(), lr=1e-2), fresh)
    info = geompi.load(f"{out}/ck3.h5", model=fresh, optimizer=opt2)
    dump("loaded", fresh, opt=opt2.state_dict(), step=info["step"])
    train(fresh, opt2, 6, start=3)
    dump("resumed", fresh)
    # HFA with DiLoCo's outer Nesterov: the parameters take the outer step, the buffers are
    # averaged (weighted by samples) at every datacenter and global average
    torch.manual_seed(1 + w)
    model = BNNet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algo = geompi.HFA(k1=2, k2=2, outer_optimizer="nesterov", outer_lr=0.7)
    opt = geompi.DistributedOptimizer(sgd, model, sync=algo)
    train(model, opt, 8)
    opt.close()
    dump("bn-hfa-nesterov", model)
    # Where the servers step: buffers travel as a mean key. FSA's servers placement averages
    # them every step; MixedSync per datacenter, and across datacenters at the end.
    # With int8 on the WAN, the mean key still travels exactly.
    for name in ("srv", "mixed", "srv-int8", "mixed-int8"):
        algo = geompi.MixedSync() if name.startswith("mixed") else geompi.FSA(optimizer="servers")
        torch.manual_seed(1 + w)
        model = BNNet()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        wan = {"wan_compression": "int8"} if name.endswith("int8") else {}
        opt = geompi.DistributedOptimizer(sgd, model, sync=algo, **wan)
        train(model, opt, 6)
        dump(f"bn-{name}-before-close", model)
        report = opt.close()  # the master's: the job's figures
        dump(f"bn-{name}", model, report=report)
elif mode == "amp":
    for sync in ("fsa", "hfa"):
        algo = geompi.HFA(k1=2, k2=2) if sync == "hfa" else "fsa"
        for kind in ("fp32", "amp"):
            torch.manual_seed(1)
            model = nn.Sequential(nn.Linear(IN, 32), nn.ReLU(), nn.Linear(32, OUT))
            opt = geompi.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, sync=algo
            )
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if kind == "amp" else None
            before = {}
            losses = []
            for t in range(8):
                if t == 3:
                    before = {k: v.clone() for k, v in model.state_dict().items()}
                losses += train(
                    model,
                    opt,
                    t + 1,
                    start=t,
                    scaler=scaler,
                    autocast=torch.bfloat16 if kind == "amp" else None,
                    inf_at=(3, 1) if kind == "amp" else None,
                )
                if t == 3:
                    after3 = {k: v.clone() for k, v in model.state_dict().items()}
            dump(
                f"{sync}-{kind}",
                model,
                losses=losses,
                scale=scaler.get_scale() if scaler else None,
                unchanged_at_inf=all(torch.equal(before[k], after3[k]) for k in before),
            )
elif mode == "mixed":
    for name, algo in (("sgd", geompi.MixedSync()), ("dcasgd", geompi.MixedSync(dcasgd=True))):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, OUT))
        momentum = 0.5 if name == "sgd" else 0.0
        opt = geompi.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), model, sync=algo
        )
        losses = train(model, opt, 40, data=learnable_batch)
        opt.close()  # the final global model arrives
        dump(f"mixed-{name}", model, losses=losses)
    # Each deposit is stepped with its own datacenter's schedule: datacenter 1's lr is 0, so
    # the final model is datacenter 0's training alone, however the deposits interleave.
    model = make_model(seed=1 + w)  # the master's wins
    opt, sched = make_optimizer(model, "mixed_perdc", dc=geompi.dc())
    opt = geompi.DistributedOptimizer(opt, model, sync=geompi.MixedSync(), bucket_mb=0.002)
    train_steps(model, opt, w, PERDC_STEPS, sched)
    opt.close()
    dump("mixed-perdc", model)
elif mode == "bad_sync":
    model = nn.Linear(IN, OUT)
    geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sync="nope")
elif mode == "bad_mixed_optimizer":
    model = nn.Linear(IN, OUT)
    opt = torch.optim.RMSprop(model.parameters(), lr=0.1)
    geompi.DistributedOptimizer(opt, model, sync="mixed")
elif mode == "bad_checkpoint":
    model = nn.Linear(IN, OUT)
    opt = geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    other = nn.Linear(IN + 1, OUT)
    geompi.save(f"{out}/other.h5", model=other)
    geompi.load(f"{out}/other.h5", model=model, optimizer=opt)
elif mode == "bad_unfreeze":
    model = nn.Sequential(nn.Linear(IN, 8), nn.Linear(8, OUT))
    model[0].requires_grad_(False)
    opt = geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model[0].requires_grad_(True)
    x, y = batch(w, 0)
    loss_fn(model(x), y).backward()
elif mode == "bad_force_global":
    model = nn.Sequential(nn.Linear(IN, 8), nn.Linear(8, OUT))
    opt = geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    opt.force_global_average()
elif mode == "bad_scaler_servers":
    model = nn.Sequential(nn.Linear(IN, 8), nn.Linear(8, OUT))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = geompi.DistributedOptimizer(sgd, model, sync=geompi.FSA(optimizer="servers"))
    train(model, opt, 2, scaler=torch.amp.GradScaler("cpu"))
elif mode == "nan_at_4th_step":  # worker 0's loss is inf at the 4th step (t = 3)
    model = nn.Sequential(nn.Linear(IN, 8), nn.Linear(8, OUT))
    opt = geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    train(model, opt, 6, inf_at=(3, 0))
elif mode == "bad_many_keys":  # 300 parameters, a bucket each: more keys than a round holds
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(150)])
    opt = geompi.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_mb=1e-9
    )
elif mode == "bad_save_servers":
    model = nn.Sequential(nn.Linear(IN, 8), nn.Linear(8, OUT))
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    srv = geompi.FSA(optimizer="servers")  # the codec's residuals cannot be saved
    opt = geompi.DistributedOptimizer(adam, model, sync=srv, wan_compression="int8")
    train(model, opt, 2)
    geompi.save(f"{out}/srv.h5", model=model, optimizer=opt, step=2)
geompi.finish()
with open(f"{out}/done-w{w}.json", "w") as f:
    json.dump({"mode": mode}, f)
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
