"""celery-once's documented behaviour through the shim: its README and its own tests, ported.

Each test names the README section or the celery-once test it stands for.
Real Redis and a real worker; the lock store is the one ``ONCE`` names.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.result import EagerResult

from celery_dedup import DeduplicatedResult, ImproperlyConfigured, inspect_lock
from celery_dedup import DuplicateTaskError as CoreDuplicateTaskError
from celery_dedup.compat.celery_once import AlreadyQueued, QueueOnce
from tests.compat.conftest import (
    LIB_DB,
    STORE_DB,
    AppFactory,
    lifetime,
    lock_of,
    wait_for,
    worker,
)
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
def once_app(make_app: AppFactory, lib_url: str) -> Celery:
    """An app configured as celery-once's README shows, its lock URL on db 26."""
    return make_app(
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": lib_url, "default_timeout": 60 * 60},
        }
    )


# -- README: usage, graceful, keys, timeout, unlock_before_run -----------------


def test_duplicate_raises_already_queued_until_the_task_ran(
    once_app: Celery, redis_server: RedisServer
) -> None:
    """README usage (test_delay_1/2, test_apply_async_1/2): AlreadyQueued until the run ends."""

    @once_app.task(base=QueueOnce, shared=False)
    def slow_task(seconds: int) -> str:
        return "Done!"

    first = slow_task.delay(10)
    with pytest.raises(AlreadyQueued) as raised:
        slow_task.delay(10)
    with pytest.raises(AlreadyQueued):
        slow_task.apply_async(args=(10,))
    assert isinstance(raised.value, CoreDuplicateTaskError)
    assert 3500 < raised.value.countdown <= 3600
    assert raised.value.message == f"Expires in {raised.value.countdown} seconds"
    assert raised.value.existing_task_id == first.id
    assert slow_task.apply_async(args=(11,)).deduplicated is False
    # ONCE['settings']['url'] is the lock store.
    assert len(redis_server.client(LIB_DB).keys("*slow_task*")) == 2

    with worker(once_app):
        assert first.get(timeout=10) == "Done!"
        wait_for(lambda: lock_of(once_app, first) is None)
    assert slow_task.delay(10).deduplicated is False


def test_graceful_returns_the_holder(once_app: Celery) -> None:
    """README graceful (test_apply_async_3, test_already_queued_graceful): no exception."""

    @once_app.task(base=QueueOnce, once={"graceful": True}, shared=False)
    def slow_task() -> str:
        return "Done!"

    @once_app.task(base=QueueOnce, shared=False)
    def example(n: int) -> int:
        return n

    first = slow_task.delay()
    second = slow_task.delay()
    assert isinstance(second, DeduplicatedResult)
    assert second.id == first.id and second.result is None
    with pytest.raises(AlreadyQueued):
        slow_task.apply_async(once={"graceful": False})

    example.delay(1)
    graceful = example.apply_async(args=(1,), once={"graceful": True})
    assert graceful.deduplicated is True and graceful.result is None


def test_apply_runs_the_task_while_a_copy_is_queued(once_app: Celery) -> None:
    """README graceful: ``example.apply(args=(10,), once={'graceful': True})`` runs in place."""

    @once_app.task(base=QueueOnce, shared=False)
    def example(n: int) -> int:
        return n * 2

    queued = example.delay(10)
    result = example.apply(args=(10,), once={"graceful": True})  # type: ignore[call-arg]
    assert isinstance(result, EagerResult)
    assert result.get() == 20
    holder = lock_of(once_app, queued)
    assert holder is not None and holder.task_id == queued.id


def test_keys_restrict_the_lock(once_app: Celery) -> None:
    """README keys: once={'keys': ['a']} locks on a alone; once={'keys': []} on no argument."""

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


def test_timeouts(make_app: AppFactory, lib_url: str) -> None:
    """README timeout, test_default_timeout, test_apply_async_timeout, test_delay_3."""
    app = make_app(
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": lib_url, "default_timeout": 120},
        }
    )

    @app.task(base=QueueOnce, shared=False)
    def example(n: int) -> int:
        return n

    @app.task(base=QueueOnce, once={"timeout": 60 * 60 * 10}, shared=False)
    def long_running_task() -> None:
        return None

    @app.task(base=QueueOnce, once={"timeout": 1}, shared=False)
    def brief() -> None:
        return None

    assert example.default_timeout == 120
    assert lifetime(lock_of(app, example.delay(1))) == pytest.approx(120, abs=1)
    assert lifetime(lock_of(app, long_running_task.delay())) == pytest.approx(36000, abs=1)
    short = example.apply_async(args=(2,), once={"timeout": 30})
    assert lifetime(lock_of(app, short)) == pytest.approx(30, abs=1)

    first = brief.delay()
    with pytest.raises(AlreadyQueued):
        brief.delay()
    time.sleep(1.2)  # the lock expired: a new call is accepted
    assert brief.delay().id != first.id


def test_unlock_before_run_releases_as_the_task_starts(once_app: Celery) -> None:
    """README unlock_before_run (test_delay_unlock_before_run_1): free while the body runs."""
    started, proceed = threading.Event(), threading.Event()

    @once_app.task(base=QueueOnce, once={"unlock_before_run": True}, shared=False)
    def slow_task() -> str:
        started.set()
        proceed.wait(10)
        return "Done!"

    first = slow_task.delay()
    lock = lock_of(once_app, first)
    assert lock is not None and lock.policy == "start"
    assert slow_task.unlock_before_run() is True
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


def test_unlock_before_run_leaves_a_lock_taken_during_the_run(once_app: Celery) -> None:
    """test_delay_unlock_before_run_2: the end of the run does not clear a newer lock."""

    @once_app.task(base=QueueOnce, once={"keys": [], "unlock_before_run": True}, shared=False)
    def relock(again: bool) -> str | None:
        if again:
            return str(relock.apply_async((False,), countdown=60).id)
        return None

    first = relock.delay(True)
    with worker(once_app):
        second_id = first.get(timeout=10)
        holder = wait_for(lambda: inspect_lock(first.deduplication_key, app=once_app))
        assert holder.task_id == second_id


@pytest.mark.parametrize("unlock_before_run", [False, True])
def test_eager_run_holds_the_lock_until_it_returns(
    make_app: AppFactory, lib_url: str, unlock_before_run: bool
) -> None:
    """test_delay_1, test_apply_async_1, test_delay_unlock_before_run_1 (always eager)."""
    app = make_app(
        task_always_eager=True,
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": lib_url}},
    )

    @app.task(
        base=QueueOnce, once={"keys": ["a"], "unlock_before_run": unlock_before_run}, shared=False
    )
    def example(a: int = 1, b: int = 0) -> bool:
        key = example.get_key(kwargs={"a": a})
        return key is not None and inspect_lock(key, app=app) is not None

    assert example.delay().get() is not unlock_before_run
    assert example.apply_async(args=(1, 2)).get() is not unlock_before_run
    assert inspect_lock(example.get_key(kwargs={"a": 1}) or "", app=app) is None


def test_a_failure_releases_the_lock(once_app: Celery) -> None:
    """README: the lock clears once the task completes "or ends due to an exception"."""

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


def test_a_retry_keeps_the_lock_until_it_ran(once_app: Celery) -> None:
    """test_retry: the retry is published without AlreadyQueued; the lock clears after it."""

    @once_app.task(base=QueueOnce, once={"keys": []}, bind=True, shared=False)
    def example_retry(self: Any, a: int = 1) -> str:
        if not self.request.retries:
            raise self.retry(countdown=1)
        return "retried"

    first = example_retry.delay()
    with worker(once_app):
        wait_for(lambda: first.state == states.RETRY)
        with pytest.raises(AlreadyQueued):
            example_retry.delay()
        assert first.get(timeout=10) == "retried"
        wait_for(lambda: lock_of(once_app, first) is None)


def test_a_chain_whose_first_step_is_queued_raises(once_app: Celery) -> None:
    """test_chain_requeued (an expected failure in celery-once): the chain is refused whole."""

    @once_app.task(base=QueueOnce, once={"keys": ["a"]}, shared=False)
    def example(a: int = 1) -> int:
        return a

    @once_app.task(shared=False)
    def example_chained_task(value: Any) -> Any:
        return value

    example.delay(1)
    with pytest.raises(AlreadyQueued):
        (example.s(1) | example_chained_task.s()).apply_async()


# -- celery-once's public methods and attributes --------------------------------


def test_get_key_and_config_attributes(once_app: Celery) -> None:
    """test_get_key_*, test_config, test_once_config, test_default_timeout."""

    @once_app.task(base=QueueOnce, shared=False)
    def simple_example() -> str:
        return "simple"

    @once_app.task(base=QueueOnce, bind=True, shared=False)
    def bound_task(self: Any, a: int, b: int) -> int:
        return a + b

    @once_app.task(base=QueueOnce, shared=False)
    def args_example(a: int, b: int) -> int:
        return a + b

    @once_app.task(base=QueueOnce, once={"keys": ["a"]}, shared=False)
    def select_args_example(a: int, b: int) -> int:
        return a + b

    @once_app.task(base=QueueOnce, autoretry_for=(Exception,), shared=False)
    def autoretry_for_example(a: int, b: int) -> int:
        return a + b

    assert simple_example.get_key() == simple_example.get_key(args=(), kwargs={})
    for task in (args_example, bound_task, autoretry_for_example):
        assert task.get_key(kwargs={"a": 1, "b": 2}) == task.get_key(args=(1, 2))
        assert task.get_key(args=(1, 2)) != task.get_key(args=(1, 3))
    assert select_args_example.get_key(kwargs={"a": 1, "b": 2}) == select_args_example.get_key(
        args=(1, 3)
    )
    result = args_example.delay(1, 2)
    assert result.deduplication_key == args_example.get_key(args=(1, 2))

    assert simple_example.config is once_app.conf
    assert simple_example.once_config == once_app.conf.ONCE
    assert simple_example.default_timeout == 3600


def test_clear_lock_releases_a_held_key(once_app: Celery) -> None:
    """test_clear_lock / test_redis_clear_lock: once_backend.clear_lock(key) frees the key."""

    @once_app.task(base=QueueOnce, shared=False)
    def example(a: int) -> int:
        return a

    first = example.delay(1)
    key = example.get_key(args=(1,))
    assert key is not None and example.once_backend.clear_lock(key) is True
    assert lock_of(once_app, first) is None
    assert example.delay(1).deduplicated is False
    assert example.once_backend.clear_lock("qo_never_taken") is False


def test_get_key_override_decides_the_lock(once_app: Celery) -> None:
    """An overridden get_key is the lock: equal strings share it, whichever task made them."""

    class AccountOnce(QueueOnce):
        def get_key(self, args: Any = None, kwargs: Any = None) -> str:
            return f"qo_account_{(kwargs or {}).get('account', (args or [None])[0])}"

    @once_app.task(base=AccountOnce, shared=False)
    def sync_account(account: int, full: bool = False) -> int:
        return account

    @once_app.task(base=AccountOnce, shared=False)
    def close_account(account: int) -> int:
        return account

    first = sync_account.delay(7)
    with pytest.raises(AlreadyQueued) as raised:
        sync_account.delay(7, full=True)
    assert raised.value.existing_task_id == first.id
    with pytest.raises(AlreadyQueued):
        close_account.delay(account=7)
    assert sync_account.delay(8).deduplicated is False

    assert sync_account.once_backend.clear_lock("qo_account_7") is True
    second = close_account.delay(7)
    with worker(once_app):
        assert second.get(timeout=10) == 7
        wait_for(lambda: lock_of(once_app, second) is None)
    assert sync_account.delay(7).deduplicated is False


def test_an_app_context_subclass_runs_and_releases(once_app: Celery) -> None:
    """README Flask integration: a QueueOnce subclass wrapping __call__ keeps the lock cycle."""
    contexts: list[str] = []

    class ContextQueueOnce(QueueOnce):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            contexts.append("entered")  # stands for ``with app.app_context():``
            return super().__call__(*args, **kwargs)

    @once_app.task(base=ContextQueueOnce, shared=False)
    def example_task(value: int) -> int:
        return value

    first = example_task.delay(3)
    with pytest.raises(AlreadyQueued):
        example_task.delay(3)
    with worker(once_app):
        assert first.get(timeout=10) == 3
        wait_for(lambda: lock_of(once_app, first) is None)
    assert contexts == ["entered"]


def test_already_queued_as_celery_once_builds_it() -> None:
    """AlreadyQueued(countdown): countdown, message, args and str() as in celery-once."""
    exc = AlreadyQueued(60)
    assert exc.countdown == 60 and isinstance(exc.countdown, int)
    assert exc.message == "Expires in 60 seconds"
    assert exc.args == (60,) and str(exc) == "60"
    assert AlreadyQueued(30.0).message == "Expires in 30.0 seconds"
    assert isinstance(exc, CoreDuplicateTaskError)


# -- backends and settings -------------------------------------------------------


def test_explicit_dedup_store_wins_over_once_url(
    make_app: AppFactory, redis_server: RedisServer, lib_url: str
) -> None:
    """ONCE['settings']['url'] is only a fallback: an explicit dedup_store keeps the locks."""
    app = make_app(
        dedup_store=redis_server.url(STORE_DB),
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": lib_url}},
    )

    @app.task(base=QueueOnce, shared=False)
    def slow_task() -> None:
        return None

    slow_task.delay()
    assert len(redis_server.client(STORE_DB).keys("*slow_task*")) == 1
    assert redis_server.client(LIB_DB).keys("*slow_task*") == []


@pytest.mark.sqlite
def test_file_backend_locks_in_a_file_under_its_location(
    make_app: AppFactory, tmp_path: Path
) -> None:
    """README File backend: its ``location`` holds a SQLite store every local process shares."""
    once = {
        "backend": "celery_once.backends.File",
        "settings": {"location": str(tmp_path / "celery_once"), "default_timeout": 60 * 60},
    }
    app, other = make_app(ONCE=once), make_app(ONCE=once)

    @app.task(base=QueueOnce, name="tasks.slow_task", shared=False)
    def slow_task() -> str:
        return "Done!"

    @other.task(base=QueueOnce, name="tasks.slow_task", shared=False)
    def same_task() -> str:
        return "Done!"

    first = slow_task.delay()
    assert app.conf.dedup_store.startswith("db+sqlite:///")
    assert list((tmp_path / "celery_once").iterdir())
    with pytest.raises(AlreadyQueued):
        same_task.delay()
    with worker(app):
        assert first.get(timeout=10) == "Done!"
        wait_for(lambda: lock_of(app, first) is None)
    assert same_task.delay().deduplicated is False


def test_no_usable_store_fails_loudly(make_app: AppFactory) -> None:
    """With no lock store (no URL, no Redis/SQL backend), a call raises instead of publishing."""
    app = make_app(
        broker_url="memory://",
        result_backend=None,
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"default_timeout": 60}},
    )

    @app.task(base=QueueOnce, shared=False)
    def example() -> None:
        return None

    with pytest.raises(ImproperlyConfigured, match="ONCE"):
        example.delay()


def test_unknown_backend_warns_with_the_store_used(
    make_app: AppFactory, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend celery-dedup has no equivalent for is named in a warning, with the store used."""
    app = make_app(
        ONCE={
            "backend": "myproject.locks.NoSuchBackend",
            "settings": {"blocking": True, "blocking_timeout": 30},
        }
    )

    @app.task(base=QueueOnce, shared=False)
    def example() -> None:
        return None

    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        example.delay()
        example.apply_async(once={"graceful": True})
    warnings = [r.getMessage() for r in caplog.records if r.name == "celery_dedup"]
    backend = redis_server.url(25)
    assert warnings == [
        "celery-dedup: ONCE['backend']='myproject.locks.NoSuchBackend' has no celery-dedup "
        f"equivalent; using {backend} instead",
        "celery-dedup: ONCE['settings']['blocking'] is ignored: taking a lock never waits",
    ]
