"""The algorithm registry (geompi.sync): names, the servers' job, the CLI's flags, and that
nothing else dispatches on an algorithm's name."""

import pathlib
import re

import pytest

from geompi import sync
from geompi.config import SYNCS, make_config
from geompi.errors import ConfigError
from geompi.sync import FSA, HFA, MixedSync

ALGOS = [
    FSA(),
    FSA(optimizer="servers"),
    HFA(k1=3, k2=2, weighting="uniform", outer_optimizer="nesterov", outer_lr=0.7),
    HFA(k1=2, k2=4, fragments=2, overlap=True, mix=0.5, reset_optimizer=True),
    MixedSync(dcasgd=True, dcasgd_lambda=0.1, dcasgd_adaptive=True, max_staleness=3),
]


@pytest.mark.parametrize("algo", ALGOS, ids=repr)
def test_the_servers_rebuild_the_workers_algorithm_from_its_job(algo):
    import json

    job = json.loads(json.dumps(algo.job()))  # as it travels: JSON text
    assert sync.from_job(job) == algo


def test_the_flags_name_the_algorithm_and_its_settings():
    cfg = make_config(["--sync", "hfa", "--k1", "3", "--k2", "5", "--hfa-weighting", "uniform"])
    assert cfg.algorithm == HFA(k1=3, k2=5, weighting="uniform")
    assert cfg.algorithm.period() == 15
    assert make_config(["--sync", "fsa"]).algorithm == FSA(optimizer="servers")
    assert make_config(["--sync", "mixed", "--max-staleness", "2"]).algorithm == MixedSync(
        max_staleness=2
    )


def test_every_flag_choice_is_registered():
    assert set(SYNCS) == set(sync.REGISTRY)
    for name, cls in sync.REGISTRY.items():
        assert cls.name == name and sync.resolve(name) == cls()


def test_a_job_with_bad_settings_is_refused():
    with pytest.raises(ConfigError, match="k1"):
        sync.from_job({"sync": "hfa", "settings": {"k1": 0}})


def test_no_module_outside_the_registry_dispatches_on_an_algorithm_name():
    """Behaviour follows the algorithm's attributes; only flag parsing reads names (config.py:
    --sync, --mixed-sync and GeoMX's variables; kv.py: GeoMX's kvstore type names)."""
    root = pathlib.Path(sync.__file__).parent.parent
    test = re.compile(r"""\bsync\s*(==|!=|in)\s*[("']|["'](fsa|hfa|mixed)["']\s*(==|!=)""")
    allowed = {"config.py", "kv.py"}
    found = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        if "sync" not in path.relative_to(root).parts[:1] and path.name not in allowed
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if test.search(line)
    ]
    assert found == []
