"""The API example of docs/python-api.md (the README's, in short), and the helpers a ported
script uses, as a type checker sees them (tests/test_packaging.py runs mypy on this file; it is
never executed)."""

import torch
from torch import nn

import geompi


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def main(train_set: torch.utils.data.Dataset, epochs: int) -> None:
    loss_fn = nn.CrossEntropyLoss()
    geompi.init()
    model = Net().to(geompi.device())
    opt = geompi.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-4), model, sync=geompi.HFA(k1=8, k2=4)
    )
    sampler = geompi.DistributedSampler(train_set, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train_set, batch_size=32, sampler=sampler)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    best = float("inf")
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            with opt.no_sync():
                loss_fn(model(x), y).backward()
            opt.synchronize()
            opt.step()
            sched.step()
        val = geompi.all_reduce(torch.tensor(0.5), op="mean").item()
        if val < best:
            best = val
            opt.force_global_average()
            geompi.save("ck.h5", model=model, optimizer=opt, step=epoch, state={"sched": sched})
    state: dict[str, object] = {"sched": sched}
    info = geompi.load("ck.h5", model=model, optimizer=opt, state=state)
    step: int = info["step"]
    ranks: int = geompi.local_worker_rank() + geompi.worker_rank() + step
    report = opt.close()
    print(report, opt.global_syncs, opt.failures, ranks, geompi.broadcast_object(best, root=0))
    geompi.finish()
