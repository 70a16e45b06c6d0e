"""Eight processes race on the same 2 000 keys: exactly one enqueue per key wins."""

from __future__ import annotations

import multiprocessing
from typing import Any

from celery import Celery

from celery_dedup import DedupTask
from tests.fixtures.redis import RedisServer

KEYS = 2000
PROCESSES = 8


def enqueue_all(broker: str, store: str, queue: Any) -> None:
    """Child: build an app, enqueue every key once, report the keys this process won."""
    app = Celery("race", set_as_current=False)
    app.conf.update(
        broker_url=broker, dedup_store=store, task_default_queue="race", result_backend=None
    )

    @app.task(base=DedupTask, shared=False, name="race.job", unique_for=120)
    def job(n: int) -> None:
        return None

    won = [n for n in range(KEYS) if not job.apply_async((n,)).deduplicated]
    queue.put(won)
    app.close()


def test_exactly_one_winner_per_key(redis_server: RedisServer) -> None:
    """Across 8 processes each key is published once and the broker holds 2 000 messages."""
    broker_db, store_db = redis_server.client(14), redis_server.client(15)
    broker_db.flushdb()
    store_db.flushdb()
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=enqueue_all, args=(redis_server.url(14), redis_server.url(15), results))
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    won = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    winners = [n for batch in won for n in batch]
    assert sorted(winners) == list(range(KEYS))
    assert broker_db.llen("race") == KEYS
    broker_db.close()
    store_db.close()
