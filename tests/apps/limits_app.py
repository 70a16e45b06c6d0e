"""A Celery app with per-key limits, for worker subprocesses and producer processes.

Configured by environment variables (``TEST_BROKER_URL``, ``TEST_BACKEND_URL``,
``TEST_STORE_URL``); the test that starts a process sets them.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_dedup import DedupTask

app = Celery("limits_app")
app.conf.update(
    broker_url=os.environ.get("TEST_BROKER_URL", "memory://"),
    result_backend=os.environ.get("TEST_BACKEND_URL"),
    dedup_store=os.environ.get("TEST_STORE_URL") or None,
    task_default_queue="limits",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # Short leases: a killed worker's slot comes back within 2 s.
    dedup_lease_ttl=2,
    # Deferred copies a killed worker held (not yet due) come back quickly.
    broker_transport_options={
        "visibility_timeout": 4,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed inside its restore sweep holds the sweep's mutex.
        "unacked_mutex_expire": 5,
    },
    result_expires=None,
)


def _marks() -> redis.Redis:
    return redis.Redis.from_url(os.environ["TEST_MARKS_URL"])


@app.task(
    base=DedupTask,
    acks_late=True,
    concurrency_limit=1,
    concurrency_key="{user}",
    concurrency_backoff=1.0,
)
def hold(user: str, item: int) -> int:
    """Item 0 blocks the first time (until its worker is killed); every body records its start.

    ``acks_late``: a message whose worker is killed is delivered again, so
    nothing is lost, the killed body's message included.
    """
    marks = _marks()
    marks.rpush(f"started:{user}", item)
    if item == 0 and marks.incr(f"blocked:{user}") == 1:
        time.sleep(120)
    return item


@app.task(
    base=DedupTask,
    unique_for=600,
    rate_limit_per_key=os.environ.get("TEST_RATE", "5/s"),
    rate_key="{user}",
    on_duplicate="raise",
    on_rate_limit=os.environ.get("TEST_ON_RATE_LIMIT", "duplicate"),
)
def ping(user: str, n: int) -> int:
    """A call counted per user (never run by these tests: they count publishes)."""
    return n


@app.task(
    base=DedupTask,
    identity="always_unique",
    rate_limit_per_key="3/h",
    rate_key="{user}",
    on_duplicate="raise",
)
def ping_hourly(user: str, n: int) -> int:
    """A call counted per user in an hour-long window (the listing tests read it)."""
    return n


Answer = tuple[int, str, float, float, float]


def call_many(user: str, ns: list[int], start_at: float) -> list[Answer]:
    """Call ``ping`` for each of ``ns`` from this process, starting at ``start_at`` (wall clock).

    Returns ``(n, outcome, before, after, retry_after)`` per call: outcome is
    the task id when published, ``"raised"`` when refused.
    """
    from celery_dedup import RateLimited

    while time.time() < start_at:
        time.sleep(0.001)
    answers: list[Answer] = []
    for n in ns:
        before = time.time()
        try:
            result = ping.delay(user, n)
        except RateLimited as exc:
            answers.append((n, "raised", before, time.time(), exc.retry_after))
        else:
            answers.append((n, str(result.id), before, time.time(), 0.0))
    return answers
