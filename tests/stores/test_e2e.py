"""End to end with a real worker, for every store of the table.

One worker per store (``pool="solo"``, Redis broker on its own databases):
a blocker task keeps the worker busy while each policy's task is enqueued
twice, so the second call is a duplicate of a message that has not started.
Then the worker runs each task once and the lock is released per policy.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_dedup import DedupTask, dedup_key_for, inspect_lock
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import Lock
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer

BROKER_DB = 9
BACKEND_DB = 10
POLICIES = ("success", "expiry", "start")


def wait_for(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll ``check`` until it returns something truthy, or fail."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.05)
    return value


class E2E:
    """An app on ``store_url`` with a blocker and one deduplicated task per policy."""

    def __init__(self, redis: RedisServer, store_url: str, queue: str) -> None:
        self.app = app = Celery("e2e", set_as_current=False)
        app.conf.update(
            broker_url=redis.url(BROKER_DB),
            result_backend=redis.url(BACKEND_DB),
            dedup_store=store_url,
            # A store that cannot be reached must fail the test, not publish unlocked.
            dedup_fallback="closed",
            task_default_queue=queue,
            broker_connection_retry_on_startup=False,
            worker_hijack_root_logger=False,
        )
        self.gate = threading.Event()
        self.runs: Counter[str] = Counter()
        #: the lock each task saw on its own key while its body ran
        self.seen: dict[str, Lock | None] = {}
        gate = self.gate

        @app.task(name="e2e.block", shared=False)
        def block() -> None:
            gate.wait(30)

        self.block = block
        self.tasks: dict[str, DedupTask] = {}
        for policy in POLICIES:
            self.tasks[policy] = self._task(policy)

    def _task(self, policy: str) -> DedupTask:
        app, runs, seen = self.app, self.runs, self.seen

        @app.task(
            name=f"e2e.{policy}", base=DedupTask, bind=True, shared=False,
            unique_for=60, unique_until=policy,
        )
        def run(self: DedupTask, n: int) -> int:
            runs[policy] += 1
            seen[policy] = inspect_lock(dedup_key_for(self, (n,)), app=app)
            return n

        task: DedupTask = run
        return task

    def close(self) -> None:
        """Write pending counters, close the app's store and the app."""
        runtime = runtime_for(self.app)
        runtime.metrics.flush()
        close = getattr(runtime.store, "close", None)
        if close is not None:
            close()
        self.app.close()


@pytest.fixture
def e2e(redis_server: RedisServer, store_case: StoreCase) -> Iterator[E2E]:
    """An app whose ``dedup_store`` is the store under test, with a running worker."""
    redis_server.flush(BROKER_DB, BACKEND_DB)
    env = E2E(redis_server, store_case.url, queue=f"e2e-{store_case.store.name}")
    try:
        with start_worker(
            env.app, pool="solo", perform_ping_check=False, loglevel="WARNING",
            shutdown_timeout=30,
        ):
            yield env
            env.gate.set()
    finally:
        env.gate.set()
        env.close()


def test_worker_runs_once_and_releases_per_policy(e2e: E2E, store_case: StoreCase) -> None:
    """A second enqueue is deduplicated; the worker runs the task once; unique_until releases."""
    blocker = e2e.block.delay()
    firsts = {}
    for policy, task in e2e.tasks.items():
        first = task.delay(1)
        second = task.delay(1)
        assert first.deduplicated is False, policy
        assert second.deduplicated is True, policy
        assert second.id == first.id, policy
        key = dedup_key_for(task, (1,))
        assert first.deduplication_key == second.deduplication_key == key
        holder = store_case.store.get(key)
        assert holder is not None and holder.task_id == first.id, policy
        assert holder.task_name == task.name and holder.policy == policy
        firsts[policy] = first

    e2e.gate.set()
    blocker.get(timeout=30)
    for policy, first in firsts.items():
        assert first.get(timeout=30) == 1, policy

    success_key = firsts["success"].deduplication_key
    wait_for(lambda: store_case.store.get(success_key) is None)
    assert e2e.runs == dict.fromkeys(POLICIES, 1)
    # "success" held its lock while running, "start" had already released it.
    assert e2e.seen["success"] is not None and e2e.seen["success"].task_id == firsts["success"].id
    assert e2e.seen["start"] is None
    assert store_case.store.get(firsts["start"].deduplication_key) is None
    expiry = store_case.store.get(firsts["expiry"].deduplication_key)
    assert expiry is not None and expiry.task_id == firsts["expiry"].id and expiry.ttl > 30

    again = e2e.tasks["success"].delay(1)
    assert again.deduplicated is False and again.id != firsts["success"].id
    assert again.get(timeout=30) == 1
    throttled = e2e.tasks["expiry"].delay(1)
    assert throttled.deduplicated is True and throttled.id == firsts["expiry"].id
