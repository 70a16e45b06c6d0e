"""Soak under store stalls longer than the lease, with ``dedup_fallback="closed"`` (issue 30).

The soak's workload (``workloads.py``) on real prefork workers while the lock
store stops answering, again and again, for one and a half leases: a Redis
store on a server of its own is paused (SIGSTOP), or a PostgreSQL store's
lock table is locked by another connection. Producers and workers run
``"closed"``: a call the store cannot check is refused (``failed``, nothing
published), a message whose claim got no answer is deferred. The checker
judges overlaps, runs of one publish, lost messages and every other kind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dedup import StoreError
from celery_dedup.runtime import runtime_for
from celery_dedup.stores import store_from_url
from tests.fixtures._store_case import StoreCase

from . import model
from .apps import TRACED, make_app, work_task
from .conftest import Backends
from .model import Revoke, check, summary
from .probe import Producer, Recorder, Scanner, scan_once
from .servers import FlakyRedis, flaky_redis
from .test_soak import PREFIX, describe, spans_seen, traced
from .workers import WorkerPool
from .workloads import SoakPlan, Workload

LEASE = 2.0
#: each stall: longer than the lease, shorter than a lease record's life
STALL = 1.5 * LEASE
#: between stalls (the store answers)
BETWEEN = 5.0


def produce_through_outages(
    index: int, plan: SoakPlan, conf: dict[str, Any], recorder_url: str, start_at: float
) -> None:
    """``workloads.produce``, for a store that stalls: refused calls and revokes go on."""
    app = make_app(conf, recorder_url, name=f"p{index}")
    task = work_task(app)
    recorder = Recorder(recorder_url)
    producer = Producer(recorder)
    workload = Workload(random.Random(plan.seed * 100 + index), plan.keys, plan.max_countdown)
    interval = plan.producers / plan.rate
    revokes: list[tuple[float, Any]] = []

    def revoke_due(until: float) -> None:
        while revokes and revokes[0][0] <= until:
            result = revokes.pop(0)[1]
            t0 = time.time()
            try:
                producer.revoke(result)
            except StoreError:
                # Ambiguous: a stalled server may still run the revoke once it resumes.
                key, task_id = str(result.deduplication_key), str(result.id)
                recorder.revoke(Revoke(key, task_id, t0, time.time(), "unanswered"))

    for i in range(plan.calls // plan.producers):
        due = start_at + i * interval
        revoke_due(due)
        time.sleep(max(0.0, due - time.time()))
        n, body, options, revoke_after = workload.next_call()
        body["seq"] = seq = f"{index}-{i}"
        try:
            result = producer.call(task, (n, body), seq=seq, **options)
        except Exception:
            continue
        if revoke_after is not None and not result.deduplicated:
            revokes.append((time.time() + revoke_after, result))
            revokes.sort(key=lambda item: item[0])
    revoke_due(float("inf"))
    runtime_for(app).metrics.flush()
    recorder.close()
    app.close()


class Staller:
    """Stalls the store for ``STALL`` seconds every ``BETWEEN`` seconds, from a daemon thread."""

    def __init__(self, stall: Callable[[float], None]) -> None:
        self.stall = stall
        self.stop = threading.Event()
        self.count = 0
        self.thread = threading.Thread(target=self.run, name="rel-staller", daemon=True)

    def run(self) -> None:
        while not self.stop.wait(BETWEEN):
            self.stall(STALL)
            self.count += 1

    def __enter__(self) -> Staller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(STALL + 30)


def _paused(server: FlakyRedis) -> Callable[[float], None]:
    def stall(seconds: float) -> None:
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)

    return stall


def _locked(case: StoreCase, request: pytest.FixtureRequest) -> Callable[[float], None]:
    from tests.fixtures.postgres import PostgresServer

    server: PostgresServer = request.getfixturevalue("postgres_server")

    def stall(seconds: float) -> None:
        with server.connect() as conn, conn.transaction():
            conn.execute("LOCK TABLE celery_dedup_sql_lock IN ACCESS EXCLUSIVE MODE")
            time.sleep(seconds)

    return stall


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("postgres", marks=pytest.mark.postgres)])
def stallable(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, Callable[[float], None]]]:
    """A store URL and how to stall it: Redis paused, or its PostgreSQL table locked."""
    if request.param == "redis":
        with flaky_redis(tmp_path / "store") as server:
            yield f"{server.url()}?socket_timeout=1&socket_connect_timeout=1", _paused(server)
        return
    case: StoreCase = request.getfixturevalue("store_postgres")
    yield case.url, _locked(case, request)


def _scan_quietly(url: str, recorder: Recorder) -> Callable[[], None]:
    store = store_from_url(url)

    def scan() -> None:
        with contextlib.suppress(StoreError):  # stalled: the next scan sees the store
            scan_once(store, PREFIX, recorder)

    return scan


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_under_store_stalls_longer_than_the_lease_finds_no_violation(
    stallable: tuple[str, Callable[[float], None]],
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 workers with 2 prefork children; the store stalls 1.5 leases every 5 s."""
    # A capped debounce's run waits out a stall (its claim cannot be answered,
    # "closed" defers it): its cap holds while the store answers, so the
    # checker allows the stall and the deferral that waits it out on top.
    monkeypatch.setattr(model, "CAP_SLACK", model.CAP_SLACK + STALL + 2.0)
    url, stall = stallable
    plan = SoakPlan.from_env()
    conf = backends.conf(
        dedup_store=url,
        dedup_lease_ttl=LEASE,
        dedup_fallback="closed",
        broker_transport_options={
            "visibility_timeout": 2,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        **{TRACED: traced(plan, "stalls", 2)},
    )
    workers.start(conf, count=2, concurrency=2)
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0
    producers = [
        context.Process(
            target=produce_through_outages, args=(i, plan, conf, recorder.url, start_at)
        )
        for i in range(plan.producers)
    ]
    with Scanner(_scan_quietly(url, recorder), interval=1.0), Staller(stall) as staller:
        for process in producers:
            process.start()
        for process in producers:
            process.join(plan.calls / plan.rate + 120)
            assert process.exitcode == 0, f"producer exited with {process.exitcode}"
    recorder.drained(180, workers.log_texts, dump=tmp_path / "trace.json")
    _scan_quietly(url, recorder)()
    trace = recorder.trace()
    (tmp_path / "trace.json").write_text(trace.to_json())
    findings = check(trace)
    report = (
        f"seed {plan.seed}, {staller.count} stalls, traced {conf[TRACED]}; {describe(trace)}; "
        f"{spans_seen(trace)}"
    )
    assert not findings, f"{summary(findings)}\n{report}\ntrace: {tmp_path / 'trace.json'}"
    # The run exercised what it claims to (not a vacuous pass).
    outcomes = Counter(c.outcome for c in trace.calls)
    assert staller.count >= 2 and outcomes["published"] > plan.calls // 10, report
    assert any(e.kind == "skipped" and "deferred" in e.outcome for e in trace.events), report
    # The traced processes' spans were judged (check_spans): publishes and duplicates.
    said = Counter(s.outcome for s in trace.spans)
    assert said["published"] > 0 and said["duplicate"] > 0, report
    assert any(c.traced for c in trace.calls), report
    # The stalls hit running leases (each worker logged a renewal the store
    # did not answer in time).
    logs = workers.log_texts()
    assert all("could not renew" in text or "to renew" in text for text in logs), report
