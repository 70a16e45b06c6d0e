"""Transaction-scoped coalescing: identical on-commit calls publish once, on commit.

A real worker and real transactions: PostgreSQL (the lock store and the
caller's transaction on the ``dedup_pg`` alias, ``apply_async_on_commit(...,
using=...)``) and the default SQLite database (``delay_on_commit``). Messages
are counted with Celery's ``after_task_publish`` signal, runs in the task body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import after_task_publish
from django.db import transaction
from django.test import override_settings

from celery_dedup import DedupTask, KeyReuseError
from celery_dedup.runtime import reset_runtime, runtime_for
from celery_dedup.stores.base import Lock
from celery_dedup.stores.django import DjangoStore
from tests.django.conftest import PG_ALIAS
from tests.django.test_django_store import flush_all
from tests.fixtures._events import Recorder

NAME = "tests.django.coalesced"


class Rollback(Exception):
    """Raised to roll a transaction (or a savepoint) back."""


def _runs(detail: str) -> int:
    from shop.models import TaskRun

    return int(TaskRun.objects.filter(task_name=NAME, detail=detail).count())


def _locks(store: DjangoStore) -> list[Lock]:
    return [lock for lock in store.scan("") if lock.task_name == NAME]


def _wait_until(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Published:
    """The messages of the task under test that reached the broker."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        if sender == NAME:
            self.ids.append(str((headers or {}).get("id")))


@pytest.fixture
def published() -> Iterator[Published]:
    """Count publishes of the task under test."""
    counter = Published()
    after_task_publish.connect(counter, weak=False)
    yield counter
    after_task_publish.disconnect(counter)


@pytest.fixture
def coalesced(celery_app: Any) -> Any:
    """A ``DedupTask`` on the example app recording each run's argument."""

    def record(self: Any, n: int) -> int:
        from shop.models import TaskRun

        TaskRun.objects.create(task_name=self.name, task_id=self.request.id, detail=f"n={n}")
        return n

    if NAME not in celery_app.tasks:
        celery_app.task(record, bind=True, base=DedupTask, name=NAME, unique_for=600)
    task = celery_app.tasks[NAME]
    task._dedup_config = None
    return task


@pytest.fixture
def pg_store(
    pg_alias: str, celery_app: Any, coalesced: Any, django_db_setup: None,
    django_db_blocker: Any,
) -> Iterator[DjangoStore]:
    """The example app's lock store on PostgreSQL, where the caller's transactions run too.

    As ``test_store_transactions.py``'s ``alias_store``: database access is
    unblocked rather than through ``transactional_db`` (whose test case
    forbids the ``dedup_pg`` alias). Runs are recorded in the default test
    database, which pytest-django creates when the selection includes a test
    using it (this module's last test does).
    """
    from shop.models import TaskRun

    with django_db_blocker.unblock():
        flush_all(pg_alias)
        TaskRun.objects.filter(task_name=NAME).delete()
        with override_settings(CELERY_DEDUP_STORE=f"django-db://{pg_alias}"):
            reset_runtime(celery_app)
            coalesced._dedup_config = None
            store = runtime_for(celery_app).store
            assert isinstance(store, DjangoStore) and store.using == pg_alias
            yield store
        reset_runtime(celery_app)
        coalesced._dedup_config = None
        flush_all(pg_alias)
        TaskRun.objects.filter(task_name=NAME).delete()


def _worker(celery_app: Any) -> Any:
    return start_worker(celery_app, pool="solo", perform_ping_check=False, shutdown_timeout=30)


def test_identical_calls_publish_once_on_commit(
    pg_store: DjangoStore, celery_app: Any, coalesced: Any, published: Published
) -> None:
    """3 identical calls in one atomic(): nothing before the commit; 1 message, 1 run after."""
    with _worker(celery_app):
        with transaction.atomic(using=PG_ALIAS):
            for _ in range(3):
                assert coalesced.apply_async_on_commit((1,), using=PG_ALIAS) is None
            assert published.ids == [] and _locks(pg_store) == []
        assert len(published.ids) == 1
        _wait_until(lambda: _runs("n=1") == 1)
        _wait_until(lambda: _locks(pg_store) == [])
        # A sentinel call after them: once it ran, the queue before it was drained.
        sentinel = coalesced.delay(99)
        assert sentinel.get(timeout=30) == 99
    assert _runs("n=1") == 1 and len(published.ids) == 2
    assert runtime_for(celery_app).metrics.read()[(NAME, "coalesced")] >= 2


def test_rollback_publishes_nothing_and_leaves_no_lock(
    pg_store: DjangoStore, celery_app: Any, coalesced: Any, published: Published
) -> None:
    """A rolled-back transaction: no message, no lock, no run."""
    with pytest.raises(Rollback), transaction.atomic(using=PG_ALIAS):
        for _ in range(3):
            coalesced.apply_async_on_commit((2,), using=PG_ALIAS)
        raise Rollback
    assert published.ids == [] and _locks(pg_store) == []
    with _worker(celery_app):
        assert coalesced.delay(98).get(timeout=30) == 98
    assert _runs("n=2") == 0 and _locks(pg_store) == []


def test_rolled_back_savepoint_does_not_publish_its_calls(
    pg_store: DjangoStore, celery_app: Any, coalesced: Any, published: Published
) -> None:
    """A savepoint's calls go with it; a call folded into a surviving outer one runs with it.

    And a call whose pending twin was dropped with a savepoint is not folded
    into nothing: it publishes on commit.
    """
    with _worker(celery_app):
        with transaction.atomic(using=PG_ALIAS):
            coalesced.apply_async_on_commit((3,), using=PG_ALIAS)
            with pytest.raises(Rollback), transaction.atomic(using=PG_ALIAS):
                coalesced.apply_async_on_commit((3,), using=PG_ALIAS)
                coalesced.apply_async_on_commit((4,), using=PG_ALIAS)
                raise Rollback
            with pytest.raises(Rollback), transaction.atomic(using=PG_ALIAS):
                coalesced.apply_async_on_commit((5,), using=PG_ALIAS)
                raise Rollback
            coalesced.apply_async_on_commit((5,), using=PG_ALIAS)
            with transaction.atomic(using=PG_ALIAS):
                coalesced.apply_async_on_commit((5,), using=PG_ALIAS)
            assert published.ids == []
        assert len(published.ids) == 2
        _wait_until(lambda: _runs("n=3") == 1 and _runs("n=5") == 1)
        assert coalesced.delay(97).get(timeout=30) == 97
    assert (_runs("n=3"), _runs("n=4"), _runs("n=5")) == (1, 0, 1)
    assert len(published.ids) == 3


def test_key_reused_with_other_arguments_raises_at_the_call(
    pg_store: DjangoStore, celery_app: Any, coalesced: Any, published: Published
) -> None:
    """on_key_reuse applies inside the transaction too: KeyReuseError before anything is held."""
    with _worker(celery_app):
        with transaction.atomic(using=PG_ALIAS):
            coalesced.apply_async_on_commit(
                (6,), deduplication_key="order-6", on_key_reuse="raise", using=PG_ALIAS
            )
            with pytest.raises(KeyReuseError):
                coalesced.apply_async_on_commit(
                    (7,), deduplication_key="order-6", on_key_reuse="raise", using=PG_ALIAS
                )
            coalesced.apply_async_on_commit(
                (6,), deduplication_key="order-6", on_key_reuse="raise", using=PG_ALIAS
            )
        assert len(published.ids) == 1
        _wait_until(lambda: _runs("n=6") == 1)
        assert coalesced.delay(96).get(timeout=30) == 96
    assert (_runs("n=6"), _runs("n=7")) == (1, 0)


def test_replace_keeps_the_latest_arguments(
    pg_store: DjangoStore, celery_app: Any, coalesced: Any, published: Published
) -> None:
    """on_duplicate='replace': different arguments are not folded; the latest call runs."""
    with transaction.atomic(using=PG_ALIAS):
        for n in (10, 11, 11):
            coalesced.apply_async_on_commit(
                (n,), deduplication_key="doc-1", on_duplicate="replace", using=PG_ALIAS
            )
    assert len(published.ids) == 2
    with _worker(celery_app):
        _wait_until(lambda: _runs("n=11") == 1)
        assert coalesced.delay(95).get(timeout=30) == 95
    assert (_runs("n=10"), _runs("n=11")) == (0, 1)


@pytest.mark.usefixtures("celery_app")
def test_delay_on_commit_default_database(
    coalesced: Any, worker: Any, lock_store: DjangoStore, published: Published
) -> None:
    """delay_on_commit on the default database (SQLite store): 3 calls, 1 message, 1 run."""
    with transaction.atomic():
        for _ in range(3):
            assert coalesced.delay_on_commit(8) is None
        assert published.ids == []
    assert len(published.ids) == 1
    _wait_until(lambda: _runs("n=8") == 1)
    _wait_until(lambda: [lock for lock in lock_store.scan("") if lock.task_name == NAME] == [])
    assert coalesced.delay(94).get(timeout=30) == 94
    assert _runs("n=8") == 1 and len(published.ids) == 2


def test_outside_a_transaction_each_call_publishes_at_once(
    pg_store: DjangoStore, coalesced: Any, published: Published
) -> None:
    """No atomic block: the call is made at once and deduplicated by its lock as usual."""
    coalesced.apply_async_on_commit((9,), using=PG_ALIAS)
    coalesced.apply_async_on_commit((9,), using=PG_ALIAS)
    assert len(published.ids) == 1
    assert [lock.task_name for lock in _locks(pg_store)] == [NAME]


def test_folded_calls_are_reported_on_commit(
    pg_store: DjangoStore, celery_app: Any, coalesced: Any, published: Published
) -> None:
    """With events on, each folded call that survived gets a task-deduplicated event naming
    on_commit, sent at commit as a child of the one message; a call folded inside a
    rolled-back savepoint gets none (a real receiver on the broker)."""
    with override_settings(CELERY_DEDUP_SEND_EVENTS=True):
        reset_runtime(celery_app)
        coalesced._dedup_config = None
        recorder = Recorder(celery_app)
        try:
            with _worker(celery_app):
                with transaction.atomic(using=PG_ALIAS):
                    coalesced.apply_async_on_commit((12,), using=PG_ALIAS)
                    with pytest.raises(Rollback), transaction.atomic(using=PG_ALIAS):
                        coalesced.apply_async_on_commit((12,), using=PG_ALIAS)
                        raise Rollback
                    coalesced.apply_async_on_commit((12,), using=PG_ALIAS)
                    coalesced.apply_async_on_commit((12,), using=PG_ALIAS)
                    assert recorder.of("task-deduplicated") == []
                assert len(published.ids) == 1
                _wait_until(lambda: _runs("n=12") == 1)
                folded = recorder.of("task-deduplicated")
        finally:
            recorder.close()
    reset_runtime(celery_app)
    coalesced._dedup_config = None
    (message,) = published.ids
    assert [(e["policy"], e["parent_id"], e["args"]) for e in folded] == [
        ("on_commit", message, "(12,)"),
        ("on_commit", message, "(12,)"),
    ]
    assert folded[0]["result"] == f"coalesced on commit into {message} (on_commit)"
    assert len({e["uuid"] for e in folded} | {message}) == 3


def test_a_hook_run_by_capture_on_commit_callbacks_takes_no_more_calls(
    celery_app: Any, coalesced: Any, published: Published, db: None,
    django_capture_on_commit_callbacks: Any,
) -> None:
    """In a ``TestCase`` the hooks that ``captureOnCommitCallbacks(execute=True)`` ran stay
    in the connection's list: a later call gets a hook of its own, as after a commit.
    """
    store = runtime_for(celery_app).store
    assert isinstance(store, DjangoStore)
    with django_capture_on_commit_callbacks(execute=True) as first:
        coalesced.delay_on_commit(12)
        coalesced.delay_on_commit(12)
    assert len(first) == 1 and len(published.ids) == 1
    # The worker ran it and released the lock, as in production.
    (lock,) = _locks(store)
    assert store.release(lock.key, lock.owner)
    with django_capture_on_commit_callbacks(execute=True) as second:
        coalesced.delay_on_commit(12)
    assert len(second) == 1 and len(published.ids) == 2
    assert [lock.task_name for lock in _locks(store)] == [NAME]


@pytest.mark.parametrize("runner", ["asyncio.run", "async_to_sync"])
def test_delay_from_an_async_view_with_the_django_db_store(
    coalesced: Any, worker: Any, lock_store: DjangoStore, published: Published, runner: str
) -> None:
    """``delay()`` on an event loop's thread (an async view) publishes as for a plain task:
    the store's database work runs off the loop; the duplicate is refused; one run.

    ``asyncio.run`` stands for an ASGI server's loop, ``async_to_sync`` for an
    async test (or sync middleware) waiting in a thread of its own.
    """
    from asgiref.sync import async_to_sync

    async def view(n: int) -> tuple[Any, Any]:
        return coalesced.delay(n), coalesced.delay(n)

    n = 20 if runner == "asyncio.run" else 21
    first, again = asyncio.run(view(n)) if runner == "asyncio.run" else async_to_sync(view)(n)
    assert (first.deduplicated, again.deduplicated) == (False, True)
    assert again.id == first.id and len(published.ids) == 1
    assert first.get(timeout=30) == n
    _wait_until(lambda: _runs(f"n={n}") == 1)
    _wait_until(lambda: [lock for lock in lock_store.scan("") if lock.task_name == NAME] == [])
    assert _runs(f"n={n}") == 1
