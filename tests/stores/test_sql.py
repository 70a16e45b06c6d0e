"""SQL store behaviour beyond the contract: statements, tables, forks, outages, URLs.

Runs against a real SQLite file, PostgreSQL and MariaDB started for the
session; the MySQL code path (no ``RETURNING``) is exercised on MariaDB.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured
from sqlalchemy import event, func, inspect, select

from celery_dedup import ImproperlyConfigured, StoreUnavailable
from celery_dedup.runtime import runtime_for
from celery_dedup.stores import derive_store_url, sql, sql_dialects, store_from_url
from celery_dedup.stores.sql import SQLStore, lock_table
from tests.fixtures._servers import free_port
from tests.fixtures._store_case import StoreCase
from tests.fixtures.mysql import MySQLServer
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.sql_stores import sql_case
from tests.stores.contract import StoreContract

META = {"task_name": "tests.add", "policy": "success"}

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
    """Record every statement the store's engine sends while the block runs."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(store.engine, "before_cursor_execute", record)


def row_count(store: SQLStore) -> int:
    """Rows in the lock table, live or expired."""
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(lock_table)).scalar_one())


def is_mariadb(store: SQLStore) -> bool:
    """Whether the store runs on MariaDB (whose upsert can return the row)."""
    return bool(getattr(store.engine.dialect, "is_mariadb", False))


# -- one statement per operation --------------------------------------------


def test_one_statement_per_operation(sql_store: SQLStore) -> None:
    """Acquire, duplicate, release, extend and get send one statement each (SQLite duplicate: 2)."""
    sql_store.get("warm-up")
    with statements(sql_store) as sent:
        assert sql_store.acquire("k", "owner-a", 30, META) is None
    assert len(sent) == 1
    upsert = sent[0].upper()
    assert "ON CONFLICT" in upsert or "ON DUPLICATE KEY UPDATE" in upsert
    assert "RETURNING" in upsert

    with statements(sql_store) as sent:
        holder = sql_store.acquire("k", "owner-b", 30, META)
    assert holder is not None and holder.owner == "owner-a"
    # SQLite cannot return the row its upsert left alone; it reads it in
    # process, with no round trip.
    assert len(sent) == (2 if sql_store.engine.dialect.name == "sqlite" else 1)

    checks: list[tuple[Callable[[], Any], Callable[[Any], bool]]] = [
        (lambda: sql_store.extend("k", "owner-a", 60), lambda r: r is True),
        (lambda: sql_store.get("k"), lambda r: r is not None and r.owner == "owner-a"),
        (lambda: sql_store.release("k", "owner-a"), lambda r: r is True),
        (lambda: sql_store.acquire("k2", "owner-a", 30, META), lambda r: r is None),
    ]
    for operation, expected in checks:
        with statements(sql_store) as sent:
            result = operation()
        assert expected(result), result
        assert len(sent) == 1, sent


def test_take_over_statements(sql_store: SQLStore) -> None:
    """take_over is one statement on PostgreSQL and one short transaction elsewhere."""
    assert sql_store.acquire("k", "owner-a", 30, META) is None
    with statements(sql_store) as sent:
        previous = sql_store.take_over("k", "owner-b", 30, META)
    assert previous is not None and previous.owner == "owner-a"
    if sql_store.engine.dialect.name == "postgresql":
        assert len(sent) == 1
    else:
        assert sent[0].upper() in ("BEGIN IMMEDIATE", "START TRANSACTION")
        assert [s.split()[0].upper() for s in sent[1:]] == ["SELECT", "INSERT", "COMMIT"]


def test_tables_checked_once_per_store(sql_store: SQLStore) -> None:
    """After the first use, no operation inspects or creates tables again."""
    with statements(sql_store) as sent:
        for i in range(5):
            assert sql_store.acquire(f"k{i}", "owner-a", 30, META) is None
    assert len(sent) == 5
    assert not any("CREATE" in s.upper() or "INFORMATION_SCHEMA" in s.upper() for s in sent)


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
    """Building a store creates nothing; its first operation creates both tables."""
    url = empty_database()
    store = store_from_url(url)
    other = store_from_url(url)
    assert isinstance(store, SQLStore) and isinstance(other, SQLStore)
    try:
        assert inspect(store.engine).get_table_names() == []
        assert store.acquire("k", "owner-a", 30, META) is None
        assert {"celery_dedup_lock", "celery_dedup_counter"} <= set(
            inspect(store.engine).get_table_names()
        )
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


# -- fork safety -------------------------------------------------------------


def _child_uses_store(store: SQLStore, query: str, conn: Any) -> None:
    try:
        fresh_pool = store.engine.pool.checkedin() == 0
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
    assert sql_store.engine.pool.checkedin() == 1

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


def test_unknown_dialect_is_improperly_configured() -> None:
    """A db+ URL naming no SQLAlchemy dialect raises ImproperlyConfigured."""
    with pytest.raises(ImproperlyConfigured, match="No SQLAlchemy dialect"):
        store_from_url("db+nosuchdatabase://u:s3cret@host/x")


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
