"""The Redis store's own per-thread connections (``ScriptWire``) on a real server.

Every lock operation runs on a connection the store keeps per thread and per
process, outside redis-py's pool. What would make that lose or mix up a
reply: a fork that shares the parent's socket, threads sharing one socket,
a connection the server closed while it sat idle, a server that forgot the
scripts. Each is tried here against a real redis-server.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_dedup.stores.redis import RedisStore
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

DB = 7
META = {"task_name": "wire.task", "policy": "success", "task_id": "t"}


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(DB)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def store(redis_server: RedisServer, raw: redis.Redis) -> Iterator[RedisStore]:
    """A store on a Celery result backend's client (no client-side retries)."""
    app = Celery("wire", broker="memory://", backend=redis_server.url(DB), set_as_current=False)
    store = RedisStore.from_url(redis_server.url(DB), app=app)
    yield store
    store.close()
    app.close()


def _cycle(store: RedisStore, prefix: str, count: int) -> list[str]:
    """Acquire, read back and release ``count`` keys; the answers that were wrong."""
    wrong = []
    for i in range(count):
        key, owner = f"{prefix}:{i}", f"{prefix}-owner-{i}"
        if store.acquire(key, owner, 30, META) is not None:
            wrong.append(f"acquire {key}")
        holder = store.get(key)
        if holder is None or holder.owner != owner:
            wrong.append(f"get {key}: {holder}")
        if not store.release(key, owner):
            wrong.append(f"release {key}")
    return wrong


def test_a_forked_child_never_uses_its_parents_connection(
    store: RedisStore, raw: redis.Redis
) -> None:
    assert _cycle(store, "before-fork", 5) == []  # the parent's connection exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            wrong = _cycle(store, "child", 300)
            os.write(write, ("\n".join(wrong) or "ok").encode())
        finally:
            os._exit(0)
    os.close(write)
    wrong_in_parent = _cycle(store, "parent", 300)
    with os.fdopen(read) as pipe:
        child_report = pipe.read()
    os.waitpid(pid, 0)
    assert child_report == "ok"
    assert wrong_in_parent == []
    assert raw.dbsize() == 0


def test_threads_never_read_each_others_replies(store: RedisStore, raw: redis.Redis) -> None:
    wrong: list[str] = []

    def run(n: int) -> None:
        wrong.extend(_cycle(store, f"thread{n}", 150))

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert raw.dbsize() == 0


def test_a_connection_closed_by_the_server_while_idle_is_replaced(
    store: RedisStore, raw: redis.Redis
) -> None:
    """Server ``timeout``, a proxy or a restart drops idle clients: no call may fail for it."""
    assert store.acquire("idle", "a", 30, META) is None
    name = "celery-dedup-wire-test"
    raw.client_setname(name)
    # Kill every normal client but this one: the store's idle connection too.
    killed = raw.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    holder = store.acquire("idle", "b", 30, META)  # no StoreUnavailable, no fallback
    assert holder is not None and holder.owner == "a"
    assert store.release("idle", "a")


def test_scripts_flushed_from_the_server_are_loaded_again(
    store: RedisStore, raw: redis.Redis
) -> None:
    assert store.acquire("flushed", "a", 30, META) is None
    raw.script_flush()
    holder = store.get("flushed")
    assert holder is not None and holder.owner == "a"
    assert store.release("flushed", "a")
    assert raw.exists("flushed") == 0


def test_close_disconnects_every_connection(redis_server: RedisServer, raw: redis.Redis) -> None:
    app = Celery("wire-close", broker="memory://", set_as_current=False)
    store = RedisStore.from_url(redis_server.url(DB), app=app)

    def clients() -> int:
        return sum(1 for c in raw.client_list() if c.get("db") == str(DB))

    before = clients()
    inside, done = threading.Barrier(5), threading.Event()

    def hold_a_connection(n: int) -> None:
        # Four commands in flight at once need four connections.
        store.get(f"k{n}")
        inside.wait(30)
        done.wait(60)

    threads = [
        threading.Thread(target=hold_a_connection, args=(n,), daemon=True) for n in range(4)
    ]
    for thread in threads:
        thread.start()
    try:
        inside.wait(30)
        store.get("main-thread")
        assert clients() > before
        store.close()
        # The server drops a closed connection when it reads the close: wait for
        # it (a connection that stayed open would be listed for ever).
        deadline = time.monotonic() + 10
        while clients() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert clients() <= before
    finally:
        done.set()
    for thread in threads:
        thread.join()
    assert store.get("after-close") is None  # reconnects on next use
    store.close()
    app.close()


def test_short_lived_threads_reuse_connections(store: RedisStore, raw: redis.Redis) -> None:
    """A thread per request (a dev server, a pool that recycles threads) opens no socket each."""
    def clients() -> int:
        return sum(1 for c in raw.client_list() if c.get("db") == str(DB))

    store.get("warm")
    before = clients()
    for n in range(100):
        thread = threading.Thread(target=store.get, args=(f"k{n}",))
        thread.start()
        thread.join()
    assert clients() <= before + 1
