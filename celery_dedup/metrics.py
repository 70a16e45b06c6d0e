"""Per-task counters of what celery-dedup did: acquired, deduplicated, released, fallback.

``released`` counts the releases of the worker hooks (per ``unique_until``,
revoked and expired messages, failed publishes); ``released_manual`` the
releases made outside them: ``celery_dedup.release()``/``revoke()``, the
CLI, the Django admin and the reaper. ``key_reused`` counts calls whose
``deduplication_key`` was held for different arguments (``on_key_reuse``
raise or warn); ``coalesced`` counts Django on-commit calls folded into an
identical one pending in the same transaction.
CLI, the Django admin and the reaper. ``deferred`` counts the messages a
worker published again for later instead of running them (a copy of a
running publish, a store that did not answer, a full ``concurrency_limit``);
``rate_limited`` the calls over ``rate_limit_per_key`` (refused or delayed).
Under ``dedup_mode="observe"``, ``would_deduplicate``, ``would_replace``,
``would_cancel`` and ``would_rate_limit`` count the calls published anyway
that enforcing would have suppressed, used to replace or cancel a holder, or
refused by their rate; they are also kept per key (``key_counter``), which
``celery dedup stats --top N`` lists.

Counted in-process and added to the store in batches, so counting never
costs a round trip per call:

* ``incr`` only adds to a local ``Counter``; once at least
  ``dedup_metrics_flush_interval`` seconds (default 5) have passed since the
  last flush, the call that notices it starts a background thread that adds
  the whole batch to the store with ``CounterSupport.add_counts`` (one round
  trip for every counter), so a slow or hung store never delays a call
  (with an interval of 0, for tests, the flush is inline);
* pending counts are also flushed at ``worker_process_shutdown``,
  ``worker_shutdown`` and interpreter exit (``atexit``; a store already gone
  by then is logged at DEBUG only);
* a forked child drops the counts it inherited (the parent still has them
  and flushes them itself), so nothing is counted twice.

Counts of a store that cannot keep counters (no ``add_counts``), or that is
unreachable, stay pending in the process and are retried at the next flush.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from celery.signals import worker_process_shutdown, worker_shutdown

from .options import DEFAULTS, read_setting
from .stores.base import CounterSupport, Lock

__all__ = [
    "DEFAULT_FLUSH_INTERVAL",
    "EVENTS",
    "FLUSH_INTERVAL_SETTING",
    "KEY_MARK",
    "OBSERVED",
    "Metrics",
    "flush_all",
    "flush_interval",
    "key_counter",
    "live_locks",
    "per_key",
]

logger = logging.getLogger("celery_dedup")

#: the counter names
EVENTS: Final = (
    "acquired", "deduplicated", "released", "released_manual", "fallback", "skipped",
    "key_reused", "coalesced",
    "replaced", "cancelled",
    "deferred", "rate_limited",
    "would_deduplicate", "would_replace", "would_cancel", "would_rate_limit",
)

#: the counters of ``dedup_mode="observe"`` (what enforcing would have done), also kept per key
OBSERVED: Final = ("would_deduplicate", "would_replace", "would_cancel", "would_rate_limit")

#: joins a task name and a key's digest into the name a per-key counter is kept under
KEY_MARK: Final = "#key:"

#: the setting that bounds how often counts are written to the store
FLUSH_INTERVAL_SETTING: Final = "dedup_metrics_flush_interval"

#: seconds between two flushes when the setting is not set
DEFAULT_FLUSH_INTERVAL: Final = float(DEFAULTS[FLUSH_INTERVAL_SETTING])

#: every live ``Metrics``, for the exit and fork hooks
_INSTANCES: weakref.WeakSet[Metrics] = weakref.WeakSet()


def flush_interval(conf: Mapping[str, Any]) -> float:
    """Read ``dedup_metrics_flush_interval`` (seconds, ``>= 0``) from ``app.conf``.

    ``0`` flushes on every count: one more round trip per call, for tests only.
    """
    return float(read_setting(conf, FLUSH_INTERVAL_SETTING))


class Metrics:
    """Counters not yet flushed to the store, per ``(task name, event)``.

    ``store`` is called (only when flushing) to get the store to add counts
    to; ``prefix`` namespaces them there (the app's ``dedup_key_prefix``).
    Without ``store`` the counts only accumulate until ``take``.
    """

    def __init__(
        self,
        store: Callable[[], object] | None = None,
        *,
        prefix: str = "celery-dedup",
        interval: float = DEFAULT_FLUSH_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.prefix = prefix
        self.interval = interval
        self._clock = clock
        self._pending: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._due = clock() + interval
        self._warned = False
        #: a background flush is running (at most one at a time)
        self._flushing = False
        _INSTANCES.add(self)

    def incr(self, task_name: str, event: str, n: int = 1) -> None:
        """Count ``n`` occurrences of ``event``; flush if the interval has passed."""
        with self._lock:
            self._pending[(task_name, event)] += n
            if self._store is None:
                return
            now = self._clock()
            if now < self._due:
                return
            # Claimed under the lock: only one thread flushes per interval.
            self._due = now + self.interval
            if self.interval > 0:
                if self._flushing:
                    return
                self._flushing = True
        if self.interval <= 0:
            self.flush()  # every count, inline: for tests only (see flush_interval)
            return
        # Off the call's path: a slow or hung store never delays the call that
        # happened to notice the interval had passed.
        threading.Thread(target=self._flush_in_background, name="celery-dedup-metrics",
                         daemon=True).start()

    def _flush_in_background(self) -> None:
        try:
            self.flush()
        finally:
            with self._lock:
                self._flushing = False

    def take(self) -> dict[tuple[str, str], int]:
        """Return and forget the pending counts."""
        with self._lock:
            pending, self._pending = dict(self._pending), Counter()
        return pending

    def pending(self) -> dict[tuple[str, str], int]:
        """A snapshot of the counts not flushed yet."""
        with self._lock:
            return dict(self._pending)

    def _put_back(self, counts: Mapping[tuple[str, str], int]) -> None:
        with self._lock:
            self._pending.update(counts)

    def flush(self, *, quiet: bool = False) -> bool:
        """Add the pending counts to the store in one round trip.

        Returns whether nothing is left pending. Never raises: on a store
        error (or a store without counters) the counts are kept for the next
        flush, and the first error is logged as a WARNING (DEBUG when
        ``quiet``, as at interpreter exit).
        """
        counts = self.take()
        if not counts:
            return True
        store = self._store() if self._store is not None else None
        if not isinstance(store, CounterSupport):
            self._put_back(counts)
            return False
        try:
            store.add_counts(self.prefix, counts)
        except Exception as exc:
            self._put_back(counts)
            level = logging.DEBUG if self._warned or quiet else logging.WARNING
            self._warned = self._warned or not quiet
            logger.log(level, "celery-dedup: could not flush metrics to the store: %s", exc)
            return False
        return True

    def read(self) -> dict[tuple[str, str], int]:
        """Flush this process's counts, then return the store's counters.

        Raises ``TypeError`` if the store keeps no counters, and the store's
        own errors (``StoreUnavailable``) if it cannot be read.
        """
        self.flush()
        store = self._store() if self._store is not None else None
        if not isinstance(store, CounterSupport):
            raise TypeError(f"the lock store {store!r} keeps no counters")
        return store.read_counts(self.prefix)

    def _after_fork_in_child(self) -> None:
        # The lock may have been held by another thread at fork time.
        self._lock = threading.Lock()
        self._pending = Counter()
        self._flushing = False
        self._due = self._clock() + self.interval


def key_counter(task_name: str, key: str) -> str:
    """The name the per-key counts of ``key`` are kept under: the task and the key's digest.

    A store key ends with the sha256 of the call's identity; the first 16
    hex digits name it (``celery dedup list`` and ``show`` print the same).
    """
    digest = key.rsplit(":", 1)[-1][:16]
    # Within the 255 characters the SQL and Django stores keep of a task name.
    return f"{task_name[:255 - len(KEY_MARK) - len(digest)]}{KEY_MARK}{digest}"


def per_key(
    counts: Mapping[tuple[str, str], int],
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], dict[str, int]]]:
    """Split stored counts into per-task ones and per-key ones (``(task, digest)`` → counts)."""
    tasks: dict[tuple[str, str], int] = {}
    keys: dict[tuple[str, str], dict[str, int]] = {}
    for (name, event), n in counts.items():
        task_name, mark, digest = name.partition(KEY_MARK)
        if mark:
            keys.setdefault((task_name, digest), {})[event] = n
        else:
            tasks[(name, event)] = n
    return tasks, keys


def live_locks(locks: Iterable[Lock]) -> dict[str, int]:
    """The number of ``locks`` per task name."""
    return dict(Counter(lock.task_name for lock in locks))


def flush_all(*, quiet: bool = False) -> None:
    """Flush every ``Metrics`` of this process (exit and worker-shutdown hook)."""
    for metrics in list(_INSTANCES):
        metrics.flush(quiet=quiet)


def _at_exit() -> None:
    # At exit the store's server is often gone already (end of a test
    # session, container shutdown): nothing an operator can act on.
    flush_all(quiet=True)


def _after_fork_in_child() -> None:
    for metrics in list(_INSTANCES):
        metrics._after_fork_in_child()


def _on_shutdown(*args: Any, **kwargs: Any) -> None:
    flush_all()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
worker_process_shutdown.connect(_on_shutdown, weak=False)
worker_shutdown.connect(_on_shutdown, weak=False)
