"""Retries keep and extend the lock; countdown/eta lengthen it; revoke and expiry release it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery import states

import celery_dedup
from celery_dedup import DedupTask, RevokeOutcome, inspect_lock

from .conftest import AppFactory, scheduled_by_worker, wait_until


def test_retry_keeps_lock_and_extends_ttl(app_factory: AppFactory, worker_for: Any) -> None:
    """self.retry() republishes as the holder: same id, TTL = retry delay + unique_for."""
    app = app_factory("retry")
    attempts: list[int] = []
    retried = threading.Event()

    @app.task(base=DedupTask, shared=False, bind=True, unique_for=5, max_retries=1)
    def flaky(self: Any, x: int) -> int:
        attempts.append(self.request.retries)
        if self.request.retries == 0:
            retried.set()
            raise self.retry(countdown=3)
        return x

    result = flaky.delay(1)
    worker_for(app)
    assert retried.wait(10)
    time.sleep(0.3)
    lock = inspect_lock(result.deduplication_key, app=app)
    assert lock is not None and lock.task_id == result.id
    assert lock.ttl > 5, "retry countdown (3 s) + unique_for (5 s) must exceed unique_for"
    assert flaky.delay(1).id == result.id
    assert result.get(timeout=15) == 1
    assert attempts == [0, 1]
    wait_until(lambda: inspect_lock(result.deduplication_key, app=app) is None)


def test_retry_longer_than_remaining_ttl(app_factory: AppFactory, worker_for: Any) -> None:
    """A retry countdown beyond the remaining TTL keeps the key held across the wait."""
    app = app_factory("retry-long")
    retried = threading.Event()

    @app.task(base=DedupTask, shared=False, bind=True, unique_for=1, max_retries=1)
    def slow_retry(self: Any, x: int) -> int:
        if self.request.retries == 0:
            retried.set()
            raise self.retry(countdown=2.5)
        return x

    result = slow_retry.delay(1)
    worker_for(app)
    assert retried.wait(10)
    time.sleep(1.5)  # past the original 1 s TTL, inside the 2.5 s retry delay
    duplicate = slow_retry.delay(1)
    assert duplicate.deduplicated is True and duplicate.id == result.id
    assert result.get(timeout=15) == 1


def test_final_failure_after_retries(app_factory: AppFactory, worker_for: Any) -> None:
    """When retries are exhausted, 'finish' releases and 'success' keeps the lock."""
    app = app_factory("retry-fail")

    def make(policy: str) -> Any:
        @app.task(
            base=DedupTask,
            shared=False,
            bind=True,
            unique_for=30,
            max_retries=1,
            unique_until=policy,
            name=f"exhaust-{policy}",
        )
        def exhaust(self: Any) -> None:
            raise self.retry(countdown=0.1, exc=ValueError("nope"))

        return exhaust

    finish, success = make("finish"), make("success")
    worker_for(app)
    r_finish, r_success = finish.delay(), success.delay()
    for result in (r_finish, r_success):
        with pytest.raises(ValueError):
            result.get(timeout=15)
    wait_until(lambda: inspect_lock(r_finish.deduplication_key, app=app) is None)
    lock = inspect_lock(r_success.deduplication_key, app=app)
    assert lock is not None and lock.task_id == r_success.id


def test_countdown_adds_delay_to_ttl(app_factory: AppFactory) -> None:
    """A scheduled call holds its lock for the delay plus unique_for."""
    app = app_factory("countdown")

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def probe(url: str) -> None:
        return None

    result = probe.apply_async(("https://x.example",), countdown=600)
    lock = inspect_lock(result.deduplication_key, app=app)
    assert lock is not None and 650 < lock.ttl <= 660


def test_celery_dedup_revoke_releases_at_once(app_factory: AppFactory) -> None:
    """celery_dedup.revoke() frees the key although no worker has seen the message."""
    app = app_factory("revoke-now")

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(x: int) -> None:
        return None

    result = job.apply_async((1,), countdown=60)
    assert celery_dedup.revoke(result) is RevokeOutcome.RELEASED
    assert inspect_lock(result.deduplication_key, app=app) is None
    fresh = job.delay(1)
    assert fresh.deduplicated is False and fresh.id != result.id
    assert celery_dedup.revoke(result) is RevokeOutcome.NOT_HELD  # idempotent, and owner-checked


def test_revoke_by_id_finds_the_lock(app_factory: AppFactory) -> None:
    """revoke() with a bare task id finds the key that id holds."""
    app = app_factory("revoke-id")

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(x: int) -> None:
        return None

    result = job.delay(1)
    assert celery_dedup.revoke(result.id, app=app) is RevokeOutcome.RELEASED
    assert inspect_lock(result.deduplication_key, app=app) is None


def test_result_revoke_releases_when_worker_drops_it(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """A plain result.revoke() releases when the worker reaches the message (task_revoked)."""
    app = app_factory("revoke-worker")
    runs: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(x: int) -> None:
        runs.append(x)

    worker_for(app)
    result = job.apply_async((1,), countdown=5)
    scheduled_by_worker(app, result.id)
    result.revoke()
    wait_until(lambda: inspect_lock(result.deduplication_key, app=app) is None, timeout=20)
    assert app.AsyncResult(result.id).state == states.REVOKED
    assert runs == []


def test_expired_message_releases(app_factory: AppFactory, worker_for: Any) -> None:
    """expires= passing while queued behind a busy worker releases the lock."""
    app = app_factory("expires")
    busy = threading.Event()

    @app.task(base=DedupTask, shared=False, unique_for=300, unique_on=())
    def blocker() -> None:
        busy.wait(10)

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(x: int) -> None:
        return None

    worker_for(app, concurrency=1, pool="solo")
    blocker.delay()
    result = job.apply_async((1,), expires=0.5)
    time.sleep(1)
    busy.set()
    wait_until(lambda: inspect_lock(result.deduplication_key, app=app) is None, timeout=10)
    assert app.AsyncResult(result.id).state == states.REVOKED


def test_expiry_policy_is_not_released_by_revoke(app_factory: AppFactory, worker_for: Any) -> None:
    """'expiry' locks survive a worker-side revoke: the TTL alone ends them."""
    app = app_factory("revoke-expiry")

    @app.task(base=DedupTask, shared=False, unique_for=300, unique_until="expiry")
    def job(x: int) -> None:
        return None

    worker_for(app)
    result = job.apply_async((1,), countdown=5)
    scheduled_by_worker(app, result.id)
    result.revoke()
    wait_until(lambda: app.AsyncResult(result.id).state == states.REVOKED, timeout=20)
    lock = inspect_lock(result.deduplication_key, app=app)
    assert lock is not None and lock.task_id == result.id
