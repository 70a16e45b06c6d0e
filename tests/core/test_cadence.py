"""Leases of several lengths in one process: each renewed every third of its own."""

from __future__ import annotations

from celery_dedup.cadence import Cadence


def test_a_lone_group_is_due_at_every_wake_up() -> None:
    """Alone, the thread wakes once per period, and every wake-up renews (as before)."""
    cadence = Cadence(3.0)
    interval = 30.0 / 3.0
    assert cadence.due({"a": 30.0}, 100.0, interval) == {"a"}  # first seen
    assert cadence.due({"a": 30.0}, 110.0, interval) == {"a"}
    assert cadence.due({"a": 30.0}, 120.5, interval) == {"a"}


def test_a_long_lease_beside_a_short_one_keeps_its_own_period() -> None:
    """The thread wakes every 0.1 s for a 0.3 s lease; a 3600 s lease waits its 1200 s."""
    cadence = Cadence(3.0)
    interval = 0.3 / 3.0
    renewed: dict[str, int] = {"short": 0, "long": 0}
    now = 0.0
    for _ in range(100):  # 10 s of wake-ups
        now += interval
        for group in cadence.due({"short": 0.3, "long": 3600.0}, now, interval):
            renewed[str(group)] += 1
    assert renewed == {"short": 100, "long": 0}
    now += 1200.0
    assert cadence.due({"short": 0.3, "long": 3600.0}, now, interval) == {"short", "long"}


def test_a_group_that_left_starts_again_when_it_returns() -> None:
    """A group with no active runs is forgotten; back, it waits a period less one wake-up."""
    cadence = Cadence(3.0)
    interval = 1.0
    assert cadence.due({"long": 30.0}, 0.0, interval) == set()
    assert cadence.due({}, 5.0, interval) == set()
    assert cadence.due({"long": 30.0}, 6.0, interval) == set()
    assert cadence.due({"long": 30.0}, 14.7, interval) == set()
    assert cadence.due({"long": 30.0}, 15.0, interval) == {"long"}
