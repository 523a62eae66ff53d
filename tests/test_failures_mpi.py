"""--on-failure continue: ranks SIGKILLed mid-run under MPI fault tolerance (ULFM); the
survivors finish with exit 0, equal to an independent simulation that drops the lost
datacenter at that step."""

import json

import h5py
import pytest
import torch

from geompi.ckpt import cli as ckpt_cli
from tests.mpirun import HOOKS, ULFM, ULFM_ENV, error_lines, mpirun, prog, read_jsonl
from tests.reference import max_abs_diff

pytestmark = pytest.mark.mpi

LOST_AT = 4  # a global average (K1 = K2 = 2): no survivor can finish it before the loss


DC2 = [3, 4]  # the worker indices of datacenter 2 (ranks 5 and 6)


def reference(
    lost: tuple[list[int], int] | None = (DC2, LOST_AT), steps: int = 12, **kw
) -> dict[str, torch.Tensor]:
    """The HFA run of tests/progs/dc_lost.py, simulated: datacenters of 2, 1 and 2 workers,
    momentum 0.9, outer Nesterov 0.7; datacenter 2 is lost during the average at LOST_AT,
    which the others make global among themselves (``kw``: hfa_reference's, as
    ``left_after``)."""
    from geompi.models import build_model
    from tests.progs.api_common import hfa_reference
    from tests.reference import worker_loaders

    ds, loaders = worker_loaders("digits", 5, batch_size=7, seed=4)
    models = []
    for _ in range(5):
        torch.manual_seed(4)
        models.append(build_model("mlp", ds.input_shape, ds.num_classes))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    return hfa_reference(
        [2, 1, 2],
        k1=2,
        k2=2,
        steps=steps,
        models=models,
        opts=opts,
        batches=lambda w, t: loaders[w].next_batch(),
        outer_nesterov_lr=0.7,
        lost=lost,
        **kw,
    )[0]


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.mark.parametrize(
    "hook,killed,what",
    [
        ("GEOMPI_FAULT_KILL_AT", "7", "local server of datacenter 2"),
        ("GEOMPI_FAULT_KILL_MID", "7", "local server of datacenter 2"),
        ("GEOMPI_FAULT_KILL_AT", "5,6", "worker of datacenter 2"),
    ],
    ids=["local_server", "local_server_mid_round", "every_worker"],
)
def test_hfa_survives_a_lost_datacenter(tmp_path, expected, hook, killed, what):
    """Datacenter 2 is lost at step 4: its local server, or both its workers, SIGKILLed.
    ``mid_round``: its local server dies once its first key has reached the global servers,
    which have then applied that key (an outer Nesterov step) and must undo it. The job ends
    with exit 0 on the global model of the other two, which equals the simulation that drops
    datacenter 2 at that average (1e-5), and says so in one line."""
    env = {**ULFM_ENV, **HOOKS, hook: f"{LOST_AT}:{killed}"}
    res = mpirun(10, [prog("dc_lost.py"), "hfa", str(tmp_path)], 150, env=env, launcher=ULFM)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert len(lines) == 1, res.stderr
    assert f"at step {LOST_AT}" in lines[0] and what in lines[0], lines[0]
    assert "datacenter(s) 2 left the job" in lines[0]
    assert "going on with 2 datacenter(s), 3 worker(s), 7 rank(s)" in lines[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (failure,) = summary["failures"]
    assert failure["step"] == LOST_AT and failure["left_dcs"] == [2]
    assert failure["lost_ranks"] == [int(r) for r in killed.split(",")]
    assert summary["topology"]["dc_sizes"] == [3, 2]
    assert summary["steps"] == 12 and summary["global_syncs"] == 3  # at 4 (redone), 8, 12
    # batches of 7: 3 workers for 12 steps, datacenter 2's 2 for the 3 steps before the loss
    assert summary["samples"] == 7 * (3 * 12 + 2 * (LOST_AT - 1))
    got = torch.load(tmp_path / "model.pt")
    assert max_abs_diff(got, expected) <= 1e-5


def test_hfa_survives_a_lost_worker(tmp_path):
    """One of datacenter 2's two workers (rank 6) is lost at step 4: datacenter 2 goes on with
    the other; the final model equals the simulation that drops that worker there."""
    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_AT": f"{LOST_AT}:6"}
    res = mpirun(10, [prog("dc_lost.py"), "hfa", str(tmp_path)], 150, env=env, launcher=ULFM)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert "6 (worker of datacenter 2)" in line and "left the job" not in line
    assert "the data shard(s) of worker rank(s) 6 dropped" in line
    assert "going on with 3 datacenter(s), 4 worker(s), 9 rank(s)" in line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["topology"]["dc_sizes"] == [3, 2, 2]
    assert summary["samples"] == 7 * (4 * 12 + 1 * (LOST_AT - 1))
    got = torch.load(tmp_path / "model.pt")
    assert max_abs_diff(got, reference(lost=([4], LOST_AT))) <= 1e-5


def test_the_reference_tells_a_lost_datacenter_apart(expected):
    """The check above can fail: had datacenter 2 stayed, or left one average later, the
    model would differ by far more than its tolerance."""
    assert max_abs_diff(reference(lost=None), expected) > 1e-3
    assert max_abs_diff(reference(lost=(DC2, LOST_AT + 2)), expected) > 1e-3


def test_a_lost_datacenter_0_stops_the_job_in_one_line(tmp_path):
    """Datacenter 0 (the master worker's) cannot leave: one line from one rank, a non-zero
    exit, no hang."""
    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_AT": f"{LOST_AT}:2"}
    stops_in_one_line(tmp_path, "hfa", env, "datacenter 0 lost its local server", "so it stops")


def stops_in_one_line(tmp_path, sync: str, env: dict, says: str, ends: str) -> None:
    """tests/progs/dc_lost.py SYNC under ``env`` stops: one error line from one rank, which
    says ``says`` and ends ``ends; run it again``, a non-zero exit, no summary, no hang."""
    res = mpirun(
        10, [prog("dc_lost.py"), sync, str(tmp_path)], 120, env=env, launcher=ULFM, check=False
    )
    assert res.returncode != 0
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and says in lines[0], res.stderr
    assert lines[0].endswith(f"{ends}; run it again")
    assert not (tmp_path / "summary.json").exists()


def test_a_lost_global_server_stops_the_job_which_resumes_from_its_checkpoint(tmp_path):
    """A global server (its shard of the global model and outer optimizer state) is lost at
    step 8: one line that says to resume, a non-zero exit, no hang; the checkpoint of step 4
    is intact, and the job resumed from it on every rank trains to the end."""
    ck = tmp_path / "ck"
    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_AT": "8:8"}
    args = [prog("dc_lost.py"), "hfa", str(tmp_path), "12", str(ck)]
    res = mpirun(10, args, 120, env=env, launcher=ULFM, check=False)
    assert res.returncode != 0
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "global server rank(s) 8 lost" in lines[0], res.stderr
    assert lines[0].endswith(f"run it again with --resume latest (from {ck})")
    assert not (tmp_path / "summary.json").exists()
    assert [p.name for p in ck.iterdir()] == ["ckpt-00000004.h5"]

    args = [prog("dc_lost.py"), "hfa", str(tmp_path), "12", str(ck), "resume"]
    res = mpirun(10, args, 150, env=ULFM_ENV, launcher=ULFM)
    assert "at step 4" in res.stderr and "resumed from" in res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    got = torch.load(tmp_path / "model.pt")
    assert summary["steps"] == 12 and max_abs_diff(got, reference(lost=None)) <= 1e-5


@pytest.mark.parametrize(
    "sync, servers, at, rank",
    [("fsa-adam", 2, 6, 8), ("hfa", 3, 8, 9)],
    ids=["fsa-server-0-of-2", "hfa-server-1-of-3"],
)
def test_a_lost_global_server_is_taken_over_by_its_mirror(tmp_path, sync, servers, at, rank):
    """--global-replicas 2: a global server is killed at the start of a round (FSA: server 0
    of 2 at step 6, Adam on the servers; HFA: server 1 of 3 at step 8's global average, outer
    Nesterov). Its shard goes on from the mirror the next server kept; the master re-shards the
    tier over the servers left (HFA: 2, which mirror each other again, their mirrors restored
    too); exit 0, one line, and the final model equals the uninterrupted run's (independent
    simulations: large-batch Adam, and HFA's), to 1e-6."""
    dumps = tmp_path / "mirrors"
    dumps.mkdir()
    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_AT": f"{at}:{rank}", "TEST_GLOBAL_REPLICAS": "2",
           "TEST_GLOBAL_SERVERS": str(servers), "GEOMPI_TEST_MIRROR_DUMP": str(dumps)}  # fmt: skip
    n = 8 + servers
    res = mpirun(n, [prog("dc_lost.py"), sync, str(tmp_path)], 150, env=env, launcher=ULFM)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert f"{rank} (global server) at step {at}" in line, line
    assert f"the shard(s) of global server(s) {rank - 8} go on from their mirrors" in line, line
    assert f"re-sharded over {servers - 1} global server(s)" in line, line
    assert f"5 worker(s), {n - 1} rank(s)" in line, line
    summary = json.loads((tmp_path / "summary.json").read_text())
    (f,) = summary["failures"]
    assert (f["step"], f["lost_ranks"], f["left_dcs"], f["lost_workers"]) == (at, [rank], [], 0)
    assert f["topology"]["global_servers"] == servers - 1 and summary["steps"] == 12
    if servers - 1 > 1:  # the survivors' mirrors, restored at the takeover, kept exact since
        snaps = [torch.load(dumps / f"gs{g}-0.pt") for g in range(servers - 1)]
        for g, snap in enumerate(snaps):
            own = snaps[(g - 1) % (servers - 1)]["own"]
            assert snap["mirror"]["index"] == own["index"] and snap["mirror"]["outer"]
            for key, v in own["values"].items():
                assert torch.equal(snap["mirror"]["values"][key], v), (g, key)
            assert snap["mirror"]["outer"].keys() == own["outer"].keys()
            for key, st in own["outer"].items():
                for name, t in st.items():
                    assert torch.equal(snap["mirror"]["outer"][key][name], t), (g, key, name)
    adam = lambda p: torch.optim.Adam(p, lr=0.003)  # noqa: E731
    want = fsa_reference(lost=(), make_opt=adam) if sync == "fsa-adam" else reference(lost=None)
    assert max_abs_diff(torch.load(tmp_path / "model.pt"), want) <= 1e-6
    # a step record for every step: those whose average the loss cut off (the batch under way)
    # with rank 0's own values, the others over every worker
    recs = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert {r["workers"] for r in recs} <= {1, 5} and recs[-1]["workers"] == 5


def test_hfa_survives_a_loss_at_a_datacenter_round(tmp_path, expected):
    """Datacenter 2's local server is lost at step 2, a datacenter-only average: the others
    finish theirs and learn of the loss later, at their next wait (the world revoked by
    datacenter 2's workers). Exit 0, one line, the two datacenters train to the end. Where
    they notice at step 4's global average (every run here), datacenter 2's steps since step 2
    never reach anyone, so the model is the one of a loss at step 4."""
    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_AT": "2:7"}
    res = mpirun(10, [prog("dc_lost.py"), "hfa", str(tmp_path)], 150, env=env, launcher=ULFM)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert "7 (local server of datacenter 2)" in line and "datacenter(s) 2 left" in line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["topology"]["dc_sizes"] == [3, 2]
    noticed = summary["failures"][0]["step"]
    assert noticed in (2, 4)  # 2: at the stop agreement that follows step 2's average
    if noticed == 4:
        assert max_abs_diff(torch.load(tmp_path / "model.pt"), expected) <= 1e-5
    assert summary["test_acc"] > 0.3  # it trained on (10 classes: chance is 0.1)


def test_a_loss_during_a_checkpoint_writes_it_again_and_the_job_resumes_on_every_rank(tmp_path):
    """Checkpoints every 4 steps. Datacenter 2's local server is lost as the checkpoint of
    step 4 (after that step's global average) reaches it: the survivors write that checkpoint
    again in their topology, then those of 8 and 12; the final model equals the simulation in
    which datacenter 2 leaves after step 4's average (nothing is averaged twice). The job then
    resumes from step 12 on all 10 ranks (re-sharded onto 3 datacenters) and trains to 16."""
    ck = tmp_path / "ck"
    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_SAVE": f"{LOST_AT}:7"}
    args = [prog("dc_lost.py"), "hfa", str(tmp_path), "12", str(ck)]
    res = mpirun(10, args, 150, env=env, launcher=ULFM)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert f"7 (local server of datacenter 2) at step {LOST_AT}" in line, line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["global_syncs"] == 3  # none added by the loss
    assert summary["failures"][0]["step"] == LOST_AT
    assert sorted(p.name for p in ck.iterdir()) == [
        "ckpt-00000004.h5", "ckpt-00000008.h5", "ckpt-00000012.h5"
    ]  # fmt: skip
    with h5py.File(ck / "ckpt-00000004.h5") as f:  # written again, after the loss
        assert json.loads(f.attrs["topology"])["dc_sizes"] == [3, 2]
    got = torch.load(tmp_path / "model.pt")
    assert max_abs_diff(got, reference(lost=None, left_after=(DC2, LOST_AT))) <= 1e-5
    assert max_abs_diff(got, reference(lost=(DC2, LOST_AT))) > 1e-3  # the check can fail

    again = tmp_path / "again"
    again.mkdir()
    args = [prog("dc_lost.py"), "hfa", str(again), "16", str(ck), "resume"]
    res = mpirun(10, args, 150, env=ULFM_ENV, launcher=ULFM)
    assert "resumed from" in res.stderr and "at step 12" in res.stderr, res.stderr
    assert "[3, 2] + 2 global server(s) to [3, 2, 3]" in res.stderr
    resumed = json.loads((again / "summary.json").read_text())
    assert resumed["steps"] == 16 and "failures" not in resumed


def test_the_public_api_survives_a_lost_datacenter(tmp_path):
    """geompi.init(on_failure="continue") and a DistributedOptimizer with HFA around the
    user's model and SGD: datacenter 2's local server is lost at step 4's global average.
    Every surviving worker ends on the model of the independent simulation that drops
    datacenter 2 there, and its optimizer lists the loss."""
    from tests.progs.api_common import hfa_reference

    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_AT": f"{LOST_AT}:7"}
    res = mpirun(10, [prog("api_dc_lost.py"), str(tmp_path)], 150, env=env, launcher=ULFM)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert f"7 (local server of datacenter 2) at step {LOST_AT}" in line, line
    refs = hfa_reference([2, 1, 2], k1=2, k2=2, steps=12, outer_nesterov_lr=0.7,
                         lost=(DC2, LOST_AT))  # fmt: skip
    for w in range(3):
        assert max_abs_diff(torch.load(tmp_path / f"w{w}.pt"), refs[w]) <= 1e-5, w
        record = json.loads((tmp_path / f"w{w}.json").read_text())
        (failure,) = record["failures"]
        assert failure["step"] == LOST_AT and failure["left_dcs"] == [2]
        assert record["global_syncs"] == 3
    assert not (tmp_path / "w3.pt").exists()  # datacenter 2's workers left with status 0
    assert max_abs_diff(torch.load(tmp_path / "w0.pt"), hfa_reference(
        [2, 1, 2], k1=2, k2=2, steps=12, outer_nesterov_lr=0.7)[0]) > 1e-3  # fmt: skip


# The two losses of FSA's runs (tests/progs/dc_lost.py fsa, api_dc_lost.py fsa): datacenter
# 2's local server (rank 7) once its first key of step 4 has reached the global servers (which
# applied it: an SGD momentum step to undo); then at step 9 worker rank 1, while rank 0 (the
# master, same datacenter) paused before step 8's results reached it: those it takes from a
# worker they did reach.
FSA_LOSSES = {
    **HOOKS,
    "GEOMPI_FAULT_KILL_MID": "4:7",
    "GEOMPI_FAULT_SLOW_PULL": "8:0",
    "GEOMPI_FAULT_KILL_AT": "9:1",
}


def fsa_reference(lost=(([3, 4], 4), ([1], 9)), make_opt=None) -> dict[str, torch.Tensor]:
    """``tests/progs/dc_lost.py fsa`` simulated: SGD with momentum 0.9 (or ``make_opt``'s) on
    the concatenated batches of the workers not yet lost at each step (``lost``: (worker
    indices, first step without))."""
    from tests.reference import large_batch_sgd

    def active(t: int) -> list[int]:
        return [w for w in range(5) if not any(w in ws and t >= at for ws, at in lost)]

    return large_batch_sgd(
        dataset="digits", model="mlp", workers=5, batch_size=7, seed=4, steps=12,
        make_opt=make_opt or (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        active=active,
    )  # fmt: skip


def test_fsa_survives_a_lost_datacenter_then_a_lost_worker(tmp_path):
    """FSA (2 global servers stepping SGD with momentum) loses datacenter 2 mid-round at step
    4, then a worker of datacenter 0 at step 9 while the master lacked step 8's results. The
    job ends with exit 0 on the model of large-batch SGD over the surviving workers' batches
    (1e-5), says each loss in one line, and counts the lost workers' samples."""
    env = {**ULFM_ENV, **FSA_LOSSES}
    res = mpirun(10, [prog("dc_lost.py"), "fsa", str(tmp_path)], 180, env=env, launcher=ULFM)
    first, second = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert "7 (local server of datacenter 2) at step 4" in first, first
    assert "datacenter(s) 2 left" in first and "2 datacenter(s), 3 worker(s), 7 rank(s)" in first
    assert "1 (worker of datacenter 0) at step 9" in second, second
    assert "the data shard(s) of worker rank(s) 1 dropped" in second
    assert "going on with 2 datacenter(s), 2 worker(s), 6 rank(s)" in second
    summary = json.loads((tmp_path / "summary.json").read_text())
    f1, f2 = summary["failures"]
    assert (f1["step"], f1["lost_ranks"], f1["left_dcs"], f1["lost_workers"]) == (4, [7], [2], 2)
    assert (f2["step"], f2["lost_ranks"], f2["left_dcs"], f2["lost_workers"]) == (9, [1], [], 1)
    assert f2["results_from_peer"] and not f1["results_from_peer"]
    assert summary["steps"] == 12 and summary["global_syncs"] == 12
    assert summary["samples"] == 7 * (5 * 3 + 3 * 5 + 2 * 4)
    assert max_abs_diff(torch.load(tmp_path / "model.pt"), fsa_reference()) <= 1e-5


def test_the_fsa_reference_tells_each_loss_apart():
    """The check above can fail: without either loss, or with a loss one step off, the model
    differs by far more than its tolerance."""
    expected = fsa_reference()
    for lost in [(([1], 9),), (([3, 4], 4),), (([3, 4], 5), ([1], 9)), (([3, 4], 4), ([1], 8))]:
        assert max_abs_diff(fsa_reference(lost), expected) > 1e-4, lost


def api_fsa_reference(lost=(([3, 4], 4), ([1], 9))) -> dict[str, torch.Tensor]:
    """``tests/progs/api_dc_lost.py OUT fsa`` simulated: one model, Adam on the sample-weighted
    loss over the batches of the workers not yet lost at each step (``lost`` as
    fsa_reference's)."""
    from tests.progs.api_common import batch, make_model, use_extra

    model = make_model(seed=1)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    for t in range(12):
        ws = [w for w in range(5) if not any(w in gone and t + 1 >= at for gone, at in lost)]
        adam.zero_grad()
        total = 0
        loss = 0.0
        for w in ws:
            x, y = batch(w, t)
            loss = loss + loss_fn(model(x, use_extra(w, t)), y)
            total += len(y)
        (loss / total).backward()
        adam.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_public_api_survives_fsa_losses(tmp_path):
    """geompi.init(on_failure="continue", global_replicas=2) and FSA with the user's Adam on
    the workers: the same two losses as the CLI's (datacenter 2 mid-round at step 4; worker
    rank 1 at step 9, as it begins its round, while the master lacked step 8's global
    gradient) and between them global server 0 (rank 8) at step 6, whose shard its mirror
    takes over. Every surviving worker ends on the model of the independent simulation
    (1e-5), which the two lost datacenter and worker change and the lost server does not."""
    env = {**ULFM_ENV, **FSA_LOSSES, "GEOMPI_FAULT_KILL_AT": "9:1;6:8", "TEST_GLOBAL_REPLICAS": "2"}
    res = mpirun(10, [prog("api_dc_lost.py"), str(tmp_path), "fsa"], 180, env=env, launcher=ULFM)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert len(lines) == 3, res.stderr
    assert "8 (global server) at step 6; the shard(s) of global server(s) 0 go on" in lines[1]
    expected = api_fsa_reference()
    for w in (0, 2):  # worker indices 0 and 2 (ranks 0 and 3) survive
        assert max_abs_diff(torch.load(tmp_path / f"w{w}.pt"), expected) <= 1e-5, w
        record = json.loads((tmp_path / f"w{w}.json").read_text())
        assert [f["step"] for f in record["failures"]] == [4, 6, 9]
        assert [f["topology"]["global_servers"] for f in record["failures"]] == [2, 1, 1]
        assert record["global_syncs"] == 12
    master = json.loads((tmp_path / "w0.json").read_text())
    assert master["failures"][2]["results_from_peer"]
    assert not (tmp_path / "w1.pt").exists() and not (tmp_path / "w3.pt").exists()
    assert max_abs_diff(api_fsa_reference(lost=()), expected) > 1e-4


MIXED_LOSSES = {  # (rank 4: local server of datacenter 1; rank 6: a worker of datacenter 2)
    **HOOKS,
    "GEOMPI_FAULT_KILL_MID": "4:4",  # lost once it has deposited its step-4 round
    "GEOMPI_FAULT_KILL_AT": "8:6",  # lost as it begins step 8
}


def mixed_alive(d: int, k: int, drop_worker: bool = True) -> list[int]:
    """The workers (indices) whose batches make datacenter d's k-th deposit in that run."""
    return {0: [0, 1], 1: [2], 2: [3] if drop_worker and k >= 8 else [3, 4]}[d]


def mixed_replay(logs: list[dict], lam: float = 2.0, drop_worker: bool = True):
    """``tests/progs/dc_lost.py mixed`` replayed in one process from each global server's logged
    deposit order (GEOMPI_TEST_DEPOSIT_LOG), written without geompi's servers: DCASGD (lr 0.1,
    ``lam``) on each owner's elements; the k-th deposit of datacenter d (numbered as launched)
    is the sample-weighted mean gradient of its workers' k-th batches at the parameters its
    (k-1)-th deposit fetched from every owner. Returns the final state_dict."""
    from geompi.comm.buckets import Buckets
    from geompi.models import build_model
    from tests.reference import worker_loaders

    ds, loaders = worker_loaders("digits", 5, batch_size=7, seed=4)
    batches = [[loader.next_batch() for _ in range(12)] for loader in loaders]
    torch.manual_seed(4)
    model = build_model("mlp", ds.input_shape, ds.num_classes)
    buckets = Buckets(list(model.named_parameters()), int(0.03 * 2**20))  # dc_lost.py's keys
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    v0 = flat([b.params for b in buckets.buckets]).clone()
    starts = [0]
    for b in buckets.buckets:
        starts.append(starts[-1] + b.numel)
    owned = []  # per owner: which elements of the flat vector it holds
    for log in logs:
        mask = torch.zeros_like(v0, dtype=torch.bool)
        for b in buckets.buckets:
            lo, hi = log["bounds"][str(b.key)]
            mask[starts[b.key] + lo : starts[b.key] + hi] = True
        owned.append(mask)
    assert bool((owned[0] ^ owned[1]).all())  # each element has one owner

    def gradient(d: int, held: torch.Tensor, k: int) -> torch.Tensor:
        with torch.no_grad():
            for b in buckets.buckets:
                b.params.copy_(held[starts[b.key] : starts[b.key + 1]])
        total, n = torch.zeros_like(v0), 0
        for w in mixed_alive(d, k, drop_worker):
            x, y = batches[w][k - 1]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            total += flat([m.param.grad for b in buckets.buckets for m in b.members]) * len(y)
            n += len(y)
        return total / n

    weights = [log_w.clone() for log_w in [v0] * len(logs)]
    backup = [{d: v0.clone() for d in range(3)} for _ in logs]
    results: dict[tuple[int, int, int], torch.Tensor] = {}
    done = [{d: 0 for d in range(3)} for _ in logs]
    pos = [0] * len(logs)
    while any(p < len(log["deposits"]) for p, log in zip(pos, logs)):
        moved = False
        for g, log in enumerate(logs):
            if pos[g] == len(log["deposits"]):
                continue
            d = log["deposits"][pos[g]]["dc"]
            k = done[g][d] + 1
            if k > 1 and not all((h, d, k - 1) in results for h in range(len(logs))):
                continue  # that datacenter's previous results are not complete yet
            held = v0
            if k > 1:
                held = torch.where(owned[0], results[(0, d, k - 1)], results[(1, d, k - 1)])
            grad, w = gradient(d, held, k), weights[g]
            step = grad + lam * grad * grad * (w - backup[g][d])
            w.add_(step, alpha=-0.1)
            backup[g][d] = w.clone()
            results[(g, d, k)] = w.clone()
            done[g][d], pos[g], moved = k, pos[g] + 1, True
        assert moved, "the logged orders contradict each other"
    final = torch.where(owned[0], weights[0], weights[1])
    with torch.no_grad():
        for b in buckets.buckets:
            b.params.copy_(final[starts[b.key] : starts[b.key + 1]])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_mixedsync_survives_a_lost_local_server_then_a_lost_worker(tmp_path):
    """MixedSync (DCASGD on 2 global servers) loses the local server of datacenter 1 right
    after it deposited its step-4 round, then a worker of datacenter 2 (renumbered 1 by then)
    at step 8. The job ends with exit 0; each loss is one line naming the ranks as launched;
    every deposit made is applied exactly once (the lost datacenter's last one included, the
    round the survivors redo not twice); and the final model equals a one-process replay of
    the logged deposit order (1e-5), whose per-datacenter DCASGD backups the renumbering
    must keep apart."""
    env = {**ULFM_ENV, **MIXED_LOSSES, "GEOMPI_TEST_DEPOSIT_LOG": str(tmp_path)}
    res = mpirun(10, [prog("dc_lost.py"), "mixed", str(tmp_path)], 180, env=env, launcher=ULFM)
    first, second = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert "lost rank(s) 4 (local server of datacenter 1) at step " in first, first
    assert " of datacenter 0; " in first  # the master's step: each datacenter is at its own
    assert "datacenter(s) 1 left the job with the round under way" in first
    assert "going on with 2 datacenter(s), 4 worker(s), 8 rank(s)" in first
    assert "lost rank(s) 6 (worker of datacenter 2) at step " in second, second
    assert "the data shard(s) of worker rank(s) 6 dropped" in second
    assert "going on with 2 datacenter(s), 3 worker(s), 7 rank(s)" in second
    summary = json.loads((tmp_path / "summary.json").read_text())
    f1, f2 = summary["failures"]
    assert (f1["lost_ranks"], f1["left_dcs"], f1["lost_workers"]) == ([4], [1], 1)
    assert (f2["lost_ranks"], f2["left_dcs"], f2["lost_workers"]) == ([6], [], 1)
    assert summary["steps"] == 12 and summary["topology"]["dc_sizes"] == [3, 2]
    logs = [json.loads((tmp_path / f"deposits-g{g}.json").read_text()) for g in (0, 1)]
    for log in logs:
        counts = [sum(e["dc"] == d for e in log["deposits"]) for d in range(3)]
        assert counts == [12, 4, 12], counts
    # what the model saw: datacenter 0's 2 workers, 1's one for 4 steps, 2's two for 7 then one
    assert summary["samples"] == summary["samples_applied"] == 7 * (2 * 12 + 4 + 2 * 7 + 5)
    assert max_abs_diff(torch.load(tmp_path / "model.pt"), mixed_replay(logs)) <= 1e-5
    # the check can fail: without the lost worker's drop, or DCASGD's backups, it misses
    assert max_abs_diff(mixed_replay(logs, drop_worker=False), mixed_replay(logs)) > 1e-4
    assert max_abs_diff(mixed_replay(logs, lam=0.0), mixed_replay(logs)) > 1e-4


def test_the_public_api_survives_a_lost_datacenter_under_mixedsync(tmp_path):
    """geompi.init(on_failure="continue") and MixedSync with the user's SGD (momentum, a new
    learning rate every step) on the global servers: the local server of datacenter 2 is lost
    at step 4. The survivors end with
    exit 0 on one final global model, each deposit made is applied once on both global servers
    (datacenter 2's 3 before the loss), and every survivor records the loss."""
    env = {
        **ULFM_ENV,
        **HOOKS,
        "GEOMPI_FAULT_KILL_AT": "4:7",
        "GEOMPI_TEST_DEPOSIT_LOG": str(tmp_path),
    }
    res = mpirun(10, [prog("api_dc_lost.py"), str(tmp_path), "mixed"], 180, env=env, launcher=ULFM)
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert "7 (local server of datacenter 2) at step " in line and "datacenter(s) 2 left" in line
    for g in (0, 1):
        log = json.loads((tmp_path / f"deposits-g{g}.json").read_text())
        counts = [sum(e["dc"] == d for e in log["deposits"]) for d in range(3)]
        assert counts == [12, 12, 3], counts
    final = torch.load(tmp_path / "w0.pt")
    for w in (0, 1, 2):
        assert max_abs_diff(torch.load(tmp_path / f"w{w}.pt"), final) == 0.0, w
        (failure,) = json.loads((tmp_path / f"w{w}.json").read_text())["failures"]
        assert failure["lost_ranks"] == [7] and failure["left_dcs"] == [2]
    assert not (tmp_path / "w3.pt").exists() and not (tmp_path / "w4.pt").exists()
    from tests.progs.api_common import make_model

    assert max_abs_diff(final, make_model(seed=1).state_dict()) > 1e-3  # it trained


def test_mixedsync_checkpoints_go_on_through_a_lost_datacenter(tmp_path):
    """Issue #35, 3: MixedSync (the CLI, checkpoints every 4 steps) loses the local server of
    datacenter 2 at step 4. The checkpoint after the loss counted its workers still, whose
    datacenter the global servers' cut no longer lists: IndexError, the job aborted. Now the
    job ends with exit 0 and every checkpoint after the loss verifies and holds the progress
    of the 3 surviving workers (datacenter 0's two at the checkpoint's step)."""
    ck = tmp_path / "ck"
    env = {**ULFM_ENV, **HOOKS, "GEOMPI_FAULT_KILL_AT": "4:7"}
    args = [prog("dc_lost.py"), "mixed", str(tmp_path), "12", str(ck)]
    res = mpirun(10, args, 180, env=env, launcher=ULFM, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("geompi: lost")]
    assert "7 (local server of datacenter 2) at step " in line and "datacenter(s) 2 left" in line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and len(summary["failures"]) == 1
    names = sorted(p.name for p in ck.iterdir())
    assert names[-2:] == ["ckpt-00000008.h5", "ckpt-00000012.h5"], names
    for name in names[-2:]:
        assert ckpt_cli.main(["verify", str(ck / name)]) == 0, name  # in this process
        with h5py.File(ck / name) as f:
            assert json.loads(f.attrs["topology"])["dc_sizes"] == [3, 2]
            steps = f["progress/steps"][()].tolist()
        step = int(name[5:13])
        assert len(steps) == 3 and steps[:2] == [step, step], (name, steps)


# Open MPI's heartbeat on its own thread, as make train and GEOMPI_FT=1 launch --on-failure continue
HEARTBEAT = {
    "OMPI_MCA_mpi_ft_detector": "true",
    "OMPI_MCA_mpi_ft_detector_thread": "true",
    "OMPI_MCA_mpi_ft_detector_timeout": "5",
}


@pytest.mark.parametrize("sync", ["hfa", "mixed"])
def test_a_run_that_loses_nothing_ends_under_the_heartbeat(tmp_path, sync):
    """With the heartbeat's thread on, Open MPI 5.0.11's MPI_Finalize never returned, so a run
    that lost no rank hung at its very end: geompi now ends its processes without it, after a
    last barrier. The job ends with exit 0 and its summary."""
    env = {**ULFM_ENV, **HEARTBEAT}
    mpirun(10, [prog("dc_lost.py"), sync, str(tmp_path)], 120, env=env, launcher=ULFM)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and "failures" not in summary


def test_a_lost_global_server_stops_mixedsync_in_one_line(tmp_path):
    """MixedSync loses a global server (after it applied 10 deposits). The local servers' one-
    sided calls to it would wait forever (Open MPI's osc/rdma is not fault tolerant); with the
    MPI library's heartbeat on, as make train and the Slurm scripts turn it on, they leave and
    the others stop the job: one line from one rank, a non-zero exit, no hang."""
    env = {**ULFM_ENV, **HOOKS, **HEARTBEAT, "GEOMPI_FAULT_KILL_AT": "10:8"}
    stops_in_one_line(tmp_path, "mixed", env, "global server rank(s) 8 lost", "so the job stops")
