"""KVStore with an optimizer at 2 global servers: odd-sized keys and an fp16 key, several
rounds; each worker writes what it pulled after every round to JSON."""

import json
import sys

import torch

import geompi.kv
import geompi.optim
from geompi.runtime import end_process

STEPS = 5
SHAPES = {"one": (1,), "three": (3,), "odd": (1001,), "half": (7, 3)}
DTYPES = {"half": torch.float16}


def init_value(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(key))
    return torch.randn(SHAPES[key], generator=g)


def push_value(key: str, worker: int, step: int) -> torch.Tensor:
    """Multiples of 1/16 in [-2, 2): every sum of them is exact in any order."""
    g = torch.Generator().manual_seed(1000 * worker + 10 * step + len(key))
    return torch.randint(-32, 32, SHAPES[key], generator=g).float() / 16


def main() -> None:
    out, which = sys.argv[1], sys.argv[2]
    kv = geompi.kv.create("dist_sync")  # servers serve here and exit
    if kv.is_master_worker:
        if which == "adam":
            kv.set_optimizer(geompi.optim.Adam(lr=0.01))
        else:
            kv.set_optimizer(geompi.optim.SGD(lr=0.05, momentum=0.9, nesterov=True))
    for k in SHAPES:
        kv.init(k, init_value(k).to(DTYPES.get(k, torch.float32)))
    res = {"rank": kv.rank}
    for step in range(STEPS):
        outs = {}
        for i, k in enumerate(SHAPES):
            dt = DTYPES.get(k, torch.float32)
            kv.push(k, push_value(k, kv.rank, step).to(dt), priority=-i)
            outs[k] = torch.empty(SHAPES[k], dtype=dt)
            kv.pull(k, out=outs[k], priority=-i)
        kv.wait()
        res[f"step{step}"] = {k: v.float().flatten().tolist() for k, v in outs.items()}
    kv.close()
    with open(f"{out}/kv-{kv.rank}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
    end_process(0)  # ends as geompi's own processes do: no interpreter teardown
