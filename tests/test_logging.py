"""geompi.logs: geompi's lines are records of the ``geompi`` logger, at the level their prefix
says, with the rank; the default stderr handler steps aside for an application's own; the
level comes from GEOMPI_LOG_LEVEL or --log-level, and a bad one is one line."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from geompi import logs
from geompi.errors import ConfigError, say

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **env},
    )  # fmt: skip


def test_say_prints_the_bare_line_by_default():
    r = _python(
        "from geompi.errors import say\n"
        "say('geompi: resumed from x')\nsay('geompi: warning: w')\nsay('geompi: error: e')\n"
    )
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr == "geompi: resumed from x\ngeompi: warning: w\ngeompi: error: e\n"


def test_the_level_hides_the_less_severe_but_never_an_error():
    code = "from geompi.errors import say\nsay('geompi: done')\nsay('geompi: error: e')\n"
    r = _python(code, GEOMPI_LOG_LEVEL="error")
    assert r.stderr == "geompi: error: e\n"
    r = _python(code + "import logging; logging.getLogger('geompi.x').debug('geompi: d')\n",
                GEOMPI_LOG_LEVEL="DEBUG")  # fmt: skip
    assert r.stderr == "geompi: done\ngeompi: error: e\ngeompi: d\n"


def test_an_applications_handler_gets_the_records_with_rank_and_level():
    code = (
        "import logging\n"
        "logging.basicConfig(format='%(rank)s|%(levelname)s|%(name)s|%(message)s')\n"
        "from geompi.errors import say\n"
        "say('geompi: warning: disk nearly full')\n"
        "logging.getLogger('geompi.metrics').info('geompi: step 1')\n"
    )
    r = _python(code, OMPI_COMM_WORLD_RANK="3")
    # once, through the application's handler (geompi's own stepped aside)
    assert r.stderr.splitlines() == [
        "3|WARNING|geompi|geompi: warning: disk nearly full",
        "3|INFO|geompi.metrics|geompi: step 1",
    ], r.stderr


def test_records_reach_a_handler_on_the_geompi_logger(caplog):
    with caplog.at_level(logging.DEBUG, logger="geompi"):
        say("geompi: error: bad")
    (rec,) = [r for r in caplog.records if r.name == "geompi"]
    assert rec.levelno == logging.ERROR and rec.getMessage() == "geompi: error: bad"
    assert rec.rank == logs.rank_of_process()


def test_level_settings_are_checked():
    assert logs.level_from_env({}) == "INFO"
    assert logs.level_from_env({"GEOMPI_LOG_LEVEL": "warning"}) == "WARNING"
    with pytest.raises(ValueError, match="GEOMPI_LOG_LEVEL='loud': choose one of DEBUG"):
        logs.level_from_env({"GEOMPI_LOG_LEVEL": "loud"})
    from geompi.config import make_config

    assert make_config(["--log-level", "debug"]).validate().log_level == "debug"
    with pytest.raises(ConfigError, match="unknown --log-level 'loud': choose one of DEBUG"):
        make_config(["--log-level", "loud"]).validate()


def test_a_bad_log_level_variable_is_one_line_at_start(monkeypatch):
    from geompi.runtime import check_log_level

    monkeypatch.setenv("GEOMPI_LOG_LEVEL", "verbose")
    with pytest.raises(ConfigError) as e:
        check_log_level()
    assert str(e.value) == ("GEOMPI_LOG_LEVEL='verbose': choose one of DEBUG, INFO, WARNING, ERROR")


def test_the_rank_is_stamped_on_geompi_and_its_children_only():
    factory = logs._stamp_rank(logging.LogRecord)
    for name, stamped in [
        ("geompi", True),
        ("geompi.metrics", True),
        ("geompi.a.b", True),
        ("geompix", False),
        ("geomp", False),
        ("app.geompi", False),
        ("", False),
    ]:
        record = factory(name, logging.INFO, __file__, 1, "m", (), None)
        assert hasattr(record, "rank") is stamped, name
