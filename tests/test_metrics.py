"""Per-task counters: batched in-process, flushed to the store, shared and durable."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.signals import worker_process_shutdown, worker_shutdown
from prometheus_client import CollectorRegistry, generate_latest

from celery_dedup import InvalidOptionError, StoreUnavailable, enqueue_many, release
from celery_dedup.batch import BATCH_TASK_NAME
from celery_dedup.metrics import DEFAULT_FLUSH_INTERVAL, Metrics
from celery_dedup.prometheus import METRIC_NAMES, register
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.memory import MemoryStore
from celery_dedup.stores.redis import RedisStore
from tests.apps.cli_app import SYNC, make_app
from tests.fixtures._servers import free_port
from tests.fixtures.redis import RedisServer

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingStore(MemoryStore):
    """A memory store that records each ``add_counts`` call (one per round trip)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[dict[tuple[str, str], int]] = []
        self.down = False

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Record the batch, or fail like an unreachable server."""
        if self.down:
            raise StoreUnavailable("lock store counting is unavailable", store="memory")
        self.batches.append(dict(counts))
        super().add_counts(prefix, counts)


@pytest.fixture
def app(redis_server: RedisServer, redis_url: str) -> Iterator[Celery]:
    """The demo app on an in-memory broker with its locks and counters in real Redis."""
    app = make_app("memory://", redis_url)
    yield app
    runtime_for(app).metrics.flush()
    app.close()


def test_counts_are_batched_per_interval() -> None:
    """Counts reach the store only once the interval has passed, in one batch."""
    store, clock = CountingStore(), Clock()
    metrics = Metrics(lambda: store, prefix="p", interval=5, clock=clock)
    for _ in range(100):
        metrics.incr("t", "acquired")
    metrics.incr("t", "deduplicated", 3)
    assert store.batches == []
    clock.now += 5
    metrics.incr("t", "released")
    assert store.batches == [{("t", "acquired"): 100, ("t", "deduplicated"): 3,
                              ("t", "released"): 1}]
    metrics.incr("t", "released")
    assert len(store.batches) == 1 and metrics.pending() == {("t", "released"): 1}


def test_failed_flush_keeps_counts_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """An unreachable store keeps the counts pending; only the first failure is a WARNING."""
    store, clock = CountingStore(), Clock()
    store.down = True
    metrics = Metrics(lambda: store, prefix="p", interval=1, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="celery_dedup"):
        metrics.incr("t", "acquired")
        assert metrics.flush() is False
        assert metrics.flush() is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]
    store.down = False
    assert metrics.flush() is True
    assert store.read_counts("p") == {("t", "acquired"): 1}


def test_store_without_counters_keeps_counts() -> None:
    """A store that keeps no counters leaves the counts pending, and read() says so."""
    metrics = Metrics(object, interval=0)
    metrics.incr("t", "fallback")
    assert metrics.pending() == {("t", "fallback"): 1}
    with pytest.raises(TypeError, match="keeps no counters"):
        metrics.read()


def test_forked_child_drops_inherited_counts(tmp_path: Path) -> None:
    """A forked child starts with no pending counts; the parent keeps its own."""
    store = CountingStore()
    metrics = Metrics(lambda: store, interval=60)
    metrics.incr("t", "acquired", 7)
    out = tmp_path / "child"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads alive
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        out.write_text(repr(metrics.pending()))
        os._exit(0)
    os.waitpid(pid, 0)
    assert out.read_text() == "{}"
    assert metrics.pending() == {("t", "acquired"): 7}


def test_worker_shutdown_signals_flush(app: Celery) -> None:
    """``worker_process_shutdown`` and ``worker_shutdown`` flush pending counts to the store."""
    store = runtime_for(app).store
    assert isinstance(store, RedisStore)
    prefix = runtime_for(app).settings.key_prefix
    # The signals flush every app of the process: an earlier test's app still open
    # may hold counts for this server. Flushed first, they are not this test's.
    worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)
    before = store.read_counts(prefix)

    def added() -> dict[tuple[str, str], int]:
        counts = store.read_counts(prefix)
        return {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}

    app.tasks[SYNC].delay(1)
    assert added() == {}
    worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)
    assert added() == {(SYNC, "acquired"): 1}
    app.tasks[SYNC].delay(2)
    worker_shutdown.send(sender=None)
    assert added() == {(SYNC, "acquired"): 2}


def test_counts_are_shared_and_survive_restarts(redis_url: str) -> None:
    """Two apps (a producer and a worker, say) add to one set of counters a new app reads."""
    producer, worker = make_app("memory://", redis_url), make_app("memory://", redis_url)
    try:
        holder = producer.tasks[SYNC].delay(1)
        assert worker.tasks[SYNC].delay(1).id == holder.id
        assert worker.tasks[SYNC].delay(1).id == holder.id
        runtime_for(producer).metrics.flush()
        runtime_for(worker).metrics.flush()
    finally:
        producer.close()
        worker.close()
    restarted = make_app("memory://", redis_url)
    try:
        assert runtime_for(restarted).metrics.read() == {
            (SYNC, "acquired"): 1, (SYNC, "deduplicated"): 2,
        }
    finally:
        restarted.close()


def test_interpreter_exit_flushes(redis_url: str) -> None:
    """A process that exits without flushing still lands its counts (atexit)."""
    script = textwrap.dedent(f"""
        from tests.apps.cli_app import SYNC, make_app
        app = make_app("memory://", {redis_url!r})
        holder = app.tasks[SYNC].delay(3)
        assert app.tasks[SYNC].delay(3).id == holder.id
    """)
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    reader = RedisStore.from_url(redis_url)
    assert reader.read_counts("celery-dedup") == {(SYNC, "acquired"): 1,
                                                  (SYNC, "deduplicated"): 1}


def test_store_gone_at_exit_logs_debug_only(tmp_path: Path) -> None:
    """At interpreter exit a store that is gone is logged at DEBUG, never as an error."""
    script = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        from tests.apps.cli_app import SYNC, make_app
        app = make_app("memory://", None, "redis://127.0.0.1:{free_port()}/0",
                       dedup_fallback="open")
        app.tasks[SYNC].delay(3)   # counts a fallback, pending until exit
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True)
    assert "lock store unavailable" in done.stderr  # the call's own fallback warning
    assert "could not flush metrics" not in done.stderr


def test_manual_releases_and_batches_are_counted(app: Celery) -> None:
    """``release()`` counts as released_manual, not released; enqueue_many counts its lock."""
    holder = app.tasks[SYNC].delay(5)
    assert release(holder, app=app) is True
    enqueue_many([app.tasks[SYNC].s(6)], deduplication_key="batch-1", app=app)
    enqueue_many([app.tasks[SYNC].s(6)], deduplication_key="batch-1", app=app)
    counts = runtime_for(app).metrics.read()
    assert counts[(SYNC, "released_manual")] == 1
    assert (SYNC, "released") not in counts
    assert counts[(BATCH_TASK_NAME, "acquired")] == 1
    assert counts[(BATCH_TASK_NAME, "deduplicated")] == 1


def test_no_extra_round_trip_per_call(app: Celery, redis_server: RedisServer) -> None:
    """Within the flush interval a duplicate call costs exactly one store command."""
    holder = app.tasks[SYNC].delay(4)
    info = redis_server.client(0)

    def calls(command: str) -> int:
        stats: dict[str, Any] = info.info("commandstats")
        return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))

    before = {c: calls(c) for c in ("evalsha", "hincrby", "hgetall")}
    for _ in range(20):
        assert app.tasks[SYNC].delay(4).id == holder.id
    after = {c: calls(c) for c in ("evalsha", "hincrby", "hgetall")}
    assert after["evalsha"] - before["evalsha"] == 20
    assert after["hincrby"] == before["hincrby"]
    assert runtime_for(app).metrics.pending() == {(SYNC, "acquired"): 1,
                                                  (SYNC, "deduplicated"): 20}
    assert runtime_for(app).metrics.interval == DEFAULT_FLUSH_INTERVAL


def test_flush_interval_setting(redis_url: str) -> None:
    """``dedup_metrics_flush_interval`` sets the interval; a bad value names the setting."""
    app = make_app("memory://", redis_url, dedup_metrics_flush_interval=0)
    try:
        holder = app.tasks[SYNC].delay(5)
        assert runtime_for(app).metrics.pending() == {}  # flushed at once
        assert holder.deduplicated is False
    finally:
        app.close()
    bad = make_app("memory://", redis_url, dedup_metrics_flush_interval=-1)
    with pytest.raises(InvalidOptionError, match="dedup_metrics_flush_interval"):
        runtime_for(bad)
    bad.close()


def test_prometheus_collector(app: Celery) -> None:
    """The Prometheus collector exposes the store's counters and the live locks per task."""
    holder = app.tasks[SYNC].delay(6)
    for _ in range(2):
        assert app.tasks[SYNC].delay(6).id == holder.id
    registry = CollectorRegistry()
    register(app, registry)
    text = generate_latest(registry).decode()
    assert f'celery_dedup_acquired_total{{task="{SYNC}"}} 1.0' in text
    assert f'celery_dedup_deduplicated_total{{task="{SYNC}"}} 2.0' in text
    assert f'celery_dedup_live_locks{{task="{SYNC}"}} 1.0' in text
    for name in METRIC_NAMES:
        assert f"# HELP {name} " in text
