"""One publish, one run: copies the broker redelivers never run the body again (issue 20).

A real ``celery worker -P prefork`` subprocess consumes from a Redis broker
whose ``visibility_timeout`` is 2 s and which restores unacknowledged
messages every second, so every message that waits longer than 2 s (for
its ETA, in the prefetch buffer, or because its worker died) is delivered
again. Task bodies append to a Redis list; each test asserts the exact
number of executions, then the lock state.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from celery_dedup import DedupTask, inspect_lock
from celery_dedup.runs import DELIVERY_FIELD
from tests.fixtures.redis import RedisServer

from .conftest import wait_until
from .subprocess_workers import RunsLog, env_app, worker_fixture
from .test_ownership import texts
from .test_ownership_prefork import Worker

pytestmark = pytest.mark.timeout(240)

QUEUE = "runs-once"
BROKER_DB, BACKEND_DB, RUNS_DB = 33, 34, 35
VISIBILITY = 2
LEASE = 3

app = env_app(
    "runs_once",
    "ONCE",
    QUEUE,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    dedup_lease_ttl=LEASE,
)
runs_log = RunsLog("ONCE")


def record(event: str) -> None:
    """Append ``event`` (with this process's pid) to the shared log."""
    runs_log.client().rpush("runs", f"{event}:{os.getpid()}")


def _waiting(until: str) -> Any:
    @app.task(base=DedupTask, name=f"once.eta_{until}", unique_for=60, unique_until=until)
    def eta(x: int) -> int:
        record(f"eta_{until}:{x}")
        return x

    return eta


ETA_TASKS = {until: _waiting(until) for until in ("start", "success", "finish", "expiry")}


@app.task(base=DedupTask, unique_for=60)
def busy(x: int) -> int:
    """Runs 1.5 s: messages behind it wait in the prefetch buffer."""
    record(f"busy:{x}")
    time.sleep(1.5)
    return x


@app.task(
    base=DedupTask,
    unique_for=120,
    unique_until="finish",
    acks_late=True,
    reject_on_worker_lost=True,
)
def fragile(x: int) -> int:
    """Records its start, then runs 6 s: long enough to be killed mid-run."""
    record(f"start:{x}")
    time.sleep(6)
    record(f"end:{x}")
    return x


@app.task(
    base=DedupTask,
    unique_for=120,
    acks_late=True,
    concurrency_limit=1,
    concurrency_key="{group}",
    concurrency_backoff=0.2,
)
def limited(x: int, group: str = "all") -> int:
    """One at a time (concurrency limit 1); runs 6 s, so the broker redelivers it meanwhile."""
    record(f"limited_start:{x}")
    time.sleep(6)
    record(f"limited_end:{x}")
    return x


@app.task(base=DedupTask, unique_for=120, on_duplicate="keep_last", acks_late=True)
def coalesced(x: int) -> int:
    """A ``keep_last`` task (deferred by any store error); runs 6 s, as ``fragile``."""
    record(f"coalesced_start:{x}")
    time.sleep(6)
    record(f"coalesced_end:{x}")
    return x


worker = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    doc=(
        "A two-slot prefork worker on the test Redis broker (started by the test). Its "
        "locks and run records live in the result backend's Redis, or in PostgreSQL "
        "(``dedup_store``)."
    ),
)


def runs(redis_server: RedisServer) -> list[str]:
    """Every execution event so far, without the pids."""
    with redis_server.client(RUNS_DB) as client:
        return [event.rsplit(":", 1)[0] for event in texts(client.lrange("runs", 0, -1))]


def pids(redis_server: RedisServer, event: str) -> list[int]:
    """The pids that logged ``event``, in order."""
    with redis_server.client(RUNS_DB) as client:
        logged = texts(client.lrange("runs", 0, -1))
    return [int(e.rsplit(":", 1)[1]) for e in logged if e.rsplit(":", 1)[0] == event]


def settle(seconds: float) -> None:
    """Let every copy the broker would still redeliver arrive and be handled."""
    time.sleep(seconds)


def test_eta_longer_than_the_visibility_timeout_runs_once_under_every_policy(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A countdown of 3.5 visibility timeouts: each copy restored meanwhile is refused."""
    worker.start()
    results = {until: task.apply_async([1], countdown=7) for until, task in ETA_TASKS.items()}
    for result in results.values():
        assert result.get(timeout=60) == 1
    settle(3 * VISIBILITY + LEASE)
    assert sorted(runs(redis_server)) == sorted(f"eta_{until}:1" for until in ETA_TASKS)
    assert "already ran" in worker.text() or "deferred" in worker.text()
    # The policies still hold: expiry keeps its lock, the others released it.
    assert inspect_lock(results["expiry"].deduplication_key, app=app) is not None
    for until in ("start", "success", "finish"):
        assert inspect_lock(results[until].deduplication_key, app=app) is None


def test_prefetched_messages_waiting_past_the_visibility_timeout_run_once(
    worker: Worker, redis_server: RedisServer
) -> None:
    """Six 1.5 s calls on two slots: the four waiting in the prefetch buffer are redelivered."""
    results = [busy.delay(i) for i in range(6)]
    worker.start()
    assert [result.get(timeout=60) for result in results] == list(range(6))
    settle(2 * VISIBILITY + LEASE)
    assert sorted(runs(redis_server)) == sorted(f"busy:{i}" for i in range(6))


def test_sigkill_of_the_pool_child_runs_exactly_once_more(
    worker: Worker, redis_server: RedisServer
) -> None:
    """``acks_late`` + ``reject_on_worker_lost``: the requeued message runs once more, after."""
    worker.start()
    result = fragile.delay(1)
    wait_until(lambda: pids(redis_server, "start:1"), timeout=30)
    child = pids(redis_server, "start:1")[0]
    os.kill(child, signal.SIGKILL)
    assert result.get(timeout=60) == 1
    settle(2 * VISIBILITY + LEASE)
    assert runs(redis_server) == ["start:1", "start:1", "end:1"]
    assert pids(redis_server, "start:1")[1] != child  # a new child, once the first was dead
    assert inspect_lock(result.deduplication_key, app=app) is None
    assert fragile.delay(1).deduplicated is False  # nothing left behind


def test_sigkill_of_the_whole_worker_runs_once_more_after_the_lease_lapsed(
    worker: Worker, redis_server: RedisServer
) -> None:
    """The restored copy waits for the dead run's lease, then runs once; the lock is freed."""
    worker.start()
    result = fragile.delay(2)
    wait_until(lambda: pids(redis_server, "start:2"), timeout=30)
    worker.kill()
    worker.start()
    assert result.get(timeout=90) == 2
    settle(2 * VISIBILITY + LEASE)
    assert runs(redis_server) == ["start:2", "start:2", "end:2"]
    assert inspect_lock(result.deduplication_key, app=app) is None


def test_a_message_deferred_by_its_concurrency_limit_runs_once_when_redelivered(
    worker: Worker, redis_server: RedisServer
) -> None:
    """Two calls, one slot: the second is deferred until the first ended, then runs 6 s
    while the broker delivers copies of it (each deferred by the limit, then refused)."""
    worker.start()
    results = [limited.delay(x) for x in (1, 2)]
    assert [result.get(timeout=60) for result in results] == [1, 2]
    settle(3 * VISIBILITY + LEASE)
    events = runs(redis_server)
    assert sorted(events) == sorted(f"limited_{e}:{x}" for e in ("start", "end") for x in (1, 2))
    assert "deferred" in worker.text()


def test_two_copies_of_a_message_deferred_with_its_delivery_token_run_once(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A message deferred because its start claim got no answer carries that claim's
    delivery token (here as an earlier version wrote it). Two copies of it, delivered at
    once to two free slots: one inherits the token's lease and runs, the other is refused."""
    result = coalesced.delay(2)
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue(QUEUE)
        message = queue.get(timeout=10)
        headers = {**message.headers, DELIVERY_FIELD: "token-of-a-claim-that-got-no-answer"}
        producer = connection.Producer()
        for _ in range(2):
            producer.publish(
                message.body,
                routing_key=QUEUE,
                headers=headers,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
            )
        message.ack()
        queue.close()
    worker.start()
    assert result.get(timeout=60) == 2
    settle(3 * VISIBILITY + LEASE)
    assert runs(redis_server) == ["coalesced_start:2", "coalesced_end:2"]
    assert inspect_lock(result.deduplication_key, app=app) is None
