"""A task class that overrides ``__call__`` without ``super()`` keeps every promise (issue 30).

Flask's documented base task (``FlaskTask.__call__`` runs ``self.run``
inside ``app.app_context()``) never calls ``Task.__call__``. Combined with
``DedupTask`` in either order of the bases, the body must still run inside
the worker's envelope: claimed (a copy of a held call is skipped), inside its
concurrency slot, and released per policy before the result is stored. Bodies
record into a list; each test asserts the exact runs, then the store.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery, Task

from celery_dedup import DedupTask, inspect_lock
from celery_dedup.envelope import is_wrapped

from .conftest import wait_until

#: set while a (simulated) Flask application context is active
IN_APP_CONTEXT: contextvars.ContextVar[bool] = contextvars.ContextVar("in_app", default=False)


@contextmanager
def app_context() -> Iterator[None]:
    """What ``flask_app.app_context()`` is to a task body here: a context it must run in."""
    token = IN_APP_CONTEXT.set(True)
    try:
        yield
    finally:
        IN_APP_CONTEXT.reset(token)


class FlaskTask(Task):  # type: ignore[type-arg]
    """Flask's documented pattern ("Celery Background Tasks"), verbatim but the app."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with app_context():
            return self.run(*args, **kwargs)


class FlaskFirst(FlaskTask, DedupTask):
    """``FlaskTask.__call__`` is the one the class resolves."""


class DedupFirst(DedupTask, FlaskTask):
    """``DedupTask.__call__`` resolves first; its ``super()`` is ``FlaskTask.__call__``."""


class PoliteOverride(DedupTask):
    """An override that does call ``super().__call__``: the envelope runs once."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with app_context():
            return super().__call__(*args, **kwargs)


BASES = [FlaskFirst, DedupFirst, PoliteOverride]


def test_every_resolved_call_runs_the_envelope() -> None:
    for base in BASES:
        assert is_wrapped(base.__call__), base


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_override_claims_runs_once_and_releases_before_the_result(
    app_factory: Any, worker_for: Any, base: type[DedupTask]
) -> None:
    """Held: a duplicate and a ``send_task`` copy do not run; the run releases before get()."""
    app = app_factory(f"override-{base.__name__}")
    runs: list[tuple[int, bool]] = []
    gate = threading.Event()

    @app.task(base=base, shared=False, unique_for=60, unique_until="success")
    def sync(x: int) -> int:
        runs.append((x, IN_APP_CONTEXT.get()))
        gate.wait(10)
        return x * 2

    first = sync.delay(1)
    assert sync.delay(1).deduplicated is True
    worker_for(app)
    wait_until(lambda: runs, timeout=10)
    # A copy that bypasses apply_async while the call runs: the guard skips it.
    copy = app.send_task(sync.name, args=[1])
    wait_until(lambda: copy.state == "IGNORED", timeout=10)
    gate.set()
    assert first.get(timeout=10) == 2
    # Released before the result was stored: no wait needed.
    assert inspect_lock(first.deduplication_key, app=app) is None
    assert runs == [(1, True)]
    again = sync.delay(1)
    assert again.deduplicated is False
    assert again.get(timeout=10) == 2
    assert runs == [(1, True), (1, True)]


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_override_keeps_the_lock_after_a_failure_under_success(
    app_factory: Any, worker_for: Any, base: type[DedupTask]
) -> None:
    """``unique_until="success"`` keeps the lock after a final failure; ``finish`` frees it."""
    app = app_factory(f"override-fail-{base.__name__}")
    runs: list[str] = []

    @app.task(base=base, shared=False, unique_for=60, unique_until="success")
    def kept(x: int) -> None:
        runs.append("kept")
        raise ValueError("boom")

    @app.task(base=base, shared=False, unique_for=60, unique_until="finish")
    def freed(x: int) -> None:
        runs.append("freed")
        raise ValueError("boom")

    worker_for(app)
    a, b = kept.delay(1), freed.delay(1)
    with pytest.raises(ValueError):
        a.get(timeout=10)
    with pytest.raises(ValueError):
        b.get(timeout=10)
    lock = inspect_lock(a.deduplication_key, app=app)
    assert lock is not None and not lock.started  # settled: nothing runs under it
    assert inspect_lock(b.deduplication_key, app=app) is None
    assert sorted(runs) == ["freed", "kept"]
    assert kept.delay(1).deduplicated is True


@pytest.mark.parametrize("base", [FlaskFirst, DedupFirst], ids=lambda b: b.__name__)
def test_override_enforces_the_concurrency_limit(
    app_factory: Any, worker_for: Any, base: type[DedupTask]
) -> None:
    """``concurrency_limit=1`` per key: four bodies of one key never overlap."""
    app = app_factory(f"override-limit-{base.__name__}")
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    @app.task(
        base=base,
        shared=False,
        unique_for=60,
        concurrency_limit=1,
        concurrency_key="{customer}",
        concurrency_backoff=0.1,
    )
    def charge(order: int, customer: str) -> int:
        with lock:
            events.append(("start", order))
        time.sleep(0.3)
        with lock:
            events.append(("end", order))
        return order

    results = [charge.delay(i, customer="c1") for i in range(4)]
    worker_for(app, concurrency=4)
    assert sorted(r.get(timeout=60) for r in results) == [0, 1, 2, 3]
    running = 0
    for event, _ in events:
        running += 1 if event == "start" else -1
        assert running <= 1, events
    assert sorted(order for event, order in events if event == "start") == [0, 1, 2, 3]


def test_direct_calls_run_the_override_without_a_lock(app_factory: Any) -> None:
    """Calling the task object directly is a plain function call, as for any Celery task."""
    app: Celery = app_factory("override-direct")

    @app.task(base=FlaskFirst, shared=False, unique_for=60)
    def direct(x: int) -> bool:
        return IN_APP_CONTEXT.get()

    assert direct(1) is True
