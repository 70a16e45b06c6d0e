"""Execution races on the Django DB store: 8 producers, one prefork worker, the same keys.

8 forked producer processes call ``delay()`` on the same 200 keys of a
``unique_until="success"`` task whose lock store is ``django-db://ALIAS``
(PostgreSQL, MariaDB), while a real worker (``celery worker -P prefork -c
4``, run by ``worker_main`` in a forked process so it inherits the aliases
added at run time) executes them. Bodies wait for the producers to finish
before they succeed, so each key has one lock lifetime during the race:
exactly one call per key publishes, exactly one body per key runs, and once
all have succeeded no lock is left.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
from celery import Celery
from django.db import connections

from celery_dedup import DedupTask
from tests.django.test_django_store import maria_alias, store_django_maria
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer

__all__ = ["maria_alias", "store_django_maria"]

pytestmark = [pytest.mark.slow, pytest.mark.django_db_store, pytest.mark.timeout(240)]

PRODUCERS = 8
KEYS = 200
CONCURRENCY = 4
QUEUE = "exec-race"
BROKER_DB, RUNS_DB = 52, 53
#: Redis keys on ``RUNS_DB``: executed bodies, published calls, "producers done", "worker ready"
RUNS, PUBLISHED, GO, READY = "runs", "published", "go", "ready"
#: the whole run (producers, executions, release) must fit in this: a
#: deadline for a hung run on a loaded machine, not a speed claim (MariaDB
#: costs four statements per executed task)
BUDGET = 150.0


def _wait(predicate: Callable[[], bool], until: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` at ``until``."""
    while not predicate():
        if time.monotonic() > until:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


_CLIENTS: dict[tuple[int, str], redis.Redis] = {}


def _client(url: str) -> redis.Redis:
    """This process's client on ``url`` (never one inherited through a fork)."""
    key = (os.getpid(), url)
    if key not in _CLIENTS:
        _CLIENTS[key] = redis.Redis.from_url(url)
    return _CLIENTS[key]


def _race_app(store_url: str, broker_url: str, runs_url: str) -> Celery:
    """The app of the race: one ``unique_until="success"`` task recording its runs."""
    app = Celery("exec_race", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=None,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        dedup_store=store_url,
        dedup_metrics_flush_interval=3600,
    )

    @app.task(
        base=DedupTask, shared=False, name="exec_race.work", unique_for=600, unique_until="success"
    )
    def work(n: int) -> int:
        runs = _client(runs_url)
        runs.rpush(RUNS, n)
        # Succeed (and release) only once every producer has called: one lock lifetime per key.
        deadline = time.monotonic() + BUDGET
        while not runs.exists(GO):
            if time.monotonic() > deadline:
                raise RuntimeError("producers never finished")
            time.sleep(0.02)
        return n

    return app


def _produce(app: Celery, runs_url: str, index: int, barrier: Any) -> None:
    """One producer: every key once, in its own order, all producers starting together."""
    task = cast(DedupTask, app.tasks["exec_race.work"])
    runs = _client(runs_url)
    order = list(range(KEYS))
    random.Random(index).shuffle(order)
    barrier.wait()
    for n in order:
        if not task.delay(n).deduplicated:
            runs.rpush(PUBLISHED, n)


def _work(app: Celery, runs_url: str) -> None:
    """The worker process: ``celery worker -P prefork -c 4`` on the race's queue."""
    from celery.signals import worker_ready

    # The fork inherits pytest's warnings-as-errors; a worker run as root warns.
    warnings.resetwarnings()

    def ready(**_: Any) -> None:
        _client(runs_url).set(READY, 1)

    worker_ready.connect(ready, weak=False)
    app.worker_main(
        [
            "worker", "-P", "prefork", "-c", str(CONCURRENCY), "-Q", QUEUE,
            "-n", "exec-race@%h", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "WARNING",
        ]
    )


@pytest.fixture
def runs_db(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """The broker and the run log, flushed before and after."""
    redis_server.flush(BROKER_DB, RUNS_DB)
    with redis_server.client(RUNS_DB) as client:
        yield client
    redis_server.flush(BROKER_DB, RUNS_DB)


@pytest.fixture(
    params=[
        pytest.param("store_django_postgres", marks=pytest.mark.postgres, id="postgres"),
        pytest.param("store_django_maria", marks=pytest.mark.mysql, id="mariadb"),
    ]
)
def store_case(request: pytest.FixtureRequest) -> StoreCase:
    """The Django DB store on one server's alias (flushed by its fixture)."""
    case: StoreCase = request.getfixturevalue(request.param)
    return case


def test_one_publish_and_one_run_per_key(
    store_case: StoreCase, runs_db: redis.Redis, redis_server: RedisServer
) -> None:
    """8 producers, 200 keys, a prefork worker: one publish, one run per key, no lock left."""
    runs_url = redis_server.url(RUNS_DB)
    app = _race_app(store_case.url, redis_server.url(BROKER_DB), runs_url)
    until = time.monotonic() + BUDGET
    # Forked children open their own connections; none may inherit (and close) ours.
    connections.close_all()
    context = multiprocessing.get_context("fork")
    worker = context.Process(target=_work, args=(app, runs_url))
    worker.start()
    producers: list[Any] = []
    try:
        _wait(lambda: bool(runs_db.exists(READY)) or not worker.is_alive(), until, "the worker")
        assert worker.is_alive(), f"worker exited with {worker.exitcode}"
        barrier = context.Barrier(PRODUCERS)
        producers.extend(
            context.Process(target=_produce, args=(app, runs_url, i, barrier))
            for i in range(PRODUCERS)
        )
        for process in producers:
            process.start()
        for process in producers:
            process.join(max(0.0, until - time.monotonic()))
        assert [p.exitcode for p in producers] == [0] * PRODUCERS
        runs_db.set(GO, 1)
        _wait(lambda: runs_db.llen(RUNS) >= KEYS, until, "every key to run")
        _wait(lambda: not list(store_case.store.scan("")), until, "every lock released")
        time.sleep(0.5)  # a second run of some key would show up here
    finally:
        for process in producers:
            if process.is_alive():
                process.kill()
                process.join(5)
        if worker.pid is not None and worker.is_alive():
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(15)
            if worker.is_alive():
                worker.kill()
                worker.join(5)
    published = Counter(int(n) for n in runs_db.lrange(PUBLISHED, 0, -1))
    runs = Counter(int(n) for n in runs_db.lrange(RUNS, 0, -1))
    assert sum(published.values()) == KEYS and set(published) == set(range(KEYS)), published
    assert runs == Counter(range(KEYS)), runs.most_common(3)
    assert not list(store_case.store.scan("")), "locks left after success"
