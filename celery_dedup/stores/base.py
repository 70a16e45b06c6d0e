"""The lock store protocol every backend implements.

A store keeps one record per key: the owner (the task id that holds it), a
little metadata and an expiry. Every operation is a single round trip and
atomic on the server, and every lock carries a TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..exceptions import StoreUnavailable

__all__ = [
    "CounterSupport",
    "Lock",
    "LockMeta",
    "LockStore",
    "unavailable_on",
]

#: Metadata saved with a lock: ``{"task_name": ..., "policy": ...}``.
LockMeta = Mapping[str, str]


@dataclass(frozen=True)
class Lock:
    """A held lock as a store reports it."""

    key: str
    owner: str
    task_name: str
    acquired_at: float
    expires_at: float
    policy: str

    @property
    def ttl(self) -> float:
        """Seconds left before the lock expires (never negative)."""
        return max(0.0, self.expires_at - time.time())


@runtime_checkable
class LockStore(Protocol):
    """**Protocol:** an owner-checked TTL lock store.

    Each method is one round trip to the server and atomic there.
    """

    #: A short name used in logs and ``StoreUnavailable`` (``"redis"``, ``"sql"``).
    name: str

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take ``key`` for ``owner`` for ``ttl`` seconds if it is free or expired.

        Returns ``None`` when the lock was taken, else the current holder, in
        the same round trip.
        """

    def release(self, key: str, owner: str) -> bool:
        """Delete ``key`` only if ``owner`` holds it (compare-and-delete).

        Returns whether it was deleted. Idempotent: a second call returns False.
        """

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Set the TTL of ``key`` to ``ttl`` seconds from now if ``owner`` holds it."""

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder of ``key`` unconditionally.

        Returns the previous live holder, or ``None`` if the key was free.
        """

    def get(self, key: str) -> Lock | None:
        """Return the live lock at ``key``, or ``None``."""

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Yield every live lock whose key starts with ``prefix``."""


@runtime_checkable
class CounterSupport(Protocol):
    """**Protocol:** a store that can keep shared metric counters.

    Counters are per ``(task_name, event)`` and are added in batches, so
    keeping them never costs a round trip per enqueue.
    """

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add ``counts`` to the stored counters in one round trip."""

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Return every stored counter under ``prefix``."""


@contextmanager
def unavailable_on(
    errors: tuple[type[BaseException], ...],
    store: str,
    describe: Callable[[], str] | None = None,
) -> Iterator[None]:
    """Translate the driver's "cannot reach the server" errors into ``StoreUnavailable``.

    Every store wraps its calls in this at one boundary, so the fallback
    logic catches one type and never branches on the store.
    """
    try:
        yield
    except errors as exc:
        where = describe() if describe is not None else store
        raise StoreUnavailable(
            f"lock store {where} is unavailable: {type(exc).__name__}: {exc}", store=store
        ) from exc
