"""Concurrency slots and publish rates for ``MemoryStore`` (one process only)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from .base import RateAnswer, RateWindow, SlotUsage
from .rate_entries import new_entry, task_id_of

__all__ = ["MemoryLimits"]


class MemoryLimits:
    """``SlotSupport`` and ``RateSupport`` in dicts (a mixin of ``MemoryStore``).

    The same semantics as the Redis scripts: slots are leases that lapse,
    rates a sliding window whose delayed publishes reserve their place.
    """

    clock: Callable[[], float]
    _mutex: threading.Lock

    @property
    def _slots(self) -> dict[str, dict[str, float]]:
        found: dict[str, dict[str, float]] | None = self.__dict__.get("_slot_table")
        if found is None:
            found = self.__dict__["_slot_table"] = {}
        return found

    @property
    def _rates(self) -> dict[str, dict[str, float]]:
        found: dict[str, dict[str, float]] | None = self.__dict__.get("_rate_table")
        if found is None:
            found = self.__dict__["_rate_table"] = {}
        return found

    def _live_slots(self, key: str, now: float) -> dict[str, float]:
        holders = self._slots.setdefault(key, {})
        for holder, expiry in list(holders.items()):
            if expiry <= now:
                del holders[holder]
        return holders

    def take_slot(self, key: str, holder: str, limit: int, ttl: float) -> tuple[bool, int]:
        """Take a slot, or report the key full."""
        with self._mutex:
            now = self.clock()
            holders = self._live_slots(key, now)
            if holder not in holders and len(holders) >= limit:
                return False, len(holders)
            holders[holder] = now + ttl
            return True, len(holders)

    def give_slot(self, key: str, holder: str) -> bool:
        """Give the holder's slot back."""
        with self._mutex:
            return self._slots.get(key, {}).pop(holder, None) is not None

    def renew_slots(self, slots: Sequence[tuple[str, str]], ttl: float) -> int:
        """Renew every live lease of the given holders."""
        renewed = 0
        with self._mutex:
            now = self.clock()
            for key, holder in slots:
                holders = self._live_slots(key, now)
                if holder in holders:
                    holders[holder] = now + ttl
                    renewed += 1
        return renewed

    def slots_in_use(self, key: str) -> int:
        """How many live leases the key has."""
        with self._mutex:
            return len(self._live_slots(key, self.clock()))

    def hit_rate(
        self, key: str, member: str, limit: int, period: float, *, delay: bool
    ) -> RateAnswer:
        """Count the publish in the sliding window, or refuse it."""
        with self._mutex:
            return self._hit(key, member, limit, period, delay)

    def rate_window(self, key: str, limit: int, period: float) -> RateAnswer:
        """The window as it is (nothing counted)."""
        with self._mutex:
            return self._hit(key, "", limit, period, None)

    def list_slots(self, prefix: str) -> list[SlotUsage]:
        """Every slot key under ``prefix`` with a live lease."""
        with self._mutex:
            now = self.clock()
            found = [
                SlotUsage(key, len(self._live_slots(key, now)))
                for key in sorted(self._slots)
                if key.startswith(prefix)
            ]
        return [usage for usage in found if usage.in_use]

    def list_rates(self, prefix: str) -> list[RateWindow]:
        """Every rate key under ``prefix`` with entries."""
        with self._mutex:
            now = self.clock()
            found = []
            for key in sorted(self._rates):
                newest = sorted(self._rates[key].items(), key=lambda item: -item[1])
                if key.startswith(prefix) and newest:
                    ages = tuple(now - at for _, at in newest)
                    found.append(RateWindow(key, ages, task_id_of(newest[0][0])))
        return found

    def _hit(
        self, key: str, member: str, limit: int, period: float, delay: bool | None
    ) -> RateAnswer:
        now = self.clock()
        window = self._rates.setdefault(key, {})
        for name, at in list(window.items()):
            if at <= now - period:
                del window[name]
        ordered = sorted(window.items(), key=lambda item: item[1])
        last = task_id_of(ordered[-1][0]) if ordered else ""
        at = now
        if len(ordered) >= limit:
            at = max(now, ordered[len(ordered) - limit][1] + period)
        if delay is None or (at > now and not delay):
            return RateAnswer(False, at - now, len(ordered), last)
        # One entry per publish: calls sharing a task id count apart.
        entry = new_entry(member)
        window[entry] = at
        return RateAnswer(True, at - now, len(ordered) + 1, member, entry)

    def forget_rate(self, key: str, member: str) -> bool:
        """Take ``member`` back out of the window (``RateRelease``)."""
        with self._mutex:
            return self._rates.get(key, {}).pop(member, None) is not None
