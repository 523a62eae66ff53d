"""KVStore: the global servers apply the optimizer once per round to the sum of every push.

2 uneven datacenters, 2 global servers (a key of 1 element has an empty slice on one of
them), keys of 1, 3 and 1001 elements and an fp16 key, against plain torch.optim per key.
"""

import json
import sys

import pytest
import torch

from tests.mpirun import PROGS, mpirun, prog

pytestmark = pytest.mark.mpi
WORKERS = 2 + 4  # GEOMPI_DC_SIZES 3,5 + 2 global servers: 10 ranks

sys.path.insert(0, str(PROGS))
from kv_optim import DTYPES, SHAPES, STEPS, init_value, push_value  # noqa: E402


def reference(make_opt) -> list[dict[str, torch.Tensor]]:
    """Per round, each key's value: its own torch optimizer stepped on the summed pushes."""
    params = {
        k: torch.nn.Parameter(init_value(k).to(DTYPES.get(k, torch.float32)).float())
        for k in SHAPES
    }
    opts = {k: make_opt([p]) for k, p in params.items()}
    rounds = []
    for step in range(STEPS):
        for k, p in params.items():
            dt = DTYPES.get(k, torch.float32)
            p.grad = sum(push_value(k, w, step).to(dt).float() for w in range(WORKERS))
            opts[k].step()
        rounds.append(
            {
                k: p.detach().to(DTYPES.get(k, torch.float32)).float().clone()
                for k, p in params.items()
            }
        )
    return rounds


CASES = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=False),
}


@pytest.mark.parametrize("which", list(CASES))
def test_optimizer_applied_once_per_round_matches_torch(tmp_path, which):
    mpirun(
        10,
        [prog("kv_optim.py"), str(tmp_path), which],
        timeout=120,
        env={"GEOMPI_DC_SIZES": "3,5", "GEOMPI_GLOBAL_SERVERS": "2"},
    )
    want = reference(CASES[which])
    for w in range(WORKERS):
        got = json.loads((tmp_path / f"kv-{w}.json").read_text())
        for step in range(STEPS):
            for k in SHAPES:
                g = torch.tensor(got[f"step{step}"][k]).view(SHAPES[k])
                tol = 1e-3 if k in DTYPES else 1e-6  # fp16: one unit in the last place
                torch.testing.assert_close(
                    g, want[step][k], rtol=tol, atol=tol, msg=f"worker {w} round {step} key {k}"
                )
