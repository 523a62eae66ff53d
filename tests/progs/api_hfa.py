"""HFA through the public API. ``sim``: uneven datacenters, momentum 0.9, sample weighting, then
GeoMX's uniform weighting in the same job; every worker saves its final states. ``torch``: the
same run next to torch's PostLocalSGDOptimizer with HierarchicalModelAverager over gloo among
the workers (equal batches, even datacenters)."""

import json
import sys
import zlib

import torch

import geompi
from tests.progs.api_common import batch, hfa_optimizer, make_model, use_extra

out, dc_sizes, gs, mode = sys.argv[1], tuple(map(int, sys.argv[2].split(","))), *sys.argv[3:5]
K1, K2, STEPS = 2, 3, 12

geompi.init(dc_sizes=dc_sizes, global_servers=int(gs))
w, workers = geompi.worker_rank(), geompi.num_workers()


def data(t):
    """torch's averager weighs workers equally and skips parameters without a gradient (its
    collective then mismatches), so the torch mode uses equal batches and no `extra`."""
    x, y = batch(w, t)
    return (x[:3], y[:3], False) if mode == "torch" else (x, y, use_extra(w, t))


def train(weighting: str, tag: str, steps: int = STEPS, lan_reduce=None, **outer) -> None:
    model = make_model(seed=1 + w)
    algo = geompi.HFA(k1=K1, k2=K2, weighting=weighting, **outer)
    opt = geompi.DistributedOptimizer(
        hfa_optimizer(model), model, sync=algo, bucket_mb=0.002, lan_reduce=lan_reduce
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    for t in range(steps):
        x, y, extra = data(t)
        opt.zero_grad()
        loss_fn(model(x, extra), y).backward()
        opt.step()
    assert opt.global_syncs == steps // (K1 * K2), opt.global_syncs
    if steps % (K1 * K2):  # close() between global averages ends on one more, over everyone
        opt.close()
        assert opt.global_syncs == steps // (K1 * K2) + 1, opt.global_syncs
    torch.save(model.state_dict(), f"{out}/{tag}-w{w}.pt")


def adaptive_under_a_slow_wan() -> None:
    """K2 starts at 1; a global average crosses an emulated 50 ms WAN both ways (>= 100 ms)
    while a datacenter round computes for a few ms, so the first decision (after step 2) is
    k2_max = 4: global averages at steps 2 and 10, then close() at 12 adds the last one."""
    model = make_model(seed=1 + w)
    algo = geompi.HFA(k1=K1, k2=1, adaptive=True, k2_max=4)
    opt = geompi.DistributedOptimizer(
        hfa_optimizer(model), model, sync=algo, bucket_mb=0.002, wan_latency="50ms"
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    syncs = []
    for t in range(STEPS):
        x, y, extra = data(t)
        opt.zero_grad()
        loss_fn(model(x, extra), y).backward()
        opt.step()
        syncs.append(opt.global_syncs)
    report = opt.close()
    torch.save(model.state_dict(), f"{out}/adaptive-w{w}.pt")
    with open(f"{out}/adaptive-w{w}.json", "w") as f:
        json.dump({"syncs": syncs, "final": opt.global_syncs, "report": report}, f)


train("samples", "hfa")
if mode == "sim":  # the same job also runs GeoMX's uniform weighting and an outer optimizer
    train("uniform", "uniform")
    train("samples", "scatter", lan_reduce="scatter")  # the datacenter sum among the workers
    train("samples", "outer", outer_optimizer="nesterov", outer_lr=0.7)
    for steps in (9, 10):  # close() after a local step, and right after a datacenter average
        train("samples", f"tail{steps}", steps=steps, outer_optimizer="nesterov", outer_lr=0.7)
    # Adaptive cadence pinned to K2=3 (k2_min = k2_max) is plain HFA, bitwise.
    train("samples", "pinned", adaptive=True, k2_min=3, k2_max=3)
    adaptive_under_a_slow_wan()
geompi.finish()

if mode == "torch":
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager,
    )
    from torch.distributed.optim import PostLocalSGDOptimizer

    port = 20000 + zlib.crc32(out.encode()) % 20000
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=w, world_size=workers
    )
    per_dc = dc_sizes[0] - 1
    loss_fn = torch.nn.CrossEntropyLoss()
    model = make_model(seed=1)
    averager = HierarchicalModelAverager({K1: per_dc, K1 * K2: workers}, warmup_steps=0)
    averager.step = 1  # average after steps K1, 2*K1, ... (not on the first call)
    opt = PostLocalSGDOptimizer(hfa_optimizer(model), averager)
    for t in range(STEPS):
        x, y, extra = data(t)
        opt.zero_grad()
        loss_fn(model(x, extra), y).backward()
        opt.step()
    torch.save(model.state_dict(), f"{out}/torch-w{w}.pt")
    dist.destroy_process_group()
