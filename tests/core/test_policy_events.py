"""Which policy acted, as a real event receiver on the Redis broker sees it.

``replace`` (and a replace whose ETA ``debounce_max_wait`` capped) sends
``task-replaced`` under the replaced message's id; ``cancel_running``
sends ``task-cancelled`` under the cancelled holder's id (queued: revoked;
running: terminated); a suppressed call's ``task-deduplicated`` names the
policy that decided (``on_duplicate``, ``on_key_reuse``). All of them only
when ``dedup_send_events`` is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dedup import DeduplicatedResult, DedupTask, KeyReuseError, RateLimited
from celery_dedup.events import dispatcher_hostname
from celery_dedup.runtime import reset_runtime
from tests.fixtures._events import Recorder

from .conftest import AppFactory, wait_until
from .test_cancel_running import RUNS_DB, worker  # noqa: F401 (a fixture)
from .test_cancel_running import app as cancel_app
from .test_cancel_running import runs as cancel_runs
from .test_cancel_running import sync as cancel_sync

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

@pytest.fixture
def recorded(app_factory: AppFactory) -> Iterator[Callable[..., tuple[Celery, Recorder]]]:
    """An app (events on unless told) and a receiver subscribed to its broker's events."""
    recorders: list[Recorder] = []

    def make(name: str, **conf: Any) -> tuple[Celery, Recorder]:
        conf.setdefault("dedup_send_events", True)
        app = app_factory(name, **conf)
        recorder = Recorder(app)
        recorders.append(recorder)
        return app, recorder

    yield make
    for recorder in recorders:
        recorder.close()


def test_replace_and_capped_replace_send_task_replaced(recorded: Any) -> None:
    """Each replaced message gets a task-replaced event under its own id naming the policy."""
    app, recorder = recorded("ev-replace")

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="replace")
    def sync(n: int) -> int:
        return n

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="replace",
              debounce_max_wait=1, deduplication_key=lambda *args, **kwargs: "burst")
    def debounced(n: int) -> int:
        return n

    first = sync.delay(1)
    second = sync.delay(1)
    burst = [debounced.apply_async((i,), countdown=30) for i in range(3)]
    replaced = recorder.of("task-replaced")
    assert [(e["uuid"], e["policy"], e["new_task_id"]) for e in replaced] == [
        (first.id, "replace", second.id),
        (burst[0].id, "replace+max_wait", burst[1].id),
        (burst[1].id, "replace+max_wait", burst[2].id),
    ]
    assert replaced[0]["result"] == f"replaced by {second.id} (replace)"
    assert replaced[0]["name"] == sync.name
    assert all(e["hostname"] == dispatcher_hostname() for e in replaced)
    # Nothing but the task events: a worker-offline for the dispatcher would set
    # Flower's flower_worker_online gauge to 0 (offline-worker alerts).
    recorder.settled()
    assert not [
        e for e in recorder.events
        if e["type"].startswith("worker-") and e["hostname"] == dispatcher_hostname()
    ]


def test_replace_with_a_deterministic_id_reports_under_a_fresh_id(recorded: Any) -> None:
    """The new message has the replaced one's id: the event must not mark it REPLACED."""
    app, recorder = recorded("ev-det")

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="replace",
              deterministic_id=True)
    def sync(n: int) -> int:
        return n

    first = sync.delay(1)
    second = sync.delay(1)
    assert first.id == second.id
    (event,) = recorder.of("task-replaced")
    assert event["uuid"] != first.id
    assert event["parent_id"] == first.id and event["policy"] == "replace"


def test_cancel_running_over_a_queued_holder_sends_task_cancelled(recorded: Any) -> None:
    """The revoked queued holder gets task-cancelled (running=False) under its own id."""
    app, recorder = recorded("ev-cancel")

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="cancel_running")
    def sync(n: int) -> int:
        return n

    first = sync.delay(1)
    second = sync.delay(1)
    (event,) = recorder.of("task-cancelled")
    assert (event["uuid"], event["policy"], event["running"]) == (
        first.id, "cancel_running", False,
    )
    assert event["new_task_id"] == second.id
    assert event["result"] == f"cancelled (revoked) by {second.id} (cancel_running)"


@pytest.mark.parametrize("worker", ["redis"], indirect=True)
def test_cancel_running_over_a_running_holder_sends_task_cancelled(
    worker: Any, redis_server: Any  # noqa: F811 (the imported fixture)
) -> None:
    """A terminated running holder gets task-cancelled (running=True); the new call runs.

    The prefork worker subprocess and tasks of ``test_cancel_running``; the
    event is the producer's (this process), so only its configuration turns
    events on.
    """
    cancel_app.conf.dedup_send_events = True
    reset_runtime(cancel_app)
    recorder = Recorder(cancel_app)
    try:
        worker.start()
        old = cancel_sync.delay(1, "old")
        wait_until(lambda: "start:old" in cancel_runs(redis_server), timeout=30)
        new = cancel_sync.delay(1, "new")  # returns once the worker freed the key
        with redis_server.client(RUNS_DB) as client:
            client.set("go", "1")
        assert new.get(timeout=30) == "new"
        cancelled = recorder.of("task-cancelled")
    finally:
        recorder.close()
        cancel_app.conf.dedup_send_events = None
        reset_runtime(cancel_app)
    assert [(e["uuid"], e["running"], e["new_task_id"]) for e in cancelled] == [
        (old.id, True, new.id)
    ]
    assert cancelled[0]["result"] == f"cancelled (terminated) by {new.id} (cancel_running)"
    assert "interrupted:old" in cancel_runs(redis_server)


def test_deduplicated_events_name_the_policy(recorded: Any) -> None:
    """A plain duplicate names its on_duplicate ("existing", the default); a reused key
    names on_key_reuse (warn or raise)."""
    app, recorder = recorded("ev-dedup")

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def sync(n: int) -> int:
        return n

    holder = sync.delay(1)
    duplicate = sync.delay(1)
    assert isinstance(duplicate, DeduplicatedResult)
    keyed = sync.apply_async((1,), deduplication_key="order-7")
    with pytest.warns(UserWarning):
        warned = sync.apply_async((2,), deduplication_key="order-7", on_key_reuse="warn")
    with pytest.raises(KeyReuseError):
        sync.apply_async((3,), deduplication_key="order-7", on_key_reuse="raise")
    events = recorder.of("task-deduplicated")
    assert [(e["policy"], e.get("parent_id")) for e in events] == [
        ("existing", holder.id),
        ("on_key_reuse=warn", keyed.id),
        ("on_key_reuse=raise", keyed.id),
    ]
    assert events[0]["uuid"] == duplicate.duplicate_id
    assert events[0]["result"] == f"suppressed: duplicate of {holder.id}"
    assert events[1]["uuid"] == warned.duplicate_id
    assert events[1]["result"] == f"suppressed: duplicate of {keyed.id} (on_key_reuse=warn)"
    assert events[2]["uuid"] not in {holder.id, keyed.id, duplicate.duplicate_id}
    assert "refused" in events[2]["result"] and "on_key_reuse=raise" in events[2]["result"]


def test_no_policy_event_with_events_off(recorded: Any) -> None:
    """dedup_send_events=False: replace, cancel_running and duplicates cost no broker publish."""
    app, recorder = recorded("ev-off", dedup_send_events=False)

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="replace")
    def replaced(n: int) -> int:
        return n

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="cancel_running")
    def cancelled(n: int) -> int:
        return n

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def plain(n: int) -> int:
        return n

    for task in (replaced, cancelled, plain):
        task.delay(1)
        task.delay(1)
    assert recorder.settled() == []


def test_rate_refusal_sends_task_rate_limited(recorded: Any) -> None:
    """A call refused by ``rate_limit_per_key`` is visible like a duplicate: one
    ``task-rate-limited`` event under the refused call's own, never-published uuid; a
    delayed call (``on_rate_limit="delay"``) is published, so it sends none."""
    app, recorder = recorded("ev-rate")

    @app.task(base=DedupTask, shared=False, unique_for=60, rate_limit_per_key="1/h",
              rate_key="{user}")
    def notify(user: str, n: int) -> int:
        return n

    @app.task(base=DedupTask, shared=False, unique_for=60, rate_limit_per_key="1/h",
              rate_key="{user}", on_rate_limit="delay")
    def later(user: str, n: int) -> int:
        return n

    admitted = notify.delay("ada", 1)
    with pytest.raises(RateLimited) as info:
        notify.delay("ada", 2)
    later.delay("ada", 1)
    later.delay("ada", 2)
    limited = recorder.of("task-rate-limited")
    assert len(limited) == 1
    event = limited[0]
    assert event["uuid"] not in (admitted.id, None)
    assert event["name"] == notify.name
    assert event["args"] == "('ada', 2)"
    assert 0 < event["retry_after"] <= 3600
    assert abs(event["retry_after"] - info.value.retry_after) < 5
    assert event["result"].startswith("refused: over rate_limit_per_key")
    assert event["hostname"] == dispatcher_hostname()
    assert not [e for e in recorder.events if e.get("uuid") == admitted.id
                and e["type"] == "task-rate-limited"]
