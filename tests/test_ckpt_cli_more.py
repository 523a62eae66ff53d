"""``python -m geompi.ckpt``: export --optimizer, inspect --json, diff --atol/--rtol (issue 37).

The export is checked by what a plain-torch user does with it: a fresh model and optimizer
load it (``torch.load(weights_only=True)``) and take one more step, which must equal the step
the run that wrote the checkpoint took. The settings make a wrong mapping show: two param
groups whose order is not the model's, parameters that never get a gradient (no state, sparse
indices), two parameters of one shape, an lr in the file unlike the fresh optimizer's.
"""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import geompi
from geompi import ckpt
from geompi.ckpt import main
from tests.mpirun import mpirun, prog
from tests.progs.api_common import batch, batch_size, make_model, param_groups, use_extra

LOSS = nn.CrossEntropyLoss()


def run_cli(capsys, *argv: str) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.strip()]


def plain_optimizer(kind: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if kind == "adam_groups":
        return torch.optim.Adam(param_groups(model, "adam"), lr=lr, weight_decay=0.01)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)


def step_on(model: nn.Module, opt: torch.optim.Optimizer, workers, t: int) -> None:
    """One step on the batches of ``workers`` at step ``t``, their gradients weighted by batch
    size (what FSA's servers apply); a parameter no batch reaches keeps ``grad`` None."""
    total = sum(batch_size(w, t) for w in workers)
    grads: dict[str, torch.Tensor] = {}
    for w in workers:
        model.zero_grad(set_to_none=True)
        x, y = batch(w, t)
        LOSS(model(x, use_extra(w, t)), y).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad * (batch_size(w, t) / total) if len(workers) > 1 else p.grad
                grads[n] = grads[n] + g if n in grads else g
    for n, p in model.named_parameters():
        p.grad = grads.get(n)
    opt.step()


def continue_from_export(exported, kind: str, workers, t: int, fresh: bool = False) -> dict:
    """A fresh model and optimizer (another seed, another lr) loaded from the export, one step;
    ``fresh``: the optimizer keeps its own state (the file's hyperparameters only), which a
    wrong mapping resembles."""
    d = torch.load(exported, weights_only=True)
    model = make_model(seed=99)
    model.load_state_dict(d["model"], strict=True)
    opt = plain_optimizer(kind, model, lr=0.5)
    if fresh:
        for g, saved in zip(opt.param_groups, d["optimizer"]["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
    else:
        opt.load_state_dict(d["optimizer"])
    step_on(model, opt, workers, t)
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---- export --optimizer, one process -----------------------------------------------------


@pytest.mark.parametrize("kind", ["adam_groups", "sgd_nesterov"])
def test_export_with_optimizer_continues_in_plain_torch_bitwise(tmp_path, capsys, kind):
    model = make_model(seed=1)
    opt = plain_optimizer(kind, model, lr=0.01 if kind == "adam_groups" else 0.05)
    for t in range(3):
        step_on(model, opt, [0], t)
    geompi.save(tmp_path / "c.h5", model=model, optimizer=opt, step=3)
    rc, out, err = run_cli(
        capsys, "export", str(tmp_path / "c.h5"), "--to", str(tmp_path / "c.pt"), "--optimizer"
    )
    assert rc == 0 and err == [], err
    d = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(d) == {"model", "optimizer"}
    assert d["optimizer"]["state"].keys() == opt.state_dict()["state"].keys()  # sparse indices

    step_on(model, opt, [0], 3)  # the run goes on
    ours = continue_from_export(tmp_path / "c.pt", kind, [0], 3)
    for k, v in model.state_dict().items():
        assert torch.equal(ours[k], v), k
    # the control: without the file's state the step is another one
    assert max_diff(continue_from_export(tmp_path / "c.pt", kind, [0], 3, fresh=True), ours) > 1e-4


def test_export_optimizer_refusals_are_one_line_exit_2(tmp_path, capsys):
    model = make_model(seed=1)
    geompi.save(tmp_path / "bare.h5", model=model)
    rc, _, err = run_cli(
        capsys, "export", str(tmp_path / "bare.h5"), "--to", str(tmp_path / "o.pt"), "--optimizer"
    )
    assert rc == 2 and len(err) == 1 and "holds no optimizer state" in err[0], err
    assert not (tmp_path / "o.pt").exists()
    # a geompi.train file: server state by parameter name, without torch's param groups
    sd = model.state_dict()
    tables = {"exp_avg": {"head.bias": torch.zeros(5)}}
    ckpt.save(tmp_path / "cli.h5", model=sd, optimizer=tables, optimizer_attrs={"name": "adam"})
    rc, _, err = run_cli(
        capsys, "export", str(tmp_path / "cli.h5"), "--to", str(tmp_path / "o.pt"), "--optimizer"
    )
    assert rc == 2 and len(err) == 1 and "without torch's param groups" in err[0], err
    # formats that cannot hold param groups
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    geompi.save(tmp_path / "sgd.h5", model=model, optimizer=opt)
    for suffix in (".npz", ".safetensors"):
        out = tmp_path / f"o{suffix}"
        rc, _, err = run_cli(
            capsys, "export", str(tmp_path / "sgd.h5"), "--to", str(out), "--optimizer"
        )
        assert rc == 2 and len(err) == 1 and "export to .pt" in err[0], err
        assert not out.exists()
    # without --optimizer the model alone is still exported
    rc, _, err = run_cli(
        capsys, "export", str(tmp_path / "bare.h5"), "--to", str(tmp_path / "m.pt")
    )
    assert rc == 0 and torch.load(tmp_path / "m.pt", weights_only=True).keys() == sd.keys()


@pytest.mark.parametrize(
    "groups, words",
    [
        ([{"lr": 1e30, "params": ["head.bias"]}], "outside"),
        ([{"lr": 0.1, "params": ["no.such"]}], "not /model's tensors"),
        ([{"lr": 0.1, "params": ["head.bias", "head.bias"]}], "not /model's tensors"),
        ({"lr": 0.1}, "not a list"),
    ],
)
def test_export_optimizer_checks_the_files_param_groups(tmp_path, capsys, groups, words):
    """The file is untrusted: its param groups are checked as geompi.load checks them."""
    sd = make_model(seed=1).state_dict()
    attrs = {"name": "SGD", "param_groups": json.dumps(groups)}
    ckpt.save(tmp_path / "c.h5", model=sd, optimizer={}, optimizer_attrs=attrs)
    rc, _, err = run_cli(
        capsys, "export", str(tmp_path / "c.h5"), "--to", str(tmp_path / "o.pt"), "--optimizer"
    )
    assert rc == 1 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "o.pt").exists()


# ---- export --optimizer, state held by the global servers and per worker (one MPI job) ------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_export_opt")
    res = mpirun(5, ["-m", "mpi4py", prog("ckpt_export_opt.py"), str(out)], 300, check=False)
    assert (out / "hfa-after-w0.pt").exists(), res.stderr[-3000:]
    return out


@pytest.mark.mpi
def test_export_of_server_held_adam_continues_the_fsa_run(trained, capsys):
    """FSA with Adam on 2 global servers: each holds a shard of the state; the export is the
    whole state in torch's format, and one plain step on both workers' batches equals the run's
    next step (up to the order the servers sum the workers' gradients in: 3e-8 here)."""
    rc, _, err = run_cli(
        capsys, "export", str(trained / "fsa.h5"), "--to", str(trained / "fsa.pt"), "--optimizer"
    )
    assert rc == 0, err
    run = torch.load(trained / "fsa-after-w0.pt", weights_only=True)
    ours = continue_from_export(trained / "fsa.pt", "adam_groups", [0, 1], 4)
    assert max_diff(ours, run) < 1e-6
    assert (
        max_diff(continue_from_export(trained / "fsa.pt", "adam_groups", [0, 1], 4, True), run)
        > 1e-3
    )


@pytest.mark.mpi
def test_export_of_hfa_holds_the_masters_state_and_the_outer_momentum(trained, capsys):
    """HFA: each worker's inner Adam is its own; the export holds the master's (worker 0's),
    so worker 0's next local step follows, and the servers' outer momentum by name."""
    rc, _, err = run_cli(
        capsys, "export", str(trained / "hfa.h5"), "--to", str(trained / "hfa.pt"), "--optimizer"
    )
    assert rc == 0, err
    d = torch.load(trained / "hfa.pt", weights_only=True)
    outer = ckpt.load(trained / "hfa.h5").algorithm["hfa"]["outer_momentum"]
    assert d["geompi_outer_momentum"].keys() == outer.keys() and outer
    assert all(torch.equal(d["geompi_outer_momentum"][k], v) for k, v in outer.items())

    run = torch.load(trained / "hfa-after-w0.pt", weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran (OMP_NUM_THREADS=1): the same sums, bitwise
    try:
        ours = continue_from_export(trained / "hfa.pt", "adam", [0], 4)
        fresh = continue_from_export(trained / "hfa.pt", "adam", [0], 4, fresh=True)
    finally:
        torch.set_num_threads(threads)
    for k, v in run.items():
        assert torch.equal(ours[k], v), k
    assert max_diff(fresh, run) > 1e-3


# ---- inspect --json --------------------------------------------------------------------------


def sample_checkpoint(path):
    model = make_model(seed=3)
    sd = model.state_dict()
    sd["half"] = torch.linspace(-2, 2, 6).to(torch.bfloat16)
    sd["count"] = torch.tensor(7)
    sd["bad"] = torch.tensor([1.0, math.inf, -math.inf])
    return ckpt.save(
        path,
        model=sd,
        optimizer={"exp_avg": {"head.bias": torch.arange(5.0)}},
        optimizer_attrs={"name": "adam"},
        algorithm={"global_updates": 4, "hfa": {"outer_momentum": {"head.bias": torch.ones(5)}}},
        progress={"blob": b"\x00\x01\x02", "steps": torch.tensor([4, 4])},
        step=4,
        epoch=1,
        metrics={"test_acc": 0.5},
        config={"lr": 0.1},
    )


def test_inspect_json_matches_what_h5py_reads(tmp_path, capsys):
    path = sample_checkpoint(tmp_path / "c.h5")
    rc, out, err = run_cli(capsys, "inspect", "--json", str(path))
    assert rc == 0 and err == [], err
    doc = json.loads(out)  # one document, strict JSON (no NaN/Infinity tokens)
    assert doc["schema"] == 1 and doc["problems"] == []
    rows = {r["path"]: r for r in doc["tensors"]}
    with h5py.File(path, "r") as f:
        assert doc["file_bytes"] == path.stat().st_size
        for key in ("format", "algorithm", "model_fingerprint", "step", "epoch"):
            v = f.attrs[key]
            assert doc["attributes"][key] == (v.decode() if isinstance(v, bytes) else v.item())
        for key in ("metrics", "config"):
            v = f.attrs[key]
            assert doc["attributes"][key] == json.loads(v.decode() if isinstance(v, bytes) else v)
        assert doc["groups"]["/optimizer"]["name"] == "adam"
        assert doc["groups"]["/algorithm"]["global_updates"] == 4
        seen = []
        f.visititems(
            lambda name, obj: seen.append("/" + name) if isinstance(obj, h5py.Dataset) else None
        )
        assert sorted(seen) == sorted(rows)
        for name in seen:
            ds, row = f[name], rows[name]
            arr = ds[()]
            if ds.attrs.get("kind") == b"bytes" or ds.attrs.get("kind") == "bytes":
                assert row["kind"] == "bytes" and row["bytes"] == arr.nbytes
                continue
            dtype = ds.attrs["dtype"]
            dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
            assert row["kind"] == "tensor" and row["dtype"] == dtype
            shape = [] if ds.attrs.get("scalar", 0) else list(ds.shape)
            assert row["shape"] == shape and row["bytes"] == arr.nbytes
            if dtype == "bfloat16":  # stored as int16 bits: widen them to float32
                arr = (arr.astype(np.int32) << 16).astype(np.uint32).view(np.float32)
            vals = arr.astype(np.float64)
            st = row["stats"]
            if not np.isfinite(vals).all():  # non-finite stats are the strings "inf", "nan"
                assert st["max"] == "inf" and st["min"] == "-inf"
                continue
            assert st["min"] == pytest.approx(vals.min()) and st["max"] == pytest.approx(vals.max())
            assert st["mean"] == pytest.approx(vals.mean())
            assert st["norm"] == pytest.approx(np.linalg.norm(vals.ravel()))
    assert doc["total_tensors"] == len(rows)
    assert doc["total_bytes"] == sum(r["bytes"] for r in rows.values())


def test_inspect_json_reports_a_corrupt_dataset_and_exits_1(tmp_path, capsys):
    path = sample_checkpoint(tmp_path / "c.h5")
    with h5py.File(path, "r") as f:
        info = f["/model/hidden.weight"].id.get_chunk_info(0)
    with open(path, "r+b") as fh:  # one bit of the data: fletcher32 and sha256 no longer match
        fh.seek(info.byte_offset + 10)
        b = fh.read(1)
        fh.seek(info.byte_offset + 10)
        fh.write(bytes([b[0] ^ 1]))
    rc, out, err = run_cli(capsys, "inspect", "--json", str(path))
    doc = json.loads(out)
    assert rc == 1 and len(doc["problems"]) == 1 and "hidden.weight" in doc["problems"][0]
    assert {r["path"]: r["kind"] for r in doc["tensors"]}["/model/hidden.weight"] == "unreadable"
    assert err == ["geompi.ckpt: error: " + doc["problems"][0]]


# ---- diff --atol / --rtol --------------------------------------------------------------------


def pair(tmp_path, delta: float):
    a = {
        "w": torch.linspace(1, 2, 10),
        "v": torch.tensor([1.0, math.nan, 3.0]),
        "n": torch.arange(4),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["w"][3] += delta
    pa = ckpt.save(tmp_path / "a.h5", model=a, step=1)
    pb = ckpt.save(tmp_path / "b.h5", model=b, step=1)
    return str(pa), str(pb)


def test_diff_within_and_beyond_tolerance(tmp_path, capsys):
    a, b = pair(tmp_path, 1e-4)
    rc, out, _ = run_cli(capsys, "diff", a, b)  # default: exact
    assert rc == 1 and "/model/w: max abs diff" in out and "(differs)" in out
    rc, out, _ = run_cli(capsys, "diff", a, b, "--atol", "2e-4")
    assert rc == 0 and out.strip().endswith("identical") and "(within tolerance)" in out
    rc, out, _ = run_cli(capsys, "diff", a, b, "--atol", "5e-5")
    assert rc == 1
    assert "tensors that differ: /model/w" in out.splitlines()
    assert "/model/v" not in [ln.split(":")[0] for ln in out.splitlines() if "beyond" in ln]
    rc, out, _ = run_cli(capsys, "diff", a, b, "--rtol", "2e-4")  # |b| is about 1.3
    assert rc == 0
    rc, out, _ = run_cli(capsys, "diff", a, b, "--rtol", "2e-5")
    assert rc == 1 and "(differs beyond atol=0 rtol=2e-05)" in out
    rc, _, _ = run_cli(capsys, "diff", a, a, "--atol", "0")
    assert rc == 0


def test_diff_tolerance_still_reports_other_differences(tmp_path, capsys):
    a, _ = pair(tmp_path, 0.0)
    other = {"w": torch.linspace(1, 2, 10).double(), "v": torch.zeros(3), "n": torch.arange(4)}
    b = ckpt.save(tmp_path / "c.h5", model=other, step=2)
    rc, out, _ = run_cli(capsys, "diff", a, str(b), "--atol", "100")
    assert (
        rc == 1 and "/model/w: dtype float32 != float64" in out and "attribute @step: 1 != 2" in out
    )


@pytest.mark.parametrize(
    "flag, value", [("--atol", "-1"), ("--atol", "nan"), ("--rtol", "inf"), ("--rtol", "x")]
)
def test_diff_bad_tolerance_is_one_line_exit_2(tmp_path, capsys, flag, value):
    a, b = pair(tmp_path, 1e-4)
    rc, out, err = run_cli(capsys, "diff", a, b, f"{flag}={value}")
    assert (
        rc == 2
        and out == ""
        and err == [f"geompi.ckpt: error: {flag} {value}: must be a finite number >= 0"]
    )
