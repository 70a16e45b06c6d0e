"""A result that died with its worker: the copy stores ``ResultLost``, never runs the body again.

A run's done marker is written before Celery stores its result. A real
``celery worker -P prefork`` subprocess (Redis broker, ``acks_late``,
``reject_on_worker_lost``, a 2 s ``visibility_timeout``) is SIGKILLed whole,
from inside, in exactly that window: a ``lock_released`` receiver (sent
right after the done marker released the lock, before the tracer stores
the result) kills the worker's process group when the test set a flag.
The worker is started again; the broker redelivers the unacknowledged
message. Bodies append to a Redis list: each test asserts the exact number
of executions, what the caller's ``get()`` sees and the store's records.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from celery.signals import task_postrun

from celery_dedup import DedupTask, ResultLost, incarnation, inspect_lock
from celery_dedup.lost_results import store_lost_result
from celery_dedup.runs import records_of
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import lock_released
from celery_dedup.stores.base import RunRef
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until
from .subprocess_workers import RunsLog, env_app, worker_fixture
from .test_ownership import texts
from .test_ownership_prefork import Worker

pytestmark = pytest.mark.timeout(240)

QUEUE = "lost-results"
BROKER_DB, BACKEND_DB, RUNS_DB = 27, 28, 29
VISIBILITY = 2

app = env_app(
    "lost_results",
    "LOST",
    QUEUE,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    dedup_lease_ttl=3,
)
runs_log = RunsLog("LOST")

#: The flag a test sets: the next run of ``pay`` kills its whole worker at this point.
KILL_AFTER_END = "kill-after-end"  # the done marker written, the result not yet stored
KILL_AFTER_STORE = "kill-after-store"  # the result stored (task_postrun), not yet acked


@app.task(base=DedupTask, name="lost.pay", unique_for=120)
def pay(x: int) -> int:
    """Charges once: records the charge, then answers."""
    runs_log.client().rpush("runs", f"pay:{x}")
    return x * 10


def _kill_worker_if(flag: str) -> None:
    """SIGKILL this worker's whole process group (main process and pool) if ``flag`` is set."""
    if runs_log.client().delete(flag):
        os.killpg(os.getpgrp(), signal.SIGKILL)


@lock_released.connect(weak=False)
def _after_end(sender: Any = None, reason: str = "", **_: Any) -> None:
    if getattr(sender, "name", None) == pay.name and reason == "success":
        _kill_worker_if(KILL_AFTER_END)


@task_postrun.connect(weak=False)
def _after_store(sender: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) == pay.name:
        _kill_worker_if(KILL_AFTER_STORE)


worker = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    doc="A two-slot prefork worker (started by the test); run records in Redis or PostgreSQL.",
)


def runs(redis_server: RedisServer) -> list[str]:
    """Every execution so far."""
    with redis_server.client(RUNS_DB) as client:
        return texts(client.lrange("runs", 0, -1))


def killed_from_inside(worker: Worker, redis_server: RedisServer, flag: str) -> None:
    """Arm ``flag``, then wait until the worker killed itself there; start a new one."""
    assert worker.proc is not None
    worker.proc.wait(90)
    with redis_server.client(RUNS_DB) as client:
        assert not client.exists(flag)  # the kill happened at the armed point
    worker.start()


def arm(redis_server: RedisServer, flag: str) -> None:
    with redis_server.client(RUNS_DB) as client:
        client.set(flag, "1")


def test_a_result_lost_with_its_worker_is_stored_as_result_lost_not_run_again(
    worker: Worker, redis_server: RedisServer
) -> None:
    """Killed between the done marker and the result store: the redelivered copy finds
    the run done, does not run it, and stores FAILURE with ``ResultLost``: get() raises it."""
    arm(redis_server, KILL_AFTER_END)
    worker.start()
    result = pay.delay(1)
    killed_from_inside(worker, redis_server, KILL_AFTER_END)
    with pytest.raises(ResultLost) as raised:
        result.get(timeout=90)
    assert raised.value.task_id == result.id
    assert raised.value.task_name == pay.name
    assert raised.value.outcome == "success"
    assert "ran to its end" in str(raised.value)
    assert result.state == "FAILURE"
    wait_until(lambda: "already ran" in worker.text(), timeout=30)
    time.sleep(2 * VISIBILITY)  # any further copy arrives and is refused
    assert runs(redis_server) == ["pay:1"]
    # The policy held: released at the run's end ("success"); a new call runs.
    assert inspect_lock(result.deduplication_key, app=app) is None
    wait_until(lambda: "ResultLost" in worker.text(), timeout=30)


def test_a_copy_that_expired_stores_the_lost_result_too(
    worker: Worker, redis_server: RedisServer
) -> None:
    """The redelivered copy is past its ``expires``: dropped as a copy of a done run (no
    REVOKED over the run's id), and its lost result is stored as ``ResultLost``."""
    arm(redis_server, KILL_AFTER_END)
    worker.start()
    expires = 4.0
    published = time.monotonic()
    result = pay.apply_async([2], expires=expires)
    assert worker.proc is not None
    worker.proc.wait(90)
    time.sleep(max(0.0, published + expires + 0.5 - time.monotonic()))  # the copy is expired
    killed_from_inside(worker, redis_server, KILL_AFTER_END)
    with pytest.raises(ResultLost):
        result.get(timeout=90)
    assert result.state == "FAILURE"
    wait_until(lambda: "dropped a copy" in worker.text(), timeout=30)  # (logged after)
    assert runs(redis_server) == ["pay:2"]


def test_a_result_stored_before_the_kill_is_returned_and_never_overwritten(
    worker: Worker, redis_server: RedisServer
) -> None:
    """Killed after the result was stored, before the ack: the copy is refused as already
    ran, get() returns the real result and the state stays SUCCESS."""
    arm(redis_server, KILL_AFTER_STORE)
    worker.start()
    result = pay.delay(3)
    killed_from_inside(worker, redis_server, KILL_AFTER_STORE)
    wait_until(lambda: "already ran" in worker.text(), timeout=60)
    assert result.get(timeout=30) == 30
    assert result.state == "SUCCESS"
    time.sleep(2 * VISIBILITY)
    assert result.state == "SUCCESS"
    assert runs(redis_server) == ["pay:3"]
    assert "ResultLost" not in worker.text()


# -- the guards, on the real Redis store and result backend (no worker) -----


def _dead_token() -> str:
    """A delivery token of a process that has exited (on this machine)."""
    made = subprocess.run(
        [sys.executable, "-c",
         "from celery_dedup.incarnation import new_delivery_token; print(new_delivery_token())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return made.stdout.strip()


def test_only_a_final_run_of_a_dead_worker_without_a_result_gets_result_lost(
    app_factory: AppFactory,
) -> None:
    """A live ender, another machine's, a retried or unrecorded outcome, a stored result:
    nothing is written. A final run of a dead process with no result: ResultLost."""
    guards = app_factory("lost_guards")

    @guards.task(base=DedupTask, name="lost.guarded", unique_for=60)
    def guarded() -> None:
        """Never run here."""

    store = runtime_for(guards).store
    assert store is not None
    records = records_of(store)
    meta = {"task_name": guarded.name, "policy": "success", "task_id": ""}
    dead = _dead_token()
    elsewhere = "0123456789." + dead.split(".", 1)[1]
    cases = {
        "live": (incarnation.new_delivery_token(), "success", False),
        "elsewhere": (elsewhere, "success", False),
        "retried": (dead, "retried", False),
        "unrecorded": (dead, "", False),
        "stored": (dead, "success", False),
        "lost": (dead, "failure", True),
    }
    for name, (token, outcome, stores) in cases.items():
        task_id = f"id-{name}"
        run = RunRef(f"key-{name}", f"owner-{name}", "0.0", token)
        records.claim_run(run, 30, meta, release=False, ttl=60)
        records.end_run(run, 60, {**meta, "outcome": outcome}, release=True)
        if name == "stored":
            guarded.backend.mark_as_done(task_id, 42)
        copy = RunRef(run.key, run.owner, "0.0", "a-copy")
        assert store_lost_result(guarded, task_id, records, copy, None) is stores, name
        state = guarded.AsyncResult(task_id).state
        assert state == {"stored": "SUCCESS", "lost": "FAILURE"}.get(name, "PENDING"), name
    with pytest.raises(ResultLost) as raised:
        guarded.AsyncResult("id-lost").get(timeout=10)
    assert raised.value.outcome == "failure"
    assert guarded.AsyncResult("id-stored").get(timeout=10) == 42
