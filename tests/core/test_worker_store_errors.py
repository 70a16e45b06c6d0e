"""The worker never turns a store answer into lost work (issue 20, item 3).

A message is published while its lock store is healthy; the store then
breaks the way production breaks it (full under ``noeviction``, a replica
after a failover, an ACL that lost a right, a one-second stall, PostgreSQL
in read-only mode) and a real worker gets the message. Under
``dedup_fallback="open"`` the body runs once, unchecked, and its lock is
released as soon as the store answers again; under ``"closed"`` the message
is deferred while the store is broken and runs once after it recovered.
Never ``FAILURE``, never a lost message, never a driver's exception.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import states

from celery_dedup import DeduplicationUnavailable, DedupTask, StoreError, inspect_lock
from tests.fixtures._servers import running
from tests.fixtures.logs import DedupLog
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.redis import start_redis

from .conftest import AppFactory, wait_until
from .test_ownership import Runs, runs, state_of

__all__ = ["runs"]  # the fixture, shared with test_ownership

pytestmark = pytest.mark.timeout(90)


@dataclass
class Breakable:
    """A store URL and how to break and repair the server behind it."""

    url: str
    breaks: Callable[[], None]
    repairs: Callable[[], None]


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[tuple[int, redis.Redis]]:
    """A redis-server of this test's own (the broker and results live elsewhere)."""
    argv, port = start_redis(tmp_path)
    with running(argv, port, log=tmp_path / "redis.log"):
        client = redis.Redis(port=port)
        yield port, client
        client.close()


def _full(port: int, admin: redis.Redis, tmp_path: Path) -> Breakable:
    def breaks() -> None:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write is now over the limit: OOM

    return Breakable(
        f"redis://127.0.0.1:{port}/0", breaks, lambda: admin.config_set("maxmemory", 0)
    )


def _replica(port: int, admin: redis.Redis, tmp_path: Path) -> Breakable:
    (tmp_path / "primary").mkdir()
    argv, primary = start_redis(tmp_path / "primary")
    context = running(argv, primary, log=tmp_path / "primary.log")
    context.__enter__()

    def repairs() -> None:
        admin.execute_command("REPLICAOF", "NO", "ONE")
        context.__exit__(None, None, None)  # (a second exit finds the process gone)

    return Breakable(
        f"redis://127.0.0.1:{port}/0",
        lambda: admin.execute_command("REPLICAOF", "127.0.0.1", str(primary)),  # READONLY
        repairs,
    )


def _acl(port: int, admin: redis.Redis, tmp_path: Path) -> Breakable:
    admin.execute_command("ACL", "SETUSER", "dedup", "on", ">secret", "~*", "&*", "+@all")
    return Breakable(
        f"redis://dedup:secret@127.0.0.1:{port}/0",
        lambda: admin.execute_command("ACL", "SETUSER", "dedup", "-@scripting"),  # NOPERM
        lambda: admin.execute_command("ACL", "SETUSER", "dedup", "+@all"),
    )


def _stall(port: int, admin: redis.Redis, tmp_path: Path) -> Breakable:
    pid = int(admin.info("server")["process_id"])
    return Breakable(
        f"redis://127.0.0.1:{port}/0?socket_timeout=0.5&socket_connect_timeout=0.5",
        lambda: os.kill(pid, signal.SIGSTOP),
        lambda: os.kill(pid, signal.SIGCONT),
    )


REDIS_FAILURES = {"full": _full, "replica": _replica, "acl": _acl, "stall": _stall}


@pytest.fixture(params=[*REDIS_FAILURES, "postgres-read-only"])
def breakable(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Breakable]:
    """One way a store breaks, on a server of this test's own."""
    if request.param == "postgres-read-only":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        yield from _postgres_read_only(server)
        return
    port, admin = request.getfixturevalue("store_server")
    broken = REDIS_FAILURES[request.param](port, admin, tmp_path)
    yield broken
    broken.repairs()  # idempotent enough for a teardown after a failed test


def _postgres_read_only(server: PostgresServer) -> Iterator[Breakable]:
    name = f"ro_{uuid.uuid4().hex[:8]}"
    with server.connect() as conn:
        conn.execute(f"CREATE DATABASE {name}")

    def switch(read_only: bool) -> None:
        with server.connect() as conn:
            value = "on" if read_only else "off"
            conn.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = {value}")
            # Sessions read the setting when they start: end the store's sessions.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            )

    url = server.url().rsplit("/", 1)[0] + f"/{name}"
    yield Breakable(f"db+{url}", lambda: switch(True), lambda: switch(False))
    switch(False)
    with server.connect() as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name]
        )
        conn.execute(f"DROP DATABASE IF EXISTS {name}")


def lock_gone(result: Any, app: Any) -> bool:
    """Whether the call's lock is gone (a repaired server may drop a pooled connection once)."""
    try:
        return inspect_lock(result.deduplication_key, app=app) is None
    except StoreError:
        return False


def job_on(app: Any, runs: Runs, until: str = "success") -> Any:
    """``job(x)`` records ``x`` and returns it (``unique_until="success"`` by default)."""

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until=until)
    def job(x: int) -> int:
        runs.record(x)
        return x

    return job


@pytest.mark.parametrize("until", ["success", "start"])
def test_open_runs_the_body_once_and_releases_the_lock_when_the_store_answers(
    app_factory: AppFactory,
    worker_for: Any,
    runs: Runs,
    breakable: Breakable,
    dedup_log: DedupLog,
    until: str,
) -> None:
    """The body runs unchecked; its lock is released once the store answers (under
    ``"start"`` too, whose start claim could not release it)."""
    app = app_factory("store-errors-open", dedup_store=breakable.url, dedup_fallback="open")
    job = job_on(app, runs, until)
    result = job.delay(1)
    assert inspect_lock(result.deduplication_key, app=app) is not None
    breakable.breaks()
    unlocked = job.delay(2)  # the producer falls back too, with a typed cause
    assert unlocked.deduplicated is False
    worker_for(app)
    assert result.get(timeout=30) == 1
    wait_until(lambda: sorted(runs.labels()) == ["1", "2"], timeout=30)
    assert any("runs unchecked" in m for m in dedup_log.warnings())
    breakable.repairs()
    # The lock taken at publish is released once the store answers: a new
    # identical call is accepted and runs.
    wait_until(lambda: lock_gone(result, app), timeout=30)
    again = job.delay(1)
    assert again.deduplicated is False
    assert again.get(timeout=30) == 1
    assert sorted(runs.labels()) == ["1", "1", "2"]


def test_closed_defers_the_message_and_runs_it_once_after_the_store_recovered(
    app_factory: AppFactory,
    worker_for: Any,
    runs: Runs,
    breakable: Breakable,
    dedup_log: DedupLog,
) -> None:
    app = app_factory("store-errors-closed", dedup_store=breakable.url, dedup_fallback="closed")
    job = job_on(app, runs)
    result = job.delay(1)
    breakable.breaks()
    with pytest.raises(DeduplicationUnavailable) as refused:
        job.delay(2)
    assert isinstance(refused.value.__cause__, StoreError)  # typed, never a driver's error
    worker_for(app)
    wait_until(lambda: any("deferred" in r.getMessage() for r in dedup_log.records), timeout=30)
    assert runs.count() == 0
    assert state_of(app, result.id) == states.PENDING  # not FAILURE: it waits
    breakable.repairs()
    assert result.get(timeout=30) == 1
    assert runs.labels() == ["1"]
    wait_until(lambda: lock_gone(result, app), timeout=10)


def test_breaking_helpers_really_break(breakable: Breakable, tmp_path: Path) -> None:
    """The scenarios above are only as good as the breakage: a store call raises a StoreError."""
    from celery_dedup.stores import store_from_url

    store = store_from_url(breakable.url)
    assert store.acquire("probe", "me", 5, {"task_name": "t", "policy": "success"}) is None
    breakable.breaks()
    with pytest.raises(StoreError):
        store.acquire("probe-2", "me", 5, {"task_name": "t", "policy": "success"})
    breakable.repairs()

