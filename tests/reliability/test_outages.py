"""Outages: the broker or the lock store refuses, dies, pauses (SIGSTOP) or comes back empty.

A publish that fails rolls its lock back and re-raises; the next call
succeeds once the broker is back, without restarting anything. A store that
cannot be reached follows ``dedup_fallback``: ``open`` publishes without a
lock and warns once per cause, ``closed`` raises ``DeduplicationUnavailable``
and publishes nothing; producers and workers recover on their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from celery_dedup import DeduplicationUnavailable, dedup_key_for
from celery_dedup.stores.redis import RedisStore
from tests.fixtures.logs import DedupLog

from .apps import work_task
from .conftest import Backends
from .model import Kind
from .probe import Producer, Recorder, poll, scan_once
from .servers import FlakyRedis, flaky_redis
from .workers import WorkerPool

AppFactory = Callable[[dict[str, Any]], Celery]

#: Fail a publish within seconds: one-second socket timeouts, two quick retries.
FAST_BROKER = {
    "task_publish_retry_policy": {
        "max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2,
    },
    "broker_transport_options": {"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
    "broker_connection_timeout": 1.0,
}
#: Give up on a silent store within half a second.
FAST_STORE = {"dedup_store_options": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}}
QUEUE = "rel"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[FlakyRedis]:
    """A broker redis-server of the test's own, not started yet."""
    with flaky_redis(tmp_path / "broker", started=False) as server:
        yield server


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[FlakyRedis]:
    """A lock-store redis-server of the test's own, started."""
    with flaky_redis(tmp_path / "store") as server:
        yield server


def queue_length(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return int(client.llen(QUEUE))


def lock_at(url: str, key: str | None) -> Any:
    assert key is not None
    store = RedisStore(redis.Redis.from_url(url))
    try:
        return store.get(key)
    finally:
        store.close()


def wait_released(url: str, key: str | None) -> None:
    def released() -> bool:
        return lock_at(url, key) is None

    poll(released, 10, what="lock released")


def on_flaky_broker(
    broker: FlakyRedis, backends: Backends, recorder: Recorder, producer_app: AppFactory
) -> tuple[dict[str, Any], Any, Producer]:
    """The app settings on ``broker`` (failing fast), the suite's task there, and a producer."""
    conf = backends.conf(broker_url=broker.url(), **FAST_BROKER)
    return conf, work_task(producer_app(conf)), Producer(recorder)


# -- the broker -------------------------------------------------------------


@pytest.mark.redis
def test_broker_on_a_closed_port_rolls_back_then_recovers(
    broker: FlakyRedis, backends: Backends, recorder: Recorder, producer_app: AppFactory
) -> None:
    _, task, producer = on_flaky_broker(broker, backends, recorder, producer_app)
    key = dedup_key_for(task, (1, {}))
    assert key is not None
    with pytest.raises(OperationalError):
        producer.call(task, (1, {}))
    assert lock_at(backends.store, key) is None
    broker.start()
    result = producer.call(task, (1, {}))
    assert result.deduplicated is False
    assert queue_length(broker.url()) == 1
    assert producer.last is not None
    assert lock_at(backends.store, key).owner == producer.last.token


@pytest.mark.redis
def test_broker_killed_after_use_rolls_back_then_recovers(
    broker: FlakyRedis, backends: Backends, recorder: Recorder, producer_app: AppFactory
) -> None:
    _, task, producer = on_flaky_broker(broker, backends, recorder, producer_app)
    broker.start()
    assert producer.call(task, (1, {})).deduplicated is False
    broker.kill()
    key = dedup_key_for(task, (2, {}))
    with pytest.raises(OperationalError):
        producer.call(task, (2, {}))
    assert lock_at(backends.store, key) is None
    broker.start()
    assert producer.call(task, (2, {})).deduplicated is False
    # The restarted broker is empty: only the call made after it came back is queued.
    assert queue_length(broker.url()) == 1


@pytest.mark.slow
@pytest.mark.redis
def test_broker_paused_during_a_publish(
    broker: FlakyRedis,
    backends: Backends,
    recorder: Recorder,
    producer_app: AppFactory,
    workers: WorkerPool,
) -> None:
    """The publish times out: lock rolled back, error raised; the next call holds the key.

    The paused broker may still enqueue the timed-out publish (and its
    retries) once it resumes: those copies carry the rolled-back owner token,
    so their start claim finds the next call's lock and skips them.
    """
    conf, task, producer = on_flaky_broker(broker, backends, recorder, producer_app)
    broker.start()
    assert producer.call(task, (1, {})).deduplicated is False
    broker.pause()
    key = dedup_key_for(task, (2, {}))
    started = time.monotonic()
    with pytest.raises(OperationalError):
        producer.call(task, (2, {}))
    assert time.monotonic() - started < 15
    assert lock_at(backends.store, key) is None
    broker.resume()
    after = producer.call(task, (2, {}))
    assert after.deduplicated is False
    workers.start(conf, concurrency=2)
    assert after.get(timeout=30) == 2
    findings = recorder.findings()
    assert not findings, findings
    runs = [e for e in recorder.events("end") if e.outcome == "success"]
    assert sorted(e.task_id for e in runs) == sorted({e.task_id for e in runs})


@pytest.mark.slow
@pytest.mark.redis
def test_a_publish_that_timed_out_runs_at_most_once(
    broker: FlakyRedis,
    backends: Backends,
    recorder: Recorder,
    producer_app: AppFactory,
    workers: WorkerPool,
) -> None:
    """The timed-out publish may still be enqueued: it runs at most once.

    A paused broker reads what was sent before it stopped once it resumes,
    so the message of a call whose caller saw an error can still arrive
    (its lock was rolled back: its start claim finds the key free and runs
    it). Celery's publish retries could send copies sharing one owner token;
    however many arrive, the body must not run more than once.
    """
    conf, task, producer = on_flaky_broker(broker, backends, recorder, producer_app)
    broker.start()
    assert producer.call(task, (1, {})).deduplicated is False
    broker.pause()
    with pytest.raises(OperationalError):
        producer.call(task, (2, {}))
    assert producer.last is not None
    token = producer.last.token
    broker.resume()
    # The first call's message is still queued (no worker yet), then the late copies.
    copies = poll(lambda: queue_length(broker.url()) - 1, 10, what="late copies arrived")
    workers.start(conf, concurrency=2)
    poll(lambda: queue_length(broker.url()) == 0, 30, what="queue drained")
    time.sleep(1.0)
    runs = recorder.events("start", token=token)
    findings = recorder.findings()
    assert len(runs) <= 1, f"{copies} copies queued, body ran {len(runs)} times: {findings}"
    assert not findings, findings


# -- the lock store -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("mode", ["open", "closed"])
def test_store_paused_killed_and_restarted_empty(
    mode: str,
    store_server: FlakyRedis,
    backends: Backends,
    recorder: Recorder,
    producer_app: AppFactory,
    workers: WorkerPool,
    dedup_log: DedupLog,
) -> None:
    """Fallback per mode during each outage, one warning per cause, recovery without restart."""
    conf = backends.conf(dedup_store=store_server.url(), dedup_fallback=mode, **FAST_STORE)
    task = work_task(producer_app(conf))
    producer = Producer(recorder)
    (worker,) = workers.start(conf, concurrency=2)
    first = producer.call(task, (1, {"sleep": 0.1}))
    assert first.get(timeout=30) == 1
    throttle: dict[str, Any] = {"unique_until": "expiry", "unique_for": 300}
    throttled = producer.call(task, (999, {}), **throttle)
    assert throttled.deduplicated is False and throttled.get(timeout=30) == 999
    outages = {
        "paused": (store_server.pause, store_server.resume),
        "killed": (store_server.kill, store_server.start),
    }
    for round_, (down, up) in enumerate(outages.values()):
        n = 100 * (round_ + 1)
        # Locked while the store is up, started by the worker while it is down.
        delayed = producer.call(task, (n + 90, {}), countdown=1.5)
        assert delayed.deduplicated is False
        down()
        published = {}
        for offset in range(3):
            if mode == "open":
                result = producer.call(task, (n + offset, {}))
                assert result.deduplicated is False
                published[n + offset] = result
            else:
                with pytest.raises(DeduplicationUnavailable):
                    producer.call(task, (n + offset, {}))
        # Messages published without a lock run, unchecked, on the worker.
        for value, result in published.items():
            assert result.get(timeout=30) == value
        if mode == "open":
            # The worker cannot check the lock: the message exists, so it runs unchecked.
            assert delayed.get(timeout=30) == n + 90
            up()
        else:
            # Closed: the worker defers the message while the store is down (never
            # fails it), and runs it once the store is back.
            line = f"[{delayed.id}] deferred"
            poll(lambda line=line: line in worker.tail(200_000), 30, what="deferred")
            assert delayed.state == "PENDING"
            up()
            assert delayed.get(timeout=30) == n + 90
        # Producers and workers recover without a restart.
        again = producer.call(task, (n + 50, {"sleep": 0.5}))
        assert again.deduplicated is False
        assert producer.call(task, (n + 50, {})).deduplicated is True
        assert again.get(timeout=30) == n + 50
        wait_released(store_server.url(), again.deduplication_key)
    # The store came back empty: the throttle's lock is forgotten, the same call
    # is accepted again (what a store without persistence loses).
    assert producer.call(task, (999, {}), **throttle).deduplicated is False
    warnings = [w for w in dedup_log.warnings() if "lock store unavailable" in w]
    if mode == "open":
        # One per cause: a timeout (paused), then a refused connection (killed).
        assert len(warnings) == 2, warnings
        assert "Timeout" in warnings[0] and "Connection" in warnings[1]
    else:
        assert warnings == []
    # Open: the delayed message of each round and the three messages published
    # during each outage (they carry their owner token: a timed-out acquire may
    # land later, so the worker tries their claim too). Closed: none.
    unchecked = 2 + 2 * 3 if mode == "open" else 0
    assert worker.tail(200_000).count("runs unchecked") == unchecked


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("mode", ["open", "closed"])
def test_a_call_that_timed_out_on_a_paused_store_leaves_no_lock(
    mode: str,
    store_server: FlakyRedis,
    backends: Backends,
    recorder: Recorder,
    producer_app: AppFactory,
    workers: WorkerPool,
) -> None:
    """A store that answers late must not apply a lock nobody owns.

    The acquire was sent before the store paused; on SIGCONT the store runs
    it. The producer had given up (``StoreUnavailable``) and fell back, so
    the lock belongs to no message: in ``closed`` mode nothing was
    published, in ``open`` mode the message carries no owner token. Either
    way the key must not stay locked until the TTL.
    """
    conf = backends.conf(dedup_store=store_server.url(), dedup_fallback=mode, **FAST_STORE)
    task = work_task(producer_app(conf))
    producer = Producer(recorder)
    workers.start(conf, concurrency=2)
    store = RedisStore(redis.Redis.from_url(store_server.url()))
    # A warm connection, as any producer has: the paused server still reads it on SIGCONT.
    assert producer.call(task, (4, {})).deduplicated is False
    store_server.pause()
    try:
        producer.call(task, (5, {}))
    except DeduplicationUnavailable:
        assert mode == "closed"
    store_server.resume()
    time.sleep(0.5)
    scan_once(store, "celery-dedup:", recorder)
    retry = producer.call(task, (5, {}))
    scan_once(store, "celery-dedup:", recorder)
    store.close()
    findings = [f for f in recorder.findings() if f.kind in (Kind.LEAK, Kind.STALE)]
    assert retry.deduplicated is False, f"suppressed by a lock of nothing: {findings}"
    assert not findings, findings


@pytest.mark.redis
def test_default_store_is_the_result_backend_and_falls_back_open(
    tmp_path: Path, recorder: Recorder, producer_app: AppFactory, dedup_log: DedupLog,
    backends: Backends,
) -> None:
    """No ``dedup_store``: locks live in the result backend; its outage publishes and warns.

    Only calls whose result is ignored get that far: with a Redis result
    backend Celery's own ``apply_async`` subscribes to the result channel
    first and fails while the backend is down, with or without celery-dedup.
    """
    with flaky_redis(tmp_path / "backend") as backend:
        conf = {"broker_url": backends.broker, "result_backend": backend.url(), **FAST_STORE}
        task = work_task(producer_app(conf))
        producer = Producer(recorder)
        first = producer.call(task, (1, {}), ignore_result=True)
        assert lock_at(backend.url(), str(first.deduplication_key)) is not None
        backend.kill()
        down = [producer.call(task, (2, {}), ignore_result=True) for _ in range(2)]
        assert [r.deduplicated for r in down] == [False, False]
        assert len([w for w in dedup_log.warnings() if "unavailable" in w]) == 1
        backend.start()
        assert producer.call(task, (3, {}), ignore_result=True).deduplicated is False
        assert producer.call(task, (3, {}), ignore_result=True).deduplicated is True
        assert queue_length(backends.broker) == 4
