"""Streaming HFA's keys cut at the model's equal fractions (issue #14: peak WAN bytes per round
<= 1/F of HFA's). Single process: real buckets, topology and checkpoint files; only the worker
object around them is a plain namespace (``Checkpointing`` needs its buckets and topology)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from geompi import ckpt
from geompi.checkpointing import Checkpointing
from geompi.comm.buckets import Buckets
from geompi.comm.topology import Topology
from geompi.ps.fragments import fragment_plan
from geompi.sync import FSA

# what server_states asks of the engine: its servers step and keep the state
_ENGINE = SimpleNamespace(
    optimizer_state_on_servers=True, holds_server_state=True, algo=FSA(optimizer="servers")
)


def _net() -> torch.nn.Module:
    """Uneven parameter sizes (7 to 816 values), so that equal fractions fall inside them."""
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Embedding(51, 16), torch.nn.Linear(16, 33), torch.nn.Linear(33, 7)
    )


def _flat(named: dict[str, torch.Tensor], net: torch.nn.Module) -> torch.Tensor:
    """The values laid end to end in reverse parameter order, written out here."""
    names = [n for n, _ in net.named_parameters()][::-1]
    return torch.cat([named[n].reshape(-1) for n in names])


@pytest.mark.parametrize("fragments, cap", [(2, 1 << 20), (3, 400), (4, 64), (7, 1000)])
def test_keys_cut_at_equal_fractions(fragments, cap):
    net = _net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    buckets = Buckets(list(net.named_parameters()), cap, fragments)
    total = sum(t.numel() for t in before.values())
    starts = [0]
    for b in buckets:
        starts.append(starts[-1] + b.numel)
        # within the cap, unless the key is (part of) one parameter
        assert b.numel * 4 <= cap or len(b.members) == 1, (b.key, b.numel)
    assert {total * f // fragments for f in range(fragments + 1)} <= set(starts)
    # the values are unchanged, every parameter a view of the keys
    flat = torch.cat([b.params for b in buckets])
    assert torch.equal(flat, _flat(before, net))
    with torch.no_grad():
        for b in buckets:
            b.params.add_(float(b.key + 1))
    added = torch.cat([torch.full((b.numel,), float(b.key + 1)) for b in buckets])
    after = {n: p.detach() for n, p in net.named_parameters()}
    assert torch.equal(_flat(after, net), _flat(before, net) + added)
    # the LAN's fragments are the equal fractions: the peak is ceil(N / F) values
    plan = fragment_plan(buckets.keys, fragments)
    per = [sum(n for k, n in buckets.keys if plan[k] == f) for f in range(fragments)]
    assert per == [total * (f + 1) // fragments - total * f // fragments for f in range(fragments)]
    cut = [m for b in buckets for m in b.members if not m.whole]
    assert cut, "no parameter straddles a fraction: the test model does not test cutting"
    assert all(id(m.param) not in buckets.where for m in cut)  # gradients: whole ones only


def test_checkpoint_state_of_cut_parameters_round_trips(tmp_path):
    """A checkpoint's per-name state goes to each global server as its slice of every key
    (compared with slices of the flat state, cut here by hand), and the servers' slices come
    back as the same per-name tensors: a vector state every parameter has (one flat tensor
    per key), one a parameter lacks and a scalar one (``{name: piece}`` per key), and HFA's
    outer momentum, with parameters cut across keys and 2 global servers."""
    net = _net()
    names = [n for n, _ in net.named_parameters()]
    gen = torch.Generator().manual_seed(4)
    model = {n: p.detach().clone() for n, p in net.named_parameters()}

    def noise():
        return {n: torch.randn(t.shape, generator=gen) for n, t in model.items()}

    partial = noise()
    del partial[names[-1]]  # a parameter torch never stepped has no state
    optimizer = {
        "exp_avg": noise(),
        "partial": partial,
        "step": {n: torch.tensor(float(i + 3)) for i, n in enumerate(names)},
    }
    momentum = noise()
    path = ckpt.save(
        tmp_path / "c.h5",
        model=model,
        optimizer=optimizer,
        algorithm={"hfa": {"outer_momentum": momentum}},
        step=8,
        algorithm_name="hfa",
    )
    topo = Topology.plan(7, dc_sizes=(3, 2), global_servers=2)
    buckets = Buckets(list(_net().named_parameters()), 400, 3)
    assert any(not m.whole for b in buckets for m in b.members)
    cp = Checkpointing(SimpleNamespace(buckets=buckets, topo=topo, engine=_ENGINE))
    cp.loaded = ckpt.load(path)
    states = cp.server_states()
    starts = {b.key: sum(c.numel for c in buckets.buckets[: b.key]) for b in buckets}
    flat_avg, flat_mom = _flat(optimizer["exp_avg"], net), _flat(momentum, net)
    for g, st in enumerate(states):
        for b in buckets:
            lo, hi = topo.shard_bounds(b.numel, g)
            at = starts[b.key]
            assert torch.equal(st["state"][b.key]["exp_avg"], flat_avg[at + lo : at + hi])
            assert torch.equal(st["outer"][b.key]["outer_momentum"], flat_mom[at + lo : at + hi])
    snaps = [
        {
            "values": {b.key: b.params[slice(*topo.shard_bounds(b.numel, g))] for b in buckets},
            "state": st["state"],
            "outer": st["outer"],
            "updates": 1,
        }
        for g, st in enumerate(states)
    ]
    got_model, got_opt, got_alg = cp.held.assemble(snaps)
    for n in names:
        assert torch.equal(got_model[n], model[n]), n
        assert torch.equal(got_opt["exp_avg"][n], optimizer["exp_avg"][n]), n
        assert torch.equal(got_opt["step"][n], optimizer["step"][n]), n
        assert torch.equal(got_alg["hfa"]["outer_momentum"][n], momentum[n]), n
    assert sorted(got_opt["partial"]) == sorted(partial)
    for n, t in partial.items():
        assert torch.equal(got_opt["partial"][n], t), n


def test_more_fragments_than_values_is_one_line():
    """Issue 35 item 8: fragments beyond the model's values were dropped without a word (or,
    past a round's keys, a traceback)."""
    from geompi.errors import ConfigError

    net = torch.nn.Linear(3, 2)  # 8 values
    Buckets(list(net.named_parameters()), 1 << 20, 8)
    with pytest.raises(ConfigError) as exc:
        Buckets(list(torch.nn.Linear(3, 2).named_parameters()), 1 << 20, 9)
    assert str(exc.value) == (
        "streaming HFA with 9 fragments of a model of 8 values: at most one fragment per "
        "value; use 8 or fewer fragments"
    )
