"""The same job through the CLI and through an API script, in one mpirun (7 ranks: datacenters
of 3 and 2 ranks, each with its local server, so 2 and 1 workers; 2 global servers):
``geompi.train.train(cfg)``, then ``geompi.init()`` and a plain torch loop over the same data
shards with ``DistributedOptimizer`` and the algorithm the CLI's flags describe. Rank 0 writes
both final models to OUT/<name>.pt. Each writes its last checkpoint: the CLI's to
OUT/cli_<name>/ (--checkpoint-dir), the API's with ``geompi.save`` to OUT/api_<name>.h5 (one
checkpoint path: they hold the same state).

Run: mpirun -n 7 python -m mpi4py tests/progs/cli_vs_api.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import geompi
from geompi import sync
from geompi.config import make_config
from geompi.data import WorkerData
from geompi.models import build_model
from geompi.ps.optim import make_spec, torch_optimizer
from geompi.runtime import end_process
from geompi.train import train

out = Path(sys.argv[1])
COMMON = ["--model", "mlp", "--batch-size", "8", "--seed", "3", "--progress-every", "1e9"]
COMMON += ["--dc-sizes", "3,2", "--global-servers", "2", "--momentum", "0.9", "--lr", "0.05"]
CASES = {
    "fsa": ["--sync", "fsa", "--steps", "10"],
    "fsa_adam": ["--sync", "fsa", "--steps", "10", "--optimizer", "adam", "--lr", "0.002"],
    "hfa": ["--sync", "hfa", "--k1", "2", "--k2", "2", "--steps", "12"],
    "hfa_nesterov": [
        *["--sync", "hfa", "--k1", "3", "--k2", "2", "--steps", "12"],
        *["--outer-optimizer", "nesterov", "--outer-lr", "0.7"],
    ],
}


def through_the_api(cfg, name: str) -> dict:
    """What a user's script does with the CLI's settings: the CLI's data shard and model
    (same seeds), its optimizer as a torch optimizer, its algorithm, a plain loop."""
    algo = sync.from_config(cfg)  # FSA with the optimizer on the servers, as the CLI's
    torch.manual_seed(cfg.seed)
    data = WorkerData(cfg, geompi.num_workers(), geompi.worker_rank())
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.ds.input_shape, data.ds.num_classes)
    spec = make_spec(
        cfg.optimizer, cfg.effective_lr, cfg.effective_momentum, cfg.weight_decay, cfg.nesterov
    )
    opt = geompi.DistributedOptimizer(torch_optimizer(spec, model.parameters()), model, sync=algo)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(cfg.steps):
        x, y = data.loader.next_batch()
        model.zero_grad(set_to_none=True)
        opt.set_batch_size(len(y))
        loss_fn(model(x), y).backward()
        opt.step()
    geompi.save(out / f"api_{name}.h5", model=model, optimizer=opt, step=cfg.steps)
    opt.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# Every CLI job first (each a whole job: its servers end with it), then one geompi.init() whose
# servers serve the API's optimizers in turn, then exit.
cli = {}
for name, flags in CASES.items():
    summary = train(make_config([*COMMON, *flags, "--checkpoint-dir", str(out / f"cli_{name}")]))
    if summary is not None:
        cli[name] = summary
cfgs = {name: make_config([*COMMON, *flags]).validate() for name, flags in CASES.items()}
first = next(iter(cfgs.values()))
geompi.init(dc_sizes=first.dc_sizes, global_servers=first.global_servers)
for name, cfg in cfgs.items():
    api = through_the_api(cfg, name)
    if geompi.is_master():
        s = cli[name]
        torch.save({"cli": s["model"], "api": api, "steps": s["steps"]}, out / f"{name}.pt")
geompi.finish()
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
