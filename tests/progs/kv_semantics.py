"""KVStore semantics on 9 ranks (2 DCs of 3 and 4 workers... see the test), written to JSON."""

import json
import sys

import torch

import geompi.kv
import geompi.optim
from geompi.runtime import end_process

out = sys.argv[1]
kv = geompi.kv.create("dist_sync")  # servers serve here and exit
w = kv.rank
W = kv.num_all_workers
res = {
    "rank": w,
    "dc": kv.dc,
    "num_workers": kv.num_workers,
    "num_all_workers": W,
    "num_dcs": kv.num_dcs,
    "master": kv.is_master_worker,
}

# 1. no optimizer: the value after a round is the sum of every worker's push
kv.init("a", torch.full((3, 4), 100.0 + w))  # only the master's value counts
a = torch.empty(3, 4)
kv.pull("a", out=a)
kv.wait()
res["init"] = a.flatten().tolist()
for r in range(3):
    kv.push("a", torch.full((3, 4), float(w + 1) * (r + 1)))
    kv.pull("a", out=a)
    kv.wait()
    res[f"sum_round{r}"] = a.flatten().tolist()

# 2. fp16 and fp32 keys of different shapes, several keys per round, with priorities;
#    an optimizer at the global servers: SGD lr=1 (value -= sum of pushes)
kv2_keys = {"w16": torch.float16, "b32": torch.float32, "big": torch.float32}
shapes = {"w16": (5,), "b32": (2, 2, 2), "big": (1000,)}
if kv.is_master_worker:
    kv.set_optimizer(geompi.optim.SGD(lr=1.0))
for k, dt in kv2_keys.items():
    kv.init(k, torch.ones(shapes[k], dtype=dt) * 8)
prio_order = sys.argv[2].split(",")  # the test runs this twice with different priorities
for step in range(4):
    for i, k in enumerate(kv2_keys):
        kv.push(
            k, torch.full(shapes[k], 0.25 * (w + 1), dtype=kv2_keys[k]), priority=int(prio_order[i])
        )
    outs = {k: torch.empty(shapes[k], dtype=dt) for k, dt in kv2_keys.items()}
    handles = [kv.pull(k, out=outs[k], priority=int(prio_order[i])) for i, k in enumerate(kv2_keys)]
    for h in handles:
        h.wait()
    res[f"step{step}"] = {k: [str(v.dtype), v.flatten().tolist()] for k, v in outs.items()}
res["lan_bytes"] = kv.stats.sent["lan"]
kv.close()
with open(f"{out}/kv-{w}.json", "w") as f:
    json.dump(res, f)
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
