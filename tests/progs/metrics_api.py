"""geompi.Metrics from a user's loop (tests/test_metrics_api_mpi.py): FSA, then HFA in the same
job, each with its own metrics file. Every worker also writes the loss it computed at each
step, for the test to average independently. At the end, a bad argument stops the job (in
one line). Usage: ``metrics_api.py OUT [tensorboard]``.
"""

import json
import logging
import sys

import torch

import geompi
import geompi.metrics
from tests.progs.api_common import batch, make_model

out, with_tb = sys.argv[1], "tensorboard" in sys.argv[2:]
STEPS = 8

geompi.init(dc_sizes=(3, 2), global_servers=1)
w = geompi.worker_rank()
# an application's own handler: geompi's default stderr handler steps aside, this one gets
# every record (with its rank)
handler = logging.FileHandler(f"{out}/log-w{w}.txt")
handler.setFormatter(logging.Formatter("rank %(rank)s %(levelname)s %(message)s"))
logging.getLogger("geompi").addHandler(handler)
# the allreduces the step records took, counted here (the test compares with the batches)
allreduces = 0
_start = geompi.metrics._Batch.start


def counted(self) -> None:
    global allreduces
    allreduces += 1
    _start(self)


geompi.metrics._Batch.start = counted  # type: ignore[method-assign]


def run(tag: str, sync, every: int, **batching) -> None:
    global allreduces
    model = make_model(seed=1)
    opt = geompi.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), model, sync=sync)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    mine = {}
    tb = f"{out}/tb-{tag}" if with_tb else None
    with geompi.Metrics(
        f"{out}/m-{tag}.jsonl", optimizer=opt, every=every, total_steps=STEPS,
        tensorboard=tb, progress_steps=4, **batching,
    ) as metrics:  # fmt: skip
        allreduces = 0
        for step in range(1, STEPS + 1):
            x, y = batch(w, step)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            mine[step] = loss.item()
            metrics.step(step, loss, samples=len(y))
            sched.step()
            if step == STEPS // 2 and geompi.is_master():
                metrics.record("eval", step=step, accuracy=0.5)
        metrics.close(note=tag)
    with open(f"{out}/loss-{tag}-w{w}.json", "w") as f:
        json.dump({**mine, "allreduces": allreduces}, f)
    opt.close()


run("fsa", "fsa", 1, batch=3)  # records of steps 1-3, 4-6, 7-8 (at close)
run("hfa", geompi.HFA(k1=2, k2=2), 2)  # the default: the 4 records of 8 steps at once
logging.getLogger("geompi.user").info("geompi: the user's own line")
logging.getLogger("geompi").removeHandler(handler)  # geompi's default handler is back
handler.close()
geompi.Metrics(every=0)  # a bad argument: one line from rank 0, and every rank stops
geompi.finish()
