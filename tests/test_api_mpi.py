"""The public API (geompi.init / DistributedOptimizer) against plain torch, under mpirun.

References run here in one process and never call geompi: the same optimizer on the
concatenation of every worker's batch (FSA), an independent per-worker simulation (HFA on uneven
datacenters), and torch's own PostLocalSGDOptimizer + HierarchicalModelAverager over gloo.
"""

import json

import pytest
import torch

from tests.mpirun import mpirun, prog
from tests.progs.api_common import MICRO, hfa_reference, make_model, reference

pytestmark = pytest.mark.mpi

KINDS = ["sgd", "adam", "adamw", "rmsprop", "adagrad", "clip", "accum", "nosync"]
STEPS = 10


@pytest.fixture(scope="module")
def fsa_2gs(tmp_path_factory):
    """Datacenters of 2 and 4 workers, 2 global servers: every case in one job."""
    out = tmp_path_factory.mktemp("api_fsa_2gs")
    mpirun(10, ["-m", "mpi4py", prog("api_fsa.py"), str(out), "3,5", "2", ",".join(KINDS)], 400)
    return out


@pytest.fixture(scope="module")
def fsa_1gs(tmp_path_factory):
    out = tmp_path_factory.mktemp("api_fsa_1gs")
    mpirun(9, ["-m", "mpi4py", prog("api_fsa.py"), str(out), "3,5", "1", "sgd,clip,accum"], 300)
    return out


def _check_fsa(out, kind, workers=6):
    ref = reference(kind, workers, STEPS)
    init = make_model(1).state_dict()
    first = torch.load(out / f"{kind}-w0.pt")
    for w in range(workers):
        got = torch.load(out / f"{kind}-w{w}.pt")
        for k in got:  # every worker holds the same bits
            assert torch.equal(got[k], first[k]), (kind, w, k)
    diff = max(float((first[k] - ref[k]).abs().max()) for k in ref)
    assert diff <= 1e-5, (kind, diff)
    assert max(float((first[k] - init[k]).abs().max()) for k in ref) > 1e-3, "nothing trained"
    # frozen and never-used parameters stay exactly as torch leaves them (no decay, no momentum)
    for k in ("frozen.weight", "frozen.bias", "unused.weight", "unused.bias"):
        assert torch.equal(first[k], init[k]), k
    assert not torch.equal(first["extra"], init["extra"]), "the sometimes-used parameter"


@pytest.mark.parametrize("kind", KINDS)
def test_fsa_equals_one_process_on_the_concatenated_batches(fsa_2gs, kind):
    _check_fsa(fsa_2gs, kind)


@pytest.mark.parametrize("kind", ["sgd", "clip", "accum"])
def test_fsa_with_one_global_server(fsa_1gs, kind):
    _check_fsa(fsa_1gs, kind)


@pytest.mark.parametrize("kind", ["accum", "nosync"])
def test_accumulation_sends_nothing_on_skipped_micro_steps(fsa_2gs, kind):
    micro = MICRO[kind]
    for w in range(6):
        sent = json.loads((fsa_2gs / f"sent-w{w}.json").read_text())[kind]
        assert len(sent) == STEPS * micro
        for i, nbytes in enumerate(sent):
            last = i % micro == micro - 1
            assert (nbytes > 0) == last, (w, i, sent)


def test_clipping_was_active(fsa_2gs):
    """The clip case must differ from plain SGD, or the clip reference proves nothing."""
    a, b = torch.load(fsa_2gs / "clip-w0.pt"), torch.load(fsa_2gs / "sgd-w0.pt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-3


def test_hfa_uneven_datacenters_two_global_servers_momentum(tmp_path):
    mpirun(10, ["-m", "mpi4py", prog("api_hfa.py"), str(tmp_path), "3,5", "2", "sim"], 300)
    refs = hfa_reference([2, 4], k1=2, k2=3, steps=12)
    init = make_model(1).state_dict()
    for w, ref in enumerate(refs):
        got = torch.load(tmp_path / f"hfa-w{w}.pt")
        assert max(float((got[k] - ref[k]).abs().max()) for k in got) <= 1e-5, w
        assert max(float((got[k] - init[k]).abs().max()) for k in got) > 1e-2
    # the run ends on a global average: every worker holds the same model
    first = torch.load(tmp_path / "hfa-w0.pt")
    for w in range(1, 6):
        got = torch.load(tmp_path / f"hfa-w{w}.pt")
        assert max(float((got[k] - first[k]).abs().max()) for k in got) <= 1e-6


def test_hfa_equals_torch_post_local_sgd_with_hierarchical_averager(tmp_path):
    mpirun(7, ["-m", "mpi4py", prog("api_hfa.py"), str(tmp_path), "3,3", "1", "torch"], 300)
    for w in range(4):
        ours = torch.load(tmp_path / f"hfa-w{w}.pt")
        theirs = torch.load(tmp_path / f"torch-w{w}.pt")
        assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) <= 1e-5, w


def test_hfa_uniform_weighting_counts_every_datacenter_the_same(tmp_path):
    """GeoMX's uniform rule on datacenters of 2 and 4 workers: not the per-worker mean."""
    mpirun(10, ["-m", "mpi4py", prog("api_hfa.py"), str(tmp_path), "3,5", "2", "uniform"], 300)
    refs = hfa_reference([2, 4], k1=2, k2=3, steps=12, uniform=True)
    per_worker = hfa_reference([2, 4], k1=2, k2=3, steps=12)
    got = torch.load(tmp_path / "hfa-w0.pt")
    assert max(float((got[k] - refs[0][k]).abs().max()) for k in got) <= 1e-5
    assert max(float((got[k] - per_worker[0][k]).abs().max()) for k in got) > 1e-4
