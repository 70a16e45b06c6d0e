"""Native deduplication on SQS FIFO queues, against a real moto server and kombu's SQS transport.

moto only drops a duplicate while the first message is still in the queue
(AWS remembers the id for 5 minutes even after deletion), so these tests
publish duplicates while the first message is queued or in flight.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.signals import before_task_publish

from celery_dedup import DeduplicationUnavailable, DedupTask, dedup_key_for, inspect_lock
from celery_dedup.identity import deterministic_task_id
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.memory import MemoryStore
from tests.fixtures._servers import free_port
from tests.fixtures.logs import DedupLog
from tests.fixtures.redis import RedisServer
from tests.fixtures.sqs import SQSServer

FLOW_DB, RETRY_DB = 20, 21


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _digest(key: str) -> str:
    return key.rsplit(":", 1)[-1]


def _wait(predicate: Callable[[], Any], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def make_app(sqs_server: SQSServer) -> Iterator[Callable[..., Celery]]:
    """Build Celery apps on the moto SQS broker; each is closed at the end of the test."""
    apps: list[Celery] = []

    def make(**conf: Any) -> Celery:
        app = Celery(_name("native"), set_as_current=False)
        app.conf.update(
            broker_url=sqs_server.broker_url,
            broker_transport_options={**sqs_server.transport_options, "wait_time_seconds": 1},
            broker_connection_retry_on_startup=False,
            worker_hijack_root_logger=False,
            **conf,
        )
        apps.append(app)
        return app

    yield make
    for app in apps:
        runtime_for(app).metrics.take()
        app.close()


@pytest.fixture
def memory_store() -> Iterator[tuple[str, MemoryStore]]:
    """A fresh, named ``memory://`` store URL and its table."""
    url = f"memory://{_name('native-test')}"
    store = MemoryStore.from_url(url)
    store.clear()
    yield url, store
    store.clear()


@pytest.fixture
def published() -> Iterator[list[tuple[Any, Any]]]:
    """``(task id, MessageDeduplicationId property)`` of every task message published."""
    seen: list[tuple[Any, Any]] = []

    def receiver(headers: Any = None, properties: Any = None, **_: Any) -> None:
        seen.append(((headers or {}).get("id"), (properties or {}).get("MessageDeduplicationId")))

    before_task_publish.connect(receiver, weak=False)
    yield seen
    before_task_publish.disconnect(receiver)


def sync_task(app: Celery, **attrs: Any) -> Any:
    """The task most tests send: 5-minute throttle, exactly what SQS FIFO honours."""

    @app.task(base=DedupTask, shared=False, unique_for=300, unique_until="expiry", **attrs)
    def sync(user_id: int) -> int:
        return user_id

    return sync


@contextmanager
def solo_worker(app: Celery, queues: list[str]) -> Iterator[None]:
    """A solo-pool worker consuming ``queues`` for the duration of the block."""
    with start_worker(
        app,
        pool="solo",
        queues=queues,
        perform_ping_check=False,
        shutdown_timeout=30,
        loglevel="WARNING",
    ):
        yield


@contextmanager
def flushed_db(redis_server: RedisServer, db: int) -> Iterator[Any]:
    """A client on Redis database ``db``, emptied before and after the block."""
    client = redis_server.client(db)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def routed_twice(
    make_app: Callable[..., Celery], url: str, default: str, routed: str, value: int
) -> tuple[Any, Any, Any]:
    """``sync`` sent by ``task_routes`` to ``routed`` (default queue ``default``), called twice."""
    app = make_app(
        dedup_store=url,
        task_default_queue=default,
        task_routes={f"{__name__}.sync": {"queue": routed}},
    )
    sync = sync_task(app)
    return sync, sync.delay(value), sync.delay(value)


def test_identical_calls_publish_one_message_with_the_key_digest(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """Two identical calls to a FIFO queue leave one message, share a derived id, touch no store."""
    url, store = memory_store
    queue = _name("orders") + ".fifo"
    app = make_app(dedup_store=url, task_default_queue=queue)

    sync = sync_task(app)

    first = sync.delay(7)
    second = sync.delay(7)

    assert first.deduplicated is None and second.deduplicated is None
    assert first.deduplication_key == second.deduplication_key
    key = first.deduplication_key
    assert key is not None and key.startswith(f"celery-dedup:{sync.name}:")
    assert first.id == second.id == deterministic_task_id(key)
    assert sqs_server.queue_length(queue) == 1
    (message,) = sqs_server.peek(queue)
    assert message["MessageDeduplicationId"] == _digest(key)
    assert message["MessageGroupId"] == "default"
    assert inspect_lock(key, app=app) is None
    assert list(store.scan("")) == []


def test_native_calls_never_contact_the_store(
    make_app: Callable[..., Celery], sqs_server: SQSServer
) -> None:
    """With an unreachable Redis store and ``dedup_fallback='closed'``, FIFO calls still publish."""
    dead_store = f"redis://127.0.0.1:{free_port()}/0"
    fifo, plain = _name("closed") + ".fifo", _name("closed-plain")
    app = make_app(dedup_store=dead_store, dedup_fallback="closed", task_default_queue=fifo)

    sync = sync_task(app)

    first = sync.delay(1)
    second = sync.delay(1)

    assert first.id == second.id and first.deduplicated is None
    assert sqs_server.queue_length(fifo) == 1
    # The same app on a standard queue does need the store, and refuses.
    with pytest.raises(DeduplicationUnavailable):
        sync.apply_async((1,), queue=plain)
    assert sqs_server.queue_length(plain) == 0


def test_different_arguments_publish_two_messages(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """Calls with different arguments get different ids and different deduplication ids."""
    url, store = memory_store
    queue = _name("args") + ".fifo"
    app = make_app(dedup_store=url, task_default_queue=queue)

    sync = sync_task(app)

    a = sync.delay(1)
    b = sync.delay(2)

    assert a.id != b.id
    assert a.deduplication_key != b.deduplication_key
    assert sqs_server.queue_length(queue) == 2
    ids = {m["MessageDeduplicationId"] for m in sqs_server.peek(queue)}
    assert ids == {_digest(a.deduplication_key), _digest(b.deduplication_key)}
    assert list(store.scan("")) == []


def test_task_queue_attribute_selects_native(
    make_app: Callable[..., Celery], sqs_server: SQSServer, memory_store: tuple[str, MemoryStore]
) -> None:
    """A task whose own FIFO ``queue`` is deduplicated natively though the default queue is not."""
    url, store = memory_store
    fifo, default = _name("own") + ".fifo", _name("default")
    app = make_app(dedup_store=url, task_default_queue=default)

    sync = sync_task(app, queue=fifo)

    first = sync.delay(3)
    second = sync.delay(3)

    assert first.deduplicated is None and first.id == second.id
    assert sqs_server.queue_length(fifo) == 1
    assert sqs_server.queue_length(default) == 0
    assert list(store.scan("")) == []


def test_standard_queue_on_the_same_broker_uses_the_store(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """A call routed to a non-FIFO queue takes a store lock; its duplicate publishes nothing."""
    url, store = memory_store
    fifo, plain = _name("mixed") + ".fifo", _name("mixed-plain")
    app = make_app(dedup_store=url, task_default_queue=fifo)

    sync = sync_task(app)

    first = sync.apply_async((5,), queue=plain)
    second = sync.apply_async((5,), queue=plain)

    assert first.deduplicated is False
    assert second.deduplicated is True and second.id == first.id
    assert sqs_server.queue_length(plain) == 1
    assert sqs_server.queue_length(fifo) == 0
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.task_id == first.id
    assert [held.task_id for held in store.scan("")] == [first.id]


def test_native_never_uses_the_store_on_fifo(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """With ``dedup_native='never'`` a FIFO call takes a store lock and gets no key-derived id."""
    url, _ = memory_store
    queue = _name("never") + ".fifo"
    app = make_app(dedup_store=url, task_default_queue=queue, dedup_native="never")

    sync = sync_task(app)

    first = sync.delay(9)
    second = sync.delay(9)

    assert first.deduplicated is False
    assert second.deduplicated is True and second.id == first.id
    assert first.id != deterministic_task_id(first.deduplication_key)
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.task_id == first.id
    assert sqs_server.queue_length(queue) == 1
    (message,) = sqs_server.peek(queue)
    assert message["MessageDeduplicationId"] != _digest(first.deduplication_key)


def test_unhonoured_window_warns_once_per_task_and_queue(
    make_app: Callable[..., Celery],
    memory_store: tuple[str, MemoryStore],
    dedup_log: DedupLog,
) -> None:
    """``unique_for=600`` on a FIFO queue logs one WARNING; the exact 5-minute window logs none."""
    url, _ = memory_store
    queue = _name("warn") + ".fifo"
    app = make_app(dedup_store=url, task_default_queue=queue)

    @app.task(base=DedupTask, shared=False, unique_for=600, unique_until="expiry")
    def long_window(user_id: int) -> int:
        return user_id

    @app.task(base=DedupTask, shared=False, unique_for=300, unique_until="expiry")
    def exact_window(user_id: int) -> int:
        return user_id

    long_window.delay(1)
    long_window.delay(1)
    long_window.delay(2)
    exact_window.delay(1)
    exact_window.delay(2)

    messages = dedup_log.warnings()
    assert len(messages) == 1, messages
    assert long_window.name in messages[0] and queue in messages[0]
    assert "unique_for=600" in messages[0]
    assert not any(exact_window.name in m for m in messages)


def test_worker_runs_each_distinct_call_once(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    redis_server: RedisServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """A real worker on the FIFO queue runs A once and B once after publishes A, A, B."""
    url, store = memory_store
    queue = _name("flow") + ".fifo"
    with flushed_db(redis_server, FLOW_DB):
        app = make_app(
            dedup_store=url, task_default_queue=queue, result_backend=redis_server.url(FLOW_DB)
        )
        runs: list[str] = []

        @app.task(base=DedupTask, shared=False, unique_for=300, unique_until="expiry")
        def sync(name: str) -> str:
            runs.append(name)
            return name.upper()

        a1, a2, b = sync.delay("a"), sync.delay("a"), sync.delay("b")
        assert a1.id == a2.id != b.id
        assert sqs_server.queue_length(queue) == 2
        with solo_worker(app, [queue]):
            assert a1.get(timeout=30) == "A"
            assert b.get(timeout=30) == "B"
            _wait(lambda: sqs_server.queue_length(queue) == 0)
        assert sorted(runs) == ["a", "b"]
        assert list(store.scan("")) == []


def test_retry_on_fifo_is_not_dropped_as_a_duplicate(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    redis_server: RedisServer,
    memory_store: tuple[str, MemoryStore],
    published: list[tuple[Any, Any]],
) -> None:
    """A ``self.retry()`` republished while the first message is in flight still runs."""
    url, _ = memory_store
    queue = _name("retry") + ".fifo"
    with flushed_db(redis_server, RETRY_DB):
        app = make_app(
            dedup_store=url,
            task_default_queue=queue,
            result_backend=redis_server.url(RETRY_DB),
            result_extended=True,
        )
        attempts: list[int] = []

        # acks_late keeps the first message in the queue (in flight) while the retry
        # is published, so moto would drop a retry that reused its deduplication id.
        @app.task(
            base=DedupTask,
            shared=False,
            bind=True,
            acks_late=True,
            max_retries=3,
            unique_for=300,
            unique_until="expiry",
        )
        def flaky(self: DedupTask, name: str) -> str:
            attempts.append(self.request.retries)
            if self.request.retries == 0:
                raise self.retry(countdown=0.5)
            return name.upper()

        result = flaky.delay("x")
        assert result.deduplicated is None
        with solo_worker(app, [queue]):
            assert result.get(timeout=30) == "X"
            _wait(lambda: sqs_server.queue_length(queue) == 0)
        assert result.state == "SUCCESS"
        assert result.retries == 1
        assert attempts == [0, 1]
        ours = [dedup_id for task_id, dedup_id in published if task_id == result.id]
        assert len(ours) == 2
        assert ours[0] == _digest(result.deduplication_key)
        assert ours[1] != ours[0]


# -- routed queues (task_routes, routers): native mode decides per routed queue --

ROUTED_DB = 22


def test_call_routed_to_fifo_from_a_standard_default_is_native(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """``task_routes`` sends the task to a FIFO queue, the default queue is standard: native."""
    url, store = memory_store
    fifo, plain = _name("routed") + ".fifo", _name("routed-default")
    sync, first, second = routed_twice(make_app, url, plain, fifo, 7)

    key = first.deduplication_key
    assert key is not None and key == dedup_key_for(sync, (7,))
    assert key == dedup_key_for(sync, (7,), queue=fifo)
    assert first.deduplicated is None and second.deduplicated is None
    assert first.id == second.id == deterministic_task_id(key)
    assert sqs_server.queue_length(fifo) == 1
    assert sqs_server.queue_length(plain) == 0
    (message,) = sqs_server.peek(fifo)
    assert message["MessageDeduplicationId"] == _digest(key)
    assert list(store.scan("")) == []


def test_call_routed_to_standard_from_a_fifo_default_uses_the_store(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """The reverse: the default queue is FIFO, the route a standard queue: a store lock."""
    url, store = memory_store
    fifo, plain = _name("rev-default") + ".fifo", _name("rev-routed")
    sync, first, second = routed_twice(make_app, url, fifo, plain, 8)

    assert first.deduplicated is False
    assert second.deduplicated is True and second.id == first.id
    assert first.deduplication_key == dedup_key_for(sync, (8,), queue=plain)
    assert first.id != deterministic_task_id(first.deduplication_key)
    assert sqs_server.queue_length(plain) == 1
    assert sqs_server.queue_length(fifo) == 0
    assert [(held.key, held.task_id) for held in store.scan("")] == [
        (first.deduplication_key, first.id)
    ]


def test_router_by_argument_picks_native_per_call(
    make_app: Callable[..., Celery],
    sqs_server: SQSServer,
    redis_server: RedisServer,
    memory_store: tuple[str, MemoryStore],
) -> None:
    """A router sending even ids to a FIFO queue and odd ids to a standard one, with a worker:
    each distinct call runs once; only the standard-queue call holds a store lock."""
    url, store = memory_store
    fifo, plain = _name("parity") + ".fifo", _name("parity-plain")
    with flushed_db(redis_server, ROUTED_DB) as runs:

        def by_parity(name: str, args: Any, *_: Any, **__: Any) -> Any:
            if name != f"{__name__}.sync":
                return None
            return {"queue": fifo if args[0] % 2 == 0 else plain}

        app = make_app(
            dedup_store=url,
            task_default_queue=_name("parity-default"),
            task_routes=(by_parity,),
            result_backend=redis_server.url(ROUTED_DB),
        )

        @app.task(base=DedupTask, shared=False, unique_for=300, unique_until="expiry")
        def sync(user_id: int) -> int:
            runs.rpush("runs", user_id)
            return user_id

        even = [sync.delay(2), sync.delay(2)]
        odd = [sync.delay(3), sync.delay(3)]
        assert [r.deduplicated for r in even] == [None, None]
        assert [r.deduplicated for r in odd] == [False, True]
        assert sqs_server.queue_length(fifo) == 1 and sqs_server.queue_length(plain) == 1
        with solo_worker(app, [fifo, plain]):
            assert even[0].get(timeout=30) == 2
            assert odd[0].get(timeout=30) == 3
            _wait(lambda: sqs_server.queue_length(fifo) + sqs_server.queue_length(plain) == 0)
        assert sorted(int(v) for v in runs.lrange("runs", 0, -1)) == [2, 3]
        assert [held.task_id for held in store.scan("")] == [odd[0].id]
