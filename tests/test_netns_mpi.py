"""Datacenters in real network namespaces (tests/netns.py): one mpirun job over TCP whose hosts
are namespaces, trained with ``--dc-map nodes``; the kernel's counters and a tbf-shaped link
hold geompi's WAN byte counts and its traffic's path to the namespaces, and MixedSync's
one-sided tier runs there too. Root only (skipped with one line elsewhere)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns
from tests.mpirun import pid_alive, prog, read_jsonl

WHY = netns.unavailable()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(WHY is not None, reason=f"netns: {WHY}")]

HOSTS = [("dc0", 3), ("dc1", 3), ("gs", 1)]  # 2 datacenters of 2 workers + a local server, G=1
# bits/s: the shaped run's link. Its queue (tc tbf's, 1 MB here) holds what one local server
# sends in a round (the model, 293 kB), so nothing is dropped and sent again.
SLOW = 20e6
# Each packet the kernel counts carries Ethernet (14), IPv4 (20) and TCP headers with timestamps
# (32): what remains is payload. geompi's WAN bytes are part of it, with MPI's own headers and the
# little that is not geompi's global tier (the launcher's messages, start-up collectives,
# control messages between datacenters): at most this share more than geompi counts, never less.
HEADERS = 14 + 20 + 32
OVERHEAD = 0.02


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict], list[str], str, Path]:
    """One job, three runs: HFA shaped, HFA unshaped, MixedSync unshaped."""
    tmp_path = tmp_path_factory.mktemp("netns")
    args = ["--dc-map", "nodes", "--sync", "hfa", "--k1", "4", "--k2", "2", "--steps", "96"]
    mixed = ["--dc-map", "nodes", "--sync", "mixed", "--steps", "96"]
    spec = [
        # shaped first: the first run of a job also opens its TCP connections
        {"args": [*args, "--metrics", str(tmp_path / "m0.jsonl")], "rate": SLOW},
        {"args": [*args, "--metrics", str(tmp_path / "m1.jsonl")], "rate": None},
        {"args": [*mixed, "--metrics", str(tmp_path / "m2.jsonl")], "rate": None},
    ]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with netns.Cluster(HOSTS) as c:
        prefix = c.prefix
        names = c.names
        res = c.run(
            [sys.executable, prog("netns_runs.py"), str(tmp_path), str(tmp_path / "spec.json")],
            timeout=150,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summaries = [read_jsonl(tmp_path / f"m{i}.jsonl")[-1] for i in range(len(spec))]
    nets = [json.loads((tmp_path / f"run{i}.net.json").read_text()) for i in range(len(spec))]
    hosts = json.loads((tmp_path / "hosts.json").read_text())
    assert hosts == [n for n, (_, k) in zip(names, HOSTS, strict=True) for _ in range(k)]
    return summaries, nets, names, prefix, tmp_path


def _moved(net: dict, host: int, what: str = "bytes") -> tuple[int, int]:
    """(sent, received) by HOST during the run, as the kernel counted at its veth (bytes, or
    packets)."""
    b, a = net["before"][host], net["after"][host]
    return a[f"rx_{what}"] - b[f"rx_{what}"], a[f"tx_{what}"] - b[f"tx_{what}"]


def _payload(net: dict, host: int) -> int:
    """What HOST sent and received during the run, less the packets' headers."""
    return sum(_moved(net, host)) - HEADERS * sum(_moved(net, host, "packets"))


def test_training_across_namespaces(runs):
    summaries, nets, names, prefix, _ = runs
    # nothing of the run remains
    spaces, links = netns.ours()
    assert not [n for n in spaces + links if n.startswith(prefix)]
    for s in summaries:
        # --dc-map nodes found one datacenter per namespace (blocks would make 3 of 7 ranks)
        assert s["topology"]["dc_sizes"] == [3, 3] and s["topology"]["global_servers"] == 1
        assert s["steps"] == 96
    summaries, nets = summaries[:2], nets[:2]  # HFA's: MixedSync's bytes are checked below
    for s, net in zip(summaries, nets, strict=True):
        wan = s["wan_bytes"]
        assert wan > 1_000_000
        dcs = _payload(net, 0) + _payload(net, 1)
        gs = _payload(net, 2)
        # every WAN byte crossed a datacenter's veth and the global servers' one, and LAN
        # traffic (4x the WAN's here) stayed inside each namespace
        for kernel in (dcs, gs):
            assert wan <= kernel <= wan * (1 + OVERHEAD), (kernel, wan, s["lan_bytes"])
    slow, fast = summaries
    sent = max(_moved(nets[0], h)[0] for h in range(2))
    received = max(_moved(nets[0], h)[1] for h in range(2))
    floor = max(sent, received) * 8 / SLOW  # the least time the shaped link allows
    assert nets[0]["wall_s"] >= floor
    assert slow["wall_s"] >= fast["wall_s"] + 0.5 * floor, (slow["wall_s"], fast["wall_s"], floor)


def test_mixedsync_across_namespaces(runs):
    """MixedSync's one-sided tier over TCP between hosts (it hung there while its global server
    waited for a lock on its own window): every deposit of both datacenters applied, and its
    bytes on the veths. The global server's side of each link carries what geompi counts
    (results, tickets, counters) to within 2%; the datacenters' side carries the deposits plus
    Open MPI's requests for each Get, which osc/rdma emulates over btl/tcp with a request as
    large as the data or twice it (measured: 40 MB of 4 MB Gets sent 80 MB), so the data
    fetched costs up to 2x more there."""
    s, net = runs[0][2], runs[1][2]
    assert s["sync"] == "mixed" and s["dc_updates"] == [96, 96]
    assert s["staleness_updates"] == 192
    up = s["global_in_bytes"]  # the deposits, as the global server took them in
    down = s["wan_bytes"] - up  # the fetched results, and the control words both ways
    assert up > 5_000_000 and down > 5_000_000
    sent_by_dcs = sum(_moved(net, h)[0] for h in range(2))
    packets_by_dcs = sum(_moved(net, h, "packets")[0] for h in range(2))
    sent_by_gs, packets_by_gs = _moved(net, 2)[0], _moved(net, 2, "packets")[0]
    payload_down = sent_by_gs - HEADERS * packets_by_gs
    payload_up = sent_by_dcs - HEADERS * packets_by_dcs
    assert down * (1 - OVERHEAD) <= payload_down <= down * (1 + OVERHEAD), (payload_down, down)
    assert up <= payload_up <= (up + 2 * down) * (1 + OVERHEAD), (payload_up, up, down)


def test_the_planner_predicts_the_kernel_shaped_run(runs):
    """geompi plan on a real link (issue 39): the shaped HFA run's time per step, predicted from
    a step's compute, what a datacenter round adds (the unshaped run of the same job,
    bench/plan_check.py's calibration), the model's size and the tbf rate, within 15% of the
    measured one over whole cycles (bench/plan_check.py --kernel holds 12 settings to 10%).
    Here the link is most of a step: a global round's model each way at 20 Mbit/s.

    The compute per step is the median of the shaped run's own local steps (those without a
    round, which the link does not touch), as a user passes ``--step-time`` measured on the
    job: taken from the unshaped run instead, a load swing on this 2-core machine between the
    two runs moved it by up to 18% (once in four suites), which is not the link model's error."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import plan_check

    from geompi.comm.linkmodel import LinkModel
    from geompi.plan import Setting, model_params, predict
    from geompi.sync import HFA

    _, _, _, _, tmp_path = runs
    algo = HFA(k1=4, k2=2)
    _, r = plan_check.calibrate([tmp_path / "m1.jsonl"])  # the unshaped run: a round's cost
    c, _ = plan_check.calibrate([tmp_path / "m0.jsonl"])  # the shaped run's local steps
    start = read_jsonl(tmp_path / "m0.jsonl")[0]  # the run's settings: the default model
    assert start["config"]["dataset"] == "digits"
    params = model_params(start["config"]["model"], (1, 8, 8), 10)
    p = predict(params, c, Setting(algo, "none"), (3, 3), 1, LinkModel(SLOW / 8, 0.0), round_s=r)
    m = plan_check.window(tmp_path / "m0.jsonl", plan_check.cycle_of(algo), 96)
    assert p.step_s > 2 * c  # the link, not the compute, sets the step
    assert abs(p.step_s / m["step_s"] - 1) < 0.15, (p.step_s, m["step_s"], c, r)


def test_stale_names_removed_at_start():
    """The namespace and veth of a run whose process is gone go when the next run starts."""
    p = subprocess.Popen(["true"])
    p.wait()  # a pid that no longer runs
    stale = f"gmn{p.pid:x}"
    subprocess.run(["ip", "netns", "add", f"{stale}-dc0"], check=True)
    subprocess.run(
        ["ip", "link", "add", f"{stale}-0o", "type", "veth", "peer", "name", f"{stale}-0i"],
        check=True,
    )
    with netns.Cluster([("a", 1), ("b", 1)]) as c:
        spaces, links = netns.ours()
        assert not [n for n in spaces + links if n.startswith(stale)]
        assert len([n for n in spaces if n.startswith(c.prefix)]) == 2
    spaces, links = netns.ours()
    assert not [n for n in spaces + links if n.startswith((stale, c.prefix))]


def test_sigterm_cleans_up():
    """A harness killed by SIGTERM during its job ends the job and removes what it made."""
    p = subprocess.Popen(
        [sys.executable, str(netns.__file__), "--hosts", "a:1,b:1", "--", "sleep", "60"],
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = f"gmn{p.pid:x}-"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spaces, _ = netns.ours()
        if len([n for n in spaces if n.startswith(prefix)]) == 2:
            break
        time.sleep(0.1)
    time.sleep(1)  # mpirun has started
    inside = [
        int(pid)
        for ns in (f"{prefix}a", f"{prefix}b")
        for pid in subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True
        ).stdout.split()
    ]
    assert inside  # the job's daemons and its sleeps
    os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode != 0
    assert [ln for ln in err.splitlines() if ln.startswith("netns:")] == [
        "netns: stopped by signal 15"
    ]
    spaces, links = netns.ours()
    assert not [n for n in spaces + links if n.startswith(prefix)]
    assert not [pid for pid in inside if pid_alive(pid)]
