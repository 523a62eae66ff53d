"""FSA through the public API: several optimizers in turn on one job; every worker saves its
final state dict, and its LAN byte counter around each micro-batch of accumulation."""

import json
import sys

import torch

import geompi
from geompi.runtime import end_process
from tests.progs.api_common import (
    CLIP,
    MICRO,
    batch,
    make_model,
    make_optimizer,
    uses_extra,
    zero_keeps,
)

out, dc_sizes, gs = sys.argv[1], tuple(map(int, sys.argv[2].split(","))), int(sys.argv[3])
kinds = sys.argv[4].split(",")
STEPS = 10

geompi.init(dc_sizes=dc_sizes, global_servers=gs)
w = geompi.worker_rank()
log = {}
local_in = {}
kept_grads = {}  # a .grad held from step 0, and its values then


def distributed(model, kind):
    opt, sched = make_optimizer(model, kind)
    opt = geompi.DistributedOptimizer(
        opt,
        model,
        sync=geompi.MixedSync()
        if kind.startswith("mixed_")
        else geompi.FSA(optimizer="servers")
        if kind.startswith("srv_")
        else "fsa",
        bucket_mb=0.002,  # several buckets
        max_grad_norm=CLIP if kind.endswith("clip") else None,
        backward_passes_per_step=MICRO[kind] if kind in ("accum", "split", "srv_split") else 1,
    )
    return opt, sched


for kind in kinds:
    model = make_model(seed=1 + w)  # different on every worker: the master's must win
    opt, sched = distributed(model, kind)
    loss_fn = torch.nn.CrossEntropyLoss()
    stats = opt._geompi.stats  # this job's byte counters
    sent = []
    micro = MICRO.get(kind, 1)
    for t in range(STEPS):
        if kind == "rewrap" and t == STEPS // 2:  # a new one on the same model takes over
            opt, sched = distributed(model, kind)
        opt.zero_grad(set_to_none=not zero_keeps(kind))
        for m in range(micro):
            x, y = batch(w, t, m)
            before = stats.sent["lan"]
            loss = loss_fn(model(x, uses_extra(kind, w, t, m)), y) / micro
            if kind == "nosync" and m < micro - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
            sent.append(stats.sent["lan"] - before)
        opt.step()
        if t == 0 and not zero_keeps(kind):  # torch hands out a fresh .grad each step
            kept_grads[kind] = (model.head.weight.grad, model.head.weight.grad.clone())
        if sched is not None:
            sched.step()
    log[kind] = sent
    held, then = kept_grads.get(kind, (None, None))
    log[f"{kind}_kept_grad_intact"] = held is None or bool(torch.equal(held, then))
    keys_numel = sum(n for _, n in opt._geompi.keys())  # one worker's push per round
    report = opt.close()
    if report is not None:  # the master: what each local server took in over the LAN
        ranks = report["per_rank"]
        received = {r["dc"]: r["lan_received_bytes"] for r in ranks if r["role"] == "LOCAL_SERVER"}
        local_in[kind] = {"received": received, "keys_numel": keys_numel}
    torch.save(model.state_dict(), f"{out}/{kind}-w{w}.pt")
geompi.finish()
with open(f"{out}/sent-w{w}.json", "w") as f:
    json.dump(log, f)
if local_in:
    with open(f"{out}/local_in.json", "w") as f:
        json.dump(local_in, f)
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
