"""Duplicates are suppressed end to end with a real worker."""

from __future__ import annotations

from typing import Any

from celery_dedup import DedupTask, inspect_lock

from .conftest import wait_until


def test_duplicate_suppressed_and_lock_released(app_factory: Any, worker_for: Any) -> None:
    """A second identical call publishes nothing; the holder runs once and frees the lock."""
    app = app_factory("basic")
    runs: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def add(x: int, y: int) -> int:
        runs.append(x)
        return x + y

    first = add.delay(1, 2)
    second = add.delay(1, y=2)
    assert first.deduplicated is False
    assert second.deduplicated is True
    assert second.id == first.id
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.task_id == first.id
    worker_for(app)
    assert first.get(timeout=10) == 3
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is None)
    assert runs == [1]
