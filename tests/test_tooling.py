"""The build's promises (issue 37): the torch floor pyproject.toml claims is the version CI
installs, the Makefile picks torch's CPU build where there is no NVIDIA GPU, and mypy covers
the public modules."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _makefile_torch_pin() -> Version:
    m = re.search(r"^TORCH\s*\?=\s*torch==(\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, "the Makefile pins no torch (TORCH ?= torch==X)"
    return Version(m.group(1))


def test_the_torch_floor_is_the_version_ci_installs():
    """Only the Makefile's pin is tested (CI installs it through make setup): a lower floor
    in pyproject.toml would promise versions nothing here has run."""
    (torch,) = [Requirement(d) for d in _pyproject()["project"]["dependencies"] if
                Requirement(d).name == "torch"]  # fmt: skip
    floors = [Version(s.version) for s in torch.specifier if s.operator == ">="]
    assert floors, f"pyproject.toml gives torch no floor: {torch}"
    pin = _makefile_torch_pin()
    assert floors == [pin], f"pyproject.toml's torch floor {floors[0]} is not CI's {pin}"
    assert pin in torch.specifier  # the pin satisfies the whole range (not above a ceiling)


def test_the_install_page_states_the_floor():
    text = (REPO / "docs" / "cli.md").read_text()
    assert f"torch>={_makefile_torch_pin()}" in text


def _setup_commands(tmp_path: Path, gpu: bool, *args: str) -> list[str]:
    """The commands ``make setup`` would run (make -n), with or without an ``nvidia-smi``
    on PATH (a stand-in for the NVIDIA driver, which cannot exist here)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    bin_dir = tmp_path / ("gpu" if gpu else "cpu")
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    env.pop("TORCH_INDEX", None)
    res = subprocess.run(
        [make, "-n", "setup", f"VENV={tmp_path / 'venv'}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return [line for line in res.stdout.splitlines() if '"torch==' in line]


def test_without_a_gpu_make_setup_takes_torch_from_the_cpu_index(tmp_path):
    (line,) = _setup_commands(tmp_path, gpu=False)
    assert f"--extra-index-url {CPU_INDEX}" in line, line
    # one try, a short timeout: offline (a local wheel in pip's find-links) costs no time
    assert "--retries 0 --timeout 5" in line, line


def test_with_a_gpu_make_setup_takes_pypi_s_cuda_build(tmp_path):
    (line,) = _setup_commands(tmp_path, gpu=True)
    assert "--extra-index-url" not in line and "--timeout" not in line, line


def test_the_torch_index_and_version_can_be_overridden(tmp_path):
    url = "https://example.invalid/whl/cu128"
    (line,) = _setup_commands(tmp_path, False, "TORCH=torch==2.13.0", f"TORCH_INDEX={url}")
    assert f"--extra-index-url {url}" in line and CPU_INDEX not in line, line
    plain = _setup_commands(tmp_path, True, "TORCH_INDEX=")
    assert len(plain) == 1 and "--extra-index-url" not in plain[0], plain


def test_mypy_covers_the_public_modules():
    """make typecheck runs mypy on [tool.mypy] files: every module of the public API."""
    files = set(_pyproject()["tool"]["mypy"]["files"])
    public = {"geompi/__init__.py", "geompi/optimizer.py", "geompi/session.py",
              "geompi/state.py", "geompi/collectives.py", "geompi/user_state.py",
              "geompi/errors.py", "geompi/sync"}  # fmt: skip
    assert public <= files, public - files
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^typecheck: setup\n\t\$\(BIN\)/mypy$", make, re.M)
