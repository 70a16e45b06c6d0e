"""Native SQS FIFO mode follows the canvas rules: a canvas is never cut by a dropped message.

Against the moto server and a real solo worker, as ``test_native_sqs``; a
canvas call keeps kombu's random ``MessageDeduplicationId``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery, chain, chord

from celery_dedup import DedupTask
from celery_dedup.stores.memory import MemoryStore
from tests.fixtures.redis import RedisServer
from tests.fixtures.sqs import SQSServer
from tests.test_native_sqs import (  # noqa: F401  (fixtures)
    _name,
    _wait,
    flushed_db,
    make_app,
    memory_store,
    solo_worker,
)

CHORD_DB, CHAIN_DB = 22, 23


def _tasks(app: Celery, runs: list[Any]) -> tuple[Any, Any]:
    @app.task(base=DedupTask, shared=False, name="ncanvas.sync", unique_for=300,
              unique_until="expiry")
    def sync(x: int) -> int:
        runs.append(x)
        return x

    @app.task(shared=False, name="ncanvas.total")
    def total(values: list[int]) -> int:
        runs.append("total")
        return sum(values)

    return sync, total


def test_chord_with_a_repeated_member_runs_its_body(
    make_app: Callable[..., Celery],  # noqa: F811
    sqs_server: SQSServer,
    redis_server: RedisServer,
    memory_store: tuple[str, MemoryStore],  # noqa: F811
) -> None:
    """Both copies of the member are delivered (the chord counts on them): body runs, [1, 1]."""
    url, _ = memory_store
    queue = _name("chord") + ".fifo"
    with flushed_db(redis_server, CHORD_DB):
        app = make_app(
            dedup_store=url, task_default_queue=queue, result_backend=redis_server.url(CHORD_DB)
        )
        runs: list[Any] = []
        sync, total = _tasks(app, runs)
        result = chord([sync.s(1), sync.s(1)], total.s()).apply_async()
        assert sqs_server.queue_length(queue) == 2
        with solo_worker(app, [queue]):
            assert result.get(timeout=30) == 2
        assert runs == [1, 1, "total"]


def test_chain_whose_first_step_duplicates_a_queued_call_is_not_lost(
    make_app: Callable[..., Celery],  # noqa: F811
    sqs_server: SQSServer,
    redis_server: RedisServer,
    memory_store: tuple[str, MemoryStore],  # noqa: F811
) -> None:
    """SQS cannot report a drop, so the chain's first step is published with its own id:
    the queued call and the chain both run, and the chain completes."""
    url, _ = memory_store
    queue = _name("chain") + ".fifo"
    with flushed_db(redis_server, CHAIN_DB):
        app = make_app(
            dedup_store=url, task_default_queue=queue, result_backend=redis_server.url(CHAIN_DB)
        )
        runs: list[Any] = []
        sync, total = _tasks(app, runs)
        queued = sync.delay(1)
        flow = chain(sync.s(1), total.si([5])).apply_async()
        assert sqs_server.queue_length(queue) == 2
        with solo_worker(app, [queue]):
            assert queued.get(timeout=30) == 1
            assert flow.get(timeout=30) == 5
        _wait(lambda: len(runs) == 3)
        assert runs == [1, 1, "total"]
