"""Canvases, batches and worker-side publishes: never a silent loss, one unit per key.

Real workers on the test Redis; executions are counted in a Redis list
written by the task bodies (``Runs``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, group, states
from celery.result import AsyncResult, GroupResult
from celery.signals import before_task_publish

from celery_dedup import (
    DeduplicationUnavailable,
    DedupTask,
    DuplicateTaskError,
    KeyReuseWarning,
    dedup_key_for,
    enqueue_many,
    inspect_lock,
)
from celery_dedup.signals import lock_acquired, task_skipped
from tests.fixtures._servers import running
from tests.fixtures.redis import RedisServer, start_redis

from .conftest import AppFactory, wait_until
from .test_paths_identity import Runs, queued


@pytest.fixture
def runs(redis_server: RedisServer) -> Iterator[Runs]:
    """An empty ``Runs`` list on the test Redis."""
    with Runs.on(redis_server) as recorded:
        yield recorded


def steps(app: Celery, runs: Runs, prefix: str, **options: Any) -> tuple[Any, Any]:
    """Two DedupTasks recording ``[name, x]``: ``first`` (returns x) and ``then``."""

    @app.task(base=DedupTask, shared=False, name=f"{prefix}.first", unique_for=30, **options)
    def first(x: int) -> int:
        runs.record(["first", x])
        return x

    @app.task(base=DedupTask, shared=False, name=f"{prefix}.then", unique_for=30)
    def then(x: int) -> int:
        runs.record(["then", x])
        return x * 10

    return first, then


def test_chain_with_duplicate_first_step_raises(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer, runs: Runs
) -> None:
    """The caller is told (DuplicateTaskError whatever on_duplicate), nothing is published;
    once the holder finished, the same chain runs every step."""
    app = app_factory("dupchain")
    first, then = steps(app, runs, "dupchain")

    holder = first.delay(1)
    for on_duplicate in ("existing", "raise"):
        with pytest.raises(DuplicateTaskError) as info:
            chain(first.s(1), then.s()).apply_async(on_duplicate=on_duplicate)
        assert info.value.existing_task_id == holder.id
    assert queued(redis_server, "q-dupchain") == 1

    worker_for(app)
    assert holder.get(timeout=10) == 1
    assert runs.all() == [["first", 1]]
    flow = chain(first.s(1), then.s()).apply_async()
    assert flow.get(timeout=10) == 10
    assert runs.all() == [["first", 1], ["first", 1], ["then", 1]]


def test_chain_published_inside_a_worker_is_never_dropped(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """A task that starts a chain whose first step is held: published anyway, parent SUCCESS."""
    app = app_factory("wchain")
    first, then = steps(app, runs, "wchain", unique_until="expiry")

    @app.task(base=DedupTask, shared=False, name="wchain.parent", unique_for=30)
    def parent(x: int) -> str:
        return str(chain(first.s(x), then.s()).apply_async().id)

    holder = first.delay(4)
    worker_for(app)
    assert holder.get(timeout=10) == 4
    launched = parent.delay(4)
    tail = app.AsyncResult(launched.get(timeout=10))
    assert launched.state == states.SUCCESS and tail.get(timeout=10) == 40
    assert sorted(runs.all()) == [["first", 4], ["first", 4], ["then", 4]]


def test_chain_with_a_key_is_one_unit(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer, runs: Runs
) -> None:
    """``chain(...).apply_async(deduplication_key=K)`` holds K for unique_for; every step runs once.

    The key belongs to the first step's task (keys are per task name): a chain
    with the same first task and key, whatever its arguments, is a duplicate
    (with other arguments for its first step, a reused key: ``on_key_reuse``
    warns by default).
    """
    app = app_factory("keychain")
    first, then = steps(app, runs, "keychain")

    flow = chain(first.s(1), then.s()).apply_async(deduplication_key="nightly")
    head = flow.parent
    assert isinstance(head, AsyncResult)
    with pytest.raises(DuplicateTaskError) as info:
        chain(first.s(1), then.s()).apply_async(deduplication_key="nightly")
    assert info.value.existing_task_id == head.id
    with pytest.warns(KeyReuseWarning), pytest.raises(DuplicateTaskError) as info:
        chain(first.s(2), then.s()).apply_async(deduplication_key="nightly")
    assert info.value.existing_task_id == head.id
    assert queued(redis_server, "q-keychain") == 1

    worker_for(app)
    assert flow.get(timeout=10) == 10
    assert runs.all() == [["first", 1], ["then", 1]]
    key = dedup_key_for(first, (1,), deduplication_key="nightly")
    lock = inspect_lock(key or "", app=app)
    assert lock is not None and lock.task_id == head.id and lock.policy == "expiry"
    assert 0 < lock.ttl <= 30
    with pytest.raises(DuplicateTaskError):
        chain(first.s(1), then.s()).apply_async(deduplication_key="nightly")


def test_group_with_a_key_is_one_unit(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer, runs: Runs
) -> None:
    """A second group with the same key raises before any member is published; the first
    group's members each run exactly once."""
    app = app_factory("keygroup")
    first, _ = steps(app, runs, "keygroup")

    batch = group(first.s(1), first.s(2), first.s(3)).apply_async(deduplication_key="batch")
    assert queued(redis_server, "q-keygroup") == 3
    with pytest.raises(DuplicateTaskError) as info:
        group(first.s(1), first.s(2), first.s(3)).apply_async(deduplication_key="batch")
    assert info.value.existing_task_id == batch.id
    assert queued(redis_server, "q-keygroup") == 3
    lock = inspect_lock(dedup_key_for(first, (1,), deduplication_key="batch") or "", app=app)
    assert lock is not None and lock.task_id == batch.id and lock.policy == "expiry"

    worker_for(app)
    assert batch.get(timeout=10) == [1, 2, 3]
    assert sorted(runs.all()) == [["first", 1], ["first", 2], ["first", 3]]


def _blocked_in_thread(
    signal: Any, matches: Callable[..., bool]
) -> tuple[threading.Event, threading.Event, Callable[..., None]]:
    """A receiver for ``signal`` that parks the sending thread until released."""
    reached, release = threading.Event(), threading.Event()

    def park(*args: Any, **kwargs: Any) -> None:
        if matches(*args, **kwargs) and not reached.is_set():
            reached.set()
            release.wait(10)

    return reached, release, park


def _concurrent_enqueue_many(
    app: Any, task: Any, signal: Any, matches: Callable[..., bool]
) -> tuple[GroupResult, GroupResult]:
    """Thread A publishes a batch and is parked on ``signal``; B asks for the same batch."""
    reached, release, park = _blocked_in_thread(signal, matches)
    signal.connect(park, weak=False)
    done: list[GroupResult] = []

    def publish_first() -> None:
        done.append(enqueue_many([task.s(1), task.s(2)], deduplication_key="b", app=app))

    thread_a = threading.Thread(target=publish_first)
    try:
        thread_a.start()
        assert reached.wait(10)
        duplicate = enqueue_many([task.s(1), task.s(2)], deduplication_key="b", app=app)
    finally:
        release.set()
        thread_a.join(10)
        signal.disconnect(park)
    return done[0], duplicate


@pytest.mark.parametrize(
    ("signal", "matches"),
    [
        pytest.param(
            before_task_publish,
            lambda *_, **kw: (kw.get("headers") or {}).get("group_index") == 0,
            id="while-members-are-published",
        ),
        pytest.param(
            lock_acquired,
            lambda sender=None, **_: sender is None,
            id="between-lock-and-save",
        ),
    ],
)
def test_enqueue_many_concurrent_duplicate_gets_the_real_members(
    app_factory: AppFactory, worker_for: Any, runs: Runs, signal: Any, matches: Any
) -> None:
    """A duplicate made while the first batch is being published restores its real members.

    The first thread is parked inside a signal receiver (a real receiver
    doing I/O widens the same window): before its first member is published,
    or right after it took the batch lock.
    """
    app = app_factory("batchrace")
    first, _ = steps(app, runs, "batchrace")

    original, duplicate = _concurrent_enqueue_many(app, first, signal, matches)
    assert getattr(original, "deduplicated") is False  # noqa: B009
    assert getattr(duplicate, "deduplicated") is True  # noqa: B009
    assert duplicate.id == original.id
    assert [r.id for r in duplicate.results or []] == [r.id for r in original.results or []]
    assert not duplicate.ready()
    worker_for(app)
    assert duplicate.get(timeout=10) == [1, 2]
    assert sorted(runs.all()) == [["first", 1], ["first", 2]]


@pytest.fixture
def lock_server(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A redis-server of its own for the lock store (stopped by the test): URL and process."""
    argv, port = start_redis(tmp_path)
    with running(argv, port, log=tmp_path / "redis.log") as proc:
        yield f"redis://127.0.0.1:{port}/0", proc


@pytest.fixture
def dedup_warnings() -> Iterator[list[str]]:
    """WARNING messages of the ``celery_dedup`` logger during the test."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("celery_dedup")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def test_closed_fallback_never_fails_the_parent(
    app_factory: AppFactory,
    worker_for: Any,
    runs: Runs,
    lock_server: tuple[str, Any],
    dedup_warnings: list[str],
) -> None:
    """``dedup_fallback="closed"``: while the lock store is stalled a producer refuses, a
    worker defers its messages (never fails them), and a parent whose body publishes a child
    while the store stalls is SUCCESS, its child published unlocked; all run once."""
    url, proc = lock_server
    app = app_factory(
        "closed",
        dedup_store=url + "?socket_timeout=0.5&socket_connect_timeout=0.5",
        dedup_fallback="closed",
    )
    first, then = steps(app, runs, "closed")

    @app.task(base=DedupTask, shared=False, name="closed.charge", unique_for=30)
    def charge(x: int) -> int:
        runs.record(["charge", x])
        os.kill(proc.pid, signal.SIGSTOP)  # the store stalls while the parent runs
        try:
            first.delay(x)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        return x

    deferred: list[str] = []

    def on_skip(sender: Any = None, reason: str = "", **_: Any) -> None:
        if reason.startswith("deferred"):
            deferred.append(reason)

    task_skipped.connect(on_skip, weak=False)
    charged = charge.delay(1)
    flow = chain(charge.s(2), then.s()).apply_async()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(DeduplicationUnavailable):
            charge.delay(3)  # a producer outside a worker refuses
        worker_for(app)
        wait_until(lambda: len(deferred) >= 2, 20)  # both parents wait for the store
        assert runs.all() == [] and charged.state == states.PENDING  # waits, never fails
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        task_skipped.disconnect(on_skip)
    assert charged.get(timeout=30) == 1 and charged.state == states.SUCCESS
    assert flow.get(timeout=30) == 20
    wait_until(lambda: len(runs.all()) == 5, timeout=20)
    assert sorted(runs.all()) == [
        ["charge", 1],
        ["charge", 2],
        ["first", 1],
        ["first", 2],
        ["then", 2],
    ]
    assert any("published without a lock from inside a worker" in m for m in dedup_warnings)
