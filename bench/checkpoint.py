"""Checkpoint write/read speed: geompi.ckpt (HDF5, fletcher32, fsync + rename) against torch.save.

    python bench/checkpoint.py                 # 100M parameters (about 400 MB of fp32)
    python bench/checkpoint.py --params 5e6    # a quick run

Each operation runs --repeat times (median taken) on a state dict shaped like a transformer
(embedding, attention and MLP matrices, biases and norms). Writes bench/results/checkpoint.json.
torch.save does not fsync; geompi.ckpt.save does (it must, to be crash safe), so the table also
shows torch.save followed by an fsync, for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import h5py
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geompi import ckpt  # noqa: E402


def build_state_dict(n_params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About n_params fp32 parameters in a realistic mix of tensor sizes."""
    g = torch.Generator().manual_seed(seed)
    d = 1024 if n_params >= 50_000_000 else max(64, int((n_params / 40) ** 0.5) // 64 * 64)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    vocab = max(1, int(n_params * 0.3) // d)
    shapes.append(("embed.weight", (vocab, d)))
    total = vocab * d
    layer = 0
    while True:
        block = [
            (f"layers.{layer}.attn.qkv.weight", (3 * d, d)),
            (f"layers.{layer}.attn.qkv.bias", (3 * d,)),
            (f"layers.{layer}.attn.out.weight", (d, d)),
            (f"layers.{layer}.attn.out.bias", (d,)),
            (f"layers.{layer}.norm1.weight", (d,)),
            (f"layers.{layer}.norm1.bias", (d,)),
            (f"layers.{layer}.mlp.fc1.weight", (4 * d, d)),
            (f"layers.{layer}.mlp.fc1.bias", (4 * d,)),
            (f"layers.{layer}.mlp.fc2.weight", (d, 4 * d)),
            (f"layers.{layer}.mlp.fc2.bias", (d,)),
            (f"layers.{layer}.norm2.weight", (d,)),
            (f"layers.{layer}.norm2.bias", (d,)),
        ]
        size = sum(torch.Size(s).numel() for _, s in block)
        if total + size > n_params:
            break
        shapes.extend(block)
        total += size
        layer += 1
    if n_params - total > 0:
        shapes.append(("head.weight", (n_params - total,)))
    return {name: torch.randn(shape, generator=g) for name, shape in shapes}


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _time(fn) -> float:
    """Seconds ``fn`` takes, started with no dirty pages, so that no operation pays for the
    write-back of the one before it."""
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="number of parameters (100e6)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (a fresh temp dir by default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    args = ap.parse_args(argv)

    model = build_state_dict(int(args.params))
    n = sum(t.numel() for t in model.values())
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    names = ("geompi_save", "torch_save", "torch_save_fsync", "geompi_load", "torch_load")
    times: dict[str, list[float]] = {k: [] for k in names}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = pathlib.Path(tmp)
        h5, pt = d / ckpt.checkpoint_name(1), d / "state.pt"
        for _ in range(args.repeat):
            for p in (h5, pt):
                p.unlink(missing_ok=True)
            times["geompi_save"].append(_time(lambda: ckpt.save(h5, model=model, step=1)))
            times["torch_save"].append(_time(lambda: torch.save(model, pt)))
            pt.unlink()
            times["torch_save_fsync"].append(_time(lambda: (torch.save(model, pt), _fsync(pt))))
            times["geompi_load"].append(_time(lambda: ckpt.load(h5, verify=True)))
            times["torch_load"].append(_time(lambda: torch.load(pt, weights_only=True)))
        loaded = ckpt.load(h5)
        assert all(torch.equal(loaded.model[k], v) for k, v in model.items())
        file_bytes = {"geompi": h5.stat().st_size, "torch": pt.stat().st_size}

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "params": n,
        "tensors": len(model),
        "data_bytes": nbytes,
        "file_bytes": file_bytes,
        "repeat": args.repeat,
        "median_s": med,
        "all_s": times,
        "save_ratio": med["geompi_save"] / med["torch_save"],
        "save_ratio_vs_torch_save_fsync": med["geompi_save"] / med["torch_save_fsync"],
        "load_ratio": med["geompi_load"] / med["torch_load"],
        "goal": "save_ratio <= 1.5",
        "chunk_bytes": ckpt._CHUNK_BYTES,
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version,
        },
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    mb = nbytes / 1e6
    print(f"{n:,} parameters in {len(model)} tensors ({mb:.0f} MB), median of {args.repeat}")
    print(f"{'operation':<24}{'seconds':>10}{'MB/s':>10}")
    for k, v in med.items():
        print(f"{k:<24}{v:>10.3f}{mb / v:>10.0f}")
    print(f"save ratio geompi/torch.save        {result['save_ratio']:.2f}  (goal <= 1.5)")
    print(f"save ratio geompi/(torch.save+fsync) {result['save_ratio_vs_torch_save_fsync']:.2f}")
    print(f"load ratio geompi(verify)/torch.load {result['load_ratio']:.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
