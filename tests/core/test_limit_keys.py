"""Concurrency keys as a real worker computes them (issue 30, point 9).

A ``pydantic=True`` task's template names the model's fields, a key the
arguments cannot fill fails the task with its lock following the policy,
and a message published without a lock shares the slots of the holder of
its deduplication key.
"""

from __future__ import annotations

import threading
import time
from itertools import pairwise
from typing import Any

from celery import states
from pydantic import BaseModel

from celery_dedup import DedupTask, inspect_lock

from .conftest import AppFactory, wait_until


class Order(BaseModel):
    """A pydantic argument (module level: the task's annotations must resolve)."""

    customer_id: int
    n: int


def _overlapped(spans: list[tuple[float, float]]) -> bool:
    ordered = sorted(spans)
    return any(later[0] < earlier[1] for earlier, later in pairwise(ordered))


def test_pydantic_task_template_names_the_model_field(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """``concurrency_key="{order.customer_id}"`` on a ``pydantic=True`` task: both calls of
    one customer run, one after the other; another customer runs beside them."""
    app = app_factory("keys-pydantic", dedup_lease_ttl=3)
    spans: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    started = threading.Event()
    go = threading.Event()

    @app.task(
        base=DedupTask, shared=False, pydantic=True, unique_until="finish",
        concurrency_limit=1, concurrency_key="{order.customer_id}", concurrency_backoff=0.1,
    )
    def ship(order: Order) -> int:
        begin = time.monotonic()
        if order.n == 1:
            started.set()
            go.wait(30)
        spans[order.customer_id].append((begin, time.monotonic()))
        return order.n

    worker_for(app, concurrency=4)
    first = ship.delay(Order(customer_id=1, n=1))
    assert started.wait(30)
    second = ship.delay(Order(customer_id=1, n=2))
    other = ship.delay(Order(customer_id=2, n=3))
    assert other.get(timeout=60) == 3  # another customer is not held back
    assert second.state == states.PENDING  # deferred: its customer's slot is taken
    go.set()
    assert first.get(timeout=60) == 1
    assert second.get(timeout=60) == 2
    assert len(spans[1]) == 2 and not _overlapped(spans[1])
    assert inspect_lock(first.deduplication_key, app=app) is None


def test_a_key_the_arguments_cannot_fill_fails_and_releases_per_policy(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """A template naming a missing field fails the task with a typed error naming the task,
    without running the body; ``finish`` releases the lock, ``success`` keeps it."""
    app = app_factory("keys-missing")
    ran: list[str] = []

    def define(until: str) -> Any:
        @app.task(
            base=DedupTask, shared=False, name=f"keys.missing_{until}", unique_for=60,
            unique_until=until, concurrency_limit=1, concurrency_key="{order[region]}",
        )
        def job(order: dict[str, Any]) -> None:
            ran.append(until)

        return job

    finish, success = define("finish"), define("success")
    worker_for(app)
    failed = {task: task.delay({"id": 1}) for task in (finish, success)}
    for result in failed.values():
        wait_until(lambda r=result: r.state == states.FAILURE, timeout=30)
        assert "keys.missing_" in str(result.result)
        assert "concurrency_key" in str(result.result)
    assert ran == []
    assert inspect_lock(failed[finish].deduplication_key, app=app) is None
    assert inspect_lock(failed[success].deduplication_key, app=app) is not None
    assert finish.delay({"id": 1}).deduplicated is False


def test_unlocked_message_shares_the_holders_slot(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """``concurrency_limit=1`` with the default key: a ``unique_for=None`` call of the same
    arguments (published without a lock) waits for the running holder; it never runs beside it."""
    app = app_factory("keys-unlocked", dedup_lease_ttl=3)
    spans: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    started = threading.Event()
    go = threading.Event()

    @app.task(base=DedupTask, shared=False, concurrency_limit=1, concurrency_backoff=0.1)
    def job(n: int) -> int:
        begin = time.monotonic()
        if not started.is_set():
            started.set()
            go.wait(30)
        spans[n].append((begin, time.monotonic()))
        return n

    worker_for(app, concurrency=4)
    holder = job.delay(1)
    assert started.wait(30)
    unlocked = job.apply_async([1], unique_for=None)
    assert unlocked.deduplicated is False
    other = job.delay(2)  # another key is not held back
    assert other.get(timeout=60) == 2
    assert unlocked.state == states.PENDING  # deferred behind the holder
    go.set()
    assert holder.get(timeout=60) == unlocked.get(timeout=60) == 1
    assert len(spans[1]) == 2 and not _overlapped(spans[1])
