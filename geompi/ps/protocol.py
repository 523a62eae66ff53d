"""The round protocol shared by workers, local servers and global servers.

A synchronous round starts with a fixed-size header that every worker sends to its local server
(``Igather``), then one ``Isend`` per key (worker -> local server, which sums them), then one
``Isend`` per key and worker (local server -> workers). Between the local and the global servers
the round is a header, the keys and a trailer with the final weight. Headers must agree across
workers: a mismatch is a ProtocolError, not a hang. The header is float64, so weights (sample
counts, or 1/num_workers) travel exactly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from geompi.errors import ProtocolError


class Op(enum.IntEnum):
    """What a round does to its keys."""

    INIT = 1  # the master worker's values become the global values
    GRAD = 2  # weighted gradient sum -> the global servers' optimizer
    AVG = 3  # weighted parameter average: per datacenter, and globally every K2-th time
    STOP = 4  # the workers are done; servers leave their loops
    SAVE = 5  # global servers hand their optimizer state to the master worker
    ASYNC = 6  # local servers switch the global tier to one-sided windows (MixedSync)


FLAG_SUM = 1  # GRAD: apply the optimizer to the plain sum (KVStore semantics), not the mean
# AVG: set by the local server when this round goes to the global tier; set by the workers
# (HFA's close() between global averages) to make every key of this round go there
FLAG_GLOBAL = 2
# Set by a local server whose header weight is already final (it cannot skip the round): the
# global servers then answer each key as soon as it arrived instead of waiting for the trailers.
FLAG_WEIGHT_FINAL = 4
# GRAD: the plain weighted sum goes back to the workers, which run the optimizer themselves (the
# Python API's default). Servers neither step nor judge non-finite sums: the workers, which see
# the same sum, decide together (a GradScaler skips the step on every worker at once).
FLAG_RAW = 8
# GRAD: the round's last key is per-parameter presence (FSA's layout, see geompi.sync.fsa): a
# count of the workers whose gradient for each parameter exists, one full copy per global server.
# Servers sum it like any key but never compress it, and skip the parameters it counts 0 for.
# A sender whose every count is > 0 sends it empty (see presence_payload): a round in which
# every parameter has a gradient costs no extra bytes, and no result goes back.
FLAG_PRESENCE = 16
# GRAD, MixedSync: the depositing datacenter's hyperparameters changed (an lr schedule). Its
# local server sent them to each global server (a state message, TAG_DEPOSIT_SPEC) before the
# deposit; the global server receives them when it applies the deposit and steps with them.
FLAG_SPEC = 32
# GRAD: the key before the presence key (or the last key) is a sample-weighted mean, not a
# gradient: the workers' buffers (BatchNorm statistics) times their weight. Servers never step or
# compress it; a global server divides the sum by the round's weight. MixedSync's keeps each
# datacenter's mean apart and publishes their sample-weighted mean with the final model.
FLAG_MEAN = 64
# GRAD, AVG, between workers and their local server only: the datacenter sum is reduce-scattered
# among the workers first (geompi.ps.client), so worker j pushes the summed slice j of each key
# (``worker_slice``) and receives slice j of the result, which the workers then exchange among
# themselves: the local server takes in one copy of the model per round, not one per worker. The
# presence key is excluded (it may travel empty). Local servers strip it before the global tier.
FLAG_SCATTER = 128
# AVG, local server -> global tier: a round the workers forced global (FLAG_GLOBAL from them:
# close(), a checkpoint, force_global_average()). Under a lossy WAN codec it travels uncompressed
# both ways and resets both ends' replicas, so every worker leaves it on the global servers'
# model, bitwise, and no datacenter's residual is left behind.
FLAG_EXACT = 256
# AVG, from the workers (HFA's close() under a lossy codec, no local step since the last global
# average): the round only delivers what compression held back; the global servers assign the
# average without an outer step (an outer momentum would otherwise move the model once more).
FLAG_FLUSH = 512
# GRAD, AVG, from the workers (a geompi.Metrics is attached): after the results, the local server
# sends each worker its link counters (TAG_STATS, STATS_LEN float64), uncounted telemetry that
# never goes beyond the datacenter: the per-step records' WAN bytes (geompi.metrics).
FLAG_STATS = 1024
_NOTHING = -1.0  # what a presence buffer holds when an empty message arrived in it

MAX_KEYS = 256
_FIXED = 8  # op, round, weight, nkeys, spec_len, flags, step, k2
_WEIGHT = 2  # the weight's position in a header
_SPEC_LEN = 4
_AGREE = [0, 1, 3, 5, 7, -2, -1]  # op, round, key count, flags, k2, the presence key's slot

TAG_SNAPSHOT = 21  # on the world communicator: a global server's state -> the master worker
TAG_RESTORE = 22  # on the world communicator: checkpointed state -> a global server
# on the world communicator, after a lost global server: a surviving global server's shards (its
# own and its mirror's) -> the master worker, which re-shards them over the global servers left
TAG_TAKEOVER = 27
TAG_NORM = 24  # on global_comm, between global servers: a shard's squared gradient norm
TAG_DEPOSIT_SPEC = 25  # on global_comm: a datacenter's new hyperparameters (FLAG_SPEC)
TAG_HEADER = 11
TAG_TRAILER = 13  # after a round's data: the sender's final weight (0: it skipped the round)
TAG_SPEC = 12
TAG_EXCHANGES = 14  # AVG with k2 (adaptive HFA): local server -> workers, its exchange times
TAG_STATS = 15  # FLAG_STATS: local server -> workers, [WAN sent, WAN received] after a round
STATS_LEN = 2
TAG_DATA = 1000  # + position of the key in the round
TAG_RESULT = 1000 + MAX_KEYS
TAG_PEER_PUSH = 1000 + 2 * MAX_KEYS  # + position: a slice of a worker's push, to its holder
TAG_PEER_RESULT = 1000 + 3 * MAX_KEYS  # + position: a worker's slice of the result, to its peers
# + position: under replication, a local server's copy of a shard's slice to the server that
# mirrors that shard (geompi.ps.global_server)
TAG_MIRROR = 1000 + 4 * MAX_KEYS
# In the state restored into a global server (TAG_RESTORE) under replication: the state of the
# shard it mirrors
MIRRORED = "mirrored"


@dataclass
class Round:
    """One round: the op, the keys (id, numel) in send order, this sender's weight."""

    op: Op
    round_id: int
    keys: list[tuple[int, int]] = field(default_factory=list)
    weight: float = 0.0
    spec_len: int = 0
    flags: int = 0
    step: int = 0  # the sender's training step, for messages
    # AVG, workers -> local server (HFA's adaptive cadence): the K2 the workers chose, by which
    # the local server runs its (staggered) schedule; 0: the local server counts its own K2
    k2: int = 0

    def encode(self) -> torch.Tensor:
        """The fixed-size header. With FLAG_PRESENCE the presence key (the last) sits in the
        header's last slot, outside the prefix that crosses the WAN (``wire_header``): the
        global servers know it from the INIT spec, so the WAN carries no more than before."""
        keys = self.keys
        h = torch.zeros(header_len(), dtype=torch.float64)
        if self.flags & FLAG_PRESENCE and keys:
            keys = keys[:-1]
            h[-2:] = torch.tensor(self.keys[-1], dtype=torch.float64)
            if len(keys) >= MAX_KEYS:
                raise ValueError(f"a round with presence carries at most {MAX_KEYS - 1} keys")
        if len(keys) > MAX_KEYS:
            raise ValueError(f"a round carries at most {MAX_KEYS} keys")
        fixed = [int(self.op), self.round_id, self.weight, len(keys)]
        fixed += [self.spec_len, self.flags, self.step, self.k2]
        values = fixed + [v for key in keys for v in key]  # one conversion, not one per key
        h[: len(values)] = torch.tensor(values, dtype=torch.float64)
        return h

    @classmethod
    def decode(cls, h: torch.Tensor) -> Round:
        op, rid, weight, nkeys, spec_len, flags, step, k2 = h[:_FIXED].tolist()
        flat = [int(v) for v in h[_FIXED : _FIXED + 2 * int(nkeys)].tolist()]
        keys = list(zip(flat[::2], flat[1::2]))
        if int(flags) & FLAG_PRESENCE and h[-1] > 0:  # a full header (a wire one lacks it)
            keys.append((int(h[-2]), int(h[-1])))
        return cls(
            Op(int(op)), int(rid), keys, weight, int(spec_len), int(flags), int(step), int(k2)
        )


def presence_position(rnd: Round) -> int | None:
    """The position of the round's presence key (FLAG_PRESENCE), else None."""
    return len(rnd.keys) - 1 if rnd.flags & FLAG_PRESENCE and rnd.keys else None


def mean_position(rnd: Round) -> int | None:
    """The position of the round's mean key (FLAG_MEAN): just before the presence key."""
    if not rnd.flags & FLAG_MEAN or not rnd.keys:
        return None
    return len(rnd.keys) - (2 if rnd.flags & FLAG_PRESENCE else 1)


def scattered_positions(rnd: Round) -> set[int]:
    """The keys of a round that the workers reduce-scatter among themselves (FLAG_SCATTER)."""
    if not rnd.flags & FLAG_SCATTER:
        return set()
    return set(range(len(rnd.keys))) - {presence_position(rnd)}


def worker_slice(n: int, j: int, workers: int) -> tuple[int, int]:
    """The part ``[lo, hi)`` of a key of ``n`` values that worker ``j`` of ``workers`` holds
    in a scattered round (FLAG_SCATTER)."""
    return j * n // workers, (j + 1) * n // workers


def plain_positions(rnd: Round) -> set[int]:
    """The keys of a round that travel exactly, never compressed: presence and mean."""
    return {i for i in (presence_position(rnd), mean_position(rnd)) if i is not None}


# The datacenter of the master worker (rank 0 is always its first worker): in an INIT round its
# local server alone sends values up; every other datacenter's sum is zeros.
INIT_SOURCE = 0


def sends_values(rnd: Round, dc: int) -> bool:
    """Whether datacenter ``dc``'s local server sends the round's values to the global servers:
    always, but for INIT only the master's datacenter (the others would send the whole model as
    zeros over the WAN; the global servers take the master's values alone)."""
    return rnd.op is not Op.INIT or dc == INIT_SOURCE


def presence_payload(counts: torch.Tensor) -> torch.Tensor:
    """What a sender pushes for a presence key: nothing when every parameter is present."""
    return counts[:0] if bool((counts > 0).all()) else counts


def expect_presence(buf: torch.Tensor) -> None:
    """Before receiving a presence push (``Link.irecv_short``) into ``buf``."""
    buf.fill_(_NOTHING)


def received_presence(buf: torch.Tensor) -> int:
    """After it arrived: an empty push means all present (1 each). Returns the bytes that came."""
    if buf.numel() and float(buf[0]) == _NOTHING:
        buf.fill_(1.0)
        return 0
    return buf.numel() * buf.element_size()


def header_len() -> int:
    """The fixed header length (float64s): room for MAX_KEYS keys."""
    return _FIXED + 2 * MAX_KEYS


def wire_header(h: torch.Tensor) -> torch.Tensor:
    """The used prefix of an encoded header, which is what crosses the WAN: the receiver posts
    a full-length receive into a zeroed buffer, and MPI allows a shorter message."""
    return h[: _FIXED + 2 * int(h[3])]


def clear_beyond_wire(headers: torch.Tensor) -> None:
    """Zero what follows each received wire header's prefix: a staged receive may leave stale
    bytes there, and a full header's last slot (the presence key) must read as absent."""
    for h in headers:
        h[_FIXED + 2 * int(h[3]) :] = 0


def sender_weights(headers: torch.Tensor) -> torch.Tensor:
    """Each sender's weight, read from a stack of encoded headers without decoding them."""
    return headers[:, _WEIGHT].clone()


def _difference(r: Round, first: Round, first_sender: int) -> str:
    """What round ``r`` holds that differs from ``first`` (sent by rank ``first_sender``): the
    round and key ids, else K2, the flags or the keys' sizes, in words."""
    ids, first_ids = [k for k, _ in r.keys], [k for k, _ in first.keys]
    if (r.op, r.round_id, ids) != (first.op, first.round_id, first_ids):
        return (
            f"keys {ids} but rank {first_sender} sent round {first.round_id} "
            f"{first.op.name} keys {first_ids}"
        )
    if r.k2 != first.k2:
        return f"with K2 {r.k2} but rank {first_sender} with K2 {first.k2}"
    if r.flags != first.flags:
        return f"with flags {r.flags:#x} but rank {first_sender} with flags {first.flags:#x}"
    sizes = [(k, n, m) for (k, n), (_, m) in zip(r.keys, first.keys) if n != m]
    shown = ", ".join(f"key {k} of {n} values (rank {first_sender}: {m})" for k, n, m in sizes[:3])
    more = f" and {len(sizes) - 3} more keys" if len(sizes) > 3 else ""
    return f"{shown}{more}: the workers' models differ in size"


def agree(headers: torch.Tensor, senders: list[int], where: str) -> tuple[Round, float, list[int]]:
    """Check that all senders' headers describe the same round.

    Returns (the round, the summed weight, the senders that attached an optimizer spec).
    """
    first = Round.decode(headers[0])
    # The fields that must agree (op, round, key count, flags, keys, the presence slot) are
    # compared in one tensor operation; only a mismatch decodes every header, to name it.
    same = headers[:, _AGREE] == headers[0, _AGREE]
    nkeys = _FIXED + 2 * len(first.keys)
    same_keys = headers[:, _FIXED:nkeys] == headers[0, _FIXED:nkeys]
    if bool(same.all()) and bool(same_keys.all()):
        values = headers[:, [_WEIGHT, _SPEC_LEN]].tolist()
        weight = float(sum(w for w, _ in values))
        return first, weight, [s for s, (_, spec) in zip(senders, values) if spec]
    rounds = [Round.decode(h) for h in headers]
    for sender, r in zip(senders, rounds):
        if (r.op, r.round_id, r.keys, r.flags, r.k2) != (
            first.op,
            first.round_id,
            first.keys,
            first.flags,
            first.k2,
        ):
            raise ProtocolError(
                f"{where}: rank {sender} sent round {r.round_id} {r.op.name} "
                f"{_difference(r, first, senders[0])}: every worker must push the same keys "
                "in the same order (the same model, parameter by parameter)"
            )
    weight = float(sum(r.weight for r in rounds))
    with_spec = [s for s, r in zip(senders, rounds) if r.spec_len]
    return first, weight, with_spec
