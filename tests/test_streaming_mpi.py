"""Streaming HFA (issue #14): fragments on staggered rounds, overlap, mix. Checked against an
independent simulation (tests/progs/api_common.py: stream_reference), plain HFA bitwise, and
the local servers' log of which keys went global at each datacenter round."""

import json

import pytest
import torch

from geompi.config import make_config
from geompi.errors import ConfigError
from geompi.ps.fragments import fragment_plan, is_global
from tests.mpirun import mpirun, prog
from tests.progs.api_common import stream_reference

WORKERS = 5  # tests/progs/api_stream.py: dc_sizes (3, 4), 2 global servers


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    env = {"GEOMPI_TEST_ROUND_LOG": str(out)}
    mpirun(9, ["-m", "mpi4py", prog("api_stream.py"), str(out), "overlap"], 300, env=env)
    return out


def _round_logs(out, dc: int) -> list[dict]:
    """Datacenter ``dc``'s local server round log, an entry per job (GEOMPI_TEST_ROUND_LOG)."""
    return [json.loads(ln) for ln in (out / f"rounds-dc{dc}.jsonl").read_text().splitlines()]


def _load(out, name):
    return [torch.load(out / f"{name}-w{w}.pt") for w in range(WORKERS)]


@pytest.mark.mpi
def test_rounds_made_global_end_on_one_global_model(overlap_run):
    """Streaming with overlap, rounds made global after steps 6 and 16 (the CLI's checkpoints
    and last step): each merges the pending global results, averages every key over the
    datacenters, and restarts the schedule, as the simulation says; every worker ends equal."""
    refs = stream_reference([2, 3], 2, 2, 2, True, 0.5, steps=16, forced=(6, 16))
    got = _load(overlap_run, "forced")
    for w in range(WORKERS):
        diff = max(float((got[w][k] - refs[w][k]).abs().max()) for k in got[w])
        assert diff <= 1e-5, (w, diff)
        assert all(torch.equal(got[w][k], got[0][k]) for k in got[w]), w
    plain = _load(overlap_run, "overlap")[0]  # the forced rounds change the run
    assert max(float((got[0][k] - plain[k]).abs().max()) for k in plain) > 1e-4


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name, k1, k2, fragments, overlap, mix",
    [("overlap", 2, 2, 2, True, 0.5), ("fragments", 2, 4, 4, False, 1.0)],
)
def test_streaming_equals_an_independent_simulation(
    overlap_run, name, k1, k2, fragments, overlap, mix
):
    refs = stream_reference([2, 3], k1, k2, fragments, overlap, mix, steps=16)
    for w, got in enumerate(_load(overlap_run, name)):
        diff = max(float((got[k] - refs[w][k]).abs().max()) for k in got)
        assert diff <= 1e-5, (name, w, diff)


@pytest.mark.mpi
def test_each_fragment_goes_global_once_per_k2_rounds_at_its_offset(overlap_run):
    """From the local servers' own log of the keys they sent to the global servers."""
    for dc in (0, 1):
        jobs = _round_logs(overlap_run, dc)
        assert len(jobs) == 5
        forced = jobs[2]  # rounds 3 and 8 made global: every key; the schedule restarts after 3
        plan = {int(k): f for k, f in forced["fragment_of"].items()}
        for r, keys in enumerate(forced["global_keys"], start=1):
            since = r if r <= 3 else r - 3
            want = sorted(k for k, f in plan.items() if (since + f) % 2 == 0)
            assert keys == (sorted(plan) if r in (3, 8) else want), (dc, r, keys)
        for job, (k2, fragments) in zip(jobs, [(2, 2), (4, 4)]):
            plan = {int(k): f for k, f in job["fragment_of"].items()}
            assert sorted(set(plan.values())) == list(range(fragments))
            rounds = job["global_keys"]
            assert len(rounds) == 8  # 16 steps / K1
            for r, keys in enumerate(rounds, start=1):
                want = sorted(k for k, f in plan.items() if (r + f * k2 // fragments) % k2 == 0)
                assert keys == want, (dc, r, keys, want)
            for f in range(fragments):  # once per K2 rounds, at rounds offset by f*K2/F
                hits = [r for r, keys in enumerate(rounds, 1) if any(plan[k] == f for k in keys)]
                assert len(hits) == 8 // k2 and all(b - a == k2 for a, b in zip(hits, hits[1:]))


@pytest.mark.mpi
def test_adaptive_cadence_with_streaming(overlap_run):
    """HFA(adaptive=True) with 2 fragments and overlap: pinned to K2=2 it is the streaming run
    bitwise; from K2=2 under an emulated 50 ms WAN, the local servers' timed exchanges make the
    workers choose k2_max=4 after the first cycle (2 rounds), every fragment still goes global
    once per cycle at its offset (the local servers' log), and every worker equals the
    simulation with that cycle of K2s."""
    for a, b in zip(_load(overlap_run, "overlap"), _load(overlap_run, "pinned")):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((overlap_run / "pinned-k2.json").read_text()) == []
    changes = json.loads((overlap_run / "adaptive-k2.json").read_text())
    assert [(c["step"], c["old_k2"], c["new_k2"]) for c in changes] == [(4, 2, 4)], changes
    assert changes[0]["exchange_s"] >= 0.1  # 50 ms each way at least
    cycles = [2, 4]  # rounds 1-2 at K2=2, then K2=4 (rounds 3-6, 7-8)
    refs = stream_reference([2, 3], 2, 2, 2, True, 0.5, steps=16, cycles=cycles)
    for w, got in enumerate(_load(overlap_run, "adaptive")):
        diff = max(float((got[k] - refs[w][k]).abs().max()) for k in got)
        assert diff <= 1e-5, (w, diff)
    fixed = stream_reference([2, 3], 2, 2, 2, True, 0.5, steps=16)[0]  # K2 changed the run
    got = _load(overlap_run, "adaptive")[0]
    assert max(float((got[k] - fixed[k]).abs().max()) for k in got) > 1e-4
    for dc in (0, 1):
        jobs = _round_logs(overlap_run, dc)
        job = jobs[4]  # the adaptive one
        plan = {int(k): f for k, f in job["fragment_of"].items()}
        starts = [(1, 2), (3, 4), (7, 4)]  # (first round, K2) of each cycle
        for r, keys in enumerate(job["global_keys"], start=1):
            first, k2 = max(c for c in starts if c[0] <= r)
            want = sorted(k for k, f in plan.items() if (r - first + 1 + f * k2 // 2) % k2 == 0)
            assert keys == want, (dc, r, keys, want)


@pytest.mark.mpi
def test_one_fragment_without_overlap_is_plain_hfa_bitwise(tmp_path):
    mpirun(9, ["-m", "mpi4py", prog("api_stream.py"), str(tmp_path), "plain"], 300)
    for a, b in zip(_load(tmp_path, "hfa"), _load(tmp_path, "f1")):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_fragment_plan_balances_whole_keys():
    keys = [(i, 1000) for i in range(16)]
    plan = fragment_plan(keys, 4)
    assert [sum(1 for f in plan.values() if f == g) for g in range(4)] == [4, 4, 4, 4]
    assert [plan[i] for i in range(16)] == sorted(plan.values())  # in key order
    # a transformer-like layout: each fragment holds about 1/F of the values
    sizes = [1280, 409_600, 1280, 409_600, 320, 320, 102_400] * 8 + [81_920]
    keys = list(enumerate(sizes))
    plan = fragment_plan(keys, 4)
    per = [sum(n for k, n in keys if plan[k] == f) for f in range(4)]
    assert max(per) <= sum(sizes) / 4 + max(sizes), per


def test_fragment_plan_has_the_smallest_largest_fragment():
    """Against every way to cut the keys into F runs (brute force, small cases)."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 3, 40, 400, 1000, 4096]) for _ in range(rng.randint(1, 9))]
        f = rng.randint(1, 4)
        keys = list(enumerate(sizes))
        plan = fragment_plan(keys, f)
        assert [plan[k] for k, _ in keys] == sorted(plan.values())  # runs, in key order
        runs = min(f, len(sizes))
        assert sorted(set(plan.values())) == list(range(runs))  # none empty
        best = min(
            max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
            for cuts in itertools.combinations(range(1, len(sizes)), runs - 1)
        )
        assert max(sum(n for k, n in keys if plan[k] == g) for g in range(runs)) == best


def test_schedule_with_one_fragment_is_every_k2th_round():
    assert [r for r in range(1, 13) if is_global(r, 0, 1, 4)] == [4, 8, 12]
    assert [r for r in range(1, 13) if is_global(r, 1, 2, 4)] == [2, 6, 10]


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(sync="hfa", k2=1, hfa_overlap=True), "needs k2 >= 2"),
        (dict(sync="hfa", hfa_fragments=0), "--hfa-fragments 0"),
        (dict(sync="hfa", hfa_mix=1.5), "--hfa-mix 1.5"),
        (dict(sync="hfa", k2=2, hfa_fragments=2, hfa_mix=0.5), "0.5 mixes .* add --hfa-overlap"),
        (dict(sync="fsa", hfa_fragments=2), "hfa_fragments is for --sync hfa, not --sync fsa"),
        (
            dict(sync="hfa", k1=4, k2=2, hfa_fragments=2, checkpoint_dir="/x", checkpoint_every=6),
            "not a multiple of K1 = 4",
        ),
    ],
)
def test_streaming_flags_are_validated(kw, words):
    with pytest.raises(ConfigError, match=words):
        make_config(env={}, **kw).validate()
