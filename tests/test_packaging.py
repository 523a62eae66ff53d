"""The installed package carries its data: py.typed and the Slurm job scripts."""

from __future__ import annotations

import os
import subprocess
import sys

try:
    from mpirun import install_copy
except ImportError:  # tests/ imported as a package
    from tests.mpirun import install_copy


def test_install_has_py_typed_and_the_job_scripts(tmp_path):
    site = install_copy(tmp_path)
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
