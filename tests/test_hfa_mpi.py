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
