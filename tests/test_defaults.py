"""One default per setting (issue 36, item 7): an algorithm's setting has the same default in the
API (``geompi.HFA()``, ``geompi.MixedSync()``), the CLI (``RunConfig``, the flags' defaults) and
the Slurm scripts, read from each of them here, not from a shared constant."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from geompi.config import RunConfig, make_config
from geompi.sync.hfa import HFA
from geompi.sync.mixed import MixedSync

ROOT = Path(__file__).resolve().parents[1]

# API field -> RunConfig field, for every setting both sides have (the rest are API-only: e.g.
# HFA(adaptive=...) is the CLI's --adaptive-sync flag, a bool with no default to disagree on).
NAMES = {
    HFA: {
        "k1": "k1",
        "k2": "k2",
        "weighting": "hfa_weighting",
        "outer_optimizer": "outer_optimizer",
        "outer_lr": "outer_lr",
        "reset_optimizer": "hfa_reset_optimizer",
        "fragments": "hfa_fragments",
        "overlap": "hfa_overlap",
        "mix": "hfa_mix",
        "adaptive": "adaptive_sync",
        "k2_min": "k2_min",
        "k2_max": "k2_max",
        "wan_share": "wan_share",
    },
    MixedSync: {
        "dcasgd_lambda": "dcasgd_lambda",
        "dcasgd_adaptive": "dcasgd_adaptive",
        "max_staleness": "max_staleness",
    },
}


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("algo", list(NAMES), ids=lambda c: c.name)
def test_the_api_and_the_cli_share_every_default(algo):
    api, cli = _defaults(algo), _defaults(RunConfig)
    names = NAMES[algo]
    # every API setting that has a CLI field of the same or a prefixed name is mapped above
    for field in api:
        for guess in (field, f"hfa_{field}", f"{algo.name}_{field}"):
            if guess in cli:
                assert names.get(field) == guess, f"{algo.__name__}.{field} <-> {guess}: map it"
    differ = {a: (api[a], cli[c]) for a, c in names.items() if api[a] != cli[c]}
    assert not differ, f"API and CLI defaults differ: {differ}"


def test_the_parsed_command_line_gets_the_same_hfa_algorithm_as_the_api():
    """What ``--sync hfa`` with no other flag trains is ``geompi.HFA()``."""
    cfg = make_config(["--sync", "hfa"], env={}).validate()
    assert HFA.from_config(cfg) == HFA()


def _script_default(script: str, var: str) -> int:
    text = (ROOT / "jobs" / "slurm" / script).read_text()
    m = re.search(rf"\$\{{{var}:-(\d+)\}}", text)
    assert m, f"{script} has no default for {var}"
    return int(m.group(1))


def test_the_slurm_script_has_the_same_k1_and_k2():
    assert _script_default("hfa.sbatch", "GEOMPI_HFA_K1") == HFA().k1
    assert _script_default("hfa.sbatch", "GEOMPI_HFA_K2") == HFA().k2
    shipped = (ROOT / "geompi" / "slurm_jobs" / "hfa.sbatch").read_text()
    assert shipped == (ROOT / "jobs" / "slurm" / "hfa.sbatch").read_text()


def test_the_documented_defaults_are_the_code_s():
    """docs/cli.md's flag table and docs/slurm.md state K1/K2 once, as the code has them."""
    d = HFA()
    slurm = (ROOT / "docs" / "slurm.md").read_text()
    assert f"| `GEOMPI_HFA_K1`, `GEOMPI_HFA_K2` | {d.k1}, {d.k2} |" in slurm
    readme = (ROOT / "README.md").read_text()
    assert f"K1={d.k1}, K2={d.k2}" in readme


@pytest.mark.parametrize("bounds", [(1, 64), (3, 9), (1, 1)])
def test_adaptive_cadence_starts_at_the_same_k2_in_the_cli_and_the_api(bounds):
    """Without a K2 of the user's, adaptive cadence starts at the default K2 clamped into its
    bounds, in both; a K2 the user gave outside them is refused in both."""
    from geompi.errors import ConfigError
    from geompi.sync.hfa import Cadence

    lo, hi = bounds
    flags = ["--sync", "hfa", "--adaptive-sync", "--k2-min", str(lo), "--k2-max", str(hi)]
    cli = HFA.from_config(make_config(flags, env={}).validate())
    api = HFA(adaptive=True, k2_min=lo, k2_max=hi)
    api.validate()
    expected = min(max(HFA().k2, lo), hi)
    assert Cadence(cli, None).k2 == Cadence(api, None).k2 == expected
    with pytest.raises(ConfigError, match="k2"):
        make_config([*flags, "--k2", str(hi + 2)], env={}).validate()
    with pytest.raises(ConfigError, match="k2"):
        HFA(adaptive=True, k2=hi + 2, k2_min=lo, k2_max=hi).validate()
