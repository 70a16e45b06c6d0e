"""Attacks on the Redis hot path: lost replies, per-thread connections, identity fast path, results.

The Redis store runs its scripts on its own per-thread connections with the
client's retry policy (``ScriptWire``), a lock is one packed string, an
acquire that finds the call's own token counts as acquired, scalar
arguments take an identity fast path and a duplicate's ``on_ready`` promise
is built lazily. Each test here tries to make that run the same work twice,
lose work, leak a lock or give a wrong answer, on a real redis-server and,
where it matters, a real worker.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, current_task
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from kombu.serialization import dumps, loads

from celery_dedup import DedupTask, enqueue_many
from celery_dedup import identity as identity_module
from celery_dedup.compat.celery_singleton import Singleton
from celery_dedup.identity import ArgumentBinder, as_delivered
from celery_dedup.results import DeduplicatedResult
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import ClaimOutcome
from celery_dedup.stores.redis import RedisStore
from tests.core.conftest import make_app, wait_until
from tests.fixtures._servers import free_port, running
from tests.fixtures.lost_reply_proxy import LostReplyProxy
from tests.fixtures.redis import RedisServer, start_redis

pytestmark = pytest.mark.redis

#: databases of the session redis-server this module uses (no other suite does)
BROKER_DB, BACKEND_DB, STORE_DB, RUNS_DB = 50, 51, 52, 53
META = {"task_name": "hot.task", "policy": "success", "task_id": "id-1"}
#: keeps the server busy for ARGV[1] microseconds (DEBUG SLEEP is disabled by default)
BUSY = """
local t = redis.call('time')
local start = t[1] * 1000000 + t[2]
repeat
    t = redis.call('time')
until t[1] * 1000000 + t[2] - start > tonumber(ARGV[1])
return 1
"""


# -- infrastructure -----------------------------------------------------------------------


@pytest.fixture
def dbs(redis_server: RedisServer) -> Iterator[RedisServer]:
    redis_server.flush(BROKER_DB, BACKEND_DB, STORE_DB, RUNS_DB)
    yield redis_server
    redis_server.flush(BROKER_DB, BACKEND_DB, STORE_DB, RUNS_DB)


@pytest.fixture
def proxy(dbs: RedisServer) -> Iterator[LostReplyProxy]:
    proxy = LostReplyProxy(dbs.port)
    yield proxy
    proxy.close()


@pytest.fixture
def apps(dbs: RedisServer) -> Iterator[Callable[..., Celery]]:
    """Apps on this module's databases (broker, backend; the store as given)."""
    made: list[Celery] = []

    def factory(name: str, **conf: Any) -> Celery:
        settings = {
            "broker_url": dbs.url(BROKER_DB),
            "result_backend": dbs.url(BACKEND_DB),
            "dedup_store": dbs.url(STORE_DB),
            "task_default_queue": "q-hot",
            **conf,
        }
        app = make_app(dbs, name, **settings)
        made.append(app)
        return app

    yield factory
    for app in made:
        runtime_for(app).metrics.flush()
        app.close()


@pytest.fixture
def worker_for() -> Iterator[Callable[[Celery], Any]]:
    stack: list[Any] = []

    def start(app: Celery) -> Any:
        ctx = start_worker(
            app,
            pool="threads",
            concurrency=2,
            perform_ping_check=False,
            shutdown_timeout=30,
            loglevel="WARNING",
        )
        worker = ctx.__enter__()
        stack.append(ctx)
        return worker

    yield start
    while stack:
        stack.pop().__exit__(None, None, None)


def _store(app: Celery) -> RedisStore:
    store = runtime_for(app).store
    assert isinstance(store, RedisStore)
    return store


def _settled(*results: AsyncResult[Any]) -> bool:
    return all(result.state != "PENDING" for result in results)


def retrying_client(proxy: LostReplyProxy) -> redis.Redis:
    """A client of the store's database through ``proxy`` that re-sends a command whose
    reply was lost (redis-py's retry on a connection error)."""
    return redis.Redis(
        host="127.0.0.1",
        port=proxy.port,
        db=STORE_DB,
        retry_on_error=[redis.exceptions.ConnectionError],
    )


# -- a replace whose take-over reply was lost ---------------------------------------------


def test_a_resent_take_over_reports_the_holder_it_replaced(
    dbs: RedisServer, proxy: LostReplyProxy
) -> None:
    """``take_over`` must name the holder it displaced even when its command is re-sent.

    The first run replaced P's record and its reply was lost; the re-sent
    command finds the caller's own record. Reporting that as "the previous
    holder" loses P: it is never revoked.
    """
    client = retrying_client(proxy)
    store = RedisStore(client)
    try:
        assert store.take_over("warm", "w", 5, META) is None  # script loaded on the server
        assert store.acquire("k", "p-token", 60, {**META, "task_id": "p-id"}) is None
        proxy.arm(store._take_over.sha)
        previous = store.take_over("k", "r-token", 60, {**META, "task_id": "r-id"})
        assert proxy.dropped == 1
        holder = store.get("k")
        assert holder is not None and holder.owner == "r-token"
        assert previous is not None
        assert (previous.owner, previous.task_id) == ("p-token", "p-id")
    finally:
        store.close()


def test_a_resent_queued_take_over_reports_the_holder_it_took_the_key_from(
    dbs: RedisServer, proxy: LostReplyProxy
) -> None:
    """``take_over_queued`` (``cancel_running`` over a queued holder): the same after a lost
    reply: the re-sent command names the queued holder, which is then revoked."""
    client = retrying_client(proxy)
    store = RedisStore(client)
    try:
        assert store.take_over_queued("warm", "w", 5, META) is None  # script loaded
        assert store.acquire("k", "p-token", 60, {**META, "task_id": "p-id"}) is None
        proxy.arm(store._take_over_queued.sha)
        previous = store.take_over_queued("k", "c-token", 60, {**META, "task_id": "c-id"})
        assert proxy.dropped == 1
        holder = store.get("k")
        assert holder is not None and holder.owner == "c-token"
        assert previous is not None
        assert (previous.owner, previous.task_id) == ("p-token", "p-id")
    finally:
        store.close()


@pytest.mark.parametrize("queued_only", [False, True])
def test_a_resent_revoking_take_over_answers_the_same_and_keeps_the_marker(
    dbs: RedisServer, proxy: LostReplyProxy, queued_only: bool
) -> None:
    """``take_over_revoking`` (``replace``, ``keep_last``, ``cancel_running``) after a lost
    reply: the re-sent command names the displaced holder, whose marker the first run
    wrote: its start is refused even once the new owner released the key."""
    client = retrying_client(proxy)
    store = RedisStore(client)
    script = store._take_over_queued if queued_only else store._take_over
    try:
        # script loaded on the server
        assert store.take_over_revoking("warm", "w", 5, META, 60, queued_only=queued_only) is None
        assert store.acquire("k", "p-token", 60, {**META, "task_id": "p-id"}) is None
        proxy.arm(script.sha)
        previous = store.take_over_revoking(
            "k", "r-token", 60, {**META, "task_id": "r-id"}, 60, queued_only=queued_only
        )
        assert proxy.dropped == 1
        assert previous is not None
        assert (previous.owner, previous.task_id) == ("p-token", "p-id")
        assert store.release("k", "r-token") is True
        claim = store.claim("k", "p-token", release=False, ttl=60, meta=META)
        assert claim.outcome is ClaimOutcome.REVOKED
        assert store.get("k") is None
    finally:
        store.close()


def test_a_replace_whose_take_over_reply_was_lost_still_refuses_the_replaced_message(
    apps: Callable[..., Celery], proxy: LostReplyProxy, dbs: RedisServer, worker_for: Any
) -> None:
    """``on_duplicate="replace"``: the replaced message never runs, even after a lost reply.

    Celery's own ``redis_retry_on_timeout`` gives the store's client a retry
    policy. P is published with a countdown, then replaced by R; R's
    take-over reply is lost and re-sent. R runs and releases; P's start must
    still be refused (revoked), or the work runs twice.
    """
    producer = apps(
        "hot-producer",
        dedup_store=f"redis://127.0.0.1:{proxy.port}/{STORE_DB}",
        redis_retry_on_timeout=True,
    )
    consumer = apps("hot-consumer")
    runs = dbs.client(RUNS_DB)

    def body(n: int) -> int:
        runs.rpush("runs", current_task.request.id)
        return n

    send = producer.task(base=DedupTask, name="hot.replace", shared=False, unique_for=60)(body)
    consumer.task(base=DedupTask, name="hot.replace", shared=False, unique_for=60)(body)
    store = _store(producer)
    assert store.take_over("warm", "w", 5, META) is None  # script loaded on the server
    worker_for(consumer)

    replaced = send.apply_async((1,), countdown=4)
    proxy.arm(store._take_over.sha)
    replacing = send.apply_async((1,), on_duplicate="replace")
    assert proxy.dropped == 1
    assert replacing.deduplicated is False
    assert replacing.get(timeout=20) == 1
    wait_until(lambda: _settled(replaced), timeout=30)
    assert [run.decode() for run in runs.lrange("runs", 0, -1)] == [replacing.id]
    assert replaced.state == "REVOKED"


def test_an_acquire_whose_reply_was_lost_on_celerys_own_retry_policy_publishes_once(
    apps: Callable[..., Celery], proxy: LostReplyProxy, dbs: RedisServer, worker_for: Any
) -> None:
    """The producer's owner-equality rule, on the client Celery builds (``retry_on_timeout``)."""
    producer = apps(
        "hot-acquire",
        dedup_store=f"redis://127.0.0.1:{proxy.port}/{STORE_DB}",
        redis_retry_on_timeout=True,
    )
    runs = dbs.client(RUNS_DB)

    @producer.task(base=DedupTask, name="hot.acquire", shared=False, unique_for=60)
    def work(n: int) -> int:
        runs.rpush("runs", n)
        return n

    store = _store(producer)
    assert store.acquire("warm", "w", 5, META) is None
    proxy.arm(store._acquire.sha)
    first = work.delay(7)
    assert proxy.dropped == 1
    assert first.deduplicated is False
    duplicate = work.delay(7)
    assert duplicate.deduplicated is True and duplicate.id == first.id
    worker_for(producer)
    assert first.get(timeout=20) == 7
    wait_until(lambda: store.get(first.deduplication_key) is None)
    assert runs.lrange("runs", 0, -1) == [b"7"]


def test_a_batch_whose_acquire_reply_was_lost_is_published(
    apps: Callable[..., Celery], proxy: LostReplyProxy, dbs: RedisServer, worker_for: Any
) -> None:
    """``enqueue_many``: its own lock seen again (a re-sent acquire) is not another batch.

    Reported as a duplicate, the batch would return its own never-published
    group as "the holder's", and every batch of the key would be refused for
    ``unique_for`` while nothing runs.
    """
    producer = apps(
        "hot-batch",
        dedup_store=f"redis://127.0.0.1:{proxy.port}/{STORE_DB}",
        redis_retry_on_timeout=True,
    )
    runs = dbs.client(RUNS_DB)

    @producer.task(name="hot.member", shared=False)
    def member(n: int) -> int:
        runs.rpush("runs", n)
        return n

    store = _store(producer)
    assert store.acquire("warm", "w", 5, META) is None
    proxy.arm(store._acquire.sha)
    batch = enqueue_many([member.s(1), member.s(2)], deduplication_key="nightly", app=producer)
    assert proxy.dropped == 1
    assert batch.deduplicated is False  # type: ignore[attr-defined]
    worker_for(producer)
    assert sorted(batch.get(timeout=20)) == [1, 2]
    assert sorted(runs.lrange("runs", 0, -1)) == [b"1", b"2"]


def test_a_singleton_lock_whose_acquire_reply_was_lost_is_reported_taken(
    apps: Callable[..., Celery], proxy: LostReplyProxy
) -> None:
    """celery-singleton's ``aquire_lock``: True when this call took the lock, re-sent or not."""
    producer = apps(
        "hot-singleton",
        dedup_store=f"redis://127.0.0.1:{proxy.port}/{STORE_DB}",
        redis_retry_on_timeout=True,
    )

    @producer.task(base=Singleton, name="hot.singleton", shared=False)
    def single(n: int) -> int:
        return n

    store = _store(producer)
    assert store.acquire("warm", "w", 5, META) is None
    lock = single.generate_lock(single.name, task_args=[1])
    proxy.arm(store._acquire.sha)
    taken = single.aquire_lock(lock, "mine")
    assert proxy.dropped == 1
    assert single.get_existing_task_id(lock) == "mine"
    assert taken is True
    assert single.aquire_lock(lock, "other") is False


@pytest.mark.parametrize("operation", ["release", "extend", "settle", "claim", "revoke"])
def test_owner_checked_writes_resent_after_a_lost_reply_leave_the_right_state(
    dbs: RedisServer, proxy: LostReplyProxy, operation: str
) -> None:
    """Each owner-checked script run twice (a lost reply) ends where one run would."""
    client = retrying_client(proxy)
    raw = dbs.client(STORE_DB)
    store = RedisStore(client)
    try:
        script = getattr(store, "_" + operation)
        for warm in ("w1", "w2"):  # every script loaded on the server
            store.acquire(warm, "w", 5, META)
        store.claim("w1", "w", release=False, ttl=None, meta=META)
        store.settle("w1", "w")
        store.extend("w1", "w", 5)
        store.revoke("w2", "w", 5)
        store.release("w1", "w")
        assert store.acquire("k", "tok", 60, META) is None
        proxy.arm(script.sha)
        if operation == "release":
            store.release("k", "tok")
            assert raw.exists("k") == 0
        elif operation == "extend":
            assert store.extend("k", "tok", 600) is True
            assert 590_000 < raw.pttl("k") <= 600_000
        elif operation == "settle":
            store.claim("k", "tok", release=False, ttl=None, meta=META)
            proxy.arm(script.sha)
            assert store.settle("k", "tok", 300) is True
            lock = store.get("k")
            assert lock is not None and lock.started is False and lock.owner == "tok"
        elif operation == "claim":
            claim = store.claim("k", "tok", release=False, ttl=None, meta=META)
            assert claim.outcome.value == "owned"
            lock = store.get("k")
            assert lock is not None and lock.started is True and lock.owner == "tok"
        else:
            store.revoke("k", "tok", 60)
            assert raw.exists("k") == 0
            claim = store.claim("k", "tok", release=False, ttl=60, meta=META)
            assert claim.outcome.value == "revoked"
        assert proxy.dropped >= 1
    finally:
        store.close()
        raw.close()


# -- per-thread connections: fork mid-command, server restart -------------------------------


def test_a_fork_while_another_thread_waits_for_a_reply_disturbs_neither_process(
    dbs: RedisServer,
) -> None:
    """A thread is mid-command when the process forks; the child closes its store.

    The waiting thread gets its own reply; the child never writes to (nor
    shuts down) a socket of its parent: the parent's connection is the same
    socket afterwards.
    """
    raw = dbs.client(STORE_DB)
    store = RedisStore(redis.Redis.from_url(dbs.url(STORE_DB)))
    try:
        assert store.acquire("main-warm", "m", 30, META) is None
        assert store._wire is not None
        main_socket = store._wire._idle[-1]._sock
        answers: list[Any] = []
        busy = dbs.client(STORE_DB).register_script(BUSY)
        sleeper = threading.Thread(target=lambda: busy(args=[600_000]))
        sleeper.start()
        time.sleep(0.1)  # the server is busy: the next command waits for its reply
        waiting = threading.Thread(
            target=lambda: answers.append(store.acquire("in-flight", "thread", 30, META))
        )
        waiting.start()
        time.sleep(0.1)
        assert waiting.is_alive()  # its command sent, its reply not read yet
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - reports through the pipe
            try:
                wrong = []
                for i in range(50):
                    key = f"child:{i}"
                    if store.acquire(key, f"c{i}", 30, META) is not None:
                        wrong.append(key)
                    if not store.release(key, f"c{i}"):
                        wrong.append("release " + key)
                store.close()
                os.write(write, (",".join(wrong) or "ok").encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            report = pipe.read()
        os.waitpid(pid, 0)
        waiting.join()
        sleeper.join()
        assert report == "ok"
        assert answers == [None]
        holder = store.get("in-flight")
        assert holder is not None and holder.owner == "thread"
        assert store.release("main-warm", "m") is True
        # The parent's connection kept its socket (the child never shut it down).
        assert any(c._sock is main_socket for c in store._wire._idle)
        assert main_socket.fileno() != -1
        assert store.release("in-flight", "thread-other") is False
        assert store.release("in-flight", "thread") is True
        assert raw.dbsize() == 0
    finally:
        store.close()
        raw.close()


def test_a_restarted_server_is_used_again_without_a_failed_call(tmp_path: Path) -> None:
    """A server restart (connections dropped, scripts and data gone): the next call just works."""
    port = free_port()
    argv, _ = start_redis(tmp_path, port)
    store = RedisStore(redis.Redis(host="127.0.0.1", port=port, retry=None))
    try:
        with running(argv, port, log=tmp_path / "first.log"):
            assert store.acquire("k", "a", 60, META) is None
            holder = store.acquire("k", "b", 60, META)
            assert holder is not None and holder.owner == "a"
        with running(argv, port, log=tmp_path / "second.log"):
            assert store.get("k") is None  # no persistence: the server forgot the lock
            assert store.acquire("k", "b", 60, META) is None
            holder = store.acquire("k", "c", 60, META)
            assert holder is not None and holder.owner == "b"
            assert store.release("k", "b") is True
    finally:
        store.close()


# -- identity: the scalar fast path is the slow path, and what the worker computes ------------


SCALARS: list[Any] = [
    True, False, 1, 0, -0.0, 0.0, 1.0, 2**70, -(2**64), 10**300, 1e16, 5e-324,
    1.7976931348623157e308, 0.1 + 0.2, "é|%7C", "\ud800", "\x00", "\u2028", "😀", '"\\', "",
    "$x", None,
]


def _three_ways(binder: ArgumentBinder, args: Any, kwargs: Any) -> tuple[str, str, str]:
    fast = binder.identity("q", *as_delivered(args, kwargs, "json"))
    plain = identity_module._plain_scalars
    identity_module._plain_scalars = lambda values: False  # type: ignore[assignment]
    try:
        slow = binder.identity("q", *as_delivered(args, kwargs, "json"))
    finally:
        identity_module._plain_scalars = plain
    content_type, encoding, data = dumps([list(args), dict(kwargs)], "json")
    delivered_args, delivered_kwargs = loads(data, content_type, encoding)
    worker = binder.identity("q", *as_delivered(delivered_args, delivered_kwargs, "json"))
    return fast, slow, worker


@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_the_scalar_fast_path_is_byte_identical_to_the_slow_path_and_to_the_worker(
    value: Any,
) -> None:
    def func(a: Any, b: Any = 0, c: Any = None) -> None: ...

    binder = ArgumentBinder(func, "hot.identity")
    for args, kwargs in [((value,), {}), ((), {"a": value}), ((1,), {"c": value, "b": value})]:
        fast, slow, worker = _three_ways(binder, args, kwargs)
        assert fast == slow == worker
    restricted = ArgumentBinder(func, "hot.identity", unique_on=["b"])
    assert len(set(_three_ways(restricted, (1, value), {"c": [1]}))) == 1


def test_scalars_equal_in_python_stay_different_calls() -> None:
    """``True == 1 == 1.0`` and ``0.0 == -0.0`` in Python; as arguments they are different calls."""

    def func(a: Any) -> None: ...

    binder = ArgumentBinder(func, "hot.identity")
    keys = {binder.identity("q", *as_delivered((v,), {}, "json")) for v in (True, 1, 1.0)}
    assert len(keys) == 3
    zeros = {binder.identity("q", *as_delivered((v,), {}, "json")) for v in (0.0, -0.0)}
    assert len(zeros) == 2
    for value in (True, 1, 1.0, 0.0, -0.0):
        assert json.loads(binder.identity("q", (value,), {}))[3]["a"] == value


def test_a_headerless_duplicate_of_scalar_arguments_is_refused_by_the_workers_guard(
    apps: Callable[..., Celery], dbs: RedisServer, worker_for: Any
) -> None:
    """The producer's key (fast path) and the worker's guard key (delivered JSON) are one key."""
    app = apps("hot-guard")
    runs = dbs.client(RUNS_DB)

    @app.task(
        base=DedupTask, name="hot.guard", shared=False, unique_for=60, unique_until="expiry"
    )
    def work(a: Any, b: Any, c: Any, d: Any = None, e: Any = 0.0) -> None:
        runs.rpush("runs", current_task.request.id)

    args = [True, -0.0, 2**70, "é|%"]
    published = work.apply_async(args, {"e": 1e16})
    worker_for(app)
    wait_until(lambda: runs.llen("runs") == 1)
    duplicate = app.send_task("hot.guard", args=args, kwargs={"e": 1e16})
    other = app.send_task("hot.guard", args=[1, -0.0, 2**70, "é|%"], kwargs={"e": 1e16})
    wait_until(lambda: _settled(duplicate, other), timeout=20)
    assert duplicate.state == "IGNORED"
    assert [run.decode() for run in runs.lrange("runs", 0, -1)] == [published.id, other.id]


# -- a duplicate's result through a real worker ----------------------------------------------


def test_a_duplicates_result_get_then_and_on_ready_through_a_worker(
    apps: Callable[..., Celery], worker_for: Any
) -> None:
    app = apps("hot-result")

    @app.task(base=DedupTask, name="hot.result", shared=False, unique_for=60)
    def double(n: int) -> int:
        return n * 2

    first = double.apply_async((21,), task_id="hot|é|%7C")  # any characters in a task id
    duplicate = double.delay(21)
    assert isinstance(duplicate, DeduplicatedResult) and duplicate.id == "hot|é|%7C"
    assert duplicate.lock is not None and duplicate.lock.task_id == "hot|é|%7C"
    promise = duplicate.on_ready
    assert duplicate.on_ready is promise and not promise.ready
    seen: list[Any] = []
    duplicate.then(lambda result: seen.append(result.result))
    worker_for(app)
    assert duplicate.get(timeout=20) == 42
    assert promise.ready and seen == [42]
    store = _store(app)
    wait_until(lambda: store.get(first.deduplication_key) is None)  # released on success
    late = double.AsyncResult(first.id)
    assert late.get(timeout=5) == 42
    second = DeduplicatedResult(first.id, app=app, deduplication_key="k")
    assert second.get(timeout=5) == 42 and second.on_ready.ready
    # Kept in a session or cache, or handed to another process: pickled and copied.
    thawed = pickle.loads(pickle.dumps(duplicate))  # on the current app, as AsyncResult
    copied = copy.copy(duplicate)
    for again in (thawed, copied):
        assert isinstance(again, DeduplicatedResult) and again.deduplicated is True
        assert again.id == duplicate.id and again.duplicate_id == duplicate.duplicate_id
        assert again.deduplication_key == duplicate.deduplication_key
        assert again.lock == duplicate.lock and again.lock is not None
        assert again.lock.owner == ""  # the holder's token never travels with it
    assert copied.get(timeout=5) == 42
