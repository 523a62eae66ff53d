"""One path (issue 36): the same job through ``python -m geompi.train`` and through a user's
script on the public API (``geompi.init`` -> ``DistributedOptimizer`` -> a plain loop) gives
the same model, bitwise. One mpirun runs the CLI jobs, then the API's (tests/progs/cli_vs_api.py):
FSA with SGD momentum and with Adam on two global servers, HFA with an outer SGD and an outer
Nesterov step; datacenters of 3 and 2 workers."""

import pytest
import torch

from tests.mpirun import mpirun, prog

pytestmark = pytest.mark.mpi

CASES = ["fsa", "fsa_adam", "hfa", "hfa_nesterov"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_vs_api")
    mpirun(7, ["-m", "mpi4py", prog("cli_vs_api.py"), str(out)], timeout=300)
    return {name: torch.load(out / f"{name}.pt") for name in CASES}


@pytest.mark.parametrize("name", CASES)
def test_the_cli_and_the_api_train_the_same_model(runs, name):
    run = runs[name]
    cli, api = run["cli"], run["api"]
    assert run["steps"] >= 10
    assert cli.keys() == api.keys()
    differ = {
        k: (cli[k] - api[k]).abs().max().item() for k in cli if not torch.equal(cli[k], api[k])
    }
    assert not differ, f"{name}: CLI and API models differ: {differ}"


def test_the_cases_are_not_alike(runs):
    """Each case trains its own model (a setting lost on the way would not pass unseen)."""
    flat = {n: torch.cat([t.flatten().float() for t in runs[n]["cli"].values()]) for n in CASES}
    for i, a in enumerate(CASES):
        for b in CASES[i + 1 :]:
            assert not torch.equal(flat[a], flat[b]), f"{a} and {b} trained alike"
