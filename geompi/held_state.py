"""The global servers' state by parameter name, and back: what a checkpoint and
``DistributedOptimizer.state_dict`` hold of it.

The global servers hold the model and the optimizer's state in shards, a slice of every flat
key each (geompi.ps), and the algorithm's state beside it (HFA's outer optimizer's, DCASGD's
per-datacenter backups, the update counter). After a SAVE round each sends its snapshot to the
master worker, which assembles whole per-name tensors from them (``assemble``); a restore cuts
per-name tensors into each global server's slices of this run's keys, on whatever topology it
has (``shard_states``), and sends them in the INIT round (``send_server_states``).

What goes where in the per-name dicts (as in the checkpoint file, geompi.checkpointing):
``model``: name -> tensor; ``optimizer``: state -> name -> tensor (scalars such as Adam's
``step`` as 0-d tensors); ``algorithm``: ``dcasgd/backup/dc<d>/<name>``, ``hfa/outer_<state>/
<name>`` and ``global_updates``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from types import SimpleNamespace

import torch

from geompi.comm.transport import isend_state, live_timeout, recv_state
from geompi.errors import CheckpointError
from geompi.ps.protocol import MIRRORED, TAG_RESTORE, TAG_SNAPSHOT
from geompi.sync.hfa import OUTER_STATE

_BACKUP = re.compile(r"^backup_dc(\d+)$")


class HeldState:
    """The master worker's link to the global servers' state: their snapshots assembled by
    parameter name, and a checkpoint's state re-sliced into their shards."""

    def __init__(self, view) -> None:
        """``view``: a worker of the CLI or the API's engine: its ``buckets`` and ``topo``, and
        to reach the servers its ``comms`` and ``client`` (only ``assemble`` and
        ``shard_states`` without them)."""
        self.w = view
        self.names = view.buckets.named_slices()  # name -> (shape, its pieces in the keys)

    @classmethod
    def for_engine(cls, engine) -> HeldState:
        """The public API's optimizer's (geompi.optimizer): its session's communicators and
        topology, its client and buckets."""
        view = SimpleNamespace(
            comms=engine.s.comms, topo=engine.s.topo, client=engine.client, buckets=engine.buckets
        )
        return cls(view)

    def held_state(self) -> dict:
        """Master worker, after a SAVE round: the global servers' state by parameter name,
        ``{"model": ..., "optimizer": ..., "algorithm": ...}`` as a checkpoint holds it."""
        snaps = self.receive_snapshots()
        model, optimizer, algorithm = self.assemble(snaps)
        algorithm["global_updates"] = int(snaps[0]["updates"])
        # MixedSync: the deposits of each datacenter the version holds
        cut = snaps[0].get("cut")
        return {"model": model, "optimizer": optimizer, "algorithm": algorithm, "cut": cut}

    def receive_snapshots(self) -> list[dict]:
        """Master worker, after a SAVE round (or MixedSync's end): every global server's
        snapshot, in shard order."""
        w = self.w
        snaps = []
        for gs in w.topo.global_servers:  # MixedSync's last comes once the slowest DC is done
            snap = recv_state(
                w.comms.world,
                gs,
                TAG_SNAPSHOT,
                w.client.link.stats,
                live_timeout(w.client.timeout),
                f"the snapshot of global server {gs}",
            )
            assert isinstance(snap, dict)  # a state message is a dict (geompi.comm.messages)
            snaps.append(snap)
        return sorted(snaps, key=lambda s: s["index"])

    def assemble(self, snaps: list[dict]) -> tuple[dict, dict, dict]:
        """Full per-name tensors from the shards of every global server: the model, the
        optimizer's state and the algorithm's (as the module's docstring lays them out)."""
        versions = {(tuple(s.get("cut", ())), s["updates"]) for s in snaps}
        if len(versions) > 1:
            raise CheckpointError(
                "the global servers' snapshots are of different versions (deposits per "
                f"datacenter, updates: {sorted(versions)}): this is a geompi bug; resume from an "
                "earlier checkpoint and report it"
            )
        keys = sorted(snaps[0]["values"])
        model = self._by_name(self.whole_keys(snaps))
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        algorithm: dict = {}
        for state_name in sorted({n for s in snaps for st in s["state"].values() for n in st}):
            per_key: dict[int, torch.Tensor] = {}
            per_param: dict[str, list] = {}
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

    @staticmethod
    def whole_keys(snaps: list[dict]) -> dict[int, torch.Tensor]:
        """Every key's values, whole: the shards' slices (``snaps`` in shard order) joined."""
        return {k: torch.cat([s["values"][k] for s in snaps]) for k in sorted(snaps[0]["values"])}

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
            flat = cls._flat(bucket, named)
            assert flat is not None  # every member has it
            return flat[lo:hi].clone()
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
        present = [p for p in parts if p is not None]
        if len(present) < len(parts):
            return None
        if present[0].dim() == 0:
            return present[0].clone()
        flat = torch.empty(bucket.numel)
        for m, t in zip(bucket.members, present):
            flat[m.offset : m.offset + m.numel] = m.values(t)
        return flat

    def send_server_states(self, reqs, states: list[dict]) -> None:
        """Master worker, during the INIT round: each global server's slice of the state
        (``states``: ``shard_states``')."""
        w = self.w
        topo = w.topo
        for g, (gs, st) in enumerate(zip(topo.global_servers, states)):
            if topo.replicas > 1:  # the shard it mirrors comes with its own
                st = {**st, MIRRORED: states[topo.mirrored_shard(g)]}
            isend_state(reqs, w.comms.world, st, gs, TAG_RESTORE, w.client.link.stats)
