"""bench/make_table.py: goals are judged right, and every committed result renders as a table."""

from __future__ import annotations

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def load_make_table():
    spec = importlib.util.spec_from_file_location("make_table", BENCH / "make_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_goals_with_fractions_and_bounds_are_judged():
    mt = load_make_table()
    assert mt.meets(0.265, "<= 1/4 (+ headers)") == "**no**"
    assert mt.meets(0.25, "<= 1/4") == "yes"
    assert mt.meets(1.2, ">= 1.0") == "yes"
    assert mt.meets(0.9, ">= 1.0") == "**no**"
    assert mt.meets(None, ">= 1.0") == "" and mt.meets(1.0, "not implemented yet") == ""


def test_every_committed_result_has_its_own_table():
    mt = load_make_table()
    found, bad = mt.load_results(BENCH / "results")
    assert not bad and found
    generic = [n for n in found if n not in mt.RENDERERS and n not in ("soak", "startup")]
    assert not generic, f"results rendered only as generic key/value tables: {generic}"
    doc = mt.build(BENCH / "results")
    assert "(unexpected layout" not in doc and "(no scalar figures)" not in doc
    for name in found:
        assert f"## {mt.TITLES.get(name, name)}" in doc
