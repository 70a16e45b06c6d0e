"""``keep_last`` on the memory store: a real in-thread worker wakes the follow-up at its gate.

The memory store keeps the run gate as a lock and lists the waiting
follow-up beside it (``GateWaiters``), in one process: the producer and a
two-thread worker share it. Every deferral's countdown is made long, so a
follow-up that runs before its parked copy comes back was woken.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_dedup.runtime import runtime_for
from celery_dedup.stores.memory import MemoryStore
from tests.fixtures.gate_wake import woken_by_the_run_s_end_and_run_once

pytestmark = pytest.mark.timeout(120)


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
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follow-up deferred at its key's gate (listed beside it) runs as soon as the run
    it follows ends, not one long backoff later; its parked copy, when it comes back, is
    dropped as a copy of a run that ran: the body ran once per call. Nothing stays listed."""
    woken_by_the_run_s_end_and_run_once(app, monkeypatch)
    store = runtime_for(app).store
    assert isinstance(store, MemoryStore)
    assert not store._gate_waiters
