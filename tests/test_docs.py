"""The docs site and the README front page stay true to the code (issue 37): every public name
has its API reference entry, the README's rank arithmetic is the topology planner's, its links
resolve, and the site builds strictly when the docs extra is installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import geompi
from geompi.comm.topology import Topology
from geompi.session import INIT_SETTINGS

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _nav_pages() -> list[str]:
    yaml = pytest.importorskip("yaml")
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages: list[str] = []

    def walk(items) -> None:
        for item in items:
            for v in item.values() if isinstance(item, dict) else [item]:
                walk(v) if isinstance(v, list) else pages.append(v)

    walk(nav)
    return pages


def test_the_api_reference_has_every_public_name() -> None:
    ref = (DOCS / "reference.md").read_text()
    documented = {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: (\S+)$", ref, re.M)}
    assert set(geompi.__all__) <= documented, set(geompi.__all__) - documented


def test_init_documents_every_keyword_it_takes() -> None:
    doc = geompi.init.__doc__ or ""
    for name in INIT_SETTINGS:
        assert re.search(rf"^\s+{name} \(", doc, re.M), name


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists() -> None:
    pages = _nav_pages()
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md"))
    assert "checkpoint-format.md" in pages and "slurm.md" in pages


def test_the_readme_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert any(t.startswith("docs/") for t in targets)
    for t in targets:
        if "://" not in t:
            assert (REPO / t).exists(), t


def test_the_readme_rank_arithmetic_is_the_planners() -> None:
    """The README's table of `mpirun -n N`: global servers, datacenter sizes, workers."""
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \(([\d, ]+)\) \| (\d+) \|$", readme, re.M)
    assert len(rows) >= 5 and "5" in [r[0] for r in rows]
    for n, g, dcs, sizes, workers in rows:
        topo = Topology.plan(int(n))
        assert topo.num_global_servers == int(g), n
        assert topo.dc_sizes == tuple(int(s) for s in sizes.split(",")), n
        assert topo.num_dcs == int(dcs) and topo.num_workers == int(workers), n


def test_ci_runs_lint_docs_and_tests_in_that_order() -> None:
    run = (REPO / ".ci" / "run").read_text()
    steps = re.findall(r"^make (\S+)$", run, re.M)
    assert steps == ["lint", "typecheck", "docs", "test"], steps
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^docs: setup\n\t.*mkdocs build --strict$", make, re.M)
    assert re.search(r'^test-fast: setup\n\t.*-m "not mpi and not slurm" tests$', make, re.M)
    assert "docs" in re.search(r"pip install -e '\.\[([^\]]*)\]'", make).group(1).split(",")


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    cmd = [str(mkdocs)] if mkdocs.exists() else [sys.executable, "-m", "mkdocs"]
    res = subprocess.run(
        [*cmd, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "WARNING" not in res.stderr, res.stderr[-3000:]
    ref = (tmp_path / "site" / "reference.html").read_text()
    for name in geompi.__all__:
        assert re.search(rf'id="geompi\.(\w+\.)*{name}"', ref), name
