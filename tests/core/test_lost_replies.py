"""A store reply lost after the server applied the command: the client re-sends it.

redis-py retries a command whose connection broke (its default policy), so
an acquire whose reply never arrived is run a second time and finds the lock
its own first attempt wrote. That call must publish (once), never report
itself as its own duplicate: nothing would run until the TTL expired.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.runtime import runtime_for
from tests.core.conftest import AppFactory, wait_until
from tests.fixtures.lost_reply_proxy import LostReplyProxy
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[LostReplyProxy]:
    redis_server.flush(5, 6)
    proxy = LostReplyProxy(redis_server.port)
    yield proxy
    proxy.close()


def _app(app_factory: AppFactory, proxy: LostReplyProxy) -> Celery:
    # Celery's backend clients do not retry; a client configured to (as
    # redis-py's own default client is) re-sends a command whose reply was lost.
    return app_factory(
        "lost",
        dedup_store=f"redis://127.0.0.1:{proxy.port}/5",
        dedup_store_options={"retry_on_error": [redis.exceptions.ConnectionError]},
    )


def test_acquire_whose_reply_was_lost_publishes_once(
    app_factory: AppFactory, proxy: LostReplyProxy, redis_server: RedisServer, worker_for
) -> None:
    app = _app(app_factory, proxy)
    runs = redis_server.client(6)

    @app.task(base=DedupTask, name="lost.work", shared=False, unique_for=60)
    def work(n: int) -> None:
        runs.rpush("runs", n)

    store = runtime_for(app).store
    assert store is not None
    # Connect and load the acquire script before arming (a NOSCRIPT reply
    # would be the one dropped).
    assert store.acquire("warm", "warm", 60, {"task_name": "w", "policy": "success"}) is None
    proxy.arm(b"EVALSHA")
    first = work.delay(1)
    assert proxy.dropped == 1
    assert first.deduplicated is False  # published, not its own duplicate
    assert work.delay(1).deduplicated is True  # the lock is really held
    worker_for(app)
    wait_until(lambda: runs.llen("runs") == 1 and store.get(first.deduplication_key) is None)
    first.get(timeout=10)
    assert runs.lrange("runs", 0, -1) == [b"1"]
