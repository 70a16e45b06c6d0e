"""The Redis store is derived like Celery's backend: its client, key prefix, TLS and Sentinel."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_dedup import DeduplicationUnavailable, DedupTask, StoreUnavailable, inspect_lock
from celery_dedup.runtime import runtime_for
from celery_dedup.stores import derive_store_url, store_from_url
from celery_dedup.stores.redis import RedisStore
from tests.fixtures._servers import find_binary, free_port, running
from tests.fixtures.memcached import MemcachedServer
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

STORE_DB = 18


@pytest.fixture
def store_db(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The session Redis with this module's database flushed."""
    redis_server.flush(STORE_DB)
    yield redis_server
    redis_server.flush(STORE_DB)


def make_app(**conf: object) -> Celery:
    app = Celery("resolution", set_as_current=False)
    app.conf.update(broker_url="memory://", **conf)
    return app


def test_result_backend_client_is_reused(store_db: RedisServer) -> None:
    """With a Redis result backend the store uses the backend's own client."""
    app = make_app(result_backend=store_db.url(STORE_DB))
    store = runtime_for(app).store
    assert isinstance(store, RedisStore)
    assert store.client is app.backend.client
    app.close()


def test_global_keyprefix_prefixes_every_lock(store_db: RedisServer) -> None:
    """result_backend_transport_options['global_keyprefix'] prefixes the physical key."""
    app = make_app(
        result_backend=store_db.url(STORE_DB),
        result_backend_transport_options={"global_keyprefix": "tenant1:"},
    )

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def job(x: int) -> int:
        return x

    result = job.delay(1)
    physical = [k.decode() for k in store_db.client(STORE_DB).keys("*")]
    assert physical == [f"tenant1:{result.deduplication_key}"]
    lock = inspect_lock(result.deduplication_key, app=app)
    assert lock is not None and lock.key == result.deduplication_key
    assert job.delay(1).deduplicated is True
    app.close()


def test_broker_is_used_when_backend_cannot_hold_locks(store_db: RedisServer) -> None:
    """rpc:// results with a Redis broker: the lock store is the broker's Redis."""
    app = Celery("broker-derived", set_as_current=False)
    app.conf.update(broker_url=store_db.url(STORE_DB), result_backend="rpc://")
    assert derive_store_url(app) == store_db.url(STORE_DB)
    assert isinstance(runtime_for(app).store, RedisStore)
    app.close()


def test_store_options_build_a_client_of_their_own(store_db: RedisServer) -> None:
    """dedup_store_options give the store its own client with those connection settings."""
    app = make_app(
        result_backend=store_db.url(STORE_DB),
        dedup_store_options={"socket_timeout": 0.5, "socket_connect_timeout": 0.25},
    )
    store = runtime_for(app).store
    assert isinstance(store, RedisStore)
    assert store.client is not app.backend.client
    kwargs = store.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.5 and kwargs["socket_connect_timeout"] == 0.25
    assert store.acquire("k", "a", 5, {"task_name": "t", "policy": "success"}) is None
    app.close()


def test_rediss_url_uses_tls_connections() -> None:
    """A rediss:// store is parsed like Celery's backend: TLS connections, certificate policy."""
    app = make_app(dedup_store="rediss://127.0.0.1:6390/0?ssl_cert_reqs=required")
    store = runtime_for(app).store
    assert isinstance(store, RedisStore)
    pool = store.client.connection_pool
    assert issubclass(pool.connection_class, redis.SSLConnection)
    assert pool.connection_kwargs["ssl_cert_reqs"] in ("required", 2)
    app.close()


@pytest.fixture
def sentinel(store_db: RedisServer, tmp_path: Path) -> Iterator[int]:
    """A real Sentinel (redis-server --sentinel) watching the session Redis as 'mymaster'."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor mymaster 127.0.0.1 {store_db.port} 1\n"
    )
    argv = [find_binary("redis-server"), str(conf), "--sentinel"]
    with running(argv, port, log=tmp_path / "sentinel.log"):
        yield port


def test_sentinel_store_finds_the_master(store_db: RedisServer, sentinel: int) -> None:
    """A sentinel:// store asks Sentinel for the master and takes its locks there."""
    app = make_app(
        dedup_store=f"sentinel://127.0.0.1:{sentinel}/{STORE_DB}",
        result_backend_transport_options={"master_name": "mymaster"},
    )

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def job(x: int) -> int:
        return x

    first = job.delay(1)
    assert job.delay(1).id == first.id
    assert store_db.client(STORE_DB).exists(first.deduplication_key) == 1
    app.close()


@pytest.mark.parametrize("fallback", ["open", "closed"])
def test_a_redis_url_on_another_service_follows_the_fallback(
    memcached_server: MemcachedServer, fallback: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A redis:// store URL on a memcached port: one typed error, never the driver's raw one."""
    url = f"redis://127.0.0.1:{memcached_server.port}/0"
    store = store_from_url(url)
    with pytest.raises(StoreUnavailable, match="InvalidResponse"):
        store.acquire("k", "owner", 10, {"task_name": "t", "policy": "success", "task_id": "i"})
    app = Celery("wrong-protocol", broker="memory://", set_as_current=False)
    app.conf.update(dedup_store=url, dedup_fallback=fallback)

    @app.task(base=DedupTask, shared=False, unique_for=10)
    def job(x: int) -> int:
        return x

    if fallback == "closed":
        with pytest.raises(DeduplicationUnavailable, match="InvalidResponse"):
            job.delay(1)
    else:
        with caplog.at_level("WARNING", logger="celery_dedup"):
            result = job.delay(1)
        assert result.deduplicated is False
        assert "unavailable" in caplog.text and "InvalidResponse" in caplog.text
    app.close()
