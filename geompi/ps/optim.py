"""Server-side optimizers on flat tensors, and their JSON specs.

A spec (``SGD(lr=0.1)``) is plain data: it travels from the master worker to the global servers
as JSON, never pickled. ``spec.build()`` makes the ``ServerOptimizer`` that a global server runs
on its slice of each key. SGD and Adam/AdamW delegate to ``torch.optim`` on a flat view, so their
arithmetic is exactly torch's; DCASGD is written out here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch

from geompi.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw", "dcasgd")


@dataclass
class SGD:
    """SGD with optional momentum, dampening, weight decay and Nesterov, as ``torch.optim.SGD``."""

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0
    name: str = field(default="sgd", init=False)


@dataclass
class Adam:
    """Adam, as ``torch.optim.Adam``."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    name: str = field(default="adam", init=False)


@dataclass
class AdamW(Adam):
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``."""

    weight_decay: float = 1e-2
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


class ServerOptimizer:
    """Applies one spec to many keys, each a flat fp32 tensor owned by this server."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self._torch: dict[int, torch.optim.Optimizer] = {}
        self._params: dict[int, torch.nn.Parameter] = {}
        self.state: dict[int, dict[str, torch.Tensor]] = {}  # DCASGD's own state

    def step(
        self, key: int, value: torch.Tensor, grad: torch.Tensor, dc: int | None = None
    ) -> None:
        """Update ``value`` in place with ``grad`` (already averaged) coming from datacenter dc."""
        if isinstance(self.spec, DCASGD):
            self._dcasgd(key, value, grad, dc)
            return
        opt = self._torch.get(key)
        if opt is None:
            p = torch.nn.Parameter(value, requires_grad=True)  # shares value's memory
            self._params[key] = p
            opt = self._make_torch([p])
            self._torch[key] = opt
        p = self._params[key]
        if p.data_ptr() != value.data_ptr():  # the key's tensor was replaced: follow it
            p.data = value
        p.grad = grad
        opt.step()
        p.grad = None

    def _make_torch(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch_optimizer(self.spec, params)

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

    def _dcasgd(self, key: int, w: torch.Tensor, g: torch.Tensor, dc: int | None) -> None:
        s = self.spec
        st = self.state.setdefault(key, {})
        gg = g * g  # the raw gradient, as MXNet squares it: weight decay stays outside
        lam: float | torch.Tensor = s.lam
        if s.adaptive:
            ms = st.get("meansquare")
            if ms is None:
                ms = st["meansquare"] = torch.zeros_like(g)
            ms.mul_(s.rho).add_(gg, alpha=1 - s.rho)
            lam = s.lam / (ms.sqrt() + s.eps)
        d = g.add(w, alpha=s.weight_decay) if s.weight_decay else g
        bak = None if dc is None else st.get(f"backup_dc{dc}")
        if bak is not None:  # synchronous (dc None): every datacenter holds w, w - w_bak = 0
            d = d + lam * gg * (w - bak)  # lam = 0: exactly SGD
        w.add_(d, alpha=-s.lr)
        if dc is not None:
            self.pulled(key, dc, w)  # uncompressed, datacenter dc pulls exactly this

    # ---- state for checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per key: named state tensors (momentum_buffer, exp_avg, exp_avg_sq, step, backups)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for key, opt in self._torch.items():
            st = opt.state.get(self._params[key], {})
            out[key] = {k: torch.as_tensor(v).clone() for k, v in st.items() if v is not None}
        for key, st in self.state.items():
            out.setdefault(key, {}).update({k: v.clone() for k, v in st.items()})
        return out

    def load_state_dict(self, values: Mapping[int, torch.Tensor], state: Mapping) -> None:
        """Restore per-key state; ``values`` are the live tensors the state belongs to."""
        for key, st in state.items():
            if isinstance(self.spec, DCASGD):
                self.state[key] = {k: v.clone() for k, v in st.items()}
                continue
            p = torch.nn.Parameter(values[key], requires_grad=True)
            self._params[key] = p
            opt = self._make_torch([p])
            self._torch[key] = opt
            restored = {}
            for k, v in st.items():
                restored[k] = v.clone() if k != "step" else torch.as_tensor(v, dtype=torch.float32)
            opt.state[p] = restored


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


def outer_step(
    value: torch.Tensor, average: torch.Tensor, spec: Mapping | None, state: dict[str, torch.Tensor]
) -> None:
    """HFA's outer optimizer: treat ``value - average`` as a pseudo-gradient (DiLoCo).

    Plain averaging (no spec, or SGD with lr 1 and no momentum) assigns the average exactly.
    """
    lr = float(spec.get("lr", 1.0)) if spec else 1.0
    if not math.isfinite(lr):
        raise ConfigError(f"--outer-lr {lr}: must be a finite number")
    if spec is None or (spec.get("name") == "sgd" and spec.get("lr", 1.0) == 1.0):
        value.copy_(average)
        return
    delta = value - average
    if spec.get("name") == "nesterov":
        mom = float(spec.get("momentum", 0.9))
        buf = state.get("outer_momentum")
        buf = delta.clone() if buf is None else buf.mul_(mom).add_(delta)
        state["outer_momentum"] = buf
        delta = delta + mom * buf
    value.sub_(lr * delta)


def torch_optimizer(spec: Spec, params) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer of an SGD/Adam/AdamW spec: the servers' and HFA workers'."""
    if isinstance(spec, SGD):
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            weight_decay=spec.weight_decay,
            nesterov=spec.nesterov,
            dampening=spec.dampening,
            foreach=False,
        )
    if isinstance(spec, DCASGD):
        raise ConfigError("DCASGD runs at the global servers only: use it with --sync mixed or fsa")
    cls = torch.optim.AdamW if isinstance(spec, AdamW) else torch.optim.Adam
    return cls(
        params,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        foreach=False,
    )
