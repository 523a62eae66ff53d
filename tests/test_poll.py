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


class _Beats:
    """Stand-in for a running geompi.comm.heartbeat.Heartbeat (its thread needs MPI): this
    rank, each rank's silence, and who announced a loss."""

    def __init__(self, rank: int, silence: dict[int, float]) -> None:
        self.rank, self.silence = rank, silence
        self.home = [0, 0, 0, 1, 1, 1, 2, 2, None]  # 9 ranks: dc_sizes 3, 3, 2 and one global
        self.reporter: int | None = None
        self.announced = 0

    def silent(self, seconds: float) -> list[tuple[int, float]]:
        return [(r, s) for r, s in self.silence.items() if s > seconds]

    def announce(self) -> None:
        self.reporter = self.rank
        self.announced += 1


def _check(beats: _Beats, monkeypatch) -> CommTimeoutError | None:
    from geompi.comm import heartbeat

    monkeypatch.setattr(heartbeat, "_current", beats)
    try:
        poll.Watchdog(5.0, "the workers").check()
    except CommTimeoutError as e:
        return e
    return None


def test_the_lost_ranks_datacenter_reports_it_and_the_others_end_quietly(monkeypatch):
    # Rank 3 (datacenter 1) silent for 5.5 s: its local server (rank 5) reports it at once and
    # tells the others; rank 2 (datacenter 0, 1 rank away) waits 5 + 2 s, then ends without a
    # line; rank 7 (4 ranks away) 5 + 5 s.
    own = _Beats(5, {3: 5.5})
    err = _check(own, monkeypatch)
    assert err is not None and not err.quiet and "from rank 3" in str(err)
    assert own.announced == 1
    other = _Beats(2, {3: 6.9})
    assert _check(other, monkeypatch) is None
    other.silence[3] = 7.1
    other.reporter = 5  # rank 5's announcement arrived on the heartbeat
    err = _check(other, monkeypatch)
    assert err is not None and err.quiet and other.announced == 0
    far = _Beats(7, {3: 9.9})
    assert _check(far, monkeypatch) is None
    # Nobody announced (the lost rank's datacenter was busy): a far one reports it itself.
    far.silence[3] = 10.1
    err = _check(far, monkeypatch)
    assert err is not None and not err.quiet and far.announced == 1
    # A lost global server (no datacenter): the nearest rank first, 1 s a rank and 1 s more.
    assert _check(_Beats(7, {8: 6.9}), monkeypatch) is None
    assert _check(_Beats(7, {8: 7.1}), monkeypatch) is not None
