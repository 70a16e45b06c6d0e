"""Races: 8 producer processes call the same keys at once; 4 worker processes run them.

Every key has one lock lifetime (``unique_until="expiry"``, a TTL longer
than the test): exactly one call per key publishes and exactly one body per
key runs, whatever the store; the checker finds nothing. 2 000 keys on Redis
and Redis Cluster, 500 on the slower SQL and memcached stores (CI time).
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections import Counter

import pytest

from celery_dedup.stores import store_from_url
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis_cluster import RedisClusterServer

from .conftest import Backends
from .model import summary
from .probe import Recorder, scan_once
from .workers import WorkerPool
from .workloads import race

PRODUCERS = 8


def run_race(
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    store_url: str,
    keys: int,
    *,
    scans: bool = True,
) -> None:
    conf = backends.conf(dedup_store=store_url)
    workers.start(conf, count=2, concurrency=2)
    seed = random.randrange(1 << 30)
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 4.0
    producers = [
        context.Process(target=race, args=(i, keys, conf, recorder.url, seed, start_at))
        for i in range(PRODUCERS)
    ]
    for process in producers:
        process.start()
    for process in producers:
        process.join(300)
        assert process.exitcode == 0, f"producer exited with {process.exitcode}"
    trace = recorder.settled(timeout=180)
    store = store_from_url(store_url)
    if scans:
        scan_once(store, "celery-dedup:", recorder)
    findings = recorder.findings()
    assert not findings, f"seed {seed}: {summary(findings)}"
    outcomes = Counter(c.outcome for c in trace.calls)
    assert outcomes["published"] == keys, outcomes
    assert outcomes["deduplicated"] == keys * (PRODUCERS - 1), outcomes
    runs = Counter(e.task_id for e in recorder.events("start"))
    assert len(runs) == keys and set(runs.values()) == {1}, runs.most_common(3)
    # Every lock still lives (TTL only), held by the call that published.
    winners = {c.key: c.token for c in trace.calls if c.outcome == "published"}
    held = {key: getattr(store.get(key), "owner", None) for key in winners}
    assert held == winners


@pytest.mark.slow
@pytest.mark.redis
def test_one_winner_and_one_run_per_key_on_redis(
    backends: Backends, recorder: Recorder, workers: WorkerPool
) -> None:
    run_race(backends, recorder, workers, backends.store, 2000)


@pytest.mark.slow
@pytest.mark.redis_cluster
def test_one_winner_and_one_run_per_key_on_redis_cluster(
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    redis_cluster: RedisClusterServer,
) -> None:
    redis_cluster.flush()
    try:
        run_race(backends, recorder, workers, redis_cluster.url, 2000)
    finally:
        redis_cluster.flush()


@pytest.mark.slow
@pytest.mark.parametrize(
    "fixture",
    [
        pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
        pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
        pytest.param("store_memcached", marks=pytest.mark.memcached, id="memcached"),
    ],
)
def test_one_winner_and_one_run_per_key_on_other_stores(
    fixture: str,
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    request: pytest.FixtureRequest,
) -> None:
    case: StoreCase = request.getfixturevalue(fixture)
    # memcached's scan can miss live locks (test_regressions.py): judge by get() only.
    run_race(backends, recorder, workers, case.url, 500, scans=fixture != "store_memcached")
