"""Pairs of apps (plain and DedupTask) on a real broker.

Celery runs one worker app per process at a time (``setup_worker_optimizations``
points the process's task registry at the last started worker), so each
side's scenarios run while that side's worker alone is up: ``Pair.working``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker

from celery_dedup.runtime import runtime_for
from tests.fixtures.rabbitmq import RabbitMQServer
from tests.fixtures.redis import RedisServer

from .harness import Capture, Runs, Side, build_side

#: Redis databases of this suite: executions, then broker and results per side
RUNS_DB = 40
DBS = {("redis", "plain"): (41, 42), ("redis", "dedup"): (43, 44),
       ("amqp", "plain"): (None, 45), ("amqp", "dedup"): (None, 46),
       ("eager", "plain"): (47, 48), ("eager", "dedup"): (49, 50)}


@dataclass
class Pair:
    """The plain side and the DedupTask side on one broker, and the message capture."""

    plain: Side
    dedup: Side
    capture: Capture

    eager: bool = False

    @contextmanager
    def working(self, side: Side) -> Iterator[Side]:
        """``side``'s worker is up (and no other) for the block; the capture is active."""
        with ExitStack() as stack:
            stack.enter_context(self.capture.active())
            if self.eager:
                yield side
                return
            side.worker = stack.enter_context(start_worker(
                side.app, pool="threads", concurrency=2, queues=side.queues,
                perform_ping_check=False, shutdown_timeout=30, loglevel="WARNING",
                hostname=f"parity-{side.label}@localhost",
            ))
            yield side
        side.worker = None


def _pair(redis_server: RedisServer, broker: str, broker_url: str | None,
          **conf: Any) -> Iterator[Pair]:
    dbs = [db for pair in DBS.values() for db in pair if db is not None]
    redis_server.flush(RUNS_DB, *dbs)
    runs_client = redis_server.client(RUNS_DB)
    sides = []
    for label in ("plain", "dedup"):
        broker_db, result_db = DBS[broker, label]
        url = broker_url or redis_server.url(int(broker_db or 0))
        sides.append(build_side(label, url, redis_server.url(result_db),
                                Runs(runs_client, f"runs:{broker}:{label}"), **conf))
    yield Pair(sides[0], sides[1], Capture(), eager=bool(conf.get("task_always_eager")))
    for side in sides:
        runtime_for(side.app).metrics.flush()
        side.app.close()
    runs_client.close()


@pytest.fixture(scope="module")
def redis_pair(redis_server: RedisServer) -> Iterator[Pair]:
    """Both sides on the test Redis broker (one database each)."""
    yield from _pair(redis_server, "redis", None)


@pytest.fixture(scope="module")
def amqp_pair(redis_server: RedisServer, rabbitmq_server: RabbitMQServer) -> Iterator[Pair]:
    """Both sides on the test RabbitMQ broker (results on Redis)."""
    yield from _pair(redis_server, "amqp", rabbitmq_server.url)


@pytest.fixture(scope="module")
def eager_pair(redis_server: RedisServer) -> Iterator[Pair]:
    """Both sides with ``task_always_eager`` (no worker; results kept as a worker would)."""
    yield from _pair(redis_server, "eager", None, task_always_eager=True,
                     task_store_eager_result=True)
