"""Helpers for testing code that uses celery-dedup.

None of them needs pytest; they are context managers and plain functions
that fit fixtures. Point them at **your** Celery app (the one your tasks are
bound to), not at the throwaway app of ``celery.contrib.pytest``'s
``celery_app`` fixture; passing a task works too::

    # conftest.py
    import pytest
    from celery_dedup.testing import memory_store
    from proj.celery import app

    @pytest.fixture
    def dedup_store():
        with memory_store(app) as store:
            yield store

    # test_tasks.py
    from celery_dedup.testing import assert_deduplicated, assert_not_deduplicated
    from proj.tasks import sync_address

    def test_second_call_is_a_duplicate(dedup_store):
        first = sync_address.delay(42, {"zip": "10115"})
        assert_not_deduplicated(first)
        assert_deduplicated(sync_address.delay(42, {"zip": "10115"}))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from . import signals
from .exceptions import DedupError
from .runtime import runtime_for
from .stores.base import Lock, LockStore
from .stores.memory import MemoryStore

if TYPE_CHECKING:
    from celery import Celery

    from .task import DedupTask

__all__ = [
    "CapturedSignal",
    "CapturedSignals",
    "assert_deduplicated",
    "assert_not_deduplicated",
    "capture_dedup_signals",
    "held_locks",
    "isolated",
    "memory_store",
]

#: Every signal ``capture_dedup_signals`` records, by name.
SIGNALS = {
    "dedup_fallback": signals.dedup_fallback,
    "lock_acquired": signals.lock_acquired,
    "lock_released": signals.lock_released,
    "lock_replaced": signals.lock_replaced,
    "task_deduplicated": signals.task_deduplicated,
    "task_skipped": signals.task_skipped,
}


def _app_of(app_or_task: Celery | DedupTask) -> Celery:
    app = getattr(app_or_task, "app", None)
    if app is not None and not hasattr(app_or_task, "tasks"):
        return cast("Celery", app)
    return cast("Celery", app_or_task)


@contextmanager
def memory_store(
    app: Celery | DedupTask, *, clock: Callable[[], float] = time.time
) -> Iterator[MemoryStore]:
    """Point ``app`` (or the app of the task given) at a fresh, empty ``MemoryStore``.

    Until the block ends, every ``DedupTask`` of that app (producer side,
    eager runs and in-process test workers from
    ``celery.contrib.testing.worker``) uses the new store, whatever
    ``dedup_store`` or the result backend say; afterwards the app's previous
    store comes back, or, if the app had not resolved its store yet, it is
    resolved again from its settings on next use. ``clock`` is the store's
    time source (pass a fake one to expire locks without sleeping). Yields
    the store.

    Pass the app your tasks are bound to (``proj.celery.app``, or a task):
    patching another app, such as the ``celery_app`` fixture of
    ``celery.contrib.pytest``, leaves your tasks on their real store.
    """
    runtime = runtime_for(_app_of(app))
    # The store is swapped inside the existing Runtime rather than replaced
    # with a new one: tasks cache the Runtime they resolved.
    with runtime._store_lock:
        previous: tuple[LockStore | None, bool] = (runtime._store, runtime._store_resolved)
    store = MemoryStore(clock=clock)
    runtime.use_store(store)
    try:
        yield store
    finally:
        with runtime._store_lock:
            runtime._store, runtime._store_resolved = previous


def _describe(result: Any) -> str:
    task_id = getattr(result, "id", None)
    key = getattr(result, "deduplication_key", None)
    digest = key.rsplit(":", 1)[-1][:16] if isinstance(key, str) else None
    return f"{type(result).__name__} {task_id} (key {digest or 'none'})"


def _deduplicated_flag(result: Any) -> bool:
    flag = getattr(result, "deduplicated", None)
    if not isinstance(flag, bool):
        raise AssertionError(
            f"{_describe(result)} has no `deduplicated` flag: it was not returned by "
            "DedupTask.apply_async (or delay) or enqueue_many"
        )
    return flag


def assert_deduplicated(result: Any) -> None:
    """Assert that ``result`` comes from a suppressed duplicate call.

    ``result`` is what ``DedupTask.apply_async``/``delay`` or ``enqueue_many``
    returned. Raises ``AssertionError`` if the call was published, or if
    ``result`` did not come from celery-dedup at all.
    """
    if not _deduplicated_flag(result):
        raise AssertionError(
            f"expected a suppressed duplicate, but the call was published as "
            f"{_describe(result)}"
        )


def assert_not_deduplicated(result: Any) -> None:
    """Assert that ``result`` comes from a call that was published.

    Raises ``AssertionError`` naming the holder's task id if the call was a
    duplicate, or if ``result`` did not come from celery-dedup at all.
    """
    if _deduplicated_flag(result):
        raise AssertionError(
            f"expected the call to be published, but it was suppressed as a duplicate "
            f"of task {getattr(result, 'id', None)} ({_describe(result)})"
        )


def held_locks(app: Celery | DedupTask, task: DedupTask | str | None = None) -> list[Lock]:
    """The live locks in ``app``'s store, sorted by key.

    ``app`` may be a task: its app is used, and the list is restricted to
    that task's locks unless ``task`` is given. ``task`` (a task or a task
    name) restricts the list to that task's locks; ``enqueue_many`` batch
    locks are listed under the task name ``celery_dedup.batch``. Raises
    ``DedupError`` when the app has no store.
    """
    if task is None and hasattr(app, "dedup_config"):
        task = cast("DedupTask", app)
    runtime = runtime_for(_app_of(app))
    store = runtime.store
    if store is None:
        raise DedupError("this app has no lock store (set dedup_store or use memory_store)")
    prefix = runtime.settings.key_prefix + ":"
    name = None if task is None else task if isinstance(task, str) else task.name
    if name is not None:
        prefix += name + ":"
    # A prefix scan of "tasks:" also finds "tasks:with:colons:…": keep the named task's.
    locks = [lock for lock in store.scan(prefix) if name is None or lock.task_name == name]
    return sorted(locks, key=lambda lock: lock.key)


@dataclass(frozen=True)
class CapturedSignal:
    """One signal send recorded by ``capture_dedup_signals``."""

    #: the signal's name, e.g. ``"task_deduplicated"``
    name: str
    #: the ``sender`` it was sent with (usually the task)
    sender: Any
    #: the other keyword arguments it was sent with
    kwargs: dict[str, Any] = field(default_factory=dict)


class CapturedSignals(list[CapturedSignal]):
    """The sends recorded by ``capture_dedup_signals``, in order."""

    def named(self, name: str) -> list[CapturedSignal]:
        """The recorded sends of the signal called ``name``."""
        if name not in SIGNALS:
            raise ValueError(f"no celery-dedup signal is called {name!r}: {sorted(SIGNALS)}")
        return [sent for sent in self if sent.name == name]


@contextmanager
def capture_dedup_signals() -> Iterator[CapturedSignals]:
    """Record every celery-dedup signal sent while the block runs.

    Yields a list of ``CapturedSignal`` that fills as signals are sent (from
    any thread of this process, so an in-process test worker counts too).
    Receivers are disconnected when the block ends.
    """
    captured = CapturedSignals()
    receivers: list[tuple[Any, Callable[..., None]]] = []

    def receiver_for(name: str) -> Callable[..., None]:
        def receive(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
            captured.append(CapturedSignal(name=name, sender=sender, kwargs=kwargs))

        return receive

    try:
        for name, signal in SIGNALS.items():
            receiver = receiver_for(name)
            signal.connect(receiver, weak=False)
            receivers.append((signal, receiver))
        yield captured
    finally:
        for signal, receiver in receivers:
            signal.disconnect(receiver)


#: What ``isolated`` sets on the app while it is open.
_ISOLATED = {
    "broker_url": "memory://",
    "result_backend": "cache+memory://",
    "broker_connection_retry_on_startup": False,
}


@contextmanager
def isolated(
    app: Celery | DedupTask, *, eager: bool = False, clock: Callable[[], float] = time.time
) -> Iterator[MemoryStore]:
    """Run ``app`` (or the app of the task given) with no broker, result backend or store.

    Inside the block the app publishes to Celery's in-process ``memory://``
    transport, keeps results in process (``cache+memory://``) and locks in a
    fresh ``MemoryStore`` (see ``memory_store``), so a test needs no server:
    calls are published and stay queued (their locks held) until an
    in-process worker (``celery.contrib.testing.worker.start_worker``) runs
    them. With ``eager=True`` calls run inside ``delay()`` instead
    (``task_always_eager``, errors propagated). Yields the store; everything
    the app had before comes back when the block ends.
    """
    target = _app_of(app)
    conf = target.conf
    changes: dict[str, Any] = dict(_ISOLATED)
    if eager:
        changes.update(task_always_eager=True, task_eager_propagates=True)
    saved = {name: conf.get(name) for name in changes}
    cached = _connection_caches(target)
    conf.update(changes)
    _drop_connection_caches(target)
    try:
        with memory_store(target, clock=clock) as store:
            yield store
    finally:
        with suppress(Exception), target.connection_for_write() as conn:
            conn.default_channel.queue_purge(conf.task_default_queue)  # type: ignore[attr-defined]
        conf.update(saved)
        _restore_connection_caches(target, cached)


def _connection_caches(app: Celery) -> tuple[Any, ...]:
    """The app's cached connection pools and result backend (restored afterwards)."""
    local = app._local  # type: ignore[attr-defined]
    return (
        app._pool,  # type: ignore[attr-defined]
        app.amqp._producer_pool,  # type: ignore[attr-defined]
        app._backend_cache,  # type: ignore[attr-defined]
        getattr(local, "backend", None),
    )


def _drop_connection_caches(app: Celery) -> None:
    """Make the app build its pools and backend again from its (changed) settings."""
    app._pool = None  # type: ignore[attr-defined]
    app.amqp._producer_pool = None  # type: ignore[attr-defined]
    app._backend_cache = None  # type: ignore[attr-defined]
    with suppress(AttributeError):
        del app._local.backend  # type: ignore[attr-defined]


def _restore_connection_caches(app: Celery, cached: tuple[Any, ...]) -> None:
    pool, producers, backend_cache, backend = cached
    app._pool = pool  # type: ignore[attr-defined]
    app.amqp._producer_pool = producers  # type: ignore[attr-defined]
    app._backend_cache = backend_cache  # type: ignore[attr-defined]
    local = app._local  # type: ignore[attr-defined]
    with suppress(AttributeError):
        del local.backend
    if backend is not None:
        local.backend = backend
