"""What a restore hands the global servers (geompi/state.py: ``held_in_file`` for a file,
``split_held`` for a state dict), in one process: the algorithm's own rule (``on_restore``:
DCASGD restarts every datacenter's backup from the model) and the refusal of an outer
optimizer's state that this run's servers do not keep. Real checkpoint files and algorithm
objects; the engine is a plain namespace of the attributes these functions read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from geompi import ckpt
from geompi.errors import ConfigError
from geompi.state import OUTER_KEY, held_in_file, split_held
from geompi.sync import FSA, HFA, MixedSync


def _net() -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _engine(algo, *, on_servers: bool, keeps: bool, net=None) -> SimpleNamespace:
    net = net or _net()
    names = [n for n, _ in net.named_parameters()]
    return SimpleNamespace(
        algo=algo,
        optimizer_state_on_servers=on_servers,
        holds_server_state=keeps,
        model=net,
        param_names=lambda: names,
    )


def _file(tmp_path, algorithm: dict, name: str) -> ckpt.Checkpoint:
    model = {n: p.detach().clone() for n, p in _net().named_parameters()}
    return ckpt.load(ckpt.save(tmp_path / "c.h5", model=model, algorithm=algorithm,
                               algorithm_name=name))  # fmt: skip


def test_dcasgd_backups_restart_from_the_model_and_other_algorithms_keep_the_file(tmp_path):
    model = {n: p.detach() for n, p in _net().named_parameters()}
    old = {"dc0": {n: t + 1.0 for n, t in model.items()}}  # what datacenter 0 fetched long ago
    ck = _file(tmp_path, {"dcasgd": {"backup": old}}, "mixed")
    held = held_in_file(ck, _engine(MixedSync(dcasgd=True), on_servers=True, keeps=True))
    assert held["algorithm"]["dcasgd"] == {"backup": True}  # rebuilt from /model, not read
    assert set(held["model"]) == set(model)
    kept = held_in_file(ck, _engine(MixedSync(), on_servers=True, keeps=True))
    assert set(kept["algorithm"]["dcasgd"]["backup"]) == {"dc0"}  # as the file holds it
    assert isinstance(ck.algorithm["dcasgd"]["backup"], dict)  # the file's own is untouched
    assert held_in_file(ck, _engine(FSA(), on_servers=False, keeps=False))["optimizer"] == {}


def test_an_outer_state_the_servers_do_not_keep_is_refused_from_a_file(tmp_path):
    names = [n for n, _ in _net().named_parameters()]
    momentum = {n: torch.ones(3) for n in names}
    ck = _file(tmp_path, {"hfa": {"outer_momentum": momentum}}, "hfa")
    plain = HFA(k1=2, k2=2)  # its servers average: they keep no outer state
    with pytest.raises(ConfigError, match="the file holds an outer optimizer's state, but this"):
        held_in_file(ck, _engine(plain, on_servers=False, keeps=False))
    nesterov = HFA(k1=2, k2=2, outer_optimizer="nesterov", outer_lr=0.7)
    held = held_in_file(ck, _engine(nesterov, on_servers=False, keeps=True), names)
    assert set(held["algorithm"]["hfa"]["outer_momentum"]) == set(names)


def test_a_state_dict_gives_dcasgd_the_model_and_refuses_an_outer_state_kept_nowhere():
    net = _net()
    sd = {"state": {0: {"meansquare": torch.ones(3, 4)}}, "param_groups": []}
    held, kept = split_held(
        _engine(MixedSync(dcasgd=True), on_servers=True, keeps=True, net=net), sd
    )
    assert held["algorithm"]["dcasgd"] == {"backup": True}
    for name, p in net.named_parameters():
        assert torch.equal(held["model"][name], p.detach())
    assert kept["state"] == {}  # the servers step: the workers keep none
    held, _ = split_held(_engine(MixedSync(), on_servers=True, keeps=True, net=net), sd)
    assert held["algorithm"] == {} and held["model"] == {}
    with pytest.raises(ConfigError, match="the optimizer state holds an outer optimizer's"):
        split_held(_engine(HFA(), on_servers=False, keeps=False), {OUTER_KEY: {0: 1.0}})
