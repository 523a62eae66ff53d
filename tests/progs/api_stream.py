"""Streaming HFA through the public API (argv: out dir, mode).

``overlap``: 2 fragments, overlap, mix 0.5, K1=2, K2=2 on datacenters of 2 and 3 workers with
2 global servers; a bucket per parameter, and the fragments' own cuts inside parameters
(tests/progs/api_common.py: stream_reference cuts them by hand); then the same with two
rounds made global (as the CLI's checkpoints make them), and with adaptive cadence.
``plain``: HFA, then the same with fragments=1 (must be bitwise equal).
Every worker saves its final state.
"""

import json
import sys

import torch

import geompi
from geompi.runtime import end_process
from tests.progs.api_common import hfa_optimizer, make_model, train_steps

out, mode = sys.argv[1], sys.argv[2]
geompi.init(dc_sizes=(3, 4), global_servers=2)
w = geompi.worker_rank()
STEPS = 16


def train(name: str, algo, forced=(), **kw) -> None:
    model = make_model(seed=1 + w)
    opt = geompi.DistributedOptimizer(hfa_optimizer(model), model, sync=algo, bucket_mb=1e-9, **kw)
    train_steps(model, opt, w, STEPS, forced=forced)
    report = opt.close()
    torch.save(model.state_dict(), f"{out}/{name}-w{w}.pt")
    if report is not None:  # the master worker: K2's changes, if any
        with open(f"{out}/{name}-k2.json", "w") as f:
            json.dump(report.get("k2_changes", []), f)


if mode == "overlap":
    train("overlap", geompi.HFA(k1=2, k2=2, fragments=2, overlap=True, mix=0.5))
    train("fragments", geompi.HFA(k1=2, k2=4, fragments=4))
    # the CLI's checkpoint rounds: after steps 6 and 16, every key global (FORCED in the test)
    algo = geompi.HFA(k1=2, k2=2, fragments=2, overlap=True, mix=0.5)
    train("forced", algo, forced=(6, 16))
    # Adaptive cadence with streaming: pinned to K2=2 it is the first run, bitwise; from K2=2
    # under an emulated 50 ms WAN it goes to k2_max=4 after the first cycle
    stream = {"k1": 2, "fragments": 2, "overlap": True, "mix": 0.5, "adaptive": True}
    train("pinned", geompi.HFA(k2=2, k2_min=2, k2_max=2, **stream))
    train("adaptive", geompi.HFA(k2=2, k2_min=2, k2_max=4, **stream), wan_latency="50ms")
else:
    train("hfa", geompi.HFA(k1=2, k2=4))
    train("f1", geompi.HFA(k1=2, k2=4, fragments=1))
geompi.finish()
end_process(0)  # ends as geompi's own processes do: no interpreter teardown
