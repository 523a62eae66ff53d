"""Error feedback with parameters that get no gradient in some steps (issue #34, 3), against a
plain-torch replay (none of geompi's code).

The run (tests/progs/api_idle_feedback.py): 2 datacenters of one worker with batches of 3 and
5, 1 global server, the servers' SGD with momentum 0.9, ``topk:0.25`` on the WAN; parameter
``b`` gets a gradient from neither datacenter at step 4 and from one of them at steps 1, 2, 5
and 7. The rule replayed: each datacenter's push is its sum of n_i * g_i through error
feedback (residual + push, compressed; the residual keeps what was left out), except that a
parameter no worker of that datacenter produced a gradient for is left out of the compressed
vector and keeps its residual: the servers step only parameters some gradient reached (as
torch.optim leaves ``grad=None``), so whatever was sent for it would be dropped. The replay
without that exception (what geompi did before) must differ, so the setting shows the loss.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.mpirun import mpirun, prog
from tests.progs.api_idle_feedback import BATCH, LR, MOMENTUM, STEPS, USES_B, Net, data

pytestmark = pytest.mark.mpi

FRACTION = 0.25
A, B = slice(0, 5), slice(5, 8)  # the model as one flat vector: a, then b


def topk(v: torch.Tensor) -> torch.Tensor:
    """What top-k sends: the ceil(fraction * n) largest magnitudes, the rest zero."""
    k = max(1, math.ceil(FRACTION * v.numel()))
    out = torch.zeros_like(v)
    idx = torch.topk(v.abs(), k).indices
    out[idx] = v[idx]
    return out


def pushes(step: int) -> list[tuple[torch.Tensor, bool]]:
    """Each datacenter's n_i * g_i (flat) and whether ``b`` has a gradient in it."""
    out = []
    for w in range(len(BATCH)):
        net = Net()  # the gradients do not depend on the parameters (a linear model)
        used = step in USES_B[w]
        net(data(w, step), used).mean().backward()
        b = net.b.grad if used else torch.zeros(3)
        out.append((torch.cat([net.a.grad, b]) * BATCH[w], used))
    return out


def send(res: dict, d: int, push: torch.Tensor, b_used: bool, keep_idle: bool) -> torch.Tensor:
    """Datacenter d's push through error feedback; ``keep_idle``: an idle ``b`` stays out."""
    v = res.get(d, torch.zeros(8)) + push
    c = v.clone()
    if keep_idle and not b_used:
        c[B] = 0.0
    sent = topk(c)
    res[d] = c - sent
    if keep_idle and not b_used:
        res[d][B] = v[B]
    return sent


def sgd(values: torch.Tensor, mom: dict, grad: torch.Tensor, b_present: bool) -> None:
    """torch.optim.SGD(lr, momentum) on a and b, b skipped when it had no gradient."""
    for name, s, present in (("a", A, True), ("b", B, b_present)):
        if not present:
            continue
        g = grad[s]
        mom[name] = g.clone() if name not in mom else mom[name].mul_(MOMENTUM).add_(g)
        values[s] -= LR * mom[name]


def flat(state: dict) -> torch.Tensor:
    return torch.cat([state["a"].reshape(-1), state["b"].reshape(-1)])


def replay_fsa(keep_idle: bool) -> torch.Tensor:
    """FSA on the servers: the servers' model steps on the sum of what both datacenters sent
    over all samples; the workers hold the replica that the compressed pulls build."""
    init = flat(Net().state_dict())
    values, replica, mom, res = init.clone(), init.clone(), {}, {}
    for t in range(STEPS):
        p = pushes(t)
        total = sum(send(res, d, x, used, keep_idle) for d, (x, used) in enumerate(p))
        sgd(values, mom, total / sum(BATCH), any(used for _, used in p))
        replica += topk(values - replica)
    return replica


def replay_mixed(order: list[int], keep_idle: bool) -> torch.Tensor:
    """MixedSync: each deposit, in the order the global server applied them, steps the model
    on what its datacenter sent over its own samples; the workers end on the global model."""
    values, mom, res = flat(Net().state_dict()), {}, {}
    step = [0] * len(BATCH)
    all_pushes = [pushes(t) for t in range(STEPS)]
    for d in order:
        x, used = all_pushes[step[d]][d]
        step[d] += 1
        sgd(values, mom, send(res, d, x, used, keep_idle) / BATCH[d], used)
    assert step == [STEPS] * len(BATCH)
    return values


@pytest.mark.parametrize("algo", ["fsa", "mixed"])
def test_idle_parameters_keep_their_error_feedback_residual(tmp_path, algo):
    out = tmp_path / "model.pt"
    mpirun(
        5,
        ["-m", "mpi4py", prog("api_idle_feedback.py"), str(out), algo],
        timeout=180,
        env={"GEOMPI_TEST_DEPOSIT_LOG": str(tmp_path)},
    )
    got = flat(torch.load(out))
    if algo == "fsa":
        want, lossy = replay_fsa(True), replay_fsa(False)
    else:
        log = json.loads((tmp_path / "deposits-g0.json").read_text())
        order = [e["dc"] for e in log["deposits"]]
        want, lossy = replay_mixed(order, True), replay_mixed(order, False)
    assert float((lossy - want).abs().max()) > 0.05  # the setting shows a lost residual
    diff = float((got - want).abs().max())
    assert diff <= 1e-5, (diff, got.tolist(), want.tolist(), float((got - lossy).abs().max()))
