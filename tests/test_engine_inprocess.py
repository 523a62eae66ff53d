"""Each algorithm's worker side, driven by the real worker engine, in one process.

geompi.engine.Synchronizer (the algorithm-free engine: buckets, hooks, sample counting, the
client) with the worker side that ``Algorithm.worker`` returns (geompi.sync.fsa, .hfa) runs on
every worker rank of a loopback world (tests/loopback.py), beside real local and global
servers built by the algorithm (``make_server``), each rank a thread. Two datacenters of uneven
size (2 workers and 1) and uneven batches. Every expectation is computed here without geompi:
FSA against one plain torch model stepped on the concatenated batch, HFA against a replay of
K1 local steps and sample-weighted datacenter and global averages. MixedSync's worker side
needs the servers' MPI windows and stays with the MPI tests (test_mixed_mpi.py).
"""

from __future__ import annotations

import pytest
import torch

import geompi.engine as engine_module
from geompi.comm.topology import Role, Topology, build_communicators
from geompi.comm.transport import LinkStats
from geompi.config import RunConfig
from geompi.engine import LocalEngine, Synchronizer
from geompi.errors import ConfigError
from geompi.session import Session
from geompi.sync import FSA, HFA, MixedSync
from geompi.sync.fsa import FSAServersWorker, FSAWorker
from geompi.sync.hfa import HFAWorker
from geompi.sync.mixed import MixedWorker

try:
    from loopback import LoopbackWorld, run_ranks
except ImportError:  # tests/ imported as a package
    from tests.loopback import LoopbackWorld, run_ranks

DC_SIZES = (3, 2)  # DC 0: workers 0, 1 + local server 2; DC 1: worker 3 + local server 4
TOPO = Topology.plan(sum(DC_SIZES) + 2, dc_sizes=DC_SIZES, global_servers=2)
WORKERS = TOPO.all_workers
BATCH = {r: 2 + i for i, r in enumerate(WORKERS)}  # uneven sample counts: 2, 3, 4
LR, MOMENTUM = 0.1, 0.9


def model0() -> torch.nn.Module:
    """The master worker's model: its values from a generator of its own, never torch's global
    one, which the other ranks' threads draw from as they build their models."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    n = BATCH[rank]
    return torch.randn(n, 3, generator=gen), torch.randn(n, 2, generator=gen)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def train(algo, steps: int, monkeypatch) -> dict[int, list[torch.Tensor]]:
    """Every worker trains ``steps`` steps through a Synchronizer, as DistributedOptimizer's
    ``step()`` drives it, then closes it; returns each worker's parameters."""
    # the one thing the loopback lacks: MPI's node query (every rank on one node here)
    monkeypatch.setattr(engine_module, "node_share", lambda c: (c.Get_rank(), c.Get_size()))
    world = LoopbackWorld(TOPO.world_size, timeout=60.0)  # generous: a loaded machine

    def body(rank: int):
        def run():
            comms = build_communicators(TOPO, world.comm(rank))
            stats = LinkStats()
            if TOPO.role(rank) is not Role.WORKER:
                algo.make_server(TOPO, comms, stats).run()
                return None
            session = Session(cfg=RunConfig(), topo=TOPO, comms=comms, stats=stats, rank=rank)
            model = model0()
            if rank != 0:  # the INIT round gives it the master's values
                torch.nn.init.zeros_(model[0].weight)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            engine = Synchronizer(
                opt, model, algo, session, bucket_mb=1.0, max_grad_norm=None, passes=1,
                server_spec=algo.server_spec(opt), stats=stats,
            )  # fmt: skip
            engine.begin()  # the INIT round: the master's parameters everywhere
            for step in range(steps):
                opt.zero_grad()
                loss_of(model, *batch(rank, step)).backward()
                engine.user_step(None, opt.step)
            engine.close(report=False)
            return [p.detach().clone() for p in model.parameters()]

        return run

    out = run_ranks(world, {r: body(r) for r in range(TOPO.world_size)}, timeout=180.0)
    return {r: out[r] for r in WORKERS}


def fsa_reference(steps: int) -> list[torch.Tensor]:
    """One process on the concatenated batch of every worker."""
    model = model0()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        xs, ys = zip(*(batch(r, step) for r in WORKERS))
        opt.zero_grad()
        loss_of(model, torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def hfa_reference(k1: int, k2: int, steps: int) -> list[torch.Tensor]:
    """K1 local steps on each worker, then its datacenter's sample-weighted average; every
    K2-th average global (the datacenters weighted by their samples, outer SGD of lr 1: the
    plain weighted average). After the last step, one more global average if the last was not
    (close() ends on the global model), weighted as the last average was."""
    models = {r: model0() for r in WORKERS}
    opts = {r: torch.optim.SGD(models[r].parameters(), lr=LR, momentum=MOMENTUM) for r in WORKERS}
    dcs = [TOPO.workers(d) for d in range(len(DC_SIZES))]
    since = dict.fromkeys(WORKERS, 0)
    last_weights = dict(since)
    averages, last_global = 0, 0

    def average(groups, weights):
        for group in groups:
            total = sum(weights[r] for r in group)
            for ps in zip(*(models[r].parameters() for r in group)):
                mean = sum(weights[r] * p.detach() for r, p in zip(group, ps)) / total
                for p in ps:
                    p.data.copy_(mean)

    for step in range(1, steps + 1):
        for r in WORKERS:
            opts[r].zero_grad()
            loss_of(models[r], *batch(r, step - 1)).backward()
            opts[r].step()
            since[r] += BATCH[r]
        if step % k1 == 0:
            averages += 1
            average(dcs, since)
            if averages % k2 == 0:  # the datacenters' averages, weighted by their samples
                average([WORKERS], since)
                last_global = step
            last_weights, since = dict(since), dict.fromkeys(WORKERS, 0)
    if last_global != steps:
        average([WORKERS], {r: since[r] or last_weights[r] for r in WORKERS})
    return [p.detach() for p in models[WORKERS[0]].parameters()]


@pytest.mark.parametrize("placement", ["workers", "servers"])
def test_fsa_worker_sides_train_as_one_process_on_the_whole_batch(placement, monkeypatch):
    got = train(FSA(optimizer=placement), 4, monkeypatch)
    want = fsa_reference(4)
    for r in WORKERS:
        for g, w in zip(got[r], want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want[0], model0()[0].weight)  # it trained


@pytest.mark.parametrize("steps", [8, 6])  # 6: close() makes one more, final, global average
def test_hfa_worker_side_averages_as_the_replay(steps, monkeypatch):
    got = train(HFA(k1=2, k2=2), steps, monkeypatch)
    want = hfa_reference(2, 2, steps)
    for r in WORKERS:
        for g, w in zip(got[r], want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # the replay's answer differs from FSA's and from a run without the final average
    assert not torch.allclose(want[0], fsa_reference(steps)[0])
    if steps == 6:
        assert not torch.allclose(want[0], hfa_reference(2, 2, 8)[0])


def test_each_algorithm_returns_its_worker_side():
    engine = object()  # these sides keep their engine until it calls them
    sides = [
        (FSA(), FSAWorker),
        (FSA(optimizer="servers"), FSAServersWorker),
        (MixedSync(), MixedWorker),
    ]  # fmt: skip
    for algo, cls in sides:
        assert type(algo.worker(engine)) is cls  # HFA's: the training tests above
    assert FSAServersWorker.servers_step and MixedWorker.servers_step
    assert not FSAWorker.servers_step and not HFAWorker.pushes_gradients


def test_where_the_optimizers_state_lives_is_each_algorithms_answer():
    """The questions geompi.state and geompi.optimizer ask, instead of the algorithm's kind:
    the servers hold the optimizer's state (and a GradScaler hands step() its state) where
    they step; each worker holds its own where it steps locally between averages (HFA)."""
    engine = object()
    for algo, servers, per_worker in [
        (FSA(), False, False),
        (FSA(optimizer="servers"), True, False),
        (MixedSync(), True, False),
        (HFA(), False, True),
    ]:
        side = algo.worker(engine) if not isinstance(algo, HFA) else object.__new__(HFAWorker)
        assert side.optimizer_state_on_servers is servers, algo
        assert side.takes_scaler_state is servers, algo
        assert algo.optimizer_state_per_worker is per_worker, algo
    assert not LocalEngine.optimizer_state_on_servers and not LocalEngine.takes_scaler_state


def test_force_global_average_and_options_are_the_algorithms_to_refuse():
    HFA().check_force_global()
    for algo in (FSA(), MixedSync()):
        with pytest.raises(ConfigError, match="force_global_average"):
            algo.check_force_global()
    with pytest.raises(ConfigError, match="WAN compression"):
        FSA().check_compression("topk")
    FSA(optimizer="servers").check_compression("topk")
    with pytest.raises(ConfigError, match="max_grad_norm with mixed"):
        MixedSync().check_clipping(1.0)
    FSA().check_clipping(1.0)
    HFA().check_clipping(1.0)
