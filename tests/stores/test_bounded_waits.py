"""Bounded waits: a hung store costs a call seconds, and connections stay capped.

The hung server accepts connections and never answers a byte. With the
default settings a call on it ends (the fallback applies) within a deadline
far below Celery's 120 s Redis socket timeout; the metrics flush never adds a
wait to the call. ``redis_max_connections`` caps the Redis store's own
connections.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.exceptions import StoreUnavailable
from celery_dedup.stores import store_from_url

META = {"task_name": "tests.bounded", "policy": "success", "task_id": "id-bounded"}
#: a call on a hung store must end well before this (the old default was 240 s)
DEADLINE = 30.0


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A loopback port whose server accepts every connection and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def _ends_within(work: Any, deadline: float = DEADLINE) -> Any:
    """Run ``work`` in a thread; it must finish before ``deadline`` seconds."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", work()))
        except BaseException as exc:
            out.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline)
    assert out, f"still waiting after {deadline} s"
    return out[0]


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:{port}",
        "memcached://127.0.0.1:{port}",
        "db+postgresql+psycopg://postgres@127.0.0.1:{port}/db",
        "db+mysql+pymysql://root@127.0.0.1:{port}/db",
    ],
    ids=["redis", "memcached", "postgresql", "mysql"],
)
def test_store_on_a_hung_server_fails_fast(hung_port: int, url: str) -> None:
    """A store URL on a hung server: the acquire raises StoreUnavailable in seconds."""
    store = store_from_url(url.format(port=hung_port))
    kind, value = _ends_within(lambda: store.acquire("bounded:k", "owner", 30, META))
    assert kind == "error" and isinstance(value, StoreUnavailable)


def test_celery_app_on_a_hung_redis_backend(hung_port: int) -> None:
    """Result backend on a hung Redis, default settings: the call publishes (open fallback)."""
    app = Celery("bounded", broker="memory://", backend=f"redis://127.0.0.1:{hung_port}/0")
    app.conf.dedup_fallback = "open"
    app.conf.dedup_metrics_flush_interval = 0.001
    runs: list[int] = []

    # ignore_result: Celery's own subscribe to a hung backend is not the store's wait.
    @app.task(base=DedupTask, name="tests.bounded.work", ignore_result=True)
    def work(n: int) -> None:
        runs.append(n)

    kind, first = _ends_within(lambda: work.delay(1))
    assert kind == "ok" and not first.deduplicated
    time.sleep(0.01)  # the flush interval passes: the next call would flush metrics
    kind, second = _ends_within(lambda: work.delay(2))
    assert kind == "ok" and not second.deduplicated


def test_redis_max_connections_caps_the_stores_connections(redis_server: Any) -> None:
    """``redis_max_connections = 4``, 24 threads: never more than 4 store connections."""
    url = redis_server.url(5)
    app = Celery("capped", broker="memory://", backend=url)
    app.conf.redis_max_connections = 4
    store = store_from_url(url, app=app)
    observer = redis_server.client()
    before = int(observer.info("clients")["connected_clients"])
    peak = [0]
    errors: list[BaseException] = []
    barrier = threading.Barrier(24)

    def hammer(i: int) -> None:
        try:
            barrier.wait(10)
            for j in range(30):
                key = f"capped:{i}:{j}"
                assert store.acquire(key, "owner", 30, META) is None
                assert store.release(key, "owner")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], int(observer.info("clients")["connected_clients"]) - before)
        time.sleep(0.005)
    assert errors == []
    after = int(observer.info("clients")["connected_clients"]) - before
    assert peak[0] <= 4
    assert after <= 4
    store.close()
    observer.close()
