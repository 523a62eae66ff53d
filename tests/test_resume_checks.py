"""A checkpoint that verifies must also resume, or be refused before training (issue #13)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from geompi import ckpt
from geompi.checkpointing import check_resumable
from geompi.config import make_config
from geompi.errors import CheckpointError
from geompi.sync import FSA, HFA, Algorithm, MixedSync

SHAPES = {"w": torch.Size([3, 2]), "b": torch.Size([3])}


def _file(tmp_path, **kw):
    model = {n: torch.zeros(s) for n, s in SHAPES.items()}
    args = dict(
        model=model,
        optimizer={"momentum_buffer": {n: torch.ones(s) for n, s in SHAPES.items()}},
        optimizer_attrs={"name": "sgd"},
        algorithm={"strategy": {"global_syncs": 4}, "global_updates": 4},
        progress={
            "data_positions": torch.tensor([[0, 4], [0, 4]]),
            "steps": torch.tensor([4, 4]),
            "rng": {f"worker{i}": torch.get_rng_state() for i in range(2)},
        },
        step=4,
        algorithm_name="fsa",
        topology={"world_size": 5, "dc_sizes": [2, 2], "global_servers": 1, "workers": 2},
        config={"optimizer": "sgd"},
    )
    args.update(kw)
    return ckpt.load(ckpt.save(tmp_path / "ckpt-00000004.h5", **args))


def _check(ck, *flags, workers=2):
    cfg = make_config(["--momentum", "0.9", *flags])
    return check_resumable("ck.h5", ck, cfg, SHAPES, workers)


def one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_a_good_checkpoint_passes_and_a_worker_count_change_says_what_it_does(tmp_path):
    ck = _file(tmp_path)
    assert _check(ck) == ""
    note = _check(ck, workers=3)
    assert "2 workers -> 3" in note and "worker 0's data position" in note


def test_another_optimizer_is_refused(tmp_path):
    with pytest.raises(CheckpointError) as exc:
        _check(_file(tmp_path), "--optimizer", "adam")
    assert "holds sgd optimizer state" in one_line(exc) and "--optimizer sgd" in one_line(exc)


def test_missing_state_is_refused(tmp_path):
    ck = _file(tmp_path, optimizer={"exp_avg": {"w": torch.ones(3, 2)}}, optimizer_attrs={})
    with pytest.raises(CheckpointError) as exc:
        _check(ck, "--optimizer", "adam")
    assert "lacks optimizer state exp_avg_sq, step" in one_line(exc)


def test_a_one_element_state_tensor_is_refused(tmp_path):
    opt = {"momentum_buffer": {"w": torch.ones(1), "b": torch.ones(3)}}
    with pytest.raises(CheckpointError) as exc:
        _check(_file(tmp_path, optimizer=opt))
    assert "momentum_buffer/w is a torch.float32 tensor of shape (1,)" in one_line(exc)
    opt = {"momentum_buffer": {"nope": torch.ones(3), "b": torch.ones(3), "w": torch.ones(3, 2)}}
    with pytest.raises(CheckpointError) as exc:
        _check(_file(tmp_path, optimizer=opt))
    assert "belongs to no parameter" in one_line(exc)


@pytest.mark.parametrize(
    "progress,expect",
    [
        ({"data_positions": torch.tensor([0, 4])}, "data_positions is"),
        ({"data_positions": torch.tensor([[0, -4], [0, 4]])}, "negative"),
        ({"data_positions": torch.tensor([[0, 4], [0, 4]]), "steps": torch.tensor([4])}, "steps"),
        (
            {"data_positions": torch.tensor([[0, 4]]), "rng": {"worker0": torch.zeros(3)}},
            "rng/worker0",
        ),
    ],
)
def test_bad_progress_is_refused(tmp_path, progress, expect):
    with pytest.raises(CheckpointError) as exc:
        _check(_file(tmp_path, progress=progress))
    assert expect in one_line(exc)


def test_bad_attribute_types_are_refused(tmp_path):
    with pytest.raises(CheckpointError) as exc:
        _check(_file(tmp_path, topology={"dc_sizes": "2,2"}))
    assert "attribute topology" in one_line(exc)
    with pytest.raises(CheckpointError) as exc:
        _check(_file(tmp_path, algorithm={"strategy": {"global_syncs": 1.5}}))
    assert "strategy" in one_line(exc)


def test_another_model_spec_with_the_same_shapes_is_refused(tmp_path):
    # the fingerprint (names and shapes) cannot tell these apart: the recorded --model does
    ck = _file(tmp_path, config={"optimizer": "sgd", "model": "mypkg.nets:small"})
    assert _check(ck, "--model", "mypkg.nets:small") == ""
    with pytest.raises(CheckpointError) as exc:
        _check(ck, "--model", "mypkg.nets:other")
    msg = one_line(exc)
    assert "written by --model mypkg.nets:small but this run uses --model mypkg.nets:other" in msg
    assert "resume with --model mypkg.nets:small" in msg


def _rng_zeros() -> torch.Tensor:
    """A uint8 tensor shaped as torch's CPU RNG state, all zeros (torch refuses to set it)."""
    return torch.zeros(torch.get_rng_state().numel(), dtype=torch.uint8)


@pytest.mark.parametrize(
    "kw, expect",
    [
        # structures where geompi writes a group: a number, a tensor (verify passes these)
        (dict(algorithm={"hfa": 5}), "/algorithm/hfa is"),
        (dict(algorithm={"hfa": {"local": 1}}), "/algorithm/hfa/local is"),
        (dict(algorithm={"hfa": {"outer_momentum": torch.ones(3)}}), "outer_momentum is"),
        (dict(algorithm={"dcasgd": torch.ones(2)}), "/algorithm/dcasgd is"),
        (dict(config={"optimizer": "sgd", "wan_compression": 7}), "wan_compression is 7"),
        (dict(config={"optimizer": "sgd", "wan_compression": "zip"}), "wan_compression is"),
        # positions and steps of a type that has no order, or out of line with @step
        ({"progress": {"data_positions": torch.tensor([[0, 4], [0, 4]]) + 0j}}, "positions"),
        ({"progress": {"data_positions": torch.tensor([[0, 4]], dtype=torch.uint8)}}, "positions"),
        (
            {"progress": {"data_positions": torch.tensor([[0, 4]]), "steps": torch.tensor([4j])}},
            "/progress/steps is",
        ),
        (
            {
                "progress": {
                    "data_positions": torch.tensor([[0, 4]]),
                    "steps": torch.tensor([2**62]),
                }
            },
            "every worker of --sync fsa is at the checkpoint's step 4",
        ),
        # an RNG state of the right shape that torch refuses to set
        (
            {"progress": {"data_positions": torch.tensor([[0, 4]]), "rng": {"w": _rng_zeros()}}},
            "rng/w is not a valid",
        ),
        # NaN or Inf in a parameter or its optimizer state: the run would stop at its first
        # non-finite gradient, blaming the learning rate
        (
            dict(model={"w": torch.zeros(3, 2), "b": torch.tensor([0.0, float("nan"), 0.0])}),
            "parameter b in /model holds NaN or Inf",
        ),
        (
            dict(
                optimizer={
                    "momentum_buffer": {"w": torch.full((3, 2), float("inf")), "b": torch.ones(3)}
                }
            ),
            "momentum_buffer/w holds NaN or Inf",
        ),
        # a 0-d tensor where the state is a buffer per value (only Adam's step is one number)
        (
            dict(optimizer={"momentum_buffer": {"w": torch.ones(3, 2), "b": torch.tensor(1.0)}}),
            "momentum_buffer/b is",
        ),
    ],
)
def test_a_file_that_verifies_but_holds_the_wrong_structure_is_refused(tmp_path, kw, expect):
    """One line naming the file and the part, not a traceback (AttributeError, TypeError,
    NotImplementedError) at start-up, nor a failure hours later (an invalid RNG state when it is
    set, a 0-d momentum buffer at the first server step, a step far ahead)."""
    with pytest.raises(CheckpointError) as exc:
        _check(_file(tmp_path, **kw))
    assert expect in one_line(exc) and "ck.h5" in one_line(exc), one_line(exc)


def test_adams_scalar_step_is_accepted(tmp_path):
    opt = {
        name: {n: torch.ones(s) for n, s in SHAPES.items()} for name in ("exp_avg", "exp_avg_sq")
    }
    opt["step"] = {n: torch.tensor(4.0) for n in SHAPES}
    ck = _file(
        tmp_path, optimizer=opt, optimizer_attrs={"name": "adam"}, config={"optimizer": "adam"}
    )
    assert _check(ck, "--optimizer", "adam") == ""


def test_a_buffer_of_minus_inf_is_not_a_diverged_run(tmp_path):
    """Only parameters and their state must be finite: a persistent attention mask holds -inf."""
    model = {n: torch.zeros(s) for n, s in SHAPES.items()}
    model["mask"] = torch.full((2, 2), float("-inf")).triu(1)
    assert _check(_file(tmp_path, model=model)) == ""


def _mixed(tmp_path, steps, dc_sizes=(3, 3)):
    """A MixedSync checkpoint at step 4 whose workers are at ``steps`` (datacenter 0 first)."""
    n = len(steps)
    return _file(
        tmp_path,
        algorithm_name="mixed",
        progress={
            "data_positions": torch.tensor([[0, 4]] * n),
            "steps": torch.tensor(steps),
            "rng": {f"worker{i}": torch.get_rng_state() for i in range(n)},
        },
        topology={
            "world_size": sum(dc_sizes) + 1,
            "dc_sizes": list(dc_sizes),
            "global_servers": 1,
            "workers": sum(dc_sizes) - len(dc_sizes),
        },
    )


def test_mixedsync_datacenters_may_be_at_their_own_steps(tmp_path):
    assert _check(_mixed(tmp_path, [4, 4, 9, 9]), "--sync", "mixed", workers=4) == ""


@pytest.mark.parametrize(
    "steps, expect",
    [
        # a datacenter is synchronous inside: its workers cannot be at different steps
        (
            [4, 4, 9, 2**62],
            "datacenter 1 are [9, 4611686018427387904], but its workers are all at one step",
        ),
        # datacenter 0 is the master's: the checkpoint's step is its step
        (
            [5, 5, 9, 9],
            "datacenter 0 are [5, 5], but its workers are all at the checkpoint's step 4",
        ),
        ([4, 4, 9], "/progress/steps has 3 workers but the topology attribute's datacenters"),
    ],
)
def test_mixedsync_steps_out_of_line_with_the_datacenters_are_refused(tmp_path, steps, expect):
    """MixedSync's steps used to be checked for type and sign only: a datacenter resumed at any
    step a file named (2**62 ends its training at once)."""
    with pytest.raises(CheckpointError) as exc:
        _check(_mixed(tmp_path, steps), "--sync", "mixed", workers=4)
    assert expect in one_line(exc), one_line(exc)


@dataclass(frozen=True)
class LocalElsewhere(HFA):
    """An HFA variant whose checkpoints keep each worker's optimizer state in a section of
    its own (``Algorithm.worker_state_section``)."""

    name: ClassVar[str] = "hfa-elsewhere"
    worker_state_section: ClassVar[str | None] = "elsewhere/workers"


def test_each_workers_state_is_read_where_its_algorithm_keeps_it(tmp_path):
    """The resume checks read each worker's own optimizer state from the section the algorithm
    names, not from HFA's: a good file resumes (onto another worker count, without them), one
    holding a state per worker too many, or a worker's state that is no group, is refused."""
    cfg_flags = ["--sync", f"{__name__}:LocalElsewhere"]
    state = {"momentum_buffer": {n: torch.ones(s) for n, s in SHAPES.items()}}
    per_worker = {f"worker{i}": state for i in range(2)}

    def file(workers: dict):
        return _file(
            tmp_path,
            optimizer={},
            optimizer_attrs={"name": "none"},
            algorithm={"elsewhere": {"workers": workers}},
            algorithm_name="hfa-elsewhere",
        )

    assert _check(file(per_worker), *cfg_flags) == ""
    assert "local optimizer states start fresh" in _check(file(per_worker), *cfg_flags, workers=3)
    with pytest.raises(CheckpointError) as exc:
        _check(file({**per_worker, "worker2": state}), *cfg_flags)
    assert "3 HFA local optimizer states but 2 workers" in one_line(exc)
    with pytest.raises(CheckpointError) as exc:
        _check(file({"worker0": {"momentum_buffer": {"w": torch.ones(3, 2)}}, "worker1": 1}),
               *cfg_flags)  # fmt: skip
    assert "/algorithm/elsewhere/workers/worker1 is not a group" in one_line(exc)


def test_an_algorithm_whose_workers_step_locally_has_a_section_for_their_state():
    """A local-steps algorithm that names no section gets its own (no checkpoint of its
    workers' state fails for want of one); HFA's variants share HFA's, as the files hold."""

    @dataclass(frozen=True)
    class Own(Algorithm):
        name: ClassVar[str] = "own-local"
        local_steps: ClassVar[bool] = True

    assert Own.worker_state_section == "own-local/local"
    assert LocalElsewhere.worker_state_section == "elsewhere/workers"
    assert type("MyHFA", (HFA,), {"name": "my-hfa"}).worker_state_section == "hfa/local"
    assert MixedSync.worker_state_section is None and FSA.worker_state_section is None
