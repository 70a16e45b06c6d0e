"""The Django DB store's own connection: outside the caller's transaction, per process, UTC.

- a lock written inside the caller's ``atomic()`` is committed at once and
  survives its rollback (PostgreSQL, MariaDB); SQLite joins the transaction;
- a process forked after the store was used gets its own connection and
  never breaks its parent's;
- MySQL sessions are UTC whatever the alias sets; expiry is by the database
  clock, whatever the producer's clock says;
- lock waits are contention, retried inside the store; a connection the
  server dropped fails one call, and the next reconnects.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import transaction

from celery_dedup.exceptions import StoreUnavailable
from celery_dedup.stores.django import DjangoStore
from tests.django.conftest import PG_DATABASE
from tests.django.test_django_store import (
    MARIA_DATABASE,
    add_alias,
    drop_alias,
    flush_all,
    maria_alias,
)

__all__ = ["maria_alias"]

META = {"task_name": "tests.conn", "policy": "success", "task_id": "id-conn"}


class Rollback(Exception):
    """Raised to roll the caller's transaction back."""


class Database:
    """An alias of a server the tests reach, and a raw connection to it (not Django's)."""

    def __init__(self, alias: str, vendor: str, server: Any, database: str) -> None:
        self.alias = alias
        self.vendor = vendor
        self.server = server
        self.database = database

    def raw(self) -> Any:
        """A fresh autocommit driver connection to the alias's database."""
        if self.vendor == "postgresql":
            import psycopg

            return psycopg.connect(
                host="127.0.0.1", port=self.server.port, user="postgres",
                dbname=self.database, autocommit=True,
            )
        import pymysql

        return pymysql.connect(
            host="127.0.0.1", port=self.server.port, user="root",
            database=self.database, autocommit=True,
        )

    def config(self, **options: Any) -> dict[str, Any]:
        """A ``DATABASES`` entry for this database with ``OPTIONS``."""
        if self.vendor == "postgresql":
            engine, user = "django.db.backends.postgresql", "postgres"
        else:
            engine, user = "django.db.backends.mysql", "root"
        return {
            "ENGINE": engine, "NAME": self.database, "USER": user, "HOST": "127.0.0.1",
            "PORT": str(self.server.port), "OPTIONS": options,
        }

    def holder_of(self, key: str) -> str | None:
        """The owner column of ``key``'s row, read on a raw connection."""
        conn = self.raw()
        try:
            cursor = conn.cursor()
            sql = f"SELECT owner FROM celery_dedup_lock WHERE {self.key_col} = %s"
            cursor.execute(sql, [key])
            row = cursor.fetchone()
            return None if row is None else str(row[0])
        finally:
            conn.close()

    @property
    def key_col(self) -> str:
        """The quoted ``key`` column (a reserved word on MySQL)."""
        return '"key"' if self.vendor == "postgresql" else "`key`"


@pytest.fixture(params=["postgresql", "mysql"])
def database(
    request: pytest.FixtureRequest, django_db_blocker: Any
) -> Iterator[Database]:
    """PostgreSQL or MariaDB, database access unblocked (``transactional_db`` forbids aliases)."""
    if request.param == "postgresql":
        alias = request.getfixturevalue("pg_alias")
        db = Database(alias, "postgresql", request.getfixturevalue("postgres_server"), PG_DATABASE)
    else:
        alias = request.getfixturevalue("maria_alias")
        db = Database(alias, "mysql", request.getfixturevalue("mysql_server"), MARIA_DATABASE)
    with django_db_blocker.unblock():
        flush_all(alias)
        yield db
        flush_all(alias)


@pytest.fixture
def extra_alias(database: Database) -> Iterator[Callable[..., str]]:
    """Add an alias of ``database`` with given ``OPTIONS``; closed and removed afterwards."""
    added: list[str] = []

    def add(**options: Any) -> str:
        alias = f"{database.alias}_{len(added)}"
        add_alias(alias, database.config(**options))
        added.append(alias)
        return alias

    yield add
    for alias in added:
        drop_alias(alias)


def test_lock_is_committed_inside_the_callers_transaction(database: Database) -> None:
    """Inside ``atomic()`` the lock is visible to others at once and survives a rollback."""
    store = DjangoStore(database.alias)
    with pytest.raises(Rollback), transaction.atomic(using=database.alias):
        assert store.acquire("conn:txn", "token-a", 30, META) is None
        assert database.holder_of("conn:txn") == "token-a"
        raise Rollback
    assert database.holder_of("conn:txn") == "token-a"
    assert store.release("conn:txn", "token-a") is True
    assert database.holder_of("conn:txn") is None


@pytest.mark.usefixtures("transactional_db")
def test_sqlite_joins_the_callers_transaction() -> None:
    """SQLite has one writer: inside ``atomic()`` the lock joins the caller's transaction."""
    flush_all("default")
    store = DjangoStore("default")
    with pytest.raises(Rollback), transaction.atomic():
        assert store.acquire("conn:sqlite", "token-a", 30, META) is None
        assert store.get("conn:sqlite") is not None
        raise Rollback
    assert store.get("conn:sqlite") is None
    assert store.acquire("conn:sqlite", "token-b", 30, META) is None
    holder = DjangoStore("default").acquire("conn:sqlite", "token-c", 30, META)
    assert holder is not None and holder.owner == "token-b"


def _child(store: DjangoStore, results: Any) -> None:
    """In a forked child: use the store object the parent already used."""
    try:
        assert store.acquire("conn:child", "token-child", 30, META) is None
        results.put(store.release("conn:child", "token-child"))
    except BaseException as exc:
        results.put(repr(exc))
        raise


def _fork_and_use(store: DjangoStore) -> None:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    for _ in range(2):
        proc = context.Process(target=_child, args=(store, results))
        proc.start()
        assert results.get(timeout=60) is True
        proc.join(30)
        assert proc.exitcode == 0


def test_forked_child_never_breaks_the_parents_connection(database: Database) -> None:
    """A child forked after the store was used connects anew; the parent's connection works."""
    store = DjangoStore(database.alias)
    assert store.acquire("conn:parent", "token-a", 30, META) is None
    _fork_and_use(store)
    lock = store.get("conn:parent")
    assert lock is not None and lock.owner == "token-a"
    assert store.release("conn:parent", "token-a") is True


@pytest.mark.usefixtures("transactional_db")
def test_forked_child_on_sqlite() -> None:
    """The same on SQLite: the child's connection is its own."""
    flush_all("default")
    store = DjangoStore("default")
    assert store.acquire("conn:parent", "token-a", 30, META) is None
    _fork_and_use(store)
    assert store.release("conn:parent", "token-a") is True


def test_mysql_session_is_utc(maria_alias: str, django_db_blocker: Any) -> None:
    """The store's MySQL session is UTC even when the alias sets another time zone."""
    from django.db import connections

    alias = "dedup_maria_tz"
    add_alias(alias, {**connections.settings[maria_alias], "OPTIONS": {
        "init_command": "SET time_zone = '+05:00'",
    }})
    try:
        with django_db_blocker.unblock():
            store = DjangoStore(alias)
            before = time.time()
            assert store.acquire("conn:utc", "token-a", 30, META) is None
            lock = store.get("conn:utc")
            assert lock is not None and abs(lock.acquired_at - before) < 5
            with store._queries().connection.cursor() as cursor:
                cursor.execute("SELECT @@session.time_zone")
                assert cursor.fetchone()[0] == "+00:00"
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT @@session.time_zone")
                assert cursor.fetchone()[0] == "+05:00"
            assert store.release("conn:utc", "token-a") is True
    finally:
        with django_db_blocker.unblock():
            drop_alias(alias)


def test_database_clock_decides_expiry(database: Database) -> None:
    """A producer whose clock is 31 s ahead cannot take a live 30-second lock."""
    store = DjangoStore(database.alias)
    ahead = DjangoStore(database.alias, clock=lambda: time.time() + 31)
    assert store.acquire("conn:clock", "token-a", 30, META) is None
    holder = ahead.acquire("conn:clock", "token-b", 30, META)
    assert holder is not None and holder.owner == "token-a"
    # Reported in the producer's own clock: 30 s from its "now".
    assert 25 < holder.expires_at - ahead.clock() <= 30.5


def test_lock_wait_timeout_is_retried(
    database: Database, extra_alias: Callable[..., str]
) -> None:
    """A row locked elsewhere for longer than the lock wait timeout: retried, never an error."""
    if database.vendor == "postgresql":
        alias = extra_alias(options="-c lock_timeout=300")
    else:
        alias = extra_alias(init_command="SET SESSION innodb_lock_wait_timeout = 1")
    store = DjangoStore(alias)
    assert store.acquire("conn:wait", "token-a", 30, META) is None
    locked = threading.Event()

    def hold_row() -> None:
        conn = database.raw()
        cursor = conn.cursor()
        cursor.execute("BEGIN")
        cursor.execute(
            f"SELECT owner FROM celery_dedup_lock WHERE {database.key_col} = %s FOR UPDATE",
            ["conn:wait"],
        )
        locked.set()
        time.sleep(2.5)
        cursor.execute("COMMIT")
        conn.close()

    holder = threading.Thread(target=hold_row)
    holder.start()
    assert locked.wait(10)
    start = time.monotonic()
    previous = store.take_over("conn:wait", "token-b", 30, META)
    holder.join()
    assert time.monotonic() - start > 1.5
    assert previous is not None and previous.owner == "token-a"
    lock = store.get("conn:wait")
    assert lock is not None and lock.owner == "token-b"


def test_dropped_connection_fails_one_call_then_reconnects(database: Database) -> None:
    """The server kills the store's connection: one StoreUnavailable, then the next call works."""
    store = DjangoStore(database.alias)
    assert store.acquire("conn:drop", "token-a", 30, META) is None
    with store._queries().connection.cursor() as cursor:
        if database.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
            kill = "SELECT pg_terminate_backend(%s)"
        else:
            cursor.execute("SELECT CONNECTION_ID()")
            kill = "KILL %s"
        backend = cursor.fetchone()[0]
    conn = database.raw()
    conn.cursor().execute(kill, [backend])
    conn.close()
    time.sleep(0.2)
    # PostgreSQL: the thread's Django connection fails once. MariaDB: the store's
    # own connection (CONN_MAX_AGE = 0) is renewed per operation, so none fails.
    if database.vendor == "postgresql":
        with pytest.raises(StoreUnavailable):
            store.get("conn:drop")
    lock = store.get("conn:drop")
    assert lock is not None and lock.owner == "token-a"


def test_missing_tables_are_a_refusal_naming_the_fix(transactional_db: None) -> None:
    """Migrations not run: a typed StoreRefused naming the fix, never a raw DB error."""
    from django.db import connection

    from celery_dedup.contrib.django.models import DedupLock
    from celery_dedup.exceptions import StoreRefused
    from celery_dedup.stores.django import DjangoStore

    table = DedupLock._meta.db_table
    with connection.schema_editor() as editor:
        editor.alter_db_table(DedupLock, table, table + "_moved")
    try:
        store = DjangoStore("default")
        meta = {"task_name": "t", "policy": "success", "task_id": "i"}
        with pytest.raises(StoreRefused, match="migrate celery_dedup"):
            store.acquire("k:missing", "owner", 10, meta)
    finally:
        with connection.schema_editor() as editor:
            editor.alter_db_table(DedupLock, table + "_moved", table)
