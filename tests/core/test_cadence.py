"""Leases of several lengths in one process: each renewed every third of its own."""

from __future__ import annotations

from celery_dedup.cadence import Cadence

#: groups as the keepers key them: (a store, its lease)
A = ("store", 30.0)
SHORT = ("store", 0.3)
LONG = ("store", 3600.0)
LONG30 = ("store", 30.0)


def test_a_lone_group_is_due_at_every_wake_up() -> None:
    """Alone, the thread wakes once per period, and every wake-up renews (as before)."""
    cadence = Cadence(3.0)
    interval = cadence.period(30.0)
    assert cadence.due([A], 100.0, interval) == {A}  # first seen
    assert cadence.due([A], 110.0, interval) == {A}
    assert cadence.due([A], 120.5, interval) == {A}


def test_a_long_lease_beside_a_short_one_keeps_its_own_period() -> None:
    """The thread wakes every 0.1 s for a 0.3 s lease; a 3600 s lease waits its 1200 s."""
    cadence = Cadence(3.0)
    interval = cadence.period(0.3)
    renewed = {SHORT: 0, LONG: 0}
    now = 0.0
    for _ in range(100):  # 10 s of wake-ups
        now += interval
        for group in cadence.due([SHORT, LONG], now, interval):
            renewed[group] += 1
    assert renewed == {SHORT: 100, LONG: 0}
    now += 1200.0
    assert cadence.due([SHORT, LONG], now, interval) == {SHORT, LONG}


def test_a_group_that_left_starts_again_when_it_returns() -> None:
    """A group with no active runs is forgotten; back, it waits a period less one wake-up."""
    cadence = Cadence(3.0)
    interval = 1.0
    assert cadence.due([LONG30], 0.0, interval) == set()
    assert cadence.due([], 5.0, interval) == set()
    assert cadence.due([LONG30], 6.0, interval) == set()
    assert cadence.due([LONG30], 14.7, interval) == set()
    assert cadence.due([LONG30], 15.0, interval) == {LONG30}
