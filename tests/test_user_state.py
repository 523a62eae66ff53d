"""geompi.save(state=...) / geompi.load(state=...): what a script keeps beside its model, in one
process (the per-worker part under mpirun is in tests/test_api_resume_mpi.py)."""

import random

import h5py
import numpy as np
import pytest
import torch

import geompi
from geompi.errors import CheckpointError, ConfigError


def _setup():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return net, opt, sched, scaler


def _step(net, opt, sched):
    opt.zero_grad()
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()


def test_a_resumed_loop_continues_exactly_with_its_scheduler_scaler_and_rngs(tmp_path):
    """Save after 3 steps with the scheduler, the scaler, every RNG and plain values; a new
    script loads them and its next 3 steps (random batches included) equal the uninterrupted
    run's, bitwise."""
    net, opt, sched, scaler = _setup()
    random.seed(1)
    np.random.seed(2)
    for _ in range(3):
        _step(net, opt, sched)
    scaler.scale(torch.tensor(1.0))  # the scale exists from the first use
    scaler.update(new_scale=77.0)
    keep = {
        "sched": sched,
        "scaler": scaler,
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.get_state(),
        "py_rng": random.getstate(),
        "epoch": 3,
        "best": float("inf"),
        "note": "warm",
        "history": [0.5, (1, 2), {"a": None}],
        "by_id": {3: "three"},
    }
    geompi.save(tmp_path / "c.h5", model=net, optimizer=opt, state=keep)
    draws = (random.random(), float(np.random.rand()))
    for _ in range(3):
        _step(net, opt, sched)
    whole = {k: v.clone() for k, v in net.state_dict().items()}

    net2, opt2, sched2, scaler2 = _setup()
    torch.manual_seed(123)  # anything: the file's RNG states replace these
    random.seed(9)
    np.random.seed(9)
    state = {"sched": sched2, "scaler": scaler2}
    info = geompi.load(tmp_path / "c.h5", model=net2, optimizer=opt2, state=state)
    rest = info["state"]
    torch.set_rng_state(rest["torch_rng"])
    np.random.set_state(rest["np_rng"])
    random.setstate(rest["py_rng"])
    assert (random.random(), float(np.random.rand())) == draws
    assert scaler2.get_scale() == 77.0 and sched2.last_epoch == 3
    assert rest["epoch"] == 3 and rest["best"] == float("inf") and rest["note"] == "warm"
    assert rest["history"] == [0.5, (1, 2), {"a": None}] and rest["by_id"] == {3: "three"}
    for _ in range(3):
        _step(net2, opt2, sched2)
    for k, v in net2.state_dict().items():
        assert torch.equal(v, whole[k]), k


def test_plain_entries_are_replaced_in_place_and_a_missing_name_is_one_line(tmp_path):
    net, opt, *_ = _setup()
    geompi.save(tmp_path / "c.h5", model=net, state={"epoch": 7})
    state = {"epoch": 0}
    geompi.load(tmp_path / "c.h5", model=net, state=state)
    assert state == {"epoch": 7}
    with pytest.raises(CheckpointError, match="holds no saved state 'sampler'"):
        geompi.load(tmp_path / "c.h5", model=net, state={"sampler": None})


def test_what_cannot_be_saved_is_refused_naming_it(tmp_path):
    net, *_ = _setup()
    with pytest.raises(ConfigError, match=r"cannot save state\['fn'\]: a function"):
        geompi.save(tmp_path / "c.h5", model=net, state={"fn": lambda: 0})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "skeleton",
    [b"not json", b'{"t": "9"}', b'{"x": 1}', b'{"d": {"a": {"m": [[1]]}}}', b"[" * 5000],
)
def test_a_damaged_skeleton_is_refused_in_one_line(tmp_path, skeleton):
    """The state is read as untrusted: a skeleton that is not what the writer makes (edited,
    then re-digested, so only these checks stand in the way) is a CheckpointError."""
    from geompi import user_state

    with pytest.raises(CheckpointError, match="its saved state state is damaged"):
        user_state.decode(skeleton, {}, "f.h5", "state")


def test_the_file_keeps_each_value_as_json_and_tensors_never_pickled(tmp_path):
    net, *_ = _setup()
    geompi.save(tmp_path / "c.h5", model=net, state={"rng": torch.get_rng_state(), "k": 1})
    with h5py.File(tmp_path / "c.h5", "r") as f:
        g = f["progress/user_state/worker0"]
        assert set(g) == {"skeleton", "tensors"}
        assert b"pickle" not in bytes(g["skeleton"][()])
        assert g["tensors/0"].dtype == np.uint8
