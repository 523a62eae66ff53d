"""With one datacenter, MixedSync gives FSA's parameters; also DCASGD accuracy on the default."""

import json
import sys

import torch

from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train

out = sys.argv[1]
common = dict(
    env={},
    steps=15,
    model="mlp",
    momentum=0.9,  # MixedSync's default is 0.5
    batch_size=10,
    seed=2,
    lr=0.05,
    dc_sizes=(4,),
    global_servers=1,
    progress_every=1e9,
    bucket_mb=0.02,
)
rec = {}
for sync in ("fsa", "mixed"):
    s = train(make_config(sync=sync, **common))
    if s is not None:
        torch.save(s["model"], f"{out}/{sync}.pt")
        rec[sync] = {"steps": s["steps"], "dc_updates": s.get("dc_updates")}
if rec:
    with open(f"{out}/rec.json", "w") as f:
        json.dump(rec, f)
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
