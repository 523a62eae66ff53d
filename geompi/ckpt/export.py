"""Export the model of a checkpoint as .pt, .safetensors or .npz."""

from __future__ import annotations

import os
import pathlib
import zipfile
from collections.abc import Callable, Mapping
from typing import BinaryIO

import numpy as np
import torch

from geompi.ckpt.files import _reason, _remove_quietly, create_temp
from geompi.ckpt.format import _STORED_AS
from geompi.ckpt.reader import _Reader
from geompi.errors import CheckpointError


def _write_npz(fh: BinaryIO, tensors: Mapping[str, torch.Tensor]) -> None:
    with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, t in tensors.items():
            if t.dtype in _STORED_AS:  # numpy has no bfloat16/float8: widen exactly to float32
                t = t.to(torch.float32)
            with zf.open(name + ".npy", "w", force_zip64=True) as out:
                np.lib.format.write_array(out, t.numpy(), allow_pickle=False)


EXPORT_SUFFIXES = (".pt", ".safetensors", ".npz")
OUTER_KEY = "geompi_outer_momentum"  # .pt with optimizer=True: HFA's outer momentum, by name


class NothingToExport(CheckpointError):
    """What export was asked for is not in the file, or the format cannot hold it."""


def _with_optimizer(path: str | os.PathLike, suffix: str) -> dict:
    """{"model": ..., "optimizer": torch's state_dict[, OUTER_KEY: ...]} of a checkpoint."""
    if suffix != ".pt":
        raise NothingToExport(
            f"cannot export the optimizer to {suffix}: torch's optimizer state_dict holds "
            "param groups (numbers, flags) besides tensors; export to .pt"
        )
    ck = _Reader(path, collect=False, full=True).read()
    assert ck is not None
    from geompi.optimizer_json import _GROUPS, exported_state

    if _GROUPS not in ck.optimizer_attrs:
        name = ck.optimizer_attrs.get("name", "none")
        why = (
            "holds no optimizer state"
            if not ck.optimizer or name == "none"
            else f"holds {name} state without torch's param groups (written by geompi.train)"
        )
        raise NothingToExport(
            f"checkpoint {path} {why}; --optimizer exports what geompi.save(optimizer=...) "
            "wrote: drop --optimizer to export the model alone"
        )
    out = {"model": ck.model, "optimizer": exported_state(ck)}
    outer = ck.algorithm.get("hfa", {}).get("outer_momentum")
    if isinstance(outer, dict) and outer:
        out[OUTER_KEY] = dict(outer)
    return out


def export(path: str | os.PathLike, out: str | os.PathLike, *, optimizer: bool = False) -> None:
    """Write the model of a checkpoint as .pt (torch.save), .safetensors or .npz (by suffix).

    npz has no bfloat16/float8, so those are widened (exactly) to float32 there. .safetensors
    needs the optional safetensors package (``pip install 'geompi[safetensors]'``).

    ``optimizer``: .pt only, ``{"model": state_dict, "optimizer": optimizer state_dict}`` in
    torch's formats (and HFA's outer momentum under ``"geompi_outer_momentum"``, by parameter
    name); NothingToExport if the file holds no optimizer state or the suffix is not .pt.
    """
    out = pathlib.Path(out)
    suffix = out.suffix.lower()
    if suffix not in EXPORT_SUFFIXES:
        raise ValueError(
            f"cannot export to {out}: unknown suffix {out.suffix!r} "
            f"(use {', '.join(EXPORT_SUFFIXES)})"
        )
    if optimizer:
        both = _with_optimizer(path, suffix)
        _write(out, lambda fh: torch.save(both, fh), path)
        return
    safetensors_save = None
    if suffix == ".safetensors":
        try:
            from safetensors.torch import save as safetensors_save
        except ImportError:
            raise CheckpointError(
                f"cannot export to {out}: the optional safetensors package is not installed; "
                "pip install 'geompi[safetensors]' (or export to .pt or .npz)"
            ) from None
    ck = _Reader(path, collect=False, full=True).read(model_only=True)
    assert ck is not None
    model = ck.model

    def write(fh: BinaryIO) -> None:
        if suffix == ".pt":
            torch.save(model, fh)
        elif safetensors_save is not None:
            meta = {"geompi_checkpoint": str(path), "step": str(ck.step)}
            fh.write(safetensors_save(model, metadata=meta))
        else:
            _write_npz(fh, model)

    _write(out, write, path)


def _write(out: pathlib.Path, write: Callable[[BinaryIO], None], path: str | os.PathLike) -> None:
    """Call write on a new temporary file beside ``out`` and rename it to ``out`` (atomic)."""
    tmp: pathlib.Path | None = None
    try:
        fd, tmp = create_temp(out.parent, out.name)  # exclusive: never through a symlink
        with os.fdopen(fd, "wb") as fh:
            write(fh)
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
