"""``RatedAcquire`` on Redis: the key looked at first, then the window, then both written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_dedup.stores.base import rated_acquire
from celery_dedup.stores.redis import RedisStore
from celery_dedup.stores.sql import SQLStore
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

META = {"task_name": "t", "policy": "success", "task_id": "id-1"}


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    redis_server.flush(9)
    store = RedisStore(redis_server.client(9))
    yield store
    store.close()


def test_held_full_and_free(store: RedisStore) -> None:
    """Free: counted and locked. Held: the holder, nothing counted. Free but full: refused
    with its retry_after, nothing written. Delayed: a place an hour on, locked that long."""
    first = store.acquire_rated("lock", "a", 10, META, "rate", "id-1", 1, 3600,
                                delay=False, unique_for=10)  # fmt: skip
    assert first is not None and first.acquired and first.rate is not None
    assert first.rate.entry.startswith("id-1")
    held = store.acquire_rated("lock", "b", 10, META, "rate", "id-2", 1, 3600,
                               delay=False, unique_for=10)  # fmt: skip
    assert held is not None and not held.acquired and held.holder is not None
    assert held.holder.owner == "a" and held.rate is None
    assert store.rate_window("rate", 1, 3600).count == 1
    assert store.release("lock", "a")
    full = store.acquire_rated("lock", "c", 10, META, "rate", "id-3", 1, 3600,
                               delay=False, unique_for=10)  # fmt: skip
    assert full is not None and not full.acquired and full.holder is None
    assert full.rate is not None and 3500 < full.rate.wait <= 3600
    assert full.rate.last == "id-1"
    assert store.get("lock") is None and store.rate_window("rate", 1, 3600).count == 1
    placed = store.acquire_rated("lock", "d", 10, META, "rate", "id-4", 1, 3600,
                                 delay=True, unique_for=10)  # fmt: skip
    assert placed is not None and placed.acquired and placed.rate is not None
    assert placed.rate.wait > 3500
    lock = store.get("lock")
    assert lock is not None and lock.owner == "d" and lock.ttl > 3500
    assert store.rate_window("rate", 1, 3600).count == 2


def test_offered_by_redis_not_by_sql() -> None:
    """SQL stores keep the two steps (and the entry's undo on a duplicate)."""
    assert rated_acquire(SQLStore.__new__(SQLStore)) is None
    assert rated_acquire(RedisStore.__new__(RedisStore)) is not None
