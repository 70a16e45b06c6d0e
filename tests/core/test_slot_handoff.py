"""A freed concurrency slot goes to the oldest waiting message at once (``handoff``).

Real in-thread workers on Redis (broker, backend and store; the call-order
and ``keep_last`` tests on PostgreSQL as the store too). A ``keep_last``
follow-up waiting for its run gate is handed the gate the same way. Each body
appends its argument to a Redis list: the list is the order the key ran
its calls in, and its length the number of runs.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
from sqlalchemy import func, select

from celery_dedup import DedupTask, backoff, coalesce, runs
from celery_dedup.limits import concurrency_store_key
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import task_skipped
from celery_dedup.stores.base import SlotSupport
from celery_dedup.stores.sql import SQLStore
from celery_dedup.stores.sql_dialects import gate_wait_table
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until


def test_waiting_calls_run_in_call_order_each_once(
    app_factory: AppFactory,
    worker_for: Any,
    redis_server: RedisServer,
    store_conf: dict[str, Any],
) -> None:
    """10 calls of one key at concurrency_limit=1 on a worker with 4 threads, nine of them
    published while the first runs: the bodies run in call order, each once, and every
    message was deferred at most once: it was woken when the slot came free, not by its
    backoff (the parked copies come back 10 s and more later, and are dropped as copies
    of a run that is done).
    """
    app = app_factory("handoff", **store_conf)
    marks = redis_server.client(4)
    marks.delete("handoff:ran")
    deferrals: dict[int, int] = {}
    dropped: set[str] = set()
    spans: list[tuple[float, float]] = []
    etas: dict[int, Any] = {}

    @app.task(
        base=DedupTask, shared=False, bind=True, concurrency_limit=1, concurrency_key="{user}"
    )
    def step(self: Any, user: str, n: int) -> int:
        request = self.request
        deferrals[n] = backoff.deferrals_of(request, runs.attempt_of(request))
        etas[n] = request.eta  # a parked copy has one (its countdown); a woken copy none
        start = time.monotonic()
        marks.rpush("handoff:ran", n)
        threading.Event().wait(0.2)
        spans.append((start, time.monotonic()))
        return n

    def on_skip(sender: Any = None, reason: str = "", task_id: str = "", **_: Any) -> None:
        if getattr(sender, "name", None) == step.name and reason == "already ran":
            dropped.add(task_id)

    task_skipped.connect(on_skip, weak=False)
    try:
        worker_for(app, concurrency=4, prefetch_multiplier=4)
        # The first call takes the free slot; the other nine find it held and wait (a
        # message that finds a slot free runs at once, whatever older call is still on
        # its way).
        results = [step.delay("k", 0)]
        wait_until(lambda: marks.llen("handoff:ran") == 1, timeout=30)
        results += [step.delay("k", n) for n in range(1, 10)]
        assert [r.get(timeout=60) for r in results] == list(range(10))
        assert [int(x) for x in marks.lrange("handoff:ran", 0, -1)] == list(range(10))
        assert all(count <= 1 for count in deferrals.values()), deferrals
        waited = {r.id for r, n in zip(results, range(10), strict=True) if deferrals[n]}
        assert waited, "no call waited: the test did not exercise the handoff"
        assert all(eta is None for eta in etas.values()), etas  # every run was a woken copy
        # Every parked copy comes back and is dropped: still one run per call.
        wait_until(lambda: waited <= dropped, timeout=90)
        assert [int(x) for x in marks.lrange("handoff:ran", 0, -1)] == list(range(10))
        # No copy gave back a slot its run's live copy held: never two bodies at once.
        ordered = sorted(spans)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))
    finally:
        task_skipped.disconnect(on_skip)
    slots = runtime_for(app).store
    assert isinstance(slots, SlotSupport)
    key = concurrency_store_key("celery-dedup", step.name, "k")
    wait_until(lambda: slots.slots_in_use(key) == 0, timeout=30)


def test_a_revoked_waiter_does_not_block_the_key(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer
) -> None:
    """The slot woken for a revoked message lapses after its grace; the next waiter runs."""
    app = app_factory("handoff-revoked")
    marks = redis_server.client(4)
    marks.delete("handoff:ran")
    release = threading.Event()

    @app.task(
        base=DedupTask,
        shared=False,
        concurrency_limit=1,
        concurrency_key="{user}",
        concurrency_backoff=1.0,
    )
    def step(user: str, n: int) -> int:
        marks.rpush("handoff:ran", n)
        if n == 0:
            release.wait(60)
        return n

    worker = worker_for(app, concurrency=4)
    first = step.delay("k", 0)
    wait_until(lambda: marks.llen("handoff:ran") == 1, timeout=30)
    revoked, last = step.delay("k", 1), step.delay("k", 2)
    store = runtime_for(app).store
    key = concurrency_store_key("celery-dedup", step.name, "k")
    wait_until(lambda: _waiters(redis_server, key) == 2, timeout=30)
    revoked.revoke()
    wait_until(lambda: revoked.id in _revoked_ids(worker), timeout=30)
    release.set()
    assert first.get(timeout=30) == 0
    assert last.get(timeout=60) == 2
    assert [int(x) for x in marks.lrange("handoff:ran", 0, -1)] == [0, 2]
    assert isinstance(store, SlotSupport)
    wait_until(lambda: store.slots_in_use(key) == 0, timeout=30)


def _waiters(redis_server: RedisServer, key: str) -> int:
    """How many messages the key's wait list holds (the store's own record)."""
    return int(redis_server.client(4).zcard("{" + key + "}:w:"))


def _revoked_ids(worker: Any) -> set[str]:
    from celery.worker import state

    del worker
    return set(state.revoked)


def test_a_pickled_message_is_woken_with_its_arguments(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer
) -> None:
    """A task serialized with pickle waits and is woken with arguments JSON cannot carry."""
    app = app_factory(
        "handoff-pickle",
        task_serializer="pickle",
        result_serializer="pickle",
        accept_content=["pickle", "json"],
    )
    release = threading.Event()
    seen: list[tuple[Any, Any]] = []

    @app.task(
        base=DedupTask,
        shared=False,
        bind=True,
        concurrency_limit=1,
        concurrency_key="{user}",
        unique_on=("n",),
    )
    def step(self: Any, user: str, n: int, value: Any) -> Any:
        seen.append((value, self.request.eta))
        if value == 0:
            release.wait(60)
        return value

    worker_for(app, concurrency=2)
    first = step.delay("k", 0, 0)
    wait_until(lambda: len(seen) == 1, timeout=30)
    waiting = step.delay("k", 1, {1, 2, b"\x00"})
    key = concurrency_store_key("celery-dedup", step.name, "k")
    wait_until(lambda: _waiters(redis_server, key) == 1, timeout=30)
    release.set()
    assert first.get(timeout=30) == 0
    assert waiting.get(timeout=30) == {1, 2, b"\x00"}
    assert seen == [(0, None), ({1, 2, b"\x00"}, None)]  # run by its woken copy


def test_a_keep_last_follow_up_is_woken_when_the_run_it_waits_for_ends(
    app_factory: AppFactory,
    worker_for: Any,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    store_conf: dict[str, Any],
) -> None:
    """A long keep_last run, a follow-up waiting at its gate: the run's end hands the gate
    over and its worker publishes the follow-up at once. The follow-up runs from that woken
    copy (no ETA: its parked copy's countdown is 10 s and more), deferred once, never beside
    the run; its parked copy comes back and is dropped as a copy of a run that is done."""
    monkeypatch.setattr(coalesce, "WAIT", 10.0)  # the parked copy comes back 10 s later
    app = app_factory("handoff-gate", dedup_lease_ttl=60, **store_conf)
    marks = redis_server.client(4)
    marks.delete("gate:ran")
    release = threading.Event()
    seen: list[tuple[int, Any, int]] = []
    spans: list[tuple[float, float]] = []
    dropped: set[str] = set()

    @app.task(
        base=DedupTask,
        shared=False,
        bind=True,
        unique_for=120,
        on_duplicate="keep_last",
        deduplication_key=lambda n: "account-1",
    )
    def sync(self: Any, n: int) -> int:
        request = self.request
        seen.append((n, request.eta, backoff.deferrals_of(request, runs.attempt_of(request))))
        start = time.monotonic()
        marks.rpush("gate:ran", n)
        if n == 0:
            release.wait(60)
        spans.append((start, time.monotonic()))
        return n

    def on_skip(sender: Any = None, reason: str = "", task_id: str = "", **_: Any) -> None:
        if getattr(sender, "name", None) == sync.name and reason == "already ran":
            dropped.add(task_id)

    task_skipped.connect(on_skip, weak=False)
    try:
        worker_for(app, concurrency=2)
        first = sync.delay(0)
        wait_until(lambda: marks.llen("gate:ran") == 1, timeout=30)
        follow = sync.delay(1)
        # The follow-up found the gate held: it waits at it (the store's own record).
        wait_until(lambda: _gate_waiters(app, marks) == 1, timeout=30)
        release.set()
        assert first.get(timeout=30) == 0
        assert follow.get(timeout=30) == 1
        assert [(n, eta) for n, eta, _ in seen] == [(0, None), (1, None)]  # a woken copy ran
        assert seen[1][2] == 1  # deferred once, by the gate
        assert _gate_waiters(app, marks) == 0  # the end took the waiter out
        wait_until(lambda: follow.id in dropped, timeout=60)  # the parked copy came back
        assert [int(x) for x in marks.lrange("gate:ran", 0, -1)] == [0, 1]
        first_span, second_span = sorted(spans)
        assert first_span[1] <= second_span[0]  # never beside the run it follows
    finally:
        task_skipped.disconnect(on_skip)


def _gate_waiters(app: Any, marks: Any) -> int:
    """How many follow-ups wait at a run gate (the store's own record)."""
    store = runtime_for(app).store
    if isinstance(store, SQLStore):
        with store.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(gate_wait_table)).scalar_one())
    return len(marks.keys("*:gatewait:"))
