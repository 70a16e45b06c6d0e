"""Concurrency slots and publish rates for ``MemoryStore`` (one process only)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from .base import RateAnswer, RateWindow, SlotTurn, SlotUsage, SlotWaiter, slot_limit_of
from .rate_entries import new_entry, own_period, rate_of, task_id_of

__all__ = ["MemoryLimits"]

#: A waiter: its place, its expiry, its payload and the limit it waits under.
_Waiting = tuple[float, float, bytes, int]
#: How many of a key's oldest waiters a dispatch looks at (as the scripts do).
_SCAN = 64


class MemoryLimits:
    """``SlotSupport``, ``SlotHandoff`` and ``RateSupport`` in dicts (a mixin of ``MemoryStore``).

    The same semantics as the Redis scripts: slots are leases that lapse,
    a full key keeps a wait list whose oldest waiter gets each freed slot,
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

    @property
    def _waits(self) -> dict[str, dict[str, _Waiting]]:
        """Per key: waiter id -> (place, expiry, payload, the limit it waits under)."""
        found: dict[str, dict[str, _Waiting]] | None = self.__dict__.get(
            "_wait_table"
        )
        if found is None:
            found = self.__dict__["_wait_table"] = {}
        return found

    @property
    def _reserved(self) -> dict[str, dict[str, float]]:
        """Per key: waiter id -> reservation expiry."""
        found: dict[str, dict[str, float]] | None = self.__dict__.get("_reserved_table")
        if found is None:
            found = self.__dict__["_reserved_table"] = {}
        return found

    def _live_turns(
        self, key: str, now: float
    ) -> tuple[dict[str, float], dict[str, _Waiting], dict[str, float]]:
        holders = self._live_slots(key, now)
        waiters = self._waits.setdefault(key, {})
        for name, (_, expiry, _, _) in list(waiters.items()):
            if expiry <= now:
                del waiters[name]
        reserved = self._reserved.setdefault(key, {})
        for name, expiry in list(reserved.items()):
            if expiry <= now:
                del reserved[name]
        return holders, waiters, reserved

    def take_slot_in_turn(
        self,
        key: str,
        holder: str,
        limit: int,
        ttl: float,
        waiter: SlotWaiter | None,
        grace: float,
    ) -> SlotTurn:
        """Take a slot in turn, or wait for one (``SlotHandoff``)."""
        with self._mutex:
            now = self.clock()
            holders, waiters, reserved = self._live_turns(key, now)
            me = waiter.id if waiter is not None else None
            taken = holder in holders
            if not taken and me is not None and reserved.pop(me, None) is not None:
                taken = True
            elif not taken and waiter is not None:
                place = waiters[waiter.id][0] if waiter.id in waiters else waiter.order
                # The limit it was called under: a slot goes to it only below it.
                waiters[waiter.id] = (place, now + waiter.life, waiter.payload, limit)
            if taken:
                holders[holder] = now + ttl
                if me is not None:
                    waiters.pop(me, None)
            woken, taken = self._dispatch(key, now, limit, grace, holder, me, taken, ttl)
            if not taken and waiter is None and len(holders) + len(reserved) < limit:
                holders[holder] = now + ttl
                taken = True
            return SlotTurn(taken, len(holders) + len(reserved), woken)

    def give_slot_in_turn(
        self, key: str, holder: str, limit: int, grace: float
    ) -> tuple[bytes, ...]:
        """Give the holder's slot back and hand the freed slots to the oldest waiters."""
        with self._mutex:
            now = self.clock()
            self._live_turns(key, now)[0].pop(holder, None)
            return self._dispatch(key, now, limit, grace, holder, None, False, 0.0)[0]

    def _dispatch(
        self,
        key: str,
        now: float,
        limit: int,
        grace: float,
        holder: str,
        me: str | None,
        taken: bool,
        ttl: float,
    ) -> tuple[tuple[bytes, ...], bool]:
        """Reserve free slots for the oldest waiters (``me`` takes its own).

        A waiter is served only while fewer slots are in use than the limit
        it waits under (``limit`` for a waiter listed without one); one that
        finds its limit reached keeps its place and the next is looked at.
        """
        holders, waiters, reserved = self._live_turns(key, now)
        used = len(holders) + len(reserved)
        queue = sorted(waiters.items(), key=lambda item: (item[1][0], item[0]))[:_SCAN]
        woken = []
        for name, (_, _, payload, own) in queue:
            if used >= (own or limit):
                continue
            used += 1
            del waiters[name]
            if name == me and not taken:
                holders[holder] = now + ttl
                taken = True
            else:
                reserved[name] = now + grace
                woken.append(payload)
        return tuple(woken), taken

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
            found = []
            for key in sorted(self._slots):
                if key.startswith(prefix):
                    holders = self._live_slots(key, now)
                    newest = max(holders, key=lambda h: holders[h], default="")
                    found.append(SlotUsage(key, len(holders), slot_limit_of(newest)))
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
                    name = newest[0][0]
                    found.append(RateWindow(key, ages, task_id_of(name), rate_of(name)))
        return found

    def _hit(
        self, key: str, member: str, limit: int, period: float, delay: bool | None
    ) -> RateAnswer:
        now = self.clock()
        window = self._rates.setdefault(key, {})
        for name, at in list(window.items()):
            # Kept while its own period lasts, even past this call's (rate_entries).
            if at <= now - max(period, own_period(name)):
                del window[name]
        ordered = sorted(
            ((name, at) for name, at in window.items() if at > now - period),
            key=lambda item: item[1],
        )
        last = task_id_of(ordered[-1][0]) if ordered else ""
        at = now
        if len(ordered) >= limit:
            at = max(now, ordered[len(ordered) - limit][1] + period)
        if delay is None or (at > now and not delay):
            return RateAnswer(False, at - now, len(ordered), last)
        # One entry per publish: calls sharing a task id count apart.
        entry = new_entry(member, limit, period)
        window[entry] = at
        return RateAnswer(True, at - now, len(ordered) + 1, member, entry)

    def forget_rate(self, key: str, member: str) -> bool:
        """Take ``member`` back out of the window (``RateRelease``)."""
        with self._mutex:
            return self._rates.get(key, {}).pop(member, None) is not None
