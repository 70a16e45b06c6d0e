"""Soak: many producers, every policy and option, real prefork workers; the checker finds nothing.

The CI form is 1 000 calls over 50 keys on Redis; ``DEDUP_SOAK_FULL=1`` runs
10 000 calls over 500 keys at ~100 calls/s (see ``workloads.py``);
``DEDUP_SOAK_SEED`` replays a run's draws; ``DEDUP_SOAK_STORES`` picks the
stores (comma-separated ids below, default ``redis``; ``all`` for every one).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from celery_dedup.stores import store_from_url
from tests.fixtures._store_case import StoreCase

from .conftest import Backends
from .model import Kind, Trace, check, summary, unfinished
from .probe import Recorder, Scanner, poll, scan_once
from .workers import WorkerPool
from .workloads import SoakPlan, produce

PREFIX = "celery-dedup:"

ALL_STORES = [
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("store_redis_cluster", marks=pytest.mark.redis_cluster, id="redis-cluster"),
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
    pytest.param("store_memcached", marks=pytest.mark.memcached, id="memcached"),
]
#: ``DEDUP_SOAK_STORES`` (comma-separated ids, or ``all``) selects the stores
#: the soak runs on; CI runs Redis (the races run on every store).
_CHOSEN = os.environ.get("DEDUP_SOAK_STORES", "redis").split(",")
STORES = [p for p in ALL_STORES if "all" in _CHOSEN or p.id in _CHOSEN]


def store_url(fixture: str, backends: Backends, request: pytest.FixtureRequest) -> str:
    """The soak's store URL."""
    if fixture == "redis":
        return backends.store
    case: StoreCase = request.getfixturevalue(fixture)
    return case.url


def describe(trace: Trace) -> str:
    """What a run exercised, for its report."""
    calls = Counter(c.outcome for c in trace.calls)
    events = Counter(
        f"{e.kind}:{e.outcome}" if e.kind in ("postrun", "skipped", "revoked", "end") else e.kind
        for e in trace.events
    )
    revokes = Counter(r.outcome for r in trace.revokes)
    return f"calls {dict(calls)}; revokes {dict(revokes)}; events {dict(sorted(events.items()))}"


#: Faults the soak runs under: ``redelivery`` gives the Redis broker a 1 s
#: ``visibility_timeout`` (restored every second) and draws countdowns up to
#: 3 s, so every message waiting for its ETA is delivered again, several times.
FAULTS = {
    "none": ({}, 1.5),
    "redelivery": (
        {
            "broker_transport_options": {
                "visibility_timeout": 1,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
            },
            "dedup_lease_ttl": 3,
        },
        3.0,
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("fixture", STORES)
def test_soak_finds_no_violation(
    fixture: str,
    fault: str,
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """2 workers with 2 prefork children each; the checker reports 0 of every kind."""
    url = store_url(fixture, backends, request)
    settings, max_countdown = FAULTS[fault]
    plan = dataclasses.replace(SoakPlan.from_env(), max_countdown=max_countdown)
    conf = backends.conf(dedup_store=url, **settings)
    workers.start(conf, count=2, concurrency=2)
    store = store_from_url(url)
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0
    producers = [
        context.Process(target=produce, args=(i, plan, conf, recorder.url, start_at))
        for i in range(plan.producers)
    ]
    with Scanner(lambda: scan_once(store, PREFIX, recorder), interval=1.0) as scanner:
        for process in producers:
            process.start()
        for process in producers:
            process.join(plan.calls / plan.rate + 120)
            assert process.exitcode == 0, f"producer exited with {process.exitcode}"
        # A copy of a killed run waits for its lease record: two leases (60 s each).
        poll(lambda: not unfinished(recorder.trace()), 180, interval=1.0, what="queue drained")
    scan_once(store, PREFIX, recorder)
    trace = recorder.trace()
    (tmp_path / "trace.json").write_text(trace.to_json())
    # memcached counts TTLs in whole seconds: a lock may outlive its TTL by ~4 s (documented).
    findings = check(trace, ttl_slack=4.0 if fixture == "store_memcached" else 0.0)
    report = f"{fault}: seed {plan.seed}, {scanner.count} scans; {describe(trace)}"
    assert not findings, f"{summary(findings)}\n{report}\ntrace: {tmp_path / 'trace.json'}"
    # The run exercised what it claims to (not a vacuous pass).
    outcomes = Counter(c.outcome for c in trace.calls)
    assert outcomes["published"] > plan.calls // 10 and outcomes["deduplicated"] > 0, report
    assert outcomes["raised"] > 0 and len(trace.revokes) > 0, report
    assert any(c.keep_last and c.outcome == "published" for c in trace.calls), report
    # cancel_running terminated running bodies; capped debounces published.
    assert any(c.cancel and c.outcome == "published" for c in trace.calls), report
    assert any(e.kind == "end" and e.outcome == "interrupted" for e in trace.events), report
    assert any(c.max_wait is not None and c.outcome == "published" for c in trace.calls), report
    kinds = Counter(e.kind for e in trace.events)
    assert kinds["start"] > 0 and kinds["skipped"] > 0 and kinds["revoked"] > 0, report
    assert all(k in Kind for k in Kind)
