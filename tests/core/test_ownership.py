"""Issue 10, exact lock ownership, with a real threads worker, real Redis and eager mode.

Every task body appends to a Redis list (``Runs``): the tests assert the
exact number of executions, then the lock state. Prefork cases (restart,
terminate, hard time limit, ``Reject``, ``self.replace()``, deterministic
replaces) are in ``test_ownership_prefork.py``; round trips in
``test_ownership_round_trips.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.einfo import ExceptionInfo
from celery import chord, group, states
from celery.exceptions import Ignore, TimeLimitExceeded
from celery.signals import task_received
from celery.utils.imports import symbol_by_name
from kombu import Producer
from kombu.exceptions import OperationalError

import celery_dedup
from celery_dedup import DedupTask, RevokeOutcome, dedup_key_for, inspect_lock, task_skipped
from celery_dedup import worker as dedup_worker
from celery_dedup.reaper import reap
from tests.fixtures._servers import free_port
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

pytestmark = pytest.mark.timeout(40)

#: the Redis database task bodies record their executions in
RUNS_DB = 22


def texts(values: Any) -> list[str]:
    """Redis replies as strings."""
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def state_of(app: Any, task_id: str) -> str:
    """The state the result backend holds for ``task_id``."""
    return str(app.AsyncResult(task_id).state)


class Runs:
    """Executions recorded by task bodies in a Redis list (shared by every process)."""

    def __init__(self, server: RedisServer, name: str) -> None:
        self.client = server.client(RUNS_DB)
        self.key = f"runs:{name}"
        self.client.delete(self.key)

    def record(self, label: Any) -> int:
        """Append one execution; return how many there are now."""
        return int(self.client.rpush(self.key, str(label)))

    def labels(self) -> list[str]:
        """Every execution so far, in order."""
        return texts(self.client.lrange(self.key, 0, -1))

    def count(self) -> int:
        """How many executions so far."""
        return int(self.client.llen(self.key))


@pytest.fixture
def runs(redis_server: RedisServer, request: pytest.FixtureRequest) -> Iterator[Runs]:
    """A fresh execution log for one test."""
    log = Runs(redis_server, request.node.name)
    yield log
    log.client.close()


@pytest.fixture
def skips() -> Iterator[list[tuple[str, str]]]:
    """``(task id, reason)`` of every ``task_skipped`` signal during the test."""
    seen: list[tuple[str, str]] = []

    def receiver(sender: Any = None, task_id: str = "", reason: str = "", **_: Any) -> None:
        seen.append((task_id, reason))

    task_skipped.connect(receiver, weak=False)
    yield seen
    task_skipped.disconnect(receiver)


def lock_of(result: Any, app: Any) -> celery_dedup.Lock | None:
    """The live lock at the key of a call."""
    return inspect_lock(result.deduplication_key, app=app)


def forged_header(key: str, token: str | None, until: str = "start") -> dict[str, Any]:
    """A ``celery_dedup`` header as a forger would write it for ``key``."""
    return {"v": 1, "key": key, "until": until, "for": 60, "replace": False, "tok": token}


def recording_job(app: Any, runs: Runs, **options: Any) -> Any:
    """``job(x)``: a dedup task (``unique_for=60``) recording ``x`` and returning it."""

    @app.task(base=DedupTask, shared=False, unique_for=60, **options)
    def job(x: int) -> int:
        runs.record(x)
        return x

    return job


def blocking_job(app: Any, runs: Runs) -> tuple[Any, threading.Event, threading.Event]:
    """``job(x)`` recording ``x``, then setting ``started`` and waiting for ``proceed``."""
    started, proceed = threading.Event(), threading.Event()

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def job(x: int) -> int:
        runs.record(x)
        started.set()
        proceed.wait(10)
        return x

    return job, started, proceed


def replacing_render(app: Any, runs: Runs) -> Any:
    """``render(doc, version)``: replaces the held call of the same ``doc``, records ``version``."""

    @app.task(
        base=DedupTask, shared=False, unique_for=30, on_duplicate="replace", unique_on=("doc",)
    )
    def render(doc: int, version: str) -> str:
        runs.record(version)
        return version

    return render


# -- item 1: deterministic ids -------------------------------------------------


def test_late_release_of_an_old_run_keeps_the_new_runs_lock(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """Run A outlives its 1 s TTL; run B (same deterministic id) takes the key; A frees nothing.

    Neither A's release nor the reaper (A's SUCCESS is stored under the
    shared id) may free B's lock while B waits or runs.
    """
    app = app_factory("own-late")
    a_running, finish_a, b_running, finish_b = (threading.Event() for _ in range(4))

    @app.task(
        base=DedupTask, shared=False, unique_for=1, unique_until="finish", deterministic_id=True
    )
    def job(x: int) -> int:
        n = runs.record("run")
        if n == 1:
            a_running.set()
            finish_a.wait(10)
        else:
            b_running.set()
            finish_b.wait(10)
        return n

    a = job.delay(1)
    worker_for(app, concurrency=1)
    assert a_running.wait(10)
    wait_until(lambda: lock_of(a, app) is None, timeout=5)  # A's TTL ran out
    b = job.delay(1)
    assert b.deduplicated is False and b.id == a.id
    b_lock = lock_of(b, app)
    assert b_lock is not None and not b_lock.started
    finish_a.set()
    assert b_running.wait(10)
    held = lock_of(b, app)
    assert held is not None and held.acquired_at == b_lock.acquired_at, "A's end freed B's lock"
    assert held.started
    assert reap(app) == [], "the reaper freed B's lock for A's SUCCESS under the shared id"
    assert job.delay(1).deduplicated is True
    finish_b.set()
    wait_until(lambda: lock_of(b, app) is None)
    assert runs.count() == 2


# -- item 3: the result is stored after the release ----------------------------------


def test_result_get_then_identical_call_is_never_suppressed(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """200 x (``result.get()`` returns, then the same call at once): every call publishes."""
    app = app_factory("own-get")

    job = recording_job(app, runs)

    worker_for(app, concurrency=2)
    suppressed = 0
    for _ in range(200):
        result = job.delay(7)
        suppressed += bool(result.deduplicated)
        assert result.get(timeout=10) == 7
    assert suppressed == 0
    assert runs.count() == 200


def test_failure_is_stored_after_the_finish_release(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """'finish' + final failure: once ``get()`` has raised, the identical call publishes (x 50)."""
    app = app_factory("own-get-failure")

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until="finish")
    def job(x: int) -> int:
        runs.record(x)
        raise ValueError("boom")

    worker_for(app, concurrency=2)
    suppressed = 0
    for _ in range(50):
        result = job.delay(7)
        suppressed += bool(result.deduplicated)
        with pytest.raises(ValueError):
            result.get(timeout=10)
    assert suppressed == 0
    assert runs.count() == 50


# -- item 4: Ignore follows the policy (Reject and replace: prefork module) -----------


@pytest.mark.parametrize(
    ("until", "released"),
    [("start", True), ("success", True), ("finish", True), ("expiry", False)],
)
def test_ignore_releases_per_policy(
    app_factory: AppFactory, worker_for: Any, runs: Runs, until: str, released: bool
) -> None:
    """``raise Ignore()`` ends the run like a success: released unless ``expiry``."""
    app = app_factory(f"own-ignore-{until}")

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until=until)
    def job(x: int) -> None:
        runs.record(x)
        raise Ignore()

    result = job.delay(1)
    worker_for(app)
    wait_until(lambda: runs.count() == 1)
    if released:
        wait_until(lambda: lock_of(result, app) is None, timeout=5)
        assert job.delay(1).deduplicated is False
        wait_until(lambda: runs.count() == 2)
    else:
        time.sleep(0.5)
        lock = lock_of(result, app)
        assert lock is not None and lock.task_id == result.id
        assert job.delay(1).deduplicated is True
        assert runs.count() == 1


# -- item 5: revoke ------------------------------------------------------------


def test_revoke_of_a_running_task_keeps_its_lock_until_it_ends(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """``revoke()`` without terminate on a running task: RUNNING; duplicates stay suppressed."""
    app = app_factory("own-revoke-running")
    job, started, proceed = blocking_job(app, runs)

    result = job.delay(1)
    worker_for(app)
    assert started.wait(10)
    assert celery_dedup.revoke(result) is RevokeOutcome.RUNNING
    for _ in range(3):
        duplicate = job.delay(1)
        assert duplicate.deduplicated is True and duplicate.id == result.id
    lock = lock_of(result, app)
    assert lock is not None and lock.task_id == result.id and lock.started
    proceed.set()
    wait_until(lambda: lock_of(result, app) is None)
    assert runs.count() == 1
    fresh = job.delay(1)
    assert fresh.deduplicated is False
    assert fresh.get(timeout=10) == 1
    assert runs.count() == 2


def test_revoke_of_a_task_waiting_for_its_retry_releases_at_once(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """A run waiting for its retry's countdown can no longer run once revoked: freed at once."""
    app = app_factory("own-revoke-retry")
    retried = threading.Event()

    @app.task(base=DedupTask, shared=False, bind=True, unique_for=60, max_retries=1)
    def job(self: Any, x: int) -> int:
        runs.record(x)
        if self.request.retries == 0:
            retried.set()
            raise self.retry(countdown=30)
        return x

    result = job.delay(1)
    worker_for(app)
    assert retried.wait(10)
    time.sleep(0.5)
    outcome = celery_dedup.revoke(result)
    assert outcome is RevokeOutcome.RELEASED, f"{outcome}: nothing runs, the lock waits 30 s"
    assert lock_of(result, app) is None
    assert runs.count() == 1


def test_revoke_of_an_ended_run_that_kept_its_lock(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """'success' keeps the lock after a final failure; revoking that ended run is not RUNNING."""
    app = app_factory("own-revoke-ended")

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def job(x: int) -> int:
        runs.record(x)
        raise ValueError("boom")

    result = job.delay(1)
    worker_for(app)
    with pytest.raises(ValueError):
        result.get(timeout=10)
    assert lock_of(result, app) is not None  # the policy keeps it
    outcome = celery_dedup.revoke(result)
    assert outcome is not RevokeOutcome.RUNNING, "nothing runs any more"
    assert outcome is RevokeOutcome.RELEASED and lock_of(result, app) is None


def test_revoked_queued_message_never_runs_without_any_broadcast(
    app_factory: AppFactory, worker_for: Any, runs: Runs, skips: list[tuple[str, str]]
) -> None:
    """Revoked while no worker listens (broadcast lost): the first worker to get it skips it."""
    app = app_factory("own-revoke-queued")

    job = recording_job(app, runs)

    result = job.delay(1)
    assert celery_dedup.revoke(result) is RevokeOutcome.RELEASED
    assert lock_of(result, app) is None
    worker_for(app)
    wait_until(lambda: (result.id, "revoked") in skips)
    # The skip signal fires before the backend holds REVOKED: wait for the state.
    wait_until(lambda: state_of(app, result.id) == states.REVOKED)
    assert runs.count() == 0
    assert lock_of(result, app) is None


def test_deterministic_revoke_does_not_poison_later_runs(
    app_factory: AppFactory, worker_for: Any, runs: Runs, skips: list[tuple[str, str]]
) -> None:
    """Revoke one run of a deterministic id; the next runs of that key run (once each)."""
    app = app_factory("own-det-revoke")

    job = recording_job(app, runs, deterministic_id=True)

    revoked = job.delay(1)
    assert celery_dedup.revoke(revoked) is RevokeOutcome.RELEASED
    later = job.delay(1)
    assert later.deduplicated is False and later.id == revoked.id
    worker_for(app)
    wait_until(lambda: runs.count() == 1)
    wait_until(lambda: (revoked.id, "revoked") in skips)
    wait_until(lambda: lock_of(later, app) is None)
    third = job.delay(1)
    assert third.deduplicated is False and third.id == revoked.id
    wait_until(lambda: runs.count() == 2)
    time.sleep(0.3)
    assert runs.count() == 2


def test_deterministic_revoke_does_not_fail_the_later_runs_result(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """The later run's ``get()`` returns its value, not the revoked run's REVOKED.

    The skipped message shares the id, and ``_skip`` stores REVOKED under it.
    """
    app = app_factory("own-det-revoke-get")

    job = recording_job(app, runs, deterministic_id=True)

    revoked = job.delay(1)
    assert celery_dedup.revoke(revoked) is RevokeOutcome.RELEASED
    later = job.delay(1)
    worker_for(app)
    assert later.get(timeout=10) == 1
    assert runs.count() == 1


@pytest.mark.parametrize("operation", ["revoke", "release"])
def test_old_runs_handle_cannot_touch_a_later_run(
    app_factory: AppFactory, worker_for: Any, runs: Runs, operation: str
) -> None:
    """``revoke``/``release`` of an ended run's result must leave the next run (same id) alone."""
    app = app_factory(f"own-old-handle-{operation}")

    job = recording_job(app, runs, deterministic_id=True)

    worker_for(app)
    first = job.delay(1)
    assert first.get(timeout=10) == 1
    wait_until(lambda: lock_of(first, app) is None)
    second = job.apply_async((1,), countdown=1.5)
    assert second.deduplicated is False and second.id == first.id
    if operation == "revoke":
        assert celery_dedup.revoke(first) is RevokeOutcome.NOT_HELD
    else:
        assert celery_dedup.release(first) is False
    assert lock_of(second, app) is not None
    wait_until(lambda: runs.count() == 2, timeout=10)


# -- item 8: replace with a missed revoke broadcast --------------------------------


def test_replace_with_a_missed_broadcast_runs_only_the_replacement(
    app_factory: AppFactory, worker_for: Any, runs: Runs, skips: list[tuple[str, str]]
) -> None:
    """The replacing call runs and releases first; the replaced message then never runs."""
    app = app_factory("own-replace-missed")

    render = replacing_render(app, runs)

    old = render.apply_async((1, "v1"), countdown=1.5)
    new = render.delay(1, "v2")  # the revoke broadcast reaches no worker
    assert new.deduplicated is False
    worker_for(app)
    assert new.get(timeout=10) == "v2"
    wait_until(lambda: lock_of(new, app) is None)
    wait_until(lambda: (old.id, "revoked") in skips, timeout=10)
    wait_until(lambda: state_of(app, old.id) == states.REVOKED)  # stored after the signal
    assert runs.labels() == ["v2"]


# -- item 2: a replace whose publish fails --------------------------------------------


class FailingProducer(Producer):
    """A producer whose publish fails (after ``delay`` seconds), like a broker going away."""

    delay = 0.0

    def publish(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay)
        raise OperationalError("broker unavailable")


@pytest.mark.parametrize("failure", ["producer", "closed_port"])
def test_failed_replace_gives_the_key_back(
    app_factory: AppFactory, worker_for: Any, runs: Runs, failure: str
) -> None:
    """The replacing publish fails: the previous holder keeps the key and runs exactly once."""
    app = app_factory(f"own-replace-fail-{failure}")

    render = replacing_render(app, runs)

    old = render.delay(1, "v1")
    with app.connection_for_write() as connection:
        if failure == "producer":
            options: dict[str, Any] = {"producer": FailingProducer(connection)}
        else:
            closed = app.connection_for_write(f"redis://127.0.0.1:{free_port()}/0")
            options = {"connection": closed, "retry": False}
        with pytest.raises(OperationalError):
            render.apply_async((1, "v2"), **options)
    lock = lock_of(old, app)
    assert lock is not None and lock.task_id == old.id
    later = render.apply_async((1, "v3"), on_duplicate="existing")
    assert later.deduplicated is True and later.id == old.id
    worker_for(app)
    assert old.get(timeout=10) == "v1"
    wait_until(lambda: lock_of(old, app) is None)
    assert runs.labels() == ["v1"]


def test_slowly_failing_replace_does_not_lose_the_previous_holder(
    app_factory: AppFactory, worker_for: Any, runs: Runs, skips: list[tuple[str, str]]
) -> None:
    """The previous holder reaches its start while the replacing publish is still failing.

    It must still run exactly once (or the replace must not have refused it).
    """
    app = app_factory("own-replace-slow-fail")

    render = replacing_render(app, runs)

    worker_for(app)
    old = render.apply_async((1, "v1"), countdown=0.5)
    with app.connection_for_write() as connection:
        producer = FailingProducer(connection)
        producer.delay = 2.0  # e.g. connection retries against a broker that went away
        with pytest.raises(OperationalError):
            render.apply_async((1, "v2"), producer=producer)
    # (A deferral is not an end: the message comes back. Waits are generous on a loaded machine.)
    ended = lambda: any(t == old.id and not r.startswith("deferred") for t, r in skips)  # noqa: E731
    wait_until(lambda: runs.count() or ended(), timeout=20)
    assert (old.id, "revoked") not in skips, "the failed replace's marker refused the old holder"
    assert runs.labels() == ["v1"]


# -- item 9: forged headers and ids --------------------------------------------------


@pytest.mark.parametrize("token", ["guessed", "holder-id", None, "guard:holder-id"])
def test_forged_header_cannot_release_or_skip_the_holder(
    app_factory: AppFactory,
    worker_for: Any,
    runs: Runs,
    skips: list[tuple[str, str]],
    token: str | None,
) -> None:
    """``send_task`` with the holder's id and a forged header: skipped, the holder's lock intact."""
    app = app_factory("own-forged")
    job, started, proceed = blocking_job(app, runs)

    holder = job.delay(1)
    worker_for(app, concurrency=2)
    assert started.wait(10)
    seen_id = job.delay(1).id  # all a duplicate caller learns
    guess = (token or "").replace("holder-id", seen_id) or None
    before = lock_of(holder, app)
    assert before is not None
    app.send_task(
        job.name,
        (1,),
        task_id=seen_id,
        headers={"celery_dedup": forged_header(holder.deduplication_key, guess)},
    )
    wait_until(lambda: any(task_id == seen_id for task_id, _ in skips), timeout=10)
    after = lock_of(holder, app)
    assert after is not None and after.owner == before.owner
    assert job.delay(1).deduplicated is True
    proceed.set()
    assert holder.get(timeout=10) == 1
    assert runs.count() == 1


@pytest.mark.parametrize("forgery", ["guard-token-header", "guessed-guard-token"])
def test_forged_message_cannot_take_a_guarded_holders_lock(
    app_factory: AppFactory, worker_for: Any, runs: Runs, forgery: str
) -> None:
    """The holder is a ``send_task`` message (worker-taken guard lock); its id is all one sees.

    A message forging a header with a guard token must neither run beside
    the holder nor free its lock: the guard token is an HMAC of the task id
    under the store's secret, not guessable from the id. (A header-less
    copy replayed under the holder's id cannot be told from a broker
    redelivery, which must keep its lock: docs/guarantees.md states it.)
    """
    app = app_factory(f"own-forged-guard-{forgery}")
    job, started, proceed = blocking_job(app, runs)

    worker_for(app, concurrency=2)
    holder = app.send_task(job.name, (1,))
    assert started.wait(10)
    seen = job.delay(1)
    assert seen.deduplicated is True
    token = "guard:" + (seen.id if forgery == "guard-token-header" else "0" * 32)
    headers = {"celery_dedup": forged_header(seen.deduplication_key, token)}
    app.send_task(job.name, (1,), task_id=seen.id, headers=headers)
    time.sleep(1.0)
    lock = inspect_lock(seen.deduplication_key, app=app)
    assert lock is not None and lock.task_id == holder.id, "the forged message freed the lock"
    assert job.delay(1).deduplicated is True
    proceed.set()
    assert holder.get(timeout=10) == 1
    time.sleep(0.5)
    assert runs.count() == 1, "the forged copy ran beside the holder"


def test_reaper_ignores_a_result_forged_under_the_holders_id(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """Another message finishing under the holder's id must not let the reaper free the lock."""
    app = app_factory("own-forged-reap")

    job = recording_job(app, runs)

    @app.task(shared=False)
    def noop() -> None:
        return None

    worker_for(app)
    holder = job.apply_async((1,), countdown=3)
    seen_id = job.delay(1).id
    app.send_task(noop.name, task_id=seen_id).get(timeout=10)
    assert reap(app) == [], "reaped for a SUCCESS another message stored under the holder's id"
    assert job.delay(1).deduplicated is True
    wait_until(lambda: runs.count() == 1, timeout=10)
    wait_until(lambda: lock_of(holder, app) is None)
    assert runs.count() == 1


# -- item 6 and the canvas rule: eager and local calls --------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 2, 3), {}), ((), {"nope": 1}), ((object(),), {})],
    ids=["arity", "unknown-kwarg", "unserialisable"],
)
def test_eager_call_failing_before_the_body_releases(
    app_factory: AppFactory, runs: Runs, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """An eager call that raises before its body ran leaves no lock."""
    app = app_factory("own-eager-fail", task_always_eager=True)

    job = recording_job(app, runs)

    key = dedup_key_for(job, deduplication_key="k")
    assert key is not None
    with pytest.raises(Exception):
        job.apply_async(args, kwargs, deduplication_key="k")
    assert inspect_lock(key, app=app) is None
    assert runs.count() == 0
    assert job.apply_async((1,), deduplication_key="k").get() == 1


def test_eager_group_and_chord_members_are_not_guarded(app_factory: AppFactory, runs: Runs) -> None:
    """An eager group of two identical calls runs both; an eager chord body gets both results."""
    app = app_factory("own-eager-canvas", task_always_eager=True)

    job = recording_job(app, runs)

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def total(values: list[int]) -> int:
        return sum(values)

    assert group(job.s(1), job.s(1)).apply_async().get() == [1, 1]
    assert runs.count() == 2
    assert chord([job.s(2), job.s(2)])(total.s()).get() == 4
    assert runs.count() == 4
    assert inspect_lock(dedup_key_for(job, (1,)) or "", app=app) is None


def test_apply_runs_while_a_copy_is_queued(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """``task.apply()`` is local: it runs, and leaves the queued copy's lock alone."""
    app = app_factory("own-apply")

    job = recording_job(app, runs)

    queued = job.delay(5)
    before = lock_of(queued, app)
    assert job.apply((5,)).get() == 5
    assert runs.count() == 1
    after = lock_of(queued, app)
    assert before is not None and after is not None and after.owner == before.owner
    worker_for(app)
    assert queued.get(timeout=10) == 5
    assert runs.count() == 2
    wait_until(lambda: lock_of(queued, app) is None)


#: Celery's own request class, as a task of an application may name it
CELERY_REQUEST = "celery.worker.request:Request"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("request_class", [None, CELERY_REQUEST])
def test_send_task_while_held_is_skipped_visibly(
    app_factory: AppFactory,
    worker_for: Any,
    runs: Runs,
    skips: list[tuple[str, str]],
    request_class: str | None,
) -> None:
    """A header-less copy of a held call is skipped: state IGNORED, signal, lock untouched.

    Also for a task with a ``Request`` class of its own (not ``DedupRequest``).
    """
    app = app_factory("own-send-task")

    job = recording_job(app, runs, **({"Request": request_class} if request_class else {}))

    holder = job.apply_async((1,), countdown=1.5)
    before = lock_of(holder, app)
    raw = app.send_task(job.name, (1,))
    skipped = threading.Event()
    at_skip: list[celery_dedup.Lock | None] = []

    def on_skip(sender: Any = None, task_id: str = "", **_: Any) -> None:
        if task_id == raw.id:
            at_skip.append(lock_of(holder, app))  # before the holder can run and release
            skipped.set()

    # Waits on what the worker does, not on a clock: a loaded machine only
    # makes them take longer (the timeouts are there to end a hung test).
    task_skipped.connect(on_skip, weak=False)
    try:
        worker_for(app)
        assert skipped.wait(60), "the worker never skipped the header-less copy"
    finally:
        task_skipped.disconnect(on_skip)
    assert (raw.id, "unannounced duplicate") in skips
    wait_until(lambda: state_of(app, raw.id) == states.IGNORED, timeout=60)
    after = at_skip[0]
    assert before is not None and after is not None and after.owner == before.owner
    assert holder.get(timeout=60) == 1
    assert runs.count() == 1
    wait_until(lambda: lock_of(holder, app) is None, timeout=60)


# -- hard time limits in the worker's main process --------------------------------


def received_request(app: Any, task: Any) -> Any:
    """The next message of ``app``'s default queue as the worker's ``task.Request`` receives it."""
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue, no_ack=True)
        message = queue.get(timeout=5)
        queue.close()
    request = symbol_by_name(task.Request)(message, app=app, task=task)
    task_received.send(sender=None, request=request)
    return request


@pytest.mark.parametrize("request_class", [None, CELERY_REQUEST])
def test_hard_time_limit_releases_in_the_main_process(
    app_factory: AppFactory, runs: Runs, monkeypatch: pytest.MonkeyPatch, request_class: str | None
) -> None:
    """A hard time limit: the main process releases a 'finish' lock (the child is gone).

    With ``DedupRequest`` (the default) the lock is gone before the failure
    is stored, as after any other ending; a ``Request`` class of the task's
    own releases it from ``on_failure``, just after.
    """
    app = app_factory("own-hard-limit")
    options = {"Request": request_class} if request_class else {}
    job = recording_job(app, runs, unique_until="finish", **options)
    dedup_worker.prepare_strategy(job)  # what the worker does as it starts consuming
    result = job.delay(1)
    request = received_request(app, job)
    at_store: list[Any] = []
    store_failure = app.backend.mark_as_failure

    def mark_as_failure(task_id: str, exc: Any, *args: Any, **kwargs: Any) -> Any:
        at_store.append(lock_of(result, app))
        return store_failure(task_id, exc, *args, **kwargs)

    monkeypatch.setattr(app.backend, "mark_as_failure", mark_as_failure)
    assert lock_of(result, app) is not None
    # What the prefork pool does: fail the job, then call the timeout callback.
    try:
        raise TimeLimitExceeded(1.0)
    except TimeLimitExceeded:
        request.on_failure(ExceptionInfo())
    request.on_timeout(False, 1.0)
    assert state_of(app, result.id) == states.FAILURE
    assert lock_of(result, app) is None
    assert len(at_store) == 2
    if request_class is None:
        assert at_store == [None, None]
    assert runs.count() == 0


def test_only_a_request_class_of_its_own_costs_a_receiver(
    app_factory: AppFactory, runs: Runs
) -> None:
    """A ``DedupTask`` adds no ``task_received`` receiver (it runs for any message)."""
    task_received.disconnect(dispatch_uid="celery_dedup.received")
    dedup_worker.prepare_strategy(recording_job(app_factory("own-receiver"), runs))
    assert not task_received.has_listeners()
    own = recording_job(app_factory("own-receiver-class"), runs, Request=CELERY_REQUEST)
    dedup_worker.prepare_strategy(own)
    assert task_received.has_listeners()
