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
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .base import Lock, LockMeta

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["MemoryStore"]

_TABLES: dict[str, MemoryStore] = {}
_TABLES_LOCK = threading.Lock()


class MemoryStore:
    """A dict of locks with TTLs, safe across threads of one process."""

    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._locks: dict[str, Lock] = {}
        self._counts: Counter[tuple[str, str]] = Counter()
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
        )
        self._locks[key] = lock
        return lock

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock if free or expired, else return the holder."""
        with self._mutex:
            now = self.clock()
            holder = self._live(key, now)
            if holder is not None:
                return holder
            self._new(key, owner, ttl, meta, now)
            return None

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
            self._locks[key] = Lock(
                key=key,
                owner=owner,
                task_name=holder.task_name,
                acquired_at=holder.acquired_at,
                expires_at=now + ttl,
                policy=holder.policy,
            )
            return True

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Become the holder; return the previous live holder."""
        with self._mutex:
            now = self.clock()
            previous = self._live(key, now)
            self._new(key, owner, ttl, meta, now)
            return previous

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key``."""
        with self._mutex:
            return self._live(key, self.clock())

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix`` (a snapshot)."""
        with self._mutex:
            now = self.clock()
            locks = [
                lock
                for key in list(self._locks)
                if key.startswith(prefix) and (lock := self._live(key, now)) is not None
            ]
        yield from locks

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
            self._counts.clear()
