"""Apps and workers for the core suite: a real Redis broker, backend and store."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_dedup.runtime import runtime_for
from tests.fixtures.redis import RedisServer

AppFactory = Callable[..., Celery]


def make_app(redis_server: RedisServer, name: str = "core", **conf: Any) -> Celery:
    """A Celery app on the test Redis: broker db 3, results and locks db 4."""
    app = Celery(name, set_as_current=False)
    settings: dict[str, Any] = {
        "broker_url": redis_server.url(3),
        "result_backend": redis_server.url(4),
        "task_default_queue": f"q-{name}",
        "broker_connection_retry_on_startup": False,
        "worker_hijack_root_logger": False,
        "result_expires": None,
    }
    app.conf.update({**settings, **conf})
    return app


@pytest.fixture
def app_factory(redis_server: RedisServer) -> Iterator[AppFactory]:
    """Build apps on flushed Redis databases; close them afterwards."""
    redis_server.flush(3, 4)
    apps: list[Celery] = []

    def factory(name: str = "core", **conf: Any) -> Celery:
        app = make_app(redis_server, name, **conf)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        runtime_for(app).metrics.flush()
        app.close()


@pytest.fixture
def worker_for() -> Iterator[Callable[..., Any]]:
    """Start a real in-thread worker for an app; stopped at teardown."""
    stack: list[Any] = []

    def start(app: Celery, pool: str = "threads", concurrency: int = 2, **kw: Any) -> Any:
        ctx = start_worker(
            app,
            pool=pool,
            concurrency=concurrency,
            perform_ping_check=False,
            shutdown_timeout=30,
            loglevel="WARNING",
            **kw,
        )
        worker = ctx.__enter__()
        stack.append(ctx)
        return worker

    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


def scheduled_by_worker(app: Celery, task_id: str) -> None:
    """Wait until a worker holds ``task_id`` as an ETA task and answers broadcasts.

    A revoke broadcast before the worker's control consumer subscribed is
    lost (a loaded machine takes a while after the worker is ready), so a
    test that revokes a held message first sees the worker report it.
    """

    def holds() -> bool:
        # A connection of its own, closed after: a pooled one would keep the
        # reply consumer's pending BRPOP, which a later fork (kombu closes
        # inherited pools after fork) waits on forever.
        with app.connection_for_write() as connection:
            replies = app.control.inspect(timeout=1, connection=connection).scheduled() or {}
        return any(
            entry.get("request", {}).get("id") == task_id
            for entries in replies.values()
            for entry in entries
        )

    wait_until(holds, timeout=20)


def wait_until(predicate: Callable[[], Any], timeout: float = 10, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@pytest.fixture
def runs(redis_server: RedisServer) -> redis.Redis:
    """The Redis database the bodies count their runs in (flushed with the app's)."""
    return redis.Redis.from_url(redis_server.url(4))


@pytest.fixture(params=["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_conf(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The store keeping locks, slots and runs: the Redis result backend, or PostgreSQL."""
    if request.param == "redis":
        return {}
    return {"dedup_store": request.getfixturevalue("store_postgres").url}
