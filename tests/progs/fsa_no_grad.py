"""FSA with parameters that get no gradient (issue #12, 1): the ``partial`` model on 2 uneven
datacenters and 2 global servers; rank 0 saves the final parameters of each case."""

import sys

import torch

from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train

out = sys.argv[1]
CASES = {
    "sgd": dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.05),
    "adamw": dict(optimizer="adamw", lr=0.01, weight_decay=0.1),
}
COMMON = dict(
    model="partial",
    dataset="digits",
    batch_size=12,
    seed=3,
    dc_sizes=(3, 5),
    global_servers=2,
    bucket_mb=0.002,  # two keys; their slices split parameters between the global servers
    progress_every=1e9,
)
for name, case in CASES.items():
    runs = [(name, dict(steps=9))]
    if name == "adamw":  # stop at 6, resume to 9: per-parameter state (steps) survives
        runs.append((f"{name}-resumed", dict(steps=6)))
        runs.append((f"{name}-resumed", dict(steps=9, resume="latest")))
    for run, extra in runs:
        cfg = make_config(env={}, **COMMON, **case, checkpoint_dir=f"{out}/ckpt-{run}", **extra)
        summary = train(cfg)
        if summary is not None:
            torch.save(summary["model"], f"{out}/{run}.pt")
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
