"""The example project's tasks, run by a real worker on the Django DB lock store."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_dedup import DuplicateTaskError, MissingDeduplicationKey, dedup_key_for, time_bucket
from celery_dedup.runtime import runtime_for


def _runs(task: Any) -> int:
    from shop.models import TaskRun

    return int(TaskRun.objects.filter(task_name=task.name).count())


def _wait_released(store: Any, result: Any, timeout: float = 10) -> bool:
    """The worker releases just after storing the result: poll briefly."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lock = store.get(result.deduplication_key)
        if lock is None or lock.task_id != result.id:
            return True
        time.sleep(0.05)
    return False


def test_duplicates_against_a_worker(worker: Any, celery_app: Any) -> None:
    """Each task's policy, end to end: what is published, suppressed, raised, run, released."""
    from shop import tasks

    store = runtime_for(celery_app).store
    home = {"zip": "10115"}

    # sync_address: strict, released on success, then the same call publishes again.
    first = tasks.sync_address.delay(42, home)
    dup = tasks.sync_address.delay(42, home)
    assert first.deduplicated is False and dup.deduplicated is True and dup.id == first.id
    assert first.get(timeout=30) == "synced"
    assert _wait_released(store, first)
    again = tasks.sync_address.delay(42, home)
    assert again.deduplicated is False and again.get(timeout=30) == "synced"

    # process_payment: a duplicate raises, with no holder id in the message; the
    # payment's key stays locked after the charge (unique_until="expiry").
    paid = tasks.process_payment.delay("pay-9", "5.00", "EUR")
    with pytest.raises(DuplicateTaskError) as excinfo:
        tasks.process_payment.delay("pay-9", "5.00", "EUR")
    assert excinfo.value.existing_task_id == paid.id and paid.id not in str(excinfo.value)
    assert paid.get(timeout=30) == "charged 5.00 EUR"

    # fulfill_order: caller_provided: no key raises before publishing; a key deduplicates.
    with pytest.raises(MissingDeduplicationKey):
        tasks.fulfill_order.delay(7, ["book"])
    order = tasks.fulfill_order.apply_async((7, ["book"]), deduplication_key="order:abc")
    replay = tasks.fulfill_order.apply_async((7, ["book"]), deduplication_key="order:abc")
    assert replay.deduplicated is True and replay.id == order.id
    assert order.get(timeout=30) == "fulfilled 1 items"

    # notify: always unique: both calls publish and run.
    notes = [tasks.notify.delay(1, "welcome") for _ in range(2)]
    assert [n.deduplicated for n in notes] == [False, False]
    assert [n.get(timeout=30) for n in notes] == ["sent", "sent"]

    # send_digest: once per user per day; the expiry lock outlives the run.
    digest = tasks.send_digest.delay(3)
    assert tasks.send_digest.delay(3).deduplicated is True
    assert digest.get(timeout=30) == "digest sent to user 3"
    assert _wait_released(store, digest, timeout=0.5) is False  # still held: TTL only

    assert (_runs(tasks.sync_address), _runs(tasks.process_payment), _runs(tasks.fulfill_order),
            _runs(tasks.notify), _runs(tasks.send_digest)) == (2, 1, 1, 2, 1)
    assert _wait_released(store, paid, timeout=0.5) is False  # the charge's key: TTL only


def test_probe_is_scheduled_once_with_a_deterministic_id(celery_app: Any,
                                                         transactional_db: None) -> None:
    """Scheduling the same probe twice is one message; its id and TTL follow the key and delay."""
    from shop import tasks

    first = tasks.schedule_probe("https://peer.example", attempt=1)
    second = tasks.schedule_probe("https://peer.example", attempt=1)
    assert first.deduplicated is False and second.deduplicated is True
    assert first.id == second.id
    key = dedup_key_for(tasks.probe_server, ("https://peer.example", 1))
    assert key == first.deduplication_key
    lock = runtime_for(celery_app).store.get(key)
    countdown = tasks.probe_countdown(1)
    assert countdown == 15 * 60
    assert lock is not None and countdown + 590 < lock.ttl <= countdown + 600
    other = tasks.schedule_probe("https://peer.example", attempt=2)
    assert other.id != first.id


def test_digest_key_is_per_day(celery_app: Any) -> None:
    """The digest key names the user and today's UTC bucket."""
    from shop.tasks import digest_key

    assert digest_key(5) == f"digest:5:{time_bucket('day')}"


def test_periodic_cleanup_runs_once_per_beat_tick(worker: Any, celery_app: Any) -> None:
    """Two beat instances tick ``purge_expired_locks``: one runs, and it deletes expired rows."""
    from shop import tasks

    from celery_dedup.contrib.django.models import DedupLock

    store = runtime_for(celery_app).store
    store.acquire("celery-dedup:old:1", "gone", 0.05, {"task_name": "old", "policy": "expiry"})
    time.sleep(0.1)
    beat = {"headers": {"celery_beat_task": True}}
    tick = tasks.purge_expired_locks.apply_async(**beat)
    other = tasks.purge_expired_locks.apply_async(**beat)
    assert tick.deduplicated is False and other.deduplicated is True
    assert tick.get(timeout=30) >= 1
    assert not DedupLock.objects.filter(key="celery-dedup:old:1").exists()


def test_beat_schedule_names_a_registered_task(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The example settings schedule ``purge_expired_locks`` hourly, a registered task."""
    import importlib
    import sys

    from example_project.celery import app

    monkeypatch.setenv("EXAMPLE_VAR_DIR", str(tmp_path))  # its var/ folder goes here
    monkeypatch.delitem(sys.modules, "example_project.settings", raising=False)
    settings = importlib.import_module("example_project.settings")
    monkeypatch.delitem(sys.modules, "example_project.settings")
    entry = settings.CELERY_BEAT_SCHEDULE["purge-expired-locks"]
    assert entry["task"] == "shop.tasks.purge_expired_locks"
    assert entry["schedule"].total_seconds() == 3600
    assert entry["task"] in app.tasks
