"""Checkpoints during training: gather one consistent version to the master worker, write it
with ``geompi.ckpt``, and restore it (re-sharded onto whatever topology the new run has).

What goes where in the file:
- ``/model``: the global model, assembled from the global servers' shards.
- ``/optimizer/<state>/<param>``: the global servers' optimizer state (scalars such as Adam's
  ``step`` are stored per parameter as 0-d tensors).
- ``/algorithm``: ``dcasgd/backup/dc<d>/<param>``, ``hfa/outer_momentum/<param>``, HFA's
  counters and each worker's local optimizer state (``hfa/local/worker<i>/<state>/<param>``).
- ``/algorithm@global_updates``: the global servers' update counter.
- ``/progress``: per-worker data positions (``data_positions``: epoch, position), steps
  (``steps``) and RNG states. In MixedSync each datacenter's entries are its own progress at
  the checkpoint's version (see docs/checkpoint-format.md).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import tempfile
from collections import defaultdict

import torch

from geompi import ckpt
from geompi.comm.compression import make_compressor
from geompi.errors import CheckpointError
from geompi.ps.protocol import TAG_RESTORE, TAG_SNAPSHOT, Op
from geompi.runtime import say

_BACKUP = re.compile(r"^backup_dc(\d+)$")


def check_writable(directory: str) -> None:
    """Fail at start-up, not after hours of training, if checkpoints cannot be written."""
    try:
        os.makedirs(directory, exist_ok=True)
        # Exclusive and unpredictable (host, pid, random): never writes through a planted symlink.
        prefix = f".geompi-write-test-{ckpt.files._host()}-{os.getpid()}-"
        fd, probe = tempfile.mkstemp(prefix=prefix, dir=directory)
        os.close(fd)
        os.unlink(probe)
        stale = ckpt.remove_stale_temps(directory)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint to {directory}: {e.strerror or e}; "
            "pass a writable --checkpoint-dir"
        ) from None
    if stale:
        say(f"geompi: removed {len(stale)} temporary file(s) of killed writers from {directory}")


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
        self.names = worker.buckets.named_slices()  # name -> (key, offset, numel, shape)
        self.loaded: ckpt.Checkpoint | None = None
        self.restore_note = ""
        self.starts: list[dict] | None = None  # MixedSync, master: every worker's run start
        self.saved_step = -1  # the step of this run's last checkpoint
        self.saved_model: dict[str, torch.Tensor] | None = None  # master: its /model
        self.resumed_from: pathlib.Path | None = None  # master: the file this run resumed
        self.written: list[pathlib.Path] = []  # master: this run's files, newest first

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
        self.starts = w.comms.all_workers.gather(mine, root=0)

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
        everyone = w.group.gather(mine, root=0)
        self.saved_step = step
        if not w.master:
            return None
        model, optimizer, algorithm = self._assemble(snaps)
        self.saved_model = model
        algorithm["strategy"] = {k: int(v) for k, v in w.strategy.state().items()}
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
        ckpt.save(
            path,
            model=model,
            optimizer=optimizer,
            optimizer_attrs={"name": cfg.optimizer if cfg.sync != "hfa" else "none"},
            algorithm=algorithm,
            progress=progress,
            step=step,
            epoch=w.loader.epoch,
            algorithm_name=cfg.sync,
            topology=w.topo.describe(),
            config=json.loads(cfg.to_json()),
            metrics=metrics,
        )
        ckpt.prune(cfg.checkpoint_dir, cfg.keep, lineage=self.lineage(path))
        return path

    def _receive_snapshots(self) -> list[dict]:
        w = self.w
        return sorted(
            (w.comms.world.recv(source=gs, tag=TAG_SNAPSHOT) for gs in w.topo.global_servers),
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
            per_key = {}
            for k in keys:
                parts = [s["state"].get(k, {}).get(state_name) for s in snaps]
                if all(p is None for p in parts):
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
            named = self._by_name(per_key)
            m = _BACKUP.match(state_name)
            if m:
                backups = algorithm.setdefault("dcasgd", {}).setdefault("backup", {})
                backups[f"dc{m.group(1)}"] = named
            else:
                optimizer[state_name] = named
        outer = {
            k: torch.cat([s["outer"][k]["outer_momentum"] for s in snaps])
            for k in keys
            if all("outer_momentum" in s["outer"].get(k, {}) for s in snaps)
        }
        if outer:
            algorithm["hfa"] = {"outer_momentum": self._by_name(outer)}
        return model, optimizer, algorithm

    def _by_name(self, per_key: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, (key, off, n, shape) in self.names.items():
            if key in per_key:
                t = per_key[key]
                out[name] = t.clone() if t.dim() == 0 else t[off : off + n].reshape(shape).clone()
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
        config = ck.attrs.get("config") or {}
        written = (json.loads(config) if isinstance(config, str) else config).get(
            "wan_compression", "none"
        )
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
        """Collective over workers: each gets its data position, RNG and local state."""
        w = self.w
        ck = self.loaded
        info = None
        if w.master and ck is not None:
            old = ck.attrs["topology"]
            positions = ck.progress["data_positions"].tolist()
            info = {
                "step": ck.step,
                "positions": positions,
                "rng": ck.progress.get("rng", {}),
                "local": ck.algorithm.get("hfa", {}).get("local", {}),
                "strategy": ck.algorithm.get("strategy", {}),
                "steps": ck.progress["steps"].tolist() if "steps" in ck.progress else None,
                "old": old,
            }
        info = w.comms.all_workers.bcast(info, root=0)
        if info is None:
            return None
        same = len(info["positions"]) == w.topo.num_workers
        i = w.widx if same else 0
        epoch, position = info["positions"][i]
        w.loader.load_state_dict({"epoch": int(epoch), "position": int(position)})
        rng = info["rng"].get(f"worker{i}")
        if rng is not None:
            torch.set_rng_state(rng)
        local = info["local"].get(f"worker{w.widx}") if same else None
        if local and w.local_opt is not None:
            self._load_local(local)
        w.strategy.load_state(info["strategy"])
        w.step = info["step"]
        if same and info["steps"] is not None:  # MixedSync: each datacenter its own step
            w.step = int(info["steps"][w.widx])
            w.strategy.global_syncs += w.step - info["step"]
        old, new = info["old"], w.topo.describe()
        if old != new:
            self.restore_note = (
                f" (topology changed from {old.get('dc_sizes')} + {old.get('global_servers')} "
                f"global server(s) to {new['dc_sizes']} + {new['global_servers']}: model and "
                "optimizer state re-sharded"
                + ("" if same else ", data positions and local optimizer state reset")
                + ")"
            )
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
        if ck is None or not (
            ck.optimizer
            or ck.algorithm.get("dcasgd")
            or ck.algorithm.get("hfa", {}).get("outer_momentum")
            or ck.algorithm.get("global_updates")
        ):
            return None
        per_state: dict[str, dict[str, torch.Tensor]] = dict(ck.optimizer)
        if ck.algorithm.get("dcasgd", {}).get("backup"):
            # Every datacenter restarts from /model (the INIT round), so that is what each one
            # holds: the saved backups predate it. Datacenters new to this topology get it too.
            for dc in range(self.w.topo.num_dcs):
                per_state[f"backup_dc{dc}"] = ck.model
        outer = ck.algorithm.get("hfa", {}).get("outer_momentum", {})
        topo = self.w.topo
        out = []
        for g in range(topo.num_global_servers):
            state: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
            outer_g: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
            for b in self.w.buckets:
                lo, hi = topo.shard_bounds(b.numel, g)
                for state_name, named in per_state.items():
                    t = self._flat(b, named)
                    if t is not None:
                        state[b.key][state_name] = t if t.dim() == 0 else t[lo:hi].clone()
                t = self._flat(b, outer)
                if t is not None:
                    outer_g[b.key]["outer_momentum"] = t[lo:hi].clone()
            out.append(
                {
                    "state": dict(state),
                    "outer": dict(outer_g),
                    "updates": int(
                        ck.algorithm.get(
                            "global_updates",  # older files: the best guess there is
                            ck.algorithm.get("strategy", {}).get("global_syncs", 0),
                        )
                    ),
                }
            )
        return out

    @staticmethod
    def _flat(bucket, named: dict[str, torch.Tensor]) -> torch.Tensor | None:
        parts = [named.get(name) for name, _, _ in bucket.members]
        if any(p is None for p in parts):
            return None
        if parts[0].dim() == 0:
            return parts[0].clone()
        flat = torch.empty(bucket.numel)
        for (_, _, off), t in zip(bucket.members, parts):
            flat[off : off + t.numel()] = t.reshape(-1)
        return flat

    def send_server_states(self, reqs) -> None:
        """Master worker, during the INIT round: each global server's slice of the state."""
        states = self.server_states()
        if states is None:
            return
        for gs, st in zip(self.w.topo.global_servers, states):
            reqs.add(self.w.comms.world.isend(st, dest=gs, tag=TAG_RESTORE), "wan")


def say_resumed(path, step: int, note: str) -> None:
    say(f"geompi: resumed from {path} at step {step}{note}")
