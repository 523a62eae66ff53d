"""FSA equals single-process large-batch SGD/Adam, across uneven datacenters and shards."""

import json

import pytest
import torch

from tests.mpirun import mpirun, prog
from tests.reference import large_batch_sgd, max_abs_diff

pytestmark = pytest.mark.mpi


CASES = ["sgd-2dc-1gs", "sgd-3dc-2gs", "adam-2dc-1gs", "adam-3dc-2gs"]


@pytest.fixture(scope="module")
def fsa_runs(tmp_path_factory):
    """Every case, then adam-3dc-2gs again through host staging buffers (GEOMPI_FORCE_STAGING:
    a GPU with an MPI that is not CUDA-aware, emulated), one after another in one job."""
    out = tmp_path_factory.mktemp("fsa")
    mpirun(9, [prog("fsa_exact.py"), str(out), ",".join([*CASES, "adam-3dc-2gs+staged"])], 360)
    return out, json.loads((out / "cases.json").read_text())


def test_fsa_through_staging_buffers_equals_reference(fsa_runs):
    _check(*fsa_runs, "adam-3dc-2gs+staged")


@pytest.mark.parametrize("name", CASES)
def test_fsa_equals_large_batch_reference(fsa_runs, name):
    _check(*fsa_runs, name)


def _check(out, meta, name):
    case, common = meta["cases"][name], meta["common"]
    workers = sum(s - 1 for s in case["dc_sizes"])
    wd, mom = common["weight_decay"], common["momentum"]
    if case["optimizer"] == "sgd":

        def make_opt(ps):
            return torch.optim.SGD(ps, lr=0.05, momentum=mom, weight_decay=wd)
    else:

        def make_opt(ps):
            return torch.optim.Adam(ps, lr=2e-3, weight_decay=wd)

    ref = large_batch_sgd(
        dataset=common["dataset"],
        model=common["model"],
        workers=workers,
        batch_size=common["batch_size"],
        seed=common["seed"],
        steps=common["steps"],
        make_opt=make_opt,
    )
    got = torch.load(out / f"{name}.pt")
    init = large_batch_sgd(
        dataset=common["dataset"],
        model=common["model"],
        workers=workers,
        batch_size=common["batch_size"],
        seed=common["seed"],
        steps=0,
        make_opt=make_opt,
    )
    assert max_abs_diff(got, init) > 1e-2, "training did not move the parameters"
    assert max_abs_diff(got, ref) <= 1e-5
    res = meta["results"][name]
    assert res["steps"] == common["steps"] and res["global_syncs"] == common["steps"]
