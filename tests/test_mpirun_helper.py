"""The test helper that starts mpirun: it tries again only a launch mpirun could not start."""

from __future__ import annotations

import stat

import pytest
from mpirun import LAUNCH_FAILURES, run, train_runs


def fake_launcher(tmp_path, fails: int, message: str, stdout: str = "") -> list[str]:
    """A script standing in for mpirun: its first FAILS calls print MESSAGE and exit 213."""
    count = tmp_path / "calls"
    script = tmp_path / "fake-mpirun"
    script.write_text(
        "#!/bin/sh\n"
        f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}\n"
        f'if [ "$n" -lt {fails} ]; then printf "%s" "{stdout}"; echo "{message}" >&2; exit 213;'
        " fi\n"
        "echo ran\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return [str(script)]


def calls(tmp_path) -> int:
    return int((tmp_path / "calls").read_text())


def test_a_launch_mpirun_could_not_start_is_tried_again(tmp_path):
    res = run(fake_launcher(tmp_path, 2, LAUNCH_FAILURES[0]), timeout=30)
    assert (res.returncode, res.stdout, calls(tmp_path)) == (0, "ran\n", 3)


def test_a_launch_that_keeps_failing_fails(tmp_path):
    res = run(fake_launcher(tmp_path, 5, LAUNCH_FAILURES[0]), timeout=30)
    assert res.returncode == 213 and calls(tmp_path) == 3


def test_any_other_failure_is_not_tried_again(tmp_path):
    res = run(fake_launcher(tmp_path, 1, "geompi: error: something"), timeout=30)
    assert res.returncode == 213 and calls(tmp_path) == 1
    # a rank that printed before the failure ran code under test: not tried again either
    other = tmp_path / "other"
    other.mkdir()
    res = run(fake_launcher(other, 1, LAUNCH_FAILURES[0], stdout="step 1"), timeout=30)
    assert res.returncode == 213 and calls(other) == 1


@pytest.mark.mpi
def test_train_runs_keeps_each_runs_output_apart_and_names_a_failing_run(tmp_path):
    """Several CLI runs in one mpirun job (train_runs): each run's output is its own, a run's
    environment is undone after it, and a run that fails is named, never passed over."""
    quiet = ["--model", "mlp", "--progress-every", "1e9"]
    hook = {"GEOMPI_TEST_HOOKS": "1", "GEOMPI_FAULT_SIGNAL_AT": "2:0"}  # stops at step 2
    first, second = train_runs(
        3, [([*quiet, "--steps", 5], hook), ([*quiet, "--steps", 4], {})], tmp_path / "a", 120
    )
    assert "geompi: preempted" in first.stderr and "steps=4" not in first.stderr, first.stderr
    assert "geompi: preempted" not in second.stderr and "steps=4" in second.stderr
    with pytest.raises(AssertionError) as info:
        train_runs(
            3,
            [([*quiet, "--steps", 2], {}), ([*quiet, "--sync", "bsp"], {})],
            tmp_path / "b",
            120,
        )
    assert "run 1 (" in str(info.value) and "unknown --sync 'bsp'" in str(info.value)
