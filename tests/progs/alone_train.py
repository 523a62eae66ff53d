"""A world of one process: ``python alone_train.py OUT PHASE`` (no mpirun) trains through
``geompi.init`` and ``geompi.DistributedOptimizer`` and compares with plain torch.

PHASE ``full``: for momentum SGD (nesterov, weight decay, an lr schedule, two param groups)
and Adam (a step schedule), under FSA, and under HFA and MixedSync, one DistributedOptimizer
each in turn (each closes the one before): STEPS steps, a checkpoint (``state=``: the
schedule and a counter) after SAVE_AT, every parameter and optimizer state compared bitwise
with plain torch on the same batches, ``no_sync`` micro-batches included. The world's
accessors and collectives are written out.
PHASE ``resume``: in a new process, the checkpoint loaded into a fresh model and optimizer,
the remaining steps, compared bitwise with an uninterrupted plain torch run.
PHASE ``named``: ``geompi.init(dc_sizes=...)`` in one process: one error line. PHASE
``closure``: ``step(closure)``, refused as under mpirun; ``raise``: the script's own error.
Writes ``OUT/<phase>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from api_common import batch, make_model, make_optimizer

import geompi

STEPS, SAVE_AT = 8, 5
# (optimizer, algorithm): in one process every algorithm's step is the optimizer's own
CASES = (("sgd", "fsa"), ("adam", "fsa"), ("sgd", "hfa"), ("adam", "mixed"), ("clip", "fsa"))
MAX_NORM = 0.5  # the "clip" case's max_grad_norm
loss_fn = torch.nn.CrossEntropyLoss()


def train_step(model, opt, sched, step: int, clip: float | None = None) -> None:
    """One step: on step 2 two micro-batches, the first inside no_sync (a plain optimizer
    accumulates the same way). ``clip``: plain torch's clipping, before its step."""
    opt.zero_grad()
    micros = 2 if step == 2 else 1
    for m in range(micros):
        x, y = batch(0, step, m)
        ctx = opt.no_sync() if (m < micros - 1 and hasattr(opt, "no_sync")) else _nothing()
        with ctx:
            loss_fn(model(x, use_extra=step % 3 == 0), y).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
    opt.step()
    if sched is not None:
        sched.step()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def plain(kind: str, steps: range, clip: bool = True):
    """Plain torch, no geompi: the reference (the "clip" case clipped, unless not ``clip``)."""
    model = make_model(0)
    opt, sched = make_optimizer(model, kind)
    for step in steps:
        train_step(model, opt, sched, step, MAX_NORM if kind == "clip" and clip else None)
    return model, opt


def distributed(opt, model, sync: str, kind: str):
    norm = MAX_NORM if kind == "clip" else None
    return geompi.DistributedOptimizer(opt, model, sync=sync, max_grad_norm=norm)


def differences(model_a, opt_a, model_b, opt_b) -> list[str]:
    """Names of every tensor that is not bitwise equal (parameters, buffers, optimizer state)."""
    out = [
        n
        for (n, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items())
        if not torch.equal(a, b)
    ]
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    if sorted(sa) != sorted(sb):
        out.append(f"optimizer state keys {sorted(sa)} vs {sorted(sb)}")
    for i in sa:
        for k, v in sa[i].items():
            w = sb.get(i, {}).get(k)
            same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
            if not same:
                out.append(f"state[{i}][{k}]")
    return out


def full(out: Path) -> dict:
    res: dict = {
        "world": [
            geompi.worker_rank(),
            geompi.num_workers(),
            geompi.is_master(),
            geompi.local_worker_rank(),
            geompi.dc(),
            geompi.num_dcs(),
            str(geompi.device()),
        ],
        "all_reduce": [
            geompi.all_reduce(torch.tensor([1.5, -2.0]), op=op).tolist()
            for op in ("mean", "sum", "max", "min")
        ],
        "broadcast": geompi.broadcast_object({"a": [1, 2]}, root=0),
        "sampler": sorted(geompi.DistributedSampler(list(range(10)), shuffle=True)),
    }
    for kind, sync in CASES:
        name = f"{kind}_{sync}"
        model = make_model(0)
        ref_model, ref_opt = plain(kind, range(STEPS))
        opt, sched = make_optimizer(model, kind)
        dopt = distributed(opt, model, sync, kind)
        res[f"{name}_same_object"] = dopt is opt and isinstance(dopt, type(ref_opt))
        for step in range(STEPS):
            train_step(model, dopt, sched, step)
            if step + 1 == SAVE_AT:
                written = geompi.save(
                    out / f"{name}.h5", model=model, optimizer=dopt, step=step + 1,
                    state={"sched": sched, "counter": 41 + step},
                )  # fmt: skip
                res[f"{name}_written"] = written is not None
        res[f"{name}_diff"] = differences(model, dopt, ref_model, ref_opt)
        if kind == "clip":  # the clipping was active: unclipped, the run differs
            res["clip_active"] = bool(differences(model, dopt, *plain(kind, range(STEPS), False)))
        res[f"{name}_syncs"] = dopt.global_syncs
        res[f"{name}_failures"] = dopt.failures
    report = dopt.close()
    res["report"] = None if report is None else [report["wan_bytes"], report["lan_bytes"]]
    return res


def resume(out: Path) -> dict:
    res: dict = {}
    for kind, sync in CASES:
        name = f"{kind}_{sync}"
        model = make_model(1)  # other initial values: the file must bring them
        opt, sched = make_optimizer(model, kind)
        dopt = distributed(opt, model, sync, kind)
        state: dict = {"sched": sched}
        info = geompi.load(out / f"{name}.h5", model=model, optimizer=dopt, state=state)
        left = info["state"]  # what state= did not name
        res[f"{name}_info"] = [info["step"], left.get("counter"), "sched" in left]
        for step in range(info["step"], STEPS):
            train_step(model, dopt, sched, step)
        ref_model, ref_opt = plain(kind, range(STEPS))
        res[f"{name}_diff"] = differences(model, dopt, ref_model, ref_opt)
    geompi.finish()
    return res


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    if phase == "named":
        geompi.init(dc_sizes=(2, 2))
        raise SystemExit("init returned")
    geompi.init()
    if phase in ("closure", "raise"):
        model = make_model(0)
        opt = geompi.DistributedOptimizer(make_optimizer(model, "sgd")[0], model)
        if phase == "closure":
            opt.step(lambda: 0.0)  # refused under mpirun: in one process too
        raise ValueError("a bug in the user's script")
    res = full(out) if phase == "full" else resume(out)
    (out / f"{phase}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
