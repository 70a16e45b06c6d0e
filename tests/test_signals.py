"""celery-dedup's signals, received by connected receivers, with their documented arguments."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.utils.dispatch import Signal

from celery_dedup import (
    DeduplicatedResult,
    DeduplicationUnavailable,
    StoreUnavailable,
    dedup_fallback,
    lock_acquired,
    lock_released,
    lock_replaced,
    task_deduplicated,
)
from celery_dedup.runtime import runtime_for
from tests.apps.cli_app import SYNC, make_app
from tests.fixtures._servers import free_port
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

BROKER_DB = 9


class Received(list[tuple[Any, dict[str, Any]]]):
    """The ``(sender, kwargs)`` of every send a receiver got."""


@pytest.fixture
def receive() -> Iterator[Any]:
    """Connect a recording receiver to a signal; disconnected at teardown."""
    connected: list[tuple[Signal, Any]] = []

    def connect(signal: Signal) -> Received:
        received = Received()

        def receiver(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
            received.append((sender, kwargs))

        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))
        return received

    yield connect
    for signal, receiver in connected:
        signal.disconnect(receiver)


@pytest.fixture
def app(redis_server: RedisServer, redis_url: str) -> Iterator[Celery]:
    """The demo app: Redis broker (flushed), results and locks in Redis."""
    redis_server.client(BROKER_DB).flushdb()
    app = make_app(redis_server.url(BROKER_DB), redis_url)
    yield app
    runtime_for(app).metrics.flush()
    app.close()


def test_lock_acquired_and_task_deduplicated(app: Celery, receive: Any) -> None:
    """A first call sends lock_acquired; a duplicate sends task_deduplicated with the holder."""
    acquired = receive(lock_acquired)
    deduplicated = receive(task_deduplicated)
    task = app.tasks[SYNC]
    holder = task.delay(5, address="x")
    duplicate = task.delay(5, address="x")
    assert isinstance(duplicate, DeduplicatedResult)

    assert len(acquired) == 1
    sender, kwargs = acquired[0]
    assert sender is task
    assert kwargs == {"key": holder.deduplication_key, "task_id": holder.id, "ttl": 600.0,
                      "policy": "success"}

    assert len(deduplicated) == 1
    sender, kwargs = deduplicated[0]
    assert sender is task
    assert kwargs["key"] == holder.deduplication_key
    assert kwargs["existing_task_id"] == holder.id
    assert kwargs["duplicate_id"] == duplicate.duplicate_id != holder.id
    assert kwargs["args"] == (5,) and kwargs["kwargs"] == {"address": "x"}
    assert 590 < kwargs["ttl"] <= 600


def test_lock_released_by_worker(app: Celery, receive: Any) -> None:
    """The worker's success hook sends lock_released with reason "success"."""
    released = receive(lock_released)
    task = app.tasks[SYNC]
    with start_worker(app, pool="threads", perform_ping_check=False, loglevel="WARNING",
                      shutdown_timeout=30):
        result = task.delay(11)
        assert result.get(timeout=20) == 11
    assert [(sender, kwargs) for sender, kwargs in released] == [
        (task, {"key": result.deduplication_key, "task_id": result.id, "reason": "success"})
    ]


def test_lock_replaced(app: Celery, receive: Any) -> None:
    """``on_duplicate="replace"`` sends lock_replaced naming the new and the previous holder."""
    replaced = receive(lock_replaced)
    acquired = receive(lock_acquired)
    task = app.tasks[SYNC]
    first = task.apply_async((8,), on_duplicate="replace")
    second = task.apply_async((8,), on_duplicate="replace")
    assert second.id != first.id
    assert replaced == [
        (task, {"key": first.deduplication_key, "task_id": second.id,
                "previous_task_id": first.id, "policy": "replace", "follow_up": False})
    ]
    assert [kwargs["task_id"] for _, kwargs in acquired] == [first.id, second.id]


def test_lock_replaced_names_keep_last(app: Celery, receive: Any) -> None:
    """``on_duplicate="keep_last"`` replacing a queued message says which policy acted."""
    replaced = receive(lock_replaced)
    task = app.tasks[SYNC]
    first = task.apply_async((9,), on_duplicate="keep_last")
    second = task.apply_async((9,), on_duplicate="keep_last")
    assert replaced == [
        (task, {"key": first.deduplication_key, "task_id": second.id,
                "previous_task_id": first.id, "policy": "keep_last", "follow_up": False})
    ]


def test_dedup_fallback_open_and_closed(redis_server: RedisServer, receive: Any) -> None:
    """An unreachable store sends dedup_fallback: open publishes, closed raises."""
    fallbacks = receive(dedup_fallback)
    redis_server.client(BROKER_DB).flushdb()
    dead_store = f"redis://127.0.0.1:{free_port()}/0"
    opened = make_app(redis_server.url(BROKER_DB), None, dead_store)
    closed = make_app(redis_server.url(BROKER_DB), None, dead_store, dedup_fallback="closed")
    try:
        published = opened.tasks[SYNC].delay(1)
        assert published.deduplicated is False
        with pytest.raises(DeduplicationUnavailable):
            closed.tasks[SYNC].delay(1)
    finally:
        opened.close()
        closed.close()
    assert [(sender, kw["reason"], kw["action"]) for sender, kw in fallbacks] == [
        (SYNC, "unavailable", "open"),
        (SYNC, "unavailable", "closed"),
    ]
    assert all(isinstance(kw["error"], StoreUnavailable) for _, kw in fallbacks)


def test_dedup_fallback_no_store(receive: Any) -> None:
    """An app with no derivable store that opted into "open" sends reason "no_store"."""
    fallbacks = receive(dedup_fallback)
    app = make_app("memory://", "rpc://", dedup_fallback="open")
    try:
        app.tasks[SYNC].delay(1)
    finally:
        app.close()
    assert fallbacks == [(SYNC, {"reason": "no_store", "action": "open", "error": None})]
