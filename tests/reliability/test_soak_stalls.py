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
#: how to stall the store for so many seconds; returns how to end the stall
Stall = Callable[[float], Callable[[], None]]
#: between stalls (the store answers)
BETWEEN = 5.0
#: stalls with probes: every one of them begins while the producers still call
PROBED_STALLS = 2
#: when a probe's message is due, in seconds after its stall began
PROBE_OFFSETS = (0.5, 1.5)
#: how long before its stall a probe is published (the store still answers)
PROBE_LEAD = 0.8


def stall_begins(origin: float) -> Iterator[float]:
    """When each stall begins: ``BETWEEN`` after the previous one ended (from ``origin``)."""
    begin = origin + BETWEEN
    while True:
        yield begin
        begin += STALL + BETWEEN


def probe_keys(plan: SoakPlan) -> Iterator[int]:
    """Fresh keys (no producer draws them) without a fixed policy or observe mode."""
    n = plan.keys
    while True:
        if Workload.policy(n) is None and not Workload.observes(n):
            yield n
        n += 1


def publish_probes(
    producer: Producer, task: Any, plan: SoakPlan, start_at: float
) -> Callable[[float], None]:
    """Calls due while the store stalls, each on a key of its own: published
    ``PROBE_LEAD`` before a stall, their messages become due inside it, so
    their start claims go unanswered (``closed``: deferred, or waited out)."""
    keys = probe_keys(plan)
    begins = stall_begins(start_at)
    due: list[tuple[float, float, int]] = []
    for _ in range(PROBED_STALLS):
        begin = next(begins)
        due += [(begin - PROBE_LEAD, begin + offset, next(keys)) for offset in PROBE_OFFSETS]

    def publish(until: float) -> None:
        while due and due[0][0] <= until:
            _, eta, n = due.pop(0)
            options = {**Workload.profile(n), "on_duplicate": "existing"}
            options["countdown"] = round(max(0.0, eta - time.time()), 3)
            with contextlib.suppress(Exception):  # recorded as the probe saw it
                producer.call(
                    task, (n, {"sleep": 0.0, "seq": f"probe-{n}"}), seq=f"probe-{n}", **options
                )

    return publish


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
    probes = publish_probes(producer, task, plan, start_at) if index == 0 else None

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
        if probes is not None:
            probes(due)
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
    """Stalls the store for ``STALL`` seconds at each of ``stall_begins(origin)``,
    from a daemon thread; ``windows`` holds each stall's (first, last) instant."""

    def __init__(self, stall: Stall, origin: float) -> None:
        self.stall = stall
        self.origin = origin
        self.stop = threading.Event()
        self.windows: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=self.run, name="rel-staller", daemon=True)

    @property
    def count(self) -> int:
        return len(self.windows)

    def run(self) -> None:
        for begin in stall_begins(self.origin):
            if self.stop.wait(max(0.0, begin - time.time())):
                return
            first = time.time()
            resume = self.stall(STALL)
            # The last instant the store was stalled: before it answers again.
            self.windows.append((first, time.time()))
            resume()

    def __enter__(self) -> Staller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(STALL + 30)


def _paused(server: FlakyRedis) -> Stall:
    """Stalls by pausing the server (SIGSTOP); returns how to resume it."""

    def stall(seconds: float) -> Callable[[], None]:
        assert server.proc is not None
        pid = server.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        except BaseException:
            os.kill(pid, signal.SIGCONT)
            raise
        return lambda: os.kill(pid, signal.SIGCONT)

    return stall


def _locked(case: StoreCase, request: pytest.FixtureRequest) -> Stall:
    """Stalls by locking the lock table from another connection; returns how to unlock it."""
    from tests.fixtures.postgres import PostgresServer

    server: PostgresServer = request.getfixturevalue("postgres_server")

    def stall(seconds: float) -> Callable[[], None]:
        conn = server.connect()
        try:
            conn.execute("BEGIN")
            conn.execute("LOCK TABLE celery_dedup_sql_lock IN ACCESS EXCLUSIVE MODE")
            time.sleep(seconds)
        except BaseException:
            conn.close()
            raise

        def resume() -> None:
            conn.execute("COMMIT")
            conn.close()

        return resume

    return stall


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def stallable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Stall]]:
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
    stallable: tuple[str, Stall],
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 workers with 2 prefork children; the store stalls 1.5 leases every 5 s."""
    # A capped debounce's run waits out a stall (its claim cannot be answered:
    # deferred, or waited out) and the backlog after it, while later calls of
    # its burst keep replacing its queued message: its cap holds while the
    # store answers and the workers keep up (docs/guarantees.md), so the
    # checker allows a stall cycle and the next stall on top.
    monkeypatch.setattr(model, "CAP_SLACK", model.CAP_SLACK + 2 * STALL + BETWEEN + 2.0)
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
    with Scanner(_scan_quietly(url, recorder), interval=1.0), Staller(stall, start_at) as staller:
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
    # The probes: a message due while the store stalls never starts before it
    # answers again, and does start after (its claim is deferred, or waits
    # the stall out: redis-py re-sends a timed-out command, PostgreSQL waits
    # for the table lock).
    probes = [c for c in trace.calls if c.seq.startswith("probe-") and c.outcome == "published"]
    stalled = [
        (call, window)
        for call in probes
        for window in staller.windows
        if window[0] <= call.t0 + call.countdown and call.t1 + call.countdown <= window[1]
    ]
    assert stalled, f"no probe was due inside a stall {staller.windows}: {probes}\n{report}"
    for call, (_, last) in stalled:
        starts = [e.t for e in trace.events if e.kind == "start" and e.task_id == call.task_id]
        assert starts and min(starts) >= last, (call, starts, last, report)
    # The traced processes' spans were judged (check_spans): publishes and duplicates.
    said = Counter(s.outcome for s in trace.spans)
    assert said["published"] > 0 and said["duplicate"] > 0, report
    assert any(c.traced for c in trace.calls), report
    # The stalls hit running leases (each worker logged a renewal the store
    # did not answer in time).
    logs = workers.log_texts()
    assert all("could not renew" in text or "to renew" in text for text in logs), report
