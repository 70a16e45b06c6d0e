"""Fixtures of the reliability suite: a recorder Redis, Redis databases, worker subprocesses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dedup.runtime import runtime_for
from tests.fixtures._servers import running
from tests.fixtures.redis import RedisServer, start_redis

from .apps import make_app
from .probe import Recorder
from .workers import WorkerPool

#: Databases of the session redis-server this suite uses (other suites use lower ones).
BROKER_DB, BACKEND_DB, STORE_DB = 40, 41, 42


@pytest.fixture(scope="session")
def recorder_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of its own for the records, so outages never touch them."""
    directory = tmp_path_factory.mktemp("recorder")
    argv, port = start_redis(directory)
    with running(argv, port, log=directory / "redis.log"):
        yield RedisServer(port=port, dir=directory)


@pytest.fixture
def recorder(recorder_server: RedisServer) -> Iterator[Recorder]:
    """An empty recorder."""
    recorder = Recorder(recorder_server.url(0))
    recorder.clear()
    yield recorder
    recorder.close()


@dataclass
class Backends:
    """URLs of the broker, result backend and lock store of one test."""

    broker: str
    backend: str
    store: str

    def conf(self, **extra: Any) -> dict[str, Any]:
        """Celery settings on these URLs (the store given explicitly)."""
        return {
            "broker_url": self.broker,
            "result_backend": self.backend,
            "dedup_store": self.store,
            **extra,
        }


@pytest.fixture
def backends(redis_server: RedisServer) -> Iterator[Backends]:
    """Flushed broker, backend and store databases on the session Redis."""
    redis_server.flush(BROKER_DB, BACKEND_DB, STORE_DB)
    yield Backends(
        broker=redis_server.url(BROKER_DB),
        backend=redis_server.url(BACKEND_DB),
        store=redis_server.url(STORE_DB),
    )
    redis_server.flush(BROKER_DB, BACKEND_DB, STORE_DB)


@pytest.fixture
def workers(recorder: Recorder, tmp_path: Path) -> Iterator[WorkerPool]:
    """Start worker subprocesses; every one is stopped at teardown."""
    with WorkerPool(recorder, tmp_path).running() as pool:
        yield pool


@pytest.fixture
def producer_app(recorder: Recorder) -> Iterator[Callable[..., Celery]]:
    """Build the suite's app in the test process; closed at teardown."""
    apps: list[Celery] = []

    def build(conf: dict[str, Any]) -> Celery:
        app = make_app(conf, recorder.url)
        apps.append(app)
        return app

    yield build
    for app in apps:
        # Drop pending counters: a test may have left its store down.
        runtime_for(app).metrics.take()
        app.close()
