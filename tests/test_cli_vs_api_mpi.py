"""One path (issue 36): the same job through ``python -m geompi.train`` and through a user's
script on the public API (``geompi.init`` -> ``DistributedOptimizer`` -> a plain loop) gives
the same model, bitwise. One mpirun runs the CLI jobs, then the API's (tests/progs/cli_vs_api.py):
FSA with SGD momentum and with Adam on two global servers, HFA with an outer SGD and an outer
Nesterov step; datacenters of 3 and 2 ranks (2 and 1 workers)."""

import pytest
import torch

from tests.mpirun import mpirun, prog

pytestmark = pytest.mark.mpi

CASES = ["fsa", "fsa_adam", "hfa", "hfa_nesterov"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_vs_api")
    mpirun(7, ["-m", "mpi4py", prog("cli_vs_api.py"), str(out)], timeout=300)
    return {name: {**torch.load(out / f"{name}.pt"), "dir": out} for name in CASES}


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


def _tensors(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint section, by its path."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_tensors(v, f"{prefix}{k}/"))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())}"
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"{what} differs at {differ}"


@pytest.mark.parametrize("name", CASES)
def test_the_cli_and_the_api_checkpoint_the_same_state(runs, name, tmp_path_factory):
    """One checkpoint path: the CLI's last checkpoint and ``geompi.save`` after the same job
    hold the same model, the same state of the global servers (their optimizer's under FSA,
    HFA's outer optimizer's, the update count), the same counters and, under HFA, every
    worker's own optimizer state, tensor for tensor."""
    from geompi import ckpt

    out = runs[name]["dir"]
    cli = ckpt.load(ckpt.latest(out / f"cli_{name}"))
    api = ckpt.load(out / f"api_{name}.h5")
    assert cli.step == api.step == runs[name]["steps"]
    _same(_tensors(cli.model), _tensors(api.model), "/model")
    _same(_tensors(cli.algorithm), _tensors(api.algorithm), "/algorithm")
    assert cli.algorithm["strategy"] == api.algorithm["strategy"]
    assert cli.algorithm["global_updates"] == api.algorithm["global_updates"] > 0
    if name.startswith("hfa"):  # each worker's own, and the master's in the API's /optimizer
        local = cli.algorithm["hfa"]["local"]
        workers = len(cli.progress["data_positions"])
        assert workers == 3 and sorted(local) == [f"worker{i}" for i in range(workers)]
        assert _tensors(local["worker0"]), "the local optimizer kept no state"
        _same(_tensors(local["worker0"]), _tensors(api.optimizer), "worker 0's optimizer state")
        assert cli.algorithm["hfa"].get("outer_momentum") or name == "hfa"
    else:  # the global servers' optimizer state
        assert _tensors(cli.optimizer), "the servers' optimizer kept no state"
        _same(_tensors(cli.optimizer), _tensors(api.optimizer), "/optimizer")
