"""Server-side optimizers on flat tensors, and their JSON specs.

A spec (``SGD(lr=0.1)``) is plain data: it travels from the master worker to the global servers
as JSON, never pickled. ``spec.build()`` makes the ``ServerOptimizer`` that a global server runs
on its slice of each key. SGD and Adam/AdamW run torch's own functional optimizers on a flat
view (``ServerTorchStep``), so their arithmetic is exactly ``torch.optim``'s; DCASGD is written
out here.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from geompi.errors import ConfigError
from geompi.ps.protocol import FLAG_RAW, FLAG_SUM

OPTIMIZERS = ("sgd", "adam", "adamw", "dcasgd")


@dataclass
class SGD:
    """SGD with optional momentum, dampening, weight decay and Nesterov, as ``torch.optim.SGD``."""

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0
    maximize: bool = False
    name: str = field(default="sgd", init=False)


@dataclass
class Adam:
    """Adam, as ``torch.optim.Adam`` (``decoupled_weight_decay``: AdamW's rule, as torch's)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    decoupled_weight_decay: bool = False
    name: str = field(default="adam", init=False)


@dataclass
class AdamW(Adam):
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``."""

    weight_decay: float = 1e-2
    decoupled_weight_decay: bool = True
    name: str = field(default="adamw", init=False)


@dataclass
class DCASGD:
    """Delay-compensated async SGD (Zheng et al. 2017) with one backup per datacenter.

    MXNet's rule: ``w <- w - lr * (g + wd * w + lam * g*g * (w - w_bak[d]))``, then
    ``w_bak[d]`` is what datacenter d pulled (``ServerOptimizer.pulled``). ``g*g`` squares the
    raw gradient: weight decay is not folded in. With ``adaptive``, lam is
    ``lam / (sqrt(ms) + eps)``, ``ms <- rho * ms + (1 - rho) * g*g`` starting from 0.
    """

    lr: float = 0.1
    lam: float = 0.04
    adaptive: bool = False
    rho: float = 0.95
    eps: float = 1e-7
    weight_decay: float = 0.0
    name: str = field(default="dcasgd", init=False)


Spec = SGD | Adam | AdamW | DCASGD
_SPECS = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "dcasgd": DCASGD}


def spec_to_dict(spec: Spec) -> dict:
    return asdict(spec)


def spec_from_dict(d: Mapping) -> Spec:
    """Rebuild a spec from its JSON form; unknown names or fields are a ConfigError."""
    d = dict(d)
    name = d.pop("name", None)
    cls = _SPECS.get(name)
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    try:
        return cls(**d)
    except TypeError as e:
        raise ConfigError(f"bad settings for optimizer {name}: {e}") from None


def dumps(spec: Spec) -> str:
    return json.dumps(spec_to_dict(spec), sort_keys=True)


@dataclass(frozen=True)
class Piece:
    """The part of one model parameter that lies in this server's slice of a key."""

    name: str  # the parameter's name ("" for a key without a layout: one parameter)
    index: int  # the parameter's position in the run's presence vector (-1: none)
    lo: int  # [lo, hi) within the server's slice of the key
    hi: int
    group: int = 0  # the worker optimizer's param group (-1: not in the optimizer: not stepped)


def shard_pieces(layout: Sequence, lo: int, hi: int, first_index: int = 0) -> list[Piece]:
    """The pieces of ``layout`` (``(name, offset, numel[, group])`` per parameter of a key, in
    order) that fall in the shard ``[lo, hi)`` of the key; parameter j has presence index
    ``first_index + j``."""
    out = []
    for j, (name, off, n, *group) in enumerate(layout):
        a, b = max(lo, off), min(hi, off + n)
        if b > a:
            out.append(Piece(str(name), first_index + j, a - lo, b - lo, int((group or [0])[0])))
    return out


class ServerOptimizer:
    """Applies one spec to many keys, each a flat fp32 tensor owned by this server.

    A key with a layout (``set_layout``) is stepped as one ``torch.optim`` parameter per piece,
    so a piece whose gradient is absent is skipped exactly as torch.optim skips ``grad=None``;
    a key without one is a single parameter. ``groups``: one spec per param group of the
    worker's optimizer (the same class, their own hyperparameters); a piece's ``group`` picks one.
    """

    def __init__(self, spec: Spec, groups: Sequence[Spec] | None = None) -> None:
        self.spec = spec
        self.groups = self._check_groups(spec, groups)
        self._group_ids: dict[int, list[int]] = {}  # key -> the spec index of each torch group
        self.pieces: dict[int, list[Piece]] = {}
        self._torch: dict[int, ServerTorchStep] = {}
        self._params: dict[int, list[torch.nn.Parameter]] = {}
        self._base: dict[int, int] = {}  # key -> data_ptr of the value the params view
        self.state: dict[int, dict[str, torch.Tensor]] = {}  # DCASGD's own state

    def set_layout(self, key: int, pieces: list[Piece]) -> None:
        """The parameters of ``key`` in this server's slice (before the key's first step)."""
        self.pieces[key] = list(pieces)

    def _pieces(self, key: int, value: torch.Tensor) -> list[Piece]:
        return self.pieces.get(key) or [Piece("", -1, 0, value.numel())]

    def step(
        self,
        key: int,
        value: torch.Tensor,
        grad: torch.Tensor,
        dc: int | None = None,
        present: Sequence[bool] | None = None,
    ) -> None:
        """Update ``value`` in place with ``grad`` (already averaged) coming from datacenter dc.

        ``present[i]`` False: piece i of the key got no gradient and is left as torch leaves it.
        """
        if isinstance(self.spec, DCASGD):
            self._dcasgd(key, value, grad, dc, present)
            return
        params = self._torch_params(key, value)
        for i, (p, pc) in enumerate(zip(params, self._pieces(key, value))):
            if pc.group >= 0 and (present is None or present[i]):
                p.grad = grad[pc.lo : pc.hi]
        self._torch[key].step()
        for p in params:
            p.grad = None

    def _torch_params(self, key: int, value: torch.Tensor) -> list[torch.nn.Parameter]:
        """The key's per-piece parameters, views of ``value`` (made on first use)."""
        params = self._params.get(key)
        if params is None:
            params = [
                torch.nn.Parameter(value[pc.lo : pc.hi], requires_grad=True)
                for pc in self._pieces(key, value)
            ]
            self._params[key] = params
            self._torch[key] = self._make_torch(key, params, self._pieces(key, value))
        elif self._base[key] != value.data_ptr():  # the key's tensor was replaced: follow it
            for p, pc in zip(params, self._pieces(key, value)):
                p.data = value[pc.lo : pc.hi]
        self._base[key] = value.data_ptr()
        return params

    def _make_torch(
        self, key: int, params: list[torch.nn.Parameter], pieces: list[Piece]
    ) -> ServerTorchStep:
        """One torch optimizer for a key, with a param group per worker group it holds."""
        by_group: dict[int, list[torch.nn.Parameter]] = {}
        for p, pc in zip(params, pieces):
            if pc.group >= len(self.groups):
                raise ConfigError(
                    f"parameter {pc.name} is in param group {pc.group}, but the spec has "
                    f"{len(self.groups)}: this is a geompi bug; report it"
                )
            if pc.group >= 0:
                by_group.setdefault(pc.group, []).append(p)
        order = sorted(by_group) or [0]
        # a key of parameters outside the optimizer: an empty stand-in, never stepped
        first = by_group.get(order[0]) or [torch.nn.Parameter(torch.zeros(0))]
        opt = ServerTorchStep(self.groups[order[0]], first)
        for g in order[1:]:
            opt.add_param_group({"params": by_group[g], **_hyperparameters(self.groups[g])})
        self._group_ids[key] = order
        return opt

    @staticmethod
    def _check_groups(spec: Spec, groups: Sequence[Spec] | None) -> list[Spec]:
        groups = list(groups or [spec])
        if any(type(g) is not type(spec) for g in groups) or (
            len(groups) > 1 and isinstance(spec, DCASGD)
        ):
            raise ConfigError(
                "the param groups of a server optimizer must share its class (DCASGD takes one "
                "group): build one torch.optim optimizer over every group"
            )
        return groups

    def update(self, spec: Spec, groups: Sequence[Spec] | None = None) -> None:
        """New hyperparameters of the same optimizer (a worker's lr schedule): its state stays."""
        if type(spec) is not type(self.spec):
            raise ConfigError(
                f"the optimizer changed from {self.spec.name} to {spec.name} during training: "
                "build a new DistributedOptimizer for another optimizer"
            )
        groups = self._check_groups(spec, groups)
        if len(groups) != len(self.groups):
            raise ConfigError(
                f"the optimizer went from {len(self.groups)} to {len(groups)} param groups "
                "during training: build a new DistributedOptimizer after add_param_group"
            )
        self.spec, self.groups = spec, groups
        if isinstance(spec, DCASGD):
            return  # read at every step
        for key, opt in self._torch.items():
            for g, group in zip(self._group_ids[key], opt.param_groups):
                group.update(_hyperparameters(self.groups[g]))

    def pulled(self, key: int, dc: int, held: torch.Tensor) -> None:
        """Datacenter ``dc`` now holds ``held`` for ``key``: DCASGD's backup ``w_bak[dc]``.

        The server calls it with what the datacenter really received: the INIT values for
        every datacenter, and after each of its deposits (also a skipped one) the new value,
        or with a lossy WAN codec that datacenter's replica. Other optimizers ignore it.
        """
        if not isinstance(self.spec, DCASGD):
            return
        st = self.state.setdefault(key, {})
        bak = st.get(f"backup_dc{dc}")
        if bak is None or bak.shape != held.shape:
            st[f"backup_dc{dc}"] = held.detach().clone()
        else:
            bak.copy_(held)

    def renumber_dcs(self, new: Mapping[int, int]) -> None:
        """After a recovery: DCASGD's backups of the datacenters that stay, under their new
        numbers (``new``: old -> new); a lost datacenter's are dropped."""
        for st in self.state.values():
            names = [n for n in st if n.startswith("backup_dc")]
            backups = {int(n[len("backup_dc") :]): st.pop(n) for n in names}
            st.update({f"backup_dc{new[d]}": t for d, t in backups.items() if d in new})

    def _dcasgd(
        self,
        key: int,
        w: torch.Tensor,
        g: torch.Tensor,
        dc: int | None,
        present: Sequence[bool] | None = None,
    ) -> None:
        s = self.spec
        st = self.state.setdefault(key, {})
        absent = (
            []
            if present is None
            else [pc for pc, here in zip(self._pieces(key, w), present) if not here]
        )
        gg = g * g  # the raw gradient, as MXNet squares it: weight decay stays outside
        lam: float | torch.Tensor = s.lam
        if s.adaptive:
            ms = st.get("meansquare")
            if ms is None:
                ms = st["meansquare"] = torch.zeros_like(g)
            kept = [ms[pc.lo : pc.hi].clone() for pc in absent]
            ms.mul_(s.rho).add_(gg, alpha=1 - s.rho)
            for pc, old in zip(absent, kept):  # no gradient: the mean square stays
                ms[pc.lo : pc.hi] = old
            lam = s.lam / (ms.sqrt() + s.eps)
        d = g.add(w, alpha=s.weight_decay) if s.weight_decay else g
        if absent and d is g:
            d = g.clone()
        bak = None if dc is None else st.get(f"backup_dc{dc}")
        if bak is not None:  # synchronous (dc None): every datacenter holds w, w - w_bak = 0
            d = d + lam * gg * (w - bak)  # lam = 0: exactly SGD
        for pc in absent:  # no gradient: the parameter is not stepped (no weight decay)
            d[pc.lo : pc.hi] = 0.0
        w.add_(d, alpha=-s.lr)
        if dc is not None:
            self.pulled(key, dc, w)  # uncompressed, datacenter dc pulls exactly this

    # ---- state for checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[int, dict]:
        """Per key: named state (momentum_buffer, exp_avg, exp_avg_sq, step, backups).

        A key without a layout, and DCASGD's state, map a state name to one tensor over the
        key's slice; a torch optimizer over a layout maps it to ``{parameter name: piece}``,
        with only the pieces torch holds state for (none for a piece never stepped).
        """
        out: dict[int, dict] = {}
        for key, opt in self._torch.items():
            pieces = self.pieces.get(key)
            entry: dict = {}
            for p, pc in zip(self._params[key], pieces or [None]):
                for k, v in opt.state.get(p, {}).items():
                    if v is None:
                        continue
                    t = torch.as_tensor(v).clone()
                    if pieces is None:
                        entry[k] = t
                    else:
                        entry.setdefault(k, {})[pc.name] = t
            out[key] = entry
        for key, st in self.state.items():
            out.setdefault(key, {}).update({k: v.clone() for k, v in st.items()})
        return out

    def load_state_dict(self, values: Mapping[int, torch.Tensor], state: Mapping) -> None:
        """Restore per-key state; ``values`` are the live tensors the state belongs to.

        Each state name maps to a tensor over the key's slice (0-d: the same for every piece)
        or to ``{parameter name: piece}``; a piece missing from the map gets no state.
        """
        for key, st in state.items():
            pieces = self._pieces(key, values[key])
            if isinstance(self.spec, DCASGD):
                self.state[key] = {}
                for k, v in st.items():
                    flat = _flat_state(v, pieces)
                    if flat is not None:
                        self.state[key][k] = flat
                continue
            self._params.pop(key, None)
            params = self._torch_params(key, values[key])
            opt = self._torch[key]
            for p, pc in zip(params, pieces):
                restored = {}
                for k, v in st.items():
                    if isinstance(v, Mapping):
                        t = v.get(pc.name)
                    else:  # one tensor over the slice, or a 0-d one for every piece
                        t = v[pc.lo : pc.hi] if v.dim() else v
                    if t is None:
                        continue
                    restored[k] = (
                        t.clone() if k != "step" else torch.as_tensor(t, dtype=torch.float32)
                    )
                if restored:
                    opt.state[p] = restored


def step_gradient(
    optimizer: ServerOptimizer | None,
    key: int,
    value: torch.Tensor,
    total: torch.Tensor,
    weight: float,
    flags: int,
    dc: int | None,
    present: list[bool] | None,
) -> None:
    """What a gradient round (``total``: the sum over ``weight`` samples) does to a shard's
    ``value``, in place, on a global server of either tier: the sum itself where there is no
    optimizer or the round is raw; a KVStore's summed pushes stepped as they are; else the
    optimizer's step on the mean gradient (``dc``: the datacenter, for DCASGD's backup;
    ``present``: per piece, whether it has a gradient), none for weight 0 (every sender
    skipped a non-finite gradient). ``total`` may be reused."""
    if optimizer is None or flags & FLAG_RAW:  # the value is the sum
        value.copy_(total)
    elif flags & FLAG_SUM:
        optimizer.step(key, value, total, dc, present)
    elif weight > 0:
        optimizer.step(key, value, total.div_(weight), dc, present)


def _hyperparameters(spec: Spec) -> dict:
    """A spec's values as a torch param group holds them."""
    fields = ("lr", "momentum", "weight_decay", "nesterov", "dampening", "betas", "eps")
    fields += ("maximize", "decoupled_weight_decay")
    return {f: getattr(spec, f) for f in fields if hasattr(spec, f)}


def _flat_state(v, pieces: list[Piece]) -> torch.Tensor | None:
    """A state tensor over a key's slice from either form; None if a piece has none."""
    if not isinstance(v, Mapping):
        return v.clone()
    parts = [v.get(pc.name) for pc in pieces]
    if any(t is None for t in parts):
        return None
    return torch.cat([t.reshape(-1) for t in parts])


def make_spec(
    name: str,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    dcasgd_lambda: float = 0.04,
    dcasgd_adaptive: bool = False,
) -> Spec:
    """The spec for a ``--optimizer`` name and the shared CLI hyperparameters."""
    if name == "sgd":
        return SGD(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    if name == "adam":
        return Adam(lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return AdamW(lr=lr, weight_decay=weight_decay)
    if name == "dcasgd":
        return DCASGD(lr=lr, lam=dcasgd_lambda, adaptive=dcasgd_adaptive, weight_decay=weight_decay)
    raise ConfigError(f"unknown --optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


class ServerTorchStep:
    """A server's SGD, Adam or AdamW over some parameters: torch's single-tensor functional
    optimizers (what ``torch.optim``'s own step calls with ``foreach=False``), with the state
    and param groups as ``torch.optim`` keeps them. Not a ``torch.optim`` object, whose
    construction imports torch._dynamo: 2 s of CPU on every global server before its first
    step, on the critical path of a job's first round."""

    def __init__(self, spec: Spec, params) -> None:
        if isinstance(spec, DCASGD):
            raise ConfigError("DCASGD is stepped by ServerOptimizer itself: this is a geompi bug")
        self.adam = not isinstance(spec, SGD)
        self.param_groups: list[dict] = []
        self.state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        self.add_param_group({"params": params, **_hyperparameters(spec)})

    def add_param_group(self, group: dict) -> None:
        self.param_groups.append({**group, "params": list(group["params"])})

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter that has a gradient (``grad`` None: left alone)."""
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if self.adam:
                self._adam(g, params, grads)
                continue
            momentum = g["momentum"]
            bufs = [self.state[p].get("momentum_buffer") for p in params] if momentum else []
            sgd(
                params, grads, bufs, foreach=False, weight_decay=g["weight_decay"],
                momentum=momentum, lr=g["lr"], dampening=g["dampening"],
                nesterov=g["nesterov"], maximize=g["maximize"],
            )  # fmt: skip
            for p, buf in zip(params, bufs):  # the buffers torch made on the first step
                self.state[p]["momentum_buffer"] = buf

    def _adam(self, g: dict, params: list, grads: list) -> None:
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for p in params:  # torch's lazy state: a CPU step count and two zero moments
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=scalar)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = g["betas"]
        adam(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [], [s["step"] for s in states], foreach=False,
            decoupled_weight_decay=g["decoupled_weight_decay"], amsgrad=False, beta1=beta1,
            beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"],
            maximize=g["maximize"],
        )  # fmt: skip


def torch_optimizer(spec: Spec, params) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer of an SGD/Adam/AdamW spec: the CLI's workers' own, where
    they step locally."""
    if isinstance(spec, DCASGD):
        raise ConfigError("DCASGD runs at the global servers only: use it with --sync mixed or fsa")
    if isinstance(spec, SGD):
        cls = torch.optim.SGD
    else:
        cls = torch.optim.AdamW if isinstance(spec, AdamW) else torch.optim.Adam
    hyper = _hyperparameters(spec)
    decoupled = hyper.pop("decoupled_weight_decay", None)  # AdamW's constructor lacks it
    opt = cls(params, **hyper, foreach=False)
    if decoupled is not None:
        for g in opt.param_groups:
            g["decoupled_weight_decay"] = decoupled
    return opt
