"""FSA leaves parameters without a gradient as torch.optim does (issue #12, defect 1).

The ``partial`` model has a frozen layer, a head unused on every third step and a parameter
never used. The global servers must skip them exactly: no weight decay, no momentum or Adam
moment update, no optimizer state. The reference is single-process torch on the concatenated
batches, with the model rebuilt here by hand.
"""

import pytest
import torch

from geompi import ckpt
from tests.mpirun import mpirun, prog
from tests.reference import max_abs_diff, worker_loaders

pytestmark = pytest.mark.mpi
WORKERS, STEPS, SEED, BATCH = 2 + 4, 9, 3, 12  # dc_sizes (3, 5): 2 + 4 workers


class Partial(torch.nn.Module):
    """geompi.models.Partial, written out again: same construction order, same forward."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(features, 16).requires_grad_(False)
        self.body = torch.nn.Linear(16, classes)
        self.side = torch.nn.Linear(16, classes)
        self.spare = torch.nn.Parameter(torch.randn(5))
        self.n = 0

    def forward(self, x):
        h = torch.tanh(self.frozen(x.flatten(1)))
        self.n += 1
        return self.body(h) if self.n % 3 == 0 else self.body(h) + self.side(h)


def reference(make_opt, steps: int = STEPS) -> tuple[dict, dict, torch.optim.Optimizer]:
    ds, loaders = worker_loaders("digits", WORKERS, BATCH, SEED)
    torch.manual_seed(SEED)
    net = Partial(64, ds.num_classes)
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    opt = make_opt(net.parameters())  # every parameter, the frozen ones included
    opt.named = list(net.named_parameters())
    for _ in range(steps):
        xs, ys = zip(*(ld.next_batch() for ld in loaders))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return init, {k: v.detach().clone() for k, v in net.state_dict().items()}, opt


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.05)


def adamw(ps):
    return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsa_no_grad")
    mpirun(10, [prog("fsa_no_grad.py"), str(out)], timeout=300)
    return out


@pytest.mark.parametrize("run,make_opt", [("sgd", sgd), ("adamw", adamw), ("adamw-resumed", adamw)])
def test_parameters_without_gradient_are_left_as_torch_leaves_them(runs, run, make_opt):
    init, want, _ = reference(make_opt)
    got = torch.load(runs / f"{run}.pt")
    for name in ("frozen.weight", "frozen.bias", "spare"):
        assert torch.equal(got[name], init[name]), name  # bitwise: never stepped
    assert not torch.equal(got["side.weight"], init["side.weight"])
    assert max_abs_diff(got, want) <= 1e-5


def test_checkpoint_has_no_state_for_parameters_without_gradient(runs):
    _, _, opt = reference(adamw)
    names = dict(opt.named)
    ck = ckpt.load(runs / "ckpt-adamw" / ckpt.checkpoint_name(STEPS))
    for state_name in ("step", "exp_avg", "exp_avg_sq"):
        assert set(ck.optimizer[state_name]) == {n for n, p in names.items() if p in opt.state}
    assert set(ck.optimizer["step"]) == {"body.weight", "body.bias", "side.weight", "side.bias"}
    for name in ("body.weight", "side.weight"):  # side skipped 3 of 9 steps
        want = opt.state[names[name]]
        assert float(ck.optimizer["step"][name]) == float(want["step"])
        for s in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ck.optimizer[s][name], want[s], rtol=0, atol=1e-6)
