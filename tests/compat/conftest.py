"""Apps and workers for the shim tests: real Redis, a real in-thread worker.

Redis databases: broker 24, results 25, the libraries' lock URL 26, an
explicit ``dedup_store`` 27.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_dedup import inspect_lock
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import Lock
from tests.fixtures.redis import RedisServer

BROKER_DB, BACKEND_DB, LIB_DB, STORE_DB = 24, 25, 26, 27
AppFactory = Callable[..., Celery]


def wait_for(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll ``check`` until it returns something truthy, or fail."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.05)
    return value


def lock_of(app: Celery, result: Any) -> Lock | None:
    """The live lock a published call's result holds, or ``None``."""
    return inspect_lock(result.deduplication_key, app=app)


def lifetime(lock: Lock | None) -> float:
    """The TTL a lock was taken with."""
    assert lock is not None
    return lock.expires_at - lock.acquired_at


def worker(app: Celery, concurrency: int = 2) -> AbstractContextManager[Any]:
    """A real worker for ``app`` in this process (threads pool)."""
    return start_worker(
        app,
        pool="threads",
        concurrency=concurrency,
        perform_ping_check=False,
        shutdown_timeout=30,
        loglevel="WARNING",
    )


@pytest.fixture
def make_app(redis_server: RedisServer) -> Iterator[AppFactory]:
    """Apps on flushed Redis dbs 24-27 with the given settings; closed afterwards."""
    dbs = (BROKER_DB, BACKEND_DB, LIB_DB, STORE_DB)
    redis_server.flush(*dbs)
    apps: list[Celery] = []

    def factory(**conf: Any) -> Celery:
        app = Celery("compat", set_as_current=False)
        app.conf.update(
            {
                "broker_url": redis_server.url(BROKER_DB),
                "result_backend": redis_server.url(BACKEND_DB),
                "task_default_queue": "q-compat",
                "broker_connection_retry_on_startup": False,
                "worker_hijack_root_logger": False,
                **conf,
            }
        )
        apps.append(app)
        return app

    yield factory
    for app in apps:
        runtime_for(app).metrics.flush()
        app.close()
    redis_server.flush(*dbs)


@pytest.fixture
def lib_url(redis_server: RedisServer) -> str:
    """The Redis URL the libraries' own settings point at (db 26)."""
    return redis_server.url(LIB_DB)
