"""Checkpoints during training: gather one consistent version to the master worker, write it
with ``geompi.ckpt``, and restore it (re-sharded onto whatever topology the new run has).

What goes where in the file:
- ``/model``: the global model, assembled from the global servers' shards.
- ``/optimizer/<state>/<param>``: the global servers' optimizer state (scalars such as Adam's
  ``step`` are stored per parameter as 0-d tensors).
- ``/algorithm``: ``dcasgd/backup/dc<d>/<param>``, ``hfa/outer_<state>/<param>`` (the outer
  optimizer's: ``outer_momentum``, or Adam's ``outer_exp_avg``, ``outer_exp_avg_sq``,
  ``outer_step``), HFA's
  counters and each worker's local optimizer state (``hfa/local/worker<i>/<state>/<param>``).
- ``/algorithm@global_updates``: the global servers' update counter.
- ``/progress``: per-worker data positions (``data_positions``: epoch, position), steps
  (``steps``) and RNG states. In MixedSync each datacenter's entries are its own progress at
  the checkpoint's version (see docs/checkpoint-format.md).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch

from geompi import ckpt
from geompi.comm import faults
from geompi.comm.buffers import all_finite
from geompi.comm.compression import make_compressor
from geompi.comm.transport import (
    barrier,
    barrier_before_collective,
    isend_state,
    live_timeout,
    recv_state,
)
from geompi.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWriteError,
    ConfigError,
)
from geompi.ps.protocol import TAG_RESTORE, TAG_SNAPSHOT, Op
from geompi.runtime import say
from geompi.session import fail_together
from geompi.sync.hfa import OUTER_STATE

_BACKUP = re.compile(r"^backup_dc(\d+)$")


def check_writable(directory: str, need_bytes: int = 0) -> None:
    """Fail at start-up, not after hours of training, if checkpoints cannot be written: the
    directory must take a file, and hold ``need_bytes`` more (a probe of 0 bytes succeeds on a
    full disk, so the free space is compared with an estimate of one checkpoint)."""
    try:
        os.makedirs(directory, exist_ok=True)
        # Exclusive and unpredictable (host, pid, random): never writes through a planted symlink.
        prefix = f".geompi-write-test-{ckpt.files._host()}-{os.getpid()}-"
        fd, probe = tempfile.mkstemp(prefix=prefix, dir=directory)
        os.close(fd)
        os.unlink(probe)
        stale = ckpt.remove_stale_temps(directory)
        st = os.statvfs(directory)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint to {directory}: {e.strerror or e}; "
            "pass a writable --checkpoint-dir"
        ) from None
    if stale:
        say(f"geompi: removed {len(stale)} temporary file(s) of killed writers from {directory}")
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise CheckpointError(
            f"checkpoint directory {directory} has {_mib(free)} free but one checkpoint needs "
            f"about {_mib(need_bytes)}: free some space or pass another --checkpoint-dir"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def checkpoint_bytes(model: torch.nn.Module, cfg, num_workers: int, num_dcs: int) -> int:
    """An upper estimate of one checkpoint's size: the model, the optimizer state per copy
    (HFA: one per worker; DCASGD: a backup per datacenter), RNG states, and the file's own
    overhead (about 1 KiB per dataset, plus the attributes)."""
    tensors = list(model.state_dict().values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    states = len(expected_state_names(cfg) - {"step"})
    local = cfg.algorithm.local_steps  # HFA: every worker's own optimizer state
    copies = 1 + states * (num_workers if local else 1)
    if cfg.optimizer == "dcasgd":
        copies += num_dcs
    if local:
        copies += 2  # the outer optimizer's state (Adam's two moments)
    datasets = len(tensors) * (1 + copies)
    rng = torch.get_rng_state().numel() * num_workers
    return int(1.05 * nbytes * copies) + 1024 * datasets + rng + 256 * 1024


def resolve_resume(resume: str | None, directory: str | None) -> pathlib.Path | None:
    """The file ``--resume`` names; None for ``latest`` with no checkpoint yet."""
    if not resume:
        return None
    if resume == "latest":
        return ckpt.latest(directory)
    path = pathlib.Path(resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {resume}: no such checkpoint file; pass a file or latest")
    return path


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


def _check_datacenter_steps(bad, steps: list[int], step: int, dc_sizes: list[int]) -> None:
    """MixedSync: each datacenter is at its own step, the same for all of its workers, and
    datacenter 0 (the master's) at the checkpoint's. Refuses any other /progress/steps."""
    per_dc = [size - 1 for size in dc_sizes]  # a datacenter's ranks: its workers + 1 server
    if sum(per_dc) != len(steps):
        bad(
            f"/progress/steps has {len(steps)} workers but the topology attribute's "
            f"datacenters {dc_sizes} hold {sum(per_dc)}"
        )
    first = 0
    for dc, n in enumerate(per_dc):
        mine = steps[first : first + n]
        first += n
        if len(set(mine)) > 1 or (dc == 0 and mine and mine[0] != step):
            at = f"the checkpoint's step {step}" if dc == 0 else "one step"
            bad(f"/progress/steps of datacenter {dc} are {mine}, but its workers are all at {at}")


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

    def optimizer_state(self) -> dict:
        """The optimizer's name and the state each parameter needs; returns HFA's per-worker
        local states (empty under the other algorithms)."""
        ck, cfg, bad, group, shapes = self.ck, self.cfg, self.bad, self.group, self.shapes
        config = ck.attrs["config"]
        # The optimizer: its name, then the state each parameter needs (a missing exp_avg is a
        # KeyError at the first update, hours after the start).
        hfa = group(ck.algorithm.get("hfa", {}), "/algorithm/hfa")
        local = group(hfa.get("local", {}), "/algorithm/hfa/local")
        if cfg.algorithm.local_steps:
            written = config.get("optimizer") if local else None
            states = {}
            for worker, st in local.items():
                if not isinstance(st, dict):
                    bad(f"/algorithm/hfa/local/{worker} is not a group")
                states.update({f"hfa/local/{worker}/{k}": v for k, v in st.items()})
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
        if (
            steps is not None
            and not cfg.algorithm.independent_dcs
            and bool((steps != ck.step).any())
        ):
            bad(
                f"/progress/steps is {steps.tolist()}, but every worker of --sync {cfg.sync} is at "
                f"the checkpoint's step {ck.step}"
            )
        if steps is not None and cfg.algorithm.independent_dcs:
            _check_datacenter_steps(bad, steps.tolist(), ck.step, topo["dc_sizes"])
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


class Checkpointing:
    """A worker's part in saving and restoring. Collective over all workers (and servers)."""

    def __init__(self, worker) -> None:
        self.w = worker
        self.loaded: ckpt.Checkpoint | None = None
        self.restore_note = ""
        self.worker_note = ""  # master: what a resume onto another worker count does
        self.starts: list[dict] | None = None  # MixedSync, master: every worker's run start
        self.saved_step = -1  # the step of this run's last checkpoint
        self.saved_model: dict[str, torch.Tensor] | None = None  # master: its /model
        self.resumed_from: pathlib.Path | None = None  # master: the file this run resumed
        self.failed_step = -1  # master: the step whose checkpoint could not be written
        self.written: list[pathlib.Path] = []  # master: this run's files, newest first

    @functools.cached_property
    def names(self) -> dict:
        """Parameter name -> (shape, its pieces in the keys), once the buckets exist."""
        return self.w.buckets.named_slices()

    @classmethod
    def for_engine(cls, engine) -> Checkpointing:
        """The server-held half of checkpointing for the public API's optimizer (snapshots
        from the global servers, their state re-sliced for a restore): the CLI's own code."""
        view = SimpleNamespace(
            comms=engine.s.comms, topo=engine.s.topo, client=engine.client, buckets=engine.buckets
        )
        return cls(view)

    def held_state(self) -> dict:
        """Master worker, after a SAVE round: the global servers' state by parameter name,
        ``{"model": ..., "optimizer": ..., "algorithm": ...}`` as a checkpoint holds it."""
        snaps = self._receive_snapshots()
        model, optimizer, algorithm = self._assemble(snaps)
        algorithm["global_updates"] = int(snaps[0]["updates"])
        return {"model": model, "optimizer": optimizer, "algorithm": algorithm}

    def load_resume(self, resume: str | None, directory: str | None) -> pathlib.Path | None:
        """Master, at start-up: load what ``--resume`` names and return its path.

        ``latest`` takes the file written last; if that one cannot be read (a torn or corrupt
        file), the one written before it, and so on, saying once which were skipped. If none
        can be read, the newest file's error is raised.
        """
        if resume != "latest":
            path = resolve_resume(resume, directory)
            if path is not None:
                self.load(path)
            return path
        skipped: list[tuple[pathlib.Path, CheckpointError]] = []
        for path in ckpt.by_write_order(directory):
            try:  # only an unreadable file is skipped; a mismatch with this run is not
                ck = self.read(path)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                skipped.append((path, e))
                continue
            self.load(path, ck)
            if skipped:
                first, err = skipped[0]
                say(
                    f"geompi: --resume latest: skipped {len(skipped)} unusable checkpoint(s), "
                    f"newest {first.name} ({err}); resuming from {path.name} instead"
                )
            return path
        if skipped:
            raise skipped[0][1]
        return None

    def lineage(self, just_written: pathlib.Path) -> list[pathlib.Path]:
        """What this run's checkpoints descend from, newest first: its own files, the file it
        resumed from, then the files of lower step than that one."""
        self.written = [just_written] + [p for p in self.written if p != just_written]
        out = list(self.written)
        base = self.resumed_from
        if base is not None:
            out.append(base)
            older = [
                p for p in ckpt.list_checkpoints(base.parent) if p.name < base.name and p not in out
            ]
            out += reversed(older)
        return out

    def record_starts(self) -> None:
        """Collective over all workers (MixedSync with checkpoints): where each worker starts,
        so the master can write every datacenter's own progress at a checkpoint's version.
        The data position follows from it (one batch per step); the RNG state is the start's:
        geompi's models draw no random numbers while training."""
        w = self.w
        mine = {
            "dc": w.dc,
            "step": w.step,
            "loader": w.loader.state_dict(),
            "steps_per_epoch": w.loader.steps_per_epoch,
            "rng": torch.get_rng_state(),
        }
        barrier_before_collective(w.comms.all_workers, w.cfg.comm_timeout, "every worker to start")
        self.starts = w.comms.all_workers.gather(mine, root=0)

    def rejoin(self, loss: faults.Loss) -> None:
        """After a recovery (``--on-failure continue``): the starts of the surviving workers
        alone, their datacenters numbered as the global servers' cut now numbers them."""
        if self.starts is None:
            return
        before = loss.before
        ranks = before.all_workers  # the starts' order: all_workers, as it was
        if len(ranks) != len(self.starts):
            raise CheckpointError(
                f"{len(self.starts)} workers' starts recorded for {len(ranks)} workers: this is "
                "a geompi bug; resume from an earlier checkpoint and report it"
            )
        kept = [d for d in range(before.num_dcs) if d not in loss.left_dcs]
        number = {d: i for i, d in enumerate(kept)}
        self.starts = [
            {**st, "dc": number[st["dc"]]}
            for r, st in zip(ranks, self.starts)
            if r not in loss.lost and st["dc"] in number
        ]

    # ---- saving ---------------------------------------------------------------------------
    def save(self, step: int, metrics: dict, final: bool = False) -> pathlib.Path | None:
        """Every worker of ``w.group`` calls this at the same step; the master writes the file.

        The group is all workers, except in MixedSync where it is datacenter 0 alone: the other
        datacenters keep training, and the global servers' snapshot is one consistent version.
        ``final`` (MixedSync, after ``finish``): the global servers' last snapshot, which they
        send unasked once every datacenter is done, so no SAVE round.
        """
        w = self.w
        if not final:
            reqs = w.client.start(Op.SAVE, [])
            reqs.wait()
        snaps = []
        if w.master:  # before the gather: in MixedSync, other datacenters still need the servers
            snaps = self._receive_snapshots()
        mine = {
            "loader": w.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "local": self._local_state(),
        }
        barrier_before_collective(w.group, w.cfg.comm_timeout, "every worker to hand in its state")
        everyone = w.group.gather(mine, root=0)
        if faults.watching():  # the master had every part: else every worker saves again
            barrier(w.group, None, "every worker's state to reach the master")
        self.saved_step = step
        if not w.master:
            return None
        model, optimizer, algorithm = self._assemble(snaps)
        self.saved_model = model
        algorithm["strategy"] = {k: int(v) for k, v in w.engine.state().items()}
        algorithm["global_updates"] = int(snaps[0]["updates"])
        if any(m["local"] for m in everyone):
            algorithm["hfa"] = {
                **algorithm.get("hfa", {}),
                "local": {f"worker{i}": m["local"] for i, m in enumerate(everyone)},
            }
        per_worker = [
            (m["loader"]["epoch"], m["loader"]["position"], step, m["rng"]) for m in everyone
        ]
        if self.starts is not None:  # MixedSync: every datacenter at the snapshot's version
            per_worker = self._progress_at(snaps[0]["cut"], step, everyone)
        progress = {
            "data_positions": torch.tensor([[e, p] for e, p, _, _ in per_worker]),
            "steps": torch.tensor([s for _, _, s, _ in per_worker]),
            "rng": {f"worker{i}": r for i, (_, _, _, r) in enumerate(per_worker)},
        }
        cfg = w.cfg
        path = pathlib.Path(cfg.checkpoint_dir) / ckpt.checkpoint_name(step)
        try:
            self._write(path, step, model, optimizer, algorithm, progress, metrics)
        except CheckpointWriteError as e:
            # A full disk must not cost the run: the state is intact in memory, the last good
            # file is untouched (written to a temporary, renamed only when complete).
            self.failed_step = step
            last = self.written[0].name if self.written else "none from this run"
            say(
                f"geompi: warning: checkpoint of step {step} not written ({e}); training goes "
                f"on, the last good checkpoint is {last}"
            )
            return None
        self.failed_step = -1
        ckpt.prune(cfg.checkpoint_dir, cfg.keep, lineage=self.lineage(path))
        return path

    def _write(self, path, step, model, optimizer, algorithm, progress, metrics) -> None:
        w, cfg = self.w, self.w.cfg
        ckpt.save(
            path,
            model=model,
            optimizer=optimizer,
            optimizer_attrs={"name": "none" if cfg.algorithm.local_steps else cfg.optimizer},
            algorithm=algorithm,
            progress=progress,
            step=step,
            epoch=w.loader.epoch,
            algorithm_name=cfg.sync,
            topology=w.topo.describe(),
            config=json.loads(cfg.to_json()),
            metrics=metrics,
        )

    def _receive_snapshots(self) -> list[dict]:
        w = self.w
        return sorted(
            (
                # MixedSync's last snapshot comes once the slowest datacenter is done
                recv_state(
                    w.comms.world,
                    gs,
                    TAG_SNAPSHOT,
                    w.client.link.stats,
                    live_timeout(w.client.timeout),
                    f"the snapshot of global server {gs}",
                )  # fmt: skip
                for gs in w.topo.global_servers
            ),
            key=lambda s: s["index"],
        )

    def _progress_at(self, cut: list[int], step: int, dc0: list[dict]) -> list[tuple]:
        """(epoch, position, step, rng) of every worker once its datacenter has made the
        deposits ``cut`` counts (the snapshot's version); datacenter 0's are its current ones."""
        out = []
        for i, st in enumerate(self.starts):
            d = st["dc"]
            s = st["step"] + cut[d]
            if d == 0:
                if s != step:
                    raise CheckpointError(
                        f"datacenter 0 is at step {step} but the global servers hold "
                        f"{cut[0]} of its deposits since step {st['step']}: this is a geompi "
                        "bug; resume from an earlier checkpoint and report it"
                    )
                m = dc0[i]
                out.append((m["loader"]["epoch"], m["loader"]["position"], s, m["rng"]))
                continue
            total = st["loader"]["position"] + cut[d]  # one batch per step
            spe = st["steps_per_epoch"]
            out.append((st["loader"]["epoch"] + total // spe, total % spe, s, st["rng"]))
        return out

    def global_model(self) -> None:
        """Collective over all workers (FSA, HFA): the master's model becomes the global model
        (with a lossy WAN codec a worker holds its replica of it, which differs)."""
        w = self.w
        model = self.saved_model
        if self.saved_step != w.step:
            reqs = w.client.start(Op.SAVE, [])
            reqs.wait()
            if w.master:
                model = self._assemble(self._receive_snapshots())[0]
        if w.master:
            with torch.no_grad():
                for name, p in w.model.named_parameters():
                    p.copy_(model[name].to(p.device))

    def _local_state(self) -> dict:
        """This worker's local optimizer state by parameter name (HFA), else {}."""
        opt = self.w.local_opt
        if opt is None or not opt.state:
            return {}
        names = {id(p): n for n, p in self.w.model.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        for p, st in opt.state.items():
            for k, v in st.items():
                out[k][names[id(p)]] = torch.as_tensor(v).detach().cpu().clone()
        return dict(out)

    def _assemble(self, snaps: list[dict]):
        """Full per-name tensors from the shards of every global server."""
        versions = {(tuple(s.get("cut", ())), s["updates"]) for s in snaps}
        if len(versions) > 1:
            raise CheckpointError(
                "the global servers' snapshots are of different versions (deposits per "
                f"datacenter, updates: {sorted(versions)}): this is a geompi bug; resume from an "
                "earlier checkpoint and report it"
            )
        keys = sorted(snaps[0]["values"])
        flat = {k: torch.cat([s["values"][k] for s in snaps]) for k in keys}
        model = self._by_name(flat)
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        algorithm: dict = {}
        for state_name in sorted({n for s in snaps for st in s["state"].values() for n in st}):
            per_key, per_param = {}, {}
            for k in keys:
                parts = [s["state"].get(k, {}).get(state_name) for s in snaps]
                if all(p is None for p in parts):
                    continue
                present = [p for p in parts if p is not None]
                if isinstance(present[0], dict):  # {param name: this shard's piece}
                    self._join_pieces(k, present, per_param)
                    continue
                if any(p is None for p in parts) or (
                    parts[0].dim() == 0 and any(not torch.equal(p, parts[0]) for p in parts)
                ):
                    raise CheckpointError(
                        f"optimizer state {state_name} of key {k} differs between the global "
                        "servers' snapshots: this is a geompi bug; resume from an earlier "
                        "checkpoint and report it"
                    )
                per_key[k] = parts[0] if parts[0].dim() == 0 else torch.cat(parts)
            named = {**self._by_name(per_key), **self._joined(per_param)}
            m = _BACKUP.match(state_name)
            if m:
                backups = algorithm.setdefault("dcasgd", {}).setdefault("backup", {})
                backups[f"dc{m.group(1)}"] = named
            else:
                optimizer[state_name] = named
        for state_name in sorted({n for s in snaps for st in s["outer"].values() for n in st}):
            outer = {}  # HFA's outer optimizer: its state over each key, per shard
            for k in keys:
                parts = [s["outer"].get(k, {}).get(state_name) for s in snaps]
                if all(p is not None for p in parts):  # a 0-d step: the same on every shard
                    outer[k] = parts[0] if parts[0].dim() == 0 else torch.cat(parts)
            if outer:
                algorithm.setdefault("hfa", {})[state_name] = self._by_name(outer)
        return model, optimizer, algorithm

    def _join_pieces(self, key: int, parts: list[dict], into: dict[str, list]) -> None:
        """Collect, per parameter of ``key`` that has this state, its pieces from the shards
        in order into ``into`` (a parameter torch never stepped has none, and stays absent;
        one cut across keys gets its pieces from each, in key order)."""
        for name, (_, pieces) in self.names.items():
            if any(k == key for k, *_ in pieces):
                into.setdefault(name, []).extend(p[name] for p in parts if name in p)

    def _joined(self, into: dict[str, list]) -> dict[str, torch.Tensor]:
        """The pieces collected by ``_join_pieces``, joined into whole parameters."""
        out = {}
        for name, pieces in into.items():
            if not pieces:
                continue
            if pieces[0].dim() == 0:
                out[name] = pieces[0].clone()
            else:
                shape = self.names[name][0]
                out[name] = torch.cat([t.reshape(-1) for t in pieces]).reshape(shape).clone()
        return out

    def _by_name(self, per_key: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole parameters from flat per-key tensors (a 0-d tensor: one value for a key's
        every parameter); a parameter is left out unless each of its keys is there."""
        out = {}
        for name, (shape, pieces) in self.names.items():
            if not all(k in per_key for k, *_ in pieces):
                continue
            first = per_key[pieces[0][0]]
            if first.dim() == 0:
                out[name] = first.clone()
            else:
                parts = [per_key[k][off : off + n] for k, off, _, n in pieces]
                out[name] = torch.cat(parts).reshape(shape).clone()
        return out

    # ---- restoring ------------------------------------------------------------------------
    def load(self, path: pathlib.Path, ck: ckpt.Checkpoint | None = None) -> None:
        """Master worker, at start-up: read and check the whole file before anything starts
        (``ck``: the file already read by :meth:`read`)."""
        w = self.w
        if ck is None:
            ck = self.read(path)
        if ck.algorithm_name != w.cfg.sync:
            raise CheckpointError(
                f"checkpoint {path} was written by --sync {ck.algorithm_name}: resume it with "
                f"--sync {ck.algorithm_name}"
            )
        shapes = {n: p.shape for n, p in w.model.named_parameters()}
        self.worker_note = check_resumable(path, ck, w.cfg, shapes, w.topo.num_workers)
        written = ck.attrs["config"].get("wan_compression", "none")  # a codec: checked above
        now = w.cfg.wan_settings().compression
        if make_compressor(written).lossy and make_compressor(now).lossy:
            raise CheckpointError(
                f"checkpoint {path} was written with lossy --wan-compression {written}, whose "
                "residuals and replicas (held by the local servers) it does not hold, so a "
                "resume would not continue that run: resume with --wan-compression none"
            )
        with torch.no_grad():
            for name, p in w.model.named_parameters():
                p.copy_(ck.model[name].to(p.device))
        self.loaded = ck
        self.resumed_from = pathlib.Path(path)

    def read(self, path: pathlib.Path) -> ckpt.Checkpoint:
        """Read and verify the file (every checksum, this model's fingerprint)."""
        return ckpt.load(path, expect_fingerprint=ckpt.fingerprint(self.w.model.state_dict()))

    def distribute(self) -> dict | None:
        """Collective over workers: each gets its data position, RNG and local state.

        What every worker needs is broadcast; what is one worker's own (its position, RNG
        state and HFA local optimizer state) is scattered, so no worker holds W copies."""
        w = self.w
        ck = self.loaded
        info = None
        own = None
        if w.master and ck is not None:
            positions = ck.progress["data_positions"].tolist()
            rng = ck.progress.get("rng", {})
            local = ck.algorithm.get("hfa", {}).get("local", {})
            n = w.topo.num_workers
            same = len(positions) == n
            own = [
                {
                    "position": positions[i if same else 0],
                    "rng": rng.get(f"worker{i if same else 0}"),
                    "local": local.get(f"worker{i}") if same else None,
                }
                for i in range(n)
            ]
            info = {
                "step": ck.step,
                "workers": len(positions),
                "strategy": ck.algorithm.get("strategy", {}),
                "steps": ck.progress["steps"].tolist() if "steps" in ck.progress else None,
                "old": ck.attrs["topology"],
                "path": str(self.resumed_from),
            }
        barrier_before_collective(w.comms.all_workers, w.cfg.comm_timeout, "the master to read it")
        info = w.comms.all_workers.bcast(info, root=0)
        if info is None:
            return None
        mine = w.comms.all_workers.scatter(own, root=0)
        same = info["workers"] == w.topo.num_workers
        epoch, position = mine["position"]
        err = None
        try:  # a position beyond this worker's epoch: every worker stops, one line names it
            w.loader.load_state_dict({"epoch": int(epoch), "position": int(position)})
        except CheckpointError as e:
            err = CheckpointError(f"checkpoint {info['path']}: worker {w.widx}'s {e}")
        fail_together(w.engine.s, err)
        if mine["rng"] is not None:
            torch.set_rng_state(mine["rng"])
        if mine["local"] and w.local_opt is not None:
            self._load_local(mine["local"])
        w.engine.load_state(info["strategy"])
        w.step = info["step"]
        if same and info["steps"] is not None:  # MixedSync: each datacenter its own step
            w.step = int(info["steps"][w.widx])
            w.engine.global_syncs += w.step - info["step"]
        old, new = info["old"], w.topo.describe()
        if old != new:
            self.restore_note = (
                f" (topology changed from {old.get('dc_sizes')} + {old.get('global_servers')} "
                f"global server(s) to {new['dc_sizes']} + {new['global_servers']}: model and "
                "optimizer state re-sharded)"
            )
        self.restore_note += self.worker_note
        steps = info["steps"]
        if same and steps is not None and len(set(steps)) > 1:
            per_dc = {}
            for i, st in enumerate(steps):
                per_dc.setdefault(w.topo.dc_of(w.topo.all_workers[i]), st)
            self.restore_note += (
                " (each datacenter at its own step: "
                + ", ".join(f"dc{d} {st}" for d, st in sorted(per_dc.items()))
                + ")"
            )
        return info

    def _load_local(self, local: dict) -> None:
        opt = self.w.local_opt
        for name, p in self.w.model.named_parameters():
            st = {
                k: v[name].to(p.device if v[name].dim() else "cpu").clone()
                for k, v in local.items()
                if name in v
            }
            if st:
                opt.state[p] = st

    def server_states(self) -> list[dict] | None:
        """Per global server: its slice of every key's optimizer and outer state."""
        ck = self.loaded
        if ck is None:
            return None
        return self.shard_states(ck.optimizer, ck.algorithm, ck.model)

    def shard_states(
        self, optimizer: dict, algorithm: dict, model: dict[str, torch.Tensor]
    ) -> list[dict] | None:
        """Per global server: its slice of ``optimizer`` (state name -> parameter name ->
        tensor) and of ``algorithm``'s outer momentum, DCASGD backups and update counter, as
        a checkpoint holds them; None if there is none of these."""
        if not (
            optimizer
            or algorithm.get("dcasgd")
            or any(n in algorithm.get("hfa", {}) for n in OUTER_STATE.values())
            or algorithm.get("global_updates")
        ):
            return None
        per_state: dict[str, dict[str, torch.Tensor]] = dict(optimizer)
        if algorithm.get("dcasgd", {}).get("backup"):
            # Every datacenter restarts from /model (the INIT round), so that is what each one
            # holds: the saved backups predate it. Datacenters new to this topology get it too.
            for dc in range(self.w.topo.num_dcs):
                per_state[f"backup_dc{dc}"] = model
        hfa = algorithm.get("hfa", {})
        outer = {n: hfa[n] for n in OUTER_STATE.values() if n in hfa}
        topo = self.w.topo
        out = []
        for g in range(topo.num_global_servers):
            state: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
            outer_g: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
            for b in self.w.buckets:
                lo, hi = topo.shard_bounds(b.numel, g)
                for state_name, named in per_state.items():
                    t = self._shard_state(b, named, lo, hi)
                    if t is not None:
                        state[b.key][state_name] = t
                for state_name, named in outer.items():
                    t = self._flat(b, named)
                    if t is not None:
                        outer_g[b.key][state_name] = (t[lo:hi] if t.dim() else t).clone()
            out.append(
                {
                    "state": dict(state),
                    "outer": dict(outer_g),
                    "updates": int(
                        algorithm.get(
                            "global_updates",  # older files: the best guess there is
                            algorithm.get("strategy", {}).get("global_syncs", 0),
                        )
                    ),
                }
            )
        return out

    @classmethod
    def _shard_state(cls, bucket, named: dict[str, torch.Tensor], lo: int, hi: int):
        """A state's part in the slice [lo, hi) of a bucket: one flat tensor when every member
        has it (a vector state), else ``{name: piece}`` for the members that have it (scalars
        such as Adam's ``step`` differ between parameters that skipped different steps)."""
        parts = [named.get(m.name) for m in bucket.members]
        if all(p is not None and p.dim() > 0 for p in parts):
            return cls._flat(bucket, named)[lo:hi].clone()
        out = {}
        for m, t in zip(bucket.members, parts):
            a, b = max(lo, m.offset), min(hi, m.offset + m.numel)
            if t is not None and b > a:
                piece = m.values(t)[a - m.offset : b - m.offset] if t.dim() else t
                out[m.name] = piece.clone()
        return out or None

    @staticmethod
    def _flat(bucket, named: dict[str, torch.Tensor]) -> torch.Tensor | None:
        parts = [named.get(m.name) for m in bucket.members]
        if any(p is None for p in parts):
            return None
        if parts[0].dim() == 0:
            return parts[0].clone()
        flat = torch.empty(bucket.numel)
        for m, t in zip(bucket.members, parts):
            flat[m.offset : m.offset + m.numel] = m.values(t)
        return flat

    def send_server_states(self, reqs, states: list[dict] | None = None) -> None:
        """Master worker, during the INIT round: each global server's slice of the state
        (``states``, else the loaded checkpoint's)."""
        states = self.server_states() if states is None else states
        if states is None:
            return
        w = self.w
        for gs, st in zip(w.topo.global_servers, states):
            isend_state(reqs, w.comms.world, st, gs, TAG_RESTORE, w.client.link.stats)


def say_resumed(path, step: int, note: str) -> None:
    say(f"geompi: resumed from {path} at step {step}{note}")
