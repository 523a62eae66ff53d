"""HFA's outer optimizer is a torch.optim class (Adam, AdamW, SGD with Nesterov) stepped on the
global servers' shards, and an algorithm from outside the package (examples/custom_algorithm.py)
trains through DistributedOptimizer(sync=...) and ``--sync pkg.module:Class``.

One job (tests/progs/outer_optim.py) against a plain-torch replay written here without
geompi's code: each worker's inner SGD steps on its batches, the datacenter and global averages
(weighted by samples) by hand, and the outer torch.optim optimizer stepped on
(global model - average); a save + load + continue equals the run in one go, bitwise."""

import json
import re

import pytest
import torch

from geompi import ckpt
from tests.mpirun import REPO, error_lines, mpirun, prog
from tests.progs.api_common import batch

pytestmark = pytest.mark.mpi
DCS = [[0, 1], [2]]  # the workers of each datacenter: dc_sizes (3, 2)
K1, K2, STEPS = 2, 2, 12


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def torch_outer(cls, **kw):
    """The outer step as DiLoCo takes it: a torch.optim optimizer over the global model."""

    def make(glob: list[torch.nn.Parameter]):
        opt = cls(glob, foreach=False, **kw)

        def step(avg: list[torch.Tensor]) -> None:
            for g, a in zip(glob, avg):
                g.grad = g.detach() - a
            opt.step()

        return step

    return make


def clipped(clip: float, lr: float = 1.0):
    def make(glob: list[torch.nn.Parameter]):
        def step(avg: list[torch.Tensor]) -> None:
            with torch.no_grad():
                for g, a in zip(glob, avg):
                    g -= lr * torch.clamp(g - a, -clip, clip)

        return step

    return make


def replay(outer, steps: int = STEPS) -> list[torch.Tensor]:
    """HFA by hand: K1 inner steps per worker, then a datacenter average weighted by the
    samples since the last average; every K2-th, the datacenters' averages weighted by their
    samples go through ``outer`` into the global model, which every worker then holds."""
    workers = [w for dc in DCS for w in dc]
    models = [make_model(1) for _ in workers]  # INIT: worker 0's model everywhere
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    glob = [torch.nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    step_outer = outer(glob)
    loss_fn = torch.nn.CrossEntropyLoss()
    samples = [0] * len(workers)
    for t in range(steps):
        for w in workers:
            x, y = batch(w, t)
            opts[w].zero_grad()
            loss_fn(models[w](x), y).backward()
            opts[w].step()
            samples[w] += len(y)
        if (t + 1) % K1:
            continue
        with torch.no_grad():
            dc_avg, dc_samples = [], []
            for dc in DCS:
                n = sum(samples[w] for w in dc)
                params = list(zip(*(models[w].parameters() for w in dc)))
                avg = [sum(p * samples[w] for p, w in zip(ps, dc)) / n for ps in params]
                dc_avg.append(avg)
                dc_samples.append(n)
            if (t + 1) % (K1 * K2) == 0:
                total = sum(dc_samples)
                avg = [
                    sum(a[i] * n for a, n in zip(dc_avg, dc_samples)) / total
                    for i in range(len(glob))
                ]
                step_outer(avg)
                dc_avg = [[g.detach() for g in glob]] * len(DCS)
            for dc, avg in zip(DCS, dc_avg):
                for w in dc:
                    for p, a in zip(models[w].parameters(), avg):
                        p.copy_(a)
        samples = [0] * len(workers)
    return [p.detach().clone() for p in models[0].parameters()]


REPLAYS = {
    "adam": torch_outer(torch.optim.Adam, lr=0.02),
    "nesterov": torch_outer(torch.optim.SGD, lr=0.7, momentum=0.8, nesterov=True),
    "adamw": torch_outer(torch.optim.AdamW, lr=0.02, betas=(0.8, 0.95), weight_decay=0.1),
    "clipped": clipped(0.002),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer_optim")
    res = mpirun(7, ["-m", "mpi4py", prog("outer_optim.py"), str(out)], 420, check=False)
    assert (out / "done-w0.json").exists(), res.stderr[-3000:]
    return out


def finals(out, tag: str) -> list[list[torch.Tensor]]:
    return [list(torch.load(out / f"{tag}-w{w}.pt").values()) for w in range(3)]


@pytest.mark.parametrize("case", list(REPLAYS))
def test_outer_step_equals_the_torch_replay(run, case):
    """Every worker ends on the replay's global model; and the outer step acts (the plain
    average of the same run is far from it)."""
    ref = replay(REPLAYS[case])
    for w, got in enumerate(finals(run, case)):
        for g, r in zip(got, ref):
            assert float((g - r).abs().max()) <= 1e-6, (case, w)
    plain = replay(torch_outer(torch.optim.SGD, lr=1.0))
    assert max(float((g - p).abs().max()) for g, p in zip(ref, plain)) > 1e-3


@pytest.mark.parametrize("resumed", ["adam-files", "adam-torch"])
def test_a_resumed_outer_adam_equals_the_run_in_one_go(run, resumed):
    """geompi.save/load at step 4 and opt.state_dict()/load_state_dict() at step 8 carry the
    servers' Adam moments and step: bitwise the uninterrupted run."""
    for a, b in zip(finals(run, "adam"), finals(run, resumed)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_state_dict_holds_the_outer_adam_state(run):
    got = json.loads((run / "state-keys.json").read_text())
    names = ["geompi_outer_exp_avg", "geompi_outer_exp_avg_sq", "geompi_outer_step"]
    assert sorted(got["keys"]) == names
    assert all(len(v) == 4 for v in got["keys"].values())  # 4 parameters
    assert got["step"] == [2.0] * 4  # two global averages by step 8


def _param_sums(stdout: str, tag: str) -> dict[int, str]:
    return dict(re.findall(rf"^{tag}: worker (\d+) .*param_sum=(\S+)$", stdout, re.M))


def test_the_example_trains_through_the_api_and_the_cli(tmp_path):
    res = mpirun(7, [str(REPO / "examples/custom_algorithm.py"), "--steps", "24"], timeout=240)
    rows = re.findall(
        r"^custom_algorithm: worker (\d) clipped-hfa first_loss=(\S+) last_loss=(\S+) "
        r"param_sum=(\S+)$",
        res.stdout,
        re.M,
    )
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2], res.stdout
    assert len({r[3] for r in rows}) == 1, "workers disagree on the final global model"
    args = ["-m", "geompi.train", "--sync", "examples.custom_algorithm:ClippedHFA"]
    args += ["--dc-sizes", "3,2", "--global-servers", "2", "--k1", "2", "--k2", "2"]
    args += ["--model", "linear", "--steps", "8", "--outer-lr", "0.5", "--clip", "0.002"]
    args += ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4"]
    res = mpirun(7, args, timeout=240, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert list((tmp_path / "ck").glob("*.h5")), "no checkpoint written"


@pytest.mark.parametrize(
    "spec, words",
    [
        ("nosuch.module:Algo", "--sync nosuch.module:Algo: cannot import nosuch.module"),
        ("examples.custom_algorithm:main", "main is not a subclass of geompi.sync.Algorithm"),
    ],
)
def test_a_bad_sync_path_is_one_line_from_one_rank(spec, words):
    args = ["-m", "geompi.train", "--sync", spec, "--dc-sizes", "2,2", "--steps", "2"]
    res = mpirun(5, args, timeout=120, cwd=REPO, check=False)
    lines = error_lines(res.stderr)
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(lines) == 1 and words in lines[0], lines


def _identical(a, b) -> bool:
    ca, cb = ckpt.load(a), ckpt.load(b)
    ta = {**ca.model, **{f"hfa/{k}/{n}": t for k, d in ca.algorithm["hfa"].items()
                         if k.startswith("outer_") for n, t in d.items()}}  # fmt: skip
    tb = {**cb.model, **{f"hfa/{k}/{n}": t for k, d in cb.algorithm["hfa"].items()
                         if k.startswith("outer_") for n, t in d.items()}}  # fmt: skip
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_the_cli_outer_adam_resumes_exactly_and_refuses_another_outer_optimizer(tmp_path):
    """--outer-optimizer adam: the checkpoint holds the servers' moments and step, a resume
    from step 4 ends bitwise where the run in one go ends; resuming it with another outer
    optimizer is one line, before any training."""
    base = ["-m", "geompi.train", "--model", "mlp", "--batch-size", "12"]
    base += ["--progress-every", "1e9", "--sync", "hfa", "--k1", "2", "--k2", "2"]
    base += ["--dc-sizes", "3,2", "--global-servers", "2", "--outer-lr", "0.01"]
    base += ["--steps", "8", "--checkpoint-every", "4"]
    adam = [*base, "--outer-optimizer", "adam"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    mpirun(7, [*adam, "--checkpoint-dir", str(full)], timeout=240)
    four, eight = full / ckpt.checkpoint_name(4), ckpt.checkpoint_name(8)
    mpirun(7, [*adam, "--checkpoint-dir", str(resumed), "--resume", str(four)], timeout=240)
    hfa = ckpt.load(full / eight).algorithm["hfa"]
    assert {"outer_exp_avg", "outer_exp_avg_sq", "outer_step"} <= set(hfa)
    assert all(float(t) == 2.0 for t in hfa["outer_step"].values())  # two global averages
    assert _identical(resumed / eight, full / eight)
    assert not _identical(full / eight, four)
    other = [*base, "--outer-optimizer", "nesterov", "--checkpoint-dir", str(tmp_path / "x")]
    res = mpirun(7, [*other, "--resume", str(four)], timeout=120, check=False)
    lines = error_lines(res.stderr)
    assert res.returncode != 0 and len(lines) == 1, res.stderr[-3000:]
    assert "outer optimizer's outer_exp_avg" in lines[0] and "nesterov" in lines[0], lines
