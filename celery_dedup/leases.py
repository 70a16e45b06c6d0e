"""The worker's main process keeps the running leases of its active messages alive.

One daemon thread per worker process renews, every third of the lease, the
lease of every message the worker is running (``celery.worker.state``'s
active requests), batched per store: the upkeep costs round trips per
worker and interval, not per task. A pool child that dies stops nothing
here, but its request leaves the active set, so its lease lapses within one
lease (or is given up at once when the worker sees the child die).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .runs import records_of
from .stores.base import LockStore, RunRef

__all__ = ["lease_of", "remember", "renew_active"]

logger = logging.getLogger("celery_dedup")

#: the attribute of a worker ``Request`` holding its ``(Run, lease seconds)``
_ATTR = "_dedup_run"


class _Renewer:
    """The renewer thread of this process (started again in a forked child)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pid = 0
        self.interval = 20.0

    def running(self) -> bool:
        return self.thread is not None and self.pid == os.getpid() and self.thread.is_alive()

    def start(self, lease: float) -> None:
        self.interval = min(self.interval, max(lease / 3.0, 0.05))
        if self.running():
            return
        with self.lock:
            if self.running():
                return
            self.pid = os.getpid()
            self.thread = threading.Thread(
                target=self.loop, name="celery-dedup-leases", daemon=True
            )
            self.thread.start()

    def loop(self) -> None:
        stop = threading.Event()
        while not stop.wait(self.interval):
            renew_active()


_renewer = _Renewer()


def remember(request: Any, store: LockStore, run: RunRef, lease: float) -> None:
    """Attach ``run`` (kept in ``store``) to a received request; make sure the renewer runs."""
    setattr(request, _ATTR, (store, run, lease))
    _renewer.start(lease)


def lease_of(request: Any) -> tuple[LockStore, RunRef, float] | None:
    """The ``(store, run, lease)`` attached to a received request, if any."""
    found: tuple[LockStore, RunRef, float] | None = getattr(request, _ATTR, None)
    return found


def _active_runs() -> dict[tuple[int, float], tuple[LockStore, list[RunRef]]]:
    from celery.worker import state as worker_state

    groups: dict[tuple[int, float], tuple[LockStore, list[RunRef]]] = {}
    for request in list(worker_state.active_requests):
        found = lease_of(request)
        if found is not None:
            store, run, lease = found
            groups.setdefault((id(store), lease), (store, []))[1].append(run)
    return groups


def renew_active() -> int:
    """Renew the lease (and ``keep_last`` run gate) of every active request of this
    worker (one pass).
    """
    renewed = 0
    for (_, lease), (store, runs) in _active_runs().items():
        try:
            renewed += records_of(store).renew_runs(runs, lease)
        except Exception as exc:  # a store outage: the next pass tries again
            logger.warning("celery-dedup: could not renew %d running leases: %s", len(runs), exc)
    return renewed
