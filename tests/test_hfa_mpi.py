"""HFA: equal to torch's HierarchicalModelAverager, to FSA at K1=K2=1, and its WAN savings."""

import json

import pytest
import torch

from tests.mpirun import mpirun, prog
from tests.reference import max_abs_diff

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def hfa(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfa")
    mpirun(7, [prog("hfa_vs_torch.py"), str(out)], timeout=240)
    return out, json.loads((out / "record.json").read_text())


def test_hfa_equals_torch_hierarchical_model_averager(hfa):
    out, meta = hfa
    ours, theirs = torch.load(out / "hfa.pt"), torch.load(out / "torch.pt")
    assert max_abs_diff(ours, theirs) <= 1e-5
    rec = meta["record"]["hfa"]
    assert rec["steps"] == meta["steps"]
    assert rec["global_syncs"] == meta["steps"] // (meta["K1"] * meta["K2"])


def test_hfa_k1_k2_1_equals_fsa(hfa):
    out, _ = hfa
    assert max_abs_diff(torch.load(out / "hfa_k11.pt"), torch.load(out / "fsa_k11.pt")) <= 1e-5


def test_wan_bytes_per_step_fall_by_k1_k2(hfa):
    _, meta = hfa
    r = meta["record"]
    fsa_per_step = (r["fsa_24"]["wan_bytes"] - r["fsa_12"]["wan_bytes"]) / 12
    hfa_per_step = (r["hfa_24"]["wan_bytes"] - r["hfa_12"]["wan_bytes"]) / 12
    assert fsa_per_step / hfa_per_step == pytest.approx(4.0, rel=1e-9)  # K1 * K2 = 2 * 2
    assert r["hfa_24"]["global_syncs"] == 24 // 4


@pytest.fixture(scope="module")
def cli_uneven(tmp_path_factory):
    out = tmp_path_factory.mktemp("hfa_cli_uneven")
    mpirun(10, [prog("hfa_cli_uneven.py"), str(out)], timeout=300)
    return out


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_cli_hfa_uneven_momentum_two_global_servers(cli_uneven, weighting):
    """The CLI's HFA on datacenters of 2 and 4 workers, momentum 0.9, against a simulation."""
    from geompi.models import build_model
    from tests.progs.api_common import hfa_reference
    from tests.reference import worker_loaders

    out = cli_uneven
    ds, loaders = worker_loaders("digits", 6, batch_size=7, seed=4)
    models = []
    for _ in range(6):
        torch.manual_seed(4)
        models.append(build_model("mlp", ds.input_shape, ds.num_classes))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    ref = hfa_reference(
        [2, 4],
        k1=2,
        k2=2,
        steps=8,
        uniform=weighting == "uniform",
        models=models,
        opts=opts,
        batches=lambda w, t: loaders[w].next_batch(),
    )
    got = torch.load(out / f"{weighting}.pt")
    assert max_abs_diff(got, ref[0]) <= 1e-5
