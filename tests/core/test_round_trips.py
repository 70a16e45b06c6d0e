"""One store round trip per acquire, per duplicate and per release (Redis; PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import LockStore
from celery_dedup.stores.redis import RedisStore
from celery_dedup.stores.sql import SQLStore
from tests.fixtures._statements import Statements
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer


class CountingConnection(redis.Connection):
    """A connection that counts what it sends: one send is one round trip."""

    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sent += 1
        super().send_packed_command(command, check_health)


def counting_client(server: RedisServer, db: int) -> redis.Redis:
    pool = redis.ConnectionPool(
        connection_class=CountingConnection, host="127.0.0.1", port=server.port, db=db
    )
    return redis.Redis(connection_pool=pool)


def app_on_store(name: str, store: LockStore) -> Celery:
    """An app on an in-memory broker whose lock store is ``store`` (metrics flushed by hand)."""
    app = Celery(name, broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(dedup_metrics_flush_interval=3600)
    runtime_for(app).use_store(store)
    return app


def measure(client: redis.Redis, action: Callable[[], Any]) -> int:
    """Round trips ``action`` makes, cross-checked against the server's EVALSHA count."""
    before_sent = CountingConnection.sent
    before_evalsha = evalsha_calls(client)
    action()
    sent = CountingConnection.sent - before_sent - 1  # minus the INFO of evalsha_calls
    assert evalsha_calls(client) - before_evalsha == sent
    return sent


def evalsha_calls(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_store_operations_are_single_round_trips(redis_server: RedisServer) -> None:
    """acquire, conflict, extend, release and get each send exactly one command."""
    client = counting_client(redis_server, 5)
    client.flushdb()
    store = RedisStore(client)
    meta = {"task_name": "t", "policy": "success"}
    store.acquire("warm", "o", 5, meta)
    store.release("warm", "o")
    store.extend("warm", "o", 5)
    store.get("warm")
    store.take_over("warm", "o", 5, meta)
    store.take_over_revoking("warm", "o", 5, meta, 5)
    store.take_over_revoking("warm", "o", 5, meta, 5, queued_only=True)
    assert measure(client, lambda: store.acquire("k", "a", 5, meta)) == 1
    assert measure(client, lambda: store.acquire("k", "b", 5, meta)) == 1
    assert measure(client, lambda: store.extend("k", "a", 9)) == 1
    assert measure(client, lambda: store.get("k")) == 1
    assert measure(client, lambda: store.take_over("k", "c", 5, meta)) == 1
    assert measure(client, lambda: store.take_over_revoking("k", "d", 5, meta, 60)) == 1
    queued = {"queued_only": True}
    assert measure(client, lambda: store.take_over_revoking("k", "e", 5, meta, 60, **queued)) == 1
    assert measure(client, lambda: store.release("k", "e")) == 1
    client.close()


def test_apply_async_costs_one_round_trip(redis_server: RedisServer) -> None:
    """Through DedupTask: a publish costs 1 round trip, a duplicate 1, an eager run + release 2."""
    client = counting_client(redis_server, 6)
    client.flushdb()
    app = app_on_store("rt", RedisStore(client))

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def job(x: int) -> int:
        return x

    job.delay(0)  # loads the scripts
    job.delay(0)
    assert measure(client, lambda: job.delay(1)) == 1
    assert measure(client, lambda: job.delay(1)) == 1
    app.conf.task_always_eager = True
    job.delay(2)
    assert measure(client, lambda: job.delay(3)) == 2
    client.close()
    app.close()


def test_replace_cancel_running_and_capped_debounce_round_trips(
    redis_server: RedisServer,
) -> None:
    """replace: 1 round trip on a free key, 1 on a held one (the take-over writes the
    revoked marker of the holder it displaced); cancel_running: 1 on a free key, 1 over
    a queued holder, as a replace.

    A capped replace costs what a replace costs when this process made the
    burst's earlier calls.
    """
    client = counting_client(redis_server, 7)
    client.flushdb()
    app = app_on_store("rt-cancel", RedisStore(client))

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="cancel_running")
    def cancel(x: int) -> int:
        return x

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="replace",
              debounce_max_wait=5)
    def debounce(x: int) -> int:
        return x

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="replace")
    def replace(x: int) -> int:
        return x

    cancel.delay(0)  # loads the scripts
    cancel.delay(0)
    debounce.apply_async((0,), countdown=1)
    assert measure(client, lambda: cancel.delay(1)) == 1
    assert measure(client, lambda: cancel.delay(1)) == 1  # the queued holder taken, revoked
    assert measure(client, lambda: debounce.apply_async((2,), countdown=1)) == 1
    assert measure(client, lambda: debounce.apply_async((2,), countdown=1)) == 1
    assert measure(client, lambda: replace.delay(3)) == 1
    assert measure(client, lambda: replace.delay(3)) == 1
    client.close()
    app.close()


def test_keep_last_round_trips(redis_server: RedisServer) -> None:
    """keep_last: a call on a free key 1 round trip, on a held key 1 (the take-over writes
    the revoked marker); an executed run 2, as any run (the run gate rides on its start
    and end)."""
    from celery.contrib.testing.worker import start_worker

    client = counting_client(redis_server, 7)
    client.flushdb()
    apps = []
    for queue in ("rt-last-calls", "rt-last-runs"):
        app = Celery(queue, broker="memory://", backend="cache+memory://", set_as_current=False)
        app.conf.update(
            task_default_queue=queue, dedup_metrics_flush_interval=3600, dedup_lease_ttl=600
        )
        runtime_for(app).use_store(RedisStore(client))
        apps.append(app)
    def echo(x: int) -> int:
        return x

    calls, runs = (
        app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="keep_last")(echo)
        for app in apps
    )
    calls.delay(0)  # loads the scripts
    calls.delay(0)
    assert measure(client, lambda: calls.delay(1)) == 1
    assert measure(client, lambda: calls.delay(1)) == 1
    with start_worker(apps[1], pool="solo", perform_ping_check=False, loglevel="WARNING"):
        runs.delay(2).get(timeout=30)  # the worker's scripts are loaded
        assert measure(client, lambda: runs.delay(3).get(timeout=30)) == 1 + 2
    client.close()
    for app in apps:
        app.close()


@pytest.mark.postgres
def test_cancel_running_round_trips_on_postgres(store_postgres: StoreCase) -> None:
    """On PostgreSQL (autocommit: one statement sent is one round trip) cancel_running,
    replace and keep_last cost what they cost on Redis: 1 statement on a free key, 1 on a
    held one (over a queued holder, for cancel_running): the take-over and the displaced
    owner's revoked marker are one statement."""
    store = store_postgres.store
    assert isinstance(store, SQLStore)
    app = app_on_store("rt-pg", store)

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="cancel_running")
    def cancel(x: int) -> int:
        return x

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="replace")
    def replace(x: int) -> int:
        return x

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="keep_last")
    def keep_last(x: int) -> int:
        return x

    cancel.delay(0)  # tables checked, the first expired rows reaped
    try:
        with Statements(store.engine) as sql:
            for call in (cancel, cancel, replace, replace, keep_last, keep_last):
                assert sql.count(lambda call=call: call.delay(1)) == 1, sql.sent
    finally:
        app.close()
