"""``on_duplicate="cancel_running"`` with a real prefork worker subprocess (issue 24, item 2).

The running holder is terminated with the soft time limit's signal, so its
body sees ``SoftTimeLimitExceeded`` and records it; the new call is
published only once the worker freed the key, and runs once. Task bodies
append to a Redis list shared by every process; the tests assert exact
counts and the lock's owner. Locks live in the result backend's Redis or
in PostgreSQL (``dedup_store``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from celery import states
from celery.signals import task_postrun
from kombu.exceptions import OperationalError

from celery_dedup import CancelOwnRunError, CancelTimeout, DedupTask, inspect_lock
from celery_dedup.results import owner_of
from celery_dedup.signals import holder_cancelled
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until
from .subprocess_workers import RunsLog, env_app, worker_fixture
from .test_ownership import FailingProducer, state_of, texts
from .test_ownership_prefork import Worker

pytestmark = pytest.mark.timeout(240)

QUEUE = "cancel-running"
BROKER_DB, BACKEND_DB, RUNS_DB = 43, 44, 45

app = env_app("cancel_running", "CANCEL", QUEUE)
runs_log = RunsLog("CANCEL")


def _redis() -> redis.Redis:
    return runs_log.client()


def record(event: str) -> None:
    """Append ``event`` to the shared log."""
    _redis().rpush("runs", event)


def _sync(doc: int, version: str) -> str:
    """``old`` runs until cancelled; ``new`` waits for the test's go; others just record."""
    record(f"start:{version}")
    if version == "old":
        try:
            time.sleep(60)
        except SoftTimeLimitExceeded:
            record("interrupted:old")
            return "interrupted"  # an ordinary end: its (owner-checked) release runs
    elif version == "self":
        try:
            sync.apply_async((doc, "inner"), cancel_wait=30)
        except CancelOwnRunError as exc:
            record(f"refused:{type(exc).__name__}")
    elif version == "new":
        deadline = time.monotonic() + 60
        while not _redis().get("go") and time.monotonic() < deadline:
            time.sleep(0.05)
    record(f"end:{version}")
    return version


_OPTIONS: dict[str, Any] = {
    "base": DedupTask,
    "unique_for": 120,
    "on_duplicate": "cancel_running",
    "unique_on": ("doc",),
    "cancel_wait": 60,
}
sync = app.task(name="cancel.sync", **_OPTIONS)(_sync)
#: the same under a deterministic id: old and new runs share their task id
det_sync = app.task(name="cancel.det_sync", deterministic_id=True, **_OPTIONS)(_sync)


@task_postrun.connect
def _ended(sender: Any = None, args: Any = None, **_: Any) -> None:
    """Recorded after the run's own release attempt (``DedupTask.__call__`` returned)."""
    if getattr(sender, "name", None) in (sync.name, det_sync.name) and args:
        record(f"postrun:{args[1]}")


worker = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    doc="A two-slot prefork worker (started by the test); locks in Redis or PostgreSQL.",
)


def runs(redis_server: RedisServer) -> list[str]:
    """Every event recorded so far, in order."""
    with redis_server.client(RUNS_DB) as client:
        return texts(client.lrange("runs", 0, -1))


@pytest.mark.parametrize("deterministic", [False, True], ids=["uuid", "deterministic-id"])
def test_running_holder_is_interrupted_and_the_new_call_runs_once(
    worker: Worker, redis_server: RedisServer, deterministic: bool
) -> None:
    """The old body gets SoftTimeLimitExceeded; the new call runs once; the old run's end
    never releases the new holder's lock."""
    task = det_sync if deterministic else sync
    worker.start()
    cancelled: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        cancelled.append(kwargs)

    holder_cancelled.connect(receiver)
    try:
        old = task.delay(1, "old")
        wait_until(lambda: "start:old" in runs(redis_server), timeout=30)
        new = task.delay(1, "new")  # returns once the worker freed the key
    finally:
        holder_cancelled.disconnect(receiver)
    assert new.deduplicated is False and (new.id == old.id) is deterministic
    assert [(c["cancelled_task_id"], c["running"], c["terminate_signal"]) for c in cancelled] == [
        (old.id, True, "SIGUSR1")
    ]
    wait_until(lambda: "postrun:old" in runs(redis_server), timeout=30)
    wait_until(lambda: "start:new" in runs(redis_server), timeout=30)
    held = inspect_lock(new.deduplication_key, app=app)
    assert held is not None and held.owner == owner_of(new), "the old run freed the new lock"
    assert held.task_id == new.id
    if not deterministic:  # (a shared id's state is the newest run's)
        # REVOKED as announced, or the value its body returned after the interrupt.
        assert state_of(app, old.id) in (states.REVOKED, states.SUCCESS)
    with redis_server.client(RUNS_DB) as client:
        client.set("go", "1")
    if deterministic:
        # The shared id may keep the cancelled run's outcome (Celery never
        # overwrites a stored SUCCESS): judged from the runs recorded.
        wait_until(lambda: "postrun:new" in runs(redis_server), timeout=30)
    else:
        assert new.get(timeout=30) == "new"
    wait_until(lambda: inspect_lock(new.deduplication_key, app=app) is None, timeout=10)
    events = runs(redis_server)
    assert events.count("start:old") == 1 and events.count("interrupted:old") == 1
    assert "end:old" not in events
    assert events.count("start:new") == 1 and events.count("end:new") == 1
    # The old run was interrupted before the new one started.
    assert events.index("interrupted:old") < events.index("start:new")


def test_queued_holder_is_revoked_and_never_runs(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A holder still in the queue is revoked (its lock freed at once); it never runs."""
    queued = sync.delay(2, "queued")
    latest = sync.delay(2, "latest")
    assert latest.deduplicated is False and latest.id != queued.id
    held = inspect_lock(latest.deduplication_key, app=app)
    assert held is not None and held.owner == owner_of(latest)
    worker.start()
    assert latest.get(timeout=30) == "latest"
    wait_until(lambda: state_of(app, queued.id) == states.REVOKED, timeout=30)
    wait_until(lambda: inspect_lock(latest.deduplication_key, app=app) is None, timeout=10)
    time.sleep(1)  # a late copy of the revoked message would have run by now
    events = [e for e in runs(redis_server) if not e.startswith("postrun:")]
    assert events == ["start:latest", "end:latest"]


@pytest.mark.parametrize("policy", ["cancel_running", "replace"])
def test_a_queued_holder_under_the_deterministic_id_is_not_revoked_by_id(
    worker: Worker, redis_server: RedisServer, policy: str
) -> None:
    """A call under an id of its own supersedes a queued holder that has the key's
    deterministic id: no revoke by id is broadcast (workers remember a revoked id for
    hours), so the next call published under that id runs, once."""
    worker.start()
    queued = det_sync.apply_async((6, "queued"), countdown=60)  # in the worker, not started
    latest = det_sync.apply_async((6, "latest"), deterministic_id=False, on_duplicate=policy)
    assert latest.deduplicated is False and latest.id != queued.id
    assert latest.get(timeout=30) == "latest"
    wait_until(lambda: inspect_lock(latest.deduplication_key, app=app) is None, timeout=10)
    again = det_sync.delay(6, "again")
    assert again.deduplicated is False and again.id == queued.id
    assert again.get(timeout=30) == "again"
    events = [e for e in runs(redis_server) if not e.startswith("postrun:")]
    assert events == ["start:latest", "end:latest", "start:again", "end:again"]


def test_failed_publish_gives_the_key_back_to_the_queued_holder(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A cancelling call whose publish fails leaves the queued holder holding and runnable
    (unrevoked), as a failed replace does; it then runs once and the call holds nothing."""
    queued = sync.delay(3, "queued")
    with app.connection_for_write() as connection, pytest.raises(OperationalError):
        # The broker fails the publish after the take-over.
        sync.apply_async((3, "failed"), producer=FailingProducer(connection))
    held = inspect_lock(queued.deduplication_key, app=app)
    assert held is not None and held.owner == owner_of(queued)
    assert held.task_id == queued.id and not held.started
    worker.start()
    assert queued.get(timeout=30) == "queued"
    wait_until(lambda: inspect_lock(queued.deduplication_key, app=app) is None, timeout=10)
    events = [e for e in runs(redis_server) if not e.startswith("postrun:")]
    assert events == ["start:queued", "end:queued"]


def test_a_run_cancelling_its_own_key_is_refused(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A body calling its own key with cancel_running would wait for itself: it gets
    ``CancelOwnRunError`` at once, nothing is revoked or published, and it ends normally."""
    cancelled: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        cancelled.append(kwargs)

    worker.start()
    holder_cancelled.connect(receiver)
    try:
        outer = sync.delay(4, "self")
        assert outer.get(timeout=60) == "self"
    finally:
        holder_cancelled.disconnect(receiver)
    wait_until(lambda: inspect_lock(outer.deduplication_key, app=app) is None, timeout=10)
    assert state_of(app, outer.id) == states.SUCCESS
    events = [e for e in runs(redis_server) if not e.startswith("postrun:")]
    assert events == ["start:self", "refused:CancelOwnRunError", "end:self"]
    assert cancelled == []


def test_timeout_without_termination_publishes_nothing(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """A thread pool cannot terminate a running body: after ``cancel_wait`` the call raises
    ``CancelTimeout``, publishes nothing and takes no lock; the old run ends once."""
    local = app_factory("cancel-threads")
    ran: list[str] = []
    release = __import__("threading").Event()

    @local.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="cancel_running",
                unique_on=("doc",))
    def job(doc: int, version: str) -> str:
        ran.append(f"start:{version}")
        release.wait(30)
        ran.append(f"end:{version}")
        return version

    worker_for(local)
    old = job.delay(1, "old")
    wait_until(lambda: "start:old" in ran, timeout=30)
    with pytest.raises(CancelTimeout) as raised:
        job.apply_async((1, "new"), cancel_wait=0.5)
    assert raised.value.existing_task_id == old.id
    assert old.id not in str(raised.value)
    held = inspect_lock(old.deduplication_key, app=local)
    assert held is not None and held.task_id == old.id
    release.set()
    assert old.get(timeout=30) == "old"
    time.sleep(0.5)
    assert ran == ["start:old", "end:old"]
