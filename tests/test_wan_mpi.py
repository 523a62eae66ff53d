"""WAN compression and the emulated WAN link, in FSA, MixedSync and HFA (one 7-rank job)."""

import json
import math

import pytest
import torch

from geompi.comm.buckets import Buckets
from tests.mpirun import mpirun, prog
from tests.reference import max_abs_diff

pytestmark = pytest.mark.mpi

DCS = 2  # tests/progs/wan_cases.py: datacenters of 2 + 1 workers, 2 global servers


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    out = tmp_path_factory.mktemp("wan")
    mpirun(7, [prog("wan_cases.py"), str(out)], timeout=300)
    return out, json.loads((out / "cases.json").read_text())


def per_step(rec: dict, name: str, key: str = "wan_data_bytes") -> float:
    """Bytes per step from two run lengths: one-off rounds (INIT, MixedSync's final fetch)
    cancel out."""
    return (rec[f"{name}_12"][key] - rec[f"{name}_6"][key]) / 6


def test_uncompressed_wan_bytes_are_the_model_both_ways(wan):
    out, meta = wan
    rec, n = meta["record"], meta["numel"]
    # each datacenter pushes n fp32 values and pulls n back, every step
    assert per_step(rec, "fsa_none") == DCS * 2 * 4 * n
    assert per_step(rec, "mixed_none") == DCS * 2 * 4 * n
    # HFA with K1*K2 = 6: one global round between step 6 and step 12
    assert per_step(rec, "hfa_none") * 6 == DCS * 2 * 4 * n
    # INIT, once: the master's datacenter alone sends its values up (the others' sums are
    # zeros), and every datacenter gets them back. INIT carries the presence key too: one count
    # per parameter and global server (the mlp has parameters only, no buffers).
    init = n + meta["common"]["global_servers"] * len(torch.load(out / "fsa_none_6.pt"))
    assert rec["fsa_none_6"]["wan_data_bytes"] - 6 * per_step(rec, "fsa_none") == (
        (1 + DCS) * 4 * init
    )


def test_bf16_halves_wan_bytes_exactly(wan):
    rec = wan[1]["record"]
    assert per_step(rec, "fsa_bf16") * 2 == per_step(rec, "fsa_none")


def test_fp16_is_half_the_bytes_plus_one_scale_per_1024_values(wan):
    """Every (key, shard) slice of m values travels as 2m bytes and ceil(m / 1024) fp32
    scales, each way, for each datacenter."""
    out, meta = wan
    state = torch.load(out / "fsa_none_6.pt")
    named = [(k, torch.nn.Parameter(v.clone())) for k, v in state.items()]
    keys = Buckets(named, int(meta["common"]["bucket_mb"] * 2**20)).keys
    g = meta["common"]["global_servers"]
    slices = [(s + 1) * n // g - s * n // g for _, n in keys for s in range(g)]
    payload = sum(2 * m + 4 * math.ceil(m / 1024) for m in slices)
    assert per_step(meta["record"], "fsa_fp16") == DCS * 2 * payload
    assert per_step(meta["record"], "fsa_none") == DCS * 2 * 4 * sum(slices)


def _slices(out, meta) -> list[int]:
    """The (key, shard) slice lengths that travel compressed, each on its own."""
    state = torch.load(out / "fsa_none_6.pt")
    named = [(k, torch.nn.Parameter(v.clone())) for k, v in state.items()]
    keys = Buckets(named, int(meta["common"]["bucket_mb"] * 2**20)).keys
    g = meta["common"]["global_servers"]
    return [(s + 1) * n // g - s * n // g for _, n in keys for s in range(g)]


@pytest.mark.parametrize(
    "comp, nbytes",
    [
        ("int8", lambda m: m + 4 * math.ceil(m / 256)),  # 1/4 of fp32, plus the scales
        ("int4", lambda m: math.ceil(m / 2) + 4 * math.ceil(m / 256)),  # 1/8, plus the scales
        (  # 10% of the values: int8 each, an int32 index each, scales per 256 kept values
            "topk:0.1+int8",
            lambda m: (k := max(1, math.ceil(0.1 * m))) + 4 * math.ceil(k / 256) + 4 * k,
        ),
    ],
)
def test_quantized_payloads_are_exact_sizes(wan, comp, nbytes):
    out, meta = wan
    payload = sum(nbytes(m) for m in _slices(out, meta))
    assert per_step(meta["record"], f"fsa_{comp}") == DCS * 2 * payload


@pytest.mark.parametrize("algo", ["mixed", "hfa"])
def test_int4_works_with_every_algorithm(wan, algo):
    """int4 under MixedSync and HFA: 1/8 of the uncompressed data plus scales, and training."""
    rec = wan[1]["record"]
    ratio = per_step(rec, f"{algo}_none") / per_step(rec, f"{algo}_int4")
    assert 7.0 < ratio < 8.0, ratio
    assert rec[f"{algo}_int4_12"]["test_acc"] > 0.2  # 10 classes: far above chance


@pytest.mark.parametrize("algo", ["fsa", "mixed", "hfa"])
def test_topk_1_percent_cuts_wan_bytes_over_30x_both_ways(wan, algo):
    rec = wan[1]["record"]
    ratio = per_step(rec, f"{algo}_none") / per_step(rec, f"{algo}_topk:0.01")
    assert ratio >= 30, ratio


@pytest.mark.parametrize(
    "algo, reference", [("fsa_topk1", "fsa_none_12"), ("hfa_topk1", "hfa_none")]
)
def test_lossless_topk_equals_no_compression(wan, algo, reference):
    """top-k keeping every value goes through the whole codec (push, pull through replicas,
    HFA's reference) and must land on the uncompressed parameters, up to rounding."""
    out, _ = wan
    assert max_abs_diff(torch.load(out / f"{algo}.pt"), torch.load(out / f"{reference}.pt")) <= 1e-6


def test_lossy_compression_changes_the_result(wan):
    """The lossless check above must be able to fail: fp16 does move the parameters."""
    out, _ = wan
    diff = max_abs_diff(torch.load(out / "fsa_fp16_12.pt"), torch.load(out / "fsa_none_12.pt"))
    assert diff > 1e-7


@pytest.mark.parametrize("algo, wan_rounds", [("fsa", 10), ("mixed", 10), ("hfa", 2)])
def test_emulated_wan_costs_at_least_latency_plus_bytes_over_bandwidth(wan, algo, wan_rounds):
    """40 ms one-way and 8 Mbit/s: every global round moves one datacenter's model each way
    on its own link, so it takes at least 2 x (40 ms + 4n bytes / 1 MB/s)."""
    rec, n = wan[1]["record"], wan[1]["numel"]
    floor = wan_rounds * 2 * (0.040 + 4 * n / 1e6)
    r = rec[f"{algo}_wan"]
    assert r["wall_s"] >= floor
    split = r["time_split"]
    assert split["wan_wait_s"] >= split["wan_held_s"] >= 0.8 * floor
    # without the emulation, the same run takes a fraction of that
    assert rec[f"{algo}_none_12"]["time_split"]["wan_held_s"] == 0


def test_mixedsync_control_operations_are_charged_to_the_emulated_wan(wan):
    """Beyond its data, each MixedSync update takes the ticket (a Fetch_and_op: a round trip),
    the deposit's flag (one way) and at least one poll of the counters (a round trip) across
    the WAN: 5 one-way latencies more than the data's 2 x (40 ms + 4n bytes / 1 MB/s)."""
    rec, n = wan[1]["record"], wan[1]["numel"]
    floor = 10 * (2 * (0.040 + 4 * n / 1e6) + 5 * 0.040)
    split = rec["mixed_wan"]["time_split"]
    assert split["wan_wait_s"] >= split["wan_held_s"] >= floor, (split, floor)
    r = rec["mixed_wan"]
    assert r["wan_bytes"] > r["wan_data_bytes"]  # the control bytes are counted, apart


def test_emulated_lan_port_serializes_the_workers_traffic(wan):
    """--lan-bandwidth 8Mbit: datacenter 0's local server takes in 2 workers' pushes and sends
    2 results of 4n bytes each per step, one after the other at 1 MB/s."""
    rec, n = wan[1]["record"], wan[1]["numel"]
    r = rec["fsa_lan"]
    floor = 5 * 4 * (4 * n / 1e6)
    assert r["wall_s"] >= floor
    assert r["time_split"]["wan_held_s"] == 0  # the WAN was not limited
    assert r["time_split"]["lan_held_s"] > 0
