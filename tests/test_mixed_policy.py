"""MixedSync's global server policy alone (geompi.sync.mixed.MixedDeposits): no MPI, no windows.

Each test drives the policy as a global server of the one-sided tier does (geompi.ps.async_tier:
the deposit's hyperparameters, then each key stepped and what its datacenter holds now, then the
deposit counted), for three datacenters of uneven weight whose deposits interleave, so each is
applied on a model others moved since its last one (staleness > 0). The expectations are replays
written here in plain torch, without the code under test: ``torch.optim.SGD``/``Adam`` stepped in
the deposits' order with each datacenter's own learning rate, DCASGD's rule written out with one
backup per datacenter, the buffers' means and the staleness figures counted by hand.
"""

from __future__ import annotations

import json

import pytest
import torch

from geompi.ps.optim import SGD, Adam, ServerOptimizer, spec_from_dict, spec_to_dict
from geompi.ps.protocol import FLAG_SUM
from geompi.sync import MixedSync

GRAD_KEYS = {0: 5, 1: 3}  # key -> this shard's slice length
MEAN_KEY, MEAN_LEN = 2, 4  # the workers' buffers (a mean key)
NUM_DCS = 3
# (datacenter, weight: its samples) in arrival order: uneven weights, a skipped deposit (weight
# 0, a non-finite gradient), and datacenters that deposit while others moved the model
ARRIVALS = [(0, 8.0), (1, 3.0), (0, 8.0), (0, 6.0), (2, 1.0), (1, 3.0), (0, 8.0), (2, 0.0)]
ARRIVALS += [(1, 2.0), (2, 1.0), (0, 7.0), (1, 3.0)]
NEW_LR_AT = 5  # datacenter 1's first worker sends a new learning rate with this deposit


def initial() -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    values = {k: torch.randn(n, generator=gen) for k, n in GRAD_KEYS.items()}
    values[MEAN_KEY] = torch.randn(MEAN_LEN, generator=gen)
    return values


def deposits(arrivals=ARRIVALS) -> list[tuple[int, float, dict[int, torch.Tensor]]]:
    """Per deposit: its datacenter, weight and the sum over its samples of each key."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for dc, weight in arrivals:
        sums = {k: torch.randn(n, generator=gen) * max(weight, 1.0) for k, n in GRAD_KEYS.items()}
        sums[MEAN_KEY] = torch.rand(MEAN_LEN, generator=gen) * weight
        out.append((dc, weight, sums))
    return out


def staleness(arrivals) -> list[int]:
    """Per deposit: the deposits applied since its datacenter's previous one (its version)."""
    last, out = [0] * NUM_DCS, []
    for version, (dc, _) in enumerate(arrivals):
        out.append(version - last[dc])
        last[dc] = version + 1
    return out


def serve(policy, optimizer, values, deps, specs: dict[int, dict] | None = None) -> None:
    """What AsyncGlobalServer asks its policy, in its order: at the start what every datacenter
    holds (the INIT values), then per deposit its hyperparameters, each key (presence aside)
    stepped or averaged and, but for the mean key, what its datacenter holds now; then the
    deposit counted."""
    specs = specs or {}
    policy.start(optimizer, NUM_DCS)
    for k in values:
        for d in range(NUM_DCS):
            policy.pulled(d, k, values[k])
    applied = [0] * NUM_DCS
    stale = staleness([(dc, w) for dc, w, _ in deps])
    for i, (dc, weight, sums) in enumerate(deps):
        policy.hyperparameters(dc, specs.get(i))
        for k, total in sums.items():
            if k == MEAN_KEY:
                policy.mean(dc, k, values[k], total.clone(), weight)
                continue
            policy.step(dc, k, values[k], total.clone(), weight, 0, None)
            policy.pulled(dc, k, values[k])
        policy.applied(dc, i + 1, weight, sorted(sums), stale[i], False)
        applied[dc] += 1
        if i == len(deps) - 3:
            policy.done(applied)  # a datacenter finished here
    policy.finish(values)


# --- the replays ----------------------------------------------------------------------------
def replay_torch(make, deps, lrs: dict[int, list[float]]) -> dict[int, torch.Tensor]:
    """The gradient keys under a torch.optim optimizer, one per key, stepped per deposit in
    arrival order on the deposit's mean gradient with its datacenter's learning rate (``lrs``:
    per deposit), a deposit of weight 0 skipped."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in initial().items() if k in GRAD_KEYS}
    opts = {k: make([p]) for k, p in params.items()}
    for i, (_, weight, sums) in enumerate(deps):
        if weight == 0:
            continue
        for k, p in params.items():
            p.grad = sums[k] / weight
            opts[k].param_groups[0]["lr"] = lrs[i]
            opts[k].step()
    return {k: p.detach() for k, p in params.items()}


def replay_dcasgd(deps, lr, lam, wd, adaptive, rho=0.95, eps=1e-7) -> dict[int, torch.Tensor]:
    """w <- w - lr * (g + wd w + lam' g^2 (w - w_bak[d])) per deposit of datacenter d, then
    w_bak[d] <- w (also after a skipped deposit: d fetches w); lam' = lam / (sqrt(ms) + eps)
    with ms <- rho ms + (1 - rho) g^2 when adaptive, else lam."""
    out = {}
    for k in GRAD_KEYS:
        w = initial()[k]
        backup = [w.clone() for _ in range(NUM_DCS)]
        ms = torch.zeros_like(w)
        for dc, weight, sums in deps:
            if weight > 0:
                g = sums[k] / weight
                scale: float | torch.Tensor = lam
                if adaptive:
                    ms = rho * ms + (1 - rho) * g * g
                    scale = lam / (ms.sqrt() + eps)
                w = w - lr * (g + wd * w + scale * g * g * (w - backup[dc]))
            backup[dc] = w.clone()
        out[k] = w
    return out


def replay_means(deps) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The mean key after each deposit (its datacenter's latest mean, or the start value if it
    has none yet) and at the end (the latest means weighted by their deposits' samples)."""
    start = initial()[MEAN_KEY]
    latest: dict[int, tuple[float, torch.Tensor]] = {}
    after = []
    for dc, weight, sums in deps:
        if weight > 0:
            latest[dc] = (weight, sums[MEAN_KEY] / weight)
        after.append(latest[dc][1] if dc in latest else start)
    total = sum(w for w, _ in latest.values())
    final = torch.zeros(MEAN_LEN)
    for d in sorted(latest):
        final += latest[d][1] * (latest[d][0] / total)
    return after, final


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- the tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("adaptive", [False, True])
def test_dcasgd_compensates_each_deposit_with_its_own_datacenters_backup(adaptive) -> None:
    algo = MixedSync(dcasgd=True, dcasgd_lambda=0.5, dcasgd_adaptive=adaptive)
    spec = algo.server_spec(torch.optim.SGD([torch.zeros(1)], lr=0.1, weight_decay=0.01))
    assert spec is not None
    optimizer = ServerOptimizer(spec_from_dict(spec["optimizer"]))
    values, deps = initial(), deposits()
    serve(algo.async_policy(), optimizer, values, deps)
    want = replay_dcasgd(deps, lr=0.1, lam=0.5, wd=0.01, adaptive=adaptive)
    for k in GRAD_KEYS:
        close(values[k], want[k])
    # the compensation matters here: plain SGD (lam 0) would land elsewhere
    plain = replay_dcasgd(deps, lr=0.1, lam=0.0, wd=0.01, adaptive=False)
    assert not torch.allclose(values[0], plain[0], rtol=1e-3)


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_each_deposit_steps_the_server_optimizer_with_its_datacenters_hyperparameters(kind):
    """Datacenter 1 sends a new learning rate with one of its deposits: from then on its
    deposits, and only its, are stepped with it; the others keep the job's."""
    if kind == "momentum":
        job = SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
        new = SGD(lr=0.02, momentum=0.9, weight_decay=0.01)

        def make(params):
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        job, new = Adam(lr=0.05, betas=(0.8, 0.99)), Adam(lr=0.01, betas=(0.8, 0.99))

        def make(params):
            return torch.optim.Adam(params, lr=0.05, betas=(0.8, 0.99))

    values, deps = initial(), deposits()
    optimizer = ServerOptimizer(job)
    sent = {NEW_LR_AT: {"optimizer": spec_to_dict(new)}}
    assert deps[NEW_LR_AT][0] == 1
    serve(MixedSync().async_policy(), optimizer, values, deps, sent)
    lrs, lr_of = [], {d: job.lr for d in range(NUM_DCS)}
    for i, (dc, _, _) in enumerate(deps):
        if i == NEW_LR_AT:
            lr_of[dc] = new.lr
        lrs.append(lr_of[dc])
    want = replay_torch(make, deps, lrs)
    for k in GRAD_KEYS:
        close(values[k], want[k])


def test_buffers_follow_each_datacenters_own_mean_and_end_on_their_weighted_mean() -> None:
    values, deps = initial(), deposits()
    policy = MixedSync().async_policy()
    seen = []
    original_mean = policy.mean

    def mean(dc, key, value, total, weight):  # what the datacenter fetches back, per deposit
        original_mean(dc, key, value, total, weight)
        seen.append(value.clone())

    policy.mean = mean
    serve(policy, ServerOptimizer(SGD(lr=0.1)), values, deps)
    after, final = replay_means(deps)
    assert len(seen) == len(after)
    for got, want in zip(seen, after):
        close(got, want)
    close(values[MEAN_KEY], final)


def test_staleness_figures_and_the_deposit_log(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GEOMPI_TEST_DEPOSIT_LOG", str(tmp_path))
    values, deps = initial(), deposits()
    policy = MixedSync().async_policy()
    serve(policy, None, values, deps)
    stale = staleness(ARRIVALS)
    assert max(stale) > 1
    report = policy.report()
    for d in range(NUM_DCS):
        mine = [s for (dc, _), s in zip(ARRIVALS, stale) if dc == d]
        got = report["staleness_per_dc"][d]
        assert got == {"updates": len(mine), "mean": sum(mine) / len(mine), "max": max(mine)}
    assert report["staleness_updates"] == len(ARRIVALS)
    assert report["mean_staleness"] == sum(stale) / len(stale)
    assert report["staleness_histogram"] == {str(s): stale.count(s) for s in sorted(set(stale))}
    first_done = [sum(1 for dc, _ in ARRIVALS[:-2] if dc == d) for d in range(NUM_DCS)]
    assert report["updates_at_first_done"] == first_done
    policy.write_log(1, {0: (0, 5)})
    log = json.loads((tmp_path / "deposits-g1.json").read_text())
    assert log["index"] == 1 and log["bounds"] == {"0": [0, 5]}
    assert [(e["dc"], e["ticket"], e["weight"]) for e in log["deposits"]] == [
        (dc, i + 1, w) for i, (dc, w) in enumerate(ARRIVALS)
    ]


def test_after_a_loss_the_survivors_keep_their_backups_and_hyperparameters() -> None:
    """Datacenter 1 is lost after the first six deposits: the others are renumbered (2 -> 1),
    and datacenter 2's later deposits are compensated with its own backup, stepped with its
    own learning rate, and logged under its first number."""
    spec = MixedSync(dcasgd=True, dcasgd_lambda=0.5).server_spec(
        torch.optim.SGD([torch.zeros(1)], lr=0.1)
    )
    assert spec is not None
    optimizer = ServerOptimizer(spec_from_dict(spec["optimizer"]))
    policy = MixedSync().async_policy()
    values, deps = initial(), deposits()
    # after the loss, datacenter 2 deposits first (its backup, renumbered, counts at once)
    before, after = deps[:6], [deps[9], deps[6], deps[7], deps[10]]
    assert [dc for dc, _, _ in after] == [2, 0, 2, 0] and after[0][1] > 0
    policy.start(optimizer, NUM_DCS)
    policy.deposits = []  # the log, as GEOMPI_TEST_DEPOSIT_LOG keeps it
    for k in values:
        for d in range(NUM_DCS):
            policy.pulled(d, k, values[k])
    slower = {"optimizer": spec_to_dict(spec_from_dict({**spec["optimizer"], "lr": 0.05}))}
    for i, (dc, weight, sums) in enumerate(before):
        policy.hyperparameters(dc, slower if (dc, i) == (2, 4) else None)
        for k in GRAD_KEYS:
            policy.step(dc, k, values[k], sums[k].clone(), weight, 0, None)
            policy.pulled(dc, k, values[k])
        policy.applied(dc, i + 1, weight, list(GRAD_KEYS), 0, False)
    policy.renumber([0, 2])
    for j, (dc, weight, sums) in enumerate(after):
        new = {0: 0, 2: 1}[dc]
        policy.hyperparameters(new, None)
        for k in GRAD_KEYS:
            policy.step(new, k, values[k], sums[k].clone(), weight, 0, None)
            policy.pulled(new, k, values[k])
        policy.applied(new, 100 + j, weight, list(GRAD_KEYS), 0, False)
    # the replay: datacenter numbers as at the start, datacenter 2 at lr 0.05 from deposit 4
    for k in GRAD_KEYS:
        w = initial()[k]
        backup = [w.clone() for _ in range(NUM_DCS)]
        for i, (dc, weight, sums) in enumerate(before + after):
            if weight > 0:
                g = sums[k] / weight
                lr = 0.05 if dc == 2 and i >= 4 else 0.1
                w = w - lr * (g + 0.5 * g * g * (w - backup[dc]))
            backup[dc] = w.clone()
        close(values[k], w)
    assert policy.deposits is not None
    assert [e["dc"] for e in policy.deposits] == [dc for dc, _, _ in before + after]


def test_a_kvstores_sum_is_stepped_as_it_is_and_without_an_optimizer_it_is_the_value() -> None:
    total = torch.tensor([2.0, -4.0])
    value = torch.zeros(2)
    policy = MixedSync().async_policy()
    policy.start(ServerOptimizer(SGD(lr=0.5)), 1)
    policy.step(0, 0, value, total.clone(), 4.0, FLAG_SUM, None)
    close(value, -0.5 * total)  # not divided by the weight
    policy.start(None, 1)
    policy.step(0, 0, value, total.clone(), 4.0, 0, None)
    close(value, total)
