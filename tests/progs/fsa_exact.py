"""FSA exactness: train several topologies on one 9-rank world; rank 0 saves final parameters.

argv: OUT [CASES], CASES a comma-separated list of CASES' names (default: all); NAME+staged
trains NAME again with GEOMPI_FORCE_STAGING=1 (every buffer through host staging, as a GPU
with an MPI that is not CUDA-aware), saved as NAME+staged.
"""

import json
import os
import sys

import torch

from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train

out = sys.argv[1]
CASES = {
    "sgd-2dc-1gs": dict(dc_sizes=(3, 5), global_servers=1, optimizer="sgd"),
    "sgd-3dc-2gs": dict(dc_sizes=(2, 3, 2), global_servers=2, optimizer="sgd"),
    "adam-2dc-1gs": dict(dc_sizes=(3, 5), global_servers=1, optimizer="adam"),
    "adam-3dc-2gs": dict(dc_sizes=(2, 3, 2), global_servers=2, optimizer="adam"),
}
COMMON = dict(
    steps=20,
    model="mlp",
    dataset="digits",
    batch_size=12,
    seed=3,
    momentum=0.9,
    weight_decay=1e-4,
    bucket_mb=0.02,
    progress_every=1e9,
)
only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
results = {}
for name in only:
    case = CASES[name.removesuffix("+staged")]
    os.environ["GEOMPI_FORCE_STAGING"] = "1" if name.endswith("+staged") else "0"
    lr = 0.05 if case["optimizer"] == "sgd" else 2e-3
    cfg = make_config(env={}, **COMMON, **case, lr=lr)
    summary = train(cfg)
    if summary is not None:
        torch.save(summary["model"], f"{out}/{name}.pt")
        results[name] = {
            "steps": summary["steps"],
            "wan_bytes": summary["wan_bytes"],
            "global_syncs": summary["global_syncs"],
        }
if results:
    with open(f"{out}/cases.json", "w") as f:
        cases = {name: CASES[name.removesuffix("+staged")] for name in only}
        json.dump({"cases": cases, "common": COMMON, "results": results}, f)
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
