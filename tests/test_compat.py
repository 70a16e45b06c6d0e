"""The celery-once and celery-singleton shims, with tasks written as those libraries' docs show.

Real Redis (broker db 24, results db 25, the libraries' lock URL db 26, an
explicit ``dedup_store`` db 27) and a real in-thread worker.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_dedup import DeduplicatedResult, inspect_lock
from celery_dedup import DuplicateTaskError as CoreDuplicateTaskError
from celery_dedup.compat.celery_once import AlreadyQueued, QueueOnce
from celery_dedup.compat.celery_singleton import DuplicateTaskError, Singleton, clear_locks
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import Lock
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

BROKER_DB, BACKEND_DB, LIB_DB, STORE_DB = 24, 25, 26, 27
AppFactory = Callable[..., Celery]


def wait_for(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll ``check`` until it returns something truthy, or fail."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.05)
    return value


def lock_of(app: Celery, result: Any) -> Lock | None:
    """The live lock a published call's result holds, or ``None``."""
    return inspect_lock(result.deduplication_key, app=app)


def lifetime(lock: Lock | None) -> float:
    """The TTL a lock was taken with."""
    assert lock is not None
    return lock.expires_at - lock.acquired_at


@pytest.fixture
def make_app(redis_server: RedisServer) -> Iterator[AppFactory]:
    """Apps on flushed Redis dbs 24-27, with the given settings; closed afterwards."""
    for db in (BROKER_DB, BACKEND_DB, LIB_DB, STORE_DB):
        redis_server.client(db).flushdb()
    apps: list[Celery] = []

    def factory(**conf: Any) -> Celery:
        app = Celery("compat", set_as_current=False)
        app.conf.update(
            broker_url=redis_server.url(BROKER_DB),
            result_backend=redis_server.url(BACKEND_DB),
            task_default_queue="q-compat",
            broker_connection_retry_on_startup=False,
            worker_hijack_root_logger=False,
            **conf,
        )
        apps.append(app)
        return app

    yield factory
    for app in apps:
        runtime_for(app).metrics.flush()
        app.close()
    for db in (BROKER_DB, BACKEND_DB, LIB_DB, STORE_DB):
        redis_server.client(db).flushdb()


def worker(app: Celery) -> AbstractContextManager[Any]:
    """A real worker for ``app`` in this process (threads pool)."""
    return start_worker(
        app, pool="threads", perform_ping_check=False, shutdown_timeout=30, loglevel="WARNING"
    )


@pytest.fixture
def once_app(make_app: AppFactory, redis_server: RedisServer) -> Celery:
    """An app configured the way celery-once's README shows, its lock URL on db 26."""
    return make_app(
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": redis_server.url(LIB_DB), "default_timeout": 60 * 60},
        }
    )


# -- celery-once ---------------------------------------------------------------


def test_once_duplicate_raises_already_queued_until_the_task_ran(
    once_app: Celery, redis_server: RedisServer
) -> None:
    """A second delay raises AlreadyQueued with the seconds left; after the run it publishes."""

    @once_app.task(base=QueueOnce, shared=False)
    def slow_task(seconds: int) -> str:
        return "Done!"

    first = slow_task.delay(10)
    with pytest.raises(AlreadyQueued) as raised:
        slow_task.delay(10)
    assert isinstance(raised.value, CoreDuplicateTaskError)
    assert 3500 < raised.value.countdown <= 3600
    assert raised.value.existing_task_id == first.id
    assert slow_task.apply_async(args=(11,)).deduplicated is False
    # ONCE['settings']['url'] became the lock store.
    assert len(redis_server.client(LIB_DB).keys("*slow_task*")) == 2

    with worker(once_app):
        assert first.get(timeout=10) == "Done!"
        wait_for(lambda: lock_of(once_app, first) is None)
    assert slow_task.delay(10).deduplicated is False


def test_once_graceful_task_option_returns_the_holder(once_app: Celery) -> None:
    """With once={'graceful': True} a duplicate returns the holder's result instead of raising."""

    @once_app.task(base=QueueOnce, once={"graceful": True}, shared=False)
    def slow_task() -> str:
        return "Done!"

    first = slow_task.delay()
    second = slow_task.delay()
    assert isinstance(second, DeduplicatedResult)
    assert second.id == first.id
    with pytest.raises(AlreadyQueued):
        slow_task.apply_async(once={"graceful": False})


def test_once_per_call_options_and_default_timeout(make_app: AppFactory) -> None:
    """Per-call once= sets graceful and timeout; ONCE default_timeout sets the task's TTL."""
    app = make_app(
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"default_timeout": 120}}
    )

    @app.task(base=QueueOnce, shared=False)
    def example(n: int) -> int:
        return n

    @app.task(base=QueueOnce, once={"timeout": 60 * 60 * 10}, shared=False)
    def long_running_task() -> None:
        return None

    assert lifetime(lock_of(app, example.delay(1))) == pytest.approx(120, abs=1)
    assert lifetime(lock_of(app, long_running_task.delay())) == pytest.approx(36000, abs=1)
    short = example.apply_async(args=(2,), once={"timeout": 30})
    assert lifetime(lock_of(app, short)) == pytest.approx(30, abs=1)
    duplicate = example.apply_async(args=(2,), once={"graceful": True})
    assert duplicate.deduplicated is True and duplicate.id == short.id


def test_once_keys_restrict_the_lock(once_app: Celery) -> None:
    """once={'keys': ['a']} locks on a alone; once={'keys': []} on no argument at all."""

    @once_app.task(base=QueueOnce, once={"keys": ["a"]}, shared=False)
    def slow_add(a: int, b: int) -> int:
        return a + b

    @once_app.task(base=QueueOnce, once={"keys": []}, shared=False)
    def only_one(a: int, b: int) -> int:
        return a + b

    slow_add.delay(1, 1)
    with pytest.raises(AlreadyQueued):
        slow_add.delay(1, 2)
    assert slow_add.delay(2, 2).deduplicated is False

    only_one.delay(1, 1)
    with pytest.raises(AlreadyQueued):
        only_one.delay(2, 2)


def test_once_releases_after_a_failure(once_app: Celery) -> None:
    """As celery-once's after_return does, a failing task releases its lock ('finish')."""

    @once_app.task(base=QueueOnce, shared=False)
    def broken(n: int) -> None:
        raise ValueError(n)

    first = broken.delay(1)
    lock = lock_of(once_app, first)
    assert lock is not None and lock.policy == "finish"
    with worker(once_app):
        with pytest.raises(ValueError):
            first.get(timeout=10)
        wait_for(lambda: lock_of(once_app, first) is None)
    assert broken.delay(1).deduplicated is False


def test_once_unlock_before_run_releases_as_the_task_starts(once_app: Celery) -> None:
    """With unlock_before_run the lock is gone while the body still runs."""
    started, proceed = threading.Event(), threading.Event()

    @once_app.task(base=QueueOnce, once={"unlock_before_run": True}, shared=False)
    def slow_task() -> str:
        started.set()
        proceed.wait(10)
        return "Done!"

    first = slow_task.delay()
    lock = lock_of(once_app, first)
    assert lock is not None and lock.policy == "start"
    with worker(once_app):
        try:
            assert started.wait(10)
            assert lock_of(once_app, first) is None
            second = slow_task.delay()
            assert second.deduplicated is False
        finally:
            proceed.set()
        assert first.get(timeout=10) == "Done!"
        assert second.get(timeout=10) == "Done!"


def test_explicit_dedup_store_wins_over_once_url(
    make_app: AppFactory, redis_server: RedisServer
) -> None:
    """ONCE['settings']['url'] is only a fallback: an explicit dedup_store keeps the locks."""
    app = make_app(
        dedup_store=redis_server.url(STORE_DB),
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": redis_server.url(LIB_DB)},
        },
    )

    @app.task(base=QueueOnce, shared=False)
    def slow_task() -> None:
        return None

    slow_task.delay()
    assert len(redis_server.client(STORE_DB).keys("*slow_task*")) == 1
    assert redis_server.client(LIB_DB).keys("*slow_task*") == []


# -- celery-singleton ----------------------------------------------------------


def test_singleton_returns_the_existing_result_until_the_task_ran(
    make_app: AppFactory, redis_server: RedisServer
) -> None:
    """The README's do_stuff: equal calls share one AsyncResult until the task has run."""
    app = make_app(singleton_backend_url=redis_server.url(LIB_DB))

    @app.task(base=Singleton, shared=False)
    def do_stuff(*args: Any, **kwargs: Any) -> str:
        return "I just woke up"

    async_result = do_stuff.delay(1, 2, 3, a="b")
    async_result2 = do_stuff.delay(1, 2, 3, a="b")
    assert async_result == async_result2
    assert async_result2.deduplicated is True
    c = do_stuff.delay(4, 5, 6)
    assert c != async_result
    assert len(redis_server.client(LIB_DB).keys("*do_stuff*")) == 2

    with worker(app):
        assert async_result.get(timeout=10) == "I just woke up"
        wait_for(lambda: lock_of(app, async_result) is None)
    d = do_stuff.delay(1, 2, 3, a="b")
    assert d != async_result and d.deduplicated is False


def test_singleton_raise_on_duplicate_from_task_and_settings(make_app: AppFactory) -> None:
    """raise_on_duplicate, or singleton_raise_on_duplicate, raises DuplicateTaskError (task_id)."""
    app = make_app(singleton_raise_on_duplicate=True)

    @app.task(base=Singleton, raise_on_duplicate=True, shared=False)
    def do_something(username: str) -> None:
        return None

    @app.task(base=Singleton, shared=False)
    def from_settings(username: str) -> None:
        return None

    @app.task(base=Singleton, raise_on_duplicate=False, shared=False)
    def overridden(username: str) -> None:
        return None

    task1 = do_something.delay("bob")
    with pytest.raises(DuplicateTaskError) as raised:
        do_something.delay("bob")
    assert raised.value.task_id == task1.id
    assert isinstance(raised.value, CoreDuplicateTaskError)

    holder = from_settings.delay("bob")
    with pytest.raises(DuplicateTaskError):
        from_settings.delay("bob")
    assert holder.deduplicated is False

    first = overridden.delay("bob")
    assert overridden.delay("bob") == first


def test_singleton_unique_on(make_app: AppFactory) -> None:
    """unique_on=['username'] makes calls differing only in otherarg duplicates."""
    app = make_app()

    @app.task(base=Singleton, unique_on=["username"], shared=False)
    def do_something(username: str, otherarg: int | None = None) -> None:
        return None

    task1 = do_something.delay(username="bob", otherarg=99)
    task2 = do_something.delay(username="bob", otherarg=100)
    assert task1 == task2 and task2.deduplicated is True
    assert do_something.delay(username="alice", otherarg=99).deduplicated is False


def test_singleton_lock_expiry(make_app: AppFactory) -> None:
    """lock_expiry, then singleton_lock_expiry, then dedup_default_ttl set the lock's TTL."""
    app = make_app(singleton_lock_expiry=20)

    @app.task(base=Singleton, lock_expiry=1, shared=False)
    def runs_briefly() -> None:
        return None

    @app.task(base=Singleton, shared=False)
    def from_settings() -> None:
        return None

    assert lifetime(lock_of(app, from_settings.delay())) == pytest.approx(20, abs=1)
    other = make_app(dedup_default_ttl=900)

    @other.task(base=Singleton, shared=False)
    def no_expiry() -> None:
        return None

    assert lifetime(lock_of(other, no_expiry.delay())) == pytest.approx(900, abs=1)

    task1 = runs_briefly.delay()
    assert runs_briefly.delay() == task1
    time.sleep(1.2)
    task2 = runs_briefly.delay()
    assert task1 != task2


def test_singleton_releases_after_a_failure(make_app: AppFactory) -> None:
    """A failing Singleton task releases its lock (celery-singleton's on_failure)."""
    app = make_app()

    @app.task(base=Singleton, shared=False)
    def broken(n: int) -> None:
        raise ValueError(n)

    first = broken.delay(1)
    with worker(app):
        with pytest.raises(ValueError):
            first.get(timeout=10)
        wait_for(lambda: lock_of(app, first) is None)
    assert broken.delay(1) != first


def test_clear_locks_releases_every_lock_of_the_app(
    make_app: AppFactory, redis_server: RedisServer
) -> None:
    """clear_locks(app) releases every lock under singleton_key_prefix; release_lock just one."""
    app = make_app(singleton_key_prefix="SINGLETONLOCK_")

    @app.task(base=Singleton, shared=False)
    def do_stuff(n: int) -> None:
        return None

    first, second = do_stuff.delay(1), do_stuff.delay(2)
    assert first.deduplication_key.startswith("SINGLETONLOCK_:")
    assert do_stuff.release_lock(task_args=[2]) is True
    assert lock_of(app, second) is None
    third = do_stuff.delay(3)

    assert clear_locks(app) == 2
    assert lock_of(app, first) is None and lock_of(app, third) is None
    assert do_stuff.delay(1) != first
    assert clear_locks(app) == 1


def test_shims_are_not_imported_by_the_package() -> None:
    """import celery_dedup leaves the compat modules unimported."""
    code = (
        "import sys, celery_dedup; "
        "print(sorted(m for m in sys.modules if m.startswith('celery_dedup.compat')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
