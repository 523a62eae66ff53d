"""geompi.load refuses an optimizer JSON or counters edited in the file (issue 35 item 6).

The attributes carry no checksum, so an edit passes ``verify``; each one here gave, before,
an uncaught KeyError/TypeError, or was accepted (lr NaN, -1e30, 3e38, betas "xy", step 2**62).
Now every one is a CheckpointError of one line that names the file, and the model and the
optimizer are left as they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import geompi
from geompi.errors import CheckpointError


def _trained(kind: str = "adam") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    if kind == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    return net, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    net, opt = _trained()
    return geompi.save(tmp_path_factory.mktemp("ck") / "a.h5", model=net, optimizer=opt, step=4)


def _redigest(f: h5py.File) -> None:
    """An edit that passes verify: the datasets' sha256 and the file's content_sha256 made
    again (what a deliberate edit does; the JSON checks stand behind the checksums)."""
    from geompi.ckpt.format import DATA_DIGEST_ATTR, DIGEST_ATTR, content_digest, data_digest

    def visit(_name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and DATA_DIGEST_ATTR in obj.attrs:
            obj.attrs[DATA_DIGEST_ATTR] = np.bytes_(data_digest(obj[()]).encode())

    f.visititems(visit)
    f.attrs[DIGEST_ATTR] = np.bytes_(content_digest(f).encode())


def _group(path: Path, **changes) -> str:
    with h5py.File(path) as f:
        (g,) = json.loads(f["optimizer"].attrs["param_groups"])
    return json.dumps([{**g, **changes}])


def _without_params(path: Path) -> str:
    with h5py.File(path) as f:
        (g,) = json.loads(f["optimizer"].attrs["param_groups"])
    del g["params"]
    return json.dumps([g])


NAN = float("nan")
# (what, attribute, new value or a function of the file, words of the refusal)
EDITS = [
    ("groups an object", "param_groups", "{}", "not a list of JSON objects"),
    ("a group a number", "param_groups", "[1]", "not a list of JSON objects"),
    ("groups unreadable", "param_groups", "[{", "not readable JSON"),
    ("no params", "param_groups", _without_params, "param group 0 holds None"),
    ("an unknown param", "param_groups", lambda p: _group(p, params=["weight", "x"]), "holds"),
    ("params a string", "param_groups", lambda p: _group(p, params="weight"), "holds 'weight'"),
    ("lr a string", "param_groups", lambda p: _group(p, lr="abc"), "lr='abc': not a number"),
    ("lr NaN", "param_groups", lambda p: _group(p, lr=NAN), "lr=nan: not a finite number"),
    ("lr -1e30", "param_groups", lambda p: _group(p, lr=-1e30), "lr=-1e+30: outside"),
    ("lr 3e38", "param_groups", lambda p: _group(p, lr=3e38), "lr=3e+38: outside"),
    ("betas xy", "param_groups", lambda p: _group(p, betas="xy"), "betas='xy'"),
    ("one beta", "param_groups", lambda p: _group(p, betas=[0.9]), "2 values expected"),
    ("beta 1", "param_groups", lambda p: _group(p, betas=[0.9, 1.0]), "below 1"),
    ("eps an object", "param_groups", lambda p: _group(p, eps={}), "eps={}: not a number"),
    ("amsgrad a string", "param_groups", lambda p: _group(p, amsgrad="yes"), "true or false"),
    ("a scheduler key NaN", "param_groups", lambda p: _group(p, initial_lr=NAN), "initial_lr"),
    ("none_states a number", "none_states", "5", "none_states is not a list"),
    ("none_states of no param", "none_states", '[["x", "step"]]', "names 'x'"),
    ("number_states of no state", "number_states", '[["weight", "x", "int"]]', "not valid"),
    ("number_states of a kind", "number_states", '[["weight", "step", "cplx"]]', "not valid"),
]


@pytest.mark.parametrize("what, attr, value, words", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_optimizer_json_is_one_line_naming_the_file(
    saved, tmp_path, what, attr, value, words
):
    path = tmp_path / "edited.h5"
    shutil.copy(saved, path)
    new = value(path) if callable(value) else value
    with h5py.File(path, "r+") as f:
        f["optimizer"].attrs[attr] = np.bytes_(new.encode())  # fixed-length, as geompi writes
        _redigest(f)
    net, opt = _trained()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(CheckpointError) as exc:
        geompi.load(path, model=net, optimizer=opt)
    msg = str(exc.value)
    assert words in msg and msg.startswith(f"{path}: ") and "\n" not in msg, msg
    assert opt.param_groups[0]["lr"] == lr  # nothing half-restored
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize("where", ["the file's step", "the file's epoch", "Adam's step"])
@pytest.mark.parametrize("value", [2**62, -1])
def test_absurd_counters_are_refused(saved, tmp_path, where, value):
    """A step of 2**62 resumed and "finished" without training, exit 0."""
    path = tmp_path / "edited.h5"
    shutil.copy(saved, path)
    with h5py.File(path, "r+") as f:
        if where == "Adam's step":
            f["optimizer/step/weight"][...] = float(value)
        else:
            f.attrs[where.split()[-1]] = value
        _redigest(f)
    net, opt = _trained()
    with pytest.raises(CheckpointError, match="a counter is an integer from 0") as exc:
        geompi.load(path, model=net, optimizer=opt)
    assert str(exc.value).startswith(f"{path}: ")
    if where != "Adam's step":  # the model alone reads the file's counters too
        with pytest.raises(CheckpointError, match="a counter"):
            geompi.load(path, model=net)


def test_non_finite_optimizer_state_is_refused(tmp_path):
    net, opt = _trained("sgd")
    path = geompi.save(tmp_path / "a.h5", model=net, optimizer=opt, step=1)
    with h5py.File(path, "r+") as f:
        f["optimizer/momentum_buffer/bias"][0] = float("inf")
        _redigest(f)
    net, opt = _trained("sgd")
    with pytest.raises(CheckpointError, match="momentum_buffer of bias is not finite"):
        geompi.load(path, model=net, optimizer=opt)


def test_a_good_file_with_a_scheduler_and_two_groups_loads(tmp_path):
    """What the checks let through: scheduler keys (initial_lr), a second group, betas."""
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW([{"params": [net.weight]}, {"params": [net.bias], "lr": 0.5}])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.01, 0.5], total_steps=10)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    path = geompi.save(tmp_path / "a.h5", model=net, optimizer=opt, step=1)
    opt2 = torch.optim.AdamW([{"params": [net.weight]}, {"params": [net.bias], "lr": 0.5}])
    assert geompi.load(path, model=net, optimizer=opt2)["step"] == 1
    assert opt2.param_groups[1]["initial_lr"] == opt.param_groups[1]["initial_lr"]
