"""geompi.comm.poll: the one polling loop (backoff, watchdog, fault check), in one process."""

import time

import pytest

from geompi.comm import faults, poll
from geompi.errors import CommTimeoutError


def test_backoff_doubles_to_its_cap_and_resets():
    b = poll.Backoff(first=1e-6, cap=4e-6)
    seen = []
    for _ in range(4):
        seen.append(b.pause)
        b.sleep()
    assert seen == [1e-6, 2e-6, 4e-6, 4e-6]
    b.reset()
    assert b.pause == 1e-6


def test_spin_until_returns_once_done_and_calls_done_until_then():
    calls = []

    def done() -> bool:
        calls.append(1)
        return len(calls) >= 5

    poll.spin_until(done, "five calls", timeout=None, backoff=poll.Backoff(1e-6, 1e-6))
    assert len(calls) == 5


def test_spin_until_gives_up_after_the_timeout_naming_what_it_waited_for():
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="while waiting for the answer of rank 3"):
        poll.spin_until(lambda: False, "the answer of rank 3", timeout=0.05)
    assert time.monotonic() - t0 < 2.0


def test_a_recovery_begun_elsewhere_ends_every_wait(monkeypatch):
    """Under --on-failure continue a survivor revokes the world: every polling wait, not only
    the requests' one, raises PeerLost (three loops lacked the check)."""
    monkeypatch.setattr(faults, "world_revoked", lambda: True)
    with pytest.raises(faults.PeerLost, match="recovery while waiting for deposits"):
        poll.Poller("deposits", None).pause()
    with pytest.raises(faults.PeerLost):
        poll.spin_until(lambda: False, "x", timeout=None)


def test_the_yield_phase_catches_a_quick_answer_without_sleeping():
    t_done = time.perf_counter() + 0.001
    poll.spin_until(
        lambda: time.perf_counter() > t_done,
        "soon",
        timeout=None,
        backoff=poll.Backoff(first=10.0, cap=10.0),
        yield_s=0.5,
    )  # fmt: skip (a sleep of 10 s would show)
