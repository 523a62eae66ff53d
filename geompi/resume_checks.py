"""The resume checks: a checkpoint that verifies (geompi.ckpt: checksums, this model's
fingerprint) must also resume this run, or be refused before training in one line that names
the file, what is wrong and what to do (issue #13).

Checked: the step and attributes, the optimizer's name and the state each parameter needs
(the global servers' under /optimizer, or each worker's own where the algorithm keeps it so:
``Algorithm.worker_state_section``), every state tensor's shape against its parameter, the
algorithm's sections, /progress (steps as the algorithm has its workers move:
``Algorithm.checkpoint_steps_problem``) and the RNG states.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from geompi import ckpt
from geompi.comm.buffers import all_finite
from geompi.comm.compression import make_compressor
from geompi.errors import CheckpointError, ConfigError
from geompi.sync import REGISTRY
from geompi.sync.hfa import OUTER_STATE


def expected_state_names(cfg) -> set[str]:
    """The per-parameter state names ``cfg``'s optimizer keeps after one step (empty for
    plain SGD; None-valued entries, such as SGD's buffer without momentum, do not count)."""
    from geompi.ps.optim import ServerTorchStep, make_spec

    if cfg.optimizer == "dcasgd":
        return set()  # its per-datacenter backups live under /algorithm
    spec = make_spec(
        cfg.optimizer, cfg.effective_lr, cfg.effective_momentum, cfg.weight_decay, cfg.nesterov
    )
    p = torch.nn.Parameter(torch.zeros(1))
    opt = ServerTorchStep(spec, [p])
    p.grad = torch.ones(1)
    opt.step()
    return {k for k, v in opt.state[p].items() if v is not None}


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer))


_INDEX_TYPES = (torch.int32, torch.int64)  # what /progress positions and steps are written as


def check_resumable(
    path, ck: ckpt.Checkpoint, cfg, shapes: dict[str, torch.Size], num_workers: int
) -> str:
    """Refuse, before training, a checkpoint that verifies but would not resume this run.

    Checks the optimizer's name and state names, every state tensor's shape against its
    parameter, /progress, the step and the types of the attributes. Returns a note for a
    resume onto another worker count ('' otherwise).
    """
    check = _Resumable(path, ck, cfg, shapes)
    topo = check.attributes()
    local = check.optimizer_state()
    old_workers = check.progress(topo, local)
    if old_workers == num_workers:
        return ""
    return (
        f" ({old_workers} workers -> {num_workers}: every worker continues from worker 0's data "
        "position and RNG state"
        + (", HFA local optimizer states start fresh" if local else "")
        + ")"
    )


class _Resumable:
    """check_resumable's sections, each refusing in one line (``bad``)."""

    def __init__(self, path, ck: ckpt.Checkpoint, cfg, shapes: dict[str, torch.Size]) -> None:
        self.path, self.ck, self.cfg, self.shapes = path, ck, cfg, shapes

    def bad(self, what: str, fix: str = "resume from a checkpoint written by this geompi") -> None:
        raise CheckpointError(f"checkpoint {self.path}: {what}: {fix}")

    def group(self, value, what: str) -> dict:
        """``value`` if it is a group (a dict), else refused: a file that verifies may still
        hold an attribute or a tensor where geompi writes a group."""
        if not isinstance(value, dict):
            self.bad(f"{what} is {_shape_of(value)}, not a group")
        return value

    def attributes(self) -> dict:
        """The step, topology, config and model attributes; returns the topology."""
        ck, cfg, bad = self.ck, self.cfg, self.bad
        if ck.step < 0 or ck.epoch < 0:
            bad(f"negative step {ck.step} or epoch {ck.epoch}")
        topo = ck.attrs.get("topology")
        if not isinstance(topo, dict) or not all(
            isinstance(topo.get(k), list) and topo[k] and all(_is_int(x) and x > 0 for x in topo[k])
            for k in ("dc_sizes",)
        ):
            bad(f"attribute topology is {topo!r}, not a topology")
        config = ck.attrs.get("config")
        if not isinstance(config, dict):
            bad(f"attribute config is {type(config).__name__}, not a JSON object")
        wan = config.get("wan_compression", "none")
        try:
            make_compressor(wan if isinstance(wan, str) else "?")
        except ConfigError:
            bad(f"/config wan_compression is {wan!r}, not a WAN codec")
        # The model: its parameter names and shapes are the fingerprint, checked on reading; the
        # --model name or pkg.module:factory spec (in /config) tells apart models that share them.
        written_model = config.get("model")
        if isinstance(written_model, str) and written_model != cfg.model:
            bad(
                f"it was written by --model {written_model} but this run uses --model {cfg.model}",
                f"resume with --model {written_model}, or start a new --checkpoint-dir",
            )
        strategy = ck.algorithm.get("strategy", {})
        if not isinstance(strategy, dict) or not all(_is_int(v) for v in strategy.values()):
            bad("/algorithm/strategy holds non-integer counters")
        if not _is_int(ck.algorithm.get("global_updates", 0)):
            bad("/algorithm@global_updates is not an integer")

        for name in self.shapes:  # parameters only: a persistent buffer may hold -inf (a mask)
            t = ck.model.get(name)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                _check_finite(bad, f"parameter {name} in /model", t)
        return topo

    def section(self, path: str) -> dict:
        """The group at ``path`` under /algorithm ({} where the file has none), each group on
        the way checked to be one."""
        here, at = self.ck.algorithm, "/algorithm"
        for part in path.split("/"):
            at += "/" + part
            here = self.group(here.get(part, {}), at)
        return here

    def optimizer_state(self) -> dict:
        """The optimizer's name and the state each parameter needs; returns each worker's own
        optimizer state where the algorithm's workers keep it (its ``worker_state_section``),
        else {}."""
        ck, cfg, bad, group, shapes = self.ck, self.cfg, self.bad, self.group, self.shapes
        config = ck.attrs["config"]
        # The optimizer: its name, then the state each parameter needs (a missing exp_avg is a
        # KeyError at the first update, hours after the start).
        hfa = group(ck.algorithm.get("hfa", {}), "/algorithm/hfa")  # its outer state: below
        section = cfg.algorithm.worker_state_section
        for path in sorted({c.worker_state_section for c in REGISTRY.values()} - {None, section}):
            self.section(path)  # a group where geompi writes one, whichever --sync reads it
        local = self.section(section) if section else {}
        if section:  # the workers keep the optimizer's state: each its own, in the section
            written = config.get("optimizer") if local else None
            states = {}
            for worker, st in local.items():
                if not isinstance(st, dict):
                    bad(f"/algorithm/{section}/{worker} is not a group")
                states.update({f"{section}/{worker}/{k}": v for k, v in st.items()})
        else:
            written = ck.optimizer_attrs.get("name")
            states = dict(ck.optimizer)
        if written is not None and written != cfg.optimizer:
            bad(
                f"it holds {written} optimizer state but this run uses --optimizer {cfg.optimizer}",
                f"resume with --optimizer {written}, or start a new --checkpoint-dir",
            )
        per_param: dict[tuple[str, str], set[str]] = defaultdict(set)  # (worker, param) -> names
        for state_path, named in states.items():
            if not isinstance(named, dict):
                bad(f"optimizer state {state_path} is not a group of tensors")
            owner, _, state_name = state_path.rpartition("/")
            for name, t in named.items():
                per_param[(owner, name)].add(state_name)
                # a 0-d tensor only where torch keeps one number (Adam's step), never a buffer
                _check_tensor(
                    bad,
                    f"optimizer state {state_path}/{name}",
                    name,
                    t,
                    shapes,
                    state_name == "step",
                )
        want = expected_state_names(cfg)
        for (_, name), have in sorted(per_param.items()):
            missing = want - have
            if missing:
                bad(
                    f"parameter {name} lacks optimizer state {', '.join(sorted(missing))} that "
                    f"--optimizer {cfg.optimizer} needs",
                    "resume with the checkpoint's --optimizer and momentum, or start a new "
                    "--checkpoint-dir",
                )
        dcasgd = group(ck.algorithm.get("dcasgd", {}), "/algorithm/dcasgd")
        for dc, named in group(dcasgd.get("backup", {}), "/algorithm/dcasgd/backup").items():
            for name, t in group(named, f"/algorithm/dcasgd/backup/{dc}").items():
                _check_tensor(bad, f"DCASGD backup {dc}/{name}", name, t, shapes, scalar=False)
        _check_outer(bad, group, cfg, hfa, shapes)
        return local

    def progress(self, topo: dict, local: dict) -> int:
        """/progress; returns the old run's worker count."""
        ck, cfg, bad = self.ck, self.cfg, self.bad
        # /progress: one (epoch, position) row, step and RNG state per worker of the old run.
        pr = ck.progress
        pos = pr.get("data_positions")
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[1] != 2 or not len(pos):
            bad(
                f"/progress/data_positions is {_shape_of(pos)}, not one (epoch, position) per "
                "worker"
            )
        if pos.dtype not in _INDEX_TYPES or bool((pos < 0).any()):
            bad("/progress/data_positions holds negative or non-integer positions")
        old_workers = len(pos)
        steps = pr.get("steps")
        if steps is not None and (
            not isinstance(steps, torch.Tensor)
            or steps.shape != (old_workers,)
            or steps.dtype not in _INDEX_TYPES
            or bool((steps < 0).any())
        ):
            bad(f"/progress/steps is {_shape_of(steps)}, not one step per worker ({old_workers})")
        if steps is not None:  # as this algorithm has its workers move
            problem = cfg.algorithm.checkpoint_steps_problem(
                steps.tolist(), ck.step, topo["dc_sizes"]
            )
            if problem:
                bad(problem)
        rng_len = torch.get_rng_state().numel()
        rng = pr.get("rng", {})
        if not isinstance(rng, dict):
            bad("/progress/rng is not a group")
        for k, t in rng.items():
            if not (
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == (rng_len,)
            ):
                bad(f"/progress/rng/{k} is {_shape_of(t)}, not a torch CPU RNG state")
            now = torch.get_rng_state()
            try:  # torch refuses an invalid state only when it is set: try it here
                torch.set_rng_state(t)
            except RuntimeError:
                bad(f"/progress/rng/{k} is not a valid torch CPU RNG state")
            finally:
                torch.set_rng_state(now)
        if local and len(local) != old_workers:
            bad(f"{len(local)} HFA local optimizer states but {old_workers} workers in /progress")
        return old_workers


def _shape_of(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)}"
    return "missing" if t is None else type(t).__name__


def _check_outer(bad, group, cfg, hfa: dict, shapes) -> None:
    """HFA's outer optimizer state: whole tensors per parameter (Adam's step 0-d), of the
    states this run's outer optimizer keeps."""
    have = {n for n in OUTER_STATE.values() if n in hfa}
    for state_name in sorted(have):
        named = group(hfa[state_name], f"/algorithm/hfa/{state_name}")
        for name, t in named.items():
            scalar = state_name == "outer_step"
            _check_tensor(bad, f"HFA {state_name} {name}", name, t, shapes, scalar=scalar)
            if scalar and t.dim() != 0:
                bad(f"HFA {state_name} {name} is {_shape_of(t)}, not one number")
    algo = cfg.algorithm
    if have and hasattr(algo, "outer"):
        from geompi.sync.hfa import outer_state_names

        want = outer_state_names(algo.outer())
        if have != want:
            bad(
                f"it holds an outer optimizer's {', '.join(sorted(have))} but this run's "
                f"--outer-optimizer {algo.outer_optimizer} keeps "
                f"{', '.join(sorted(want)) or 'none'}",
                "resume with the checkpoint's --outer-optimizer (and momentum), or start a new "
                "--checkpoint-dir",
            )


def _check_tensor(bad, what: str, name: str, t, shapes, scalar: bool = True) -> None:
    if name not in shapes:
        bad(f"{what} belongs to no parameter of this model")
    if not isinstance(t, torch.Tensor):
        bad(f"{what} is {_shape_of(t)}, not a tensor")
    if t.dim() == 0 and scalar:
        return
    if t.shape != shapes[name] or not t.is_floating_point():
        bad(
            f"{what} is {_shape_of(t)} but the parameter is {tuple(shapes[name])}",
            "the file is damaged or was edited; resume from an earlier checkpoint",
        )
    _check_finite(bad, what, t)


def _check_finite(bad, what: str, t: torch.Tensor) -> None:
    """NaN or Inf in a parameter or its state: the run would stop at its first non-finite
    gradient, blaming the learning rate, instead of naming the file."""
    if not all_finite(t):
        bad(
            f"{what} holds NaN or Inf",
            "the run had diverged when it was written, or the file was edited; resume from an "
            "earlier checkpoint",
        )
