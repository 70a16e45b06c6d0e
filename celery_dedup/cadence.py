"""When a group of leases is due for its renewal pass: every part of its own lease.

A renewer thread wakes as often as the shortest lease it keeps needs. Leases
of another length (another app in the same process) are renewed only when
their own period has passed since their last pass, so a long lease costs the
same round trips beside a short one as alone. A group seen for the first
time is due one wake-up early, as it is when it is alone (the thread then
wakes once per period, and renews it at the first wake-up after it appeared).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["Cadence"]


class Cadence:
    """The last renewal pass of each group (e.g. a store and a lease length)."""

    def __init__(self, parts: float) -> None:
        #: a group's passes come every ``lease / parts`` seconds
        self.parts = parts
        self._last: dict[tuple[Hashable, float], float] = {}

    def period(self, lease: float) -> float:
        """Seconds between two passes of a group whose lease lasts ``lease``
        (the thread's wake-up interval is the shortest of them)."""
        return lease / self.parts

    def due(
        self, groups: Iterable[tuple[Hashable, float]], now: float, interval: float
    ) -> set[tuple[Hashable, float]]:
        """The ``groups`` (each ``(what, lease)``) due at ``now``; their pass is noted.

        ``interval`` is how long the thread waits between wake-ups. Groups
        missing from ``groups`` are forgotten.
        """
        last = {group: self._last.get(group, now - interval) for group in groups}
        # A quarter of a wake-up of slack: a wake-up a hair early (the clock's
        # granularity) must not skip a lone group's pass.
        slack = interval / 4.0
        due = {group for group in last if now - last[group] + slack >= self.period(group[1])}
        for group in due:
            last[group] = now
        self._last = last
        return due
