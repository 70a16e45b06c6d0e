"""In-process lock store for tests and single-process eager use.

``memory://`` locks live in one dict guarded by a lock; they are shared by
the threads of one process, never across processes. Each ``memory://NAME``
URL names one shared table, so producer and eager worker code in one
process see the same locks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .base import (
    FENCE_TTL,
    RECORD_POLICIES,
    AcquireItem,
    Claim,
    ClaimOutcome,
    Lock,
    LockMeta,
    RevokeOutcome,
)
from .memory_limits import MemoryLimits

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["MemoryStore"]

_TABLES: dict[str, MemoryStore] = {}
_TABLES_LOCK = threading.Lock()


class MemoryStore(MemoryLimits):
    """A dict of locks with TTLs, safe across threads of one process."""

    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._locks: dict[str, Lock] = {}
        #: (key, owner) → when the revoked marker expires
        self._revoked: dict[tuple[str, str], float] = {}
        self._counts: Counter[tuple[str, str]] = Counter()
        #: key → (its last fence, when its counter lapses)
        self._fences: dict[str, tuple[int, float]] = {}
        #: gate key → (the payload of the follow-up waiting at it, when it lapses)
        self._gate_waiters: dict[str, tuple[bytes, float]] = {}
        self._mutex = threading.Lock()

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> MemoryStore:
        """``memory://`` or ``memory://NAME``: the process-wide table of that name."""
        name = url.partition("://")[2]
        with _TABLES_LOCK:
            if name not in _TABLES:
                _TABLES[name] = cls()
            return _TABLES[name]

    def _live(self, key: str, now: float) -> Lock | None:
        lock = self._locks.get(key)
        if lock is not None and lock.expires_at <= now:
            del self._locks[key]
            return None
        return lock

    def _new(self, key: str, owner: str, ttl: float, meta: LockMeta, now: float) -> Lock:
        lock = Lock(
            key=key,
            owner=owner,
            task_name=meta.get("task_name", ""),
            acquired_at=now,
            expires_at=now + ttl,
            policy=meta.get("policy", ""),
            task_id=meta.get("task_id") or owner,
            started=meta.get("started") == "1",
        )
        self._locks[key] = lock
        return lock

    def _is_revoked(self, key: str, owner: str, now: float) -> bool:
        until = self._revoked.get((key, owner))
        if until is not None and until <= now:
            del self._revoked[(key, owner)]
            return False
        return until is not None

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock if free or expired, else return the holder."""
        with self._mutex:
            now = self.clock()
            holder = self._live(key, now)
            if holder is not None:
                return holder
            self._new(key, owner, ttl, meta, now)
            return None

    def acquire_many(self, items: Sequence[AcquireItem]) -> list[Lock | None]:
        """``acquire`` for each item under one hold of the table's lock."""
        answers: list[Lock | None] = []
        with self._mutex:
            now = self.clock()
            for key, owner, ttl, meta in items:
                holder = self._live(key, now)
                if holder is None:
                    self._new(key, owner, ttl, meta, now)
                answers.append(holder)
        return answers

    def release(self, key: str, owner: str) -> bool:
        """Delete the lock if ``owner`` holds it."""
        with self._mutex:
            holder = self._live(key, self.clock())
            if holder is None or holder.owner != owner:
                return False
            del self._locks[key]
            return True

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Reset the TTL if ``owner`` holds the lock."""
        with self._mutex:
            now = self.clock()
            holder = self._live(key, now)
            if holder is None or holder.owner != owner:
                return False
            self._locks[key] = replace(holder, expires_at=now + ttl)
            return True

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Become the holder; return the previous live holder."""
        with self._mutex:
            now = self.clock()
            previous = self._live(key, now)
            self._new(key, owner, ttl, meta, now)
            return previous

    def take_over_queued(
        self, key: str, owner: str, ttl: float, meta: LockMeta
    ) -> Lock | None:
        """Become the holder unless a started holder holds the key; return the previous."""
        with self._mutex:
            now = self.clock()
            previous = self._live(key, now)
            if previous is None or not previous.started:
                self._new(key, owner, ttl, meta, now)
            return previous

    def take_over_revoking(
        self,
        key: str,
        owner: str,
        ttl: float,
        meta: LockMeta,
        revoked_ttl: float,
        *,
        queued_only: bool = False,
    ) -> Lock | None:
        """Become the holder (unless started, when ``queued_only``); revoke the displaced owner."""
        with self._mutex:
            now = self.clock()
            previous = self._live(key, now)
            if previous is not None and queued_only and previous.started:
                return previous
            if previous is not None and previous.owner != owner:
                until = now + max(previous.expires_at - now, revoked_ttl)
                marker = (key, previous.owner)
                self._revoked[marker] = max(self._revoked.get(marker, 0.0), until)
            self._new(key, owner, ttl, meta, now)
            return previous

    def fence_of(self, key: str) -> int | None:
        """The last fence issued for ``key`` (``FencedClaims``)."""
        with self._mutex:
            last = self._fences.get(key)
            return None if last is None or last[1] <= self.clock() else last[0]

    def _fence(self, key: str, now: float) -> int:
        """The next fence of ``key``: above its last and the clock in microseconds."""
        last = self._fences.get(key)
        previous = last[0] if last is not None and last[1] > now else 0
        fence = max(previous + 1, int(now * 1_000_000))
        self._fences[key] = (fence, now + FENCE_TTL)
        return fence

    def claim(
        self,
        key: str,
        owner: str,
        *,
        release: bool,
        ttl: float | None,
        meta: LockMeta,
        fence: bool = False,
    ) -> Claim:
        """The start check (see ``LockStore.claim``); with ``fence``, an admitted
        claim carries the key's next fence (``FencedClaims``)."""
        with self._mutex:
            now = self.clock()
            holder = self._live(key, now)
            mine = holder is not None and holder.owner == owner
            if self._is_revoked(key, owner, now):
                if mine:
                    del self._locks[key]
                return Claim(ClaimOutcome.REVOKED)
            if holder is not None and mine:
                if release:
                    del self._locks[key]
                else:
                    self._locks[key] = replace(holder, started=True)
                return Claim(ClaimOutcome.OWNED, fence=self._fence(key, now) if fence else None)
            if holder is not None:
                return Claim(ClaimOutcome.HELD, holder)
            if ttl is not None and not release:
                self._new(key, owner, ttl, {**meta, "started": "1"}, now)
            return Claim(ClaimOutcome.FREE, fence=self._fence(key, now) if fence else None)

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Mark ``owner`` revoked; release its lock unless it started."""
        with self._mutex:
            now = self.clock()
            self._revoked[(key, owner)] = max(self._revoked.get((key, owner), 0.0), now + ttl)
            holder = self._live(key, now)
            if holder is None or holder.owner != owner:
                return RevokeOutcome.NOT_HELD
            if holder.started:
                return RevokeOutcome.RUNNING
            del self._locks[key]
            return RevokeOutcome.RELEASED

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Mark the owner's lock not started, keeping or resetting its TTL."""
        with self._mutex:
            now = self.clock()
            holder = self._live(key, now)
            if holder is None or holder.owner != owner:
                return False
            expires_at = holder.expires_at if ttl is None else now + ttl
            self._locks[key] = replace(holder, started=False, expires_at=expires_at)
            return True

    def unrevoke(self, key: str, owner: str) -> None:
        """Forget the revoked marker of ``owner``."""
        with self._mutex:
            self._revoked.pop((key, owner), None)

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key``."""
        with self._mutex:
            return self._live(key, self.clock())

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix`` (a snapshot; run records are not locks)."""
        with self._mutex:
            now = self.clock()
            locks = [
                lock
                for key in list(self._locks)
                if key.startswith(prefix)
                and (lock := self._live(key, now)) is not None
                and lock.policy not in RECORD_POLICIES
            ]
        yield from locks

    # -- GateWaiters --------------------------------------------------------

    def list_gate_waiter(self, gate: str, token: str, payload: bytes, life: float) -> bool:
        """List the follow-up at the gate another owner holds (``GateWaiters``)."""
        with self._mutex:
            now = self.clock()
            holder = self._live(gate, now)
            if holder is None or holder.owner == token:
                return False
            lapsed = [k for k, (_, until) in self._gate_waiters.items() if until <= now]
            for key in lapsed:
                del self._gate_waiters[key]
            self._gate_waiters[gate] = (payload, now + life)
            return True

    def open_gate(self, gate: str, token: str) -> bytes | None:
        """Release ``token``'s gate and take its waiter (``GateWaiters``), under the lock."""
        with self._mutex:
            now = self.clock()
            holder = self._live(gate, now)
            if holder is not None:
                if holder.owner != token:
                    return None
                del self._locks[gate]
            payload, until = self._gate_waiters.pop(gate, (None, 0.0))
            return payload if until > now else None

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add to the in-memory counters."""
        with self._mutex:
            self._counts.update(counts)

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """The in-memory counters."""
        with self._mutex:
            return dict(self._counts)

    def clear(self) -> None:
        """Forget every lock and counter (for tests)."""
        with self._mutex:
            self._locks.clear()
            self._revoked.clear()
            self._counts.clear()
            self._gate_waiters.clear()
            self.__dict__.pop("_slot_table", None)
            self.__dict__.pop("_rate_table", None)
