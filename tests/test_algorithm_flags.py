"""Each algorithm owns its command-line flags (``Algorithm.add_arguments``): the built-in
ones add theirs, an algorithm from outside the package (``--sync pkg.module:Class``) adds its
own, the values reach its settings (and so the servers' job), and a flag under another
``--sync`` is one line naming its owner."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest

from geompi import sync
from geompi.config import build_parser, flag_owners, make_config
from geompi.errors import ConfigError
from geompi.sync import HFA, MixedSync

CLIPPED = "examples.custom_algorithm:ClippedHFA"


def test_the_builtin_flags_belong_to_their_algorithms():
    owners = flag_owners()
    assert owners["k1"] is HFA and owners["hfa_fragments"] is HFA
    assert owners["outer_optimizer"] is HFA and owners["wan_share"] is HFA
    assert owners["max_staleness"] is MixedSync
    assert "lr" not in owners and "dcasgd_lambda" not in owners  # the optimizer's, any sync


def test_an_outside_algorithm_adds_its_flag_and_its_value_reaches_the_job():
    cfg = make_config(["--sync", CLIPPED, "--k1", "3", "--clip", "0.25"], env={})
    cfg.validate()
    algo = cfg.algorithm
    assert type(algo).__name__ == "ClippedHFA" and algo.clip == 0.25 and algo.k1 == 3
    assert algo.job()["settings"]["clip"] == 0.25  # what the servers rebuild it from
    assert cfg.algorithm_args == {"clip": 0.25} and cfg.sources["clip"] == "--clip"
    assert make_config(["--sync", CLIPPED], env={}).algorithm.clip == 0.01  # the field's


def test_its_flags_are_in_the_help_under_its_name_and_absent_without_it():
    text = build_parser(CLIPPED).format_help()
    assert "--sync clipped-hfa:" in text and "--clip CLIP" in text
    assert "--sync hfa:" in text and "--sync mixed:" in text
    assert "--clip" not in build_parser().format_help()
    with pytest.raises(ConfigError, match="unrecognized arguments: --clip"):
        make_config(["--sync", "hfa", "--clip", "0.5"], env={})


def test_the_env_chooses_the_class_whose_flags_are_parsed():
    cfg = make_config(["--clip", "0.5"], env={"GEOMPI_SYNC": CLIPPED})
    assert cfg.algorithm.clip == 0.5


def test_a_bad_value_is_one_line_naming_the_flag():
    with pytest.raises(ConfigError, match="argument --clip: expected a number, not 'x'"):
        make_config(["--sync", CLIPPED, "--clip", "x"], env={})
    cfg = make_config(["--sync", CLIPPED, "--clip", "-1"], env={})
    with pytest.raises(ConfigError, match=r"ClippedHFA\(clip=-1.0\): must be a number > 0"):
        cfg.validate()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--k1", "2"], "--k1 is for --sync hfa, not --sync fsa: drop --k1 or pass --sync hfa"),
        (["--sync", "mixed", "--outer-lr", "2"], "--outer-lr is for --sync hfa, not --sync mixed"),
        (["--sync", "hfa", "--max-staleness", "2"], "--max-staleness is for --sync mixed"),
    ],
)
def test_a_flag_under_another_sync_names_its_owner(argv, words):
    with pytest.raises(ConfigError, match=words):
        make_config(argv, env={}).validate()


def test_a_subclass_takes_its_parents_flags():
    cfg = make_config(["--sync", CLIPPED, "--outer-lr", "0.5", "--hfa-fragments", "2"], env={})
    cfg.validate()
    assert cfg.algorithm.outer_lr == 0.5 and cfg.algorithm.fragments == 2


@dataclass(frozen=True)
class Clashing(HFA):
    name: ClassVar[str] = "clashing-hfa"

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--lr", type=float, default=None)


def test_a_flag_that_geompi_has_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "clashing_mod", sys.modules[__name__])
    monkeypatch.setattr(sys.modules[__name__], "Clashing", Clashing, raising=False)
    with pytest.raises(ConfigError, match="--sync clashing-hfa: its flag --lr cannot be added"):
        make_config(["--sync", f"{__name__}:Clashing"], env={})
    sync.REGISTRY.pop("clashing-hfa", None)


def test_an_unimportable_sync_is_named_before_its_flags():
    with pytest.raises(ConfigError, match="--sync nosuch.mod:X: cannot import nosuch.mod"):
        make_config(["--sync", "nosuch.mod:X", "--clip", "1"], env={})
