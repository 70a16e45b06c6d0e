"""The README's and the docs' examples, type-checked (never run) by::

    python -m mypy tests/typing/api_usage.py

If a change to the public API breaks an example users copy, mypy fails here.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery, group

from celery_dedup import (
    BulkResult,
    DeduplicatedResult,
    DedupTask,
    DuplicateTaskError,
    Identity,
    ItemOutcome,
    ItemStatus,
    Lock,
    OnDuplicate,
    UniqueUntil,
    dedup_key_for,
    enqueue_many,
    inspect_lock,
    release,
    revoke,
    task_deduplicated,
    time_bucket,
)
from celery_dedup.testing import (
    assert_deduplicated,
    assert_not_deduplicated,
    capture_dedup_signals,
    held_locks,
    memory_store,
)

app = Celery("proj", broker="redis://localhost:6379/0", backend="redis://localhost:6379/1")
app.conf.dedup_default_ttl = 3600


@app.task(base=DedupTask, unique_for=600, unique_until="success")
def sync_address(user_id: int, address: dict[str, str]) -> None:
    """Push an address to the CRM."""


@app.task(base=DedupTask, unique_for=timedelta(hours=1), unique_until=UniqueUntil.EXPIRY)
def send_digest(customer_id: int) -> None:
    """Send the daily digest."""


@app.task(base=DedupTask, identity=Identity.CALLER_PROVIDED, on_duplicate=OnDuplicate.RAISE)
def charge(order_id: int, amount_cents: int) -> None:
    """Charge an order once per idempotency key."""


@app.task(base=DedupTask, unique_on=("user_id",), deterministic_id=True)
def rebuild_profile(user_id: int, reason: str) -> None:
    """Rebuild a profile; the reason does not make a call different."""


def report_key(customer_id: int) -> str:
    """A caller key: one report per customer per hour."""
    return f"report:{customer_id}:{time_bucket('hour')}"


@app.task(base=DedupTask, deduplication_key=report_key)
def build_report(customer_id: int) -> None:
    """Build a report at most once per customer and hour."""


class ThrottledTask(DedupTask):
    """A base class with the options set once for many tasks."""

    unique_for = 300
    unique_until = "expiry"
    on_duplicate = "existing"


def quick_start() -> None:
    """``delay`` and ``apply_async`` with per-call options."""
    first = sync_address.apply_async(args=[42, {"zip": "10115"}])
    again = sync_address.apply_async(args=[42, {"zip": "10115"}])
    published: bool = not first.deduplicated
    holder_id: str = again.id
    print(published, holder_id, again.deduplication_key)

    result = sync_address.delay(42, {"zip": "10115"})
    if isinstance(result, DeduplicatedResult):
        key: str = result.deduplication_key
        lock: Lock | None = result.lock
        never_published: str | None = result.duplicate_id
        print(key, lock, never_published, result.id)

    send_digest.apply_async(
        args=[7],
        deduplication_key=f"digest:7:{time_bucket('day')}",
        unique_for=3600,
        unique_until="expiry",
    )
    send_digest.apply_async(args=[7], countdown=60, unique_for=None)  # bypass: no lock


def raise_on_duplicate() -> int:
    """``on_duplicate="raise"``: an HTTP 409 for an API client."""
    try:
        charge.apply_async(args=[1, 999], deduplication_key="Idempotency-Key:abc")
    except DuplicateTaskError as exc:
        holder: str = exc.existing_task_id
        ttl: float | None = exc.ttl
        print(exc.task_name, exc.key, holder, ttl)
        return 409
    return 202


def batches() -> None:
    """One lock for a whole batch; the canvas result comes back."""
    batch = [send_digest.s(customer) for customer in (1, 2, 3)]
    result = enqueue_many(batch, deduplication_key="digest-run:2026-11-22", unique_for=3600)
    print(result.id)
    group(batch).apply_async()
    outcomes: BulkResult = enqueue_many(batch, per_item=True)
    for outcome in outcomes:
        status: ItemStatus = outcome.status
        error: BaseException | None = outcome.error
        print(outcome.index, status.value, outcome.result, error)
    published: list[ItemOutcome] = outcomes.with_status("published")
    print(len(published), outcomes.results)


def helpers() -> None:
    """Keys, locks, release and revoke."""
    key: str | None = dedup_key_for(sync_address, args=[42, {"zip": "10115"}])
    if key is not None:
        lock: Lock | None = inspect_lock(key, app=app)
        if lock is not None:
            seconds_left: float = lock.ttl
            print(lock.owner, lock.task_name, lock.policy, lock.expires_at, seconds_left)
        released: bool = release(key, force=True, app=app)
        print(released)
    result = sync_address.apply_async(args=[42, {"zip": "10115"}])
    print(revoke(result), release(result))
    week: str = time_bucket("week", datetime(2026, 11, 22, tzinfo=timezone.utc))
    print(week)


@task_deduplicated.connect
def count_duplicates(sender: Any = None, key: str = "", **kwargs: Any) -> None:
    """A signal receiver."""
    print(sender, key, kwargs.get("existing_task_id"))


def in_a_test() -> None:
    """``celery_dedup.testing`` in a user's test."""
    with memory_store(app) as store, capture_dedup_signals() as sent:
        first = send_digest.apply_async(args=[7])
        assert_not_deduplicated(first)
        assert_deduplicated(send_digest.apply_async(args=[7]))
        locks: list[Lock] = held_locks(app, send_digest)
        names: list[str] = [s.name for s in sent.named("task_deduplicated")]
        print(store.get(locks[0].key), names)
