"""Your own model, optimizer, scheduler and DataLoader on geompi: a byte-level transformer
language model (5.1M parameters by default) trained on the Python standard library's source.

A plain single-process torch loop; the lines marked ``# geompi`` are all that was added.

    mpirun -n 9 python examples/transformer_lm.py --sync fsa --steps 200
    mpirun -n 9 python examples/transformer_lm.py --sync hfa --k1 8 --k2 4 --amp bf16

The corpus ships with Python itself (every ``*.py`` file of the standard library, read in sorted
order), so it is available offline and the same on every rank.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib

import torch
from torch import nn

import geompi  # geompi


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's source, as a uint8 tensor."""
    root = pathlib.Path(os.__file__).parent
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class Windows(torch.utils.data.Dataset):
    """Consecutive, non-overlapping windows of ``seq + 1`` bytes: (input, next bytes)."""

    def __init__(self, data: torch.Tensor, seq: int) -> None:
        self.data, self.seq = data, seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[i * self.seq : (i + 1) * self.seq + 1].long()
        return w[:-1], w[1:]


class TinyGPT(nn.Module):
    """A decoder-only transformer over bytes: embeddings, pre-norm blocks, a tied output head."""

    def __init__(self, d: int = 320, layers: int = 4, heads: int = 5, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied to the output: small logits at start
        self.pos = nn.Parameter(torch.zeros(seq, d))
        block = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(h) @ self.embed.weight.T  # logits over the 256 byte values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync", default="fsa", choices=["fsa", "hfa", "mixed"])
    p.add_argument("--k1", type=int, default=8, help="HFA: local steps per datacenter average")
    p.add_argument("--k2", type=int, default=4, help="HFA: datacenter averages per global one")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per worker")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=320)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--amp", choices=["off", "bf16"], default="off", help="torch.autocast dtype")
    p.add_argument("--checkpoint", default=None, help="write the final model here (.h5)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    geompi.init()  # geompi: server ranks serve in here and exit
    device = geompi.device()  # geompi
    torch.manual_seed(0)
    data = stdlib_corpus(int(args.corpus_mb * 2**20))
    split = int(0.95 * len(data))
    train_set, val_set = Windows(data[:split], args.seq), Windows(data[split:], args.seq)
    sampler = geompi.DistributedSampler(train_set, shuffle=True, seed=0)  # geompi
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = TinyGPT(args.d_model, args.layers, args.heads, args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sync = geompi.HFA(k1=args.k1, k2=args.k2) if args.sync == "hfa" else args.sync  # geompi
    opt = geompi.DistributedOptimizer(opt, model, sync=sync)  # geompi
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loss_fn = nn.CrossEntropyLoss()
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    step, epoch, first = 0, 0, None
    while step < args.steps:
        sampler.set_epoch(epoch)  # geompi
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            with amp:
                loss = loss_fn(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            first = loss.item() if first is None else first
            if step >= args.steps:
                break
        epoch += 1
    model.eval()
    with torch.no_grad():
        xs, ys = zip(*(val_set[i] for i in range(min(len(val_set), 64))))
        val = float(
            loss_fn(
                model(torch.stack(xs).to(device)).flatten(0, 1),
                torch.stack(ys).flatten().to(device),
            )
        )
    if args.checkpoint:
        # MixedSync's optimizer state is on the global servers: the model only
        held = None if args.sync == "mixed" else opt
        geompi.save(args.checkpoint, model=model, optimizer=held, step=step)  # geompi
    params = sum(p.numel() for p in model.parameters())
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    print(
        f"transformer_lm: worker {geompi.worker_rank()} params={params} steps={step} "  # geompi
        f"first_loss={first:.4f} val_loss={val:.4f} bits_per_byte={val / math.log(2):.3f} "
        f"param_sum={digest:.8f}",
        flush=True,
    )
    geompi.finish()  # geompi


if __name__ == "__main__":
    main()
