"""SQL store behaviour beyond the contract: statements, tables, forks, outages, URLs.

Runs against a real SQLite file, PostgreSQL and MariaDB started for the
session; the MySQL code path (no ``RETURNING``) is exercised on MariaDB.
Races under load are in ``test_sql_contention.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    func,
    inspect,
    select,
    text,
)

from celery_dedup import ImproperlyConfigured, StorePermissionDenied, StoreUnavailable
from celery_dedup.runtime import runtime_for
from celery_dedup.stores import derive_store_url, sql, sql_dialects, store_from_url
from celery_dedup.stores.base import ClaimOutcome, RevokeOutcome, revoked_marker_key
from celery_dedup.stores.sql import SQLStore, lock_table, revoked_table
from celery_dedup.stores.sql_limits import TURN_FUNCTION
from tests.fixtures._servers import free_port
from tests.fixtures._store_case import StoreCase
from tests.fixtures.mysql import MySQLServer
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.redis import RedisServer
from tests.fixtures.sql_stores import sql_case
from tests.stores.contract import StoreContract

META = {"task_name": "tests.add", "policy": "success", "task_id": "id-a"}

SQL_STORES = [
    pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
]

#: The query that names the server-side session of a connection.
SESSION_ID = {
    "postgresql": "SELECT pg_backend_pid()",
    "mysql": "SELECT CONNECTION_ID()",
    "sqlite": "SELECT 1",
}


@pytest.fixture(params=SQL_STORES)
def sql_store(request: pytest.FixtureRequest) -> SQLStore:
    """Each SQL store in turn, tables created and empty."""
    case: StoreCase = request.getfixturevalue(request.param)
    assert isinstance(case.store, SQLStore)
    case.store.create_tables()
    return case.store


@contextmanager
def statements(store: SQLStore) -> Iterator[list[str]]:
    """Record every statement the store's engine sends while the block runs.

    A cursor listener: the store then runs its statements through SQLAlchemy.
    """
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(store.engine, "before_cursor_execute", record)


@contextmanager
def driver_statements(store: SQLStore) -> Iterator[list[str]]:
    """Record every statement the store's driver runs, with no engine listener.

    Nothing observes the engine, so the store runs its statements on the
    DBAPI connection itself; they are recorded below SQLAlchemy: at the
    driver's cursor (psycopg, PyMySQL) or by SQLite's trace callback.
    """
    assert not sql._observed(store.engine)
    sent: list[str] = []
    if store.engine.dialect.name == "sqlite":

        def trace(dbapi_connection: Any, *args: Any) -> None:
            dbapi_connection.set_trace_callback(sent.append)

        def untrace(dbapi_connection: Any, *args: Any) -> None:
            dbapi_connection.set_trace_callback(None)

        # Pool events, not statement events: the store still skips SQLAlchemy.
        event.listen(store.engine, "checkout", trace)
        event.listen(store.engine, "checkin", untrace)
        try:
            yield sent
        finally:
            event.remove(store.engine, "checkout", trace)
            event.remove(store.engine, "checkin", untrace)
        return
    cursor_class: Any = (
        psycopg.Cursor if store.engine.dialect.name == "postgresql" else pymysql.cursors.Cursor
    )
    execute = cursor_class.execute

    def record(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(query))
        return execute(cursor, query, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cursor_class, "execute", record)
        yield sent


Recorder = Callable[[SQLStore], AbstractContextManager[list[str]]]


@pytest.fixture(params=["sqlalchemy", "driver"])
def recorded(request: pytest.FixtureRequest) -> Recorder:
    """Each way the store runs statements in turn, with a recorder that sees it.

    ``sqlalchemy``: an engine listener is registered, so statements go
    through SQLAlchemy; ``driver``: nothing observes the engine, so they go
    to the DBAPI connection directly.
    """
    return statements if request.param == "sqlalchemy" else driver_statements


def row_count(store: SQLStore) -> int:
    """Rows in the lock table, live or expired."""
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(lock_table)).scalar_one())


def is_mariadb(store: SQLStore) -> bool:
    """Whether the store runs on MariaDB (whose upsert can return the row)."""
    return bool(getattr(store.engine.dialect, "is_mariadb", False))


# -- one statement per operation --------------------------------------------


def test_one_statement_per_operation(sql_store: SQLStore, recorded: Recorder) -> None:
    """Acquire, duplicate, release, extend, get, start check and unrevoke send one statement each.

    A duplicate on SQLite sends two (in process, no round trip). Both ways
    of running statements send the same ones.
    """
    sql_store.get("warm-up")
    with recorded(sql_store) as sent:
        assert sql_store.acquire("k", "owner-a", 30, META) is None
    assert len(sent) == 1
    upsert = sent[0].upper()
    assert "ON CONFLICT" in upsert or "ON DUPLICATE KEY UPDATE" in upsert
    assert "RETURNING" in upsert

    with recorded(sql_store) as sent:
        holder = sql_store.acquire("k", "owner-b", 30, META)
    assert holder is not None and holder.owner == "owner-a"
    # SQLite cannot return the row its upsert left alone; it reads it in
    # process, with no round trip.
    assert len(sent) == (2 if sql_store.engine.dialect.name == "sqlite" else 1)

    checks: list[tuple[Callable[[], Any], Callable[[Any], bool]]] = [
        (lambda: sql_store.extend("k", "owner-a", 60), lambda r: r is True),
        (lambda: sql_store.get("k"), lambda r: r is not None and r.owner == "owner-a"),
        (
            lambda: sql_store.claim("k", "owner-a", release=False, ttl=30, meta=META),
            lambda r: r.outcome is ClaimOutcome.OWNED,
        ),
        (lambda: sql_store.get("k"), lambda r: r is not None and r.started),
        (lambda: sql_store.release("k", "owner-a"), lambda r: r is True),
        (lambda: sql_store.acquire("k2", "owner-a", 30, META), lambda r: r is None),
        (
            lambda: sql_store.claim("k2", "owner-a", release=True, ttl=None, meta=META),
            lambda r: r.outcome is ClaimOutcome.OWNED,
        ),
        (lambda: sql_store.unrevoke("k2", "owner-a"), lambda r: r is None),
    ]
    for operation, expected in checks:
        with recorded(sql_store) as sent:
            result = operation()
        assert expected(result), result
        assert len(sent) == 1, sent


@pytest.mark.postgres
def test_every_operation_is_one_statement_on_postgres(
    store_postgres: StoreCase, recorded: Recorder
) -> None:
    """On PostgreSQL every start-check outcome, revoke and take-over (of a queued holder
    too, taken or left to a started one) is one statement."""
    store = store_postgres.store
    assert isinstance(store, SQLStore)
    assert store.acquire("held", "owner-a", 30, META) is None
    assert store.acquire("mine", "owner-a", 30, META) is None
    operations: list[tuple[Callable[[], Any], Any]] = [
        (lambda: store.claim("held", "owner-b", release=False, ttl=30, meta=META).outcome,
         ClaimOutcome.HELD),
        (lambda: store.claim("free", "owner-b", release=False, ttl=30, meta=META).outcome,
         ClaimOutcome.FREE),
        (lambda: store.revoke("mine", "owner-a", 60), RevokeOutcome.RELEASED),
        (lambda: store.revoke("free", "owner-b", 60), RevokeOutcome.RUNNING),
        (lambda: store.revoke("none", "owner-c", 60), RevokeOutcome.NOT_HELD),
        (lambda: store.claim("mine", "owner-a", release=False, ttl=30, meta=META).outcome,
         ClaimOutcome.REVOKED),
        (lambda: store.take_over("held", "owner-c", 30, META) is not None, True),
        (lambda: store.take_over("new", "owner-c", 30, META) is None, True),
        (lambda: store.take_over_queued("held", "owner-d", 30, META).owner, "owner-c"),
        (lambda: store.take_over_queued("queued-new", "owner-d", 30, META), None),
        (lambda: store.claim("held", "owner-d", release=False, ttl=None, meta=META).outcome,
         ClaimOutcome.OWNED),
        (lambda: store.take_over_queued("held", "owner-e", 30, META).started, True),
        # The take-over and the displaced owner's marker: still one statement.
        (lambda: store.settle("held", "owner-d"), True),
        (lambda: store.take_over_revoking("held", "owner-f", 30, META, 60).owner, "owner-d"),
        (lambda: store.take_over_revoking("held", "owner-g", 30, META, 60, queued_only=True)
         .owner, "owner-f"),
        (lambda: store.take_over_revoking("free-r", "owner-g", 30, META, 60), None),
        (lambda: store.claim("held", "owner-f", release=False, ttl=None, meta=META).outcome,
         ClaimOutcome.REVOKED),
    ]
    for operation, expected in operations:
        with recorded(store) as sent:
            assert operation() == expected
        assert len(sent) == 1, sent


TRANSACTIONAL_STORES = [
    pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
]


@pytest.mark.parametrize("sql_store", TRANSACTIONAL_STORES, indirect=True)
def test_transaction_shapes(sql_store: SQLStore, recorded: Recorder) -> None:
    """On SQLite and MySQL/MariaDB take-over, revoke and the rarer start checks are transactions.

    Each locks the key's row first: take-over and the start check with an
    upsert that inserts the row or keeps (and locks) the existing one.
    """
    mariadb = is_mariadb(sql_store)

    def shape(operation: Callable[[], Any]) -> list[str]:
        with recorded(sql_store) as sent:
            operation()
        return [s.split()[0].upper() for s in sent]

    assert sql_store.acquire("k", "owner-a", 30, META) is None
    read = [] if mariadb else ["SELECT"]
    assert shape(lambda: sql_store.take_over("k", "owner-b", 30, META)) == [
        "BEGIN" if sql_store.engine.dialect.name == "sqlite" else "START", "INSERT", *read,
        "UPDATE", "COMMIT",
    ]
    begin = shape(lambda: sql_store.take_over("new", "owner-b", 30, META))[0]
    assert shape(lambda: sql_store.take_over("new2", "owner-b", 30, META)) == [
        begin, "INSERT", *read, "COMMIT",
    ]
    # take_over_queued: the same transaction; a started holder is only read.
    assert sql_store.acquire("kq", "owner-a", 30, META) is None
    assert shape(lambda: sql_store.take_over_queued("kq", "owner-d", 30, META)) == [
        begin, "INSERT", *read, "UPDATE", "COMMIT",
    ]
    assert shape(lambda: sql_store.take_over_queued("new3", "owner-d", 30, META)) == [
        begin, "INSERT", *read, "COMMIT",
    ]
    assert sql_store.claim("kq", "owner-d", release=False, ttl=None, meta=META).outcome is (
        ClaimOutcome.OWNED
    )
    assert shape(lambda: sql_store.take_over_queued("kq", "owner-e", 30, META)) == [
        begin, "INSERT", *read, "COMMIT",
    ]
    # A start check by another owner: the one-statement try, then a
    # transaction that locks the owner's revoked marker, then the key's row.
    assert shape(lambda: sql_store.claim("k", "owner-c", release=False, ttl=30, meta=META)) == [
        "UPDATE", begin, "SELECT", "INSERT", *read, "COMMIT",
    ]
    assert shape(lambda: sql_store.revoke("k", "owner-b", 60)) == [
        begin, "INSERT", "SELECT", "DELETE", "COMMIT",
    ]
    # take_over_revoking: the take-over's transaction, then revoke's (marker before row).
    assert sql_store.acquire("kr", "owner-a", 30, META) is None
    assert shape(lambda: sql_store.take_over_revoking("kr", "owner-b", 30, META, 60)) == [
        begin, "INSERT", *read, "UPDATE", "COMMIT", begin, "INSERT", "SELECT", "COMMIT",
    ]


def test_tables_checked_once_per_store(sql_store: SQLStore, recorded: Recorder) -> None:
    """After the first use, no operation inspects or creates tables again."""
    with recorded(sql_store) as sent:
        for i in range(5):
            assert sql_store.acquire(f"k{i}", "owner-a", 30, META) is None
    assert len(sent) == 5
    assert not any("CREATE" in s.upper() or "INFORMATION_SCHEMA" in s.upper() for s in sent)


# -- how statements are run -------------------------------------------------


def _every_operation(store: SQLStore, tag: str) -> None:
    """Each operation of the store once, on keys under ``tag``, checking its answer."""
    assert store.acquire(f"{tag}:a", "owner-a", 30, META) is None
    holder = store.acquire(f"{tag}:a", "owner-b", 30, META)
    assert holder is not None and holder.owner == "owner-a" and holder.task_id == "id-a"
    assert store.extend(f"{tag}:a", "owner-a", 60) is True
    lock = store.get(f"{tag}:a")
    assert lock is not None and not lock.started and 30 < lock.ttl <= 60
    claim = store.claim(f"{tag}:a", "owner-a", release=False, ttl=30, meta=META)
    assert claim.outcome is ClaimOutcome.OWNED
    assert store.settle(f"{tag}:a", "owner-a") is True
    assert store.revoke(f"{tag}:a", "owner-a", 60) is RevokeOutcome.RELEASED
    store.unrevoke(f"{tag}:a", "owner-a")
    claim = store.claim(f"{tag}:b", "owner-c", release=False, ttl=30, meta=META)
    assert claim.outcome is ClaimOutcome.FREE
    previous = store.take_over(f"{tag}:b", "owner-d", 30, META)
    assert previous is not None and previous.owner == "owner-c" and previous.started
    assert [lock.owner for lock in store.scan(f"{tag}:")] == ["owner-d"]
    assert store.release(f"{tag}:b", "owner-d") is True
    counted = store.read_counts(tag).get(("tests.add", "acquired"), 0)
    store.add_counts(tag, {("tests.add", "acquired"): 2})
    assert store.read_counts(tag) == {("tests.add", "acquired"): counted + 2}
    assert store.purge_expired() == 0


def test_both_ways_send_the_same_statements(sql_store: SQLStore) -> None:
    """On the DBAPI connection or through SQLAlchemy, every operation sends the same SQL."""
    _every_operation(sql_store, "warm")
    with driver_statements(sql_store) as direct:
        _every_operation(sql_store, "direct")
    with statements(sql_store) as through_sqlalchemy:
        _every_operation(sql_store, "direct")  # the same keys, so the same answers
    assert len(direct) >= 17
    if sql_store.engine.dialect.name == "sqlite":
        # The trace callback shows the SQL with its values inlined.
        assert [s.split()[0] for s in direct] == [s.split()[0] for s in through_sqlalchemy]
    else:
        assert direct == through_sqlalchemy


def test_sql_logging_sees_every_statement(
    sql_store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """With SQLAlchemy's SQL log on, the store's statements go through SQLAlchemy and are logged."""
    sql_store.get("warm-up")
    caplog.set_level(logging.INFO, logger="sqlalchemy.engine.Engine")
    assert sql_store.acquire("logged", "owner-a", 30, META) is None
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("sqlalchemy.engine")]
    assert any("INSERT INTO celery_dedup_sql_lock" in message for message in logged), logged


SERVER_STORES = [
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
]
#: How an administrator ends another session, and how to see that it ended.
KILL = {
    "postgresql": ("SELECT pg_terminate_backend({id})",
                   "SELECT count(*) FROM pg_stat_activity WHERE pid = {id}"),
    "mysql": ("KILL {id}", "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = {id}"),
}


@pytest.mark.parametrize("sql_store", SERVER_STORES, indirect=True)
def test_dropped_connections_cost_one_call(sql_store: SQLStore) -> None:
    """Server-side sessions killed under a pool of two: one call fails, the next reconnects.

    The failing call is ``StoreUnavailable``; the other pooled connection is
    discarded with the dead one, as SQLAlchemy does, so it fails no call.
    """
    name = sql_store.engine.dialect.name
    assert sql_store.acquire("k", "owner-a", 30, META) is None
    with sql_store.engine.connect() as first, sql_store.engine.connect() as second:
        sessions = [c.exec_driver_sql(SESSION_ID[name]).scalar() for c in (first, second)]
    assert sql_store.engine.pool.checkedin() == 2  # type: ignore[attr-defined]
    kill, alive = KILL[name]
    admin = create_engine(sql_store.url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for session in sessions:
                conn.exec_driver_sql(kill.format(id=session))
            deadline = time.monotonic() + 10
            while any(conn.exec_driver_sql(alive.format(id=s)).scalar() for s in sessions):
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        admin.dispose()
    with pytest.raises(StoreUnavailable) as info:
        sql_store.get("k")
    assert info.value.__cause__ is not None
    lock = sql_store.get("k")
    assert lock is not None and lock.owner == "owner-a"
    assert sql_store.release("k", "owner-a") is True


class Interrupted(BaseException):
    """Stands for an interruption that is not an ``Exception`` (``KeyboardInterrupt``, gevent)."""


@pytest.mark.postgres
@pytest.mark.parametrize("interruption", [Interrupted, SoftTimeLimitExceeded])
def test_connection_interrupted_mid_call_is_not_reused(
    store_postgres: StoreCase, interruption: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection interrupted inside the driver (a time limit…) never returns to the pool."""
    store = store_postgres.store
    assert isinstance(store, SQLStore)
    store.get("warm-up")
    with store.engine.connect() as conn:
        before = conn.exec_driver_sql(SESSION_ID["postgresql"]).scalar()
    execute = psycopg.Cursor.execute

    def interrupted(cursor: Any, *args: Any, **kwargs: Any) -> Any:
        execute(cursor, *args, **kwargs)
        raise interruption()

    with monkeypatch.context() as patch:
        patch.setattr(psycopg.Cursor, "execute", interrupted)
        with pytest.raises(interruption):
            store.acquire("k", "owner-a", 30, META)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql(SESSION_ID["postgresql"]).scalar() != before
    lock = store.get("k")  # the statement itself had run
    assert lock is not None and lock.owner == "owner-a"


def test_schema_translate_map_applies(tmp_path: Path) -> None:
    """Statements are rendered once, with the engine's ``schema_translate_map``."""
    store = SQLStore(
        f"sqlite:///{tmp_path / 'locks.sqlite3'}",
        engine_options={"execution_options": {"schema_translate_map": {None: "main"}}},
    )
    try:
        store.create_tables()
        with statements(store) as sent:
            assert store.acquire("k", "owner-a", 30, META) is None
            assert store.acquire("k", "owner-b", 30, META) is not None
            assert store.release("k", "owner-a") is True
        assert len(sent) == 4  # a duplicate on SQLite reads the holder in a second statement
        assert all("main.celery_dedup_sql_lock" in statement for statement in sent), sent
    finally:
        store.close()


# -- tables created on first use --------------------------------------------


@pytest.fixture
def empty_database(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[], str]]:
    """A factory of store URLs on a database without tables (SQLite file, new PG/MySQL db)."""
    kind = request.param
    created: list[str] = []

    def make() -> str:
        if kind == "sqlite":
            return f"db+sqlite:///{tmp_path / f'{uuid.uuid4().hex}.sqlite3'}"
        name = f"fresh_{uuid.uuid4().hex[:12]}"
        created.append(name)
        if kind == "postgres":
            server: PostgresServer = request.getfixturevalue("postgres_server")
            with server.connect() as conn:
                conn.execute(f"CREATE DATABASE {name}")
            return f"db+postgresql+psycopg://postgres@127.0.0.1:{server.port}/{name}"
        mysql: MySQLServer = request.getfixturevalue("mysql_server")
        conn = mysql.connect()
        try:
            with conn.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {name}")
        finally:
            conn.close()
        return f"db+mysql+pymysql://root@127.0.0.1:{mysql.port}/{name}"

    yield make
    for name in created:
        if kind == "postgres":
            with request.getfixturevalue("postgres_server").connect() as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        else:
            conn = request.getfixturevalue("mysql_server").connect()
            try:
                with conn.cursor() as cursor:
                    cursor.execute(f"DROP DATABASE IF EXISTS {name}")
            finally:
                conn.close()


EMPTY_DATABASES = [
    pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
]


@pytest.mark.parametrize("empty_database", EMPTY_DATABASES, indirect=True)
def test_tables_created_on_first_use(empty_database: Callable[[], str]) -> None:
    """Building a store creates nothing; its first operation creates its tables."""
    url = empty_database()
    store = store_from_url(url)
    other = store_from_url(url)
    assert isinstance(store, SQLStore) and isinstance(other, SQLStore)
    try:
        assert inspect(store.engine).get_table_names() == []
        assert store.acquire("k", "owner-a", 30, META) is None
        tables = set(inspect(store.engine).get_table_names())
        assert tables == {
            "celery_dedup_sql_lock", "celery_dedup_sql_revoked", "celery_dedup_sql_counter",
            "celery_dedup_sql_slot", "celery_dedup_sql_rate", "celery_dedup_sql_slot_wait",
            "celery_dedup_sql_gate_wait", "celery_dedup_sql_fence",
        }
        if store.engine.dialect.name == "postgresql":  # the handoff's function, with its table
            with store.engine.connect() as conn:
                found = conn.execute(
                    text("SELECT count(*) FROM pg_proc WHERE proname = :name"),
                    {"name": TURN_FUNCTION},
                ).scalar()
            assert found == 1
        holder = other.acquire("k", "owner-b", 30, META)
        assert holder is not None and holder.owner == "owner-a"
    finally:
        store.close()
        other.close()


@pytest.mark.parametrize("empty_database", EMPTY_DATABASES, indirect=True)
def test_processes_starting_together_create_tables_once(empty_database: Callable[[], str]) -> None:
    """Four processes using a new database at once all succeed; the tables exist once."""
    url = empty_database()
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    results = context.Queue()
    procs = [
        context.Process(target=_first_use, args=(url, f"owner-{i}", barrier, results))
        for i in range(4)
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(30)
    results.close()
    results.join_thread()
    assert sorted(outcome for outcome in outcomes if outcome != "held") == ["acquired"]
    assert outcomes.count("held") == 3


def _first_use(url: str, owner: str, barrier: Any, results: Any) -> None:
    try:
        store = store_from_url(url)
        barrier.wait()
        holder = store.acquire("first", owner, 30, META)
        results.put("acquired" if holder is None else "held")
    except BaseException as exc:
        results.put(repr(exc))


#: The tables of 0.1.0 (also the names of the Django app's tables).
LEGACY = MetaData()
Table(
    "celery_dedup_lock", LEGACY,
    Column("key", String(255), primary_key=True), Column("owner", String(255)),
    Column("task_name", String(255)), Column("policy", String(32)), Column("token", String(32)),
    Column("acquired_at", Double()), Column("expires_at", Double()),
)
Table(
    "celery_dedup_counter", LEGACY,
    Column("prefix", String(191), primary_key=True), Column("task_name", String(255)),
    Column("event", String(64)), Column("count", BigInteger()),
)


@pytest.mark.parametrize("empty_database", EMPTY_DATABASES, indirect=True)
def test_tables_of_0_1_0_are_left_alone(empty_database: Callable[[], str]) -> None:
    """Tables named as 0.1.0's (or the Django app's) are neither read, changed nor recreated.

    A lock held in them at upgrade time is not carried over: the key is free
    for the new store (docs/stores/sql.md, "Upgrading from 0.1.0").
    """
    url = empty_database()
    store = store_from_url(url)
    assert isinstance(store, SQLStore)
    try:
        LEGACY.create_all(store.engine)
        old_lock = LEGACY.tables["celery_dedup_lock"]
        with store.engine.connect() as conn:
            conn.execute(old_lock.insert().values(
                key="k", owner="old-task-id", task_name="t", policy="success", token="x",
                acquired_at=time.time(), expires_at=time.time() + 600,
            ))
        assert store.acquire("k", "owner-a", 30, META) is None
        store.add_counts("metrics", {("t", "acquired"): 1})
        with store.engine.connect() as conn:
            assert conn.execute(select(old_lock.c.owner)).scalars().all() == ["old-task-id"]
            old_counter = LEGACY.tables["celery_dedup_counter"]
            assert conn.execute(select(func.count()).select_from(old_counter)).scalar() == 0
        assert {"celery_dedup_lock", "celery_dedup_counter", "celery_dedup_sql_lock"} <= set(
            inspect(store.engine).get_table_names()
        )
    finally:
        store.close()


# -- fork safety -------------------------------------------------------------


def _child_uses_store(store: SQLStore, query: str, conn: Any) -> None:
    try:
        fresh_pool = store.engine.pool.checkedin() == 0  # type: ignore[attr-defined]
        holder = store.acquire("forked", "child", 30, META)
        with store.engine.connect() as c:
            session = c.exec_driver_sql(query).scalar()
        conn.send((fresh_pool, None if holder is None else holder.owner, session))
    except BaseException as exc:
        conn.send(repr(exc))
    finally:
        conn.close()


def test_forked_child_gets_its_own_connections(sql_store: SQLStore) -> None:
    """A forked child drops the parent's pool and connects anew; the parent's connection lives."""
    query = SESSION_ID[sql_store.engine.dialect.name]
    assert sql_store.acquire("parent", "parent", 30, META) is None
    with sql_store.engine.connect() as c:
        parent_session = c.exec_driver_sql(query).scalar()
    assert sql_store.engine.pool.checkedin() == 1  # type: ignore[attr-defined]

    context = multiprocessing.get_context("fork")
    here, there = context.Pipe()
    child = context.Process(target=_child_uses_store, args=(sql_store, query, there))
    child.start()
    there.close()
    reply = here.recv()
    child.join(30)
    here.close()
    assert child.exitcode == 0, reply
    fresh_pool, holder, child_session = reply
    assert fresh_pool is True
    assert holder is None
    if sql_store.engine.dialect.name != "sqlite":
        assert child_session != parent_session

    lock = sql_store.get("forked")
    assert lock is not None and lock.owner == "child"
    with sql_store.engine.connect() as c:
        assert c.exec_driver_sql(query).scalar() == parent_session
    assert sql_store.release("parent", "parent") is True


# -- mutual exclusion under churn -------------------------------------------


def _churn(url: str, index: int, slots: Any, barrier: Any, results: Any) -> None:
    try:
        store = store_from_url(url)
        owner = f"churner-{index}"
        won = held = violations = 0
        barrier.wait()
        for step in range(150):
            key = (step * 7 + index) % len(slots)
            holder = store.acquire(f"churn:{key}", owner, 30, META)
            if holder is not None:
                held += 1
                if holder.owner == owner or holder.ttl <= 0:
                    violations += 1
                continue
            won += 1
            if slots[key] != 0:
                violations += 1
            slots[key] = index + 1
            time.sleep(0.0005)
            if slots[key] != index + 1:
                violations += 1
            slots[key] = 0
            if not store.release(f"churn:{key}", owner):
                violations += 1
        results.put((won, held, violations))
    except BaseException as exc:
        results.put(repr(exc))


def test_acquire_release_churn_keeps_mutual_exclusion(sql_store: SQLStore) -> None:
    """Processes churning on 3 hot keys never hold one together and never see a dead holder."""
    url = "db+" + sql_store.url
    context = multiprocessing.get_context("fork")
    slots = context.RawArray("i", 3)
    barrier = context.Barrier(4)
    results = context.Queue()
    procs = [
        context.Process(target=_churn, args=(url, i, slots, barrier, results)) for i in range(4)
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
    results.close()
    results.join_thread()
    assert all(isinstance(outcome, tuple) for outcome in outcomes), outcomes
    assert sum(v for _, _, v in outcomes) == 0
    assert sum(w for w, _, _ in outcomes) >= 150
    assert sum(h for _, h, _ in outcomes) > 0


# -- the database's clock ----------------------------------------------------


def test_expiry_follows_the_database_clock(
    sql_store: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer whose clock is an hour behind still takes a 30 s lock, as the others see it."""
    behind = types.SimpleNamespace(time=lambda: time.time() - 3600, monotonic=time.monotonic)
    with monkeypatch.context() as patch:
        patch.setattr(sql, "time", behind)
        assert sql_store.acquire("clock", "slow-clock", 30, META) is None
    holder = sql_store.acquire("clock", "owner-b", 30, META)
    assert holder is not None and holder.owner == "slow-clock"
    assert 25 < holder.ttl <= 30.001


@pytest.mark.mysql
def test_mysql_sessions_are_utc_and_repeatable_read(mysql_server: MySQLServer) -> None:
    """Whatever the server's defaults, store connections run in UTC with repeatable read."""
    admin = mysql_server.connect()
    store = store_from_url(f"db+{mysql_server.url('pymysql')}")
    assert isinstance(store, SQLStore)
    try:
        with admin.cursor() as cursor:
            cursor.execute("SET GLOBAL time_zone = '+05:00'")
            cursor.execute("SET GLOBAL TRANSACTION ISOLATION LEVEL READ COMMITTED")
        assert store.acquire("tz", "owner-a", 30, META) is None
        with store.engine.connect() as conn:
            zone = conn.exec_driver_sql("SELECT @@session.time_zone").scalar()
            isolation = conn.exec_driver_sql("SHOW SESSION VARIABLES LIKE '%%_isolation'").all()
        assert zone == "+00:00"
        levels = {value for name, value in isolation if name.endswith("x_isolation")}
        assert levels == {"REPEATABLE-READ"}
        lock = store.get("tz")
        assert lock is not None and 25 < lock.ttl <= 30.001
    finally:
        with admin.cursor() as cursor:
            cursor.execute("SET GLOBAL time_zone = SYSTEM")
            cursor.execute("SET GLOBAL TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        admin.close()
        store.close()


def test_key_longer_than_the_column_is_refused(sql_store: SQLStore) -> None:
    """A key over 255 characters raises ValueError before any statement is sent."""
    with statements(sql_store) as sent, pytest.raises(ValueError, match="up to 255"):
        sql_store.acquire("k" * 256, "owner-a", 30, META)
    assert sent == []
    assert sql_store.acquire("k" * 255, "owner-a", 30, META) is None


# -- reaping expired rows ----------------------------------------------------


def test_expired_rows_are_reaped_at_most_once_per_interval(sql_store: SQLStore) -> None:
    """With reap_interval set, an acquire after the interval deletes expired rows."""
    store = SQLStore.from_url(sql_store.url, options={"reap_interval": 0.5})
    try:
        for i in range(5):
            assert store.acquire(f"short:{i}", "owner-a", 0.1, META) is None
        time.sleep(0.15)
        assert row_count(store) == 5
        deadline = time.monotonic() + 5
        i = 0
        while row_count(store) > i:
            assert time.monotonic() < deadline, "expired rows were never reaped"
            i += 1
            assert store.acquire(f"live:{i}", "owner-a", 30, META) is None
            time.sleep(0.05)
        assert row_count(store) == i
        assert {lock.key for lock in store.scan("live:")} == {f"live:{n}" for n in range(1, i + 1)}
    finally:
        store.close()


def test_reaping_disabled_keeps_rows_until_purged(sql_store: SQLStore) -> None:
    """reap_interval=0 never deletes from an acquire; purge_expired() deletes expired rows only."""
    store = SQLStore.from_url(sql_store.url, options={"reap_interval": 0})
    try:
        for i in range(3):
            assert store.acquire(f"short:{i}", "owner-a", 0.1, META) is None
        assert store.acquire("live", "owner-a", 30, META) is None
        time.sleep(0.2)
        assert store.acquire("live2", "owner-a", 30, META) is None
        assert row_count(store) == 5
        assert store.purge_expired() == 3
        assert row_count(store) == 2
        assert store.purge_expired() == 0
    finally:
        store.close()


def revoked_count(store: SQLStore) -> int:
    """Rows in the revoked marker table, live or expired."""
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(revoked_table)).scalar_one())


def test_revoked_markers_live_apart_from_locks(sql_store: SQLStore) -> None:
    """Markers are rows of their own table, keyed by revoked_marker_key, expiring like locks.

    They never show in scan, even under a prefix that matches the marker
    key; purge_expired deletes expired ones too but counts only locks.
    """
    assert sql_store.acquire("k", "owner-a", 30, META) is None
    assert sql_store.revoke("k", "owner-a", 0.2) is RevokeOutcome.RELEASED
    assert sql_store.revoke("k", "owner-b", 30) is RevokeOutcome.NOT_HELD
    assert sql_store.acquire("short", "owner-c", 0.1, META) is None
    with sql_store.engine.connect() as conn:
        keys = set(conn.execute(select(revoked_table.c.key)).scalars())
    assert keys == {revoked_marker_key("k", "owner-a"), revoked_marker_key("k", "owner-b")}
    assert list(sql_store.scan("")) != [] and all(
        lock.key == "short" for lock in sql_store.scan("")
    )
    assert list(sql_store.scan("celery-dedup")) == []
    time.sleep(0.3)
    assert sql_store.purge_expired() == 1
    assert revoked_count(sql_store) == 1
    claim = sql_store.claim("k", "owner-b", release=False, ttl=None, meta=META)
    assert claim.outcome is ClaimOutcome.REVOKED
    claim = sql_store.claim("k", "owner-a", release=False, ttl=None, meta=META)
    assert claim.outcome is ClaimOutcome.FREE


# -- unreachable databases ---------------------------------------------------


UNREACHABLE = [
    pytest.param("db+postgresql+psycopg://postgres:s3cret@127.0.0.1:{port}/postgres",
                 marks=pytest.mark.postgres, id="postgres"),
    pytest.param("db+mysql+pymysql://root:s3cret@127.0.0.1:{port}/celery_dedup_test",
                 marks=pytest.mark.mysql, id="mysql"),
    pytest.param("db+sqlite:////nonexistent-{port}/dir/locks.sqlite3",
                 marks=pytest.mark.sqlite, id="sqlite"),
]


@pytest.mark.parametrize("template", UNREACHABLE)
def test_unreachable_database_raises_store_unavailable(template: str) -> None:
    """Every operation on an unreachable database raises StoreUnavailable, password hidden."""
    store = store_from_url(template.format(port=free_port()))
    assert isinstance(store, SQLStore)
    operations: list[Callable[[], Any]] = [
        lambda: store.acquire("k", "owner-a", 30, META),
        lambda: store.release("k", "owner-a"),
        lambda: store.extend("k", "owner-a", 30),
        lambda: store.take_over("k", "owner-a", 30, META),
        lambda: store.get("k"),
        lambda: list(store.scan("k")),
        lambda: store.add_counts("p", {("t", "acquired"): 1}),
        lambda: store.read_counts("p"),
        lambda: store.claim("k", "owner-a", release=False, ttl=30, meta=META),
        lambda: store.revoke("k", "owner-a", 30),
        lambda: store.unrevoke("k", "owner-a"),
    ]
    try:
        for operation in operations:
            with pytest.raises(StoreUnavailable) as info:
                operation()
            assert info.value.store == "sql"
            assert "s3cret" not in str(info.value)
            assert "lock store sql (" in str(info.value)
            assert info.value.__cause__ is not None
    finally:
        store.close()


@pytest.mark.postgres
@pytest.mark.redis
def test_postgres_url_on_a_port_that_is_not_postgres(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A db+postgresql:// URL on a Redis server's port raises StoreUnavailable, not a hang.

    Redis waits for a newline that the PostgreSQL handshake never sends, so
    only the store's default connect timeout ends the attempt.
    """
    monkeypatch.setattr(sql, "CONNECT_TIMEOUT", 2)
    url = f"db+postgresql+psycopg://postgres:s3cret@127.0.0.1:{redis_server.port}/postgres"
    store = store_from_url(url)
    assert isinstance(store, SQLStore)
    start = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.acquire("k", "owner-a", 30, META)
        assert time.monotonic() - start < 10
        assert info.value.store == "sql" and "s3cret" not in str(info.value)
        assert info.value.__cause__ is not None
    finally:
        store.close()


@pytest.mark.parametrize(
    ("query", "options", "timeout"),
    [
        ("", {}, 10),
        ("?connect_timeout=3", {}, "3"),
        ("", {"connect_args": {"connect_timeout": 5}}, 5),
    ],
)
def test_postgres_connections_time_out_by_default(
    query: str, options: dict[str, Any], timeout: object
) -> None:
    """PostgreSQL connections get connect_timeout=10 unless the URL or connect_args set one."""
    store = SQLStore(f"postgresql+psycopg://u@127.0.0.1:{free_port()}/x{query}",
                     engine_options=options)
    seen: list[dict[str, Any]] = []

    def record(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        seen.append(dict(cparams))

    event.listen(store.engine, "do_connect", record)
    try:
        with pytest.raises(StoreUnavailable):
            store.get("k")
    finally:
        store.close()
    assert seen and seen[0]["connect_timeout"] == timeout


@pytest.mark.postgres
def test_database_refusing_the_sql_is_permission_denied(
    postgres_server: PostgresServer,
) -> None:
    """A user who may not create the tables gets StorePermissionDenied, not a driver error."""
    name = f"limited_{uuid.uuid4().hex[:12]}"
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE DATABASE {name}")
        conn.execute(f"CREATE ROLE {name} LOGIN")
    with psycopg.connect(
        host="127.0.0.1", port=postgres_server.port, user="postgres", dbname=name, autocommit=True
    ) as conn:
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    store = SQLStore(f"postgresql+psycopg://{name}@127.0.0.1:{postgres_server.port}/{name}")
    try:
        with pytest.raises(StorePermissionDenied, match="denied permission") as info:
            store.acquire("k", "owner-a", 30, META)
        assert f"127.0.0.1:{postgres_server.port}/{name}" in str(info.value)
        assert "permission denied" in str(info.value)
    finally:
        store.close()
        with postgres_server.connect() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"DROP ROLE IF EXISTS {name}")


# -- URLs, options and drivers -----------------------------------------------


@pytest.mark.sqlite
def test_store_derived_from_a_db_result_backend(tmp_path: Path) -> None:
    """A db+ result backend selects the SQL store; database_engine_options, then store options."""
    backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
    app = Celery("sqlapp", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend=backend,
        database_engine_options={"pool_size": 3, "echo": False},
    )
    try:
        assert derive_store_url(app) == backend
        store = store_from_url(backend, app=app)
        assert isinstance(store, SQLStore)
        assert store.engine.url.database == str(tmp_path / "results.sqlite3")
        assert store.engine.pool.size() == 3  # type: ignore[attr-defined]
        store.close()

        tuned = store_from_url(backend, app=app, options={"pool_size": 4, "reap_interval": 5})
        assert isinstance(tuned, SQLStore)
        assert tuned.engine.pool.size() == 4  # type: ignore[attr-defined]
        assert tuned.reap_interval == 5
        tuned.close()

        other = store_from_url(f"db+sqlite:///{tmp_path / 'other.sqlite3'}", app=app)
        assert isinstance(other, SQLStore)
        assert other.engine.pool.size() == 5  # type: ignore[attr-defined]
        other.close()

        app.conf.dedup_store_options = {"pool_size": 2}
        runtime = runtime_for(app)
        resolved = runtime.store
        assert isinstance(resolved, SQLStore)
        assert resolved.engine.pool.size() == 2  # type: ignore[attr-defined]
        assert resolved.acquire("k", "owner-a", 30, META) is None
        second = store_from_url(backend)
        assert isinstance(second, SQLStore)
        holder = second.acquire("k", "owner-b", 30, META)
        assert holder is not None and holder.owner == "owner-a"
        second.close()
        resolved.close()
    finally:
        app.close()


@pytest.mark.sqlite
def test_dedup_store_wins_over_the_result_backend(tmp_path: Path) -> None:
    """dedup_store names the store even when the result backend is a database."""
    app = Celery("sqlapp", set_as_current=False)
    app.conf.update(
        result_backend=f"db+sqlite:///{tmp_path / 'results.sqlite3'}",
        dedup_store=f"db+sqlite:///{tmp_path / 'locks.sqlite3'}",
    )
    assert derive_store_url(app) == f"db+sqlite:///{tmp_path / 'locks.sqlite3'}"
    app.close()


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [
        ("db+postgresql+psycopg://u:s3cret@127.0.0.1:1/x", "psycopg", "postgres"),
        ("db+postgresql://u:s3cret@127.0.0.1:1/x", "psycopg", "postgres"),
        ("db+mysql+pymysql://u:s3cret@127.0.0.1:1/x", "pymysql", "mysql"),
    ],
)
def test_missing_driver_names_the_extra(
    url: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing driver raises ImproperlyConfigured naming the URL (no password) and the extra."""
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImproperlyConfigured) as info:
        store_from_url(url)
    message = str(info.value)
    assert isinstance(info.value, CeleryImproperlyConfigured)
    assert f"pip install 'celery-dedup[{extra}]'" in message
    assert "127.0.0.1:1" in message and "s3cret" not in message


@pytest.mark.parametrize(
    ("url", "module", "driver", "alternative"),
    [
        ("db+mysql://u:s3cret@127.0.0.1:1/x", "MySQLdb", "mysqldb", "db+mysql+pymysql://"),
        ("db+postgresql+psycopg2://u:s3cret@127.0.0.1:1/x", "psycopg2", "psycopg2",
         "db+postgresql+psycopg://"),
    ],
)
def test_other_missing_driver_points_to_the_extra(
    url: str, module: str, driver: str, alternative: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL naming a driver the extras do not install says which, and the URL the extra serves."""
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImproperlyConfigured) as info:
        store_from_url(url)
    message = str(info.value)
    assert f"needs the {driver} driver" in message
    assert alternative in message and "s3cret" not in message


def test_missing_sqlalchemy_names_the_sql_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SQLAlchemy, a db+ URL raises ImproperlyConfigured naming the sql extra."""
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    monkeypatch.delitem(sys.modules, "celery_dedup.stores.sql")
    with pytest.raises(ImproperlyConfigured, match=r"celery-dedup\[sql\]"):
        store_from_url("db+sqlite:///locks.sqlite3")


@pytest.mark.parametrize("url", ["db+nosuchdatabase://u:s3cret@host/x", "db+not a url"])
def test_unknown_dialect_is_improperly_configured(url: str) -> None:
    """A db+ URL naming no SQLAlchemy dialect, or no URL at all, raises ImproperlyConfigured."""
    with pytest.raises(ImproperlyConfigured, match="No SQLAlchemy dialect") as info:
        store_from_url(url)
    assert "s3cret" not in str(info.value)


# -- the MySQL path (no RETURNING), on MariaDB --------------------------------


@pytest.fixture
def store_case(mysql_server: MySQLServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreCase]:
    """MariaDB through the MySQL code path (upsert, then read); forked children inherit it."""
    monkeypatch.setattr(sql_dialects, "_MariaDB", sql_dialects._MySQL)
    for case in sql_case(f"db+{mysql_server.url('pymysql')}"):
        assert isinstance(case.store, SQLStore)
        case.store.create_tables()
        assert type(case.store._dialect) is sql_dialects._MySQL
        yield case


@pytest.mark.mysql
class TestMySQLWithoutReturning(StoreContract):
    """The whole store contract on the MySQL code path."""

    def test_acquire_is_an_upsert_then_a_read(self, store_case: StoreCase) -> None:
        """Without RETURNING, acquire sends the upsert and then reads the row back."""
        store = store_case.store
        assert isinstance(store, SQLStore)
        with statements(store) as sent:
            assert store.acquire("k", "owner-a", 30, META) is None
            holder = store.acquire("k", "owner-b", 30, META)
        assert holder is not None and holder.owner == "owner-a"
        assert [s.split()[0].upper() for s in sent] == ["INSERT", "SELECT", "INSERT", "SELECT"]
        assert "RETURNING" not in sent[0].upper()
