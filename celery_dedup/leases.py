"""The worker's main process keeps the running leases of its active messages alive.

One daemon thread per worker process renews, every third of the lease, the
lease of every message the worker is running (``celery.worker.state``'s
active requests), batched per store: the upkeep costs round trips per
worker and interval, not per task. A pool child that dies stops nothing
here, but its request leaves the active set, so its lease lapses within one
lease (or is given up at once when the worker sees the child die).

A lease survives a store that stalls longer than the lease: its record
lives a full lease period past the lease (``runs.record_life``), and once
this thread has seen a run hold its lease it takes the lease back as soon
as the store answers again if the record lapsed meanwhile and no other copy
took it (``RunRecords.keep_runs``). A pass the store answers slowly is
logged, as a store error is. Runs whose end could not be recorded from this
process (``pending_end``) keep their lease here until the end lands.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .cadence import Cadence
from .runs import record_life, records_of
from .stores.base import LockStore, RunRef

__all__ = ["began", "forget", "lease_of", "pending_end", "pending_ends", "remember", "renew_active"]

logger = logging.getLogger("celery_dedup")

#: the attribute of a worker ``Request`` holding its ``(Run, lease seconds)``
_ATTR = "_dedup_run"

#: Delivery tokens of runs a renewal found holding their lease: they began,
#: so their lease is taken back if it lapses (forgotten once no longer active).
_held: dict[str, float] = {}
_held_lock = threading.Lock()

#: Ends of runs this process could not record yet: ``(store, run, lease,
#: end, given up at)``, retried by the renewer, their lease kept meanwhile.
_pending: list[tuple[LockStore, RunRef, float, Callable[[], object], float]] = []


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
        self.interval = min(self.interval, max(_cadence.period(lease), 0.05))
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
            renew_active(only_due=True)


_renewer = _Renewer()
#: each (store, lease) group is renewed every third of its own lease
_cadence = Cadence(3.0)


def remember(request: Any, store: LockStore, run: RunRef, lease: float) -> None:
    """Attach ``run`` (kept in ``store``) to a received request; make sure the renewer runs."""
    setattr(request, _ATTR, (store, run, lease))
    _renewer.start(lease)


def lease_of(request: Any) -> tuple[LockStore, RunRef, float] | None:
    """The ``(store, run, lease)`` attached to a received request, if any."""
    found: tuple[LockStore, RunRef, float] | None = getattr(request, _ATTR, None)
    return found


def began(run: RunRef) -> bool:
    """Whether a renewal in this process found ``run`` holding its lease: it began.

    A request of a message that was deferred (a full concurrency key, a
    ``keep_last`` follow-up waiting for the run gate) stays active until its
    pool child reports, yet never held a lease: it is no live run.
    """
    with _held_lock:
        return run.token in _held


def forget(run: RunRef) -> None:
    """This process gave ``run``'s lease up (its child died): never take it back."""
    with _held_lock:
        _held.pop(run.token, None)


def pending_end(
    store: LockStore,
    run: RunRef,
    lease: float,
    end: Callable[[], object],
    patience: float | None = None,
) -> None:
    """Keep ``run``'s lease alive and call ``end`` each pass until it returns without
    raising: the end of a run this process could not record (the store did not answer).

    Given up (an ERROR log line) after ``patience`` seconds (default: never),
    the done marker's own life: past it a copy would be accepted even had the
    marker landed.
    """
    now = time.monotonic()
    given_up_at = now + patience if patience is not None else float("inf")
    with _held_lock:
        _held[run.token] = now
        _pending.append((store, run, lease, end, given_up_at))
    _renewer.start(lease)


def pending_ends() -> int:
    """How many ends of runs wait for the store in this process."""
    return len(_pending)


def _active_runs() -> dict[tuple[int, float], tuple[LockStore, list[RunRef]]]:
    from celery.worker import state as worker_state

    groups: dict[tuple[int, float], tuple[LockStore, list[RunRef]]] = {}
    for request in list(worker_state.active_requests):
        found = lease_of(request)
        if found is not None:
            store, run, lease = found
            groups.setdefault((id(store), lease), (store, []))[1].append(run)
    for store, run, lease, _, _ in list(_pending):
        groups.setdefault((id(store), lease), (store, []))[1].append(run)
    return groups


def renew_active(*, only_due: bool = False) -> int:
    """Renew the lease (and ``keep_last`` run gate) of every active request of this
    worker, taking back those that lapsed (one pass); then retry pending ends.

    ``only_due`` (the renewer thread's passes): only the leases whose third
    has passed since their last pass, when leases of several lengths share
    the process.
    """
    renewed = 0
    tokens: set[str] = set()
    groups = _active_runs()
    due = (
        _cadence.due(groups, time.monotonic(), _renewer.interval)
        if only_due
        else set(groups)
    )
    for group, (store, runs) in groups.items():
        tokens.update(run.token for run in runs)
        if group not in due:
            continue
        lease = group[1]
        started = time.monotonic()
        try:
            kept = records_of(store).keep_runs(runs, record_life(lease), set(_held))
        except Exception as exc:  # a store outage: the next pass tries again
            logger.warning("celery-dedup: could not renew %d running leases: %s", len(runs), exc)
            continue
        took = time.monotonic() - started
        if took > lease / 3.0:  # a stall that raised nothing (a locked SQL table)
            logger.warning(
                "celery-dedup: the lock store took %.1fs to renew %d running leases "
                "(a lease lasts %gs)",
                took,
                len(runs),
                lease,
            )
        now = time.monotonic()
        with _held_lock:
            for run, held in zip(runs, kept, strict=True):
                if held:
                    _held[run.token] = now
        renewed += sum(kept)
    with _held_lock:
        for token in [t for t in _held if t not in tokens]:
            del _held[token]
    _retry_pending()
    return renewed


def _retry_pending() -> None:
    for entry in list(_pending):
        try:
            entry[3]()
        except Exception as exc:  # still no answer: the lease is kept, tried next pass
            if time.monotonic() < entry[4]:
                logger.debug("celery-dedup: the end of a run still waits for the store: %s", exc)
                continue
            logger.error("celery-dedup: gave up recording the end of a run: %s", exc)
        with _held_lock:
            if entry in _pending:
                _pending.remove(entry)
