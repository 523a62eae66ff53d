"""Packaging: the PEP 621 metadata, the LICENSE and the installed package (its data and
console scripts)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import geompi

try:
    from mpirun import REPO, install_copy
except ImportError:  # tests/ imported as a package
    from tests.mpirun import REPO, install_copy

tomllib = pytest.importorskip("tomllib")

ALIASES = ("geompi-train", "geompi-ckpt", "geompi-slurm", "geompi-plot")
# sha256 of the Apache License 2.0 text (apache.org's LICENSE-2.0.txt) with its runs of
# whitespace collapsed to one space: the file must be the licence, verbatim
APACHE_2_SHA256 = "0ffddef9e48f8a09aed5caf2d44f7ba1c1be2d9b8e0a6f693b1635b2d5566645"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``pip install --target`` of the checkout, shared by this module's tests."""
    return install_copy(tmp_path_factory.mktemp("install"))


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None):
    return subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


# --- metadata -------------------------------------------------------------------------------


def test_metadata_is_pep_621_in_pyproject_and_setup_cfg_is_gone() -> None:
    assert not (REPO / "setup.cfg").exists()
    project = _pyproject()["project"]
    assert project["name"] == "geompi"
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert project["readme"] == "README.md" and project["requires-python"].startswith(">=")
    assert project["description"] and any(c.startswith("Topic ::") for c in project["classifiers"])
    # the version has one source, geompi.__version__
    assert project["dynamic"] == ["version"]
    dyn = _pyproject()["tool"]["setuptools"]["dynamic"]
    assert dyn["version"] == {"attr": "geompi.__version__"}
    # no placeholder URLs: the repository is not published
    assert "urls" not in project
    # the Makefile's install step depends on files that exist
    line = next(s for s in (REPO / "Makefile").read_text().splitlines() if ".installed:" in s)
    for prereq in line.split(":", 1)[1].split():
        assert (REPO / prereq).is_file(), prereq


def test_license_is_the_apache_2_text_verbatim() -> None:
    text = (REPO / "LICENSE").read_text()
    assert hashlib.sha256(" ".join(text.split()).encode()).hexdigest() == APACHE_2_SHA256


# --- the installed package ------------------------------------------------------------------


def test_install_has_py_typed_and_the_job_scripts(site: Path, tmp_path: Path) -> None:
    pkg = site / "geompi"
    assert (pkg / "py.typed").is_file()
    for name in ("common.sh", "fsa.sbatch", "hfa.sbatch", "mixedsync.sbatch"):
        assert (pkg / "slurm_jobs" / name).is_file(), name
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = _run([sys.executable, "-m", "geompi.slurm", "common-path"], env, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == str(pkg / "slurm_jobs" / "common.sh"), r


def test_install_has_the_metadata_licence_and_commands(site: Path, tmp_path: Path) -> None:
    (dist,) = site.glob("geompi-*.dist-info")
    meta = (dist / "METADATA").read_text()
    assert f"Version: {geompi.__version__}\n" in meta
    assert "License-Expression: Apache-2.0\n" in meta
    assert (dist / "licenses" / "LICENSE").is_file()
    env = {**os.environ, "PYTHONPATH": str(site)}
    for alias in ALIASES:
        r = _run([str(site / "bin" / alias), "--help"], env, tmp_path)
        assert r.returncode == 0 and "usage:" in r.stdout, (alias, r)
