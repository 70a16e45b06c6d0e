"""Leases that survive a stall; copies that never act for the run (issue 30, items 3 and 4).

A real ``celery worker -P prefork`` subprocess runs a body far longer than
``dedup_lease_ttl`` while its lock store stops answering for longer than
the lease: a Redis store on a server of the test's own is paused
(SIGSTOP), a PostgreSQL store's table is locked by another connection.
Bodies append their start and end to a Redis list on another server, so
its order shows whether two runs of a key ever overlapped. Also: a copy
Celery drops (expired) never acts for the live run, a revoked retry is not
taken for a copy, and an end the store refused is recorded once it accepts.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import states

from celery_dedup import DedupTask, inspect_lock
from tests.fixtures._servers import running
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.redis import RedisServer, start_redis

from .conftest import wait_until
from .subprocess_workers import RunsLog, env_app
from .test_ownership import texts
from .test_ownership_prefork import ROOT, Worker

pytestmark = pytest.mark.timeout(300)

QUEUE = "stalls"
BROKER_DB, BACKEND_DB, RUNS_DB = 55, 56, 57
LEASE = 3
#: longer than the lease, shorter than the lease record's life (``runs.record_life``)
STALL = 4.5
#: the first run outlasts the stall by far
LONG_RUN = 11.0

app = env_app(
    "stalls",
    "STALL",
    QUEUE,
    broker_transport_options={
        "visibility_timeout": 2,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    dedup_lease_ttl=LEASE,
    dedup_fallback="closed",
)
runs_log = RunsLog("STALL")


def record(event: str) -> None:
    """Append ``event`` (with this process's pid) to the shared log."""
    runs_log.client().rpush("runs", f"{event}:{os.getpid()}")


@app.task(
    base=DedupTask,
    name="stalls.sync",
    unique_for=120,
    on_duplicate="keep_last",
    deduplication_key=lambda x: "account-9",
)
def sync(x: int) -> int:
    """The first run (``x == 0``) lasts ``LONG_RUN`` seconds; a follow-up is short."""
    record(f"start:{x}")
    time.sleep(LONG_RUN if x == 0 else 0.2)
    record(f"end:{x}")
    return x


@app.task(
    base=DedupTask, name="stalls.charge", unique_for=120, unique_until="expiry", acks_late=True
)
def charge(x: int) -> int:
    """An idempotency-keyed charge: the first copy lasts ``LONG_RUN`` seconds."""
    record(f"start:{x}")
    time.sleep(LONG_RUN)
    record(f"end:{x}")
    return x


@app.task(base=DedupTask, name="stalls.hold", unique_for=120, acks_late=True)
def hold(x: int) -> int:
    """Runs ``LONG_RUN`` seconds; the broker restores its unacknowledged message meanwhile."""
    record(f"start:{x}")
    time.sleep(LONG_RUN)
    record(f"end:{x}")
    return x


@app.task(
    base=DedupTask, name="stalls.pay", unique_for=120, unique_until="expiry", acks_late=True
)
def pay(x: int) -> int:
    """Ends when the test says so (``go``), so the store can stall just as it ends."""
    record(f"start:{x}")
    client = runs_log.client()
    deadline = time.monotonic() + 120
    while not client.get("go") and time.monotonic() < deadline:
        time.sleep(0.05)
    record(f"end:{x}")
    return x


@app.task(
    base=DedupTask,
    name="stalls.limited",
    unique_for=120,
    concurrency_limit=1,
    concurrency_key="{account}",
)
def limited(account: str, x: int) -> int:
    """One body per account at a time; the first lasts ``LONG_RUN`` seconds."""
    record(f"start:{x}")
    time.sleep(LONG_RUN if x == 0 else 0.2)
    record(f"end:{x}")
    return x


@app.task(base=DedupTask, name="stalls.again", unique_for=120, bind=True)
def again(self: Any, x: int) -> int:
    """Retries once, 2 s later (a new attempt of the same publish)."""
    record(f"start:{x}:{self.request.retries}")
    if not self.request.retries:
        raise self.retry(countdown=2)
    return x


class Stallable:
    """A lock store URL, and how to make its server stop answering (``stall``) or
    refuse every write (``refuse``) for a while."""

    def __init__(
        self, url: str, stall: Callable[[float], None], refuse: Callable[[float], None]
    ) -> None:
        self.url = url
        self.stall = stall
        self.refuse = refuse


def _redis_store(tmp_path: Path) -> Iterator[Stallable]:
    (tmp_path / "store").mkdir()
    argv, port = start_redis(tmp_path / "store")
    with running(argv, port, log=tmp_path / "store-redis.log"):
        client = redis.Redis(port=port)
        pid = int(client.info("server")["process_id"])
        client.close()

        def stall(seconds: float) -> None:
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.kill(pid, signal.SIGCONT)

        def refuse(seconds: float) -> None:
            with redis.Redis(port=port) as admin:
                admin.config_set("maxmemory-policy", "noeviction")
                admin.config_set("maxmemory", 1)  # every write is over the limit: OOM
                try:
                    time.sleep(seconds)
                finally:
                    admin.config_set("maxmemory", 0)

        # Store calls time out during the stall (they fail, not only wait).
        timeouts = "socket_timeout=1&socket_connect_timeout=1"
        yield Stallable(f"redis://127.0.0.1:{port}/0?{timeouts}", stall, refuse)


def _postgres_store(server: PostgresServer) -> Iterator[Stallable]:
    with server.connect() as conn:
        conn.execute(
            "DO $$ BEGIN IF to_regclass('celery_dedup_sql_lock') IS NOT NULL THEN "
            "DELETE FROM celery_dedup_sql_lock; DELETE FROM celery_dedup_sql_revoked; "
            "END IF; END $$"
        )

    def stall(seconds: float) -> None:
        with server.connect() as conn, conn.transaction():
            conn.execute("LOCK TABLE celery_dedup_sql_lock IN ACCESS EXCLUSIVE MODE")
            time.sleep(seconds)

    yield Stallable("db+" + server.url(), stall, stall)  # (statements wait for the lock)


@pytest.fixture(params=["redis", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stallable]:
    """A store that can stall: Redis paused, or a PostgreSQL table locked."""
    if request.param == "redis":
        yield from _redis_store(tmp_path)
    else:
        yield from _postgres_store(request.getfixturevalue("postgres_server"))


@pytest.fixture
def worker(
    store: Stallable,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Worker]:
    """A two-slot prefork worker (started by the test) whose lock store can stall."""
    runs_log.forget()
    redis_server.flush(BROKER_DB, BACKEND_DB, RUNS_DB)
    env = {
        **os.environ,
        "STALL_BROKER_URL": redis_server.url(BROKER_DB),
        "STALL_BACKEND_URL": redis_server.url(BACKEND_DB),
        "STALL_RUNS_URL": redis_server.url(RUNS_DB),
        "STALL_STORE_URL": store.url,
        "PYTHONPATH": str(ROOT),
    }
    monkeypatch.setenv("STALL_RUNS_URL", env["STALL_RUNS_URL"])
    app.conf.update(
        broker_url=env["STALL_BROKER_URL"],
        result_backend=env["STALL_BACKEND_URL"],
        dedup_store=store.url,
    )
    proc = Worker(env, tmp_path / "worker.log", app_module=__name__, queue=QUEUE, concurrency=2)
    try:
        yield proc
    finally:
        proc.stop()


def logged(redis_server: RedisServer) -> list[str]:
    """Every start and end so far, in order, without the pids."""
    with redis_server.client(RUNS_DB) as client:
        return [event.rsplit(":", 1)[0] for event in texts(client.lrange("runs", 0, -1))]


def stall_in_background(
    store: Stallable, seconds: float, *, refuse: bool = False
) -> threading.Thread:
    """Stall the store (or make it refuse writes) for ``seconds`` from a daemon thread."""
    breaks = store.refuse if refuse else store.stall
    thread = threading.Thread(target=breaks, args=(seconds,), daemon=True)
    thread.start()
    return thread


def test_a_keep_last_follow_up_never_runs_inside_a_run_whose_store_stalled(
    worker: Worker, store: Stallable, redis_server: RedisServer
) -> None:
    """The store stalls longer than the lease while the first run runs: the follow-up
    waits for its end (starts only after it), and the stall is logged."""
    worker.start()
    first = sync.delay(0)
    wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
    follow_up = sync.delay(1)
    wait_until(lambda: "deferred" in worker.text(), timeout=60)  # waiting for the gate
    stalled = stall_in_background(store, STALL)
    stalled.join(STALL + 30)
    assert first.get(timeout=90) == 0
    assert follow_up.get(timeout=90) == 1
    assert logged(redis_server) == ["start:0", "end:0", "start:1", "end:1"]
    text = worker.text()
    assert "to renew" in text or "could not renew" in text  # the stall was logged
    assert inspect_lock(first.deduplication_key, app=app) is None


def test_a_copy_of_a_run_whose_store_stalled_never_runs_beside_it(
    worker: Worker, store: Stallable, redis_server: RedisServer
) -> None:
    """``unique_until="expiry"`` under ``"closed"``: the broker redelivers the running
    message (2 s visibility) while the store stalls longer than the lease; the copy
    never runs the body again, during or after the stall."""
    worker.start()
    result = charge.delay(7)
    wait_until(lambda: "start:7" in logged(redis_server), timeout=60)
    stalled = stall_in_background(store, STALL)
    stalled.join(STALL + 30)
    assert result.get(timeout=90) == 7
    time.sleep(2 * LEASE + 3)  # copies the broker restored come and are refused
    assert logged(redis_server) == ["start:7", "end:7"]
    assert result.state == states.SUCCESS


def test_an_expired_copy_of_a_running_message_never_acts_for_the_run(
    worker: Worker, store: Stallable, redis_server: RedisServer
) -> None:
    """A redelivered copy deferred past the message's ``expires`` is dropped by Celery:
    the running message keeps its lock and state, an identical call is still a
    duplicate, and the caller's ``get()`` returns the run's result."""
    worker.start()
    result = hold.apply_async((3,), expires=4)
    wait_until(lambda: "start:3" in logged(redis_server), timeout=60)
    wait_until(lambda: "Discarding revoked task" in worker.text(), timeout=60)  # the copy
    assert "end:3" not in logged(redis_server)  # the run is still live
    assert result.state != states.REVOKED
    lock = inspect_lock(result.deduplication_key, app=app)
    assert lock is not None and lock.task_id == result.id
    assert hold.apply_async((3,), expires=4).deduplicated is True
    assert result.get(timeout=90) == 3
    assert logged(redis_server) == ["start:3", "end:3"]


def test_a_done_marker_is_recorded_once_the_store_answers_again(
    worker: Worker, store: Stallable, redis_server: RedisServer
) -> None:
    """The store refuses writes (Redis: OOM; PostgreSQL: a locked table) for about a
    lease just as the run ends: the end is recorded once it accepts them, and the
    copies the broker restores never run again."""
    worker.start()
    result = pay.delay(5)
    wait_until(lambda: "start:5" in logged(redis_server), timeout=60)
    wait_until(lambda: "deferred" in worker.text(), timeout=60)  # a restored copy waits
    stalled = stall_in_background(store, LEASE, refuse=True)
    with redis_server.client(RUNS_DB) as client:
        client.set("go", "1")
    stalled.join(STALL + 30)
    assert result.get(timeout=90) == 5
    time.sleep(2 * LEASE + 4)  # restored copies come and are refused
    assert logged(redis_server) == ["start:5", "end:5"]


def test_a_concurrency_slot_outlives_a_store_stall(
    worker: Worker, store: Stallable, redis_server: RedisServer
) -> None:
    """``concurrency_limit=1``: the store stalls longer than the lease while one body
    holds the key's slot; the other call's body starts only after it ended."""
    worker.start()
    first = limited.delay("acct", 0)
    wait_until(lambda: "start:0" in logged(redis_server), timeout=60)
    second = limited.delay("acct", 1)
    wait_until(lambda: "concurrency limit 1 reached" in worker.text(), timeout=60)
    stalled = stall_in_background(store, STALL)
    stalled.join(STALL + 30)
    assert first.get(timeout=90) == 0
    assert second.get(timeout=90) == 1
    assert logged(redis_server) == ["start:0", "end:0", "start:1", "end:1"]


def test_a_revoked_retry_is_not_taken_for_a_copy_of_the_attempt_before_it(
    worker: Worker, store: Stallable, redis_server: RedisServer
) -> None:
    """The retry of a run is a new attempt: revoked by id (Celery's own revoke) while it
    waits for its countdown, Celery drops it and its lock is released; it is not
    taken for a copy of the first attempt, whose done marker is not its own."""
    worker.start()
    result = again.delay(4)
    wait_until(lambda: "retry: Retry in" in worker.text(), timeout=60)
    app.control.revoke(result.id)
    wait_until(lambda: "Discarding revoked task" in worker.text(), timeout=60)
    wait_until(lambda: inspect_lock(result.deduplication_key, app=app) is None, timeout=30)
    assert result.state == states.REVOKED
    assert logged(redis_server) == ["start:4:0"]
    assert "dropped a copy" not in worker.text()
