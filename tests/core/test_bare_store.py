"""A store with nothing but the ``LockStore`` protocol keeps every policy's promise.

The stores shipped all implement the optional protocols (native run
records and gates, ``QueuedTakeOver``, the one-step revoking take-over); a
store of one's own may implement none. Then run records, the
``keep_last`` gate and ``cancel_running``'s take-over are built from the
plain lock operations: these tests run each policy through a real worker
over such a store and count executions in the task bodies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states

from celery_dedup import DedupTask
from celery_dedup.runs import GatedRuns, StoreRuns, records_of
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import (
    Claim,
    Lock,
    LockMeta,
    QueuedTakeOver,
    RevokeOutcome,
    RunRecords,
)
from celery_dedup.stores.memory import MemoryStore

from .conftest import AppFactory, wait_until

pytestmark = pytest.mark.timeout(120)


class BareStore:
    """The ``LockStore`` protocol and nothing else, over a memory store."""

    name = "bare"

    def __init__(self) -> None:
        self.inner = MemoryStore()

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        return self.inner.acquire(key, owner, ttl, meta)

    def release(self, key: str, owner: str) -> bool:
        return self.inner.release(key, owner)

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        return self.inner.extend(key, owner, ttl)

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        return self.inner.take_over(key, owner, ttl, meta)

    def claim(
        self, key: str, owner: str, *, release: bool, ttl: float | None, meta: LockMeta
    ) -> Claim:
        return self.inner.claim(key, owner, release=release, ttl=ttl, meta=meta)

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        return self.inner.revoke(key, owner, ttl)

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        return self.inner.settle(key, owner, ttl)

    def unrevoke(self, key: str, owner: str) -> None:
        self.inner.unrevoke(key, owner)

    def get(self, key: str) -> Lock | None:
        return self.inner.get(key)

    def scan(self, prefix: str) -> Iterator[Lock]:
        return self.inner.scan(prefix)


class Runs:
    """What the task bodies did, in order, and how many ran at once at most."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[str] = []
        self.running = 0
        self.most = 0
        self.go = threading.Event()

    def run(self, doc: int, version: str) -> str:
        with self.lock:
            self.events.append(f"start:{version}")
            self.running += 1
            self.most = max(self.most, self.running)
        if version == "first":
            self.go.wait(30)
        with self.lock:
            self.running -= 1
            self.events.append(f"end:{version}")
        return version

    def task(self, app: Any, policy: str) -> Any:
        """A ``DedupTask`` under ``policy``, one key per ``doc``, running ``run``."""

        def body(doc: int, version: str) -> str:
            return self.run(doc, version)

        options = {"unique_for": 60, "on_duplicate": policy, "unique_on": ("doc",)}
        return app.task(name=f"bare.{policy}", base=DedupTask, shared=False, **options)(body)


@pytest.fixture
def bare() -> BareStore:
    store = BareStore()
    assert not isinstance(store, (RunRecords, QueuedTakeOver))
    records = records_of(store)
    assert isinstance(records, GatedRuns) and isinstance(records.records, StoreRuns)
    return store


def _app(app_factory: AppFactory, store: BareStore, name: str) -> Any:
    app = app_factory(name, dedup_lease_ttl=30, dedup_metrics_flush_interval=3600)
    runtime_for(app).use_store(store)
    return app


@pytest.mark.parametrize("policy", ["replace", "keep_last", "cancel_running"])
def test_a_queued_holder_is_replaced_and_only_the_latest_call_runs(
    policy: str, app_factory: AppFactory, worker_for: Any, bare: BareStore
) -> None:
    """Two calls before any worker runs: the first never runs, the latest runs once."""
    app = _app(app_factory, bare, f"bare-{policy}")
    log = Runs()
    task = log.task(app, policy)
    queued = task.delay(1, "queued")
    latest = task.delay(1, "latest")
    assert latest.id != queued.id
    worker_for(app)
    assert latest.get(timeout=30) == "latest"
    wait_until(lambda: app.AsyncResult(queued.id).state == states.REVOKED, timeout=30)
    wait_until(lambda: bare.get(latest.deduplication_key) is None, timeout=10)
    assert log.events == ["start:latest", "end:latest"]


def test_keep_last_follow_up_waits_for_the_run_and_carries_the_last_arguments(
    app_factory: AppFactory, worker_for: Any, bare: BareStore
) -> None:
    """1 call, then 5 while it runs, a second worker slot free: exactly 2 runs, never at
    once, the second with the 5th call's arguments; the key and its gate free after."""
    app = _app(app_factory, bare, "bare-last")
    log = Runs()
    task = log.task(app, "keep_last")
    worker_for(app, concurrency=2)
    first = task.delay(7, "first")
    wait_until(lambda: "start:first" in log.events, timeout=30)
    handles = [task.delay(7, f"call-{i}") for i in range(1, 6)]
    time.sleep(2.5)  # the follow-up looked at the gate twice meanwhile, and waits
    assert log.events == ["start:first"]
    log.go.set()
    assert first.get(timeout=30) == "first"
    assert [handle.get(timeout=30) for handle in handles] == ["call-5"] * 5
    assert log.events == ["start:first", "end:first", "start:call-5", "end:call-5"]
    assert log.most == 1
    wait_until(lambda: bare.get(first.deduplication_key) is None, timeout=10)
