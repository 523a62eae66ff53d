"""Issue #13: state that grew without bound in long runs (MixedSync staleness) or was held
W times (HFA's per-worker optimizer states on resume)."""

from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import torch

from geompi.checkpointing import Checkpointing
from geompi.comm.topology import Topology
from geompi.sync import HFA
from geompi.sync.mixed import StalenessStats


def test_staleness_statistics_stay_bounded():
    stats = StalenessStats(num_dcs=2)
    rng = random.Random(0)
    values = [rng.choice([0, 1, 2, 3, 70, 5000, 10**6]) for _ in range(200_000)]
    for i, s in enumerate(values):
        stats.record(i % 2, s)
    out = stats.as_dict()
    assert out["staleness_updates"] == len(values)
    assert out["max_staleness_seen"] == 10**6
    assert abs(out["mean_staleness"] - sum(values) / len(values)) < 1e-6
    assert sum(out["staleness_histogram"].values()) == len(values)
    assert set(out["staleness_histogram"]) == {"0", "1", "2", "3", "64-127", "4096-8191",
                                               "524288-1048575"}  # fmt: skip
    assert len(pickle.dumps(out)) < 4096  # what goes to rank 0, after 200,000 updates
    assert [d["updates"] for d in out["staleness_per_dc"]] == [100_000, 100_000]


class _Comm:
    """all_workers of a 3-worker job, seen from the master (worker 0)."""

    def __init__(self):
        self.bcast_payload = None

    def bcast(self, obj, root=0):
        self.bcast_payload = obj
        return obj

    def scatter(self, objs, root=0):
        assert len(objs) == 3
        return objs[0]

    def allgather(self, obj):  # the workers' agreement that every position fits
        return [obj] * 3


def test_resume_sends_each_worker_only_its_own_local_optimizer_state():
    topo = Topology.plan(5, 1, None, 1)  # 3 workers, 1 local server, 1 global server
    big = {"momentum_buffer": {"w": torch.ones(1000)}}
    ck = SimpleNamespace(
        step=8,
        attrs={"topology": topo.describe()},
        progress={
            "data_positions": torch.tensor([[0, 8]] * 3),
            "rng": {f"worker{i}": torch.get_rng_state() for i in range(3)},
        },
        algorithm={"hfa": {"local": {f"worker{i}": big for i in range(3)}}, "strategy": {}},
    )
    comm = _Comm()
    loaded = []
    w = SimpleNamespace(
        master=True,
        widx=0,
        step=0,
        topo=topo,
        # no watchdog: no barrier before the bcast; HFA: each worker keeps its optimizer state
        cfg=SimpleNamespace(comm_timeout=None, algorithm=HFA()),
        comms=SimpleNamespace(all_workers=comm),
        loader=SimpleNamespace(load_state_dict=lambda st: None),
        engine=SimpleNamespace(
            load_state=lambda st: None,
            global_syncs=0,
            s=SimpleNamespace(
                comms=SimpleNamespace(all_workers=comm), worker_comm=comm, rank=0, finished=False
            ),
        ),
        local_opt=object(),
    )
    c = Checkpointing.__new__(Checkpointing)
    c.w, c.loaded, c.restore_note, c.worker_note = w, ck, "", ""
    c.resumed_from = "ck.h5"
    c._load_local = loaded.append
    c.distribute()
    assert loaded == [big]  # worker 0 got its own state
    # what every worker receives holds no worker's optimizer state (it held all W of them)
    assert len(pickle.dumps(comm.bcast_payload)) < 2048, comm.bcast_payload.keys()
    assert w.step == 8
