"""celery-dedup's events as a real Flower shows them, with a real worker on Redis."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app import trace
from celery.contrib.testing.worker import start_worker

from celery_dedup import DeduplicatedResult, DedupTask
from celery_dedup.events import dispatcher_hostname
from celery_dedup.runtime import runtime_for
from tests.apps.cli_app import SLOW, make_app
from tests.fixtures.flower import FlowerServer

pytestmark = [pytest.mark.flower, pytest.mark.redis, pytest.mark.slow]

WORKER = "flower-test@127.0.0.1"
N_DUPLICATES = 3
#: the Flower state of a message each policy displaced
STATE = {"replace": "REPLACED", "cancel_running": "CANCELLED"}


@pytest.fixture
def app(flower: FlowerServer, redis_url: str) -> Iterator[Celery]:
    """The demo app on Flower's broker, events on, locks and results in Redis db 1."""
    app = make_app(
        flower.broker_url,
        redis_url,
        worker_send_task_events=True,
        task_send_sent_event=True,
    )
    yield app
    app.close()


@pytest.fixture
def worker(app: Celery) -> Iterator[Any]:
    """A real in-process worker (two threads) sending task events.

    ``celery worker`` sets up the tracer with its node name (so
    ``task.request.hostname`` is ``WORKER``); the bare test controller does
    not, so the fixture does what ``celery.apps.worker`` does.
    """
    trace.setup_worker_optimizations(app, WORKER)
    try:
        with start_worker(
            app, pool="threads", concurrency=2, perform_ping_check=False, hostname=WORKER,
            loglevel="WARNING", shutdown_timeout=30,
        ) as controller:
            yield controller
    finally:
        trace.reset_worker_optimizations(app)
        runtime_for(app).metrics.flush()


def events_counted(flower: FlowerServer, task: str, event: str) -> float:
    """``flower_events_total`` for one task and event type, summed over workers."""
    total = 0.0
    pattern = re.compile(r"^flower_events_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
    for line in flower.get("/metrics").splitlines():
        match = pattern.match(line)
        if match and f'task="{task}"' in match["labels"] and f'type="{event}"' in match["labels"]:
            total += float(match["value"])
    return total


def test_duplicates_are_children_of_an_intact_holder(
    app: Celery, worker: Any, flower: FlowerServer
) -> None:
    """N duplicates show as DEDUPLICATED children of a holder that stays SUCCESS on its worker."""
    counted_before = events_counted(flower, SLOW, "task-deduplicated")
    slow = app.tasks[SLOW]
    holder = slow.delay(1.5, tag="flower")
    duplicates = [slow.delay(1.5, tag="flower") for _ in range(N_DUPLICATES)]
    assert all(isinstance(d, DeduplicatedResult) and d.id == holder.id for d in duplicates)
    duplicate_ids = {d.duplicate_id for d in duplicates}
    assert len(duplicate_ids) == N_DUPLICATES and holder.id not in duplicate_ids
    assert holder.get(timeout=30) == "done flower"

    def holder_done() -> dict[str, Any] | None:
        info = flower.task(holder.id)
        if info and info["state"] == "SUCCESS" and set(info["children"]) >= duplicate_ids:
            return info
        return None

    info = flower.wait_for(holder_done, what="the holder's SUCCESS and children")
    assert info["worker"] == WORKER
    assert info["result"] == "'done flower'"
    assert set(info["children"]) == duplicate_ids

    for duplicate_id in duplicate_ids:
        row = flower.task(duplicate_id)
        assert row is not None
        assert row["state"] == "DEDUPLICATED"
        assert row["parent_id"] == holder.id
        assert row["name"] == SLOW
        assert row["args"] == "(1.5,)" and row["kwargs"] == "{'tag': 'flower'}"
        assert row["result"] == f"suppressed: duplicate of {holder.id}"
        assert row["worker"] == dispatcher_hostname()
        assert row["received"] and abs(row["received"] - time.time()) < 60

    filtered = flower.get_json(f"/api/tasks?state=DEDUPLICATED&taskname={SLOW}")
    assert duplicate_ids <= set(filtered)
    assert holder.id not in filtered
    assert all(row["state"] == "DEDUPLICATED" for row in filtered.values())

    assert events_counted(flower, SLOW, "task-deduplicated") - counted_before == N_DUPLICATES


def test_skipped_task_shows_ignored(app: Celery, worker: Any, flower: FlowerServer) -> None:
    """A message that bypassed apply_async and was skipped by the worker shows as IGNORED."""
    slow = app.tasks[SLOW]
    holder = slow.delay(2.0, tag="skip")
    bypass = app.send_task(SLOW, args=(2.0,), kwargs={"tag": "skip"})
    assert bypass.id != holder.id
    assert holder.get(timeout=30) == "done skip"

    def skipped() -> dict[str, Any] | None:
        info = flower.task(bypass.id)
        return info if info and info["state"] == "IGNORED" else None

    info = flower.wait_for(skipped, what="the skipped task's IGNORED state")
    assert info["worker"] == WORKER
    assert holder.id in info["result"]
    assert bypass.state == "IGNORED"
    assert flower.wait_for(lambda: (flower.task(holder.id) or {}).get("state") == "SUCCESS")


def test_deferred_message_shows_deferred(
    app: Celery, flower: FlowerServer, request: pytest.FixtureRequest
) -> None:
    """A message over its concurrency limit shows as DEFERRED (not failed), then SUCCESS."""

    @app.task(
        base=DedupTask,
        shared=False,
        name="demo.limited",
        concurrency_limit=1,
        concurrency_key="{account}",
        concurrency_backoff=0.5,
    )
    def limited(account: str, seconds: float) -> str:
        time.sleep(seconds)
        return account

    request.getfixturevalue("worker")  # started once the task is registered
    first = limited.delay("acme", 2.0)
    second = limited.delay("acme", 0.0)

    def deferred() -> dict[str, Any] | None:
        info = flower.task(second.id)
        return info if info and info["state"] == "DEFERRED" else None

    info = flower.wait_for(deferred, what="the deferred task's DEFERRED state")
    assert "concurrency limit 1 reached" in info["result"]
    assert first.get(timeout=30) == second.get(timeout=30) == "acme"
    assert flower.wait_for(lambda: (flower.task(second.id) or {}).get("state") == "SUCCESS")
    assert events_counted(flower, "demo.limited", "task-deferred") >= 1


def dashboard_workers(flower: FlowerServer) -> dict[str, dict[str, Any]]:
    """The rows of Flower's *Workers* dashboard (what its page fetches), by name."""
    rows = flower.get_json("/workers?json=1")["data"]
    return {row["hostname"]: row for row in rows}


def online_gauges(flower: FlowerServer) -> dict[str, float]:
    """``flower_worker_online`` by worker: what offline-worker alerts watch."""
    pattern = re.compile(r'^flower_worker_online\{worker="(?P<worker>[^"]*)"\} (?P<value>\S+)$')
    matches = (pattern.match(line) for line in flower.get("/metrics").splitlines())
    return {m["worker"]: float(m["value"]) for m in matches if m}


def test_a_call_made_by_a_running_task_adds_no_worker_row(
    app: Celery, flower: FlowerServer, request: pytest.FixtureRequest
) -> None:
    """A duplicate called by a task a worker runs is reported from that worker's hostname:
    its DEDUPLICATED row is there, and no other worker row counts it."""
    slow = app.tasks[SLOW]

    @app.task(shared=False, name="demo.caller")
    def caller(tag: str) -> str:
        result = slow.delay(2.0, tag=tag)
        assert isinstance(result, DeduplicatedResult)
        return result.duplicate_id

    request.getfixturevalue("worker")  # started once the task is registered
    flower.wait_for(lambda: WORKER in dashboard_workers(flower), what="the worker's row")
    counted = {name: row.get("task-deduplicated", 0)
               for name, row in dashboard_workers(flower).items()}
    holder = slow.delay(2.0, tag="inner")
    duplicate_id = caller.delay("inner").get(timeout=30)
    assert holder.get(timeout=30) == "done inner"

    row = flower.wait_for(lambda: flower.task(duplicate_id), what="the DEDUPLICATED row")
    assert row["state"] == "DEDUPLICATED"
    assert row["parent_id"] == holder.id
    assert row["worker"] == WORKER

    def counted_by_the_worker() -> dict[str, dict[str, Any]] | None:
        rows = dashboard_workers(flower)
        return rows if rows[WORKER].get("task-deduplicated", 0) == counted.get(WORKER, 0) + 1 \
            else None

    rows = flower.wait_for(counted_by_the_worker, what="the worker's task-deduplicated count")
    others = {name: row.get("task-deduplicated", 0) for name, row in rows.items()
              if name != WORKER}
    assert others == {name: counted.get(name, 0) for name in others}
    assert not set(rows) - set(counted)  # no new row


def test_the_dispatcher_is_never_reported_offline(
    app: Celery, worker: Any, flower: FlowerServer
) -> None:
    """A call made outside a worker: its row is there, the dispatcher never gets a
    flower_worker_online series (no offline alert), /api/workers lists only real ones."""
    slow = app.tasks[SLOW]
    holder = slow.delay(0.5, tag="phantom")
    duplicate = slow.delay(0.5, tag="phantom")
    assert isinstance(duplicate, DeduplicatedResult)
    assert holder.get(timeout=30) == "done phantom"
    row = flower.wait_for(lambda: flower.task(duplicate.duplicate_id), what="the DEDUPLICATED row")
    assert row["state"] == "DEDUPLICATED" and row["worker"] == dispatcher_hostname()
    # Before, a worker-offline followed each event: the gauge went to 0.
    assert dispatcher_hostname() not in online_gauges(flower)
    assert dashboard_workers(flower)[WORKER]["status"] is True
    real = flower.get_json("/api/workers?refresh=1")
    assert set(real) == {WORKER}


@pytest.mark.parametrize("policy", ["replace", "cancel_running"])
def test_displaced_message_shows_the_policy(
    app: Celery, flower: FlowerServer, request: pytest.FixtureRequest, policy: str
) -> None:
    """A queued message replaced or cancelled by a policy shows REPLACED/CANCELLED, with the
    policy in its result, and keeps that state once the worker reached and revoked it."""

    @app.task(base=DedupTask, shared=False, name=f"demo.{policy}", unique_for=600,
              on_duplicate=policy)
    def displaced(n: int) -> int:
        return n

    request.getfixturevalue("worker")  # started once the task is registered
    counted_before = events_counted(flower, displaced.name, f"task-{STATE[policy].lower()}")
    first = displaced.apply_async((1,), countdown=2)
    second = displaced.apply_async((1,), countdown=2)
    assert second.get(timeout=30) == 1

    def revoked_by_the_worker() -> dict[str, Any] | None:
        info = flower.task(first.id)
        return info if info and info.get("revoked") else None

    info = flower.wait_for(revoked_by_the_worker, what="the displaced message's task-revoked")
    assert info["state"] == STATE[policy]
    verb = "replaced" if policy == "replace" else "cancelled (revoked)"
    assert info["result"] == f"{verb} by {second.id} ({policy})"
    assert flower.wait_for(lambda: (flower.task(second.id) or {}).get("state") == "SUCCESS")
    counted = events_counted(flower, displaced.name, f"task-{STATE[policy].lower()}")
    assert counted - counted_before == 1
