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
import tempfile

import torch

from geompi import ckpt, state
from geompi.comm import faults
from geompi.comm.compression import make_compressor
from geompi.comm.transport import barrier_before_collective
from geompi.errors import CheckpointError, CheckpointWriteError
from geompi.held_state import HeldState
from geompi.resume_checks import check_resumable, expected_state_names
from geompi.runtime import say
from geompi.session import fail_together

__all__ = [  # check_resumable and expected_state_names live in geompi.resume_checks
    "Checkpointing",
    "HeldState",
    "check_resumable",
    "check_writable",
    "checkpoint_bytes",
    "expected_state_names",
    "resolve_resume",
    "say_resumed",
]


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
    copies = 1 + cfg.algorithm.checkpoint_copies(states, num_workers)  # the model's + the state's
    if cfg.optimizer == "dcasgd":
        copies += num_dcs
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
    def held(self) -> HeldState:
        """The global servers' state, by name and back (once the worker's buckets exist)."""
        return HeldState(self.w)

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
        found = ckpt.newest_readable(directory, self.read)  # as geompi.latest
        if found is None:
            return None
        path, ck, skipped = found
        self.load(path, ck)
        if skipped:
            say(ckpt.skipped_note("--resume latest", skipped, path))
        return path

    def lineage(self, just_written: pathlib.Path) -> list[pathlib.Path]:
        """What this run's checkpoints descend from, newest first: its own files, the file it
        resumed from, then the files of lower step than that one."""
        self.written = [just_written] + [p for p in self.written if p != just_written]
        return ckpt.lineage(self.written, self.resumed_from)

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
        own = {
            "loader": w.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "local": state.own_optimizer_state(w.local_opt, w.model),
        }
        held, everyone = state.gather(w.engine, w.group, own, w.cfg.comm_timeout, final=final)
        self.saved_step = step
        if not w.master:
            return None
        model, optimizer = held["model"], held["optimizer"]
        self.saved_model = model
        algorithm = state.algorithm_sections(held, everyone, w.engine)
        per_worker = [
            (m["loader"]["epoch"], m["loader"]["position"], step, m["rng"]) for m in everyone
        ]
        if self.starts is not None:  # MixedSync: every datacenter at the snapshot's version
            per_worker = self._progress_at(held["cut"], step, everyone)
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
        workers_keep = cfg.algorithm.worker_state_section is not None
        ckpt.save(
            path,
            model=model,
            optimizer=optimizer,
            # /optimizer holds the global servers' state: none where the workers keep it
            optimizer_attrs={"name": "none" if workers_keep else cfg.optimizer},
            algorithm=algorithm,
            progress=progress,
            step=step,
            epoch=w.loader.epoch,
            algorithm_name=cfg.sync,
            topology=w.topo.describe(),
            config=json.loads(cfg.to_json()),
            metrics=metrics,
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
            held, _ = state.gather(w.engine, None, {}, None)
            model = held["model"] if w.master else None
        if w.master:
            with torch.no_grad():
                for name, p in w.model.named_parameters():
                    p.copy_(model[name].to(p.device))

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
            local = state.get_section(ck.algorithm, w.cfg.algorithm.worker_state_section)
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
        if err is None and mine["local"] and w.local_opt is not None:
            try:  # its own optimizer state (a file that does not fit: every worker stops)
                self._load_local(mine["local"])
            except CheckpointError as e:
                err = e
        fail_together(w.engine.s, err)
        if mine["rng"] is not None:
            torch.set_rng_state(mine["rng"])
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
        """This worker's own optimizer state (HFA's), as geompi.load restores it."""
        path = self.resumed_from or "the checkpoint"  # the master's file, by name
        state.load_own_state(self.w.local_opt, self.w.model, local, path)

    def server_states(self) -> list[dict] | None:
        """Per global server: its slice of every key's optimizer and outer state."""
        ck = self.loaded
        if ck is None:
            return None
        held = state.held_in_file(ck, self.w.engine)
        return self.held.shard_states(held["optimizer"], held["algorithm"], held["model"])

    def send_server_states(self, reqs, states: list[dict] | None = None) -> None:
        """Master worker, during the INIT round: each global server's slice of the state
        (``states``, else the loaded checkpoint's)."""
        states = self.server_states() if states is None else states
        if states is not None:
            self.held.send_server_states(reqs, states)


def say_resumed(path, step: int, note: str) -> None:
    say(f"geompi: resumed from {path} at step {step}{note}")
