"""Single-process tests of geompi.ps.optim: server optimizers, DCASGD, specs, HFA's outer step."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from geompi.errors import ConfigError
from geompi.ps.optim import (
    DCASGD,
    SGD,
    Adam,
    AdamW,
    ServerOptimizer,
    dumps,
    make_spec,
    shard_pieces,
    spec_from_dict,
    spec_to_dict,
)
from geompi.sync.hfa import outer_step

N = 257  # an odd size, so no vectorized kernel covers every element


def randn(gen: torch.Generator, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=gen, dtype=torch.float32)


def torch_reference(spec, value: torch.Tensor) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """torch.optim on its own copy of ``value``, built from the spec by hand."""
    p = torch.nn.Parameter(value.clone())
    if isinstance(spec, SGD):
        opt = torch.optim.SGD(
            [p],
            lr=spec.lr,
            momentum=spec.momentum,
            weight_decay=spec.weight_decay,
            nesterov=spec.nesterov,
            dampening=spec.dampening,
            maximize=spec.maximize,
        )
    elif isinstance(spec, AdamW):
        opt = torch.optim.AdamW(
            [p],
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            maximize=spec.maximize,
        )
    else:
        opt = torch.optim.Adam(
            [p],
            lr=spec.lr,
            betas=spec.betas,
            eps=spec.eps,
            weight_decay=spec.weight_decay,
            maximize=spec.maximize,
            decoupled_weight_decay=spec.decoupled_weight_decay,
        )
    return p, opt


def torch_step(p: torch.nn.Parameter, opt: torch.optim.Optimizer, grad: torch.Tensor) -> None:
    p.grad = grad.clone()
    opt.step()


TORCH_SPECS = [
    SGD(lr=0.1),
    SGD(lr=0.05, momentum=0.9),
    SGD(lr=0.05, momentum=0.9, nesterov=True),
    SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
    SGD(lr=0.02, momentum=0.8, weight_decay=5e-4, nesterov=True),
    SGD(lr=0.05, momentum=0.9, dampening=0.1),
    Adam(lr=1e-3),
    Adam(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
    AdamW(lr=1e-3),
    AdamW(lr=2e-3, weight_decay=0.1),
    # torch flags the servers carry (issue 34 item 6)
    SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, maximize=True),
    Adam(lr=3e-3, weight_decay=1e-2, maximize=True),
    Adam(lr=3e-3, weight_decay=0.1, decoupled_weight_decay=True),
    AdamW(lr=2e-3, weight_decay=0.1, maximize=True),
]


# --- SGD and Adam/AdamW are torch.optim ---------------------------------------------------------
@pytest.mark.parametrize("spec", TORCH_SPECS, ids=repr)
def test_server_optimizer_is_bit_identical_to_torch_optim(spec) -> None:
    gen = torch.Generator().manual_seed(1)
    value = randn(gen)
    start = value.clone()
    p, ref = torch_reference(spec, value)
    opt = ServerOptimizer(spec)
    for _ in range(6):
        grad = randn(gen)
        opt.step(3, value, grad.clone())
        torch_step(p, ref, grad)
        assert torch.equal(value, p.detach())
    assert not torch.equal(value, start)  # the steps did move the value


@pytest.mark.parametrize("spec", [SGD(lr=0.1, momentum=0.9), Adam(lr=1e-2)], ids=repr)
def test_two_keys_keep_separate_state(spec) -> None:
    gen = torch.Generator().manual_seed(2)
    values = {0: randn(gen), 7: randn(gen, 31)}
    refs = {k: torch_reference(spec, v) for k, v in values.items()}
    opt = ServerOptimizer(spec)
    for i in range(8):
        key = 0 if i % 3 else 7  # interleaved, uneven
        grad = randn(gen, values[key].numel())
        opt.step(key, values[key], grad.clone())
        torch_step(*refs[key], grad)
        for k in values:
            assert torch.equal(values[k], refs[k][0].detach())
    state = opt.state_dict()
    assert set(state) == {0, 7}
    assert state[0].keys() == state[7].keys()
    for k, v in values.items():  # each key's buffers have that key's size
        assert all(t.numel() in (1, v.numel()) for t in state[k].values())
        assert any(t.numel() == v.numel() for t in state[k].values())


def test_step_updates_the_value_in_place_and_leaves_the_grad_alone() -> None:
    value, grad = torch.tensor([2.0, -4.0]), torch.tensor([1.0, 2.0])
    ptr = value.data_ptr()
    ServerOptimizer(SGD(lr=0.5, momentum=0.9, weight_decay=0.5)).step(0, value, grad)
    # g + wd*w = [2, 0]; the first momentum buffer is that gradient
    assert value.data_ptr() == ptr
    assert value.tolist() == [1.0, -4.0]
    assert grad.tolist() == [1.0, 2.0]


def test_sgd_hand_computation() -> None:
    value = torch.tensor([1.0, -2.0, 0.5])
    opt = ServerOptimizer(SGD(lr=0.5, momentum=0.5))
    opt.step(0, value, torch.tensor([2.0, 2.0, -1.0]))  # buf = g
    assert value.tolist() == [0.0, -3.0, 1.0]
    opt.step(0, value, torch.tensor([2.0, 0.0, 1.0]))  # buf = 0.5 * buf + g
    assert value.tolist() == [-1.5, -3.5, 0.75]


# --- checkpoint state ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [SGD(lr=0.1, momentum=0.9), SGD(lr=0.1, momentum=0.9, nesterov=True), Adam(lr=1e-2), AdamW()],
    ids=repr,
)
def test_state_dict_round_trip_continues_identically(spec) -> None:
    gen = torch.Generator().manual_seed(4)
    values = {0: randn(gen), 1: randn(gen, 40)}
    a = ServerOptimizer(spec)
    for _ in range(3):
        for k, v in values.items():
            a.step(k, v, randn(gen, v.numel()))
    state = a.state_dict()
    copies = {k: v.clone() for k, v in values.items()}
    b = ServerOptimizer(spec)
    b.load_state_dict(copies, state)
    fresh = ServerOptimizer(spec)  # no state: must diverge, or the test could not fail
    fresh_values = {k: v.clone() for k, v in values.items()}
    for _ in range(4):
        for k in values:
            grad = randn(gen, values[k].numel())
            a.step(k, values[k], grad.clone())
            b.step(k, copies[k], grad.clone())
            fresh.step(k, fresh_values[k], grad.clone())
            assert torch.equal(values[k], copies[k])
    assert not all(torch.equal(values[k], fresh_values[k]) for k in values)
    after_a, after_b = a.state_dict(), b.state_dict()
    assert after_a.keys() == after_b.keys()
    for k in after_a:
        assert after_a[k].keys() == after_b[k].keys()
        for name in after_a[k]:
            assert torch.equal(after_a[k][name], after_b[k][name]), name


def test_state_dict_names_and_is_a_copy() -> None:
    gen = torch.Generator().manual_seed(5)
    value = randn(gen)
    sgd = ServerOptimizer(SGD(lr=0.1, momentum=0.9))
    sgd.step(0, value, randn(gen))
    state = sgd.state_dict()
    assert set(state[0]) == {"momentum_buffer"}
    saved = state[0]["momentum_buffer"].clone()
    sgd.step(0, value, randn(gen))
    assert torch.equal(state[0]["momentum_buffer"], saved)
    adam = ServerOptimizer(Adam())
    adam.step(0, value, randn(gen))
    adam.step(0, value, randn(gen))
    st = adam.state_dict()[0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(st["step"]) == 2.0


# --- DCASGD -------------------------------------------------------------------------------------
def test_dcasgd_hand_computation_with_per_datacenter_backups() -> None:
    # dyadic numbers: every operation below is exact in float32
    opt = ServerOptimizer(DCASGD(lr=0.5, lam=0.25))
    w = torch.tensor([1.0, -2.0])
    # DC 0, first push: no backup, plain SGD step w - lr*g
    opt.step(0, w, torch.tensor([1.0, 2.0]), dc=0)
    assert w.tolist() == [0.5, -3.0]
    # DC 1, first push: no backup either, plain SGD even though DC 0 has one
    opt.step(0, w, torch.tensor([2.0, -1.0]), dc=1)
    assert w.tolist() == [-0.5, -2.5]
    # DC 0 again: its backup is [0.5, -3.0] (not DC 1's [-0.5, -2.5])
    #   w - bak = [-1, 0.5]; lam*g*g*(w - bak) = 0.25*[4, 4]*[-1, 0.5] = [-1, 0.5]
    #   w - 0.5*([2, 2] + [-1, 0.5]) = [-0.5, -2.5] - [0.5, 1.25]
    opt.step(0, w, torch.tensor([2.0, 2.0]), dc=0)
    assert w.tolist() == [-1.0, -3.75]
    # DC 1 again: its backup is [-0.5, -2.5]
    #   w - bak = [-0.5, -1.25]; 0.25*[4, 16]*[-0.5, -1.25] = [-0.5, -5]
    #   w - 0.5*([-2, 4] + [-0.5, -5]) = [-1, -3.75] - [-1.25, -0.5]
    opt.step(0, w, torch.tensor([-2.0, 4.0]), dc=1)
    assert w.tolist() == [0.25, -3.25]
    # each backup is the value that datacenter pulled after its last push
    state = opt.state_dict()[0]
    assert state["backup_dc0"].tolist() == [-1.0, -3.75]
    assert state["backup_dc1"].tolist() == [0.25, -3.25]
    assert state["backup_dc1"].data_ptr() != w.data_ptr()  # a copy, not the live value


def test_dcasgd_backups_are_per_key() -> None:
    opt = ServerOptimizer(DCASGD(lr=0.5, lam=0.25))
    a, b = torch.tensor([1.0]), torch.tensor([4.0])
    opt.step(0, a, torch.tensor([2.0]), dc=0)  # key 0, DC 0: backup [0]
    opt.step(1, b, torch.tensor([2.0]), dc=0)  # key 1, DC 0: first push of that key -> plain
    assert b.tolist() == [3.0]
    opt.step(0, a, torch.tensor([2.0]), dc=0)  # w == backup: compensation term is 0
    assert a.tolist() == [-1.0]


def test_dcasgd_without_datacenter_is_synchronous_sgd() -> None:
    opt = ServerOptimizer(DCASGD(lr=0.5, lam=1.0))
    w = torch.tensor([1.0, 2.0])
    for g in ([2.0, 1.0], [1.0, -2.0], [4.0, 4.0]):
        opt.step(0, w, torch.tensor(g))
    assert w.tolist() == [1.0 - 0.5 * 7.0, 2.0 - 0.5 * 3.0]
    assert opt.state_dict() == {0: {}}  # no backups kept


def test_dcasgd_weight_decay() -> None:
    opt = ServerOptimizer(DCASGD(lr=0.5, lam=0.25, weight_decay=0.5))
    w = torch.tensor([2.0])
    opt.step(0, w, torch.tensor([1.0]), dc=0)  # g' = 1 + 0.5*2 = 2 -> w = 1
    assert w.tolist() == [1.0]
    opt.step(0, w, torch.tensor([1.5]), dc=1)  # g' = 1.5 + 0.5 = 2 -> w = 0
    assert w.tolist() == [0.0]
    # DC 0: g' = 2 + 0 = 2, bak = 1: w - 0.5*(2 + 0.25*4*(0 - 1)) = 0 - 0.5*1
    opt.step(0, w, torch.tensor([2.0]), dc=0)
    assert w.tolist() == [-0.5]


def test_dcasgd_lambda_zero_is_plain_sgd_on_exact_values() -> None:
    opt = ServerOptimizer(DCASGD(lr=0.25, lam=0.0))
    w = torch.tensor([1.0, -1.0, 3.0])
    expected = [1.0, -1.0, 3.0]
    grads = [[1.0, 2.0, -4.0], [0.5, 8.0, 1.0], [-2.0, 0.25, 2.0], [4.0, 4.0, -0.5]]
    for i, g in enumerate(grads):
        opt.step(0, w, torch.tensor(g), dc=i % 2)
        expected = [e - 0.25 * x for e, x in zip(expected, g)]
        assert w.tolist() == expected


def test_dcasgd_lambda_zero_is_bit_identical_to_plain_sgd() -> None:
    gen = torch.Generator().manual_seed(7)
    w = randn(gen)
    w_sgd = w.clone()
    dcasgd, sgd = ServerOptimizer(DCASGD(lr=0.1, lam=0.0)), ServerOptimizer(SGD(lr=0.1))
    for i in range(6):
        grad = randn(gen)
        dcasgd.step(0, w, grad.clone(), dc=i % 2)
        sgd.step(0, w_sgd, grad.clone())
        assert torch.equal(w, w_sgd), f"push {i}"


def test_dcasgd_adaptive_lambda() -> None:
    lr, lam, rho, eps = 0.1, 0.5, 0.95, 1e-7
    gen = torch.Generator().manual_seed(8)
    w = randn(gen, 64)
    pushes = [(dc, randn(gen, 64)) for dc in (0, 1, 0, 0, 1, 1, 0)]
    adaptive = ServerOptimizer(DCASGD(lr=lr, lam=lam, adaptive=True))
    fixed = ServerOptimizer(DCASGD(lr=lr, lam=lam))
    w_fixed = w.clone()
    # reference in float64, written from the formula
    ref = w.double()
    ms = torch.zeros(64, dtype=torch.float64)  # GeoMX: the moving average starts from 0
    backup: dict[int, torch.Tensor] = {}
    for dc, g in pushes:
        adaptive.step(0, w, g.clone(), dc=dc)
        fixed.step(0, w_fixed, g.clone(), dc=dc)
        g64 = g.double()
        ms = rho * ms + (1 - rho) * g64 * g64
        lam_t = lam / (torch.sqrt(ms) + eps)
        if dc in backup:
            ref = ref - lr * (g64 + lam_t * g64 * g64 * (ref - backup[dc]))
        else:
            ref = ref - lr * g64
        backup[dc] = ref.clone()
        torch.testing.assert_close(w.double(), ref, rtol=1e-5, atol=1e-6)
    state = adaptive.state_dict()[0]
    torch.testing.assert_close(state["meansquare"].double(), ms, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(state["backup_dc0"].double(), backup[0], rtol=1e-5, atol=1e-6)
    assert "meansquare" not in fixed.state_dict()[0]
    assert (w - w_fixed).abs().max() > 1e-3  # adaptive lambda really changes the result


def _mxnet_dcasgd(w, g, bak, lr, lam, wd, ms=None, rho=0.95, eps=1e-7):
    """MXNet's DCASGD step written out in float64 (GeoMX's adaptive lambda when ms is given):
    w - lr * (g + wd*w + lam * g*g * (w - bak)), g the raw gradient."""
    if ms is not None:
        ms = rho * ms + (1 - rho) * g * g
        lam = lam / (torch.sqrt(ms) + eps)
    return w - lr * (g + wd * w + lam * g * g * (w - bak)), ms


@pytest.mark.parametrize("adaptive", [False, True])
def test_dcasgd_first_update_is_compensated_against_init(adaptive) -> None:
    # issue #12, 3: w_bak[d] starts at w0, which every datacenter pulled in the INIT round
    lr, lam, wd = 0.2, 0.7, 0.05
    gen = torch.Generator().manual_seed(12)
    w0 = randn(gen)
    w = w0.clone()
    opt = ServerOptimizer(DCASGD(lr=lr, lam=lam, adaptive=adaptive, weight_decay=wd))
    for dc in (0, 1, 2):
        opt.pulled(3, dc, w)  # what the global server does when the INIT round is over
    ref = w0.double()
    bak = {dc: w0.double() for dc in (0, 1, 2)}
    ms = torch.zeros(N, dtype=torch.float64) if adaptive else None
    lag = []
    for dc in (0, 1, 2, 1, 0, 0, 2):  # the first push of DCs 1 and 2 comes after others moved w
        g = torch.sin(3 * w) + 0.5 * randn(gen)  # a gradient of what the server holds: nonlinear
        lag.append(float((ref - bak[dc]).abs().max()))
        opt.step(3, w, g.clone(), dc=dc)
        ref, ms = _mxnet_dcasgd(ref, g.double(), bak[dc], lr, lam, wd, ms)
        bak[dc] = ref.clone()
        torch.testing.assert_close(w.double(), ref, rtol=1e-5, atol=1e-5)
    assert lag[0] == 0.0 and min(lag[1:3]) > 0.1  # DCs 1 and 2 start behind: compensated


def test_dcasgd_backup_is_what_the_datacenter_was_told_it_holds() -> None:
    # issue #12, 4: with a lossy WAN codec a datacenter holds its replica, not w
    lr, lam = 0.25, 0.5
    gen = torch.Generator().manual_seed(13)
    w = randn(gen)
    opt = ServerOptimizer(DCASGD(lr=lr, lam=lam))
    opt.pulled(0, 0, w)
    opt.pulled(0, 1, w)
    ref = w.double()
    held = {0: ref.clone(), 1: ref.clone()}
    for dc in (0, 1, 1, 0, 1):
        g = torch.cos(2 * w) + randn(gen)
        opt.step(0, w, g.clone(), dc=dc)
        ref, _ = _mxnet_dcasgd(ref, g.double(), held[dc], lr, lam, 0.0)
        replica = w.half().float()  # what a lossy pull left that datacenter with
        opt.pulled(0, dc, replica)
        held[dc] = replica.double()
        torch.testing.assert_close(w.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(opt.state_dict()[0]["backup_dc1"], w.half().float())


def test_dcasgd_weight_decay_is_not_squared() -> None:
    # issue #12, 6: MXNet squares the raw gradient; weight decay is a separate term.
    # w = 2, g = 1, wd = 0.5, lam = 0.25, lr = 0.5, w_bak = 1 (DC 0 pulled 1, then w moved to 2)
    #   MXNet: 2 - 0.5 * (1 + 0.5*2 + 0.25 * 1*1 * (2 - 1)) = 2 - 0.5 * 2.25 = 0.875
    #   (folding wd first would square g + wd*w = 2: 2 - 0.5 * (2 + 0.25*4*1) = 0.5)
    opt = ServerOptimizer(DCASGD(lr=0.5, lam=0.25, weight_decay=0.5))
    opt.pulled(0, 0, torch.tensor([1.0]))
    w = torch.tensor([2.0])
    opt.step(0, w, torch.tensor([1.0]), dc=0)
    assert w.tolist() == [0.875]
    assert opt.state_dict()[0]["backup_dc0"].tolist() == [0.875]


def test_dcasgd_adaptive_meansquare_starts_from_zero() -> None:
    # issue #12, 6: ms = rho*ms + (1 - rho)*g*g from 0; lam / (sqrt(ms) + eps)
    # g = 2, rho = 0.75: ms = 0.25 * 4 = 1, lam_t = 0.5 / (1 + 0) = 0.5 (eps 0)
    #   w = 3, bak = 1: 3 - 0.5 * (2 + 0.5 * 4 * 2) = 3 - 3 = 0 (ms from g*g = 4: lam_t 0.25 -> 1)
    opt = ServerOptimizer(DCASGD(lr=0.5, lam=0.5, adaptive=True, rho=0.75, eps=0.0))
    opt.pulled(0, 0, torch.tensor([1.0]))
    w = torch.tensor([3.0])
    opt.step(0, w, torch.tensor([2.0]), dc=0)
    assert w.tolist() == [0.0]
    assert opt.state_dict()[0]["meansquare"].tolist() == [1.0]


def test_pulled_is_ignored_by_other_optimizers() -> None:
    opt = ServerOptimizer(SGD(lr=0.1))
    opt.pulled(0, 0, torch.ones(3))
    assert opt.state_dict() == {}


def test_dcasgd_state_round_trip() -> None:
    gen = torch.Generator().manual_seed(9)
    spec = DCASGD(lr=0.1, lam=0.3, adaptive=True)
    a = ServerOptimizer(spec)
    w = randn(gen)
    for dc in (0, 1, 2):
        a.step(5, w, randn(gen), dc=dc)
    b = ServerOptimizer(spec)
    w_b = w.clone()
    b.load_state_dict({5: w_b}, a.state_dict())
    for dc in (2, 0, 1, 0):
        g = randn(gen)
        a.step(5, w, g.clone(), dc=dc)
        b.step(5, w_b, g.clone(), dc=dc)
        assert torch.equal(w, w_b)


# --- specs --------------------------------------------------------------------------------------
ALL_SPECS = [
    SGD(),
    SGD(lr=0.2, momentum=0.9, weight_decay=1e-4, nesterov=True, dampening=0.0),
    Adam(),
    Adam(lr=1e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01),
    AdamW(),
    AdamW(lr=5e-4, betas=(0.9, 0.98), weight_decay=0.05),
    DCASGD(),
    DCASGD(lr=0.05, lam=0.1, adaptive=True, rho=0.9, eps=1e-6, weight_decay=1e-4),
]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=repr)
def test_spec_round_trip(spec) -> None:
    d = spec_to_dict(spec)
    assert d["name"] == {SGD: "sgd", Adam: "adam", AdamW: "adamw", DCASGD: "dcasgd"}[type(spec)]
    back = spec_from_dict(d)
    assert type(back) is type(spec) and back == spec
    via_json = spec_from_dict(json.loads(dumps(spec)))  # betas come back as a list
    assert type(via_json) is type(spec) and via_json == spec


def test_spec_from_dict_does_not_modify_its_argument() -> None:
    d = spec_to_dict(Adam())
    copy = dict(d)
    spec_from_dict(d)
    assert d == copy


@pytest.mark.parametrize("name", ["rmsprop", None, "SGD"])
def test_unknown_optimizer_name(name) -> None:
    with pytest.raises(ConfigError) as exc:
        spec_from_dict({"name": name, "lr": 0.1})
    message = str(exc.value)
    assert "\n" not in message and repr(name) in message and "sgd, adam, adamw, dcasgd" in message


def test_unknown_optimizer_field() -> None:
    with pytest.raises(ConfigError) as exc:
        spec_from_dict({"name": "sgd", "lr": 0.1, "beta": 0.9})
    assert "sgd" in str(exc.value) and "\n" not in str(exc.value)


def test_make_spec() -> None:
    assert make_spec("sgd", 0.1, momentum=0.9, nesterov=True) == SGD(
        lr=0.1, momentum=0.9, nesterov=True
    )
    assert make_spec("adam", 1e-3, weight_decay=0.1) == Adam(lr=1e-3, weight_decay=0.1)
    assert make_spec("adamw", 1e-3) == AdamW(lr=1e-3, weight_decay=0.0)  # --weight-decay rules
    assert make_spec("dcasgd", 0.05, dcasgd_lambda=0.2, dcasgd_adaptive=True) == DCASGD(
        lr=0.05, lam=0.2, adaptive=True
    )
    with pytest.raises(ConfigError) as exc:
        make_spec("lamb", 0.1)
    assert "'lamb'" in str(exc.value)


# --- HFA's outer step ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, {"name": "sgd", "lr": 1.0}, {"name": "sgd"}])
def test_outer_step_plain_averaging_assigns_exactly(spec) -> None:
    gen = torch.Generator().manual_seed(10)
    value, average = randn(gen), randn(gen)
    state: dict = {}
    outer_step(value, average, spec, state)
    assert torch.equal(value, average)
    assert state == {}


def test_outer_step_sgd_half_way() -> None:
    value = torch.tensor([4.0, -2.0, 1.0])
    average = torch.tensor([2.0, 2.0, 1.0])
    outer_step(value, average, {"name": "sgd", "lr": 0.5}, {})
    assert value.tolist() == [3.0, 0.0, 1.0]


def test_outer_step_sgd_random_half_way() -> None:
    gen = torch.Generator().manual_seed(11)
    value, average = randn(gen).double(), randn(gen).double()
    expected = [v - 0.5 * (v - a) for v, a in zip(value.tolist(), average.tolist())]
    outer_step(value, average, {"name": "sgd", "lr": 0.5}, {})
    assert value.tolist() == expected


def test_outer_step_nesterov_hand_computation() -> None:
    spec = {"name": "nesterov", "lr": 1.0, "momentum": 0.5}
    state: dict = {}
    value = torch.tensor([4.0])
    # delta = 2, buf = 2, step = delta + 0.5*buf = 3
    outer_step(value, torch.tensor([2.0]), spec, state)
    assert value.tolist() == [1.0]
    assert state["outer_momentum"].tolist() == [2.0]
    # delta = 1, buf = 0.5*2 + 1 = 2, step = 1 + 0.5*2 = 2
    outer_step(value, torch.tensor([0.0]), spec, state)
    assert value.tolist() == [-1.0]
    assert state["outer_momentum"].tolist() == [2.0]


def test_outer_step_nesterov_default_momentum_and_lr() -> None:
    spec = {"name": "nesterov", "lr": 0.7}  # what train.py sends: momentum defaults to 0.9
    state: dict = {}
    value = torch.tensor([4.0], dtype=torch.float64)
    outer_step(value, torch.tensor([2.0], dtype=torch.float64), spec, state)
    v1 = 4.0 - 0.7 * (2.0 + 0.9 * 2.0)
    assert value.tolist() == [v1]
    outer_step(value, torch.tensor([1.0], dtype=torch.float64), spec, state)
    delta = v1 - 1.0
    buf = 0.9 * 2.0 + delta
    assert state["outer_momentum"].tolist() == [buf]
    # torch.optim.SGD's arithmetic (value + (-lr) * step in one operation): within a rounding
    assert value.tolist() == pytest.approx([v1 - 0.7 * (delta + 0.9 * buf)], rel=1e-15)


def test_outer_step_nesterov_differs_from_sgd_on_the_second_step() -> None:
    v_sgd, v_nes = torch.tensor([4.0]), torch.tensor([4.0])
    st_sgd: dict = {}
    st_nes: dict = {}
    for avg in (2.0, 0.0):
        outer_step(v_sgd, torch.tensor([avg]), {"name": "sgd", "lr": 0.5}, st_sgd)
        outer_step(v_nes, torch.tensor([avg]), {"name": "nesterov", "lr": 0.5}, st_nes)
    assert st_sgd == {} and "outer_momentum" in st_nes
    assert v_sgd.tolist() != v_nes.tolist()


def test_outer_step_keys_keep_separate_momentum() -> None:
    spec = {"name": "nesterov", "lr": 1.0, "momentum": 0.5}
    s0: dict = {}
    s1: dict = {}
    a, b = torch.tensor([4.0]), torch.tensor([4.0])
    outer_step(a, torch.tensor([2.0]), spec, s0)
    outer_step(a, torch.tensor([0.0]), spec, s0)
    outer_step(b, torch.tensor([0.0]), spec, s1)  # first step of b: buf = delta = 4
    assert s1["outer_momentum"].tolist() == [4.0]
    assert b.tolist() == [4.0 - (4.0 + 0.5 * 4.0)]


@pytest.mark.parametrize("name", ["sgd", "nesterov"])
def test_outer_step_non_finite_lr_leaves_value_untouched(name: str) -> None:
    value = torch.tensor([4.0, 1.0])
    state: dict = {}
    with pytest.raises(ConfigError):
        outer_step(value, torch.tensor([2.0, 1.0]), {"name": name, "lr": math.nan}, state)
    assert value.tolist() == [4.0, 1.0]
    assert state == {}


def test_step_updates_the_tensor_it_is_given() -> None:
    opt = ServerOptimizer(SGD(lr=0.5))
    first = torch.tensor([1.0])
    opt.step(0, first, torch.tensor([1.0]))
    second = torch.tensor([10.0])  # e.g. a GlobalServer INIT round replaced values[key]
    opt.step(0, second, torch.tensor([1.0]))
    assert second.tolist() == [9.5]
    assert first.tolist() == [0.5]


# --- keys with a layout: one torch parameter per piece, absent gradients skipped ----------------
LAYOUT = [("a", 0, 5), ("b", 5, 7), ("c", 12, 4)]  # a key of 16 values: three parameters


@pytest.mark.parametrize(
    "spec", [SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), AdamW(lr=0.05)], ids=repr
)
@pytest.mark.parametrize("lo,hi", [(0, 16), (3, 14)])  # the whole key, or a shard cutting a, c
def test_absent_pieces_are_skipped_as_torch_skips_grad_none(spec, lo, hi) -> None:
    from geompi.ps.optim import shard_pieces

    gen = torch.Generator().manual_seed(8)
    full = randn(gen, 16)
    refs = {n: torch_reference(spec, full[off : off + k]) for n, off, k in LAYOUT}
    value = full[lo:hi].clone()
    opt = ServerOptimizer(spec)
    pieces = shard_pieces(LAYOUT, lo, hi)
    opt.set_layout(0, pieces)
    for step in range(6):
        grad = randn(gen, 16)
        here = {"a": True, "b": step % 2 == 0, "c": step == 5}  # c: only the last step
        opt.step(0, value, grad[lo:hi].clone(), present=[here[pc.name] for pc in pieces])
        for n, off, k in LAYOUT:
            p, ref = refs[n]
            p.grad = grad[off : off + k].clone() if here[n] else None
            ref.step()
        want = torch.cat([refs[n][0].detach() for n, _, _ in LAYOUT])[lo:hi]
        assert torch.equal(value, want), step
    state = opt.state_dict()[0]
    for name, per_param in state.items():
        for n, t in per_param.items():
            pc = next(pc for pc in pieces if pc.name == n)
            ref_t = refs[n][1].state[refs[n][0]][name]
            if ref_t.dim():  # this shard's part of the parameter
                off = next(o for x, o, _ in LAYOUT if x == n)
                ref_t = ref_t[pc.lo + lo - off : pc.hi + lo - off]
            assert torch.equal(t, ref_t), (name, n)
    # a round trip through state_dict keeps a piece's missing state missing
    copy = value.clone()
    again = ServerOptimizer(spec)
    again.set_layout(0, pieces)
    again.load_state_dict({0: copy}, {0: state})
    assert again.state_dict()[0].keys() == state.keys()
    for name in state:
        assert state[name].keys() == again.state_dict()[0][name].keys()


def test_param_groups_on_the_server_equal_torch_with_the_same_groups() -> None:
    """Two groups with their own lr and weight decay, an lr change between steps, one key
    whose shard holds pieces of both groups and a parameter outside the optimizer."""
    torch.manual_seed(0)
    shapes = {"a": 5, "b": 3, "c": 4, "d": 2}  # a, c: group 0; b: group 1; d: in no group
    groups = [
        AdamW(lr=1e-2, weight_decay=0.1),
        AdamW(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.0),
    ]
    group = {"a": 0, "b": 1, "c": 0, "d": -1}
    layout, off = [], 0
    for name, n in shapes.items():
        layout.append([name, off, n, group[name]])
        off += n
    value = torch.randn(off)
    params = {n: torch.nn.Parameter(value[o : o + k].clone()) for (n, o, k, _) in layout}
    ref = torch.optim.AdamW(
        [
            {"params": [params["a"], params["c"]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [params["b"]], "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.0},
        ],
        foreach=False,
    )
    opt = ServerOptimizer(groups[0], groups)
    lo, hi = 2, 13  # a shard that cuts a and d
    opt.set_layout(0, shard_pieces(layout, lo, hi))
    shard = value[lo:hi].clone()
    for _ in range(4):
        grad = torch.randn(off)
        for name, o, k, _ in layout:
            params[name].grad = grad[o : o + k].clone()
        ref.step()
        opt.step(0, shard, grad[lo:hi])
        ref.param_groups[1]["lr"] *= 0.5  # a schedule on group 1 only
        groups[1] = AdamW(lr=ref.param_groups[1]["lr"], betas=(0.8, 0.95), weight_decay=0.0)
        opt.update(groups[0], groups)
    want = torch.cat([params[n].detach() for n in shapes])[lo:hi]
    assert torch.equal(shard, want)
    assert torch.equal(shard[-1:], value[12:13])  # d is in no group: never stepped
    with pytest.raises(ConfigError, match="param groups"):
        opt.update(groups[0], groups[:1])


def test_server_steps_do_not_import_torch_dynamo() -> None:
    """A torch.optim object imports torch._dynamo when built (2 s of CPU, on every global
    server before its first step); the servers' SGD/Adam/AdamW steps without one."""
    code = (
        "import sys, torch\n"
        "from geompi.ps.optim import SGD, AdamW, ServerOptimizer\n"
        "for spec in (SGD(lr=0.1, momentum=0.9, nesterov=True), AdamW(lr=1e-3)):\n"
        "    opt = ServerOptimizer(spec)\n"
        "    value = torch.ones(8)\n"
        "    opt.step(0, value, torch.full((8,), 0.5))\n"
        "    assert not torch.equal(value, torch.ones(8)), 'no step was taken'\n"
        "assert 'torch._dynamo' not in sys.modules, 'a server step imported torch._dynamo'\n"
        "torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)\n"
        "print('torch.optim imports it:', 'torch._dynamo' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # the check can fail: torch.optim itself does import it
    assert res.stdout.strip() == "torch.optim imports it: True", res.stdout


@pytest.mark.parametrize(
    "name, kwargs, cls, torch_kwargs",
    [
        ("sgd", {}, torch.optim.SGD, {}),
        ("sgd", {"momentum": 0.5, "weight_decay": 0.01}, torch.optim.SGD, {}),
        ("nesterov", {}, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        ("adam", {}, torch.optim.Adam, {}),
        ("adam", {"betas": (0.8, 0.99), "eps": 1e-6}, torch.optim.Adam, {}),
        ("adamw", {"weight_decay": 0.1}, torch.optim.AdamW, {}),
    ],
)
def test_outer_step_is_torch_optim_on_the_pseudo_gradient(name, kwargs, cls, torch_kwargs) -> None:
    """Each outer optimizer of the allow-list is the torch.optim class stepped with
    (value - average) as the gradient: bitwise, round after round, on one parameter."""
    gen = torch.Generator().manual_seed(3)
    value = torch.randn(37, generator=gen)
    p = torch.nn.Parameter(value.clone())
    opt = cls([p], lr=0.3, foreach=False, **kwargs, **torch_kwargs)
    state: dict = {}
    for _ in range(4):
        average = value + 0.1 * torch.randn(37, generator=gen)
        p.grad = p.detach() - average
        opt.step()
        outer_step(value, average, {"name": name, "lr": 0.3, **kwargs}, state)
        assert torch.equal(value, p.detach())
    torch_state = opt.state[p]
    for k, v in torch_state.items():
        assert torch.equal(state["outer_" + ("momentum" if k == "momentum_buffer" else k)], v)
