"""Lossy WAN codecs must not lose progress (argv: out dir). One job, datacenters of 2 and 1
workers, 2 global servers. The model is linear in its input with a constant input per worker,
so every gradient is a constant the test knows; each case trains, every worker saves its
parameters after some steps and after ``close()``, and the test compares them with the
exact sum computed without geompi (tests/test_wan_conservation_mpi.py)."""

import json
import sys

import torch

import geompi
from geompi.runtime import end_process

out = sys.argv[1]
geompi.init(dc_sizes=(3, 2), global_servers=2)  # a local server each
w = geompi.worker_rank()
DIM = 40
LR, MOMENTUM = 0.05, 0.9


class Linear(torch.nn.Module):
    """Two parameters (two keys with a tiny bucket): ``a . x[:DIM] + b . x[DIM:]``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(DIM, generator=g))
        self.b = torch.nn.Parameter(torch.randn(DIM, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :DIM] @ self.a + x[:, DIM:] @ self.b


def gradient(worker: int) -> torch.Tensor:
    """Worker ``worker``'s constant gradient (of a and b, concatenated)."""
    return torch.randn(2 * DIM, generator=torch.Generator().manual_seed(100 + worker))


def run(name: str, sync, codec: str, steps: int, keep_at=(), momentum=MOMENTUM) -> None:
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    opt = geompi.DistributedOptimizer(opt, model, sync=sync, bucket_mb=1e-9, wan_compression=codec)
    x = gradient(w)[None]
    for t in range(1, steps + 1):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if t in keep_at:
            torch.save(torch.cat([model.a.detach(), model.b.detach()]), f"{out}/{name}-{t}-w{w}.pt")
    opt.close()
    torch.save(torch.cat([model.a.detach(), model.b.detach()]), f"{out}/{name}-end-w{w}.pt")


CASES = []
for codec in ("topk:0.25", "int8", "int4"):
    CASES.append((f"hfa-{codec}", geompi.HFA(k1=1, k2=1), codec, 80, (20, 80)))
CASES += [
    ("hfa-k2-topk:0.25", geompi.HFA(k1=2, k2=2), "topk:0.25", 80, (20, 80)),
    ("stream-topk:0.25", geompi.HFA(k1=1, k2=2, fragments=2), "topk:0.25", 80, (20, 80)),
    ("fsa-servers-topk:0.25", geompi.FSA(optimizer="servers"), "topk:0.25", 80, (20, 80)),
    ("fsa-servers-none", geompi.FSA(optimizer="servers"), "none", 80, ()),
    ("mixed-none", geompi.MixedSync(), "none", 80, ()),
    ("mixed-topk:0.25", geompi.MixedSync(), "topk:0.25", 80, ()),
    ("mixed-int4", geompi.MixedSync(), "int4", 80, ()),
]
done = []
for name, sync, codec, steps, keep_at in CASES:
    # MixedSync's servers step SGD without momentum on each deposit: keep the exact sum simple
    run(name, sync, codec, steps, keep_at, momentum=0.0 if "mixed" in name else MOMENTUM)
    done.append(name)
if w == 0:
    with open(f"{out}/cases.json", "w") as f:
        json.dump({"done": done, "dim": DIM, "lr": LR, "momentum": MOMENTUM}, f)
geompi.finish()
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
