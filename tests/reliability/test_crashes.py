"""Crashes: SIGKILL of a pool child and of a whole worker, with and without ``acks_late``.

With ``acks_late`` + ``task_reject_on_worker_lost`` the message comes back:
its redelivery still owns the lock (same owner token), no duplicate is
accepted meanwhile, the body runs once more (never twice at once) and the
lock is released at its end. Without ``acks_late`` the message is gone: the
lock is kept until its TTL, and the reaper frees it once the result backend
recorded the failure, never a live holder's lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, states

from celery_dedup.reaper import reap
from celery_dedup.stores.redis import RedisStore

from .apps import work_task, worker_env
from .conftest import Backends
from .model import Event, summary
from .probe import Producer, Recorder, poll
from .workers import ROOT, WorkerPool, wait_pid_gone

AppFactory = Callable[[dict[str, Any]], Celery]

ACKS_LATE = {"task_acks_late": True, "task_reject_on_worker_lost": True}
#: the first run of a try hangs (to be killed there); a redelivery finishes quickly
HANG_ONCE = {"hang": 120, "hang_runs": 1, "sleep": 0.3}


def store_of(backends: Backends) -> RedisStore:
    return RedisStore(redis.Redis.from_url(backends.store))


def first_start(recorder: Recorder, token: str) -> Event:
    starts: list[Event] = poll(lambda: recorder.events("start", token=token), 30, what="started")
    return starts[0]


def wait_state(result: Any, state: str) -> None:
    def reached() -> bool:
        return bool(result.state == state)

    poll(reached, 30, what=f"{result.id} {state}")


def hold_while(
    producer: Producer, task: Any, n: int, holder: str, done: Callable[[], Any], timeout: float
) -> int:
    """Call the same key until ``done()``: every call must be suppressed by ``holder``."""
    calls = 0
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the redelivery never finished"
        result = producer.call(task, (n, HANG_ONCE))
        assert result.deduplicated is True and result.id == holder, "a duplicate was accepted"
        calls += 1
        time.sleep(0.1)
    return calls


def assert_ran_twice_in_sequence(recorder: Recorder, token: str, killed_at: float) -> None:
    starts = recorder.events("start", token=token)
    ends = recorder.events("end", token=token)
    assert len(starts) == 2, starts
    assert starts[1].t > killed_at and starts[1].pid != starts[0].pid
    assert [e.outcome for e in ends] == ["success"] and ends[0].pid == starts[1].pid


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("until", ["success", "finish"])
def test_acks_late_redelivery_after_a_killed_pool_child_owns_its_lock(
    until: str,
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    producer_app: AppFactory,
) -> None:
    conf = backends.conf(**ACKS_LATE, unique_until=until)
    (worker,) = workers.start(conf, concurrency=2)
    task = work_task(producer_app(conf))
    producer = Producer(recorder)
    first = producer.call(task, (7, HANG_ONCE), unique_until=until, unique_for=120)
    assert producer.last is not None
    token = producer.last.token
    start = first_start(recorder, token)
    assert start.pid in worker.children()
    store = store_of(backends)
    lock = store.get(first.deduplication_key)
    assert lock is not None and lock.owner == token and lock.started

    os.kill(start.pid, signal.SIGKILL)
    killed_at = time.time()
    wait_pid_gone(start.pid)
    calls = hold_while(
        producer, task, 7, first.id, lambda: recorder.events("end", token=token), 60
    )
    assert first.get(timeout=30) == 7
    assert calls > 0
    assert_ran_twice_in_sequence(recorder, token, killed_at)
    poll(lambda: store.get(first.deduplication_key) is None, 10, what="lock released")
    fresh = producer.call(task, (7, {}))
    assert fresh.deduplicated is False and fresh.get(timeout=30) == 7
    store.close()
    findings = recorder.findings()
    assert not findings, summary(findings)


@pytest.mark.slow
@pytest.mark.redis
def test_acks_late_redelivery_after_the_whole_worker_was_killed(
    backends: Backends, recorder: Recorder, workers: WorkerPool, producer_app: AppFactory
) -> None:
    """SIGKILL of the worker and its children; the restarted worker gets the message back."""
    # Redis restores unacked messages older than visibility_timeout, checked every
    # unacked_restore_interval * unacked_restore_throttle seconds (100 by default).
    transport = {"visibility_timeout": 4, "unacked_restore_interval": 1,
                 "unacked_restore_throttle": 1}
    conf = backends.conf(**ACKS_LATE, broker_transport_options=transport)
    (worker,) = workers.start(conf, concurrency=2)
    task = work_task(producer_app(conf))
    producer = Producer(recorder)
    first = producer.call(task, (8, HANG_ONCE), unique_for=120)
    assert producer.last is not None
    token = producer.last.token
    first_start(recorder, token)
    worker.kill()
    killed_at = time.time()
    # Down: the lock stays, so the same call is still a duplicate.
    for _ in range(5):
        assert producer.call(task, (8, HANG_ONCE)).deduplicated is True
    worker.start()
    hold_while(producer, task, 8, first.id, lambda: recorder.events("end", token=token), 90)
    assert first.get(timeout=30) == 8
    assert_ran_twice_in_sequence(recorder, token, killed_at)
    store = store_of(backends)
    poll(lambda: store.get(first.deduplication_key) is None, 10, what="lock released")
    store.close()
    findings = recorder.findings()
    assert not findings, summary(findings)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_revoked_copy_of_a_run_that_died_with_its_worker_ends_revoked(
    backends: Backends, recorder: Recorder, workers: WorkerPool, producer_app: AppFactory
) -> None:
    """The run's worker is SIGKILLed, the message is revoked, the broker restores it: the
    copy is dropped as Celery drops a revoked message (REVOKED stored, its lock released),
    not quietly as a copy of a live run, though the dead run's lease is still on record."""
    transport = {"visibility_timeout": 8, "unacked_restore_interval": 1,
                 "unacked_restore_throttle": 1}
    conf = backends.conf(**ACKS_LATE, broker_transport_options=transport)
    (worker,) = workers.start(conf, concurrency=2)
    app = producer_app(conf)
    task = work_task(app)
    producer = Producer(recorder)
    first = producer.call(task, (10, HANG_ONCE), unique_for=300)
    assert producer.last is not None
    token = producer.last.token
    first_start(recorder, token)
    worker.kill()
    worker.start()
    app.control.revoke(first.id)
    poll(lambda: recorder.events("revoked", token=token), 60, what="the copy dropped")
    wait_state(first, states.REVOKED)
    assert len(recorder.events("start", token=token)) == 1  # never run again
    assert "its run is live or done" not in worker.tail(1_000_000)
    store = store_of(backends)
    poll(lambda: store.get(first.deduplication_key) is None, 10, what="lock released")
    store.close()
    assert producer.call(task, (10, {"sleep": 0.1})).deduplicated is False


#: Receptions of one message whose run died with its worker, when the copy
#: comes back to a worker on the same machine: the run, and its copy.
MAX_RECEPTIONS = 2


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_killed_workers_message_is_received_a_bounded_number_of_times(
    backends: Backends, recorder: Recorder, workers: WorkerPool, producer_app: AppFactory
) -> None:
    """``acks_late``, whole worker SIGKILLed mid-run, a visibility timeout (8 s) shorter
    than a third of the lease (60 s): the restored copy finds the dead run's lease, sees
    that the process renewing it is gone, takes it over at once and runs, once, to its
    end: two receptions in all, no deferral (issue 30's scenario saw 67).
    """
    transport = {"visibility_timeout": 8, "unacked_restore_interval": 1,
                 "unacked_restore_throttle": 1}
    conf = backends.conf(**ACKS_LATE, broker_transport_options=transport)
    (worker,) = workers.start(conf, concurrency=2)
    task = work_task(producer_app(conf))
    producer = Producer(recorder)
    first = producer.call(task, (9, HANG_ONCE), unique_for=300)
    assert producer.last is not None
    token = producer.last.token
    first_start(recorder, token)
    worker.kill()
    killed_at = time.time()
    worker.start()
    assert first.get(timeout=150) == 9
    assert_ran_twice_in_sequence(recorder, token, killed_at)
    received = recorder.events("received", token=token)
    deferred = [
        e for e in recorder.events("skipped", token=token) if e.outcome.startswith("deferred")
    ]
    assert deferred == [], [round(e.t - killed_at, 1) for e in deferred]
    assert len(received) == MAX_RECEPTIONS, [round(e.t - killed_at, 1) for e in received]
    assert "takes over the lease of a run whose worker is gone" in worker.tail(1_000_000)
    findings = recorder.findings(max_receptions=MAX_RECEPTIONS)
    assert not findings, summary(findings)


@pytest.mark.slow
@pytest.mark.redis
def test_without_acks_late_a_killed_childs_lock_follows_its_failure(
    backends: Backends, recorder: Recorder, workers: WorkerPool, producer_app: AppFactory
) -> None:
    """A killed child's ``finish`` lock is released as Celery records its FAILURE.

    As for a hard time limit: the worker's main process ends the run before
    Celery stores ``WorkerLostError``. ``success`` keeps its lock after the
    failure; the reaper leaves it and a live holder's lock alone.
    """
    conf = backends.conf()
    (worker,) = workers.start(conf, concurrency=3)
    app = producer_app(conf)
    task = work_task(app)
    producer = Producer(recorder)
    hang = {"hang": 120, "hang_runs": 1}
    victim = producer.call(task, (1, hang), unique_until="finish", unique_for=120)
    victim_token = producer.last.token if producer.last else ""
    # Long enough to outlive the kills and the reap subprocess on a loaded machine.
    kept = producer.call(task, (2, hang), unique_until="success", unique_for=30)
    kept_token = producer.last.token if producer.last else ""
    live = producer.call(task, (3, hang), unique_until="finish", unique_for=120)
    live_token = producer.last.token if producer.last else ""
    pids = [first_start(recorder, tok).pid for tok in (victim_token, kept_token, live_token)]
    for pid in pids[:2]:
        os.kill(pid, signal.SIGKILL)
    for result in (victim, kept):
        wait_state(result, states.FAILURE)
    store = store_of(backends)
    # The message is gone for good, and so is its lock: the failure released it.
    assert store.get(victim.deduplication_key) is None
    assert store.get(kept.deduplication_key) is not None

    cli = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.reliability.worker_app", "dedup", "reap"],
        cwd=ROOT,
        env={**os.environ, **worker_env(conf, recorder.url), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert store.get(victim.deduplication_key) is None
    # success keeps its lock after a failure (until the TTL); a running holder keeps its own.
    assert store.get(kept.deduplication_key) is not None
    assert store.get(live.deduplication_key) is not None
    assert reap(app) == []
    assert producer.call(task, (1, {}), unique_until="finish").deduplicated is False
    poll(lambda: store.get(kept.deduplication_key) is None, 45, what="success lock expired")
    assert store.get(live.deduplication_key) is not None
    store.close()
    worker.kill()
