"""A call with ``rate_limit_per_key`` costs what a call without does (Redis: the window and
the lock in one script), and the window still counts exactly the publishes that ran."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import group

from celery_dedup import DedupTask, RateLimited, release
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.redis import RedisStore
from tests.core.test_round_trips import app_on_store, counting_client, measure
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

pytestmark = pytest.mark.redis


def entries(client: redis.Redis) -> int:
    """Publishes counted in every rate window of the database."""
    return sum(int(client.zcard(key)) for key in client.scan_iter(match="*-rate:*"))


def test_rate_limited_calls_cost_one_round_trip(redis_server: RedisServer) -> None:
    """First call and duplicate: 1 round trip each with a rate limit (raise or delay) or a
    concurrency limit, as without; a refused call 1, and it leaves nothing behind; a group
    member over the rate 2 (refused, then its place reserved)."""
    client = counting_client(redis_server, 8)
    client.flushdb()
    app = app_on_store("rt-rate", RedisStore(client))
    options: dict[str, Any] = {"base": DedupTask, "shared": False, "unique_for": 30}

    @app.task(**options)
    def plain(x: int) -> int:
        return x

    @app.task(**options, rate_limit_per_key="2/h", rate_key=lambda x: "all")
    def rated(x: int) -> int:
        return x

    @app.task(**options, rate_limit_per_key="1/h", on_rate_limit="delay")
    def delayed(x: int) -> int:
        return x

    @app.task(**options, concurrency_limit=1)
    def limited(x: int) -> int:
        return x

    for task in (plain, delayed, limited):  # loads the scripts
        task.delay(0)
    first = measure(client, lambda: plain.delay(1))
    assert first == 1
    assert measure(client, lambda: plain.delay(1)) == 1

    assert measure(client, lambda: rated.delay(1)) <= first + 1
    assert entries(client) == 1 + 1  # delayed(0)'s window and rated(1)'s
    assert measure(client, lambda: rated.delay(1)) == 1
    assert measure(client, lambda: rated.delay(1)) == 1
    assert entries(client) == 2  # a duplicate is not counted
    assert rated.delay(2).deduplicated is False  # the window of "all" is full now
    assert measure(client, lambda: rated.delay(1)) == 1  # a duplicate all the same

    def refused() -> None:
        with pytest.raises(RateLimited):
            rated.delay(3)

    assert measure(client, refused) == 1
    assert measure(client, refused) == 1  # the refusal locked nothing
    assert entries(client) == 3  # and counted nothing

    # A group member is never refused: a full window is asked again, to reserve its place
    # (both members are over the rate: 2 round trips each).
    before = entries(client)
    assert measure(client, lambda: group(rated.s(4), rated.s(5)).apply_async()) == 2 * 2
    assert entries(client) == before + 2

    assert measure(client, lambda: delayed.delay(1)) == 1
    assert measure(client, lambda: delayed.delay(1)) == 1
    waiting = delayed.delay(2)  # the window of its key is free: no wait
    assert release(waiting, app=app)
    again = delayed.delay(2)  # its place is an hour away: so is the end of its lock
    lock = runtime_for(app).store.get(again.deduplication_key)
    assert lock is not None and lock.ttl > 3000
    assert measure(client, lambda: delayed.delay(2)) == 1

    assert measure(client, lambda: limited.delay(1)) == first
    assert measure(client, lambda: limited.delay(1)) == 1
    client.close()
    app.close()


def test_rate_window_and_duplicates_with_a_worker(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer
) -> None:
    """Two places an hour: a call, its duplicates, a second call and a refused third run
    two bodies; a duplicate of a running call takes no place; once a lock is released the
    full window still refuses."""
    app = app_factory("rate-rt")
    runs = redis_server.client(5)
    runs.delete("runs")

    @app.task(base=DedupTask, shared=False, unique_for=60, rate_limit_per_key="2/h",
              rate_key="{user}")
    def job(user: str, n: int) -> int:
        runs.rpush("runs", n)
        return n

    first = job.delay("u", 1)
    assert job.delay("u", 1).id == first.id
    assert job.delay("u", 1).id == first.id
    second = job.delay("u", 2)
    with pytest.raises(RateLimited):
        job.delay("u", 3)
    assert job.delay("v", 3).deduplicated is False  # another user's window
    worker_for(app)
    assert first.get(timeout=30) == 1 and second.get(timeout=30) == 2
    wait_until(lambda: runs.llen("runs") == 3, timeout=30)
    # The runs ended: the locks are gone, the window stays full for u.
    with pytest.raises(RateLimited):
        job.delay("u", 1)
    assert sorted(int(n) for n in runs.lrange("runs", 0, -1)) == [1, 2, 3]
    store = runtime_for(app).store
    assert isinstance(store, RedisStore)
    assert entries(store.client) == 3
