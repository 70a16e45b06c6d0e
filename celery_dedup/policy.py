"""Unlock policies (``unique_until``) and the TTL arithmetic of a lock."""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum
from typing import Final

__all__ = ["KEEPS_ON_FAILURE", "UniqueUntil", "lock_ttl"]


class UniqueUntil(str, Enum):
    """When a lock is released (besides its TTL, which always applies)."""

    #: just before the task body runs
    START = "start"
    #: after the task succeeds; kept through retries and after a final failure
    SUCCESS = "success"
    #: after success or final failure; retries keep it
    FINISH = "finish"
    #: never actively: the TTL alone (a throttle)
    EXPIRY = "expiry"

    def releases_on_success(self) -> bool:
        """Whether a successful run releases the lock."""
        return self in (UniqueUntil.SUCCESS, UniqueUntil.FINISH)

    def releases_on_failure(self) -> bool:
        """Whether a final failure releases the lock."""
        return self is UniqueUntil.FINISH

    def releases_on_revoke(self) -> bool:
        """Whether a revoked or expired message releases the lock."""
        return self is not UniqueUntil.EXPIRY


#: the policies that keep a failed run's lock, so ``retry_window`` can shorten it
KEEPS_ON_FAILURE: Final = frozenset({UniqueUntil.SUCCESS, UniqueUntil.EXPIRY})


def lock_ttl(
    unique_for: float,
    *,
    countdown: float | None = None,
    eta: datetime | str | None = None,
    now: datetime | None = None,
) -> float:
    """Seconds a lock lives: ``unique_for``, plus the delay of a scheduled call.

    A call with ``countdown`` or ``eta`` holds its lock for the delay and then
    ``unique_for`` more, so a scheduled job stays unique until it has had
    its chance to run (Faktory's rule for scheduled jobs).
    """
    delay = 0.0
    if countdown:
        delay = float(countdown)
    elif eta is not None:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        current = now or datetime.now(timezone.utc)
        delay = (when - current).total_seconds()
    return max(0.0, delay) + unique_for
