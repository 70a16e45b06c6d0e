"""The reaper frees locks of holders that ended in a releasing state, and nothing else."""

from __future__ import annotations

from typing import Any

from celery import Celery

import celery_dedup
from celery_dedup import DedupTask, inspect_lock
from celery_dedup.reaper import REAP_TASK_NAME, reap, register_reaper
from celery_dedup.results import owner_of
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import ClaimOutcome

from .conftest import AppFactory


def test_reap_follows_each_policy(app_factory: AppFactory) -> None:
    """SUCCESS frees success/finish, FAILURE frees finish, REVOKED frees all but expiry."""
    app = app_factory("reap")
    made = {}
    for policy in ("success", "finish", "expiry"):

        @app.task(
            base=DedupTask, shared=False, name=f"reap.{policy}", unique_for=300, unique_until=policy
        )
        def job(x: int) -> int:
            return x

        made[policy] = job

    ok = {p: t.delay(1) for p, t in made.items()}
    failed = {p: t.delay(2) for p, t in made.items()}
    revoked = {p: t.delay(3) for p, t in made.items()}
    untouched = made["success"].delay(4)
    for result in [*ok.values(), *failed.values(), *revoked.values(), untouched]:
        started_then_died(app, result)
    for result in ok.values():
        app.backend.mark_as_done(result.id, 1)
    for result in failed.values():
        app.backend.mark_as_failure(result.id, ValueError("x"))
    for result in revoked.values():
        app.backend.mark_as_revoked(result.id, "test")

    released = {lock.task_id for lock in reap(app)}

    expected = {
        ok["success"].id,
        ok["finish"].id,
        failed["finish"].id,
        revoked["success"].id,
        revoked["finish"].id,
    }
    assert released == expected
    assert inspect_lock(untouched.deduplication_key, app=app) is not None
    assert inspect_lock(ok["expiry"].deduplication_key, app=app) is not None
    assert inspect_lock(failed["success"].deduplication_key, app=app) is not None
    assert reap(app) == []


def started_then_died(app: Celery, result: Any) -> None:
    """What a worker killed mid-run leaves: its lock marked started, never released."""
    owner = owner_of(result)
    assert owner is not None
    store = runtime_for(app).store
    assert store is not None
    meta = {"task_name": "", "policy": "", "task_id": result.id}
    claim = store.claim(result.deduplication_key, owner, release=False, ttl=None, meta=meta)
    assert claim.outcome is ClaimOutcome.OWNED


def test_a_result_stored_under_a_queued_holders_id_is_not_reaped(app_factory: AppFactory) -> None:
    """A queued holder has no result of its own: one stored under its id never frees it."""
    app = app_factory("reap-queued")

    @app.task(base=DedupTask, shared=False, unique_for=300, unique_until="finish")
    def job(x: int) -> int:
        return x

    queued = job.delay(1)
    app.backend.mark_as_done(queued.id, 1)
    assert reap(app) == []
    assert inspect_lock(queued.deduplication_key, app=app) is not None


def test_old_result_of_a_reused_id_is_ignored(app_factory: AppFactory) -> None:
    """A deterministic id's stored SUCCESS may be an earlier run's: such locks are never reaped."""
    app = app_factory("reap-detid")

    @app.task(base=DedupTask, shared=False, unique_for=300, deterministic_id=True)
    def probe(url: str) -> None:
        return None

    first = probe.delay("https://a.example")
    app.backend.mark_as_done(first.id, None)
    assert reap(app) == []
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.task_id == first.id
    assert celery_dedup.release(first, app=app) is True
    again = probe.delay("https://a.example")
    assert again.id == first.id and again.deduplicated is False
    assert reap(app) == []
    lock = inspect_lock(again.deduplication_key, app=app)
    assert lock is not None and lock.owner != "" and lock.task_id == again.id
def test_register_reaper_adds_a_periodic_task(app_factory: AppFactory, worker_for: Any) -> None:
    """register_reaper adds celery_dedup.reap; a worker runs it and it frees finished locks."""
    app = app_factory("reap-task")

    @app.task(base=DedupTask, shared=False, unique_for=300, unique_until="expiry")
    def job(x: int) -> int:
        return x

    task = register_reaper(app)
    assert app.tasks[REAP_TASK_NAME].name == task.name == REAP_TASK_NAME
    @app.task(base=DedupTask, shared=False, unique_for=300)
    def other(x: int) -> int:
        return x

    # Parked on a queue no worker consumes: only the reaper can free these locks.
    throttled = job.apply_async((1,), queue="parked")
    started_then_died(app, throttled)
    app.backend.mark_as_revoked(throttled.id, "test")
    stuck = other.apply_async((1,), queue="parked")
    started_then_died(app, stuck)
    app.backend.mark_as_done(stuck.id, 1)
    worker_for(app)
    assert task.delay().get(timeout=10) == 1
    assert inspect_lock(stuck.deduplication_key, app=app) is None
    # 'expiry' locks are only ever freed by their TTL
    assert inspect_lock(throttled.deduplication_key, app=app) is not None
