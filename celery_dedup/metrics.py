"""Per-task counters of what celery-dedup did: acquired, deduplicated, released, fallback.

Counted in-process and added to the store in batches, so counting never
costs a round trip per call.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Final

__all__ = ["EVENTS", "Metrics"]

#: the counter names
EVENTS: Final = ("acquired", "deduplicated", "released", "fallback", "skipped")


class Metrics:
    """Counters not yet flushed to the store, per ``(task name, event)``."""

    def __init__(self) -> None:
        self._pending: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def incr(self, task_name: str, event: str, n: int = 1) -> None:
        """Count ``n`` occurrences of ``event`` for ``task_name``."""
        with self._lock:
            self._pending[(task_name, event)] += n

    def take(self) -> dict[tuple[str, str], int]:
        """Return and forget the pending counts."""
        with self._lock:
            pending, self._pending = dict(self._pending), Counter()
        return pending
