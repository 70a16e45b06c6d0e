"""Celery's own re-sends and re-deliveries run a ``DedupTask`` as they run a plain task.

Every path on which Celery itself puts a message back or publishes it again
(a hard time limit under ``acks_on_failure_or_timeout=False``,
``retry_on_worker_lost``, ``reject_on_worker_lost``, ``Reject(requeue=True)``,
``self.retry()`` from ``on_failure``) runs the same scenario on a plain
``Task`` (the oracle) and on a ``DedupTask``, in one real prefork worker
subprocess (a pool child has to die for most of them). The bodies append to
a Redis list; each test asserts that the ``DedupTask``'s body ran as often
and ended in the same state as the plain task's, then that its lock was
released as its policy says.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Task, states
from celery.exceptions import Reject

from celery_dedup import DedupTask, inspect_lock

from .conftest import wait_until
from .subprocess_workers import RunsLog, env_app, worker_fixture
from .test_ownership import texts
from .test_ownership_prefork import Worker

pytestmark = pytest.mark.timeout(240)

QUEUE = "requeue-parity"
BROKER_DB, BACKEND_DB, RUNS_DB = 56, 57, 58
SIDES = ("plain", "dedup")

app = env_app("requeue_parity", "REQUEUE", QUEUE)
runs_log = RunsLog("REQUEUE")


def record(label: str) -> int:
    """Append one run of ``label``; return how many runs of it there are so far."""
    client = runs_log.client()
    client.rpush("runs", label)
    return texts(client.lrange("runs", 0, -1)).count(label)


class RetryOnFailure(Task):  # type: ignore[misc]
    """Retries the first attempt from its ``on_failure`` handler."""

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        if self.request.id == task_id and not self.request.retries:
            self.retry(countdown=0.2, throw=False)
        super().on_failure(exc, task_id, args, kwargs, einfo)


class DedupRetryOnFailure(RetryOnFailure, DedupTask):  # type: ignore[misc]
    """A ``DedupTask`` whose ``on_failure`` retries, as ``RetryOnFailure``."""


def _timeout(label: str) -> int:
    n = record(label)
    if n == 1:
        time.sleep(30)  # killed by the hard time limit
    return n


def _lost(label: str) -> int:
    n = record(label)
    if n == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the pool child dies mid-run
    return n


def _reject(label: str) -> int:
    n = record(label)
    if n == 1:
        raise Reject("put back by the test", requeue=True)
    return n


def _fail_once(label: str) -> int:
    n = record(label)
    if n == 1:
        raise ValueError("the first attempt fails")
    return n


def pair(
    scenario: str,
    body: Callable[[str], int],
    *,
    plain_base: Any = Task,
    dedup_base: Any = DedupTask,
    **options: Any,
) -> dict[str, Any]:
    """The scenario's task on both sides: same body and options, only the base differs."""
    tasks = {}
    for side, base in (("plain", plain_base), ("dedup", dedup_base)):
        extra = {"unique_for": 120, "unique_until": "finish"} if side == "dedup" else {}
        tasks[side] = app.task(base=base, name=f"requeue.{scenario}.{side}", **options, **extra)(
            body
        )
    return tasks


SCENARIOS: dict[str, dict[str, Any]] = {
    "time_limit_requeue": pair(
        "time_limit_requeue", _timeout, acks_late=True, acks_on_failure_or_timeout=False,
        time_limit=2,
    ),
    "retry_on_worker_lost": pair(
        "retry_on_worker_lost", _lost, retry_on_worker_lost=True, default_retry_delay=0,
        max_retries=3,
    ),
    "retry_on_worker_lost_exhausted": pair(
        "retry_on_worker_lost_exhausted", _lost, retry_on_worker_lost=True,
        default_retry_delay=0, max_retries=0,
    ),
    "reject_on_worker_lost": pair(
        "reject_on_worker_lost", _lost, acks_late=True, reject_on_worker_lost=True,
    ),
    "reject_requeue": pair("reject_requeue", _reject, acks_late=True),
    "retry_from_on_failure": pair(
        "retry_from_on_failure", _fail_once, plain_base=RetryOnFailure,
        dedup_base=DedupRetryOnFailure,
    ),
}


worker = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    stores=('redis',),
    started=True,
    doc="A two-slot prefork worker on the test Redis broker, started.",
)


def runs_of(label: str) -> int:
    """How many times the body of ``label`` ran."""
    return texts(runs_log.client().lrange("runs", 0, -1)).count(label)


def final(result: Any) -> str:
    """The state ``result`` settles in (SUCCESS or FAILURE), waiting for it."""
    wait_until(lambda: result.state in states.READY_STATES, timeout=90)
    return str(result.state)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_dedup_task_runs_as_the_plain_task(worker: Worker, scenario: str) -> None:
    """The same scenario on a plain task and on a ``DedupTask``: same runs, same final state."""
    tasks = SCENARIOS[scenario]
    results = {side: tasks[side].delay(f"requeue.{scenario}.{side}") for side in SIDES}
    seen = {side: (final(results[side]), results[side].result) for side in SIDES}
    time.sleep(3)  # a copy put back late would have run by now
    counts = {side: runs_of(f"requeue.{scenario}.{side}") for side in SIDES}
    assert counts["dedup"] == counts["plain"], worker.text()
    assert seen["dedup"][0] == seen["plain"][0], worker.text()
    if seen["plain"][0] == states.SUCCESS:
        assert seen["dedup"][1] == seen["plain"][1]
    # The run ended (success or final failure): "finish" released the lock.
    key = results["dedup"].deduplication_key
    wait_until(lambda: inspect_lock(key, app=app) is None, timeout=10)
    fresh = tasks["dedup"].delay(f"requeue.{scenario}.dedup")
    assert fresh.deduplicated is False
    fresh.get(timeout=60)
