"""Checkpoints during training: gather one consistent version to the master worker, write it
with ``geompi.ckpt``, and restore it (re-sharded onto whatever topology the new run has).

What goes where in the file:
- ``/model``: the global model, assembled from the global servers' shards.
- ``/optimizer/<state>/<param>``: the global servers' optimizer state (scalars such as Adam's
  ``step`` are stored per parameter as 0-d tensors).
- ``/algorithm``: ``dcasgd/backup/dc<d>/<param>``, ``hfa/outer_momentum/<param>``, HFA's
  counters and each worker's local optimizer state (``hfa/local/worker<i>/<state>/<param>``).
- ``/progress``: per-worker data positions (``data_positions``: epoch, position) and RNG states.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections import defaultdict

import torch

from geompi import ckpt
from geompi.errors import CheckpointError
from geompi.ps.protocol import TAG_RESTORE, TAG_SNAPSHOT, Op
from geompi.runtime import say

_BACKUP = re.compile(r"^backup_dc(\d+)$")


def check_writable(directory: str) -> None:
    """Fail at start-up, not after hours of training, if checkpoints cannot be written."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = pathlib.Path(directory) / f".geompi-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint to {directory}: {e.strerror or e}; "
            "pass a writable --checkpoint-dir"
        ) from None


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

    # ---- saving ---------------------------------------------------------------------------
    def save(self, step: int, metrics: dict) -> pathlib.Path | None:
        """Every worker of ``w.group`` calls this at the same step; the master writes the file.

        The group is all workers, except in MixedSync where it is datacenter 0 alone: the other
        datacenters keep training, and the global servers' snapshot is one consistent version.
        """
        w = self.w
        reqs = w.client.start(Op.SAVE, [])
        reqs.wait()
        snaps = []
        if w.master:  # before the gather: in MixedSync, other datacenters still need the servers
            snaps = sorted(
                (w.comms.world.recv(source=gs, tag=TAG_SNAPSHOT) for gs in w.topo.global_servers),
                key=lambda s: s["index"],
            )
        mine = {
            "loader": w.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "local": self._local_state(),
        }
        everyone = w.group.gather(mine, root=0)
        if not w.master:
            return None
        model, optimizer, algorithm = self._assemble(snaps)
        algorithm["strategy"] = {k: int(v) for k, v in w.strategy.state().items()}
        if any(m["local"] for m in everyone):
            algorithm["hfa"] = {
                **algorithm.get("hfa", {}),
                "local": {f"worker{i}": m["local"] for i, m in enumerate(everyone)},
            }
        progress = {
            "data_positions": torch.tensor(
                [[m["loader"]["epoch"], m["loader"]["position"]] for m in everyone]
            ),
            "rng": {f"worker{i}": m["rng"] for i, m in enumerate(everyone)},
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
        ckpt.prune(cfg.checkpoint_dir, cfg.keep)
        return path

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
        keys = sorted(snaps[0]["values"])
        flat = {k: torch.cat([s["values"][k] for s in snaps]) for k in keys}
        model = self._by_name(flat)
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        algorithm: dict = {}
        for state_name in sorted({n for s in snaps for st in s["state"].values() for n in st}):
            per_key, per_param = {}, {}
            for k in keys:
                parts = [s["state"].get(k, {}).get(state_name) for s in snaps]
                parts = [p for p in parts if p is not None]
                if not parts:
                    continue
                if isinstance(parts[0], dict):  # {param name: this shard's piece}
                    per_param.update(self._join_pieces(k, parts))
                else:
                    per_key[k] = parts[0] if parts[0].dim() == 0 else torch.cat(parts)
            named = {**self._by_name(per_key), **per_param}
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

    def _join_pieces(self, key: int, parts: list[dict]) -> dict[str, torch.Tensor]:
        """Each parameter of ``key`` that has this state, joined from the shards in order (a
        parameter torch never stepped has none, and stays absent)."""
        out = {}
        for name, (k, _, _, shape) in self.names.items():
            pieces = [p[name] for p in parts if name in p]
            if k != key or not pieces:
                continue
            if pieces[0].dim() == 0:
                out[name] = pieces[0].clone()
            else:
                out[name] = torch.cat([t.reshape(-1) for t in pieces]).reshape(shape).clone()
        return out

    def _by_name(self, per_key: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, (key, off, n, shape) in self.names.items():
            if key in per_key:
                t = per_key[key]
                out[name] = t.clone() if t.dim() == 0 else t[off : off + n].reshape(shape).clone()
        return out

    # ---- restoring ------------------------------------------------------------------------
    def load(self, path: pathlib.Path) -> None:
        """Master worker, at start-up: read and check the whole file before anything starts."""
        w = self.w
        fp = ckpt.fingerprint(w.model.state_dict())
        ck = ckpt.load(path, expect_fingerprint=fp)
        if ck.algorithm_name != w.cfg.sync:
            raise CheckpointError(
                f"checkpoint {path} was written by --sync {ck.algorithm_name}: resume it with "
                f"--sync {ck.algorithm_name}"
            )
        with torch.no_grad():
            for name, p in w.model.named_parameters():
                p.copy_(ck.model[name].to(p.device))
        self.loaded = ck

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
        old, new = info["old"], w.topo.describe()
        if old != new:
            self.restore_note = (
                f" (topology changed from {old.get('dc_sizes')} + {old.get('global_servers')} "
                f"global server(s) to {new['dc_sizes']} + {new['global_servers']}: model and "
                "optimizer state re-sharded"
                + ("" if same else ", data positions and local optimizer state reset")
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
                    t = self._shard_state(b, named, lo, hi)
                    if t is not None:
                        state[b.key][state_name] = t
                t = self._flat(b, outer)
                if t is not None:
                    outer_g[b.key]["outer_momentum"] = t[lo:hi].clone()
            out.append(
                {
                    "state": dict(state),
                    "outer": dict(outer_g),
                    "updates": int(ck.algorithm.get("strategy", {}).get("global_syncs", 0)),
                }
            )
        return out

    @classmethod
    def _shard_state(cls, bucket, named: dict[str, torch.Tensor], lo: int, hi: int):
        """A state's part in the slice [lo, hi) of a bucket: one flat tensor when every member
        has it (a vector state), else ``{name: piece}`` for the members that have it (scalars
        such as Adam's ``step`` differ between parameters that skipped different steps)."""
        parts = [named.get(name) for name, _, _ in bucket.members]
        if all(p is not None and p.dim() > 0 for p in parts):
            return cls._flat(bucket, named)[lo:hi].clone()
        out = {}
        for (name, p, off), t in zip(bucket.members, parts):
            a, b = max(lo, off), min(hi, off + p.numel())
            if t is not None and b > a:
                out[name] = t.clone() if t.dim() == 0 else t.reshape(-1)[a - off : b - off].clone()
        return out or None

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
