"""HFA through the CLI's train() under --on-failure continue (launched with ULFM): uneven
datacenters of 2, 1 and 2 workers, 2 global servers, momentum 0.9 and an outer Nesterov step.
The test kills ranks with GEOMPI_FAULT_KILL_AT; rank 0 saves the final model and summary.

    hfa_dc_lost.py OUT [STEPS [CHECKPOINT_DIR [resume]]]   # checkpoints every 4 steps"""

import json
import sys

import torch

from geompi.config import make_config
from geompi.train import train

out = sys.argv[1]
cfg = make_config(
    env={},
    dataset="digits",
    model="mlp",
    batch_size=7,
    seed=4,
    lr=0.05,
    momentum=0.9,
    sync="hfa",
    k1=2,
    k2=2,
    steps=int(sys.argv[2]) if len(sys.argv) > 2 else 12,
    dc_sizes=(3, 2, 3),
    global_servers=2,
    outer_optimizer="nesterov",
    outer_lr=0.7,
    progress_every=1e9,
    bucket_mb=0.03,
    on_failure="continue",
    metrics=f"{out}/metrics.jsonl",
    checkpoint_dir=sys.argv[3] if len(sys.argv) > 3 else None,
    checkpoint_every=4 if len(sys.argv) > 3 else 0,
    resume="latest" if sys.argv[4:] == ["resume"] else None,
)
s = train(cfg)
if s is not None:
    torch.save(s.pop("model"), f"{out}/model.pt")
    with open(f"{out}/summary.json", "w") as f:
        json.dump(s, f)
