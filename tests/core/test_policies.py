"""unique_until: when each policy releases the lock, with a real worker."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery.exceptions import Ignore

from celery_dedup import DedupTask, inspect_lock

from .conftest import AppFactory, wait_until


def test_start_releases_before_body_runs(app_factory: AppFactory, worker_for: Any) -> None:
    """'start' frees the key as the body begins, so a new call is accepted while it runs."""
    app = app_factory("p-start")
    started, finish = threading.Event(), threading.Event()

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until="start")
    def job(x: int) -> int:
        started.set()
        finish.wait(10)
        return x

    first = job.delay(1)
    assert job.delay(1).deduplicated is True
    worker_for(app)
    assert started.wait(10)
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is None)
    second = job.delay(1)
    assert second.deduplicated is False and second.id != first.id
    finish.set()
    assert first.get(timeout=10) == 1 and second.get(timeout=10) == 1


@pytest.mark.parametrize(
    ("policy", "freed_after_success"), [("success", True), ("finish", True), ("expiry", False)]
)
def test_success_outcome(
    app_factory: AppFactory, worker_for: Any, policy: str, freed_after_success: bool
) -> None:
    """After success, 'success' and 'finish' free the key; 'expiry' keeps it until the TTL."""
    app = app_factory(f"p-{policy}")

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until=policy)
    def job(x: int) -> int:
        return x

    result = job.delay(5)
    worker_for(app)
    assert result.get(timeout=10) == 5
    if freed_after_success:
        wait_until(lambda: inspect_lock(result.deduplication_key, app=app) is None)
        assert job.delay(5).deduplicated is False
    else:
        lock = inspect_lock(result.deduplication_key, app=app)
        assert lock is not None and lock.task_id == result.id and lock.policy == "expiry"
        assert 50 < lock.ttl <= 60
        assert job.delay(5).id == result.id


@pytest.mark.parametrize(
    ("policy", "freed_after_failure"), [("success", False), ("finish", True), ("expiry", False)]
)
def test_failure_outcome(
    app_factory: AppFactory, worker_for: Any, policy: str, freed_after_failure: bool
) -> None:
    """After a final failure only 'finish' frees the key; 'success' keeps it until the TTL."""
    app = app_factory(f"pf-{policy}")

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until=policy)
    def job(x: int) -> int:
        raise ValueError("boom")

    result = job.delay(5)
    worker_for(app)
    with pytest.raises(ValueError, match="boom"):
        result.get(timeout=10)
    if freed_after_failure:
        wait_until(lambda: inspect_lock(result.deduplication_key, app=app) is None)
    else:
        lock = inspect_lock(result.deduplication_key, app=app)
        assert lock is not None and lock.task_id == result.id
        assert job.delay(5).deduplicated is True


@pytest.mark.parametrize("until", ["success", "finish"])
def test_ignored_task_releases_like_a_success(
    app_factory: AppFactory, worker_for: Any, until: str
) -> None:
    """A body that raises Ignore ended its run: its lock is released as on success."""
    app = app_factory(f"p-ignore-{until}")
    runs: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until=until)
    def job(x: int) -> None:
        runs.append(x)
        raise Ignore()

    result = job.delay(1)
    worker_for(app)
    deadline = time.monotonic() + 10
    while inspect_lock(result.deduplication_key, app=app) is not None:
        assert time.monotonic() < deadline, "an ignored run kept its lock"
        time.sleep(0.05)
    assert runs == [1]
    again = job.delay(1)
    assert again.deduplicated is False


def test_owner_check_late_finish_keeps_newer_lock(app_factory: AppFactory, worker_for: Any) -> None:
    """Holder A (TTL 1 s) runs 3 s; B takes the key after expiry; A's finish leaves B's lock."""
    app = app_factory("p-owner")
    a_running, b_taken, checked = threading.Event(), threading.Event(), threading.Event()
    calls: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=1, unique_until="finish")
    def job(x: int) -> str:
        calls.append(x)
        if len(calls) == 1:
            a_running.set()
            b_taken.wait(10)
        else:
            checked.wait(10)
        return "done"

    a = job.delay(1)
    worker_for(app, concurrency=1)
    assert a_running.wait(10)
    wait_until(lambda: inspect_lock(a.deduplication_key, app=app) is None, timeout=5)
    b = job.apply_async((1,), unique_for=30)
    assert b.deduplicated is False and b.id != a.id
    b_taken.set()
    assert a.get(timeout=10) == "done"
    lock = inspect_lock(a.deduplication_key, app=app)
    assert lock is not None and lock.task_id == b.id
    checked.set()
    assert b.get(timeout=10) == "done"
    wait_until(lambda: inspect_lock(a.deduplication_key, app=app) is None)
