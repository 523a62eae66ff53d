"""MixedSync: no lost updates under concurrency, FSA-equivalence with one DC, DCASGD accuracy."""

import json
import math

import pytest
import torch

from tests.mpirun import mpirun, prog
from tests.reference import max_abs_diff

pytestmark = pytest.mark.mpi


def test_no_update_is_lost_under_concurrency(tmp_path):
    rounds = 40
    mpirun(10, [prog("mixed_no_lost_update.py"), str(tmp_path), str(rounds)], timeout=240)
    res = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("mixed-*.json"))]
    assert len(res) == 6 and {r["dc"] for r in res} == {0, 1, 2}
    for k in ("a", "b", "c"):
        expect = 1000.0 - sum(r["pushed"][k] for r in res)  # from what the workers pushed
        for r in res:
            assert r["final"][k] == [expect] * len(r["final"][k]), (k, r["worker"])
    for r in res:  # lr=1 and positive pushes: each pull sees a strictly smaller value
        assert all(b < a for a, b in zip(r["seen"], r["seen"][1:]))


@pytest.fixture(scope="module")
def one_dc(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed1")
    mpirun(5, [prog("mixed_matches_fsa.py"), str(out)], timeout=120)
    return out


def test_mixed_with_one_datacenter_equals_fsa(one_dc):
    assert max_abs_diff(torch.load(one_dc / "mixed.pt"), torch.load(one_dc / "fsa.pt")) <= 1e-5
    rec = json.loads((one_dc / "rec.json").read_text())
    assert rec["mixed"]["dc_updates"] == [15]


# --- DCASGD against a single-process replay (issue #12) ------------------------------------------
def _dcasgd_step(w, g, bak, ms, s: dict):
    """MXNet's DCASGD, written out: w - lr*(g + wd*w + lam*g*g*(w - bak)), with GeoMX's
    adaptive lam / (sqrt(ms) + eps), ms = rho*ms + (1 - rho)*g*g from 0."""
    gg = g * g
    lam = s["lam"]
    if s["adaptive"]:
        ms = torch.add(ms * s["rho"], gg, alpha=1 - s["rho"])
        lam = s["lam"] / (ms.sqrt() + s["eps"])
    d = torch.add(g, w, alpha=s["weight_decay"]) + lam * gg * (w - bak)
    return torch.add(w, d, alpha=-s["lr"]), ms


def _fp16_wire(x: torch.Tensor) -> torch.Tensor:
    """What an fp16 pull of ``x`` (one slice, at most 1024 values: one chunk) decodes to: x
    over the power of two that puts its largest magnitude in [2^14, 2^15), rounded to fp16,
    times it again. A plain ``x.half()`` differs where a value is below fp16's normal range
    (the change after two deposits of one datacenter in a row is such a rounding residue)."""
    assert x.numel() <= 1024, "more than one chunk: each has its own scale"
    amax = float(x.abs().max())
    scale = 2.0 ** (math.frexp(amax)[1] - 15) if amax > 0 else 2.0**-15
    return (x / scale).half().float() * scale


def _replay(out, spec: dict, lossy_pull: bool):
    """Replay each owner's logged deposit order in one process; returns what every datacenter
    should have pulled each round and the final values, per key."""
    res = [json.loads(p.read_text()) for p in sorted(out.glob("replay-*.json"))]
    logs = [json.loads(p.read_text()) for p in sorted(out.glob("deposits-g*.json"))]
    assert len(res) == 4 and len(logs) == 2
    names, rounds = res[0]["keys"], len(res[0]["pushed"])
    dcs = sorted({r["dc"] for r in res})
    members = {d: sorted((r for r in res if r["dc"] == d), key=lambda r: r["worker"]) for d in dcs}
    init = {k: torch.tensor(res[0]["init"][k]) for k in names}
    pulled = {d: [{k: init[k].clone() for k in names} for _ in range(rounds)] for d in dcs}
    final = {k: torch.empty_like(init[k]) for k in names}
    lag = 0.0
    for log in logs:
        for kid, k in enumerate(names):
            lo, hi = log["bounds"][str(kid)]
            w = init[k][lo:hi].clone()
            held = {d: w.clone() for d in dcs}  # INIT: every datacenter pulled w0
            ms = torch.zeros_like(w)
            count = dict.fromkeys(dcs, 0)
            for dep in log["deposits"]:
                d = dep["dc"]
                r = count[d]
                count[d] += 1
                assert kid in dep["keys"]
                skipped = r in members[d][0]["skipped"]
                assert (dep["weight"] == 0) == skipped, (d, r, dep)
                if not skipped:
                    g = torch.tensor(members[d][0]["pushed"][r][k][lo:hi])
                    for m in members[d][1:]:  # the local server's sum, in worker order
                        g = g + torch.tensor(m["pushed"][r][k][lo:hi])
                    lag = max(lag, float((w - held[d]).abs().max()))
                    w, ms = _dcasgd_step(w, g, held[d], ms, spec)
                if lossy_pull:  # fp16 pull: the replica moves by the rounded change
                    held[d] = held[d] + _fp16_wire(w - held[d])
                else:
                    held[d] = w.clone()
                pulled[d][r][k][lo:hi] = held[d]
            assert all(c == rounds for c in count.values()), count
            final[k][lo:hi] = w
    assert lag > 0.05  # datacenters were really behind: the compensation term mattered
    return res, pulled, final


@pytest.mark.parametrize("mode", ["plain", "fp16"])
def test_mixed_dcasgd_matches_a_replay_of_the_deposit_order(tmp_path, mode):
    """MixedSync "no lost update" with DCASGD: 2 global servers, 3 datacenters, one of them
    skipping rounds, against a replay in one process of each owner's logged deposit order."""
    env = {"GEOMPI_TEST_DEPOSIT_LOG": str(tmp_path)}
    if mode == "fp16":
        env["GEOMPI_WAN_COMPRESSION"] = "fp16"
    mpirun(9, [prog("mixed_dcasgd_replay.py"), str(tmp_path), "30", mode], timeout=240, env=env)
    spec = {
        "plain": dict(lr=0.3, lam=0.3, adaptive=True, rho=0.95, eps=1e-7, weight_decay=0.05),
        "fp16": dict(lr=0.5, lam=2.0, adaptive=False, weight_decay=0.05),
    }[mode]
    res, pulled, final = _replay(tmp_path, spec, lossy_pull=mode == "fp16")
    for r in res:
        assert r["skipped"] == ([3, 10, 17, 24] if r["dc"] == 2 else [])
        for i, got in enumerate(r["pulled"]):
            for k, v in got.items():
                want = pulled[r["dc"]][i][k]
                diff = float((torch.tensor(v) - want).abs().max())
                assert diff == 0, (r["worker"], i, k, diff)  # the servers' arithmetic, op for op
        for k, v in r["final"].items():
            torch.testing.assert_close(torch.tensor(v), final[k], rtol=0, atol=0)
