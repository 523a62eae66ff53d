"""FSA through the CLI's train() under --on-failure continue (launched with ULFM): uneven
datacenters of 2, 1 and 2 workers, 2 global servers stepping SGD with momentum 0.9. The test
kills ranks with the GEOMPI_FAULT_* hooks; rank 0 saves the final model and summary.

    fsa_lost.py OUT"""

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
    sync="fsa",
    steps=12,
    dc_sizes=(3, 2, 3),
    global_servers=2,
    progress_every=1e9,
    bucket_mb=0.03,
    on_failure="continue",
    metrics=f"{out}/metrics.jsonl",
)
s = train(cfg)
if s is not None:
    torch.save(s.pop("model"), f"{out}/model.pt")
    with open(f"{out}/summary.json", "w") as f:
        json.dump(s, f)
