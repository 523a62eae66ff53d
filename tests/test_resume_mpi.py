"""Checkpoints during training: exact resume, re-sharding onto another topology, refusals."""

import shutil

import h5py
import pytest
import torch

from geompi import ckpt
from geompi.ckpt import cli as ckpt_cli
from tests.mpirun import HOOKS, error_lines, mpirun, read_jsonl, train_runs

pytestmark = pytest.mark.mpi
BASE = ["-m", "geompi.train", "--model", "mlp", "--batch-size", "12", "--progress-every", "1e9"]


def train(n, *args, timeout=120, check=True, env=None):
    return mpirun(n, BASE + [str(a) for a in args], timeout=timeout, check=check, env=env)


def train_seq(n, out, *runs, timeout=120):
    """train(n, *args, env=env) for each (args, env) of RUNS in turn, in ONE mpirun job
    (tests.mpirun.train_runs: the ranks start once, not once a run); each under TIMEOUT.
    A resume never directly follows the run whose checkpoint it reads: state a run left in
    the process would then be another step's, and the bitwise comparisons would catch it."""
    return train_runs(
        n, [(BASE[2:] + list(a), e) for a, e in runs], out / "runs", timeout * len(runs)
    )


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}/")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v


def identical(a, b) -> bool:
    """Every tensor of the two checkpoints (model, optimizer, algorithm) is bitwise equal."""
    ca, cb = ckpt.load(a), ckpt.load(b)
    ta = dict(_leaves({"model": ca.model, "optimizer": ca.optimizer, "algorithm": ca.algorithm}))
    tb = dict(_leaves({"model": cb.model, "optimizer": cb.optimizer, "algorithm": cb.algorithm}))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_ckpt_diff_cli_reports_identical_tensors(good_ckpt, tmp_path):
    shutil.copy(good_ckpt, tmp_path / "copy.h5")  # (the CLI's entry point: tests/test_ckpt.py)
    assert ckpt_cli.main(["diff", str(good_ckpt), str(tmp_path / "copy.h5")]) == 0


@pytest.mark.parametrize("algo", [["--sync", "fsa", "--optimizer", "adam"]])
def test_resume_is_bitwise_identical(tmp_path, algo):
    # (A resumed run that equals the uninterrupted one also shows that runs are deterministic.)
    # HFA's bitwise resumes: plain (after a SIGTERM and a rewind) in test_reliability_mpi.py,
    # adaptive and streaming below.
    full, part = tmp_path / "full", tmp_path / "part"
    _, _, res = train_seq(
        9,
        tmp_path,
        (["--steps", 8, "--checkpoint-dir", part, *algo], {}),
        (["--steps", 16, "--checkpoint-dir", full, *algo], {}),
        (["--steps", 16, "--checkpoint-dir", part, "--resume", "latest", *algo], {}),
    )
    assert "geompi: resumed from" in res.stderr and "at step 8" in res.stderr
    a, b = full / "ckpt-00000016.h5", part / "ckpt-00000016.h5"
    assert identical(a, b)
    ca, cb = ckpt.load(a), ckpt.load(b)
    assert ca.optimizer.keys() == cb.optimizer.keys()
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(ca.optimizer)
    assert not identical(a, part / "ckpt-00000008.h5")  # the comparison can fail


def test_adaptive_sync_checkpoints_its_k2_and_resumes_exactly(tmp_path):
    """--adaptive-sync in the CLI (issue 14, point 4): under a 100 ms emulated WAN, K2 goes
    from 1 to --k2-max 3 at the first global average (one metrics line), the checkpoint rounds
    (every 10 steps) and the last are made global, and each checkpoint holds K2. A SIGTERM
    after step 13 stops at round 14 and rewinds to step 10; the resume starts from K2 = 3 (from
    1 it would go global at step 12) and ends bitwise where an uninterrupted run ends."""
    hfa = ["--sync", "hfa", "--adaptive-sync", "--k1", 2, "--k2", 1, "--k2-max", 3]
    hfa += ["--wan-latency", "100ms"]
    hfa += ["--dc-sizes", "4,2", "--momentum", 0.9, "--steps", 20, "--checkpoint-every", 10]
    full, part, again = tmp_path / "full", tmp_path / "part", tmp_path / "again"
    # (the resume writes to its own directory: part keeps what the stopped run left)
    stopped, res, resumed = train_seq(
        7,
        tmp_path,
        ([*hfa, "--checkpoint-dir", part], {**HOOKS, "GEOMPI_FAULT_SIGNAL_AT": "13:1"}),
        ([*hfa, "--checkpoint-dir", full, "--metrics", tmp_path / "m.jsonl"], {}),
        ([*hfa, "--checkpoint-dir", again, "--resume", part / ckpt.checkpoint_name(10)], {}),
    )
    assert "k2=3" in res.stderr, res.stderr[-3000:]
    records = read_jsonl(tmp_path / "m.jsonl")
    changes = [r for r in records if r.get("event") == "k2"]
    assert [(c["step"], c["old_k2"], c["new_k2"]) for c in changes] == [(2, 1, 3)], changes
    summary = records[-1]
    # global at 2 (K2 1), 8 (K2 3), 10 (a checkpoint), 16, 20 (the last)
    assert (summary["k2"], summary["k2_changes"], summary["global_syncs"]) == (3, 1, 5)
    for step in (10, 20):
        strategy = ckpt.load(full / ckpt.checkpoint_name(step)).algorithm["strategy"]
        assert strategy["k2"] == 3 and strategy["steps"] == step, strategy
    res = stopped
    assert res.returncode == 0 and not error_lines(res.stderr), res.stderr[-3000:]
    assert "at step 10 (stopped at step 14, between global syncs" in res.stderr, res.stderr[-3000:]
    assert [p.name for p in ckpt.list_checkpoints(part)] == [ckpt.checkpoint_name(10)]
    assert identical(part / ckpt.checkpoint_name(10), full / ckpt.checkpoint_name(10))
    res = resumed
    assert "at step 10" in res.stderr and "steps=20" in res.stderr, res.stderr[-3000:]
    name = ckpt.checkpoint_name(20)
    assert identical(again / name, full / name)
    assert len(ckpt.load(again / name).algorithm["hfa"]["local"]) == 4  # each worker's momentum
    assert not identical(again / name, part / ckpt.checkpoint_name(10))


ADAPTIVE = ["--adaptive-sync", "--k2-min", 2, "--k2-max", 3, "--wan-latency", "100ms"]


@pytest.mark.parametrize("cadence", [[], ADAPTIVE], ids=["fixed", "adaptive"])
def test_streaming_hfa_checkpoints_and_resumes_exactly(tmp_path, cadence):
    """Streaming HFA (2 fragments, overlap, outer Nesterov) checkpoints: the checkpoint rounds
    (every 8 steps) and the last are made global, so a resume from step 8 ends bitwise where
    an uninterrupted run ends. A SIGTERM after step 11 stops at round 12, which is then made
    global and checkpointed (streaming has no earlier round with one global model). With
    --adaptive-sync under a 100 ms WAN, K2 goes from 2 to 3 after the first cycle (step 4),
    the checkpoints hold it and the resume goes on with it."""
    hfa = ["--sync", "hfa", "--k1", 2, "--k2", 2, "--hfa-fragments", 2, "--hfa-overlap"]
    hfa += ["--hfa-mix", 0.5, "--outer-optimizer", "nesterov", "--outer-lr", 0.7]
    hfa += ["--dc-sizes", "4,2", "--momentum", 0.9, "--steps", 16, "--checkpoint-every", 8]
    hfa += ["--bucket-mb", 0.01, *cadence]  # buckets of 10 kB: each fragment has keys
    full, part, resumed = tmp_path / "full", tmp_path / "part", tmp_path / "resumed"
    stopped, _, res_resumed = train_seq(
        7,
        tmp_path,
        ([*hfa, "--checkpoint-dir", part], {**HOOKS, "GEOMPI_FAULT_SIGNAL_AT": "11:1"}),
        ([*hfa, "--checkpoint-dir", full, "--metrics", tmp_path / "m.jsonl"], {}),
        ([*hfa, "--checkpoint-dir", resumed, "--resume", part / ckpt.checkpoint_name(8)], {}),
    )
    if cadence:
        records = read_jsonl(tmp_path / "m.jsonl")
        changes = [(r["step"], r["old_k2"], r["new_k2"]) for r in records if r.get("event") == "k2"]
        assert changes == [(4, 2, 3)], changes
        assert records[-1]["k2"] == 3
        for step in (8, 16):
            assert ckpt.load(full / ckpt.checkpoint_name(step)).algorithm["strategy"]["k2"] == 3
    res = stopped
    assert res.returncode == 0 and not error_lines(res.stderr), res.stderr[-3000:]
    assert "at step 12; checkpoint written" in res.stderr, res.stderr[-3000:]
    assert [p.name for p in ckpt.list_checkpoints(part)] == [
        ckpt.checkpoint_name(8), ckpt.checkpoint_name(12)
    ]  # fmt: skip
    assert identical(part / ckpt.checkpoint_name(8), full / ckpt.checkpoint_name(8))
    res = res_resumed
    assert "at step 8" in res.stderr and "steps=16" in res.stderr, res.stderr[-3000:]
    name = ckpt.checkpoint_name(16)
    assert identical(resumed / name, full / name)
    assert not identical(full / name, full / ckpt.checkpoint_name(8))


def test_resume_onto_another_topology_reshards(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    # 9 ranks -> 2 datacenters and 2 global servers; no further steps: the state written back
    # after re-sharding must be the state that was read
    read = src / "ckpt-00000006.h5"
    reshard = ["--dc-sizes", "3,4", "--global-servers", "2"]
    _, res = train_seq(
        9,
        tmp_path,
        (["--steps", 6, "--checkpoint-dir", src, "--optimizer", "adam"], {}),
        (
            [
                "--steps",
                6,
                "--checkpoint-dir",
                dst,
                "--resume",
                read,
                *reshard,
                "--optimizer",
                "adam",
            ],
            {},
        ),
    )
    assert "re-sharded" in res.stderr
    assert [p.name for p in ckpt.list_checkpoints(src)] == [read.name]  # the input, unchanged
    assert identical(read, dst / "ckpt-00000006.h5")


def _nbytes(*trees) -> int:
    return sum(t.numel() * t.element_size() for tree in trees for _, t in _leaves(tree))


def test_checkpoint_state_messages_are_counted(tmp_path):
    """The snapshot a global server sends the master and the state the master sends back on a
    resume are WAN control bytes: in wan_bytes and global_in_bytes, never in wan_data_bytes."""
    args = ["--optimizer", "adam", "--dc-sizes", "4", "--global-servers", "1"]
    plain, saved, resumed = (tmp_path / f"{r}.jsonl" for r in ("plain", "saved", "resumed"))
    d = tmp_path / "ck"
    train_seq(
        5,
        tmp_path,
        (["--steps", 4, *args, "--metrics", saved, "--checkpoint-dir", d], {}),
        (["--steps", 4, *args, "--metrics", plain], {}),
        (
            [
                "--steps",
                8,
                *args,
                "--metrics",
                resumed,
                "--checkpoint-dir",
                d,
                "--resume",
                "latest",
            ],
            {},
        ),
    )
    a, b, c = (read_jsonl(m)[-1] for m in (plain, saved, resumed))
    ck = ckpt.load(d / "ckpt-00000004.h5")
    # The SAVE round adds its header (sent by the local server, received by the global server)
    # and the snapshot (sent by the global server to the master worker, a worker: not in
    # global_in_bytes): the values and the optimizer state, plus the message's JSON header.
    snapshot = (b["wan_bytes"] - a["wan_bytes"]) - (b["global_in_bytes"] - a["global_in_bytes"])
    payload = _nbytes(ck.model, ck.optimizer)
    assert payload < snapshot < payload + 4096, (snapshot, payload)
    assert b["wan_data_bytes"] == a["wan_data_bytes"]
    # The same rounds as the saved run (INIT, 4 steps, SAVE), and the restored optimizer state
    # (every tensor of it; the values come in the INIT round) that reached the global server.
    restore = c["global_in_bytes"] - b["global_in_bytes"]
    payload = _nbytes(ck.optimizer)
    assert payload < restore < payload + 4096, (restore, payload)
    assert c["wan_data_bytes"] == b["wan_data_bytes"]


def test_mixedsync_dcasgd_resumes_and_reaches_accuracy(tmp_path):
    """The default 16-rank job with GeoMX's flags for MixedSync + DCASGD, datacenter 1 slowed
    3x and bounded staleness: checkpointed at step 80, resumed, and trained to 210 steps."""
    d = tmp_path / "ck"
    args = ["--mixed-sync", "--dcasgd", "--dc-slowdown", "1:3", "--max-staleness", "8"]
    args += ["--model", "cnn", "--batch-size", "16"]
    metrics = tmp_path / "m.jsonl"
    _, res = train_seq(
        16,
        tmp_path,
        ([*args, "--steps", 80, "--checkpoint-dir", d], {}),
        (
            [
                *args,
                "--steps",
                210,
                "--checkpoint-dir",
                d,
                "--resume",
                "latest",
                "--metrics",
                metrics,
            ],
            {},
        ),
        timeout=240,
    )
    assert "at step 80" in res.stderr
    start, summary = read_jsonl(metrics)[0], read_jsonl(metrics)[-1]
    assert summary["sync"] == "mixed"
    assert start["config"]["optimizer"] == "dcasgd"  # not GeoMX's silent Adam
    assert summary["test_acc"] >= 0.93
    assert summary["max_staleness_seen"] >= 1  # the tiers really were asynchronous
    assert summary["staleness_updates"] == sum(summary["dc_updates"])
    assert sum(summary["staleness_histogram"].values()) == sum(summary["dc_updates"])


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    train(4, "--steps", 3, "--checkpoint-dir", d)
    return d / "ckpt-00000003.h5"


def _flip_byte(path):
    with h5py.File(path, "r") as f:
        ds = f["model"][sorted(f["model"])[0]]
        off = ds.id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(off + 3)
        b = fh.read(1)
        fh.seek(off + 3)
        fh.write(bytes([b[0] ^ 0xFF]))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bump_version(path):
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 99


DAMAGES = {"_flip_byte": _flip_byte, "_truncate": _truncate, "_bump_version": _bump_version}


def _far_positions(good_ckpt, path):
    """A file that verifies but puts the last worker past its epoch's end."""
    ck = ckpt.load(good_ckpt)
    positions = ck.progress["data_positions"].clone()
    positions[-1] = torch.tensor([0, 10**6])
    ckpt.save(
        path,
        model=ck.model,
        optimizer=ck.optimizer,
        optimizer_attrs=ck.optimizer_attrs,
        algorithm=ck.algorithm,
        progress={**ck.progress, "data_positions": positions},
        step=ck.step,
        epoch=ck.epoch,
        algorithm_name=ck.algorithm_name,
        topology=ck.attrs["topology"],
        config=ck.attrs["config"],
    )
    return len(positions) - 1


@pytest.fixture(scope="module")
def refused(tmp_path_factory, good_ckpt):
    """The refused resumes below, one after another in ONE 4-rank mpirun job (each is refused
    at start-up, where every rank leaves by SystemExit(2): tests.mpirun.train_runs); each test
    asserts on its own run. (A position beyond an epoch is found in training, where the job
    aborts: that test has its own job.) Maps a case to (its run, its directory, the bytes of
    its file as they were before the job)."""
    root = tmp_path_factory.mktemp("refused")
    cases, runs = {}, []
    for name, damage in DAMAGES.items():
        d = root / name
        d.mkdir()
        bad = d / "bad.h5"
        shutil.copy(good_ckpt, bad)
        damage(bad)
        cases[name] = (d, bad.read_bytes())
        runs.append((BASE[2:] + ["--steps", 6, "--checkpoint-dir", d / "out", "--resume", bad], {}))
    cases["other_model"] = (root, b"")
    runs.append((["--model", "cnn", "--steps", 3, "--resume", good_ckpt], {}))
    d = root / "unwritable"
    d.mkdir()
    (d / "file").write_text("not a directory")
    cases["unwritable"] = (d, b"")
    runs.append((BASE[2:] + ["--steps", 3, "--checkpoint-dir", d / "file" / "ck"], {}))
    done = train_runs(4, runs, root / "runs", timeout=60 * len(runs), check=False)
    return {name: (res, *case) for (name, case), res in zip(cases.items(), done)}


@pytest.mark.parametrize(
    "damage,words",
    [
        ("_flip_byte", ["checksum"]),
        ("_truncate", ["truncated"]),
        ("_bump_version", ["format_version 99", "upgrade geompi"]),
    ],
)
def test_bad_checkpoint_is_refused_on_resume(refused, damage, words):
    res, d, before = refused[damage]
    bad = d / "bad.h5"
    errs = error_lines(res.stderr)
    assert res.returncode != 0 and len(errs) == 1 and "Traceback" not in res.stderr, res.stderr
    assert all(w in errs[0] for w in words), errs[0]
    assert bad.read_bytes() == before  # nothing overwritten
    assert not list((d / "out").glob("ckpt-*.h5"))  # and no run started
    assert ckpt_cli.main(["verify", str(bad)]) == 1


def test_a_data_position_beyond_an_epoch_stops_every_rank_in_one_line(tmp_path, good_ckpt):
    """A file that verifies but puts a worker past its epoch's end (a hand-edited or foreign
    file): the workers learn it only as they take their positions, after start-up, so they
    stop together and the master names the file; it used to be that worker's own line, which
    did not say which file."""
    bad = tmp_path / "far.h5"
    worker = _far_positions(good_ckpt, bad)
    res = train(4, "--steps", 6, "--resume", bad, check=False, timeout=60)
    errs = error_lines(res.stderr)
    assert res.returncode != 0 and len(errs) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"checkpoint {bad}: worker {worker}'s loader state epoch=0 position=1000000" in errs[0]
    assert "resume with the same --batch-size" in errs[0], errs[0]


def test_checkpoint_of_another_model_is_refused(refused):
    res, _, _ = refused["other_model"]
    errs = error_lines(res.stderr)
    assert res.returncode != 0 and len(errs) == 1, res.stderr
    assert "different model" in errs[0]


def test_unwritable_checkpoint_dir(refused):
    res, _, _ = refused["unwritable"]
    errs = error_lines(res.stderr)
    assert res.returncode != 0 and len(errs) == 1, res.stderr
    assert "cannot write checkpoint" in errs[0] and "--checkpoint-dir" in errs[0]
