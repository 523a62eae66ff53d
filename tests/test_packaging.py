"""The installed package carries its data: py.typed and the Slurm job scripts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

try:
    from mpirun import REPO
except ImportError:  # tests/ imported as a package
    from tests.mpirun import REPO


def test_install_has_py_typed_and_the_job_scripts(tmp_path):
    src = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "geompi", src / "geompi", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--target", str(site), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    pkg = site / "geompi"
    assert (pkg / "py.typed").is_file()
    for name in ("common.sh", "fsa.sbatch", "hfa.sbatch", "mixedsync.sbatch"):
        assert (pkg / "slurm_jobs" / name).is_file(), name
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run(
        [sys.executable, "-m", "geompi.slurm", "common-path"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == str(pkg / "slurm_jobs" / "common.sh"), r
