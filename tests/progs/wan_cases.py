"""WAN compression and emulation across the three algorithms, on 7 ranks.

Topology: datacenters of 3 and 2 ranks (2 + 1 workers), 2 global servers (so every key is
split into shards, each compressed on its own). Rank 0 saves each run's final parameters and
writes cases.json with the figures the tests check.
"""

import json
import sys

import torch

from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train

out = sys.argv[1]
COMMON = dict(
    dataset="digits",
    model="mlp",
    batch_size=10,
    seed=2,
    lr=0.05,
    dc_sizes=(3, 2),
    global_servers=2,
    progress_every=1e9,
    bucket_mb=0.01,
)
record = {}


def run(name: str, **kw) -> None:
    s = train(make_config(env={}, **{**COMMON, **kw}))
    if s is not None:
        torch.save(s["model"], f"{out}/{name}.pt")
        keys = ("steps", "global_syncs", "wan_bytes", "wan_data_bytes", "wall_s", "test_acc")
        record[name] = {k: s[k] for k in keys} | {"time_split": s["time_split"]}


# Bytes per step, from the difference of two run lengths (the INIT round cancels out).
for comp in ("none", "fp16", "bf16", "topk:0.01", "int8", "int4", "topk:0.1+int8"):
    for steps in (6, 12):
        run(f"fsa_{comp}_{steps}", steps=steps, wan_compression=comp)
for comp in ("none", "topk:0.01", "int4"):
    for steps in (6, 12):
        run(f"mixed_{comp}_{steps}", sync="mixed", steps=steps, wan_compression=comp)
        run(f"hfa_{comp}_{steps}", sync="hfa", k1=2, k2=3, steps=steps, wan_compression=comp)
# Top-k keeping every value is lossless up to rounding: the whole codec path, checked
# against the uncompressed run (push, pull through replicas, HFA's reference).
run("fsa_topk1", steps=12, wan_compression="topk:1")
run("hfa_none", sync="hfa", k1=2, k2=2, steps=12)
run("hfa_topk1", sync="hfa", k1=2, k2=2, steps=12, wan_compression="topk:1")
# Emulated WAN: 10 FSA steps, each a push and a pull of >= 40 ms plus 40 kB at 8 Mbit/s.
run("fsa_wan", steps=10, wan_latency="40ms", wan_bandwidth="8Mbit")
run("mixed_wan", sync="mixed", steps=10, wan_latency="40ms", wan_bandwidth="8Mbit")
run("hfa_wan", sync="hfa", k1=5, k2=1, steps=10, wan_latency="40ms", wan_bandwidth="8Mbit")
# Emulated LAN port at the local servers: 8 Mbit/s, 5 FSA steps.
run("fsa_lan", steps=5, lan_bandwidth="8Mbit")
if record:
    n = sum(t.numel() for t in torch.load(f"{out}/fsa_none_6.pt").values())
    with open(f"{out}/cases.json", "w") as f:
        json.dump({"record": record, "numel": n, "common": COMMON}, f)
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
