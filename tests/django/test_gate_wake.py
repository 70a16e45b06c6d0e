"""``keep_last`` on the Django stores: a real in-thread worker wakes the follow-up at its gate.

The Django DB store (SQLite test database) and the Django cache store (each
backend) keep the run gate as a lock and list the waiting follow-up beside
it (``GateWaiters``). Every deferral's countdown is made long, so a
follow-up whose parked copy is later dropped as "already ran" was woken.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery, _state
from celery.contrib.testing.worker import start_worker

from celery_dedup import DedupTask, inspect_lock
from celery_dedup import worker as worker_module
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import task_skipped
from tests.core.conftest import wait_until
from tests.fixtures._store_case import StoreCase

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]

#: the countdown of every deferral here: the parked copy comes back this late
LONG_BACKOFF = 8.0
GATE_WAIT = "deferred: the previous run of its key"


@contextmanager
def app_on(case: StoreCase) -> Iterator[Celery]:
    """An app on the memory broker, its locks in the case's store; the current and
    default app restored afterwards (``start_worker`` makes its app both, and the
    sample project's shared tasks follow the current app)."""
    current, default = _state.get_current_app(), _state.default_app
    app = Celery("gate-wake-django", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(
        task_default_queue="gate-wake-django",
        dedup_store=case.url,
        dedup_metrics_flush_interval=3600,
    )
    try:
        yield app
    finally:
        runtime_for(app).metrics.flush()
        app.close()
        current.set_current()
        _state.set_default_app(default)


def test_on_the_django_db_store(
    store_django_sqlite: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Django DB store (``celery_dedup_gate_wait``)."""
    with app_on(store_django_sqlite) as app:
        woken_by_the_run_s_end_and_run_once(app, monkeypatch)


def test_on_the_django_cache_store(
    store_django_cache: StoreCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Django cache store on each backend (the waiter in the gate's own entry, or
    beside it on a ``RedisCache``)."""
    with app_on(store_django_cache) as app:
        woken_by_the_run_s_end_and_run_once(app, monkeypatch)


def woken_by_the_run_s_end_and_run_once(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follow-up deferred at its key's gate runs as soon as the run it follows ends;
    its parked copy, when it comes back after the long countdown, is dropped as a copy
    of a run that ran: the body ran once per call."""
    monkeypatch.setattr(
        worker_module, "deferral_countdown", lambda task, request, base=None: LONG_BACKOFF
    )
    ran: list[int] = []
    started, release = threading.Event(), threading.Event()

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="keep_last",
              deduplication_key=lambda x: "account-1")
    def sync(x: int) -> int:
        ran.append(x)
        if x == 0:
            started.set()
            release.wait(30)
        return x

    skipped: list[str] = []

    def on_skip(sender: Any = None, task_id: str = "", reason: str = "", **_: Any) -> None:
        skipped.append(f"{task_id}:{reason}")

    task_skipped.connect(on_skip, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                          shutdown_timeout=30, loglevel="WARNING"):
            first = sync.delay(0)
            assert started.wait(10)
            follow_up = sync.delay(1)
            wait_until(
                lambda: any(s.startswith(f"{follow_up.id}:{GATE_WAIT}") for s in skipped),
                timeout=10,
            )
            release.set()
            assert first.get(timeout=10) == 0
            assert follow_up.get(timeout=10) == 1
            wait_until(
                lambda: f"{follow_up.id}:already ran" in skipped, timeout=LONG_BACKOFF + 20
            )
            assert ran == [0, 1]
            assert inspect_lock(follow_up.deduplication_key, app=app) is None
    finally:
        task_skipped.disconnect(on_skip)
