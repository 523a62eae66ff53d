"""MixedSync under concurrency: no update is lost. 10 ranks: 3 DCs of 2 workers and a local
server, 1 global server, DC 1 slowed.

Through ``dist_async`` with SGD lr=1 (no momentum) and the KVStore's sum semantics, the final
global value must be the initial one minus the sum of everything every worker pushed. Each
worker writes what it pushed; the test adds it up independently.
"""

import json
import sys
import time

import torch

import geompi.kv
import geompi.optim
from geompi.runtime import end_process

out, rounds = sys.argv[1], int(sys.argv[2])
kv = geompi.kv.create("dist_async")
w = kv.rank
shapes = {"a": (7, 3), "b": (1000,), "c": (4,)}
if kv.is_master_worker:
    kv.set_optimizer(geompi.optim.SGD(lr=1.0))
for k, s in shapes.items():
    kv.init(k, torch.full(s, 1000.0))
pushed = {k: 0.0 for k in shapes}
outs = {k: torch.empty(s) for k, s in shapes.items()}
seen = []
for r in range(rounds):
    if kv.dc == 1:
        time.sleep(0.01)  # emulation of a slow datacenter
    for i, (k, s) in enumerate(shapes.items()):
        g = float((w + 1) * (r % 5 + 1) * (i + 1)) / 8.0  # exact in fp32
        kv.push(k, torch.full(s, g), priority=-i)
        pushed[k] += g
    for k in shapes:
        kv.pull(k, out=outs[k])
    kv.wait()
    seen.append(outs["c"][0].item())
kv.close()  # waits for every datacenter; afterwards pull returns the final global value
final = {}
for k in shapes:
    kv.pull(k, out=outs[k])
    final[k] = outs[k].flatten().tolist()
with open(f"{out}/mixed-{w}.json", "w") as f:
    json.dump({"worker": w, "dc": kv.dc, "pushed": pushed, "seen": seen, "final": final}, f)
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
