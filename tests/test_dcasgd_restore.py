"""DCASGD after a resume (issue #12, 5): the restored backups are the restored model.

Single process: a real checkpoint file, real buckets and topology; only the worker object
around them is a plain namespace (``Checkpointing.server_states`` needs nothing else).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from geompi import ckpt
from geompi.checkpointing import Checkpointing
from geompi.comm.buckets import Buckets
from geompi.comm.topology import Topology
from geompi.sync import MixedSync

# what server_states asks of the engine: its servers step and keep the state (MixedSync's
# DCASGD, whose on_restore restarts every datacenter's backup from the model)
_ENGINE = SimpleNamespace(
    optimizer_state_on_servers=True, holds_server_state=True, algo=MixedSync(dcasgd=True)
)


def _net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def test_restored_backups_are_the_checkpointed_model(tmp_path):
    net = _net()
    model = {n: p.detach().clone() for n, p in net.named_parameters()}
    gen = torch.Generator().manual_seed(6)
    old = {  # backups from before the checkpoint: what the datacenters pulled long ago
        f"dc{d}": {n: t + torch.randn(t.shape, generator=gen) for n, t in model.items()}
        for d in range(2)
    }
    ms = {n: torch.rand(t.shape, generator=gen) for n, t in model.items()}
    path = ckpt.save(
        tmp_path / "c.h5",
        model=model,
        optimizer={"meansquare": ms},
        algorithm={"dcasgd": {"backup": old}},
        step=7,
        algorithm_name="mixed",
    )
    # resumed on 3 datacenters (one more than before) and 2 global servers
    topo = Topology.plan(11, dc_sizes=(3, 3, 3), global_servers=2)
    buckets = Buckets(list(_net().named_parameters()), cap_bytes=64)  # several keys
    assert len(buckets) > 1
    cp = Checkpointing(SimpleNamespace(buckets=buckets, topo=topo, engine=_ENGINE))
    cp.loaded = ckpt.load(path)
    states = cp.server_states()
    assert len(states) == 2
    for g, st in enumerate(states):
        for b in buckets:
            lo, hi = topo.shard_bounds(b.numel, g)
            # the model and meansquare of this slice, assembled here by hand
            want = torch.cat([model[n].reshape(-1) for n, *_ in b.members])[lo:hi]
            want_ms = torch.cat([ms[n].reshape(-1) for n, *_ in b.members])[lo:hi]
            per = st["state"][b.key]
            assert sorted(per) == ["backup_dc0", "backup_dc1", "backup_dc2", "meansquare"]
            for d in range(3):
                assert torch.equal(per[f"backup_dc{d}"], want), (g, b.key, d)
            assert torch.equal(per["meansquare"], want_ms)  # optimizer state is kept
