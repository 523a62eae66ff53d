"""FSA, HFA or MixedSync through the CLI's train() under --on-failure continue (launched with
ULFM): uneven datacenters of 2, 1 and 2 workers, 2 global servers. HFA: SGD with momentum 0.9
on the workers, then an outer Nesterov step; FSA: SGD with momentum 0.9 on the global servers
(fsa-adam: Adam);
MixedSync: DCASGD (lambda 2) on the global servers. The test kills ranks with the
GEOMPI_FAULT_* hooks; rank 0 saves the final model and summary.

    dc_lost.py hfa|fsa|fsa-adam|mixed OUT [STEPS [CHECKPOINT_DIR [resume]]]

(checkpoints every 4 steps)"""

import json
import os
import sys

import torch

from geompi.config import make_config
from geompi.runtime import end_process
from geompi.train import train

sync, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
algo = {
    "hfa": dict(k1=2, k2=2, outer_optimizer="nesterov", outer_lr=0.7, lr=0.05, momentum=0.9),
    "fsa": dict(lr=0.05, momentum=0.9),
    "fsa-adam": dict(optimizer="adam", lr=0.003),
    "mixed": dict(optimizer="dcasgd", lr=0.1, dcasgd_lambda=2.0),
}[sync]
cfg = make_config(
    env={},
    dataset="digits",
    model="mlp",
    batch_size=7,
    seed=4,
    sync=sync.split("-")[0],
    **algo,
    steps=int(rest[0]) if rest else 12,
    dc_sizes=(3, 2, 3),
    global_servers=int(os.environ.get("TEST_GLOBAL_SERVERS", "2")),
    global_replicas=int(os.environ.get("TEST_GLOBAL_REPLICAS", "1")),  # 2: mirrors take over
    progress_every=1e9,
    bucket_mb=0.03,
    on_failure="continue",
    metrics=f"{out}/metrics.jsonl",
    checkpoint_dir=rest[1] if len(rest) > 1 else None,
    checkpoint_every=4 if len(rest) > 1 else 0,
    resume="latest" if rest[2:] == ["resume"] else None,
)
s = train(cfg)
if s is not None:
    torch.save(s.pop("model"), f"{out}/model.pt")
    with open(f"{out}/summary.json", "w") as f:
        json.dump(s, f)
end_process(0)  # as python -m geompi.train ends: no interpreter teardown
