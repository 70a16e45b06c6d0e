"""``keep_last`` on the memory store: a real in-thread worker wakes the follow-up at its gate.

The memory store keeps the run gate as a lock and lists the waiting
follow-up beside it (``GateWaiters``), in one process: the producer and a
two-thread worker share it. Every deferral's countdown is made long, so a
follow-up that runs before its parked copy comes back was woken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dedup import DedupTask, inspect_lock
from celery_dedup import worker as worker_module
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import task_skipped
from celery_dedup.stores.memory import MemoryStore

from .conftest import wait_until

pytestmark = pytest.mark.timeout(120)

#: the countdown of every deferral here: the parked copy comes back this late
LONG_BACKOFF = 8.0


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app on the memory broker and store (one name per test: a table of its own)."""
    app = Celery("gate-wake-memory", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.update(
        task_default_queue="gate-wake-memory",
        dedup_store="memory://gate-wake",
        dedup_metrics_flush_interval=3600,
    )
    store = MemoryStore.from_url("memory://gate-wake")
    store.clear()
    yield app
    store.clear()
    runtime_for(app).metrics.flush()
    app.close()


def test_a_follow_up_at_the_gate_is_woken_by_the_run_s_end_and_runs_once(
    app: Celery, worker_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follow-up deferred at its key's gate (listed beside it) runs as soon as the run
    it follows ends, not one long backoff later; its parked copy, when it comes back, is
    dropped as a copy of a run that ran: the body ran once per call."""
    monkeypatch.setattr(
        worker_module, "deferral_countdown", lambda task, request, base=None: LONG_BACKOFF
    )
    ran: list[int] = []
    started, release = threading.Event(), threading.Event()

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="keep_last",
              deduplication_key=lambda x: "account-1")
    def sync(x: int) -> int:
        ran.append(x)
        if x == 0:
            started.set()
            release.wait(30)
        return x

    skipped: list[str] = []

    def on_skip(sender: Any = None, task_id: str = "", reason: str = "", **_: Any) -> None:
        skipped.append(f"{task_id}:{reason}")

    task_skipped.connect(on_skip, weak=False)
    try:
        worker_for(app)
        first = sync.delay(0)
        assert started.wait(10)
        follow_up = sync.delay(1)
        store = runtime_for(app).store
        assert isinstance(store, MemoryStore)
        wait_until(lambda: store._gate_waiters, timeout=10)  # listed at the gate
        release.set()
        assert first.get(timeout=10) == 0
        assert follow_up.get(timeout=10) == 1
        assert ran == [0, 1]
        # The parked copy comes back after its long countdown and is dropped.
        wait_until(lambda: f"{follow_up.id}:already ran" in skipped, timeout=LONG_BACKOFF + 20)
        assert ran == [0, 1]
        assert not store._gate_waiters
        assert inspect_lock(follow_up.deduplication_key, app=app) is None
    finally:
        task_skipped.disconnect(on_skip)
