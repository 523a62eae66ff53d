"""HFA against torch's HierarchicalModelAverager, and HFA(K1=K2=1) against FSA, on 7 ranks.

Topology: 2 datacenters of 2 workers (+ a local server each) and 1 global server.
"""

import json
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

from geompi.config import make_config
from geompi.data import ShardLoader, load_dataset, shard_indices
from geompi.models import build_model
from geompi.train import train

out = sys.argv[1]
world = MPI.COMM_WORLD
K1, K2, ROUNDS = 2, 3, 3
COMMON = dict(
    dataset="digits",
    model="mlp",
    batch_size=10,
    seed=5,
    lr=0.05,
    momentum=0.0,
    dc_sizes=(3, 3),
    global_servers=1,
    progress_every=1e9,
    bucket_mb=0.03,
)
STEPS = K1 * K2 * ROUNDS
record = {}


def run(name, **kw):
    s = train(make_config(env={}, **{**COMMON, **kw}))
    if s is not None:
        torch.save(s["model"], f"{out}/{name}.pt")
        record[name] = {k: s[k] for k in ("steps", "global_syncs", "wan_bytes", "lan_bytes")}


run("hfa", sync="hfa", k1=K1, k2=K2, steps=STEPS)
run("hfa_k11", sync="hfa", k1=1, k2=1, steps=8, hfa_weighting="uniform")
run("fsa_k11", sync="fsa", steps=8)
for steps in (12, 24):  # WAN bytes per step, from the difference of two run lengths
    run(f"fsa_{steps}", sync="fsa", steps=steps)
    run(f"hfa_{steps}", sync="hfa", k1=2, k2=2, steps=steps)

# ---- the torch side: gloo among the worker ranks only ----
workers = [0, 1, 3, 4]  # world ranks of the workers (blocks of [w, w, LS])
rank = world.Get_rank()
port = world.bcast(29500 + (hash(out) % 2000) if rank == 0 else None, root=0)
if rank in workers:
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager,
    )

    w = workers.index(rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=w, world_size=len(workers)
    )
    ds = load_dataset("digits")
    idx = shard_indices(len(ds.y_train), len(workers), w, seed=COMMON["seed"], labels=ds.y_train)
    loader = ShardLoader(
        ds.x_train, ds.y_train, idx, COMMON["batch_size"], seed=COMMON["seed"], shard=w
    )
    torch.manual_seed(COMMON["seed"])
    net = build_model("mlp", ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(net.parameters(), lr=COMMON["lr"])
    averager = HierarchicalModelAverager({K1: 2, K1 * K2: len(workers)}, warmup_steps=0)
    averager.step = 1  # average after steps K1, 2*K1, ... like geompi (not on the first call)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(STEPS):
        x, y = loader.next_batch()
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        averager.average_parameters(net.parameters())
    if w == 0:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, f"{out}/torch.pt")
    dist.destroy_process_group()
if rank == 0:
    with open(f"{out}/record.json", "w") as f:
        json.dump({"record": record, "K1": K1, "K2": K2, "steps": STEPS}, f)
