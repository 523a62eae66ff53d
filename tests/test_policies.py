"""Each algorithm's server policy alone (geompi.ps.policy): no server, no MPI, no threads.

The expectations are replays written here without the code under test: HFA's K2 count per key
as a plain counter, the staggered fragments as a hand table, the overlap's mix as its formula,
the outer step as ``torch.optim`` on the whole tensor.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from geompi.ps.policy import Assign, Routing, UpNow
from geompi.ps.protocol import FLAG_EXACT, FLAG_GLOBAL, FLAG_MEAN, Op, Round
from geompi.sync import FSA, HFA, MixedSync
from geompi.sync.hfa import HFALocal, OuterStep

KEYS = [(10, 4), (11, 4), (12, 4)]


def avg(keys=KEYS, flags: int = 0, k2: int = 0) -> Round:
    return Round(Op.AVG, 0, list(keys), 1.0, 0, flags, 0, k2)


def up_keys(rnd: Round, routing: Routing) -> list[int]:
    return [rnd.keys[i][0] for i in sorted(routing.up)]


# --- the plain policies, and which algorithm takes which -----------------------------------------
def test_plain_policies_send_every_key_up_and_assign_the_average() -> None:
    rnd = Round(Op.GRAD, 3, list(KEYS), 2.0, 0, FLAG_MEAN)
    assert UpNow().route(rnd) == Routing(frozenset({0, 1, 2}))
    assert not UpNow().keeps_late(avg())
    value, average = torch.zeros(4), torch.randn(4)
    Assign().average(10, value, average)
    assert torch.equal(value, average) and Assign().state_dict() == {}


def test_each_algorithm_builds_its_own_policies() -> None:
    for algo in (FSA(), MixedSync()):
        assert isinstance(algo.local_policy(), UpNow)
        assert isinstance(algo.global_policy(), Assign)
    hfa = HFA(k1=2, k2=5, fragments=2, overlap=True, mix=0.5)
    local = hfa.local_policy()
    assert isinstance(local, HFALocal)
    assert (local.k2, local.fragments, local.overlap, local.mix) == (5, 2, True, 0.5)
    assert HFA(adaptive=True).local_policy().k2 > 64  # only the workers' K2 counts then
    assert isinstance(hfa.global_policy(), OuterStep)


# --- HFA's local policy ---------------------------------------------------------------------------
def replay_k2(rounds: list[tuple[list[int], bool]], k2: int) -> list[list[int]]:
    """The keys that go global per round: a counter per key since it last went global, which
    a forced round empties for every key it carries."""
    since: dict[int, int] = {}
    out = []
    for keys, forced in rounds:
        up = []
        for k in keys:
            since[k] = since.get(k, 0) + 1
            if forced or since[k] == k2:
                up.append(k)
                since[k] = 0
        out.append(up)
    return out


def test_hfa_counts_k2_per_key_and_a_forced_round_starts_again() -> None:
    """GeoMX users push one key per round: key 10 every round, key 11 every other one; round 5
    is forced global (close(), a checkpoint)."""
    k2 = 3
    rounds = [([10, 11] if r % 2 else [10], r == 5) for r in range(1, 15)]
    policy = HFALocal(k2)
    got = []
    for keys, forced in rounds:
        rnd = avg([(k, 4) for k in keys], FLAG_GLOBAL if forced else 0)
        routing = policy.route(rnd)
        got.append(up_keys(rnd, routing))
        assert routing.merge_first is forced and not routing.overlapped and not routing.timed
        assert routing.flags == FLAG_GLOBAL | (FLAG_EXACT if forced else 0)
    want = replay_k2(rounds, k2)
    assert got == want
    assert want[4] == [10, 11] and want[2] == [10] and [] in want  # the cases happen


def test_hfa_init_and_gradient_rounds_go_up_whole_and_leave_the_count() -> None:
    policy = HFALocal(2)
    policy.route(avg())  # one datacenter average: nothing global yet
    for op in (Op.INIT, Op.GRAD):
        rnd = Round(op, 0, list(KEYS), 1.0)
        assert policy.route(rnd) == Routing(frozenset({0, 1, 2}))
        assert not policy.keeps_late(rnd)
    assert policy.route(avg()).up == frozenset({0, 1, 2})  # the second average: global
    policy.route(avg())
    policy.rejoin()  # after a recovery the count starts again
    assert policy.route(avg()).up == frozenset()
    assert policy.keeps_late(avg())


def test_hfa_streaming_staggers_the_fragments_and_overlaps_them() -> None:
    """Three equal keys in three fragments, K2 = 3: every round one fragment goes global,
    fragment 2 first (staggered by f * K2 / F rounds), each once per K2 rounds, overlapped."""
    policy = HFALocal(3, fragments=3, overlap=True)
    policy.route(Round(Op.INIT, 0, list(KEYS), 1.0))
    got = []
    for _ in range(6):
        routing = policy.route(avg())
        got.append(up_keys(avg(), routing))
        assert routing.overlapped and not routing.merge_first
    assert got == [[12], [11], [10], [12], [11], [10]]
    forced = policy.route(avg(flags=FLAG_GLOBAL))  # everything, waited for, merged first
    assert forced.up == frozenset({0, 1, 2}) and forced.merge_first and not forced.overlapped
    assert [up_keys(avg(), policy.route(avg())) for _ in range(3)] == [[12], [11], [10]]


def test_hfa_adaptive_k2_follows_the_workers_after_each_cycle() -> None:
    """The workers choose K2 (Round.k2): 2 for two cycles, then 3; the count empties at the
    end of each cycle, so the new K2 counts from there; the exchange is timed."""
    policy = HFALocal(2**31)
    chosen = [2, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    got = []
    for k2 in chosen:
        routing = policy.route(avg(KEYS[:1], k2=k2))
        got.append(bool(routing.up))
        assert routing.timed
    assert got == [False, True, False, True, False, False, True, False, False, True]
    assert not policy.route(avg(KEYS[:1])).timed  # no K2 from the workers: none timed


def test_hfa_merges_a_late_global_result_by_its_mix() -> None:
    local, result = torch.randn(6), torch.randn(6)
    for mix in (1.0, 0.25):
        got = local.clone()
        HFALocal(2, overlap=True, mix=mix).merge(10, got, result)
        if mix == 1.0:
            assert torch.equal(got, result)
        else:
            torch.testing.assert_close(got, (1 - mix) * local + mix * result)


def test_hfa_round_log_test_hook(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GEOMPI_TEST_ROUND_LOG", str(tmp_path))
    policy = HFALocal(2, fragments=3)
    policy.route(Round(Op.INIT, 0, list(KEYS), 1.0))
    for _ in range(2):
        policy.route(avg())
    policy.stopped(dc=1)
    log = json.loads((tmp_path / "rounds-dc1.jsonl").read_text())
    assert log["fragment_of"] == {"10": 0, "11": 1, "12": 2}
    # shifts 0, 0, 1 (f * K2 // F): fragment 2 goes at round 1, fragments 0 and 1 at round 2
    assert log["global_keys"] == [[12], [10, 11]]


# --- HFA's global policy: the outer step ---------------------------------------------------------
OUTERS = {
    "average": (None, None),
    "sgd": ({"name": "sgd", "lr": 0.6}, lambda p: torch.optim.SGD(p, lr=0.6)),
    "nesterov": (
        {"name": "nesterov", "lr": 0.7},
        lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True),
    ),
    "adamw": (
        {"name": "adamw", "lr": 0.05, "betas": [0.8, 0.95], "weight_decay": 0.1},
        lambda p: torch.optim.AdamW(p, lr=0.05, betas=(0.8, 0.95), weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("name", OUTERS)
def test_outer_step_on_two_shards_is_torch_optim_on_the_whole(name: str) -> None:
    """Two global servers each hold half of a key; at each global average their OuterStep
    steps its half. Together: torch.optim on the whole key, with the pseudo-gradient
    (model - average) as its gradient (the plain average for no outer spec). Halfway, the
    state goes through state_dict into a new policy, as a checkpoint's restore does."""
    spec, make_opt = OUTERS[name]
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(9, generator=gen)
    averages = [start + torch.randn(9, generator=gen) for _ in range(4)]
    param = torch.nn.Parameter(start.clone())
    opt = make_opt([param]) if make_opt else None
    halves = [start[:4].clone(), start[4:].clone()]
    shards = [OuterStep(), OuterStep()]
    for s in shards:
        s.configure({"outer": spec} if spec else {})
        s.configure({"optimizer": {"name": "sgd"}, "update": True})  # not its entry: kept
    for r, average in enumerate(averages):
        if r == 2:  # restored from a checkpoint of this state
            restored = [OuterStep(), OuterStep()]
            for new, old in zip(restored, shards):
                new.configure({"outer": spec} if spec else {})
                new.load_state_dict(copy.deepcopy(old.state_dict()))
            shards = restored
        for s, value, part in zip(shards, halves, (average[:4], average[4:])):
            s.average(10, value, part.clone())
        if opt is None:
            param.data.copy_(average)
        else:
            param.grad = param.detach() - average
            opt.step()
        assert torch.equal(torch.cat(halves), param.detach())  # elementwise: bitwise
    if name == "average":
        assert torch.equal(torch.cat(halves), averages[-1])
        assert shards[0].state_dict() == {10: {}}
    elif name == "adamw":
        assert set(shards[0].state_dict()[10]) == {
            "outer_exp_avg",
            "outer_exp_avg_sq",
            "outer_step",
        }


def test_outer_step_uses_the_algorithms_own_rule() -> None:
    """A variant of HFA overrides outer_rule; its global policy steps with it."""
    seen = []

    class Halfway(HFA):
        def outer_rule(self, value, average, spec, state) -> None:
            seen.append(spec)
            value.add_(average - value, alpha=0.5)

    policy = Halfway(outer_lr=2.0).global_policy()
    policy.configure({"outer": Halfway(outer_lr=2.0).outer()})
    value = torch.zeros(3)
    policy.average(1, value, torch.full((3,), 4.0))
    assert value.tolist() == [2.0, 2.0, 2.0] and seen == [{"name": "sgd", "lr": 2.0}]
