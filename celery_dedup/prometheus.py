"""Prometheus exposition of celery-dedup's counters (``pip install 'celery-dedup[prometheus]'``).

::

    from prometheus_client import start_http_server
    from celery_dedup.prometheus import register

    register(app)            # adds a collector to the default registry
    start_http_server(9808)

The collector reads the counters every process flushed to the store (so
any one process exposes the whole system's numbers) and, per scrape,
scans the live locks:

=======================================  =======  ======================================
metric                                   type     meaning
=======================================  =======  ======================================
``celery_dedup_acquired_total``          counter  locks taken (a call was published)
``celery_dedup_deduplicated_total``      counter  calls suppressed as duplicates
``celery_dedup_released_total``          counter  locks released by the worker hooks
``celery_dedup_released_manual_total``   counter  locks released by hand or the reaper
``celery_dedup_fallback_total``          counter  calls that could not use the store
``celery_dedup_skipped_total``           counter  tasks a worker skipped (``IGNORED``)
``celery_dedup_key_reused_total``        counter  keys held for different arguments
``celery_dedup_coalesced_total``         counter  on-commit calls folded into one
``celery_dedup_live_locks``              gauge    locks held right now
=======================================  =======  ======================================

Every metric has one label, ``task`` (the task name). Expose it from one
process only (for example next to Flower); the counts are system-wide.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from .metrics import EVENTS, live_locks, per_key
from .runtime import runtime_for

if TYPE_CHECKING:
    from celery import Celery
    from prometheus_client.registry import CollectorRegistry

__all__ = ["METRIC_NAMES", "DedupCollector", "register"]

logger = logging.getLogger("celery_dedup")

_HELP: Final = {
    "acquired": "Locks taken by celery-dedup (the call was published).",
    "deduplicated": "Calls suppressed by celery-dedup as duplicates of a live lock.",
    "released": "celery-dedup locks released by the worker hooks.",
    "released_manual": "celery-dedup locks released by hand (release, revoke, CLI, admin) "
    "or by the reaper.",
    "fallback": "Calls celery-dedup published or refused without a lock (store unusable).",
    "skipped": "Tasks a worker skipped because another task held their lock.",
    "key_reused": "Calls whose deduplication_key was held by a publish with different "
    "arguments (on_key_reuse raise or warn).",
    "coalesced": "Django on-commit calls folded into an identical call pending in the "
    "same transaction.",
    "replaced": "Queued holders on_duplicate='replace' took the lock from.",
    "cancelled": "Holders on_duplicate='cancel_running' revoked (queued) or terminated (running).",
    "deferred": "Messages a worker published again for later instead of running them "
    "(a running copy, a store that did not answer, a full concurrency_limit).",
    "rate_limited": "Calls over rate_limit_per_key (refused or delayed).",
    "would_deduplicate": "dedup_mode='observe': calls published anyway that enforcing "
    "would have suppressed as duplicates.",
    "would_replace": "dedup_mode='observe': calls published anyway that enforcing would "
    "have used to replace their key's holder (replace, keep_last).",
    "would_cancel": "dedup_mode='observe': calls published anyway that enforcing would "
    "have used to cancel their key's holder (cancel_running).",
    "would_rate_limit": "dedup_mode='observe': calls published anyway that enforcing "
    "would have refused or delayed by rate_limit_per_key.",
}

#: every metric name as exposed (counters get ``_total`` from the client)
METRIC_NAMES: Final = (
    *(f"celery_dedup_{event}_total" for event in EVENTS),
    "celery_dedup_live_locks",
)


class DedupCollector:
    """A ``prometheus_client`` collector reading celery-dedup's store counters.

    ``live_locks=False`` skips the per-scrape scan of the lock keyspace
    (which costs one ``SCAN`` pass on Redis, one query on SQL).
    """

    def __init__(self, app: Celery, *, live_locks: bool = True) -> None:
        self.app = app
        self.live_locks = live_locks

    def describe(self) -> list[Any]:
        """Nothing up front: the collector is only read at scrape time."""
        return []

    def collect(self) -> Iterator[Any]:
        """Yield one counter family per event and the live-lock gauge."""
        runtime = runtime_for(self.app)
        try:
            counts = runtime.metrics.read()
        except Exception as exc:  # unreachable store or no counters: expose nothing
            logger.warning("celery-dedup: cannot read metrics for Prometheus: %s", exc)
            counts = {}
        counts, _ = per_key(counts)  # per-key counts: `celery dedup stats --top`, not labels
        families = {
            event: CounterMetricFamily(f"celery_dedup_{event}", _HELP[event], labels=["task"])
            for event in EVENTS
        }
        for (task_name, event), value in sorted(counts.items()):
            if event in families:
                families[event].add_metric([task_name], value)
        yield from families.values()
        if not self.live_locks:
            return
        store = runtime.store
        live: dict[str, int] = {}
        if store is not None:
            try:
                live = live_locks(store.scan(runtime.settings.key_prefix + ":"))
            except Exception as exc:
                logger.warning("celery-dedup: cannot scan locks for Prometheus: %s", exc)
        gauge = GaugeMetricFamily(
            "celery_dedup_live_locks", "celery-dedup locks held right now.", labels=["task"]
        )
        for task_name, n in sorted(live.items()):
            gauge.add_metric([task_name], n)
        yield gauge


def register(
    app: Celery, registry: CollectorRegistry | None = None, *, live_locks: bool = True
) -> DedupCollector:
    """Register a ``DedupCollector`` for ``app`` (default: the global registry)."""
    collector = DedupCollector(app, live_locks=live_locks)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
