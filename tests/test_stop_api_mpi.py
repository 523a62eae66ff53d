"""geompi.stop_requested(): a SIGTERM to one worker stops every worker at the same step, and
the job resumed from the checkpoint they saved there ends where an uninterrupted one does
(FSA, Adam, datacenters of 2 and 1 workers; tests/progs/api_stop.py)."""

import pytest
import torch

from tests.mpirun import mpirun, prog

pytestmark = pytest.mark.mpi


def test_a_signal_to_one_worker_stops_all_at_one_step_and_the_resume_is_exact(tmp_path):
    mpirun(6, ["-m", "mpi4py", prog("api_stop.py"), str(tmp_path)], timeout=240)
    stops = [int((tmp_path / f"stop-w{w}.txt").read_text()) for w in range(3)]
    assert len(set(stops)) == 1, f"the workers stopped at different steps: {stops}"
    # signalled after step 5: seen at the next call (step 5's agreement started before it) or
    # the one after, never later, and training was not yet over
    assert stops[0] in (5, 6, 7), stops
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
