"""``cancel_running`` on a gevent worker (issue 30, item 9).

The gevent pool terminates one task by killing its greenlet with
``GreenletExit`` (a ``BaseException``): the body's ``finally`` runs, its
``except Exception`` does not. The killed run must end as terminated: its
lock freed per policy, its copies never run again, the new call published
and run once. A real ``celery worker -P gevent`` subprocess; bodies append
to a Redis list.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import states
from celery.signals import before_task_publish

from celery_dedup import DedupTask, inspect_lock
from celery_dedup.header import HEADER
from tests.fixtures.redis import RedisServer

from .conftest import wait_until
from .subprocess_workers import RunsLog, env_app, worker_fixture
from .test_ownership import state_of, texts
from .test_ownership_prefork import Worker

pytestmark = pytest.mark.timeout(180)

QUEUE = "cancel-gevent"
BROKER_DB, BACKEND_DB, RUNS_DB = 46, 47, 48

#: a short lease: a copy deferred while the holder runs comes back within a second
app = env_app("cancel_gevent", "GEVENT", QUEUE, dedup_lease_ttl=3)
runs_log = RunsLog("GEVENT")


def record(event: str) -> None:
    runs_log.client().rpush("runs", event)


_OPTIONS = {
    "base": DedupTask,
    "unique_for": 120,
    "on_duplicate": "cancel_running",
    "unique_on": ("doc",),
    "cancel_wait": 60,
}


def _edit(version: str) -> str:
    """``old`` runs until it is killed; every other version returns at once."""
    record(f"start:{version}")
    try:
        if version == "old":
            time.sleep(60)  # gevent's patched sleep: the greenlet can be killed here
    except Exception:  # GreenletExit is not an Exception: never recorded
        record(f"except:{version}")
    finally:
        record(f"finally:{version}")
    record(f"end:{version}")
    return version


@app.task(**_OPTIONS)
def edit(doc: int, version: str) -> str:
    return _edit(version)


worker = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    started=True,
    concurrency=4,
    pool="gevent",
    doc="A ``-P gevent`` worker (started); locks in the backend's Redis or in PostgreSQL.",
)


def runs(redis_server: RedisServer) -> list[str]:
    with redis_server.client(RUNS_DB) as client:
        return texts(client.lrange("runs", 0, -1))


def test_cancel_running_kills_the_holder_greenlet_and_runs_the_new_call_once(
    worker: Worker, redis_server: RedisServer
) -> None:
    old = edit.delay(1, "old")
    wait_until(lambda: "start:old" in runs(redis_server), timeout=60)
    new = edit.delay(1, "new")  # terminates the running holder, waits for the key, publishes
    assert new.deduplicated is False
    assert new.get(timeout=60) == "new"
    wait_until(lambda: "end:new" in runs(redis_server), timeout=30)
    assert runs(redis_server) == [
        "start:old", "finally:old", "start:new", "finally:new", "end:new",
    ]
    assert state_of(app, old.id) == states.REVOKED
    assert inspect_lock(new.deduplication_key, app=app) is None  # released on success
    # The killed run ended as terminated: nothing of it is left to run again.
    again = edit.delay(1, "again")
    assert again.get(timeout=60) == "again"
    assert runs(redis_server).count("start:old") == 1


def test_a_copy_of_the_killed_run_never_runs_after_the_new_call_ended(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A copy of the killed holder's message (as a broker redelivers it) never runs."""
    published: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        published.append(dict(headers or {}))

    before_task_publish.connect(capture, weak=False)
    try:
        old = edit.delay(1, "old")
    finally:
        before_task_publish.disconnect(capture)
    wait_until(lambda: "start:old" in runs(redis_server), timeout=60)
    # The same message again (same id, same header): put back while the holder runs.
    (headers,) = published
    app.send_task(edit.name, args=[1, "old"], task_id=old.id, headers={HEADER: headers[HEADER]})
    wait_until(lambda: "deferred" in worker.text(), timeout=60)
    new = edit.delay(1, "new")
    assert new.get(timeout=60) == "new"
    # The copy comes back once the key is free, and is acknowledged without running;
    # unless the cancel's terminate, aimed at the task id the copy shares, killed its
    # greenlet while it was republishing itself (then there is no copy left to run).
    deadline = time.monotonic() + 15
    while "already ran" not in worker.text() and time.monotonic() < deadline:
        time.sleep(0.1)
    if "already ran" not in worker.text():
        assert f"edit[{old.id}] ignored" not in worker.text(), worker.text()
    assert runs(redis_server).count("start:old") == 1
    assert state_of(app, old.id) == states.REVOKED
