"""The broker matrix: the same dedup scenario on Redis, RabbitMQ and filesystem:// brokers.

The lock store is Redis in every case; nothing in the lock path depends on
the broker.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_dedup import DedupTask, inspect_lock
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import lock_released
from tests.fixtures.redis import RedisServer

BROKER_DB, STORE_DB = 14, 15

BrokerConf = Callable[[], dict[str, Any]]


@pytest.fixture
def store_db(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The session Redis with this module's databases flushed."""
    redis_server.flush(BROKER_DB, STORE_DB)
    yield redis_server
    redis_server.flush(BROKER_DB, STORE_DB)


@pytest.fixture(params=["redis", "rabbitmq", "filesystem"])
def broker_conf(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Broker settings for one broker of the matrix."""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return {"broker_url": server.url(BROKER_DB)}
    if request.param == "rabbitmq":
        rabbitmq = request.getfixturevalue("rabbitmq_server")
        return {"broker_url": rabbitmq.url}
    data, control = tmp_path / "broker", tmp_path / "control"
    data.mkdir()
    control.mkdir()
    return {
        "broker_url": "filesystem://",
        "broker_transport_options": {
            "data_folder_in": str(data),
            "data_folder_out": str(data),
            "control_folder": str(control),
            "polling_interval": 0.1,
        },
    }


def _wait(predicate: Callable[[], Any], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_duplicate_suppressed_holder_runs_once_lock_released(
    broker_conf: dict[str, Any], store_db: RedisServer
) -> None:
    """A duplicate publishes nothing, the holder runs once on a real worker, then unlocks."""
    app = Celery(f"brokers-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        result_backend=store_db.url(STORE_DB),
        dedup_store=store_db.url(STORE_DB),
        task_default_queue=f"q-{app.main}",
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        **broker_conf,
    )
    runs: list[int] = []
    released: list[str] = []

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until="success")
    def sync(user_id: int) -> int:
        runs.append(user_id)
        return user_id * 10

    def on_release(sender: Any = None, task_id: str = "", reason: str = "", **_: Any) -> None:
        if getattr(sender, "name", None) == sync.name:
            released.append(f"{task_id}:{reason}")

    lock_released.connect(on_release, weak=False)
    try:
        first = sync.delay(7)
        second = sync.delay(7)
        assert first.deduplicated is False
        assert second.deduplicated is True and second.id == first.id
        lock = inspect_lock(first.deduplication_key, app=app)
        assert lock is not None and lock.task_id == first.id and lock.policy == "success"
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                          shutdown_timeout=30, loglevel="WARNING"):
            assert first.get(timeout=20) == 70
            _wait(lambda: inspect_lock(first.deduplication_key, app=app) is None)
            _wait(lambda: released)  # the signal follows the store's delete
            assert released == [f"{first.id}:success"]
            third = sync.delay(7)
            assert third.deduplicated is False and third.id != first.id
            assert third.get(timeout=20) == 70
        assert runs == [7, 7]
    finally:
        lock_released.disconnect(on_release)
        runtime_for(app).metrics.take()
        app.close()
