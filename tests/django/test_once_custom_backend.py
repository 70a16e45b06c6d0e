"""celery-once with a project's own Django-cache backend and a ``memory://`` broker.

The setup of django-eveuniverse's suite (and other Alliance Auth apps): the
documented one-line import change must be all it takes. The shim locks in
Django's cache (``django-cache``) and says so in a warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, _state
from celery.contrib.testing.worker import start_worker

from celery_dedup.compat.celery_once import QueueOnce
from celery_dedup.runtime import runtime_for
from tests.fixtures._events import wait_until

BACKEND = "tests.django.once_backend.DjangoBackend"


def _app(name: str, **conf: Any) -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=name,
        ONCE={"backend": BACKEND, "settings": {}},
        worker_hijack_root_logger=False,
        **conf,
    )
    return app


@pytest.fixture
def runs() -> Iterator[list[int]]:
    """The bodies run, in order; the current and default app restored afterwards.

    ``start_worker`` makes its app the current and default one; the rest of
    the session (``manage.py`` commands, ``current_app``) expects the example's.
    """
    current, default = _state.get_current_app(), _state.default_app
    yield []
    current.set_current()
    _state.set_default_app(default)


def _task(app: Celery, runs: list[int], done: threading.Event | None = None) -> Any:
    @app.task(base=QueueOnce, once={"keys": ["x"], "graceful": True}, shared=False,
              name=f"{app.main}.update")
    def update(x: int) -> int:
        runs.append(x)
        if done is not None:
            done.set()
        return x

    return update


def test_custom_django_cache_backend_locks_in_djangos_cache(
    runs: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """No result backend, a memory broker: the lock store is Django's cache, with a warning."""
    app = _app("eve-queued")
    done = threading.Event()
    update = _task(app, runs, done)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_dedup"):
            first = update.delay(1)
            second = update.delay(1)
        assert not first.deduplicated
        assert second.deduplicated and second.id == first.id
        warned = [r.getMessage() for r in caplog.records if r.name == "celery_dedup"]
        assert any(f"ONCE['backend']={BACKEND!r} has no celery-dedup equivalent; using "
                   "django-cache instead" in m for m in warned), warned
        store = runtime_for(app).store
        assert store is not None and store.name == "django-cache"
        assert store.get(first.deduplication_key) is not None
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30,
                          loglevel="WARNING"):
            assert done.wait(30)
            # released once the run finished (unlock_before_run off: "finish")
            wait_until(lambda: store.get(first.deduplication_key) is None)
        assert runs == [1]  # the duplicate never ran
    finally:
        app.close()


def test_eager_suite_runs_every_call(runs: list[int]) -> None:
    """The eager setup of a test suite: each call runs in place and frees its lock."""
    app = _app("eve-eager", task_always_eager=True)
    update = _task(app, runs)
    try:
        update.delay(1)
        update.delay(1)
        update.delay(2)
        assert runs == [1, 1, 2]
        store = runtime_for(app).store
        assert store is not None and store.name == "django-cache"
        assert store.get(update.get_key((1,), {})) is None
    finally:
        app.close()


def test_explicit_dedup_store_wins(runs: list[int]) -> None:
    """``dedup_store`` set by the project is kept (the shim only fills an unset one)."""
    app = _app("eve-explicit", dedup_store="memory://eve-explicit")
    update = _task(app, runs)
    try:
        update.delay(1)
        store = runtime_for(app).store
        assert store is not None and store.name == "memory"
    finally:
        app.close()
