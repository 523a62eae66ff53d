"""WAN compression against independent plain-torch replays (one 7-rank job).

The replays below simulate what the global tier should do, from the algorithms' definitions:
each datacenter's push is the sum of n_i * g_i of its workers, sent with error feedback per
(key, shard) (residual += push; send compress(residual); residual -= what was sent); the global
servers average what the used datacenters sent and take an SGD step; the pulls send the change
since the datacenters' replica, which both ends then move by what was sent. A datacenter whose
sum had a NaN skips the round (weight 0): its data is thrown away, so it must consume nothing.
None of the replays calls geompi's compressors or codec.
"""

import json
import math

import pytest
import torch

from tests.mpirun import mpirun, prog
from tests.reference import FidelityNet, max_abs_diff, worker_loaders

pytestmark = pytest.mark.mpi

DCS = [[0, 1], [2]]  # worker indices per datacenter (tests/progs/wan_fidelity.py)
G = 2  # global servers: every key is split in two shards


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One job for every case; a case that aborts the job fails its own tests only."""
    out = tmp_path_factory.mktemp("wan_fidelity")
    res = mpirun(7, [prog("wan_fidelity.py"), str(out)], timeout=300, check=False)
    cases = out / "cases.json"
    meta = json.loads(cases.read_text()) if cases.exists() else {"record": {}}
    return out, meta, res


def finished(runs, name: str) -> tuple:
    out, meta, res = runs
    assert name in meta["record"], f"{name} did not finish:\n{res.stderr[-3000:]}"
    return out, meta


# ---- independent compressors -------------------------------------------------------------
def topk(fraction: float):
    def send(v: torch.Tensor) -> torch.Tensor:
        k = max(1, math.ceil(fraction * v.numel()))
        idx = torch.topk(v.abs(), k, sorted=False).indices
        out = torch.zeros_like(v)
        out[idx] = v[idx]
        return out

    return send


def exact(v: torch.Tensor) -> torch.Tensor:
    return v.clone()


def shards(n: int):
    return [(g * n // G, (g + 1) * n // G) for g in range(G)]


# ---- the replays -------------------------------------------------------------------------
class Replay:
    """Workers' gradients and the datacenters' sums, as the run computes them."""

    def __init__(self, meta: dict, model_kw: dict, nan: bool) -> None:
        c = meta["common"]
        self.batch, self.steps = c["batch_size"], c["steps"]
        self.nan_step, nan_rank = meta["nan"]
        self.nan_worker = 2 if nan else None  # rank 3 is worker 2, datacenter 1's only worker
        assert nan_rank == 3
        ds, self.loaders = worker_loaders(c["dataset"], 3, self.batch, c["seed"])
        torch.manual_seed(c["seed"])
        shape = ds.input_shape
        self.net = FidelityNet(shape[0] * shape[1] * shape[2], ds.num_classes, **model_kw)
        self.names = [n for n, _ in self.net.named_parameters()]
        self.init = {n: p.detach().reshape(-1).clone() for n, p in self.net.named_parameters()}
        self.largest_push = 0.0

    def dc_sums(self, step: int, model: dict[str, torch.Tensor]) -> list[dict]:
        """Each datacenter's sum of n_i * g_i at ``model`` (workers in rank order)."""
        with torch.no_grad():
            for n, p in self.net.named_parameters():
                p.copy_(model[n].view_as(p))
        pushes = []
        for w, ld in enumerate(self.loaders):
            x, y = ld.next_batch()
            self.net.zero_grad()
            torch.nn.functional.cross_entropy(self.net(x), y).backward()
            g = {n: p.grad.reshape(-1) * self.batch for n, p in self.net.named_parameters()}
            if w == self.nan_worker and step == self.nan_step:
                g["l1.weight"] = g["l1.weight"] * float("nan")
            pushes.append(g)
        sums = []
        for workers in DCS:
            s = {}
            for n in self.names:
                t = pushes[workers[0]][n].clone()
                for w in workers[1:]:
                    t.add_(pushes[w][n])
                s[n] = t
            for t in s.values():
                t = t[torch.isfinite(t)]
                self.largest_push = max(self.largest_push, float(t.abs().max()) if t.numel() else 0)
            sums.append(s)
        return sums


def send_with_feedback(res, sums, d, n, lo, hi, compress, skipped, consume_skipped):
    """Datacenter d's slice through error feedback; None where nothing is used."""
    x = sums[d][n][lo:hi]
    if skipped and not (consume_skipped and bool(torch.isfinite(x).all())):
        return None
    key = (d, n, lo)
    v = res.get(key, torch.zeros_like(x)) + x
    sent = compress(v)
    res[key] = v - sent
    return None if skipped else sent


def replay_fsa(meta, model_kw, nan, lr, compress, consume_skipped=False):
    """FSA over a compressed global tier; returns the global model (what ``train()`` returns,
    not the workers' replica of it) and the replay."""
    r = Replay(meta, model_kw, nan)
    values = {n: v.clone() for n, v in r.init.items()}  # the global servers'
    replica = {n: v.clone() for n, v in r.init.items()}  # what every datacenter holds
    res: dict = {}
    for step in range(1, r.steps + 1):
        sums = r.dc_sums(step, replica)
        skipped = [not all(bool(torch.isfinite(t).all()) for t in s.values()) for s in sums]
        weight = sum(r.batch * len(DCS[d]) for d in range(len(DCS)) if not skipped[d])
        for n in r.names:
            for lo, hi in shards(values[n].numel()):
                sent = [
                    send_with_feedback(res, sums, d, n, lo, hi, compress, skip, consume_skipped)
                    for d, skip in enumerate(skipped)
                ]
                sent = [s for s in sent if s is not None]
                total = sent[0].clone()
                for s in sent[1:]:
                    total.add_(s)
                values[n][lo:hi].add_(total / weight, alpha=-lr)
                replica[n][lo:hi] += compress(values[n][lo:hi] - replica[n][lo:hi])
    return values, r


def replay_mixed(meta, model_kw, nan, lr, compress, consume_skipped=False):
    """MixedSync with gradients that depend on the data only: each datacenter's deposits and
    residuals are its own, so the order the deposits landed in does not matter."""
    r = Replay(meta, model_kw, nan)
    values = {n: v.clone() for n, v in r.init.items()}
    res: dict = {}
    for step in range(1, r.steps + 1):
        sums = r.dc_sums(step, r.init)  # the model does not change the gradient
        for d in range(len(DCS)):
            skipped = not all(bool(torch.isfinite(t).all()) for t in sums[d].values())
            weight = r.batch * len(DCS[d])
            for n in r.names:
                for lo, hi in shards(values[n].numel()):
                    sent = send_with_feedback(
                        res, sums, d, n, lo, hi, compress, skipped, consume_skipped
                    )
                    if sent is not None:
                        values[n][lo:hi].add_(sent / weight, alpha=-lr)
    return values, r


def as_state(flat: dict, net: torch.nn.Module) -> dict:
    return {n: flat[n].view_as(p) for n, p in net.named_parameters()}


# ---- defect: a skipped round must not consume the residuals -------------------------------
@pytest.mark.parametrize("algo", ["fsa", "mixed"])
def test_topk_error_feedback_with_a_skipped_round_matches_replay(runs, algo):
    """Top-k 10% over 8 rounds, 2 datacenters; at step 4 datacenter 1's l1.weight is NaN and
    its other keys finite. The run must equal the replay in which that round consumed none of
    its residuals, and the replay must tell that apart from one that consumed them."""
    name = f"{algo}_topk_skip"
    out, meta = finished(runs, name)
    assert meta["record"][name]["skipped_nonfinite"] == 1
    replay = replay_fsa if algo == "fsa" else replay_mixed
    kw = {} if algo == "fsa" else {"frozen": True}
    want, r = replay(meta, kw, True, 0.2, topk(0.1))
    lossy, _ = replay(meta, kw, True, 0.2, topk(0.1), consume_skipped=True)
    got = torch.load(out / f"{name}.pt")
    diff = max_abs_diff(got, as_state(want, r.net))
    assert diff <= 1e-5, diff
    assert max_abs_diff(as_state(lossy, r.net), as_state(want, r.net)) > 1e-3


# ---- defect: fp16 pushes beyond 65504 -------------------------------------------------------
@pytest.mark.parametrize("algo", ["fsa", "mixed"])
def test_fp16_pushes_beyond_its_range_follow_the_uncompressed_replay(runs, algo):
    """Loss scaling 2^16 (GradScaler's default) with lr / 2^16: the pushes reach several 100 000,
    far beyond fp16's 65504. With error feedback the fp16 run stays within fp16 rounding of
    the uncompressed replay, finite throughout."""
    out, meta = finished(runs, f"{algo}_fp16_scaled")
    scale = 2.0**16
    kw = {"loss_scale": scale} | ({} if algo == "fsa" else {"frozen": True})
    replay = replay_fsa if algo == "fsa" else replay_mixed
    want, r = replay(meta, kw, False, 0.2 / scale, exact)
    assert r.largest_push > 3 * 65504, r.largest_push
    got = torch.load(out / f"{algo}_fp16_scaled.pt")
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    diff = max_abs_diff(got, as_state(want, r.net))
    moved = max_abs_diff(as_state(r.init, r.net), as_state(want, r.net))
    assert diff <= 5e-4 < moved / 20, (diff, moved)  # the training moved far more than that
