"""``on_duplicate="keep_last"``: one run in progress per key, plus one follow-up (issue 24).

A real ``celery worker -P prefork`` subprocess with two free slots consumes
from a Redis broker that restores unacknowledged messages after 2 s; locks
and run gates live in the result backend's Redis or in PostgreSQL. Task
bodies append their start and end to a Redis list: its order shows that no
two runs of the key overlapped, and its entries the arguments each run had.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import redis
from celery import states
from celery.signals import task_postrun, task_prerun

from celery_dedup import DedupTask, inspect_lock
from tests.fixtures.redis import RedisServer

from .conftest import wait_until
from .subprocess_workers import RunsLog, env_app, worker_fixture
from .test_ownership import texts
from .test_ownership_prefork import Worker

pytestmark = pytest.mark.timeout(300)

QUEUE = "keep-last"
BROKER_DB, BACKEND_DB, RUNS_DB = 60, 61, 62
VISIBILITY = 2
LEASE = 3

app = env_app(
    "keep_last",
    "LAST",
    QUEUE,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    dedup_lease_ttl=LEASE,
)
runs_log = RunsLog("LAST")


def _redis() -> redis.Redis:
    return runs_log.client()


def record(event: str) -> None:
    """Append ``event`` (with this process's pid) to the shared log."""
    _redis().rpush("runs", f"{event}:{os.getpid()}")


def hold_until_released(x: int) -> None:
    """The first run (``x == 0``) waits until the test lets it end."""
    deadline = time.monotonic() + 120
    while x == 0 and not _redis().get("go") and time.monotonic() < deadline:
        time.sleep(0.05)


def account_sync(name: str, account: str, unique_for: float) -> Any:
    """A ``keep_last`` task re-syncing ``account`` with the state ``x`` (every call
    carries the newest)."""

    @app.task(
        base=DedupTask,
        name=name,
        unique_for=unique_for,
        on_duplicate="keep_last",
        deduplication_key=lambda x: account,
    )
    def resync(x: int) -> int:
        record(f"start:{x}")
        hold_until_released(x)
        record(f"end:{x}")
        return x

    return resync


sync = account_sync("last.sync", "account-7", 120)
#: a window shorter than a done marker's default life here
brief = account_sync("last.brief", "account-9", 0.5)


@app.task(
    base=DedupTask,
    name="last.fragile",
    unique_for=120,
    on_duplicate="keep_last",
    deduplication_key=lambda x: "account-8",
    acks_late=True,
    reject_on_worker_lost=True,
)
def fragile(x: int) -> int:
    """Like ``sync``; a follow-up runs 6 s, long enough to be killed mid-run."""
    record(f"start:{x}")
    hold_until_released(x)
    if x:
        time.sleep(6)
    record(f"end:{x}")
    return x


@task_postrun.connect
def linger_after_a_deferral(state: str = "", args: object = (), **_: object) -> None:
    """With ``linger`` set, a deferred ``sync(1)`` stays active in its worker for 3 s
    after publishing its copy: the copy arrives while the original is still active."""
    if state == states.IGNORED and list(args or ()) == [1] and _redis().get("linger"):
        time.sleep(3)


@task_prerun.connect
def start_a_parked_copy_late(task: object = None, args: object = (), **_: object) -> None:
    """With ``late`` set, the first parked copy of ``brief(1)`` (a deferral: it has an
    ETA) starts 5 s late, as in a worker whose pool is busy or whose store stalls."""
    request = getattr(task, "request", None)
    if (
        getattr(task, "name", "") == "last.brief"
        and list(args or ()) == [1]
        and getattr(request, "eta", None)
        and _redis().getdel("late")
    ):
        record("late:1")
        time.sleep(5)


worker = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    doc="A two-slot prefork worker (started by the test); its store is Redis or PostgreSQL.",
)
#: Every store a worker can share with its producers: Redis and PostgreSQL wake the
#: follow-up in their run records, the others at the gate lock (``GateWaiters``).
every_store = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    doc="A two-slot prefork worker (started by the test) on each store.",
    stores=("redis", "postgres", "sqlite", "mysql", "memcached"),
)
#: Stores keeping the gate as a lock (``GateWaiters``).
gate_lock_store = worker_fixture(
    app, runs_log,
    module=__name__,
    queue=QUEUE,
    dbs=(BROKER_DB, BACKEND_DB, RUNS_DB),
    doc="A two-slot prefork worker (started by the test) on SQLite or memcached.",
    stores=("sqlite", "memcached"),
)

#: The countdown of every deferral in a worker started with ``LAST_LONG_BACKOFF`` set:
#: a follow-up's parked copy comes back only this long after it was deferred, so a
#: follow-up that runs before it was woken.
LONG_BACKOFF = 12.0

if os.environ.get("LAST_LONG_BACKOFF"):
    from celery_dedup import worker as _worker

    def _long_countdown(task: Any, request: Any, base: float | None = None) -> float:
        return LONG_BACKOFF

    _worker.deferral_countdown = _long_countdown


def logged(redis_server: RedisServer) -> list[str]:
    """Every start and end so far, in order, without the pids."""
    with redis_server.client(RUNS_DB) as client:
        return [event.rsplit(":", 1)[0] for event in texts(client.lrange("runs", 0, -1))]


def pids(redis_server: RedisServer, event: str) -> list[int]:
    """The pids that logged ``event``, in order."""
    with redis_server.client(RUNS_DB) as client:
        events = texts(client.lrange("runs", 0, -1))
    return [int(e.rsplit(":", 1)[1]) for e in events if e.rsplit(":", 1)[0] == event]


def first_run_then(redis_server: RedisServer, task: Any, flag: str) -> Any:
    """Call ``task(0)`` (it runs until released), then set ``flag`` once it started."""
    first = task.delay(0)
    wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
    with redis_server.client(RUNS_DB) as client:
        client.set(flag, "1")
    return first


def release_first_run(redis_server: RedisServer) -> None:
    with redis_server.client(RUNS_DB) as client:
        client.set("go", "1")


def settle() -> None:
    """Let every copy the broker would still redeliver (or a deferral bring back) arrive."""
    time.sleep(3 * VISIBILITY + LEASE)


def test_twenty_calls_while_one_runs_make_one_follow_up_with_the_last_arguments(
    worker: Worker, redis_server: RedisServer
) -> None:
    """1 call, then 20 while it runs, two workers with free slots: exactly 2 runs, the second
    with call 20's arguments, starting only after the first ended."""
    other = Worker(
        worker.env, worker.log.with_name("other.log"), app_module=__name__, queue=QUEUE,
        concurrency=2,
    )
    worker.start()
    other.start()
    try:
        first = sync.delay(0)
        wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
        calls = [sync.delay(x) for x in range(1, 21)]
        assert all(call.deduplicated is False for call in calls)
        # Follow-ups delivered to the free slots are deferred meanwhile, never run.
        wait_until(lambda: "deferred" in worker.text() + other.text(), timeout=60)
        assert logged(redis_server) == ["start:0"]
        release_first_run(redis_server)
        assert first.get(timeout=60) == 0
        assert calls[-1].get(timeout=90) == 20
        settle()
        assert logged(redis_server) == ["start:0", "end:0", "start:20", "end:20"]
        # Every replaced follow-up ends REVOKED; its handle resolves to call 20's run.
        for call in calls[:-1]:
            wait_until(lambda call=call: call.state == states.REVOKED, timeout=60)
            assert call.get(timeout=30) == 20
        assert inspect_lock(first.deduplication_key, app=app) is None
        assert sync.delay(21).deduplicated is False  # nothing left behind
    finally:
        other.stop()


def test_a_call_while_only_a_queued_message_holds_the_key_replaces_it(
    worker: Worker, redis_server: RedisServer
) -> None:
    """Nothing runs yet: the queued message is replaced, only the last call runs."""
    calls = [sync.delay(x) for x in (5, 6, 7)]
    release_first_run(redis_server)
    worker.start()
    assert calls[-1].get(timeout=60) == 7
    settle()
    assert logged(redis_server) == ["start:7", "end:7"]
    for call in calls[:-1]:
        wait_until(lambda call=call: call.state == states.REVOKED, timeout=60)
        assert call.get(timeout=30) == 7  # the run that covered the call


def test_a_replaced_follow_up_whose_copy_arrives_while_it_is_deferred_ends_revoked(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A follow-up waiting for the run gate is deferred again and again; a later call
    replaces it (revoking its id) while a deferred copy is on its way and the deferring
    request is still active: the copy is dropped as Celery drops a revoked message (the
    follow-up ends REVOKED), never quietly as if a run of it were live."""
    worker.start()
    first = first_run_then(redis_server, sync, "linger")
    follow_up = sync.delay(1)
    # The replacing call lands while the first deferred copy's countdown runs.
    wait_until(lambda: f"[{follow_up.id}] deferred" in worker.text(), timeout=60, interval=0.01)
    last = sync.delay(2)
    wait_until(lambda: f"Discarding revoked task: last.sync[{follow_up.id}]" in worker.text(),
               timeout=60)
    release_first_run(redis_server)
    assert first.get(timeout=60) == 0
    assert last.get(timeout=90) == 2
    wait_until(lambda: follow_up.state == states.REVOKED, timeout=60)
    settle()
    assert logged(redis_server) == ["start:0", "end:0", "start:2", "end:2"]
    assert "its run is live or done" not in worker.text()


def test_a_follow_up_whose_pool_child_is_sigkilled_still_runs_once(
    worker: Worker, redis_server: RedisServer
) -> None:
    """``acks_late`` + ``reject_on_worker_lost``: the killed follow-up runs once more, to its end,
    never beside another run of the key."""
    worker.start()
    first = fragile.delay(0)
    wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
    follow_up = fragile.delay(1)
    release_first_run(redis_server)
    wait_until(lambda: pids(redis_server, "start:1"), timeout=60)
    child = pids(redis_server, "start:1")[0]
    os.kill(child, signal.SIGKILL)
    assert first.get(timeout=60) == 0
    assert follow_up.get(timeout=90) == 1
    settle()
    assert logged(redis_server) == ["start:0", "end:0", "start:1", "start:1", "end:1"]
    assert inspect_lock(first.deduplication_key, app=app) is None
    assert fragile.delay(2).deduplicated is False


def test_a_follow_up_waiting_when_the_whole_worker_is_sigkilled_still_runs_once(
    worker: Worker, redis_server: RedisServer
) -> None:
    """The worker dies while the first run holds the key and its follow-up waits: after a
    restart the follow-up runs once, and the superseded first run is not run again."""
    worker.start()
    first = fragile.delay(0)
    wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
    follow_up = fragile.delay(1)
    wait_until(lambda: "deferred" in worker.text(), timeout=60)
    worker.kill()
    release_first_run(redis_server)
    worker.start()
    assert follow_up.get(timeout=120) == 1
    settle()
    assert logged(redis_server) == ["start:0", "start:1", "end:1"]
    assert first.state != states.SUCCESS
    assert inspect_lock(first.deduplication_key, app=app) is None


def test_a_parked_copy_that_starts_late_after_its_woken_twin_ran_is_refused(
    worker: Worker, redis_server: RedisServer
) -> None:
    """A follow-up waits at its key's gate with a parked copy on its way; the gate's
    opening wakes it and the woken twin runs. The parked copy starts later than
    ``unique_for`` plus the ``visibility_timeout`` after that run ended: the done marker
    still refuses it (it outlives any copy the worker parks), so the follow-up runs once."""
    worker.start()
    first = first_run_then(redis_server, brief, "late")
    follow_up = brief.delay(1)
    assert follow_up.deduplicated is False  # the first call's window has passed
    wait_until(lambda: "late:1" in logged(redis_server), timeout=60)
    release_first_run(redis_server)
    assert first.get(timeout=60) == 0
    assert follow_up.get(timeout=90) == 1
    # The late copy's claim: refused (skipped), or, were the marker gone, a second run.
    wait_until(
        lambda: "already ran" in worker.text() or logged(redis_server).count("start:1") > 1,
        timeout=60,
    )
    settle()
    assert logged(redis_server) == ["start:0", "late:1", "end:0", "start:1", "end:1"]
    assert "woken" in worker.text()


def test_a_follow_up_waiting_when_the_run_it_follows_is_sigkilled_is_woken_by_the_main_process(
    worker: Worker, redis_server: RedisServer
) -> None:
    """The run holding the gate dies with its pool child while a follow-up is listed at
    the gate: the worker's main process records the killed run's end, and that end, as a
    body's would, hands the gate to the follow-up (publishes it at once). It runs once."""
    worker.start()
    first = sync.delay(0)
    wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
    follow_up = sync.delay(1)
    wait_until(lambda: f"[{follow_up.id}] deferred" in worker.text(), timeout=60)
    os.kill(pids(redis_server, "start:0")[0], signal.SIGKILL)
    assert follow_up.get(timeout=90) == 1
    assert f"INFO/MainProcess] celery-dedup: last.sync[{follow_up.id}] woken" in worker.text()
    assert first.state == states.FAILURE
    settle()
    assert logged(redis_server) == ["start:0", "start:1", "end:1"]
    assert inspect_lock(follow_up.deduplication_key, app=app) is None


def _woken_then_parked_copy_dropped(
    worker: Worker, redis_server: RedisServer, follow_up: Any
) -> None:
    """The follow-up ran once, woken (its parked copy's backoff is ``LONG_BACKOFF``); the
    parked copy, when it comes back, is refused as a copy of a run that ran."""
    assert follow_up.get(timeout=90) == 1
    assert f"last.sync[{follow_up.id}] woken" in worker.text()
    # Never run by its parked copy: that one comes back later and is dropped.
    wait_until(lambda: "already ran" in worker.text(), timeout=LONG_BACKOFF + 60)
    settle()
    assert logged(redis_server)[-2:] == ["start:1", "end:1"]
    assert logged(redis_server).count("start:1") == 1
    assert inspect_lock(follow_up.deduplication_key, app=app) is None


def _follow_up_at_the_gate(worker: Worker, redis_server: RedisServer) -> tuple[Any, Any]:
    """Start ``worker`` with a long deferral backoff, run call 0 and defer call 1 at its
    key's gate: their results."""
    worker.env["LAST_LONG_BACKOFF"] = "1"
    worker.start()
    first = sync.delay(0)
    wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
    follow_up = sync.delay(1)
    wait_until(lambda: f"[{follow_up.id}] deferred" in worker.text(), timeout=60)
    return first, follow_up


def test_a_follow_up_waiting_at_the_gate_is_woken_when_the_run_it_follows_ends(
    every_store: Worker, redis_server: RedisServer
) -> None:
    """On every store: a follow-up deferred at its key's run gate, its parked copy due back
    only after a long backoff, runs as soon as the run it follows ends (the end hands the
    gate over and the ending worker publishes it), exactly once."""
    worker = every_store
    first, follow_up = _follow_up_at_the_gate(worker, redis_server)
    release_first_run(redis_server)
    assert first.get(timeout=60) == 0
    _woken_then_parked_copy_dropped(worker, redis_server, follow_up)
    assert logged(redis_server) == ["start:0", "end:0", "start:1", "end:1"]


def test_on_a_gate_lock_store_a_killed_run_s_end_wakes_the_follow_up_from_the_main_process(
    gate_lock_store: Worker, redis_server: RedisServer
) -> None:
    """SQLite and memcached (the gate a lock): the run holding the gate dies with its pool
    child while the follow-up waits at the gate, its parked copy due back only after a long
    backoff; the worker's main process records the killed run's end, which opens the gate
    and wakes the follow-up. It runs once."""
    worker = gate_lock_store
    first, follow_up = _follow_up_at_the_gate(worker, redis_server)
    os.kill(pids(redis_server, "start:0")[0], signal.SIGKILL)
    _woken_then_parked_copy_dropped(worker, redis_server, follow_up)
    assert f"INFO/MainProcess] celery-dedup: last.sync[{follow_up.id}] woken" in worker.text()
    assert first.state == states.FAILURE
    assert logged(redis_server) == ["start:0", "start:1", "end:1"]
