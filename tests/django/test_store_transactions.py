"""Lock writes and the caller's transaction, with a real worker.

The Django DB store writes through its own autocommit connection, so what
the caller's ``transaction.atomic()`` does later never changes a lock:

- the worker finishes before the caller commits → its release is seen, the
  lock is gone (not left for its TTL);
- the caller rolls back → the lock stays with the message that was
  published, so a retried request is a duplicate of it and the work runs once.

SQLite has one writer: inside ``atomic()`` the store writes through the
caller's connection, and the worker's start check waits for the commit. And
``delay_on_commit`` publishes (and locks) only when the transaction commits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from django.db import transaction
from django.test import override_settings

from celery_dedup import DedupTask
from celery_dedup.contrib.django.models import DedupCounter
from celery_dedup.runtime import reset_runtime, runtime_for
from celery_dedup.stores.base import Lock
from celery_dedup.stores.django import DjangoStore
from tests.django.conftest import PG_ALIAS
from tests.django.test_django_store import MARIA_ALIAS, flush_all, maria_alias

__all__ = ["maria_alias"]

HOME = {"zip": "10115"}


class Rollback(Exception):
    """Raised to roll the caller's transaction back."""


def _runs(task_name: str, detail: str) -> int:
    from shop.models import TaskRun

    return int(TaskRun.objects.filter(task_name=task_name, detail=detail).count())


def _lock_of(store: DjangoStore, task_name: str) -> Lock | None:
    locks = [lock for lock in store.scan("") if lock.task_name == task_name]
    assert len(locks) <= 1
    return locks[0] if locks else None


def _wait_until(condition: Any, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _caller_writes(alias: str) -> None:
    """The caller's own write in its transaction (it holds row locks, as real code does)."""
    DedupCounter.objects.using(alias).create(prefix="txn", task_name="caller", event="wrote")


@pytest.fixture
def sync_address(celery_app: Any) -> Iterator[Any]:
    """The example's ``sync_address`` task (released on success), its config reset."""
    from shop.tasks import sync_address

    sync_address._dedup_config = None
    yield sync_address
    sync_address._dedup_config = None


@pytest.fixture(params=[PG_ALIAS, MARIA_ALIAS])
def alias_store(
    request: pytest.FixtureRequest, pg_alias: str, maria_alias: str, celery_app: Any,
    sync_address: Any, django_db_setup: None, django_db_blocker: Any,
) -> Iterator[tuple[str, DjangoStore]]:
    """The example app's lock store moved to PostgreSQL or MariaDB; ``(alias, store)``.

    Database access is unblocked rather than through ``transactional_db``,
    whose test case forbids the aliases these tests open transactions on.
    """
    from shop.models import TaskRun

    alias = request.param
    with django_db_blocker.unblock():
        flush_all(alias)
        with override_settings(CELERY_DEDUP_STORE=f"django-db://{alias}"):
            reset_runtime(celery_app)
            sync_address._dedup_config = None
            store = runtime_for(celery_app).store
            assert isinstance(store, DjangoStore) and store.using == alias
            yield alias, store
        reset_runtime(celery_app)
        flush_all(alias)
        DedupCounter.objects.using(alias).all().delete()
        TaskRun.objects.filter(task_name=sync_address.name).delete()


def _worker(celery_app: Any) -> Any:
    return start_worker(celery_app, pool="solo", perform_ping_check=False, shutdown_timeout=30)


def test_worker_finishing_before_commit_releases_the_lock(
    alias_store: tuple[str, DjangoStore], celery_app: Any, sync_address: Any
) -> None:
    """The task runs and succeeds while the caller's transaction is open: its release sticks."""
    alias, store = alias_store
    with _worker(celery_app):
        with transaction.atomic(using=alias):
            _caller_writes(alias)
            result = sync_address.delay(1, HOME)
            assert result.deduplicated is False
            assert result.get(timeout=30) == "synced"
            _wait_until(lambda: _lock_of(store, sync_address.name) is None)
        assert _lock_of(store, sync_address.name) is None
        again = sync_address.delay(1, HOME)
        assert again.deduplicated is False and again.get(timeout=30) == "synced"
    assert _runs(sync_address.name, "user=1") == 2


def test_rollback_keeps_the_lock_of_the_published_message(
    alias_store: tuple[str, DjangoStore], celery_app: Any, sync_address: Any
) -> None:
    """A rolled-back caller leaves the lock with its message: a retry is a duplicate; one run."""
    alias, store = alias_store
    with pytest.raises(Rollback), transaction.atomic(using=alias):
        _caller_writes(alias)
        first = sync_address.delay(2, HOME)
        raise Rollback
    assert not DedupCounter.objects.using(alias).filter(prefix="txn").exists()
    lock = _lock_of(store, sync_address.name)
    assert lock is not None and lock.task_id == first.id
    retry = sync_address.delay(2, HOME)
    assert retry.deduplicated is True and retry.id == first.id
    with _worker(celery_app):
        assert first.get(timeout=30) == "synced"
        _wait_until(lambda: _lock_of(store, sync_address.name) is None)
    assert _runs(sync_address.name, "user=2") == 1


@pytest.mark.usefixtures("celery_app")
def test_sqlite_start_check_waits_for_the_commit(
    worker: Any, lock_store: DjangoStore, sync_address: Any
) -> None:
    """SQLite: the lock joins the caller's transaction; the worker starts after the commit."""
    with transaction.atomic():
        _caller_writes("default")
        result = sync_address.delay(3, HOME)
        time.sleep(1.0)
        assert _runs(sync_address.name, "user=3") == 0
    assert result.get(timeout=30) == "synced"
    _wait_until(lambda: _lock_of(lock_store, sync_address.name) is None)
    assert _runs(sync_address.name, "user=3") == 1


def test_sqlite_rollback_runs_the_work_once(
    celery_app: Any, lock_store: DjangoStore, sync_address: Any
) -> None:
    """SQLite: a rollback drops the joined lock; the retry's message runs, the first is skipped."""
    with pytest.raises(Rollback), transaction.atomic():
        first = sync_address.delay(4, HOME)
        raise Rollback
    assert _lock_of(lock_store, sync_address.name) is None
    retry = sync_address.delay(4, HOME)
    assert retry.deduplicated is False and retry.id != first.id
    with _worker(celery_app):
        assert retry.get(timeout=30) == "synced"
        _wait_until(lambda: first.state != "PENDING")
        _wait_until(lambda: _lock_of(lock_store, sync_address.name) is None)
    assert _runs(sync_address.name, "user=4") == 1


@pytest.fixture
def on_commit_task(celery_app: Any) -> Any:
    """A plain ``DedupTask`` on the example app (registered before the worker starts)."""

    def record(self: Any, n: int) -> int:
        from shop.models import TaskRun

        TaskRun.objects.create(task_name=self.name, task_id=self.request.id, detail=f"n={n}")
        return n

    name = "tests.django.on_commit"
    if name not in celery_app.tasks:
        celery_app.task(record, bind=True, base=DedupTask, name=name, unique_for=600)
    task = celery_app.tasks[name]
    task._dedup_config = None
    return task


def test_dedup_task_has_delay_on_commit(sync_address: Any) -> None:
    """``base=DedupTask`` replaces the fixup's ``DjangoTask`` but keeps its on-commit API."""
    assert callable(sync_address.delay_on_commit)
    assert callable(sync_address.apply_async_on_commit)


def test_delay_on_commit_locks_and_publishes_only_on_commit(
    on_commit_task: Any, worker: Any, lock_store: DjangoStore
) -> None:
    """Inside ``atomic()`` nothing is locked or published; the commit does both, once."""
    with transaction.atomic():
        _caller_writes("default")
        on_commit_task.delay_on_commit(5)
        on_commit_task.delay_on_commit(5)
        time.sleep(0.5)
        assert _lock_of(lock_store, on_commit_task.name) is None
        assert _runs(on_commit_task.name, "n=5") == 0
    _wait_until(lambda: _runs(on_commit_task.name, "n=5") == 1)
    _wait_until(lambda: _lock_of(lock_store, on_commit_task.name) is None)
    time.sleep(0.5)
    assert _runs(on_commit_task.name, "n=5") == 1


def test_delay_on_commit_rolled_back_does_nothing(
    on_commit_task: Any, worker: Any, lock_store: DjangoStore
) -> None:
    """A rollback publishes nothing and takes no lock."""
    with pytest.raises(Rollback), transaction.atomic():
        on_commit_task.delay_on_commit(6)
        raise Rollback
    time.sleep(1.0)
    assert _lock_of(lock_store, on_commit_task.name) is None
    assert _runs(on_commit_task.name, "n=6") == 0
