"""A prefork worker in a subprocess, on the test Redis broker, with locks in Redis or PostgreSQL.

Shared by the suites whose bodies record events in a Redis list that every
process appends to (``runs_once``, ``cancel_running`` and its stress test).
The worker's app is the test module's own, configured from environment
variables named ``<PREFIX>_BROKER_URL``, ``_BACKEND_URL``, ``_STORE_URL`` and
``_RUNS_URL`` (``env_app``), so the subprocess builds the same app.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup.runtime import runtime_for
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.redis import RedisServer

from .test_ownership_prefork import ROOT, Worker


def env_app(name: str, prefix: str, queue: str, **conf: Any) -> Celery:
    """The test module's app, configured from ``<prefix>_*`` environment variables."""
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url=os.environ.get(f"{prefix}_BROKER_URL", "memory://"),
        result_backend=os.environ.get(f"{prefix}_BACKEND_URL"),
        dedup_store=os.environ.get(f"{prefix}_STORE_URL") or None,
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        result_expires=None,
        dedup_metrics_flush_interval=3600,
        **conf,
    )
    return app


class RunsLog:
    """The Redis list bodies append their events to (one client per process)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._client: redis.Redis | None = None

    def client(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(os.environ[f"{self.prefix}_RUNS_URL"])
        return self._client

    def forget(self) -> None:
        """Drop the client (a new test points the variable at another database)."""
        self._client = None


def store_url(request: pytest.FixtureRequest) -> str:
    """``""`` (the result backend's Redis) or an emptied PostgreSQL, SQLite, MySQL/MariaDB
    or memcached store, per ``request.param``."""
    if request.param == "sqlite":
        path = request.getfixturevalue("tmp_path") / "locks.sqlite3"
        return f"db+sqlite:///{path}"
    if request.param == "mysql":
        from celery_dedup.stores.sql import SQLStore
        from tests.fixtures.sql_stores import empty_tables

        url = "db+" + request.getfixturevalue("mysql_server").url("pymysql")
        store = SQLStore(url.removeprefix("db+"))
        try:
            empty_tables(store)
        finally:
            store.close()
        return url
    if request.param == "memcached":
        server = request.getfixturevalue("memcached_server")
        client = server.client()
        try:
            client.flush_all()
        finally:
            client.close()
        return str(server.url)
    if request.param != "postgres":
        return ""
    server: PostgresServer = request.getfixturevalue("postgres_server")
    with server.connect() as conn:
        conn.execute(
            "DO $$ BEGIN IF to_regclass('celery_dedup_sql_lock') IS NOT NULL THEN "
            "DELETE FROM celery_dedup_sql_lock; DELETE FROM celery_dedup_sql_revoked; "
            "END IF; END $$"
        )
    return "db+" + server.url()


@contextmanager
def subprocess_worker(
    app: Celery,
    *,
    module: str,
    prefix: str,
    queue: str,
    dbs: tuple[int, int, int],
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    concurrency: int = 2,
    pool: str = "prefork",
) -> Iterator[Worker]:
    """A prefork worker of ``module``'s ``app`` (started by the test); broker, results
    and the runs log on databases ``dbs`` of the test Redis; locks per ``request.param``."""
    broker_db, backend_db, runs_db = dbs
    redis_server.flush(*dbs)
    store = store_url(request)
    env = {
        **os.environ,
        f"{prefix}_BROKER_URL": redis_server.url(broker_db),
        f"{prefix}_BACKEND_URL": redis_server.url(backend_db),
        f"{prefix}_RUNS_URL": redis_server.url(runs_db),
        f"{prefix}_STORE_URL": store,
        "PYTHONPATH": str(ROOT),
    }
    monkeypatch.setenv(f"{prefix}_RUNS_URL", env[f"{prefix}_RUNS_URL"])
    app.conf.update(
        broker_url=env[f"{prefix}_BROKER_URL"],
        result_backend=env[f"{prefix}_BACKEND_URL"],
        dedup_store=store or None,
    )
    proc = Worker(env, tmp_path / "worker.log", app_module=module, queue=queue,
                  concurrency=concurrency, pool=pool)
    try:
        yield proc
    finally:
        proc.stop()
        runtime_for(app).metrics.flush()


def worker_fixture(
    app: Celery,
    runs_log: RunsLog,
    *,
    module: str,
    queue: str,
    dbs: tuple[int, int, int],
    doc: str,
    stores: tuple[str, ...] = ("redis", "postgres"),
    started: bool = False,
    concurrency: int = 2,
    pool: str = "prefork",
) -> Any:
    """A test module's ``worker`` fixture: a ``subprocess_worker`` of its ``app`` per store
    in ``stores`` (``redis``: the result backend's Redis; ``postgres``), ``started`` or
    started by the test. Assign it to a module-level ``worker``."""

    @pytest.fixture(params=list(stores))
    def worker(
        request: pytest.FixtureRequest,
        redis_server: RedisServer,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> Iterator[Worker]:
        runs_log.forget()
        with subprocess_worker(
            app, module=module, prefix=runs_log.prefix, queue=queue, dbs=dbs,
            request=request, redis_server=redis_server, tmp_path=tmp_path,
            monkeypatch=monkeypatch, concurrency=concurrency, pool=pool,
        ) as proc:
            if started:
                proc.start()
            yield proc

    worker.__doc__ = doc
    return worker
