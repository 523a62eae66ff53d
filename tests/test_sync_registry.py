"""The algorithm registry (geompi.sync): names, the servers' job, the CLI's flags, and that
nothing else dispatches on an algorithm's name."""

import pathlib
import re

import pytest

from geompi import sync
from geompi.config import SYNCS, build_parser, make_config
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
    builtin = {cls.name: cls for cls in sync.BUILTIN}  # a test may have registered its own
    assert set(SYNCS) == set(builtin) and builtin.items() <= sync.REGISTRY.items()
    for name, cls in builtin.items():
        assert cls.name == name and sync.resolve(name) == cls()


def test_a_job_with_bad_settings_is_refused():
    with pytest.raises(ConfigError, match="k1"):
        sync.from_job({"sync": "hfa", "settings": {"k1": 0}})


def test_no_module_outside_the_registry_dispatches_on_an_algorithm_name():
    """Behaviour follows the algorithm's attributes; GeoMX's spellings (--mixed-sync, its
    variables, its KVStore type names) are the algorithms' to declare (geompi.sync.declared),
    so no module outside the registry reads a name, flag parsing included."""
    root = pathlib.Path(sync.__file__).parent.parent
    test = re.compile(r"""\bsync\s*(==|!=|in)\s*[("']|["'](fsa|hfa|mixed)["']\s*(==|!=)""")
    allowed: set[str] = set()
    found = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        if "sync" not in path.relative_to(root).parts[:1] and path.name not in allowed
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if test.search(line)
    ]
    assert found == []


def test_a_registered_algorithm_passes_resolve_and_travels_to_the_servers(monkeypatch):
    """An algorithm from outside the package (examples/custom_algorithm.py): registered, it
    passes resolve() and the CLI's --sync; a server that never imported it rebuilds it from
    the import path its job carries."""
    import json
    import sys

    from examples.custom_algorithm import ClippedHFA

    algo = ClippedHFA(k1=2, k2=3, clip=0.5, outer_optimizer="adam", outer_lr=0.1)
    assert sync.resolve(algo) is algo
    assert sync.REGISTRY["clipped-hfa"] is ClippedHFA
    cfg = make_config(env={}, sync="examples.custom_algorithm:ClippedHFA", k1=2, k2=3)
    cfg.validate()
    assert type(cfg.algorithm) is ClippedHFA and cfg.family == "hfa"
    job = json.loads(json.dumps(algo.job()))
    assert job["path"] == "examples.custom_algorithm:ClippedHFA"
    monkeypatch.delitem(sync.REGISTRY, "clipped-hfa")  # a server rank that never imported it
    monkeypatch.delitem(sys.modules, "examples.custom_algorithm")
    rebuilt = sync.from_job(job)
    assert type(rebuilt).__name__ == "ClippedHFA" and rebuilt.clip == 0.5
    assert rebuilt.outer() == {"name": "adam", "lr": 0.1}


def test_register_refuses_what_is_not_an_algorithm_and_a_taken_name():
    from dataclasses import dataclass
    from typing import ClassVar

    with pytest.raises(ConfigError, match="pass a subclass of geompi.sync.Algorithm"):
        sync.register(int)

    @dataclass(frozen=True)
    class Nameless(HFA):
        pass

    with pytest.raises(ConfigError, match="give the class its own name"):
        sync.register(Nameless)

    @dataclass(frozen=True)
    class Impostor(HFA):
        name: ClassVar[str] = "hfa"

    with pytest.raises(ConfigError, match="the name 'hfa' is taken by geompi.sync.hfa:HFA"):
        sync.register(Impostor)

    @dataclass(frozen=True)
    class Unregistered(HFA):
        name: ClassVar[str] = "unregistered"

    with pytest.raises(ConfigError, match="register the class first"):
        sync.resolve(Unregistered())


@pytest.mark.parametrize(
    "flags, outer, stateful",
    [
        ({}, {"name": "sgd", "lr": 1.0}, False),  # the plain average: no state on the servers
        ({"outer_optimizer": "nesterov", "outer_lr": 0.7}, {"name": "nesterov", "lr": 0.7}, True),
        (
            {"outer_optimizer": "sgd", "outer_momentum": 0.5},
            {"name": "sgd", "lr": 1.0, "momentum": 0.5},
            True,
        ),
        ({"outer_optimizer": "adamw", "outer_lr": 0.01}, {"name": "adamw", "lr": 0.01}, True),
    ],
)
def test_the_cli_outer_flags_make_hfa_outer_optimizer(flags, outer, stateful):
    algo = make_config(env={}, sync="hfa", **flags).validate().algorithm
    assert algo.outer() == outer and algo.outer_stateful is stateful


# ---- GeoMX's spellings, each algorithm's to declare -----------------------------------------
def _kvstore_before(kind: str, chosen: str):
    """kv.create's choice as it was written before the algorithms declared their KVStore types
    (the reference): the algorithm, or the ConfigError's text."""
    if kind == "dist_async" and chosen == "hfa":
        return "dist_async and HFA (MXNET_KVSTORE_USE_HFA=1) disagree: unset one"
    hfa = kind == "dist_sync_hfa" or (chosen == "hfa" and kind != "dist_async")
    if kind == "dist_async":
        return MixedSync()
    return HFA(k1=3, k2=5) if hfa else FSA(optimizer="servers")


@pytest.mark.parametrize("kind", ["dist_sync", "dist_sync_hfa", "dist_async"])
@pytest.mark.parametrize(
    "env",
    [
        {},
        {"GEOMPI_SYNC": "fsa"},
        {"GEOMPI_SYNC": "mixed"},
        {"GEOMPI_SYNC": "HFA"},  # as spelt: this never chose HFA's KVStore
        {"GEOMPI_SYNC": "examples.custom_algorithm:ClippedHFA"},
        {"MXNET_KVSTORE_USE_HFA": "1"},
    ],
    ids=repr,
)
def test_a_kvstore_type_trains_the_algorithm_it_always_did(kind, env):
    cfg = make_config(env={**env, "GEOMPI_HFA_K1": "3", "MXNET_KVSTORE_HFA_K2": "5"})
    want = _kvstore_before(kind, cfg.sync)
    if isinstance(want, str):
        with pytest.raises(ConfigError) as exc:
            sync.for_kvstore(kind, cfg)
        assert str(exc.value) == want
    else:
        assert sync.for_kvstore(kind, cfg).from_config(cfg) == want


def test_the_environments_hfa_named_by_its_variable_refuses_dist_async():
    cfg = make_config(env={"GEOMPI_SYNC": "hfa"})
    with pytest.raises(ConfigError, match=r"^dist_async and HFA \(GEOMPI_SYNC=hfa\) disagree"):
        sync.for_kvstore("dist_async", cfg)


def test_an_unknown_kvstore_type_names_the_known_ones():
    with pytest.raises(ConfigError) as exc:
        sync.for_kvstore("dist_foo")
    text = str(exc.value)
    assert text.startswith("unknown KVStore type 'dist_foo': choose one of dist_sync, ")
    assert "dist_sync_hfa" in text and "dist_async" in text


def test_a_kvstore_push_is_each_algorithms_round():
    from geompi.ps.protocol import FLAG_SUM, Op

    assert FSA(optimizer="servers").kvstore_push(3) == (Op.GRAD, 1.0, FLAG_SUM)
    assert MixedSync().kvstore_push(3) == (Op.GRAD, 1.0, FLAG_SUM)
    assert HFA().kvstore_push(4) == (Op.AVG, 0.25, 0)


def test_a_registered_algorithm_declares_its_own_geomx_spellings(monkeypatch):
    """An algorithm's switch variable, switch flag and variables reach the configuration
    without geompi naming it; a subclass does not inherit its parent's."""
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass(frozen=True)
    class Switched(FSA):
        name: ClassVar[str] = "switched"
        switch_variable: ClassVar[str | None] = "MY_USE_SWITCHED"
        switch_flag: ClassVar[str | None] = "--switched"
        variables: ClassVar[dict[str, tuple[str, ...]]] = {"seed": ("MY_SEED", "MY_OLD_SEED")}

    @dataclass(frozen=True)
    class Child(Switched):
        name: ClassVar[str] = "child"

    monkeypatch.setitem(sync.REGISTRY, "switched", Switched)
    monkeypatch.setitem(sync.REGISTRY, "child", Child)
    cfg = make_config(env={"MY_USE_SWITCHED": "1", "MY_OLD_SEED": "7"})
    assert cfg.sync == "switched" and cfg.sources["sync"] == "MY_USE_SWITCHED"
    assert cfg.seed == 7 and cfg.sources["seed"] == "MY_OLD_SEED"
    with pytest.raises(ConfigError, match="MY_SEED=1 and MY_OLD_SEED=2 disagree"):
        make_config(env={"MY_SEED": "1", "MY_OLD_SEED": "2"})
    with pytest.raises(ConfigError, match="MY_SEED='x': must be a whole number"):
        make_config(env={"MY_SEED": "x"})
    with pytest.raises(ConfigError, match="GEOMPI_SYNC=fsa and MY_USE_SWITCHED=1 disagree"):
        make_config(env={"MY_USE_SWITCHED": "1", "GEOMPI_SYNC": "fsa"})
    assert make_config(["--switched"], env={}).sync == "switched"
    with pytest.raises(ConfigError, match="--switched conflicts with --sync hfa: drop one"):
        make_config(["--switched", "--sync", "hfa"], env={})
    assert "GeoMX alias for --sync switched" in build_parser().format_help()
    assert [c for c, _ in sync.declared("switch_flag")] == [MixedSync, Switched]  # not Child


def test_the_builtin_geomx_spellings_are_their_algorithms():
    assert sync.declared("switch_variable") == [(HFA, "MXNET_KVSTORE_USE_HFA")]
    assert sync.declared("switch_flag")[0] == (MixedSync, "--mixed-sync")
    (cls, variables), *_ = sync.declared("variables")
    assert cls is HFA and variables["k1"] == ("GEOMPI_HFA_K1", "MXNET_KVSTORE_HFA_K1")
    assert sync.kvstore_types()[:3] == ["dist_sync", "dist_sync_hfa", "dist_async"]
