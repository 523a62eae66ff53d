"""WAN compression fidelity on 7 ranks: runs that the tests replay in plain torch.

Topology: datacenters of 3 and 2 ranks (2 + 1 workers), 2 global servers, every parameter its
own key (so one key can be non-finite while the others are not). The model is
tests.reference.FidelityNet. ``NAN`` cases make the gradient of ``l1.weight`` NaN on rank 3
(datacenter 1's worker) at step 4, as an overflow in one layer would; the other keys of that
round stay finite. Rank 0 saves each run's final parameters and, after each run, cases.json.
"""

import json
import sys

import torch
from mpi4py import MPI

import geompi.models
from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train
from tests.reference import FidelityNet

out = sys.argv[1]
only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
RANK = MPI.COMM_WORLD.Get_rank()
NAN_STEP, NAN_RANK = 4, 3
COMMON = dict(
    dataset="digits",
    model="mlp",  # replaced by FidelityNet below
    batch_size=10,
    seed=5,
    momentum=0.0,
    dc_sizes=(3, 2),
    global_servers=2,
    progress_every=1e9,
    bucket_mb=1e-9,  # one key per parameter
    steps=8,
)
SCALE = 2.0**16  # GradScaler's default loss scale
CASES = {
    # name: (model keywords, NaN injected, config)
    "fsa_topk_skip": ({}, True, dict(wan_compression="topk:0.1", on_nonfinite="skip", lr=0.2)),
    "mixed_topk_skip": (
        {"frozen": True},
        True,
        dict(sync="mixed", wan_compression="topk:0.1", on_nonfinite="skip", lr=0.2),
    ),
    "fsa_fp16_scaled": ({"loss_scale": SCALE}, False, dict(wan_compression="fp16", lr=0.2 / SCALE)),
    "mixed_fp16_scaled": (
        {"loss_scale": SCALE, "frozen": True},
        False,
        dict(sync="mixed", wan_compression="fp16", lr=0.2 / SCALE),
    ),
}
current: dict = {}


def build_model(name, input_shape, num_classes):
    """FidelityNet for the current case; with NaN, a one-step NaN gradient in ``l1.weight``."""
    c, h, w = input_shape
    net = FidelityNet(c * h * w, num_classes, **current["model"])
    if current["nan"] and RANK == NAN_RANK:
        calls = [0]
        net.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
        net.l1.weight.register_hook(lambda g: g * float("nan") if calls[0] == NAN_STEP else g)
    return net


geompi.models.build_model = build_model
record = {}
for name, (model_kw, nan, cfg) in CASES.items():
    if only and name not in only:
        continue
    current.update(model=model_kw, nan=nan)
    s = train(make_config(env={}, **{**COMMON, **cfg}))
    if s is not None:
        torch.save(s["model"], f"{out}/{name}.pt")
        record[name] = {k: s[k] for k in ("steps", "skipped_nonfinite", "wan_data_bytes")}
        with open(f"{out}/cases.json", "w") as f:  # after each case: a later abort keeps it
            json.dump({"record": record, "common": COMMON, "nan": [NAN_STEP, NAN_RANK]}, f)
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
