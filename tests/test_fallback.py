"""dedup_fallback with real servers: no usable store, a store that dies, a worker-side outage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Connection, Queue

from celery_dedup import DeduplicationUnavailable, DedupTask, inspect_lock
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import dedup_fallback
from tests.fixtures._servers import running
from tests.fixtures.logs import DedupLog
from tests.fixtures.rabbitmq import RabbitMQServer
from tests.fixtures.redis import RedisServer, start_redis

BROKER_DB, BACKEND_DB = 12, 13


@pytest.fixture
def fallbacks() -> Iterator[list[dict[str, Any]]]:
    """The ``dedup_fallback`` signals sent during the test."""
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    dedup_fallback.connect(receiver, weak=False)
    yield seen
    dedup_fallback.disconnect(receiver)


@pytest.fixture
def apps() -> Iterator[Callable[..., Celery]]:
    """Build apps with a fresh queue name; close them at teardown."""
    made: list[Celery] = []

    def make(**conf: Any) -> Celery:
        app = Celery(f"fallback-{uuid.uuid4().hex[:8]}", set_as_current=False)
        app.conf.update(
            task_default_queue=f"q-{app.main}",
            broker_connection_retry_on_startup=False,
            worker_hijack_root_logger=False,
            **conf,
        )
        made.append(app)
        return app

    yield make
    for app in made:
        # Drop this app's pending counters: its store may be gone by exit time.
        runtime_for(app).metrics.take()
        app.close()


@pytest.fixture
def redis_dbs(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The session Redis with the broker and backend databases of this module flushed."""
    redis_server.flush(BROKER_DB, BACKEND_DB)
    yield redis_server
    redis_server.flush(BROKER_DB, BACKEND_DB)


@contextmanager
def declared(rabbitmq: RabbitMQServer, queue: str) -> Iterator[str]:
    """Declare ``queue`` on the test RabbitMQ for the block, then delete it."""
    with Connection(rabbitmq.url) as conn:
        Queue(queue).bind(conn.default_channel).declare()
    try:
        yield queue
    finally:
        with Connection(rabbitmq.url) as conn:
            conn.default_channel.queue_delete(queue)


def identity_job(app: Celery) -> Any:
    """``job(x)``, held 60 s, returning ``x``."""

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def job(x: int) -> int:
        return x

    return job


def test_no_store_open_publishes_every_call_and_warns_once(
    rabbitmq_server: RabbitMQServer,
    apps: Callable[..., Celery],
    dedup_log: DedupLog,
    fallbacks: list[dict[str, Any]],
) -> None:
    """rpc:// results on AMQP give no store: open mode publishes all calls, one warning total."""
    app = apps(broker_url=rabbitmq_server.url, result_backend="rpc://", dedup_fallback="open")
    job = identity_job(app)

    with declared(rabbitmq_server, app.conf.task_default_queue) as queue:
        results = [job.delay(1) for _ in range(3)]
        assert len({r.id for r in results}) == 3
        assert not any(r.deduplicated for r in results)
        assert rabbitmq_server.queue_length(queue) == 3
        assert len(dedup_log.warnings()) == 1
        assert "no lock store can be derived" in dedup_log.warnings()[0]
        assert [(f["reason"], f["action"]) for f in fallbacks] == [("no_store", "open")] * 3


def test_no_store_closed_raises_and_publishes_nothing(
    rabbitmq_server: RabbitMQServer,
    apps: Callable[..., Celery],
    fallbacks: list[dict[str, Any]],
) -> None:
    """Closed mode raises DeduplicationUnavailable (a RuntimeError); the queue stays empty."""
    app = apps(broker_url=rabbitmq_server.url, result_backend="rpc://", dedup_fallback="closed")
    job = identity_job(app)

    with declared(rabbitmq_server, app.conf.task_default_queue) as queue:
        with pytest.raises(DeduplicationUnavailable) as info:
            job.delay(1)
        assert isinstance(info.value, RuntimeError)
        assert info.value.reason == "no_store" and info.value.task_name == job.name
        assert rabbitmq_server.queue_length(queue) == 0
        # A call that takes no lock is not affected by the fallback.
        job.apply_async((1,), unique_for=None)
        assert rabbitmq_server.queue_length(queue) == 1
        assert [(f["reason"], f["action"]) for f in fallbacks] == [("no_store", "closed")]


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_store_stopped_mid_test(
    mode: str,
    redis_dbs: RedisServer,
    apps: Callable[..., Celery],
    dedup_log: DedupLog,
    fallbacks: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    """A lock store that goes away: open publishes and warns, closed raises; a restart heals."""
    argv, port = start_redis(tmp_path)
    app = apps(
        broker_url=redis_dbs.url(BROKER_DB),
        result_backend=redis_dbs.url(BACKEND_DB),
        dedup_store=f"redis://127.0.0.1:{port}/0",
        dedup_fallback=mode,
    )
    job = identity_job(app)

    queue = app.conf.task_default_queue
    broker = redis_dbs.client(BROKER_DB)
    try:
        with running(argv, port, log=tmp_path / "store-1.log"):
            first = job.delay(1)
            assert job.delay(1).deduplicated is True
        assert broker.llen(queue) == 1
        assert not dedup_log.warnings()

        if mode == "open":
            down = [job.delay(1), job.delay(1)]
            assert not any(r.deduplicated for r in down)
            assert broker.llen(queue) == 3
            assert len(dedup_log.warnings()) == 1
            assert "lock store unavailable" in dedup_log.warnings()[0]
        else:
            with pytest.raises(DeduplicationUnavailable) as info:
                job.delay(1)
            assert info.value.reason == "unavailable"
            assert broker.llen(queue) == 1
        assert {(f["reason"], f["action"]) for f in fallbacks} == {("unavailable", mode)}

        with running(argv, port, log=tmp_path / "store-2.log"):
            again = job.delay(1)
            assert again.deduplicated is False and again.id != first.id
            duplicate = job.delay(1)
            assert duplicate.deduplicated is True and duplicate.id == again.id
    finally:
        broker.close()


def test_release_outage_on_the_worker_is_logged_and_task_succeeds(
    redis_dbs: RedisServer,
    apps: Callable[..., Celery],
    dedup_log: DedupLog,
    tmp_path: Path,
) -> None:
    """If the store dies while the task runs, the failed release is logged; the task succeeds."""
    argv, port = start_redis(tmp_path)
    app = apps(
        broker_url=redis_dbs.url(BROKER_DB),
        result_backend=redis_dbs.url(BACKEND_DB),
        dedup_store=f"redis://127.0.0.1:{port}/0",
    )
    with running(argv, port, log=tmp_path / "store.log") as store_proc:

        @app.task(base=DedupTask, shared=False, unique_for=60)
        def job(x: int) -> int:
            store_proc.terminate()  # the store dies while the holder runs
            store_proc.wait(10)
            return x * 2

        result = job.delay(21)
        assert inspect_lock(result.deduplication_key, app=app) is not None
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                          shutdown_timeout=30, loglevel="WARNING"):
            assert result.get(timeout=20) == 42
            assert result.state == "SUCCESS"
            deadline = time.monotonic() + 10
            # The done marker and the release are one store call (run records).
            while not any("could not record the end of" in m for m in dedup_log.warnings()):
                assert time.monotonic() < deadline, dedup_log.warnings()
                time.sleep(0.05)
    released = [m for m in dedup_log.warnings() if "could not record the end of" in m]
    assert len(released) == 1 and result.id in released[0]
