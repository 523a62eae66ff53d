"""The KVStore API that GeoMX users know, in PyTorch terms.

    kv = geompi.kv.create("dist_sync")         # on server ranks this serves, then exits
    if kv.is_master_worker:
        kv.set_optimizer(geompi.optim.SGD(lr=0.1))
    kv.init(key, tensor)                       # the master worker's value reaches every worker
    kv.push(key, grad, priority=-idx)          # queued, nonblocking
    kv.pull(key, out=param.data, priority=-idx)
    kv.wait()                                  # or handle.wait()

Pushes are queued and sent as one round, highest priority first, when a pull needs them or at
``wait()``. ``out`` of a pull is written at the latest by the next ``wait()``. Every worker must
push the same keys in the same order of rounds; a mismatch is a clear error, not a hang.

``dist_sync``: a pull after a push returns the value after the global servers applied the
optimizer once to the sum of every worker's push of that round (without an optimizer, the value
becomes that sum). With ``MXNET_KVSTORE_USE_HFA=1`` (or ``GEOMPI_SYNC=hfa``) pushes are
parameters pre-divided by ``num_workers``, as GeoMX users write them: the local server sums them
into the datacenter average, and every K2-th time the global servers average the datacenters.
"""

from __future__ import annotations

import atexit
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from geompi.comm.topology import Topology
from geompi.comm.transport import LAN, Link
from geompi.config import make_config
from geompi.errors import ConfigError
from geompi.ps.client import ClientRound, PSClient
from geompi.ps.optim import Spec, spec_to_dict
from geompi.ps.protocol import MAX_KEYS, Op
from geompi.runtime import install_excepthook

if TYPE_CHECKING:
    from geompi.sync import Algorithm


@dataclass
class _Key:
    id: int
    shape: torch.Size
    dtype: torch.dtype
    value: torch.Tensor  # fp32, flat: the latest value this worker received


@dataclass
class Handle:
    """What push and pull return; ``wait()`` completes the round that carries it."""

    kv: KVStore
    seq: int

    def wait(self) -> None:
        self.kv._complete(self.seq)


@dataclass
class _Round:
    seq: int
    reqs: ClientRound | None = None
    outs: list[tuple[torch.Tensor, _Key]] = field(default_factory=list)


class KVStore:
    """A worker's handle on the parameter servers. Create it with ``geompi.kv.create``."""

    def __init__(self, kind: str, session, algo: Algorithm) -> None:
        topo, comms, stats = session.topo, session.comms, session.stats
        rank = comms.world.Get_rank()
        self._session = session
        self.type = kind
        self.topo = topo
        self._comms = comms
        self.stats = stats
        self.rank = topo.worker_index(rank)
        self.dc = topo.dc_of(rank)
        self.num_dcs = topo.num_dcs
        self.num_workers = len(topo.workers(self.dc))
        self.num_all_workers = topo.num_workers
        self.is_master_worker = rank == 0
        # a push round's kind, each push's weight and flags: the algorithm's (gradients summed,
        # or HFA's parameters averaged)
        self._push = algo.kvstore_push(self.num_workers)
        self._final_at_close = algo.final_model_at_close  # close(): STOP pulls every key
        self._client = PSClient(Link(comms.dc, LAN, stats))
        self._keys: dict[object, _Key] = {}
        self._spec: bytes | None = None
        self._queue: list[tuple[int, int, _Key, torch.Tensor]] = []  # -prio, order, key, data
        self._queued_pulls: list[tuple[torch.Tensor, _Key]] = []
        self._seq = 0  # the round the next flush starts
        self._inflight: _Round | None = None
        self._closed = False
        atexit.register(self.close)

    # ---- configuration --------------------------------------------------------------------
    def set_optimizer(self, optimizer: Spec) -> None:
        """The global servers' optimizer (master worker only); it travels with the next round."""
        if not self.is_master_worker:
            raise ConfigError(
                "set_optimizer is for the master worker: guard it with `if kv.is_master_worker:`"
            )
        self._spec = json.dumps({"optimizer": spec_to_dict(optimizer)}).encode()

    def init(self, key, value: torch.Tensor | list) -> None:
        """Register key(s); the master worker's value(s) become everyone's. Blocking."""
        keys, values = (key, value) if isinstance(key, (list, tuple)) else ([key], [value])
        new = []
        for k, v in zip(keys, values, strict=True):
            if k in self._keys:
                raise ConfigError(f"key {k!r} is already initialized: init each key once")
            entry = _Key(len(self._keys), v.shape, v.dtype, torch.zeros(v.numel()))
            self._keys[k] = entry
            data = (
                v.detach().reshape(-1).to(torch.float32) if self.is_master_worker else entry.value
            )
            new.append((entry, data.clone()))
        self.wait()
        for i in range(0, len(new), MAX_KEYS):
            part = new[i : i + MAX_KEYS]
            self._run_round(Op.INIT, part, weight=0.0, flags=0)
            self._complete(self._seq)

    # ---- push / pull ----------------------------------------------------------------------
    def push(self, key, value: torch.Tensor, priority: int = 0) -> Handle:
        """Queue ``value`` for ``key``. Higher priority is sent first within a round."""
        entry = self._entry(key)
        if value.numel() != entry.value.numel():
            raise ConfigError(
                f"push of key {key!r} with {value.numel()} elements, but it was initialized with "
                f"{entry.value.numel()}: push a tensor of shape {tuple(entry.shape)}"
            )
        if any(e is entry for _, _, e, _ in self._queue):
            self._flush()  # a second push of the same key starts a new round
        data = value.detach().reshape(-1).to(torch.float32, copy=True)
        self._queue.append((-priority, len(self._queue), entry, data))
        return Handle(self, self._seq)

    def pull(self, key, out: torch.Tensor, priority: int = 0) -> Handle:
        """Have ``out`` receive the key's value after the pushes queued so far."""
        entry = self._entry(key)
        if any(e is entry for _, _, e, _ in self._queue):
            self._queued_pulls.append((out, entry))
            self._flush()
            return Handle(self, self._seq - 1)
        if self._inflight is not None:
            self._inflight.outs.append((out, entry))
            return Handle(self, self._inflight.seq)
        _copy_out(out, entry)
        return Handle(self, self._seq - 1)

    def wait(self) -> None:
        """Send everything queued and complete every pending push and pull."""
        if self._queue:
            self._flush()
        if self._inflight is not None:
            self._complete(self._inflight.seq)

    def close(self) -> None:
        """Finish pending work and release the servers (every worker must close; atexit does).

        Where the algorithm ends on the global model at close (``dist_async``: MixedSync) this
        waits for every datacenter; afterwards ``pull`` returns the final global values.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            if self._final_at_close:
                entries = sorted(self._keys.values(), key=lambda e: e.id)
                reqs = self._client.start(Op.STOP, [(e.id, e.value.numel()) for e in entries])
                for e in entries:
                    reqs.pull(e.value)
                reqs.wait()
            else:
                self._client.stop()
        except BaseException:
            self._comms.free()
            raise
        from geompi import session  # the end of the job, as every path ends one

        s = self._session
        session.gather_report(s, {"role": "WORKER", **self.stats.as_dict()})
        s.send_job({"sync": None}, None)
        session.end(s)

    # ---- rounds ---------------------------------------------------------------------------
    def _entry(self, key) -> _Key:
        try:
            return self._keys[key]
        except KeyError:
            raise ConfigError(f"key {key!r} was never initialized: call kv.init first") from None

    def _flush(self) -> None:
        queue = sorted(self._queue, key=lambda item: (item[0], item[1]))
        self._queue = []
        pulls, self._queued_pulls = self._queued_pulls, []
        op, weight, flags = self._push
        for i in range(0, len(queue), MAX_KEYS):
            part = [(entry, data) for _, _, entry, data in queue[i : i + MAX_KEYS]]
            self._run_round(op, part, weight, flags)
        self._inflight.outs.extend(pulls)

    def _run_round(self, op: Op, part, weight: float, flags: int) -> None:
        if self._inflight is not None:
            self._complete(self._inflight.seq)
        spec, self._spec = self._spec, None
        keys = [(e.id, e.value.numel()) for e, _ in part]
        reqs = self._client.start(op, keys, weight=weight, spec=spec, flags=flags)
        for _, data in part:
            reqs.push(data)
        for entry, _ in part:
            reqs.pull(entry.value)
        self._inflight = _Round(self._seq, reqs)
        self._seq += 1

    def _complete(self, seq: int) -> None:
        if self._queue and seq >= self._seq:
            self._flush()
        r = self._inflight
        if r is None or r.seq > seq:
            return
        r.reqs.wait()
        for out, entry in r.outs:
            _copy_out(out, entry)
        self._inflight = None


def _copy_out(out: torch.Tensor, entry: _Key) -> None:
    with torch.no_grad():
        out.copy_(entry.value.view(entry.shape).to(out.dtype))


def create(
    name: str = "dist_sync",
    *,
    dcs: int | None = None,
    dc_sizes: tuple[int, ...] | None = None,
    global_servers: int | None = None,
    comm=None,
) -> KVStore:
    """Join the job's parameter-server tiers. Collective over ``comm`` (default COMM_WORLD).

    On a worker this returns the KVStore. On a server rank it serves until every worker has
    closed its store, then ends the process with status 0: code after ``create()`` runs on
    workers only. The topology comes from the keywords or ``GEOMPI_DCS``, ``GEOMPI_DC_SIZES``
    and ``GEOMPI_GLOBAL_SERVERS`` (and ``GEOMPI_GLOBAL_REPLICAS``: mirrored global servers).
    """
    from geompi import session, sync

    install_excepthook()

    def config():
        sync.for_kvstore(name)  # an unknown type: one line, before the environment's
        cfg = make_config(dcs=dcs, dc_sizes=dc_sizes, global_servers=global_servers)
        sync.for_kvstore(name, cfg)  # a type the environment's algorithm disagrees with
        if cfg.global_replicas > 1:  # GEOMPI_GLOBAL_REPLICAS: where this type keeps mirrors
            sync.for_kvstore(name, cfg).from_config(cfg).check_replication()
        return cfg

    def plan(cfg, c) -> Topology:
        return Topology.plan(
            c.Get_size(), cfg.dcs, cfg.dc_sizes, cfg.global_servers, cfg.global_replicas
        )

    # The one start-up and serve path (geompi.session), as the CLI's and geompi.init()'s: the
    # workers announce the servers' algorithm, the servers serve it until the workers finish.
    s = session.start(config, comm, plan=plan)
    if not s.is_worker:
        session.serve_until_finished(s)
        sys.exit(0)
    algo = sync.for_kvstore(name, s.cfg).from_config(s.cfg)  # the environment's (HFA's K1, K2)
    s.send_job(algo.job(), None)
    return KVStore(name, s, algo)
