"""The problem the Python API tests train: a small nonlinear model and deterministic batches.

Shared by the MPI programs and by the single-process references in the tests; nothing here
calls geompi.
"""

from __future__ import annotations

import torch
from torch import nn

IN, HID, OUT = 10, 24, 5


class Net(nn.Module):
    """LayerNorm + tanh + relu, a frozen layer, a layer never called, and a parameter that only
    some workers use on some steps (so some steps no worker gives it a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.hidden = nn.Linear(HID, HID)
        self.frozen = nn.Linear(HID, HID)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(HID, OUT)
        self.extra = nn.Parameter(torch.ones(HID))
        self.head = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.norm(self.emb(x)))
        h = torch.relu(self.hidden(h)) + self.frozen(h)
        if use_extra:
            h = h * self.extra
        return self.head(h)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch_size(worker: int, step: int, micro: int = 0) -> int:
    """Different per worker and per step (equal across one worker's micro-batches)."""
    return 3 + (worker + 2 * step) % 5


def use_extra(worker: int, step: int) -> bool:
    return step % 3 == 0 and worker % 2 == 0


def uses_extra(kind: str, worker: int, step: int, micro: int = 0) -> bool:
    """``split`` cases: ``extra`` only in the first micro-batch of a step, so the last pass of
    an accumulation leaves its gradient alone; else as use_extra."""
    return micro == 0 if kind.endswith("split") else use_extra(worker, step)


def zero_keeps(kind: str) -> bool:
    """``keep`` cases: zero_grad(set_to_none=False), so a parameter no worker used this step
    has a zero gradient (torch.optim steps it: momentum, weight decay), not None."""
    return kind.endswith("keep")


def batch(worker: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + 100 * worker + micro)
    n = batch_size(worker, step, micro)
    x = torch.randn(n, IN, generator=g)
    y = torch.randint(0, OUT, (n,), generator=g)
    return x, y


def learnable_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose label is a function of the input (the largest of its first OUT values)."""
    x, _ = batch(worker, step)
    return x, x[:, :OUT].argmax(1)


def param_groups(model: Net, kind: str) -> list[dict]:
    """Two groups with their own lr and weight decay (the head, and the rest)."""
    head = [model.head.weight, model.head.bias]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    if kind in ("sgd", "clip"):
        return [{"params": head, "lr": 0.05, "weight_decay": 1e-3}, {"params": rest}]
    return [{"params": head, "lr": 3e-3, "weight_decay": 1e-2}, {"params": rest}]


def make_optimizer(
    model: Net, kind: str, dc: int = 0
) -> tuple[torch.optim.Optimizer, object | None]:
    """The optimizer (and lr scheduler) of one test case. ``srv_*``: the optimizer on the
    global servers, with a schedule they must follow; ``srv_groups_K`` is case K's (two param
    groups with their own lr and weight decay) there; ``mixed_K`` is case K's optimizer and
    schedule under MixedSync. ``mixed_perdc``: plain SGD (no momentum, so a step at lr 0
    changes nothing) whose schedule is datacenter ``dc``'s: datacenter 1's lr is always 0."""
    if kind.startswith("srv_groups_"):
        return make_optimizer(model, kind.removeprefix("srv_groups_"))
    if kind == "mixed_perdc":
        opt = torch.optim.SGD(param_groups(model, "sgd"), lr=0.1, weight_decay=1e-4)
        factor = (lambda s: 0.0) if dc == 1 else (lambda s: 1.0 / (1 + 0.3 * s))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
    if kind.startswith("mixed_"):
        return make_optimizer(model, kind.removeprefix("mixed_"))
    if kind == "srv_sgd":
        opt = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
        )
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    if kind == "srv_max_sgd":  # torch's flags the servers carry (issue 34 item 6)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, maximize=True)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if kind in ("srv_max_adam", "srv_max_adamw"):
        cls = torch.optim.Adam if kind == "srv_max_adam" else torch.optim.AdamW
        return cls(param_groups(model, kind), lr=5e-3, weight_decay=1e-2, maximize=True), None
    if kind == "srv_decoupled_adam":
        opt = torch.optim.Adam(
            model.parameters(), lr=5e-3, weight_decay=0.2, decoupled_weight_decay=True
        )
        return opt, None
    if kind == "srv_adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.05)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    groups = param_groups(model, kind)
    if kind in ("sgd", "clip"):
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
    if kind in ("split", "srv_split", "keep", "srv_keep", "rewrap"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        return opt, None
    if kind in ("adam", "accum", "nosync"):
        opt = torch.optim.Adam(groups, lr=5e-3, weight_decay=1e-4)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=5e-3)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    if kind == "rmsprop":
        return torch.optim.RMSprop(groups, lr=2e-3, momentum=0.5, weight_decay=1e-4), None
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.05, weight_decay=1e-4), None
    raise ValueError(kind)


def train_steps(
    model: Net, opt, worker: int, steps: int, sched=None, forced=(), first: int = 0
) -> None:
    """The plain torch loop the API programs run on ``batch`` (opt may be geompi's), steps
    ``first`` to ``steps`` (a resume starts past 0). HFA: the datacenter averages after the
    steps in ``forced`` go global (as the CLI's checkpoints)."""
    loss_fn = nn.CrossEntropyLoss()
    for t in range(first, steps):
        x, y = batch(worker, t)
        opt.zero_grad()
        loss_fn(model(x, use_extra(worker, t)), y).backward()
        if t + 1 in forced:
            opt.force_global_average()
        opt.step()
        if sched is not None:
            sched.step()


MICRO = {"accum": 3, "nosync": 2, "split": 2, "srv_split": 2}  # micro-batches per step
PERDC_STEPS = 10  # api_misc's MixedSync run with a schedule per datacenter
CLIP = 0.05


def reference(kind: str, workers: int, steps: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """One process, the same optimizer, on the concatenation of every worker's batch, from the
    model that worker 0 (the master, seed 1) builds. ``rewrap``: a new optimizer of the same
    kind takes over halfway."""
    model = make_model(seed)
    opt, sched = make_optimizer(model, kind)
    loss_fn = nn.CrossEntropyLoss()
    micro = MICRO.get(kind, 1)
    for t in range(steps):
        if kind == "rewrap" and t == steps // 2:
            opt, sched = make_optimizer(model, kind)
        opt.zero_grad(set_to_none=not zero_keeps(kind))
        outs, ys = [], []
        for w in range(workers):
            for m in range(micro):
                x, y = batch(w, t, m)
                outs.append(model(x, uses_extra(kind, w, t, m)))
                ys.append(y)
        loss_fn(torch.cat(outs), torch.cat(ys)).backward()
        if kind.endswith("clip"):
            with_grad = [p for p in model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(with_grad, CLIP)
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


HFA_LR, HFA_MOMENTUM = 0.05, 0.9


def hfa_optimizer(model: Net) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=HFA_LR, momentum=HFA_MOMENTUM)


def hfa_reference(
    dc_sizes: list[int],
    k1: int,
    k2: int,
    steps: int,
    seed: int = 1,
    uniform: bool = False,
    models: list | None = None,
    opts: list | None = None,
    batches=None,
    outer_nesterov_lr: float | None = None,
    final_global: bool = False,
    lost: tuple[list[int], int] | None = None,
    left_after: tuple[list[int], int] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """An independent simulation of HFA: one model and optimizer per worker, datacenter
    averages every K1 steps, every K2-th one over all workers. Weights: samples, or
    ``uniform`` (GeoMX): 1 / the worker's datacenter size, so datacenters count the same.
    ``outer_nesterov_lr``: the global average goes through an outer Nesterov step (momentum
    0.9) on ``global - average``, DiLoCo's outer optimizer. ``final_global``: after ``steps``
    that are not a multiple of K1*K2, one more average over every worker (what close() does),
    weighted by the samples since the last average, or if there were none by its weights.
    ``lost`` = (workers, step): those workers (or their datacenter) are lost during the average
    at ``step`` (a multiple of K1), which becomes global over the other workers; they train no
    more, and the count towards K2 starts again (--on-failure continue, as docs/failures.md says).
    ``left_after`` = (workers, step): lost after the average at ``step`` (during the checkpoint
    that follows it): they take part in it, then train no more; the cadence goes on."""
    workers = sum(dc_sizes)
    dcs = [list(range(sum(dc_sizes[:d]), sum(dc_sizes[: d + 1]))) for d in range(len(dc_sizes))]
    dc_of = {w: d for d, members in enumerate(dcs) for w in members}
    models = models or [make_model(seed) for _ in range(workers)]
    opts = opts or [hfa_optimizer(m) for m in models]
    batches = batches or (lambda w, t: (*batch(w, t), use_extra(w, t)))
    loss_fn = nn.CrossEntropyLoss()
    glob = [p.detach().clone() for p in models[0].parameters()]  # the global servers' model
    outer_buf: list[torch.Tensor | None] = [None] * len(glob)

    def fresh() -> list[float]:
        return [1.0 / dc_sizes[dc_of[w]] if uniform else 0.0 for w in range(workers)]

    samples = fresh()
    last = samples  # the weights of the last average
    rounds = 0
    alive = list(range(workers))
    for t in range(steps + (1 if final_global and steps % (k1 * k2) else 0)):
        final = t == steps  # close(): one more average, over every worker
        for w in alive if not final else []:
            x, y, *extra = batches(w, t)
            opts[w].zero_grad()
            loss_fn(models[w](x, *extra), y).backward()
            opts[w].step()
            if not uniform:
                samples[w] += len(y)
        if (t + 1) % k1 and not final:
            continue
        if final and not any(samples):  # just averaged: the last average's weights again
            samples = last
        rounds += 1
        lost_now = lost is not None and t + 1 == lost[1]
        if lost_now:
            alive = [w for w in alive if w not in lost[0]]
            rounds = 0
        is_global = lost_now or rounds % k2 == 0 or final
        groups = [alive] if is_global else [[w for w in d if w in alive] for d in dcs]
        groups = [g for g in groups if g]
        with torch.no_grad():
            for group in groups:
                total = sum(samples[w] for w in group)
                for i, ps in enumerate(zip(*(models[w].parameters() for w in group))):
                    avg = sum(p * samples[w] for p, w in zip(ps, group)) / total
                    if is_global and outer_nesterov_lr is not None:
                        delta = glob[i] - avg
                        buf = delta.clone() if outer_buf[i] is None else outer_buf[i] * 0.9 + delta
                        outer_buf[i] = buf
                        glob[i] = glob[i] - outer_nesterov_lr * (delta + 0.9 * buf)
                        avg = glob[i]
                    for p in ps:
                        p.copy_(avg)
        last, samples = samples, fresh()
        if left_after is not None and t + 1 == left_after[1]:
            alive = [w for w in alive if w not in left_after[0]]
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


def _weighted(params: list[dict], samples: list[int], name: str, group) -> torch.Tensor:
    group = list(group)
    return sum(params[w][name] * samples[w] for w in group) / sum(samples[w] for w in group)


def stream_reference(
    dc_sizes: list[int],
    k1: int,
    k2: int,
    fragments: int,
    overlap: bool,
    mix: float,
    steps: int,
    forced: tuple[int, ...] = (),
    cycles: list[int] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """An independent simulation of streaming HFA: fragment f is the values [N*f//F,
    N*(f+1)//F) of the N parameter values laid end to end in reverse parameter order (as
    backward produces them), so a parameter may lie in two; fragment f is
    global at datacenter round r when (r + f*K2//F) % K2 == 0; with overlap, workers get the
    datacenter average at that round and ``mix * global + (1 - mix) * average`` at the next.
    After the steps in ``forced``, every parameter goes global at once: each datacenter's
    average, with a pending global result mixed in first, is averaged by the datacenters'
    samples, every worker gets it, nothing stays pending, and the rounds count from 0 again.
    With ``cycles`` (adaptive cadence), K2 is cycles[c] in the c-th cycle of datacenter rounds
    (the last one goes on): the rounds count from 0 again after each cycle's K2 of them, or
    after a forced round."""
    workers = sum(dc_sizes)
    dcs = [list(range(sum(dc_sizes[:d]), sum(dc_sizes[: d + 1]))) for d in range(len(dc_sizes))]
    models = [make_model(1) for _ in range(workers)]
    opts = [hfa_optimizer(m) for m in models]
    names = [n for n, _ in models[0].named_parameters()][::-1]
    sizes = [dict(models[0].named_parameters())[n].numel() for n in names]
    total = sum(sizes)
    ends = [total * f // fragments for f in range(fragments + 1)]
    pieces = []  # (name, lo, hi): a parameter's values in one fragment
    frag = {}
    start = 0
    for name, n in zip(names, sizes):
        for f in range(fragments):
            lo, hi = max(start, ends[f]), min(start + n, ends[f + 1])
            if hi > lo:
                pieces.append((name, lo - start, hi - start))
                frag[pieces[-1]] = f
        start += n
    loss_fn = nn.CrossEntropyLoss()
    samples, rnd, pending = [0] * workers, 0, {}
    cycles = list(cycles or [k2])
    for t in range(steps):
        for w in range(workers):
            x, y = batch(w, t)
            opts[w].zero_grad()
            loss_fn(models[w](x, use_extra(w, t)), y).backward()
            opts[w].step()
            samples[w] += len(y)
        if (t + 1) % k1:
            continue
        rnd += 1
        k2 = cycles[0]
        with torch.no_grad():
            named = [dict(m.named_parameters()) for m in models]
            params = [{pc: d[pc[0]].view(-1)[pc[1] : pc[2]] for pc in pieces} for d in named]
            if t + 1 in forced:
                dc_samples = [sum(samples[w] for w in g) for g in dcs]
                for name in pieces:
                    values = [_weighted(params, samples, name, g) for g in dcs]
                    if name in pending:
                        late = pending.pop(name)
                        values = [mix * late + (1 - mix) * v for v in values]
                    glob = sum(v * n for v, n in zip(values, dc_samples)) / sum(dc_samples)
                    for w in range(workers):
                        params[w][name].copy_(glob)
                samples, rnd = [0] * workers, 0
                cycles = cycles[1:] or cycles  # a cycle ends here too
                continue
            for name in pieces:
                glob = (rnd + frag[name] * k2 // fragments) % k2 == 0

                dc_avg = [_weighted(params, samples, name, g) for g in dcs]
                everyone = _weighted(params, samples, name, range(workers)) if glob else None
                for d, group in enumerate(dcs):
                    if glob and not overlap:
                        value = everyone
                    elif name in pending and not glob:
                        value = mix * pending[name] + (1 - mix) * dc_avg[d]
                    else:
                        value = dc_avg[d]
                    for w in group:
                        params[w][name].copy_(value)
                if glob and overlap:
                    pending[name] = everyone
                elif name in pending:
                    del pending[name]
        if rnd == k2:  # a cycle ends: the next one's K2
            rnd, cycles = 0, cycles[1:] or cycles
        samples = [0] * workers
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
