"""MixedSync with DCASGD, recorded for a single-process replay. 9 ranks: datacenters of 3, 2
and 2 ranks (2 + 1 + 1 workers), 2 global servers (every key split in two owners), DC 1 slowed.

Each worker writes what it pushed and what it pulled, every round; the global servers write
the order in which they applied the deposits (``GEOMPI_TEST_DEPOSIT_LOG``, set by the test).
Datacenter 2 skips every 7th round from round 3 on: its workers push with weight 0, as a
datacenter that dropped a non-finite gradient does.

Modes: ``plain``: adaptive DCASGD, gradients a nonlinear function of what the worker pulled.
``fp16`` (the test sets ``GEOMPI_WAN_COMPRESSION=fp16``): fixed DCASGD; the gradients are
small dyadic numbers, so pushes are exact, while pulls are lossy (each datacenter holds its
replica).
"""

import json
import sys
import time

import torch

import geompi.kv
from geompi.ps.optim import DCASGD
from geompi.ps.protocol import Op
from geompi.runtime import end_process

out, rounds, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kv = geompi.kv.create("dist_async", dc_sizes=(3, 2, 2), global_servers=2)
w = kv.rank
spec = {
    "plain": DCASGD(lr=0.3, lam=0.3, adaptive=True, weight_decay=0.05),
    "fp16": DCASGD(lr=0.5, lam=2.0, weight_decay=0.05),
}[mode]
if kv.is_master_worker:
    kv.set_optimizer(spec)
shapes = {"a": (7, 3), "b": (300,), "c": (5,)}
init = {}
for i, (k, s) in enumerate(shapes.items()):
    n = torch.Size(s).numel()
    init[k] = torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + i).reshape(s)
    kv.init(k, init[k])
outs = {k: v.clone() for k, v in init.items()}  # what this worker holds


def gradient(r: int, i: int, held: torch.Tensor) -> torch.Tensor:
    n = held.numel()
    c = float((w + 1) * (r % 5 + 1) * (i + 1) % 7 - 3) / 8.0
    if mode == "fp16":  # exact in fp16, so the compressed push loses nothing
        return c + (torch.arange(n, dtype=torch.float32) % 3 - 1) / 16.0
    return 0.25 * torch.sin(3.0 * held + w) + c


record = {"worker": w, "dc": kv.dc, "pushed": [], "pulled": [], "skipped": []}
for r in range(rounds):
    if kv.dc == 1:
        time.sleep(0.01)  # emulation of a slow datacenter
    skip = kv.dc == 2 and r % 7 == 3
    grads = {k: gradient(r, i, outs[k].reshape(-1)) for i, k in enumerate(shapes)}
    if skip:  # one round with weight 0 (what --on-nonfinite skip sends), through the KVStore
        grads = {k: torch.zeros_like(g) for k, g in grads.items()}
        kv._run_round(Op.GRAD, [(kv._entry(k), grads[k]) for k in shapes], 0.0, 0)
        record["skipped"].append(r)
    else:
        for i, k in enumerate(shapes):
            kv.push(k, grads[k], priority=-i)
    kv.wait()
    for k in shapes:
        kv.pull(k, out=outs[k])
    kv.wait()
    record["pushed"].append({k: g.tolist() for k, g in grads.items()})
    record["pulled"].append({k: v.reshape(-1).tolist() for k, v in outs.items()})
kv.close()  # waits for every datacenter; afterwards pull returns the final global value
for k in shapes:
    kv.pull(k, out=outs[k])
record["final"] = {k: v.reshape(-1).tolist() for k, v in outs.items()}
record["init"] = {k: v.reshape(-1).tolist() for k, v in init.items()}
record["keys"] = list(shapes)
with open(f"{out}/replay-{w}.json", "w") as f:
    json.dump(record, f)
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
