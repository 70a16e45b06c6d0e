"""Every path through apply_async: signatures, canvas, worker-side publishes, beat, send_task."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import chain, chord, group, states

from celery_dedup import DedupTask, DuplicateTaskError, dedup_key_for, enqueue_many, inspect_lock
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until


def test_signature_set_options_apply(app_factory: AppFactory, worker_for: Any) -> None:
    """Options given with sig.set() are honoured and never published as message properties."""
    app = app_factory("sig")

    @app.task(base=DedupTask, shared=False, bind=True)
    def job(self: Any, x: int) -> Any:
        return sorted(
            k for k in ("deduplication_key", "unique_for") if k in self.request.properties
        )

    first = job.s(1).set(deduplication_key="k1", unique_for=30).apply_async()
    second = job.s(2).set(deduplication_key="k1", on_key_reuse="ignore").delay()
    assert second.deduplicated is True and second.id == first.id
    worker_for(app)
    assert first.get(timeout=10) == []


def test_duplicate_raise_hides_holder_id(app_factory: AppFactory) -> None:
    """on_duplicate='raise' raises with context attributes; str and repr omit the holder id."""
    app = app_factory("raise")

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="raise")
    def pay(payment_id: int) -> None:
        return None

    holder = pay.delay(1)
    with pytest.raises(DuplicateTaskError) as info:
        pay.delay(1)
    err = info.value
    assert err.task_name == pay.name and err.existing_task_id == holder.id
    assert err.key == holder.deduplication_key and err.ttl is not None and 0 < err.ttl <= 30
    assert holder.id not in str(err) and holder.id not in repr(err)
    assert pay.apply_async((1,), on_duplicate="existing").id == holder.id


def test_chain_first_step_and_worker_side_steps(app_factory: AppFactory, worker_for: Any) -> None:
    """A chain's first step is checked in the producer; a later duplicate step never fails it."""
    app = app_factory("chain")

    @app.task(
        base=DedupTask, shared=False, unique_for=30, on_duplicate="raise", unique_until="expiry"
    )
    def step(x: int) -> int:
        return x + 1

    step.delay(2)  # holds the lock of step(2), which the chain's second step will hit
    workflow = chain(step.s(1), step.s())
    first = workflow.apply_async()
    worker_for(app)
    # step(1) → 2; step(2) is a duplicate published from the worker: it returns the holder's
    # handle instead of raising, so the parent step succeeds.
    parent = first.parent
    assert parent is not None and parent.get(timeout=10) == 2
    assert parent.state == states.SUCCESS
    with pytest.raises(DuplicateTaskError):
        chain(step.s(1), step.s()).apply_async()


def test_chain_step_carrying_the_rest_is_published(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """A held middle step of a chain is published anyway, so the steps after it still run."""
    app = app_factory("chain3")

    @app.task(base=DedupTask, shared=False, unique_for=30, unique_until="expiry")
    def step(x: int) -> int:
        return x + 1

    held = step.delay(2)
    result = chain(step.s(1), step.s(), step.s()).apply_async()
    worker_for(app)
    assert result.get(timeout=10) == 4
    assert held.get(timeout=10) == 3


def test_link_callback_is_deduplicated_worker_side(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """A link callback whose key is held is suppressed without failing the parent."""
    app = app_factory("link")
    runs: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=30, unique_until="expiry")
    def cb(x: int) -> int:
        runs.append(x)
        return x

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def parent(x: int) -> int:
        return x

    worker_for(app)
    cb.delay(7).get(timeout=10)
    result = parent.apply_async((7,), link=cb.s())
    assert result.get(timeout=10) == 7
    assert result.state == states.SUCCESS
    assert runs == [7]


def test_group_and_chord_members_never_suppressed(app_factory: AppFactory, worker_for: Any) -> None:
    """Duplicate members of a group and of a chord header all run; the chord completes."""
    app = app_factory("canvas")

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def square(x: int) -> int:
        return x * x

    @app.task(shared=False)
    def total(values: list[int]) -> int:
        return sum(values)

    worker_for(app)
    held = square.delay(3)
    assert group(square.s(3), square.s(3), square.s(4)).apply_async().get(timeout=10) == [9, 9, 16]
    assert chord([square.s(3), square.s(3)], total.s()).apply_async().get(timeout=10) == 18
    assert held.get(timeout=10) == 9


def test_beat_publish_never_raises(app_factory: AppFactory) -> None:
    """A publish marked by celery beat returns the holder instead of raising."""
    app = app_factory("beat")

    @app.task(base=DedupTask, shared=False, unique_for=30, on_duplicate="raise")
    def tick() -> None:
        return None

    first = tick.apply_async(headers={"celery_beat_task": True})
    again = tick.apply_async(headers={"celery_beat_task": True})
    assert again.deduplicated is True and again.id == first.id


def test_celery_beat_scheduler_entry(app_factory: AppFactory, worker_for: Any) -> None:
    """Celery beat's own scheduler: a due entry whose previous run is still queued is
    suppressed without a SchedulingError, and runs again once the holder finished."""
    from datetime import timedelta

    from celery.beat import ScheduleEntry, Scheduler

    app = app_factory("beat-real")

    @app.task(base=DedupTask, shared=False, name="beat.tick", unique_for=60, on_duplicate="raise")
    def tick() -> str:
        return "tick"

    scheduler = Scheduler(app, lazy=True)
    entry = ScheduleEntry(name="tick", task="beat.tick", schedule=timedelta(seconds=1), app=app)
    first = scheduler.apply_async(entry, advance=False)
    second = scheduler.apply_async(entry, advance=False)
    assert first.deduplicated is False
    assert second.deduplicated is True and second.id == first.id
    worker_for(app)
    assert first.get(timeout=10) == "tick"
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is None)
    third = scheduler.apply_async(entry, advance=False)
    assert third.deduplicated is False and third.get(timeout=10) == "tick"


def test_deterministic_id(app_factory: AppFactory, worker_for: Any) -> None:
    """deterministic_id derives the task id from the key; a repeat is still a duplicate."""
    app = app_factory("detid")
    runs: list[str] = []

    @app.task(base=DedupTask, shared=False, unique_for=60, deterministic_id=True)
    def probe(url: str, attempt: int) -> str:
        runs.append(url)
        return url

    first = probe.delay("https://a.example", 1)
    second = probe.delay("https://a.example", 1)
    assert second.deduplicated is True and second.id == first.id
    assert second.duplicate_id != first.id
    worker_for(app)
    assert first.get(timeout=10) == "https://a.example"
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is None)
    third = probe.delay("https://a.example", 1)
    assert third.deduplicated is False and third.id == first.id
    assert third.get(timeout=10) == "https://a.example"


def test_send_task_is_guarded_in_the_worker(app_factory: AppFactory, worker_for: Any) -> None:
    """A send_task message (no header) is skipped by the worker while another task holds the key."""
    app = app_factory("sendtask")
    release_holder = threading.Event()
    runs: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def sync(user_id: int) -> int:
        runs.append(user_id)
        release_holder.wait(10)
        return user_id

    holder = sync.delay(1)
    raw = app.send_task(sync.name, args=(1,))
    worker_for(app, concurrency=2)
    wait_until(lambda: app.AsyncResult(raw.id).state == states.IGNORED)
    release_holder.set()
    assert holder.get(timeout=10) == 1
    assert runs == [1]
    alone = app.send_task(sync.name, args=(2,))
    assert alone.get(timeout=10) == 2
    # The guard is a throttle: a later copy that does not overlap is skipped too.
    lock = inspect_lock(dedup_key_for(sync, (2,)) or "", app=app)
    assert lock is not None and lock.task_id == alone.id and lock.policy == "expiry"
    assert 25 < lock.ttl <= 30
    later = app.send_task(sync.name, args=(2,))
    wait_until(lambda: app.AsyncResult(later.id).state == states.IGNORED)
    assert runs == [1, 2]


def test_replace_debounces(app_factory: AppFactory, worker_for: Any) -> None:
    """on_duplicate='replace' publishes the newest call; the replaced one is skipped."""
    app = app_factory("replace")
    runs: list[str] = []

    @app.task(
        base=DedupTask, shared=False, unique_for=30, on_duplicate="replace", unique_on=("doc",)
    )
    def render(doc: int, version: str) -> str:
        runs.append(version)
        return version

    old = render.delay(1, "v1")
    new = render.delay(1, "v2")
    assert new.deduplicated is False and new.id != old.id
    lock = inspect_lock(new.deduplication_key, app=app)
    assert lock is not None and lock.task_id == new.id
    worker_for(app)
    assert new.get(timeout=10) == "v2"
    wait_until(lambda: app.AsyncResult(old.id).state in (states.REVOKED, states.IGNORED))
    assert runs == ["v2"]


def test_publish_failure_releases_lock(app_factory: AppFactory, redis_server: RedisServer) -> None:
    """If the broker refuses the publish, the lock just taken is released and the error raised."""
    from tests.fixtures._servers import free_port

    app = app_factory(
        "pubfail",
        broker_url=f"redis://127.0.0.1:{free_port()}/0",
        dedup_store=redis_server.url(4),
    )

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def job(x: int) -> int:
        return x

    key = dedup_key_for(job, (1,))
    assert key is not None
    with pytest.raises(Exception) as info:
        job.apply_async((1,), retry=False)
    assert "refused" in str(info.value).lower() or "connect" in str(info.value).lower()
    assert inspect_lock(key, app=app) is None


def test_eager_mode_follows_the_same_path(app_factory: AppFactory) -> None:
    """In task_always_eager the lock is taken, the task runs inline and 'success' frees it."""
    app = app_factory("eager", task_always_eager=True)
    runs: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def job(x: int) -> int:
        runs.append(x)
        return x * 2

    @app.task(base=DedupTask, shared=False, unique_for=30, unique_until="expiry")
    def throttled(x: int) -> int:
        runs.append(x)
        return x

    assert job.delay(2).get() == 4
    assert job.delay(2).deduplicated is False  # released on success
    first = throttled.delay(9)
    assert throttled.delay(9).deduplicated is True
    assert first.get() == 9
    assert runs == [2, 2, 9]


def test_enqueue_many_batch_lock(app_factory: AppFactory, worker_for: Any) -> None:
    """enqueue_many publishes a group once per batch key; a repeat returns the first group."""
    app = app_factory("batch")

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def item(x: int) -> int:
        return x

    first = enqueue_many([item.s(1), item.s(2)], deduplication_key="batch:1", app=app)
    again = enqueue_many([item.s(1), item.s(2)], deduplication_key="batch:1", app=app)
    assert first.deduplicated is False and again.deduplicated is True and again.id == first.id
    with pytest.raises(DuplicateTaskError):
        enqueue_many([item.s(3)], deduplication_key="batch:1", on_duplicate="raise", app=app)
    worker_for(app)
    assert first.get(timeout=10) == [1, 2]
    assert [r.id for r in again.results] == [r.id for r in first.results]
