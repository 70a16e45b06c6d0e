"""The helpers of ``celery_dedup.testing``, end to end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult

from celery_dedup import DedupTask, enqueue_many, release
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import lock_acquired
from celery_dedup.stores.memory import MemoryStore
from celery_dedup.testing import (
    assert_deduplicated,
    assert_not_deduplicated,
    capture_dedup_signals,
    held_locks,
    memory_store,
)


def wait_for(predicate: Callable[[], Any], timeout: float = 15) -> Any:
    """Poll ``predicate`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.02)
    return value


@pytest.fixture
def eager_app() -> Iterator[Celery]:
    """An eager app with an in-memory broker and no result backend."""
    app = Celery("testing_helpers", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    yield app
    app.close()


@pytest.fixture
def tasks(eager_app: Celery) -> dict[str, Any]:
    """Two throttled tasks (TTL-only locks) registered on ``eager_app``."""

    @eager_app.task(base=DedupTask, shared=False, unique_for=60, unique_until="expiry")
    def sync_address(user_id: int, address: dict[str, str]) -> int:
        return user_id

    @eager_app.task(base=DedupTask, shared=False, unique_for=60, unique_until="expiry")
    def send_digest(user_id: int) -> int:
        return user_id

    return {"sync_address": sync_address, "send_digest": send_digest}


def test_memory_store_deduplicates_and_restores(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """Calls lock in a fresh memory store inside the block; the app's own store comes back after."""
    eager_app.conf.dedup_store = "memory://testing-restore"
    configured = MemoryStore.from_url("memory://testing-restore")
    configured.clear()
    sync_address = tasks["sync_address"]
    with memory_store(eager_app) as store:
        assert runtime_for(eager_app).store is store
        first = sync_address.delay(42, {"zip": "10115"})
        second = sync_address.delay(user_id=42, address={"zip": "10115"})
        assert first.get() == 42
        assert second.deduplicated is True and second.id == first.id
        assert [lock.task_id for lock in store.scan("")] == [first.id]
    assert runtime_for(eager_app).store is configured
    assert list(configured.scan("")) == []
    third = sync_address.delay(42, {"zip": "10115"})
    assert third.deduplicated is False
    assert [lock.task_id for lock in configured.scan("")] == [third.id]
    configured.clear()


def test_memory_store_is_fresh_each_time(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """Locks taken in one block are gone in the next one."""
    send_digest = tasks["send_digest"]
    with memory_store(eager_app):
        assert send_digest.delay(7).deduplicated is False
        assert send_digest.delay(7).deduplicated is True
    with memory_store(eager_app):
        assert send_digest.delay(7).deduplicated is False


def test_memory_store_of_a_task_patches_its_app(
    eager_app: Celery, tasks: dict[str, Any]
) -> None:
    """Given a task, ``memory_store`` patches the app the task is bound to, not another app."""
    other = Celery("throwaway", broker="memory://", set_as_current=False)
    send_digest = tasks["send_digest"]
    try:
        with memory_store(other), pytest.raises(Exception, match="no lock store"):
            send_digest.delay(1)  # the task's own app was left alone
        with memory_store(send_digest) as store:
            first = send_digest.delay(1)
            assert [lock.task_id for lock in store.scan("")] == [first.id]
            assert [lock.task_id for lock in held_locks(send_digest)] == [first.id]
            assert held_locks(tasks["sync_address"]) == []
    finally:
        other.close()


def test_memory_store_clock_expires_locks(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """A fake clock passed to ``memory_store`` lets a lock expire without sleeping."""
    now = [1_000_000.0]
    send_digest = tasks["send_digest"]
    with memory_store(eager_app, clock=lambda: now[0]):
        first = send_digest.delay(7)
        assert send_digest.delay(7).deduplicated is True
        now[0] += 61
        later = send_digest.delay(7)
        assert later.deduplicated is False and later.id != first.id


def test_assert_deduplicated(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """``assert_deduplicated`` passes for a suppressed call and explains a published one."""
    send_digest = tasks["send_digest"]
    with memory_store(eager_app):
        first = send_digest.delay(7)
        duplicate = send_digest.delay(7)
        assert_deduplicated(duplicate)
        with pytest.raises(AssertionError, match="expected a suppressed duplicate") as info:
            assert_deduplicated(first)
        assert first.id in str(info.value)


def test_assert_not_deduplicated(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """``assert_not_deduplicated`` passes for a published call and names the holder otherwise."""
    send_digest = tasks["send_digest"]
    with memory_store(eager_app):
        first = send_digest.delay(7)
        assert_not_deduplicated(first)
        duplicate = send_digest.delay(7)
        with pytest.raises(AssertionError, match="suppressed as a duplicate") as info:
            assert_not_deduplicated(duplicate)
        assert first.id in str(info.value)


def test_assertions_refuse_foreign_results(eager_app: Celery) -> None:
    """A result that celery-dedup did not return fails both assertions."""
    foreign: AsyncResult[Any] = AsyncResult("not-from-dedup", app=eager_app)
    for check in (assert_deduplicated, assert_not_deduplicated):
        with pytest.raises(AssertionError, match="has no `deduplicated` flag"):
            check(foreign)


def test_assertions_accept_enqueue_many(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """Group results of ``enqueue_many`` work with both assertions."""
    send_digest = tasks["send_digest"]
    eager_app.conf.update(
        task_always_eager=False,
        result_backend="cache+memory://",
        dedup_store="memory://testing-batch",
    )
    with memory_store(eager_app):
        batch = [send_digest.s(1), send_digest.s(2)]
        first = enqueue_many(batch, deduplication_key="digest:batch", app=eager_app)
        again = enqueue_many(batch, deduplication_key="digest:batch", app=eager_app)
        assert_not_deduplicated(first)
        assert_deduplicated(again)
        batch_locks = held_locks(eager_app, "celery_dedup.batch")
        assert [lock.task_id for lock in batch_locks] == [first.id]
        # Members are DedupTasks too: each takes its own lock while it is free.
        assert len(held_locks(eager_app, send_digest)) == 2


def test_held_locks_filters_by_task(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """``held_locks`` lists live locks, optionally of one task (object or name)."""
    sync_address, send_digest = tasks["sync_address"], tasks["send_digest"]
    with memory_store(eager_app):
        assert held_locks(eager_app) == []
        a = sync_address.delay(1, {"zip": "1"})
        b = send_digest.delay(2)
        c = send_digest.delay(3)
        assert sorted(lock.task_id for lock in held_locks(eager_app)) == sorted([a.id, b.id, c.id])
        assert [lock.task_id for lock in held_locks(eager_app, sync_address)] == [a.id]
        by_name = held_locks(eager_app, send_digest.name)
        assert sorted(lock.task_id for lock in by_name) == sorted([b.id, c.id])
        assert all(lock.task_name == send_digest.name for lock in by_name)
        assert release(b, app=eager_app) is True
        assert [lock.task_id for lock in held_locks(eager_app, send_digest)] == [c.id]


def test_held_locks_of_a_task_name_that_prefixes_another(eager_app: Celery) -> None:
    """``held_locks(app, "jobs")`` never lists the locks of task ``jobs:nightly``."""

    @eager_app.task(base=DedupTask, name="jobs", shared=False, unique_until="expiry")
    def jobs(n: int) -> int:
        return n

    @eager_app.task(base=DedupTask, name="jobs:nightly", shared=False, unique_until="expiry")
    def nightly(n: int) -> int:
        return n

    with memory_store(eager_app):
        first, other = jobs.delay(1), nightly.delay(1)
        assert [lock.task_id for lock in held_locks(eager_app, "jobs")] == [first.id]
        assert [lock.task_id for lock in held_locks(nightly)] == [other.id]


def test_held_locks_without_store(eager_app: Celery) -> None:
    """An app with no derivable store makes ``held_locks`` raise instead of returning []."""
    runtime_for(eager_app).use_store(None)
    with pytest.raises(Exception, match="no lock store"):
        held_locks(eager_app)


def test_capture_dedup_signals(eager_app: Celery, tasks: dict[str, Any]) -> None:
    """Signals sent inside the block are recorded in order; none after it."""
    send_digest = tasks["send_digest"]
    with memory_store(eager_app), capture_dedup_signals() as sent:
        first = send_digest.delay(7)
        send_digest.delay(7)
        assert release(first, app=eager_app) is True
        assert [s.name for s in sent] == ["lock_acquired", "task_deduplicated", "lock_released"]
        acquired = sent.named("lock_acquired")[0]
        assert acquired.sender.name == send_digest.name
        assert acquired.kwargs["task_id"] == first.id
        assert acquired.kwargs["policy"] == "expiry"
        assert "signal" not in acquired.kwargs
        duplicate = sent.named("task_deduplicated")[0]
        assert duplicate.kwargs["existing_task_id"] == first.id
        assert sent.named("lock_released")[0].kwargs["reason"] == "manual"
        with pytest.raises(ValueError, match="no celery-dedup signal"):
            sent.named("lock_lost")
    lock_acquired.send(sender=None, key="k", task_id="t", ttl=1.0, policy="expiry")
    assert len(sent) == 3


@pytest.mark.redis
def test_helpers_with_a_real_worker(redis_url: str) -> None:
    """With a real worker and Redis the helpers see the lock while it runs and its release."""
    app = Celery("testing_worker", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        result_backend=redis_url,
        task_default_queue="q-testing-helpers",
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
    )
    gate = threading.Event()

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def slow(n: int) -> int:
        gate.wait(15)
        return n

    with (
        capture_dedup_signals() as sent,
        start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"),
    ):
        first = slow.delay(1)
        assert_not_deduplicated(first)
        duplicate = slow.delay(1)
        assert_deduplicated(duplicate)
        assert duplicate.id == first.id
        assert [lock.task_id for lock in held_locks(app, slow)] == [first.id]
        gate.set()
        assert first.get(timeout=15) == 1
        released = wait_for(lambda: sent.named("lock_released"))
        assert released[0].kwargs["task_id"] == first.id
        assert released[0].kwargs["reason"] == "success"
        assert held_locks(app, slow) == []
        again = slow.delay(1)
        assert_not_deduplicated(again)
        assert again.get(timeout=15) == 1
    # Write the counters now, while this test's Redis still runs (not at exit).
    runtime_for(app).metrics.flush()
    app.close()
