"""HFA through the CLI's train(): uneven datacenters, 2 global servers, momentum 0.9, with
sample and uniform (GeoMX) weighting; rank 0 saves each final model."""

import sys

import torch

from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train

out = sys.argv[1]
COMMON = dict(
    dataset="digits",
    model="mlp",
    batch_size=7,
    seed=4,
    lr=0.05,
    momentum=0.9,
    sync="hfa",
    k1=2,
    k2=2,
    steps=8,
    dc_sizes=(3, 5),
    global_servers=2,
    progress_every=1e9,
    bucket_mb=0.03,
)
for weighting in ("samples", "uniform"):
    s = train(make_config(env={}, **COMMON, hfa_weighting=weighting))
    if s is not None:
        torch.save(s["model"], f"{out}/{weighting}.pt")
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
