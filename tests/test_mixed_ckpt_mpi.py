"""Checkpoint fidelity (issue #12, defects 7 and 10): MixedSync checkpoints are one version
across shards and hold every datacenter's own progress, its last one follows the final model,
the update counter survives a resume; with compression the returned model is the global one."""

import pytest
import torch

from geompi import ckpt
from tests.mpirun import error_lines, mpirun, prog, read_jsonl

pytestmark = pytest.mark.mpi

# 9 ranks: datacenters of 3 and 4 ranks (2 + 3 workers), 2 global servers (every key split)
MIXED = ["--sync", "mixed", "--dc-sizes", "3,4", "--global-servers", "2", "--batch-size", "12"]
# parameters start at 0; SGD lr 1: every element is -(n0 + 1024 * n1) (tests/progs/train_api.py)
CONST = ["--const-grad", "--model", "mlp", "--optimizer", "sgd", "--lr", "1", "--momentum", "0"]
QUIET = ["--progress-every", "1e9"]


def run_api(out, *args, n=9, timeout=180, check=True):
    return mpirun(
        n, [prog("train_api.py"), str(out), *map(str, args)], timeout=timeout, check=check
    )


def decode(model: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(n0, n1): the deposits of datacenter 0 and 1 a const-grad model holds. Every element
    must say the same; elements that differ are shards of different versions."""
    flat = torch.cat([t.reshape(-1) for t in model.values()]).to(torch.float64)
    values = sorted(set(flat.tolist()))
    assert len(values) == 1, f"torn: the shards hold {values}"
    total = int(-values[0])
    return total % 1024, total // 1024


def dc_steps(ck) -> tuple[set, set]:
    """The steps the checkpoint records for the workers of datacenter 0 and 1 (2 + 3)."""
    steps = ck.progress["steps"].tolist()
    return set(steps[:2]), set(steps[2:])


def test_every_mixedsync_checkpoint_is_one_version_across_shards(tmp_path):
    d, steps = tmp_path / "ck", 40
    run_api(
        tmp_path, *CONST, *MIXED, *QUIET, "--steps", steps, "--checkpoint-dir", d,
        "--checkpoint-every", 1, "--keep", 1000, "--wan-bandwidth", "2MB",
    )  # fmt: skip
    files = ckpt.list_checkpoints(d)
    assert len(files) == steps
    cks, torn = [ckpt.load(f) for f in files], []
    for f, ck in zip(files, cks):
        try:
            decode(ck.model)
        except AssertionError as e:
            torn.append(f"{f.name}: {e}")
    assert not torn, f"{len(torn)} of {len(files)} checkpoints torn: {torn[:3]}"
    behind = 0
    for f, ck in zip(files, cks):
        n0, n1 = decode(ck.model)
        assert n0 == ck.step, (f.name, n0, n1)  # datacenter 0 waits for its checkpoints
        assert dc_steps(ck) == ({n0}, {n1}), f.name  # each datacenter's own step
        behind += n1 != n0
    assert behind, "datacenter 1 was never behind: the test did not exercise concurrency"
    # the last checkpoint comes after every datacenter finished: it is the final model
    last = ckpt.load(files[-1])
    assert decode(last.model) == (steps, steps)
    final = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(final[k], v) for k, v in last.model.items())


def test_mixedsync_resume_continues_each_datacenter_and_the_update_count(tmp_path):
    d = tmp_path / "ck"
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = [*CONST, *MIXED, *QUIET, "--checkpoint-dir", d, "--keep", 100]
    run_api(
        tmp_path, *common, "--steps", 12, "--checkpoint-every", 4, "--dc-slowdown", "1:3",
        "--metrics", first,
    )  # fmt: skip
    mid = d / "ckpt-00000008.h5"
    n0, n1 = decode(ckpt.load(mid).model)
    assert n0 == 8 and n1 < 8, (n0, n1)  # datacenter 1 was behind at that checkpoint
    res = run_api(
        tmp_path, *common, "--steps", 16, "--resume", mid, "--metrics", second,
    )  # fmt: skip
    # every datacenter made exactly 16 deposits in all: datacenter 1 went on from n1, not 8
    assert decode(torch.load(tmp_path / "final.pt")) == (16, 16)
    assert f"each datacenter at its own step: dc0 8, dc1 {n1}" in res.stderr, res.stderr
    a, b = read_jsonl(first)[-1], read_jsonl(second)[-1]
    keys = a["global_updates"] // sum(a["dc_updates"])  # per deposit, one update per key
    assert a["global_updates"] == keys * 24
    assert b["dc_updates"] == [8, 16 - n1]
    assert b["global_updates"] == keys * 32  # restored from the checkpoint, not global_syncs


@pytest.mark.parametrize(
    "algo",
    [
        ["--sync", "fsa"],
        ["--sync", "hfa", "--k1", "2", "--k2", "2"],
        [*MIXED, "--dc-slowdown", "1:3"],  # datacenter 1 still trains at datacenter 0's end
    ],
    ids=["fsa", "hfa", "mixed"],
)
def test_compressed_run_returns_the_global_model_of_its_last_checkpoint(tmp_path, algo):
    d = tmp_path / "ck"
    run_api(
        tmp_path, *algo, *QUIET, "--model", "mlp", "--batch-size", "12", "--steps", 8,
        "--wan-compression", "topk:0.1", "--checkpoint-dir", d,
    )  # fmt: skip
    last = ckpt.load(ckpt.latest(d))
    assert last.step == 8
    final = torch.load(tmp_path / "final.pt")
    assert final.keys() == last.model.keys()
    diff = {k: float((final[k] - v).abs().max()) for k, v in last.model.items()}
    assert all(v == 0 for v in diff.values()), diff


def test_resume_with_lossy_compression_is_refused_in_one_line(tmp_path):
    d = tmp_path / "ck"
    args = [*QUIET, "--model", "mlp", "--batch-size", "12", "--checkpoint-dir", d]
    run_api(tmp_path, *args, "--steps", 3, "--wan-compression", "topk:0.1", n=4)
    res = run_api(
        tmp_path, *args, "--steps", 6, "--wan-compression", "topk:0.1", "--resume", "latest",
        n=4, check=False, timeout=60,
    )  # fmt: skip
    errs = error_lines(res.stderr)
    assert res.returncode != 0 and len(errs) == 1, res.stderr
    assert "lossy --wan-compression topk:0.1" in errs[0] and "--wan-compression none" in errs[0]
    assert ckpt.latest(d).name == "ckpt-00000003.h5"  # no run started
