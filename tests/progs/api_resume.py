"""Exact resume through the public API (argv: out dir, mode). Datacenters of 2 and 1 workers,
2 global servers; each case trains 8 steps in one go, then 4 steps, saves, builds a new model
and optimizer, loads and trains 4 more; every worker writes both final models.

``resume``: HFA (K1=2, K2=2, inner SGD with momentum, outer Nesterov) and FSA with Adam on the
global servers through geompi.save/load; the same FSA through torch's own pattern
(opt.state_dict() / load_state_dict() and the model's); MixedSync's state_dict() holds the
servers' Adam state; geompi.load between opt.close() and the next DistributedOptimizer.
``closed``: geompi.load(optimizer=...) of a closed optimizer whose state the servers held.
``replicated``: HFA and FSA as in ``resume`` with ``global_replicas=2``; then MixedSync, refused
(the job ends there).
"""

import json
import sys

import torch

import geompi
from geompi.runtime import end_process
from tests.progs.api_common import make_model, train_steps

out, mode = sys.argv[1], sys.argv[2]
replicated = {"global_replicas": 2} if mode == "replicated" else {}
geompi.init(dc_sizes=(3, 2), global_servers=2, **replicated)
w = geompi.worker_rank()


def steps(model, opt, first: int, last: int) -> None:
    train_steps(model, opt, w, last, first=first)


def build(name: str):
    model = make_model(seed=1 + w)  # different on each worker: INIT gives the master's
    if name == "hfa":
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sync = geompi.HFA(k1=2, k2=2, outer_optimizer="nesterov", outer_lr=0.7)
    elif name == "mixed":
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
        sync = geompi.MixedSync()
    else:
        inner = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
        sync = geompi.FSA(optimizer="servers")
    return model, geompi.DistributedOptimizer(inner, model, sync=sync, bucket_mb=0.002)


def dump(tag: str, model) -> None:
    torch.save(model.state_dict(), f"{out}/{tag}-w{w}.pt")


def in_one_go(name: str) -> None:
    model, opt = build(name)
    steps(model, opt, 0, 8)
    opt.close()
    dump(f"{name}-whole", model)


def through_files(name: str) -> None:
    """HFA: a file named by the script. FSA: a directory, as a long job keeps its checkpoints
    (keep=1 after two saves; a torn newer file that geompi.latest skips)."""
    model, opt = build(name)
    directory = f"{out}/{name}-ck"
    first = geompi.latest(directory)  # none yet: a first run
    if name == "fsa":
        steps(model, opt, 0, 2)
        geompi.save(directory, model=model, optimizer=opt, step=2, keep=1)
    steps(model, opt, 2 if name == "fsa" else 0, 4)
    own = {"who": w, "rng": torch.Generator().manual_seed(w).get_state()}  # each worker's
    if name == "fsa":
        geompi.save(directory, model=model, optimizer=opt, step=4, state=own, keep=1)
        if w == 0:  # a newer file torn as a crash mid-write would leave it (not a temporary)
            with open(f"{directory}/ckpt-00000009.h5", "wb") as f:
                f.write(b"\x89HDF\r\n\x1a\n" + bytes(100))
    else:
        geompi.save(f"{out}/{name}.h5", model=model, optimizer=opt, step=4, state=own)
    opt.close()
    model, opt = build(name)
    state = {"who": -1}
    path = geompi.latest(directory) if name == "fsa" else f"{out}/{name}.h5"
    info = geompi.load(path, model=model, optimizer=opt, state=state)
    rng = info["state"]["rng"]
    with open(f"{out}/{name}-state-w{w}.json", "w") as f:  # each worker got its own back
        mine = {"who": state["who"], "rng": bool(torch.equal(rng, own["rng"]))}
        json.dump({**mine, "first": first, "latest": str(path)}, f)
    steps(model, opt, info["step"], 8)
    opt.close()
    dump(f"{name}-resumed", model)


def through_torch(name: str) -> None:
    """torch's pattern: the state dicts of the model and the optimizer, a new pair, load."""
    model, opt = build(name)
    steps(model, opt, 0, 4)
    held, params = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    model, opt = build(name)
    model.load_state_dict(params)
    opt.load_state_dict(held)
    steps(model, opt, 4, 8)
    opt.close()
    dump(f"{name}-torch", model)
    if w == 0:
        with open(f"{out}/{name}-state.json", "w") as f:
            json.dump({i: sorted(st) for i, st in held["state"].items()}, f)


if mode == "resume":
    for name in ("hfa", "fsa"):
        in_one_go(name)
        through_files(name)
    through_torch("fsa")
    # MixedSync: the servers' Adam state in torch's format, loaded before the first step
    model, opt = build("mixed")
    steps(model, opt, 0, 3)
    held = opt.state_dict()
    opt.close()
    model, opt = build("mixed")
    opt.load_state_dict(held)
    steps(model, opt, 3, 5)
    opt.close()
    if w == 0:
        with open(f"{out}/mixed-state.json", "w") as f:
            json.dump({i: sorted(st) for i, st in held["state"].items()}, f)
    # geompi.load after close(), before the next DistributedOptimizer (hung in the closed one)
    model, opt = build("fsa")
    steps(model, opt, 0, 2)
    opt.close()
    geompi.load(f"{out}/fsa-ck/ckpt-00000004.h5", model=model)
    model2, opt2 = build("fsa")
    steps(model2, opt2, 0, 1)
    opt2.close()
    dump("after-close", model)
    # collectives among the workers for a script's own metrics and decisions
    x = torch.tensor([1.5 * (w + 1), -float(w)], dtype=torch.bfloat16)
    got = {
        "mean": geompi.all_reduce(x).float().tolist(),
        "sum": geompi.all_reduce(x, op="sum").float().tolist(),
        "max": geompi.all_reduce(torch.tensor([w, 10 - w]), op="max").tolist(),
        "min_dtype": str(geompi.all_reduce(torch.tensor([w]), op="min").dtype),
        "obj": geompi.broadcast_object({"from": w, "items": [w, "x"]}, root=1),
        "local": geompi.local_worker_rank(),
    }
    with open(f"{out}/collectives-w{w}.json", "w") as f:
        json.dump(got, f)
elif mode == "replicated":  # every shard mirrored: the same cases, and MixedSync refused
    for name in ("hfa", "fsa"):
        in_one_go(name)
        through_files(name)
    with open(f"{out}/trained-w{w}.json", "w") as f:
        json.dump({"mode": mode}, f)
    build("mixed")  # refused: one line, every rank ends
elif mode == "mismatch":  # worker 1 reduces another shape: one line, every rank stops
    geompi.all_reduce(torch.zeros(3 if w == 1 else 2))
elif mode == "closed":
    model, opt = build("fsa")
    steps(model, opt, 0, 2)
    geompi.save(f"{out}/closed.h5", model=model, optimizer=opt, step=2)
    opt.close()
    geompi.load(f"{out}/closed.h5", model=model, optimizer=opt)
geompi.finish()
with open(f"{out}/done-{mode}-w{w}.json", "w") as f:
    json.dump({"mode": mode}, f)
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
