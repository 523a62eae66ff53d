"""GlobalServer: holds the fp32 master copy of its shard of every key and its optimizer state."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pathlib
from dataclasses import dataclass

import torch

from geompi.comm import faults
from geompi.comm.buffers import BufferPool
from geompi.comm.topology import Communicators, Topology
from geompi.comm.transport import (
    WAN,
    Link,
    LinkStats,
    Requests,
    isend_state,
    live_timeout,
    recv_buffer,
    recv_state,
    send_state,
)
from geompi.ps.optim import Piece, ServerOptimizer, shard_pieces, spec_from_dict, step_gradient
from geompi.ps.policy import POLICY_STATE, Assign, GlobalPolicy
from geompi.ps.protocol import (
    FLAG_EXACT,
    FLAG_FLUSH,
    FLAG_PRESENCE,
    FLAG_RAW,
    FLAG_SUM,
    FLAG_WEIGHT_FINAL,
    MIRRORED,
    TAG_DATA,
    TAG_HEADER,
    TAG_MIRROR,
    TAG_NORM,
    TAG_RESTORE,
    TAG_RESULT,
    TAG_SNAPSHOT,
    TAG_SPEC,
    TAG_TAKEOVER,
    TAG_TRAILER,
    Op,
    Round,
    agree,
    clear_beyond_wire,
    expect_presence,
    header_len,
    mean_position,
    plain_positions,
    presence_position,
    received_presence,
    sender_weights,
    sends_values,
    wire_header,
)
from geompi.ps.wan import TierCodec


@dataclass
class _Posted:
    """The receives a shard posted for one round's slices, and how to read them."""

    incoming: list[list[torch.Tensor]]  # per local server, per key position
    per_key: list[Requests]
    sizes: list[int]  # this shard's slice length of each key
    packed: list[bool]  # per key position: compressed on the wire
    pos: int | None  # the presence key's position
    exact: bool  # an exact value round of a compressed tier
    plain: set[int]  # positions never compressed


# Test hook: ``GEOMPI_TEST_MIRROR_DUMP=DIR``: at the end of each job, every global server with a
# mirror writes its own shard's snapshot and its mirror's (``gs<index>-<job>.pt``).
MIRROR_DUMP = "GEOMPI_TEST_MIRROR_DUMP"


class GlobalServer:
    """Shard ``index`` of the global model: ``topo.shard_bounds(numel, index)`` of each key."""

    keeps_mirror = True  # under replication (the one-sided tier's servers keep none)

    def __init__(
        self,
        comms: Communicators,
        topo: Topology,
        stats: LinkStats,
        timeout: float | None = None,
        codec: TierCodec | None = None,
        policy: GlobalPolicy | None = None,
    ) -> None:
        self.topo = topo
        self.comms = comms
        self.link = Link(comms.glob, WAN, stats)
        self.world = comms.world
        self._kill_at = faults.fault_step("GEOMPI_FAULT_KILL_AT", comms.world.Get_rank())
        self.index = comms.glob.Get_rank() - topo.num_dcs
        self.answers = True  # a mirror answers no local server
        self.stats = stats
        self.timeout = timeout
        self.codec = codec  # compression of the global tier's data rounds (geompi.ps.wan)
        self._policy0 = copy.deepcopy(policy)  # as the algorithm made it: for a fresh start
        self._fresh()

    def _fresh(self) -> None:
        """The state a new shard starts from (configured by the INIT round's spec)."""
        self.values: dict[int, torch.Tensor] = {}
        self.optimizer: ServerOptimizer | None = None
        # what a value round's average does to a key (geompi.ps.policy): the algorithm's
        self.policy: GlobalPolicy = copy.deepcopy(self._policy0) or Assign()
        self.updates = 0
        self.pieces: dict[int, list[Piece]] = {}  # key -> its parameters in this shard
        self.presence_key: int | None = None
        self.presence_numel = 0  # the whole presence key: one copy per global server
        self._present: torch.Tensor | None = None  # this round's presence counts
        # clip_grad_norm_ of the global gradient before the optimizer steps (FSA on the servers)
        self.max_grad_norm: float | None = None
        self._before: dict | None = None  # this shard at the start of the round under way
        self._restore: dict | None = None  # state from the master worker, after INIT's values
        self._recv_bufs = BufferPool()  # (local server, key position) -> its data
        # Replication (replicas=2): this server also keeps an exact copy of the shard of the
        # server before it (its mirror), from the same slices the local servers send that one.
        self.mirror: GlobalServer | None = None
        topo = self.topo
        if self.keeps_mirror and topo.replicas > 1 and topo.num_global_servers > 1:
            mirrored = dataclasses.replace(topo, replicas=1)  # a mirror mirrors nothing
            mirror = GlobalServer(
                self.comms, mirrored, self.stats, self.timeout, None, self._policy0
            )
            mirror.answers = False
            mirror.index = topo.mirrored_shard(self.index)
            mirror.link = self.link
            if self.codec is not None:
                mirror.codec = TierCodec(self.codec.compressor)
            self.mirror = mirror

    def configure(self, spec: dict) -> None:
        """Apply a spec from the master worker: the optimizer and the policy's settings."""
        if "layout" in spec:
            self.set_layout(spec["layout"], spec.get("presence_key"))
        groups = [spec_from_dict(g) for g in spec.get("groups") or []] or None
        if spec.get("optimizer") and spec.get("update") and self.optimizer is not None:
            # the worker's schedule
            self.optimizer.update(spec_from_dict(spec["optimizer"]), groups)
        elif spec.get("optimizer"):
            self.optimizer = ServerOptimizer(spec_from_dict(spec["optimizer"]), groups)
            for key, pieces in self.pieces.items():
                self.optimizer.set_layout(key, pieces)
        if "max_grad_norm" in spec:
            self.max_grad_norm = float(spec["max_grad_norm"])
        self.policy.configure(spec)
        if self.mirror is not None:
            self.mirror.configure({k: v for k, v in spec.items() if k != "restore"})
        if spec.get("restore"):  # checkpointed state follows from the master worker
            self._restore = recv_state(
                self.world, 0, TAG_RESTORE, self.stats, self.timeout,
                "the checkpointed state to restore",
            )  # fmt: skip
            if self.mirror is not None:  # the mirrored shard's comes with it
                self.mirror._restore = self._restore.pop(MIRRORED)

    def set_layout(self, layout: list, presence_key: int | None) -> None:
        """``[[key, [[name, offset, numel], ...]], ...]``: the parameters of every key, in the
        order of the presence vector (whose key is ``presence_key``)."""
        self.pieces, first = {}, 0
        for key, params in layout:
            numel = sum(int(entry[2]) for entry in params)  # [name, offset, numel(, group)]
            lo, hi = self.topo.shard_bounds(numel, self.index)
            self.pieces[int(key)] = shard_pieces(params, lo, hi, first)
            first += len(params)
        self.presence_key = presence_key
        self.presence_numel = first * self.topo.num_global_servers

    def run(self) -> None:
        faults.serve(self)
        out = os.environ.get(MIRROR_DUMP)
        if out and self.mirror is not None:  # test hook: both copies, to compare them
            job = len(list(pathlib.Path(out).glob(f"gs{self.index}-*.pt")))
            both = {"own": self.snapshot(), "mirror": self.mirror.snapshot()}
            torch.save(both, pathlib.Path(out) / f"gs{self.index}-{job}.pt")

    def rejoin(self, loss: faults.Loss) -> None:
        """After a recovery: the round a lost rank cut off undone; the same shard (and mirror)
        served to the surviving local servers, or, when a global server was lost, both handed
        to the master worker, which re-shards the global tier (its mirror held the lost
        server's shard) and starts this server afresh with an INIT round."""
        parts = self._parts()
        for part in parts:
            roll_back(part, loss.done)
        handed = [part.snapshot() for part in parts] if loss.lost_global else None
        self.topo = loss.topo
        self.link = Link(self.comms.glob, WAN, self.stats)
        self.world = self.comms.world
        self.index = self.comms.glob.Get_rank() - self.topo.num_dcs
        if handed is not None:
            reqs = Requests(self.stats, live_timeout(self.timeout), "the master worker")
            isend_state(reqs, self.world, {"shards": handed}, 0, TAG_TAKEOVER, self.stats)
            reqs.wait()
            self._fresh()  # after the snapshots: they share nothing with what comes
        elif self.mirror is not None:  # the same shard mirrored: the global servers all stay
            self.mirror.topo = dataclasses.replace(self.topo, replicas=1)
            self.mirror.link, self.mirror.world = self.link, self.world

    def report(self) -> dict:
        """What this server contributes to the run's summary."""
        out = {"global_server": self.index, "updates": self.updates}
        if self.mirror is not None:
            out["mirrors"] = self.mirror.index
        return out

    def serve_round(self) -> Round | None:
        """Serve one synchronous round; returns it, or None once the workers are done."""
        d = self.topo.num_dcs
        reqs = Requests(self.stats, self.timeout, "the local servers")
        headers = torch.zeros(d, header_len(), dtype=torch.float64)
        for i in range(d):
            self.link.irecv(reqs, headers[i], i, TAG_HEADER, count=False)
        reqs.wait()
        clear_beyond_wire(headers)
        self.stats.received[WAN] += sum(8 * wire_header(h).numel() for h in headers)
        rnd, weight, with_spec = agree(headers, list(range(d)), "global tier")
        if rnd.step == self._kill_at:  # test hook: this global server is lost now
            faults.kill_self(self.world.Get_rank())
        for ls in with_spec:
            spec_t = torch.empty(int(Round.decode(headers[ls]).spec_len), dtype=torch.uint8)
            recv_buffer(
                self.link.comm, spec_t.numpy(), ls, TAG_SPEC, self.timeout,
                f"the spec from local server {ls}",
            )  # fmt: skip
            self.configure(json.loads(spec_t.numpy().tobytes()))
        if rnd.op is Op.STOP:
            return None
        if rnd.op is Op.ASYNC:
            return rnd
        if rnd.op is Op.SAVE:
            self.send_snapshot()
            return rnd
        if rnd.flags & FLAG_PRESENCE and self.presence_key is not None:  # not on the wire
            rnd.keys.append((self.presence_key, self.presence_numel))
        self._serve_data(rnd, headers, reqs)
        return rnd

    def _parts(self) -> list[GlobalServer]:
        """The shards this server keeps: its own, and the one it mirrors (replication)."""
        return [self] if self.mirror is None else [self, self.mirror]

    def _serve_data(self, rnd: Round, headers: torch.Tensor, reqs: Requests) -> None:
        """A data round: every shard this server keeps receives its slices and applies them;
        only its own shard answers (a mirror keeps an exact copy of another server's)."""
        d = self.topo.num_dcs
        parts = self._parts()
        if faults.watching():
            for part in parts:
                keep_before(part, rnd)
        trailers = torch.zeros(d, dtype=torch.float64)
        senders = [ls for ls in range(d) if sends_values(rnd, ls)]  # INIT: the master's only
        for ls in range(d):
            self.link.irecv(reqs, trailers[ls : ls + 1], ls, TAG_TRAILER)
        posted = [part._post(rnd, senders, mirrored=part is not self) for part in parts]
        if rnd.flags & FLAG_WEIGHT_FINAL:  # each key goes on as soon as it arrived
            weights = sender_weights(headers)
        else:  # a local server may still skip the round (weight 0): wait for every trailer
            reqs.wait()
            weights = trailers
        # A gradient from a datacenter that skipped a non-finite round (weight 0) is left out.
        used = [ls for ls in senders if rnd.op is not Op.GRAD or weights[ls] > 0]
        weight = float(weights[used].sum()) if used else 0.0
        held = [
            part._apply_posted(rnd, post, reqs, senders, used, weight)
            for part, post in zip(parts, posted)
        ]
        if held[0]:  # clipping: one coefficient for the whole model, every shard alike
            coef = clip_coefficient(self, [g for *_, g in held[0]])
            for part, post, keys in zip(parts, posted, held):
                for i, key, compressed, grad in keys:
                    part.apply(rnd, key, grad.mul_(coef), 1.0)  # already the average
                    part._send_result(reqs, rnd, i, post.pos, compressed, post.sizes[i])
        for part in parts:
            if part._restore is not None:
                part.restore(part._restore)
                part._restore = None
        reqs.wait()

    def _post(self, rnd: Round, senders: list[int], mirrored: bool) -> _Posted:
        """Post the receives of this shard's slices of the round's keys (``mirrored``: the
        copies the local servers send a mirror, under their own tags)."""
        self._keep: list[torch.Tensor] = []  # payloads alive until their sends complete
        self._present = None
        pos = presence_position(rnd)  # never compressed; read first, it says what to step
        exact = self.codec is not None and rnd.op is Op.AVG and bool(rnd.flags & FLAG_EXACT)
        codec_round = self.codec is not None and rnd.op in (Op.GRAD, Op.AVG) and not exact
        plain = plain_positions(rnd)
        packed = [codec_round and i not in plain for i in range(len(rnd.keys))]
        sizes = [self._slice_len(n) for _, n in rnd.keys]
        d = self.topo.num_dcs
        incoming = [
            [
                self._payload(m) if packed[i] else self._recv_bufs.get((ls, i), m)
                for i, m in enumerate(sizes)
            ]
            for ls in range(d)
        ]
        per_key = [Requests(self.stats, self.timeout, "the local servers") for _ in sizes]
        base = TAG_MIRROR if mirrored else TAG_DATA
        for ls in senders:
            for i, buf in enumerate(incoming[ls]):
                if i == pos:  # may come empty: every parameter of that datacenter present
                    expect_presence(buf)
                    self.link.irecv_short(per_key[i], buf, ls, base + i)
                elif sizes[i]:
                    self.link.irecv(per_key[i], buf, ls, base + i)
        return _Posted(incoming, per_key, sizes, packed, pos, exact, plain)

    def _apply_posted(
        self, rnd: Round, post: _Posted, reqs: Requests, senders: list[int], used: list[int],
        weight: float,
    ) -> list[tuple[int, int, bool, torch.Tensor]]:  # fmt: skip
        """Apply each key's slices as they arrive and answer it; returns the gradients held
        back for clipping (it needs the norm over every key of every shard)."""
        pos, sizes = post.pos, post.sizes
        mean = mean_position(rnd)  # buffers: averaged, never stepped or compressed
        order = list(range(len(rnd.keys)))
        if pos is not None:
            order.insert(0, order.pop(pos))
        clip = (
            self.max_grad_norm is not None
            and rnd.op is Op.GRAD
            and self.optimizer is not None
            and not rnd.flags & (FLAG_RAW | FLAG_SUM)
            and weight > 0
        )
        held: list[tuple[int, int, bool, torch.Tensor]] = []
        for i in order:
            key = rnd.keys[i][0]
            compressed = post.packed[i]
            post.per_key[i].wait()
            if i == pos:
                self.stats.received[WAN] += sum(
                    received_presence(post.incoming[ls][i]) for ls in senders
                )
            total = self._total(rnd, key, i, post, used, weight)
            if clip and i not in (pos, mean) and key in self.values:
                held.append((i, key, compressed, total.div_(weight)))  # the global gradient
                continue
            if i == mean and key in self.values:
                self.apply_mean(key, total, weight)
            elif used or key not in self.values:
                self.apply(rnd, key, total, weight)
            self._send_result(reqs, rnd, i, pos, compressed, sizes[i])
        return held

    def _total(
        self, rnd: Round, key: int, i: int, post: _Posted, used: list[int], weight: float
    ) -> torch.Tensor:
        """The sum over the senders of key position ``i``'s slices (decoded)."""
        row = [post.incoming[ls][i] for ls in used]
        compressed = post.packed[i]
        if compressed:
            row = [self.codec.decode_push(p, post.sizes[i]) for p in row]
        total = row[0] if row else torch.zeros(post.sizes[i], dtype=torch.float32)
        for other in row[1:]:
            total.add_(other)
        if key in self.values and rnd.op is Op.AVG and i not in post.plain:
            if compressed:  # the pushes were relative to the replica: add them to the
                # servers' own model, not to the replica, so what the last pull left out
                # (values - replica) is kept, and sent with a later pull
                total.add_(self.values[key], alpha=weight)
            elif post.exact:  # whole models, each on top of the replica: the same rule
                ahead = self.values[key] - self.codec.reference(key, post.sizes[i])
                total.add_(ahead, alpha=weight)
        return total

    def _send_result(
        self, reqs: Requests, rnd: Round, i: int, pos: int | None, compressed: bool, size: int
    ) -> None:
        """The round's result for key position ``i`` to every local server."""
        if not size:
            return
        key = rnd.keys[i][0]
        result = self.values[key] if i != pos else self.values[key][:0]  # none back
        if compressed:
            result = self.codec.encode_pull(key, result)
            self._keep.append(result)
        elif self.codec is not None and (rnd.op is Op.INIT or rnd.flags & FLAG_EXACT):
            self.codec.set_replica(key, result)  # both ends hold the values exactly
        if not self.answers:  # a mirror: its codec moved as the shard's own server's did
            return
        for ls in range(self.topo.num_dcs):
            self.link.isend(reqs, result, ls, TAG_RESULT + i)
        reqs.test()

    def apply(
        self, rnd: Round, key: int, total: torch.Tensor, weight: float, dc: int | None = None
    ) -> None:
        """What a round does to this server's slice of ``key``, given the sum over senders."""
        if key == self.presence_key:  # counts, not a value: kept as they are, sent back
            self.values[key] = total.clone()
            self._present = self.values[key] if rnd.op is Op.GRAD else None
            return
        if key not in self.values:
            self.values[key] = total.clone()
            return
        if rnd.op is Op.INIT:  # in place: the optimizer state keeps pointing at it
            self.values[key].copy_(total)
            return
        value = self.values[key]
        if rnd.op is Op.GRAD:
            self.updates += 1
            present = self._presence(key)
            step_gradient(self.optimizer, key, value, total, weight, rnd.flags, dc, present)
        elif rnd.flags & FLAG_FLUSH:  # a value round of held-back residuals only
            self.updates += 1
            value.copy_(total.div_(weight))
        else:  # a value round: the policy steps the key from the datacenters' average
            self.updates += 1
            self.policy.average(key, value, total.div_(weight))

    def apply_mean(self, key: int, total: torch.Tensor, weight: float, dc=None) -> None:
        """A mean key (the workers' buffers times their weight): the sample-weighted mean of
        the round; a round every datacenter skipped (weight 0) keeps the last one."""
        if weight > 0:
            self.values[key].copy_(total.div_(weight))

    def _presence(self, key: int) -> list[bool] | None:
        """Per piece of ``key``: whether any worker's gradient for it exists this round."""
        if self._present is None or key not in self.pieces:
            return None
        return [bool(self._present[pc.index] > 0) for pc in self.pieces[key]]

    # ---- checkpoints ----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """This shard's values and optimizer state, per key (for the checkpoint writer)."""
        return {
            "index": self.index,
            "values": {k: v.clone() for k, v in self.values.items()},
            "state": self.optimizer.state_dict() if self.optimizer is not None else {},
            POLICY_STATE: {k: dict(st) for k, st in self.policy.state_dict().items()},
            "updates": self.updates,
        }

    def send_snapshot(self) -> None:
        # the master may be waiting for slower datacenters first (MixedSync's last snapshot)
        send_state(
            self.world, self.snapshot(), 0, TAG_SNAPSHOT, self.stats, live_timeout(self.timeout),
            "the master worker to take a snapshot",
        )  # fmt: skip

    def restore(self, state: dict) -> None:
        """Optimizer and policy state for this shard, re-sliced by the master worker."""
        if self.optimizer is not None and state.get("state"):
            self.optimizer.load_state_dict(self.values, state["state"])
        self.policy.load_state_dict({k: dict(st) for k, st in state.get(POLICY_STATE, {}).items()})
        self.updates = int(state.get("updates", 0))

    def _slice_len(self, numel: int) -> int:
        lo, hi = self.topo.shard_bounds(numel, self.index)
        return hi - lo

    def _payload(self, n: int) -> torch.Tensor:
        return torch.empty(self.codec.nbytes(n), dtype=torch.uint8)


# ---- pieces of a round beside the shard's own state -------------------------------------------
def keep_before(shard: GlobalServer, rnd: Round) -> None:
    """Under --on-failure continue: the shard as the round starts, kept until the next one
    starts (every worker then had this round's results), so a round that no surviving worker
    completed (some keys applied, some not, or all applied but not every result delivered) can
    be undone and redone by the survivors."""
    shard._before = {
        "round": rnd.round_id,
        "values": {k: v.clone() for k, v in shard.values.items()},
        "policy": copy.deepcopy(shard.policy.state_dict()),
        "optimizer": copy.deepcopy(shard.optimizer.state_dict()) if shard.optimizer else None,
        "updates": shard.updates,
    }


def roll_back(shard: GlobalServer, done: int) -> None:
    """Undo the round a lost rank cut off (see keep_before): one later than ``done``, the last
    round a surviving worker completed. Nothing if none was."""
    before, shard._before = shard._before, None
    if before is None or before["round"] <= done:
        return
    for k, v in before["values"].items():
        if k in shard.values:
            shard.values[k].copy_(v)  # in place: the optimizer state points at them
    shard.policy.load_state_dict(before["policy"])
    if before["optimizer"] is not None:
        shard.optimizer.load_state_dict(shard.values, before["optimizer"])
    shard.updates = before["updates"]


def clip_coefficient(server: GlobalServer, grads: list[torch.Tensor]) -> float:
    """``clip_grad_norm_``'s factor for the global gradient, whose slices the global servers
    share: each sends the others its squared norm (a round among them, on global_comm). A
    mirror's shard takes the same factor: the norm is the whole model's."""
    mine = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        mine += float(torch.linalg.vector_norm(g)) ** 2
    link, topo = server.link, server.topo
    ndc, me = topo.num_dcs, link.comm.Get_rank()
    others = [ndc + g for g in range(topo.num_global_servers) if ndc + g != me]
    theirs = torch.zeros(len(others), dtype=torch.float64)
    reqs = Requests(server.stats, server.timeout, "the other global servers' gradient norms")
    for j, o in enumerate(others):
        link.isend(reqs, mine, o, TAG_NORM, control=True)
        link.irecv(reqs, theirs[j : j + 1], o, TAG_NORM)
    reqs.wait()
    # every server adds the same numbers in the same order (by rank), so all agree exactly
    parts = dict(zip(others, theirs.tolist()))
    parts[me] = float(mine)
    norm = math.sqrt(sum(parts[r] for r in sorted(parts)))
    return min(1.0, server.max_grad_norm / (norm + 1e-6))
