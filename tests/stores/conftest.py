"""The table of stores the conformance suite runs against.

Each entry names a fixture returning a ``StoreCase``; the fixtures live in
``tests/fixtures/`` next to the server they start. Django DB stores run the
same contract from ``tests/django/``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_dedup.stores.memory import MemoryStore
from celery_dedup.stores.redis import RedisStore
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer

STORES = [
    pytest.param("store_memory", marks=pytest.mark.memory, id="memory"),
    pytest.param("store_redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("store_redis_cluster", marks=pytest.mark.redis_cluster, id="redis-cluster"),
    pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
    pytest.param("store_memcached", marks=pytest.mark.memcached, id="memcached"),
]


@pytest.fixture(params=STORES)
def store_case(request: pytest.FixtureRequest) -> StoreCase:
    """Every store of the table, one after the other."""
    case: StoreCase = request.getfixturevalue(request.param)
    return case


@pytest.fixture
def store_memory() -> Iterator[StoreCase]:
    """A fresh memory store."""
    store = MemoryStore.from_url("memory://conformance")
    store.clear()
    yield StoreCase(
        url="memory://conformance", store=store, flush=store.clear, shared_across_processes=False
    )
    store.clear()


@pytest.fixture
def store_redis(redis_server: RedisServer) -> Iterator[StoreCase]:
    """A Redis store on a flushed database."""
    client = redis_server.client(2)
    client.flushdb()
    url = redis_server.url(2)
    yield StoreCase(url=url, store=RedisStore.from_url(url), flush=client.flushdb)
    client.flushdb()
    client.close()
