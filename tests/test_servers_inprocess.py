"""Characterization tests of today's servers, in one process (issue 36 item 4).

A LocalServer per datacenter and two GlobalServer shards run as threads on the loopback world
(tests/loopback.py), with the communicators that ``build_communicators`` splits from it, and
the workers' side is geompi's own PSClient. Two datacenters of uneven size: 3 workers and 1.
Every expectation is computed here, independently of geompi: the weighted sums and averages by
hand, the optimizer steps by ``torch.optim`` on the whole (unsharded) key.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch

from geompi.comm.compression import make_compressor
from geompi.comm.topology import Role, Topology, build_communicators
from geompi.comm.transport import LAN, WAN, Link, LinkStats
from geompi.errors import NonFiniteError
from geompi.ps.client import PSClient
from geompi.ps.global_server import GlobalServer
from geompi.ps.local_server import LocalServer, SyncUplink
from geompi.ps.optim import DCASGD, SGD, Adam, spec_to_dict
from geompi.ps.protocol import (
    FLAG_GLOBAL,
    FLAG_MEAN,
    FLAG_PRESENCE,
    FLAG_RAW,
    FLAG_SCATTER,
    FLAG_SUM,
    Op,
    Round,
    presence_payload,
)
from geompi.ps.wan import TierCodec
from geompi.sync import FSA, HFA, Algorithm

try:
    from loopback import ANY_SOURCE, LoopbackError, LoopbackWorld, Status, run_ranks
except ImportError:  # tests/ imported as a package
    from tests.loopback import ANY_SOURCE, LoopbackError, LoopbackWorld, Status, run_ranks

DC_SIZES = (4, 2)  # DC 0: workers 0-2 + local server 3; DC 1: worker 4 + local server 5
G = 2  # global servers: ranks 6 and 7
TOPO = Topology.plan(sum(DC_SIZES) + G, dc_sizes=DC_SIZES, global_servers=G)
KEYS = [(0, 7), (1, 5)]  # odd sizes: the two shards differ (3 + 4 and 2 + 3 values)
WORKERS = TOPO.all_workers
WEIGHT = {r: float(1 + i) for i, r in enumerate(WORKERS)}  # uneven sample counts: 1, 2, 3, 4


def rand(*seed: int) -> list[torch.Tensor]:
    """One tensor per key, from ``seed``: a worker's gradient or parameters at some round."""
    gen = torch.Generator().manual_seed(hash(seed) % 2**31)
    return [torch.randn(n, generator=gen) for _, n in KEYS]


INIT = rand(0)  # the master worker's starting values


# --- running a job on the loopback world ------------------------------------------------------
def run_job(
    worker: Callable[[int, PSClient], object],
    *,
    algo: Algorithm | None = None,
    on_nonfinite: str = "abort",
    topo: Topology = TOPO,
    codec: str | None = None,
) -> tuple[dict[int, object], dict[int, LocalServer | GlobalServer]]:
    """Every rank of ``topo`` (TOPO, or the same with replicas) in a thread: the servers (with
    ``algo``'s policies, FSA's by default; ``codec``: the global tier's WAN codec) serve until
    STOP, each worker runs ``worker(rank, client)`` then stops. Returns the workers' results and
    the servers."""
    algo = algo or FSA()
    world = LoopbackWorld(topo.world_size)

    def tier_codec() -> TierCodec | None:
        return TierCodec(make_compressor(codec)) if codec else None

    servers: dict[int, LocalServer | GlobalServer] = {}

    def body(rank: int) -> Callable[[], object]:
        def run() -> object:
            comms = build_communicators(topo, world.comm(rank))
            stats = LinkStats()
            role = topo.role(rank)
            if role is Role.WORKER:
                client = PSClient(Link(comms.dc, LAN, stats))
                out = worker(rank, client)
                client.stop()
                return out
            if role is Role.LOCAL_SERVER:
                policy = algo.local_policy()
                up = SyncUplink(Link(comms.glob, WAN, stats), topo, codec=tier_codec())
                server = LocalServer(
                    comms, topo, stats, policy=policy, on_nonfinite=on_nonfinite, uplink=up
                )
            else:
                server = GlobalServer(
                    comms, topo, stats, codec=tier_codec(), policy=algo.global_policy()
                )
            servers[rank] = server
            server.run()
            return None

        return run

    results = run_ranks(world, {r: body(r) for r in range(topo.world_size)})
    return {r: results[r] for r in WORKERS}, servers


def round_trip(
    client: PSClient, op: Op, pushes: list[torch.Tensor], weight: float = 0.0, keys=KEYS, **kw
) -> list[torch.Tensor]:
    """One round of ``keys``: push ``pushes``, return what the local server answers."""
    outs = [torch.full((n,), float("nan")) for _, n in keys]
    reqs = client.start(op, keys, weight, **kw)
    for p in pushes:
        reqs.push(p)
    for o in outs:
        reqs.pull(o)
    reqs.wait()
    return outs


def init_round(rank: int, client: PSClient, spec: dict | None, keys=KEYS) -> list[torch.Tensor]:
    """As DistributedOptimizer does: the master pushes its values (and the spec), others 0
    (the keys of ``keys`` beyond KEYS, a mean and a presence key, zeros from everyone)."""
    master = rank == 0
    payload = json.dumps(spec).encode() if spec and master else None
    pushes = [v.clone() if master else torch.zeros_like(v) for v in INIT]
    pushes += [torch.zeros(n) for _, n in keys[len(INIT) :]]
    return round_trip(client, Op.INIT, pushes, spec=payload, keys=keys)[: len(INIT)]


def shards(servers: dict, key: int) -> list[torch.Tensor]:
    """The global servers' slices of ``key``, in shard order."""
    return [servers[r].values[key] for r in TOPO.global_servers]


def dc_members(dc: int) -> list[int]:
    return TOPO.workers(dc)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --- FSA: gradient rounds -----------------------------------------------------------------------
STEPS = 3


def grad(rank: int, step: int) -> list[torch.Tensor]:
    return rand(1, rank, step)


def fsa_worker(
    spec: dict | None, flags: int, dc0_flags: int = 0
) -> Callable[[int, PSClient], object]:
    """``dc0_flags``: added by datacenter 0's workers only (a datacenter's own choice)."""

    def work(rank: int, client: PSClient) -> list[list[torch.Tensor]]:
        seen = [init_round(rank, client, spec)]
        mine = flags | (dc0_flags if rank in dc_members(0) else 0)
        for step in range(STEPS):
            w = WEIGHT[rank]
            pushes = [g * w for g in grad(rank, step)]  # a worker pushes gradient x weight
            seen.append(round_trip(client, Op.GRAD, pushes, w, flags=mine))
        return seen

    return work


def weighted_sum(step: int, ranks: list[int]) -> list[torch.Tensor]:
    return [sum(grad(r, step)[i] * WEIGHT[r] for r in ranks) for i in range(len(KEYS))]


def torch_reference(make_opt: Callable, mean: bool) -> list[list[torch.Tensor]]:
    """The values after INIT and each step: torch.optim on the whole keys, stepping on the
    sample-weighted mean gradient of every worker (``mean``) or on the plain weighted sum."""
    params = [torch.nn.Parameter(v.clone()) for v in INIT]
    opt = make_opt(params)
    total = sum(WEIGHT.values())
    out = [[p.detach().clone() for p in params]]
    for step in range(STEPS):
        for p, g in zip(params, weighted_sum(step, WORKERS)):
            p.grad = g / total if mean else g
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


OPTIMIZERS = {
    "sgd-momentum": (
        SGD(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    ),
    "adam": (
        Adam(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("flags", [0, FLAG_SUM], ids=["mean", "sum"])
def test_fsa_servers_step_torch_optim_on_the_global_gradient(name: str, flags: int) -> None:
    """GeoMX's placement: the local servers sum their datacenter, the global servers sum the
    datacenters and step their shard with the optimizer of the INIT spec, on the weighted
    mean gradient (FLAG_SUM: on the plain sum); every worker gets the new values."""
    spec, make_opt = OPTIMIZERS[name]
    seen, servers = run_job(fsa_worker({"optimizer": spec_to_dict(spec)}, flags))
    want = torch_reference(make_opt, mean=not flags & FLAG_SUM)
    for rank in WORKERS:
        for got_step, want_step in zip(seen[rank], want):
            for got, exp in zip(got_step, want_step):
                close(got, exp)
    for i, (key, n) in enumerate(KEYS):
        parts = shards(servers, key)
        assert [p.numel() for p in parts] == [n // 2, n - n // 2]  # shard g: [g*n//G, (g+1)*n//G)
        close(torch.cat(parts), want[-1][i])
    assert [servers[r].updates for r in TOPO.global_servers] == [STEPS * len(KEYS)] * G


@pytest.mark.parametrize("scatter", [0, FLAG_SCATTER], ids=["funnel", "scatter"])
def test_fsa_raw_rounds_return_the_plain_weighted_sum(scatter: int) -> None:
    """The Python API's default (FLAG_RAW): the servers neither step nor average; every
    worker gets the sum over all workers of gradient x weight, and steps itself. With
    FLAG_SCATTER, datacenter 0's three workers reduce-scatter among themselves first and each
    pushes one summed slice (PSClient); datacenter 1's one worker pushes as before."""
    seen, servers = run_job(fsa_worker(None, FLAG_RAW, dc0_flags=scatter))
    for rank in WORKERS:
        assert all(torch.equal(a, b) for a, b in zip(seen[rank][0], INIT))
        for step in range(STEPS):
            for got, exp in zip(seen[rank][1 + step], weighted_sum(step, WORKERS)):
                close(got, exp)
    for i, (key, _) in enumerate(KEYS):  # the global servers hold the last sum
        close(torch.cat(shards(servers, key)), weighted_sum(STEPS - 1, WORKERS)[i])


def test_nonfinite_datacenter_is_skipped_or_aborts() -> None:
    """--on-nonfinite skip: a datacenter whose sum holds a NaN sends weight 0 and the global
    servers step on the other datacenter's mean gradient alone; the default aborts, naming it."""
    lr = 0.5
    spec = {"optimizer": spec_to_dict(SGD(lr=lr))}

    def work(rank: int, client: PSClient) -> list[torch.Tensor]:
        init_round(rank, client, spec)
        pushes = [g * WEIGHT[rank] for g in grad(rank, 0)]
        if rank == dc_members(1)[0]:
            pushes[1][2] = float("nan")
        return round_trip(client, Op.GRAD, pushes, WEIGHT[rank])

    seen, servers = run_job(work, on_nonfinite="skip")
    dc0 = dc_members(0)
    w0 = sum(WEIGHT[r] for r in dc0)
    for rank in WORKERS:
        for v, g, got in zip(INIT, weighted_sum(0, dc0), seen[rank]):
            close(got, v - lr * g / w0)
    assert [servers[TOPO.local_server(d)].skipped for d in (0, 1)] == [0, 1]
    with pytest.raises(AssertionError, match=r"rank 5 failed: NonFiniteError: non-finite gra") as e:
        run_job(work)  # rank 5: datacenter 1's local server
    assert isinstance(e.value.__cause__, NonFiniteError)


# Presence (FSA with the optimizer on the servers): key 0 holds parameters "a" (4 values, across
# both shards) and "b" (3), key 1 holds "c" (5); the presence key counts, per global server, the
# workers with a gradient for each parameter.
LAYOUT = [[0, [["a", 0, 4], ["b", 4, 3]]], [1, [["c", 0, 5]]]]
PKEY, NPARAMS, MKEY = 99, 3, 98
ABSENT = {1: {"b": "all", "a": "some"}}  # step 1: no worker has b; only worker 0 has a


def has_grad(rank: int, step: int, name: str) -> bool:
    absent = ABSENT.get(step, {}).get(name)
    return absent is None or (absent == "some" and rank == WORKERS[0])


def sparse_grad(rank: int, step: int) -> list[torch.Tensor]:
    """grad() with zeros where this worker has no gradient, as its buckets hold them."""
    g = grad(rank, step)
    for i, params in LAYOUT:
        for name, off, n in params:
            if not has_grad(rank, step, name):
                g[i][off : off + n] = 0.0
    return g


def buffers(rank: int, step: int) -> torch.Tensor:
    """A worker's BatchNorm-like buffers after a step (the mean key, FLAG_MEAN)."""
    return rand(4, rank, step)[1][:3]


def test_fsa_servers_skip_parameters_no_worker_has_a_gradient_for() -> None:
    """FLAG_PRESENCE: a parameter that no worker produced a gradient for is left alone by the
    global servers, momentum included, as torch.optim leaves a parameter whose grad is None; one
    that some workers have is stepped on the sum over all workers / the total weight.
    FLAG_MEAN: the key before presence holds buffers x weight; the servers answer their
    sample-weighted mean and never step it."""
    spec = {"optimizer": spec_to_dict(SGD(lr=0.1, momentum=0.9)), "layout": LAYOUT}
    spec["presence_key"] = PKEY
    keys = KEYS + [(MKEY, 3), (PKEY, G * NPARAMS)]
    names = [name for _, params in LAYOUT for name, *_ in params]

    def work(rank: int, client: PSClient) -> list[torch.Tensor]:
        init_round(rank, client, spec, keys)
        for step in range(STEPS):
            w = WEIGHT[rank]
            counts = torch.tensor([float(has_grad(rank, step, n)) for n in names]).repeat(G)
            pushes = [g * w for g in sparse_grad(rank, step)] + [buffers(rank, step) * w]
            pushes.append(presence_payload(counts))
            flags = FLAG_PRESENCE | FLAG_MEAN
            out = round_trip(client, Op.GRAD, pushes, w, flags=flags, keys=keys)
        return out[:-1]

    seen, servers = run_job(work)
    split = {"a": INIT[0][:4], "b": INIT[0][4:], "c": INIT[1]}
    model = {n: torch.nn.Parameter(v.clone()) for n, v in split.items()}
    opt = torch.optim.SGD(model.values(), lr=0.1, momentum=0.9)
    total = sum(WEIGHT.values())
    for step in range(STEPS):
        g = [sum(sparse_grad(r, step)[i] * WEIGHT[r] for r in WORKERS) / total for i in (0, 1)]
        by_name = {"a": g[0][:4], "b": g[0][4:], "c": g[1]}
        for n, p in model.items():
            here = any(has_grad(r, step, n) for r in WORKERS)
            p.grad = by_name[n] if here else None
        opt.step()
    want = [torch.cat([model["a"], model["b"]]).detach(), model["c"].detach()]
    want.append(sum(buffers(r, STEPS - 1) * WEIGHT[r] for r in WORKERS) / total)
    assert not torch.equal(want[0][4:], INIT[0][4:])  # b moved at the other steps
    for rank in WORKERS:
        for got, exp in zip(seen[rank], want):
            close(got, exp)
    for i, (key, _) in enumerate(keys[:-1]):
        close(torch.cat(shards(servers, key)), want[i])


# --- HFA: parameter averages --------------------------------------------------------------------
def params(rank: int, rnd: int) -> list[torch.Tensor]:
    """A worker's parameters at datacenter round ``rnd`` (as if after its K1 local steps)."""
    return rand(2, rank, rnd)


def hfa_worker(
    spec: dict | None, forced: set[int], rounds: int
) -> Callable[[int, PSClient], object]:
    def work(rank: int, client: PSClient) -> list[list[torch.Tensor]]:
        init_round(rank, client, spec)
        seen = []
        for rnd in range(1, rounds + 1):
            w = WEIGHT[rank]
            flags = FLAG_GLOBAL if rnd in forced else 0
            pushes = [p * w for p in params(rank, rnd)]
            seen.append(round_trip(client, Op.AVG, pushes, w, flags=flags))
        return seen

    return work


def weighted_average(rnd: int, ranks: list[int]) -> list[torch.Tensor]:
    total = sum(WEIGHT[r] for r in ranks)
    return [sum(params(r, rnd)[i] * WEIGHT[r] for r in ranks) / total for i in range(len(KEYS))]


@pytest.mark.parametrize(
    "outer",
    [None, {"name": "sgd", "lr": 0.6}, {"name": "nesterov", "lr": 0.7}],
    ids=["average", "outer-sgd", "outer-nesterov"],
)
def test_hfa_datacenter_average_and_every_k2th_global_outer_step(outer: dict | None) -> None:
    """K2 = 3, the workers force round 2 global (FLAG_GLOBAL, as close() does), which starts
    the count again: rounds 2 and 5 are global. A datacenter round answers the datacenter's
    sample-weighted average; a global one the global servers' model after the outer step on the
    pseudo-gradient (model - global weighted average), as DiLoCo: torch.optim.SGD here, Nesterov
    momentum 0.9 for "nesterov" (no outer spec: the average itself)."""
    rounds, forced, k2 = 6, {2}, 3
    work = hfa_worker({"outer": outer} if outer else None, forced, rounds)
    seen, servers = run_job(work, algo=HFA(k1=1, k2=k2))
    model = [torch.nn.Parameter(v.clone()) for v in INIT]
    nesterov = bool(outer) and outer["name"] == "nesterov"
    lr = outer["lr"] if outer else 1.0
    opt = torch.optim.SGD(model, lr=lr, momentum=0.9 if nesterov else 0.0, nesterov=nesterov)
    global_rounds = []
    for rnd in range(1, rounds + 1):
        is_global = rnd in (2, 5)
        if is_global:
            global_rounds.append(rnd)
            for m, avg in zip(model, weighted_average(rnd, WORKERS)):
                m.grad = m.detach() - avg
            opt.step()
        for dc in (0, 1):
            want = model if is_global else weighted_average(rnd, dc_members(dc))
            for rank in dc_members(dc):
                for got, exp in zip(seen[rank][rnd - 1], want):
                    close(got, exp.detach())
    assert global_rounds == [2, 5]
    for i, (key, _) in enumerate(KEYS):
        close(torch.cat(shards(servers, key)), model[i].detach())


# --- replicated global servers: each shard mirrored, exactly, by the next server --------------
REPLICATED = dataclasses.replace(TOPO, replicas=2)


def assert_mirrors_exact(servers: dict) -> None:
    """Every global server's mirror holds exactly (bitwise) what the server it mirrors holds:
    values, optimizer state, the policy's state (HFA's outer momentum), the update count and
    the WAN codec's replicas; and a mirror sends nothing (only the shard's own server answers,
    or the workers would see two results)."""
    ranks = REPLICATED.global_servers
    for g, r in enumerate(ranks):
        owner = servers[ranks[REPLICATED.mirrored_shard(g)]]
        mirror = servers[r].mirror
        assert mirror is not None and mirror.index == owner.index != g
        assert mirror.updates == owner.updates > 0
        assert_same_tree(mirror.values, owner.values)
        if owner.optimizer is not None:
            assert_same_tree(mirror.optimizer.state_dict(), owner.optimizer.state_dict())
        assert_same_tree(mirror.policy.state_dict(), owner.policy.state_dict())
        if owner.codec is not None:
            assert owner.codec.replica
            assert_same_tree(mirror.codec.replica, owner.codec.replica)


def assert_same_tree(a, b) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), (sorted(a), sorted(b))
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), (a, b)
    else:
        assert a == b


CLIP = {"max_grad_norm": 0.5}  # binds on these gradients: every shard takes one factor


@pytest.mark.parametrize("codec", [None, "topk:0.5"], ids=["plain", "topk"])
def test_fsa_adam_with_clipping_mirrored_exactly_and_answered_once(codec: str | None) -> None:
    """FSA with Adam on the servers and clipping (one factor over every shard): with replicas,
    each shard's mirror steps the same slices to the same bits, the workers see what they see
    without replicas (the mirror answers nothing), and each local server sends every slice
    twice."""
    spec = {"optimizer": spec_to_dict(OPTIMIZERS["adam"][0]), **CLIP}
    seen, servers = run_job(fsa_worker(spec, 0), topo=REPLICATED, codec=codec)
    plain, alone = run_job(fsa_worker(spec, 0), codec=codec)
    assert_mirrors_exact(servers)
    for rank in WORKERS:
        for got_step, want_step in zip(seen[rank], plain[rank]):
            for got, want in zip(got_step, want_step):
                assert torch.equal(got, want)
    ls = REPLICATED.local_server(0)
    assert servers[ls].stats.sent[WAN] - servers[ls].stats.control[WAN] == 2 * (
        alone[ls].stats.sent[WAN] - alone[ls].stats.control[WAN]
    )


@pytest.mark.parametrize("codec", [None, "topk:0.5"], ids=["plain", "topk"])
def test_hfa_outer_nesterov_mirrored_exactly(codec: str | None) -> None:
    """HFA, K2 = 3 with a forced global round, outer Nesterov momentum on the servers: the
    mirrors hold the same model and momentum after datacenter and global rounds (with a lossy
    codec: the same codec replicas, which exact rounds read)."""
    outer = {"outer": {"name": "nesterov", "lr": 0.7}}
    work = hfa_worker(outer, {2}, 6)
    seen, servers = run_job(work, algo=HFA(k1=1, k2=3), topo=REPLICATED, codec=codec)
    plain, _ = run_job(work, algo=HFA(k1=1, k2=3), codec=codec)
    assert_mirrors_exact(servers)
    assert any(servers[r].policy.state_dict() for r in REPLICATED.global_servers)
    for rank in WORKERS:
        for got_round, want_round in zip(seen[rank], plain[rank]):
            for got, want in zip(got_round, want_round):
                assert torch.equal(got, want)


# --- MixedSync's policy: DCASGD on a global server ---------------------------------------------
def test_mixed_dcasgd_policy_on_a_global_server_against_a_hand_replay() -> None:
    """MixedSync's one-sided windows (MPI.Win: tickets, slots, the cut) are beyond the loopback;
    its policy is not: a global server set up by a real INIT round (DCASGD spec) applies the
    datacenters' deposits, in the order they arrive, with delay compensation against the value
    each datacenter last pulled. Replayed by hand: w -= lr * (g + lam * g*g * (w - w_bak[d]))."""
    lr, lam = 0.3, 0.5
    spec = {"optimizer": spec_to_dict(DCASGD(lr=lr, lam=lam))}
    _, servers = run_job(lambda rank, client: init_round(rank, client, spec))
    gs = servers[TOPO.global_servers[1]]
    key, n = KEYS[0]
    lo, hi = TOPO.shard_bounds(n, 1)
    w = INIT[0][lo:hi].clone()
    assert torch.equal(gs.values[key], w)
    backup = {d: w.clone() for d in (0, 1)}  # every datacenter pulled the INIT values
    for d in (0, 1):
        gs.optimizer.pulled(key, d, gs.values[key])
    arrivals = [0, 0, 1, 0, 1, 1]  # datacenter 1 deposits on a stale model, twice
    for t, d in enumerate(arrivals):
        weight = 2.0 + d
        g = rand(3, t)[0][lo:hi]
        gs.apply(Round(Op.GRAD, 0, [(key, n)], weight), key, (g * weight).clone(), weight, dc=d)
        w = w - lr * (g + lam * g * g * (w - backup[d]))
        backup[d] = w.clone()
        close(gs.values[key], w)


# --- the loopback itself ------------------------------------------------------------------------
def test_loopback_matches_in_order_copies_at_send_and_allows_short_messages() -> None:
    world = LoopbackWorld(3)
    a, b, c = (world.comm(r) for r in range(3))
    buf = np.arange(4, dtype=np.float32)
    a.Isend(buf, 2, tag=5)
    buf[:] = -1  # the send copied it when posted
    b.Isend(np.full(2, 7.0, dtype=np.float32), 2, tag=5)
    a.Isend(np.full(4, 9.0, dtype=np.float32), 2, tag=5)
    first, second, third = (np.zeros(4, dtype=np.float32) for _ in range(3))
    status = Status()
    c.Irecv(first, 0, 5).Wait()  # from rank 0: its first message, not rank 1's
    assert first.tolist() == [0, 1, 2, 3]
    c.Irecv(second, ANY_SOURCE, 5).Wait(status)  # the earliest left: rank 1's, 8 bytes
    assert second.tolist() == [7, 7, 0, 0] and (status.source, status.count) == (1, 8)
    posted = c.Irecv(third, 0, 5)
    assert posted.Test() and third.tolist() == [9, 9, 9, 9]
    late = c.Irecv(third, 1, 6)  # posted before the message: completes when it comes
    assert not late.Test() and not c.Iprobe(1, 6)
    b.Isend(np.ones(8, dtype=np.float32), 2, tag=6)
    with pytest.raises(LoopbackError, match="truncated: a message of 32 bytes for a 16-byte"):
        late.Wait()


def test_loopback_reports_a_stuck_rank_instead_of_hanging() -> None:
    world = LoopbackWorld(2, timeout=30.0)

    def waits_forever() -> None:
        world.comm(1).Irecv(np.zeros(1), 0, 77).Wait()

    with pytest.raises(AssertionError, match=r"ranks \[1\] still running.*rank 1 <-> 0 tag 77"):
        run_ranks(world, {0: lambda: None, 1: waits_forever}, timeout=0.5)
    quick = LoopbackWorld(2, timeout=0.3)
    with pytest.raises(AssertionError, match="rank 1 failed: LoopbackError: no message in 0.3 s"):
        run_ranks(quick, {0: lambda: None, 1: lambda: quick.comm(1).Irecv(np.zeros(1), 0).Wait()})
