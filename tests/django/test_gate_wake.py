"""``keep_last`` on the Django stores: a real in-thread worker wakes the follow-up at its gate.

The Django DB store (SQLite test database) and the Django cache store (each
backend) keep the run gate as a lock and list the waiting follow-up beside
it (``GateWaiters``). Every deferral's countdown is made long, so a
follow-up whose parked copy is later dropped as "already ran" was woken.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from celery import Celery, _state

from celery_dedup.runtime import runtime_for
from tests.fixtures._store_case import StoreCase
from tests.fixtures.gate_wake import woken_by_the_run_s_end_and_run_once

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]


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
