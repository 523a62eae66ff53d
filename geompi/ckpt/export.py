"""Export the model of a checkpoint as .pt, .safetensors or .npz."""

from __future__ import annotations

import os
import pathlib
import zipfile
from collections.abc import Mapping

import numpy as np
import torch

from geompi.ckpt.files import _reason, _remove_quietly
from geompi.ckpt.format import _STORED_AS
from geompi.ckpt.reader import _Reader
from geompi.errors import CheckpointError


def _write_npz(path: pathlib.Path, tensors: Mapping[str, torch.Tensor]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, t in tensors.items():
            if t.dtype in _STORED_AS:  # numpy has no bfloat16/float8: widen exactly to float32
                t = t.to(torch.float32)
            with zf.open(name + ".npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, t.numpy(), allow_pickle=False)


EXPORT_SUFFIXES = (".pt", ".safetensors", ".npz")


def export(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the model of a checkpoint as .pt (torch.save), .safetensors or .npz (by suffix).

    npz has no bfloat16/float8, so those are widened (exactly) to float32 there.
    """
    out = pathlib.Path(out)
    suffix = out.suffix.lower()
    if suffix not in EXPORT_SUFFIXES:
        raise ValueError(
            f"cannot export to {out}: unknown suffix {out.suffix!r} "
            f"(use {', '.join(EXPORT_SUFFIXES)})"
        )
    ck = _Reader(path, collect=False, full=True).read(model_only=True)
    assert ck is not None
    model = ck.model
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        if suffix == ".pt":
            torch.save(model, tmp)
        elif suffix == ".safetensors":
            from safetensors.torch import save_file

            meta = {"geompi_checkpoint": str(path), "step": str(ck.step)}
            save_file(model, str(tmp), metadata=meta)
        else:
            _write_npz(tmp, model)
        os.replace(tmp, out)
    except OSError as e:
        _remove_quietly(tmp)
        raise CheckpointError(f"cannot write {out}: {_reason(e)}") from None
    except (TypeError, ValueError, RuntimeError) as e:  # e.g. a dtype safetensors lacks
        _remove_quietly(tmp)
        raise CheckpointError(f"cannot export {path} to {out}: {_reason(e)}") from None
    except BaseException:
        _remove_quietly(tmp)
        raise
