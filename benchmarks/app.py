"""The benchmark's Celery app, shared by the producer and the worker subprocess.

Configured from ``BENCH_BROKER``, ``BENCH_STORE`` and ``BENCH_RESULTS`` (set
by ``benchmarks/run.py`` before it imports this module or starts a worker).
The tasks differ only in their base class.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_dedup import DedupTask

QUEUE = "celery-dedup-bench"
LOCK_SECONDS = 600
#: a 30-character task name, the size the memory target is stated for
DEDUP_NAME = "bench.dedup.noop_with_30_chars"

app = Celery("celery_dedup_bench", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER", "memory://"),
    result_backend=os.environ.get("BENCH_RESULTS") or None,
    dedup_store=os.environ.get("BENCH_STORE", "memory://"),
    # Only the worker has a result backend (the benchmark polls it for the
    # end of a run); the message must not say "ignore the result".
    task_ignore_result=False,
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # Counters are flushed every few seconds in one pipelined round trip:
    # keep that out of the per-call counts.
    dedup_metrics_flush_interval=3600,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ.get("BENCH_STORE", ""), "default_timeout": LOCK_SECONDS},
    },
    singleton_backend_url=os.environ.get("BENCH_STORE"),
    singleton_lock_expiry=LOCK_SECONDS,
)


@app.task(name="bench.plain", shared=False)
def plain(n: int) -> int:
    """The floor: a plain task."""
    return n


@app.task(name=DEDUP_NAME, base=DedupTask, shared=False, unique_for=LOCK_SECONDS)
def dedup(n: int) -> int:
    """The same task, deduplicated."""
    return n


@app.task(name="bench.dedup.rated", base=DedupTask, shared=False, unique_for=LOCK_SECONDS,
          rate_limit_per_key="1000000/h")
def rated(n: int) -> int:
    """The DedupTask with a per-key rate limit that never refuses (its round trips are counted)."""
    return n


def peer_tasks() -> tuple[Any, Any]:
    """The same task on celery-once's ``QueueOnce`` and celery-singleton's ``Singleton``."""
    from celery_once import QueueOnce
    from celery_singleton import Singleton

    @app.task(name="bench.once", base=QueueOnce, shared=False, once={"graceful": True})
    def once(n: int) -> int:
        return n

    @app.task(name="bench.singleton", base=Singleton, shared=False)
    def singleton(n: int) -> int:
        return n

    return once, singleton


#: the Redis list each ``serial`` body appends its call number to when it starts
SERIAL_STARTED = "bench:serial:started"
#: ... and when it ends
SERIAL_ENDED = "bench:serial:ended"


@app.task(
    name="bench.serial", base=DedupTask, shared=False, concurrency_limit=1,
    concurrency_key="{key}",
)
def serial(key: str, n: int, seconds: float) -> int:
    """A body of ``seconds`` that one key runs one at a time (``concurrency_limit=1``)."""
    import time

    import redis

    marks = redis.Redis.from_url(os.environ["BENCH_STORE"])
    marks.rpush(SERIAL_STARTED, n)
    time.sleep(seconds)
    marks.rpush(SERIAL_ENDED, n)
    marks.close()
    return n
