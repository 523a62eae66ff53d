"""geompi plan: the planner's arithmetic against hand-computed cases, its command line, and one
MPI job that holds two predictions to measured runs (bench/plan_check.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from geompi.comm.linkmodel import LinkModel
from geompi.plan import Setting, main, predict, recommend, shard_payload
from geompi.sync import FSA, HFA, MixedSync

REPO = Path(__file__).resolve().parent.parent
# 1e6 bytes/s (8 Mbit/s), 20 ms one way; a model of 250,000 values is 1 MB in fp32
LINK = LinkModel(bandwidth=1e6, latency=0.02)
N = 250_000


# ---- bytes: the codecs' payloads, by hand -----------------------------------------------------
@pytest.mark.parametrize(
    "codec, values, servers, expected",
    [
        ("none", 1000, 1, 4000),
        ("none", 1000, 3, 4000),  # 333 + 333 + 334 values
        ("fp16", 3000, 1, 2 * 3000 + 4 * 3),  # a scale per 1,024 values: 3 chunks
        ("fp16", 3000, 2, 2 * (2 * 1500 + 4 * 2)),  # each shard its own chunks
        ("bf16", 3000, 1, 6000),
        ("int8", 1000, 1, 1000 + 4 * 4),  # a scale per 256 values
        ("int4", 1001, 1, 501 + 4 * 4),  # two values a byte
        ("topk:0.01", 1000, 1, 10 * 8),  # value and index
        ("topk:0.01+int8", 1000, 1, 10 * 4 + 10 + 4),
    ],
)
def test_payload_bytes(codec, values, servers, expected):
    assert shard_payload(values, codec, servers) == expected


# ---- time per step: one round each way, latencies, overlap ------------------------------------
def test_fsa_step_is_compute_plus_two_latencies_plus_both_directions():
    p = predict(N, 0.01, Setting(FSA()), (3, 3), 1, LINK)
    exchange = 2 * 0.02 + 2 * 1e6 / 1e6  # up, a latency, down, a latency
    assert p.step_s == pytest.approx(0.01 + exchange)
    assert p.utilisation == pytest.approx(0.01 / (0.01 + exchange))
    assert p.wan_bytes_per_step == 2e6
    assert p.peak_round_bytes == 1e6


def test_mixed_sync_waits_its_control_trips_per_global_server():
    one = predict(N, 0.01, Setting(MixedSync()), (3, 3), 1, LINK)
    two = predict(N, 0.01, Setting(MixedSync()), (3, 3), 2, LINK)
    assert one.step_s == pytest.approx(0.01 + 8 * 0.02 + 2.0)  # 3 + 5 * 1 one-way trips
    assert two.step_s == pytest.approx(0.01 + 13 * 0.02 + 2.0)  # the shards split the bytes
    assert two.wan_bytes_per_step == 2e6


def test_hfa_spreads_one_exchange_over_k1_k2_steps():
    p = predict(N, 0.01, Setting(HFA(k1=4, k2=2)), (3, 3), 1, LINK)
    assert p.step_s == pytest.approx((8 * 0.01 + 2.04) / 8)
    assert p.utilisation == pytest.approx(0.08 / 2.12)
    assert p.wan_bytes_per_step == pytest.approx(2e6 / 8)


def test_streaming_pays_a_latency_pair_per_fragment_and_peaks_lower():
    p = predict(N, 0.01, Setting(HFA(k1=4, k2=4, fragments=4)), (3, 3), 1, LINK)
    assert p.step_s == pytest.approx((16 * 0.01 + 4 * (0.04 + 0.5)) / 16)
    assert p.peak_round_bytes == 250_000
    assert p.wan_bytes_per_step == pytest.approx(2e6 / 16)
    # 3 fragments over K2=2 rounds: shifts 0, 0, 1 -> rounds of 2/3 and 1/3 of the model
    q = predict(300_000, 0.01, Setting(HFA(k1=1, k2=2, fragments=3)), (3, 3), 1, LINK)
    assert q.peak_round_bytes == 4 * 200_000


def test_overlap_hides_an_exchange_behind_the_next_k1_steps_only():
    algo = HFA(k1=4, k2=4, fragments=4, overlap=True)
    p = predict(N, 0.1, Setting(algo), (3, 3), 1, LINK)  # 0.54 s exchange, 0.4 s hidden
    assert p.step_s == pytest.approx((16 * 0.1 + 4 * (0.54 - 0.4)) / 16)
    full = predict(N, 0.2, Setting(algo), (3, 3), 1, LINK)  # 0.8 s of compute hides it all
    assert full.utilisation == 1.0
    # a datacenter round's own time counts once per round, and hides the exchange too
    r = predict(N, 0.1, Setting(algo), (3, 3), 1, LINK, round_s=0.05)
    assert r.step_s == pytest.approx((16 * 0.1 + 4 * 0.05 + 4 * (0.54 - 0.4 - 0.05)) / 16)
    no = predict(N, 0.1, Setting(HFA(k1=4, k2=4, fragments=4)), (3, 3), 1, LINK)
    assert no.step_s > p.step_s


def test_codec_bytes_and_lan_port():
    p = predict(N, 0.01, Setting(FSA(), "int8"), (3, 3), 1, LINK)
    assert p.wan_bytes_per_step == 2 * (N + 4 * math.ceil(N / 256))
    lan = LinkModel(bandwidth=1e6)
    q = predict(N, 0.01, Setting(FSA()), (3, 2), 1, LINK, lan)
    # the larger datacenter's 2 workers push 1 MB each through the port and get 1 MB back
    assert q.step_s == pytest.approx(0.01 + 2.04 + 2 * 2 * 1e6 / 1e6)


def test_recommend_the_fewest_local_steps_then_the_least_lossy_codec():
    link = LinkModel(bandwidth=1e6, latency=0.025)
    recs = recommend(N, 0.01, (3, 3), 1, link, target=0.5)
    p, ok = recs["HFA"]
    # K1*K2 = 8 reaches 0.5 only with topk:0.01+int8 (0.08 / (0.08 + 0.075)); top-k alone,
    # 0.08 / (0.08 + 0.09), does not; K1*K2 = 4 does not with any codec (0.04 / 0.115)
    assert ok and p.setting.algorithm.k1 * p.setting.algorithm.k2 == 8
    assert p.setting.codec == "topk:0.01+int8"
    fsa, fsa_ok = recs["FSA"]
    assert not fsa_ok and fsa.setting.codec == "topk:0.01+int8"  # the best it has
    with pytest.raises(Exception, match="--target"):
        recommend(N, 0.01, (3, 3), 1, link, target=1.5)


# ---- the command line -------------------------------------------------------------------------
ARGS = ["--model", "80458", "--step-time", "10ms", "--wan-bandwidth", "20Mbit"]


def test_cli_table_and_json(capsys, tmp_path):
    assert main([*ARGS, "--wan-latency", "50ms"]) == 0
    out = capsys.readouterr().out
    assert "FSA" in out and "streaming HFA" in out and "cheapest settings" in out
    assert main([*ARGS, "--json", "--wan-compression", "int8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["settings"].split()[-1] for r in data["table"]} == {"int8"}
    assert set(data["recommended"]) == {"FSA", "MixedSync", "HFA", "streaming HFA"}


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "u.png"
    assert main([*ARGS, "--plot", str(out), "--wan-compression", "none"]) == 0
    assert out.stat().st_size > 1000


def test_cli_measures_a_built_in_model(capsys):
    assert main(["--model", "mlp", "--wan-bandwidth", "1Gbit", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert 0 < data["step_time_s"] < 1


@pytest.mark.parametrize(
    "args, says",
    [
        (["--model", "80458", "--step-time", "10ms", "--wan-bandwidth", "fast"], "--wan-bandwidth"),
        ([*ARGS, "--wan-latency", "5"], "--wan-latency"),
        (["--model", "0", "--step-time", "1ms", "--wan-bandwidth", "1Gbit"], "model size"),
        ([*ARGS, "--dc-sizes", "1,3"], "--dc-sizes"),
        ([*ARGS, "--dc-sizes", "a"], "--dc-sizes"),
        ([*ARGS, "--target", "1.5"], "--target"),
        ([*ARGS, "--k1", "0"], "k1"),
        ([*ARGS, "--wan-compression", "zip"], "--wan-compression"),
        ([*ARGS, "--step-time", "-3ms"], "--step-time"),
        (["--model", "80458", "--wan-bandwidth", "1Gbit"], "--step-time"),
        (["--model", "no/such.h5", "--step-time", "1ms", "--wan-bandwidth", "1Gbit"], "no such"),
        (["--model", "nosuch", "--step-time", "1ms", "--wan-bandwidth", "1Gbit"], "--model"),
        (["--model", "mlp", "--input-shape", "1,8", "--wan-bandwidth", "1Gbit"], "--input-shape"),
        ([*ARGS, "--bogus"], "unrecognized"),
        (["--step-time", "1ms", "--wan-bandwidth", "1Gbit"], "--model"),
    ],
)
def test_cli_bad_input_is_one_line(args, says, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("geompi: error: ") and err.count("\n") == 1, err
    assert says in err


def test_geompi_plan_command():
    r = subprocess.run(
        [sys.executable, "-m", "geompi", "plan", *ARGS, "--target", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--target" in r.stderr


# ---- held to measurement: one MPI job ---------------------------------------------------------
@pytest.mark.mpi
def test_predictions_within_tolerance_of_emulated_runs(tmp_path):
    """Two settings the planner was not fitted on (FSA with bf16; streaming HFA, a fragment a
    step), run under the emulated WAN after calibration runs, predicted from the calibration,
    the link and the parameter count alone (bench/plan_check.py). Both links are slow enough
    that the WAN is most of a step (about 1.3 s of it, against 0.05 s of compute): this suite
    runs beside other jobs on 2 cores, where a load swing between the calibration and a run
    moves a step's compute several times over (a setting with 0.4 s of WAN a step missed by
    32% so). Tolerance 15% rather than the benchmark's 10% for the same reason."""
    sys.path.insert(0, str(REPO / "bench"))
    import plan_check

    from tests.mpirun import mpirun_path

    settings = [
        (FSA(optimizer="servers"), "bf16", "2Mbit", "20ms"),
        (HFA(k1=1, k2=2, fragments=2), "none", "2Mbit", "50ms"),
    ]
    res = plan_check.check(
        settings,
        launcher=f"{mpirun_path()} -n {{n}} --oversubscribe",
        batch=16,
        cycles=4,
        cal_steps=24,
        budget_s=3.0,
        out=tmp_path,
        timeout=240,
    )
    for row in res["rows"]:
        assert abs(row["bytes_error"]) < 0.01, row
        assert abs(row["step_error"]) < 0.15, row
        assert abs(row["utilisation_error"]) < 0.15, row
